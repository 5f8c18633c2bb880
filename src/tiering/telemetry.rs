//! The tiering manager's metrics: vLLM 0.33.0's `kv_offload_tiering_*` families (names, types,
//! labels, buckets; contract doc §9.1) with vLLM's byte and time semantics (§9.2), the primary
//! usage gauges (§9.4), and the tiers' own metrics, all in the manager's [`Registry`].

use std::collections::HashMap;

use crate::contract::secondary::{TierMetric, TierMetricKind};
use crate::error::Result;
use crate::metrics::{FamilyId, MetricKind, Registry, SeriesId};

/// Family names without the namespace prefix.
pub mod names {
    /// Histogram: blocking time of a per-chunk tier lookup that resolved HIT/MISS.
    pub const LOOKUP_SYNC_DELAY: &str = "kv_offload_tiering_lookup_sync_delay_seconds";
    /// Histogram: first RETRY -> resolution of the same tier lookup.
    pub const LOOKUP_ASYNC_DELAY: &str = "kv_offload_tiering_lookup_async_delay_seconds";
    /// Counter: bytes secondary -> primary (completed keys x row stride).
    pub const READ_BYTES: &str = "kv_offload_tiering_read_bytes";
    /// Counter: seconds reading secondary -> primary (reported `transfer_time`).
    pub const READ_TIME: &str = "kv_offload_tiering_read_time";
    /// Counter: bytes primary -> secondary (completed keys x row stride).
    pub const WRITE_BYTES: &str = "kv_offload_tiering_write_bytes";
    /// Counter: seconds writing primary -> secondary.
    pub const WRITE_TIME: &str = "kv_offload_tiering_write_time";
    /// Counter: failed promotion jobs.
    pub const PROMOTION_JOB_FAILURES: &str = "kv_offload_tiering_promotion_job_failures";
    /// Counter: failed store (cascade) jobs.
    pub const CASCADE_JOB_FAILURES: &str = "kv_offload_tiering_cascade_job_failures";
    /// Counter: chunk lookups resolved by a tier.
    pub const CHUNK_QUERIES: &str = "kv_offload_tiering_chunk_queries";
    /// Counter: chunk lookup hits.
    pub const CHUNK_HITS: &str = "kv_offload_tiering_chunk_hits";
    /// Counter (no labels): promotions refused because the primary could not allocate.
    pub const PROMOTION_ALLOCATION_FAILURES: &str =
        "kv_offload_tiering_promotion_allocation_failures";
    /// Gauge: fraction of primary rows held by active promotion jobs.
    pub const PRIMARY_WRITE_USAGE_PERC: &str = "kv_offload_tiering_primary_write_usage_perc";
    /// Gauge: fraction of primary rows pinned by active store jobs.
    pub const PRIMARY_READ_USAGE_PERC: &str = "kv_offload_tiering_primary_read_usage_perc";
    /// Gauge: active promotion jobs.
    pub const ACTIVE_PROMOTION_JOBS: &str = "kv_offload_tiering_active_promotion_jobs";
    /// Gauge: active store jobs.
    pub const ACTIVE_CASCADE_JOBS: &str = "kv_offload_tiering_active_cascade_jobs";
    /// Histogram (tier, result): promotion job creation -> completion processed.
    pub const PROMOTION_LATENCY: &str = "kv_offload_tiering_promotion_latency_seconds";
    /// Gauge: back-pressure EMA, s/MiB.
    pub const BACKPRESSURE_STORE_LATENCY_EMA: &str =
        "kv_offload_tiering_backpressure_store_latency_ema";
    /// Counter: store jobs dropped by back-pressure.
    pub const BACKPRESSURE_STORES_DROPPED: &str = "kv_offload_tiering_backpressure_stores_dropped";
    /// Counter: chunks in dropped store jobs.
    pub const BACKPRESSURE_BLOCKS_DROPPED: &str = "kv_offload_tiering_backpressure_blocks_dropped";
    /// Gauge: primary rows with `ref_cnt != 0`.
    pub const CPU_CACHE_USAGE_PERC: &str = "kv_offload_cpu_cache_usage_perc";
    /// Gauge: primary rows being written (`ref_cnt == -1`).
    pub const CPU_CACHE_WRITE_USAGE_PERC: &str = "kv_offload_cpu_cache_write_usage_perc";
    /// Gauge: primary rows pinned for reading (`ref_cnt > 0`).
    pub const CPU_CACHE_READ_USAGE_PERC: &str = "kv_offload_cpu_cache_read_usage_perc";
    /// Counter (kvtier): breaches of the job-reporting contract (duplicate, unknown, foreign ids).
    pub const CONTRACT_VIOLATIONS: &str = "tiering_contract_violations";
}

/// Buckets of the sync lookup delay histogram.
pub const LOOKUP_SYNC_BUCKETS: [f64; 11] = [
    1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0,
];
/// Buckets of the async lookup delay histogram.
pub const LOOKUP_ASYNC_BUCKETS: [f64; 11] =
    [1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0];
/// Buckets of the promotion latency histogram.
pub const PROMOTION_LATENCY_BUCKETS: [f64; 13] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// (tier index, metric name, extra labels).
type TierMetricKey = (usize, &'static str, Vec<(&'static str, String)>);

/// Lookup series of one tier (the primary included, as `0:primary`).
#[derive(Debug, Clone, Copy)]
pub struct LookupSeries {
    /// `chunk_queries`.
    pub queries: SeriesId,
    /// `chunk_hits`.
    pub hits: SeriesId,
    /// `lookup_sync_delay_seconds`.
    pub sync_delay: SeriesId,
    /// `lookup_async_delay_seconds`.
    pub async_delay: SeriesId,
}

/// Series of one secondary tier.
#[derive(Debug, Clone, Copy)]
pub struct SecondarySeries {
    /// `read_bytes`.
    pub read_bytes: SeriesId,
    /// `write_bytes`.
    pub write_bytes: SeriesId,
    /// `read_time`, created at the first reported transfer time.
    pub read_time: Option<SeriesId>,
    /// `write_time`, created at the first reported transfer time.
    pub write_time: Option<SeriesId>,
    /// `promotion_job_failures`.
    pub promotion_failures: SeriesId,
    /// `cascade_job_failures`.
    pub cascade_failures: SeriesId,
    /// `primary_write_usage_perc`.
    pub write_usage: SeriesId,
    /// `primary_read_usage_perc`.
    pub read_usage: SeriesId,
    /// `active_promotion_jobs`.
    pub active_promotions: SeriesId,
    /// `active_cascade_jobs`.
    pub active_cascades: SeriesId,
    /// `promotion_latency_seconds{result="success"}`.
    pub latency_success: SeriesId,
    /// `promotion_latency_seconds{result="failure"}`.
    pub latency_failure: SeriesId,
    /// Back-pressure series (EMA, stores dropped, blocks dropped), for tiers with a detector.
    pub backpressure: Option<(SeriesId, SeriesId, SeriesId)>,
}

/// Every family and series the manager records into.
#[derive(Debug)]
pub struct TieringMetrics {
    /// The registry (owned by the manager).
    pub registry: Registry,
    labels: Vec<String>,
    read_time: FamilyId,
    write_time: FamilyId,
    /// Index 0 = primary, `i + 1` = secondary tier `i`.
    pub lookup: Vec<LookupSeries>,
    /// Index `i` = secondary tier `i`.
    pub tiers: Vec<SecondarySeries>,
    /// `promotion_allocation_failures`.
    pub promotion_allocation_failures: SeriesId,
    /// CPU usage gauges: (usage, write usage, read usage).
    pub cpu_usage: (SeriesId, SeriesId, SeriesId),
    /// `tiering_contract_violations`.
    pub contract_violations: SeriesId,
    tier_metric_series: HashMap<TierMetricKey, Option<SeriesId>>,
}

/// The families the manager declares, in declaration order (the exposition's order).
struct Families {
    /// Lookups and transfers, declared first.
    transfers: TransferFamilies,
    /// Jobs, back-pressure and the primary's usage, declared next.
    jobs: JobFamilies,
}

/// The families of lookups and transfers.
struct TransferFamilies {
    /// `lookup_sync_delay_seconds`.
    sync: FamilyId,
    /// `lookup_async_delay_seconds`.
    asyn: FamilyId,
    /// `read_bytes`.
    read_bytes: FamilyId,
    /// `read_time`.
    read_time: FamilyId,
    /// `write_bytes`.
    write_bytes: FamilyId,
    /// `write_time`.
    write_time: FamilyId,
    /// `promotion_job_failures`.
    pfail: FamilyId,
    /// `cascade_job_failures`.
    cfail: FamilyId,
    /// `chunk_queries`.
    queries: FamilyId,
    /// `chunk_hits`.
    hits: FamilyId,
}

/// The families of jobs, back-pressure, the primary's usage and contract breaches.
struct JobFamilies {
    /// `promotion_allocation_failures`.
    alloc: FamilyId,
    /// `primary_write_usage_perc`.
    wuse: FamilyId,
    /// `primary_read_usage_perc`.
    ruse: FamilyId,
    /// `active_promotion_jobs`.
    aprom: FamilyId,
    /// `active_cascade_jobs`.
    acasc: FamilyId,
    /// `promotion_latency_seconds`.
    lat: FamilyId,
    /// `backpressure_store_latency_ema`.
    ema: FamilyId,
    /// `backpressure_stores_dropped`.
    sdrop: FamilyId,
    /// `backpressure_blocks_dropped`.
    bdrop: FamilyId,
    /// `cpu_cache_usage_perc`.
    cpu: FamilyId,
    /// `cpu_cache_write_usage_perc`.
    cpu_w: FamilyId,
    /// `cpu_cache_read_usage_perc`.
    cpu_r: FamilyId,
    /// `tiering_contract_violations`.
    contract: FamilyId,
}

impl TransferFamilies {
    /// Declares the lookup delay histograms and the transfer, failure and query counters.
    fn declare(r: &mut Registry) -> Result<Self> {
        use names::*;
        let tier = &["tier"][..];
        let h = |b: &[f64]| MetricKind::Histogram(b.to_vec());
        let sync = r.family(LOOKUP_SYNC_DELAY, "Histogram of blocking time spent in a per-chunk tier lookup that resolved as a hit or miss, labeled by tier, in seconds.", h(&LOOKUP_SYNC_BUCKETS), tier)?;
        let asyn = r.family(LOOKUP_ASYNC_DELAY, "Histogram of wall-clock time from a per-chunk tier lookup first returning retry until that same tier lookup resolves as a hit or miss, labeled by tier, in seconds.", h(&LOOKUP_ASYNC_BUCKETS), tier)?;
        let read_bytes = r.family(
            READ_BYTES,
            "Total bytes read from secondary tiers into the primary tier, labeled by tier.",
            MetricKind::Counter,
            tier,
        )?;
        let read_time_help = format!(
            "Total time spent reading from secondary tiers into the primary tier, in seconds, \
             labeled by tier. Tiers that do not report per-job transfer time have no series \
             here. Use {}{PROMOTION_LATENCY} for tier-independent promotion timing.",
            r.prefix()
        );
        let read_time = r.family(READ_TIME, &read_time_help, MetricKind::Counter, tier)?;
        let write_bytes = r.family(
            WRITE_BYTES,
            "Total bytes written from the primary tier to secondary tiers, labeled by tier.",
            MetricKind::Counter,
            tier,
        )?;
        let write_time = r.family(WRITE_TIME, "Total time spent writing from the primary tier to secondary tiers, in seconds, labeled by tier. Tiers that do not report per-job transfer time have no series here.", MetricKind::Counter, tier)?;
        let pfail = r.family(
            PROMOTION_JOB_FAILURES,
            "Number of failed secondary-tier promotion jobs, labeled by tier.",
            MetricKind::Counter,
            tier,
        )?;
        let cfail = r.family(
            CASCADE_JOB_FAILURES,
            "Number of failed secondary-tier cascade jobs, labeled by tier.",
            MetricKind::Counter,
            tier,
        )?;
        let queries = r.family(
            CHUNK_QUERIES,
            "Number of chunk lookup queries sent to a tier, labeled by tier.",
            MetricKind::Counter,
            tier,
        )?;
        let hits = r.family(
            CHUNK_HITS,
            "Number of chunk lookup hits in a tier, labeled by tier.",
            MetricKind::Counter,
            tier,
        )?;
        Ok(TransferFamilies {
            sync,
            asyn,
            read_bytes,
            read_time,
            write_bytes,
            write_time,
            pfail,
            cfail,
            queries,
            hits,
        })
    }
}

impl JobFamilies {
    /// Declares the job, back-pressure, usage and contract families.
    fn declare(r: &mut Registry) -> Result<Self> {
        use names::*;
        let tier = &["tier"][..];
        let h = |b: &[f64]| MetricKind::Histogram(b.to_vec());
        let alloc = r.family(PROMOTION_ALLOCATION_FAILURES, "Number of promotion attempts that failed because the primary tier could not allocate space.", MetricKind::Counter, &[])?;
        let wuse = r.family(PRIMARY_WRITE_USAGE_PERC, "Current fraction of primary-tier space used by writes from secondary tiers, labeled by tier.", MetricKind::Gauge, tier)?;
        let ruse = r.family(PRIMARY_READ_USAGE_PERC, "Current fraction of primary-tier space used by reads to secondary tiers, labeled by tier.", MetricKind::Gauge, tier)?;
        let aprom = r.family(
            ACTIVE_PROMOTION_JOBS,
            "Number of active secondary-tier promotion jobs, labeled by tier.",
            MetricKind::Gauge,
            tier,
        )?;
        let acasc = r.family(
            ACTIVE_CASCADE_JOBS,
            "Number of active secondary-tier cascade jobs, labeled by tier.",
            MetricKind::Gauge,
            tier,
        )?;
        let lat = r.family(PROMOTION_LATENCY, "Histogram of per-job latency for secondary-tier promotion attempts, measured from job creation until the tiering manager observes completion so that tier queueing is included, labeled by tier and result, in seconds. Includes failed attempts.", h(&PROMOTION_LATENCY_BUCKETS), &["tier", "result"])?;
        let ema = r.family(
            BACKPRESSURE_STORE_LATENCY_EMA,
            "Exponential moving average of store latency for back-pressure detection, in s/MiB.",
            MetricKind::Gauge,
            tier,
        )?;
        let sdrop = r.family(
            BACKPRESSURE_STORES_DROPPED,
            "Number of store operations dropped due to back-pressure on a secondary tier.",
            MetricKind::Counter,
            tier,
        )?;
        let bdrop = r.family(
            BACKPRESSURE_BLOCKS_DROPPED,
            "Number of blocks dropped due to back-pressure on a secondary tier.",
            MetricKind::Counter,
            tier,
        )?;
        let cpu = r.family(
            CPU_CACHE_USAGE_PERC,
            // vLLM's own documentation of these three (cpu/spec.py), word for word.
            "Fraction of CPU KV-cache space currently pinned by active transfers (0.0 = idle, \
             1.0 = saturated). Sustained high values indicate transfers (stores or promotions) \
             may be dropped due to insufficient capacity.",
            MetricKind::Gauge,
            &[],
        )?;
        let cpu_w = r.family(
            CPU_CACHE_WRITE_USAGE_PERC,
            "Fraction of CPU KV-cache space currently pinned by in-flight stores that have not \
             yet completed (0.0 = idle, 1.0 = saturated).",
            MetricKind::Gauge,
            &[],
        )?;
        let cpu_r = r.family(
            CPU_CACHE_READ_USAGE_PERC,
            "Fraction of CPU KV-cache space currently pinned by in-flight loads that have not \
             yet completed (0.0 = idle, 1.0 = saturated).",
            MetricKind::Gauge,
            &[],
        )?;
        let contract = r.family(CONTRACT_VIOLATIONS, "Job reports that broke the exactly-once contract (duplicate, unknown or foreign job id), a bug in a tier.", MetricKind::Counter, &[])?;
        Ok(JobFamilies {
            alloc,
            wuse,
            ruse,
            aprom,
            acasc,
            lat,
            ema,
            sdrop,
            bdrop,
            cpu,
            cpu_w,
            cpu_r,
            contract,
        })
    }
}

impl Families {
    /// Declares every family in `r` (vLLM's names, help texts, kinds, buckets and labels).
    fn declare(r: &mut Registry) -> Result<Self> {
        let transfers = TransferFamilies::declare(r)?;
        let jobs = JobFamilies::declare(r)?;
        Ok(Families { transfers, jobs })
    }

    /// The lookup series of the tier labelled `l`.
    fn lookup(&self, r: &mut Registry, l: &str) -> Result<LookupSeries> {
        Ok(LookupSeries {
            queries: r.series(self.transfers.queries, &[l])?,
            hits: r.series(self.transfers.hits, &[l])?,
            sync_delay: r.series(self.transfers.sync, &[l])?,
            async_delay: r.series(self.transfers.asyn, &[l])?,
        })
    }

    /// The series of the secondary tier labelled `l` (back-pressure ones when it has a
    /// detector).
    fn secondary(&self, r: &mut Registry, l: &str, has_detector: bool) -> Result<SecondarySeries> {
        let backpressure = if has_detector {
            Some((
                r.series(self.jobs.ema, &[l])?,
                r.series(self.jobs.sdrop, &[l])?,
                r.series(self.jobs.bdrop, &[l])?,
            ))
        } else {
            None
        };
        Ok(SecondarySeries {
            read_bytes: r.series(self.transfers.read_bytes, &[l])?,
            write_bytes: r.series(self.transfers.write_bytes, &[l])?,
            read_time: None,
            write_time: None,
            promotion_failures: r.series(self.transfers.pfail, &[l])?,
            cascade_failures: r.series(self.transfers.cfail, &[l])?,
            write_usage: r.series(self.jobs.wuse, &[l])?,
            read_usage: r.series(self.jobs.ruse, &[l])?,
            active_promotions: r.series(self.jobs.aprom, &[l])?,
            active_cascades: r.series(self.jobs.acasc, &[l])?,
            latency_success: r.series(self.jobs.lat, &[l, "success"])?,
            latency_failure: r.series(self.jobs.lat, &[l, "failure"])?,
            backpressure,
        })
    }
}

impl TieringMetrics {
    /// Declares every family for the primary plus `secondaries` = (label, has detector).
    pub fn new(prefix: &str, secondaries: &[(String, bool)]) -> Result<Self> {
        let mut r = Registry::new(prefix)?;
        let f = Families::declare(&mut r)?;
        let mut labels = vec!["0:primary".to_string()];
        labels.extend(secondaries.iter().map(|(l, _)| l.clone()));
        let mut lookup = Vec::new();
        for l in &labels {
            lookup.push(f.lookup(&mut r, l)?);
        }
        let mut tiers = Vec::new();
        for (l, has_detector) in secondaries {
            tiers.push(f.secondary(&mut r, l, *has_detector)?);
        }
        Ok(TieringMetrics {
            promotion_allocation_failures: r.series(f.jobs.alloc, &[])?,
            cpu_usage: (
                r.series(f.jobs.cpu, &[])?,
                r.series(f.jobs.cpu_w, &[])?,
                r.series(f.jobs.cpu_r, &[])?,
            ),
            contract_violations: r.series(f.jobs.contract, &[])?,
            registry: r,
            labels,
            read_time: f.transfers.read_time,
            write_time: f.transfers.write_time,
            lookup,
            tiers,
            tier_metric_series: HashMap::new(),
        })
    }

    /// The label of tier `idx` (0 = primary, `i + 1` = secondary `i`).
    #[cfg(any(test, feature = "test-support"))]
    pub fn label(&self, idx: usize) -> &str {
        &self.labels[idx]
    }

    /// Adds a reported transfer time to tier `tier`'s read (promotion) or write counter.
    pub fn add_transfer_time(&mut self, tier: usize, promotion: bool, secs: f64) {
        let label = self.labels[tier + 1].clone();
        let (slot, fam) = if promotion {
            (&mut self.tiers[tier].read_time, self.read_time)
        } else {
            (&mut self.tiers[tier].write_time, self.write_time)
        };
        if slot.is_none() {
            *slot = self.registry.series(fam, &[&label]).ok();
        }
        if let Some(s) = *slot {
            self.registry.inc(s, secs);
        }
    }

    /// Mirrors tier `tier`'s own metrics into the registry (adds the `tier` label).
    pub fn record_tier_metrics(&mut self, tier: usize, metrics: Vec<TierMetric>) {
        for m in metrics {
            let key = (tier, m.name, m.labels.clone());
            let id = match self.tier_metric_series.get(&key) {
                Some(id) => *id,
                None => {
                    let series = tier_metric_series(&mut self.registry, &self.labels[tier + 1], &m);
                    let id = match series {
                        Ok(id) => Some(id),
                        Err(e) => {
                            // Logged once; the series stays absent from the exposition.
                            log::warn!("tier metric {} not exported: {e}", m.name);
                            None
                        }
                    };
                    self.tier_metric_series.insert(key, id);
                    id
                }
            };
            let Some(id) = id else { continue };
            self.registry.set(id, m.value);
        }
    }
}

/// The series of `m`, a metric of the tier labelled `tier_label`, in `registry`: its family
/// (made on first use) has the label `tier` followed by the metric's own labels.
pub(crate) fn tier_metric_series(
    registry: &mut Registry,
    tier_label: &str,
    m: &TierMetric,
) -> Result<SeriesId> {
    let kind = match m.kind {
        TierMetricKind::Counter => MetricKind::Counter,
        TierMetricKind::Gauge => MetricKind::Gauge,
    };
    let mut names = vec!["tier"];
    names.extend(m.labels.iter().map(|(k, _)| *k));
    let mut values = vec![tier_label];
    values.extend(m.labels.iter().map(|(_, v)| v.as_str()));
    let family = registry.family(m.name, m.help, kind, &names)?;
    registry.series(family, &values)
}
