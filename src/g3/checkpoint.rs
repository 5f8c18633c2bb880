//! Checkpoints: the compacted index, written as a new generation beside the previous one.
//!
//! [`rotate`] writes checkpoint `seq` and an empty journal continuing it under temporary names
//! (complete and fsynced) before it renames anything, then moves the current generation to
//! `.prev` and the new one into place (`docs/format.md`, "Checkpoint"). Recovery reads the
//! newest intact checkpoint plus every journal continuing it or a later one; with the order of
//! the renames, every crash point leaves files from which it rebuilds what was acknowledged.
//! A failure before the checkpoint's rename leaves the current journal in use; after it, the
//! current journal is no longer the one recovery reads, and the caller must stop appending to
//! it ([`RotateError::journal_still_read`]).

use crate::error::{Error, Result};
use crate::g3::index::IndexEntry;
use crate::g3::index_dir::{
    CHECKPOINT_FILE_NAME, CHECKPOINT_PREV_FILE_NAME, CHECKPOINT_TMP_FILE_NAME, INDEX_FILE_NAMES,
    IndexDir, JOURNAL_FILE_NAME, JOURNAL_PREV_FILE_NAME, JOURNAL_TMP_FILE_NAME,
};
use crate::g3::journal::{JournalWriter, journal_header};
use crate::g3::record::{
    CHECKPOINT_MAGIC, FILE_HEADER_SIZE, FileHeader, RECORD_HEADER_SIZE, RecordCodec,
};
use crate::io::MetaFile;

/// The bytes of checkpoint `seq` of the set `set_uuid`: header, then one insert record per
/// entry, least recently used first.
pub fn encode_checkpoint(
    set_uuid: [u8; 16],
    seq: u64,
    next_generation: u64,
    entries: &[IndexEntry],
) -> Vec<u8> {
    let header = FileHeader {
        magic: CHECKPOINT_MAGIC,
        set_uuid,
        seq,
        count: entries.len() as u64,
        next_generation,
    };
    let codec = RecordCodec::new(set_uuid);
    let mut buf = Vec::with_capacity(FILE_HEADER_SIZE + entries.len() * (RECORD_HEADER_SIZE + 40));
    buf.extend_from_slice(&header.encode());
    // `buf` starts at offset 0 of the file.
    for e in entries {
        codec.encode_insert(&mut buf, 0, e.key.as_bytes(), e.slot, e.crc, e.generation);
    }
    buf
}

/// A failed [`rotate`].
#[derive(Debug)]
pub struct RotateError {
    /// What failed.
    pub error: Error,
    /// True when nothing that recovery reads changed: the current journal may still be
    /// appended to. False once the new checkpoint is in place: records appended to the
    /// current journal would not be replayed.
    pub journal_still_read: bool,
}

/// Writes checkpoint `seq` of `entries` and a fresh journal continuing it, keeping the current
/// generation as the previous one; returns the new journal's writer.
pub fn rotate(
    dir: &IndexDir,
    set_uuid: [u8; 16],
    seq: u64,
    next_generation: u64,
    entries: &[IndexEntry],
) -> std::result::Result<JournalWriter, RotateError> {
    let still = |error| RotateError {
        error,
        journal_still_read: true,
    };
    let moved = |error| RotateError {
        error,
        journal_still_read: false,
    };
    let bytes = encode_checkpoint(set_uuid, seq, next_generation, entries);
    // 1. The new generation, complete and durable under temporary names.
    dir.write_file(CHECKPOINT_TMP_FILE_NAME, &bytes, MetaFile::Checkpoint)
        .map_err(still)?;
    dir.write_file(
        JOURNAL_TMP_FILE_NAME,
        &journal_header(set_uuid, seq),
        MetaFile::Journal,
    )
    .map_err(still)?;
    // 2. The current checkpoint becomes the previous generation; the new one takes its place.
    //    Until the second rename, recovery still reads the current checkpoint and journal.
    dir.rename(
        CHECKPOINT_FILE_NAME,
        CHECKPOINT_PREV_FILE_NAME,
        MetaFile::Checkpoint,
    )
    .map_err(still)?;
    dir.rename(
        CHECKPOINT_TMP_FILE_NAME,
        CHECKPOINT_FILE_NAME,
        MetaFile::Checkpoint,
    )
    .map_err(still)?;
    // 3. The journals follow.
    dir.rename(JOURNAL_FILE_NAME, JOURNAL_PREV_FILE_NAME, MetaFile::Journal)
        .map_err(moved)?;
    dir.rename(JOURNAL_TMP_FILE_NAME, JOURNAL_FILE_NAME, MetaFile::Journal)
        .map_err(moved)?;
    dir.sync().map_err(moved)?;
    let file = dir.open_rw(JOURNAL_FILE_NAME).map_err(moved)?;
    Ok(JournalWriter::new(
        file,
        dir.file_path(JOURNAL_FILE_NAME),
        set_uuid,
        FILE_HEADER_SIZE as u64,
        dir,
    ))
}

/// Removes every index file in `dir` (missing files are fine), then syncs the directory if
/// anything was removed.
pub fn remove_index_files(dir: &IndexDir) -> Result<()> {
    let mut removed = false;
    for name in INDEX_FILE_NAMES {
        removed |= dir.remove(name)?;
    }
    // Nothing removed, nothing to sync (and no fsync of a directory that refuses it).
    if removed { dir.sync() } else { Ok(()) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::g3::record::decode_records;
    use crate::io::{FaultPlan, FaultyEngine, MetaFault, MetaOp};
    use crate::key::ChunkKey;
    use std::path::Path;
    use std::sync::Arc;

    const U: [u8; 16] = [7; 16];

    fn entry(i: u32) -> IndexEntry {
        IndexEntry {
            key: ChunkKey::new(i.to_le_bytes()),
            slot: i,
            crc: i,
            generation: u64::from(i),
        }
    }

    fn seq_of(p: &Path, magic: [u8; 8]) -> u64 {
        let b = std::fs::read(p).unwrap();
        FileHeader::decode(&b, magic, "t").unwrap().seq
    }

    #[test]
    fn checkpoint_golden_layout() {
        let b = encode_checkpoint(U, 3, 9, &[entry(1), entry(2)]);
        let h = FileHeader::decode(&b, CHECKPOINT_MAGIC, "t").unwrap();
        assert_eq!((h.seq, h.count, h.next_generation), (3, 2, 9));
        let d = decode_records(&RecordCodec::new(U), &b[64..], 64);
        assert_eq!(d.records.len(), 2);
    }

    #[test]
    fn rotation_keeps_the_previous_generation() {
        let d = tempfile::tempdir_in("/tmp").unwrap();
        let dir = IndexDir::open(d.path()).unwrap();
        rotate(&dir, U, 1, 1, &[]).unwrap();
        let mut w = rotate(&dir, U, 2, 1, &[entry(1)]).unwrap();
        w.insert(&ChunkKey::new(b"x"), 4, 4, 4);
        w.flush(true).unwrap();
        let p = |n: &str| d.path().join(n);
        assert_eq!(seq_of(&p(CHECKPOINT_FILE_NAME), CHECKPOINT_MAGIC), 2);
        assert_eq!(seq_of(&p(CHECKPOINT_PREV_FILE_NAME), CHECKPOINT_MAGIC), 1);
        assert_eq!(
            seq_of(&p(JOURNAL_FILE_NAME), crate::g3::record::JOURNAL_MAGIC),
            2
        );
        assert_eq!(
            seq_of(&p(JOURNAL_PREV_FILE_NAME), crate::g3::record::JOURNAL_MAGIC),
            1
        );
        assert!(!p(CHECKPOINT_TMP_FILE_NAME).exists() && !p(JOURNAL_TMP_FILE_NAME).exists());
        remove_index_files(&dir).unwrap();
        assert!(dir.names().unwrap().is_empty());
    }

    #[test]
    fn a_failure_says_whether_the_current_journal_is_still_read() {
        let region = Arc::new(crate::region::PrimaryRegion::create(1, 4096).unwrap());
        let inner = crate::io::psync::PsyncEngine::new(region, Vec::new(), 1, false).unwrap();
        // (file, op, skip, still read)
        let cases = [
            (MetaFile::Journal, MetaOp::Create, 0, true),
            (MetaFile::Checkpoint, MetaOp::Write, 0, true),
            (MetaFile::Journal, MetaOp::Sync, 0, true),
            (MetaFile::Checkpoint, MetaOp::Rename, 0, true),
            (MetaFile::Checkpoint, MetaOp::Rename, 1, true),
            (MetaFile::Journal, MetaOp::Rename, 0, false),
            (MetaFile::Journal, MetaOp::Rename, 1, false),
            (MetaFile::Directory, MetaOp::Sync, 0, false),
        ];
        let inner: Arc<dyn crate::io::IoEngine> = Arc::new(inner);
        for (file, op, skip, still) in cases {
            let d = tempfile::tempdir_in("/tmp").unwrap();
            rotate(&IndexDir::open(d.path()).unwrap(), U, 1, 1, &[]).unwrap();
            let plan =
                FaultPlan::new().meta(MetaFault::new(file, op, libc::ENOSPC).after(skip).times(1));
            let engine: Arc<dyn crate::io::IoEngine> =
                Arc::new(FaultyEngine::new(inner.clone(), plan).unwrap());
            let dir = IndexDir::open(d.path()).unwrap().with_faults(engine);
            let e = rotate(&dir, U, 2, 1, &[entry(1)]).unwrap_err();
            assert_eq!(
                e.journal_still_read, still,
                "{file:?} {op:?} after {skip}: {}",
                e.error
            );
            assert!(e.error.to_string().contains("No space"), "{}", e.error);
        }
    }
}
