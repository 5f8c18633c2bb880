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
//! The phases live in `bench_phases`, the report in `bench_report`.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::canonical::{LayoutDescriptor, NamespaceParams, namespace_digest};
use crate::cli::args::{load_layout, parse_engine};
use crate::cli::bench_data::chunk_key;
use crate::cli::bench_phases::{
    corrupt_chunk_for_test, corrupt_loaded_chunk, fill, load_phase, store_phase, verify,
};
use crate::cli::bench_report::{BenchReport, LayoutReport, TierReport, render};
use crate::cli::bench_tier::{BenchTier, TierOptions};
use crate::cli::output::print_json;
use crate::cli::size::{format_size, parse_size};
use crate::error::{Error, ErrorKind, Result};
use crate::geometry::ChunkGeometry;
use crate::io::IoEngineKind;
use crate::key::ChunkKey;

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
    /// How long the tier's worker lingers (naps instead of blocking) after its last work, as
    /// the nvme key `idle_linger_ms`; 0 turns lingering off.
    #[arg(long, default_value_t = 50, value_name = "MS")]
    pub idle_linger_ms: u64,
    /// Keep the tier afterwards (its path is printed) for `kvtier tier inspect/verify`.
    #[arg(long)]
    pub keep: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Everything derived from the arguments before anything runs.
#[derive(Debug)]
pub(crate) struct Plan {
    pub(crate) layout: LayoutDescriptor,
    pub(crate) params: NamespaceParams,
    pub(crate) row_stride: u64,
    pub(crate) chunks: u64,
    pub(crate) chunks_per_job: usize,
    pub(crate) window_jobs: usize,
    pub(crate) capacity: u64,
}

impl Plan {
    fn from_args(args: &BenchArgs) -> Result<Self> {
        let layout = load_layout(args.layout.as_deref())?;
        if args.blocks_per_chunk == 0 {
            return Err(Error::config("--blocks-per-chunk", "must be at least 1"));
        }
        let params = NamespaceParams::new(&layout, args.tp, args.blocks_per_chunk, true)
            .map_err(|e| flag_error("--tp", e))?;
        let row_stride = params.row_stride;
        if args.bytes == 0 {
            return Err(Error::config(
                "--bytes",
                format!(
                    "0 stores nothing; give at least one row ({})",
                    format_size(row_stride)
                ),
            ));
        }
        let chunks = ChunkGeometry::rows_in(args.bytes, row_stride).max(1);
        let n_paths = args.paths.len().max(1) as u64;
        let capacity = match args.capacity {
            Some(c) => {
                let slots = ChunkGeometry::total_slots(c, n_paths as usize, row_stride);
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
        // The bench sizes its jobs from the rows in flight, so it wants at least one whole
        // row in the budget (the tier itself would move one row at a time).
        let rows_in_flight = ChunkGeometry::rows_in(args.max_bytes_in_flight, row_stride);
        if rows_in_flight == 0 {
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
        let rows_in_flight = rows_in_flight as usize;
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

    pub(crate) fn batches(&self) -> Vec<std::ops::Range<u64>> {
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
pub(crate) fn mem_available() -> Option<u64> {
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

/// Runs `kvtier bench`. Ctrl-C or SIGTERM stops it between batches, removes the tier's
/// directories (even with `--keep`) and exits 130.
pub fn run(args: BenchArgs) -> Result<ExitCode> {
    crate::cli::interrupt::run_interruptible(|| run_caught(args))
}

fn run_caught(args: BenchArgs) -> Result<ExitCode> {
    let plan = Plan::from_args(&args)?;
    let namespace = namespace_digest(&plan.layout, &plan.params);
    let mut tier = BenchTier::open(&TierOptions {
        parent_dirs: args.paths.clone(),
        capacity: plan.capacity,
        row_stride: plan.row_stride,
        primary_rows: plan.chunks,
        max_bytes_in_flight: args.max_bytes_in_flight,
        io_engine: args.io_engine,
        idle_linger: std::time::Duration::from_millis(args.idle_linger_ms),
        namespace,
        keep: args.keep,
    })?;
    let seed = run_seed();
    let keys: Vec<ChunkKey> = (0..plan.chunks).map(|i| chunk_key(seed, i)).collect();
    let batches = plan.batches();
    let progress = !args.json;

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

/// A seed that differs between runs (so a kept tier never makes a later run look good).
fn run_seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ (u64::from(std::process::id()) << 32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::args::parse_for_test;

    fn plan(argv: &[&str]) -> Result<Plan> {
        Plan::from_args(&parse_for_test(argv))
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
        let e = plan(&["--bytes", "0"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.to_string().contains("--bytes"), "{e}");
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
