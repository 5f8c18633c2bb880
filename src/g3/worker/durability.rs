//! The worker's durability work: index recovery at start, checkpoints, and the final
//! checkpoint at close.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::Worker;
use crate::error::{Error, ErrorKind, Result};
use crate::g3::journal::{JournalWriter, write_checkpoint};
use crate::g3::recovery;

impl Worker {
    pub(super) fn recover(&mut self) -> Result<()> {
        let total = u32::try_from(self.set.total_slots()).map_err(|_| {
            Error::new(
                ErrorKind::Config,
                "more than 2^32 - 1 slots in one stripe set",
            )
        })?;
        let dir = self.set.meta_dir().to_path_buf();
        let uuid = self.set.set_uuid();
        let rec = recovery::recover(&dir, uuid, total, self.set.files.len())?;
        let (journal, seq) = recovery::open_journal(&dir, uuid, &rec)?;
        let m = &self.sh.metrics;
        m.recovery_micros
            .store(rec.duration.as_micros() as u64, Ordering::Relaxed);
        m.recovery_records.store(rec.records, Ordering::Relaxed);
        m.recovery_cut_bytes.store(rec.cut_bytes, Ordering::Relaxed);
        log::info!(
            "G3 tier {}: recovered {} entries ({} records) in {:?}",
            self.tier_id,
            rec.index.len(),
            rec.records,
            rec.duration
        );
        self.journal = Some(journal);
        self.ckpt_seq = seq;
        self.next_gen = rec.next_generation;
        self.last_ckpt = Instant::now();
        let mut index = rec.index;
        for (i, p) in self.sh.paths.iter().enumerate() {
            if p.poisoned.load(Ordering::Relaxed) {
                index.mark_path_dead(i);
            }
        }
        self.refresh_slot_gauges(&index);
        *self.sh.index.lock() = Some(index);
        Ok(())
    }

    pub(super) fn maybe_checkpoint(&mut self) {
        if let Some(j) = &self.journal
            && j.len() >= self.cfg.checkpoint_journal_bytes
        {
            self.checkpoint_logged();
        }
    }

    pub(super) fn checkpoint_logged(&mut self) {
        if let Err(e) = self.checkpoint() {
            self.checkpoint_failed(&e);
        }
        // Success, failure or a skipped checkpoint all restart the interval (no re-firing).
        self.last_ckpt = Instant::now();
    }

    /// Makes the slabs durable, then writes a checkpoint of the committed index and starts
    /// a fresh journal.
    pub(super) fn checkpoint(&mut self) -> Result<()> {
        if self.journal.is_none() || self.sh.failed.lock().is_some() {
            return Ok(());
        }
        for f in 0..self.set.files.len() {
            self.engine.sync_data(f)?;
        }
        let entries = match self.sh.index.lock().as_ref() {
            Some(ix) => ix.entries_lru_first(),
            None => return Ok(()),
        };
        let dir = self.set.meta_dir().to_path_buf();
        let seq = self.ckpt_seq + 1;
        write_checkpoint(&dir, self.set.set_uuid(), seq, self.next_gen, &entries)?;
        self.journal = Some(JournalWriter::create(&dir, self.set.set_uuid(), seq)?);
        self.ckpt_seq = seq;
        self.last_ckpt = Instant::now();
        self.sh
            .metrics
            .journal_poisoned
            .store(false, Ordering::Relaxed);
        self.sh.metrics.checkpoints.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Final checkpoint and engine shutdown. The result says whether I/O may still reference
    /// the region: never, once the engine's shutdown returned. A failed final checkpoint is
    /// not such an error (the journal still holds every committed entry, so a reopen recovers
    /// them): it is logged and counted in `g3_checkpoint_failures`.
    pub(super) fn close(&mut self) -> Result<()> {
        if self.checkpoint_on_close
            && let Err(e) = self.checkpoint()
        {
            self.checkpoint_failed(&e);
        }
        self.engine.shutdown();
        Ok(())
    }

    fn checkpoint_failed(&self, e: &Error) {
        self.sh
            .metrics
            .checkpoint_failures
            .fetch_add(1, Ordering::Relaxed);
        log::error!(
            "G3 tier {}: checkpoint failed: {e}; the journal still holds every committed entry",
            self.tier_id
        );
    }
}
