//! The tiering manager: the CPU primary tier plus secondary tiers, with vLLM 0.33.0's
//! multi-tier semantics (contract doc §1, §3, §6, §7, §9).
//!
//! Driven by one caller at a time (the scheduler). No call waits on I/O: tiers enqueue, and
//! completions are collected by polling ([`TieringManager::poll`], and implicitly by `lookup`
//! once per step, `prepare_store` and `on_schedule_end`).
//!
//! * [`lookup`](TieringManager::lookup) and promotions: `lookup.rs`.
//! * GPU stores, cascades, parked cascades, GPU loads: `cascade.rs`.
//! * Finished-job processing (exactly-once checks, metrics, back-pressure feed): `jobs.rs`.
//! * Construction, request lifecycle, reset, shutdown, events, metrics: here.

mod cascade;
mod jobs;
mod lookup;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use crate::config::KvtierConfig;
use crate::contract::job::{JobId, Medium, OffloadPolicy, OffloadingEvent, RequestContext};
use crate::contract::secondary::{SecondaryTier, TierHealth};
use crate::error::{Error, ErrorKind, Result};
use crate::hash::{FastMap, FastSet};
use crate::key::ChunkKey;
use crate::metrics::Registry;
use crate::primary::PrimaryTier;
use crate::region::PrimaryRegion;
use crate::tiering::backpressure::{DetectorParams, EmaDetector};
use crate::tiering::clock::{Clock, SystemClock};
use crate::tiering::factory::{TierBuildContext, TierFactory};
use crate::tiering::telemetry::TieringMetrics;

/// What the scheduler tells the manager at the end of a step (vLLM `ScheduleEndContext`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScheduleEndContext {
    /// Requests scheduled for the first time this step (their lookup metrics stop).
    pub new_req_ids: Vec<Arc<str>>,
    /// Requests preempted this step.
    pub preempted_req_ids: Vec<Arc<str>>,
}

/// Manager options.
#[derive(Debug, Clone)]
pub struct ManagerOptions {
    /// Metric namespace prefix (default `kvtier:`; `vllm:` for drop-in dashboards).
    pub metrics_prefix: String,
    /// Time source for job stamps, latencies and back-pressure.
    pub clock: Arc<dyn Clock>,
    /// Whether the primary and the tiers built from the configuration record stored/removed
    /// events ([`TieringManager::take_events`] drains them).
    pub enable_events: bool,
    /// Storage namespace digest handed to persistent tiers (`None`: geometry namespace).
    pub namespace: Option<[u8; 32]>,
    /// vLLM's FileMapper fields of the model, handed to `fs` tiers (they name its folder).
    pub file_mapper_fields: Option<serde_json::Value>,
    /// Bytes of each row persistent slot tiers store (`None`: the whole row); see
    /// `TierBuildContext::slot_bytes`.
    pub slot_bytes: Option<u64>,
}

impl Default for ManagerOptions {
    fn default() -> Self {
        ManagerOptions {
            metrics_prefix: crate::metrics::DEFAULT_PREFIX.to_string(),
            clock: Arc::new(SystemClock),
            enable_events: false,
            namespace: None,
            file_mapper_fields: None,
            slot_bytes: None,
        }
    }
}

/// A secondary tier handed to [`TieringManager::with_tiers`].
pub struct TierSpec {
    /// The tier.
    pub tier: Box<dyn SecondaryTier>,
    /// Back-pressure parameters; `None` = no detector (stores are never dropped).
    pub backpressure: Option<DetectorParams>,
}

/// Where a promoted chunk came from (for cache-hit-source metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadSource {
    /// Secondary tier index (config order).
    pub tier: usize,
    /// That tier's medium (`Cpu` -> host, `Storage` -> disk, `None` -> unspecified).
    pub medium: Option<Medium>,
}

struct TierSlot {
    tier: Box<dyn SecondaryTier>,
    label: String,
    detector: Option<EmaDetector>,
    active_promotions: usize,
    active_cascades: usize,
    promotion_rows: usize,
    cascade_rows: usize,
}

#[derive(Debug)]
struct ActiveJob {
    tier: usize,
    keys: Vec<ChunkKey>,
    is_promotion: bool,
    submit_time: Instant,
    req_id: Arc<str>,
}

#[derive(Debug)]
struct PendingPromotion {
    req_id: Arc<str>,
    keys: Vec<ChunkKey>,
    chunk_ids: Vec<u32>,
}

/// This step's promotions, one batch per (tier, request): tiers in the order they first
/// promoted, and within a tier the requests in the order they first promoted (vLLM's nested
/// insertion-ordered dicts).
#[derive(Debug, Default)]
struct PendingPromotions {
    by_tier: Vec<(usize, Vec<PendingPromotion>)>,
    index: FastMap<(usize, Arc<str>), (usize, usize)>,
}

impl PendingPromotions {
    fn entry(&mut self, tier: usize, req_id: &Arc<str>) -> &mut PendingPromotion {
        let (ti, ri) = match self.index.get(&(tier, req_id.clone())) {
            Some(&pos) => pos,
            None => {
                let ti = match self.by_tier.iter().position(|(t, _)| *t == tier) {
                    Some(ti) => ti,
                    None => {
                        self.by_tier.push((tier, Vec::new()));
                        self.by_tier.len() - 1
                    }
                };
                let list = &mut self.by_tier[ti].1;
                list.push(PendingPromotion {
                    req_id: req_id.clone(),
                    keys: Vec::new(),
                    chunk_ids: Vec::new(),
                });
                let pos = (ti, list.len() - 1);
                self.index.insert((tier, req_id.clone()), pos);
                pos
            }
        };
        &mut self.by_tier[ti].1[ri]
    }

    fn take(&mut self) -> Vec<(usize, Vec<PendingPromotion>)> {
        self.index.clear();
        std::mem::take(&mut self.by_tier)
    }
}

#[derive(Debug)]
struct RequestState {
    ctx: RequestContext,
    /// Arrival order (vLLM iterates its request dict in insertion order).
    arrival: u64,
    /// Tiers that asked for `RequestLevel`, ascending.
    request_level: Vec<usize>,
    /// Stores prepared (with keys to store) and not yet completed.
    pending_primary_stores: usize,
    /// Request-level cascade keys parked on a primary write in flight.
    pending_cascade_keys: Vec<ChunkKey>,
    finished: bool,
    /// Lookup metrics are recorded until the request is first scheduled.
    tracking: Option<LookupTracking>,
}

#[derive(Debug, Default)]
struct LookupTracking {
    resolved: FastSet<(usize, ChunkKey)>,
    first_retry: FastMap<(usize, ChunkKey), Instant>,
}

/// The tiering manager (vLLM `TieringOffloadingManager`).
pub struct TieringManager {
    primary: PrimaryTier,
    region: Arc<PrimaryRegion>,
    row_stride: u64,
    tiers: Vec<TierSlot>,
    clock: Arc<dyn Clock>,
    next_job_id: JobId,
    jobs: FastMap<JobId, ActiveJob>,
    pending_promotions: PendingPromotions,
    /// Per request: the tier each key it promoted came from.
    load_sources: FastMap<Arc<str>, FastMap<ChunkKey, usize>>,
    requests: FastMap<Arc<str>, RequestState>,
    next_arrival: u64,
    /// Requests with parked cascade keys, by arrival.
    parked_cascades: BTreeMap<u64, Arc<str>>,
    /// Keys whose GPU -> primary write was in flight at the last `reset_cache`. vLLM drops
    /// those rows and its scheduler never completes the stores (stale jobs); kvtier keeps the
    /// rows (docs/primary.md, "Deviations"), so their late `complete_store` only publishes or
    /// frees the rows: no tier gets a store job for them (the reset already told the tiers of
    /// the finished requests) and no request's count of pending stores moves.
    stale_stores: FastSet<ChunkKey>,
    promotions_held: bool,
    polled_this_step: bool,
    errors: Vec<Error>,
    contract_violations: u64,
    metrics: TieringMetrics,
    shut_down: bool,
}

impl std::fmt::Debug for TieringManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TieringManager")
            .field(
                "tiers",
                &self.tiers.iter().map(|t| &t.label).collect::<Vec<_>>(),
            )
            .field("active_jobs", &self.jobs.len())
            .field("requests", &self.requests.len())
            .finish()
    }
}

/// `<index+1>:<type>`.
pub fn tier_label(index: usize, tier_type: &str) -> String {
    format!("{}:{tier_type}", index + 1)
}

fn shutdown_in_reverse(tiers: &mut Vec<Box<dyn SecondaryTier>>) {
    while let Some(mut t) = tiers.pop() {
        if let Err(e) = t.shutdown() {
            log::error!("failed to shut down secondary tier during initialization cleanup: {e}");
        }
    }
}

impl TieringManager {
    /// Builds the manager from the resolved config: the primary over `region`, then each
    /// secondary tier in config order through `factory`. On any failure every tier already
    /// built is shut down in reverse order, the primary is dropped (so `region` is unmapped
    /// unless the caller holds another reference), and the original error is returned.
    pub fn from_config(
        cfg: &KvtierConfig,
        region: Arc<PrimaryRegion>,
        factory: &TierFactory,
        opts: ManagerOptions,
    ) -> Result<Self> {
        // The configuration's own rules (a parsed one passed them already; a programmatic
        // one is checked here, before anything starts).
        cfg.validate()?;
        // Validate the prefix before anything is started.
        Registry::new(opts.metrics_prefix.clone())?;
        let primary = PrimaryTier::new(region.clone(), cfg.eviction_policy, opts.enable_events);
        let mut built: Vec<Box<dyn SecondaryTier>> = Vec::new();
        let mut params = Vec::new();
        for tc in &cfg.secondary_tiers {
            let label = tier_label(tc.index, &tc.tier_type);
            let step = DetectorParams::for_tier(tc).and_then(|p| {
                let mut ctx =
                    TierBuildContext::new(region.clone(), opts.clock.clone(), label.clone());
                ctx.namespace = opts.namespace;
                ctx.file_mapper_fields = opts.file_mapper_fields.clone();
                ctx.slot_bytes = opts.slot_bytes;
                ctx.events = opts.enable_events;
                factory.create(tc, &ctx).map(|t| (t, p))
            });
            match step {
                Ok((t, p)) => {
                    log::info!("Created secondary tier #{} ({})", tc.index, tc.tier_type);
                    built.push(t);
                    params.push(p);
                }
                Err(e) => {
                    shutdown_in_reverse(&mut built);
                    drop(primary);
                    return Err(e);
                }
            }
        }
        let specs = built
            .into_iter()
            .zip(params)
            .map(|(tier, backpressure)| TierSpec { tier, backpressure })
            .collect();
        Self::with_tiers(primary, specs, opts)
    }

    /// Assembles a manager from a primary and already-built tiers (labels `<i+1>:<type>` by
    /// position). On failure the tiers are shut down in reverse order.
    pub fn with_tiers(
        primary: PrimaryTier,
        specs: Vec<TierSpec>,
        opts: ManagerOptions,
    ) -> Result<Self> {
        let labels: Vec<(String, bool)> = specs
            .iter()
            .enumerate()
            .map(|(i, s)| (tier_label(i, s.tier.tier_type()), s.backpressure.is_some()))
            .collect();
        let metrics = match TieringMetrics::new(&opts.metrics_prefix, &labels) {
            Ok(m) => m,
            Err(e) => {
                let mut tiers: Vec<_> = specs.into_iter().map(|s| s.tier).collect();
                shutdown_in_reverse(&mut tiers);
                return Err(e);
            }
        };
        let tiers = specs
            .into_iter()
            .zip(labels)
            .enumerate()
            .map(|(i, (s, (label, _)))| TierSlot {
                detector: s.backpressure.map(|p| {
                    let name = format!("Tier #{i} ({})", s.tier.tier_type());
                    EmaDetector::new(p, name, opts.clock.clone())
                }),
                tier: s.tier,
                label,
                active_promotions: 0,
                active_cascades: 0,
                promotion_rows: 0,
                cascade_rows: 0,
            })
            .collect();
        let region = primary.region().clone();
        log::info!(
            "Created TieringManager with primary tier ({} chunks) and {} secondary tier(s)",
            primary.num_chunks(),
            labels_len(&metrics)
        );
        Ok(TieringManager {
            row_stride: region.row_stride(),
            region,
            primary,
            tiers,
            clock: opts.clock,
            next_job_id: 0,
            jobs: FastMap::default(),
            pending_promotions: PendingPromotions::default(),
            load_sources: FastMap::default(),
            requests: FastMap::default(),
            next_arrival: 0,
            parked_cascades: BTreeMap::new(),
            stale_stores: FastSet::default(),
            promotions_held: false,
            polled_this_step: false,
            errors: Vec::new(),
            contract_violations: 0,
            metrics,
            shut_down: false,
        })
    }

    /// The primary tier (read-only).
    pub fn primary(&self) -> &PrimaryTier {
        &self.primary
    }

    /// The primary region.
    pub fn region(&self) -> &Arc<PrimaryRegion> {
        &self.region
    }

    /// Number of secondary tiers.
    pub fn num_tiers(&self) -> usize {
        self.tiers.len()
    }

    /// Secondary tier `i` (read-only).
    pub fn tier(&self, i: usize) -> Option<&dyn SecondaryTier> {
        self.tiers.get(i).map(|t| t.tier.as_ref())
    }

    /// Secondary tier `i`'s metric label (`<i+1>:<type>`).
    pub fn tier_label(&self, i: usize) -> Option<&str> {
        self.tiers.get(i).map(|t| t.label.as_str())
    }

    /// Tier `i`'s back-pressure detector, if configured.
    pub fn detector(&self, i: usize) -> Option<&EmaDetector> {
        self.tiers.get(i).and_then(|t| t.detector.as_ref())
    }

    /// Jobs submitted and not yet reported.
    pub fn active_jobs(&self) -> usize {
        self.jobs.len()
    }

    /// Total contract violations seen (duplicate, unknown or foreign job reports...).
    pub fn contract_violations(&self) -> u64 {
        self.contract_violations
    }

    fn next_id(&mut self) -> JobId {
        let id = self.next_job_id;
        self.next_job_id += 1;
        id
    }

    fn contract_error(&mut self, e: Error) {
        log::error!("tiering contract violation: {e}");
        self.contract_violations += 1;
        self.metrics
            .registry
            .inc(self.metrics.contract_violations, 1.0);
        self.errors.push(e);
    }

    /// Errors held since the last call (surfaced by [`TieringManager::poll`] too).
    fn take_error(&mut self) -> Result<()> {
        if self.errors.is_empty() {
            return Ok(());
        }
        let n = self.errors.len();
        let first = self.errors.remove(0);
        self.errors.clear();
        if n > 1 {
            Err(first.with("more_errors", (n - 1).to_string()))
        } else {
            Err(first)
        }
    }

    /// A request starts: every tier says which chunks it wants. `RequestLevel` if any tier
    /// asked for it.
    pub fn on_new_request(&mut self, req: &RequestContext) -> OffloadPolicy {
        let request_level: Vec<usize> = self
            .tiers
            .iter_mut()
            .enumerate()
            .filter_map(|(i, t)| {
                (t.tier.on_new_request(req) == OffloadPolicy::RequestLevel).then_some(i)
            })
            .collect();
        let policy = if request_level.is_empty() {
            OffloadPolicy::ChunkLevel
        } else {
            OffloadPolicy::RequestLevel
        };
        self.next_arrival += 1;
        self.requests.insert(
            req.req_id.clone(),
            RequestState {
                ctx: req.clone(),
                arrival: self.next_arrival,
                request_level,
                pending_primary_stores: 0,
                pending_cascade_keys: Vec::new(),
                finished: false,
                tracking: Some(LookupTracking::default()),
            },
        );
        policy
    }

    /// The request is finished: its accesses are committed to the primary's policy, and the
    /// tiers hear of it at once unless a store it prepared is still being written or a
    /// request-level cascade of its is parked (then when that is done).
    pub fn on_request_finished(&mut self, req: &RequestContext) {
        self.primary.on_request_finished(req);
        match self.requests.get_mut(&req.req_id) {
            Some(st) => {
                st.finished = true;
                st.tracking = None;
                self.maybe_finalize(&req.req_id);
            }
            None => {
                for t in &mut self.tiers {
                    t.tier.on_request_finished(req);
                }
            }
        }
    }

    fn maybe_finalize(&mut self, req_id: &Arc<str>) {
        let ready = self.requests.get(req_id).is_some_and(|st| {
            st.finished && st.pending_primary_stores == 0 && st.pending_cascade_keys.is_empty()
        });
        if ready && let Some(st) = self.requests.remove(req_id) {
            for t in &mut self.tiers {
                t.tier.on_request_finished(&st.ctx);
            }
            self.load_sources.remove(req_id);
        }
    }

    /// Collects finished jobs unless a lookup or `prepare_store` already did in this step
    /// (vLLM's once-per-step gate).
    fn maybe_process_finished_jobs(&mut self) {
        if !self.polled_this_step {
            self.polled_this_step = true;
            self.process_finished_jobs();
        }
    }

    /// End of a scheduling step: collect finished jobs (unless this step already did), submit
    /// this step's promotions (one load job per (tier, request)), retry parked cascades, tell
    /// the tiers. Returns the first contract violation seen since the last check.
    pub fn on_schedule_end(&mut self, ctx: &ScheduleEndContext) -> Result<()> {
        self.maybe_process_finished_jobs();
        self.polled_this_step = false;
        self.flush_pending_promotions();
        self.flush_parked_cascades();
        for t in &mut self.tiers {
            t.tier.on_schedule_end();
        }
        for id in &ctx.new_req_ids {
            if let Some(st) = self.requests.get_mut(id) {
                st.tracking = None;
            }
        }
        self.take_error()
    }

    /// Collects finished jobs from every tier now. Returns the first contract violation.
    pub fn poll(&mut self) -> Result<()> {
        self.process_finished_jobs();
        self.take_error()
    }

    /// True while jobs or parked cascades are outstanding, or a tier has work (as vLLM
    /// counts: promotions not yet submitted are submitted by the next `on_schedule_end`, which
    /// the scheduler calls anyway).
    pub fn has_pending_work(&self) -> bool {
        !self.jobs.is_empty()
            || !self.parked_cascades.is_empty()
            || self.tiers.iter().any(|t| t.tier.has_pending_work())
    }

    /// Stored/removed events of the primary and every tier since the last call.
    pub fn take_events(&mut self) -> Vec<OffloadingEvent> {
        let mut ev = self.primary.take_events();
        for t in &mut self.tiers {
            ev.extend(t.tier.take_events());
        }
        ev
    }

    /// Where a chunk `req` promoted came from (`None`: the primary), kept for the request's
    /// life even after the chunk reached the primary (vLLM's per-request load sources).
    pub fn get_load_source(&self, key: &ChunkKey, req: &RequestContext) -> Option<LoadSource> {
        let tier = *self.load_sources.get(&req.req_id)?.get(key)?;
        Some(LoadSource {
            tier,
            medium: self.tiers[tier].tier.medium(),
        })
    }

    /// Sleep / weight update: drains every tier, processes their results, drops pending
    /// promotions, finalizes finished requests, resets the primary and the detectors, and
    /// holds promotions until [`TieringManager::on_reset_flushed`]. Secondary data is kept.
    pub fn reset_cache(&mut self) -> Result<()> {
        for t in &mut self.tiers {
            t.tier.drain_jobs();
        }
        self.process_finished_jobs();
        if !self.jobs.is_empty() {
            let e = Error::new(
                ErrorKind::Contract,
                format!(
                    "{} job(s) still unreported after drain_jobs; the primary is not reset",
                    self.jobs.len()
                ),
            );
            self.contract_error(e);
            return self.take_error();
        }
        for (_, list) in self.pending_promotions.take() {
            for p in list {
                self.primary.complete_write(&p.keys, false);
            }
        }
        self.load_sources.clear();
        self.parked_cascades.clear();
        for st in self.requests.values_mut() {
            st.pending_cascade_keys.clear();
        }
        // In the order the requests arrived, as vLLM walks its request dict.
        let mut finished: Vec<(u64, Arc<str>)> = self
            .requests
            .iter()
            .filter(|(_, s)| s.finished)
            .map(|(k, s)| (s.arrival, k.clone()))
            .collect();
        finished.sort_unstable_by_key(|(arrival, _)| *arrival);
        for st in self.requests.values_mut() {
            st.pending_primary_stores = 0;
        }
        for (_, id) in finished {
            self.maybe_finalize(&id);
        }
        self.primary.reset_cache();
        // Every job was reported and every unsubmitted promotion freed above, so the writes
        // still in flight are GPU -> primary stores prepared before the reset.
        self.stale_stores = self.primary.writes_in_flight().into_iter().collect();
        for t in &mut self.tiers {
            if let Some(d) = &mut t.detector {
                d.reset();
            }
        }
        self.promotions_held = true;
        self.take_error()
    }

    /// The workers reported every job in flight at the reset: promotions may start again.
    pub fn on_reset_flushed(&mut self) {
        self.promotions_held = false;
    }

    /// Drains every tier and processes the results (so every pin taken for a store is released
    /// and every reserved promotion row freed or published, and the metrics count every job),
    /// frees the rows of promotions never submitted, then shuts the tiers down in config
    /// order. If any fails, its error (the last one) is returned and the primary region is
    /// deliberately kept mapped for the life of the process, because a failed tier may still
    /// do I/O into it.
    pub fn shutdown(&mut self) -> Result<()> {
        if self.shut_down {
            return Ok(());
        }
        self.shut_down = true;
        for t in &mut self.tiers {
            t.tier.drain_jobs();
        }
        self.process_finished_jobs();
        for (_, list) in self.pending_promotions.take() {
            for p in list {
                self.primary.complete_write(&p.keys, false);
            }
        }
        if !self.jobs.is_empty() {
            log::error!(
                "{} job(s) still unreported after drain_jobs at shutdown; their rows stay pinned",
                self.jobs.len()
            );
        }
        let mut last = None;
        for t in &mut self.tiers {
            if let Err(e) = t.tier.shutdown() {
                log::error!("failed to shut down secondary tier {}: {e}", t.label);
                last = Some(e);
            }
        }
        match last {
            None => Ok(()),
            Some(e) => {
                log::error!("keeping the primary region mapped: a tier may still reference it");
                std::mem::forget(self.region.clone());
                Err(e)
            }
        }
    }

    /// Refreshes gauges (usage, active jobs, EMA, drops, tier metrics) in the registry.
    pub fn refresh_metrics(&mut self) {
        let u = self.primary.usage();
        let total = u.total.max(1) as f64;
        let (usage, write, read) = u.usage_fractions();
        let m = &mut self.metrics;
        m.registry.set(m.cpu_usage.0, usage);
        m.registry.set(m.cpu_usage.1, write);
        m.registry.set(m.cpu_usage.2, read);
        for (i, t) in self.tiers.iter().enumerate() {
            let s = m.tiers[i];
            m.registry
                .set(s.write_usage, t.promotion_rows as f64 / total);
            m.registry.set(s.read_usage, t.cascade_rows as f64 / total);
            m.registry
                .set(s.active_promotions, t.active_promotions as f64);
            m.registry.set(s.active_cascades, t.active_cascades as f64);
            if let (Some((ema, stores, blocks)), Some(d)) = (s.backpressure, &t.detector) {
                let (ds, db) = d.dropped();
                m.registry.set(ema, d.ema());
                m.registry.set(stores, ds as f64);
                m.registry.set(blocks, db as f64);
            }
        }
        for i in 0..self.tiers.len() {
            let tm = self.tiers[i].tier.metrics();
            self.metrics.record_tier_metrics(i, tm);
        }
    }

    /// The registry (call [`TieringManager::refresh_metrics`] first for current gauges).
    pub fn registry(&self) -> &Registry {
        &self.metrics.registry
    }

    /// Refreshes and renders every metric (`text/plain; version=0.0.4`).
    pub fn metrics_text(&mut self) -> String {
        self.refresh_metrics();
        self.metrics.registry.render()
    }

    /// Each secondary tier's health, with its label (`1:nvme`), in config order.
    pub fn health(&self) -> Vec<(String, TierHealth)> {
        self.tiers
            .iter()
            .map(|t| (t.label.clone(), t.tier.health()))
            .collect()
    }
}

fn labels_len(m: &TieringMetrics) -> usize {
    m.tiers.len()
}

impl Drop for TieringManager {
    fn drop(&mut self) {
        if !self.shut_down
            && let Err(e) = self.shutdown()
        {
            log::error!("tiering manager shutdown on drop failed: {e}");
        }
    }
}
