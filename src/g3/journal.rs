//! The journal writer: appends CRC-protected records (encoded by [`crate::g3::record`]) to the
//! current journal. Byte layouts are in `docs/format.md`; every integer is little-endian.
//!
//! A record is appended only after the data it describes is written (and, under
//! `fsync = always`, durable). After a failed write or sync the writer is poisoned and
//! refuses every further append: the tier then refuses stores until a checkpoint starts a new
//! journal ([`crate::g3::checkpoint::rotate`]).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
#[cfg(any(test, feature = "test-support"))]
use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result};
use crate::g3::index::Slot;
use crate::g3::index_dir::IndexDir;
#[cfg(any(test, feature = "test-support"))]
use crate::g3::index_dir::JOURNAL_TMP_FILE_NAME;
use crate::g3::record::{FileHeader, JOURNAL_MAGIC, RecordCodec};
use crate::io::MetaOp;
#[cfg(any(test, feature = "test-support"))]
use crate::io::{IoEngine, MetaFile};
use crate::key::ChunkKey;

pub use crate::g3::index_dir::{CHECKPOINT_FILE_NAME, JOURNAL_FILE_NAME};
pub use crate::g3::record::FILE_HEADER_SIZE;
#[cfg(any(test, feature = "test-support"))]
pub use crate::g3::record::MAX_KEY_LEN;

/// The 64-byte header of a journal continuing checkpoint `seq` of the set `set_uuid`.
pub fn journal_header(set_uuid: [u8; 16], seq: u64) -> [u8; FILE_HEADER_SIZE] {
    FileHeader {
        magic: JOURNAL_MAGIC,
        set_uuid,
        seq,
        count: 0,
        next_generation: 0,
    }
    .encode()
}

/// Appends records to the journal. After a failed write or sync it is poisoned and refuses
/// every further append.
pub struct JournalWriter {
    file: File,
    path: PathBuf,
    codec: RecordCodec,
    len: u64,
    pending: Vec<u8>,
    poisoned: Option<String>,
    #[cfg(any(test, feature = "test-support"))]
    faults: Option<Arc<dyn IoEngine>>,
}

impl std::fmt::Debug for JournalWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JournalWriter")
            .field("path", &self.path)
            .field("len", &self.len)
            .field("poisoned", &self.poisoned)
            .finish_non_exhaustive()
    }
}

impl JournalWriter {
    /// Opens the current journal of `dir`, whose first `valid_len` bytes are whole valid
    /// records; anything after (a torn tail, holding no valid record) is truncated away.
    pub fn open_at(dir: &IndexDir, set_uuid: [u8; 16], valid_len: u64) -> Result<Self> {
        let path = dir.file_path(JOURNAL_FILE_NAME);
        let file = dir.open_rw(JOURNAL_FILE_NAME)?;
        let len = file
            .metadata()
            .map_err(|e| Error::io("stat", &path, e))?
            .len();
        if len > valid_len {
            file.set_len(valid_len)
                .map_err(|e| Error::io("truncate journal", &path, e))?;
            file.sync_all().map_err(|e| Error::io("fsync", &path, e))?;
        }
        Ok(Self::new(file, path, set_uuid, valid_len, dir))
    }

    /// Replaces the current journal of `dir` with an empty one continuing checkpoint `seq`
    /// (temp file, fsync, rename, directory fsync). For tools and tests: the tier starts
    /// journals with [`crate::g3::checkpoint::rotate`], which keeps the previous generation.
    #[cfg(any(test, feature = "test-support"))]
    pub fn create(dir: &IndexDir, set_uuid: [u8; 16], seq: u64) -> Result<Self> {
        dir.write_file(
            JOURNAL_TMP_FILE_NAME,
            &journal_header(set_uuid, seq),
            MetaFile::Journal,
        )?;
        dir.rename(JOURNAL_TMP_FILE_NAME, JOURNAL_FILE_NAME, MetaFile::Journal)?;
        dir.sync()?;
        Self::open_at(dir, set_uuid, FILE_HEADER_SIZE as u64)
    }

    /// The writer of the freshly created journal `file` (its header only).
    pub(crate) fn new(
        file: File,
        path: PathBuf,
        set_uuid: [u8; 16],
        len: u64,
        // The directory's fault hook (test support).
        #[cfg_attr(not(any(test, feature = "test-support")), allow(unused_variables))]
        dir: &IndexDir,
    ) -> Self {
        JournalWriter {
            file,
            path,
            codec: RecordCodec::new(set_uuid),
            len,
            pending: Vec::new(),
            poisoned: None,
            #[cfg(any(test, feature = "test-support"))]
            faults: dir.faults().cloned(),
        }
    }

    /// The journal's path.
    #[cfg(any(test, feature = "test-support"))]
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
        // `pending` starts at the journal's end.
        self.codec.encode_insert(
            &mut self.pending,
            self.len,
            key.as_bytes(),
            slot,
            crc,
            generation,
        );
    }

    /// Buffers a remove record.
    pub fn remove(&mut self, slot: Slot) {
        self.codec.encode_remove(&mut self.pending, self.len, slot);
    }

    /// The fault a test injects into `op` on the journal; none in a shipped build.
    #[cfg(any(test, feature = "test-support"))]
    fn fault(&self, op: MetaOp) -> std::io::Result<()> {
        match self
            .faults
            .as_ref()
            .and_then(|e| e.meta_fault(MetaFile::Journal, op))
        {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The fault a test injects into `op` on the journal; none in a shipped build.
    #[cfg(not(any(test, feature = "test-support")))]
    #[inline(always)]
    fn fault(&self, _op: MetaOp) -> std::io::Result<()> {
        Ok(())
    }

    /// Writes the buffered records; with `sync`, also `fdatasync`s the journal. With `sync`
    /// it also checks that the journal file is still linked: records appended to a journal
    /// that was deleted would not be found by a restart.
    pub fn flush(&mut self, sync: bool) -> Result<()> {
        if let Some(why) = &self.poisoned {
            self.pending.clear();
            return Err(self.poison_error(why));
        }
        if !self.pending.is_empty() {
            if let Err(e) = self
                .fault(MetaOp::Write)
                .and_then(|()| self.file.write_all_at(&self.pending, self.len))
            {
                return Err(self.poison(journal_error("append to journal", &self.path, e)));
            }
            self.len += self.pending.len() as u64;
            self.pending.clear();
        }
        if sync {
            if let Err(e) = self
                .fault(MetaOp::Sync)
                .and_then(|()| self.file.sync_data())
            {
                return Err(self.poison(journal_error("fdatasync journal", &self.path, e)));
            }
            if let Err(e) = self.check_linked() {
                return Err(self.poison(e));
            }
        }
        Ok(())
    }

    /// Fails when the journal file has no name any more (deleted under the tier).
    pub fn check_linked(&self) -> Result<()> {
        let st = rustix::fs::fstat(&self.file)
            .map_err(|e| Error::io("stat", &self.path, std::io::Error::from(e)))?;
        if st.st_nlink == 0 {
            return Err(Error::new(
                ErrorKind::InvalidPath,
                format!(
                    "journal {} was deleted while the tier ran: records appended to it would \
                     not be found by a restart",
                    self.path.display()
                ),
            )
            .with("path", self.path.display().to_string()));
        }
        Ok(())
    }

    /// Refuses every further append, for `e`.
    pub fn poison(&mut self, e: Error) -> Error {
        if self.poisoned.is_none() {
            log::error!("G3 journal {} poisoned: {e}", self.path.display());
            self.poisoned = Some(e.to_string());
        }
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

/// ENOSPC / EDQUOT is [`ErrorKind::NoSpace`]; anything else an I/O error.
fn journal_error(op: &str, path: &Path, e: std::io::Error) -> Error {
    if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) {
        return Error::new(ErrorKind::NoSpace, format!("{op} {}: {e}", path.display()))
            .with("path", path.display().to_string())
            .with_source(e);
    }
    Error::io(op, path, e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::g3::record::decode_records;

    const U: [u8; 16] = [1; 16];

    fn fresh(dir: &IndexDir) -> JournalWriter {
        dir.write_file(JOURNAL_FILE_NAME, &journal_header(U, 0), MetaFile::Journal)
            .unwrap();
        JournalWriter::open_at(dir, U, FILE_HEADER_SIZE as u64).unwrap()
    }

    #[test]
    fn writer_appends_records_at_their_offsets_and_truncates_a_torn_tail() {
        let d = tempfile::tempdir_in("/tmp").unwrap();
        let dir = IndexDir::open(d.path()).unwrap();
        let mut w = fresh(&dir);
        w.insert(&ChunkKey::new(b"a"), 0, 5, 1);
        w.flush(true).unwrap();
        w.remove(0);
        w.flush(true).unwrap();
        let good = w.len();
        drop(w);
        let p = d.path().join(JOURNAL_FILE_NAME);
        let bytes = std::fs::read(&p).unwrap();
        let decoded = decode_records(&RecordCodec::new(U), &bytes[64..], 64);
        assert_eq!(decoded.records.len(), 2, "{decoded:?}");
        assert!(decoded.tail.is_none() && decoded.skipped.is_empty());
        let mut f = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
        std::io::Write::write_all(&mut f, &[1, 2, 3]).unwrap();
        let w = JournalWriter::open_at(&dir, U, good).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), good);
        assert_eq!(w.len(), good);
    }

    #[test]
    fn a_deleted_journal_is_noticed_at_the_next_sync() {
        let d = tempfile::tempdir_in("/tmp").unwrap();
        let dir = IndexDir::open(d.path()).unwrap();
        let mut w = fresh(&dir);
        std::fs::remove_file(d.path().join(JOURNAL_FILE_NAME)).unwrap();
        w.insert(&ChunkKey::new(b"a"), 0, 5, 1);
        let e = w.flush(true).unwrap_err();
        assert!(e.to_string().contains("deleted"), "{e}");
        assert!(w.poisoned().is_some());
        assert_eq!(w.flush(false).unwrap_err().kind(), ErrorKind::Poisoned);
    }
}
