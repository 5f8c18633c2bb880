//! Reading the driver's input: typed fields with errors that name the field.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier::contract::job::{JobResult, TransferJob};
use kvtier::contract::secondary::SecondaryTier;
use kvtier::key::ChunkKey;
use serde_json::{Value, json};

/// `value[key]` as an object field, required.
pub fn field<'a>(v: &'a Value, key: &str) -> Result<&'a Value, String> {
    v.get(key)
        .ok_or_else(|| format!("missing field {key:?} in {}", short(v)))
}

/// A required array field.
pub fn array<'a>(v: &'a Value, key: &str) -> Result<&'a Vec<Value>, String> {
    field(v, key)?
        .as_array()
        .ok_or_else(|| format!("field {key:?} must be an array"))
}

/// A required string field.
pub fn string<'a>(v: &'a Value, key: &str) -> Result<&'a str, String> {
    field(v, key)?
        .as_str()
        .ok_or_else(|| format!("field {key:?} must be a string"))
}

/// A required non-negative integer field.
pub fn uint(v: &Value, key: &str) -> Result<u64, String> {
    field(v, key)?
        .as_u64()
        .ok_or_else(|| format!("field {key:?} must be a non-negative integer"))
}

/// An optional non-negative integer field.
pub fn opt_uint(v: &Value, key: &str) -> Result<Option<u64>, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_u64()
            .map(Some)
            .ok_or_else(|| format!("field {key:?} must be a non-negative integer or null")),
    }
}

/// A `u32` field with a default.
pub fn u32_or(v: &Value, key: &str, default: u32) -> Result<u32, String> {
    match opt_uint(v, key)? {
        None => Ok(default),
        Some(x) => u32::try_from(x).map_err(|_| format!("field {key:?} is too large")),
    }
}

/// An optional boolean field with a default.
pub fn bool_or(v: &Value, key: &str, default: bool) -> Result<bool, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x
            .as_bool()
            .ok_or_else(|| format!("field {key:?} must be a boolean")),
    }
}

/// A chunk key given as a hex string.
pub fn key(v: &Value) -> Result<ChunkKey, String> {
    v.as_str()
        .and_then(ChunkKey::from_hex)
        .ok_or_else(|| format!("key {} is not hex", short(v)))
}

/// `value[name]` as an array of hex chunk keys, required.
pub fn keys(value: &Value, name: &str) -> Result<Vec<ChunkKey>, String> {
    array(value, name)?.iter().map(key).collect()
}

/// A kvtier refusal as an observation.
pub fn error_entry(e: &kvtier::Error) -> Value {
    json!({"error": e.to_string(), "kind": e.kind().as_str()})
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 120 {
        format!("{}...", &s[..s.floor_char_boundary(120)])
    } else {
        s
    }
}

/// Submits one store (`load == false`) or load job of `keys` to / from `rows` and waits for its
/// result (at most [`JOB_DEADLINE`]).
pub fn run_job(
    t: &mut dyn SecondaryTier,
    id: u64,
    keys: Vec<ChunkKey>,
    rows: Vec<u32>,
    load: bool,
) -> Result<JobResult, String> {
    let job = TransferJob {
        job_id: id,
        keys,
        chunk_ids: rows,
        is_promotion: load,
        req_id: Arc::from("replay"),
        submit_time: Instant::now(),
    };
    if load {
        t.submit_load(job);
    } else {
        t.submit_store(job);
    }
    let deadline = Instant::now() + JOB_DEADLINE;
    loop {
        if let Some(r) = t.get_finished_jobs().into_iter().find(|r| r.job_id == id) {
            return Ok(r);
        }
        if Instant::now() > deadline {
            return Err(format!("job {id} was not reported within {JOB_DEADLINE:?}"));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// How long [`run_job`] waits for a job's result.
pub const JOB_DEADLINE: Duration = Duration::from_secs(60);
