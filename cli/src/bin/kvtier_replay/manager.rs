//! `kvtier-replay manager`: call sequences through kvtier's primary tier and tiering manager,
//! observed after every call (tests/python/test_manager_vs_vllm.py replays the same sequences
//! through vLLM 0.33.0's `TieringOffloadingManager` and compares).
//!
//! Input: `{"scenarios": [scenario, ...]}`; a scenario is
//! `{"policy": "lru"|"arc", "num_chunks": n, "keys": [hex, ...], "tiers": [tier, ...],
//! "calls": [call, ...]}`. `keys` are the keys observed after each call. A tier is
//! `{"policy": "chunk"|"request", "contents": [hex...], "busy": [hex...]}`: a scripted tier
//! that holds `contents` (and every key of a store job it reports ok), answers `Retry` for
//! `busy`, `Hit` for what it holds, else `Miss`, and logs every call it receives.
//!
//! Calls (`req` names a request, keys are hex): `new_request`, `lookup {req, key}`,
//! `prepare_store {req, keys}`, `complete_store {req, keys, success}`,
//! `prepare_load {req, keys}`, `complete_load {req, keys}`, `touch {req, keys}`,
//! `finish {req}`, `schedule_end {new: [req...]}`, `take_events`, `pending`,
//! `load_source {req, key}`, `job {tier, job, outcome: "ok"|"failed"|"partial", mask}` (the
//! tier reports its `job`-th job, in submission order, at its next poll; `partial`: the keys
//! whose `mask` entry is true loaded).
//!
//! Output: `{"results": [{"observations": [...]} ...]}`, one observation per call:
//! `{"ret", "refs": [ref_cnt or null per key], "arc": [t1, t2, b1, b2, target] | null,
//! "calls": [[call...] per tier], "usage": [usage, write usage, read usage], "metrics":
//! {"<name>{<labels>}": value}}` (the tiering metrics of [`METRICS`]: counters and gauges as
//! the registry holds them, histograms as their observation counts). A call kvtier refuses
//! ends the scenario with `"error"`.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use kvtier::ChunkKey;
use kvtier::config::model::EvictionPolicyKind;
use kvtier::contract::job::{
    JobResult, Locality, LookupResult, Medium, OffloadPolicy, RequestContext, TransferJob,
};
use kvtier::contract::secondary::SecondaryTier;
use kvtier::primary::PrimaryTier;
use kvtier::region::PrimaryRegion;
use kvtier::tiering::telemetry::names;
use kvtier::tiering::{ManagerOptions, ScheduleEndContext, TierSpec, TieringManager};
use parking_lot::Mutex;
use serde_json::{Value, json};

use crate::json::{array, field, key, keys, string, uint};

const ROW_STRIDE: u64 = 4096;

/// Which labels a compared metric has.
#[derive(Clone, Copy)]
enum Per {
    /// `0:primary` and every tier.
    Lookup,
    /// Every tier.
    Tier,
    /// Every tier, then `success` / `failure`.
    Result,
    /// No label.
    Nothing,
}

/// The tiering metrics compared after every call (`true`: a histogram, compared by count).
const METRICS: &[(&str, bool, Per)] = &[
    (names::CHUNK_QUERIES, false, Per::Lookup),
    (names::CHUNK_HITS, false, Per::Lookup),
    (names::LOOKUP_SYNC_DELAY, true, Per::Lookup),
    (names::LOOKUP_ASYNC_DELAY, true, Per::Lookup),
    (names::READ_BYTES, false, Per::Tier),
    (names::WRITE_BYTES, false, Per::Tier),
    (names::PROMOTION_JOB_FAILURES, false, Per::Tier),
    (names::CASCADE_JOB_FAILURES, false, Per::Tier),
    (names::PRIMARY_WRITE_USAGE_PERC, false, Per::Tier),
    (names::PRIMARY_READ_USAGE_PERC, false, Per::Tier),
    (names::ACTIVE_PROMOTION_JOBS, false, Per::Tier),
    (names::ACTIVE_CASCADE_JOBS, false, Per::Tier),
    (names::PROMOTION_LATENCY, true, Per::Result),
    (names::PROMOTION_ALLOCATION_FAILURES, false, Per::Nothing),
];

/// Runs every scenario.
pub fn run(input: &Value) -> Result<Value, String> {
    let mut results = Vec::new();
    for s in array(input, "scenarios")? {
        results.push(scenario(s)?);
    }
    Ok(json!({ "results": results }))
}

#[derive(Default)]
struct Script {
    contents: HashSet<ChunkKey>,
    busy: HashSet<ChunkKey>,
    policy: Option<OffloadPolicy>,
    calls: Vec<Value>,
    jobs: Vec<TransferJob>,
    reported: HashSet<usize>,
    ready: VecDeque<JobResult>,
}

struct ScriptedTier {
    script: Arc<Mutex<Script>>,
}

fn hexes(keys: &[ChunkKey]) -> Vec<String> {
    keys.iter().map(ChunkKey::to_hex).collect()
}

impl ScriptedTier {
    fn job(&mut self, kind: &str, job: TransferJob) {
        let mut s = self.script.lock();
        s.calls.push(json!([
            kind,
            job.job_id,
            job.req_id.as_ref(),
            hexes(&job.keys),
            job.chunk_ids
        ]));
        s.jobs.push(job);
    }
}

impl SecondaryTier for ScriptedTier {
    fn tier_type(&self) -> &str {
        "scripted"
    }
    fn medium(&self) -> Option<Medium> {
        Some(Medium::Storage)
    }
    fn locality(&self) -> Option<Locality> {
        None
    }
    fn lookup(&mut self, key: &ChunkKey, _req: &RequestContext) -> LookupResult {
        let mut s = self.script.lock();
        s.calls.push(json!(["lookup", key.to_hex()]));
        if s.busy.contains(key) {
            LookupResult::Retry
        } else if s.contents.contains(key) {
            LookupResult::Hit
        } else {
            LookupResult::Miss
        }
    }
    fn submit_store(&mut self, job: TransferJob) {
        self.job("store", job);
    }
    fn submit_load(&mut self, job: TransferJob) {
        self.job("load", job);
    }
    fn get_finished_jobs(&mut self) -> Vec<JobResult> {
        let mut s = self.script.lock();
        s.calls.push(json!(["poll"]));
        s.ready.drain(..).collect()
    }
    fn touch(&mut self, keys: &[ChunkKey], req: &RequestContext) {
        self.script
            .lock()
            .calls
            .push(json!(["touch", req.req_id.as_ref(), hexes(keys)]));
    }
    fn on_new_request(&mut self, req: &RequestContext) -> OffloadPolicy {
        let mut s = self.script.lock();
        s.calls.push(json!(["new", req.req_id.as_ref()]));
        s.policy.unwrap_or(OffloadPolicy::ChunkLevel)
    }
    fn on_request_finished(&mut self, req: &RequestContext) {
        self.script
            .lock()
            .calls
            .push(json!(["finished", req.req_id.as_ref()]));
    }
    fn on_schedule_end(&mut self) {
        self.script.lock().calls.push(json!(["schedule_end"]));
    }
    fn has_pending_work(&self) -> bool {
        false
    }
    fn drain_jobs(&mut self) {}
    fn shutdown(&mut self) -> kvtier::Result<()> {
        Ok(())
    }
}

fn lookup_name(r: LookupResult) -> &'static str {
    match r {
        LookupResult::Hit => "HIT",
        LookupResult::Miss => "MISS",
        LookupResult::HitPending => "HIT_PENDING",
        LookupResult::Retry => "RETRY",
    }
}

struct Replay {
    manager: TieringManager,
    scripts: Vec<Arc<Mutex<Script>>>,
    keys: Vec<ChunkKey>,
    reqs: HashMap<String, RequestContext>,
    arc: bool,
}

fn scenario(s: &Value) -> Result<Value, String> {
    let policy = match string(s, "policy")? {
        "lru" => EvictionPolicyKind::Lru,
        "arc" => EvictionPolicyKind::Arc,
        other => return Err(format!("unknown policy {other:?}")),
    };
    let num_chunks = usize::try_from(uint(s, "num_chunks")?).map_err(|e| e.to_string())?;
    let region = PrimaryRegion::create(num_chunks, ROW_STRIDE).map_err(|e| e.to_string())?;
    let primary = PrimaryTier::new(Arc::new(region), policy, true);
    let mut scripts = Vec::new();
    let mut specs = Vec::new();
    for t in array(s, "tiers")? {
        let script = Arc::new(Mutex::new(Script {
            contents: keys(t, "contents")?.into_iter().collect(),
            busy: keys(t, "busy")?.into_iter().collect(),
            policy: Some(match string(t, "policy")? {
                "request" => OffloadPolicy::RequestLevel,
                _ => OffloadPolicy::ChunkLevel,
            }),
            ..Script::default()
        }));
        specs.push(TierSpec {
            tier: Box::new(ScriptedTier {
                script: script.clone(),
            }),
            backpressure: None,
        });
        scripts.push(script);
    }
    let opts = ManagerOptions {
        enable_events: true,
        metrics_prefix: "vllm:".into(),
        ..ManagerOptions::default()
    };
    let manager = TieringManager::with_tiers(primary, specs, opts).map_err(|e| e.to_string())?;
    let mut replay = Replay {
        manager,
        scripts,
        keys: keys(s, "keys")?,
        reqs: HashMap::new(),
        arc: policy == EvictionPolicyKind::Arc,
    };
    let mut observations = Vec::new();
    let mut error = None;
    for c in array(s, "calls")? {
        match replay.apply(c) {
            Ok(ret) => observations.push(replay.observe(ret)),
            Err(msg) => {
                error = Some(msg);
                break;
            }
        }
    }
    let _ = replay.manager.shutdown();
    Ok(match error {
        None => json!({ "observations": observations }),
        Some(e) => json!({ "observations": observations, "error": e }),
    })
}

impl Replay {
    fn req(&self, c: &Value) -> Result<RequestContext, String> {
        let id = string(c, "req")?;
        self.reqs
            .get(id)
            .cloned()
            .ok_or_else(|| format!("unknown request {id:?}"))
    }

    fn apply(&mut self, c: &Value) -> Result<Value, String> {
        let op = string(c, "op")?;
        let m = &mut self.manager;
        Ok(match op {
            "new_request" => {
                let id = string(c, "req")?;
                let req = RequestContext::new(id);
                let level = m.on_new_request(&req);
                self.reqs.insert(id.to_string(), req);
                json!(match level {
                    OffloadPolicy::RequestLevel => "request_level",
                    OffloadPolicy::ChunkLevel => "chunk_level",
                })
            }
            "lookup" => {
                let req = self.req(c)?;
                let k = key(field(c, "key")?)?;
                json!(lookup_name(self.manager.lookup(&k, &req)))
            }
            "prepare_store" => {
                let req = self.req(c)?;
                match self.manager.prepare_store(&keys(c, "keys")?, &req) {
                    None => Value::Null,
                    Some(out) => json!({
                        "store": hexes(&out.keys_to_store),
                        "chunks": out.chunk_ids,
                        "evicted": hexes(&out.evicted_keys),
                    }),
                }
            }
            "complete_store" => {
                let req = self.req(c)?;
                let success = field(c, "success")?.as_bool().ok_or("success: bool")?;
                self.manager
                    .complete_store(&keys(c, "keys")?, &req, success);
                Value::Null
            }
            "prepare_load" => {
                let req = self.req(c)?;
                let ids = self
                    .manager
                    .prepare_load(&keys(c, "keys")?, &req)
                    .map_err(|e| e.to_string())?;
                json!(ids)
            }
            "complete_load" => {
                self.manager
                    .complete_load(&keys(c, "keys")?)
                    .map_err(|e| e.to_string())?;
                Value::Null
            }
            "touch" => {
                let req = self.req(c)?;
                self.manager.touch(&keys(c, "keys")?, &req);
                Value::Null
            }
            "finish" => {
                let req = self.req(c)?;
                self.manager.on_request_finished(&req);
                Value::Null
            }
            "schedule_end" => self.schedule_end(c)?,
            "take_events" => {
                let events: Vec<Value> = m
                    .take_events()
                    .iter()
                    .map(|e| json!([e.removed, e.metadata_only, hexes(&e.keys)]))
                    .collect();
                json!(events)
            }
            "pending" => json!(m.has_pending_work()),
            "load_source" => self.load_source(c)?,
            "job" => self.report_job(c)?,
            other => return Err(format!("unknown op {other:?}")),
        })
    }

    /// `job`: scripted tier `tier` reports its job `job` (`ok`, `partial` with a `mask` of the keys that succeeded, or failed).
    fn report_job(&mut self, c: &Value) -> Result<Value, String> {
        let t = usize::try_from(uint(c, "tier")?).map_err(|e| e.to_string())?;
        let j = usize::try_from(uint(c, "job")?).map_err(|e| e.to_string())?;
        let outcome = string(c, "outcome")?;
        let script = self.scripts.get(t).ok_or("job: no such tier")?;
        let mut s = script.lock();
        if j >= s.jobs.len() || !s.reported.insert(j) {
            return Err(format!("job: tier {t} has no unreported job {j}"));
        }
        let job = s.jobs[j].clone();
        let err = || kvtier::Error::new(kvtier::ErrorKind::Io, "scripted failure");
        let result = match outcome {
            "ok" => {
                if !job.is_promotion {
                    s.contents.extend(job.keys.iter().cloned());
                }
                JobResult::ok(job.job_id, Duration::ZERO, 0)
            }
            "partial" => {
                let mask: Vec<bool> = array(c, "mask")?
                    .iter()
                    .map(|v| v.as_bool().unwrap_or(false))
                    .collect();
                let ok: Vec<ChunkKey> = job
                    .keys
                    .iter()
                    .zip(mask)
                    .filter(|(_, m)| *m)
                    .map(|(k, _)| k.clone())
                    .collect();
                JobResult {
                    successful_keys: Some(ok),
                    ..JobResult::failed(job.job_id, err())
                }
            }
            _ => JobResult::failed(job.job_id, err()),
        };
        s.ready.push_back(result);
        Ok(Value::Null)
    }

    /// `schedule_end`: the scheduler step ends with the requests `new`.
    fn schedule_end(&mut self, c: &Value) -> Result<Value, String> {
        let new = array(c, "new")?
            .iter()
            .map(|v| v.as_str().map(Arc::from).ok_or("new: request ids"))
            .collect::<Result<Vec<Arc<str>>, _>>()?;
        let ctx = ScheduleEndContext {
            new_req_ids: new,
            preempted_req_ids: Vec::new(),
        };
        self.manager
            .on_schedule_end(&ctx)
            .map_err(|e| e.to_string())?;
        Ok(Value::Null)
    }

    /// `load_source`: where the manager would load `key` from, as vLLM names the medium.
    fn load_source(&self, c: &Value) -> Result<Value, String> {
        let req = self.req(c)?;
        let k = key(field(c, "key")?)?;
        let source = self.manager.get_load_source(&k, &req);
        Ok(json!(match source.and_then(|s| s.medium) {
            None if source.is_some() => "EXTERNAL_UNSPECIFIED",
            None | Some(Medium::Cpu) => "HOST",
            Some(Medium::Storage) => "DISK",
        }))
    }

    fn observe(&mut self, ret: Value) -> Value {
        let p = self.manager.primary();
        let refs: Vec<Value> = self
            .keys
            .iter()
            .map(|k| p.ref_count(k).map_or(Value::Null, |r| json!(r)))
            .collect();
        let arc = if self.arc {
            let a = p.policy_stats().arc.unwrap_or_default();
            json!([a.t1, a.t2, a.b1, a.b2, a.target_t1])
        } else {
            Value::Null
        };
        let calls: Vec<Value> = self
            .scripts
            .iter()
            .map(|s| Value::Array(std::mem::take(&mut s.lock().calls)))
            .collect();
        self.manager.refresh_metrics();
        let reg = self.manager.registry();
        let usage: Vec<Value> = [
            names::CPU_CACHE_USAGE_PERC,
            names::CPU_CACHE_WRITE_USAGE_PERC,
            names::CPU_CACHE_READ_USAGE_PERC,
        ]
        .iter()
        .map(|n| json!(reg.value(n, &[]).unwrap_or(f64::NAN)))
        .collect();
        let tiers: Vec<String> = (0..self.scripts.len())
            .map(|i| format!("{}:scripted", i + 1))
            .collect();
        let mut metrics = serde_json::Map::new();
        for &(name, histogram, per) in METRICS {
            let labelsets: Vec<Vec<&str>> = match per {
                Per::Lookup => std::iter::once(vec!["0:primary"])
                    .chain(tiers.iter().map(|t| vec![t.as_str()]))
                    .collect(),
                Per::Tier => tiers.iter().map(|t| vec![t.as_str()]).collect(),
                Per::Result => tiers
                    .iter()
                    .flat_map(|t| [vec![t.as_str(), "success"], vec![t.as_str(), "failure"]])
                    .collect(),
                Per::Nothing => vec![vec![]],
            };
            for labels in labelsets {
                let value = if histogram {
                    reg.histogram_count(name, &labels).map(|c| c as f64)
                } else {
                    reg.value(name, &labels)
                };
                metrics.insert(
                    format!("{name}{{{}}}", labels.join(",")),
                    json!(value.unwrap_or(0.0)),
                );
            }
        }
        json!({"ret": ret, "refs": refs, "arc": arc, "calls": calls, "usage": usage,
               "metrics": metrics})
    }
}
