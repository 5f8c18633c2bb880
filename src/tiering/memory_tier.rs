//! `memory`: an in-memory secondary tier for tests, examples and benchmarks. Rows are copied
//! into a hash map on a background thread (or, in [`ExecMode::Inline`], on the calling thread
//! with completions released on a virtual clock, for deterministic simulations). Faults can be
//! injected: failed stores, failed keys in loads (reported through `successful_keys`), latency,
//! and deliberate misreports that break the exactly-once contract (to test the manager).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;

use crate::contract::job::{
    JobResult, Locality, LookupResult, Medium, OffloadPolicy, OffloadingEvent, RequestContext,
    TransferJob,
};
use crate::contract::secondary::{SecondaryTier, TierMetric, TierMetricKind};
use crate::error::{Error, ErrorKind, Result};
use crate::io::IdlePolicy;
use crate::key::ChunkKey;
use crate::region::PrimaryRegion;
#[cfg(any(test, feature = "test-support"))]
use crate::tiering::clock::Clock;

pub use crate::tiering::rng::XorShift64;

/// How jobs execute.
#[derive(Debug, Clone)]
pub enum ExecMode {
    /// On a background thread, each job delayed by `latency` (real time).
    Threaded {
        /// Delay before each job runs.
        latency: Duration,
    },
    /// On the submitting thread; a job's result is released once `clock` reaches its
    /// `submit_time` plus the latency (deterministic with a manual clock).
    #[cfg(any(test, feature = "test-support"))]
    Inline {
        /// The clock that releases results.
        clock: Arc<dyn Clock>,
        /// Virtual latency of store jobs.
        store_latency: Duration,
        /// Virtual latency of load jobs.
        load_latency: Duration,
    },
}

/// A deliberate breach of the exactly-once contract (tests of the manager's checks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Misreport {
    /// Report the first finished job twice.
    #[cfg(any(test, feature = "test-support"))]
    Duplicate,
    /// Report a job id that was never submitted.
    Unknown,
}

/// Injected faults.
#[derive(Debug, Clone, Default)]
pub struct FaultPlan {
    /// Seed of the fault generator.
    pub seed: u64,
    /// Probability that a store job fails as a whole (nothing stored).
    pub store_fail_prob: f64,
    /// Probability that each key of a load fails (the key is then dropped from the tier).
    pub load_key_fail_prob: f64,
    /// Break the reporting contract once.
    pub misreport: Option<Misreport>,
}

/// Jobs the threaded executor's queue holds; a job submitted beyond that fails at once
/// (`NoSpace`). The queue is a preallocated ring, so that a submission never allocates.
pub const MAX_QUEUED_JOBS: usize = 4096;

/// Options of a [`MemoryTier`].
#[derive(Debug, Clone)]
pub struct MemoryTierOptions {
    /// Ownership id in events (the manager's tier label, e.g. `1:memory`).
    pub tier_id: String,
    /// Locality reported to the manager.
    pub locality: Option<Locality>,
    /// Maximum chunks held; the oldest are evicted first. `None` = unbounded.
    pub capacity_chunks: Option<usize>,
    /// Execution mode.
    pub mode: ExecMode,
    /// Injected faults.
    pub faults: FaultPlan,
    /// Answer `Retry` the first time a key is looked up, resolving at the next
    /// `on_schedule_end` (models an asynchronous existence probe).
    pub retry_first_lookup: bool,
    /// What the tier asks for in `on_new_request` (`RequestLevel` models a P/D tier).
    pub policy: OffloadPolicy,
    /// How the threaded executor waits for jobs (see [`crate::io::IdlePolicy`]).
    pub idle: IdlePolicy,
}

impl MemoryTierOptions {
    /// Threaded, unbounded, no faults.
    pub fn new(tier_id: impl Into<String>) -> Self {
        MemoryTierOptions {
            tier_id: tier_id.into(),
            locality: Some(Locality::Local),
            capacity_chunks: None,
            mode: ExecMode::Threaded {
                latency: Duration::ZERO,
            },
            faults: FaultPlan::default(),
            retry_first_lookup: false,
            policy: OffloadPolicy::ChunkLevel,
            idle: IdlePolicy::default(),
        }
    }
}

#[derive(Debug, Default)]
struct Store {
    map: HashMap<ChunkKey, Arc<[u8]>>,
    fifo: VecDeque<ChunkKey>,
    events: Vec<OffloadingEvent>,
    injected_failures: u64,
}

#[derive(Debug)]
struct Executor {
    store: Arc<Mutex<Store>>,
    region: Arc<PrimaryRegion>,
    rng: XorShift64,
    capacity: Option<usize>,
    faults: FaultPlan,
    tier_id: String,
    locality: Option<Locality>,
}

impl Executor {
    fn event(&self, keys: Vec<ChunkKey>, removed: bool) -> OffloadingEvent {
        OffloadingEvent {
            keys,
            medium: Medium::Cpu,
            removed,
            locality: self.locality,
            ownership: Some(self.tier_id.clone()),
            removal_expected: true,
            metadata_only: false,
        }
    }

    fn run(&mut self, job: &TransferJob) -> JobResult {
        let started = Instant::now();
        if job.keys.len() != job.chunk_ids.len() {
            let e = Error::new(
                ErrorKind::Contract,
                "job keys and chunk_ids differ in length",
            );
            return JobResult::failed(job.job_id, e);
        }
        if job.is_promotion {
            self.load(job, started)
        } else {
            self.store(job, started)
        }
    }

    fn store(&mut self, job: &TransferJob, started: Instant) -> JobResult {
        if self.faults.store_fail_prob > 0.0 && self.rng.next_f64() < self.faults.store_fail_prob {
            self.store.lock().injected_failures += 1;
            let e = Error::new(
                ErrorKind::Io,
                format!("injected store failure (job {})", job.job_id),
            );
            return JobResult::failed(job.job_id, e);
        }
        let mut copies = Vec::with_capacity(job.keys.len());
        for (key, &chunk) in job.keys.iter().zip(&job.chunk_ids) {
            if self.store.lock().map.contains_key(key) {
                continue;
            }
            // The manager keeps this row pinned (read-only) until the job is reported.
            match self.region.read_row(chunk as usize) {
                Ok(row) => copies.push((key.clone(), Arc::<[u8]>::from(&*row))),
                Err(e) => return JobResult::failed(job.job_id, e.with("key", key.to_hex())),
            }
        }
        let bytes: u64 = copies.iter().map(|(_, d)| d.len() as u64).sum();
        let mut guard = self.store.lock();
        let mut stored = Vec::new();
        let mut evicted = Vec::new();
        for (key, data) in copies {
            if guard.map.insert(key.clone(), data).is_none() {
                guard.fifo.push_back(key.clone());
                stored.push(key);
            }
            while let Some(cap) = self.capacity
                && guard.map.len() > cap
                && let Some(old) = guard.fifo.pop_front()
            {
                if guard.map.remove(&old).is_some() {
                    evicted.push(old);
                }
            }
        }
        if !stored.is_empty() {
            let ev = self.event(stored, false);
            guard.events.push(ev);
        }
        if !evicted.is_empty() {
            let ev = self.event(evicted, true);
            guard.events.push(ev);
        }
        JobResult::ok(job.job_id, started.elapsed(), bytes)
    }

    fn load(&mut self, job: &TransferJob, started: Instant) -> JobResult {
        let mut ok_keys = Vec::with_capacity(job.keys.len());
        let mut first_err = None;
        let mut bytes = 0u64;
        for (key, &chunk) in job.keys.iter().zip(&job.chunk_ids) {
            let inject = self.faults.load_key_fail_prob > 0.0
                && self.rng.next_f64() < self.faults.load_key_fail_prob;
            let data = {
                let mut g = self.store.lock();
                if inject {
                    g.injected_failures += 1;
                    // Mark MISS after a failed load: drop the key so no later lookup says HIT.
                    if g.map.remove(key).is_some() {
                        let ev = self.event(vec![key.clone()], true);
                        g.events.push(ev);
                    }
                    None
                } else {
                    g.map.get(key).cloned()
                }
            };
            let Some(data) = data else {
                first_err.get_or_insert_with(|| {
                    Error::new(ErrorKind::Io, format!("memory tier cannot load key {key}"))
                        .with("key", key.to_hex())
                });
                continue;
            };
            // The manager reserved this row for this job (no reader, no other writer)
            // until the job is reported.
            match self.region.write_row(chunk as usize) {
                Ok(mut row) if row.len() == data.len() => {
                    row.copy_from_slice(&data);
                    bytes += data.len() as u64;
                    ok_keys.push(key.clone());
                }
                Ok(row) => {
                    first_err.get_or_insert_with(|| {
                        Error::new(
                            ErrorKind::IncompatibleLayout,
                            "stored row has another length",
                        )
                        .with("expected", row.len().to_string())
                        .with("found", data.len().to_string())
                    });
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            None => JobResult::ok(job.job_id, started.elapsed(), bytes),
            Some(e) => JobResult {
                job_id: job.job_id,
                success: false,
                successful_keys: Some(ok_keys),
                transfer_time: Some(started.elapsed()),
                transfer_bytes: Some(bytes),
                error: Some(e),
            },
        }
    }
}

enum Engine {
    Threaded {
        jobs: Option<Sender<TransferJob>>,
        results: Receiver<JobResult>,
        thread: Option<JoinHandle<()>>,
    },
    #[cfg(any(test, feature = "test-support"))]
    Inline {
        exec: Box<Executor>,
        clock: Arc<dyn Clock>,
        store_latency: Duration,
        load_latency: Duration,
        waiting: Vec<(Instant, JobResult)>,
    },
}

/// The in-memory secondary tier.
pub struct MemoryTier {
    store: Arc<Mutex<Store>>,
    engine: Engine,
    outstanding: usize,
    stash: Vec<JobResult>,
    locality: Option<Locality>,
    retry_first_lookup: bool,
    probing: HashSet<ChunkKey>,
    probed: HashSet<ChunkKey>,
    misreport: Option<Misreport>,
    policy: OffloadPolicy,
    requests_finished: u64,
    closed: bool,
}

impl std::fmt::Debug for MemoryTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryTier")
            .field("outstanding", &self.outstanding)
            .field("closed", &self.closed)
            .finish()
    }
}

impl MemoryTier {
    /// Starts a memory tier over `region`.
    pub fn start(region: Arc<PrimaryRegion>, opts: MemoryTierOptions) -> Result<Self> {
        let store = Arc::new(Mutex::new(Store::default()));
        let exec = Executor {
            store: store.clone(),
            region,
            rng: XorShift64::new(opts.faults.seed),
            capacity: opts.capacity_chunks,
            faults: opts.faults.clone(),
            tier_id: opts.tier_id.clone(),
            locality: opts.locality,
        };
        let engine = match opts.mode {
            ExecMode::Threaded { latency } => {
                let (jtx, jrx) = crossbeam_channel::bounded::<TransferJob>(MAX_QUEUED_JOBS);
                let (rtx, rrx) = crossbeam_channel::unbounded();
                let mut exec = exec;
                let idle = opts.idle;
                let thread = crate::io::spawn_io_thread("kvtier-memory-tier".into(), move || {
                    let mut last_work = Instant::now();
                    while let Ok(job) = idle.recv(&jrx, &mut last_work) {
                        if !latency.is_zero() {
                            std::thread::sleep(latency);
                        }
                        if rtx.send(exec.run(&job)).is_err() {
                            break;
                        }
                    }
                })
                .map_err(|e| {
                    Error::new(ErrorKind::Io, "cannot spawn the memory tier thread").with_source(e)
                })?;
                Engine::Threaded {
                    jobs: Some(jtx),
                    results: rrx,
                    thread: Some(thread),
                }
            }
            #[cfg(any(test, feature = "test-support"))]
            ExecMode::Inline {
                clock,
                store_latency,
                load_latency,
            } => Engine::Inline {
                exec: Box::new(exec),
                clock,
                store_latency,
                load_latency,
                waiting: Vec::new(),
            },
        };
        Ok(MemoryTier {
            store,
            engine,
            outstanding: 0,
            stash: Vec::new(),
            locality: opts.locality,
            retry_first_lookup: opts.retry_first_lookup,
            probing: HashSet::new(),
            probed: HashSet::new(),
            misreport: opts.faults.misreport,
            policy: opts.policy,
            requests_finished: 0,
            closed: false,
        })
    }

    /// Number of chunks held.
    #[cfg(any(test, feature = "test-support"))]
    pub fn len(&self) -> usize {
        self.store.lock().map.len()
    }

    /// True when nothing is held.
    #[cfg(any(test, feature = "test-support"))]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A copy of the bytes held for `key`.
    #[cfg(any(test, feature = "test-support"))]
    pub fn get(&self, key: &ChunkKey) -> Option<Vec<u8>> {
        self.store.lock().map.get(key).map(|d| d.to_vec())
    }

    fn submit(&mut self, job: TransferJob) {
        self.outstanding += 1;
        if self.closed {
            let e = Error::new(ErrorKind::Closed, "memory tier is shut down");
            self.stash.push(JobResult::failed(job.job_id, e));
            return;
        }
        match &mut self.engine {
            Engine::Threaded { jobs, .. } => {
                let id = job.job_id;
                if let Some(Err(e)) = jobs.as_ref().map(|tx| tx.try_send(job)) {
                    let e = if e.is_full() {
                        Error::new(
                            ErrorKind::NoSpace,
                            format!("memory tier queue is full ({MAX_QUEUED_JOBS} jobs)"),
                        )
                    } else {
                        Error::new(ErrorKind::Closed, "memory tier thread is gone")
                    };
                    self.stash.push(JobResult::failed(id, e));
                }
            }
            #[cfg(any(test, feature = "test-support"))]
            Engine::Inline {
                exec,
                store_latency,
                load_latency,
                waiting,
                ..
            } => {
                let latency = if job.is_promotion {
                    *load_latency
                } else {
                    *store_latency
                };
                let result = exec.run(&job);
                waiting.push((job.submit_time + latency, result));
            }
        }
    }

    fn collect(&mut self, block: bool) {
        match &mut self.engine {
            Engine::Threaded { results, .. } => {
                self.stash.extend(results.try_iter());
                if block {
                    while self.stash.len() < self.outstanding {
                        match results.recv() {
                            Ok(r) => self.stash.push(r),
                            Err(_) => break,
                        }
                    }
                }
            }
            #[cfg(any(test, feature = "test-support"))]
            Engine::Inline { clock, waiting, .. } => {
                let now = clock.now();
                let (ready, wait): (Vec<_>, Vec<_>) =
                    waiting.drain(..).partition(|(t, _)| block || *t <= now);
                *waiting = wait;
                let mut ready = ready;
                ready.sort_by_key(|(t, r)| (*t, r.job_id));
                self.stash.extend(ready.into_iter().map(|(_, r)| r));
            }
        }
    }
}

impl SecondaryTier for MemoryTier {
    fn tier_type(&self) -> &str {
        "memory"
    }

    fn medium(&self) -> Option<Medium> {
        Some(Medium::Cpu)
    }

    fn locality(&self) -> Option<Locality> {
        self.locality
    }

    fn lookup(&mut self, key: &ChunkKey, _req: &RequestContext) -> LookupResult {
        if self.retry_first_lookup && !self.probed.contains(key) {
            self.probing.insert(key.clone());
            return LookupResult::Retry;
        }
        if self.store.lock().map.contains_key(key) {
            LookupResult::Hit
        } else {
            LookupResult::Miss
        }
    }

    fn submit_store(&mut self, job: TransferJob) {
        self.submit(job);
    }

    fn submit_load(&mut self, job: TransferJob) {
        self.submit(job);
    }

    fn get_finished_jobs(&mut self) -> Vec<JobResult> {
        self.collect(false);
        let mut out = std::mem::take(&mut self.stash);
        self.outstanding = self.outstanding.saturating_sub(out.len());
        if let Some(m) = self.misreport
            && let Some(first) = out.first()
        {
            self.misreport = None;
            let mut extra = first.clone();
            if m == Misreport::Unknown {
                extra.job_id = first.job_id.wrapping_add(1 << 40);
            }
            out.push(extra);
        }
        out
    }

    fn on_new_request(&mut self, _req: &RequestContext) -> OffloadPolicy {
        self.policy
    }

    fn on_request_finished(&mut self, _req: &RequestContext) {
        self.requests_finished += 1;
    }

    fn on_schedule_end(&mut self) {
        if self.probed.len() > 1 << 20 {
            self.probed.clear();
        }
        self.probed.extend(self.probing.drain());
    }

    fn has_pending_work(&self) -> bool {
        self.outstanding > 0 || !self.probing.is_empty()
    }

    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        std::mem::take(&mut self.store.lock().events)
    }

    fn drain_jobs(&mut self) {
        self.collect(true);
    }

    // Without the test-only inline engine, `Engine` has one variant.
    #[cfg_attr(
        not(any(test, feature = "test-support")),
        allow(irrefutable_let_patterns)
    )]
    fn shutdown(&mut self) -> Result<()> {
        self.drain_jobs();
        self.closed = true;
        if let Engine::Threaded { jobs, thread, .. } = &mut self.engine {
            jobs.take();
            if let Some(t) = thread.take()
                && t.join().is_err()
            {
                return Err(Error::new(
                    ErrorKind::Internal,
                    "memory tier thread panicked",
                ));
            }
        }
        Ok(())
    }

    fn metrics(&self) -> Vec<TierMetric> {
        let g = self.store.lock();
        let bytes: usize = g.map.values().map(|d| d.len()).sum();
        vec![
            TierMetric {
                name: "memory_tier_chunks",
                help: "Chunks held by the memory tier.",
                kind: TierMetricKind::Gauge,
                labels: Vec::new(),
                value: g.map.len() as f64,
            },
            TierMetric {
                name: "memory_tier_bytes",
                help: "Bytes held by the memory tier.",
                kind: TierMetricKind::Gauge,
                labels: Vec::new(),
                value: bytes as f64,
            },
            TierMetric {
                name: "memory_tier_queue_depth",
                help: "Jobs submitted to the memory tier and not yet reported.",
                kind: TierMetricKind::Gauge,
                labels: Vec::new(),
                value: self.outstanding as f64,
            },
            TierMetric {
                name: "memory_tier_requests_finished",
                help: "Requests the manager reported finished to the memory tier.",
                kind: TierMetricKind::Counter,
                labels: Vec::new(),
                value: self.requests_finished as f64,
            },
            TierMetric {
                name: "memory_tier_injected_failures",
                help: "Faults injected by the memory tier (stores and load keys).",
                kind: TierMetricKind::Counter,
                labels: Vec::new(),
                value: g.injected_failures as f64,
            },
        ]
    }
}

impl Drop for MemoryTier {
    fn drop(&mut self) {
        if !self.closed {
            let _ = self.shutdown();
        }
    }
}

#[cfg(test)]
#[path = "memory_tier_tests.rs"]
mod tests;
