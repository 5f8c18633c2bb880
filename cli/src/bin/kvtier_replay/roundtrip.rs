//! `kvtier-replay roundtrip`: canonical chunks through a G3 tier, from and to the rank-local
//! chunk files the tests write through vLLM-shaped views.
//!
//! Input: `{"dir": path, "layout": "layouts/x.toml" | "layout_toml": "<text>",
//! "blocks_per_chunk": 1, "steps": [step, ...]}` where a step is
//!
//! * `{"op": "store", "tp": 4, "key": 7, "views": [view, ...], "files": [path, ...]}`: every
//!   rank's local chunk (file `files[rank]`: layer after layer, `blocks_per_chunk` pages each)
//!   is gathered into one primary row (elected writers only, page ids `key * blocks_per_chunk
//!   + j`) and the row stored under `key`;
//! * `{"op": "load", "tp": 2, "key": 7, "views": [...], "files": [path, ...]}`: `key` is loaded
//!   into a row and scattered into every rank's local chunk, written to `files[rank]`.
//!
//! Each step opens the G3 tier in `dir` as kvtier's own embedding would at that TP size: a
//! primary row of vLLM's size for the TP, slots of the canonical area
//! (`NamespaceParams::slot_bytes`), kvtier's namespace, and every rank prepared from the
//! layers' `views` (`prepare_canonical_from_views`, which refuses a descriptor the views
//! contradict). Nothing is overridden.
//!
//! Output: `{"results": [{"row_stride", "slot_bytes", "namespace"} | {"error", "kind"}]}`, one
//! per step.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvtier::canonical::digest::{NamespaceParams, namespace_digest};
use kvtier::canonical::{
    LayerView, LayoutDescriptor, ParallelConfig, prepare_canonical_from_views,
};
use kvtier::contract::secondary::SecondaryTier;
use kvtier::g3::{FsyncPolicy, G3Tier, G3TierConfig};
use kvtier::key::ChunkKey;
use kvtier::region::PrimaryRegion;
use kvtier::{Error, ErrorKind};
use serde_json::{Value, json};

use crate::json::{self, array, error_entry, field, string, uint};

const DEADLINE: Duration = Duration::from_secs(60);
/// Slots of the tier (distinct keys a test may store).
const SLOTS: u64 = 16;

/// Runs every step of the document.
pub fn run(input: &Value) -> Result<Value, String> {
    let dir = PathBuf::from(string(input, "dir")?);
    let desc = if let Some(text) = input.get("layout_toml") {
        LayoutDescriptor::from_toml_str(text.as_str().ok_or("\"layout_toml\" must be text")?)
    } else {
        LayoutDescriptor::load(string(input, "layout")?)
    }
    .map_err(|e| e.to_string())?;
    let bpc = u32::try_from(uint(input, "blocks_per_chunk")?).map_err(|e| e.to_string())?;
    let mut results = Vec::new();
    for step in array(input, "steps")? {
        let op = string(step, "op")?;
        let load = match op {
            "store" => false,
            "load" => true,
            other => return Err(format!("unknown op {other:?} (store or load)")),
        };
        let tp = u32::try_from(uint(step, "tp")?).map_err(|e| e.to_string())?;
        let key = uint(step, "key")?;
        let views: Vec<LayerView> = serde_json::from_value(field(step, "views")?.clone())
            .map_err(|e| format!("field \"views\": {e}"))?;
        let files: Vec<PathBuf> = array(step, "files")?
            .iter()
            .map(|f| f.as_str().map(PathBuf::from).ok_or("files must be paths"))
            .collect::<Result<_, _>>()?;
        let out = transfer(&desc, &dir, bpc, tp, key, &views, &files, load);
        results.push(out.unwrap_or_else(|e| error_entry(&e)));
    }
    Ok(json!({ "results": results }))
}

#[allow(clippy::too_many_arguments)]
fn transfer(
    desc: &LayoutDescriptor,
    dir: &std::path::Path,
    bpc: u32,
    tp: u32,
    key: u64,
    views: &[LayerView],
    files: &[PathBuf],
    load: bool,
) -> kvtier::Result<Value> {
    if files.len() != tp as usize {
        return Err(Error::config(
            "files",
            format!("one file per rank: {} for TP {tp}", files.len()),
        ));
    }
    let params = NamespaceParams::new(desc, tp, bpc, true)?;
    let namespace = namespace_digest(desc, &params);
    let plans = (0..tp)
        .map(|rank| {
            prepare_canonical_from_views(desc, &ParallelConfig::tp(tp, rank), bpc, true, views)
        })
        .collect::<kvtier::Result<Vec<_>>>()?;
    let region = Arc::new(PrimaryRegion::create(1, params.row_stride)?);
    let mut cfg = G3TierConfig::new(vec![dir.to_path_buf()], SLOTS * params.slot_bytes);
    cfg.slot_bytes = params.slot_prefix();
    cfg.fsync = FsyncPolicy::Never;
    let mut tier = G3Tier::open(cfg, region.clone(), namespace, "replay".into(), None)?;
    if !tier.wait_recovered(DEADLINE) {
        return Err(Error::new(ErrorKind::Internal, "G3 recovery timed out"));
    }
    let result = if load {
        run_job(&mut tier, key, true).and_then(|()| {
            // This function is the region's only user and the load has completed.
            let row = region.read_row(0)?;
            for (p, file) in plans.iter().zip(files) {
                let mut local = vec![0u8; p.plan.local_chunk_bytes as usize];
                p.plan.scatter(&row, &mut local)?;
                std::fs::write(file, &local).map_err(|e| Error::io("write", file, e))?;
            }
            Ok(())
        })
    } else {
        let fill = || -> kvtier::Result<()> {
            for (p, file) in plans.iter().zip(files) {
                let local = std::fs::read(file).map_err(|e| Error::io("read", file, e))?;
                // As above; no transfer is in flight.
                p.plan.gather(&local, &mut region.write_row(0)?, key)?;
            }
            Ok(())
        };
        fill().and_then(|()| run_job(&mut tier, key, false))
    };
    tier.shutdown()?;
    result?;
    Ok(json!({
        "row_stride": params.row_stride,
        "slot_bytes": params.slot_bytes,
        "namespace": hex::encode(namespace),
    }))
}

fn chunk_key(id: u64) -> ChunkKey {
    let mut b = b"kvtier-replay roundtrip ".to_vec();
    b.extend_from_slice(&id.to_le_bytes());
    ChunkKey::new(b)
}

fn run_job(tier: &mut G3Tier, key: u64, load: bool) -> kvtier::Result<()> {
    let what = if load { "load" } else { "store" };
    let r = json::run_job(tier, key, vec![chunk_key(key)], vec![0], load)
        .map_err(|e| Error::new(ErrorKind::Internal, e))?;
    if r.success {
        Ok(())
    } else {
        Err(Error::new(
            ErrorKind::Internal,
            format!("G3 {what} of key {key} failed"),
        ))
    }
}
