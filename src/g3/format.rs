//! The slab superblock: the first 4096 bytes of every slab file, byte for byte as in
//! `docs/format.md`. All integers are little-endian.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use rustix::rand::GetRandomFlags;
use sha2::{Digest, Sha256};

use crate::error::{Error, ErrorKind, Result};

/// Bytes reserved for the superblock at the start of every slab file; slot 0 of a file starts
/// here.
pub const SUPERBLOCK_SIZE: usize = 4096;
/// Magic at offset 0 of every slab file.
pub const SLAB_MAGIC: [u8; 8] = *b"KVTG3SLB";
/// The slab format version this build writes and reads. Version 2 (issue 21): the index
/// records' CRC covers the set uuid and the record offset, and an entry's data CRC covers the
/// key as well as the row; a version 1 set is refused at open (never misread).
pub const SLAB_FORMAT_VERSION: u32 = 2;
const CRC_OFFSET: usize = SUPERBLOCK_SIZE - 4;

/// The `mismatch` context value of an [`ErrorKind::IncompatibleLayout`] refusal whose slab
/// holds bytes of another namespace (model layout, TP size, blocks per chunk, canonical
/// layout): the settings decide, so a command may advise a format that matches them.
pub const MISMATCH_NAMESPACE: &str = "namespace";
/// `mismatch` of a refusal whose slab's slots have another size than the rows (settings).
pub const MISMATCH_ROW_STRIDE: &str = "row_stride";
/// `mismatch` of a refusal whose slab holds another number of slots (`capacity_bytes`).
pub const MISMATCH_CAPACITY: &str = "capacity";
/// `mismatch` of a refusal of paths listed in another order, or another number of them.
pub const MISMATCH_STRIPE: &str = "stripe";
/// `mismatch` of a refusal of a slab written by another kvtier format version.
pub const MISMATCH_VERSION: &str = "version";

/// The decoded superblock of one slab file of a stripe set.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Superblock {
    /// Format version (1).
    pub version: u32,
    /// Bytes per slot (= the primary's row stride, a multiple of 4096).
    pub row_stride: u64,
    /// Slots held by this file.
    pub slots_in_file: u64,
    /// Slots of the whole stripe set (sum over its files).
    pub total_slots: u64,
    /// This file's position in the stripe set (0-based).
    pub path_index: u32,
    /// Files in the stripe set.
    pub path_count: u32,
    /// Namespace digest of the bytes stored (layout compatibility).
    #[serde(serialize_with = "ser_hex")]
    pub namespace: [u8; 32],
    /// Random id shared by every file of the stripe set and by its journal.
    #[serde(serialize_with = "ser_hex")]
    pub set_uuid: [u8; 16],
    /// Creation time, seconds since the Unix epoch.
    pub created_unix_s: u64,
}

fn ser_hex<S: serde::Serializer, const N: usize>(b: &[u8; N], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&hex::encode(b))
}

impl Superblock {
    /// Encodes into exactly [`SUPERBLOCK_SIZE`] bytes (reserved bytes zero, CRC last).
    pub fn encode(&self) -> [u8; SUPERBLOCK_SIZE] {
        let mut b = [0u8; SUPERBLOCK_SIZE];
        b[0..8].copy_from_slice(&SLAB_MAGIC);
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
        b[12..16].copy_from_slice(&(SUPERBLOCK_SIZE as u32).to_le_bytes());
        b[16..24].copy_from_slice(&self.row_stride.to_le_bytes());
        b[24..32].copy_from_slice(&self.slots_in_file.to_le_bytes());
        b[32..40].copy_from_slice(&self.total_slots.to_le_bytes());
        b[40..44].copy_from_slice(&self.path_index.to_le_bytes());
        b[44..48].copy_from_slice(&self.path_count.to_le_bytes());
        b[48..80].copy_from_slice(&self.namespace);
        b[80..96].copy_from_slice(&self.set_uuid);
        b[96..104].copy_from_slice(&self.created_unix_s.to_le_bytes());
        let crc = crc32fast::hash(&b[..CRC_OFFSET]);
        b[CRC_OFFSET..].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes and checks magic, CRC, version and header size. `what` names the file in
    /// errors.
    pub fn decode(b: &[u8], what: &str) -> Result<Self> {
        if b.len() < SUPERBLOCK_SIZE {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!(
                    "{what}: file is {} bytes, shorter than a superblock ({SUPERBLOCK_SIZE})",
                    b.len()
                ),
            ));
        }
        if b[0..8] != SLAB_MAGIC {
            // Another file under kvtier's name: the path given is wrong (the user's input,
            // like a path that is not a directory), not a kvtier file that was damaged.
            return Err(Error::new(
                ErrorKind::InvalidPath,
                format!("{what}: not a kvtier G3 slab (bad magic)"),
            )
            .with("expected", hex::encode(SLAB_MAGIC))
            .with("found", hex::encode(&b[0..8])));
        }
        let stored = le_u32(b, CRC_OFFSET);
        let computed = crc32fast::hash(&b[..CRC_OFFSET]);
        if stored != computed {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!("{what}: superblock CRC mismatch"),
            )
            .with("expected", format!("{computed:08x}"))
            .with("found", format!("{stored:08x}")));
        }
        let version = le_u32(b, 8);
        if version != SLAB_FORMAT_VERSION {
            let why = if version < SLAB_FORMAT_VERSION {
                format!(
                    "it was written by an older kvtier, whose index this build cannot check \
                     (this build reads version {SLAB_FORMAT_VERSION}): reformat it with \
                     `kvtier tier format` (the chunks it holds are discarded; they are a cache)"
                )
            } else {
                format!(
                    "it was written by a newer kvtier (this build reads version \
                     {SLAB_FORMAT_VERSION}): open it with that kvtier or a newer one; this \
                     build leaves it untouched"
                )
            };
            return Err(Error::new(
                ErrorKind::IncompatibleLayout,
                format!("{what}: slab format version {version} is not supported: {why}"),
            )
            .with("mismatch", MISMATCH_VERSION)
            .with("expected", SLAB_FORMAT_VERSION.to_string())
            .with("found", version.to_string()));
        }
        let header = le_u32(b, 12);
        if header as usize != SUPERBLOCK_SIZE {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!("{what}: superblock size {header} is not {SUPERBLOCK_SIZE}"),
            ));
        }
        let mut namespace = [0u8; 32];
        namespace.copy_from_slice(&b[48..80]);
        let mut set_uuid = [0u8; 16];
        set_uuid.copy_from_slice(&b[80..96]);
        Ok(Superblock {
            version,
            row_stride: le_u64(b, 16),
            slots_in_file: le_u64(b, 24),
            total_slots: le_u64(b, 32),
            path_index: le_u32(b, 40),
            path_count: le_u32(b, 44),
            namespace,
            set_uuid,
            created_unix_s: le_u64(b, 96),
        })
    }
}

/// Reads `buf.len()` bytes of `f` from byte `offset`, fewer when the file ends first
/// (interrupted reads are retried); returns how many were read.
pub(crate) fn read_at_most(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match f.read_at(&mut buf[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// Reads a little-endian u32 at `off` (caller guarantees bounds).
pub(crate) fn le_u32(b: &[u8], off: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[off..off + 4]);
    u32::from_le_bytes(a)
}

/// Reads a little-endian u64 at `off` (caller guarantees bounds).
pub(crate) fn le_u64(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

/// Where slot `slot` lives: `(file index, byte offset)`. Slots are striped across the files of
/// the set: `file = slot % n_paths`, `offset = 4096 + (slot / n_paths) * row_stride`.
pub fn slot_location(slot: u64, n_paths: usize, row_stride: u64) -> (usize, u64) {
    let n = n_paths as u64;
    (
        (slot % n) as usize,
        SUPERBLOCK_SIZE as u64 + (slot / n) * row_stride,
    )
}

/// Size of a slab file holding `slots` slots.
pub fn slab_file_len(slots: u64, row_stride: u64) -> u64 {
    SUPERBLOCK_SIZE as u64 + slots * row_stride
}

/// Namespace digest of the geometry alone, used until the canonical layout supplies the real
/// namespace digest: `sha256("kvtier-g3-geometry-v1" || row_stride u64 LE)`.
pub fn geometry_namespace(row_stride: u64) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"kvtier-g3-geometry-v1");
    h.update(row_stride.to_le_bytes());
    h.finalize().into()
}

/// 16 random bytes from the kernel (`getrandom(2)`).
pub fn random_uuid() -> Result<[u8; 16]> {
    let mut b = [0u8; 16];
    let mut filled = 0;
    while filled < b.len() {
        match rustix::rand::getrandom(&mut b[filled..], GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => {
                let err = std::io::Error::from(e);
                return Err(
                    Error::new(ErrorKind::Io, format!("getrandom failed: {err}")).with_source(err),
                );
            }
        }
    }
    Ok(b)
}

/// The namespace digest of the slab differs from the tier's: show both (short hex) and what
/// the digest is made of, so the user can tell which setting changed.
pub fn namespace_mismatch(p: &Path, expected: &[u8; 32], found: &[u8; 32]) -> Error {
    let short = |d: &[u8; 32]| hex::encode(&d[..6]);
    Error::new(
        ErrorKind::IncompatibleLayout,
        format!(
            "{}: namespace digest differs: the tier expects {}…, the slab holds {}…. The \
             namespace is derived from the model layout, TP size, blocks per chunk, canonical \
             layout and row stride: one of these settings differs from the ones the slab was \
             formatted with (restore it, or reformat explicitly with `kvtier tier format` to \
             discard the stored chunks)",
            p.display(),
            short(expected),
            short(found)
        ),
    )
    .with("path", p.display().to_string())
    .with("mismatch", MISMATCH_NAMESPACE)
    .with("expected", hex::encode(expected))
    .with("found", hex::encode(found))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Superblock {
        Superblock {
            version: SLAB_FORMAT_VERSION,
            row_stride: 2 << 20,
            slots_in_file: 1000,
            total_slots: 2000,
            path_index: 1,
            path_count: 2,
            namespace: [0x5A; 32],
            set_uuid: [0x11; 16],
            created_unix_s: 1_800_000_000,
        }
    }

    #[test]
    fn golden_bytes() {
        let b = sample().encode();
        let expected_head = concat!(
            "4b56544733534c42",
            "02000000",
            "00100000", // magic, version, header size
            "0000200000000000",
            "e803000000000000",
            "d007000000000000", // stride, slots, total
            "01000000",
            "02000000", // path index, path count
        );
        assert_eq!(hex::encode(&b[..48]), expected_head);
        assert_eq!(b[48..80], [0x5A; 32]);
        assert_eq!(b[80..96], [0x11; 16]);
        assert_eq!(hex::encode(&b[96..104]), "00d2496b00000000");
        assert!(b[104..4092].iter().all(|&x| x == 0));
        assert_eq!(le_u32(&b, 4092), crc32fast::hash(&b[..4092]));
        assert_eq!(Superblock::decode(&b, "t").unwrap(), sample());
    }

    #[test]
    fn decode_rejects_damage() {
        let good = sample().encode();
        let mut bad = good;
        bad[0] = b'X';
        assert_eq!(
            Superblock::decode(&bad, "t").unwrap_err().kind(),
            ErrorKind::InvalidPath
        );
        let mut bad = good;
        bad[20] ^= 1;
        let e = Superblock::decode(&bad, "slab0").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt);
        assert!(e.to_string().contains("slab0"), "{e}");
        let mut v1 = sample();
        v1.version = 1;
        let e = Superblock::decode(&v1.encode(), "t").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::IncompatibleLayout);
        assert!(e.to_string().contains("version 1"), "{e}");
        assert!(e.to_string().contains("kvtier tier format"), "{e}");
        assert!(Superblock::decode(&good[..100], "t").is_err());
    }

    #[test]
    fn striping_and_sizes() {
        assert_eq!(slot_location(0, 2, 8192), (0, 4096));
        assert_eq!(slot_location(1, 2, 8192), (1, 4096));
        assert_eq!(slot_location(5, 2, 8192), (1, 4096 + 2 * 8192));
        assert_eq!(slab_file_len(3, 8192), 4096 + 3 * 8192);
        assert_ne!(geometry_namespace(4096), geometry_namespace(8192));
        assert_ne!(random_uuid().unwrap(), random_uuid().unwrap());
    }
}
