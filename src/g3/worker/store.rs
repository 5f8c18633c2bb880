//! The store half of the worker: reserving slots (evicting, journaled first), CRC before the
//! write, durability and journaling after it.

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use super::{Active, KeyStatus, Worker};
use crate::error::{Error, ErrorKind};
use crate::g3::config::FsyncPolicy;
use crate::g3::journal::MAX_KEY_LEN;
use crate::key::ChunkKey;

impl Worker {
    pub(super) fn prepare_store(&mut self, a: &mut Active) {
        let mut journal_bad = self
            .journal
            .as_ref()
            .and_then(|j| j.poisoned().map(str::to_string));
        if journal_bad.is_none()
            && self
                .sh
                .paths
                .iter()
                .all(|p| p.poisoned.load(Ordering::Relaxed))
        {
            journal_bad = Some("every slab path is poisoned by an earlier failed write".into());
        }
        let mut evicted = Vec::new();
        {
            let mut guard = self.sh.index.lock();
            let Some(ix) = guard.as_mut() else { return };
            let mut seen = HashSet::new();
            for i in 0..a.keys.len() {
                let key = &a.keys[i];
                if ix.is_held(key) || !seen.insert(key.clone()) {
                    a.status[i] = KeyStatus::Skipped;
                    self.sh
                        .metrics
                        .stores_skipped
                        .fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                if let Some(why) = &journal_bad {
                    a.fail(
                        i,
                        Error::new(
                            ErrorKind::Poisoned,
                            format!("G3 tier refuses writes: {why}"),
                        ),
                    );
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
                if let Err(e) = self.check_row(a.rows[i]) {
                    a.fail(i, e);
                    continue;
                }
                match ix.reserve(key) {
                    Some(r) => {
                        a.slots[i] = Some((r.slot, 0));
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
        if !evicted.is_empty() {
            self.sh
                .metrics
                .evictions
                .fetch_add(evicted.len() as u64, Ordering::Relaxed);
            let keys: Vec<ChunkKey> = evicted.iter().map(|(k, _)| k.clone()).collect();
            self.event(keys, true);
            // An eviction is journaled (and, under fsync = always, made durable) before the
            // slot is overwritten.
            let sync = self.cfg.fsync == FsyncPolicy::Always;
            let res = match self.journal.as_mut() {
                Some(j) => {
                    evicted.iter().for_each(|(_, s)| j.remove(*s));
                    j.flush(sync)
                }
                None => Err(Error::new(ErrorKind::Closed, "G3 journal is not open")),
            };
            if let Err(e) = res {
                self.sh
                    .metrics
                    .journal_poisoned
                    .store(true, Ordering::Relaxed);
                let mut guard = self.sh.index.lock();
                for i in 0..a.keys.len() {
                    if let (KeyStatus::Pending, Some((slot, _))) = (a.status[i], a.slots[i]) {
                        if let Some(ix) = guard.as_mut() {
                            ix.abort(slot);
                        }
                        a.slots[i] = None;
                        a.fail(i, e.duplicate());
                    }
                }
                return;
            }
        }
        let region = self.engine.region().clone();
        for i in 0..a.keys.len() {
            if let (KeyStatus::Pending, Some((slot, _))) = (a.status[i], a.slots[i]) {
                // SAFETY: the manager pins a store job's rows (no writer) until the job is
                // reported; the row index was range-checked above.
                let crc = match unsafe { region.row(a.rows[i] as usize) } {
                    Ok(bytes) => crc32fast::hash(bytes),
                    Err(e) => {
                        a.fail(i, e);
                        continue;
                    }
                };
                a.slots[i] = Some((slot, crc));
            }
        }
    }

    pub(super) fn finish_store(&mut self, mut a: Active) {
        let n_paths = self.set.files.len();
        let sync = self.cfg.fsync == FsyncPolicy::Always;
        // Write failures poison their path.
        for i in 0..a.keys.len() {
            if let (KeyStatus::Failed, Some((slot, _))) = (a.status[i], a.slots[i]) {
                let e = a
                    .first_error
                    .clone()
                    .unwrap_or_else(|| Error::new(ErrorKind::Io, "write failed"));
                self.poison_path(slot as usize % n_paths, &e);
            }
        }
        // Under fsync = always the data is made durable before the journal names it.
        if sync {
            let touched: HashSet<usize> = (0..a.keys.len())
                .filter(|&i| a.status[i] == KeyStatus::Done)
                .filter_map(|i| a.slots[i].map(|(s, _)| s as usize % n_paths))
                .collect();
            for f in touched {
                if let Err(err) = self.set.files[f].meta.sync_data() {
                    let e = Error::io("fdatasync", &self.set.files[f].path, err);
                    self.poison_path(f, &e);
                    for i in 0..a.keys.len() {
                        if a.status[i] == KeyStatus::Done
                            && a.slots[i].is_some_and(|(s, _)| s as usize % n_paths == f)
                        {
                            a.fail(i, e.duplicate());
                        }
                    }
                }
            }
        }
        let done: Vec<usize> = (0..a.keys.len())
            .filter(|&i| a.status[i] == KeyStatus::Done)
            .collect();
        let mut journal_err = None;
        let mut gens = Vec::with_capacity(done.len());
        if !done.is_empty() {
            match self.journal.as_mut() {
                Some(j) => {
                    for &i in &done {
                        let (slot, crc) = a.slots[i].unwrap_or((0, 0));
                        gens.push(self.next_gen);
                        j.insert(&a.keys[i], slot, crc, self.next_gen);
                        self.next_gen += 1;
                    }
                    journal_err = j.flush(sync).err();
                }
                None => journal_err = Some(Error::new(ErrorKind::Closed, "G3 journal is not open")),
            }
        }
        if let Some(e) = &journal_err {
            self.sh
                .metrics
                .journal_poisoned
                .store(true, Ordering::Relaxed);
            for &i in &done {
                a.fail(i, e.duplicate());
            }
        }
        let mut stored = Vec::new();
        {
            let mut guard = self.sh.index.lock();
            if let Some(ix) = guard.as_mut() {
                for (n, &i) in done.iter().enumerate() {
                    if let Some((slot, crc)) = a.slots[i] {
                        if journal_err.is_none() {
                            ix.commit(slot, crc, gens[n]);
                            stored.push(a.keys[i].clone());
                        } else {
                            ix.abort(slot);
                        }
                    }
                }
                for i in 0..a.keys.len() {
                    if let (KeyStatus::Failed, Some((slot, _))) = (a.status[i], a.slots[i])
                        && !done.contains(&i)
                    {
                        ix.abort(slot);
                    }
                }
                self.refresh_slot_gauges(ix);
            }
        }
        let m = &self.sh.metrics;
        m.keys_stored
            .fetch_add(stored.len() as u64, Ordering::Relaxed);
        let failed = a.status.iter().filter(|s| **s == KeyStatus::Failed).count();
        m.key_failures.fetch_add(failed as u64, Ordering::Relaxed);
        if !stored.is_empty() {
            self.event(stored, false);
        }
        self.report(a, None);
    }
}
