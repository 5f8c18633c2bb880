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

use crate::cli::output::print_json;
use crate::cli::size::{format_size, parse_size};
use crate::config::{self, Format, KvtierConfig, TierConfig};
use crate::error::Result;
use crate::g3::G3TierConfig;
use crate::geometry::ChunkGeometry;

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
    /// One worker's KV bytes per GPU block (bytes or a size such as `2MiB`); with it the chunk
    /// geometry is derived and printed.
    #[arg(long, value_parser = parse_size)]
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
    geometry: Option<ChunkGeometry>,
    tier_params: Vec<TierParamsCheck>,
    notes: &'a [String],
}

/// Whether a tier's type-specific keys (`params`) were validated, and by what.
#[derive(Serialize)]
struct TierParamsCheck {
    index: usize,
    #[serde(rename = "type")]
    tier_type: String,
    validated: bool,
    by: &'static str,
}

/// Validates a tier's type-specific keys with the tier's own parser and rules, where kvtier
/// has them; with the chunk geometry known, the rules that depend on the row stride too.
fn check_tier_params(tier: &TierConfig, row_stride: Option<u64>) -> Result<TierParamsCheck> {
    let (validated, by) = match tier.tier_type.as_str() {
        "nvme" => {
            G3TierConfig::from_tier(tier)?.validate(&tier.key_path(), row_stride)?;
            (true, "the nvme (G3) tier parser")
        }
        "fs" => {
            crate::fs::FsTierConfig::from_tier(tier)?.validate(&tier.key_path(), row_stride)?;
            (true, "the fs tier parser")
        }
        _ => (
            false,
            "nothing: kvtier has no tier of this type; vLLM's factory checks it",
        ),
    };
    Ok(TierParamsCheck {
        index: tier.index,
        tier_type: tier.tier_type.clone(),
        validated,
        by,
    })
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
    let geometry = match args.bytes_per_block {
        None => None,
        Some(bytes_per_block) => {
            Some(cfg.geometry(bytes_per_block, args.copies, args.gpu_block_size)?)
        }
    };
    let tier_params = cfg
        .secondary_tiers
        .iter()
        .map(|t| check_tier_params(t, geometry.map(|g| g.row_stride)))
        .collect::<Result<Vec<_>>>()
        .map_err(|e| config::error_in_file(&args.file, e))?;
    let report = CheckReport {
        file: args.file.display().to_string(),
        format: format.as_str(),
        valid: true,
        cpu_bytes_to_use_human: format_size(cfg.cpu_bytes_to_use),
        config: cfg,
        geometry,
        tier_params,
        notes: &resolved.notes,
    };
    print_json(&report)?;
    Ok(ExitCode::SUCCESS)
}
