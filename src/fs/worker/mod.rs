//! The tier's coordinator thread and its pool of I/O threads.
//!
//! A key's transfer goes through four hands, none of them the scheduler's:
//!
//! 1. The **coordinator** admits it while the bytes in flight stay under
//!    `max_bytes_in_flight` (stores and loads share the budget) and hands an open task to the
//!    pool.
//! 2. An **I/O thread** runs the blocking file steps: for a store, the temporary file (with
//!    its CRC record); for a load, open, size check and record ([`crate::fs::chunk_file`]).
//!    It attaches the file to the engine and reports back.
//! 3. The **I/O engine** (io_uring or psync, shared with nothing else) moves the row.
//! 4. An I/O thread finishes: detaches and closes the file, then publishes it (store) or
//!    checks the CRC (load). The coordinator updates the catalog, the job and the metrics.
//!
//! The coordinator blocks on its three channels (commands, finished steps, engine
//! completions); the I/O threads block on their task channel.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crossbeam_channel::{Receiver, Sender, never};
use parking_lot::Mutex;

use crate::contract::job::{JobResult, TransferJob};
use crate::contract::worker::{
    EventSink, JobQueue, JobRun, KeyStatus, Lifecycle, Next, WorkerLoop, job_counters, run_worker,
};
use crate::error::{Error, ErrorKind, Result};
use crate::fs::catalog::Catalog;
use crate::fs::chunk_file::{DirCache, PublishMode, Published};
use crate::fs::config::{FsSync, Integrity};
use crate::fs::mapper::FileMapper;
use crate::fs::metrics::FsMetrics;
use crate::io::{IoCompletion, IoDir, IoEngine, IoRequest, job_tag, split_job_tag};
use crate::key::ChunkKey;
use crate::region::PrimaryRegion;
use task::{KeyOutcome, Opened, Step, Task, run_task};

mod task;

/// A message from the tier (or its lookup and scan threads) to the coordinator.
pub(crate) enum Cmd {
    /// Primary -> files.
    Store(TransferJob),
    /// Files -> primary.
    Load(TransferJob),
    /// Complete files a lookup found (key, bytes).
    Seen(Vec<(ChunkKey, u64)>),
    /// Files the start-up scan found, newest first (key, bytes).
    Scanned(Vec<(ChunkKey, u64)>),
    /// Cancel queued jobs, wait for started ones, then signal.
    Drain(Sender<()>),
    /// Drain, stop the I/O threads and the engine, then signal and exit.
    Shutdown(Sender<Result<()>>),
}

/// What every thread of the tier shares.
pub(crate) struct Shared {
    /// Files this process knows, LRU first.
    pub catalog: Mutex<Catalog>,
    /// Metrics.
    pub metrics: FsMetrics,
    /// The vLLM naming.
    pub mapper: FileMapper,
    /// The primary region.
    pub region: Arc<PrimaryRegion>,
    /// The engine that moves the rows.
    pub engine: Arc<dyn IoEngine>,
    /// Whether chunk files are opened with O_DIRECT.
    pub direct: bool,
    /// How files are published.
    pub publish: PublishMode,
    /// Whether CRC records are written.
    pub integrity: Integrity,
    /// Durability of stored files.
    pub fsync: FsSync,
    /// Directories known to exist.
    pub dirs: DirCache,
    /// Whether stored / removed events are recorded (true until
    /// [`crate::fs::FsTier::set_events_enabled`] says otherwise).
    pub events: AtomicBool,
}

impl Shared {
    /// Bytes per chunk file (the row stride).
    pub fn stride(&self) -> u64 {
        self.region.row_stride()
    }

    /// Refreshes the catalog gauges.
    pub fn catalog_gauges(&self, c: &Catalog) {
        let m = &self.metrics;
        m.known_files.store(c.len() as u64, Ordering::Relaxed);
        m.known_bytes.store(c.bytes(), Ordering::Relaxed);
    }
}

/// A started fs job; `tier`: the keys now in the tier because of it (for the stored event,
/// which names those of them the tier still holds when the job is reported).
type Active = JobRun<Vec<ChunkKey>>;

job_counters!(FsMetrics);

/// Channels and settings the coordinator starts with.
pub(crate) struct WorkerInit {
    pub sh: Arc<Shared>,
    pub max_bytes_in_flight: u64,
    pub io_threads: usize,
    /// Where events go (with the tier's id and locality).
    pub events: EventSink,
    pub cmd_rx: Receiver<Cmd>,
    pub results_tx: Sender<JobResult>,
    /// Keys this process evicted or found bad, for the lookup verdict cache.
    pub invalidated_tx: Sender<Vec<ChunkKey>>,
}

/// The coordinator's state.
pub(crate) struct Worker {
    sh: Arc<Shared>,
    tier_id: String,
    cmd_rx: Receiver<Cmd>,
    results_tx: Sender<JobResult>,
    events: EventSink,
    invalidated_tx: Sender<Vec<ChunkKey>>,
    tasks_tx: Option<Sender<Task>>,
    steps_rx: Receiver<Step>,
    pool: Vec<std::thread::JoinHandle<()>>,
    /// Jobs waiting to start and keys (tags) waiting for the byte budget.
    jobs: JobQueue<u64>,
    active: HashMap<u32, Active>,
    /// Keys whose row the engine is moving: what the finish step needs.
    moving: HashMap<u64, (usize, Opened)>,
    /// Files being removed, each with the store keys (tags) that wait for the removal: a
    /// store must not find the file about to go and take it for its own.
    evicting: HashMap<ChunkKey, Vec<u64>>,
    life: Lifecycle,
    /// The engine's completions (`never` once the engine is gone).
    completions: Receiver<IoCompletion>,
}

impl Worker {
    /// Starts the I/O threads; the coordinator runs when [`Worker::run`] is called.
    pub fn spawn_pool(w: WorkerInit) -> Result<Self> {
        let (tasks_tx, tasks_rx) = crossbeam_channel::unbounded::<Task>();
        let (steps_tx, steps_rx) = crossbeam_channel::unbounded::<Step>();
        let mut pool = Vec::new();
        for i in 0..w.io_threads.max(1) {
            let rx = tasks_rx.clone();
            let tx = steps_tx.clone();
            let sh = w.sh.clone();
            let name = format!("kvtier-fs-io-{i}");
            let h = crate::io::spawn_io_thread(name, move || {
                while let Ok(task) = rx.recv() {
                    // The coordinator outlives its pool.
                    let _ = tx.send(run_task(&sh, task));
                }
            })
            .map_err(|e| {
                Error::new(ErrorKind::Io, format!("cannot start an fs I/O thread: {e}"))
                    .with_source(e)
            })?;
            pool.push(h);
        }
        Ok(Worker {
            jobs: JobQueue::new(w.max_bytes_in_flight, w.sh.stride()),
            completions: w.sh.engine.completions().clone(),
            sh: w.sh,
            tier_id: w.events.tier_id().to_string(),
            events: w.events,
            cmd_rx: w.cmd_rx,
            results_tx: w.results_tx,
            invalidated_tx: w.invalidated_tx,
            tasks_tx: Some(tasks_tx),
            steps_rx,
            pool,
            active: HashMap::new(),
            moving: HashMap::new(),
            evicting: HashMap::new(),
            life: Lifecycle::default(),
        })
    }

    /// The coordinator's thread body.
    pub fn run(mut self) {
        run_worker(&mut self);
    }

    /// Blocks on the commands, the finished steps and the engine's completions, and handles
    /// what came.
    fn wait_for_work(&mut self) {
        let cmds = if self.life.commands_open() && !self.life.stopping() {
            self.cmd_rx.clone()
        } else {
            never()
        };
        crossbeam_channel::select! {
            recv(cmds) -> msg => match msg {
                Ok(cmd) => self.command(cmd),
                Err(_) => {
                    self.life.commands_closed();
                    self.cancel_queued();
                }
            },
            recv(self.steps_rx) -> step => {
                if let Ok(step) = step {
                    self.step(step);
                }
            }
            recv(self.completions) -> c => match c {
                Ok(c) => self.completion(c),
                Err(_) => {
                    self.completions = never();
                    self.engine_gone();
                }
            },
        }
    }

    fn command(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Store(job) => self.jobs.push_job(job, false),
            Cmd::Load(job) => self.jobs.push_job(job, true),
            Cmd::Seen(files) => self.learn(files, false),
            Cmd::Scanned(files) => self.learn(files, true),
            Cmd::Drain(ack) => {
                self.pump();
                self.cancel_queued();
                self.life.drain(ack);
            }
            Cmd::Shutdown(ack) => {
                self.pump();
                self.cancel_queued();
                self.life.shutdown(ack);
            }
        }
    }

    /// Adds files found by a lookup (`cold` false: just used) or by the start-up scan (`cold`:
    /// behind everything, newest first), except those being removed; then evicts if needed.
    fn learn(&mut self, files: Vec<(ChunkKey, u64)>, cold: bool) {
        let mut c = self.sh.catalog.lock();
        for (key, bytes) in files {
            if self.evicting.contains_key(&key) {
                continue;
            }
            if cold {
                c.insert_cold(key, bytes);
            } else {
                c.insert(key, bytes);
            }
        }
        drop(c);
        self.evict();
    }

    fn cancel_queued(&mut self) {
        self.jobs
            .cancel_jobs("fs", &self.sh.metrics, &self.results_tx);
    }

    fn send_task(&self, task: Task) {
        if let Some(tx) = &self.tasks_tx {
            // The pool lives until `close`, after every task has been sent.
            let _ = tx.send(task);
        }
    }

    /// Hands waiting keys to the pool while the byte budget allows, starting queued jobs as
    /// their turn comes.
    fn pump(&mut self) {
        while let Some(next) = self.jobs.next(&self.sh.metrics) {
            match next {
                Next::Unit(tag) => self.dispatch_open(tag),
                Next::Job(job, load) => self.start_job(job, load),
            }
        }
        self.jobs.publish(&self.sh.metrics);
    }

    fn dispatch_open(&mut self, tag: u64) {
        let (serial, i) = split_job_tag(tag);
        let Some(a) = self.active.get_mut(&serial) else {
            return;
        };
        let key = a.keys[i].clone();
        let row = a.rows[i];
        let path = match self.sh.mapper.file_path(&key) {
            Ok(p) => p,
            Err(e) => {
                a.fail_key(i, e);
                // Nothing went in flight for it.
                self.jobs.release();
                self.key_done(serial);
                return;
            }
        };
        a.status[i] = KeyStatus::Running;
        if a.load {
            self.sh.catalog.lock().pin(&key);
            self.send_task(Task::OpenLoad { tag, path, row });
        } else {
            self.send_task(Task::OpenStore {
                tag,
                dest: path,
                row,
            });
        }
    }

    fn start_job(&mut self, job: TransferJob, load: bool) {
        let serial = self.jobs.next_serial();
        let n = job.keys.len();
        let mut a = Active::of(job, load, Vec::new(), &self.sh.metrics);
        {
            let mut catalog = self.sh.catalog.lock();
            for i in 0..n {
                if let Err(e) = self.sh.region.row_offset(a.rows[i] as usize) {
                    a.fail_key(i, e);
                    continue;
                }
                // A store of a file this process knows writes nothing (content addresses).
                if !load && catalog.touch(&a.keys[i]) {
                    a.skip(i, &self.sh.metrics.stores_skipped);
                    continue;
                }
                a.remaining += 1;
                let tag = job_tag(serial, i);
                match self.evicting.get_mut(&a.keys[i]) {
                    // A store of a file being removed starts once it is gone.
                    Some(parked) if !load => parked.push(tag),
                    _ => self.jobs.push_unit(tag),
                }
            }
        }
        if a.remaining == 0 {
            self.report(a);
        } else {
            self.active.insert(serial, a);
        }
    }

    fn step(&mut self, step: Step) {
        match step {
            Step::Opened { tag, file, then } => {
                let (serial, i) = split_job_tag(tag);
                let Some(a) = self.active.get(&serial) else {
                    return;
                };
                let req = IoRequest {
                    dir: if a.load { IoDir::Read } else { IoDir::Write },
                    file,
                    file_offset: 0,
                    region_offset: a.rows[i] as usize * self.sh.stride() as usize,
                    len: self.sh.stride() as usize,
                    tag,
                };
                self.moving.insert(tag, (file, then));
                if let Err(e) = self.sh.engine.submit(&[req]) {
                    self.completion(IoCompletion {
                        tag,
                        result: Err(e),
                        row_crc: None,
                    });
                }
            }
            Step::Finished { tag, outcome } => self.finished(tag, outcome),
            Step::Evicted { key, result } => {
                for tag in self.evicting.remove(&key).unwrap_or_default() {
                    self.jobs.push_unit_front(tag);
                }
                let m = &self.sh.metrics;
                m.evictions_in_flight
                    .store(self.evicting.len() as u64, Ordering::Relaxed);
                match result {
                    Ok(()) => {
                        m.evictions.fetch_add(1, Ordering::Relaxed);
                        self.event(vec![key], true);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        // Another host removed it first: gone all the same.
                        m.evictions.fetch_add(1, Ordering::Relaxed);
                        self.event(vec![key], true);
                    }
                    Err(e) => {
                        if m.eviction_failures.fetch_add(1, Ordering::Relaxed) == 0 {
                            log::error!(
                                "fs tier {}: cannot remove a chunk file to stay within \
                                 capacity: {e} (logged once; see fs_eviction_failures)",
                                self.tier_id
                            );
                        }
                    }
                }
            }
        }
    }

    fn completion(&mut self, c: IoCompletion) {
        let Some((file, opened)) = self.moving.remove(&c.tag) else {
            log::error!("fs worker: completion for unknown tag {:#x}", c.tag);
            return;
        };
        let stride = self.sh.stride();
        let io = match c.result {
            Ok(n) if n as u64 == stride => Ok(n),
            Ok(n) => Err(Error::new(
                ErrorKind::ShortIo,
                format!("chunk transfer moved {n} of {stride} bytes"),
            )),
            Err(e) => Err(e),
        };
        let task = match opened {
            Opened::Store { tmp, dest } => Task::FinishStore {
                tag: c.tag,
                file,
                tmp,
                dest,
                io,
            },
            Opened::Load {
                path,
                record,
                identity,
                row,
            } => Task::FinishLoad {
                tag: c.tag,
                file,
                path,
                record,
                identity,
                row,
                io,
                row_crc: c.row_crc,
            },
        };
        self.send_task(task);
    }

    fn finished(&mut self, tag: u64, outcome: Result<KeyOutcome>) {
        let stride = self.sh.stride();
        self.jobs.release();
        let (serial, i) = split_job_tag(tag);
        let Some(a) = self.active.get_mut(&serial) else {
            log::error!("fs worker: finished step for unknown tag {tag:#x}");
            return;
        };
        let key = a.keys[i].clone();
        let m = &self.sh.metrics;
        let mut invalidate = false;
        // A file this process is removing is not known any more, whatever this key did.
        let removing = self.evicting.contains_key(&key);
        {
            let mut catalog = self.sh.catalog.lock();
            if a.load {
                catalog.unpin(&key);
            }
            match outcome {
                Ok(KeyOutcome::Stored(p)) => {
                    a.status[i] = KeyStatus::Done;
                    a.bytes += stride;
                    a.tier.push(key.clone());
                    if !removing {
                        catalog.insert(key, stride);
                    }
                    m.bytes_written.fetch_add(stride, Ordering::Relaxed);
                    match p {
                        Published::New => m.files_stored.fetch_add(1, Ordering::Relaxed),
                        Published::AlreadyThere => m.store_races.fetch_add(1, Ordering::Relaxed),
                    };
                }
                Ok(KeyOutcome::Present) => {
                    a.status[i] = KeyStatus::Skipped;
                    a.tier.push(key.clone());
                    if !removing {
                        catalog.insert(key, stride);
                    }
                    m.stores_skipped.fetch_add(1, Ordering::Relaxed);
                }
                Ok(KeyOutcome::Loaded { verified }) => {
                    a.status[i] = KeyStatus::Done;
                    a.bytes += stride;
                    if !removing {
                        catalog.insert(key, stride);
                    }
                    m.bytes_read.fetch_add(stride, Ordering::Relaxed);
                    let ctr = if verified {
                        &m.files_loaded_verified
                    } else {
                        &m.files_loaded_unverified
                    };
                    ctr.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    m.key_failures.fetch_add(1, Ordering::Relaxed);
                    match e.kind() {
                        ErrorKind::Checksum => &m.checksum_failures,
                        ErrorKind::Corrupt => &m.corrupt_files,
                        ErrorKind::InvalidPath => &m.missing_files,
                        _ => &m.io_errors,
                    }
                    .fetch_add(1, Ordering::Relaxed);
                    if a.load {
                        // Whatever is at that name now, this process does not trust it.
                        catalog.remove(&key);
                        invalidate = true;
                    }
                    a.fail_key(i, e);
                }
            }
            self.sh.catalog_gauges(&catalog);
        }
        if invalidate {
            let _ = self.invalidated_tx.send(vec![a.keys[i].clone()]);
        }
        self.key_done(serial);
        self.evict();
    }

    /// One key of job `serial` is finished.
    fn key_done(&mut self, serial: u32) {
        let Some(a) = self.active.get_mut(&serial) else {
            return;
        };
        a.remaining -= 1;
        if a.remaining == 0
            && let Some(a) = self.active.remove(&serial)
        {
            self.report(a);
        }
    }

    fn report(&mut self, a: Active) {
        // Events off (the fs tier's default): nothing to announce, so no catalog lock either.
        if !a.load && self.sh.events.load(Ordering::Relaxed) {
            // Only the keys the tier still holds: a key of this job may have finished long
            // before its last one (the engine completes requests in any order, and the uring
            // engine's staging queues large ones for its slots) and been evicted meanwhile, its
            // removed event already sent. Announcing it now would leave every consumer of the
            // events believing the tier holds a file it removed.
            let held: Vec<ChunkKey> = {
                let c = self.sh.catalog.lock();
                a.tier.iter().filter(|k| c.contains(k)).cloned().collect()
            };
            if !held.is_empty() {
                self.event(held, false);
            }
        }
        let loaded = a.load.then(|| a.done_keys());
        let result = a.into_result(loaded, &self.sh.metrics);
        let _ = self.results_tx.send(result);
    }

    /// Removes the least recently used files while the known bytes exceed the capacity.
    fn evict(&mut self) {
        let victims = {
            let mut c = self.sh.catalog.lock();
            let v = c.take_victims();
            self.sh.catalog_gauges(&c);
            v
        };
        if victims.is_empty() {
            return;
        }
        let _ = self.invalidated_tx.send(victims.clone());
        for key in victims {
            if let Ok(path) = self.sh.mapper.file_path(&key) {
                self.evicting.insert(key.clone(), Vec::new());
                self.send_task(Task::Evict { key, path });
            }
        }
        self.sh
            .metrics
            .evictions_in_flight
            .store(self.evicting.len() as u64, Ordering::Relaxed);
    }

    fn event(&self, keys: Vec<ChunkKey>, removed: bool) {
        self.events.send(&self.sh.events, keys, removed);
    }

    fn engine_gone(&mut self) {
        log::error!(
            "fs tier {}: the I/O engine stopped; failing transfers in flight",
            self.tier_id
        );
        *self.sh.metrics.failed.lock() = Some("its I/O engine stopped".to_string());
        let tags: Vec<u64> = self.moving.keys().copied().collect();
        for tag in tags {
            self.completion(IoCompletion {
                tag,
                result: Err(Error::new(ErrorKind::Closed, "the I/O engine stopped")),
                row_crc: None,
            });
        }
    }

    fn stop_pool(&mut self) -> Result<()> {
        // Every job is finished: the pool has nothing left but to exit.
        drop(self.tasks_tx.take());
        let mut panicked = false;
        for h in self.pool.drain(..) {
            panicked |= h.join().is_err();
        }
        self.sh.engine.shutdown();
        if panicked {
            return Err(Error::new(
                ErrorKind::Internal,
                "an fs I/O thread panicked; I/O may still reference the primary region",
            ));
        }
        Ok(())
    }
}

impl WorkerLoop for Worker {
    fn life(&mut self) -> &mut Lifecycle {
        &mut self.life
    }

    fn advance(&mut self) {
        self.pump();
    }

    fn idle(&self) -> bool {
        self.active.is_empty() && self.jobs.no_jobs() && self.evicting.is_empty()
    }

    fn close(&mut self) -> Result<()> {
        self.stop_pool()
    }

    fn wait(&mut self) {
        self.wait_for_work();
    }
}

#[cfg(test)]
mod tests;
