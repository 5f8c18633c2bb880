//! Helpers shared by the tiering tests: deterministic row contents, an auditing tier wrapper
//! that checks the exactly-once contract and the bytes every store job reads, and builders.
#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use kvtier::config::EvictionPolicyKind;
use kvtier::contract::job::{
    JobId, JobResult, Locality, LookupResult, Medium, OffloadPolicy, OffloadingEvent,
    RequestContext, TransferJob,
};
use kvtier::contract::secondary::{SecondaryTier, TierMetric};
use kvtier::key::ChunkKey;
use kvtier::primary::PrimaryTier;
use kvtier::region::PrimaryRegion;
use kvtier::tiering::backpressure::DetectorParams;
use kvtier::tiering::clock::{Clock, ManualClock};
use kvtier::tiering::memory_tier::{
    ExecMode, FaultPlan, MemoryTier, MemoryTierOptions, XorShift64,
};
use kvtier::tiering::{ManagerOptions, TierSpec, TieringManager};

/// Bytes per row in the tests.
pub const STRIDE: usize = 4096;

/// A key from (document, chunk): shared prefixes give equal keys.
pub fn key(doc: u64, chunk: u64) -> ChunkKey {
    let mut b = Vec::with_capacity(20);
    b.extend_from_slice(&doc.to_le_bytes());
    b.extend_from_slice(&chunk.to_le_bytes());
    b.extend_from_slice(&[0, 0, 0, 0]);
    ChunkKey::new(b)
}

fn seed_of(key: &ChunkKey) -> u64 {
    // FNV-1a.
    key.as_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ *b as u64).wrapping_mul(0x100_0000_01b3)
        })
}

/// The bytes a row holding `key` must contain.
pub fn expected_row(key: &ChunkKey, len: usize) -> Vec<u8> {
    let mut rng = XorShift64::new(seed_of(key));
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        out.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Writes `key`'s bytes into `row` (a row reserved for writing by the caller).
pub fn write_row(region: &PrimaryRegion, row: u32, key: &ChunkKey) {
    let data = expected_row(key, region.row_stride() as usize);
    // The caller holds the row reserved for this write (prepare_store), so nobody
    // reads or writes it concurrently.
    let mut dst = region.write_row(row as usize).expect("row in range");
    dst.copy_from_slice(&data);
}

/// Whether `row` holds `key`'s bytes.
pub fn row_matches(region: &PrimaryRegion, row: u32, key: &ChunkKey) -> bool {
    // The caller holds the row pinned or reserved; no writer is active.
    let got = region.read_row(row as usize).expect("row in range");
    got[..] == expected_row(key, region.row_stride() as usize)[..]
}

/// What the audit saw (shared with the test).
#[derive(Debug, Default)]
pub struct AuditLog {
    /// Submitted, not yet reported: job id -> (is_promotion, keys).
    pub outstanding: HashMap<JobId, (bool, Vec<ChunkKey>)>,
    /// Every id ever submitted.
    pub submitted: HashSet<JobId>,
    /// Contract breaches (duplicate, unknown id, wrong bytes in a store's rows...).
    pub violations: Vec<String>,
    /// Keys of successful store jobs.
    pub stored_keys: u64,
    /// Keys loaded by promotion jobs (successful keys of partial failures included).
    pub loaded_keys: u64,
    /// Failed store jobs.
    pub failed_stores: u64,
    /// Failed promotion jobs.
    pub failed_loads: u64,
    /// Keys the tier holds according to its events.
    pub held: HashSet<ChunkKey>,
    /// Keys in every store job in flight (they must stay pinned in the primary).
    pub store_pins: HashMap<ChunkKey, usize>,
    /// The requests the tier was told are finished, in the order it was told.
    pub finished: Vec<String>,
}

/// Wraps a tier and audits the manager/tier contract.
pub struct AuditTier {
    inner: Box<dyn SecondaryTier>,
    region: Arc<PrimaryRegion>,
    /// The shared log.
    pub log: Arc<Mutex<AuditLog>>,
}

impl AuditTier {
    /// Wraps `inner`.
    pub fn new(
        inner: Box<dyn SecondaryTier>,
        region: Arc<PrimaryRegion>,
    ) -> (Self, Arc<Mutex<AuditLog>>) {
        let log = Arc::new(Mutex::new(AuditLog::default()));
        (
            AuditTier {
                inner,
                region,
                log: log.clone(),
            },
            log,
        )
    }

    fn record(&self, job: &TransferJob) {
        let mut l = self.log.lock();
        if !l.submitted.insert(job.job_id) {
            l.violations
                .push(format!("job id {} submitted twice", job.job_id));
        }
        if !job.is_promotion {
            for (k, &c) in job.keys.iter().zip(&job.chunk_ids) {
                if !row_matches(&self.region, c, k) {
                    l.violations.push(format!(
                        "store job {} reads row {c} without key {k}'s bytes",
                        job.job_id
                    ));
                }
                *l.store_pins.entry(k.clone()).or_default() += 1;
            }
        }
        l.outstanding
            .insert(job.job_id, (job.is_promotion, job.keys.clone()));
    }
}

impl SecondaryTier for AuditTier {
    fn tier_type(&self) -> &str {
        self.inner.tier_type()
    }
    fn medium(&self) -> Option<Medium> {
        self.inner.medium()
    }
    fn locality(&self) -> Option<Locality> {
        self.inner.locality()
    }
    fn lookup(&mut self, key: &ChunkKey, req: &RequestContext) -> LookupResult {
        self.inner.lookup(key, req)
    }
    fn submit_store(&mut self, job: TransferJob) {
        self.record(&job);
        self.inner.submit_store(job);
    }
    fn submit_load(&mut self, job: TransferJob) {
        self.record(&job);
        self.inner.submit_load(job);
    }
    fn get_finished_jobs(&mut self) -> Vec<JobResult> {
        let results = self.inner.get_finished_jobs();
        let mut l = self.log.lock();
        for r in &results {
            match l.outstanding.remove(&r.job_id) {
                None => l
                    .violations
                    .push(format!("job {} reported but not outstanding", r.job_id)),
                Some((promotion, keys)) => {
                    if promotion {
                        if r.success {
                            l.loaded_keys += keys.len() as u64;
                        } else {
                            l.failed_loads += 1;
                            l.loaded_keys +=
                                r.successful_keys.as_ref().map_or(0, |k| k.len() as u64);
                        }
                    } else {
                        for k in &keys {
                            if let Some(n) = l.store_pins.get_mut(k) {
                                *n -= 1;
                                if *n == 0 {
                                    l.store_pins.remove(k);
                                }
                            }
                        }
                        if r.success {
                            l.stored_keys += keys.len() as u64;
                        } else {
                            l.failed_stores += 1;
                        }
                    }
                }
            }
        }
        results
    }
    fn on_new_request(&mut self, req: &RequestContext) -> OffloadPolicy {
        self.inner.on_new_request(req)
    }
    fn on_request_finished(&mut self, req: &RequestContext) {
        self.log.lock().finished.push(req.req_id.to_string());
        self.inner.on_request_finished(req)
    }
    fn on_schedule_end(&mut self) {
        self.inner.on_schedule_end()
    }
    fn has_pending_work(&self) -> bool {
        self.inner.has_pending_work()
    }
    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        let ev = self.inner.take_events();
        let mut l = self.log.lock();
        for e in &ev {
            for k in &e.keys {
                if e.removed {
                    l.held.remove(k);
                } else {
                    l.held.insert(k.clone());
                }
            }
        }
        ev
    }
    fn drain_jobs(&mut self) {
        self.inner.drain_jobs()
    }
    fn shutdown(&mut self) -> kvtier::Result<()> {
        self.inner.shutdown()
    }
    fn metrics(&self) -> Vec<TierMetric> {
        self.inner.metrics()
    }
}

/// A region of `rows` rows of [`STRIDE`] bytes.
pub fn region(rows: usize) -> Arc<PrimaryRegion> {
    Arc::new(PrimaryRegion::create(rows, STRIDE as u64).expect("region"))
}

/// Inline memory-tier options on `clock` with virtual latencies (ms).
pub fn inline_opts(
    label: &str,
    clock: &ManualClock,
    store_ms: u64,
    load_ms: u64,
    faults: FaultPlan,
) -> MemoryTierOptions {
    let mut o = MemoryTierOptions::new(label);
    o.mode = ExecMode::Inline {
        clock: Arc::new(clock.clone()) as Arc<dyn Clock>,
        store_latency: Duration::from_millis(store_ms),
        load_latency: Duration::from_millis(load_ms),
    };
    o.faults = faults;
    o
}

/// A manager over `rows` primary rows with audited inline memory tiers.
pub fn manager_with(
    rows: usize,
    clock: &ManualClock,
    tiers: Vec<MemoryTierOptions>,
) -> (TieringManager, Vec<Arc<Mutex<AuditLog>>>) {
    manager_with_bp(rows, clock, tiers.into_iter().map(|t| (t, None)).collect())
}

/// A manager over `rows` primary rows with one inline memory tier (`1:memory`) whose jobs
/// finish at once and without faults.
pub fn instant_manager(
    rows: usize,
    clock: &ManualClock,
) -> (TieringManager, Vec<Arc<Mutex<AuditLog>>>) {
    let tier = inline_opts("1:memory", clock, 0, 0, FaultPlan::default());
    manager_with(rows, clock, vec![tier])
}

/// Like [`manager_with`], each tier with optional back-pressure parameters.
pub fn manager_with_bp(
    rows: usize,
    clock: &ManualClock,
    tiers: Vec<(MemoryTierOptions, Option<DetectorParams>)>,
) -> (TieringManager, Vec<Arc<Mutex<AuditLog>>>) {
    let region = region(rows);
    let mut specs = Vec::new();
    let mut logs = Vec::new();
    for (o, bp) in tiers {
        let t = MemoryTier::start(region.clone(), o).expect("memory tier");
        let (a, log) = AuditTier::new(Box::new(t), region.clone());
        specs.push(TierSpec {
            tier: Box::new(a),
            backpressure: bp,
        });
        logs.push(log);
    }
    let primary = PrimaryTier::new(region, EvictionPolicyKind::Lru, true);
    let opts = ManagerOptions {
        clock: Arc::new(clock.clone()),
        enable_events: true,
        ..Default::default()
    };
    (
        TieringManager::with_tiers(primary, specs, opts).expect("manager"),
        logs,
    )
}

/// Stores `keys` through the GPU path (prepare, write the key's bytes, complete). Returns the
/// keys actually stored, or `None` if the primary refused.
pub fn gpu_store(
    m: &mut TieringManager,
    keys: &[ChunkKey],
    r: &RequestContext,
) -> Option<Vec<ChunkKey>> {
    let out = m.prepare_store(keys, r)?;
    for (k, &c) in out.keys_to_store.iter().zip(&out.chunk_ids) {
        write_row(m.region(), c, k);
    }
    m.complete_store(&out.keys_to_store, r, true);
    Some(out.keys_to_store)
}

/// A request context.
pub fn req(id: &str) -> RequestContext {
    RequestContext::new(id)
}
