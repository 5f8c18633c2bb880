//! The contract every secondary tier implements (vLLM `SecondaryTierManager`, contract doc
//! section 3). The manager calls these from one thread at a time; every call except
//! [`SecondaryTier::drain_jobs`] and [`SecondaryTier::shutdown`] must return in microseconds:
//! validate, enqueue to the tier's own I/O threads, return.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::contract::job::{
    JobResult, Locality, LookupResult, Medium, OffloadPolicy, OffloadingEvent, RequestContext,
    TransferJob,
};
use crate::error::Result;
use crate::key::ChunkKey;

/// Whether a tier metric is a counter or a gauge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TierMetricKind {
    /// Monotonic total.
    Counter,
    /// Current value.
    Gauge,
}

/// One tier-owned metric sample (bytes in flight, checksum failures, direct-I/O mode...).
/// The manager adds the `tier` label and its namespace prefix.
#[derive(Debug, Clone, PartialEq)]
pub struct TierMetric {
    /// Name without prefix, e.g. `g3_checksum_failures`.
    pub name: &'static str,
    /// Help text.
    pub help: &'static str,
    /// Counter or gauge.
    pub kind: TierMetricKind,
    /// Extra labels from small fixed sets (never keys or free text).
    pub labels: Vec<(&'static str, String)>,
    /// The value.
    pub value: f64,
}

/// One row of a tier's table of metrics: name, help text, kind and value (see
/// [`TierMetric::rows`]).
pub type MetricRow = (&'static str, &'static str, TierMetricKind, f64);

/// The value of a counter or gauge a tier's threads keep in an atomic (read relaxed).
pub fn sampled(a: &AtomicU64) -> f64 {
    a.load(Ordering::Relaxed) as f64
}

/// The value of a flag a tier's threads keep in an atomic: 1 when set, else 0.
pub fn sampled_flag(a: &AtomicBool) -> f64 {
    f64::from(u8::from(a.load(Ordering::Relaxed)))
}

impl TierMetric {
    /// Samples without labels, one per row of `rows`, in order.
    pub fn rows(rows: impl IntoIterator<Item = MetricRow>) -> impl Iterator<Item = TierMetric> {
        rows.into_iter()
            .map(|(name, help, kind, value)| TierMetric::new(name, help, kind, value))
    }

    /// This sample with the label `name` = `value` added after its others.
    pub fn with_label(mut self, name: &'static str, value: String) -> Self {
        self.labels.push((name, value));
        self
    }

    /// A sample without labels.
    pub fn new(name: &'static str, help: &'static str, kind: TierMetricKind, value: f64) -> Self {
        TierMetric {
            name,
            help,
            kind,
            labels: Vec::new(),
            value,
        }
    }

    /// The gauge `name` = 1 that says which I/O engine a tier runs (label `engine`) and
    /// whether it fell back to it (label `fallback`, 0 or 1).
    pub fn engine_info(
        name: &'static str,
        help: &'static str,
        engine: String,
        fell_back: bool,
    ) -> Self {
        let mut m = TierMetric::new(name, help, TierMetricKind::Gauge, 1.0);
        m.labels.push(("engine", engine));
        m.labels.push(("fallback", u8::from(fell_back).to_string()));
        m
    }
}

/// How well a tier can serve, for `/healthz` and shutdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum HealthState {
    /// Stores and loads are served.
    #[default]
    Ok,
    /// Served in part: some stores refused, a path or the journal failing, recovering.
    Degraded,
    /// Nothing is served (its index could not be recovered), or its shutdown lost durability
    /// (the final checkpoint failed).
    Failed,
}

/// A tier's health: its state and one line per problem.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TierHealth {
    /// The overall state (the worst of the problems).
    pub state: HealthState,
    /// What is wrong, one line each (empty when `Ok`).
    pub problems: Vec<String>,
}

impl TierHealth {
    /// Adds a problem of `state` (the overall state becomes the worse of the two).
    pub fn add(&mut self, state: HealthState, problem: impl Into<String>) {
        self.state = self.state.max(state);
        self.problems.push(problem.into());
    }
}

/// What a tier type reports, without a tier: a metric's name, help, kind and label names
/// (for a host that declares metrics before any tier exists, such as vLLM's
/// `build_metric_definitions`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricDescriptor {
    /// Name without prefix, e.g. `g3_checksum_failures`.
    pub name: &'static str,
    /// Help text.
    pub help: &'static str,
    /// Counter or gauge.
    pub kind: TierMetricKind,
    /// Label names, in the order samples carry them.
    pub label_names: Vec<&'static str>,
}

/// A secondary tier: holds chunks outside the primary and moves whole rows to and from it.
pub trait SecondaryTier: Send {
    /// The tier's type name (`"nvme"`, `"memory"`), used in the metric label `<i+1>:<type>`.
    fn tier_type(&self) -> &str;

    /// The medium (`Storage` for NVMe).
    fn medium(&self) -> Option<Medium>;

    /// The configured locality.
    fn locality(&self) -> Option<Locality>;

    /// `Hit` = present and loadable now; `Miss` = absent; `Retry` = not known yet (e.g. while
    /// the index is being recovered). Never blocks.
    fn lookup(&mut self, key: &ChunkKey, req: &RequestContext) -> LookupResult;

    /// Primary -> tier. The job's rows are pinned until the job is reported. Keys already held
    /// are skipped. Must be reported even if empty.
    fn submit_store(&mut self, job: TransferJob);

    /// Tier -> primary. Writes each key's whole row into `chunk_ids[i]` and no other row.
    fn submit_load(&mut self, job: TransferJob);

    /// Every job finished since the last call, exactly once each.
    fn get_finished_jobs(&mut self) -> Vec<JobResult>;

    /// A request starts; the answer says which chunks the tier wants.
    fn on_new_request(&mut self, _req: &RequestContext) -> OffloadPolicy {
        OffloadPolicy::ChunkLevel
    }

    /// No further submissions for this request (jobs may still be in flight).
    fn on_request_finished(&mut self, _req: &RequestContext) {}

    /// Marks chunks as recently used, for the tier's own eviction (vLLM's `touch`, forwarded
    /// by the manager to every tier). Default: nothing.
    fn touch(&mut self, _keys: &[ChunkKey], _req: &RequestContext) {}

    /// Last call of each scheduling step.
    fn on_schedule_end(&mut self) {}

    /// True while jobs are outstanding.
    fn has_pending_work(&self) -> bool;

    /// Stored / removed events since the last call.
    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        Vec::new()
    }

    /// Blocks until every submitted job has completed or failed. Transfers in flight are never
    /// aborted; queued ones may be cancelled and reported failed. Results are then available
    /// from [`SecondaryTier::get_finished_jobs`].
    fn drain_jobs(&mut self);

    /// Drains, persists what must survive a restart, and releases threads and registrations.
    /// An error means I/O may still reference the primary region: keep it mapped.
    fn shutdown(&mut self) -> Result<()>;

    /// Tier-owned metrics (engine, queue depth, checksum failures, ...).
    fn metrics(&self) -> Vec<TierMetric> {
        Vec::new()
    }

    /// The tier's health, from its own state (never blocks). After [`SecondaryTier::shutdown`]
    /// it says whether the shutdown kept everything durable.
    fn health(&self) -> TierHealth {
        TierHealth::default()
    }

    /// Whether lookups can answer HIT or MISS yet: false while the tier is still opening (a
    /// persistent tier recovering its index answers RETRY meanwhile).
    fn ready(&self) -> bool {
        true
    }

    /// Static facts about the tier, as (label name, value) pairs, for vLLM's
    /// `vllm:kv_offload_config_info` series and for reports. Never `tier` (the manager adds
    /// it); the names are fixed for a tier type.
    fn config_info(&self) -> Vec<(&'static str, String)> {
        Vec::new()
    }
}
