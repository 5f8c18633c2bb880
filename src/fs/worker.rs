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

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender, never};
use parking_lot::Mutex;

use crate::contract::job::{JobResult, Locality, Medium, OffloadingEvent, TransferJob};
use crate::error::{Error, ErrorKind, Result};
use crate::fs::catalog::Catalog;
use crate::fs::chunk_file::{self, DirCache, LoadFile, PublishMode, Published, discard_temp};
use crate::fs::config::{FsSync, Integrity};
use crate::fs::integrity::CrcRecord;
use crate::fs::mapper::FileMapper;
use crate::fs::metrics::FsMetrics;
use crate::io::{IoCompletion, IoDir, IoEngine, IoRequest, job_tag, split_job_tag};
use crate::key::ChunkKey;
use crate::region::PrimaryRegion;

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

/// Blocking file work for an I/O thread.
enum Task {
    OpenStore {
        tag: u64,
        dest: PathBuf,
        row: u32,
    },
    OpenLoad {
        tag: u64,
        path: PathBuf,
        row: u32,
    },
    FinishStore {
        tag: u64,
        file: usize,
        tmp: PathBuf,
        dest: PathBuf,
        io: Result<usize>,
    },
    FinishLoad {
        tag: u64,
        file: usize,
        path: PathBuf,
        record: Option<CrcRecord>,
        identity: (u64, u64),
        row: u32,
        io: Result<usize>,
    },
    Evict {
        key: ChunkKey,
        path: PathBuf,
    },
}

/// What an open step leaves for the finish step.
enum Opened {
    Store {
        tmp: PathBuf,
        dest: PathBuf,
    },
    Load {
        path: PathBuf,
        record: Option<CrcRecord>,
        identity: (u64, u64),
        row: u32,
    },
}

/// How a key ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyOutcome {
    /// The store published this file, or found another writer's file there meanwhile.
    Stored(Published),
    /// A complete file was there before the store started: nothing was written.
    Present,
    /// The load's bytes are in the row; `verified` when a CRC record matched.
    Loaded { verified: bool },
}

/// What an I/O thread reports.
enum Step {
    /// The file is open and attached as engine file `file`: the row moves next.
    Opened { tag: u64, file: usize, then: Opened },
    /// The key is finished.
    Finished {
        tag: u64,
        outcome: Result<KeyOutcome>,
    },
    /// An eviction's unlink returned.
    Evicted {
        key: ChunkKey,
        result: std::io::Result<()>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyStatus {
    Waiting,
    Running,
    Skipped,
    Done,
    Failed,
}

struct Active {
    job_id: u64,
    load: bool,
    keys: Vec<ChunkKey>,
    rows: Vec<u32>,
    status: Vec<KeyStatus>,
    remaining: usize,
    bytes: u64,
    started: Instant,
    first_error: Option<Error>,
    /// Keys now in the tier because of this job (for the stored event, which names those of
    /// them the tier still holds when the job is reported).
    stored: Vec<ChunkKey>,
}

impl Active {
    fn fail(&mut self, i: usize, e: Error) {
        self.status[i] = KeyStatus::Failed;
        if self.first_error.is_none() {
            self.first_error = Some(e.with("key", self.keys[i].to_hex()));
        }
    }
}

/// Channels and settings the coordinator starts with.
pub(crate) struct WorkerInit {
    pub sh: Arc<Shared>,
    pub max_bytes_in_flight: u64,
    pub io_threads: usize,
    pub tier_id: String,
    pub locality: Option<Locality>,
    pub cmd_rx: Receiver<Cmd>,
    pub results_tx: Sender<JobResult>,
    pub events_tx: Sender<OffloadingEvent>,
    /// Keys this process evicted or found bad, for the lookup verdict cache.
    pub invalidated_tx: Sender<Vec<ChunkKey>>,
}

/// The coordinator's state.
pub(crate) struct Worker {
    sh: Arc<Shared>,
    cap: u64,
    tier_id: String,
    locality: Option<Locality>,
    cmd_rx: Receiver<Cmd>,
    results_tx: Sender<JobResult>,
    events_tx: Sender<OffloadingEvent>,
    invalidated_tx: Sender<Vec<ChunkKey>>,
    tasks_tx: Option<Sender<Task>>,
    steps_rx: Receiver<Step>,
    pool: Vec<std::thread::JoinHandle<()>>,
    queue: VecDeque<(TransferJob, bool)>,
    active: HashMap<u32, Active>,
    next_serial: u32,
    waiting: VecDeque<u64>,
    /// Keys whose row the engine is moving: what the finish step needs.
    moving: HashMap<u64, (usize, Opened)>,
    in_flight: u64,
    /// Files being removed, each with the store keys (tags) that wait for the removal: a
    /// store must not find the file about to go and take it for its own.
    evicting: HashMap<ChunkKey, Vec<u64>>,
    drain_waiters: Vec<Sender<()>>,
    shutdown_ack: Option<Sender<Result<()>>>,
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
            sh: w.sh,
            cap: w.max_bytes_in_flight,
            tier_id: w.tier_id,
            locality: w.locality,
            cmd_rx: w.cmd_rx,
            results_tx: w.results_tx,
            events_tx: w.events_tx,
            invalidated_tx: w.invalidated_tx,
            tasks_tx: Some(tasks_tx),
            steps_rx,
            pool,
            queue: VecDeque::new(),
            active: HashMap::new(),
            next_serial: 0,
            waiting: VecDeque::new(),
            moving: HashMap::new(),
            in_flight: 0,
            evicting: HashMap::new(),
            drain_waiters: Vec::new(),
            shutdown_ack: None,
        })
    }

    /// The coordinator's thread body.
    pub fn run(mut self) {
        let mut completions = self.sh.engine.completions().clone();
        let mut cmd_open = true;
        loop {
            self.pump();
            if self.idle() {
                for w in self.drain_waiters.drain(..) {
                    let _ = w.send(());
                }
                if self.shutdown_ack.is_some() || !cmd_open {
                    let result = self.close();
                    if let Some(ack) = self.shutdown_ack.take() {
                        let _ = ack.send(result);
                    }
                    return;
                }
            }
            let cmds = if cmd_open && self.shutdown_ack.is_none() {
                self.cmd_rx.clone()
            } else {
                never()
            };
            crossbeam_channel::select! {
                recv(cmds) -> msg => match msg {
                    Ok(cmd) => self.command(cmd),
                    Err(_) => {
                        cmd_open = false;
                        self.cancel_queued();
                    }
                },
                recv(self.steps_rx) -> step => {
                    if let Ok(step) = step {
                        self.step(step);
                    }
                }
                recv(completions) -> c => match c {
                    Ok(c) => self.completion(c),
                    Err(_) => {
                        completions = never();
                        self.engine_gone();
                    }
                },
            }
        }
    }

    fn idle(&self) -> bool {
        self.active.is_empty() && self.queue.is_empty() && self.evicting.is_empty()
    }

    fn command(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Store(job) => self.queue.push_back((job, false)),
            Cmd::Load(job) => self.queue.push_back((job, true)),
            Cmd::Seen(files) => self.learn(files, false),
            Cmd::Scanned(files) => self.learn(files, true),
            Cmd::Drain(ack) => {
                self.pump();
                self.cancel_queued();
                self.drain_waiters.push(ack);
            }
            Cmd::Shutdown(ack) => {
                self.pump();
                self.cancel_queued();
                self.shutdown_ack = Some(ack);
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
        while let Some((job, _)) = self.queue.pop_front() {
            let m = &self.sh.metrics;
            m.queued_jobs.fetch_sub(1, Ordering::Relaxed);
            m.jobs_cancelled.fetch_add(1, Ordering::Relaxed);
            let e = Error::new(
                ErrorKind::Cancelled,
                format!(
                    "fs job {} was cancelled by a drain before it started",
                    job.job_id
                ),
            );
            let _ = self.results_tx.send(JobResult::failed(job.job_id, e));
        }
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
        let stride = self.sh.stride();
        loop {
            if let Some(&tag) = self.waiting.front() {
                if self.in_flight > 0 && self.in_flight + stride > self.cap {
                    break;
                }
                self.waiting.pop_front();
                self.dispatch_open(tag);
                continue;
            }
            if self.in_flight >= self.cap {
                break;
            }
            let Some((job, load)) = self.queue.pop_front() else {
                break;
            };
            self.sh.metrics.queued_jobs.fetch_sub(1, Ordering::Relaxed);
            self.start_job(job, load);
        }
        self.sh
            .metrics
            .bytes_in_flight
            .store(self.in_flight, Ordering::Relaxed);
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
                a.fail(i, e);
                self.key_done(serial);
                return;
            }
        };
        a.status[i] = KeyStatus::Running;
        self.in_flight += self.sh.stride();
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
        let serial = self.next_serial;
        self.next_serial = self.next_serial.wrapping_add(1);
        let n = job.keys.len();
        let mut a = Active {
            job_id: job.job_id,
            load,
            keys: job.keys,
            rows: job.chunk_ids,
            status: vec![KeyStatus::Waiting; n],
            remaining: 0,
            bytes: 0,
            started: Instant::now(),
            first_error: None,
            stored: Vec::new(),
        };
        self.sh.metrics.active_jobs.fetch_add(1, Ordering::Relaxed);
        {
            let mut catalog = self.sh.catalog.lock();
            for i in 0..n {
                if let Err(e) = self.sh.region.row_offset(a.rows[i] as usize) {
                    a.fail(i, e);
                    continue;
                }
                // A store of a file this process knows writes nothing (content addresses).
                if !load && catalog.touch(&a.keys[i]) {
                    a.status[i] = KeyStatus::Skipped;
                    self.sh
                        .metrics
                        .stores_skipped
                        .fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                a.remaining += 1;
                let tag = job_tag(serial, i);
                match self.evicting.get_mut(&a.keys[i]) {
                    // A store of a file being removed starts once it is gone.
                    Some(parked) if !load => parked.push(tag),
                    _ => self.waiting.push_back(tag),
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
                    self.waiting.push_front(tag);
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
            },
        };
        self.send_task(task);
    }

    fn finished(&mut self, tag: u64, outcome: Result<KeyOutcome>) {
        let stride = self.sh.stride();
        self.in_flight = self.in_flight.saturating_sub(stride);
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
                    a.stored.push(key.clone());
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
                    a.stored.push(key.clone());
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
                    a.fail(i, e);
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
        let ok = a
            .status
            .iter()
            .all(|s| matches!(s, KeyStatus::Done | KeyStatus::Skipped));
        let elapsed = a.started.elapsed();
        if !a.load {
            // Only the keys the tier still holds: a key of this job may have finished long
            // before its last one (the engine completes requests in any order, and the uring
            // engine's staging queues large ones for its slots) and been evicted meanwhile, its
            // removed event already sent. Announcing it now would leave every consumer of the
            // events believing the tier holds a file it removed.
            let held: Vec<ChunkKey> = {
                let c = self.sh.catalog.lock();
                a.stored.iter().filter(|k| c.contains(k)).cloned().collect()
            };
            if !held.is_empty() {
                self.event(held, false);
            }
        }
        let result = if ok {
            JobResult::ok(a.job_id, elapsed, a.bytes)
        } else {
            let loaded: Vec<ChunkKey> = if a.load {
                a.keys
                    .iter()
                    .zip(&a.status)
                    .filter(|(_, s)| **s == KeyStatus::Done)
                    .map(|(k, _)| k.clone())
                    .collect()
            } else {
                Vec::new()
            };
            JobResult {
                job_id: a.job_id,
                success: false,
                successful_keys: (!loaded.is_empty()).then_some(loaded),
                transfer_time: Some(elapsed),
                transfer_bytes: Some(a.bytes),
                error: a.first_error,
            }
        };
        self.sh.metrics.active_jobs.fetch_sub(1, Ordering::Relaxed);
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
        if !self.sh.events.load(Ordering::Relaxed) {
            return;
        }
        let _ = self.events_tx.send(OffloadingEvent {
            keys,
            medium: Medium::Storage,
            removed,
            locality: self.locality,
            ownership: Some(self.tier_id.clone()),
            removal_expected: true,
            metadata_only: false,
        });
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

    fn close(&mut self) -> Result<()> {
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

/// Runs one task on an I/O thread.
fn run_task(sh: &Shared, task: Task) -> Step {
    match task {
        Task::OpenStore { tag, dest, row } => match open_store(sh, &dest, row) {
            Ok(None) => Step::Finished {
                tag,
                outcome: Ok(KeyOutcome::Present),
            },
            Ok(Some((file, tmp))) => Step::Opened {
                tag,
                file,
                then: Opened::Store { tmp, dest },
            },
            Err(e) => Step::Finished {
                tag,
                outcome: Err(e),
            },
        },
        Task::OpenLoad { tag, path, row } => match open_load(sh, &path) {
            Ok((file, record, identity)) => Step::Opened {
                tag,
                file,
                then: Opened::Load {
                    path,
                    record,
                    identity,
                    row,
                },
            },
            Err(e) => Step::Finished {
                tag,
                outcome: Err(e),
            },
        },
        Task::FinishStore {
            tag,
            file,
            tmp,
            dest,
            io,
        } => Step::Finished {
            tag,
            outcome: finish_store(sh, file, &tmp, &dest, io).map(KeyOutcome::Stored),
        },
        Task::FinishLoad {
            tag,
            file,
            path,
            record,
            identity,
            row,
            io,
        } => Step::Finished {
            tag,
            outcome: finish_load(sh, file, &path, record, identity, row, io),
        },
        Task::Evict { key, path } => Step::Evicted {
            key,
            result: std::fs::remove_file(&path),
        },
    }
}

/// `None` when a complete file is there already; else the attached temporary file.
fn open_store(sh: &Shared, dest: &std::path::Path, row: u32) -> Result<Option<(usize, PathBuf)>> {
    if chunk_file::check_existing(dest, sh.stride()) {
        return Ok(None);
    }
    let record = match sh.integrity {
        Integrity::Xattr => {
            // The manager pinned this row for the job until it is reported, which
            // happens only after this step: nothing writes it meanwhile.
            let bytes = sh.region.read_row(row as usize)?;
            Some(CrcRecord::of(&bytes))
        }
        Integrity::None => None,
    };
    let (file, tmp) = chunk_file::create_temp(dest, sh.direct, &sh.dirs, record)?;
    match sh
        .engine
        .attach_file(file, tmp.display().to_string(), sh.direct)
    {
        Ok(id) => Ok(Some((id, tmp))),
        Err(e) => {
            discard_temp(&tmp);
            Err(e)
        }
    }
}

/// The attached file, its CRC record and its identity.
fn open_load(
    sh: &Shared,
    path: &std::path::Path,
) -> Result<(usize, Option<CrcRecord>, (u64, u64))> {
    let LoadFile {
        file,
        record,
        identity,
    } = chunk_file::open_for_load(path, sh.stride(), sh.direct)?;
    let id = sh
        .engine
        .attach_file(file, path.display().to_string(), sh.direct)?;
    Ok((id, record, identity))
}

fn finish_store(
    sh: &Shared,
    file: usize,
    tmp: &std::path::Path,
    dest: &std::path::Path,
    io: Result<usize>,
) -> Result<Published> {
    let synced = match (&io, sh.fsync) {
        (Ok(_), FsSync::Always) => sh.engine.sync_data(file),
        _ => Ok(()),
    };
    let detached = sh.engine.detach_file(file);
    let outcome = io.and(synced).and(detached.map(drop));
    if let Err(e) = outcome {
        discard_temp(tmp);
        return Err(e);
    }
    let published = chunk_file::publish(tmp, dest, sh.publish)?;
    if sh.fsync == FsSync::Always
        && let Some(dir) = dest.parent()
    {
        crate::g3::dirs::sync_dir(dir)?;
    }
    Ok(published)
}

fn finish_load(
    sh: &Shared,
    file: usize,
    path: &std::path::Path,
    record: Option<CrcRecord>,
    identity: (u64, u64),
    row: u32,
    io: Result<usize>,
) -> Result<KeyOutcome> {
    let detached = sh.engine.detach_file(file);
    io?;
    detached?;
    let Some(rec) = record else {
        return Ok(KeyOutcome::Loaded { verified: false });
    };
    // The row is reserved for this job until it is reported (after this step), and
    // the engine's write into it has completed: nothing else writes it now.
    let bytes = sh.region.read_row(row as usize)?;
    let found = crc32fast::hash(&bytes);
    if found == rec.crc {
        return Ok(KeyOutcome::Loaded { verified: true });
    }
    // A corrupt file: remove it (unless another host replaced it meanwhile) so that no host
    // keeps trying it.
    let removed = chunk_file::remove_if_same(path, identity);
    Err(Error::new(
        ErrorKind::Checksum,
        format!("chunk file {} failed its CRC32 check", path.display()),
    )
    .with("path", path.display().to_string())
    .with("expected", format!("{:08x}", rec.crc))
    .with("found", format!("{found:08x}"))
    .with("removed", removed.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::{EngineOptions, IoEngineKind, open_engine};
    use serde_json::json;
    use std::collections::HashSet;
    use std::time::Duration;

    const STRIDE: usize = 4096;

    fn key(n: u8) -> ChunkKey {
        ChunkKey::new(vec![n, 0, 0, 0, 0, 0, 0, 0])
    }

    fn store_job(job_id: u64, keys: &[u8], rows: &[u32]) -> TransferJob {
        TransferJob {
            job_id,
            keys: keys.iter().map(|&n| key(n)).collect(),
            chunk_ids: rows.to_vec(),
            is_promotion: false,
            req_id: Arc::from("r"),
            submit_time: Instant::now(),
        }
    }

    /// A coordinator with one I/O thread and room for one file, driven by hand (its `run`
    /// loop is not started), so that steps arrive in exactly the order a test chooses.
    fn worker(dir: &std::path::Path) -> (Worker, Receiver<OffloadingEvent>) {
        let region = Arc::new(PrimaryRegion::create(4, STRIDE as u64).unwrap());
        let opts = EngineOptions {
            queue_depth: 4,
            psync_threads: 1,
            o_direct: false,
        };
        let handle = open_engine(IoEngineKind::Psync, region.clone(), Vec::new(), &opts).unwrap();
        let mapper =
            FileMapper::new(dir, json!({"model_name": "m", "tokens_per_hash": 16})).unwrap();
        let sh = Arc::new(Shared {
            catalog: Mutex::new(Catalog::new(STRIDE as u64)),
            metrics: FsMetrics::default(),
            mapper,
            region,
            engine: handle.engine,
            direct: false,
            publish: PublishMode::Link,
            integrity: Integrity::None,
            fsync: FsSync::Never,
            dirs: DirCache::default(),
            events: AtomicBool::new(true),
        });
        let (_cmd_tx, cmd_rx) = crossbeam_channel::unbounded();
        let (results_tx, _results_rx) = crossbeam_channel::unbounded();
        let (events_tx, events_rx) = crossbeam_channel::unbounded();
        let (invalidated_tx, _invalidated_rx) = crossbeam_channel::unbounded();
        let w = Worker::spawn_pool(WorkerInit {
            sh,
            max_bytes_in_flight: 4 * STRIDE as u64,
            io_threads: 1,
            tier_id: "fs".into(),
            locality: None,
            cmd_rx,
            results_tx,
            events_tx,
            invalidated_tx,
        })
        .unwrap();
        (w, events_rx)
    }

    /// Runs the eviction the coordinator handed its I/O thread and takes its step.
    fn take_eviction(w: &mut Worker) {
        let step = w
            .steps_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the eviction's step");
        assert!(matches!(step, Step::Evicted { .. }));
        w.step(step);
    }

    #[test]
    fn a_key_evicted_before_its_store_job_is_reported_is_not_announced_after_its_removal() {
        let dir = tempfile::tempdir().unwrap();
        let (mut w, events) = worker(dir.path());
        // Job 1 stores keys 1 and 2; job 2 stores key 3. The tier holds one file.
        w.start_job(store_job(1, &[1, 2], &[0, 1]), false);
        w.start_job(store_job(2, &[3], &[2]), false);
        let stored = || Ok(KeyOutcome::Stored(Published::New));
        // Key 1 finishes first; job 1 still waits for key 2 (completions come in any order,
        // and a staged engine may hold a request back for a while).
        w.finished(job_tag(0, 0), stored());
        // Job 2's key 3 finishes: the tier is over its capacity, key 1 (least recently used)
        // goes, and its removal is announced.
        w.finished(job_tag(1, 0), stored());
        take_eviction(&mut w);
        // Key 2 finishes: job 1 is reported (then key 3 goes to make room for key 2).
        w.finished(job_tag(0, 1), stored());
        take_eviction(&mut w);
        let mut held = HashSet::new();
        while let Ok(e) = events.try_recv() {
            for k in e.keys {
                if e.removed {
                    held.remove(&k);
                } else {
                    held.insert(k);
                }
            }
        }
        let known: HashSet<ChunkKey> = w.sh.catalog.lock().keys_lru_first().into_iter().collect();
        assert_eq!(known, HashSet::from([key(2)]), "the files the tier knows");
        assert_eq!(
            held, known,
            "the events' account of the tier vs its catalog"
        );
        w.close().unwrap();
    }
}
