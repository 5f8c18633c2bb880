//! `kvtier-replay fs`: kvtier's `fs` tier on a directory, for the interop tests with vLLM's own
//! `FileMapper` and `FileSystemTierManager`.
//!
//! Input: `{"scenarios": [scenario, ...]}`, each scenario
//! `{"root_dir": "/tmp/x", "fields": {FileMapper fields}, "row_stride": 4096, "steps": [...]}`
//! run on one tier opened on `root_dir` (kvtier's defaults: xattr CRC records, O_DIRECT where
//! it works), with steps (keys and rows in hex):
//!
//! * `{"op": "paths", "keys": [k, ...]}` -> `{"base_path", "data_dir", "digest",
//!   "config_json", "paths": [path | null, ...]}` (`config_json`: the text kvtier would write);
//! * `{"op": "store", "keys": [k, ...], "rows": [row, ...]}` -> `{"success", "error"?}`;
//! * `{"op": "lookup", "keys": [k, ...]}` -> `{"answers": ["hit" | "miss", ...]}` (asked as a
//!   scheduler asks: RETRY until the background check has answered);
//! * `{"op": "load", "keys": [k, ...]}` -> `{"rows": [row | null, ...], "verified",
//!   "unverified", "error"?}` (a failed key's row is null).
//!
//! Output: `{"results": [{"steps": [...]} | {"error", "kind"}, ...]}`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier::contract::job::{LookupResult, RequestContext};
use kvtier::contract::secondary::SecondaryTier;
use kvtier::fs::{FsTier, FsTierConfig};
use kvtier::g3::geometry_namespace;
use kvtier::key::ChunkKey;
use kvtier::region::PrimaryRegion;
use serde_json::{Value, json};

use crate::json::{array, error_entry, field, keys, run_job, string, uint};

/// How long one job or lookup may take before the scenario fails.
const DEADLINE: Duration = Duration::from_secs(60);

/// Runs every scenario of the document.
pub fn run(input: &Value) -> Result<Value, String> {
    let mut results = Vec::new();
    for s in array(input, "scenarios")? {
        results.push(scenario(s)?);
    }
    Ok(json!({ "results": results }))
}

fn scenario(s: &Value) -> Result<Value, String> {
    let root = string(s, "root_dir")?;
    let fields = field(s, "fields")?.clone();
    let stride = uint(s, "row_stride")?;
    let steps = array(s, "steps")?;
    let rows = steps
        .iter()
        .filter_map(|st| st.get("keys").and_then(Value::as_array).map(Vec::len))
        .max()
        .unwrap_or(1)
        .max(1);
    let region = match PrimaryRegion::create(rows, stride) {
        Ok(r) => Arc::new(r),
        Err(e) => return Ok(error_entry(&e)),
    };
    let mut cfg = FsTierConfig::new(root, 1 << 40);
    cfg.io_threads = 4;
    let tier = FsTier::open(
        cfg,
        region.clone(),
        fields,
        geometry_namespace(stride),
        "1:fs".into(),
        None,
    );
    let mut tier = match tier {
        Ok(t) => t,
        Err(e) => return Ok(error_entry(&e)),
    };
    let mut out = Vec::new();
    for (n, st) in steps.iter().enumerate() {
        out.push(step(&mut tier, &region, n as u64, st)?);
    }
    tier.shutdown().map_err(|e| e.to_string())?;
    Ok(json!({ "steps": out }))
}

fn step(t: &mut FsTier, region: &PrimaryRegion, n: u64, st: &Value) -> Result<Value, String> {
    let ks = keys(st, "keys")?;
    let rows: Vec<u32> = (0..ks.len() as u32).collect();
    match string(st, "op")? {
        "paths" => {
            let m = t.mapper();
            let paths: Vec<Value> = ks
                .iter()
                .map(|k| {
                    m.file_path(k)
                        .map_or(Value::Null, |p| json!(p.display().to_string()))
                })
                .collect();
            Ok(json!({
                "base_path": m.base_path().display().to_string(),
                "data_dir": m.data_dir().display().to_string(),
                "digest": m.digest(),
                "config_json": m.config_json(),
                "paths": paths,
            }))
        }
        "store" => {
            let data = array(st, "rows")?;
            if data.len() != ks.len() {
                return Err("a store step needs one row per key".into());
            }
            for (row, hex_row) in rows.iter().zip(data) {
                let bytes = hex_row
                    .as_str()
                    .and_then(|h| hex::decode(h).ok())
                    .filter(|b| b.len() as u64 == region.row_stride())
                    .ok_or("each row must be row_stride bytes of hex")?;
                // This driver owns the region; no job uses the row now.
                region
                    .write_row(*row as usize)
                    .map_err(|e| e.to_string())?
                    .copy_from_slice(&bytes);
            }
            let r = run_job(t, n, ks, rows, false)?;
            Ok(json!({"success": r.success, "error": r.error.map(|e| e.to_string())}))
        }
        "load" => {
            let before = counts(t);
            let r = run_job(t, n, ks.clone(), rows.clone(), true)?;
            let loaded = |k: &ChunkKey| {
                r.success || r.successful_keys.as_ref().is_some_and(|ok| ok.contains(k))
            };
            let mut out = Vec::new();
            for (k, row) in ks.iter().zip(&rows) {
                if loaded(k) {
                    // The job is reported: nothing writes the row any more.
                    let bytes = region.read_row(*row as usize).map_err(|e| e.to_string())?;
                    out.push(json!(hex::encode(&*bytes)));
                } else {
                    out.push(Value::Null);
                }
            }
            let after = counts(t);
            Ok(json!({
                "rows": out,
                "verified": after.0 - before.0,
                "unverified": after.1 - before.1,
                "error": r.error.map(|e| e.to_string()),
            }))
        }
        "lookup" => {
            let req = RequestContext::new(format!("lookup-{n}"));
            let mut answers = Vec::new();
            for k in &ks {
                let deadline = Instant::now() + DEADLINE;
                let answer = loop {
                    match t.lookup(k, &req) {
                        LookupResult::Retry => {}
                        LookupResult::Hit => break "hit",
                        _ => break "miss",
                    }
                    if Instant::now() > deadline {
                        return Err(format!("lookup of {k} never resolved"));
                    }
                    t.on_schedule_end();
                    std::thread::sleep(Duration::from_millis(1));
                };
                answers.push(answer);
            }
            t.on_request_finished(&req);
            Ok(json!({ "answers": answers }))
        }
        other => Err(format!("unknown op {other:?}")),
    }
}

/// Verified and unverified loads so far.
fn counts(t: &FsTier) -> (u64, u64) {
    let get = |name: &str| {
        t.metrics()
            .into_iter()
            .find(|m| m.name == name)
            .map_or(0, |m| m.value as u64)
    };
    (
        get("fs_files_loaded_verified"),
        get("fs_files_loaded_unverified"),
    )
}
