//! Helpers shared by the `fs` tier tests: a region of small rows, vLLM-shaped keys, row
//! patterns, and a driver that runs jobs to completion with a deadline.
#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier::contract::job::{JobResult, LookupResult, RequestContext};
use kvtier::contract::secondary::SecondaryTier;
use kvtier::fs::{FsTier, FsTierConfig};
use kvtier::io::IoEngineKind;
use kvtier::region::PrimaryRegion;
use serde_json::{Value, json};

/// Rows, keys (a 36-byte hash then group 0: vLLM-shaped), row patterns and jobs are those of
/// the G3 tests.
#[path = "../g3_common/mod.rs"]
pub mod g3_common;
pub use g3_common::{STRIDE, clear_row, fill_row, job, key, pattern, region, row_is};

/// The FileMapper fields of a small test model.
pub fn fields() -> Value {
    json!({
        "model_name": "kvtier-test/tiny", "tokens_per_hash": 16, "blocks_per_file": 1,
        "tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1, "dtype": "bfloat16",
        "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["l0", "l1"]}],
        "inference_engine": "vllm"
    })
}

/// The value of a tier metric (by name, first sample).
pub fn metric(t: &dyn SecondaryTier, name: &str) -> f64 {
    t.metrics()
        .into_iter()
        .find(|m| m.name == name)
        .unwrap_or_else(|| panic!("no metric {name}"))
        .value
}

pub fn req(id: &str) -> RequestContext {
    RequestContext::new(id)
}

pub fn config(root: &Path, capacity_rows: u64) -> FsTierConfig {
    let mut c = FsTierConfig::new(root, capacity_rows * STRIDE as u64);
    c.io_engine = IoEngineKind::Psync;
    c.io_threads = 4;
    c.lookup_threads = 2;
    c
}

pub fn open(cfg: FsTierConfig, r: &Arc<PrimaryRegion>) -> FsTier {
    FsTier::open(cfg, r.clone(), fields(), [7; 32], "1:fs".into(), None)
        .unwrap_or_else(|e| panic!("open fs tier: {e}"))
}

/// Polls until the job is reported (30 s at most).
pub fn wait_job(t: &mut dyn SecondaryTier, id: u64) -> JobResult {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(r) = t.get_finished_jobs().into_iter().find(|r| r.job_id == id) {
            return r;
        }
        assert!(Instant::now() < deadline, "job {id} was not reported");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Stores keys `keys` from rows `0..` (filled with their patterns) and waits.
pub fn store(t: &mut FsTier, r: &PrimaryRegion, id: u64, keys: &[u64]) -> JobResult {
    let rows: Vec<u32> = (0..keys.len() as u32).collect();
    for (k, row) in keys.iter().zip(&rows) {
        fill_row(r, *row, *k);
    }
    t.submit_store(job(id, keys, &rows, false));
    wait_job(t, id)
}

/// Loads keys into rows `0..` (cleared first) and waits.
pub fn load(t: &mut FsTier, r: &PrimaryRegion, id: u64, keys: &[u64]) -> JobResult {
    let rows: Vec<u32> = (0..keys.len() as u32).collect();
    for row in &rows {
        clear_row(r, *row);
    }
    t.submit_load(job(id, keys, &rows, true));
    wait_job(t, id)
}

/// Asks until the lookup resolves (flushing each "step"), 10 s at most.
pub fn resolve(t: &mut dyn SecondaryTier, k: u64, rq: &RequestContext) -> LookupResult {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = t.lookup(&key(k), rq);
        if r != LookupResult::Retry {
            return r;
        }
        t.on_schedule_end();
        assert!(Instant::now() < deadline, "lookup of {k} never resolved");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Every file under `dir`, relative, sorted.
pub fn files_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p.strip_prefix(dir).unwrap().display().to_string());
            }
        }
    }
    out.sort();
    out
}

/// Temporary files left under `dir`.
pub fn temps_under(dir: &Path) -> Vec<String> {
    files_under(dir)
        .into_iter()
        .filter(|f| f.ends_with(".tmp"))
        .collect()
}
