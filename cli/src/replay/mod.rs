//! `kvtier replay`: a Mooncake-format KV-cache trace replayed through the tiering manager,
//! with a CPU primary and a real G3 tier (O_DIRECT, CRC) on fresh directories, every loaded
//! byte verified (see `docs/workloads.md`).
//!
//! * [`trace`]: the trace format.
//! * [`driver`]: the replay loop (prefix lookups, promotions, verification, stores).
//! * [`report`]: what it prints.

pub mod driver;
pub mod report;
pub mod trace;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::args::{ModelArgs, parse_engine};
use crate::output::{print_json, progress_bar};
use crate::size::parse_size;
use kvtier::config::{EvictionPolicyKind, KvtierConfig, TierConfig};
use kvtier::contract::admission::AdmissionKind;
use kvtier::contract::secondary::TierMetric;
use kvtier::embed::Builder;
use kvtier::error::{Error, ErrorKind, Result};
use kvtier::geometry::{ChunkGeometry, ROW_ALIGNMENT};
use kvtier::io::IoEngineKind;
use kvtier::region::PrimaryRegion;
use kvtier::tiering::TieringManager;

use driver::{DriveOptions, drive};
use report::{Report, ReportBase, TierBytes, io_ticks_ms};
use trace::{TOKENS_PER_BLOCK, Trace};

/// `kvtier replay`.
#[derive(Debug, Clone, clap::Args)]
#[command(after_help = "Examples:
  kvtier replay --trace mooncake.jsonl --tier-capacity 25%
  kvtier replay --trace mooncake.jsonl --tier-capacity 25% --admission tinylfu --json
  kvtier replay --trace mooncake.jsonl --tier-capacity 25% --tier-eviction arc
  kvtier replay --trace mooncake.jsonl --layout llama-3.1-8b --primary 4GiB --tier-capacity 40GiB")]
pub struct ReplayArgs {
    /// The trace: one JSON request per line (`timestamp` ms, `input_length`, `hash_ids` of
    /// 512-token blocks), as Mooncake's FAST'25 traces.
    #[arg(long, value_name = "FILE")]
    pub trace: PathBuf,
    /// Bytes of each 512-token block (one row, one G3 slot; a multiple of 4 KiB). Scale it
    /// down to replay a long trace quickly. Ignored with `--layout`.
    #[arg(long, value_parser = parse_size, default_value = "16KiB", value_name = "SIZE")]
    pub bytes_per_block: u64,
    /// Size blocks as this model's 512-token KV instead (`--layout NAME_OR_FILE --tp N`).
    #[command(flatten)]
    pub model: OptionalModel,
    /// Primary (CPU) capacity: bytes (`4GiB`) or a share of the trace's unique blocks (`5%`).
    #[arg(long, default_value = "5%", value_name = "SIZE|PCT")]
    pub primary: String,
    /// G3 tier capacity: bytes or a share of the trace's unique blocks.
    #[arg(long, default_value = "25%", value_name = "SIZE|PCT")]
    pub tier_capacity: String,
    /// The tier's admission policy (`all` or `tinylfu`; the config key `admission`).
    #[arg(long, default_value = "all", value_name = "POLICY")]
    pub admission: String,
    /// The tier's eviction policy (`lru` or `arc`; the tier's config key `eviction_policy`).
    #[arg(long, default_value = "lru", value_name = "POLICY")]
    pub tier_eviction: String,
    /// Directory for the tier's slab (a fresh directory inside it, removed afterwards).
    /// Default: the system temp dir.
    #[arg(long, value_name = "DIR")]
    pub path: Option<PathBuf>,
    /// `always` (each store durable before it is reported, the tier's default) or `never`.
    #[arg(long, default_value = "always", value_name = "MODE")]
    pub fsync: String,
    /// I/O engine: auto, uring or psync.
    #[arg(long, value_parser = parse_engine, default_value = "auto", value_name = "ENGINE")]
    pub io_engine: IoEngineKind,
    /// Time: 0 replays as fast as possible; X > 0 starts each request at its timestamp / X
    /// (1 = real time).
    #[arg(long, default_value_t = 0.0, value_name = "X")]
    pub time_scale: f64,
    /// Replay only the first N requests.
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
    /// Seed of the block keys and payloads.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `--layout` / `--tp`, optional here (bytes per block otherwise).
#[derive(Debug, Clone, clap::Args)]
pub struct OptionalModel {
    /// Model layout (a shipped name or a TOML file) that sizes each block.
    #[arg(long, value_name = "FILE")]
    pub layout: Option<PathBuf>,
    /// Tensor-parallel size of the layout.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub tp: u32,
}

/// Runs `kvtier replay`.
pub fn run(args: ReplayArgs) -> Result<ExitCode> {
    let trace = Trace::read(&args.trace, args.limit)?;
    let unique = trace.unique_full_blocks();
    let row = row_bytes(&args)?;
    let primary_blocks = capacity_blocks(&args.primary, "--primary", unique, row)?;
    let tier_blocks = capacity_blocks(&args.tier_capacity, "--tier-capacity", unique, row)?;
    let admission = AdmissionKind::parse(&args.admission).ok_or_else(|| {
        Error::config(
            "--admission",
            format!(
                "unknown policy {:?}; expected {}",
                args.admission,
                AdmissionKind::CHOICES.join(" | ")
            ),
        )
    })?;
    if !matches!(args.tier_eviction.as_str(), "lru" | "arc") {
        return Err(Error::config(
            "--tier-eviction",
            format!("expected lru | arc, found {:?}", args.tier_eviction),
        ));
    }
    if !matches!(args.fsync.as_str(), "always" | "never") {
        return Err(Error::config(
            "--fsync",
            format!("expected always | never, found {:?}", args.fsync),
        ));
    }
    if !(args.time_scale.is_finite() && args.time_scale >= 0.0) {
        return Err(Error::config(
            "--time-scale",
            format!(
                "expected 0 (as fast as possible) or a positive factor, found {}",
                args.time_scale
            ),
        ));
    }
    let parent = match &args.path {
        Some(p) => p.clone(),
        None => std::env::temp_dir(),
    };
    crate::args::check_dir(&parent)?;
    let dir = tempfile::Builder::new()
        .prefix("kvtier-replay-")
        .tempdir_in(&parent)
        .map_err(|e| Error::io("create the replay directory in", &parent, e))?;
    let mut manager = build_stack(
        &args,
        dir.path(),
        row,
        primary_blocks,
        tier_blocks,
        admission,
    )?;
    let bar = progress_bar(trace.requests.len() as u64, "replay", !args.json);
    let ticks0 = io_ticks_ms(dir.path());
    let start = Instant::now();
    let opts = DriveOptions {
        seed: args.seed,
        slot_bytes: row,
        time_scale: (args.time_scale > 0.0).then_some(args.time_scale),
    };
    let outcome = drive(&mut manager, &trace, opts, |n| bar.set_position(n));
    bar.finish_and_clear();
    let wall_s = start.elapsed().as_secs_f64();
    let ticks1 = io_ticks_ms(dir.path());
    let tier = tier_bytes(&manager);
    manager.shutdown()?;
    drop(manager);
    let outcome = outcome?;
    dir.close().map_err(|e| {
        Error::new(
            ErrorKind::Io,
            format!("cannot remove the replay directory: {e}"),
        )
    })?;
    let device_busy = match (ticks0, ticks1) {
        (Ok(a), Ok(b)) => Ok(b.saturating_sub(a) as f64 / 1e3),
        (Err(e), _) | (_, Err(e)) => Err(e),
    };
    let base = ReportBase {
        trace: args.trace.display().to_string(),
        bytes_per_block: row,
        unique_blocks: unique,
        primary_blocks,
        tier_blocks,
        admission: admission.as_str().to_string(),
        tier_eviction: args.tier_eviction.clone(),
        wall_s,
        device_busy,
    };
    let report = Report::new(base, &outcome, tier);
    if args.json {
        print_json(&report)?;
    } else {
        report.print()?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Bytes of one block's row: the layout's 512-token chunk, or `--bytes-per-block`.
fn row_bytes(args: &ReplayArgs) -> Result<u64> {
    if args.model.layout.is_some() {
        let model = ModelArgs {
            layout: args.model.layout.clone(),
            tp: args.model.tp,
        };
        let desc = model.load()?;
        let per = u64::from(desc.tokens_per_block);
        if per == 0 || !TOKENS_PER_BLOCK.is_multiple_of(per) {
            return Err(Error::config(
                "--layout",
                format!("{per}-token blocks do not tile a {TOKENS_PER_BLOCK}-token trace block"),
            ));
        }
        let blocks = u32::try_from(TOKENS_PER_BLOCK / per).unwrap_or(u32::MAX);
        let p = kvtier::canonical::NamespaceParams::new(&desc, args.model.tp, blocks, false)?;
        return Ok(p.row_stride);
    }
    let b = args.bytes_per_block;
    if !ChunkGeometry::is_row_aligned(b) {
        return Err(Error::config(
            "--bytes-per-block",
            format!("must be a positive multiple of {ROW_ALIGNMENT} bytes, found {b}"),
        ));
    }
    Ok(b)
}

/// A capacity flag in blocks: `N%` of `unique` blocks (rounded up, at least one) or bytes.
pub fn capacity_blocks(text: &str, flag: &str, unique: u64, row: u64) -> Result<u64> {
    let blocks = if let Some(p) = text.strip_suffix('%') {
        let share: f64 = p
            .trim()
            .parse()
            .ok()
            .filter(|v: &f64| v.is_finite() && *v > 0.0)
            .ok_or_else(|| {
                Error::config(
                    flag,
                    format!("expected a positive share like 25%, found {text:?}"),
                )
            })?;
        (share / 100.0 * unique as f64).ceil() as u64
    } else {
        parse_size(text).map_err(|e| Error::config(flag, e))? / row
    };
    if blocks == 0 {
        return Err(Error::config(
            flag,
            format!("{text} holds no block of {row} bytes"),
        ));
    }
    Ok(blocks)
}

fn build_stack(
    args: &ReplayArgs,
    dir: &std::path::Path,
    row: u64,
    primary_blocks: u64,
    tier_blocks: u64,
    admission: AdmissionKind,
) -> Result<TieringManager> {
    let rows = usize::try_from(primary_blocks)
        .map_err(|_| Error::config("--primary", "too many blocks for this platform"))?;
    let region = Arc::new(PrimaryRegion::create(rows, row)?);
    let engine = match args.io_engine {
        IoEngineKind::Auto => "auto",
        IoEngineKind::Uring => "uring",
        IoEngineKind::Psync => "psync",
    };
    let mut tier = TierConfig::new(0, "nvme");
    let params = serde_json::json!({
        "paths": [dir.display().to_string()],
        "capacity_bytes": tier_blocks * row,
        "io_engine": engine,
        "fsync": args.fsync,
        "admission": admission.as_str(),
        "eviction_policy": args.tier_eviction,
    });
    tier.params = params.as_object().cloned().unwrap_or_default();
    let mut cfg = KvtierConfig::new(region.len() as u64);
    cfg.eviction_policy = EvictionPolicyKind::Lru;
    cfg.secondary_tiers = vec![tier];
    let manager = Builder::new(cfg).region(region).build()?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !manager.tier(0).is_some_and(|t| t.ready()) {
        if Instant::now() >= deadline {
            return Err(Error::new(
                ErrorKind::Internal,
                "the fresh tier did not finish opening its index within 60 s",
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(manager)
}

fn tier_bytes(manager: &TieringManager) -> TierBytes {
    let metrics: Vec<TierMetric> = manager.tier(0).map(|t| t.metrics()).unwrap_or_default();
    let get = |name: &str, outcome: Option<&str>| {
        metrics
            .iter()
            .find(|m| {
                m.name == name
                    && outcome
                        .is_none_or(|o| m.labels.iter().any(|(k, v)| *k == "outcome" && v == o))
            })
            .map_or(0, |m| m.value as u64)
    };
    TierBytes {
        written: get("g3_bytes_written", None),
        read: get("g3_bytes_read", None),
        admitted: get("g3_admission_blocks", Some("admitted")),
        rejected: get("g3_admission_blocks", Some("rejected")),
        unchecked: get("g3_admission_blocks", Some("unchecked")),
    }
}
