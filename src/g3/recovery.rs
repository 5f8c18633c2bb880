//! Rebuilding the index from the checkpoints and journals at start-up (on the tier's worker
//! thread, while `lookup` answers RETRY; read-only, so `tier inspect` runs it beside a live
//! tier).
//!
//! The rule (`docs/format.md`, "Recovery"): the newest intact checkpoint, then every journal
//! of this stripe set that continues it or a later checkpoint, in sequence order. Damage costs
//! only what it covers and is never fatal:
//! * a damaged record is skipped and reading resumes at the next valid record;
//! * a damaged checkpoint falls back to the previous generation plus the journals since (its
//!   own readable records are used when that journal is gone);
//! * a damaged header does not drop the file's records (they are bound to the set by their
//!   CRC);
//! * a torn journal tail (no valid record after it) is cut off.
//!
//! Files with damage are named in [`Recovered::keep_damaged`] so that the tier keeps them for
//! inspection before it writes a fresh checkpoint of what was recovered. Every entry still
//! carries its data CRC, checked on every load, so recovery never yields wrong bytes.

use std::fs::File;
use std::time::{Duration, Instant, SystemTime};

use crate::error::{Error, ErrorKind, Result};
use crate::g3::checkpoint::rotate;
use crate::g3::format::read_at_most;
use crate::g3::index::Index;
use crate::g3::index_dir::{
    CHECKPOINT_FILE_NAME, CHECKPOINT_PREV_FILE_NAME, IndexDir, JOURNAL_FILE_NAME,
    JOURNAL_PREV_FILE_NAME,
};
use crate::g3::journal::JournalWriter;
use crate::g3::record::{
    CHECKPOINT_MAGIC, FILE_HEADER_SIZE, FileHeader, JOURNAL_MAGIC, MAX_SEQUENCE, RecordCodec,
    RecordRef, records,
};
use crate::g3::record_reader::{StreamEnd, stream_records};
use crate::io::MetaFile;

/// A damaged (or unusable) index file to keep for inspection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeepDamaged {
    /// Its name in the index directory.
    pub name: &'static str,
    /// Move it away (it is not used any more) rather than keep a linked copy (it stays in use
    /// as the previous generation).
    pub rename: bool,
    /// Which kind of file it is (for fault injection).
    pub file: MetaFile,
}

/// What recovery found.
#[derive(Debug)]
pub struct Recovered {
    /// The rebuilt index.
    pub index: Index,
    /// Next generation number to hand out.
    pub next_generation: u64,
    /// Sequence number of the checkpoint the index was rebuilt from (0 when none).
    pub checkpoint_seq: u64,
    /// Highest sequence number named by any index file (a new checkpoint takes the next).
    pub max_seq: u64,
    /// `Some(valid_len)` when the current journal continues the current checkpoint and can be
    /// appended to after cutting it at `valid_len`; `None` when a fresh checkpoint + journal
    /// must be written.
    pub append_at: Option<u64>,
    /// Damaged files to keep for inspection before the fresh checkpoint is written.
    pub keep_damaged: Vec<KeepDamaged>,
    /// Checkpoint entries plus journal records applied.
    pub records: u64,
    /// Bytes of the current journal's torn tail, cut off.
    pub cut_bytes: u64,
    /// Bytes of damage skipped (records lost to it), tails of other files included.
    pub skipped_bytes: u64,
    /// Warnings logged (damage found).
    pub warnings: Vec<String>,
    /// Time spent.
    pub duration: Duration,
    /// When the checkpoint used was written (its modification time).
    pub checkpoint_written: Option<SystemTime>,
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
    /// Applies the records of `chunk` (whole records, already checked).
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
                    if generation <= MAX_SEQUENCE {
                        self.max_gen = self.max_gen.max(generation);
                    }
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

/// One index file found in the directory.
struct Found {
    name: &'static str,
    file: File,
    /// `None` when the header is damaged (the records may still be readable).
    header: Option<FileHeader>,
    written: Option<SystemTime>,
}

impl Found {
    fn seq(&self) -> Option<u64> {
        self.header.map(|h| h.seq)
    }
}

/// Everything recovery accumulates while it reads.
struct Reader<'a> {
    dir: &'a IndexDir,
    codec: RecordCodec,
    set_uuid: [u8; 16],
    total_slots: u32,
    n_paths: usize,
    warnings: Vec<String>,
    keep: Vec<KeepDamaged>,
    max_seq: u64,
    skipped_bytes: u64,
}

impl Reader<'_> {
    fn warn(&mut self, w: String) {
        log::warn!("{w}");
        self.warnings.push(w);
    }

    fn keep(&mut self, name: &'static str, rename: bool, file: MetaFile) {
        if !self.keep.iter().any(|k| k.name == name) {
            self.keep.push(KeepDamaged { name, rename, file });
        }
    }

    fn fresh_index(&self) -> Index {
        Index::for_recovery(self.total_slots, self.n_paths)
    }

    /// Opens `name` and decodes its header. Files of another set or format version are set
    /// aside (kept, never read); a damaged header leaves `header: None`.
    fn find(
        &mut self,
        name: &'static str,
        magic: [u8; 8],
        kind: MetaFile,
    ) -> Result<Option<Found>> {
        let Some(file) = self.dir.open_read(name)? else {
            return Ok(None);
        };
        let path = self.dir.file_path(name);
        let shown = path.display().to_string();
        let mut buf = vec![0u8; FILE_HEADER_SIZE];
        let n = read_at_most(&file, &mut buf, 0).map_err(|e| Error::io("read", &path, e))?;
        let written = file.metadata().and_then(|m| m.modified()).ok();
        let header = match FileHeader::decode(&buf[..n], magic, &shown) {
            Ok(h) if h.set_uuid != self.set_uuid => {
                self.warn(format!(
                    "G3 index file {shown} belongs to stripe set {}, not {}; setting it aside",
                    hex::encode(h.set_uuid),
                    hex::encode(self.set_uuid)
                ));
                self.keep(name, true, kind);
                return Ok(None);
            }
            Ok(h) => {
                self.max_seq = self.max_seq.max(h.seq);
                Some(h)
            }
            Err(e) if e.kind() == ErrorKind::IncompatibleLayout => {
                self.warn(format!("{e}; setting it aside"));
                self.keep(name, true, kind);
                return Ok(None);
            }
            Err(_) if n == 0 => {
                // Every index file is written and fsynced under a temporary name before it is
                // renamed into place, so none is empty by a crash of kvtier: a filesystem lost
                // its data (a flush it did not perform), or the file was truncated by hand.
                // Whatever it held is gone; say so.
                self.warn(format!(
                    "G3 index file {shown} is empty (0 bytes; kvtier writes index files whole \
                     before they take this name): whatever it held is lost (a filesystem that \
                     lost its data in a crash, or a file truncated by hand); ignored"
                ));
                return Ok(None);
            }
            Err(e) => {
                self.warn(format!("{e}; reading its records without it"));
                None
            }
        };
        Ok(Some(Found {
            name,
            file,
            header,
            written,
        }))
    }

    /// The highest generation among the insert records of `f` (`None` when it has none): the
    /// evidence of its age when its header is damaged.
    fn newest_generation(&self, f: &Found) -> Result<Option<u64>> {
        let path = self.dir.file_path(f.name);
        let mut newest: Option<u64> = None;
        stream_records(&self.codec, &f.file, &path, FILE_HEADER_SIZE as u64, |c| {
            for r in records(c) {
                if let RecordRef::Insert { generation, .. } = r
                    && generation <= MAX_SEQUENCE
                {
                    newest = Some(newest.map_or(generation, |n| n.max(generation)));
                }
            }
        })?;
        Ok(newest)
    }

    /// Streams the records of `f` into `index`.
    fn stream(&self, f: &Found, index: &mut Index, replay: &mut Replay) -> Result<StreamEnd> {
        let path = self.dir.file_path(f.name);
        stream_records(&self.codec, &f.file, &path, FILE_HEADER_SIZE as u64, |c| {
            replay.apply(index, c)
        })
    }
}

/// The checkpoint recovery starts from, chosen by [`Reader::choose_base`].
struct Base {
    /// The index read from it (`None` when no checkpoint is intact).
    index: Option<Index>,
    /// What reading it applied.
    replay: Replay,
    /// Its position among the checkpoints (`None` when none is intact).
    at: Option<usize>,
    /// The positions of the damaged checkpoints.
    damaged: Vec<usize>,
}

/// What replaying the journals found, from [`Reader::replay_journals`].
struct JournalsReplayed {
    /// Bytes of the current journal's torn tail.
    cut_bytes: u64,
    /// Where the current journal's valid records end, when it was replayed last.
    append_at: Option<u64>,
    /// Whether any replayed journal was damaged (beyond a torn tail of the current one).
    damaged: bool,
}

impl Reader<'_> {
    /// Opens every index file of the directory: the checkpoints newest first (one whose
    /// header is damaged last), then the journals.
    fn find_all(&mut self) -> Result<(Vec<Found>, Vec<Found>)> {
        let mut ckpts = Vec::new();
        for name in [CHECKPOINT_FILE_NAME, CHECKPOINT_PREV_FILE_NAME] {
            ckpts.extend(self.find(name, CHECKPOINT_MAGIC, MetaFile::Checkpoint)?);
        }
        let mut journals = Vec::new();
        for name in [JOURNAL_FILE_NAME, JOURNAL_PREV_FILE_NAME] {
            journals.extend(self.find(name, JOURNAL_MAGIC, MetaFile::Journal)?);
        }
        // Newest first; a checkpoint whose header is damaged comes last.
        ckpts.sort_by_key(|c| std::cmp::Reverse(c.seq().map_or(0, |s| s + 1)));
        Ok((ckpts, journals))
    }

    /// The base: the newest intact checkpoint of `ckpts` (newest first). The damaged ones
    /// before it are named, kept and their damage counted.
    fn choose_base(&mut self, ckpts: &[Found]) -> Result<Base> {
        // (An index is allocated only for what is read into it: its slot table is written
        // whole when it is made, hundreds of MB for millions of slots.)
        let mut damaged = Vec::new();
        for (i, c) in ckpts.iter().enumerate() {
            let mut ix = self.fresh_index();
            let mut rp = Replay::default();
            let end = self.stream(c, &mut ix, &mut rp)?;
            let shown = self.dir.file_path(c.name).display().to_string();
            let problem = match (end.problem(), c.header) {
                (Some(p), _) => Some(p),
                (None, None) => Some("its header is damaged".to_string()),
                (None, Some(h)) if rp.records != h.count => Some(format!(
                    "it holds {} entries, its header says {}",
                    rp.records, h.count
                )),
                (None, Some(_)) => None,
            };
            let Some(p) = problem else {
                return Ok(Base {
                    index: Some(ix),
                    replay: rp,
                    at: Some(i),
                    damaged,
                });
            };
            self.skipped_bytes += end.skipped_bytes() + end.tail.map_or(0, |t| t.len());
            self.warn(format!(
                "G3 checkpoint {shown} is damaged ({p}); {} of its entries are readable",
                rp.records
            ));
            self.keep(c.name, true, MetaFile::Checkpoint);
            damaged.push(i);
        }
        Ok(Base {
            index: None,
            replay: Replay::default(),
            at: None,
            damaged,
        })
    }

    /// Drops the header of a previous journal that claims to be as new as the current one,
    /// and returns the current journal's sequence.
    ///
    /// The names give the journals' order: a checkpoint renames the current journal to
    /// `.prev` before the next one takes the name, so `.journal.prev` is always older than
    /// `.journal`. A header that says otherwise (a `seq` at or above the current journal's)
    /// is not trusted: the journal is placed by its name and its records' own generations,
    /// like a journal whose header is damaged.
    fn distrust_newer_prev_journal(&mut self, journals: &mut [Found]) -> Option<u64> {
        let current_seq = journals
            .iter()
            .find(|j| j.name == JOURNAL_FILE_NAME)
            .and_then(Found::seq);
        for j in journals
            .iter_mut()
            .filter(|j| j.name == JOURNAL_PREV_FILE_NAME)
        {
            if let (Some(p), Some(c)) = (j.seq(), current_seq)
                && p >= c
            {
                self.warn(format!(
                    "G3 journal {}: its header names checkpoint {p}, not older than the current \
                     journal's {c}: the header is wrong (the previous journal is always the \
                     older); placed by its name and its records instead",
                    self.dir.file_path(j.name).display()
                ));
                j.header = None;
            }
        }
        current_seq
    }

    /// The journals (oldest first) to replay onto a base that holds the checkpoint of
    /// sequence `from` and the generations below `base_generations`. A journal whose header
    /// is damaged is kept aside and placed by its name and its records' generations.
    fn select_journals<'f>(
        &mut self,
        journals: &'f [Found],
        from: u64,
        base_generations: Option<u64>,
        current_seq: Option<u64>,
    ) -> Result<Vec<&'f Found>> {
        let current_beyond_base = current_seq.is_some_and(|c| c > from)
            && journals
                .iter()
                .any(|j| j.name == JOURNAL_FILE_NAME && j.header.is_some());
        let mut use_journals: Vec<&Found> = Vec::new();
        for j in journals {
            let shown = self.dir.file_path(j.name).display().to_string();
            let replayed = match j.seq() {
                Some(s) => s >= from,
                None => {
                    // A damaged header: the file is kept aside, and its records' generations
                    // say whether the base already holds them.
                    self.keep(j.name, false, MetaFile::Journal);
                    let newest = self.newest_generation(j)?;
                    let replayed = match (base_generations, newest) {
                        (None, _) => true,
                        (Some(g), Some(n)) => n >= g,
                        // No insert to date it: the current journal is the newest file; the
                        // previous one continues the base only when the current one does not.
                        (Some(_), None) => j.name == JOURNAL_FILE_NAME || current_beyond_base,
                    };
                    self.warn(format!(
                        "G3 journal {shown} has a damaged header; {}",
                        damaged_header_verdict(replayed, newest)
                    ));
                    replayed
                }
            };
            if replayed {
                use_journals.push(j);
            } else if j.header.is_some() {
                log::info!(
                    "G3 journal {shown} continues checkpoint {} and predates checkpoint {from}; \
                     already folded in",
                    j.seq().unwrap_or(0)
                );
            }
        }
        Ok(use_journals)
    }

    /// Replays `journals` (oldest first) into `index`: damage is skipped and named, the torn
    /// tail of the current journal (when it is the last) is cut off.
    fn replay_journals(
        &mut self,
        journals: &[&Found],
        index: &mut Index,
        replay: &mut Replay,
        base_seq: Option<u64>,
        from: u64,
    ) -> Result<JournalsReplayed> {
        let mut out = JournalsReplayed {
            cut_bytes: 0,
            append_at: None,
            damaged: false,
        };
        let last = journals.len().saturating_sub(1);
        for (i, j) in journals.iter().enumerate() {
            let end = self.stream(j, index, replay)?;
            let shown = self.dir.file_path(j.name).display().to_string();
            let current = j.name == JOURNAL_FILE_NAME;
            if !end.skipped.is_empty() {
                out.damaged = true;
                self.skipped_bytes += end.skipped_bytes();
                self.warn(format!(
                    "G3 journal {shown} is damaged ({}); the records after the damage were \
                     replayed",
                    end.problem().unwrap_or_default()
                ));
                self.keep(j.name, false, MetaFile::Journal);
            }
            if let Some(t) = end.tail {
                if current && i == last {
                    out.cut_bytes = t.len();
                    self.warn(format!(
                        "G3 journal {shown}: {} at offset {}; cutting off the last {} bytes",
                        t.why,
                        t.start,
                        t.len()
                    ));
                } else {
                    out.damaged = true;
                    self.skipped_bytes += t.len();
                    self.warn(format!(
                        "G3 journal {shown}: its last {} bytes hold no valid record ({})",
                        t.len(),
                        t.why
                    ));
                    self.keep(j.name, false, MetaFile::Journal);
                }
            }
            if current && i == last {
                out.append_at = Some(end.valid_end);
            }
            if j.header.is_some() && j.seq() != base_seq && current && base_seq.is_some() {
                self.warn(format!(
                    "G3 journal {shown} continues checkpoint {} but checkpoint {from} was used; \
                     replayed (loads stay CRC-checked)",
                    j.seq().unwrap_or(0)
                ));
            }
        }
        Ok(out)
    }
}

/// What happened to a journal whose header is damaged, for its warning.
fn damaged_header_verdict(replayed: bool, newest: Option<u64>) -> String {
    match (replayed, newest) {
        (true, _) => "its records were replayed by its name and generations".to_string(),
        (false, Some(n)) => format!(
            "its newest insert (generation {n}) predates the checkpoint used: already folded \
             in, not replayed"
        ),
        (false, None) => {
            "it is older than the checkpoint used: already folded in, not replayed".to_string()
        }
    }
}

/// The damaged checkpoints (by position in `ckpts`, oldest first) whose readable records are
/// replayed onto the base: those newer than the base when no journal continues it (the
/// records between the base and them exist nowhere else); without an intact checkpoint, the
/// newest damaged one, as the base.
fn newer_damaged(
    ckpts: &[Found],
    base: &Base,
    base_seq: Option<u64>,
    continued: bool,
) -> Vec<usize> {
    let mut newer: Vec<usize> = base
        .damaged
        .iter()
        .copied()
        .filter(|&i| match (base_seq, ckpts[i].seq()) {
            (None, _) => true,
            (Some(b), Some(s)) => s > b,
            (Some(_), None) => true,
        })
        .collect();
    if base.at.is_some() && continued {
        newer.clear();
    } else if base.at.is_none() {
        // No intact checkpoint: the readable records of the newest damaged one are the base.
        newer.truncate(1);
    }
    newer.sort_by_key(|&i| ckpts[i].seq().map_or(u64::MAX, |s| s));
    newer
}

/// Rebuilds the index of the stripe set `set_uuid` from the files in `dir` (read-only).
pub fn recover(
    dir: &IndexDir,
    set_uuid: [u8; 16],
    total_slots: u32,
    n_paths: usize,
) -> Result<Recovered> {
    let start = Instant::now();
    let mut rd = Reader {
        dir,
        codec: RecordCodec::new(set_uuid),
        set_uuid,
        total_slots,
        n_paths,
        warnings: Vec::new(),
        keep: Vec::new(),
        max_seq: 0,
        skipped_bytes: 0,
    };
    let (ckpts, mut journals) = rd.find_all()?;
    let base = rd.choose_base(&ckpts)?;
    let base_seq = base.at.and_then(|b| ckpts[b].seq());
    let current_seq = rd.distrust_newer_prev_journal(&mut journals);
    journals.sort_by_key(|j| u8::from(j.name == JOURNAL_FILE_NAME));
    let continued = journals.iter().any(|j| j.seq() == base_seq);
    let newer_damaged = newer_damaged(&ckpts, &base, base_seq, continued);
    // Journals continuing the base (or a later checkpoint), oldest first. Without an intact
    // checkpoint, the damaged one used as the base decides (when its header is readable).
    let from = base_seq
        .or_else(|| newer_damaged.first().and_then(|&i| ckpts[i].seq()))
        .unwrap_or(0);
    let base_header = base.at.and_then(|b| ckpts[b].header);
    let mut index = base.index.unwrap_or_else(|| rd.fresh_index());
    let mut replay = base.replay;
    for &i in &newer_damaged {
        rd.stream(&ckpts[i], &mut index, &mut replay)?;
        rd.warn(format!(
            "G3 checkpoint {}: its readable entries were used",
            rd.dir.file_path(ckpts[i].name).display()
        ));
    }
    // Generations below this are in the base: every insert made before a checkpoint has a
    // generation below its `next_generation`, every insert after it one at or above.
    let base_generations = match base_header {
        Some(h) => Some(h.next_generation),
        None if replay.records > 0 => Some(replay.max_gen.saturating_add(1)),
        None => None,
    };
    let use_journals = rd.select_journals(&journals, from, base_generations, current_seq)?;
    if let Some(b) = base.at
        && !base.damaged.is_empty()
    {
        rd.warn(format!(
            "G3 index rebuilt from the previous generation {} (seq {}) and the journals since",
            rd.dir.file_path(ckpts[b].name).display(),
            base_seq.unwrap_or(0)
        ));
    }
    let replayed = rd.replay_journals(&use_journals, &mut index, &mut replay, base_seq, from)?;
    // The current journal is appended to only when nothing needs rewriting: it continues the
    // current checkpoint, intact, and no other file was damaged.
    let current_ckpt = base
        .at
        .is_some_and(|b| ckpts[b].name == CHECKPOINT_FILE_NAME);
    let current_journal_continues = use_journals
        .last()
        .is_some_and(|j| j.name == JOURNAL_FILE_NAME && j.header.is_some() && j.seq() == base_seq);
    let clean = rd.keep.is_empty() && base.damaged.is_empty() && !replayed.damaged;
    let append_at = replayed
        .append_at
        .filter(|_| clean && current_ckpt && current_journal_continues && use_journals.len() == 1);
    if replay.out_of_range > 0 {
        rd.warn(format!(
            "{} G3 index records named slots beyond {total_slots}; ignored",
            replay.out_of_range
        ));
    }
    index.finish_recovery();
    let header_gen = base_header.map_or(1, |h| h.next_generation);
    Ok(Recovered {
        index,
        next_generation: header_gen.max(replay.max_gen.saturating_add(1)).max(1),
        checkpoint_seq: base_seq.unwrap_or(0),
        max_seq: rd.max_seq,
        append_at,
        keep_damaged: rd.keep,
        records: replay.records,
        cut_bytes: replayed.cut_bytes,
        skipped_bytes: rd.skipped_bytes,
        warnings: rd.warnings,
        duration: start.elapsed(),
        checkpoint_written: base.at.and_then(|b| ckpts[b].written),
    })
}

/// Opens the journal for appending after [`recover`]: keeps the damaged files aside, then
/// continues the current journal when possible, else writes a fresh checkpoint of the
/// recovered index and a fresh journal. Returns the writer and the checkpoint sequence it
/// continues.
pub fn open_journal(
    dir: &IndexDir,
    set_uuid: [u8; 16],
    rec: &Recovered,
) -> Result<(JournalWriter, u64)> {
    for k in &rec.keep_damaged {
        dir.keep_damaged(k.name, k.rename, k.file)?;
    }
    if let Some(len) = rec.append_at {
        return Ok((
            JournalWriter::open_at(dir, set_uuid, len)?,
            rec.checkpoint_seq,
        ));
    }
    let seq = rec.max_seq.checked_add(1).ok_or_else(|| {
        Error::new(
            ErrorKind::Corrupt,
            "G3 checkpoint sequence numbers are exhausted",
        )
    })?;
    let w = rotate(
        dir,
        set_uuid,
        seq,
        rec.next_generation,
        &rec.index.entries_lru_first(),
    )
    .map_err(|e| e.error)?;
    Ok((w, seq))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::g3::checkpoint::encode_checkpoint;
    use crate::key::ChunkKey;

    const U: [u8; 16] = [9; 16];

    fn k(i: u32) -> ChunkKey {
        ChunkKey::new(i.to_le_bytes())
    }

    fn dir(d: &tempfile::TempDir) -> IndexDir {
        IndexDir::open(d.path()).unwrap()
    }

    #[test]
    fn empty_dir_recovers_empty_and_writes_fresh_files() {
        let d = tempfile::tempdir_in("/tmp").unwrap();
        let r = recover(&dir(&d), U, 8, 2).unwrap();
        assert!(r.index.is_empty() && r.append_at.is_none());
        let (_w, seq) = open_journal(&dir(&d), U, &r).unwrap();
        assert_eq!(seq, 1);
        let r2 = recover(&dir(&d), U, 8, 2).unwrap();
        assert_eq!(r2.checkpoint_seq, 1);
        assert_eq!(r2.append_at, Some(FILE_HEADER_SIZE as u64));
        assert!(r2.warnings.is_empty(), "{:?}", r2.warnings);
    }

    #[test]
    fn checkpoint_plus_journal_with_torn_tail() {
        let d = tempfile::tempdir_in("/tmp").unwrap();
        let r = recover(&dir(&d), U, 8, 1).unwrap();
        let (mut w, _) = open_journal(&dir(&d), U, &r).unwrap();
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
        let r = recover(&dir(&d), U, 8, 1).unwrap();
        assert_eq!(r.index.len(), 3);
        assert!(r.index.is_valid(&k(0)) && !r.index.is_valid(&k(1)) && !r.index.is_valid(&k(7)));
        assert_eq!(r.append_at, Some(good));
        assert_eq!(r.cut_bytes, 10);
        assert_eq!(r.warnings.len(), 1, "{:?}", r.warnings);
        assert_eq!(r.next_generation, 5);
        // Compaction keeps the same state.
        let entries = r.index.entries_lru_first();
        rotate(&dir(&d), U, 2, r.next_generation, &entries).unwrap();
        let r2 = recover(&dir(&d), U, 8, 1).unwrap();
        assert_eq!(r2.index.entries_lru_first(), entries);
        assert!(r2.warnings.is_empty(), "{:?}", r2.warnings);
    }

    #[test]
    fn foreign_set_files_are_set_aside() {
        let d = tempfile::tempdir_in("/tmp").unwrap();
        let r = recover(&dir(&d), [1; 16], 4, 1).unwrap();
        let (mut w, _) = open_journal(&dir(&d), [1; 16], &r).unwrap();
        w.insert(&k(1), 1, 1, 1);
        w.flush(true).unwrap();
        let r = recover(&dir(&d), U, 4, 1).unwrap();
        assert!(r.index.is_empty());
        assert_eq!(r.warnings.len(), 2, "{:?}", r.warnings);
        assert!(r.append_at.is_none());
        assert_eq!(r.keep_damaged.len(), 2);
    }

    #[test]
    fn a_journal_continuing_an_older_checkpoint_is_folded_in_not_replayed_twice() {
        // The state a crash leaves between the checkpoint's rename and the journal's.
        let d = tempfile::tempdir_in("/tmp").unwrap();
        let r = recover(&dir(&d), U, 8, 1).unwrap();
        let (mut w, _) = open_journal(&dir(&d), U, &r).unwrap();
        w.insert(&k(1), 1, 1, 1);
        w.insert(&k(2), 2, 2, 2);
        w.remove(1);
        w.flush(true).unwrap();
        let r = recover(&dir(&d), U, 8, 1).unwrap();
        let entries = r.index.entries_lru_first();
        let bytes = encode_checkpoint(U, 2, 3, &entries);
        std::fs::write(d.path().join(CHECKPOINT_FILE_NAME), bytes).unwrap();
        let r = recover(&dir(&d), U, 8, 1).unwrap();
        assert_eq!(r.index.entries_lru_first(), entries);
        assert_eq!(r.checkpoint_seq, 2);
        assert!(
            r.append_at.is_none(),
            "the journal must be rotated, not continued"
        );
    }
}
