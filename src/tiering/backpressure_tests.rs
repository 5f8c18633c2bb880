use super::*;
use crate::tiering::clock::ManualClock;

fn params(policy: PolicyKind, failure_threshold: Option<u32>) -> DetectorParams {
    DetectorParams::preset(false, policy, failure_threshold)
}

fn detector(policy: PolicyKind, ft: Option<u32>) -> (EmaDetector, ManualClock) {
    let clock = ManualClock::new();
    let d = EmaDetector::new(
        params(policy, ft),
        "Tier #1 (test)",
        Arc::new(clock.clone()),
    );
    (d, clock)
}

/// One MiB stored in `s_per_mib` seconds.
fn complete(d: &mut EmaDetector, s_per_mib: f64) {
    d.on_store_completed(Duration::from_secs_f64(s_per_mib), 1 << 20);
}

fn drops_in(d: &mut EmaDetector, calls: usize) -> usize {
    (0..calls)
        .filter(|_| d.should_store(4) == StoreDecision::Drop)
        .count()
}

#[test]
fn warmup_collects_samples_then_seeds_ema_with_their_mean() {
    let (mut d, _c) = detector(PolicyKind::Throttled, None);
    for i in 0..9 {
        complete(&mut d, 0.05 + i as f64 * 0.001);
        assert!(!d.is_under_pressure(), "no pressure during warm-up");
        assert_eq!(d.ema(), 0.0);
    }
    complete(&mut d, 0.059);
    assert!((d.ema() - 0.0545).abs() < 1e-9, "{}", d.ema());
    assert!(d.is_warmed_up());
    assert!(
        !d.is_under_pressure(),
        "the seeding completion never sets pressure"
    );
    complete(&mut d, 0.0545);
    assert!(d.is_under_pressure());
    assert_eq!(d.take_transitions(), vec![Transition::Activated]);
}

#[test]
fn ema_update_and_hysteresis() {
    let (mut d, _c) = detector(PolicyKind::Throttled, None);
    for _ in 0..10 {
        complete(&mut d, 0.02);
    }
    complete(&mut d, 0.02);
    assert!(d.is_under_pressure());
    // Between the marks: state unchanged.
    for _ in 0..40 {
        complete(&mut d, 0.004);
    }
    let ema = d.ema();
    assert!(ema > 0.002 && ema < 0.010, "{ema}");
    assert!(
        d.is_under_pressure(),
        "hysteresis keeps pressure between the marks"
    );
    let expected = 0.15 * 0.001 + 0.85 * ema;
    complete(&mut d, 0.001);
    assert!((d.ema() - expected).abs() < 1e-12);
    while d.ema() >= 0.002 {
        complete(&mut d, 0.001);
    }
    assert!(!d.is_under_pressure());
    assert_eq!(
        d.take_transitions(),
        vec![Transition::Activated, Transition::Cleared],
        "each transition reported once"
    );
}

fn pressured_at(ema: f64) -> (EmaDetector, ManualClock) {
    let (mut d, c) = detector(PolicyKind::Throttled, None);
    for _ in 0..11 {
        complete(&mut d, ema);
    }
    assert!(d.is_under_pressure());
    (d, c)
}

#[test]
fn throttled_policy_drops_the_documented_fraction() {
    // drop_rate = min(1, (ema - high) / high / 2).
    for (ema, rate) in [
        (0.010_000_1, 0.0),
        (0.015, 0.25),
        (0.020, 0.5),
        (0.025, 0.75),
        (0.030, 1.0),
        (0.060, 1.0),
    ] {
        let (mut d, _c) = pressured_at(ema);
        let calls = 4000;
        let drops = drops_in(&mut d, calls);
        let want = rate * calls as f64;
        assert!(
            (drops as f64 - want).abs() <= 1.0,
            "ema {ema}: {drops} drops of {calls}, want {want}"
        );
        assert_eq!(d.dropped(), (drops as u64, 4 * drops as u64));
    }
}

#[test]
fn throttled_policy_is_an_accumulator_not_a_period() {
    // 0.9 drop rate: a fixed period would cap at 50 %.
    let (mut d, _c) = pressured_at(0.028);
    let drops = drops_in(&mut d, 1000);
    assert!((899..=901).contains(&drops), "{drops}");
}

#[test]
fn drop_store_policy_drops_everything_under_pressure() {
    let (mut d, _c) = detector(PolicyKind::DropAll, None);
    for _ in 0..11 {
        complete(&mut d, 0.0101);
    }
    assert!(d.is_under_pressure());
    assert_eq!(drops_in(&mut d, 100), 100);
}

#[test]
fn cooldown_drops_every_second_store_for_one_second() {
    let (mut d, c) = pressured_at(0.02);
    // Clear with completions far below low water.
    while d.is_under_pressure() {
        complete(&mut d, 0.0);
    }
    assert!(d.healthy_streak() < HEALTHY_THRESHOLD);
    let decisions: Vec<_> = (0..6).map(|_| d.should_store(1)).collect();
    use StoreDecision::*;
    assert_eq!(decisions, vec![Store, Drop, Store, Drop, Store, Drop]);
    c.advance(Duration::from_millis(1001));
    assert_eq!(drops_in(&mut d, 10), 0, "cooldown over");
}

#[test]
fn healthy_streak_bypasses_the_gate() {
    let (mut d, _c) = pressured_at(0.02);
    while d.is_under_pressure() {
        complete(&mut d, 0.0);
    }
    for _ in 0..HEALTHY_THRESHOLD {
        complete(&mut d, 0.0);
    }
    assert!(d.healthy_streak() >= HEALTHY_THRESHOLD);
    assert_eq!(drops_in(&mut d, 10), 0, "healthy: the cooldown is bypassed");
}

#[test]
fn failure_trip_lifts_ema_drops_all_and_decays_with_half_life() {
    let (mut d, c) = detector(PolicyKind::Throttled, Some(3));
    d.on_store_failed();
    d.on_store_failed();
    assert!(!d.is_under_pressure());
    d.on_store_failed();
    assert!(d.is_under_pressure(), "trips during warm-up too");
    assert!((d.ema() - 0.04).abs() < 1e-12);
    assert_eq!(drops_in(&mut d, 50), 50);
    // 0.04 * 0.5^(t/2) < 0.002  <=>  t > 2 * log2(20) = 8.64 s.
    c.advance(Duration::from_millis(8500));
    assert!(d.is_under_pressure());
    c.advance(Duration::from_millis(200));
    assert!(!d.is_under_pressure());
    // A failed probe re-trips at once; a success resets the streak.
    d.on_store_failed();
    assert!(d.is_under_pressure());
    assert_eq!(d.consecutive_failures(), 4);
    complete(&mut d, 0.001);
    assert_eq!(d.consecutive_failures(), 0);
}

#[test]
fn failures_are_ignored_without_threshold_and_zero_bytes_ignored() {
    let (mut d, _c) = detector(PolicyKind::Throttled, None);
    for _ in 0..100 {
        d.on_store_failed();
    }
    assert!(!d.is_under_pressure());
    assert_eq!(d.consecutive_failures(), 0);
    d.on_store_completed(Duration::from_secs(5), 0);
    d.update(d.clock.now(), 0);
    assert_eq!(d.ema(), 0.0);
    assert!(!d.is_warmed_up());
}

#[test]
fn reset_clears_state_but_keeps_cumulative_drop_counts() {
    let (mut d, _c) = pressured_at(0.05);
    assert_eq!(drops_in(&mut d, 5), 5);
    d.reset();
    assert!(!d.is_under_pressure());
    assert_eq!(d.ema(), 0.0);
    assert!(!d.is_warmed_up());
    assert_eq!(d.dropped(), (5, 20));
}

#[test]
fn resolve_fills_presets_only_where_missing_and_validates() {
    let empty = BackpressureConfig::default();
    let p = DetectorParams::resolve(&empty, "nvme", Some(Locality::Local), "t").unwrap();
    assert_eq!((p.high_water_s, p.low_water_s), LOCAL_WATER_MARKS);
    assert_eq!(p.failure_threshold, None);
    assert_eq!(p.policy, PolicyKind::Throttled);
    let p = DetectorParams::resolve(&empty, "nvme", Some(Locality::Remote), "t").unwrap();
    assert_eq!((p.high_water_s, p.low_water_s), NETWORK_WATER_MARKS);
    // The tier type's failure threshold is the config merge's to fill (tests/config_*);
    // resolve takes the merged value as given.
    let p = DetectorParams::resolve(&empty, "obj", None, "t").unwrap();
    assert_eq!((p.high_water_s, p.failure_threshold), (0.050, None));
    let explicit = BackpressureConfig {
        backpressure_cls: Some(DETECTOR_CLASS.into()),
        policy_cls: Some("DropStorePolicy".into()),
        high_water_s: Some(0.5),
        low_water_s: Some(0.1),
        alpha: Some(0.3),
        warmup_completions: Some(3),
        decay_half_life_s: Some(4.0),
        cooldown_s: Some(0.0),
        failure_threshold: Some(7),
    };
    let p = DetectorParams::resolve(&explicit, "nvme", Some(Locality::Remote), "t").unwrap();
    assert_eq!(
        p,
        DetectorParams {
            high_water_s: 0.5,
            low_water_s: 0.1,
            alpha: 0.3,
            warmup_completions: 3,
            decay_half_life_s: 4.0,
            cooldown_s: 0.0,
            failure_threshold: Some(7),
            policy: PolicyKind::DropAll,
        }
    );
    for (bad, key) in [
        (
            BackpressureConfig {
                alpha: Some(0.0),
                ..Default::default()
            },
            "alpha",
        ),
        (
            BackpressureConfig {
                alpha: Some(1.5),
                ..Default::default()
            },
            "alpha",
        ),
        (
            BackpressureConfig {
                low_water_s: Some(0.2),
                high_water_s: Some(0.1),
                ..Default::default()
            },
            "low_water_s",
        ),
        (
            BackpressureConfig {
                failure_threshold: Some(0),
                ..Default::default()
            },
            "failure_threshold",
        ),
        (
            BackpressureConfig {
                policy_cls: Some("Nope".into()),
                ..Default::default()
            },
            "policy_cls",
        ),
        (
            BackpressureConfig {
                backpressure_cls: Some("x.Y".into()),
                ..Default::default()
            },
            "backpressure_cls",
        ),
    ] {
        let e = DetectorParams::resolve(&bad, "nvme", None, "secondary_tiers[0]").unwrap_err();
        assert_eq!(e.kind(), crate::error::ErrorKind::Config);
        assert_eq!(
            e.context_value("key"),
            Some(format!("secondary_tiers[0].backpressure.{key}").as_str()),
            "{e}"
        );
    }
}
