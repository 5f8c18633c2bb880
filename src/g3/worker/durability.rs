//! The worker's durability work: index recovery at start, checkpoints (with backoff while
//! they fail), the checks that the files written are still the ones a restart will find, the
//! journal bound, and the final checkpoint at close.
//!
//! The rule behind all of it: a store is acknowledged only when a restart will find it. So
//! stores are refused (visibly: `g3_stores_refused`, `g3_journal_healthy`, `/healthz`) while
//! * the journal is poisoned (a failed append or sync), or not open (a checkpoint put a new
//!   checkpoint in place but not its journal, or the start-up checkpoint failed);
//! * the journal has grown past `max_journal_bytes` because checkpoints keep failing;
//! * the index directory no longer is what its path leads to (lazy unmount, replaced dir);
//! * every slab path is poisoned.
//!
//! A failed checkpoint is retried after 100 ms, then with a doubling delay up to 5 s, also
//! with no new work (the worker's timer), and its success is logged; the log is rate-limited
//! while it keeps failing.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime};

use super::Worker;
use crate::error::{Error, ErrorKind, Result};
use crate::g3::checkpoint::{RotateError, rotate};
use crate::g3::index_dir::IndexDir;
use crate::g3::metrics::JournalState;
use crate::g3::recovery::{self, KeepDamaged};

/// First delay before a failed checkpoint is retried.
const RETRY_MIN: Duration = Duration::from_millis(100);
/// Longest delay between retries of a failing checkpoint.
const RETRY_MAX: Duration = Duration::from_secs(5);
/// While checkpoints keep failing, at most one log line per this period (the rest at debug).
const FAILURE_LOG_EVERY: Duration = Duration::from_secs(30);
/// How often the slab and index files are checked to still be the ones their paths name,
/// when no commit with `fsync = always` (which checks every time) has done it.
const FILE_CHECK_EVERY: Duration = Duration::from_secs(1);

/// The worker's checkpoint bookkeeping.
#[derive(Debug)]
pub(super) struct Durability {
    /// The open index directory (`None` before recovery, or when it failed).
    pub dir: Option<IndexDir>,
    /// Sequence number of the checkpoint the current journal continues.
    pub seq: u64,
    /// Highest sequence number used or seen; the next checkpoint takes the one after.
    pub max_seq: u64,
    /// Next generation number to hand out.
    pub next_gen: u64,
    /// When a checkpoint was last attempted (start of the interval).
    pub last_attempt: Instant,
    /// Consecutive failed checkpoints, and when the first of them failed.
    pub failures: u32,
    pub failing_since: Option<Instant>,
    /// No attempt before this (backoff).
    pub retry_at: Option<Instant>,
    last_log: Option<Instant>,
    quiet_failures: u64,
    /// Damaged files still to be kept aside before the next checkpoint.
    pub keep_damaged: Vec<KeepDamaged>,
    /// Why the index directory cannot take writes any more (sticky).
    pub dir_lost: Option<String>,
    /// When the paths were last checked.
    pub last_file_check: Instant,
}

impl Default for Durability {
    fn default() -> Self {
        Durability {
            dir: None,
            seq: 0,
            max_seq: 0,
            next_gen: 1,
            last_attempt: Instant::now(),
            failures: 0,
            failing_since: None,
            retry_at: None,
            last_log: None,
            quiet_failures: 0,
            keep_damaged: Vec::new(),
            dir_lost: None,
            last_file_check: Instant::now(),
        }
    }
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Worker {
    pub(super) fn recover(&mut self) -> Result<()> {
        let total = u32::try_from(self.set.total_slots()).map_err(|_| {
            Error::new(
                ErrorKind::Config,
                "more than 2^32 - 1 slots in one stripe set",
            )
        })?;
        let dir = IndexDir::open(self.set.meta_dir())?;
        // Tests inject metadata faults through the engine's hook.
        #[cfg(any(test, feature = "test-support"))]
        let dir = dir.with_faults(self.engine.clone());
        let uuid = self.set.set_uuid();
        let rec = recovery::recover(&dir, uuid, total, self.set.files.len())?;
        let m = &self.sh.metrics;
        m.recovery_micros
            .store(rec.duration.as_micros() as u64, Ordering::Relaxed);
        m.recovery_records.store(rec.records, Ordering::Relaxed);
        m.recovery_cut_bytes.store(rec.cut_bytes, Ordering::Relaxed);
        m.recovery_skipped_bytes
            .store(rec.skipped_bytes, Ordering::Relaxed);
        m.recovery_damaged_files
            .store(rec.keep_damaged.len() as u64, Ordering::Relaxed);
        if let Some(t) = rec.checkpoint_written {
            m.last_checkpoint_unix_ms
                .store(unix_ms(t), Ordering::Relaxed);
        }
        log::info!(
            "G3 tier {}: recovered {} entries ({} records) in {:?}",
            self.tier_id,
            rec.index.len(),
            rec.records,
            rec.duration
        );
        let d = &mut self.dur;
        d.max_seq = rec.max_seq;
        d.seq = rec.checkpoint_seq;
        d.next_gen = rec.next_generation;
        d.last_attempt = Instant::now();
        let opened = recovery::open_journal(&dir, uuid, &rec);
        d.dir = Some(dir);
        match opened {
            Ok((journal, seq)) => {
                d.seq = seq;
                d.max_seq = d.max_seq.max(seq);
                if rec.append_at.is_none() {
                    self.sh
                        .metrics
                        .last_checkpoint_unix_ms
                        .store(unix_ms(SystemTime::now()), Ordering::Relaxed);
                }
                self.journal = Some(journal);
            }
            Err(e) => {
                // The recovered index serves loads; stores wait for a checkpoint.
                d.keep_damaged = rec.keep_damaged.clone();
                d.max_seq = d.max_seq.saturating_add(1);
                self.checkpoint_failed(&e);
            }
        }
        let mut index = rec.index;
        for (i, p) in self.sh.paths.iter().enumerate() {
            if p.poisoned.load(Ordering::Relaxed) {
                index.mark_path_dead(i);
            }
        }
        // ARC starts from the recovered LRU order (its ghosts are not persisted).
        index.set_eviction_policy(self.cfg.eviction_policy);
        self.refresh_slot_gauges(&index);
        *self.sh.index.lock() = Some(index);
        self.publish_journal_state();
        Ok(())
    }

    /// Why new stores must be refused now, if they must (see the module docs).
    pub(super) fn store_refusal(&self) -> Option<Error> {
        if let Some(e) = self.journal_refusal() {
            return Some(e);
        }
        let refuse = |kind, why: String| {
            Some(Error::new(
                kind,
                format!("G3 tier {} refuses stores: {why}", self.tier_id),
            ))
        };
        if let Some(j) = &self.journal
            && j.len() >= self.cfg.max_journal_bytes
        {
            return refuse(
                ErrorKind::NoSpace,
                format!(
                    "the journal holds {} bytes, at max_journal_bytes = {}, because \
                     checkpoints fail ({}); stores resume once one succeeds",
                    j.len(),
                    self.cfg.max_journal_bytes,
                    self.last_checkpoint_error()
                ),
            );
        }
        if self
            .sh
            .paths
            .iter()
            .all(|p| p.poisoned.load(Ordering::Relaxed))
        {
            return refuse(
                ErrorKind::Poisoned,
                "every slab path is poisoned by an earlier failure".into(),
            );
        }
        None
    }

    /// Why nothing can be journaled now, if so: records appended now would not be found by a
    /// restart, or cannot be appended at all.
    pub(super) fn journal_refusal(&self) -> Option<Error> {
        let refuse = |kind, why: String| {
            Some(Error::new(
                kind,
                format!("G3 tier {} refuses stores: {why}", self.tier_id),
            ))
        };
        if let Some(why) = &self.dur.dir_lost {
            return refuse(ErrorKind::Poisoned, why.clone());
        }
        match &self.journal {
            None => {
                return refuse(
                    ErrorKind::Poisoned,
                    format!(
                        "the index journal is not open ({}); stores resume once a checkpoint \
                         succeeds",
                        self.last_checkpoint_error()
                    ),
                );
            }
            Some(j) => {
                if let Some(why) = j.poisoned() {
                    return refuse(
                        ErrorKind::Poisoned,
                        format!("{why}; stores resume once a checkpoint succeeds"),
                    );
                }
            }
        }
        None
    }

    fn last_checkpoint_error(&self) -> String {
        self.sh
            .checkpoint_error
            .lock()
            .clone()
            .unwrap_or_else(|| "no checkpoint failed".into())
    }

    /// Publishes the journal's length (after an append), and its state when that changed.
    pub(super) fn note_journal_len(&self) {
        let len = self.journal.as_ref().map_or(0, |j| j.len());
        self.sh.metrics.journal_bytes.store(len, Ordering::Relaxed);
        if self.journal_state() != self.published_journal_state() {
            self.publish_journal_state();
        }
    }

    fn journal_state(&self) -> JournalState {
        if self.dur.dir_lost.is_some() {
            return JournalState::DirectoryLost;
        }
        match &self.journal {
            None => JournalState::NotOpen,
            Some(j) if j.poisoned().is_some() => JournalState::Poisoned,
            Some(j) if j.len() >= self.cfg.max_journal_bytes => JournalState::Full,
            Some(_) => JournalState::Healthy,
        }
    }

    fn published_journal_state(&self) -> JournalState {
        JournalState::from_u8(self.sh.metrics.journal_state.load(Ordering::Relaxed))
    }

    /// Publishes the journal's state to the metrics (`g3_journal_healthy`,
    /// `g3_journal_info{state}`) and health, and logs each change of state.
    pub(super) fn publish_journal_state(&self) {
        let m = &self.sh.metrics;
        let len = self.journal.as_ref().map_or(0, |j| j.len());
        m.journal_bytes.store(len, Ordering::Relaxed);
        let problem = match &self.journal {
            None => Some("the index journal is not open".to_string()),
            Some(j) => j.poisoned().map(str::to_string),
        };
        let problem = self.dur.dir_lost.clone().or(problem);
        m.journal_poisoned
            .store(problem.is_some(), Ordering::Relaxed);
        let state = self.journal_state();
        let before = self.published_journal_state();
        m.journal_state.store(state as u8, Ordering::Relaxed);
        if state != before {
            match state {
                JournalState::Healthy => log::warn!(
                    "G3 tier {}: the index journal is healthy again (was {}); stores are accepted",
                    self.tier_id,
                    before.as_str()
                ),
                JournalState::Full => log::error!(
                    "G3 tier {}: the index journal is full ({len} bytes, max_journal_bytes = \
                     {}) because checkpoints fail ({}); stores are refused until one succeeds",
                    self.tier_id,
                    self.cfg.max_journal_bytes,
                    self.last_checkpoint_error()
                ),
                _ => log::error!(
                    "G3 tier {}: the index journal is {}: {}; stores are refused until a \
                     checkpoint replaces it (retried with backoff)",
                    self.tier_id,
                    state.as_str(),
                    problem.as_deref().unwrap_or("")
                ),
            }
        }
        *self.sh.journal_problem.lock() = problem;
    }

    /// Checks that every healthy slab, and the index directory, are still what their paths
    /// name: a slab deleted, renamed or replaced, or a directory unmounted (also lazily) or
    /// replaced, would not be found by a restart. A path that fails is poisoned; a lost index
    /// directory stops every store.
    /// Returns the paths found lost now, with the reason.
    pub(super) fn check_files(&mut self) -> Vec<(usize, Error)> {
        self.dur.last_file_check = Instant::now();
        let mut lost = Vec::new();
        for i in 0..self.set.files.len() {
            if self.sh.paths[i].lost.lock().is_some() {
                continue;
            }
            if let Err(e) = self.set.files[i].check_identity() {
                *self.sh.paths[i].lost.lock() = Some(e.to_string());
                // Not fenced: the slab may well be found again (a filesystem unmounted
                // under the tier is mounted again), so no removal is journaled; its
                // entries stay loadable from the open file.
                self.stop_writes_on(i, &e);
                lost.push((i, e));
            }
        }
        if self.dur.dir_lost.is_none()
            && let Some(dir) = &self.dur.dir
            && let Err(e) = dir.check_identity()
        {
            log::error!("G3 tier {}: {e}; stores are refused", self.tier_id);
            self.dur.dir_lost = Some(e.to_string());
            // Every store is refused from now on; the entries on the first path stay
            // loadable from the open files (nothing can be journaled, so nothing is fenced).
            self.stop_writes_on(0, &e);
            self.publish_journal_state();
        }
        lost
    }

    /// [`Worker::check_files`] when it has not run for a while.
    pub(super) fn check_files_now_and_then(&mut self) -> Vec<(usize, Error)> {
        if self.dur.last_file_check.elapsed() >= FILE_CHECK_EVERY {
            self.check_files()
        } else {
            Vec::new()
        }
    }

    fn retry_allowed(&self) -> bool {
        self.dur.retry_at.is_none_or(|t| Instant::now() >= t)
    }

    /// True when stores wait for a checkpoint (the journal must be replaced).
    fn needs_repair(&self) -> bool {
        match &self.journal {
            None => self.dur.dir.is_some(),
            Some(j) => j.poisoned().is_some() || j.len() >= self.cfg.max_journal_bytes,
        }
    }

    /// When the worker's timer should fire next for a checkpoint: the interval (while the
    /// journal holds records), or a retry while stores wait for one.
    pub(super) fn next_checkpoint_at(&self) -> Option<Instant> {
        if self.dur.dir.is_none() || self.sh.failed.lock().is_some() {
            return None;
        }
        let over_size = self.journal_over_checkpoint_size();
        let retry = self.dur.retry_at.unwrap_or_else(Instant::now);
        let urgent = (self.needs_repair() || over_size || !self.dur.keep_damaged.is_empty())
            .then_some(retry);
        let interval = match (self.cfg.checkpoint_interval, &self.journal) {
            (Some(iv), Some(j)) if !j.is_empty() => self
                .dur
                .last_attempt
                .checked_add(iv.max(Duration::from_millis(1)))
                .map(|t| t.max(retry)),
            _ => None,
        };
        match (urgent, interval) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The journal holds records and has reached `checkpoint_journal_bytes`. (A journal of
    /// only its header never is: with a threshold at or below the header's 64 bytes, every
    /// fresh journal would call for the next checkpoint at once, in a loop.)
    fn journal_over_checkpoint_size(&self) -> bool {
        self.journal
            .as_ref()
            .is_some_and(|j| !j.is_empty() && j.len() >= self.cfg.checkpoint_journal_bytes)
    }

    pub(super) fn maybe_checkpoint(&mut self) {
        let due = self.needs_repair() || self.journal_over_checkpoint_size();
        if due && self.retry_allowed() {
            self.checkpoint_logged();
        }
    }

    pub(super) fn checkpoint_logged(&mut self) {
        if !self.retry_allowed() {
            return;
        }
        if let Err(e) = self.checkpoint() {
            self.checkpoint_failed(&e);
        }
        // Success, failure or a skipped checkpoint all restart the interval (no re-firing).
        self.dur.last_attempt = Instant::now();
    }

    /// Makes the slabs durable, then writes a checkpoint of the committed index and starts
    /// a fresh journal (a new generation, see [`rotate`]).
    pub(super) fn checkpoint(&mut self) -> Result<()> {
        if self.sh.failed.lock().is_some() || self.dur.dir.is_none() {
            return Ok(());
        }
        let _ = self.check_files();
        if let Some(dir) = &self.dur.dir {
            while let Some(k) = self.dur.keep_damaged.first() {
                dir.keep_damaged(k.name, k.rename, k.file)?;
                self.dur.keep_damaged.remove(0);
            }
        }
        for f in 0..self.set.files.len() {
            if self.sh.paths[f].poisoned.load(Ordering::Relaxed) {
                continue;
            }
            // A slab that cannot be made durable is failed like a failed write; the
            // checkpoint goes on for the others.
            if let Err(e) = self.engine.sync_data(f) {
                self.poison_path(f, &e);
            }
        }
        let entries = match self.sh.index.lock().as_ref() {
            Some(ix) => ix.entries_lru_first(),
            None => return Ok(()),
        };
        let seq = self.dur.max_seq.checked_add(1).ok_or_else(|| {
            Error::new(
                ErrorKind::Corrupt,
                "G3 checkpoint sequence numbers are exhausted",
            )
        })?;
        // A sequence number is never reused, even when this attempt fails.
        self.dur.max_seq = seq;
        let Some(dir) = &self.dur.dir else {
            return Ok(());
        };
        match rotate(dir, self.set.set_uuid(), seq, self.dur.next_gen, &entries) {
            Ok(journal) => {
                self.journal = Some(journal);
                self.dur.seq = seq;
                self.checkpoint_succeeded();
                Ok(())
            }
            Err(RotateError {
                error,
                journal_still_read,
            }) => {
                if !journal_still_read && let Some(j) = self.journal.as_mut() {
                    j.poison(Error::new(
                        ErrorKind::Poisoned,
                        format!(
                            "checkpoint {seq} is in place but its journal could not be ({error}): \
                             records appended to the old journal would not be replayed"
                        ),
                    ));
                }
                self.publish_journal_state();
                Err(error)
            }
        }
    }

    fn checkpoint_succeeded(&mut self) {
        let m = &self.sh.metrics;
        m.checkpoints.fetch_add(1, Ordering::Relaxed);
        m.last_checkpoint_unix_ms
            .store(unix_ms(SystemTime::now()), Ordering::Relaxed);
        *self.sh.checkpoint_error.lock() = None;
        if self.dur.failures > 0 {
            let since = self
                .dur
                .failing_since
                .map_or(Duration::ZERO, |t| t.elapsed());
            log::warn!(
                "G3 tier {}: checkpoint succeeded after {} failed attempt(s) over {:.1} s; the \
                 journal is healthy again{}",
                self.tier_id,
                self.dur.failures,
                since.as_secs_f64(),
                if self.dur.dir_lost.is_some() {
                    ""
                } else {
                    " and stores are accepted"
                }
            );
        }
        self.dur.failures = 0;
        self.dur.failing_since = None;
        self.dur.retry_at = None;
        self.dur.last_log = None;
        self.dur.quiet_failures = 0;
        self.dur.last_attempt = Instant::now();
        self.publish_journal_state();
    }

    /// Final checkpoint and engine shutdown. The result says whether I/O may still reference
    /// the region: never, once the engine's shutdown returned. A failed final checkpoint is
    /// not such an error (the journal that recovery reads holds every acknowledged entry): it
    /// is logged, counted in `g3_checkpoint_failures` and reported by the tier's health, so
    /// that `kvtier serve` exits non-zero.
    pub(super) fn checkpoint_and_stop(&mut self) -> Result<()> {
        if self.checkpoint_on_close {
            self.dur.retry_at = None;
            if let Err(e) = self.checkpoint() {
                self.checkpoint_failed(&e);
                *self.sh.final_checkpoint_error.lock() = Some(e.to_string());
            }
        }
        self.engine.shutdown();
        Ok(())
    }

    pub(super) fn checkpoint_failed(&mut self, e: &Error) {
        self.sh
            .metrics
            .checkpoint_failures
            .fetch_add(1, Ordering::Relaxed);
        *self.sh.checkpoint_error.lock() = Some(e.to_string());
        let d = &mut self.dur;
        d.failures = d.failures.saturating_add(1);
        let now = Instant::now();
        d.failing_since.get_or_insert(now);
        let delay = RETRY_MIN
            .saturating_mul(1u32 << (d.failures - 1).min(16))
            .min(RETRY_MAX);
        d.retry_at = Some(now + delay);
        let consequence = if self.store_refusal().is_some() {
            "stores are refused until a checkpoint succeeds"
        } else {
            "the journal still holds every committed entry"
        };
        let d = &mut self.dur;
        let first = d.failures == 1;
        if first || d.last_log.is_none_or(|t| t.elapsed() >= FAILURE_LOG_EVERY) {
            let quiet = std::mem::take(&mut d.quiet_failures);
            d.last_log = Some(now);
            if first {
                log::error!(
                    "G3 tier {}: checkpoint failed: {e}; {consequence}; retrying in {} ms, \
                     then with backoff up to {} s",
                    self.tier_id,
                    delay.as_millis(),
                    RETRY_MAX.as_secs()
                );
            } else {
                log::error!(
                    "G3 tier {}: checkpoint still failing after {} attempts ({quiet} not \
                     logged): {e}; {consequence}",
                    self.tier_id,
                    d.failures
                );
            }
        } else {
            d.quiet_failures += 1;
            log::debug!("G3 tier {}: checkpoint failed again: {e}", self.tier_id);
        }
        self.publish_journal_state();
    }
}
