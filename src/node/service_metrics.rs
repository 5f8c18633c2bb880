//! The node service's metrics in Prometheus text (`NodeService::metrics_text`): the tier's own
//! (label `tier`), the service's connections, refusals, cancellations and losses, and per
//! connected engine (label `engine`) its jobs, bytes, failed jobs, lookups, errors,
//! connections, jobs in flight and its region's pages; then the staging pool's.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::contract::secondary::SecondaryTier;
use crate::error::Result;
use crate::metrics::{FamilyId, MetricKind, Registry};
use crate::node::engines::EngineStatus;
use crate::node::session::ServiceShared;
use crate::tiering::telemetry::tier_metric_series;

/// Renders the service's metrics with names under `prefix`; `tier_label` names the tier.
pub fn render(sh: &ServiceShared, tier_label: &str, prefix: &str) -> Result<String> {
    let mut reg = Registry::new(prefix)?;
    let shares = sh.engines.region_huge_page_shares();
    tier_series(&mut reg, sh, tier_label, &shares)?;
    let engines = sh.engines.status();
    service_series(&mut reg, sh, engines.len())?;
    let families = EngineFamilies::register(&mut reg)?;
    region_series(&mut reg, sh, &shares)?;
    if let Some(st) = &sh.staging {
        st.render_metrics(&mut reg)?;
    }
    counter(
        &mut reg,
        "node_events_dropped_total",
        "Inventory events dropped from the queue of an engine that did not ask for them",
        &sh.events.dropped,
    )?;
    families.set(&mut reg, &engines)?;
    Ok(reg.render())
}

/// The tier's own metrics. Its `g3_region_huge_pages` is the lowest share among the engines'
/// regions (`shares`), which are what the service moves rows through (the tier's own one-row
/// region moves nothing); absent while no engine is connected.
fn tier_series(
    reg: &mut Registry,
    sh: &ServiceShared,
    tier_label: &str,
    shares: &[(String, f64)],
) -> Result<()> {
    let tier_metrics = sh.tier.lock().metrics();
    for m in &tier_metrics {
        let mut value = m.value;
        if m.name == "g3_region_huge_pages" {
            match shares.iter().map(|(_, s)| *s).reduce(f64::min) {
                Some(lowest) => value = lowest,
                None => continue,
            }
        }
        let id = tier_metric_series(reg, tier_label, m)?;
        reg.set(id, value);
    }
    Ok(())
}

/// A series without labels: a gauge set to `v`.
fn gauge(reg: &mut Registry, name: &str, help: &str, v: f64) -> Result<()> {
    let f = reg.family(name, help, MetricKind::Gauge, &[])?;
    let id = reg.series(f, &[])?;
    reg.set(id, v);
    Ok(())
}

/// A series without labels: a counter at `v`.
fn counter(reg: &mut Registry, name: &str, help: &str, v: &AtomicU64) -> Result<()> {
    let f = reg.family(name, help, MetricKind::Counter, &[])?;
    let id = reg.series(f, &[])?;
    reg.inc(id, v.load(Ordering::Relaxed) as f64);
    Ok(())
}

/// The service's own counts: engines connected, connections refused, jobs cancelled,
/// sessions ended, regions lost.
fn service_series(reg: &mut Registry, sh: &ServiceShared, connected: usize) -> Result<()> {
    gauge(
        reg,
        "node_engines_connected",
        "Engine processes connected to the node service",
        connected as f64,
    )?;
    let e = &sh.engines;
    counter(
        reg,
        "node_connections_refused_total",
        "Connections refused (uid not allowed, digest or row stride mismatch, protocol)",
        &e.refused,
    )?;
    counter(
        reg,
        "node_jobs_cancelled_total",
        "Jobs cancelled because their engine disconnected",
        &e.cancelled_jobs,
    )?;
    counter(
        reg,
        "node_disconnects_total",
        "Engine sessions ended",
        &e.disconnects,
    )?;
    counter(
        reg,
        "node_regions_lost_total",
        "Engine regions lost: the engine shrank its region file while registered \
         (its jobs failed, its session ended; see `kvtier service status`)",
        &e.regions_lost,
    )
}

/// Per engine: the share of its region the service maps in 2 MiB pages (`shares`), and the
/// bytes of its rows staged through the service's own pages.
fn region_series(reg: &mut Registry, sh: &ServiceShared, shares: &[(String, f64)]) -> Result<()> {
    let huge = reg.family(
        "node_engine_region_huge_pages",
        "Share (0 to 1) of an engine's registered region the service maps in 2 MiB pages",
        MetricKind::Gauge,
        &["engine"],
    )?;
    for (name, share) in shares {
        let id = reg.series(huge, &[name.as_str()])?;
        reg.set(id, *share);
    }
    let staged = reg.family(
        "node_engine_staged_bytes",
        "Bytes of an engine's rows the service staged through its own 2 MiB pages because \
         the region is in 4 KiB pages (only engines whose rows are staged)",
        MetricKind::Counter,
        &["engine"],
    )?;
    // Connections under one engine name add up, as the engine's other counters do.
    for (name, bytes) in sh.engines.region_staged_bytes() {
        let id = reg.series(staged, &[name.as_str()])?;
        reg.inc(id, bytes as f64);
    }
    Ok(())
}

/// The per-engine families of the engines' counters (label `engine`; jobs and bytes also
/// `op`).
struct EngineFamilies {
    jobs: FamilyId,
    bytes: FamilyId,
    failed: FamilyId,
    lookups: FamilyId,
    errors: FamilyId,
    connections: FamilyId,
    in_flight: FamilyId,
}

impl EngineFamilies {
    fn register(reg: &mut Registry) -> Result<EngineFamilies> {
        let engine = &["engine"];
        Ok(EngineFamilies {
            jobs: reg.family(
                "node_engine_jobs_total",
                "Jobs finished per engine and operation",
                MetricKind::Counter,
                &["engine", "op"],
            )?,
            bytes: reg.family(
                "node_engine_bytes_total",
                "Bytes moved between G3 and an engine's rows, per operation",
                MetricKind::Counter,
                &["engine", "op"],
            )?,
            failed: reg.family(
                "node_engine_failed_jobs_total",
                "Jobs of an engine that failed (any key)",
                MetricKind::Counter,
                engine,
            )?,
            lookups: reg.family(
                "node_engine_lookups_total",
                "Keys an engine looked up",
                MetricKind::Counter,
                engine,
            )?,
            errors: reg.family(
                "node_engine_errors_total",
                "Requests of an engine answered with an error (malformed, out of order, a \
                 region or job refused)",
                MetricKind::Counter,
                engine,
            )?,
            connections: reg.family(
                "node_engine_connections",
                "Connections open per engine name",
                MetricKind::Gauge,
                engine,
            )?,
            in_flight: reg.family(
                "node_engine_jobs_in_flight",
                "Jobs of an engine queued or running at the service",
                MetricKind::Gauge,
                engine,
            )?,
        })
    }

    /// Adds each connected engine's counts (engines of one name add up).
    fn set(&self, reg: &mut Registry, engines: &[EngineStatus]) -> Result<()> {
        for en in engines {
            let n = en.name.as_str();
            for (op, j, b) in [
                ("store", en.stores, en.bytes_stored),
                ("load", en.loads, en.bytes_loaded),
            ] {
                let id = reg.series(self.jobs, &[n, op])?;
                reg.inc(id, j as f64);
                let id = reg.series(self.bytes, &[n, op])?;
                reg.inc(id, b as f64);
            }
            for (family, v) in [
                (self.failed, en.failed_jobs),
                (self.lookups, en.lookups),
                (self.in_flight, en.jobs_in_flight),
                (self.errors, en.errors),
                (self.connections, 1),
            ] {
                let id = reg.series(family, &[n])?;
                reg.inc(id, v as f64);
            }
        }
        Ok(())
    }
}
