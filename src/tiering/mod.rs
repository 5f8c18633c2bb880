//! The tiering layer: the manager that ties the primary and secondary tiers together with
//! vLLM 0.33.0's semantics. The vocabulary it speaks with the tiers (jobs, lookups, events, the
//! `SecondaryTier` trait) is [`crate::contract`].
//!
//! * [`manager`]: [`TieringManager`] (lookup, promotion, cascade, lifecycle, reset, shutdown).
//! * [`backpressure`]: the EMA store-latency detector and its drop policies.
//! * [`factory`]: tier type name -> constructor.
//! * [`memory_tier`]: an in-memory tier for tests, examples and benchmarks.
//! * [`telemetry`]: the manager's vLLM-compatible metric families.
//! * [`clock`]: the injectable time source.

pub mod backpressure;
pub mod clock;
pub mod factory;
pub mod manager;
pub mod memory_tier;
pub mod rng;
pub mod telemetry;

pub use manager::{LoadSource, ManagerOptions, ScheduleEndContext, TierSpec, TieringManager};
