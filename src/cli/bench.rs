//! `kvtier bench`: the whole stack end to end on a temporary (or given) G3 tier.
//!
//! 1. Fill: reserve primary rows through the manager (`prepare_store`) and write each chunk's
//!    deterministic bytes into its row (what the GPU -> primary copy does in vLLM).
//! 2. Store: `complete_store` per job-sized batch; the manager cascades every batch to the G3
//!    tier as one store job. A window of outstanding jobs keeps the tier's byte budget busy.
//! 3. Evict: `reset_cache` drains the tier and empties the primary (G3 keeps its data).
//! 4. Load: `lookup` finds each chunk in G3 and starts a promotion; `on_schedule_end` submits
//!    one load job per request (batch).
//! 5. Verify: pin every row (`prepare_load`) and compare it byte for byte with what was stored.
//!
//! The driver polls the manager every [`POLL_INTERVAL`] while waiting, like a scheduler's step
//! loop; job latencies are measured from submission to the poll that saw the job finish, so
//! their resolution is that interval.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::canonical::{LayoutDescriptor, NamespaceParams, default_layout, namespace_digest};
use crate::cli::bench_data::{chunk_key, fill_row, first_mismatch, process_cpu_seconds};
use crate::cli::bench_tier::{BenchTier, TierOptions};
use crate::cli::fio_compare::parse_engine;
use crate::cli::output::{Table, print_json, progress_bar};
use crate::cli::size::{format_gbps, format_size, parse_size};
use crate::cli::stats::percentile_sorted;
use crate::error::{Error, ErrorKind, Result};
use crate::io::IoEngineKind;
use crate::key::ChunkKey;
use crate::tiering::job::{LookupResult, RequestContext};
use crate::tiering::manager::{ScheduleEndContext, TieringManager};

/// How often the driver polls the manager while it waits for jobs.
pub const POLL_INTERVAL: Duration = Duration::from_micros(200);

/// Arguments of `kvtier bench`.
#[derive(Debug, Clone, clap::Args)]
#[command(after_help = "Examples:
  kvtier bench                                   # 2 GiB of Llama-3.1-8B chunks (2 MiB rows) on the temp dir
  kvtier bench --path /mnt/nvme0 --path /mnt/nvme1 --bytes 16GiB
  kvtier bench --layout layouts/qwen3-32b.toml --tp 2 --blocks-per-chunk 4
  kvtier bench --bytes 256MiB --keep --json      # keep the tier for `kvtier tier inspect`

Exits 1 if any stored byte does not come back intact.")]
pub struct BenchArgs {
    /// Directory for the tier (repeatable: one slab per path, rows striped across them). A new
    /// sub-directory is made in each. Default: the system temp dir.
    #[arg(long = "path", value_name = "DIR")]
    pub paths: Vec<PathBuf>,
    /// Tier capacity over all paths. Default: just enough for --bytes.
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub capacity: Option<u64>,
    /// Bytes of KV chunks to store and load back (rounded down to whole rows, at least one).
    #[arg(long, default_value = "2GiB", value_parser = parse_size, value_name = "SIZE")]
    pub bytes: u64,
    /// Model layout descriptor (TOML). Default: Llama-3.1-8B, bf16, 16-token blocks.
    #[arg(long, value_name = "FILE")]
    pub layout: Option<PathBuf>,
    /// Tensor-parallel size the rows are sized for.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub tp: u32,
    /// GPU blocks per chunk (row).
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub blocks_per_chunk: u32,
    /// The tier's cap on bytes of I/O in flight.
    #[arg(long, default_value = "64MiB", value_parser = parse_size, value_name = "SIZE")]
    pub max_bytes_in_flight: u64,
    /// I/O engine: auto, uring or psync.
    #[arg(long, default_value = "auto", value_parser = parse_engine, value_name = "ENGINE")]
    pub io_engine: IoEngineKind,
    /// Keep the tier afterwards (its path is printed) for `kvtier tier inspect/verify`.
    #[arg(long)]
    pub keep: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Timing of one direction.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PhaseReport {
    /// Bytes moved (whole rows).
    pub bytes: u64,
    /// Wall time from the first job submitted to the last one finished.
    pub seconds: f64,
    /// `bytes / seconds / 1e9`.
    pub gb_per_s: f64,
    /// Jobs (one per batch of chunks).
    pub jobs: usize,
    /// Chunks per job.
    pub chunks_per_job: usize,
    /// Median job latency (submission to completion seen), milliseconds.
    pub job_latency_p50_ms: f64,
    /// 99th percentile job latency, milliseconds.
    pub job_latency_p99_ms: f64,
    /// User + system CPU seconds of the whole process during the phase.
    pub cpu_seconds: f64,
    /// CPU seconds per GB (10^9 bytes) moved.
    pub cpu_seconds_per_gb: f64,
}

/// The layout the rows were sized for.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct LayoutReport {
    /// Model name.
    pub model: String,
    /// TP size.
    pub tp: u32,
    /// GPU blocks per chunk.
    pub blocks_per_chunk: u32,
    /// Tokens per chunk.
    pub tokens_per_chunk: u32,
    /// Bytes per primary row and G3 slot.
    pub row_stride: u64,
    /// The namespace digest written into the slab superblocks (hex).
    pub namespace: String,
}

/// The tier as it ran.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TierReport {
    /// Tier directories.
    pub paths: Vec<PathBuf>,
    /// Capacity over all paths.
    pub capacity_bytes: u64,
    /// Cap on bytes in flight.
    pub max_bytes_in_flight: u64,
    /// The I/O engine in use (`uring`, `psync`).
    pub io_engine: String,
    /// `direct` when every path uses O_DIRECT, else `buffered` (or `mixed`).
    pub direct_io: String,
    /// Whether the tier was kept.
    pub kept: bool,
}

/// `kvtier bench --json`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BenchReport {
    /// Layout.
    pub layout: LayoutReport,
    /// Tier.
    pub tier: TierReport,
    /// Chunks stored and loaded.
    pub chunks: u64,
    /// Primary -> G3.
    pub store: PhaseReport,
    /// G3 -> primary.
    pub load: PhaseReport,
    /// Chunks whose every byte matched.
    pub chunks_verified: u64,
    /// Chunks that loaded with different bytes.
    pub chunks_mismatched: u64,
    /// Chunks that did not come back (store or promotion failed).
    pub chunks_missing: u64,
    /// True iff every chunk was verified.
    pub ok: bool,
}

/// Everything derived from the arguments before anything runs.
#[derive(Debug)]
struct Plan {
    layout: LayoutDescriptor,
    params: NamespaceParams,
    row_stride: u64,
    chunks: u64,
    chunks_per_job: usize,
    window_jobs: usize,
    capacity: u64,
}

impl Plan {
    fn from_args(args: &BenchArgs) -> Result<Self> {
        let layout = match &args.layout {
            Some(p) => LayoutDescriptor::load(p)?,
            None => default_layout(),
        };
        if args.blocks_per_chunk == 0 {
            return Err(Error::config("--blocks-per-chunk", "must be at least 1"));
        }
        let params = NamespaceParams::new(&layout, args.tp, args.blocks_per_chunk, true)
            .map_err(|e| flag_error("--tp", e))?;
        let row_stride = params.row_stride;
        let chunks = (args.bytes / row_stride).max(1);
        let n_paths = args.paths.len().max(1) as u64;
        let capacity = match args.capacity {
            Some(c) => {
                let slots = c / n_paths / row_stride * n_paths;
                if slots < chunks {
                    return Err(Error::config(
                        "--capacity",
                        format!(
                            "{} holds {slots} rows of {} over {n_paths} path(s), but --bytes \
                             needs {chunks}; raise --capacity or lower --bytes",
                            format_size(c),
                            format_size(row_stride)
                        ),
                    ));
                }
                c
            }
            None => chunks.div_ceil(n_paths) * n_paths * row_stride,
        };
        if args.max_bytes_in_flight < row_stride {
            return Err(Error::config(
                "--max-bytes-in-flight",
                format!(
                    "{} is less than one row ({})",
                    format_size(args.max_bytes_in_flight),
                    format_size(row_stride)
                ),
            ));
        }
        check_memory(chunks * row_stride, mem_available())?;
        let rows_in_flight = (args.max_bytes_in_flight / row_stride) as usize;
        // A job is a batch of chunks (one request's chunks in one step); keep about twice the
        // tier's byte budget outstanding so the device never idles between polls.
        let chunks_per_job = (rows_in_flight / 4).clamp(1, 16);
        let window_jobs = (2 * rows_in_flight).div_ceil(chunks_per_job).max(2);
        Ok(Plan {
            layout,
            params,
            row_stride,
            chunks,
            chunks_per_job,
            window_jobs,
            capacity,
        })
    }

    fn batches(&self) -> Vec<std::ops::Range<u64>> {
        let per = self.chunks_per_job as u64;
        (0..self.chunks.div_ceil(per))
            .map(|b| b * per..((b + 1) * per).min(self.chunks))
            .collect()
    }
}

/// The primary region holds every chunk of the run (like a primary sized to the working set):
/// refuse a `--bytes` that would take more than 3/4 of the available memory.
fn check_memory(region_bytes: u64, available: Option<u64>) -> Result<()> {
    match available {
        Some(avail) if region_bytes > avail / 4 * 3 => Err(Error::config(
            "--bytes",
            format!(
                "the bench keeps all {} of chunks in the primary region, but only {} of memory \
                 is available; lower --bytes",
                format_size(region_bytes),
                format_size(avail)
            ),
        )),
        _ => Ok(()),
    }
}

/// `MemAvailable` from `/proc/meminfo`, in bytes.
fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// An error in a flag's value is the user's: it keeps its message and becomes a config error
/// naming the flag.
fn flag_error(flag: &str, e: Error) -> Error {
    if e.kind() == ErrorKind::Config {
        Error::config(flag, e.message().to_string())
    } else {
        e
    }
}

/// Runs `kvtier bench`.
pub fn run(args: BenchArgs) -> Result<ExitCode> {
    let plan = Plan::from_args(&args)?;
    let namespace = namespace_digest(&plan.layout, &plan.params);
    let tier = BenchTier::open(&TierOptions {
        parent_dirs: args.paths.clone(),
        capacity: plan.capacity,
        row_stride: plan.row_stride,
        primary_rows: plan.chunks,
        max_bytes_in_flight: args.max_bytes_in_flight,
        io_engine: args.io_engine,
        namespace,
        keep: args.keep,
    })?;
    let seed = run_seed();
    let keys: Vec<ChunkKey> = (0..plan.chunks).map(|i| chunk_key(seed, i)).collect();
    let batches = plan.batches();
    let progress = !args.json;
    let mut tier = tier;

    fill(&mut tier.manager, &keys, &batches, seed, progress)?;
    let store = store_phase(&mut tier.manager, &plan, &keys, &batches, progress)?;
    tier.manager.reset_cache()?;
    tier.manager.on_reset_flushed();
    let load = load_phase(&mut tier.manager, &plan, &keys, &batches, progress)?;
    if let Some(index) = corrupt_chunk_for_test()? {
        corrupt_loaded_chunk(&mut tier.manager, &keys, index)?;
    }
    let (verified, mismatched, missing) = verify(&mut tier.manager, &keys, seed, progress)?;

    let facts = tier.facts();
    let kept = tier.close()?;
    let report = BenchReport {
        layout: LayoutReport {
            model: plan.layout.model_name.clone(),
            tp: args.tp,
            blocks_per_chunk: args.blocks_per_chunk,
            tokens_per_chunk: plan.layout.tokens_per_block * args.blocks_per_chunk,
            row_stride: plan.row_stride,
            namespace: hex::encode(namespace),
        },
        tier: TierReport {
            paths: facts.dirs,
            capacity_bytes: plan.capacity,
            max_bytes_in_flight: args.max_bytes_in_flight,
            io_engine: facts.io_engine,
            direct_io: facts.direct_io,
            kept,
        },
        chunks: plan.chunks,
        store,
        load,
        chunks_verified: verified,
        chunks_mismatched: mismatched,
        chunks_missing: missing,
        ok: verified == plan.chunks,
    };
    if args.json {
        print_json(&report)?;
    } else {
        print!("{}", render(&report));
    }
    if report.ok {
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!(
            "kvtier: error: {} of {} chunks did not load back intact ({} mismatched, {} missing)",
            plan.chunks - verified,
            plan.chunks,
            mismatched,
            missing
        );
        Ok(ExitCode::from(1))
    }
}

/// Test hook: `KVTIER_BENCH_CORRUPT_CHUNK=<index>` flips one byte of that chunk's loaded row
/// before verification, to prove that a wrong byte fails the run (exit 1). Logged when used.
pub const CORRUPT_CHUNK_ENV: &str = "KVTIER_BENCH_CORRUPT_CHUNK";

fn corrupt_chunk_for_test() -> Result<Option<u64>> {
    match std::env::var(CORRUPT_CHUNK_ENV) {
        Err(_) => Ok(None),
        Ok(v) => {
            v.trim().parse().map(Some).map_err(|_| {
                Error::config(CORRUPT_CHUNK_ENV, format!("{v:?} is not a chunk index"))
            })
        }
    }
}

fn corrupt_loaded_chunk(manager: &mut TieringManager, keys: &[ChunkKey], index: u64) -> Result<()> {
    let key = keys.get(index as usize).ok_or_else(|| {
        Error::config(CORRUPT_CHUNK_ENV, format!("chunk {index} is out of range"))
    })?;
    log::warn!("{CORRUPT_CHUNK_ENV}: flipping one byte of chunk {index} before verification");
    let req = RequestContext::new("bench-corrupt");
    manager.on_new_request(&req);
    let rows = manager.prepare_load(std::slice::from_ref(key), &req)?;
    let region = manager.region().clone();
    if let Some(&row) = rows.first() {
        // SAFETY: the row is pinned and this single-threaded driver is its only user until
        // `complete_load`; the G3 tier finished writing it (the promotion completed).
        let bytes = unsafe { region.row_mut(row as usize)? };
        bytes[bytes.len() / 2] ^= 0x40;
    }
    manager.complete_load(std::slice::from_ref(key))?;
    manager.on_request_finished(&req);
    Ok(())
}

/// A seed that differs between runs (so a kept tier never makes a later run look good).
fn run_seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ (u64::from(std::process::id()) << 32)
}

fn request(kind: &str, batch: usize) -> RequestContext {
    RequestContext::new(format!("bench-{kind}-{batch}"))
}

/// Reserves every chunk's row and writes its bytes (untimed).
fn fill(
    manager: &mut TieringManager,
    keys: &[ChunkKey],
    batches: &[std::ops::Range<u64>],
    seed: u64,
    progress: bool,
) -> Result<()> {
    let bar = progress_bar(keys.len() as u64, "fill", progress);
    let region = manager.region().clone();
    for (b, range) in batches.iter().enumerate() {
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
            // SAFETY: `prepare_store` reserved this row for our write (ref_cnt -1): nothing
            // else reads or writes it until `complete_store`.
            let bytes = unsafe { region.row_mut(row as usize)? };
            fill_row(bytes, seed, index);
        }
        bar.inc(batch.len() as u64);
    }
    bar.finish_and_clear();
    Ok(())
}

/// An outstanding job: its batch, keys, and when it was submitted.
struct Outstanding {
    batch: usize,
    started: Instant,
}

fn store_phase(
    manager: &mut TieringManager,
    plan: &Plan,
    keys: &[ChunkKey],
    batches: &[std::ops::Range<u64>],
    progress: bool,
) -> Result<PhaseReport> {
    let bar = progress_bar(keys.len() as u64, "store", progress);
    let slice = |b: usize| &keys[batches[b].start as usize..batches[b].end as usize];
    let cpu0 = process_cpu_seconds();
    let start = Instant::now();
    let mut latencies = Vec::with_capacity(batches.len());
    let mut outstanding: VecDeque<Outstanding> = VecDeque::new();
    let mut next = 0;
    while next < batches.len() || !outstanding.is_empty() {
        while next < batches.len() && outstanding.len() < plan.window_jobs {
            let req = request("store", next);
            manager.complete_store(slice(next), &req, true);
            manager.on_request_finished(&req);
            outstanding.push_back(Outstanding {
                batch: next,
                started: Instant::now(),
            });
            next += 1;
        }
        manager.poll()?;
        // A cascade pins its rows until the tier reports: a batch is done when no row of it
        // is pinned any more.
        let before = outstanding.len();
        outstanding.retain(|o| {
            let done = slice(o.batch)
                .iter()
                .all(|k| manager.primary().ref_count(k).is_none_or(|r| r == 0));
            if done {
                latencies.push(o.started.elapsed());
                bar.inc(slice(o.batch).len() as u64);
            }
            !done
        });
        if outstanding.len() == before && !outstanding.is_empty() {
            std::thread::sleep(POLL_INTERVAL);
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

fn load_phase(
    manager: &mut TieringManager,
    plan: &Plan,
    keys: &[ChunkKey],
    batches: &[std::ops::Range<u64>],
    progress: bool,
) -> Result<PhaseReport> {
    let bar = progress_bar(keys.len() as u64, "load", progress);
    let slice = |b: usize| &keys[batches[b].start as usize..batches[b].end as usize];
    let cpu0 = process_cpu_seconds();
    let start = Instant::now();
    let mut latencies = Vec::with_capacity(batches.len());
    let mut outstanding: VecDeque<Outstanding> = VecDeque::new();
    let mut next = 0;
    while next < batches.len() || !outstanding.is_empty() {
        let mut submitted = false;
        while next < batches.len() && outstanding.len() < plan.window_jobs {
            let req = request("load", next);
            manager.on_new_request(&req);
            for key in slice(next) {
                // The first secondary HIT starts a promotion (HitPending); RETRY only while
                // the index recovers, which a fresh tier never does.
                let answer = manager.lookup(key, &req);
                if answer == LookupResult::Retry {
                    return Err(Error::new(
                        ErrorKind::Internal,
                        "the G3 tier answered RETRY on a freshly formatted tier",
                    ));
                }
            }
            outstanding.push_back(Outstanding {
                batch: next,
                started: Instant::now(),
            });
            next += 1;
            submitted = true;
        }
        if submitted {
            // One load job per (tier, request) goes out at the end of the step.
            manager.on_schedule_end(&ScheduleEndContext::default())?;
        } else {
            manager.poll()?;
        }
        let before = outstanding.len();
        outstanding.retain(|o| {
            let done = slice(o.batch)
                .iter()
                .all(|k| manager.primary().lookup(k) != LookupResult::HitPending);
            if done {
                latencies.push(o.started.elapsed());
                bar.inc(slice(o.batch).len() as u64);
            }
            !done
        });
        if outstanding.len() == before && !outstanding.is_empty() && !submitted {
            std::thread::sleep(POLL_INTERVAL);
        }
    }
    for b in 0..batches.len() {
        manager.on_request_finished(&request("load", b));
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

/// Pins every loaded row and compares it with the bytes stored under its key.
fn verify(
    manager: &mut TieringManager,
    keys: &[ChunkKey],
    seed: u64,
    progress: bool,
) -> Result<(u64, u64, u64)> {
    let bar = progress_bar(keys.len() as u64, "verify", progress);
    let region = manager.region().clone();
    let req = RequestContext::new("bench-verify");
    manager.on_new_request(&req);
    let (mut verified, mut mismatched, mut missing) = (0u64, 0u64, 0u64);
    for (index, key) in keys.iter().enumerate() {
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
        // SAFETY: `prepare_load` pinned the row for reading: nobody writes it until
        // `complete_load`.
        let bytes = unsafe { region.row(row as usize)? };
        match first_mismatch(bytes, seed, index as u64) {
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

/// The human report.
pub fn render(r: &BenchReport) -> String {
    let mut out = format!(
        "kvtier bench: {} chunks of {} ({}, TP {}, {} tokens per chunk) = {}\n",
        r.chunks,
        format_size(r.layout.row_stride),
        r.layout.model,
        r.layout.tp,
        r.layout.tokens_per_chunk,
        format_size(r.chunks * r.layout.row_stride)
    );
    let paths: Vec<String> = r
        .tier
        .paths
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    out.push_str(&format!(
        "tier: {} ({} capacity), engine {}, direct I/O: {}, {} in flight\n\n",
        paths.join(", "),
        format_size(r.tier.capacity_bytes),
        r.tier.io_engine,
        r.tier.direct_io,
        format_size(r.tier.max_bytes_in_flight)
    ));
    let mut t = Table::new([
        "phase",
        "throughput",
        "job p50",
        "job p99",
        "jobs",
        "CPU s/GB",
    ]);
    for (name, p) in [("store", &r.store), ("load", &r.load)] {
        t.row([
            name.to_string(),
            format_gbps(p.bytes as f64 / p.seconds.max(1e-9)),
            format!("{:.2} ms", p.job_latency_p50_ms),
            format!("{:.2} ms", p.job_latency_p99_ms),
            format!("{} x {}", p.jobs, p.chunks_per_job),
            format!("{:.3}", p.cpu_seconds_per_gb),
        ]);
    }
    out.push_str(&t.render());
    out.push_str(&format!(
        "\nchunks verified: {} / {}{}\n",
        r.chunks_verified,
        r.chunks,
        if r.ok { " (every byte matches)" } else { "" }
    ));
    if r.tier.kept {
        out.push_str(&format!(
            "tier kept at {} (kvtier tier inspect {})\n",
            paths.join(", "),
            paths.join(" ")
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Wrapper {
        #[command(flatten)]
        args: BenchArgs,
    }

    fn plan(argv: &[&str]) -> Result<Plan> {
        let mut full = vec!["x"];
        full.extend_from_slice(argv);
        Plan::from_args(&Wrapper::try_parse_from(full).unwrap().args)
    }

    #[test]
    fn default_is_llama_8b_with_2_mib_rows_and_2_gib() {
        let p = plan(&[]).unwrap();
        assert_eq!(p.row_stride, 2 << 20);
        assert_eq!(p.chunks, 1024);
        assert_eq!(p.capacity, 2 << 30);
        assert_eq!(p.chunks_per_job, 8);
        assert_eq!(p.window_jobs, 8);
        let b = p.batches();
        assert_eq!(b.len(), 128);
        assert_eq!(b[127], 1016..1024);
    }

    #[test]
    fn batches_cover_every_chunk_once() {
        let p = plan(&["--bytes", "21MiB", "--max-bytes-in-flight", "8MiB"]).unwrap();
        assert_eq!(p.chunks, 10);
        assert_eq!(p.chunks_per_job, 1);
        let covered: Vec<u64> = p.batches().into_iter().flatten().collect();
        assert_eq!(covered, (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn user_mistakes_are_config_errors() {
        let e = plan(&["--capacity", "10MiB", "--bytes", "64MiB"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.to_string().contains("--capacity"), "{e}");
        assert_eq!(
            plan(&["--max-bytes-in-flight", "1MiB"]).unwrap_err().kind(),
            ErrorKind::Config
        );
        assert_eq!(
            plan(&["--blocks-per-chunk", "0"]).unwrap_err().kind(),
            ErrorKind::Config
        );
        let e = plan(&["--tp", "3"]).unwrap_err();
        assert!(crate::cli::is_user_error(&e), "{e:?}");
        assert!(e.to_string().contains("TP size 3"), "{e}");
        let e = check_memory(8 << 30, Some(8 << 30)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.to_string().contains("--bytes"), "{e}");
        assert!(check_memory(2 << 30, Some(8 << 30)).is_ok());
        assert!(check_memory(2 << 30, None).is_ok());
        let e = plan(&["--layout", "/nonexistent/layout.toml"]).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/layout.toml"), "{e}");
    }
}
