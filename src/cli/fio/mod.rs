//! `kvtier fio-compare`: runs fio and the equivalent kvtier workload on the same path, on the
//! same kind of file, at the same row size and depth, alternating them, and reports medians and
//! the ratio kvtier/fio per profile.
//!
//! File state: before the first measured pass every file (fio's and kvtier's) is preallocated
//! with `fallocate` and then written in full once, so every measured pass overwrites (store) or
//! reads (load) written extents. A first write into fresh (unwritten) extents costs about twice
//! an overwrite on the development disk, so mixing the two states would make the ratio
//! meaningless.
//!
//! * [`plan`]: what will run, checked before anything runs. [`runner`]: fio itself (job files,
//!   JSON output). [`files`]: the test files, prepared identically for both sides.
//! * [`kvtier_workload`], [`g3_workload`]: kvtier's side, through its I/O engine alone or the
//!   whole G3 tier.
//! * [`report`], [`plot`]: the `--json` objects, the tables and the SVG chart.

pub mod files;
pub mod g3_workload;
pub mod kvtier_workload;
pub mod plan;
pub mod plot;
pub mod report;
pub mod runner;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::cli::args::{InFlightArgs, PathArgs, parse_engine};
use crate::cli::fio::g3_workload::{G3Shape, G3Workload};
use crate::cli::fio::kvtier_workload::{KvtierWorkload, PassStats, WorkloadShape};
use crate::cli::fio::plan::Plan;
use crate::cli::fio::plot::{Panel, render_svg};
use crate::cli::fio::report::{DepthPoint, ProfileComparison, render_report};
use crate::cli::fio::runner::{FioRun, Profile};
use crate::cli::output::{display_paths, out, outln, print_json, progress_bar};
use crate::cli::size::{format_size, parse_size};
use crate::cli::stats::median;
use crate::error::{Error, ErrorKind, Result};
use crate::io::IoEngineKind;

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
  kvtier fio-compare --plot depth.svg --depths 1,2,4,8,16,32

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
    /// kvtier's I/O engine: auto, uring or psync.
    #[arg(long, default_value = "uring", value_parser = parse_engine, value_name = "ENGINE")]
    pub io_engine: IoEngineKind,
    /// Also sweep the depth and draw throughput against depth to this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// Depths for --plot (comma-separated). Default: powers of two up to the depth.
    #[arg(long, value_delimiter = ',', value_name = "N,N,...")]
    pub depths: Vec<u32>,
    /// Keep the test files afterwards.
    #[arg(long)]
    pub keep: bool,
    /// Print JSON (an array with one object per profile) instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Runs `kvtier fio-compare`. Ctrl-C or SIGTERM stops it between passes, removes its files
/// (unless `--keep`) and exits 130.
pub fn run(args: FioCompareArgs) -> Result<ExitCode> {
    crate::cli::interrupt::run_interruptible(|| run_caught(args))
}

fn run_caught(args: FioCompareArgs) -> Result<ExitCode> {
    // The arguments first (paths, sizes, depth, plot folder), then fio: a mistake is reported
    // as such on a machine without fio too.
    let plan = Plan::from_args(&args)?;
    let fio_version = runner::fio_version()?;
    let cleanup = Cleanup {
        files: plan.all_files(),
        dirs: plan.g3_dirs.clone(),
        keep: args.keep,
    };
    // fio's files, and kvtier's on the engine side (the G3 side prepares its own slabs).
    files::prepare(&cleanup.files, plan.per_file, plan.row_size)?;
    let mut workload = match args.kvtier_side {
        KvtierSide::Engine => Side::Engine(KvtierWorkload::open(&WorkloadShape {
            files: plan.kvtier_files.clone(),
            file_size: plan.per_file,
            row_size: plan.row_size,
            max_depth: plan.max_depth(),
            engine: args.io_engine,
        })?),
        KvtierSide::G3 => Side::G3(Box::new(G3Workload::open(&G3Shape {
            dirs: plan.g3_dirs.clone(),
            bytes_per_path: plan.per_file,
            row_size: plan.row_size,
            max_depth: plan.max_depth(),
            engine: args.io_engine,
        })?)),
    };
    let scratch = tempfile::Builder::new()
        .prefix("kvtier-fio-")
        .tempdir()
        .map_err(|e| Error::new(ErrorKind::Io, format!("cannot create a scratch dir: {e}")))?;

    let runs = plan.profiles.len() * plan.depths.len() * plan.pairs * 2;
    let bar = progress_bar(runs as u64, "fio-compare", !args.json);
    let mut results = Vec::new();
    for &profile in &plan.profiles {
        let mut sweep = Vec::new();
        for &depth in &plan.depths {
            let point = measure(&plan, profile, depth, &mut workload, scratch.path(), &bar)?;
            sweep.push(point);
        }
        let main = sweep
            .iter()
            .find(|p| p.iodepth == plan.depth)
            .cloned()
            .ok_or_else(|| Error::new(ErrorKind::Internal, "main depth missing from the sweep"))?;
        results.push(ProfileComparison {
            profile: profile.name(),
            kvtier_bytes_per_sec: main.kvtier_bytes_per_sec,
            fio_bytes_per_sec: main.fio_bytes_per_sec,
            ratio: main.ratio,
            row_size: plan.row_size,
            iodepth: plan.depth,
            file_size: plan.per_file * plan.paths.len() as u64,
            paths: plan.paths.clone(),
            file_state: plan.file_state,
            pairs: plan.pairs,
            kvtier_side: plan.side_name,
            kvtier_engine: workload.describe(),
            fio_version: fio_version.clone(),
            kvtier_samples: main.kvtier_samples,
            fio_samples: main.fio_samples,
            sweep: if args.plot.is_some() {
                sweep
            } else {
                Vec::new()
            },
        });
    }
    bar.finish_and_clear();
    workload.close()?;
    drop(cleanup);

    if let Some(svg_path) = &args.plot {
        let panels: Vec<Panel> = results
            .iter()
            .map(|r| Panel {
                title: r.profile.to_string(),
                depths: r.sweep.iter().map(|p| p.iodepth).collect(),
                kvtier: r.sweep.iter().map(|p| p.kvtier_bytes_per_sec).collect(),
                fio: r.sweep.iter().map(|p| p.fio_bytes_per_sec).collect(),
            })
            .collect();
        let subtitle = format!(
            "{} rows, {} per side on {}, medians of {} alternating pairs, {}",
            format_size(plan.row_size),
            format_size(plan.per_file * plan.paths.len() as u64),
            display_paths(&plan.paths),
            plan.pairs,
            fio_version
        );
        std::fs::write(svg_path, render_svg(&panels, &subtitle))
            .map_err(|e| Error::io("write plot", svg_path, e))?;
    }

    if args.json {
        print_json(&results)?;
    } else {
        out!("{}", render_report(&plan, &results, &fio_version))?;
        if let Some(svg_path) = &args.plot {
            outln!("plot: {}", svg_path.display())?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs `plan.pairs` alternating pairs (kvtier first on even pairs, fio first on odd ones).
fn measure(
    plan: &Plan,
    profile: Profile,
    depth: u32,
    workload: &mut Side,
    scratch: &Path,
    bar: &indicatif::ProgressBar,
) -> Result<DepthPoint> {
    let fio_run = FioRun {
        profile,
        files: plan.fio_files.clone(),
        size: plan.per_file * plan.fio_files.len() as u64,
        block_size: plan.row_size,
        iodepth: depth,
    };
    let mut kv = Vec::with_capacity(plan.pairs);
    let mut fi = Vec::with_capacity(plan.pairs);
    for pair in 0..plan.pairs {
        for side in 0..2 {
            crate::cli::interrupt::check("fio-compare")?;
            let kvtier_turn = (side == 0) == pair.is_multiple_of(2);
            if kvtier_turn {
                kv.push(workload.run_pass(profile, depth)?.bytes_per_sec());
            } else {
                fi.push(runner::run_fio(&fio_run, scratch)?.total_bytes_per_sec());
            }
            bar.inc(1);
        }
    }
    let k = median(&kv).unwrap_or(f64::NAN);
    let f = median(&fi).unwrap_or(f64::NAN);
    Ok(DepthPoint {
        iodepth: depth,
        kvtier_bytes_per_sec: k,
        fio_bytes_per_sec: f,
        ratio: if f > 0.0 { k / f } else { f64::NAN },
        kvtier_samples: kv,
        fio_samples: fi,
    })
}

/// Removes the test files and tier directories on drop unless asked to keep them.
struct Cleanup {
    files: Vec<PathBuf>,
    dirs: Vec<PathBuf>,
    keep: bool,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        for f in &self.files {
            if let Err(e) = std::fs::remove_file(f)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                log::warn!("cannot remove {}: {e}", f.display());
            }
        }
        for d in &self.dirs {
            if let Err(e) = std::fs::remove_dir_all(d)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                log::warn!("cannot remove {}: {e}", d.display());
            }
        }
    }
}

/// kvtier's side of the comparison.
enum Side {
    Engine(KvtierWorkload),
    G3(Box<G3Workload>),
}

impl Side {
    fn run_pass(&mut self, profile: Profile, depth: u32) -> Result<PassStats> {
        match self {
            Side::Engine(w) => w.run_pass(profile, depth),
            Side::G3(w) => w.run_pass(profile, depth),
        }
    }

    fn describe(&self) -> String {
        match self {
            Side::Engine(w) => format!("I/O engine on a plain file: {}", w.describe()),
            Side::G3(w) => w.describe(),
        }
    }

    fn close(self) -> Result<()> {
        match self {
            Side::Engine(w) => w.close(),
            Side::G3(w) => w.close(),
        }
    }
}
