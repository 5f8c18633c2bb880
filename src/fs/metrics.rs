//! The `fs` tier's own metrics: atomics updated by its threads, sampled by
//! [`crate::contract::secondary::SecondaryTier::metrics`]. Labels come from small fixed sets.

use std::sync::atomic::{AtomicBool, AtomicU64};

use parking_lot::Mutex;

use crate::contract::secondary::{
    MetricRow, TierMetric,
    TierMetricKind::{Counter, Gauge},
    sampled, sampled_flag,
};

/// Counters and gauges of one `fs` tier.
#[derive(Debug, Default)]
pub struct FsMetrics {
    /// Bytes of chunk transfers admitted and not finished.
    pub bytes_in_flight: AtomicU64,
    /// Jobs waiting to start.
    pub queued_jobs: AtomicU64,
    /// Jobs started and not finished.
    pub active_jobs: AtomicU64,
    /// Jobs refused because the queue was full.
    pub jobs_rejected: AtomicU64,
    /// Queued jobs cancelled by a drain.
    pub jobs_cancelled: AtomicU64,
    /// Files this process published.
    pub files_stored: AtomicU64,
    /// Stores found the file already there (published by another writer meanwhile).
    pub store_races: AtomicU64,
    /// Store keys skipped because the file was known or found.
    pub stores_skipped: AtomicU64,
    /// Files loaded whose CRC record matched.
    pub files_loaded_verified: AtomicU64,
    /// Files loaded without a CRC record (written by vLLM, or `integrity = none`).
    pub files_loaded_unverified: AtomicU64,
    /// Loads whose bytes failed their CRC.
    pub checksum_failures: AtomicU64,
    /// Loads of a file of the wrong size or with an unreadable record.
    pub corrupt_files: AtomicU64,
    /// Loads of a file that was not there (removed by another host, or never stored).
    pub missing_files: AtomicU64,
    /// Keys whose store or load failed (any reason).
    pub key_failures: AtomicU64,
    /// Failed file operations (open, transfer, xattr, rename, sync).
    pub io_errors: AtomicU64,
    /// Bytes written to chunk files.
    pub bytes_written: AtomicU64,
    /// Bytes read from chunk files.
    pub bytes_read: AtomicU64,
    /// Files removed to stay within the capacity.
    pub evictions: AtomicU64,
    /// Evictions whose unlink failed (other than the file being gone already).
    pub eviction_failures: AtomicU64,
    /// Evictions handed to the I/O threads and not yet done.
    pub evictions_in_flight: AtomicU64,
    /// Files this process knows (catalog size).
    pub known_files: AtomicU64,
    /// Bytes of the files this process knows.
    pub known_bytes: AtomicU64,
    /// Lookups answered from the catalog (HIT without a probe).
    pub lookup_catalog_hits: AtomicU64,
    /// Existence checks run for lookups.
    pub lookup_probes: AtomicU64,
    /// Lookups answered RETRY.
    pub lookup_retries: AtomicU64,
    /// Lookups answered MISS because the verdict cache was full of unresolved probes.
    pub lookup_overflows: AtomicU64,
    /// Lookups answered MISS because their probe took longer than `lookup_timeout_ms`.
    pub lookup_timeouts: AtomicU64,
    /// Verdicts cached now.
    pub lookup_cache_entries: AtomicU64,
    /// Files the start-up scan found.
    pub scanned_files: AtomicU64,
    /// Leftover temporary files the scan removed.
    pub stale_temps_removed: AtomicU64,
    /// Set once the start-up scan has finished.
    pub scan_done: AtomicBool,
    /// Whether chunk files use O_DIRECT.
    pub direct_io: AtomicBool,
    /// Whether kvtier writes CRC records (`integrity = xattr`).
    pub writes_records: AtomicBool,
    /// Engine name (e.g. `uring`), set at open.
    pub engine: Mutex<String>,
    /// Why the engine fell back, if it did.
    pub engine_fallback: Mutex<Option<String>>,
    /// How files are published (`noreplace`, `link`, `rename`).
    pub publish_mode: Mutex<&'static str>,
    /// When a lookup last timed out (for health).
    pub last_lookup_timeout: Mutex<Option<std::time::Instant>>,
    /// Why the tier serves nothing any more (its engine stopped), if so.
    pub failed: Mutex<Option<String>>,
}

impl FsMetrics {
    /// Samples every metric.
    pub fn sample(&self, capacity: u64) -> Vec<TierMetric> {
        let mut out: Vec<TierMetric> = TierMetric::rows(self.transfer_counters())
            .chain(TierMetric::rows(self.eviction_and_lookup_counters()))
            .chain(TierMetric::rows(self.gauges(capacity)))
            .collect();
        out.push(TierMetric::new(
            "fs_crc_records_written",
            "1 when kvtier writes a CRC32 record with each file (integrity = xattr), 0 when not",
            Gauge,
            sampled_flag(&self.writes_records),
        ));
        let engine = TierMetric::engine_info(
            "fs_engine_info",
            "The I/O engine and publish method in use (value 1)",
            self.engine.lock().clone(),
            self.engine_fallback.lock().is_some(),
        );
        out.push(engine.with_label("publish", self.publish_mode.lock().to_string()));
        out
    }

    /// The counters of jobs and of the files and bytes they stored and loaded.
    fn transfer_counters(&self) -> [MetricRow; 14] {
        [
            (
                "fs_jobs_rejected",
                "Jobs refused because the queue was full",
                Counter,
                sampled(&self.jobs_rejected),
            ),
            (
                "fs_jobs_cancelled",
                "Queued jobs cancelled by a drain",
                Counter,
                sampled(&self.jobs_cancelled),
            ),
            (
                "fs_files_stored",
                "Chunk files this process published",
                Counter,
                sampled(&self.files_stored),
            ),
            (
                "fs_store_races",
                "Stores that found the file published by another writer meanwhile",
                Counter,
                sampled(&self.store_races),
            ),
            (
                "fs_stores_skipped",
                "Store keys skipped because the file was already there",
                Counter,
                sampled(&self.stores_skipped),
            ),
            (
                "fs_files_loaded_verified",
                "Chunk files loaded whose CRC32 record matched",
                Counter,
                sampled(&self.files_loaded_verified),
            ),
            (
                "fs_files_loaded_unverified",
                "Chunk files loaded without a CRC32 record (written by vLLM or with integrity = none)",
                Counter,
                sampled(&self.files_loaded_unverified),
            ),
            (
                "fs_checksum_failures",
                "Loads whose bytes failed their CRC32",
                Counter,
                sampled(&self.checksum_failures),
            ),
            (
                "fs_corrupt_files",
                "Loads of a file of the wrong size or with an unreadable CRC record",
                Counter,
                sampled(&self.corrupt_files),
            ),
            (
                "fs_missing_files",
                "Loads of a file that was gone (removed by another host)",
                Counter,
                sampled(&self.missing_files),
            ),
            (
                "fs_key_failures",
                "Keys whose store or load failed",
                Counter,
                sampled(&self.key_failures),
            ),
            (
                "fs_io_errors",
                "Failed file operations (open, transfer, xattr, rename, sync)",
                Counter,
                sampled(&self.io_errors),
            ),
            (
                "fs_bytes_written",
                "Bytes written to chunk files",
                Counter,
                sampled(&self.bytes_written),
            ),
            (
                "fs_bytes_read",
                "Bytes read from chunk files",
                Counter,
                sampled(&self.bytes_read),
            ),
        ]
    }

    /// The counters of evictions, lookups and the start-up scan.
    fn eviction_and_lookup_counters(&self) -> [MetricRow; 8] {
        [
            (
                "fs_evictions",
                "Chunk files removed to stay within capacity_bytes",
                Counter,
                sampled(&self.evictions),
            ),
            (
                "fs_eviction_failures",
                "Evictions whose unlink failed",
                Counter,
                sampled(&self.eviction_failures),
            ),
            (
                "fs_lookup_catalog_hits",
                "Lookups answered HIT from the files this process knows",
                Counter,
                sampled(&self.lookup_catalog_hits),
            ),
            (
                "fs_lookup_probes",
                "Existence checks run in the background for lookups",
                Counter,
                sampled(&self.lookup_probes),
            ),
            (
                "fs_lookup_retries",
                "Lookups answered RETRY while their existence check ran",
                Counter,
                sampled(&self.lookup_retries),
            ),
            (
                "fs_lookup_overflows",
                "Lookups answered MISS because the verdict cache was full of unresolved checks",
                Counter,
                sampled(&self.lookup_overflows),
            ),
            (
                "fs_lookup_timeouts",
                "Lookups answered MISS because their check took longer than lookup_timeout_ms",
                Counter,
                sampled(&self.lookup_timeouts),
            ),
            (
                "fs_stale_temps_removed",
                "Leftover temporary files removed by the start-up scan",
                Counter,
                sampled(&self.stale_temps_removed),
            ),
        ]
    }

    /// The gauges.
    fn gauges(&self, capacity: u64) -> [MetricRow; 10] {
        [
            (
                "fs_bytes_in_flight",
                "Bytes of chunk transfers admitted and not finished",
                Gauge,
                sampled(&self.bytes_in_flight),
            ),
            (
                "fs_queued_jobs",
                "Jobs waiting to start",
                Gauge,
                sampled(&self.queued_jobs),
            ),
            (
                "fs_active_jobs",
                "Jobs started and not finished",
                Gauge,
                sampled(&self.active_jobs),
            ),
            (
                "fs_known_files",
                "Chunk files this process knows under the tier's folder",
                Gauge,
                sampled(&self.known_files),
            ),
            (
                "fs_known_bytes",
                "Bytes of the chunk files this process knows",
                Gauge,
                sampled(&self.known_bytes),
            ),
            (
                "fs_capacity_bytes",
                "capacity_bytes: known bytes above it are evicted",
                Gauge,
                capacity as f64,
            ),
            (
                "fs_lookup_cache_entries",
                "Lookup verdicts cached",
                Gauge,
                sampled(&self.lookup_cache_entries),
            ),
            (
                "fs_scanned_files",
                "Chunk files found by the start-up scan",
                Gauge,
                sampled(&self.scanned_files),
            ),
            (
                "fs_scan_done",
                "1 once the start-up scan of the tier's folder has finished",
                Gauge,
                sampled_flag(&self.scan_done),
            ),
            (
                "fs_direct_io",
                "1 when chunk files use O_DIRECT, 0 when the tier fell back to buffered I/O",
                Gauge,
                sampled_flag(&self.direct_io),
            ),
        ]
    }
}
