//! Targeted tests of the tiering manager's flows: cascade and pins, lookup order, filter and
//! retry, batched promotion, allocation failure, failed loads, request finalization, parked
//! cascades, contract violations, reset, shutdown, construction cleanup and metrics.

mod tiering_common;

use std::sync::Arc;

use kvtier::config::{ChunkSizing, EvictionPolicyKind, KvtierConfig, TierConfig};
use kvtier::contract::job::{LookupResult, Medium, OffloadPolicy, TierFilter, TierMatcher};
use kvtier::contract::secondary::SecondaryTier;
use kvtier::error::{Error, ErrorKind};
use kvtier::key::ChunkKey;
use kvtier::tiering::clock::ManualClock;
use kvtier::tiering::factory::TierFactory;
use kvtier::tiering::memory_tier::{FaultPlan, Misreport};
use kvtier::tiering::{ManagerOptions, ScheduleEndContext, TieringManager};
use tiering_common::*;

fn end_step(m: &mut TieringManager) {
    m.on_schedule_end(&ScheduleEndContext::default())
        .expect("no contract violation");
}

fn load_and_verify(
    m: &mut TieringManager,
    keys: &[ChunkKey],
    r: &kvtier::contract::job::RequestContext,
) {
    let rows = m.prepare_load(keys, r).expect("pinned");
    for (k, c) in keys.iter().zip(rows) {
        assert!(
            row_matches(m.region(), c, k),
            "row {c} must hold {k}'s bytes"
        );
    }
    m.complete_load(keys).expect("unpinned");
}

fn value(m: &mut TieringManager, name: &str, labels: &[&str]) -> f64 {
    m.refresh_metrics();
    m.registry().value(name, labels).unwrap_or(0.0)
}

/// Fills the primary with `n` other keys so earlier ready keys are evicted.
fn churn(m: &mut TieringManager, n: u64) {
    let r = req("churn");
    for i in 0..n {
        gpu_store(m, &[key(9999, i)], &r);
    }
    m.poll().unwrap();
}

#[test]
fn cascade_pins_one_per_tier_and_promotion_round_trips() {
    let clock = ManualClock::new();
    let f = FaultPlan::default;
    let (mut m, logs) = manager_with(
        4,
        &clock,
        vec![
            inline_opts("1:memory", &clock, 0, 0, f()),
            inline_opts("2:memory", &clock, 5, 0, f()),
        ],
    );
    let r = req("a");
    m.on_new_request(&r);
    let k = key(1, 0);
    gpu_store(&mut m, std::slice::from_ref(&k), &r);
    assert_eq!(m.primary().ref_count(&k), Some(2), "one pin per tier");
    m.poll().unwrap();
    assert_eq!(
        m.primary().ref_count(&k),
        Some(1),
        "tier 1 reported; tier 2 still pinned"
    );
    clock.advance_secs(0.005);
    m.poll().unwrap();
    assert_eq!(m.primary().ref_count(&k), Some(0));
    assert_eq!(
        value(&mut m, "kv_offload_tiering_write_bytes", &["1:memory"]),
        STRIDE as f64
    );

    churn(&mut m, 4);
    assert_eq!(
        m.primary().lookup(&k),
        LookupResult::Miss,
        "evicted from the primary"
    );
    clock.advance_secs(0.005);
    m.poll().unwrap();
    let r2 = req("b");
    m.on_new_request(&r2);
    assert_eq!(m.lookup(&k, &r2), LookupResult::HitPending);
    assert_eq!(
        m.primary().ref_count(&k),
        Some(-1),
        "row reserved for the promotion"
    );
    assert_eq!(
        m.lookup(&k, &r2),
        LookupResult::HitPending,
        "no second promotion"
    );
    end_step(&mut m);
    let promotions = |l: &AuditLog| l.outstanding.values().filter(|(p, _)| *p).count();
    assert_eq!(promotions(&logs[0].lock()), 1, "tier 1 got the load");
    assert_eq!(promotions(&logs[1].lock()), 0, "tier 2 was not asked");
    m.poll().unwrap();
    assert_eq!(m.lookup(&k, &r2), LookupResult::Hit);
    load_and_verify(&mut m, std::slice::from_ref(&k), &r2);
    let src = m.get_load_source(&k, &r2).expect("source recorded");
    assert_eq!((src.tier, src.medium), (0, Some(Medium::Cpu)));
    assert_eq!(
        value(&mut m, "kv_offload_tiering_read_bytes", &["1:memory"]),
        STRIDE as f64
    );
    assert_eq!(
        value(&mut m, "kv_offload_tiering_chunk_hits", &["1:memory"]),
        1.0
    );
    assert_eq!(
        m.registry().histogram_count(
            "kv_offload_tiering_promotion_latency_seconds",
            &["1:memory", "success"]
        ),
        Some(1)
    );
    for l in &logs {
        assert!(l.lock().violations.is_empty(), "{:?}", l.lock().violations);
    }
}

#[test]
fn promotions_are_batched_per_tier_and_request() {
    let clock = ManualClock::new();
    let (mut m, logs) = instant_manager(16, &clock);
    let w = req("writer");
    let keys: Vec<_> = (0..4).map(|c| key(2, c)).collect();
    gpu_store(&mut m, &keys, &w);
    m.poll().unwrap();
    churn(&mut m, 16);
    let (a, b) = (req("a"), req("b"));
    for r in [&a, &b] {
        m.on_new_request(r);
    }
    for k in &keys[..3] {
        assert_eq!(m.lookup(k, &a), LookupResult::HitPending);
    }
    assert_eq!(m.lookup(&keys[3], &b), LookupResult::HitPending);
    let before = logs[0].lock().submitted.len();
    end_step(&mut m);
    let l = logs[0].lock();
    assert_eq!(
        l.submitted.len() - before,
        2,
        "one load job per (tier, request)"
    );
    let mut sizes: Vec<_> = l.outstanding.values().map(|(p, k)| (*p, k.len())).collect();
    sizes.sort();
    assert_eq!(sizes, vec![(true, 1), (true, 3)]);
}

#[test]
fn tier_filter_skips_tiers_and_retry_resolves_later() {
    let clock = ManualClock::new();
    let mut o = inline_opts("1:memory", &clock, 0, 0, FaultPlan::default());
    o.retry_first_lookup = true;
    let (mut m, _logs) = manager_with(8, &clock, vec![o]);
    let k = key(3, 0);
    let w = req("w");
    gpu_store(&mut m, std::slice::from_ref(&k), &w);
    m.poll().unwrap();
    churn(&mut m, 8);
    let mut r = req("r");
    r.load_tier_filter = TierFilter::Only(vec![TierMatcher {
        medium: Some(Medium::Storage),
        locality: None,
    }]);
    m.on_new_request(&r);
    assert_eq!(
        m.lookup(&k, &r),
        LookupResult::Miss,
        "the CPU tier is filtered out"
    );
    let r2 = req("r2");
    m.on_new_request(&r2);
    assert_eq!(m.lookup(&k, &r2), LookupResult::Retry);
    clock.advance_secs(0.002);
    assert_eq!(
        m.lookup(&k, &r2),
        LookupResult::Retry,
        "still probing this step"
    );
    end_step(&mut m);
    assert_eq!(m.lookup(&k, &r2), LookupResult::HitPending);
    let n = m.registry().histogram_count(
        "kv_offload_tiering_lookup_async_delay_seconds",
        &["1:memory"],
    );
    assert_eq!(n, Some(1));
    let sum = m
        .registry()
        .value(
            "kv_offload_tiering_lookup_async_delay_seconds",
            &["1:memory"],
        )
        .unwrap();
    assert!((sum - 0.002).abs() < 1e-9, "{sum}");
    assert_eq!(
        value(&mut m, "kv_offload_tiering_chunk_queries", &["1:memory"]),
        1.0,
        "counted once per (req, tier, key)"
    );
}

#[test]
fn allocation_failure_is_counted_and_misses() {
    let clock = ManualClock::new();
    let (mut m, _logs) = instant_manager(2, &clock);
    let w = req("w");
    let k = key(4, 0);
    gpu_store(&mut m, std::slice::from_ref(&k), &w);
    m.poll().unwrap();
    let pinned = [key(4, 1), key(4, 2)];
    gpu_store(&mut m, &pinned, &w);
    m.poll().unwrap();
    m.prepare_load(&pinned, &w).unwrap();
    let r = req("r");
    m.on_new_request(&r);
    assert_eq!(m.lookup(&k, &r), LookupResult::Miss);
    assert_eq!(
        value(
            &mut m,
            "kv_offload_tiering_promotion_allocation_failures",
            &[]
        ),
        1.0
    );
    m.complete_load(&pinned).unwrap();
}

#[test]
fn failed_loads_free_rows_and_are_not_retried_forever() {
    let clock = ManualClock::new();
    let faults = FaultPlan {
        seed: 7,
        load_key_fail_prob: 1.0,
        ..Default::default()
    };
    let (mut m, _logs) = manager_with(
        4,
        &clock,
        vec![inline_opts("1:memory", &clock, 0, 0, faults)],
    );
    let w = req("w");
    let k = key(5, 0);
    gpu_store(&mut m, std::slice::from_ref(&k), &w);
    m.poll().unwrap();
    churn(&mut m, 4);
    let r = req("r");
    m.on_new_request(&r);
    assert_eq!(m.lookup(&k, &r), LookupResult::HitPending);
    end_step(&mut m);
    m.poll().unwrap();
    assert_eq!(
        m.primary().lookup(&k),
        LookupResult::Miss,
        "the reserved row was freed"
    );
    assert!(m.get_load_source(&k, &r).is_none());
    assert_eq!(
        m.lookup(&k, &r),
        LookupResult::Miss,
        "the tier marked the key MISS"
    );
    assert_eq!(
        value(
            &mut m,
            "kv_offload_tiering_promotion_job_failures",
            &["1:memory"]
        ),
        1.0
    );
    assert_eq!(
        m.registry().histogram_count(
            "kv_offload_tiering_promotion_latency_seconds",
            &["1:memory", "failure"]
        ),
        Some(1)
    );
    assert_eq!(m.primary().usage().reserved_for_write, 0);
    assert_eq!(
        m.registry()
            .value("kv_offload_tiering_read_time", &["1:memory"]),
        None,
        "a promotion that loaded nothing adds no read time"
    );
}

#[test]
fn finish_waits_for_pending_stores_and_parked_cascades() {
    let clock = ManualClock::new();
    let mut rl = inline_opts("2:memory", &clock, 0, 0, FaultPlan::default());
    rl.policy = OffloadPolicy::RequestLevel;
    let (mut m, logs) = manager_with(
        8,
        &clock,
        vec![
            inline_opts("1:memory", &clock, 0, 0, FaultPlan::default()),
            rl,
        ],
    );
    let finished =
        |m: &mut TieringManager, t: &str| value(m, "memory_tier_requests_finished", &[t]);
    let (a, b) = (req("a"), req("b"));
    m.on_new_request(&a);
    m.on_new_request(&b);
    let (k1, k2, k3) = (key(6, 1), key(6, 2), key(6, 3));
    let out_a = m.prepare_store(&[k1.clone(), k2.clone()], &a).unwrap();
    for (k, &c) in out_a.keys_to_store.iter().zip(&out_a.chunk_ids) {
        write_row(m.region(), c, k);
    }
    // b asks for k2 (in flight for a) and k3: k2 is parked for the REQUEST_LEVEL tier.
    let out_b = m.prepare_store(&[k2.clone(), k3.clone()], &b).unwrap();
    assert_eq!(out_b.keys_to_store, vec![k3.clone()]);
    write_row(m.region(), out_b.chunk_ids[0], &k3);
    m.on_request_finished(&a);
    m.on_request_finished(&b);
    assert_eq!(
        finished(&mut m, "1:memory"),
        0.0,
        "a still has pending stores"
    );
    m.complete_store(std::slice::from_ref(&k3), &b, true);
    assert_eq!(finished(&mut m, "1:memory"), 0.0, "b has a parked cascade");
    m.complete_store(&out_a.keys_to_store, &a, true);
    assert_eq!(finished(&mut m, "1:memory"), 1.0, "a is finalized");
    assert!(m.has_pending_work());
    end_step(&mut m);
    assert_eq!(
        finished(&mut m, "2:memory"),
        2.0,
        "b finalized after its parked cascade"
    );
    m.poll().unwrap();
    let l = logs[1].lock();
    assert!(l.violations.is_empty(), "{:?}", l.violations);
    // k2 reached the RL tier twice (the cascade and the parked retry); it skips the copy.
    assert_eq!(l.stored_keys, 4);
}

#[test]
fn request_level_tier_gets_chunks_already_in_the_primary() {
    let clock = ManualClock::new();
    let mut rl = inline_opts("1:memory", &clock, 0, 0, FaultPlan::default());
    rl.policy = OffloadPolicy::RequestLevel;
    let (mut m, logs) = manager_with(8, &clock, vec![rl]);
    let w = req("w");
    let k = key(7, 0);
    gpu_store(&mut m, std::slice::from_ref(&k), &w);
    m.poll().unwrap();
    let r = req("r");
    m.on_new_request(&r);
    let out = m.prepare_store(&[k.clone(), key(7, 1)], &r).unwrap();
    assert_eq!(out.keys_to_store, vec![key(7, 1)]);
    assert_eq!(
        m.primary().ref_count(&k),
        Some(1),
        "existing chunk cascaded at once, pinned"
    );
    assert_eq!(logs[0].lock().submitted.len(), 2);
}

#[test]
fn reporting_violations_are_contract_errors() {
    for mis in [Misreport::Duplicate, Misreport::Unknown] {
        let clock = ManualClock::new();
        let faults = FaultPlan {
            misreport: Some(mis),
            ..Default::default()
        };
        let (mut m, _logs) = manager_with(
            4,
            &clock,
            vec![inline_opts("1:memory", &clock, 0, 0, faults)],
        );
        let w = req("w");
        let k = key(8, 0);
        gpu_store(&mut m, std::slice::from_ref(&k), &w);
        let e = m.poll().expect_err("violation surfaced");
        assert_eq!(e.kind(), ErrorKind::Contract, "{e}");
        assert_eq!(m.contract_violations(), 1);
        assert_eq!(
            m.primary().ref_count(&k),
            Some(0),
            "the genuine report was processed once"
        );
        assert_eq!(value(&mut m, "tiering_contract_violations", &[]), 1.0);
        m.poll().unwrap();
    }
}

#[test]
fn reset_keeps_secondary_data_and_holds_promotions_until_flushed() {
    let clock = ManualClock::new();
    let (mut m, _logs) = manager_with(
        4,
        &clock,
        vec![inline_opts("1:memory", &clock, 3, 0, FaultPlan::default())],
    );
    let w = req("w");
    let k = key(10, 0);
    gpu_store(&mut m, std::slice::from_ref(&k), &w);
    assert!(m.has_pending_work());
    m.reset_cache().expect("drained");
    assert!(!m.has_pending_work());
    assert_eq!(m.primary().lookup(&k), LookupResult::Miss);
    let r = req("r");
    m.on_new_request(&r);
    assert_eq!(m.lookup(&k, &r), LookupResult::Miss, "promotions held");
    m.on_reset_flushed();
    assert_eq!(
        m.lookup(&k, &r),
        LookupResult::HitPending,
        "secondary data kept"
    );
}

struct FailingShutdown;
impl SecondaryTier for FailingShutdown {
    fn tier_type(&self) -> &str {
        "failing"
    }
    fn medium(&self) -> Option<Medium> {
        None
    }
    fn locality(&self) -> Option<kvtier::contract::job::Locality> {
        None
    }
    fn lookup(&mut self, _: &ChunkKey, _: &kvtier::contract::job::RequestContext) -> LookupResult {
        LookupResult::Miss
    }
    fn submit_store(&mut self, _: kvtier::contract::job::TransferJob) {}
    fn submit_load(&mut self, _: kvtier::contract::job::TransferJob) {}
    fn get_finished_jobs(&mut self) -> Vec<kvtier::contract::job::JobResult> {
        Vec::new()
    }
    fn has_pending_work(&self) -> bool {
        false
    }
    fn drain_jobs(&mut self) {}
    fn shutdown(&mut self) -> kvtier::Result<()> {
        Err(Error::new(ErrorKind::Io, "cannot stop"))
    }
}

fn config(tiers: &[&str]) -> KvtierConfig {
    KvtierConfig {
        cpu_bytes_to_use: 8 * STRIDE as u64,
        chunk: ChunkSizing::BlocksPerChunk(1),
        eviction_policy: EvictionPolicyKind::Lru,
        store_threshold: 0,
        canonical_layout: false,
        engine_id: None,
        secondary_tiers: tiers
            .iter()
            .enumerate()
            .map(|(i, t)| TierConfig {
                index: i,
                tier_type: t.to_string(),
                locality: None,
                backpressure: None,
                params: Default::default(),
            })
            .collect(),
        service: None,
    }
}

#[test]
fn failed_tier_shutdown_keeps_the_region_mapped() {
    let mut f = TierFactory::with_builtins();
    f.register(
        "failing",
        Arc::new(|_, _| Ok(Box::new(FailingShutdown) as Box<dyn SecondaryTier>)),
    );
    let reg = region(8);
    let weak = Arc::downgrade(&reg);
    let mut m = TieringManager::from_config(
        &config(&["memory", "failing"]),
        reg,
        &f,
        ManagerOptions::default(),
    )
    .unwrap();
    let e = m.shutdown().expect_err("tier failed");
    assert_eq!(e.message(), "cannot stop");
    drop(m);
    assert!(
        weak.upgrade().is_some(),
        "kept mapped after a failed tier shutdown"
    );

    let reg = region(8);
    let weak = Arc::downgrade(&reg);
    let mut m = TieringManager::from_config(
        &config(&["memory", "memory"]),
        reg,
        &f,
        ManagerOptions::default(),
    )
    .unwrap();
    m.shutdown().unwrap();
    drop(m);
    assert!(
        weak.upgrade().is_none(),
        "clean shutdown releases the region"
    );
}

#[test]
fn construction_failure_shuts_down_built_tiers_and_returns_the_original_error() {
    let mut f = TierFactory::with_builtins();
    f.register(
        "broken",
        Arc::new(|_, _| {
            Err(Error::new(
                ErrorKind::InvalidPath,
                "no such device /dev/nope",
            ))
        }),
    );
    let reg = region(8);
    let weak = Arc::downgrade(&reg);
    let e = TieringManager::from_config(
        &config(&["memory", "memory", "broken"]),
        reg,
        &f,
        ManagerOptions::default(),
    )
    .expect_err("third tier fails");
    assert_eq!(
        (e.kind(), e.message()),
        (ErrorKind::InvalidPath, "no such device /dev/nope")
    );
    assert!(
        weak.upgrade().is_none(),
        "no tier thread and no primary hold the region"
    );

    let mut cfg = config(&["memory"]);
    cfg.store_threshold = 2;
    let e = TieringManager::from_config(&cfg, region(8), &f, ManagerOptions::default())
        .expect_err("rejected");
    assert_eq!(e.context_value("key"), Some("store_threshold"));
    let e = TieringManager::from_config(
        &config(&["nvmee"]),
        region(8),
        &f,
        ManagerOptions::default(),
    )
    .expect_err("unknown type");
    assert_eq!(e.context_value("key"), Some("secondary_tiers[0].type"));
}

#[test]
fn metrics_use_vllm_names_labels_buckets_and_the_prefix() {
    let f = TierFactory::with_builtins();
    let opts = ManagerOptions {
        metrics_prefix: "vllm:".into(),
        ..Default::default()
    };
    let mut m = TieringManager::from_config(&config(&["memory"]), region(8), &f, opts).unwrap();
    let r = req("r");
    m.on_new_request(&r);
    assert_eq!(m.lookup(&key(11, 0), &r), LookupResult::Miss);
    let text = m.metrics_text();
    for want in [
        "# TYPE vllm:kv_offload_tiering_chunk_queries_total counter",
        "vllm:kv_offload_tiering_chunk_queries_total{tier=\"0:primary\"} 1.0",
        "vllm:kv_offload_tiering_chunk_queries_total{tier=\"1:memory\"} 1.0",
        "vllm:kv_offload_tiering_chunk_hits_total{tier=\"1:memory\"} 0.0",
        "vllm:kv_offload_tiering_lookup_sync_delay_seconds_bucket{le=\"1e-05\",tier=\"0:primary\"}",
        "vllm:kv_offload_tiering_promotion_latency_seconds_bucket{le=\"60.0\",result=\"success\",tier=\"1:memory\"} 0.0",
        "vllm:kv_offload_tiering_promotion_allocation_failures_total 0.0",
        "# TYPE vllm:kv_offload_tiering_primary_read_usage_perc gauge",
        "vllm:kv_offload_tiering_active_cascade_jobs{tier=\"1:memory\"} 0.0",
        "vllm:kv_offload_cpu_cache_usage_perc 0.0",
        "vllm:memory_tier_chunks{tier=\"1:memory\"} 0.0",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
    assert!(
        !text.contains("read_time_total{"),
        "no time series before a transfer time is reported"
    );
    assert!(
        !text.contains("backpressure_store_latency_ema{"),
        "no detector configured"
    );
    let e = TieringManager::from_config(
        &config(&["memory"]),
        region(8),
        &f,
        ManagerOptions {
            metrics_prefix: "bad prefix".into(),
            ..Default::default()
        },
    )
    .expect_err("invalid prefix");
    assert_eq!(e.kind(), ErrorKind::Config);
}

#[test]
fn manager_is_send() {
    fn assert_send<T: Send>() {}
    assert_send::<TieringManager>();
}

#[test]
fn finish_tells_tiers_at_once_even_with_unsubmitted_promotions() {
    // As vLLM 0.33.0: a finished request's tiers hear of it at once; its promotion found in
    // this step is still submitted at the end of the step.
    let clock = ManualClock::new();
    let (mut m, logs) = instant_manager(4, &clock);
    let w = req("w");
    let k = key(12, 0);
    gpu_store(&mut m, std::slice::from_ref(&k), &w);
    m.poll().unwrap();
    churn(&mut m, 4);
    let r = req("r");
    m.on_new_request(&r);
    assert_eq!(m.lookup(&k, &r), LookupResult::HitPending);
    let finished =
        |m: &mut TieringManager| value(m, "memory_tier_requests_finished", &["1:memory"]);
    let before = finished(&mut m);
    m.on_request_finished(&r);
    assert_eq!(finished(&mut m), before + 1.0, "told at once");
    end_step(&mut m);
    let promotions = |l: &AuditLog| l.outstanding.values().filter(|(p, _)| *p).count();
    assert_eq!(
        promotions(&logs[0].lock()),
        1,
        "the load job was still submitted"
    );
}

#[test]
fn shutdown_releases_store_pins_and_reserved_promotion_rows() {
    let clock = ManualClock::new();
    let (mut m, logs) = instant_manager(4, &clock);
    let w = req("w");
    m.on_new_request(&w);
    let held = key(20, 0);
    gpu_store(&mut m, std::slice::from_ref(&held), &w);
    m.poll().unwrap();
    churn(&mut m, 4);
    assert_eq!(m.primary().lookup(&held), LookupResult::Miss);

    // A promotion reserved but not yet submitted, and a store job in flight.
    let r = req("r");
    m.on_new_request(&r);
    assert_eq!(m.lookup(&held, &r), LookupResult::HitPending);
    let fresh = key(21, 0);
    gpu_store(&mut m, std::slice::from_ref(&fresh), &r);
    assert_eq!(m.primary().ref_count(&held), Some(-1));
    assert_eq!(m.primary().ref_count(&fresh), Some(1));
    assert_eq!(m.active_jobs(), 1);

    m.shutdown().expect("clean shutdown");
    assert_eq!(m.active_jobs(), 0, "every job reported and processed");
    assert_eq!(m.primary().ref_count(&fresh), Some(0), "store pin released");
    assert_eq!(
        m.primary().lookup(&held),
        LookupResult::Miss,
        "the unsubmitted promotion's row is freed"
    );
    assert_eq!(
        value(&mut m, "kv_offload_tiering_write_bytes", &["1:memory"]),
        (6 * STRIDE) as f64,
        "the job finished at shutdown is counted"
    );
    let l = logs[0].lock();
    assert!(l.outstanding.is_empty(), "{:?}", l.outstanding);
    assert!(l.violations.is_empty(), "{:?}", l.violations);
}

/// `reset_cache` tells the tiers of the finished requests (whose stores it drops) in the
/// order the requests arrived, as vLLM 0.33's `reset_cache` walks its request dict, to every
/// tier; not in hash order.
#[test]
fn reset_tells_the_tiers_of_finished_requests_in_arrival_order() {
    let clock = ManualClock::new();
    let (mut m, logs) = manager_with(
        16,
        &clock,
        vec![
            inline_opts("1:memory", &clock, 3, 0, FaultPlan::default()),
            inline_opts("2:memory", &clock, 3, 0, FaultPlan::default()),
        ],
    );
    let ids: Vec<String> = (0..12).map(|i| format!("req-{}", (i * 7) % 12)).collect();
    for (i, id) in ids.iter().enumerate() {
        let r = req(id);
        m.on_new_request(&r);
        // A store still being written: the request's finish waits for it (or the reset).
        let out = m.prepare_store(&[key(500, i as u64)], &r).expect("room");
        assert_eq!(out.keys_to_store.len(), 1);
        m.on_request_finished(&r);
    }
    for log in &logs {
        assert!(log.lock().finished.is_empty(), "stores are pending");
    }
    m.reset_cache().expect("drained");
    for log in &logs {
        assert_eq!(log.lock().finished, ids);
    }
}

/// A store prepared before `reset_cache` and completed after it (kvtier keeps the row in
/// flight; vLLM 0.33 drops it and its scheduler never completes the store): the row is
/// published, but no tier gets a store job for it (vLLM's tiers never see one), not even for
/// a request the tiers already heard had finished, and the request's pending stores, zeroed
/// by the reset, are not counted down again (a store it prepares after the reset still holds
/// its finish back, as in vLLM).
#[test]
fn stores_prepared_before_a_reset_reach_no_tier_after_it() {
    let clock = ManualClock::new();
    let (mut m, logs) = manager_with(
        16,
        &clock,
        vec![
            inline_opts("1:memory", &clock, 0, 0, FaultPlan::default()),
            inline_opts("2:memory", &clock, 0, 0, FaultPlan::default()),
        ],
    );
    let (a, b) = (req("a"), req("b"));
    m.on_new_request(&a);
    m.on_new_request(&b);
    let (k1, k2, k3) = (key(900, 1), key(900, 2), key(900, 3));
    let out_a = m
        .prepare_store(std::slice::from_ref(&k1), &a)
        .expect("room");
    write_row(m.region(), out_a.chunk_ids[0], &k1);
    let out_b = m
        .prepare_store(std::slice::from_ref(&k2), &b)
        .expect("room");
    write_row(m.region(), out_b.chunk_ids[0], &k2);
    m.on_request_finished(&b);
    m.reset_cache().expect("drained");
    m.on_reset_flushed();
    // As vLLM: the reset told the tiers of b (finished), a's pending store is forgotten, so
    // a's finish reaches the tiers at once.
    m.on_request_finished(&a);
    for log in &logs {
        assert_eq!(log.lock().finished, vec!["b".to_string(), "a".to_string()]);
    }
    let submitted: Vec<usize> = logs.iter().map(|l| l.lock().submitted.len()).collect();
    // The late completions publish the rows and submit nothing.
    m.complete_store(std::slice::from_ref(&k1), &a, true);
    m.complete_store(std::slice::from_ref(&k2), &b, true);
    end_step(&mut m);
    for (log, before) in logs.iter().zip(&submitted) {
        let l = log.lock();
        assert_eq!(
            l.submitted.len(),
            *before,
            "no store job after the tiers heard the finish"
        );
        assert!(l.violations.is_empty(), "{:?}", l.violations);
    }
    assert_eq!(m.primary().ref_count(&k1), Some(0), "k1 published");
    assert_eq!(m.primary().ref_count(&k2), Some(0), "k2 published");
    // A request alive across the reset: its store prepared after the reset counts again.
    let c = req("c");
    m.on_new_request(&c);
    let out_c = m
        .prepare_store(std::slice::from_ref(&k3), &c)
        .expect("room");
    write_row(m.region(), out_c.chunk_ids[0], &k3);
    m.on_request_finished(&c);
    assert_eq!(logs[0].lock().finished.len(), 2, "c's store is pending");
    m.complete_store(std::slice::from_ref(&k3), &c, true);
    for (log, before) in logs.iter().zip(&submitted) {
        let l = log.lock();
        assert_eq!(l.submitted.len(), before + 1, "c's store cascades");
        assert_eq!(l.finished.last().map(String::as_str), Some("c"));
    }
    assert_eq!(m.contract_violations(), 0);
}
