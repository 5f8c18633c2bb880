//! The phases `kvtier bench` drives through the tiering manager: fill, store (cascade), load
//! (promotion) and verify, plus the corrupt-chunk test hook.
//!
//! The driver polls the manager every [`POLL_INTERVAL`] while waiting, like a scheduler's step
//! loop; job latencies are measured from submission to the poll that saw the job finish, so
//! their resolution is that interval.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::bench::data::{fill_row, first_mismatch};
use crate::bench::plan::Plan;
use crate::bench::report::PhaseReport;
use crate::output::progress_bar;
use crate::stats::percentile_sorted;
use crate::stats::process_cpu_seconds;
use kvtier::contract::job::{LookupResult, RequestContext};
use kvtier::error::{Error, ErrorKind, Result};
use kvtier::key::ChunkKey;
use kvtier::tiering::{ScheduleEndContext, TieringManager};

/// How often the driver polls the manager while it waits for jobs.
pub const POLL_INTERVAL: Duration = Duration::from_micros(200);

/// Test hook: `KVTIER_BENCH_CORRUPT_CHUNK=<index>` flips one byte of that chunk's loaded row
/// before verification, to prove that a wrong byte fails the run (exit 1). Logged when used.
pub const CORRUPT_CHUNK_ENV: &str = "KVTIER_BENCH_CORRUPT_CHUNK";

pub(crate) fn corrupt_chunk_for_test() -> Result<Option<u64>> {
    match std::env::var(CORRUPT_CHUNK_ENV) {
        Err(_) => Ok(None),
        Ok(v) => {
            v.trim().parse().map(Some).map_err(|_| {
                Error::config(CORRUPT_CHUNK_ENV, format!("{v:?} is not a chunk index"))
            })
        }
    }
}

pub(crate) fn corrupt_loaded_chunk(
    manager: &mut TieringManager,
    keys: &[ChunkKey],
    index: u64,
) -> Result<()> {
    let key = keys.get(index as usize).ok_or_else(|| {
        Error::config(CORRUPT_CHUNK_ENV, format!("chunk {index} is out of range"))
    })?;
    log::warn!("{CORRUPT_CHUNK_ENV}: flipping one byte of chunk {index} before verification");
    let req = RequestContext::new("bench-corrupt");
    manager.on_new_request(&req);
    let rows = manager.prepare_load(std::slice::from_ref(key), &req)?;
    let region = manager.region().clone();
    if let Some(&row) = rows.first() {
        // The row is pinned and this single-threaded driver is its only user until
        // `complete_load`; the G3 tier finished writing it (the promotion completed).
        let mut bytes = region.write_row(row as usize)?;
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x40;
    }
    manager.complete_load(std::slice::from_ref(key))?;
    manager.on_request_finished(&req);
    Ok(())
}

fn request(kind: &str, batch: usize) -> RequestContext {
    RequestContext::new(format!("bench-{kind}-{batch}"))
}

/// Reserves every chunk's row and writes its bytes (untimed).
pub(crate) fn fill(
    manager: &mut TieringManager,
    keys: &[ChunkKey],
    batches: &[std::ops::Range<u64>],
    seed: u64,
    progress: bool,
) -> Result<()> {
    let bar = progress_bar(keys.len() as u64, "fill", progress);
    let region = manager.region().clone();
    for (b, range) in batches.iter().enumerate() {
        crate::interrupt::check("the fill phase")?;
        let req = request("store", b);
        manager.on_new_request(&req);
        let batch = &keys[range.start as usize..range.end as usize];
        let out = manager.prepare_store(batch, &req).ok_or_else(|| {
            Error::new(
                ErrorKind::NoSpace,
                "the primary refused the bench's store (no room); this is a bench bug",
            )
        })?;
        for (key, &row) in out.keys_to_store.iter().zip(&out.chunk_ids) {
            let index = range.start + batch.iter().position(|k| k == key).unwrap_or(0) as u64;
            // `prepare_store` reserved this row for our write (ref_cnt -1): nothing
            // else reads or writes it until `complete_store`.
            let mut bytes = region.write_row(row as usize)?;
            fill_row(&mut bytes, seed, index);
        }
        bar.inc(batch.len() as u64);
    }
    bar.finish_and_clear();
    Ok(())
}

/// Turns a job that never finishes into an error instead of a hang.
struct StallGuard {
    last_progress: Instant,
}

/// How long the bench waits without any job finishing before it gives up.
const STALL_LIMIT: Duration = Duration::from_secs(120);

impl StallGuard {
    fn new() -> Self {
        StallGuard {
            last_progress: Instant::now(),
        }
    }

    fn check(&mut self, progressed: bool, phase: &str) -> Result<()> {
        crate::interrupt::check(&format!("the {phase} phase"))?;
        if progressed {
            self.last_progress = Instant::now();
            return Ok(());
        }
        if self.last_progress.elapsed() > STALL_LIMIT {
            return Err(Error::new(
                ErrorKind::Internal,
                format!(
                    "{phase} phase: no job finished for {} s; the tier stopped reporting",
                    STALL_LIMIT.as_secs()
                ),
            ));
        }
        Ok(())
    }
}

/// An outstanding job: its batch, keys, and when it was submitted.
struct Outstanding {
    batch: usize,
    started: Instant,
}

/// What distinguishes one timed phase: how a batch is submitted, how the manager is stepped
/// after a round of submissions, and when a batch counts as finished.
trait PhaseSteps {
    /// Hands batch `batch` (its `keys`) to the manager.
    fn submit(&mut self, m: &mut TieringManager, batch: usize, keys: &[ChunkKey]) -> Result<()>;
    /// Steps the manager after a round; `submitted` says whether any batch went out.
    fn step(&mut self, m: &mut TieringManager, submitted: bool) -> Result<()>;
    /// Whether every key of a batch is done.
    fn batch_done(&self, m: &TieringManager, keys: &[ChunkKey]) -> bool;
    /// Whether to wait [`POLL_INTERVAL`] when a round finished nothing.
    fn may_wait(&self, submitted: bool) -> bool;
}

/// Stores: `complete_store` cascades each batch to the tier as one store job.
struct StoreSteps;

impl PhaseSteps for StoreSteps {
    fn submit(&mut self, m: &mut TieringManager, batch: usize, keys: &[ChunkKey]) -> Result<()> {
        let req = request("store", batch);
        m.complete_store(keys, &req, true);
        m.on_request_finished(&req);
        Ok(())
    }

    fn step(&mut self, m: &mut TieringManager, _submitted: bool) -> Result<()> {
        m.poll()
    }

    fn batch_done(&self, m: &TieringManager, keys: &[ChunkKey]) -> bool {
        // A cascade pins its rows until the tier reports: a batch is done when no row of it
        // is pinned any more.
        keys.iter()
            .all(|k| m.primary().ref_count(k).is_none_or(|r| r == 0))
    }

    fn may_wait(&self, _submitted: bool) -> bool {
        true
    }
}

/// Loads: lookups start promotions; one load job per (tier, request) goes out at the end of
/// the step.
struct LoadSteps;

impl PhaseSteps for LoadSteps {
    fn submit(&mut self, m: &mut TieringManager, batch: usize, keys: &[ChunkKey]) -> Result<()> {
        let req = request("load", batch);
        m.on_new_request(&req);
        for key in keys {
            // The first secondary HIT starts a promotion (HitPending). RETRY: the G3 tier
            // while it recovers (a fresh tier never does), an fs tier while it checks a file
            // it does not know; ask again after the step ends, as a scheduler would.
            let deadline = Instant::now() + STALL_LIMIT;
            while m.lookup(key, &req) == LookupResult::Retry {
                if Instant::now() > deadline {
                    return Err(Error::new(
                        ErrorKind::Internal,
                        format!(
                            "the tier answered RETRY for {} s; its lookups never resolved",
                            STALL_LIMIT.as_secs()
                        ),
                    ));
                }
                m.on_schedule_end(&ScheduleEndContext::default())?;
                std::thread::sleep(POLL_INTERVAL);
            }
        }
        Ok(())
    }

    fn step(&mut self, m: &mut TieringManager, submitted: bool) -> Result<()> {
        if submitted {
            m.on_schedule_end(&ScheduleEndContext::default())
        } else {
            m.poll()
        }
    }

    fn batch_done(&self, m: &TieringManager, keys: &[ChunkKey]) -> bool {
        keys.iter()
            .all(|k| m.primary().lookup(k) != LookupResult::HitPending)
    }

    fn may_wait(&self, submitted: bool) -> bool {
        !submitted
    }
}

pub(crate) fn store_phase(
    manager: &mut TieringManager,
    plan: &Plan,
    keys: &[ChunkKey],
    batches: &[std::ops::Range<u64>],
    progress: bool,
) -> Result<PhaseReport> {
    drive_phase(
        manager,
        plan,
        keys,
        batches,
        progress,
        "store",
        &mut StoreSteps,
    )
}

pub(crate) fn load_phase(
    manager: &mut TieringManager,
    plan: &Plan,
    keys: &[ChunkKey],
    batches: &[std::ops::Range<u64>],
    progress: bool,
) -> Result<PhaseReport> {
    let report = drive_phase(
        manager,
        plan,
        keys,
        batches,
        progress,
        "load",
        &mut LoadSteps,
    )?;
    for b in 0..batches.len() {
        manager.on_request_finished(&request("load", b));
    }
    Ok(report)
}

/// Keeps up to `plan.window_jobs` batches outstanding, steps the manager, retires finished
/// batches (recording submission-to-poll latency) and times the whole phase.
fn drive_phase(
    manager: &mut TieringManager,
    plan: &Plan,
    keys: &[ChunkKey],
    batches: &[std::ops::Range<u64>],
    progress: bool,
    phase: &str,
    steps: &mut impl PhaseSteps,
) -> Result<PhaseReport> {
    let bar = progress_bar(keys.len() as u64, phase, progress);
    let slice = |b: usize| &keys[batches[b].start as usize..batches[b].end as usize];
    let cpu0 = process_cpu_seconds();
    let start = Instant::now();
    let mut latencies = Vec::with_capacity(batches.len());
    let mut outstanding: VecDeque<Outstanding> = VecDeque::new();
    let mut next = 0;
    let mut stall = StallGuard::new();
    while next < batches.len() || !outstanding.is_empty() {
        let mut submitted = false;
        while next < batches.len() && outstanding.len() < plan.window_jobs {
            steps.submit(manager, next, slice(next))?;
            outstanding.push_back(Outstanding {
                batch: next,
                started: Instant::now(),
            });
            next += 1;
            submitted = true;
        }
        steps.step(manager, submitted)?;
        let before = outstanding.len();
        outstanding.retain(|o| {
            let done = steps.batch_done(manager, slice(o.batch));
            if done {
                latencies.push(o.started.elapsed());
                bar.inc(slice(o.batch).len() as u64);
            }
            !done
        });
        if outstanding.len() == before && !outstanding.is_empty() && steps.may_wait(submitted) {
            stall.check(false, phase)?;
            std::thread::sleep(POLL_INTERVAL);
        } else {
            stall.check(true, phase)?;
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    Ok(phase_report(
        plan,
        latencies,
        seconds,
        process_cpu_seconds() - cpu0,
    ))
}

fn phase_report(
    plan: &Plan,
    mut latencies: Vec<Duration>,
    seconds: f64,
    cpu_seconds: f64,
) -> PhaseReport {
    latencies.sort_unstable();
    let ms = |p: f64| {
        percentile_sorted(&latencies, p)
            .map(|d| d.as_secs_f64() * 1e3)
            .unwrap_or(f64::NAN)
    };
    let bytes = plan.chunks * plan.row_stride;
    let gb = bytes as f64 / 1e9;
    PhaseReport {
        bytes,
        seconds,
        gb_per_s: gb / seconds.max(1e-9),
        jobs: latencies.len(),
        chunks_per_job: plan.chunks_per_job,
        job_latency_p50_ms: ms(50.0),
        job_latency_p99_ms: ms(99.0),
        cpu_seconds,
        cpu_seconds_per_gb: cpu_seconds / gb,
    }
}

/// Pins every loaded row and compares it with the bytes stored under its key (the first
/// `stored_bytes` of it when the tier keeps only that prefix of each row).
pub(crate) fn verify(
    manager: &mut TieringManager,
    keys: &[ChunkKey],
    seed: u64,
    stored_bytes: Option<u64>,
    progress: bool,
) -> Result<(u64, u64, u64)> {
    let bar = progress_bar(keys.len() as u64, "verify", progress);
    let region = manager.region().clone();
    let req = RequestContext::new("bench-verify");
    manager.on_new_request(&req);
    let (mut verified, mut mismatched, mut missing) = (0u64, 0u64, 0u64);
    for (index, key) in keys.iter().enumerate() {
        if index % 64 == 0 {
            crate::interrupt::check("the verify phase")?;
        }
        if manager.primary().lookup(key) != LookupResult::Hit {
            missing += 1;
            if missing <= 5 {
                log::error!("chunk {index} (key {key}) did not come back from the G3 tier");
            }
            continue;
        }
        let rows = manager.prepare_load(std::slice::from_ref(key), &req)?;
        let row = rows
            .first()
            .copied()
            .ok_or_else(|| Error::new(ErrorKind::Internal, "prepare_load returned no row"))?;
        // `prepare_load` pinned the row for reading: nobody writes it until
        // `complete_load`.
        let bytes = region.read_row(row as usize)?;
        // A tier that keeps a prefix of each row (slots of the canonical area) brings back
        // only that prefix.
        let stored = stored_bytes.map_or(bytes.len(), |n| (n as usize).min(bytes.len()));
        match first_mismatch(&bytes[..stored], seed, index as u64) {
            None => verified += 1,
            Some(at) => {
                mismatched += 1;
                if mismatched <= 5 {
                    log::error!("chunk {index} (key {key}) differs at byte {at} of its row");
                }
            }
        }
        manager.complete_load(std::slice::from_ref(key))?;
        bar.inc(1);
    }
    manager.on_request_finished(&req);
    bar.finish_and_clear();
    Ok((verified, mismatched, missing))
}
