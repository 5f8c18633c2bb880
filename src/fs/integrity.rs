//! The integrity record of a chunk file: a CRC32 that any host can check, kept in the user
//! extended attribute `user.kvtier.crc` so that the file's bytes stay exactly the row's (what
//! vLLM's fs tier reads and writes). The record is set on the temporary file before it is
//! published, so a published file that has one always had it.
//!
//! Record, 16 bytes, little-endian:
//!
//! | bytes | field |
//! | --- | --- |
//! | 0..4 | magic `KVC1` (`4B 56 43 31`) |
//! | 4..8 | CRC-32 (ISO-HDLC, as zlib and `crc32fast`) of the whole file, `u32` LE |
//! | 8..16 | length of the file in bytes, `u64` LE |

use std::ffi::CStr;
use std::fs::File;
use std::path::Path;

use crate::error::{Error, ErrorKind, Result};
use crate::fs::sys;

/// The attribute that holds the record.
pub const XATTR_NAME: &CStr = c"user.kvtier.crc";

/// The record's magic.
pub const RECORD_MAGIC: [u8; 4] = *b"KVC1";

/// Bytes of a record.
pub const RECORD_LEN: usize = 16;

/// A chunk file's CRC and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CrcRecord {
    /// CRC-32 of the file's bytes.
    pub crc: u32,
    /// The file's length in bytes.
    pub len: u64,
}

impl CrcRecord {
    /// The record of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        CrcRecord {
            crc: crc32fast::hash(bytes),
            len: bytes.len() as u64,
        }
    }

    /// The 16 bytes of the record.
    pub fn encode(&self) -> [u8; RECORD_LEN] {
        let mut b = [0u8; RECORD_LEN];
        b[..4].copy_from_slice(&RECORD_MAGIC);
        b[4..8].copy_from_slice(&self.crc.to_le_bytes());
        b[8..].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Parses a record; anything but 16 bytes with the magic is [`ErrorKind::Corrupt`].
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let ok = bytes.len() == RECORD_LEN && bytes[..4] == RECORD_MAGIC;
        if !ok {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!(
                    "{} is not a kvtier CRC record ({} bytes: {})",
                    XATTR_NAME.to_string_lossy(),
                    bytes.len(),
                    hex::encode(&bytes[..bytes.len().min(32)])
                ),
            ));
        }
        let mut crc = [0u8; 4];
        crc.copy_from_slice(&bytes[4..8]);
        let mut len = [0u8; 8];
        len.copy_from_slice(&bytes[8..16]);
        Ok(CrcRecord {
            crc: u32::from_le_bytes(crc),
            len: u64::from_le_bytes(len),
        })
    }

    /// Writes the record on `file`.
    pub fn write_to(&self, file: &File) -> std::io::Result<()> {
        sys::set_xattr(file, XATTR_NAME, &self.encode())
    }

    /// The record of `file`, `None` when it has none (a file vLLM wrote); `path` names it in
    /// errors.
    pub fn read_from(file: &File, path: &Path) -> Result<Option<Self>> {
        let mut buf = [0u8; 64];
        match sys::get_xattr(file, XATTR_NAME, &mut buf) {
            Ok(None) => Ok(None),
            Ok(Some(n)) => Self::decode(&buf[..n])
                .map(Some)
                .map_err(|e| e.with("path", path.display().to_string())),
            // A filesystem without user xattrs holds no records: every file is unverified.
            Err(e) if sys::is_unsupported(&e) => Ok(None),
            Err(e) if e.raw_os_error() == Some(libc::ERANGE) => Err(Error::new(
                ErrorKind::Corrupt,
                format!(
                    "{} of {} is longer than a kvtier CRC record",
                    XATTR_NAME.to_string_lossy(),
                    path.display()
                ),
            )
            .with("path", path.display().to_string())),
            Err(e) => Err(Error::io("fgetxattr", path, e)),
        }
    }
}

/// Whether user extended attributes work in `dir`: sets and reads back a record on a
/// temporary file (removed afterwards). `Err` says why not (the filesystem refused it).
pub fn probe_xattr(dir: &Path) -> std::result::Result<(), String> {
    // Every host sharing the directory probes it: a name of its own (not just the pid, which
    // hosts' containers often share), created exclusively.
    let path = dir.join(format!(
        ".kvtier-xattr-probe-{}-{:016x}",
        std::process::id(),
        sys::unique_suffix()
    ));
    let file =
        File::create_new(&path).map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    let rec = CrcRecord { crc: 1, len: 2 };
    let outcome = match rec.write_to(&file) {
        Err(e) => Err(format!(
            "setting {} failed: {e}",
            XATTR_NAME.to_string_lossy()
        )),
        Ok(()) => match CrcRecord::read_from(&file, &path) {
            Ok(Some(r)) if r == rec => Ok(()),
            Ok(other) => Err(format!("the attribute read back as {other:?}")),
            Err(e) => Err(e.to_string()),
        },
    };
    drop(file);
    if let Err(e) = std::fs::remove_file(&path) {
        log::warn!("cannot remove xattr probe file {}: {e}", path.display());
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_bytes_are_little_endian_with_magic() {
        let r = CrcRecord {
            crc: 0x1122_3344,
            len: 0x0102_0304_0506_0708,
        };
        assert_eq!(
            r.encode(),
            [
                b'K', b'V', b'C', b'1', 0x44, 0x33, 0x22, 0x11, 8, 7, 6, 5, 4, 3, 2, 1
            ]
        );
        assert_eq!(CrcRecord::decode(&r.encode()).unwrap(), r);
        assert_eq!(
            CrcRecord::decode(&r.encode()[..15]).unwrap_err().kind(),
            ErrorKind::Corrupt
        );
        let mut bad = r.encode();
        bad[0] = b'X';
        assert!(CrcRecord::decode(&bad).is_err());
        // The CRC is zlib's (CRC-32/ISO-HDLC): check value of "123456789".
        assert_eq!(CrcRecord::of(b"123456789").crc, 0xCBF4_3926);
    }

    #[test]
    fn records_round_trip_on_a_file() {
        let d = tempfile::tempdir_in("/tmp").unwrap();
        if let Err(why) = probe_xattr(d.path()) {
            crate::skip_test!("no user xattrs in /tmp: {why}");
            return;
        }
        let p = d.path().join("c.bin");
        let f = File::create(&p).unwrap();
        assert_eq!(CrcRecord::read_from(&f, &p).unwrap(), None);
        let r = CrcRecord::of(b"row bytes");
        r.write_to(&f).unwrap();
        assert_eq!(CrcRecord::read_from(&f, &p).unwrap(), Some(r));
        sys::set_xattr(&f, XATTR_NAME, b"junk").unwrap();
        let e = CrcRecord::read_from(&f, &p).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt);
        assert!(e.to_string().contains("c.bin") || e.context_value("path").is_some());
    }
}
