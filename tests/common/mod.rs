//! Helpers shared by the configuration tests.
#![allow(dead_code)]

use kvtier::config::{self, BackpressureConfig, KvtierConfig};
use kvtier::{Error, ErrorKind};
use serde_json::{Value, json};

pub fn ok(v: Value) -> KvtierConfig {
    config::from_value(v.clone()).unwrap_or_else(|e| panic!("{v} should be valid: {e}"))
}

pub fn err(v: Value) -> Error {
    match config::from_value(v.clone()) {
        Ok(c) => panic!("{v} should be invalid, got {c:?}"),
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::Config, "{e}");
            assert!(!e.to_string().contains('\n'), "one line: {e}");
            e
        }
    }
}

/// A config with the given tiers and optional top-level backpressure.
pub fn with_tiers(top_bp: Option<Value>, tiers: Value) -> Value {
    let mut v = json!({"cpu_bytes_to_use": 1 << 30, "secondary_tiers": tiers});
    if let Some(bp) = top_bp {
        v["backpressure"] = bp;
    }
    v
}

pub fn bp_of(v: Value, tier: usize) -> Option<BackpressureConfig> {
    ok(v).secondary_tiers[tier].backpressure.clone()
}

pub fn notes_of(v: Value) -> Vec<String> {
    config::resolve(&v).unwrap().notes
}
