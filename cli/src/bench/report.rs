//! The report of `kvtier bench`: the `--json` schema and the human table.

use std::path::PathBuf;

use serde::Serialize;

use crate::output::Table;
use crate::size::{format_gbps, format_size};
use crate::stats::{median, spread_of};
use kvtier::size::count;

/// Timing of one direction.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PhaseReport {
    /// Bytes moved (whole rows).
    pub bytes: u64,
    /// Wall time from the first job submitted to the last one finished.
    pub seconds: f64,
    /// `bytes / seconds / 1e9`.
    pub gb_per_s: f64,
    /// Jobs (one per batch of chunks).
    pub jobs: usize,
    /// Chunks per job.
    pub chunks_per_job: usize,
    /// Median job latency (submission to completion seen), milliseconds.
    pub job_latency_p50_ms: f64,
    /// 99th percentile job latency, milliseconds.
    pub job_latency_p99_ms: f64,
    /// User + system CPU seconds of the whole process during the phase.
    pub cpu_seconds: f64,
    /// CPU seconds per GB (10^9 bytes) moved.
    pub cpu_seconds_per_gb: f64,
}

/// The layout the rows were sized for.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct LayoutReport {
    /// Model name.
    pub model: String,
    /// TP size.
    pub tp: u32,
    /// GPU blocks per chunk.
    pub blocks_per_chunk: u32,
    /// Tokens per chunk.
    pub tokens_per_chunk: u32,
    /// Bytes per primary row and G3 slot.
    pub row_stride: u64,
    /// The page encoding (`packed NHD`) of the layer tensors a canonical gather works with,
    /// derived from those kvtier allocates as vLLM's allocator does, checked against the
    /// descriptor.
    pub page_encoding: String,
    /// Where [`LayoutReport::page_encoding`] came from: `allocated`, or `descriptor` for a
    /// layout vLLM's certified views do not cover.
    pub page_encoding_source: &'static str,
    /// The namespace digest written into the slab superblocks (hex).
    pub namespace: String,
}

/// The tier as it ran.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TierReport {
    /// Tier directories.
    pub paths: Vec<PathBuf>,
    /// Capacity over all paths.
    pub capacity_bytes: u64,
    /// Cap on bytes in flight.
    pub max_bytes_in_flight: u64,
    /// The I/O engine in use (`uring`, `psync`).
    pub io_engine: String,
    /// `direct` when every path uses O_DIRECT, else `buffered` (or `mixed`).
    pub direct_io: String,
    /// Whether the tier was kept.
    pub kept: bool,
}

/// `kvtier bench --json`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BenchReport {
    /// Layout.
    pub layout: LayoutReport,
    /// Tier.
    pub tier: TierReport,
    /// The primary region of the first (or only) run: `own`, `vllm` or `vllm-4k`.
    pub region: &'static str,
    /// How its rows are backed: `2 MiB pages` or `4 KiB pages (why)`.
    pub region_pages: String,
    /// Chunks stored and loaded (per run).
    pub chunks: u64,
    /// Primary -> G3.
    pub store: PhaseReport,
    /// G3 -> primary.
    pub load: PhaseReport,
    /// Chunks whose every byte matched.
    pub chunks_verified: u64,
    /// Chunks that loaded with different bytes.
    pub chunks_mismatched: u64,
    /// Chunks that did not come back (store or promotion failed).
    pub chunks_missing: u64,
    /// True iff every chunk of every run was verified.
    pub ok: bool,
    /// With several `--region`s or `--rounds`: each region's medians over the rounds, and
    /// its rounds (the top-level `store`, `load` and chunk counts are the first region's
    /// first round).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub regions: Vec<RegionSummary>,
}

/// One region's store and load in one round.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RegionRound {
    /// Primary -> G3.
    pub store: PhaseReport,
    /// G3 -> primary.
    pub load: PhaseReport,
}

/// One region over all rounds.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RegionSummary {
    /// `own`, `vllm` or `vllm-4k`.
    pub region: &'static str,
    /// How its rows were backed.
    pub pages: String,
    /// Median store throughput, GB/s.
    pub store_gb_per_s: f64,
    /// Median load throughput, GB/s.
    pub load_gb_per_s: f64,
    /// Median store CPU seconds per GB.
    pub store_cpu_seconds_per_gb: f64,
    /// Median load CPU seconds per GB.
    pub load_cpu_seconds_per_gb: f64,
    /// Spread of the store throughput over the rounds: (max - min) / median.
    pub store_spread: f64,
    /// Spread of the load throughput over the rounds: (max - min) / median.
    pub load_spread: f64,
    /// Every round, in run order.
    pub rounds: Vec<RegionRound>,
}

impl RegionSummary {
    /// An empty summary for `region`.
    pub fn new(region: &'static str) -> Self {
        RegionSummary {
            region,
            pages: String::new(),
            store_gb_per_s: f64::NAN,
            load_gb_per_s: f64::NAN,
            store_cpu_seconds_per_gb: f64::NAN,
            load_cpu_seconds_per_gb: f64::NAN,
            store_spread: f64::NAN,
            load_spread: f64::NAN,
            rounds: Vec::new(),
        }
    }

    /// Sets the medians from the rounds.
    pub fn compute_medians(&mut self) {
        let med = |f: &dyn Fn(&RegionRound) -> f64| {
            let v: Vec<f64> = self.rounds.iter().map(f).collect();
            median(&v).unwrap_or(f64::NAN)
        };
        self.store_gb_per_s = med(&|r| r.store.gb_per_s);
        self.load_gb_per_s = med(&|r| r.load.gb_per_s);
        self.store_cpu_seconds_per_gb = med(&|r| r.store.cpu_seconds_per_gb);
        self.load_cpu_seconds_per_gb = med(&|r| r.load.cpu_seconds_per_gb);
        let spread = |f: &dyn Fn(&RegionRound) -> f64| {
            spread_of(&self.rounds.iter().map(f).collect::<Vec<f64>>())
        };
        self.store_spread = spread(&|r| r.store.gb_per_s);
        self.load_spread = spread(&|r| r.load.gb_per_s);
    }
}

/// The human report.
pub fn render(r: &BenchReport) -> String {
    let mut out = format!(
        "kvtier bench: {} of {} ({}, TP {}, {} tokens per chunk, {} pages from the {}) = {}\n",
        count(r.chunks, "chunk"),
        format_size(r.layout.row_stride),
        r.layout.model,
        r.layout.tp,
        r.layout.tokens_per_chunk,
        r.layout.page_encoding,
        match r.layout.page_encoding_source {
            "allocated" => "tensors as vLLM allocates them",
            _ => "descriptor",
        },
        format_size(r.chunks * r.layout.row_stride)
    );
    let paths: Vec<String> = r
        .tier
        .paths
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    out.push_str(&format!(
        "tier: {} ({} capacity), engine {}, direct I/O: {}, {} in flight\n\n",
        paths.join(", "),
        format_size(r.tier.capacity_bytes),
        r.tier.io_engine,
        r.tier.direct_io,
        format_size(r.tier.max_bytes_in_flight)
    ));
    let mut t = Table::new([
        "phase",
        "throughput",
        "job p50",
        "job p99",
        "jobs",
        "CPU s/GB",
    ]);
    for (name, p) in [("store", &r.store), ("load", &r.load)] {
        t.row([
            name.to_string(),
            format_gbps(p.bytes as f64 / p.seconds.max(1e-9)),
            format!("{:.2} ms", p.job_latency_p50_ms),
            format!("{:.2} ms", p.job_latency_p99_ms),
            format!("{} x {}", p.jobs, p.chunks_per_job),
            format!("{:.3}", p.cpu_seconds_per_gb),
        ]);
    }
    out.push_str(&t.render());
    out.push_str(&format!("region: {} ({})\n", r.region, r.region_pages));
    if !r.regions.is_empty() {
        let rounds = r.regions.first().map_or(0, |s| s.rounds.len());
        out.push_str(&format!(
            "\nregions side by side (medians of {}, alternating order):\n",
            count(rounds as u64, "round")
        ));
        // Ratios against the `own` region, or the first one when `own` did not run.
        let own = r
            .regions
            .iter()
            .find(|x| x.region == "own")
            .or(r.regions.first());
        let ratio = |x: f64, b: Option<f64>| match b {
            Some(b) if b > 0.0 => format!("{:.2}", x / b),
            _ => "-".to_string(),
        };
        let mut t = Table::new([
            "region",
            "store",
            "store CPU s/GB",
            "load",
            "load CPU s/GB",
            "store/own",
            "load/own",
            "spread st/ld",
            "pages",
        ]);
        for s in &r.regions {
            t.row([
                s.region.to_string(),
                format_gbps(s.store_gb_per_s * 1e9),
                format!("{:.3}", s.store_cpu_seconds_per_gb),
                format_gbps(s.load_gb_per_s * 1e9),
                format!("{:.3}", s.load_cpu_seconds_per_gb),
                ratio(s.store_gb_per_s, own.map(|o| o.store_gb_per_s)),
                ratio(s.load_gb_per_s, own.map(|o| o.load_gb_per_s)),
                format!(
                    "{:.0} % / {:.0} %",
                    s.store_spread * 100.0,
                    s.load_spread * 100.0
                ),
                // The reason is in the log and in `--json`; the table keeps the measure.
                s.pages
                    .split_once(": ")
                    .map_or(s.pages.as_str(), |(short, _)| short)
                    .to_string(),
            ]);
        }
        out.push_str(&t.render());
    }
    out.push_str(&format!(
        "\nchunks verified: {} / {}{}\n",
        r.chunks_verified,
        r.chunks,
        if r.ok { " (every byte matches)" } else { "" }
    ));
    if r.tier.kept {
        out.push_str(&format!(
            "tier kept at {} (kvtier tier inspect {})\n",
            paths.join(", "),
            paths.join(" ")
        ));
    }
    out
}
