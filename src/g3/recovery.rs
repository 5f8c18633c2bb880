//! Rebuilding the index from checkpoint + journal at start-up (on the tier's worker thread,
//! while `lookup` answers RETRY).
//!
//! Damage is never fatal and never yields a wrong entry: a torn or corrupt journal tail is cut
//! off with a warning; a checkpoint or journal of another stripe set is ignored with a
//! warning. Entries lost that way become misses, and their slots are reused. Every entry that
//! survives still carries its data CRC, checked on every load.

use std::fs::File;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::g3::format::read_at_most;
use crate::g3::index::Index;
use crate::g3::journal::{
    CHECKPOINT_FILE_NAME, CHECKPOINT_MAGIC, FILE_HEADER_SIZE, FileHeader, JOURNAL_FILE_NAME,
    JOURNAL_MAGIC, JournalWriter, write_checkpoint,
};
use crate::g3::record_reader::{RecordRef, records, stream_records};

/// What recovery found.
#[derive(Debug)]
pub struct Recovered {
    /// The rebuilt index.
    pub index: Index,
    /// Next generation number to hand out.
    pub next_generation: u64,
    /// Sequence number of the checkpoint read (0 when none).
    pub checkpoint_seq: u64,
    /// `Some(valid_len)` when the journal continues that checkpoint and can be appended to
    /// after cutting it at `valid_len`; `None` when a fresh checkpoint + journal must be
    /// written.
    pub journal_valid_len: Option<u64>,
    /// Checkpoint entries plus journal records applied.
    pub records: u64,
    /// Bytes of journal cut off.
    pub cut_bytes: u64,
    /// Warnings logged (damage found).
    pub warnings: Vec<String>,
    /// Time spent.
    pub duration: Duration,
}

/// Applies checked records in small batches, prefetching what each insert will touch one
/// batch ahead so that the cache misses of a batch overlap. Keys are hashed and copied into
/// the index straight from the read buffer.
#[derive(Default)]
struct Replay {
    records: u64,
    max_gen: u64,
    out_of_range: u64,
}

const REPLAY_BATCH: usize = 16;

impl Replay {
    /// Applies the records of `chunk` (whole records, already CRC-checked).
    fn apply(&mut self, index: &mut Index, chunk: &[u8]) {
        let mut batch = Vec::with_capacity(REPLAY_BATCH);
        for r in records(chunk) {
            let h = match r {
                RecordRef::Insert { key, slot, .. } => {
                    let h = index.key_hash(key);
                    index.prefetch_insert(h, slot);
                    h
                }
                RecordRef::Remove { .. } => 0,
            };
            batch.push((r, h));
            if batch.len() == REPLAY_BATCH {
                self.flush(index, &mut batch);
            }
        }
        self.flush(index, &mut batch);
    }

    fn flush(&mut self, index: &mut Index, batch: &mut Vec<(RecordRef<'_>, u64)>) {
        for (r, h) in batch.drain(..) {
            self.records += 1;
            let ok = match r {
                RecordRef::Insert {
                    key,
                    slot,
                    crc,
                    generation,
                } => {
                    self.max_gen = self.max_gen.max(generation);
                    index.apply_insert_hashed(key, h, slot, crc, generation)
                }
                RecordRef::Remove { slot } => index.apply_remove(slot),
            };
            if !ok {
                self.out_of_range += 1;
            }
        }
    }
}

/// Opens `p` and reads its header bytes (fewer when the file is shorter); `None` when the
/// file does not exist.
fn open_optional(p: &Path) -> Result<Option<(File, Vec<u8>)>> {
    let f = match File::open(p) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("open", p, e)),
    };
    let mut header = vec![0u8; FILE_HEADER_SIZE];
    let n = read_at_most(&f, &mut header, 0).map_err(|e| Error::io("read", p, e))?;
    header.truncate(n);
    Ok(Some((f, header)))
}

/// Rebuilds the index of the stripe set `set_uuid` from the files in `dir`.
pub fn recover(
    dir: &Path,
    set_uuid: [u8; 16],
    total_slots: u32,
    n_paths: usize,
) -> Result<Recovered> {
    let start = Instant::now();
    let mut index = Index::for_recovery(total_slots, n_paths);
    let mut warnings = Vec::new();
    let mut warn = |w: String| {
        log::warn!("{w}");
        warnings.push(w);
    };
    let mut replay = Replay::default();

    let ckpt_path = dir.join(CHECKPOINT_FILE_NAME);
    let mut ckpt_seq = 0;
    let mut next_generation = 1;
    let mut have_ckpt = false;
    if let Some((file, header)) = open_optional(&ckpt_path)? {
        match FileHeader::decode(&header, CHECKPOINT_MAGIC, &ckpt_path) {
            Err(e) => warn(format!("ignoring G3 checkpoint: {e}")),
            Ok(h) if h.set_uuid != set_uuid => warn(format!(
                "ignoring G3 checkpoint {}: it belongs to stripe set {}, not {}",
                ckpt_path.display(),
                hex::encode(h.set_uuid),
                hex::encode(set_uuid)
            )),
            Ok(h) => {
                have_ckpt = true;
                ckpt_seq = h.seq;
                next_generation = h.next_generation;
                let end = stream_records(&file, &ckpt_path, FILE_HEADER_SIZE as u64, |c| {
                    replay.apply(&mut index, c)
                })?;
                let n = replay.records;
                if let Some(p) = end.problem {
                    warn(format!(
                        "G3 checkpoint {} is damaged ({p}); {n} of {} entries recovered",
                        ckpt_path.display(),
                        h.count
                    ));
                } else if n != h.count {
                    warn(format!(
                        "G3 checkpoint {} holds {n} entries, its header says {}",
                        ckpt_path.display(),
                        h.count
                    ));
                }
            }
        }
    }

    let jpath = dir.join(JOURNAL_FILE_NAME);
    let mut journal_valid_len = None;
    let mut cut_bytes = 0;
    if let Some((file, header)) = open_optional(&jpath)? {
        match FileHeader::decode(&header, JOURNAL_MAGIC, &jpath) {
            Err(e) => warn(format!("ignoring G3 journal: {e}")),
            Ok(h) if h.set_uuid != set_uuid => warn(format!(
                "ignoring G3 journal {}: it belongs to stripe set {}, not {}",
                jpath.display(),
                hex::encode(h.set_uuid),
                hex::encode(set_uuid)
            )),
            Ok(h) if have_ckpt && h.seq < ckpt_seq => log::info!(
                "G3 journal {} predates checkpoint {ckpt_seq}; already folded in",
                jpath.display()
            ),
            Ok(h) => {
                if h.seq != ckpt_seq {
                    warn(format!(
                        "G3 journal {} continues checkpoint {} but checkpoint {ckpt_seq} was \
                         found; replaying it anyway (loads stay CRC-checked)",
                        jpath.display(),
                        h.seq
                    ));
                }
                let end = stream_records(&file, &jpath, FILE_HEADER_SIZE as u64, |c| {
                    replay.apply(&mut index, c)
                })?;
                let valid = end.valid;
                if let Some(p) = end.problem {
                    cut_bytes = end.total - valid;
                    warn(format!(
                        "G3 journal {}: {p}; cutting off the last {cut_bytes} bytes",
                        jpath.display()
                    ));
                }
                if h.seq == ckpt_seq {
                    journal_valid_len = Some(FILE_HEADER_SIZE as u64 + valid);
                }
            }
        }
    }
    if replay.out_of_range > 0 {
        warn(format!(
            "{} G3 index records named slots beyond {total_slots}; ignored",
            replay.out_of_range
        ));
    }
    index.finish_recovery();
    Ok(Recovered {
        index,
        next_generation: next_generation.max(replay.max_gen + 1),
        checkpoint_seq: ckpt_seq,
        journal_valid_len,
        records: replay.records,
        cut_bytes,
        warnings,
        duration: start.elapsed(),
    })
}

/// Opens the journal for appending after [`recover`]: continues it when possible, else
/// writes a fresh checkpoint of the recovered index and a fresh journal. Returns the writer
/// and the checkpoint sequence it continues.
pub fn open_journal(
    dir: &Path,
    set_uuid: [u8; 16],
    rec: &Recovered,
) -> Result<(JournalWriter, u64)> {
    if let Some(len) = rec.journal_valid_len {
        return Ok((
            JournalWriter::open_at(&dir.join(JOURNAL_FILE_NAME), len)?,
            rec.checkpoint_seq,
        ));
    }
    let seq = rec.checkpoint_seq + 1;
    write_checkpoint(
        dir,
        set_uuid,
        seq,
        rec.next_generation,
        &rec.index.entries_lru_first(),
    )?;
    Ok((JournalWriter::create(dir, set_uuid, seq)?, seq))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::ChunkKey;

    const U: [u8; 16] = [9; 16];

    fn k(i: u32) -> ChunkKey {
        ChunkKey::new(i.to_le_bytes())
    }

    #[test]
    fn empty_dir_recovers_empty_and_writes_fresh_files() {
        let d = tempfile::tempdir_in("/tmp").unwrap();
        let r = recover(d.path(), U, 8, 2).unwrap();
        assert!(r.index.is_empty() && r.journal_valid_len.is_none());
        let (_w, seq) = open_journal(d.path(), U, &r).unwrap();
        assert_eq!(seq, 1);
        let r2 = recover(d.path(), U, 8, 2).unwrap();
        assert_eq!(r2.checkpoint_seq, 1);
        assert_eq!(r2.journal_valid_len, Some(FILE_HEADER_SIZE as u64));
        assert!(r2.warnings.is_empty(), "{:?}", r2.warnings);
    }

    #[test]
    fn checkpoint_plus_journal_with_torn_tail() {
        let d = tempfile::tempdir_in("/tmp").unwrap();
        let r = recover(d.path(), U, 8, 1).unwrap();
        let (mut w, _) = open_journal(d.path(), U, &r).unwrap();
        for i in 0..4 {
            w.insert(&k(i), i, 100 + i, u64::from(i) + 1);
        }
        w.remove(1);
        w.flush(true).unwrap();
        let good = w.len();
        w.insert(&k(7), 7, 7, 9);
        w.flush(true).unwrap();
        drop(w);
        // Tear the last record.
        let p = d.path().join(JOURNAL_FILE_NAME);
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.set_len(good + 10).unwrap();
        let r = recover(d.path(), U, 8, 1).unwrap();
        assert_eq!(r.index.len(), 3);
        assert!(r.index.is_valid(&k(0)) && !r.index.is_valid(&k(1)) && !r.index.is_valid(&k(7)));
        assert_eq!(r.journal_valid_len, Some(good));
        assert_eq!(r.cut_bytes, 10);
        assert_eq!(r.warnings.len(), 1);
        assert_eq!(r.next_generation, 5);
        // Compaction keeps the same state.
        let entries = r.index.entries_lru_first();
        write_checkpoint(d.path(), U, 2, r.next_generation, &entries).unwrap();
        JournalWriter::create(d.path(), U, 2).unwrap();
        let r2 = recover(d.path(), U, 8, 1).unwrap();
        assert_eq!(r2.index.entries_lru_first(), entries);
    }

    #[test]
    fn foreign_set_files_are_ignored() {
        let d = tempfile::tempdir_in("/tmp").unwrap();
        let r = recover(d.path(), [1; 16], 4, 1).unwrap();
        let (mut w, _) = open_journal(d.path(), [1; 16], &r).unwrap();
        w.insert(&k(1), 1, 1, 1);
        w.flush(true).unwrap();
        let r = recover(d.path(), U, 4, 1).unwrap();
        assert!(r.index.is_empty());
        assert_eq!(r.warnings.len(), 2);
        assert!(r.journal_valid_len.is_none());
    }
}
