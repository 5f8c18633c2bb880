//! `kvtier-replay node-serve`: the node service (`kvtier::node`) for the Python tests, with
//! the compatibility digest and row stride of vLLM engines given directly (the Python side
//! computes them from vLLM's own spec) instead of from a model layout as `kvtier serve` does.
//!
//! Input: `{"config": {kvtier configuration with a service section and one nvme tier},
//! "row_stride": 4096, "digest": "64 hex digits", "slot_bytes": optional, the rows' stored
//! prefix, "hold_file": optional, a path: the service holds every job after its G3 I/O while
//! that file exists (`kvtier::node::start_holding_jobs`, a test hook)}`. Once the socket
//! listens the driver prints `{"ready": true}` on a line of its own and serves until SIGTERM or
//! SIGINT; then it stops the service and the document it prints is `{"status": {the service's
//! last status}}`.

use kvtier::node::{start_from_config, start_holding_jobs};
use serde_json::{Value, json};
use signal_hook::consts::{SIGINT, SIGTERM};

use crate::json::{field, string, uint};

/// Runs the service until a signal.
pub fn run(input: &Value) -> Result<Value, String> {
    let config =
        kvtier::config::from_value(field(input, "config")?.clone()).map_err(|e| e.to_string())?;
    let row_stride = uint(input, "row_stride")?;
    let slot_bytes = match input.get("slot_bytes") {
        None | Some(Value::Null) => None,
        Some(_) => Some(uint(input, "slot_bytes")?),
    };
    let digest_hex = string(input, "digest")?;
    let digest = kvtier::canonical::digest_from_hex(digest_hex)
        .ok_or_else(|| format!("digest {digest_hex:?} is not 64 hex digits"))?;
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT])
        .map_err(|e| format!("signal handlers: {e}"))?;
    let service = match input.get("hold_file") {
        None | Some(Value::Null) => start_from_config(&config, row_stride, slot_bytes, digest),
        Some(_) => {
            let hold_file = std::path::Path::new(string(input, "hold_file")?);
            start_holding_jobs(&config, row_stride, slot_bytes, digest, hold_file)
        }
    }
    .map_err(|e| e.to_string())?;
    println!("{}", json!({"ready": true}));
    let _ = signals.forever().next();
    let status: Value = serde_json::from_str(&service.status_json()).map_err(|e| e.to_string())?;
    service.shutdown().map_err(|e| e.to_string())?;
    Ok(json!({ "status": status }))
}
