//! The report of `kvtier fio-compare`: the `--json` objects and the human tables.

use std::path::PathBuf;

use serde::Serialize;

use crate::cli::fio::plan::Plan;
use crate::cli::output::{Table, display_paths};
use crate::cli::size::{format_gbps, format_size};

/// One measured point: medians of alternating runs.
#[derive(Debug, Clone, Serialize)]
pub struct DepthPoint {
    /// Rows in flight per direction.
    pub iodepth: u32,
    /// Median kvtier throughput, bytes per second.
    pub kvtier_bytes_per_sec: f64,
    /// Median fio throughput, bytes per second.
    pub fio_bytes_per_sec: f64,
    /// kvtier / fio.
    pub ratio: f64,
    /// Every kvtier pass, in run order.
    pub kvtier_samples: Vec<f64>,
    /// Every fio pass, in run order.
    pub fio_samples: Vec<f64>,
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
    /// kvtier's engine as it ran (`uring`, fixed buffers or not, O_DIRECT).
    pub kvtier_engine: String,
    /// `fio --version`.
    pub fio_version: String,
    /// Samples at the main depth.
    pub kvtier_samples: Vec<f64>,
    /// Samples at the main depth.
    pub fio_samples: Vec<f64>,
    /// The depth sweep (with `--plot`), ascending depth.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub sweep: Vec<DepthPoint>,
}

pub(crate) fn render_report(
    plan: &Plan,
    results: &[ProfileComparison],
    fio_version: &str,
) -> String {
    let mut out = format!(
        "fio-compare: {} rows, depth {} ({} in flight), {} per side on {}, {} alternating pairs\n",
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
            "kvtier: {}; fio: {fio_version}\n\n",
            r.kvtier_engine
        ));
    }
    let mut table = Table::new(["profile", "kvtier", "fio", "kvtier/fio"]);
    for r in results {
        table.row([
            r.profile.to_string(),
            format_gbps(r.kvtier_bytes_per_sec),
            format_gbps(r.fio_bytes_per_sec),
            format!("{:.3}", r.ratio),
        ]);
    }
    out.push_str(&table.render());
    if results.iter().any(|r| !r.sweep.is_empty()) {
        out.push('\n');
        let mut sweep = Table::new(["profile", "depth", "kvtier", "fio", "kvtier/fio"]);
        for r in results {
            for p in &r.sweep {
                sweep.row([
                    r.profile.to_string(),
                    p.iodepth.to_string(),
                    format_gbps(p.kvtier_bytes_per_sec),
                    format_gbps(p.fio_bytes_per_sec),
                    format!("{:.3}", p.ratio),
                ]);
            }
        }
        out.push_str(&sweep.render());
    }
    out
}
