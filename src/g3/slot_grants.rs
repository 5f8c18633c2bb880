//! [`SlotGrants`]: moving chunk bytes into and out of a live G3 tier's slots by another data
//! path (GPUDirect Storage), with the tier keeping its index, journal and CRC rules.
//!
//! 1. [`SlotGrants::begin_store`] / [`SlotGrants::begin_load`]: the tier's worker reserves
//!    slots for the keys (evicting and journaling like a store job; keys already held are
//!    skipped) or pins their committed slots, and returns each one's slab file, byte offset
//!    and (loads) indexed CRC.
//! 2. The caller moves whole rows (`row_stride` bytes) at those offsets through the slab
//!    files' O_DIRECT descriptors ([`SlotGrants::files`]), checksumming each row with
//!    CRC-32 (IEEE), what `crc32fast` computes over the row.
//! 3. [`SlotGrants::finish`] with each key's CRC or error: stores are committed exactly like
//!    the tier's own (fdatasync of the slabs under `fsync = always`, one journal record per
//!    key, then the index); loads are checked against the indexed CRC, and a failed key
//!    becomes a miss, except one failed with [`ErrorKind::RegionLost`] (the caller's memory
//!    was lost, not the slot's bytes): its chunk stays, and a store failed that way fences no
//!    path. The returned [`JobResult`] follows the tier's rules: success only if every key
//!    moved (or was skipped as held).
//!
//! A slot written this way is an ordinary slot: the CPU path loads it, and the reverse. The
//! calls wait for the worker (microseconds, longer while it writes a checkpoint): call them
//! from an I/O thread, not from the scheduler.

use std::fs::File;

use crossbeam_channel::Sender;

use crate::contract::job::JobResult;
use crate::error::{Error, ErrorKind, Result};
use crate::g3::worker::{Cmd, GrantOutcome, GrantStart};
pub use crate::g3::worker::{SlotGrant, GrantedSlot};
use crate::key::ChunkKey;

/// A handle for another data path to move rows into and out of a live tier's slots. Clones
/// share the tier; after the tier shuts down every call fails with `Closed`.
#[derive(Debug, Clone)]
pub struct SlotGrants {
    pub(crate) cmd_tx: Sender<Cmd>,
    pub(crate) files: std::sync::Arc<Vec<File>>,
    pub(crate) row_stride: u64,
}

fn closed() -> Error {
    Error::new(ErrorKind::Closed, "the G3 tier is shut down")
}

impl SlotGrants {
    /// Bytes per slot.
    pub fn row_stride(&self) -> u64 {
        self.row_stride
    }

    /// Fresh descriptors of the slab files' O_DIRECT data descriptors, in stripe order (the
    /// `file` of a [`GrantedSlot::Ready`] indexes this list).
    pub fn files(&self) -> Result<Vec<File>> {
        self.files
            .iter()
            .map(|f| {
                f.try_clone().map_err(|e| {
                    Error::new(ErrorKind::Io, format!("dup of a slab descriptor: {e}"))
                        .with_source(e)
                })
            })
            .collect()
    }

    fn begin(&self, job_id: u64, keys: Vec<ChunkKey>, load: bool) -> Result<SlotGrant> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.cmd_tx
            .send(Cmd::GrantStart(GrantStart {
                job_id,
                load,
                keys,
                reply: tx,
            }))
            .map_err(|_| closed())?;
        rx.recv().map_err(|_| closed())?
    }

    /// Reserves a slot for each key to store (see the module docs).
    pub fn begin_store(&self, job_id: u64, keys: Vec<ChunkKey>) -> Result<SlotGrant> {
        self.begin(job_id, keys, false)
    }

    /// Pins the committed slot of each key to load.
    pub fn begin_load(&self, job_id: u64, keys: Vec<ChunkKey>) -> Result<SlotGrant> {
        self.begin(job_id, keys, true)
    }

    /// Marks `keys` most recently used in the tier's index, as a load of each would (the keys
    /// it does not hold are ignored), for another copy of the chunks that served a read (the
    /// node service's staging pool). Never waits: the touch is queued for the tier's worker,
    /// which applies it before any later request of this handle. False, and nothing changes,
    /// when the worker's queue is full or the tier is shut down.
    pub fn touch(&self, keys: Vec<ChunkKey>) -> bool {
        keys.is_empty() || self.cmd_tx.try_send(Cmd::Touch(keys)).is_ok()
    }

    /// Reports each key's outcome (the CRC-32 of the row written or read, or the error;
    /// entries for keys not [`GrantedSlot::Ready`] are ignored) and waits for the commit or
    /// check. The result is the job's, by the tier's rules.
    pub fn finish(&self, grant: SlotGrant, results: Vec<Result<u32>>) -> JobResult {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let job_id = grant.job_id;
        let sent = self.cmd_tx.send(Cmd::GrantFinish(GrantOutcome {
            serial: grant.serial,
            results,
            reply: tx,
        }));
        match sent.ok().and_then(|()| rx.recv().ok()) {
            Some(r) => r,
            None => JobResult::failed(job_id, closed()),
        }
    }
}
