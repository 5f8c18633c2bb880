//! What `kvtier replay` prints: the counts, the tier's bytes, load latency and device busy
//! time, as text or `--json`.

use std::path::Path;

use crate::output::outln;
use crate::replay::driver::{Counts, Outcome};
use crate::size::format_size;
use crate::stats::percentile_sorted;
use kvtier::error::Result;

/// The report (`--json` prints it as is).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// The trace file.
    pub trace: String,
    /// Bytes of each block's row, and of what the tier stores of it.
    pub bytes_per_block: u64,
    /// Distinct full blocks of the trace.
    pub unique_blocks: u64,
    /// Primary rows.
    pub primary_blocks: u64,
    /// Tier slots.
    pub tier_blocks: u64,
    /// The tier's admission policy.
    pub admission: String,
    /// The tier's eviction policy (`lru` or `arc`).
    pub tier_eviction: String,
    /// The counts.
    #[serde(flatten)]
    pub counts: Counts,
    /// Prompt tokens served instead of computed (primary and tier).
    pub prefill_tokens_saved: u64,
    /// Of which from the tier.
    pub prefill_tokens_saved_tier: u64,
    /// Share of block references the tier served.
    pub tier_hit_ratio: f64,
    /// Slab bytes the tier wrote.
    pub nvme_bytes_written: u64,
    /// Slab bytes the tier read.
    pub nvme_bytes_read: u64,
    /// Bytes written per byte read back (`null` when nothing was read).
    pub write_amplification: Option<f64>,
    /// Keys the tier's admission policy admitted and rejected.
    pub admitted_blocks: u64,
    /// Keys rejected.
    pub rejected_blocks: u64,
    /// Keys admitted without a decision (the tier's index was busy or recovering).
    pub unchecked_blocks: u64,
    /// Lookup to loaded, seconds, of the blocks the tier served: p50.
    pub load_latency_p50_s: Option<f64>,
    /// p99.
    pub load_latency_p99_s: Option<f64>,
    /// Wall time of the replay, seconds.
    pub wall_s: f64,
    /// Time the tier's block device was busy during the replay (its `io_ticks`), seconds;
    /// `null` when the path is on no block device the kernel reports.
    pub device_busy_s: Option<f64>,
    /// Why `device_busy_s` is missing.
    pub device_busy_note: Option<String>,
}

/// The tier's own counters the report needs.
#[derive(Debug, Clone, Copy, Default)]
pub struct TierBytes {
    /// `g3_bytes_written`.
    pub written: u64,
    /// `g3_bytes_read`.
    pub read: u64,
    /// `g3_admission_blocks{outcome="admitted"}`.
    pub admitted: u64,
    /// `g3_admission_blocks{outcome="rejected"}`.
    pub rejected: u64,
    /// `g3_admission_blocks{outcome="unchecked"}`.
    pub unchecked: u64,
}

impl Report {
    /// Fills the derived figures.
    pub fn new(base: ReportBase, outcome: &Outcome, tier: TierBytes) -> Self {
        let mut lat = outcome.load_latencies.clone();
        lat.sort_by(f64::total_cmp);
        let c = outcome.counts.clone();
        let refs = c.block_references.max(1) as f64;
        Report {
            trace: base.trace,
            bytes_per_block: base.bytes_per_block,
            unique_blocks: base.unique_blocks,
            primary_blocks: base.primary_blocks,
            tier_blocks: base.tier_blocks,
            admission: base.admission,
            tier_eviction: base.tier_eviction,
            prefill_tokens_saved: c.tokens_saved(),
            prefill_tokens_saved_tier: c.tokens_saved_tier(),
            tier_hit_ratio: c.served_tier as f64 / refs,
            nvme_bytes_written: tier.written,
            nvme_bytes_read: tier.read,
            write_amplification: (tier.read > 0).then(|| tier.written as f64 / tier.read as f64),
            admitted_blocks: tier.admitted,
            rejected_blocks: tier.rejected,
            unchecked_blocks: tier.unchecked,
            load_latency_p50_s: percentile_sorted(&lat, 50.0),
            load_latency_p99_s: percentile_sorted(&lat, 99.0),
            wall_s: base.wall_s,
            device_busy_s: base.device_busy.as_ref().ok().copied(),
            device_busy_note: base.device_busy.err(),
            counts: c,
        }
    }

    /// Prints the report for people.
    pub fn print(&self) -> Result<()> {
        let c = &self.counts;
        let pct = |n: u64| 100.0 * n as f64 / c.block_references.max(1) as f64;
        outln!("trace            {}", self.trace)?;
        outln!(
            "requests         {} ({} prompt tokens, {} full-block references, {} unique blocks)",
            c.requests,
            c.input_tokens,
            c.block_references,
            self.unique_blocks
        )?;
        outln!(
            "stack            primary {} blocks, tier {} blocks of {} (admission {}, eviction {})",
            self.primary_blocks,
            self.tier_blocks,
            format_size(self.bytes_per_block),
            self.admission,
            self.tier_eviction
        )?;
        outln!(
            "served           primary {} ({:.1} %), tier {} ({:.1} %), recomputed {} ({:.1} %)",
            c.served_primary,
            pct(c.served_primary),
            c.served_tier,
            pct(c.served_tier),
            c.recomputed,
            pct(c.recomputed)
        )?;
        outln!(
            "prefill saved    {} tokens ({} from the tier) of {}",
            self.prefill_tokens_saved,
            self.prefill_tokens_saved_tier,
            c.input_tokens
        )?;
        let wa = self
            .write_amplification
            .map_or_else(|| "n/a (nothing read)".to_string(), |w| format!("{w:.2}"));
        outln!(
            "nvme             written {}, read {}, write amplification {wa}",
            format_size(self.nvme_bytes_written),
            format_size(self.nvme_bytes_read)
        )?;
        outln!(
            "admission        {} blocks admitted, {} rejected, {} unchecked (index busy)",
            self.admitted_blocks,
            self.rejected_blocks,
            self.unchecked_blocks
        )?;
        let ms =
            |v: Option<f64>| v.map_or_else(|| "n/a".to_string(), |s| format!("{:.3} ms", s * 1e3));
        outln!(
            "load latency     p50 {}, p99 {} (lookup to loaded)",
            ms(self.load_latency_p50_s),
            ms(self.load_latency_p99_s)
        )?;
        let busy = match (self.device_busy_s, &self.device_busy_note) {
            (Some(s), _) => format!("{s:.2} s"),
            (None, Some(why)) => format!("n/a ({why})"),
            (None, None) => "n/a".to_string(),
        };
        outln!(
            "time             {:.2} s wall, device busy {busy}",
            self.wall_s
        )?;
        outln!(
            "verified         {} bytes loaded, every one as stored; {} load failures, {} stores refused",
            c.bytes_verified,
            c.load_failures,
            c.stores_refused
        )?;
        Ok(())
    }
}

/// The facts of the run the report repeats.
#[derive(Debug, Clone)]
pub struct ReportBase {
    /// The trace file.
    pub trace: String,
    /// Row bytes.
    pub bytes_per_block: u64,
    /// Distinct full blocks.
    pub unique_blocks: u64,
    /// Primary rows.
    pub primary_blocks: u64,
    /// Tier slots.
    pub tier_blocks: u64,
    /// Admission policy name.
    pub admission: String,
    /// Tier eviction policy name.
    pub tier_eviction: String,
    /// Wall seconds.
    pub wall_s: f64,
    /// Device busy seconds, or why unknown.
    pub device_busy: std::result::Result<f64, String>,
}

/// The kernel's busy time (`io_ticks`, ms) of the block device holding `path`, or why it is
/// unknown.
pub fn io_ticks_ms(path: &Path) -> std::result::Result<u64, String> {
    crate::block_device::counters_of(path).map(|c| c.busy_ms)
}
