//! The tiering layer: job vocabulary, the secondary-tier contract, and (later) the manager that
//! ties the primary and secondary tiers together with vLLM's semantics.

pub mod job;
pub mod secondary;
