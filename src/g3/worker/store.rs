//! The store half of the worker: reserving slots (evicting, journaled first), CRC before the
//! write, durability and journaling after it.

use std::collections::{BTreeSet, HashSet};
use std::sync::atomic::Ordering;

use parking_lot::Mutex;

use super::{Active, KeyStatus, Worker};
use crate::error::{Error, ErrorKind};
use crate::g3::config::FsyncPolicy;
use crate::g3::index::Index;
use crate::g3::record::{MAX_KEY_LEN, chunk_crc};
use crate::io::{IoDir, IoRequest};
use crate::key::ChunkKey;

/// When the removal records of the slots a store job evicts are written to the journal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum EvictionFlush {
    /// Before `prepare_store` returns (a grant: another data path overwrites the slots as soon
    /// as it has them).
    Now,
    /// Once for every job started in the same `pump`, before any of their writes is
    /// submitted (`Worker::flush_evictions`); the caller records the job.
    BeforeSubmit,
}

impl Worker {
    /// Reserves a slot per key (evicting where needed) and journals the evictions, now or
    /// before the next submission (`flush`). Returns whether the job evicted any slot.
    pub(super) fn prepare_store(&mut self, a: &mut Active, flush: EvictionFlush) -> bool {
        let refusal = self.store_refusal();
        let mut evicted = Vec::new();
        {
            let mut guard = self.sh.index.lock();
            let Some(ix) = guard.as_mut() else {
                return false;
            };
            let mut seen = HashSet::new();
            for i in 0..a.keys.len() {
                let key = &a.keys[i];
                if ix.is_held(key) || !seen.insert(key.clone()) {
                    a.skip(i, &self.sh.metrics.stores_skipped);
                    continue;
                }
                if let Some(e) = &refusal {
                    self.sh
                        .metrics
                        .stores_refused
                        .fetch_add(1, Ordering::Relaxed);
                    a.fail(i, e.duplicate());
                    continue;
                }
                if key.len() > MAX_KEY_LEN {
                    a.fail(
                        i,
                        Error::new(
                            ErrorKind::Config,
                            format!("key of {} bytes is longer than {MAX_KEY_LEN}", key.len()),
                        ),
                    );
                    continue;
                }
                if a.tier.grant.is_none()
                    && let Err(e) = self.check_row(a.rows[i])
                {
                    a.fail(i, e);
                    continue;
                }
                match ix.reserve(key) {
                    Some(r) => {
                        a.tier.slots[i] = Some((r.slot, 0));
                        if let Some(ev) = r.evicted {
                            evicted.push(ev);
                        }
                    }
                    None => a.fail(
                        i,
                        Error::new(
                            ErrorKind::NoSpace,
                            "no G3 slot can be reused now (all busy or on poisoned paths)",
                        ),
                    ),
                }
            }
            self.refresh_slot_gauges(ix);
        }
        if evicted.is_empty() {
            return false;
        }
        self.sh
            .metrics
            .evictions
            .fetch_add(evicted.len() as u64, Ordering::Relaxed);
        let keys: Vec<ChunkKey> = evicted.iter().map(|(k, _)| k.clone()).collect();
        self.event(keys, true);
        // An eviction is journaled (and, under fsync = always, made durable) before the slot
        // is overwritten: the records are appended now and written now or before the job's
        // writes are submitted.
        match self.journal.as_mut() {
            Some(j) => evicted.iter().for_each(|(_, s)| j.remove(*s)),
            None => {
                let e = Error::new(ErrorKind::Closed, "G3 journal is not open");
                fail_reserved(&self.sh.index, a, &e);
                return true;
            }
        }
        if flush == EvictionFlush::Now
            && let Err(e) = self.write_journal()
        {
            fail_reserved(&self.sh.index, a, &e);
        }
        // The rows' CRCs are computed once their writes are submitted
        // (`checksum_submitted_writes`), so that hashing overlaps the device's work.
        true
    }

    /// Writes the journal's appended records (under `fsync = always` durably).
    fn write_journal(&mut self) -> crate::error::Result<()> {
        let sync = self.cfg.fsync == FsyncPolicy::Always;
        let res = match self.journal.as_mut() {
            Some(j) => j.flush(sync),
            None => Err(Error::new(ErrorKind::Closed, "G3 journal is not open")),
        };
        self.note_journal_len();
        if res.is_err() {
            self.publish_journal_state();
        }
        res
    }

    /// Writes the eviction records of the store jobs started since the last submission
    /// (`EvictionFlush::BeforeSubmit`) in one journal write. When it fails, those jobs' keys
    /// fail and their slots are released, and their writes are never submitted: they leave
    /// `batch` (taken from the queue, charged to the budget) and the queue.
    pub(super) fn flush_evictions(&mut self, batch: &mut Vec<IoRequest>) {
        if self.evicting.is_empty() {
            return;
        }
        let serials = std::mem::take(&mut self.evicting);
        let Err(e) = self.write_journal() else {
            return;
        };
        for serial in &serials {
            if let Some(a) = self.active.get_mut(serial) {
                fail_reserved(&self.sh.index, a, &e);
            }
        }
        let active = &self.active;
        let failed = |op: &IoRequest| {
            let (serial, i) = crate::io::split_job_tag(op.tag);
            serials.contains(&serial)
                && active
                    .get(&serial)
                    .is_some_and(|a| a.status.get(i) == Some(&KeyStatus::Failed))
        };
        let (dropped, kept): (Vec<IoRequest>, Vec<IoRequest>) =
            std::mem::take(batch).into_iter().partition(|op| failed(op));
        *batch = kept;
        let waiting = self.jobs.take_units(|op| failed(op));
        self.drop_unsent(dropped.iter().map(|op| op.tag), true);
        self.drop_unsent(waiting.iter().map(|op| op.tag), false);
    }

    /// [`chunk_crc`] (key, then row) of the rows whose writes were just submitted, computed
    /// while those writes are in flight. The manager pins a store job's rows (nobody writes them) until the job is
    /// reported, so this is the CRC of the bytes being written; it reaches the journal and
    /// the index only after the write completed (`flush_commits`).
    pub(super) fn checksum_submitted_writes(&mut self, batch: &[IoRequest]) {
        let region = self.engine.region();
        let slot_bytes = self.set.row_stride() as usize;
        // A staged write is checksummed by the engine in the same pass as its copy (the CRC
        // comes with its completion, see `Worker::complete`).
        for op in batch
            .iter()
            .filter(|op| op.dir == IoDir::Write && !self.engine.stages(op.len))
        {
            let (serial, i) = crate::io::split_job_tag(op.tag);
            let Some(a) = self.active.get_mut(&serial) else {
                continue;
            };
            let (Some(&row), Some(Some((slot_id, _)))) =
                (a.rows.get(i), a.tier.slots.get(i).copied())
            else {
                continue;
            };
            // The row is pinned (no writer) until the job is reported, and was
            // range-checked in `prepare_store`; O_DIRECT only reads it meanwhile.
            match region.read_row(row as usize) {
                Ok(bytes) => {
                    let stored = &bytes[..slot_bytes.min(bytes.len())];
                    a.tier.slots[i] = Some((slot_id, chunk_crc(a.keys[i].as_bytes(), stored)))
                }
                // Unreachable after the range check; the key fails rather than journaling
                // a CRC that was never computed.
                Err(e) => a.fail(i, e),
            }
        }
    }

    /// A store job's writes have all completed (their failures fenced their paths as they
    /// completed, see `Worker::complete`): queue the job for the next group commit.
    pub(super) fn finish_store(&mut self, a: Active) {
        self.commits.push(a);
    }

    /// Group commit of every finished store job: under `fsync = always` one fdatasync per
    /// slab written (data durable before the journal names it) and a check that every slab
    /// and the index directory are still the ones a restart will find (each time under
    /// `fsync = always`, else at most every second), then one journal append (and fdatasync),
    /// then the index commit, the events and the results. A key whose slab failed any of it
    /// is failed, never reported stored.
    pub(super) fn flush_commits(&mut self) {
        if self.commits.is_empty() {
            return;
        }
        let mut jobs = std::mem::take(&mut self.commits);
        let n_paths = self.set.files.len();
        let sync = self.cfg.fsync == FsyncPolicy::Always;
        let lost = self.lost_paths(&jobs, sync);
        for (f, e) in &lost {
            for a in jobs.iter_mut() {
                for i in 0..a.keys.len() {
                    if a.status[i] == KeyStatus::Done && path_of(a, i, n_paths) == Some(*f) {
                        a.fail(i, e.duplicate());
                    }
                }
            }
        }
        // (The journal bound and the paths were checked when the jobs started; records of
        // writes already done may go past the bound.)
        let refusal = self.journal_refusal();
        // One append for the whole group.
        let mut gens: Vec<Vec<u64>> = jobs.iter().map(|a| vec![0; a.keys.len()]).collect();
        let any_done = jobs.iter().any(|a| a.status.contains(&KeyStatus::Done));
        let journal_err = match (any_done, refusal, self.journal.as_mut()) {
            (false, _, _) => None,
            (true, Some(e), _) => Some(e),
            (true, None, Some(j)) => {
                for (a, g) in jobs.iter().zip(gens.iter_mut()) {
                    for (i, gen_i) in g.iter_mut().enumerate() {
                        if let (KeyStatus::Done, Some((slot, crc))) = (a.status[i], a.tier.slots[i])
                        {
                            *gen_i = self.dur.next_gen;
                            j.insert(&a.keys[i], slot, crc, self.dur.next_gen);
                            self.dur.next_gen = self.dur.next_gen.saturating_add(1);
                        }
                    }
                }
                j.flush(sync).err()
            }
            (true, None, None) => Some(Error::new(ErrorKind::Closed, "G3 journal is not open")),
        };
        self.note_journal_len();
        if let Some(e) = &journal_err {
            self.publish_journal_state();
            for a in jobs.iter_mut() {
                for i in 0..a.keys.len() {
                    if a.status[i] == KeyStatus::Done {
                        a.fail(i, e.duplicate());
                    }
                }
            }
        }
        // Statuses are final: Done keys become loadable, failed reservations are released.
        let mut stored: Vec<Vec<ChunkKey>> = Vec::with_capacity(jobs.len());
        {
            let mut guard = self.sh.index.lock();
            for (a, g) in jobs.iter().zip(&gens) {
                let mut keys = Vec::new();
                if let Some(ix) = guard.as_mut() {
                    for (i, &gen_i) in g.iter().enumerate() {
                        match (a.status[i], a.tier.slots[i]) {
                            (KeyStatus::Done, Some((slot, crc))) => {
                                ix.commit(slot, crc, gen_i);
                                keys.push(a.keys[i].clone());
                            }
                            (KeyStatus::Failed, Some((slot, _))) => ix.abort(slot),
                            _ => {}
                        }
                    }
                }
                stored.push(keys);
            }
            if let Some(ix) = guard.as_ref() {
                self.refresh_slot_gauges(ix);
            }
        }
        for (a, keys) in jobs.into_iter().zip(stored) {
            let m = &self.sh.metrics;
            m.keys_stored
                .fetch_add(keys.len() as u64, Ordering::Relaxed);
            let failed = a.count(KeyStatus::Failed);
            m.key_failures.fetch_add(failed as u64, Ordering::Relaxed);
            if !keys.is_empty() {
                self.event(keys, false);
            }
            self.report(a, None);
        }
        self.maybe_checkpoint();
    }

    /// The paths whose keys of the group `jobs` must fail, each with why: a slab that a
    /// restart would not find, a path fenced since these writes were issued, or (under
    /// `fsync = always`, `sync`) a slab whose fdatasync failed (it is fenced).
    fn lost_paths(&mut self, jobs: &[Active], sync: bool) -> Vec<(usize, Error)> {
        let n_paths = self.set.files.len();
        // Paths whose keys of this group must fail: a slab that a restart would not find, or
        // (below) whose sync failed.
        let mut lost: Vec<(usize, Error)> = if sync {
            self.check_files()
        } else {
            self.check_files_now_and_then()
        };
        // A path fenced since these writes were issued (another write there failed) holds no
        // entry any more: its keys fail too.
        for (f, p) in self.sh.paths.iter().enumerate() {
            let why = p.lost.lock().clone().or_else(|| {
                p.poisoned
                    .load(Ordering::Relaxed)
                    .then(|| p.problem.lock().clone().unwrap_or_default())
            });
            if let Some(why) = why
                && !lost.iter().any(|(l, _)| *l == f)
            {
                lost.push((
                    f,
                    Error::new(
                        ErrorKind::Poisoned,
                        format!("G3 path {f} was taken out of service: {why}"),
                    ),
                ));
            }
        }
        if sync {
            let touched: BTreeSet<usize> = jobs
                .iter()
                .flat_map(|a| {
                    (0..a.keys.len())
                        .filter(|&i| a.status[i] == KeyStatus::Done)
                        .filter_map(|i| path_of(a, i, n_paths))
                })
                .collect();
            for f in touched {
                if lost.iter().any(|(l, _)| *l == f) {
                    continue;
                }
                if let Err(e) = self.engine.sync_data(f) {
                    self.poison_path(f, &e);
                    lost.push((f, e));
                }
            }
        }
        lost
    }
}

/// The path holding key `i`'s slot, of `n_paths`.
fn path_of(a: &Active, i: usize, n_paths: usize) -> Option<usize> {
    a.tier.slots[i].map(|(s, _)| s as usize % n_paths)
}

/// Fails every key of `a` that holds a reserved slot in `index` and has not moved yet,
/// releasing the slot (its eviction could not be journaled, so it must not be overwritten).
fn fail_reserved(index: &Mutex<Option<Index>>, a: &mut Active, e: &Error) {
    let mut guard = index.lock();
    for i in 0..a.keys.len() {
        if let (KeyStatus::Pending, Some((slot, _))) = (a.status[i], a.tier.slots[i]) {
            if let Some(ix) = guard.as_mut() {
                ix.abort(slot);
            }
            a.tier.slots[i] = None;
            a.fail(i, e.duplicate());
        }
    }
}
