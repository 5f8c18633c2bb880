//! The arguments of `kvtier fio-compare` (what the command and its plan read).

use std::path::PathBuf;

use crate::args::{InFlightArgs, PathArgs, parse_engine};
use crate::fio::runner::Profile;
use crate::region_arg::BenchRegion;
use crate::size::parse_size;
use kvtier::io::IoEngineKind;

/// Which kvtier code path the comparison drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvtierSide {
    /// The G3 tier's whole data path (jobs, slots, CRC32, journal), fsync never.
    G3,
    /// kvtier's I/O engine alone on a plain file (what the tier's I/O layer can do).
    Engine,
}

/// Arguments of `kvtier fio-compare`.
#[derive(Debug, clap::Args)]
#[command(after_help = "Examples:
  kvtier fio-compare                                  # store and load, 2 MiB rows, on the temp dir
  kvtier fio-compare --path /mnt/nvme0 --path /mnt/nvme1 --size 8GiB
  kvtier fio-compare --profile load --pairs 5 --json
  kvtier fio-compare --profile load --row-size 64KiB --fio-verify   # fio checking what it loads too
  kvtier fio-compare --kvtier-side engine --profile load --row-size 64KiB --iodepth 32 --buffer-sets 64
  kvtier fio-compare --plot depth.svg --depths 1,2,4,8,16,32
  kvtier fio-compare --region vllm --plot sweep.svg --row-sizes 64KiB,1MiB,16MiB --depths 1,8,64

Needs fio (apt-get install fio). Every pass covers each row of the file once.")]
pub struct FioCompareArgs {
    /// The directories to test.
    #[command(flatten)]
    pub path: PathArgs,
    /// Workload to compare (repeatable). Default: store and load.
    #[arg(long = "profile", value_enum, value_name = "NAME")]
    pub profiles: Vec<Profile>,
    /// Bytes per I/O: one primary row.
    #[arg(long, default_value = "2MiB", value_parser = parse_size, value_name = "SIZE")]
    pub row_size: u64,
    /// File bytes per side over all paths (each pass moves this much per direction).
    #[arg(long, default_value = "1GiB", value_parser = parse_size, value_name = "SIZE")]
    pub size: u64,
    /// Bytes in flight per direction.
    #[command(flatten)]
    pub in_flight: InFlightArgs,
    /// Rows in flight per direction (overrides --max-bytes-in-flight).
    #[arg(long, value_name = "N")]
    pub iodepth: Option<u32>,
    /// kvtier/fio pairs per profile (and per depth with --plot); the order alternates.
    #[arg(long, default_value_t = 3, value_name = "N")]
    pub pairs: usize,
    /// What kvtier runs: the G3 tier's data path, or its I/O engine on a plain file.
    #[arg(long, value_enum, default_value = "g3", value_name = "SIDE")]
    pub kvtier_side: KvtierSide,
    /// kvtier's buffer rows in N sets, taken in turn. 1: the engine side gives a completed
    /// request's row to the next request at once, as fio reuses its iodepth buffers, and the
    /// G3 side's driver gives a new job the row freed last. More: a row comes back only after
    /// the other sets, as a tier's rows do (its caller names them; docs/performance.md,
    /// "Reused buffers").
    #[arg(long, default_value_t = 1, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub buffer_sets: u32,
    /// kvtier's I/O engine: auto, uring or psync.
    #[arg(long, default_value = "uring", value_parser = parse_engine, value_name = "ENGINE")]
    pub io_engine: IoEngineKind,
    /// kvtier's buffer rows: `own` (kvtier's region, 2 MiB pages), `vllm` (made as vLLM 0.33
    /// makes its /dev/shm region and adopted as the Python tier adopts it) or `vllm-4k` (the
    /// same, adopted with huge pages off). fio's buffers get the same kind of memory.
    #[arg(long, value_enum, default_value = "own", value_name = "REGION")]
    pub region: BenchRegion,
    /// With --plot: also sweep these row sizes (comma-separated, e.g. 64KiB,256KiB,1MiB,4MiB,16MiB).
    #[arg(long, value_delimiter = ',', value_parser = parse_size, value_name = "SIZE,...")]
    pub row_sizes: Vec<u64>,
    /// Also sweep the depth (and --row-sizes) and draw throughput against depth to this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// Depths for --plot (comma-separated). Default: powers of two up to the depth.
    #[arg(long, value_delimiter = ',', value_name = "N,N,...")]
    pub depths: Vec<u32>,
    /// Also run fio checking what it loads: a CRC-32C of every block it reads
    /// (`--verify=crc32c`, fio-profiles/load-verify.fio), the work of kvtier's load check,
    /// with fio's best memory and batching; its file is written with fio's verify headers
    /// first (untimed). Loads only.
    #[arg(long)]
    pub fio_verify: bool,
    /// Keep the test files afterwards.
    #[arg(long)]
    pub keep: bool,
    /// Print JSON (an array with one object per profile) instead of a table.
    #[arg(long)]
    pub json: bool,
}
