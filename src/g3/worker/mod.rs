//! The tier's worker thread: recovers the index, then turns jobs into slab I/O on the engine,
//! caps bytes in flight, checks CRCs, journals, and posts one result per job. All index
//! changes happen here, under the index mutex, each together with its journal record, so that
//! the committed index always equals checkpoint + journal.
//!
//! **Waiting.** The worker blocks on its channels, the engine's completion channel and (when
//! the journal holds records) a checkpoint timer; it never spins. What it listens to is chosen
//! so that a submission from the scheduler rarely has to wake it (on the 2-vCPU development VM
//! a send to a blocked thread took 2-4 us at the median and over 10 us at the tail):
//! * Store jobs (the cascade, from `complete_store`) have a channel of their own, listened to
//!   only while no transfer is in flight. Otherwise the next completion wakes the worker
//!   anyway and it takes new stores then.
//! * Commands (loads, drains, shutdowns) are listened to while fewer than two transfers are in
//!   flight. With two or more, the next completion comes within about one transfer's time and
//!   the worker takes them then (measured: the promotion submit's p99 fell from 7-8 us to
//!   2 us, promotion latency unchanged).
//! * With nothing in flight the worker lingers before it blocks ([`crate::io::IdlePolicy`]):
//!   it naps and looks at its channels between naps, so that the next step's submissions find
//!   it without a wake-up. It does not nap while transfers are in flight (a completion comes
//!   anyway; napping then, even every 200 us, added 40-100 % to the CPU per GB of bulk loads).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, after, never};
use parking_lot::Mutex;

use crate::contract::job::{JobResult, TransferJob};
use crate::contract::worker::{
    EventSink, JobQueue, JobRun, KeyStatus, Lifecycle, Next, WorkerLoop, job_counters, run_worker,
};
use crate::error::{Error, ErrorKind, Result};
use crate::g3::config::G3TierConfig;
use crate::g3::format::slot_location;
use crate::g3::index::{Index, Slot};
use crate::g3::journal::JournalWriter;
use crate::g3::metrics::{G3Metrics, PathStatus};
use crate::g3::record::{chunk_crc, chunk_crc_from_row_crc};
use crate::g3::slab::SlabSet;
use crate::io::{IoCompletion, IoDir, IoEngine, IoRequest, is_transient, job_tag, split_job_tag};
use crate::key::ChunkKey;
use durability::Durability;

mod durability;
mod grants;
mod load;
mod store;

pub(crate) use grants::{GrantOutcome, GrantStart};
pub use grants::{GrantedSlot, SlotGrant};

/// Transfers in flight from which the worker stops listening for commands and takes them at
/// the next completion instead (see the module docs).
const QUIET_IN_FLIGHT_ROWS: u64 = 2;

/// Most store jobs committed together (one fdatasync per slab, one journal append).
const MAX_COMMIT_GROUP: usize = 64;

/// A message from the tier to its worker.
pub(crate) enum Cmd {
    /// Slabs -> primary.
    Load(TransferJob),
    /// Cancel queued jobs, wait for started ones, then signal.
    Drain(Sender<()>),
    /// Drain, checkpoint (when the flag is true), stop the engine, then signal and exit.
    Shutdown(Sender<Result<()>>, bool),
    /// Reserve (store) or pin (load) slots for a transfer another data path makes.
    GrantStart(GrantStart),
    /// The other data path's per-key outcome: commit, release, report to the sender.
    GrantFinish(GrantOutcome),
    /// Keys another copy of the chunks served (the node service's staging pool): each one
    /// the index holds moves to the most recently used end, as a load of it would.
    Touch(Vec<ChunkKey>),
}

/// State shared between the tier (caller side) and its worker.
#[derive(Debug)]
pub(crate) struct Shared {
    /// The index; `None` until recovery has finished.
    pub index: Mutex<Option<Index>>,
    /// Metrics.
    pub metrics: G3Metrics,
    /// Per-path status.
    pub paths: Vec<PathStatus>,
    /// Why the tier cannot serve (recovery failed, worker gone), if so.
    pub failed: Mutex<Option<Error>>,
    /// Why the last checkpoint failed, while checkpoints fail.
    pub checkpoint_error: Mutex<Option<String>>,
    /// Why the journal refuses writes, if it does.
    pub journal_problem: Mutex<Option<String>>,
    /// Why the final checkpoint at shutdown failed, if it did.
    pub final_checkpoint_error: Mutex<Option<String>>,
    /// Whether stored/removed events are recorded (see `G3Tier::set_events_enabled`).
    pub events: std::sync::atomic::AtomicBool,
}

impl Shared {
    /// The state of a tier over the slab files of `set`, not recovered yet.
    pub fn new(metrics: G3Metrics, set: &SlabSet) -> Self {
        Shared {
            index: Mutex::new(None),
            metrics,
            paths: set
                .files
                .iter()
                .map(|f| PathStatus {
                    direct: f.direct,
                    poisoned: Default::default(),
                    problem: Default::default(),
                    lost: Default::default(),
                    wrong_filesystem: Default::default(),
                })
                .collect(),
            failed: Mutex::new(None),
            checkpoint_error: Mutex::new(None),
            journal_problem: Mutex::new(None),
            final_checkpoint_error: Mutex::new(None),
            events: std::sync::atomic::AtomicBool::new(true),
        }
    }
}

/// What a G3 job keeps besides the shared per-key progress.
struct G3Job {
    /// Per key, its slot and the CRC bound to the key (stores: once written).
    slots: Vec<Option<(Slot, u32)>>,
    /// A transfer made by another data path (see `grants.rs`): no primary rows, the CRCs come
    /// from it, the result goes to `reply`.
    grant: Option<grants::GrantState>,
    /// Per key, the CRC-32 of the row's bytes as the engine's staging copy computed it (a
    /// load through this tier's engine; see `IoCompletion::row_crc`; empty otherwise).
    row_crcs: Vec<Option<u32>>,
}

impl G3Job {
    /// A job of `n` keys; only a `load` through this tier's own engine (no `grant`) collects
    /// the engine's row CRCs.
    fn new(n: usize, load: bool, grant: Option<grants::GrantState>) -> Self {
        let row_crcs = if load && grant.is_none() {
            vec![None; n]
        } else {
            Vec::new()
        };
        G3Job {
            slots: vec![None; n],
            grant,
            row_crcs,
        }
    }
}

/// A started G3 job.
type Active = JobRun<G3Job>;

job_counters!(G3Metrics);

/// What the tier hands its worker at start.
pub(crate) struct WorkerInit {
    /// Shared state.
    pub sh: Arc<Shared>,
    /// The engine (its region is the tier's primary region).
    pub engine: Arc<dyn IoEngine>,
    /// The open slab files.
    pub set: SlabSet,
    /// Configuration.
    pub cfg: G3TierConfig,
    /// Where events go (with the tier's id and locality).
    pub events: EventSink,
    /// Commands from the tier.
    pub cmd_rx: Receiver<Cmd>,
    /// Store jobs from the tier (see the module docs).
    pub store_rx: Receiver<TransferJob>,
    /// Results to the tier.
    pub results_tx: Sender<JobResult>,
}

/// Everything the worker owns.
pub(crate) struct Worker {
    sh: Arc<Shared>,
    engine: Arc<dyn IoEngine>,
    set: SlabSet,
    cfg: G3TierConfig,
    tier_id: String,
    cmd_rx: Receiver<Cmd>,
    store_rx: Receiver<TransferJob>,
    results_tx: Sender<JobResult>,
    events: EventSink,
    journal: Option<JournalWriter>,
    dur: Durability,
    /// Jobs waiting to start and slot transfers waiting for the byte budget.
    jobs: JobQueue<IoRequest>,
    active: HashMap<u32, Active>,
    /// The requests `pump` submits in one call (kept to reuse its allocation).
    batch: Vec<IoRequest>,
    life: Lifecycle,
    /// The engine's completions (`never` once the engine is gone).
    completions: Receiver<IoCompletion>,
    /// False once the tier dropped its store channel.
    stores_open: bool,
    checkpoint_on_close: bool,
    /// When the worker last had something to do (start of its idle linger).
    last_work: Instant,
    /// Store jobs whose writes completed, waiting for the next group commit.
    commits: Vec<Active>,
    /// Jobs whose transfers all completed, finished (load CRC checks, commit queueing) once
    /// the budget they freed has been refilled with new submissions.
    completed: Vec<Active>,
    /// Granted transfers started and not finished, by serial.
    grants: HashMap<u32, Active>,
    /// Store jobs started since the last submission whose evictions wait in the journal's
    /// buffer (written by `flush_evictions` before their writes are submitted).
    evicting: Vec<u32>,
}

impl Worker {
    /// A worker that has not recovered yet.
    pub fn new(w: WorkerInit) -> Self {
        let stride = w.set.row_stride();
        Worker {
            jobs: JobQueue::new(w.cfg.max_bytes_in_flight_for(stride), stride),
            completions: w.engine.completions().clone(),
            sh: w.sh,
            engine: w.engine,
            set: w.set,
            cfg: w.cfg,
            tier_id: w.events.tier_id().to_string(),
            events: w.events,
            cmd_rx: w.cmd_rx,
            store_rx: w.store_rx,
            results_tx: w.results_tx,
            journal: None,
            dur: Durability::default(),
            active: HashMap::new(),
            batch: Vec::new(),
            life: Lifecycle::default(),
            stores_open: true,
            checkpoint_on_close: true,
            last_work: Instant::now(),
            commits: Vec::new(),
            completed: Vec::new(),
            grants: HashMap::new(),
            evicting: Vec::new(),
        }
    }

    /// The thread body.
    pub fn run(mut self) {
        if let Err(e) = self.recover() {
            log::error!(
                "G3 tier {}: index recovery failed, the tier serves no data: {e}",
                self.tier_id
            );
            self.sh
                .metrics
                .recovery_failed
                .store(true, Ordering::Relaxed);
            *self.sh.failed.lock() = Some(e);
        }
        self.sh.metrics.recovered.store(true, Ordering::Release);
        run_worker(&mut self);
    }

    /// What the worker listens to while it blocks (see the module docs), and handling what
    /// came.
    fn wait_for_work(&mut self) {
        let cmd_open = self.life.commands_open();
        let in_flight = self.jobs.in_flight();
        let tick_at = self.next_checkpoint_at();
        if in_flight == 0 && cmd_open && self.stores_open {
            // Nothing is coming from the engine: linger (see the module docs).
            let (cmds, stores) = (&self.cmd_rx, &self.store_rx);
            let naps = self.cfg.idle.linger(self.last_work, tick_at, || {
                !cmds.is_empty() || !stores.is_empty()
            });
            self.sh.metrics.idle_naps.fetch_add(naps, Ordering::Relaxed);
        }
        let tick = match tick_at {
            Some(at) => after(
                at.saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1)),
            ),
            None => never(),
        };
        // With several transfers in flight the next completion is never far: commands
        // (loads among them) are taken then, without waking the worker.
        let completion_soon = in_flight >= QUIET_IN_FLIGHT_ROWS * self.set.row_stride();
        let cmds = if cmd_open && !completion_soon {
            self.cmd_rx.clone()
        } else {
            never()
        };
        // With transfers in flight a completion is coming; stores wait for it.
        let stores = if self.stores_open && in_flight == 0 {
            self.store_rx.clone()
        } else {
            never()
        };
        crossbeam_channel::select! {
            recv(stores) -> job => match job {
                Ok(job) => {
                    self.last_work = Instant::now();
                    self.jobs.push_job(job, false);
                }
                // The tier is closing; its command channel says what to do next.
                Err(_) => self.stores_open = false,
            },
            recv(cmds) -> msg => match msg {
                Ok(cmd) => {
                    self.note_work(&cmd);
                    self.command(cmd);
                }
                Err(_) => {
                    self.life.commands_closed();
                    self.cancel_queued();
                }
            },
            recv(self.completions) -> c => match c {
                Ok(c) => {
                    self.last_work = Instant::now();
                    self.complete(c);
                    // Completions come in bursts (a merged device request ends many
                    // transfers): take every one that is there, so that the next `pump`
                    // starts the jobs they make room for together.
                    while let Ok(c) = self.completions.try_recv() {
                        self.complete(c);
                    }
                }
                Err(_) => {
                    // Never select on a disconnected channel again (it would spin).
                    self.completions = never();
                    self.engine_gone();
                }
            },
            recv(tick) -> _ => self.checkpoint_logged(),
        }
    }

    fn refresh_slot_gauges(&self, ix: &Index) {
        let free = ix.free_slots() as u64;
        self.sh.metrics.free_slots.store(free, Ordering::Relaxed);
        self.sh
            .metrics
            .used_slots
            .store(ix.total_slots() as u64 - free, Ordering::Relaxed);
    }

    /// A command other than a touch is work: the idle linger starts again from now.
    fn note_work(&mut self, cmd: &Cmd) {
        if !matches!(cmd, Cmd::Touch(_)) {
            self.last_work = Instant::now();
        }
    }

    fn command(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Load(job) => self.jobs.push_job(job, true),
            Cmd::Drain(ack) => {
                self.start_then_cancel_the_rest();
                self.life.drain(ack);
            }
            Cmd::GrantStart(start) => self.start_grant(start),
            Cmd::GrantFinish(outcome) => self.finish_grant(outcome),
            Cmd::Touch(keys) => {
                if let Some(ix) = self.sh.index.lock().as_mut() {
                    for k in &keys {
                        ix.touch(k);
                    }
                }
            }
            Cmd::Shutdown(ack, checkpoint) => {
                self.abandon_grants();
                self.start_then_cancel_the_rest();
                self.life.shutdown(ack);
                self.checkpoint_on_close = checkpoint;
            }
        }
    }

    /// Handles the commands waiting in their channel. False once the channel is disconnected.
    fn take_commands(&mut self) -> bool {
        loop {
            match self.cmd_rx.try_recv() {
                Ok(cmd) => {
                    self.note_work(&cmd);
                    self.command(cmd);
                }
                Err(crossbeam_channel::TryRecvError::Empty) => return true,
                Err(crossbeam_channel::TryRecvError::Disconnected) => return false,
            }
        }
    }

    /// For a drain or shutdown: every job submitted before it (stores from their channel
    /// too) starts if the byte budget allows, as if it had been picked up first; the rest is
    /// cancelled.
    fn start_then_cancel_the_rest(&mut self) {
        self.take_stores();
        self.pump();
        self.cancel_queued();
    }

    /// Moves the store jobs waiting in their channel to the queue (in arrival order).
    fn take_stores(&mut self) {
        while let Ok(job) = self.store_rx.try_recv() {
            self.jobs.push_job(job, false);
        }
    }

    fn cancel_queued(&mut self) {
        // Stores sent before the drain or shutdown command are already in their channel.
        self.take_stores();
        self.jobs
            .cancel_jobs("G3", &self.sh.metrics, &self.results_tx);
    }

    /// Submits queued operations while the byte budget allows, starting queued jobs as their
    /// turn comes. The evictions of the store jobs started here are journaled in one write
    /// before any transfer is submitted (`flush_evictions`, which drops the transfers of the
    /// keys that fail when it fails).
    fn pump(&mut self) {
        let mut batch = std::mem::take(&mut self.batch);
        while let Some(next) = self.jobs.next(&self.sh.metrics) {
            match next {
                Next::Unit(op) => batch.push(op),
                Next::Job(job, load) => self.start(job, load),
            }
        }
        self.flush_evictions(&mut batch);
        self.jobs.publish(&self.sh.metrics);
        if !batch.is_empty() {
            match self.engine.submit(&batch) {
                Ok(()) => {
                    // What follows is CRC work: the writes just submitted, then the loads
                    // that completed (about 3 us per 64 KiB row). The engine thread that
                    // hands this batch to the kernel is often runnable on this same CPU (the
                    // scheduler woke this worker where the completions were reaped): it goes
                    // first, so the device has the batch while the CRCs are computed. For
                    // reads too, at every row size: measured faster at 64 and 128 KiB as at
                    // 256 KiB and up (docs/performance.md, "Small rows").
                    std::thread::yield_now();
                    self.checksum_submitted_writes(&batch)
                }
                Err(e) => {
                    for op in &batch {
                        self.complete(IoCompletion {
                            tag: op.tag,
                            result: Err(e.duplicate()),
                            row_crc: None,
                        });
                    }
                }
            }
        }
        batch.clear();
        self.batch = batch;
    }

    /// Forgets the transfers tagged `tags`, never submitted (their keys failed): their jobs
    /// finish once nothing else of them is left. `charged`: they were taken from the queue
    /// (their bytes return to the budget).
    fn drop_unsent(&mut self, tags: impl IntoIterator<Item = u64>, charged: bool) {
        for tag in tags {
            if charged {
                self.jobs.release();
            }
            let (serial, _) = split_job_tag(tag);
            let Some(a) = self.active.get_mut(&serial) else {
                continue;
            };
            a.remaining -= 1;
            if a.remaining == 0
                && let Some(a) = self.active.remove(&serial)
            {
                self.completed.push(a);
            }
        }
    }

    fn start(&mut self, job: TransferJob, load: bool) {
        let serial = self.jobs.next_serial();
        let n = job.keys.len();
        let mut a = Active::of(job, load, G3Job::new(n, load, None), &self.sh.metrics);
        if a.rows.len() != n {
            let e = Error::new(
                ErrorKind::Contract,
                format!(
                    "job {} has {n} keys but {} chunk ids",
                    a.job_id,
                    a.rows.len()
                ),
            );
            (0..n).for_each(|i| a.fail(i, e.duplicate()));
        } else if let Some(e) = self.sh.failed.lock().as_ref() {
            (0..n).for_each(|i| a.fail(i, e.duplicate()));
        } else if load {
            self.prepare_load(&mut a);
        } else if self.prepare_store(&mut a, store::EvictionFlush::BeforeSubmit) {
            self.evicting.push(serial);
        }
        let stride = self.set.row_stride();
        // Slots may hold only a prefix of each row (`G3TierConfig::slot_bytes`).
        let region_stride = self.engine.region().row_stride() as usize;
        for i in 0..n {
            if a.status[i] != KeyStatus::Pending {
                continue;
            }
            let Some((slot, _)) = a.tier.slots[i] else {
                // Never report a key as moved that no transfer was issued for.
                let e = Error::new(ErrorKind::Internal, "no G3 slot was assigned to this key");
                a.fail(i, e.with("key", a.keys[i].to_hex()));
                continue;
            };
            let (file, file_offset) = slot_location(u64::from(slot), self.set.files.len(), stride);
            a.remaining += 1;
            self.jobs.push_unit(IoRequest {
                dir: if load { IoDir::Read } else { IoDir::Write },
                file,
                file_offset,
                region_offset: a.rows[i] as usize * region_stride,
                len: stride as usize,
                tag: job_tag(serial, i),
            });
        }
        if a.remaining == 0 {
            self.finish(a);
        } else {
            self.active.insert(serial, a);
        }
    }

    fn check_row(&self, row: u32) -> Result<()> {
        self.engine.region().row_offset(row as usize).map(|_| ())
    }

    fn complete(&mut self, c: IoCompletion) {
        let (serial, i) = split_job_tag(c.tag);
        let stride = self.set.row_stride();
        self.jobs.release();
        self.jobs.publish(&self.sh.metrics);
        let n_paths = self.set.files.len();
        let Some(a) = self.active.get_mut(&serial) else {
            log::error!("G3 worker: completion for unknown tag {:#x}", c.tag);
            return;
        };
        a.remaining -= 1;
        // A failed write of this worker's own takes its path out of service, unless the error
        // says nothing about the medium (interrupted, would block, cancelled): then only the
        // key fails.
        let failed_path = match (&c.result, a.load, a.tier.slots.get(i).copied().flatten()) {
            (Ok(n), false, Some((slot, _))) if *n as u64 != stride => Some(slot as usize % n_paths),
            (Err(e), false, Some((slot, _))) if !is_transient(e) => Some(slot as usize % n_paths),
            _ => None,
        };
        match c.result {
            Ok(n) if n as u64 == stride => {
                // A key that failed while its transfer was in flight stays failed.
                if a.status[i] == KeyStatus::Pending {
                    a.status[i] = KeyStatus::Done;
                }
                // The engine's staging copy checksummed the bytes it moved: a store's
                // bytes as written, a load's as they reached the row.
                match (a.load, c.row_crc, a.tier.slots.get(i).copied().flatten()) {
                    (true, crc, _) => {
                        if let Some(r) = a.tier.row_crcs.get_mut(i) {
                            *r = crc;
                        }
                    }
                    (false, Some(crc), Some((slot, _))) => {
                        a.tier.slots[i] = Some((
                            slot,
                            chunk_crc_from_row_crc(a.keys[i].as_bytes(), crc, stride),
                        ));
                    }
                    (false, None, Some((slot, _))) if self.engine.stages(stride as usize) => {
                        // Not checksummed at submission (see `checksum_submitted_writes`);
                        // the row is still pinned, so this is the CRC of the bytes written.
                        let region = self.engine.region();
                        // The row is pinned (no writer) until the job is reported.
                        match region.read_row(a.rows[i] as usize) {
                            Ok(bytes) => {
                                let stored = &bytes[..(stride as usize).min(bytes.len())];
                                let crc = chunk_crc(a.keys[i].as_bytes(), stored);
                                a.tier.slots[i] = Some((slot, crc));
                            }
                            Err(e) => a.fail(i, e),
                        }
                    }
                    _ => {}
                }
                a.bytes += stride;
                let ctr = if a.load {
                    &self.sh.metrics.bytes_read
                } else {
                    &self.sh.metrics.bytes_written
                };
                ctr.fetch_add(stride, Ordering::Relaxed);
            }
            Ok(n) => {
                self.sh.metrics.io_errors.fetch_add(1, Ordering::Relaxed);
                a.fail(
                    i,
                    Error::new(
                        ErrorKind::ShortIo,
                        format!("slab transfer moved {n} of {stride} bytes"),
                    ),
                );
            }
            Err(e) => {
                self.sh.metrics.io_errors.fetch_add(1, Ordering::Relaxed);
                a.fail(i, e);
            }
        }
        let done = a.remaining == 0;
        if let Some(path) = failed_path {
            let why = a.first_error.as_ref().map_or_else(
                || Error::new(ErrorKind::Io, "write failed"),
                Error::duplicate,
            );
            self.poison_path(path, &why);
        }
        if done && let Some(a) = self.active.remove(&serial) {
            self.completed.push(a);
        }
    }

    fn engine_gone(&mut self) {
        log::error!(
            "G3 tier {}: the I/O engine stopped; failing in-flight jobs",
            self.tier_id
        );
        let e = Error::new(ErrorKind::Closed, "the I/O engine stopped");
        *self.sh.failed.lock() = Some(e.duplicate());
        for a in std::mem::take(&mut self.completed) {
            self.finish(a);
        }
        let serials: Vec<u32> = self.active.keys().copied().collect();
        for s in serials {
            if let Some(mut a) = self.active.remove(&s) {
                for i in 0..a.keys.len() {
                    if a.status[i] == KeyStatus::Pending {
                        a.fail(i, e.duplicate());
                    }
                }
                self.finish(a);
            }
        }
        self.jobs.forget_units();
    }

    /// Marks `path` as taking no further writes, leaving its entries loadable.
    fn stop_writes_on(&mut self, path: usize, why: &Error) {
        if let Some(p) = self.sh.paths.get(path)
            && !p.poisoned.swap(true, Ordering::Relaxed)
        {
            log::error!(
                "G3 slab {} takes no further writes: {why}",
                self.set.files[path].path.display()
            );
            *p.problem.lock() = Some(why.to_string());
        }
        if let Some(ix) = self.sh.index.lock().as_mut() {
            ix.mark_path_dead(path);
        }
    }

    /// Takes a failed path out of service (fences it): no further writes go there, and every
    /// entry it holds leaves the index (a miss from now on, never a slot the eviction scan has
    /// to walk past), journaled as removals and announced as removed events. The other paths
    /// go on serving. Idempotent.
    fn poison_path(&mut self, path: usize, why: &Error) {
        let Some(p) = self.sh.paths.get(path) else {
            return;
        };
        if p.poisoned.swap(true, Ordering::Relaxed) {
            return;
        }
        *p.problem.lock() = Some(why.to_string());
        let dropped = {
            let mut guard = self.sh.index.lock();
            match guard.as_mut() {
                Some(ix) => {
                    let dropped = ix.fence_path(path);
                    self.refresh_slot_gauges(ix);
                    dropped
                }
                None => Vec::new(),
            }
        };
        let entries = match dropped.len() {
            1 => "1 entry was".to_string(),
            n => format!("{n} entries were"),
        };
        log::error!(
            "G3 slab {} (path {path}) fenced: {why}; no further writes go there, its {entries} \
             dropped from the index; the other paths keep serving",
            self.set.files[path].path.display(),
        );
        self.sh
            .metrics
            .entries_fenced
            .fetch_add(dropped.len() as u64, Ordering::Relaxed);
        self.journal_removals(dropped);
    }

    /// Journals the removal of entries `dropped` from the index and announces them as removed
    /// events. A journal that refuses the removals is repaired by the next checkpoint, which
    /// no longer holds these entries.
    fn journal_removals(&mut self, dropped: Vec<(ChunkKey, Slot)>) {
        if dropped.is_empty() {
            return;
        }
        let sync = self.cfg.fsync == crate::g3::config::FsyncPolicy::Always;
        if let Some(j) = self.journal.as_mut() {
            dropped.iter().for_each(|(_, s)| j.remove(*s));
            if j.flush(sync).is_err() {
                self.publish_journal_state();
            }
        }
        self.note_journal_len();
        self.event(dropped.into_iter().map(|(k, _)| k).collect(), true);
    }

    fn finish(&mut self, a: Active) {
        if a.load {
            self.finish_load(a);
            self.maybe_checkpoint();
        } else {
            self.finish_store(a);
        }
    }

    fn report(&mut self, mut a: Active, loaded: Option<Vec<ChunkKey>>) {
        let reply = a.tier.grant.take().and_then(|d| d.reply);
        let result = a.into_result(loaded, &self.sh.metrics);
        match reply {
            Some(reply) => {
                let _ = reply.send(result);
            }
            None => {
                let _ = self.results_tx.send(result);
            }
        }
    }

    fn event(&self, keys: Vec<ChunkKey>, removed: bool) {
        self.events.send(&self.sh.events, keys, removed);
    }
}

impl WorkerLoop for Worker {
    fn life(&mut self) -> &mut Lifecycle {
        &mut self.life
    }

    fn advance(&mut self) {
        if self.life.commands_open() && !self.take_commands() {
            self.life.commands_closed();
            self.cancel_queued();
        }
        self.take_stores();
        // Submit first, so that the device has work during the CRC checks that follow.
        self.pump();
        for a in std::mem::take(&mut self.completed) {
            self.finish(a);
        }
        // Group commit once the completions that are already there are handled (or when the
        // group is large).
        if !self.commits.is_empty()
            && (self.completions.is_empty() || self.commits.len() >= MAX_COMMIT_GROUP)
        {
            self.flush_commits();
        }
    }

    fn idle(&self) -> bool {
        self.active.is_empty()
            && self.completed.is_empty()
            && self.jobs.no_units()
            && self.jobs.no_jobs()
            && self.commits.is_empty()
    }

    fn close(&mut self) -> Result<()> {
        self.checkpoint_and_stop()
    }

    fn wait(&mut self) {
        self.wait_for_work();
    }
}
