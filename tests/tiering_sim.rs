//! Deterministic simulations of a scheduler driving the tiering manager for thousands of
//! steps against in-memory tiers (healthy, probing with RETRY, REQUEST_LEVEL, and
//! fault-injecting with a bounded capacity). See `tiering_sim_driver` for the invariants.

mod tiering_common;
mod tiering_sim_driver;

use kvtier::contract::job::OffloadPolicy;
use kvtier::tiering::clock::ManualClock;
use kvtier::tiering::memory_tier::FaultPlan;
use tiering_common::*;
use tiering_sim_driver::Sim;

const HELD: Option<&str> = Some("memory_tier_chunks");

#[test]
fn healthy_memory_tiers() {
    let clock = ManualClock::new();
    let mut probing = inline_opts("2:memory", &clock, 4, 2, FaultPlan::default());
    probing.retry_first_lookup = true;
    probing.policy = OffloadPolicy::RequestLevel;
    let tiers = vec![
        inline_opts("1:memory", &clock, 2, 3, FaultPlan::default()),
        probing,
    ];
    let (m, logs) = manager_with(80, &clock, tiers);
    let mut sim = Sim::new(m, clock, logs, 42);
    let st = sim.run(3000, &[HELD, HELD]);
    eprintln!("healthy: {st:?}");
    assert!(st.promoted_rows > 50, "promotions exercised: {st:?}");
    assert!(st.verified_rows > 1000, "{st:?}");
    assert!(
        st.answers.iter().all(|&n| n > 0),
        "every lookup answer seen: {st:?}"
    );
}

#[test]
fn faulty_bounded_memory_tier_in_front_of_a_healthy_one() {
    let clock = ManualClock::new();
    let faults = FaultPlan {
        seed: 9,
        store_fail_prob: 0.1,
        load_key_fail_prob: 0.1,
        ..Default::default()
    };
    let mut faulty = inline_opts("1:memory", &clock, 3, 2, faults);
    faulty.capacity_chunks = Some(150);
    let tiers = vec![
        faulty,
        inline_opts("2:memory", &clock, 1, 5, FaultPlan::default()),
    ];
    let (m, logs) = manager_with(72, &clock, tiers);
    let mut sim = Sim::new(m, clock, logs.clone(), 7);
    let st = sim.run(3000, &[HELD, HELD]);
    eprintln!("faulty: {st:?}");
    let l = logs[0].lock();
    assert!(
        l.failed_stores > 10 && l.failed_loads > 5,
        "faults exercised: {} {}",
        l.failed_stores,
        l.failed_loads
    );
    assert!(st.promoted_rows > 50, "{st:?}");
}

#[test]
fn back_pressured_slow_tier_drops_stores_without_breaking_invariants() {
    use kvtier::tiering::backpressure::{DetectorParams, PolicyKind};
    let clock = ManualClock::new();
    // A store job takes >= 5 ms of virtual time: 0.3 to 1.3 s/MiB depending on its size.
    let slow = inline_opts("1:memory", &clock, 5, 1, FaultPlan::default());
    let params = DetectorParams {
        high_water_s: 0.3,
        low_water_s: 0.05,
        alpha: 0.15,
        warmup_completions: 10,
        decay_half_life_s: 2.0,
        cooldown_s: 1.0,
        failure_threshold: Some(3),
        policy: PolicyKind::Throttled,
    };
    let tiers = vec![
        (slow, Some(params)),
        (
            inline_opts("2:memory", &clock, 1, 1, FaultPlan::default()),
            None,
        ),
    ];
    let (m, logs) = manager_with_bp(80, &clock, tiers);
    let mut sim = Sim::new(m, clock, logs, 11);
    let st = sim.run(3000, &[HELD, HELD]);
    let (stores, blocks) = sim.m.detector(0).expect("detector").dropped();
    eprintln!("back-pressured: {st:?}; dropped {stores} stores / {blocks} blocks");
    assert!(stores > 20 && blocks >= stores, "stores dropped: {stores}");
    assert!(st.promoted_rows > 50, "promotions keep flowing: {st:?}");
}
