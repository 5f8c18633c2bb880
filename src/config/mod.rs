//! Configuration: the serde model of vLLM's `kv_connector_extra_config`, merge and validation.
//!
//! [`model`] holds the resolved (validated) types every other module consumes. Parsing,
//! merging and validation live beside it.

pub mod model;

pub use model::{BackpressureConfig, ChunkSizing, EvictionPolicyKind, KvtierConfig, TierConfig};
