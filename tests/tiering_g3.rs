//! The scheduler simulation against real G3 (NVMe slab) tiers under /tmp: a healthy one, and
//! one whose I/O engine injects EIO, short transfers, bit flips and latency. Same invariants
//! as `tiering_sim` (every job reported once, no slot leaks, pins balance, nothing pinned
//! evicted, loaded bytes equal stored bytes, metrics agree with events).

mod tiering_common;
mod tiering_sim_driver;

use std::sync::Arc;
use std::time::Duration;

use kvtier::config::EvictionPolicyKind;
use kvtier::contract::job::Locality;
use kvtier::contract::secondary::SecondaryTier;
use kvtier::g3::{FsyncPolicy, G3Tier, G3TierConfig, geometry_namespace};
use kvtier::io::IoEngineKind;
use kvtier::io::faulty::{FaultPlan as IoFaultPlan, FaultyEngine};
use kvtier::io::open_engine;
use kvtier::primary::PrimaryTier;
use kvtier::tiering::clock::ManualClock;
use kvtier::tiering::{ManagerOptions, TierSpec, TieringManager};
use tiering_common::*;
use tiering_sim_driver::Sim;

fn g3_config(dir: &std::path::Path) -> G3TierConfig {
    let mut c = G3TierConfig::new(vec![dir.to_path_buf()], 96 * STRIDE as u64);
    // Per-job fdatasync is the default; the simulation checks semantics, not durability.
    c.fsync = FsyncPolicy::Never;
    c.io_engine = IoEngineKind::Auto;
    c
}

/// Runs the simulation; the temporary directory is returned so that it outlives the tier.
fn run(
    faults: Option<IoFaultPlan>,
    seed: u64,
) -> Option<(Sim, tiering_sim_driver::SimStats, tempfile::TempDir)> {
    let healthy = faults.is_none();
    let dir = tempfile::tempdir_in("/tmp").expect("tempdir under /tmp");
    let clock = ManualClock::new();
    let region = region(80);
    let cfg = g3_config(dir.path());
    let ns = geometry_namespace(STRIDE as u64);
    let opened = match faults {
        None => G3Tier::open(
            cfg,
            region.clone(),
            ns,
            "1:nvme".into(),
            Some(Locality::Local),
        ),
        Some(plan) => G3Tier::open_with_engine(
            cfg,
            region.clone(),
            ns,
            "1:nvme".into(),
            Some(Locality::Local),
            Box::new(move |kind, region, files, opts| {
                FaultyEngine::wrap_handle(open_engine(kind, region, files, opts)?, plan)
            }),
        ),
    };
    let g3 = match opened {
        Ok(t) => t,
        Err(e) => {
            kvtier::skip_test!("cannot open a G3 tier under /tmp here: {e}");
            return None;
        }
    };
    let (audited, log) = AuditTier::new(Box::new(g3) as Box<dyn SecondaryTier>, region.clone());
    let primary = PrimaryTier::new(region, EvictionPolicyKind::Lru, true);
    let opts = ManagerOptions {
        clock: Arc::new(clock.clone()),
        enable_events: true,
        ..Default::default()
    };
    let spec = TierSpec {
        tier: Box::new(audited),
        backpressure: None,
    };
    let m = TieringManager::with_tiers(primary, vec![spec], opts).expect("manager");
    let mut sim = Sim::new(m, clock, vec![log.clone()], seed).with_real_io();
    // Slots in use must match the stored/removed events once quiescent (healthy engine).
    let held = if healthy { Some("g3_used_slots") } else { None };
    let stats = sim.run(1500, &[held]);
    let l = log.lock();
    eprintln!(
        "g3 sim (faults: {}): {stats:?}; stored {} loaded {} failed stores {} failed loads {}",
        if healthy { "none" } else { "injected" },
        l.stored_keys,
        l.loaded_keys,
        l.failed_stores,
        l.failed_loads
    );
    drop(l);
    Some((sim, stats, dir))
}

#[test]
fn simulation_against_a_real_g3_tier() {
    let Some((mut sim, stats, _dir)) = run(None, 1) else {
        return;
    };
    assert!(stats.promoted_rows > 20, "promotions exercised: {stats:?}");
    // The tier's own metrics are exported with the tier label.
    let text = sim.m.metrics_text();
    for want in [
        "kvtier:g3_checksum_failures_total{tier=\"1:nvme\"} 0.0",
        "kvtier:g3_direct_io{path=\"0\",tier=\"1:nvme\"}",
        "kvtier:g3_engine_info{engine=",
        "kvtier:kv_offload_tiering_write_bytes_total{tier=\"1:nvme\"}",
    ] {
        assert!(text.contains(want), "missing {want:?}");
    }
    sim.m.shutdown().expect("clean shutdown");
}

#[test]
fn simulation_against_a_g3_tier_with_a_faulty_engine() {
    let mut plan = IoFaultPlan::new().latency(Duration::from_micros(200));
    for op in (40..4000).step_by(37) {
        plan = plan.eio_on(op);
    }
    for op in (60..4000).step_by(53) {
        plan = plan.short_on(op, 512);
    }
    for op in (80..4000).step_by(71) {
        plan = plan.flip_bit(op, 100, 3);
    }
    let Some((mut sim, stats, _dir)) = run(Some(plan), 2) else {
        return;
    };
    assert!(stats.verified_rows > 100, "{stats:?}");
    // A failed tier shutdown would be reported; a faulty engine still drains cleanly.
    sim.m.shutdown().expect("shutdown");
}
