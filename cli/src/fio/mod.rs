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
//! * [`args`]: the arguments. [`plan`]: what will run, checked before anything runs. [`runner`]: fio itself (job files,
//!   JSON output). [`files`]: the test files, prepared identically for both sides.
//! * [`kvtier_workload`], [`g3_workload`]: kvtier's side, through its I/O engine alone or the
//!   whole G3 tier.
//! * [`report`], [`plot`]: the `--json` objects, the tables and the SVG chart.

pub mod args;
pub mod files;
pub mod g3_workload;
pub mod kvtier_workload;
pub mod memory;
pub mod plan;
pub mod plot;
pub mod report;
pub mod runner;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use crate::block_device::{DeviceSampler, DeviceView};
pub use crate::fio::args::{FioCompareArgs, KvtierSide};
use crate::fio::g3_workload::{G3Shape, G3Workload};
use crate::fio::kvtier_workload::{KvtierWorkload, PassStats, WorkloadShape};
use crate::fio::memory::FioChoice;
use crate::fio::plan::Plan;
use crate::fio::plot::{Panel, Series, render_svg};
use crate::fio::report::{DepthPoint, ProfileComparison, VerifyingFio, render_report};
use crate::fio::runner::{FioRun, Profile};
use crate::output::{display_paths, out, outln, print_json, progress_bar};
use crate::size::format_size;
use crate::stats::process_cpu_seconds;
use crate::stats::{median, spread_of};
use kvtier::error::{Error, ErrorKind, Result};
use kvtier::region::PrimaryRegion;

/// Runs `kvtier fio-compare`. Ctrl-C or SIGTERM stops it between passes, removes its files
/// (unless `--keep`) and exits 130.
pub fn run(args: FioCompareArgs) -> Result<ExitCode> {
    crate::interrupt::run_interruptible(|| run_caught(args))
}

/// Where fio's 4 KiB shared buffer file goes (a tmpfs, as vLLM's region).
fn fio_shm_file() -> PathBuf {
    PathBuf::from(crate::region_arg::VLLM_SHM_DIR)
        .join(format!("kvtier-fio-buffers-{}", std::process::id()))
}

fn run_caught(args: FioCompareArgs) -> Result<ExitCode> {
    // The arguments first (paths, sizes, depth, plot folder), then fio: a mistake is reported
    // as such on a machine without fio too.
    let plan = Plan::from_args(&args)?;
    let fio_version = runner::fio_version()?;
    let shm_file = fio_shm_file();
    let mut cleanup = Cleanup {
        files: plan.all_files(),
        dirs: plan.g3_dirs.clone(),
        keep: args.keep,
    };
    // fio's files, and kvtier's on the engine side (the G3 side prepares its own slabs).
    files::prepare(&cleanup.files, plan.per_file, plan.max_row_size())?;
    cleanup.files.push(shm_file.clone());
    let scratch = tempfile::Builder::new()
        .prefix("kvtier-fio-")
        .tempdir()
        .map_err(|e| Error::new(ErrorKind::Io, format!("cannot create a scratch dir: {e}")))?;

    let points = measure_points(&plan, &args, &shm_file, scratch.path())?;
    drop(cleanup);
    let results = comparisons(&plan, &args, &points, &fio_version)?;
    if let Some(svg_path) = &args.plot {
        write_plot(svg_path, &plan, &args, &results, &fio_version)?;
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

/// Every point of the plan (row size x depth x profile), each measured in rounds on both sides
/// with fio's memory chosen for it, behind a progress bar.
fn measure_points(
    plan: &Plan,
    args: &FioCompareArgs,
    shm_file: &Path,
    scratch: &Path,
) -> Result<Vec<(Profile, DepthPoint)>> {
    // fio on the same memory and fio's best in every round, and fio checking what it loads
    // in load rounds with --fio-verify.
    let sides_per_round: usize = plan
        .profiles
        .iter()
        .map(|&p| 3 + usize::from(plan.fio_verify && p == Profile::Load))
        .sum();
    let runs = plan.depths.len() * plan.row_sizes.len() * plan.pairs * sides_per_round;
    let bar = progress_bar(runs as u64, "fio-compare", !args.json);
    let mut points: Vec<(Profile, DepthPoint)> = Vec::new();
    let jobs = if plan.profiles.contains(&Profile::Mixed) {
        2
    } else {
        1
    };
    for &row_size in &plan.row_sizes {
        let mut workload = Side::open(plan, args, row_size)?;
        let kvtier_engine = workload.describe();
        let region = workload.region();
        let kvtier_pages = crate::region_arg::pages_note(&region);
        // kvtier's rows count as 2 MiB pages when most of them are (a partial collapse is
        // named in the report's pages).
        let kvtier_huge = region.huge_page_share() >= 0.5;
        for &depth in &plan.depths {
            // fio's memory per point: the hugetlb pages this row size and depth need are
            // reserved for it alone, so a point too large for the machine's free 2 MiB blocks
            // is marked (and says why) while the others still run like for like.
            let needed = memory::hugetlb_pages_needed(row_size, depth, jobs);
            let (choice, reservation) = memory::choose(kvtier_huge, shm_file.to_path_buf(), needed);
            for &profile in &plan.profiles {
                let mut point = measure(
                    plan,
                    profile,
                    row_size,
                    depth,
                    &choice,
                    &mut workload,
                    scratch,
                    &bar,
                )?;
                point.kvtier_pages = kvtier_pages.clone();
                point.kvtier_engine = kvtier_engine.clone();
                points.push((profile, point));
            }
            drop(reservation);
        }
        workload.close()?;
    }
    bar.finish_and_clear();
    Ok(points)
}

/// One comparison per profile: its figures at the plan's row size and depth, and with
/// `--plot` the whole sweep.
fn comparisons(
    plan: &Plan,
    args: &FioCompareArgs,
    points: &[(Profile, DepthPoint)],
    fio_version: &str,
) -> Result<Vec<ProfileComparison>> {
    let mut results = Vec::new();
    for &profile in &plan.profiles {
        let sweep: Vec<DepthPoint> = points
            .iter()
            .filter(|(p, _)| *p == profile)
            .map(|(_, d)| d.clone())
            .collect();
        let main = sweep
            .iter()
            .find(|p| p.iodepth == plan.depth && p.row_size == plan.row_size)
            .cloned()
            .ok_or_else(|| Error::new(ErrorKind::Internal, "main point missing from the sweep"))?;
        results.push(ProfileComparison {
            profile: profile.name(),
            kvtier_bytes_per_sec: main.kvtier_bytes_per_sec,
            fio_bytes_per_sec: main.fio_bytes_per_sec,
            ratio: main.ratio,
            fio_best_bytes_per_sec: main.fio_best_bytes_per_sec,
            ratio_to_best: main.ratio_to_best,
            kvtier_cpu_seconds_per_gb: main.kvtier_cpu_seconds_per_gb,
            fio_cpu_seconds_per_gb: main.fio_cpu_seconds_per_gb,
            fio_best_cpu_seconds_per_gb: main.fio_best_cpu_seconds_per_gb,
            row_size: plan.row_size,
            iodepth: plan.depth,
            file_size: plan.per_file * plan.paths.len() as u64,
            paths: plan.paths.clone(),
            file_state: plan.file_state,
            pairs: plan.pairs,
            kvtier_side: plan.side_name,
            kvtier_region: args.region.name(),
            kvtier_pages: main.kvtier_pages.clone(),
            kvtier_engine: main.kvtier_engine.clone(),
            fio_version: fio_version.to_string(),
            fio_setup: main.fio_setup.clone(),
            fio_like_for_like: main.fio_like_for_like,
            fio_note: main.fio_note.clone(),
            fio_best_setup: main.fio_best_setup.clone(),
            kvtier_samples: main.kvtier_samples,
            fio_samples: main.fio_samples,
            pair_ratios: main.pair_ratios.clone(),
            ratio_spread: main.ratio_spread,
            kvtier_device: main.kvtier_device,
            fio_device: main.fio_device,
            devices: main.devices.clone(),
            fio_verify: main.fio_verify.clone(),
            sweep: if args.plot.is_some() {
                sweep
            } else {
                Vec::new()
            },
        });
    }
    Ok(results)
}

/// Draws throughput against depth, one panel per row size and profile, to `svg_path`.
fn write_plot(
    svg_path: &Path,
    plan: &Plan,
    args: &FioCompareArgs,
    results: &[ProfileComparison],
    fio_version: &str,
) -> Result<()> {
    let mut panels: Vec<Panel> = Vec::new();
    for &row_size in &plan.row_sizes {
        for r in results {
            let at: Vec<&DepthPoint> = r.sweep.iter().filter(|p| p.row_size == row_size).collect();
            let mut series = vec![
                Series::new(
                    "kvtier",
                    at.iter().map(|p| p.kvtier_bytes_per_sec).collect(),
                ),
                Series::new(
                    "fio, same memory",
                    at.iter().map(|p| p.fio_bytes_per_sec).collect(),
                ),
            ];
            if at.iter().any(|p| !p.fio_best_samples.is_empty()) {
                series.push(Series::new(
                    "fio best (hugetlb)",
                    at.iter().map(|p| p.fio_best_bytes_per_sec).collect(),
                ));
            }
            if at.iter().any(|p| p.fio_verify.is_some()) {
                series.push(Series::new(
                    "fio verifying",
                    at.iter()
                        .map(|p| p.fio_verify.as_ref().map_or(f64::NAN, |v| v.bytes_per_sec))
                        .collect(),
                ));
            }
            // Points where fio could not have the same memory are named in the title.
            let unlike: Vec<String> = at
                .iter()
                .filter(|p| !p.fio_like_for_like)
                .map(|p| p.iodepth.to_string())
                .collect();
            let mut title = format!("{} rows, {}", format_size(row_size), r.profile);
            if !unlike.is_empty() {
                title.push_str(&format!(
                    " (fio NOT like for like at depth {})",
                    unlike.join(", ")
                ));
            }
            panels.push(Panel {
                title,
                depths: at.iter().map(|p| p.iodepth).collect(),
                series,
            });
        }
    }
    let main = results.first();
    let subtitle = format!(
        "kvtier region {} ({}); fio: {}; {} per side on {}, medians of {} rotating rounds, {}",
        args.region.name(),
        main.map_or("", |r| r.kvtier_pages.as_str()),
        main.map_or_else(String::new, |r| r.fio_setup.describe()),
        format_size(plan.per_file * plan.paths.len() as u64),
        display_paths(&plan.paths),
        plan.pairs,
        fio_version
    );
    std::fs::write(
        svg_path,
        render_svg(&panels, plan.profiles.len(), &subtitle),
    )
    .map_err(|e| Error::io("write plot", svg_path, e))?;
    Ok(())
}

/// One pass's throughput and CPU cost.
#[derive(Debug, Clone, Copy)]
struct Sample {
    bytes_per_sec: f64,
    cpu_seconds_per_gb: f64,
    /// What the block device saw during the pass (none without a block device).
    device: Option<DeviceView>,
}

/// Runs `plan.pairs` rounds of kvtier, fio on the same memory and (when it differs) fio's best
/// configuration, the order rotating each round so no side always goes first.
#[allow(clippy::too_many_arguments)]
fn measure(
    plan: &Plan,
    profile: Profile,
    row_size: u64,
    depth: u32,
    choice: &FioChoice,
    workload: &mut Side,
    scratch: &Path,
    bar: &indicatif::ProgressBar,
) -> Result<DepthPoint> {
    let fio_run = |setup: &memory::FioSetup, verify: bool| FioRun {
        profile,
        files: plan.fio_files.clone(),
        size: plan.per_file * plan.fio_files.len() as u64,
        block_size: row_size,
        iodepth: depth,
        setup: setup.clone(),
        verify,
    };
    let like = fio_run(&choice.like, false);
    let best = choice.best.as_ref().map(|b| fio_run(b, false));
    // fio checking what it loads, with fio's best memory and batching (`--fio-verify`): its
    // file first gets fio's verify headers, written at this row size (untimed).
    let verify = if plan.fio_verify && profile == Profile::Load {
        let setup = choice.best.as_ref().unwrap_or(&choice.like);
        let headers = FioRun {
            profile: Profile::Store,
            ..fio_run(setup, true)
        };
        runner::run_fio(&headers, scratch)?;
        Some(fio_run(setup, true))
    } else {
        None
    };
    // The fio runs of a round by side (1 fio on the same memory, 2 fio's best, 3 fio
    // verifying; 0 is kvtier), and the sides that run, in the order of the first round; each
    // round starts one further.
    let fio_runs: [Option<&FioRun>; 4] = [None, Some(&like), best.as_ref(), verify.as_ref()];
    let order: Vec<usize> = (0..fio_runs.len())
        .filter(|&side| side == 0 || fio_runs[side].is_some())
        .collect();
    let devices = DeviceSampler::of(&plan.paths);
    let mut samples: [Vec<Sample>; 4] = Default::default();
    // The reference each round's kvtier sample is compared with: fio's best where it runs
    // separately, else fio on the same memory.
    let reference = if best.is_some() { 2 } else { 1 };
    let max_pairs = plan.pairs.saturating_mul(MAX_PAIRS_FACTOR);
    let mut pair = 0;
    while pair < plan.pairs
        || (pair < max_pairs && pair_spread(&samples[0], &samples[reference]) > WIDE_SPREAD)
    {
        if pair >= plan.pairs {
            // A wide spread: one more round (the bar grows with it).
            // (One step stands for fio's best where it does not run separately.)
            bar.inc_length((order.len() + usize::from(best.is_none())) as u64);
        }
        for k in 0..order.len() {
            crate::interrupt::check("fio-compare")?;
            let side = order[(k + pair) % order.len()];
            let sample = match fio_runs[side] {
                None => {
                    let cpu0 = process_cpu_seconds();
                    let (pass, device) = devices.around(|| workload.run_pass(profile, depth));
                    let pass = pass?;
                    let cpu = process_cpu_seconds() - cpu0;
                    Sample {
                        bytes_per_sec: pass.bytes_per_sec(),
                        cpu_seconds_per_gb: cpu / (pass.bytes as f64 / 1e9).max(1e-12),
                        device,
                    }
                }
                Some(run) => {
                    let (report, device) = devices.around(|| runner::run_fio(run, scratch));
                    fio_sample(&report?, device)
                }
            };
            samples[side].push(sample);
            bar.inc(1);
        }
        if best.is_none() {
            // The bar counts fio's best in every round.
            bar.inc(1);
        }
        pair += 1;
    }
    let pair_ratios = pair_ratios(&samples[0], &samples[reference]);
    let med = |v: &[Sample], f: fn(&Sample) -> f64| {
        median(&v.iter().map(f).collect::<Vec<_>>()).unwrap_or(f64::NAN)
    };
    let speed = |s: &Sample| s.bytes_per_sec;
    let cost = |s: &Sample| s.cpu_seconds_per_gb;
    let (k, f) = (med(&samples[0], speed), med(&samples[1], speed));
    // Without a separate best run, fio on the same memory is the best when that memory is
    // hugetlb pages (like for like with kvtier's own region).
    let best_is_like = best.is_none() && choice.like_for_like && choice.like.memory.huge();
    let (b, b_cost, b_samples) = if best_is_like {
        (f, med(&samples[1], cost), Vec::new())
    } else {
        (
            med(&samples[2], speed),
            med(&samples[2], cost),
            samples[2].iter().map(speed).collect(),
        )
    };
    let ratio = |x: f64, y: f64| if y > 0.0 { x / y } else { f64::NAN };
    let device_of = |v: &[Sample]| {
        DeviceView::median_of(&v.iter().filter_map(|s| s.device).collect::<Vec<_>>())
    };
    Ok(DepthPoint {
        row_size,
        iodepth: depth,
        kvtier_bytes_per_sec: k,
        fio_bytes_per_sec: f,
        ratio: ratio(k, f),
        fio_best_bytes_per_sec: b,
        ratio_to_best: ratio(k, b),
        kvtier_cpu_seconds_per_gb: med(&samples[0], cost),
        fio_cpu_seconds_per_gb: med(&samples[1], cost),
        fio_best_cpu_seconds_per_gb: b_cost,
        kvtier_samples: samples[0].iter().map(speed).collect(),
        fio_samples: samples[1].iter().map(speed).collect(),
        fio_best_samples: b_samples,
        fio_setup: choice.like.clone(),
        fio_like_for_like: choice.like_for_like,
        fio_note: choice.note.clone(),
        fio_best_setup: choice
            .best
            .clone()
            .or_else(|| best_is_like.then(|| choice.like.clone())),
        kvtier_pages: String::new(),
        kvtier_engine: String::new(),
        kvtier_device: device_of(&samples[0]),
        fio_device: device_of(&samples[reference]),
        devices: devices.names.clone(),
        ratio_spread: spread_of(&pair_ratios),
        pair_ratios,
        fio_verify: verify.map(|_| {
            let v = &samples[3];
            VerifyingFio {
                bytes_per_sec: med(v, speed),
                cpu_seconds_per_gb: med(v, cost),
                ratio: ratio(k, med(v, speed)),
                samples: v.iter().map(speed).collect(),
                device: device_of(v),
            }
        }),
    })
}

/// Above this spread of the per-round kvtier/reference ratios ((max - min) / median),
/// `measure` takes more rounds.
const WIDE_SPREAD: f64 = 0.10;

/// At most this many times `--pairs` rounds when the spread stays wide.
const MAX_PAIRS_FACTOR: usize = 3;

/// Each round's kvtier throughput over the reference's in the same round.
fn pair_ratios(kvtier: &[Sample], reference: &[Sample]) -> Vec<f64> {
    kvtier
        .iter()
        .zip(reference)
        .filter(|(_, r)| r.bytes_per_sec > 0.0)
        .map(|(k, r)| k.bytes_per_sec / r.bytes_per_sec)
        .collect()
}

/// [`spread_of`](crate::stats::spread_of) the pair ratios so far (0 with fewer than two rounds).
fn pair_spread(kvtier: &[Sample], reference: &[Sample]) -> f64 {
    let r = pair_ratios(kvtier, reference);
    if r.len() < 2 { 0.0 } else { spread_of(&r) }
}

fn fio_sample(r: &runner::FioReport, device: Option<DeviceView>) -> Sample {
    let bytes = (r.read.io_bytes + r.write.io_bytes) as f64;
    Sample {
        bytes_per_sec: r.total_bytes_per_sec(),
        cpu_seconds_per_gb: r.cpu_seconds / (bytes / 1e9).max(1e-12),
        device,
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
    fn open(plan: &Plan, args: &FioCompareArgs, row_size: u64) -> Result<Self> {
        Ok(match args.kvtier_side {
            KvtierSide::Engine => Side::Engine(KvtierWorkload::open(&WorkloadShape {
                files: plan.kvtier_files.clone(),
                file_size: plan.per_file,
                row_size,
                max_depth: plan.max_depth(),
                engine: args.io_engine,
                region: args.region,
                buffer_sets: args.buffer_sets,
            })?),
            KvtierSide::G3 => Side::G3(Box::new(G3Workload::open(&G3Shape {
                dirs: plan.g3_dirs.clone(),
                bytes_per_path: plan.per_file,
                row_size,
                max_depth: plan.max_depth(),
                engine: args.io_engine,
                region: args.region,
                buffer_sets: args.buffer_sets,
            })?)),
        })
    }

    fn region(&self) -> Arc<PrimaryRegion> {
        match self {
            Side::Engine(w) => w.region(),
            Side::G3(w) => w.region(),
        }
    }

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
