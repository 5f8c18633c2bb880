//! The report of `kvtier fio-compare`: the `--json` objects and the human tables.

use std::path::PathBuf;

use serde::Serialize;

use crate::block_device::DeviceView;
use crate::fio::memory::FioSetup;
use crate::fio::plan::Plan;
use crate::output::{Table, display_paths};
use crate::size::{format_gbps, format_size};

/// fio checking what it loads (`--fio-verify`): `verify=crc32c` on every block read, with
/// fio's best memory and batching, a side of its own in the rotating rounds.
#[derive(Debug, Clone, Serialize)]
pub struct VerifyingFio {
    /// Median throughput, bytes per second.
    pub bytes_per_sec: f64,
    /// Its CPU seconds per GB (its jobs' `usr_cpu` + `sys_cpu`), median.
    pub cpu_seconds_per_gb: f64,
    /// kvtier / fio checking what it loads.
    pub ratio: f64,
    /// Every pass, in run order.
    pub samples: Vec<f64>,
    /// What the block device saw during its passes (medians); null without a block device.
    pub device: Option<DeviceView>,
}

/// One measured point: medians of rounds whose order rotates.
#[derive(Debug, Clone, Serialize)]
pub struct DepthPoint {
    /// Bytes per I/O.
    pub row_size: u64,
    /// Rows in flight per direction.
    pub iodepth: u32,
    /// Median kvtier throughput, bytes per second.
    pub kvtier_bytes_per_sec: f64,
    /// Median fio throughput, bytes per second.
    pub fio_bytes_per_sec: f64,
    /// kvtier / fio.
    pub ratio: f64,
    /// Median throughput of fio's best configuration on the path (hugetlb pages, batched
    /// submit and complete), bytes per second; NaN (null) when it could not run.
    pub fio_best_bytes_per_sec: f64,
    /// kvtier / fio's best.
    pub ratio_to_best: f64,
    /// kvtier's CPU seconds (user + system, the whole process) per GB moved, median.
    pub kvtier_cpu_seconds_per_gb: f64,
    /// fio's CPU seconds per GB (its jobs' `usr_cpu` + `sys_cpu`), median.
    pub fio_cpu_seconds_per_gb: f64,
    /// The same for fio's best configuration.
    pub fio_best_cpu_seconds_per_gb: f64,
    /// Every kvtier pass, in run order.
    pub kvtier_samples: Vec<f64>,
    /// Every fio pass, in run order.
    pub fio_samples: Vec<f64>,
    /// Every pass of fio's best configuration when it ran separately (empty when fio's
    /// same-memory setup is already its best).
    pub fio_best_samples: Vec<f64>,
    /// fio's memory and batching at this point (hugetlb pages are reserved per point).
    pub fio_setup: FioSetup,
    /// Whether fio's memory at this point is the same kind as kvtier's rows.
    pub fio_like_for_like: bool,
    /// Why not (the hugetlb pages this point needed and how many could be had), or what was
    /// done to make it so.
    pub fio_note: Option<String>,
    /// fio's best configuration at this point, when it could run.
    pub fio_best_setup: Option<FioSetup>,
    /// How kvtier's rows were backed for this row size (each row size gets a fresh region).
    pub kvtier_pages: String,
    /// kvtier's engine as it ran.
    pub kvtier_engine: String,
    /// Each round's kvtier throughput over the reference's (fio's best, else fio on the same
    /// memory) in the same round.
    pub pair_ratios: Vec<f64>,
    /// (max - min) / median of `pair_ratios`: how far one round's ratio can be trusted.
    /// Above 10 % more rounds were taken (up to 3 x `--pairs`).
    pub ratio_spread: f64,
    /// What the block device saw during kvtier's passes (medians; see
    /// [`crate::block_device`]); null where the paths have no block device.
    pub kvtier_device: Option<DeviceView>,
    /// The same for the reference the ratios are taken against (fio's best where it ran
    /// separately, else fio on the same memory).
    pub fio_device: Option<DeviceView>,
    /// The block devices those figures are summed over.
    pub devices: Vec<String>,
    /// fio checking what it loads, with `--fio-verify` at a load point (absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fio_verify: Option<VerifyingFio>,
}

/// The `--json` object for one profile.
#[derive(Debug, Clone, Serialize)]
pub struct ProfileComparison {
    /// `store`, `load` or `mixed`.
    pub profile: &'static str,
    /// Median kvtier throughput at the main depth, bytes per second.
    pub kvtier_bytes_per_sec: f64,
    /// Median fio throughput at the main depth, bytes per second.
    pub fio_bytes_per_sec: f64,
    /// kvtier / fio at the main depth.
    pub ratio: f64,
    /// fio's best configuration at the main depth, bytes per second (NaN when it could not
    /// run): the device reference.
    pub fio_best_bytes_per_sec: f64,
    /// kvtier / fio's best.
    pub ratio_to_best: f64,
    /// kvtier's CPU seconds per GB at the main depth.
    pub kvtier_cpu_seconds_per_gb: f64,
    /// fio's CPU seconds per GB at the main depth.
    pub fio_cpu_seconds_per_gb: f64,
    /// fio's best configuration's CPU seconds per GB at the main depth.
    pub fio_best_cpu_seconds_per_gb: f64,
    /// Bytes per I/O.
    pub row_size: u64,
    /// Rows in flight per direction.
    pub iodepth: u32,
    /// Bytes of each side's file(s), over all paths.
    pub file_size: u64,
    /// Directories tested.
    pub paths: Vec<PathBuf>,
    /// How the files were prepared (both sides alike).
    pub file_state: &'static str,
    /// `g3` (the tier's data path) or `engine` (the I/O engine on a plain file).
    pub kvtier_side: &'static str,
    /// Alternating pairs per point.
    pub pairs: usize,
    /// kvtier's buffer rows: `own`, `vllm` or `vllm-4k`.
    pub kvtier_region: &'static str,
    /// How they were backed (`2 MiB pages`, `4 KiB pages (why)`).
    pub kvtier_pages: String,
    /// kvtier's engine as it ran (`uring`, fixed buffers or not, O_DIRECT).
    pub kvtier_engine: String,
    /// fio's memory and batching beside kvtier.
    pub fio_setup: FioSetup,
    /// Whether fio's memory is the same kind as kvtier's rows.
    pub fio_like_for_like: bool,
    /// Why not, or what was done (hugetlb pages reserved, best configuration unavailable).
    pub fio_note: Option<String>,
    /// fio's best configuration on the path, when it could run.
    pub fio_best_setup: Option<FioSetup>,
    /// `fio --version`.
    pub fio_version: String,
    /// Samples at the main depth.
    pub kvtier_samples: Vec<f64>,
    /// Samples at the main depth.
    pub fio_samples: Vec<f64>,
    /// Each round's kvtier/reference ratio (see `DepthPoint::pair_ratios`).
    pub pair_ratios: Vec<f64>,
    /// Their spread, (max - min) / median; `pair_ratios.len()` rounds ran (more than
    /// `pairs` when the spread was wide).
    pub ratio_spread: f64,
    /// What the block device saw during kvtier's passes at the main depth (medians).
    pub kvtier_device: Option<DeviceView>,
    /// The same for the reference (see `DepthPoint::fio_device`).
    pub fio_device: Option<DeviceView>,
    /// The block devices those figures are summed over.
    pub devices: Vec<String>,
    /// fio checking what it loads at the main depth (`--fio-verify`, load only; absent
    /// otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fio_verify: Option<VerifyingFio>,
    /// The depth sweep (with `--plot`), ascending depth.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub sweep: Vec<DepthPoint>,
}

pub(crate) fn render_report(
    plan: &Plan,
    results: &[ProfileComparison],
    fio_version: &str,
) -> String {
    let mut out = render_preamble(plan, results, fio_version);
    let mut table = Table::new(std::iter::once("profile").chain(HEADER));
    for r in results {
        let c = cells(
            [
                r.kvtier_bytes_per_sec,
                r.kvtier_cpu_seconds_per_gb,
                r.fio_bytes_per_sec,
                r.fio_cpu_seconds_per_gb,
                r.ratio,
                r.fio_best_bytes_per_sec,
                r.fio_best_cpu_seconds_per_gb,
                r.ratio_to_best,
                r.ratio_spread,
            ],
            r.pair_ratios.len(),
        );
        table.row(std::iter::once(r.profile.to_string()).chain(c));
    }
    out.push_str(&table.render());
    out.push_str(&render_devices(results));
    if results.iter().any(|r| !r.sweep.is_empty()) {
        out.push('\n');
        out.push_str(&render_sweep(results));
    }
    out.push_str(&render_verifying(results));
    out
}

/// What the block device saw, per profile: kvtier's passes and the reference's (empty
/// without a block device).
fn render_devices(results: &[ProfileComparison]) -> String {
    let Some(first) = results.iter().find(|r| r.kvtier_device.is_some()) else {
        return String::new();
    };
    let mut out = format!(
        "\ndevice ({}, medians): requests in the device while busy, latency per request, bytes \
         per request after merging (docs/performance.md)\n",
        first.devices.join(", ")
    );
    let view = |v: &Option<DeviceView>| match v {
        Some(v) => format!(
            "{}, {}",
            queue_and_latency(v),
            format_size(v.request_bytes.round() as u64)
        ),
        None => "-".to_string(),
    };
    for r in results {
        out.push_str(&format!(
            "  {:<6} kvtier {} | reference {}\n",
            r.profile,
            view(&r.kvtier_device),
            view(&r.fio_device)
        ));
    }
    out
}

/// A device view's requests queued while busy and latency per request, as the report prints
/// them.
fn queue_and_latency(v: &DeviceView) -> String {
    format!(
        "{:.1} queued, {:.0} us",
        v.queue_while_busy, v.request_latency_us
    )
}

/// fio checking what it loads (`--fio-verify`), per profile that ran it and, with `--plot`,
/// per sweep point (empty without it).
fn render_verifying(results: &[ProfileComparison]) -> String {
    if results.iter().all(|r| r.fio_verify.is_none()) {
        return String::new();
    }
    let mut out = String::from(
        "\nfio checking what it loads (--fio-verify: verify=crc32c on every block read, fio \
         best's memory and batching), medians:\n",
    );
    let line = |label: String, v: &VerifyingFio| {
        let device = v.device.map_or_else(String::new, |d| {
            format!("; device {}", queue_and_latency(&d))
        });
        format!(
            "  {label} fio verifying {}, CPU {:.3} s/GB; kvtier/that {:.3}{device}\n",
            format_gbps(v.bytes_per_sec),
            v.cpu_seconds_per_gb,
            v.ratio
        )
    };
    for r in results {
        if r.sweep.is_empty() {
            if let Some(v) = &r.fio_verify {
                out.push_str(&line(format!("{:<6}", r.profile), v));
            }
            continue;
        }
        for p in &r.sweep {
            if let Some(v) = &p.fio_verify {
                let at = format!("{} {} x {}:", r.profile, format_size(p.row_size), p.iodepth);
                out.push_str(&line(at, v));
            }
        }
    }
    out
}

/// The columns of both tables after their first ones.
const HEADER: [&str; 9] = [
    "kvtier",
    "CPU s/GB",
    "fio",
    "CPU s/GB",
    "kvtier/fio",
    "fio best",
    "CPU s/GB",
    "kvtier/best",
    "spread",
];

/// What ran and how (rows, depth, files, both sides' memory, the notes on CPU and spread).
fn render_preamble(plan: &Plan, results: &[ProfileComparison], fio_version: &str) -> String {
    let mut out = format!(
        "fio-compare: {} rows, depth {} ({} in flight), {} per side on {}, {} rounds (order \
         rotating)\n",
        format_size(plan.row_size),
        plan.depth,
        format_size(plan.row_size * u64::from(plan.depth)),
        format_size(plan.per_file * plan.paths.len() as u64),
        display_paths(&plan.paths),
        plan.pairs
    );
    out.push_str(&format!("file state: {}\n", plan.file_state));
    if let Some(r) = results.first() {
        out.push_str(&format!(
            "kvtier: {} region, {}\nfio: {} ({fio_version}){}\n",
            r.kvtier_region,
            r.kvtier_engine,
            r.fio_setup.describe(),
            if r.fio_like_for_like {
                ", same kind of memory as kvtier's rows"
            } else {
                ""
            }
        ));
        match &r.fio_best_setup {
            Some(b) => out.push_str(&format!("fio best (device reference): {}\n", b.describe())),
            None => out.push_str("fio best (device reference): could not run\n"),
        }
        if let Some(note) = &r.fio_note {
            out.push_str(&format!("note: {note}\n"));
        }
        out.push_str(
            "CPU: core-seconds per GB moved (kvtier: the whole process, CRC32 of every row \
             included on the G3 side; fio: its job threads' usr + sys). Completion work in \
             interrupt context (hard and soft IRQ) is charged to whatever task it interrupts, \
             seldom the one waiting for the I/O: neither figure holds all of it, which is why \
             fio's load figure reads near 0 (docs/performance.md)\n\
             spread: (max - min) / median of each round's kvtier/reference ratio (the rounds \
             run in brackets); above 10 % more rounds are taken, up to 3 x --pairs\n\n",
        );
    }
    out
}

/// The [`HEADER`] cells of one row: kvtier, fio and fio's best (speed and CPU s/GB), the two
/// ratios and the spread over `rounds` rounds; `-` where a figure is missing.
fn cells(figures: [f64; 9], rounds: usize) -> [String; 9] {
    let [k, kc, f, fc, ratio, b, bc, rb, spread] = figures;
    let num = |v: f64, digits: usize| {
        if v.is_finite() {
            format!("{v:.digits$}")
        } else {
            "-".to_string()
        }
    };
    let speed = |v: f64| {
        if v.is_finite() {
            format_gbps(v)
        } else {
            "-".to_string()
        }
    };
    [
        speed(k),
        num(kc, 3),
        speed(f),
        num(fc, 3),
        num(ratio, 3),
        speed(b),
        num(bc, 3),
        num(rb, 3),
        if spread.is_finite() {
            format!("{:.0} % ({rounds})", spread * 100.0)
        } else {
            "-".to_string()
        },
    ]
}

/// The `--plot` sweep as a table (profile, row size, depth), fio's memory named, and a note
/// under it for each point where fio's memory was not like kvtier's.
fn render_sweep(results: &[ProfileComparison]) -> String {
    let mut sweep = Table::new(
        ["profile", "row", "depth"]
            .into_iter()
            .chain(HEADER)
            .chain(["fio memory"]),
    );
    let mut unlike: Vec<String> = Vec::new();
    for r in results {
        for p in &r.sweep {
            let c = cells(
                [
                    p.kvtier_bytes_per_sec,
                    p.kvtier_cpu_seconds_per_gb,
                    p.fio_bytes_per_sec,
                    p.fio_cpu_seconds_per_gb,
                    p.ratio,
                    p.fio_best_bytes_per_sec,
                    p.fio_best_cpu_seconds_per_gb,
                    p.ratio_to_best,
                    p.ratio_spread,
                ],
                p.pair_ratios.len(),
            );
            let memory = if p.fio_like_for_like {
                p.fio_setup.memory.short().to_string()
            } else {
                format!("{} (NOT like for like *)", p.fio_setup.memory.short())
            };
            sweep.row(
                [
                    r.profile.to_string(),
                    format_size(p.row_size),
                    p.iodepth.to_string(),
                ]
                .into_iter()
                .chain(c)
                .chain([memory]),
            );
            if !p.fio_like_for_like {
                unlike.push(format!(
                    "* {} {} x {}: {}",
                    r.profile,
                    format_size(p.row_size),
                    p.iodepth,
                    p.fio_note.as_deref().unwrap_or("fio's memory differs")
                ));
            }
        }
    }
    let mut out = sweep.render();
    for line in unlike {
        out.push_str(&line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::parse_for_test;
    use crate::fio::memory::{FioMemory, FioSetup};

    fn point(depth: u32, like_for_like: bool) -> DepthPoint {
        let memory = if like_for_like {
            FioMemory::ShmHuge
        } else {
            FioMemory::Malloc
        };
        DepthPoint {
            row_size: 2 << 20,
            iodepth: depth,
            kvtier_bytes_per_sec: 1e9,
            fio_bytes_per_sec: 2e9,
            ratio: 0.5,
            fio_best_bytes_per_sec: if like_for_like { 2e9 } else { f64::NAN },
            ratio_to_best: if like_for_like { 0.5 } else { f64::NAN },
            kvtier_cpu_seconds_per_gb: 0.1,
            fio_cpu_seconds_per_gb: 0.05,
            fio_best_cpu_seconds_per_gb: 0.05,
            kvtier_samples: vec![1e9],
            fio_samples: vec![2e9],
            fio_best_samples: Vec::new(),
            fio_setup: FioSetup { memory, batch: 0 },
            fio_like_for_like: like_for_like,
            fio_note: (!like_for_like).then(|| {
                "NOT like for like: only 286 of the 514 hugetlb pages fio needs could be reserved"
                    .to_string()
            }),
            fio_best_setup: None,
            kvtier_pages: "2 MiB pages".into(),
            kvtier_engine: "G3 tier".into(),
            pair_ratios: vec![0.5],
            ratio_spread: 0.0,
            kvtier_device: None,
            fio_device: None,
            devices: Vec::new(),
            fio_verify: None,
        }
    }

    /// The comparison of `profile` whose main point is `main`, sweeping `sweep`.
    fn comparison(
        plan: &Plan,
        profile: &'static str,
        main: &DepthPoint,
        sweep: Vec<DepthPoint>,
    ) -> ProfileComparison {
        ProfileComparison {
            profile,
            kvtier_bytes_per_sec: main.kvtier_bytes_per_sec,
            fio_bytes_per_sec: main.fio_bytes_per_sec,
            ratio: main.ratio,
            fio_best_bytes_per_sec: main.fio_best_bytes_per_sec,
            ratio_to_best: main.ratio_to_best,
            kvtier_cpu_seconds_per_gb: 0.1,
            fio_cpu_seconds_per_gb: 0.05,
            fio_best_cpu_seconds_per_gb: 0.05,
            row_size: main.row_size,
            iodepth: main.iodepth,
            file_size: 1 << 30,
            paths: plan.paths.clone(),
            file_state: plan.file_state,
            kvtier_side: "g3",
            pairs: 3,
            kvtier_region: "own",
            kvtier_pages: "2 MiB pages".into(),
            kvtier_engine: "G3 tier".into(),
            fio_setup: main.fio_setup.clone(),
            fio_like_for_like: main.fio_like_for_like,
            fio_note: main.fio_note.clone(),
            fio_best_setup: None,
            fio_version: "fio-3.33".into(),
            kvtier_samples: vec![1e9],
            fio_samples: vec![2e9],
            pair_ratios: vec![0.5],
            ratio_spread: 0.0,
            kvtier_device: main.kvtier_device,
            fio_device: None,
            devices: vec!["vda".into()],
            fio_verify: main.fio_verify.clone(),
            sweep,
        }
    }

    /// A sweep point whose hugetlb pages could not be had is kept, marked and explained; the
    /// others stay like for like.
    #[test]
    fn sweep_marks_points_fio_could_not_run_like_for_like() {
        let plan =
            Plan::from_args(&parse_for_test(&["--plot", "x.svg", "--depths", "1"])).expect("plan");
        let (like, unlike) = (point(1, true), point(32, false));
        let mut main = unlike.clone();
        main.kvtier_device = Some(DeviceView {
            queue_while_busy: 27.64,
            request_latency_us: 1260.4,
            request_bytes: 65_536.0,
            requests: 16_384,
        });
        let result = comparison(&plan, "store", &main, vec![like, unlike]);
        let text = render_report(&plan, &[result], "fio-3.33");
        let marked: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("NOT like for like *"))
            .collect();
        assert_eq!(marked.len(), 1, "{text}");
        assert!(marked[0].contains("malloc"), "{text}");
        assert!(
            text.lines()
                .any(|l| l.starts_with("* store 2 MiB x 32:") && l.contains("286 of the 514")),
            "{text}"
        );
        assert!(
            text.contains("fio best (device reference): could not run"),
            "{text}"
        );
        assert!(text.contains("\ndevice (vda, medians): "), "{text}");
        assert!(
            text.lines()
                .any(|l| l == "  store  kvtier 27.6 queued, 1260 us, 64 KiB | reference -"),
            "{text}"
        );
        assert!(!text.contains("fio checking what it loads"), "{text}");
    }

    /// fio checking what it loads is reported, in the table's notes and the JSON, only where
    /// it ran (`--fio-verify`, load points).
    #[test]
    fn fio_checking_what_it_loads_is_reported_where_it_ran() {
        let plan = Plan::from_args(&parse_for_test(&["--fio-verify"])).expect("plan");
        let mut load = point(32, true);
        load.fio_verify = Some(VerifyingFio {
            bytes_per_sec: 1.25e9,
            cpu_seconds_per_gb: 0.0914,
            ratio: 0.8,
            samples: vec![1.25e9],
            device: Some(DeviceView {
                queue_while_busy: 30.96,
                request_latency_us: 1480.2,
                request_bytes: 65_536.0,
                requests: 8_192,
            }),
        });
        let store = point(32, true);
        let results = [
            comparison(&plan, "store", &store, Vec::new()),
            comparison(&plan, "load", &load, Vec::new()),
        ];
        let text = render_report(&plan, &results, "fio-3.33");
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("fio verifying"))
            .collect();
        assert_eq!(
            lines,
            [
                "  load   fio verifying 1.25 GB/s, CPU 0.091 s/GB; kvtier/that 0.800; device \
                 31.0 queued, 1480 us"
            ],
            "{text}"
        );
        let json = serde_json::to_value(&results).unwrap();
        assert!(
            json[0].get("fio_verify").is_none(),
            "absent where it did not run"
        );
        assert_eq!(json[1]["fio_verify"]["bytes_per_sec"], 1.25e9);
        assert_eq!(json[1]["fio_verify"]["ratio"], 0.8);
        assert_eq!(json[1]["fio_verify"]["device"]["requests"], 8_192);
    }
}
