//! The persistent index: an append-only journal of CRC-protected records plus a checkpoint
//! that compacts it. Byte layouts are in `docs/format.md`; every integer is little-endian.
//!
//! A record is appended only after the data it describes is written (and, under
//! `fsync = always`, durable). Readers stop at the first record that is torn or fails its CRC
//! and report how many bytes were valid, so the tail can be cut off.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, ErrorKind, Result};
use crate::g3::format::{le_u32, le_u64};
use crate::g3::index::{IndexEntry, Slot};
use crate::g3::record_reader::{check_records, records};
use crate::g3::slab::sync_dir;
use crate::key::ChunkKey;

/// Journal file name (in the first path's directory).
pub const JOURNAL_FILE_NAME: &str = "kvtier-g3.journal";
/// Checkpoint file name (in the first path's directory).
pub const CHECKPOINT_FILE_NAME: &str = "kvtier-g3.checkpoint";
/// Magic of a journal file.
pub const JOURNAL_MAGIC: [u8; 8] = *b"KVTG3JNL";
/// Magic of a checkpoint file.
pub const CHECKPOINT_MAGIC: [u8; 8] = *b"KVTG3CKP";
/// Version of the journal and checkpoint formats.
pub const JOURNAL_VERSION: u32 = 1;
/// Size of the journal / checkpoint file header.
pub const FILE_HEADER_SIZE: usize = 64;
/// Fixed part of a record, before the key bytes.
pub const RECORD_HEADER_SIZE: usize = 24;
/// Longest key a record can hold.
pub const MAX_KEY_LEN: usize = u16::MAX as usize;

pub(crate) const KIND_INSERT: u8 = 1;
pub(crate) const KIND_REMOVE: u8 = 2;

/// The header of a journal or checkpoint file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileHeader {
    /// `JOURNAL_MAGIC` or `CHECKPOINT_MAGIC`.
    pub magic: [u8; 8],
    /// Uuid of the stripe set the file belongs to.
    pub set_uuid: [u8; 16],
    /// Checkpoint: its sequence number. Journal: the checkpoint it continues.
    pub seq: u64,
    /// Checkpoint: number of entries. Journal: 0.
    pub count: u64,
    /// Checkpoint: next generation to hand out. Journal: 0.
    pub next_generation: u64,
}

impl FileHeader {
    /// Encodes the 64-byte header.
    pub fn encode(&self) -> [u8; FILE_HEADER_SIZE] {
        let mut b = [0u8; FILE_HEADER_SIZE];
        b[0..8].copy_from_slice(&self.magic);
        b[8..12].copy_from_slice(&JOURNAL_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&(FILE_HEADER_SIZE as u32).to_le_bytes());
        b[16..32].copy_from_slice(&self.set_uuid);
        b[32..40].copy_from_slice(&self.seq.to_le_bytes());
        b[40..48].copy_from_slice(&self.count.to_le_bytes());
        b[48..56].copy_from_slice(&self.next_generation.to_le_bytes());
        let crc = crc32fast::hash(&b[..60]);
        b[60..64].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes and checks a header with the expected magic.
    pub fn decode(b: &[u8], magic: [u8; 8], what: &Path) -> Result<Self> {
        let corrupt = |why: String| {
            Error::new(ErrorKind::Corrupt, format!("{}: {why}", what.display()))
                .with("path", what.display().to_string())
        };
        if b.len() < FILE_HEADER_SIZE {
            return Err(corrupt(format!(
                "{} bytes, shorter than its header",
                b.len()
            )));
        }
        if b[0..8] != magic {
            return Err(corrupt("bad magic".into()));
        }
        let crc = crc32fast::hash(&b[..60]);
        if le_u32(b, 60) != crc {
            return Err(corrupt("header CRC mismatch".into()));
        }
        let version = le_u32(b, 8);
        if version != JOURNAL_VERSION {
            return Err(Error::new(
                ErrorKind::IncompatibleLayout,
                format!(
                    "{}: format version {version} is not supported",
                    what.display()
                ),
            )
            .with("expected", JOURNAL_VERSION.to_string())
            .with("found", version.to_string()));
        }
        let mut set_uuid = [0u8; 16];
        set_uuid.copy_from_slice(&b[16..32]);
        Ok(FileHeader {
            magic,
            set_uuid,
            seq: le_u64(b, 32),
            count: le_u64(b, 40),
            next_generation: le_u64(b, 48),
        })
    }
}

/// One journal record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// `slot` now holds `key`, whose bytes have CRC32 `crc`.
    Insert {
        /// The key.
        key: ChunkKey,
        /// Its slot.
        slot: Slot,
        /// CRC32 of the slot's bytes.
        crc: u32,
        /// Generation (monotonic per stripe set).
        generation: u64,
    },
    /// `slot` holds nothing any more.
    Remove {
        /// The slot.
        slot: Slot,
    },
}

/// Appends the encoding of an insert record to `out`. Keys longer than [`MAX_KEY_LEN`] are
/// refused by the caller before reaching here.
pub fn encode_insert(out: &mut Vec<u8>, key: &[u8], slot: Slot, crc: u32, generation: u64) {
    encode(out, KIND_INSERT, key, slot, crc, generation);
}

/// Appends the encoding of a remove record to `out`.
pub fn encode_remove(out: &mut Vec<u8>, slot: Slot) {
    encode(out, KIND_REMOVE, &[], slot, 0, 0);
}

fn encode(out: &mut Vec<u8>, kind: u8, key: &[u8], slot: Slot, crc: u32, generation: u64) {
    let start = out.len();
    out.extend_from_slice(&[0u8; 4]);
    out.push(kind);
    out.push(0);
    out.extend_from_slice(&(key.len().min(MAX_KEY_LEN) as u16).to_le_bytes());
    out.extend_from_slice(&slot.to_le_bytes());
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(&generation.to_le_bytes());
    out.extend_from_slice(&key[..key.len().min(MAX_KEY_LEN)]);
    let c = crc32fast::hash(&out[start + 4..]);
    out[start..start + 4].copy_from_slice(&c.to_le_bytes());
}

/// Decodes records from `body` (the bytes after the file header), calling `f` for each valid
/// one. Returns `(valid_bytes, problem)`: decoding stops at the first torn or corrupt record,
/// described by `problem`. (Recovery streams files with
/// [`crate::g3::record_reader::stream_records`] instead, which applies the same checks.)
pub fn decode_records(body: &[u8], mut f: impl FnMut(Record)) -> (usize, Option<String>) {
    let (valid, problem) = check_records(body, 0, true);
    records(&body[..valid]).for_each(|r| f(r.to_record()));
    (valid, problem)
}

/// Appends records to the journal. After a failed write or sync it is poisoned and refuses
/// every further append.
#[derive(Debug)]
pub struct JournalWriter {
    file: File,
    path: PathBuf,
    len: u64,
    pending: Vec<u8>,
    poisoned: Option<String>,
}

impl JournalWriter {
    /// Opens an existing journal whose first `valid_len` bytes are valid; anything after
    /// (a torn tail) is truncated away.
    pub fn open_at(path: &Path, valid_len: u64) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| Error::io("open journal", path, e))?;
        let len = file
            .metadata()
            .map_err(|e| Error::io("stat", path, e))?
            .len();
        if len > valid_len {
            file.set_len(valid_len)
                .map_err(|e| Error::io("truncate journal", path, e))?;
            file.sync_all().map_err(|e| Error::io("fsync", path, e))?;
        }
        Ok(JournalWriter {
            file,
            path: path.to_path_buf(),
            len: valid_len,
            pending: Vec::new(),
            poisoned: None,
        })
    }

    /// Creates (atomically replaces) a journal continuing checkpoint `seq`.
    pub fn create(dir: &Path, set_uuid: [u8; 16], seq: u64) -> Result<Self> {
        let path = dir.join(JOURNAL_FILE_NAME);
        let header = FileHeader {
            magic: JOURNAL_MAGIC,
            set_uuid,
            seq,
            count: 0,
            next_generation: 0,
        };
        write_atomically(&path, &header.encode())?;
        Self::open_at(&path, FILE_HEADER_SIZE as u64)
    }

    /// The journal's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes written so far (header included).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True when only the header is present.
    pub fn is_empty(&self) -> bool {
        self.len <= FILE_HEADER_SIZE as u64 && self.pending.is_empty()
    }

    /// Why the journal refuses writes, if it does.
    pub fn poisoned(&self) -> Option<&str> {
        self.poisoned.as_deref()
    }

    /// Buffers an insert record.
    pub fn insert(&mut self, key: &ChunkKey, slot: Slot, crc: u32, generation: u64) {
        encode_insert(&mut self.pending, key.as_bytes(), slot, crc, generation);
    }

    /// Buffers a remove record.
    pub fn remove(&mut self, slot: Slot) {
        encode_remove(&mut self.pending, slot);
    }

    /// Writes the buffered records; with `sync`, also `fdatasync`s the journal.
    pub fn flush(&mut self, sync: bool) -> Result<()> {
        if let Some(why) = &self.poisoned {
            self.pending.clear();
            return Err(self.poison_error(why));
        }
        if !self.pending.is_empty() {
            if let Err(e) = self.file.write_all_at(&self.pending, self.len) {
                return Err(self.poison(Error::io("append to journal", &self.path, e)));
            }
            self.len += self.pending.len() as u64;
            self.pending.clear();
        }
        if sync && let Err(e) = self.file.sync_data() {
            return Err(self.poison(Error::io("fdatasync journal", &self.path, e)));
        }
        Ok(())
    }

    fn poison(&mut self, e: Error) -> Error {
        log::error!("G3 journal {} poisoned: {e}", self.path.display());
        self.poisoned = Some(e.to_string());
        self.pending.clear();
        e
    }

    fn poison_error(&self, why: &str) -> Error {
        Error::new(
            ErrorKind::Poisoned,
            format!(
                "journal {} refuses writes after an earlier failure: {why}",
                self.path.display()
            ),
        )
        .with("path", self.path.display().to_string())
    }
}

/// Writes a checkpoint (`seq`, entries in LRU order) atomically: temp file, fsync, rename,
/// fsync of the directory.
pub fn write_checkpoint(
    dir: &Path,
    set_uuid: [u8; 16],
    seq: u64,
    next_generation: u64,
    entries: &[IndexEntry],
) -> Result<()> {
    let header = FileHeader {
        magic: CHECKPOINT_MAGIC,
        set_uuid,
        seq,
        count: entries.len() as u64,
        next_generation,
    };
    let mut buf = Vec::with_capacity(FILE_HEADER_SIZE + entries.len() * (RECORD_HEADER_SIZE + 40));
    buf.extend_from_slice(&header.encode());
    for e in entries {
        encode_insert(&mut buf, e.key.as_bytes(), e.slot, e.crc, e.generation);
    }
    write_atomically(&dir.join(CHECKPOINT_FILE_NAME), &buf)
}

/// Replaces `path` with `bytes` atomically (temp file in the same directory, fsync, rename,
/// directory fsync).
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = path.with_extension("tmp");
    let write = || -> std::io::Result<()> {
        let f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(&tmp)?;
        f.write_all_at(bytes, 0)?;
        f.sync_all()
    };
    write().map_err(|e| Error::io("write", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io("rename into place", path, e))?;
    sync_dir(dir)
}

/// Removes the journal and checkpoint in `dir` (missing files are fine).
pub fn remove_index_files(dir: &Path) -> Result<()> {
    let mut removed = false;
    for name in [JOURNAL_FILE_NAME, CHECKPOINT_FILE_NAME] {
        let p = dir.join(name);
        match std::fs::remove_file(&p) {
            Ok(()) => removed = true,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("remove", &p, e)),
        }
    }
    // Nothing removed, nothing to sync (and no fsync of a directory that refuses it).
    if removed { sync_dir(dir) } else { Ok(()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_golden_bytes_and_round_trip() {
        let mut b = Vec::new();
        encode_insert(&mut b, &[0xAA, 0xBB], 7, 0x1122_3344, 9);
        assert_eq!(b.len(), RECORD_HEADER_SIZE + 2);
        assert_eq!(
            hex::encode(&b[4..]),
            concat!(
                "01000200",
                "07000000",
                "44332211",
                "0900000000000000",
                "aabb"
            )
        );
        assert_eq!(le_u32(&b, 0), crc32fast::hash(&b[4..]));
        encode_remove(&mut b, 7);
        let mut got = Vec::new();
        let (n, problem) = decode_records(&b, |r| got.push(r));
        assert_eq!((n, problem), (b.len(), None));
        assert_eq!(
            got,
            vec![
                Record::Insert {
                    key: ChunkKey::new([0xAA, 0xBB]),
                    slot: 7,
                    crc: 0x1122_3344,
                    generation: 9
                },
                Record::Remove { slot: 7 },
            ]
        );
    }

    #[test]
    fn torn_and_corrupt_tails_stop_decoding() {
        let mut b = Vec::new();
        encode_insert(&mut b, b"k1", 1, 1, 1);
        let first = b.len();
        encode_insert(&mut b, b"k2", 2, 2, 2);
        for cut in first + 1..b.len() {
            let (n, p) = decode_records(&b[..cut], |_| {});
            assert_eq!(n, first);
            assert!(p.is_some());
        }
        let mut bad = b.clone();
        bad[first + 10] ^= 0x40;
        let mut count = 0;
        let (n, p) = decode_records(&bad, |_| count += 1);
        assert_eq!((n, count), (first, 1));
        assert!(p.unwrap().contains("CRC"));
    }

    #[test]
    fn header_round_trip_and_checks() {
        let h = FileHeader {
            magic: JOURNAL_MAGIC,
            set_uuid: [3; 16],
            seq: 5,
            count: 6,
            next_generation: 7,
        };
        let b = h.encode();
        let p = Path::new("/x/journal");
        assert_eq!(FileHeader::decode(&b, JOURNAL_MAGIC, p).unwrap(), h);
        assert_eq!(
            FileHeader::decode(&b, CHECKPOINT_MAGIC, p)
                .unwrap_err()
                .kind(),
            ErrorKind::Corrupt
        );
        let mut bad = b;
        bad[33] ^= 1;
        assert_eq!(
            FileHeader::decode(&bad, JOURNAL_MAGIC, p)
                .unwrap_err()
                .kind(),
            ErrorKind::Corrupt
        );
    }

    #[test]
    fn writer_appends_and_truncates_torn_tail() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let mut w = JournalWriter::create(dir.path(), [1; 16], 0).unwrap();
        w.insert(&ChunkKey::new(b"a"), 0, 5, 1);
        w.flush(true).unwrap();
        let good = w.len();
        drop(w);
        let p = dir.path().join(JOURNAL_FILE_NAME);
        let mut f = OpenOptions::new().append(true).open(&p).unwrap();
        std::io::Write::write_all(&mut f, &[1, 2, 3]).unwrap();
        let w = JournalWriter::open_at(&p, good).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), good);
        assert_eq!(w.len(), good);
    }

    #[test]
    fn removing_nothing_syncs_nothing() {
        // /proc refuses fsync (EINVAL); with no index files there it must not be synced.
        if !Path::new("/proc/self").exists() {
            crate::skip_test!("no /proc here");
            return;
        }
        remove_index_files(Path::new("/proc")).unwrap();
        let d = tempfile::tempdir_in("/tmp").unwrap();
        std::fs::write(d.path().join(JOURNAL_FILE_NAME), b"x").unwrap();
        remove_index_files(d.path()).unwrap();
        assert!(!d.path().join(JOURNAL_FILE_NAME).exists());
    }
}
