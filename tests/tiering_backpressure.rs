//! Back-pressure through the manager, on a virtual clock: stores are dropped at the
//! documented ratios while promotions keep flowing; failures trip pressure; config merge
//! results reach the detector unchanged; the metrics agree with the detector.

mod tiering_common;

use std::time::Duration;

use kvtier::config::from_json_str;
use kvtier::contract::job::LookupResult;
use kvtier::tiering::ManagerOptions;
use kvtier::tiering::ScheduleEndContext;
use kvtier::tiering::TieringManager;
use kvtier::tiering::backpressure::{
    DEFAULT_ALPHA, DEFAULT_COOLDOWN_S, DEFAULT_DECAY_HALF_LIFE_S, DEFAULT_WARMUP_COMPLETIONS,
    DetectorParams, PolicyKind,
};
use kvtier::tiering::clock::ManualClock;
use kvtier::tiering::factory::TierFactory;
use kvtier::tiering::memory_tier::FaultPlan;
use tiering_common::*;

fn local(policy: PolicyKind, failure_threshold: Option<u32>) -> DetectorParams {
    DetectorParams::preset(false, policy, failure_threshold)
}

/// Per-job latency that makes a one-row (4 KiB) store cost `s_per_mib`.
fn latency_for(s_per_mib: f64) -> Duration {
    Duration::from_secs_f64(s_per_mib * STRIDE as f64 / (1u64 << 20) as f64)
}

/// One step: store a fresh key, let `lat` pass, collect. Returns whether a job was created.
fn store_step(m: &mut TieringManager, clock: &ManualClock, n: u64, lat: Duration) -> bool {
    let r = req("w");
    let before = m.active_jobs();
    gpu_store(m, &[key(100, n)], &r).expect("primary room");
    let created = m.active_jobs() > before;
    clock.advance(lat);
    m.poll().unwrap();
    created
}

#[test]
fn stores_are_dropped_at_the_documented_ratio_and_promotions_keep_flowing() {
    // EMA / high water -> dropped fraction: 0 at 1x, 1 at 3x, linear in between.
    for (factor, want) in [(1.5, 0.25), (2.0, 0.5), (2.5, 0.75), (5.0, 1.0)] {
        let clock = ManualClock::new();
        let lat = latency_for(0.010 * factor);
        let mut o = inline_opts("1:memory", &clock, 0, 0, FaultPlan::default());
        o.mode = kvtier::tiering::memory_tier::ExecMode::Inline {
            clock: std::sync::Arc::new(clock.clone()),
            store_latency: lat,
            load_latency: Duration::ZERO,
        };
        let (mut m, logs) = manager_with_bp(
            64,
            &clock,
            vec![(o, Some(local(PolicyKind::Throttled, None)))],
        );
        // Warm-up: 10 samples seed the EMA, the 11th sets pressure.
        let mut n = 0;
        while n < 11 {
            assert!(store_step(&mut m, &clock, n, lat), "no drop during warm-up");
            n += 1;
        }
        let ema = m.detector(0).unwrap().ema();
        assert!((ema / 0.010 - factor).abs() < 1e-4, "ema {ema}");
        let (d0, _) = m.detector(0).unwrap().dropped();
        let steps = 400;
        let mut created = 0;
        for _ in 0..steps {
            created += store_step(&mut m, &clock, n, lat) as usize;
            n += 1;
        }
        let (d1, b1) = m.detector(0).unwrap().dropped();
        let dropped = (d1 - d0) as usize;
        assert_eq!(dropped + created, steps);
        let frac = dropped as f64 / steps as f64;
        assert!(
            (frac - want).abs() <= 0.02,
            "factor {factor}: dropped {frac}, want {want}"
        );
        assert_eq!(b1, d1, "one block per dropped store");
        m.refresh_metrics();
        let reg = m.registry();
        let v = |n: &str| reg.value(n, &["1:memory"]).unwrap();
        assert_eq!(
            v("kv_offload_tiering_backpressure_stores_dropped"),
            d1 as f64
        );
        assert_eq!(
            v("kv_offload_tiering_backpressure_blocks_dropped"),
            b1 as f64
        );
        assert_eq!(
            v("kv_offload_tiering_backpressure_store_latency_ema"),
            m.detector(0).unwrap().ema()
        );

        // Promotions are never gated: the first keys (evicted from the small primary) load.
        let r = req(&format!("reader{factor}"));
        m.on_new_request(&r);
        let early: Vec<_> = (0..8).map(|i| key(100, i)).collect();
        for k in &early {
            assert_eq!(m.primary().lookup(k), LookupResult::Miss);
            assert_eq!(m.lookup(k, &r), LookupResult::HitPending, "{factor}");
        }
        m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
        m.poll().unwrap();
        let rows = m.prepare_load(&early, &r).expect("promoted");
        for (k, c) in early.iter().zip(rows) {
            assert!(row_matches(m.region(), c, k));
        }
        m.complete_load(&early).unwrap();
        assert!(logs[0].lock().violations.is_empty());
    }
}

#[test]
fn failures_trip_pressure_and_idle_decay_lets_a_probe_through() {
    let clock = ManualClock::new();
    let faults = FaultPlan {
        seed: 1,
        store_fail_prob: 1.0,
        ..Default::default()
    };
    let o = inline_opts("1:memory", &clock, 0, 0, faults);
    let (mut m, _logs) = manager_with_bp(
        64,
        &clock,
        vec![(o, Some(local(PolicyKind::Throttled, Some(3))))],
    );
    let lat = Duration::from_micros(10);
    let created: Vec<bool> = (0..10)
        .map(|n| store_step(&mut m, &clock, n, lat))
        .collect();
    assert_eq!(&created[..3], &[true, true, true]);
    assert!(
        created[3..].iter().all(|c| !c),
        "tripped after 3 failures: {created:?}"
    );
    m.refresh_metrics();
    let failures = m
        .registry()
        .value("kv_offload_tiering_cascade_job_failures", &["1:memory"]);
    assert_eq!(failures, Some(3.0));
    // 4 x high water = 0.04 decays below 0.002 after 2 * log2(20) = 8.64 s.
    clock.advance(Duration::from_millis(8700));
    assert!(
        store_step(&mut m, &clock, 10, lat),
        "a probe passes after decay"
    );
    assert!(
        !store_step(&mut m, &clock, 11, lat),
        "the failed probe re-trips at once"
    );
}

fn cfg_json(tiers: &str, top: &str) -> String {
    format!(r#"{{"cpu_bytes_to_use": 32768, {top} "secondary_tiers": [{tiers}]}}"#)
}

#[test]
fn config_merge_results_reach_the_detector_unchanged() {
    let cases = [
        cfg_json(
            r#"{"type": "memory", "backpressure": {"alpha": 0.3}}"#,
            r#""backpressure": {"backpressure_cls": "EMABackpressureDetector", "high_water_s": 0.2, "low_water_s": 0.05, "failure_threshold": 5},"#,
        ),
        cfg_json(
            r#"{"type": "memory", "locality": "REMOTE", "backpressure": {"backpressure_cls": "EMABackpressureDetector"}}"#,
            "",
        ),
        cfg_json(
            r#"{"type": "memory", "backpressure": {"backpressure_cls": "EMABackpressureDetector", "policy_cls": "vllm.v1.kv_offload.tiering.backpressure.DropStorePolicy", "warmup_completions": 2, "cooldown_s": 0.5, "decay_half_life_s": 4.0}}"#,
            "",
        ),
        cfg_json(
            r#"{"type": "memory"}, {"type": "memory", "backpressure": {"backpressure_cls": "EMABackpressureDetector", "high_water_s": 0.03}}"#,
            "",
        ),
    ];
    let factory = TierFactory::with_builtins();
    let mut checked = 0;
    for text in &cases {
        let cfg = from_json_str(text).unwrap_or_else(|e| panic!("{text}: {e}"));
        let m = TieringManager::from_config(&cfg, region(8), &factory, ManagerOptions::default())
            .unwrap();
        for (i, tc) in cfg.secondary_tiers.iter().enumerate() {
            match (&tc.backpressure, m.detector(i)) {
                (None, None) => {}
                (Some(bp), Some(d)) => {
                    let p = d.params();
                    assert_eq!(Some(p.high_water_s), bp.high_water_s, "{text}");
                    assert_eq!(Some(p.low_water_s), bp.low_water_s, "{text}");
                    assert_eq!(p.alpha, bp.alpha.unwrap_or(DEFAULT_ALPHA), "{text}");
                    assert_eq!(
                        p.warmup_completions,
                        bp.warmup_completions.unwrap_or(DEFAULT_WARMUP_COMPLETIONS)
                    );
                    assert_eq!(
                        p.decay_half_life_s,
                        bp.decay_half_life_s.unwrap_or(DEFAULT_DECAY_HALF_LIFE_S)
                    );
                    assert_eq!(p.cooldown_s, bp.cooldown_s.unwrap_or(DEFAULT_COOLDOWN_S));
                    assert_eq!(p.failure_threshold, bp.failure_threshold, "{text}");
                    let drop_all = bp.policy_cls.as_deref() == Some("DropStorePolicy");
                    assert_eq!(p.policy == PolicyKind::DropAll, drop_all, "{text}");
                    checked += 1;
                }
                (bp, d) => panic!(
                    "{text}: tier {i} config {bp:?} but detector {}",
                    d.is_some()
                ),
            }
        }
    }
    assert_eq!(checked, 4);
    // Spot-check the merge itself: tier fields win, top-level fields fill in, presets last.
    let cfg = from_json_str(&cases[0]).unwrap();
    let bp = cfg.secondary_tiers[0].backpressure.clone().unwrap();
    assert_eq!(
        (bp.high_water_s, bp.alpha, bp.failure_threshold),
        (Some(0.2), Some(0.3), Some(5))
    );
    let cfg = from_json_str(&cases[1]).unwrap();
    let bp = cfg.secondary_tiers[0].backpressure.clone().unwrap();
    assert_eq!(
        (bp.high_water_s, bp.low_water_s),
        (Some(0.050), Some(0.010)),
        "NETWORK preset"
    );
}
