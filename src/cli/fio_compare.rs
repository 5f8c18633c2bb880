//! `kvtier fio-compare`: runs fio and the equivalent kvtier workload on the same path, on the
//! same kind of file, at the same row size and depth, alternating them, and reports medians and
//! the ratio kvtier/fio per profile.
//!
//! File state: before the first measured pass every file (fio's and kvtier's) is preallocated
//! with `fallocate` and then written in full once, so every measured pass overwrites (store) or
//! reads (load) written extents. A first write into fresh (unwritten) extents costs about twice
//! an overwrite on the development disk, so mixing the two states would make the ratio
//! meaningless.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::cli::args::{parse_engine, path_dirs};
use crate::cli::fio::{self, FioRun, Profile};
use crate::cli::fio_files;
use crate::cli::fio_report::{DepthPoint, ProfileComparison, render_report};
use crate::cli::g3_workload::{G3Shape, G3Workload};
use crate::cli::kvtier_workload::{KvtierWorkload, PassStats, WorkloadShape};
use crate::cli::output::{display_paths, print_json, progress_bar};
use crate::cli::plot::{Panel, render_svg};
use crate::cli::size::{format_size, parse_size};
use crate::cli::stats::median;
use crate::error::{Error, ErrorKind, Result};
use crate::geometry::{ChunkGeometry, ROW_ALIGNMENT};
use crate::io::IoEngineKind;

/// How the files are prepared, in the words the report uses (engine side).
pub const FILE_STATE: &str = "preallocated with fallocate and written in full once before the \
first pass; store passes overwrite written extents, load passes read them";

/// How the files are prepared when kvtier runs through the G3 tier.
pub const FILE_STATE_G3: &str = "preallocated (fio: fallocate; kvtier: the G3 slabs, \
posix_fallocate) and written in full once before the first pass (kvtier: an untimed store pass \
fills every slot); store passes overwrite written extents, load passes read them";

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
    /// Directory to test (repeat for several devices; rows are striped across them).
    /// Default: the system temp dir.
    #[arg(long = "path", value_name = "DIR")]
    pub paths: Vec<PathBuf>,
    /// Workload to compare (repeatable). Default: store and load.
    #[arg(long = "profile", value_enum, value_name = "NAME")]
    pub profiles: Vec<Profile>,
    /// Bytes per I/O: one primary row.
    #[arg(long, default_value = "2MiB", value_parser = parse_size, value_name = "SIZE")]
    pub row_size: u64,
    /// File bytes per side over all paths (each pass moves this much per direction).
    #[arg(long, default_value = "1GiB", value_parser = parse_size, value_name = "SIZE")]
    pub size: u64,
    /// Bytes in flight per direction; the depth is this divided by the row size.
    #[arg(long, default_value = "64MiB", value_parser = parse_size, value_name = "SIZE")]
    pub max_bytes_in_flight: u64,
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
    let fio_version = fio::fio_version()?;
    let plan = Plan::from_args(&args)?;
    let cleanup = Cleanup {
        files: plan.all_files(),
        dirs: plan.g3_dirs.clone(),
        keep: args.keep,
    };
    // fio's files, and kvtier's on the engine side (the G3 side prepares its own slabs).
    fio_files::prepare(&cleanup.files, plan.per_file, plan.row_size)?;
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
        print!("{}", render_report(&plan, &results, &fio_version));
        if let Some(svg_path) = &args.plot {
            println!("plot: {}", svg_path.display());
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
                fi.push(fio::run_fio(&fio_run, scratch)?.total_bytes_per_sec());
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

/// What will run, resolved and validated from the arguments.
#[derive(Debug)]
pub(crate) struct Plan {
    pub(crate) paths: Vec<PathBuf>,
    pub(crate) profiles: Vec<Profile>,
    pub(crate) row_size: u64,
    pub(crate) per_file: u64,
    pub(crate) depth: u32,
    pub(crate) depths: Vec<u32>,
    pub(crate) pairs: usize,
    pub(crate) fio_files: Vec<PathBuf>,
    pub(crate) kvtier_files: Vec<PathBuf>,
    pub(crate) g3_dirs: Vec<PathBuf>,
    pub(crate) file_state: &'static str,
    pub(crate) side_name: &'static str,
}

impl Plan {
    fn from_args(args: &FioCompareArgs) -> Result<Self> {
        let paths = path_dirs(&args.paths)?;
        if !ChunkGeometry::is_row_aligned(args.row_size) {
            return Err(Error::config(
                "--row-size",
                format!(
                    "{} is not a positive multiple of {ROW_ALIGNMENT}",
                    args.row_size
                ),
            ));
        }
        let n = paths.len() as u64;
        let per_file =
            ChunkGeometry::slots_per_file(args.size, paths.len(), args.row_size) * args.row_size;
        if per_file == 0 {
            return Err(Error::config(
                "--size",
                format!(
                    "{} over {n} path(s) is less than one {} row per path",
                    format_size(args.size),
                    format_size(args.row_size)
                ),
            ));
        }
        let depth = match args.iodepth {
            Some(0) => return Err(Error::config("--iodepth", "must be at least 1")),
            Some(d) => d,
            None => u32::try_from(ChunkGeometry::rows_in_flight(
                args.max_bytes_in_flight,
                args.row_size,
            ))
            .map_err(|_| Error::config("--max-bytes-in-flight", "too large"))?,
        };
        if args.pairs == 0 {
            return Err(Error::config("--pairs", "must be at least 1"));
        }
        // Found out before the runs, not after minutes of them.
        if let Some(svg) = &args.plot {
            let parent = svg.parent().filter(|p| !p.as_os_str().is_empty());
            if parent.is_some_and(|p| !p.is_dir()) {
                return Err(Error::config(
                    "--plot",
                    format!("{}: its folder does not exist", svg.display()),
                ));
            }
        }
        let mut depths = if args.plot.is_some() {
            if args.depths.is_empty() {
                std::iter::successors(Some(1u32), |d| d.checked_mul(2))
                    .take_while(|d| *d < depth)
                    .collect()
            } else {
                args.depths.clone()
            }
        } else {
            Vec::new()
        };
        if depths.contains(&0) {
            return Err(Error::config("--depths", "depths must be at least 1"));
        }
        depths.push(depth);
        depths.sort_unstable();
        depths.dedup();
        let mut profiles = if args.profiles.is_empty() {
            vec![Profile::Store, Profile::Load]
        } else {
            args.profiles.clone()
        };
        profiles.dedup();
        if args.kvtier_side == KvtierSide::G3 && profiles.contains(&Profile::Mixed) {
            return Err(Error::config(
                "--profile",
                "mixed runs on the engine side only (concurrent stores would evict the keys \
                 being loaded): add --kvtier-side engine",
            ));
        }
        let in_each = |name: &str| -> Vec<PathBuf> { paths.iter().map(|p| p.join(name)).collect() };
        let fio_files = in_each("kvtier-fio-compare.fio.dat");
        let (kvtier_files, g3_dirs, file_state, side_name) = match args.kvtier_side {
            KvtierSide::Engine => (
                in_each("kvtier-fio-compare.kvtier.dat"),
                Vec::new(),
                FILE_STATE,
                "engine",
            ),
            KvtierSide::G3 => (
                Vec::new(),
                in_each("kvtier-fio-compare.g3"),
                FILE_STATE_G3,
                "g3",
            ),
        };
        Ok(Plan {
            paths,
            profiles,
            row_size: args.row_size,
            per_file,
            depth,
            depths,
            pairs: args.pairs,
            fio_files,
            kvtier_files,
            g3_dirs,
            file_state,
            side_name,
        })
    }

    fn max_depth(&self) -> u32 {
        self.depths.iter().copied().max().unwrap_or(self.depth)
    }

    /// Every plain test file (fio's, and kvtier's on the engine side).
    fn all_files(&self) -> Vec<PathBuf> {
        self.fio_files
            .iter()
            .chain(&self.kvtier_files)
            .cloned()
            .collect()
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::args::parse_for_test;

    fn plan(argv: &[&str]) -> Result<Plan> {
        Plan::from_args(&parse_for_test(argv))
    }

    #[test]
    fn defaults_are_store_and_load_at_2mib_depth_32_on_temp() {
        let p = plan(&[]).unwrap();
        assert_eq!(p.profiles, vec![Profile::Store, Profile::Load]);
        assert_eq!(p.row_size, 2 << 20);
        assert_eq!(p.depth, 32);
        assert_eq!(p.depths, vec![32]);
        assert_eq!(p.paths, vec![std::env::temp_dir()]);
        assert_eq!(p.per_file, 1 << 30);
        assert_eq!(p.pairs, 3);
    }

    #[test]
    fn plot_sweeps_powers_of_two_up_to_the_depth() {
        let p = plan(&["--plot", "x.svg", "--iodepth", "12"]).unwrap();
        assert_eq!(p.depths, vec![1, 2, 4, 8, 12]);
        let p = plan(&["--plot", "x.svg", "--depths", "4,1,4"]).unwrap();
        assert_eq!(p.depths, vec![1, 4, 32]);
    }

    #[test]
    fn user_mistakes_are_config_or_path_errors() {
        assert_eq!(
            plan(&["--row-size", "1000"]).unwrap_err().kind(),
            ErrorKind::Config
        );
        assert_eq!(
            plan(&["--iodepth", "0"]).unwrap_err().kind(),
            ErrorKind::Config
        );
        assert_eq!(
            plan(&["--pairs", "0"]).unwrap_err().kind(),
            ErrorKind::Config
        );
        assert_eq!(
            plan(&["--size", "1MiB"]).unwrap_err().kind(),
            ErrorKind::Config
        );
        let e = plan(&["--path", "/nonexistent/kvtier"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidPath);
        assert!(e.to_string().contains("/nonexistent/kvtier"), "{e}");
        let f = tempfile::NamedTempFile::new().unwrap();
        let e = plan(&["--path", f.path().to_str().unwrap()]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidPath);
        assert!(e.to_string().contains("not a directory"), "{e}");
    }

    #[test]
    fn several_paths_split_the_size_in_whole_rows() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let (a, b) = (a.path().to_str().unwrap(), b.path().to_str().unwrap());
        let p = plan(&[
            "--path",
            a,
            "--path",
            b,
            "--size",
            "5MiB",
            "--row-size",
            "1MiB",
        ])
        .unwrap();
        assert_eq!(p.per_file, 2 << 20);
        assert_eq!(p.fio_files.len(), 2);
        assert_ne!(p.fio_files[0], p.fio_files[1]);
        let e = plan(&["--path", a, "--path", a]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.to_string().contains("given twice"), "{e}");
    }
}
