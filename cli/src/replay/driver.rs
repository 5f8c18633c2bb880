//! The replay loop: each trace request driven through the tiering manager the way vLLM's
//! scheduler drives its offloading manager, one request at a time.
//!
//! For a request: look its full blocks up in order until the first miss (prefix semantics:
//! the first miss ends the reusable prefix); blocks the primary holds are served from it,
//! blocks a secondary tier holds are promoted (one load job at the end of the step) and
//! waited for; every served block is pinned and its bytes verified against the block's
//! deterministic payload; the rest of the prompt is "computed": rows reserved, filled with
//! each block's payload and stored, which cascades them to the tier. The request then
//! finishes and the driver waits until every job is reported, so that the counts of a replay
//! do not depend on timing (the primary never refuses a store because a cascade is late).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::bench::data::{chunk_key, fill_row, first_mismatch};
use crate::replay::trace::{TOKENS_PER_BLOCK, Trace, TraceRequest};
use kvtier::contract::job::{LookupResult, RequestContext};
use kvtier::error::{Error, ErrorKind, Result};
use kvtier::key::ChunkKey;
use kvtier::tiering::{ScheduleEndContext, TieringManager};

/// Longest the driver waits for the manager's jobs (a load, or the cascades of a request)
/// before it calls the tier stuck.
const JOB_TIMEOUT: Duration = Duration::from_secs(120);
/// Lookups answered RETRY (a tier still opening, or busy with a checkpoint) are asked again
/// this many times, a step apart, before the block counts as a miss.
const MAX_RETRIES: u32 = 10_000;

/// What the driver needs besides the manager and the trace.
#[derive(Debug, Clone, Copy)]
pub struct DriveOptions {
    /// Seed of the block payloads and keys.
    pub seed: u64,
    /// Bytes of each row the tier stores (what a load brings back and is verified).
    pub slot_bytes: u64,
    /// `Some(x)`: request i starts `timestamp_i / x` after the first; `None`: at once.
    pub time_scale: Option<f64>,
}

/// What the replay counted (independent of timing).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counts {
    /// Requests replayed.
    pub requests: u64,
    /// Prompt tokens over all requests.
    pub input_tokens: u64,
    /// References to full blocks (the partial last block of a prompt is never stored).
    pub block_references: u64,
    /// Block references served by the primary.
    pub served_primary: u64,
    /// Block references served by the secondary tier (loaded and verified).
    pub served_tier: u64,
    /// Block references computed again (after the first miss of their request).
    pub recomputed: u64,
    /// Blocks a tier promised (HIT) but whose load failed: computed again, counted in
    /// `recomputed` too.
    pub load_failures: u64,
    /// Primary hits evicted (for a promotion's row) before they were pinned: the prefix ends
    /// there and they are computed again (counted in `recomputed` too).
    pub hits_evicted: u64,
    /// Blocks whose store the primary refused (no row free): not stored anywhere.
    pub stores_refused: u64,
    /// Lookups that still answered RETRY after every attempt (counted as misses).
    pub retries_given_up: u64,
    /// Distinct blocks the tier ever served: all an oracle admission (one that knew the
    /// future) would have had to write.
    pub distinct_blocks_served_by_tier: u64,
    /// Loaded bytes compared with the expected payload (every one matched, or the replay
    /// failed).
    pub bytes_verified: u64,
}

impl Counts {
    /// Prompt tokens served from the primary or the tier instead of computed.
    pub fn tokens_saved(&self) -> u64 {
        (self.served_primary + self.served_tier) * TOKENS_PER_BLOCK
    }

    /// Prompt tokens served from the secondary tier.
    pub fn tokens_saved_tier(&self) -> u64 {
        self.served_tier * TOKENS_PER_BLOCK
    }
}

/// What the replay measured: counts, and load latencies (lookup to loaded) of tier loads.
#[derive(Debug, Default)]
pub struct Outcome {
    /// The counts.
    pub counts: Counts,
    /// Ids of the blocks the tier served.
    pub tier_served_ids: std::collections::HashSet<u64>,
    /// Seconds from a request's first lookup to each promoted block found loaded.
    pub load_latencies: Vec<f64>,
}

/// The key of trace block `id`.
pub fn block_key(seed: u64, id: u64) -> ChunkKey {
    chunk_key(seed, id)
}

/// Replays `trace` through `manager`; `on_request` is called after each request (progress).
pub fn drive(
    manager: &mut TieringManager,
    trace: &Trace,
    opts: DriveOptions,
    mut on_request: impl FnMut(u64),
) -> Result<Outcome> {
    let mut out = Outcome::default();
    let start = Instant::now();
    let t0 = trace.requests.first().map_or(0, |r| r.timestamp_ms);
    for (i, r) in trace.requests.iter().enumerate() {
        if let Some(scale) = opts.time_scale {
            let due =
                Duration::from_secs_f64(r.timestamp_ms.saturating_sub(t0) as f64 / 1e3 / scale);
            if let Some(wait) = due.checked_sub(start.elapsed()) {
                std::thread::sleep(wait);
            }
        }
        run_request(manager, r, &format!("replay-{i}"), opts, &mut out)?;
        on_request(i as u64 + 1);
    }
    Ok(out)
}

fn run_request(
    manager: &mut TieringManager,
    r: &TraceRequest,
    req_id: &str,
    opts: DriveOptions,
    out: &mut Outcome,
) -> Result<()> {
    let req = RequestContext::new(req_id);
    let req_ids: Vec<Arc<str>> = vec![req.req_id.clone()];
    let keys: Vec<ChunkKey> = r
        .full_blocks()
        .iter()
        .map(|&id| block_key(opts.seed, id))
        .collect();
    let c = &mut out.counts;
    c.requests += 1;
    c.input_tokens += r.input_length;
    c.block_references += keys.len() as u64;
    manager.on_new_request(&req);
    let started = Instant::now();
    let (hits, promoted) = lookup_prefix(manager, &keys, &req, c)?;
    manager.on_schedule_end(&ScheduleEndContext {
        new_req_ids: req_ids,
        preempted_req_ids: Vec::new(),
    })?;
    wait_promotions(manager, &promoted)?;
    let latency = started.elapsed().as_secs_f64();
    // The served prefix: the leading run of looked-up blocks the primary now holds. A failed
    // promotion ends it, and so does a primary hit evicted for a promotion's row (nothing
    // pins a hit until `prepare_load`, in vLLM's scheduler too).
    let looked = hits + promoted.len();
    let served = keys[..looked]
        .iter()
        .take_while(|k| manager.primary().lookup(k) == LookupResult::Hit)
        .count();
    let failed = promoted
        .iter()
        .filter(|k| manager.primary().lookup(k) != LookupResult::Hit)
        .count();
    let c = &mut out.counts;
    c.load_failures += failed as u64;
    c.hits_evicted += keys[..hits]
        .iter()
        .filter(|k| manager.primary().lookup(k) != LookupResult::Hit)
        .count() as u64;
    c.served_primary += served.min(hits) as u64;
    let from_tier = served.saturating_sub(hits);
    c.served_tier += from_tier as u64;
    c.recomputed += (keys.len() - served) as u64;
    out.tier_served_ids
        .extend(r.hash_ids[hits.min(served)..served].iter().copied());
    c.distinct_blocks_served_by_tier = out.tier_served_ids.len() as u64;
    out.load_latencies
        .extend(std::iter::repeat_n(latency, from_tier));
    let c = &mut out.counts;
    verify_served(manager, &keys[..served], r, &req, opts, c)?;
    store_computed(manager, &keys[served..], r, served, &req, opts, c)?;
    manager.on_request_finished(&req);
    wait_idle(manager)
}

/// Looks the blocks up in order until the first miss. Returns the primary hits (a leading
/// run) and the keys promoted from a tier after them.
fn lookup_prefix(
    manager: &mut TieringManager,
    keys: &[ChunkKey],
    req: &RequestContext,
    c: &mut Counts,
) -> Result<(usize, Vec<ChunkKey>)> {
    let mut hits = 0;
    let mut promoted = Vec::new();
    for key in keys {
        let mut answer = manager.lookup(key, req);
        let mut tries = 0;
        while answer == LookupResult::Retry && tries < MAX_RETRIES {
            tries += 1;
            std::thread::sleep(Duration::from_micros(100));
            manager.poll()?;
            answer = manager.lookup(key, req);
        }
        match answer {
            LookupResult::Hit if promoted.is_empty() => hits += 1,
            // A primary hit inside a run of promotions is served like them.
            LookupResult::Hit => promoted.push(key.clone()),
            LookupResult::HitPending => promoted.push(key.clone()),
            LookupResult::Retry => {
                c.retries_given_up += 1;
                break;
            }
            LookupResult::Miss => break,
        }
    }
    Ok((hits, promoted))
}

/// Waits until every promoted key is loaded or failed.
fn wait_promotions(manager: &mut TieringManager, promoted: &[ChunkKey]) -> Result<()> {
    let deadline = Instant::now() + JOB_TIMEOUT;
    loop {
        manager.poll()?;
        let pending = promoted
            .iter()
            .any(|k| manager.primary().lookup(k) == LookupResult::HitPending);
        if !pending {
            break;
        }
        if Instant::now() >= deadline {
            return Err(stuck("a promotion"));
        }
        std::thread::yield_now();
    }
    Ok(())
}

/// Pins the served blocks, checks every byte the tier stores of each against its payload,
/// and unpins them.
fn verify_served(
    manager: &mut TieringManager,
    keys: &[ChunkKey],
    r: &TraceRequest,
    req: &RequestContext,
    opts: DriveOptions,
    c: &mut Counts,
) -> Result<()> {
    if keys.is_empty() {
        return Ok(());
    }
    let rows = manager.prepare_load(keys, req)?;
    let region = manager.region().clone();
    let mut bad = None;
    for (j, &row) in rows.iter().enumerate() {
        // `prepare_load` pinned the row for reading: nobody writes it until
        // `complete_load`, and this single-threaded driver only reads it.
        let bytes = region.read_row(row as usize)?;
        let n = (opts.slot_bytes as usize).min(bytes.len());
        let id = r.hash_ids[j];
        if let Some(at) = first_mismatch(&bytes[..n], opts.seed, id) {
            bad = Some((id, at));
            break;
        }
        c.bytes_verified += n as u64;
    }
    manager.complete_load(keys)?;
    match bad {
        None => Ok(()),
        Some((id, at)) => Err(Error::new(
            ErrorKind::Checksum,
            format!(
                "block {id} (key {}) served with wrong bytes: first difference at byte {at}",
                block_key(opts.seed, id)
            ),
        )),
    }
}

/// "Computes" the blocks after the served prefix: reserves rows, fills each with its block's
/// payload and completes the store (which cascades the blocks to every secondary tier).
fn store_computed(
    manager: &mut TieringManager,
    keys: &[ChunkKey],
    r: &TraceRequest,
    first: usize,
    req: &RequestContext,
    opts: DriveOptions,
    c: &mut Counts,
) -> Result<()> {
    if keys.is_empty() {
        return Ok(());
    }
    let Some(prep) = manager.prepare_store(keys, req) else {
        c.stores_refused += keys.len() as u64;
        return Ok(());
    };
    let region = manager.region().clone();
    for (key, &row) in prep.keys_to_store.iter().zip(&prep.chunk_ids) {
        let j = keys.iter().position(|k| k == key).ok_or_else(|| {
            Error::new(
                ErrorKind::Internal,
                format!("prepare_store returned key {key} that was not offered"),
            )
        })?;
        // `prepare_store` reserved the row for this write (`ref_cnt == -1`): no tier
        // reads or writes it until `complete_store`, and this driver is single-threaded.
        let mut bytes = region.write_row(row as usize)?;
        fill_row(&mut bytes, opts.seed, r.hash_ids[first + j]);
    }
    manager.complete_store(&prep.keys_to_store, req, true);
    Ok(())
}

/// Waits until the manager has no job outstanding.
fn wait_idle(manager: &mut TieringManager) -> Result<()> {
    let deadline = Instant::now() + JOB_TIMEOUT;
    loop {
        manager.poll()?;
        if !manager.has_pending_work() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(stuck("the request's stores"));
        }
        std::thread::sleep(Duration::from_micros(20));
    }
}

fn stuck(what: &str) -> Error {
    Error::new(
        ErrorKind::Internal,
        format!(
            "{what} did not finish within {} s; the tier is stuck",
            JOB_TIMEOUT.as_secs()
        ),
    )
}
