//! The tiering layer: the manager that ties the primary and secondary tiers together with
//! vLLM 0.33.0's semantics. The vocabulary it speaks with the tiers (jobs, lookups, events, the
//! `SecondaryTier` trait) is [`crate::contract`].
//!
//! * `manager`: [`TieringManager`] (lookup, promotion, cascade, lifecycle, reset, shutdown).
//! * `backpressure`: the EMA store-latency detector and its drop policies.
//! * `factory`: tier type name -> constructor.
//! * `memory_tier`: an in-memory tier for tests, examples and benchmarks.
//! * `telemetry`: the manager's vLLM-compatible metric families.
//! * `clock`: the injectable time source.

test_visible! {
    mod backpressure;
    mod clock;
    mod factory;
    mod manager;
    mod memory_tier;
    mod rng;
    mod telemetry;
}

pub use factory::{TierFactory, VLLM_TIER_CLASS};
pub use manager::{LoadSource, ManagerOptions, ScheduleEndContext, TierSpec, TieringManager};
pub use rng::XorShift64;
