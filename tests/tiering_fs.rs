//! The tiering manager over `fs` tiers under /tmp: the scheduler simulation (every job
//! reported once, no slot leaks, loaded bytes equal stored bytes, metrics agree with events)
//! against a healthy tier and one whose engine injects faults, and one configuration that
//! holds an `nvme` and an `fs` tier built through the tier factory.

mod tiering_common;
mod tiering_sim_driver;

use std::sync::Arc;
use std::time::Duration;

use kvtier::config::{self, EvictionPolicyKind};
use kvtier::contract::job::{Locality, LookupResult};
use kvtier::contract::secondary::SecondaryTier;
use kvtier::fs::{FsTier, FsTierConfig};
use kvtier::io::IoEngineKind;
use kvtier::io::faulty::{FaultPlan as IoFaultPlan, FaultyEngine};
use kvtier::io::open_engine;
use kvtier::primary::PrimaryTier;
use kvtier::tiering::clock::ManualClock;
use kvtier::tiering::factory::TierFactory;
use kvtier::tiering::{ManagerOptions, ScheduleEndContext, TierSpec, TieringManager};
use serde_json::json;
use tiering_common::*;
use tiering_sim_driver::Sim;

fn fields() -> serde_json::Value {
    json!({"model_name": "kvtier-test/sim", "tokens_per_hash": 16, "blocks_per_file": 1})
}

fn fs_config(dir: &std::path::Path, rows: u64) -> FsTierConfig {
    let mut c = FsTierConfig::new(dir, rows * STRIDE as u64);
    c.io_engine = IoEngineKind::Auto;
    c.io_threads = 4;
    c.lookup_threads = 2;
    c
}

fn run(faults: Option<IoFaultPlan>, seed: u64) -> (Sim, tiering_sim_driver::SimStats) {
    let healthy = faults.is_none();
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let clock = ManualClock::new();
    let region = region(80);
    // Room for 96 chunks: the simulation's working set is larger, so files are evicted too.
    let cfg = fs_config(dir.path(), 96);
    let tier = match faults {
        None => FsTier::open(
            cfg,
            region.clone(),
            fields(),
            [3; 32],
            "1:fs".into(),
            Some(Locality::Remote),
        ),
        Some(plan) => FsTier::open_with_engine(
            cfg,
            region.clone(),
            fields(),
            [3; 32],
            "1:fs".into(),
            Some(Locality::Remote),
            Box::new(move |kind, region, files, opts| {
                FaultyEngine::wrap_handle(open_engine(kind, region, files, opts)?, plan)
            }),
        ),
    }
    .expect("open an fs tier under /tmp");
    let (audited, log) = AuditTier::new(Box::new(tier) as Box<dyn SecondaryTier>, region.clone());
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
    let held = if healthy {
        Some("fs_known_files")
    } else {
        None
    };
    let stats = sim.run(1200, &[held]);
    let l = log.lock();
    eprintln!(
        "fs sim (faults: {}): {stats:?}; stored {} loaded {} failed stores {} failed loads {}",
        if healthy { "none" } else { "injected" },
        l.stored_keys,
        l.loaded_keys,
        l.failed_stores,
        l.failed_loads
    );
    drop(l);
    // The tier's files outlive the simulation's checks only as long as the directory.
    std::mem::forget(dir);
    (sim, stats)
}

#[test]
fn simulation_against_a_real_fs_tier() {
    let (mut sim, stats) = run(None, 11);
    assert!(stats.promoted_rows > 20, "promotions exercised: {stats:?}");
    let text = sim.m.metrics_text();
    for want in [
        "kvtier:fs_checksum_failures_total{tier=\"1:fs\"} 0.0",
        "kvtier:fs_direct_io{tier=\"1:fs\"} 1.0",
        "kvtier:fs_engine_info{engine=",
        "kvtier:kv_offload_tiering_write_bytes_total{tier=\"1:fs\"}",
    ] {
        assert!(text.contains(want), "missing {want:?}");
    }
    sim.m.shutdown().expect("clean shutdown");
}

#[test]
fn simulation_against_an_fs_tier_with_a_faulty_engine() {
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
    let (mut sim, stats) = run(Some(plan), 12);
    assert!(stats.verified_rows > 50, "{stats:?}");
    sim.m.shutdown().expect("shutdown");
}

/// One configuration, both tier types: a shared `fs` tier first, a local `nvme` tier second,
/// built by the factory from the parsed config. A chunk cascades to both; after the primary
/// is emptied, the fs tier answers RETRY, then HIT, and the promotion brings the bytes back.
#[test]
fn one_config_with_an_fs_and_an_nvme_tier() {
    let fs_dir = tempfile::tempdir_in("/tmp").unwrap();
    let nvme_dir = tempfile::tempdir_in("/tmp").unwrap();
    let cfg = config::from_value(json!({
        "cpu_bytes_to_use": 16 * STRIDE,
        "secondary_tiers": [
            {"type": "fs", "locality": "REMOTE", "root_dir": fs_dir.path(),
             "capacity_bytes": 64 * STRIDE, "io_threads": 2},
            {"type": "nvme", "locality": "LOCAL", "paths": [nvme_dir.path()],
             "capacity_bytes": 64 * STRIDE, "fsync": "never"}
        ]
    }))
    .unwrap();
    let region = region(16);
    let opts = ManagerOptions {
        file_mapper_fields: Some(fields()),
        ..Default::default()
    };
    let mut m =
        TieringManager::from_config(&cfg, region.clone(), &TierFactory::with_builtins(), opts)
            .expect("both tiers build");
    assert_eq!(m.tier_label(0), Some("1:fs"));
    assert_eq!(m.tier_label(1), Some("2:nvme"));
    let keys: Vec<_> = (0..4).map(|c| key(77, c)).collect();
    let r = req("store");
    m.on_new_request(&r);
    let out = m.prepare_store(&keys, &r).expect("room");
    for (k, &row) in out.keys_to_store.iter().zip(&out.chunk_ids) {
        write_row(&region, row, k);
    }
    m.complete_store(&keys, &r, true);
    m.on_request_finished(&r);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while m.has_pending_work() {
        assert!(
            std::time::Instant::now() < deadline,
            "stores did not finish"
        );
        m.poll().unwrap();
        m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    m.reset_cache().unwrap();
    m.on_reset_flushed();
    let r = req("load");
    m.on_new_request(&r);
    let mut answers = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    'ask: loop {
        let mut pending = 0;
        for k in &keys {
            match m.lookup(k, &r) {
                LookupResult::Hit => {}
                LookupResult::HitPending | LookupResult::Retry => pending += 1,
                LookupResult::Miss => panic!("{k:?} was stored in both tiers"),
            }
        }
        answers.push(pending);
        if pending == 0 {
            break 'ask;
        }
        assert!(std::time::Instant::now() < deadline, "lookups: {answers:?}");
        m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
        m.poll().unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        answers[0] > 0,
        "the fs tier answers RETRY first: {answers:?}"
    );
    let rows = m.prepare_load(&keys, &r).unwrap();
    for (k, &row) in keys.iter().zip(&rows) {
        assert!(
            row_matches(&region, row, k),
            "{k:?} came back with other bytes"
        );
    }
    m.complete_load(&keys).unwrap();
    m.on_request_finished(&r);
    let text = m.metrics_text();
    assert!(text.contains("kvtier:kv_offload_tiering_read_bytes_total{tier=\"1:fs\"}"));
    m.shutdown().unwrap();
}

/// `enable_kv_events` on an `fs` entry, with vLLM 0.33's fs tier's meaning: the tier built by
/// the factory records events only when the entry asks for them and the host records events
/// too (its stored events, one per successful store job, as vLLM's fs tier emits them, and
/// the removals of kvtier's own eviction); a value that is not a boolean names the key.
#[test]
fn an_fs_tier_records_events_only_with_its_flag_and_the_hosts() {
    use kvtier::contract::job::TransferJob;
    use kvtier::tiering::clock::Clock;
    use kvtier::tiering::factory::TierBuildContext;
    for (tier_flag, host_flag) in [(false, false), (true, false), (false, true), (true, true)] {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        // Room for one file: the second store evicts the first.
        let cfg = config::from_value(json!({
            "cpu_bytes_to_use": 4 * STRIDE,
            "secondary_tiers": [{"type": "fs", "root_dir": dir.path(),
                                 "capacity_bytes": STRIDE, "enable_kv_events": tier_flag}]
        }))
        .unwrap();
        let region = region(4);
        let clock = ManualClock::new();
        let mut ctx = TierBuildContext::new(
            region.clone(),
            Arc::new(clock) as Arc<dyn Clock>,
            "1:fs".into(),
        );
        ctx.file_mapper_fields = Some(fields());
        ctx.events = host_flag;
        let mut tier = TierFactory::with_builtins()
            .create(&cfg.secondary_tiers[0], &ctx)
            .expect("an fs tier under /tmp");
        let (k1, k2) = (key(88, 1), key(88, 2));
        for (id, (k, row)) in [(&k1, 0u32), (&k2, 1u32)].into_iter().enumerate() {
            write_row(&region, row, k);
            tier.submit_store(TransferJob {
                job_id: id as u64,
                keys: vec![k.clone()],
                chunk_ids: vec![row],
                is_promotion: false,
                req_id: "r".into(),
                submit_time: std::time::Instant::now(),
            });
            tier.drain_jobs();
            let done = tier.get_finished_jobs();
            assert!(done.len() == 1 && done[0].success, "{done:?}");
        }
        // Eviction runs on the I/O threads: wait until the tier counts it.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while fs_metric(tier.as_ref(), "fs_evictions") < 1.0 {
            assert!(std::time::Instant::now() < deadline, "k1 was not evicted");
            std::thread::sleep(Duration::from_millis(2));
        }
        let events = tier.take_events();
        let stored: Vec<_> = events.iter().filter(|e| !e.removed).collect();
        let removed: Vec<_> = events
            .iter()
            .filter(|e| e.removed)
            .flat_map(|e| &e.keys)
            .collect();
        if tier_flag && host_flag {
            assert_eq!(stored.len(), 2, "one event per store job: {events:?}");
            assert_eq!(stored[0].keys, vec![k1.clone()]);
            assert_eq!(stored[1].keys, vec![k2.clone()]);
            assert_eq!(removed, vec![&k1]);
        } else {
            assert!(
                events.is_empty(),
                "tier flag {tier_flag}, host flag {host_flag}: {events:?}"
            );
        }
        tier.shutdown().unwrap();
    }
    let bad = config::from_value(json!({
        "cpu_bytes_to_use": 4 * STRIDE,
        "secondary_tiers": [{"type": "fs", "root_dir": "/tmp", "capacity_bytes": STRIDE,
                             "enable_kv_events": "yes"}]
    }))
    .and_then(|cfg| FsTierConfig::from_tier(&cfg.secondary_tiers[0]))
    .expect_err("a string is not a boolean");
    assert_eq!(
        bad.context_value("key"),
        Some("secondary_tiers[0].enable_kv_events")
    );
}

fn fs_metric(t: &dyn SecondaryTier, name: &str) -> f64 {
    t.metrics()
        .into_iter()
        .find(|m| m.name == name)
        .unwrap_or_else(|| panic!("no metric {name}"))
        .value
}
