//! One engine's job thread: its stores and loads, in order, moving rows directly between the
//! G3 slots and the engine's region (through the DRAM staging pool for loads when there is
//! one), each reported once; the end of the session when the engine's region is lost.

use std::cell::RefCell;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crossbeam_channel::Receiver;
use parking_lot::Mutex;

use super::shared::{MappedRegion, QueuedJob, ServiceShared, send};
use crate::contract::job::JobResult;
use crate::error::{Error, ErrorKind, Result};
use crate::g3::slot_grants::{GrantedSlot, SlotGrant};
use crate::io::{IoDir, IoRequest};
use crate::key::ChunkKey;
use crate::node::engines::EngineEntry;
use crate::node::prefetch::Staging;
use crate::node::protocol::{JobDone, JobRequest, Reply};
use crate::node::staging::{FILL_WAIT, Reserve};

/// Runs one engine's jobs in order.
pub(super) struct JobWorker {
    pub(super) sh: Arc<ServiceShared>,
    pub(super) entry: Arc<EngineEntry>,
    pub(super) writer: Arc<Mutex<Option<UnixStream>>>,
    pub(super) mapped: Arc<MappedRegion>,
    pub(super) cancelled: Arc<AtomicBool>,
    /// The buffer rows are read through for their CRC (`CRC_CHUNK` bytes).
    pub(super) chunk: RefCell<Vec<u8>>,
}

impl JobWorker {
    /// Runs the jobs `rx` brings until the session drops its sender.
    pub(super) fn run(self, rx: Receiver<QueuedJob>) {
        for q in rx.iter() {
            if self.cancelled.load(Ordering::Acquire) {
                self.sh
                    .engines
                    .cancelled_jobs
                    .fetch_add(1, Ordering::Relaxed);
                let c = &self.entry.counters;
                c.jobs_in_flight.fetch_sub(1, Ordering::Relaxed);
                continue;
            }
            let lost = self.mapped.lost.lock().as_ref().map(Error::duplicate);
            let r = match lost {
                Some(e) => JobResult::failed(q.job.job_id, e),
                None => self.transfer(q.load, &q.job),
            };
            let newly_lost = match &r.error {
                Some(e) if e.kind() == ErrorKind::RegionLost => {
                    self.mapped.lost.lock().is_none().then(|| e.duplicate())
                }
                _ => None,
            };
            self.report(&q, &r);
            if let Some(e) = newly_lost {
                self.end_for_lost_region(e, &rx);
            }
        }
    }

    /// Counts a finished job and sends its `JOB_DONE`.
    fn report(&self, q: &QueuedJob, r: &JobResult) {
        let c = &self.entry.counters;
        let done = JobDone::from_result(r, &q.job.keys);
        if q.load {
            c.loads.fetch_add(1, Ordering::Relaxed);
            c.bytes_loaded
                .fetch_add(done.transfer_bytes, Ordering::Relaxed);
        } else {
            c.stores.fetch_add(1, Ordering::Relaxed);
            c.bytes_stored
                .fetch_add(done.transfer_bytes, Ordering::Relaxed);
        }
        if !r.success {
            c.failed_jobs.fetch_add(1, Ordering::Relaxed);
        }
        c.jobs_in_flight.fetch_sub(1, Ordering::Relaxed);
        send(&self.writer, &Reply::JobDone(done).to_frame(q.seq));
    }

    /// The engine's region file was shrunk: the region is marked lost (later jobs
    /// fail with `e` at once), the jobs already queued fail with it, the loss is recorded for
    /// `STATUS` and `/metrics`, and the session ends (its reader sees the socket's read side
    /// shut), which unmaps the region and releases the pages io_uring pinned.
    fn end_for_lost_region(&self, e: Error, rx: &Receiver<QueuedJob>) {
        log::warn!("node service: {e}");
        self.sh.engines.region_lost(&self.entry, &e);
        *self.mapped.lost.lock() = Some(e.duplicate());
        while let Ok(q) = rx.try_recv() {
            self.report(&q, &JobResult::failed(q.job.job_id, e.duplicate()));
        }
        if let Some(stream) = self.writer.lock().as_ref() {
            let _ = stream.shutdown(std::net::Shutdown::Read);
        }
    }

    /// Runs a job: a load through the staging pool when there is one, else straight between
    /// G3 and the engine's rows.
    ///
    /// The region file is checked before (a region already shrunk fails at once, saying what
    /// happened) and after: no key of a job whose region shrank meanwhile reports success
    /// (the G3 part checks it again before anything is committed).
    fn transfer(&self, load: bool, job: &JobRequest) -> JobResult {
        if let Err(e) = self.mapped.file.check("before the job") {
            return JobResult::failed(job.job_id, e);
        }
        let r = match self.sh.staging.as_ref().filter(|_| load) {
            Some(st) => self.load_through_staging(st, job),
            None => self.transfer_g3(load, job, &mut Vec::new()),
        };
        if let Err(e) = self.mapped.file.check("after the job") {
            // A copy that failed says more than the check.
            let e = match r.error {
                Some(copy) if copy.kind() == ErrorKind::RegionLost => copy,
                _ => e,
            };
            return JobResult::failed(job.job_id, e);
        }
        r
    }

    /// A load: each key the pool holds is copied from it into the engine's row (its CRC
    /// checked); the rest are read from G3, and what G3 vouched for is copied into the pool
    /// for the other engines.
    fn load_through_staging(&self, st: &Staging, job: &JobRequest) -> JobResult {
        let started = Instant::now();
        let (region, file) = (&self.mapped.region, &self.mapped.file);
        let stride = region.row_stride();
        let pool_stride = st.pool.row_stride();
        let mut from_pool = Vec::new();
        let (mut keys, mut rows) = (Vec::new(), Vec::new());
        for (k, &row) in job.keys.iter().zip(&job.rows) {
            if region.row_offset(row as usize).is_err() {
                keys.push(k.clone());
                rows.push(row);
                continue;
            }
            let copy = |slot: usize, bytes: &[u8]| {
                let pool_fd = st.pool.region().fd().ok_or_else(|| {
                    Error::new(ErrorKind::Internal, "the staging pool has no descriptor")
                })?;
                // The service's mapping of the engine's row `row`, a whole row (at least a
                // slot) long, mapped while this job runs; the engine gave the row to this job
                // to fill and reads it only after JOB_DONE.
                file.copy_into_row(
                    region,
                    row as usize,
                    bytes.len(),
                    pool_fd,
                    slot as u64 * pool_stride,
                )
            };
            match st.pool.copy_out_with(k, FILL_WAIT, copy) {
                Ok(Some(_)) => from_pool.push(k.clone()),
                Ok(None) => {
                    keys.push(k.clone());
                    rows.push(row);
                }
                // The engine's row is gone (its region file was shrunk): the job fails.
                Err(e) => return JobResult::failed(job.job_id, e),
            }
        }
        let pool_bytes = from_pool.len() as u64 * self.sh.slot_bytes;
        // A G3 load would have pinned these keys, making them G3's most recently used.
        st.touch_g3(from_pool.clone());
        st.pool
            .counters
            .g3_loads
            .fetch_add(keys.len() as u64, Ordering::Relaxed);
        if keys.is_empty() {
            return JobResult::ok(job.job_id, started.elapsed(), pool_bytes);
        }
        let rest = JobRequest {
            job_id: job.job_id,
            rows,
            keys,
        };
        let mut crcs = Vec::new();
        let mut r = self.transfer_g3(true, &rest, &mut crcs);
        let (keys, rows) = (&rest.keys, &rest.rows);
        for (i, k) in keys.iter().enumerate() {
            let vouched = r.success || r.successful_keys.as_ref().is_some_and(|ok| ok.contains(k));
            let (true, Some(&Some(crc))) = (vouched, crcs.get(i)) else {
                continue;
            };
            if let Reserve::Reserved(slot) = st.pool.reserve(k, false) {
                // The slot holds the row's first slot_bytes, what G3 stored; read through
                // the region file (a lost row fails the copy, and the job, see `transfer`).
                // The slot was reserved to this thread just now; its lease ends before the
                // commit reads it.
                let read = match st.pool.fill_bytes(slot) {
                    Ok(mut dst) => file.read_into(u64::from(rows[i]) * stride, &mut dst),
                    Err(e) => Err(e),
                };
                match read {
                    Ok(()) => {
                        st.pool.commit(slot, crc);
                    }
                    Err(_) => st.pool.abort(slot),
                }
            }
        }
        r.transfer_time = Some(started.elapsed());
        r.transfer_bytes = Some(r.transfer_bytes.unwrap_or(0) + pool_bytes);
        if !r.success {
            let mut ok = r.successful_keys.take().unwrap_or_default();
            ok.extend(from_pool);
            r.successful_keys = Some(ok);
        }
        r
    }

    /// Moves the job's rows between the engine's region and the granted slots, then reports
    /// each key's CRC (or error) to the tier, which commits or checks them. `crcs` gets each
    /// key's CRC as moved (`None`: not moved), what the tier checked.
    fn transfer_g3(&self, load: bool, job: &JobRequest, crcs: &mut Vec<Option<u32>>) -> JobResult {
        let slots = &self.sh.slots;
        let keys: Vec<ChunkKey> = job.keys.clone();
        let grant = if load {
            slots.begin_load(job.job_id, keys)
        } else {
            slots.begin_store(job.job_id, keys)
        };
        let grant = match grant {
            Ok(g) => g,
            Err(e) => return JobResult::failed(job.job_id, e),
        };
        let region = &self.mapped.region;
        let stride = region.row_stride() as usize;
        let slot = self.sh.slot_bytes as usize;
        let n = job.keys.len();
        let mut results: Vec<Result<u32>> = (0..n)
            .map(|_| Err(Error::new(ErrorKind::Internal, "not moved")))
            .collect();
        // A store's CRC is taken from the row before it is written; it counts only once the
        // write has completed.
        let mut store_crcs = vec![0u32; if load { 0 } else { n }];
        let mut reqs = Vec::new();
        let engine = &self.mapped.engine.engine;
        // A staged transfer is checksummed by the engine in the same pass as its copy (a
        // kernel copy through the region file, see `io/uring/staging.rs`), and the CRC comes
        // with its completion.
        let staged = engine.stages(slot);
        for (i, g) in grant.slots.iter().enumerate() {
            if let GrantedSlot::Ready { file, offset, .. } = g {
                let row = job.rows[i] as usize;
                if !load && !staged {
                    match self.row_crc(row) {
                        Ok(crc) => store_crcs[i] = crc,
                        Err(e) => {
                            let all = (0..n).map(|_| Err(e.duplicate())).collect();
                            return slots.finish(grant, all);
                        }
                    }
                }
                reqs.push(IoRequest {
                    dir: if load { IoDir::Read } else { IoDir::Write },
                    file: *file,
                    file_offset: *offset,
                    region_offset: row * stride,
                    len: slot,
                    tag: i as u64,
                });
            }
        }
        let started = Instant::now();
        // A store of an engine that went away is abandoned (its reserved slots released,
        // nothing committed). A load is finished: the tier turns every key reported failed
        // into a miss, so cancelling one would throw good chunks away; the rows it fills are
        // still mapped here and nobody reads them.
        if !load && self.cancelled.load(Ordering::Acquire) {
            return self.cancel(grant, n);
        }
        if !reqs.is_empty() {
            if let Err(e) = engine.submit(&reqs) {
                let all = (0..n).map(|_| Err(e.duplicate())).collect();
                return slots.finish(grant, all);
            }
            for _ in 0..reqs.len() {
                let Ok(c) = engine.completions().recv() else {
                    break;
                };
                let i = c.tag as usize;
                results[i] = match (c.result, c.row_crc) {
                    (Ok(_), Some(crc)) => Ok(crc),
                    (Ok(_), None) if load => self.row_crc(job.rows[i] as usize),
                    // Not staged after all (a background collapse made the row's pages
                    // huge meanwhile): the row, still pinned, is checksummed now.
                    (Ok(_), None) if staged => self.row_crc(job.rows[i] as usize),
                    (Ok(_), None) => Ok(store_crcs[i]),
                    (Err(e), _) => Err(e),
                };
            }
        }
        #[cfg(feature = "test-support")]
        if let Some(hold) = &self.sh.hooks.hold {
            hold.hold(&self.cancelled);
        }
        if !load && self.cancelled.load(Ordering::Acquire) {
            return self.cancel(grant, n);
        }
        log::trace!(
            "node service: job {} of {} moved in {:?}",
            job.job_id,
            self.entry.name,
            started.elapsed()
        );
        // A region shrunk while its rows moved: nothing of the job commits (a store's bytes
        // may have come from pages the file no longer holds) and no chunk is blamed (a load
        // keeps its chunk, a store fences no path: `ErrorKind::RegionLost`).
        if let Err(e) = self.mapped.file.check("after the transfer") {
            results = (0..n).map(|_| Err(e.duplicate())).collect();
        }
        *crcs = results.iter().map(|r| r.as_ref().ok().copied()).collect();
        slots.finish(grant, results)
    }

    /// Finishes a store's grant with every key failed (nothing committed, reserved slots
    /// released).
    fn cancel(&self, grant: SlotGrant, n: usize) -> JobResult {
        self.sh
            .engines
            .cancelled_jobs
            .fetch_add(1, Ordering::Relaxed);
        let e = || Error::new(ErrorKind::Cancelled, "the engine disconnected");
        self.sh
            .slots
            .finish(grant, (0..n).map(|_| Err(e())).collect())
    }

    /// The CRC-32 of the row's first `slot_bytes` (what its slot holds), read through the
    /// region file: a row the file lost is an error ([`ErrorKind::RegionLost`]), not a signal.
    fn row_crc(&self, row: usize) -> Result<u32> {
        let offset = row as u64 * self.mapped.region.row_stride();
        let mut chunk = self.chunk.borrow_mut();
        self.mapped
            .file
            .crc(offset, self.sh.slot_bytes as usize, &mut chunk)
    }
}
