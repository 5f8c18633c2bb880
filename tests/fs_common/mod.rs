//! Helpers shared by the `fs` tier tests: a region of small rows, vLLM-shaped keys, row
//! patterns, and a driver that runs jobs to completion with a deadline.
#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier::fs::{FsTier, FsTierConfig};
use kvtier::io::IoEngineKind;
use kvtier::key::ChunkKey;
use kvtier::region::PrimaryRegion;
use kvtier::contract::job::{JobResult, LookupResult, RequestContext, TransferJob};
use kvtier::contract::secondary::SecondaryTier;
use serde_json::{Value, json};

pub const STRIDE: usize = 16384;

pub fn region(rows: usize) -> Arc<PrimaryRegion> {
    Arc::new(PrimaryRegion::create(rows, STRIDE).unwrap())
}

/// The FileMapper fields of a small test model.
pub fn fields() -> Value {
    json!({
        "model_name": "kvtier-test/tiny", "tokens_per_hash": 16, "blocks_per_file": 1,
        "tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1, "dtype": "bfloat16",
        "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["l0", "l1"]}],
        "inference_engine": "vllm"
    })
}

/// A vLLM-shaped key: a 32-byte block hash derived from `i`, then group 0 (big-endian).
pub fn key(i: u64) -> ChunkKey {
    let mut b = Vec::with_capacity(36);
    for j in 0..4u64 {
        b.extend_from_slice(&(i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ j).to_le_bytes());
    }
    b.extend_from_slice(&[0, 0, 0, 0]);
    ChunkKey::new(b)
}

/// Deterministic bytes of chunk `i`.
pub fn pattern(i: u64, len: usize) -> Vec<u8> {
    let mut x = i.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn fill_row(r: &PrimaryRegion, row: u32, i: u64) {
    // SAFETY: tests own every row of their region; no transfer targets it now.
    unsafe { r.row_mut(row as usize).unwrap() }.copy_from_slice(&pattern(i, r.row_stride()));
}

pub fn clear_row(r: &PrimaryRegion, row: u32) {
    // SAFETY: tests own every row of their region; no transfer targets it now.
    unsafe { r.row_mut(row as usize).unwrap() }.fill(0);
}

pub fn row_is(r: &PrimaryRegion, row: u32, i: u64) -> bool {
    // SAFETY: tests own every row of their region; no transfer targets it now.
    let got = unsafe { r.row(row as usize).unwrap() };
    got == pattern(i, r.row_stride()).as_slice()
}

pub fn job(id: u64, keys: &[u64], rows: &[u32], load: bool) -> TransferJob {
    TransferJob {
        job_id: id,
        keys: keys.iter().map(|&k| key(k)).collect(),
        chunk_ids: rows.to_vec(),
        is_promotion: load,
        req_id: Arc::from("req"),
        submit_time: Instant::now(),
    }
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
