//! Transfers another data path makes (GPUDirect Storage) into and out of this tier's slots.
//!
//! The worker reserves (store) or pins (load) the slots exactly as for its own jobs and hands
//! out their file offsets; when told each key's outcome it commits the stores through the same
//! group commit (fdatasync of the slabs, journal record, index) or checks the loads' CRCs
//! against the index and turns failures into misses, then reports the job to the caller. A
//! granted transfer is never visible to lookups before its commit, exactly like a store job.

use std::sync::atomic::Ordering;

use crossbeam_channel::Sender;

use super::{Active, G3Job, KeyStatus, Worker};
use crate::contract::job::JobResult;
use crate::error::{Error, ErrorKind, Result};
use crate::g3::format::slot_location;
use crate::g3::record::{chunk_crc_from_row_crc, row_crc_from_chunk_crc};
use crate::key::ChunkKey;

/// What the tier granted one key.
#[derive(Debug)]
pub enum GrantedSlot {
    /// Store: the key is already held (or repeated in the job); nothing to move.
    Skipped,
    /// The key cannot move (no slot, not held, poisoned tier...).
    Failed(Error),
    /// Move `row_stride` bytes at `offset` of slab file `file` (an index into
    /// `SlotGrants::files`); `crc` is the indexed CRC (loads; 0 for stores).
    Ready {
        /// Slab file index (stripe order).
        file: usize,
        /// Byte offset of the slot in that file.
        offset: u64,
        /// The CRC-32 the row's bytes must have (loads; the index stores it bound to the key,
        /// see `g3::record::chunk_crc`).
        crc: u32,
    },
}

/// The slots granted for one transfer; hand it back to `SlotGrants::finish`.
#[derive(Debug)]
pub struct SlotGrant {
    pub(crate) serial: u32,
    /// The caller's job id.
    pub job_id: u64,
    /// Bytes per slot (the whole row moves).
    pub row_stride: u64,
    /// One per key, in the job's order.
    pub slots: Vec<GrantedSlot>,
}

/// A request for slots (see [`crate::g3::slot_grants::SlotGrants`]).
pub(crate) struct GrantStart {
    /// The caller's job id (in the result).
    pub job_id: u64,
    /// Load (pin committed slots) or store (reserve free or evicted slots).
    pub load: bool,
    /// The keys.
    pub keys: Vec<ChunkKey>,
    /// Where the grant goes.
    pub reply: Sender<Result<SlotGrant>>,
}

/// The outcome of a granted transfer, per key of its grant.
pub(crate) struct GrantOutcome {
    /// The grant's serial.
    pub serial: u32,
    /// Per key: the CRC-32 of the row written (store) or read (load), or why it failed.
    /// Ignored for keys the grant did not make ready.
    pub results: Vec<Result<u32>>,
    /// Where the job result goes.
    pub reply: Sender<JobResult>,
}

/// What an [`Active`] of a granted transfer carries.
pub(crate) struct GrantState {
    /// Where the job result goes (set when the outcome arrives).
    pub reply: Option<Sender<JobResult>>,
    /// Per key, the CRC the other data path found (loads).
    pub crcs: Vec<u32>,
    /// Per key, whether its failure was the destination's and not the slot's (a load into a
    /// region that was lost, [`ErrorKind::RegionLost`]): the chunk stays.
    pub keep: Vec<bool>,
}

impl Worker {
    pub(super) fn start_grant(&mut self, s: GrantStart) {
        let serial = self.jobs.next_serial();
        let n = s.keys.len();
        let grant = GrantState {
            reply: None,
            crcs: vec![0; n],
            keep: vec![false; n],
        };
        let mut a = Active::start(
            s.job_id,
            s.load,
            s.keys,
            vec![0; n],
            G3Job::new(n, s.load, Some(grant)),
            &self.sh.metrics,
        );
        if let Some(e) = self.sh.failed.lock().as_ref() {
            (0..n).for_each(|i| a.fail(i, e.duplicate()));
        } else if s.load {
            self.prepare_load(&mut a);
        } else {
            self.prepare_store(&mut a, super::store::EvictionFlush::Now);
        }
        let stride = self.set.row_stride();
        let n_files = self.set.files.len();
        let failed = |a: &Active| {
            a.first_error.as_ref().map_or_else(
                || Error::new(ErrorKind::Internal, "key failed"),
                Error::duplicate,
            )
        };
        let slots = (0..n)
            .map(|i| match (a.status[i], a.tier.slots[i]) {
                (KeyStatus::Skipped, _) => GrantedSlot::Skipped,
                (KeyStatus::Pending, Some((slot, crc))) => {
                    let (file, offset) = slot_location(u64::from(slot), n_files, stride);
                    // The other data path checks the row's own CRC-32; the index binds the
                    // key too (`chunk_crc`).
                    let crc = if s.load {
                        row_crc_from_chunk_crc(a.keys[i].as_bytes(), crc, stride)
                    } else {
                        0
                    };
                    GrantedSlot::Ready { file, offset, crc }
                }
                _ => GrantedSlot::Failed(failed(&a)),
            })
            .collect();
        self.grants.insert(serial, a);
        let _ = s.reply.send(Ok(SlotGrant {
            serial,
            job_id: s.job_id,
            row_stride: stride,
            slots,
        }));
    }

    pub(super) fn finish_grant(&mut self, o: GrantOutcome) {
        let Some(mut a) = self.grants.remove(&o.serial) else {
            let e = Error::new(
                ErrorKind::Contract,
                format!("granted transfer {} is unknown (finished twice?)", o.serial),
            );
            let _ = o.reply.send(JobResult::failed(0, e));
            return;
        };
        let stride = self.set.row_stride();
        let n_paths = self.set.files.len();
        let n = a.keys.len();
        if o.results.len() != n {
            let e = Error::new(
                ErrorKind::Contract,
                format!("{} outcomes for a transfer of {n} keys", o.results.len()),
            );
            for i in 0..n {
                if a.status[i] == KeyStatus::Pending {
                    a.fail(i, e.duplicate());
                }
            }
        }
        for (i, r) in o.results.into_iter().enumerate().take(n) {
            if a.status[i] != KeyStatus::Pending {
                continue;
            }
            match r {
                Ok(crc) => {
                    a.status[i] = KeyStatus::Done;
                    a.bytes += stride;
                    let ctr = if a.load {
                        if let Some(d) = a.tier.grant.as_mut() {
                            d.crcs[i] = crc;
                        }
                        &self.sh.metrics.bytes_read
                    } else {
                        if let Some((slot, _)) = a.tier.slots[i] {
                            let crc = chunk_crc_from_row_crc(a.keys[i].as_bytes(), crc, stride);
                            a.tier.slots[i] = Some((slot, crc));
                        }
                        &self.sh.metrics.bytes_written
                    };
                    ctr.fetch_add(stride, Ordering::Relaxed);
                }
                Err(e) => {
                    if let (ErrorKind::RegionLost, Some(d)) = (e.kind(), a.tier.grant.as_mut()) {
                        // Nothing was wrong with the slot: a load keeps its chunk, a store
                        // fences no path.
                        d.keep[i] = true;
                    }
                    if e.kind() == ErrorKind::Checksum {
                        self.sh
                            .metrics
                            .checksum_failures
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    if matches!(
                        e.kind(),
                        ErrorKind::Io | ErrorKind::ShortIo | ErrorKind::NoSpace
                    ) {
                        self.sh.metrics.io_errors.fetch_add(1, Ordering::Relaxed);
                        // A failed write fences its path, as on the CPU path.
                        if let (false, Some((slot, _)), false) =
                            (a.load, a.tier.slots[i], crate::io::is_transient(&e))
                        {
                            self.poison_path(slot as usize % n_paths, &e);
                        }
                    }
                    a.fail(i, e);
                }
            }
        }
        if let Some(d) = a.tier.grant.as_mut() {
            d.reply = Some(o.reply);
        }
        self.finish(a);
    }

    /// At shutdown: releases the slots of granted transfers whose outcome never came (stores
    /// were never journaled; they are simply not there after a restart).
    pub(super) fn abandon_grants(&mut self) {
        let parked: Vec<Active> = self.grants.drain().map(|(_, a)| a).collect();
        let mut guard = self.sh.index.lock();
        for a in parked {
            self.sh.metrics.active_jobs.fetch_sub(1, Ordering::Relaxed);
            let Some(ix) = guard.as_mut() else { continue };
            for i in 0..a.keys.len() {
                if let (KeyStatus::Pending, Some((slot, _))) = (a.status[i], a.tier.slots[i]) {
                    if a.load {
                        ix.unpin(slot);
                    } else {
                        ix.abort(slot);
                    }
                }
            }
        }
    }
}
