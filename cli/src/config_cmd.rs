//! `kvtier config check FILE [--bytes-per-block N] [--copies N] [--gpu-block-size N]`: reads a
//! JSON or TOML configuration, validates it and prints the resolved configuration as JSON
//! (back-pressure merged per tier with presets and defaults filled in; chunk geometry when the
//! layout inputs are given). Type-specific tier keys are validated by the tier's own parser
//! where kvtier has that tier (`nvme`, `fs`). Exit 0 when valid, 2 with a one-line error on stderr
//! when not.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use serde::Serialize;

use crate::args::ModelArgs;
use crate::output::print_json;
use crate::serve::{check_tiers, in_file};
use crate::size::{format_size, parse_size};
use kvtier::config::{self, Format, KvtierConfig};
use kvtier::embed::Builder;
use kvtier::error::Result;
use kvtier::geometry::ChunkGeometry;
use kvtier::tiering::TierFactory;

/// `kvtier config ...`.
#[derive(Debug, Args)]
pub struct ConfigArgs {
    /// The configuration command.
    #[command(subcommand)]
    pub command: ConfigCommand,
}

/// Configuration commands.
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Validate a configuration file and print the resolved configuration as JSON.
    Check(CheckArgs),
}

/// Arguments of `kvtier config check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// The configuration file (`.json` or `.toml`): vLLM's `kv_connector_extra_config`, or a
    /// whole `kv_transfer_config` containing it.
    pub file: PathBuf,
    /// The model the rows are sized for, as `kvtier serve` takes it (default Llama-3.1-8B,
    /// TP 1).
    #[command(flatten)]
    pub model: ModelArgs,
    /// One worker's KV bytes per GPU block (bytes or a size such as `2MiB`), instead of
    /// `--layout` and `--tp`.
    #[arg(long, value_parser = parse_size, conflicts_with_all = ["layout", "tp"])]
    pub bytes_per_block: Option<u64>,
    /// Copies of each block in a row: 1 for a replicated layout or TP1, else the local world
    /// size.
    #[arg(long, default_value_t = 1, requires = "bytes_per_block")]
    pub copies: u32,
    /// Tokens per GPU block; needed for the geometry when the config sets `block_size`.
    #[arg(long, requires = "bytes_per_block")]
    pub gpu_block_size: Option<u32>,
}

#[derive(Serialize)]
struct CheckReport<'a> {
    file: String,
    format: &'static str,
    valid: bool,
    cpu_bytes_to_use_human: String,
    config: &'a KvtierConfig,
    /// What sized the rows: the layout and TP, or `--bytes-per-block`.
    rows_from: String,
    geometry: ChunkGeometry,
    tier_params: Vec<TierParamsCheck>,
    notes: &'a [String],
}

/// A tier whose type, keys and values were checked, and by what.
#[derive(Serialize)]
struct TierParamsCheck {
    index: usize,
    #[serde(rename = "type")]
    tier_type: String,
    validated: bool,
    by: String,
}

/// Runs `kvtier config ...`.
pub fn run(args: ConfigArgs) -> Result<ExitCode> {
    match args.command {
        ConfigCommand::Check(a) => check(a),
    }
}

fn check(args: CheckArgs) -> Result<ExitCode> {
    let format = Format::from_path(&args.file)?;
    let resolved = config::load_resolved(&args.file)?;
    let cfg = &resolved.config;
    let (geometry, rows_from) = match args.bytes_per_block {
        None => {
            let layout = args.model.load()?;
            let plan = Builder::new(cfg.clone())
                .layout(layout.clone(), args.model.tp)
                .plan()
                .map_err(|e| in_file(&args.file, e))?;
            let from = format!("{} at --tp {}", layout.model_name, args.model.tp);
            (plan.geometry, from)
        }
        Some(bytes_per_block) => {
            let geometry = cfg.geometry(bytes_per_block, args.copies, args.gpu_block_size)?;
            check_tiers(cfg, &TierFactory::with_builtins(), geometry.row_stride)
                .map_err(|e| config::error_in_file(&args.file, e))?;
            let from = format!(
                "--bytes-per-block {} x --copies {}",
                format_size(bytes_per_block),
                args.copies
            );
            (geometry, from)
        }
    };
    let tier_params = cfg
        .secondary_tiers
        .iter()
        .map(|t| TierParamsCheck {
            index: t.index,
            tier_type: t.tier_type.clone(),
            validated: true,
            by: format!(
                "kvtier's {} tier rules, for rows of {}",
                t.tier_type,
                format_size(geometry.row_stride)
            ),
        })
        .collect();
    let report = CheckReport {
        file: args.file.display().to_string(),
        format: format.as_str(),
        valid: true,
        cpu_bytes_to_use_human: format_size(cfg.cpu_bytes_to_use),
        config: cfg,
        rows_from,
        geometry,
        tier_params,
        notes: &resolved.notes,
    };
    print_json(&report)?;
    Ok(ExitCode::SUCCESS)
}
