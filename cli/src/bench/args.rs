//! The arguments of `kvtier bench` (what the command, its plan and its sides all read).

use crate::args::{InFlightArgs, PathArgs, RowArgs, parse_engine};
use crate::region_arg::BenchRegion;
use crate::size::parse_size;
use kvtier::io::IoEngineKind;

/// Arguments of `kvtier bench`.
#[derive(Debug, Clone, clap::Args)]
#[command(after_help = "Examples:
  kvtier bench                                   # 2 GiB of Llama-3.1-8B chunks (2 MiB rows) on the temp dir
  kvtier bench --path /mnt/nvme0 --path /mnt/nvme1 --bytes 16GiB
  kvtier bench --layout layouts/qwen3-32b.toml --tp 2 --blocks-per-chunk 4
  kvtier bench --bytes 256MiB --keep --json      # keep the tier for `kvtier tier inspect`
  kvtier bench --tier fs --path /mnt/shared --bytes 512MiB --fio   # fs tier vs vLLM's approach vs fio

The tier gets a new sub-directory in each --path (one slab each), removed afterwards unless
--keep. Exits 1 if any stored byte does not come back intact.")]
pub struct BenchArgs {
    /// Where the tier goes.
    #[command(flatten)]
    pub path: PathArgs,
    /// Tier capacity over all paths. Default: just enough for --bytes.
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub capacity: Option<u64>,
    /// Bytes of KV chunks to store and load back (rounded down to whole rows, at least one).
    #[arg(long, default_value = "2GiB", value_parser = parse_size, value_name = "SIZE")]
    pub bytes: u64,
    /// The rows: model layout, TP size, blocks per chunk.
    #[command(flatten)]
    pub row: RowArgs,
    /// The tier's byte budget in flight.
    #[command(flatten)]
    pub in_flight: InFlightArgs,
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
    /// The tier: `nvme` (G3 slab files) or `fs` (one file per chunk in one --path, as on a
    /// shared file system, measured in rounds beside vLLM's fs tier approach).
    #[arg(long, value_enum, default_value = "nvme")]
    pub tier: BenchTierKind,
    /// With --tier fs: rounds, each running every side once (the side that goes first
    /// alternates); the report gives each side's medians. Default 3.
    #[arg(long, value_name = "N")]
    pub rounds: Option<u32>,
    /// With --tier fs: also run fio's one-file-per-chunk profiles (fio-profiles/fs-store.fio,
    /// fs-load.fio: 16 threads, O_DIRECT, the raw ceiling) in every round.
    #[arg(long)]
    pub fio: bool,
    /// The primary region (repeatable; with several, each runs on a fresh tier, in --rounds
    /// alternating rounds, and the report sets them side by side): `own` (kvtier's memfd in
    /// 2 MiB pages), `vllm` (a /dev/shm file mapped as vLLM 0.33 maps its region, 4 KiB pages,
    /// adopted as the Python tier adopts it: kvtier collapses its own mapping into 2 MiB pages
    /// where it can), `vllm-4k` (the same, adopted with huge pages off). Default: own.
    #[arg(long = "region", value_enum, value_name = "REGION")]
    pub regions: Vec<BenchRegion>,
    /// Instead: chunks in GPU memory stored and loaded by GPUDirect Storage and, from the same
    /// GPU buffers, by the CPU path (GPU -> pinned row -> O_DIRECT), every byte verified; one
    /// table of GB/s. Needs a build with `--features gds` and a GPU.
    #[arg(long)]
    pub gds: bool,
}

/// Which tier `kvtier bench` measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchTierKind {
    /// The G3 NVMe tier (slab files).
    Nvme,
    /// The fs tier (one file per chunk).
    Fs,
}
