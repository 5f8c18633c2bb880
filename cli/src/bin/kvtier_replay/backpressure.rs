//! `kvtier-replay backpressure`: replays back-pressure scenarios through kvtier.
//!
//! Input: `{"scenarios": [scenario, ...]}`. Time is counted in ticks of 1/512 s: such times
//! are exact both as whole nanoseconds (kvtier's `Duration`) and as binary floats (vLLM's
//! `time.monotonic()` values), so both sides do the same arithmetic. Three kinds:
//!
//! * `{"kind": "detector", "params": {...}, "events": [...]}`: one `EmaDetector` on a manual
//!   clock. `params` are vLLM's constructor arguments (`high_water_s`, `low_water_s`, `alpha`,
//!   `warmup_completions`, `decay_half_life_s`, `cooldown_s`, `failure_threshold` (or null),
//!   `policy_cls`). Events: `{"op": "advance", "ticks": n}`, `{"op": "update", "age_ticks": n,
//!   "bytes": b}` (a store submitted `n` ticks ago completed), `{"op": "failed"}`,
//!   `{"op": "should_store", "blocks": n}`, `{"op": "is_under_pressure"}`, `{"op": "reset"}`.
//! * `{"kind": "manager", "config": {...}, "events": [...]}`: kvtier's `TieringManager` built
//!   from the configuration (vLLM's `kv_connector_extra_config` shape; every secondary tier is a
//!   scripted tier that reports jobs when told), a primary of `num_chunks` rows of `row_stride`
//!   bytes (from the scenario, defaults 1024 and 4096) and a manual clock. Events:
//!   `advance`; `{"op": "store", "keys": n}` (one scheduler step in which a new request stores
//!   `n` new chunks: `on_new_request`, `prepare_store`, `complete_store`, `on_request_finished`,
//!   `on_schedule_end`; the result lists, per tier, the index of the store job it received or
//!   null when back-pressure dropped it);
//!   `{"op": "finish", "tier": i, "job": k, "success": b, "transfer_bytes": n | null}` (tier
//!   `i` reports its `k`-th store job at the next poll); `{"op": "poll"}` (`on_schedule_end`).
//! * `{"kind": "config", "config": {...}}`: the detector parameters kvtier resolves for each
//!   secondary tier (null: no detector), or the configuration error.
//!
//! Detector and manager scenarios answer `{"observations": [...]}`, one per event (a manager
//! scenario that names a job kvtier never submitted stops there and adds `"error"`):
//! `{"result", "tiers": [{"ema", "pressure", "consecutive_failures", "healthy_streak",
//! "stores_dropped", "blocks_dropped"}]}` (`pressure` is the state as last computed, read
//! without applying idle decay; drop counts are cumulative).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use kvtier::ChunkKey;
use kvtier::config::{self, KvtierConfig};
use kvtier::contract::job::{
    JobId, JobResult, Locality, LookupResult, Medium, RequestContext, TransferJob,
};
use kvtier::contract::secondary::SecondaryTier;
use kvtier::primary::PrimaryTier;
use kvtier::region::PrimaryRegion;
use kvtier::tiering::backpressure::{DetectorParams, EmaDetector, PolicyKind, StoreDecision};
use kvtier::tiering::clock::{Clock, ManualClock};
use kvtier::tiering::{ManagerOptions, ScheduleEndContext, TierSpec, TieringManager};
use parking_lot::Mutex;
use serde_json::{Value, json};

use crate::json::{array, error_entry, field, opt_uint, string, uint};

/// Nanoseconds per tick (1/512 s).
const TICK_NS: u64 = 1_953_125;

fn ticks(n: u64) -> Result<Duration, String> {
    n.checked_mul(TICK_NS)
        .map(Duration::from_nanos)
        .ok_or_else(|| format!("{n} ticks overflow"))
}

/// Runs every scenario of the document.
pub fn run(input: &Value) -> Result<Value, String> {
    let mut results = Vec::new();
    for s in array(input, "scenarios")? {
        let out = match string(s, "kind")? {
            "detector" => detector_scenario(s)?,
            "manager" => manager_scenario(s)?,
            "config" => config_scenario(s)?,
            other => return Err(format!("unknown scenario kind {other:?}")),
        };
        results.push(out);
    }
    Ok(json!({ "results": results }))
}

fn detector_state(d: &EmaDetector) -> Value {
    let (stores, blocks) = d.dropped();
    json!({
        "ema": d.ema(),
        "pressure": d.pressure_flag(),
        "consecutive_failures": d.consecutive_failures(),
        "healthy_streak": d.healthy_streak(),
        "stores_dropped": stores,
        "blocks_dropped": blocks,
    })
}

fn f64_field(v: &Value, key: &str) -> Result<f64, String> {
    field(v, key)?
        .as_f64()
        .ok_or_else(|| format!("field {key:?} must be a number"))
}

/// vLLM's constructor arguments as given (no kvtier validation: the detector is exercised
/// with whatever vLLM's detector accepts).
fn params_of(p: &Value) -> Result<DetectorParams, String> {
    let policy = match p.get("policy_cls").and_then(Value::as_str) {
        None | Some("ThrottledDropPolicy") => PolicyKind::Throttled,
        Some("DropStorePolicy") => PolicyKind::DropAll,
        Some(other) => return Err(format!("unknown policy_cls {other:?}")),
    };
    let failure_threshold = opt_uint(p, "failure_threshold")?
        .map(|n| u32::try_from(n).map_err(|_| "failure_threshold too large".to_string()))
        .transpose()?;
    Ok(DetectorParams {
        high_water_s: f64_field(p, "high_water_s")?,
        low_water_s: f64_field(p, "low_water_s")?,
        alpha: f64_field(p, "alpha")?,
        warmup_completions: u32::try_from(uint(p, "warmup_completions")?)
            .map_err(|_| "warmup_completions too large")?,
        decay_half_life_s: f64_field(p, "decay_half_life_s")?,
        cooldown_s: f64_field(p, "cooldown_s")?,
        failure_threshold,
        policy,
    })
}

fn detector_scenario(s: &Value) -> Result<Value, String> {
    let params = params_of(field(s, "params")?)?;
    let clock = Arc::new(ManualClock::new());
    let mut d = EmaDetector::new(params, "replay", clock.clone());
    let mut observations = Vec::new();
    for e in array(s, "events")? {
        let result = match string(e, "op")? {
            "advance" => {
                clock.advance(ticks(uint(e, "ticks")?)?);
                Value::Null
            }
            "update" => {
                let submit = clock.now() - ticks(uint(e, "age_ticks")?)?;
                d.update(submit, uint(e, "bytes")?);
                Value::Null
            }
            "failed" => {
                d.on_store_failed();
                Value::Null
            }
            "should_store" => {
                let blocks = usize::try_from(uint(e, "blocks")?).map_err(|e| e.to_string())?;
                json!(d.should_store(blocks) == StoreDecision::Store)
            }
            "is_under_pressure" => json!(d.is_under_pressure()),
            "reset" => {
                d.reset();
                Value::Null
            }
            other => return Err(format!("unknown detector op {other:?}")),
        };
        observations.push(json!({"result": result, "tiers": [detector_state(&d)]}));
    }
    Ok(json!({ "observations": observations }))
}

/// The resolved detector parameters of every tier of `cfg`.
fn tier_params(cfg: &KvtierConfig) -> kvtier::Result<Vec<Option<DetectorParams>>> {
    cfg.secondary_tiers
        .iter()
        .map(DetectorParams::for_tier)
        .collect()
}

fn params_json(p: &Option<DetectorParams>) -> Value {
    match p {
        None => Value::Null,
        Some(p) => json!({
            "high_water_s": p.high_water_s,
            "low_water_s": p.low_water_s,
            "alpha": p.alpha,
            "warmup_completions": p.warmup_completions,
            "decay_half_life_s": p.decay_half_life_s,
            "cooldown_s": p.cooldown_s,
            "failure_threshold": p.failure_threshold,
            "policy_cls": match p.policy {
                PolicyKind::Throttled => "ThrottledDropPolicy",
                PolicyKind::DropAll => "DropStorePolicy",
            },
        }),
    }
}

fn config_scenario(s: &Value) -> Result<Value, String> {
    let resolved =
        config::from_value(field(s, "config")?.clone()).and_then(|cfg| tier_params(&cfg));
    Ok(match resolved {
        Ok(tiers) => json!({"tiers": tiers.iter().map(params_json).collect::<Vec<_>>()}),
        Err(e) => error_entry(&e),
    })
}

/// What the driver tells a scripted tier, and what it saw.
#[derive(Default)]
struct Script {
    /// Store jobs in submission order.
    submitted: Vec<JobId>,
    /// Results to hand out at the next `get_finished_jobs`.
    ready: VecDeque<JobResult>,
}

/// A secondary tier that holds nothing and reports each job when the driver says so.
struct ScriptedTier {
    tier_type: String,
    locality: Option<Locality>,
    script: Arc<Mutex<Script>>,
}

impl SecondaryTier for ScriptedTier {
    fn tier_type(&self) -> &str {
        &self.tier_type
    }
    fn medium(&self) -> Option<Medium> {
        Some(Medium::Storage)
    }
    fn locality(&self) -> Option<Locality> {
        self.locality
    }
    fn lookup(&mut self, _key: &ChunkKey, _req: &RequestContext) -> LookupResult {
        LookupResult::Miss
    }
    fn submit_store(&mut self, job: TransferJob) {
        self.script.lock().submitted.push(job.job_id);
    }
    fn submit_load(&mut self, job: TransferJob) {
        let e = kvtier::Error::new(kvtier::ErrorKind::Internal, "scripted tier holds nothing");
        self.script
            .lock()
            .ready
            .push_back(JobResult::failed(job.job_id, e));
    }
    fn get_finished_jobs(&mut self) -> Vec<JobResult> {
        self.script.lock().ready.drain(..).collect()
    }
    fn has_pending_work(&self) -> bool {
        false
    }
    fn drain_jobs(&mut self) {}
    fn shutdown(&mut self) -> kvtier::Result<()> {
        Ok(())
    }
}

fn manager_scenario(s: &Value) -> Result<Value, String> {
    let cfg = match config::from_value(field(s, "config")?.clone()) {
        Ok(c) => c,
        Err(e) => return Ok(error_entry(&e)),
    };
    let params = match tier_params(&cfg) {
        Ok(p) => p,
        Err(e) => return Ok(error_entry(&e)),
    };
    let num_chunks =
        usize::try_from(opt_uint(s, "num_chunks")?.unwrap_or(1024)).map_err(|e| e.to_string())?;
    let row_stride = opt_uint(s, "row_stride")?.unwrap_or(4096);
    let region = PrimaryRegion::create(num_chunks, row_stride).map_err(|e| e.to_string())?;
    let primary = PrimaryTier::new(Arc::new(region), cfg.eviction_policy, false);
    let clock = Arc::new(ManualClock::new());
    let scripts: Vec<Arc<Mutex<Script>>> = cfg
        .secondary_tiers
        .iter()
        .map(|_| Arc::new(Mutex::new(Script::default())))
        .collect();
    let specs = cfg
        .secondary_tiers
        .iter()
        .zip(&scripts)
        .zip(params)
        .map(|((t, script), backpressure)| TierSpec {
            tier: Box::new(ScriptedTier {
                tier_type: t.tier_type.clone(),
                locality: t.locality,
                script: script.clone(),
            }),
            backpressure,
        })
        .collect();
    let opts = ManagerOptions {
        clock: clock.clone(),
        ..ManagerOptions::default()
    };
    let mut m = TieringManager::with_tiers(primary, specs, opts).map_err(|e| e.to_string())?;
    let mut replay = ManagerReplay {
        manager: &mut m,
        clock: &clock,
        scripts: &scripts,
        next_key: 0,
        next_req: 0,
    };
    let mut observations = Vec::new();
    let mut error = None;
    for e in array(s, "events")? {
        match replay.apply(e) {
            Ok(result) => {
                let m = &replay.manager;
                let tiers: Vec<Value> = (0..m.num_tiers())
                    .map(|i| m.detector(i).map_or(Value::Null, detector_state))
                    .collect();
                observations.push(json!({"result": result, "tiers": tiers}));
            }
            Err(msg) => {
                error = Some(msg);
                break;
            }
        }
    }
    m.shutdown().map_err(|e| e.to_string())?;
    Ok(match error {
        None => json!({ "observations": observations }),
        Some(e) => json!({ "observations": observations, "error": e }),
    })
}

/// One manager scenario in progress.
struct ManagerReplay<'a> {
    manager: &'a mut TieringManager,
    clock: &'a ManualClock,
    scripts: &'a [Arc<Mutex<Script>>],
    next_key: u64,
    next_req: u64,
}

impl ManagerReplay<'_> {
    /// Applies one event; an event kvtier cannot follow (a job it never submitted) is an error
    /// that ends the scenario.
    fn apply(&mut self, e: &Value) -> Result<Value, String> {
        let m = &mut *self.manager;
        Ok(match string(e, "op")? {
            "advance" => {
                self.clock.advance(ticks(uint(e, "ticks")?)?);
                Value::Null
            }
            "store" => {
                let n = uint(e, "keys")?;
                let keys: Vec<ChunkKey> = (0..n)
                    .map(|_| {
                        self.next_key += 1;
                        replay_key(self.next_key)
                    })
                    .collect();
                self.next_req += 1;
                let req = RequestContext::new(format!("req-{}", self.next_req));
                let before: Vec<usize> = self
                    .scripts
                    .iter()
                    .map(|s| s.lock().submitted.len())
                    .collect();
                m.on_new_request(&req);
                if m.prepare_store(&keys, &req).is_none() {
                    return Err("the primary refused a store: raise num_chunks".into());
                }
                m.complete_store(&keys, &req, true);
                m.on_request_finished(&req);
                m.on_schedule_end(&ScheduleEndContext::default())
                    .map_err(|e| e.to_string())?;
                let jobs: Vec<Value> = self
                    .scripts
                    .iter()
                    .zip(before)
                    .map(|(s, b)| {
                        let now = s.lock().submitted.len();
                        if now > b { json!(b) } else { Value::Null }
                    })
                    .collect();
                json!(jobs)
            }
            "finish" => {
                let tier = usize::try_from(uint(e, "tier")?).map_err(|e| e.to_string())?;
                let job = usize::try_from(uint(e, "job")?).map_err(|e| e.to_string())?;
                let script = self.scripts.get(tier).ok_or("finish: no such tier")?;
                let mut script = script.lock();
                let id = *script
                    .submitted
                    .get(job)
                    .ok_or_else(|| format!("finish: tier {tier} never received store job {job}"))?;
                let result = if field(e, "success")?.as_bool().ok_or("success: bool")? {
                    JobResult {
                        transfer_bytes: opt_uint(e, "transfer_bytes")?,
                        ..JobResult::ok(id, Duration::ZERO, 0)
                    }
                } else {
                    let err = kvtier::Error::new(kvtier::ErrorKind::Io, "scripted failure");
                    JobResult::failed(id, err)
                };
                script.ready.push_back(result);
                Value::Null
            }
            "poll" => {
                m.on_schedule_end(&ScheduleEndContext::default())
                    .map_err(|e| e.to_string())?;
                Value::Null
            }
            other => return Err(format!("unknown manager op {other:?}")),
        })
    }
}

/// The `n`-th key of a replay: a unique 8-byte block hash, then group 0 (vLLM's key layout is
/// hash bytes then a 4-byte group id; the group id 0 reads the same in either byte order).
pub fn replay_key(n: u64) -> ChunkKey {
    let mut bytes = n.to_le_bytes().to_vec();
    bytes.extend_from_slice(&[0; 4]);
    ChunkKey::new(bytes)
}
