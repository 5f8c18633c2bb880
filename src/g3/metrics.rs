//! The G3 tier's own metrics: atomics updated by the worker, sampled by
//! [`crate::contract::secondary::SecondaryTier::metrics`]. Labels come from small fixed sets
//! (path position, engine name, mode), never from keys or paths.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::contract::secondary::{
    MetricDescriptor, MetricRow, TierMetric,
    TierMetricKind::{Counter, Gauge},
    sampled, sampled_flag,
};

/// Per-path facts fixed at open, plus its health.
#[derive(Debug)]
pub struct PathStatus {
    /// Whether the data descriptor is O_DIRECT.
    pub direct: bool,
    /// Set after a failed write or fsync, or once the slab is not what its path names any
    /// more: no further writes go to this path.
    pub poisoned: AtomicBool,
    /// Why the path is poisoned.
    pub problem: Mutex<Option<String>>,
    /// Set when the slab is no longer what its path names (deleted, replaced, unmounted):
    /// what is written to it would not be found by a restart.
    pub lost: Mutex<Option<String>>,
    /// Set when the path was found on another filesystem than the tier was created on (its
    /// disk not mounted) and the tier runs without it (`on_wrong_filesystem = "degraded"`).
    pub wrong_filesystem: AtomicBool,
}

/// What the index journal can do now (`g3_journal_info{state}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum JournalState {
    /// Takes records.
    Healthy = 0,
    /// Refuses records after a failed append or sync (or a checkpoint that replaced the
    /// files it continues); the next checkpoint starts a fresh one.
    Poisoned = 1,
    /// Not open (a start-up checkpoint failed); the next checkpoint opens one.
    NotOpen = 2,
    /// At `max_journal_bytes` because checkpoints fail; stores wait for one.
    Full = 3,
    /// The index directory is no longer what its path names; stores are refused.
    DirectoryLost = 4,
}

impl JournalState {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            JournalState::Healthy => "healthy",
            JournalState::Poisoned => "poisoned",
            JournalState::NotOpen => "not_open",
            JournalState::Full => "full",
            JournalState::DirectoryLost => "directory_lost",
        }
    }

    /// The state stored as `v` (see [`G3Metrics::journal_state`]).
    pub fn from_u8(v: u8) -> Self {
        match v {
            1 => JournalState::Poisoned,
            2 => JournalState::NotOpen,
            3 => JournalState::Full,
            4 => JournalState::DirectoryLost,
            _ => JournalState::Healthy,
        }
    }
}

/// Counters and gauges of one tier.
#[derive(Debug, Default)]
pub struct G3Metrics {
    /// Bytes submitted to the engine and not yet completed.
    pub bytes_in_flight: AtomicU64,
    /// Jobs waiting (submitted, not started).
    pub queued_jobs: AtomicU64,
    /// Jobs started and not finished.
    pub active_jobs: AtomicU64,
    /// Loads whose bytes failed their CRC.
    pub checksum_failures: AtomicU64,
    /// Entries evicted to make room.
    pub evictions: AtomicU64,
    /// Store keys skipped because already held.
    pub stores_skipped: AtomicU64,
    /// Keys stored (committed).
    pub keys_stored: AtomicU64,
    /// Keys loaded (CRC-verified).
    pub keys_loaded: AtomicU64,
    /// Keys whose transfer failed (any reason).
    pub key_failures: AtomicU64,
    /// Failed engine operations (I/O errors, short transfers).
    pub io_errors: AtomicU64,
    /// Bytes written to slabs.
    pub bytes_written: AtomicU64,
    /// Bytes read from slabs.
    pub bytes_read: AtomicU64,
    /// Jobs cancelled by a drain before they started.
    pub jobs_cancelled: AtomicU64,
    /// Jobs refused because the queue was full.
    pub jobs_rejected: AtomicU64,
    /// Lookups answered RETRY because the index was busy (checkpoint snapshot).
    pub lookup_retries_busy: AtomicU64,
    /// Checkpoints written.
    pub checkpoints: AtomicU64,
    /// Checkpoints that failed (the journal kept every committed entry).
    pub checkpoint_failures: AtomicU64,
    /// Naps the idle worker took while lingering (see `crate::io::IdlePolicy`).
    pub idle_naps: AtomicU64,
    /// Recovery duration in microseconds (set once).
    pub recovery_micros: AtomicU64,
    /// Index records applied by recovery.
    pub recovery_records: AtomicU64,
    /// Journal bytes cut off at recovery.
    pub recovery_cut_bytes: AtomicU64,
    /// Bytes of index-file damage skipped at recovery (records lost to it).
    pub recovery_skipped_bytes: AtomicU64,
    /// Damaged index files kept aside at recovery.
    pub recovery_damaged_files: AtomicU64,
    /// Store keys refused because the index cannot take them now.
    pub stores_refused: AtomicU64,
    /// Bytes in the current journal.
    pub journal_bytes: AtomicU64,
    /// When the last checkpoint was written (Unix milliseconds; 0 = none known).
    pub last_checkpoint_unix_ms: AtomicU64,
    /// Set when recovery failed (the tier serves nothing).
    pub recovery_failed: AtomicBool,
    /// Entries dropped from the index because their path was taken out of service.
    pub entries_fenced: AtomicU64,
    /// Set while the journal refuses writes.
    pub journal_poisoned: AtomicBool,
    /// The journal's state, a [`JournalState`] as `u8`.
    pub journal_state: AtomicU8,
    /// Set once recovery has finished.
    pub recovered: AtomicBool,
    /// Used and free slots, refreshed by the worker.
    pub used_slots: AtomicU64,
    /// Free slots, refreshed by the worker.
    pub free_slots: AtomicU64,
    /// Engine name (e.g. `uring`), set at open.
    pub engine: Mutex<String>,
    /// Why the engine fell back (e.g. io_uring unavailable), if it did.
    pub engine_fallback: Mutex<Option<String>>,
    /// The share of the primary region's bytes in 2 MiB pages (see
    /// `PrimaryRegion::huge_page_share`), in millionths, set at open.
    pub region_huge_page_ppm: AtomicU64,
    /// Paths whose filesystem could not be recorded at open (no or a read-only state
    /// directory): a restart cannot tell that filesystem, unmounted, from an empty directory.
    pub paths_unrecorded: AtomicU64,
    /// Bytes the engine staged through its own 2 MiB pages because the region is in 4 KiB
    /// pages (`IoEngine::staged_bytes`), set at open when it stages.
    pub staged_bytes: Mutex<Option<std::sync::Arc<AtomicU64>>>,
    /// The GPUDirect Storage state and its reason (`gds` key).
    pub gds: Mutex<crate::g3::gds::GdsStatus>,
    /// Keys and bytes the admission policy admitted and rejected (`admission` key).
    pub admission: crate::g3::admission::AdmissionCounters,
}

impl G3Metrics {
    /// Time since the last checkpoint was written, when one is known.
    pub fn checkpoint_age(&self) -> Option<std::time::Duration> {
        let ms = self.last_checkpoint_unix_ms.load(Ordering::Relaxed);
        if ms == 0 {
            return None;
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        Some(std::time::Duration::from_millis(now.saturating_sub(ms)))
    }

    /// Every metric a G3 tier reports, with its label names: for a host that declares its
    /// metrics before any tier exists (vLLM's `build_metric_definitions`, in processes that
    /// never open a tier). Per-path metrics appear once, labelled `path`.
    pub fn descriptors() -> Vec<MetricDescriptor> {
        let one_path = PathStatus {
            direct: true,
            poisoned: Default::default(),
            problem: Default::default(),
            lost: Default::default(),
            wrong_filesystem: Default::default(),
        };
        Self::default()
            .sample(std::slice::from_ref(&one_path))
            .into_iter()
            .map(|m| MetricDescriptor {
                name: m.name,
                help: m.help,
                kind: m.kind,
                label_names: m.labels.iter().map(|(k, _)| *k).collect(),
            })
            .collect()
    }

    /// Samples every metric.
    pub fn sample(&self, paths: &[PathStatus]) -> Vec<TierMetric> {
        let mut out: Vec<TierMetric> = TierMetric::rows(self.transfer_rows()).collect();
        out.extend(self.index_metrics());
        out.extend(TierMetric::rows(self.worker_rows()));
        out.extend(self.engine_metrics());
        for (i, p) in paths.iter().enumerate() {
            out.extend(path_metrics(i, p));
        }
        out.extend(self.admission.sample());
        out
    }

    /// The jobs and the bytes and keys they moved.
    fn transfer_rows(&self) -> [MetricRow; 15] {
        [
            (
                "g3_bytes_in_flight",
                "Bytes of slab I/O submitted and not completed",
                Gauge,
                sampled(&self.bytes_in_flight),
            ),
            (
                "g3_queued_jobs",
                "Jobs waiting to start",
                Gauge,
                sampled(&self.queued_jobs),
            ),
            (
                "g3_active_jobs",
                "Jobs started and not finished",
                Gauge,
                sampled(&self.active_jobs),
            ),
            (
                "g3_checksum_failures",
                "Loads whose bytes failed their CRC32",
                Counter,
                sampled(&self.checksum_failures),
            ),
            (
                "g3_evictions",
                "Entries evicted to make room",
                Counter,
                sampled(&self.evictions),
            ),
            (
                "g3_stores_skipped",
                "Store keys skipped because already held",
                Counter,
                sampled(&self.stores_skipped),
            ),
            (
                "g3_keys_stored",
                "Keys stored",
                Counter,
                sampled(&self.keys_stored),
            ),
            (
                "g3_keys_loaded",
                "Keys loaded with a valid CRC",
                Counter,
                sampled(&self.keys_loaded),
            ),
            (
                "g3_key_failures",
                "Keys whose transfer failed",
                Counter,
                sampled(&self.key_failures),
            ),
            (
                "g3_io_errors",
                "Failed slab I/O operations",
                Counter,
                sampled(&self.io_errors),
            ),
            (
                "g3_bytes_written",
                "Bytes written to slabs",
                Counter,
                sampled(&self.bytes_written),
            ),
            (
                "g3_bytes_read",
                "Bytes read from slabs",
                Counter,
                sampled(&self.bytes_read),
            ),
            (
                "g3_jobs_cancelled",
                "Queued jobs cancelled by a drain",
                Counter,
                sampled(&self.jobs_cancelled),
            ),
            (
                "g3_jobs_rejected",
                "Jobs refused because the queue was full",
                Counter,
                sampled(&self.jobs_rejected),
            ),
            (
                "g3_checkpoints",
                "Index checkpoints written",
                Counter,
                sampled(&self.checkpoints),
            ),
        ]
    }

    /// The index: its recovery, its journal and its checkpoints.
    fn index_metrics(&self) -> Vec<TierMetric> {
        let recovered =
            self.recovered.load(Ordering::Relaxed) && !self.recovery_failed.load(Ordering::Relaxed);
        let mut out: Vec<TierMetric> = TierMetric::rows([
            (
                "g3_recovery_seconds",
                "Time the index recovery took",
                Gauge,
                sampled(&self.recovery_micros) / 1e6,
            ),
            (
                "g3_recovery_records",
                "Index records applied by recovery",
                Gauge,
                sampled(&self.recovery_records),
            ),
            (
                "g3_recovery_cut_bytes",
                "Journal bytes cut off at recovery",
                Gauge,
                sampled(&self.recovery_cut_bytes),
            ),
            (
                "g3_recovery_skipped_bytes",
                "Bytes of index-file damage skipped at recovery (records lost to it)",
                Gauge,
                sampled(&self.recovery_skipped_bytes),
            ),
            (
                "g3_recovery_damaged_files",
                "Damaged index files kept aside at recovery",
                Gauge,
                sampled(&self.recovery_damaged_files),
            ),
            (
                "g3_recovered",
                "1 once the index is recovered (0 while recovering, or when recovery failed)",
                Gauge,
                f64::from(u8::from(recovered)),
            ),
            (
                "g3_entries_fenced",
                "Entries dropped from the index because their path was taken out of service \
                 (g3_path_healthy 0)",
                Counter,
                sampled(&self.entries_fenced),
            ),
            (
                "g3_journal_healthy",
                "0 while the journal refuses writes (stores refused until a checkpoint succeeds)",
                Gauge,
                f64::from(u8::from(!self.journal_poisoned.load(Ordering::Relaxed))),
            ),
        ])
        .collect();
        let state = JournalState::from_u8(self.journal_state.load(Ordering::Relaxed));
        out.push(
            TierMetric::new(
                "g3_journal_info",
                "The index journal's state: healthy, poisoned, not_open, full or \
                 directory_lost (value 1)",
                Gauge,
                1.0,
            )
            .with_label("state", state.as_str().to_string()),
        );
        out.extend(TierMetric::rows([
            (
                "g3_journal_bytes",
                "Bytes in the current index journal",
                Gauge,
                sampled(&self.journal_bytes),
            ),
            (
                "g3_stores_refused",
                "Store keys refused because the index cannot take them (journal unhealthy or full)",
                Counter,
                sampled(&self.stores_refused),
            ),
            (
                "g3_checkpoint_age_seconds",
                "Seconds since the last checkpoint was written",
                Gauge,
                self.checkpoint_age().map_or(0.0, |d| d.as_secs_f64()),
            ),
        ]));
        out
    }

    /// The slots and the worker: its thread policy, checkpoint failures, naps and busy
    /// lookups.
    fn worker_rows(&self) -> [MetricRow; 6] {
        [
            (
                "g3_used_slots",
                "Slots holding a chunk or being written",
                Gauge,
                sampled(&self.used_slots),
            ),
            (
                "g3_free_slots",
                "Free slots",
                Gauge,
                sampled(&self.free_slots),
            ),
            (
                "g3_io_threads_without_batch_policy",
                "kvtier I/O threads in this process that could not switch to SCHED_BATCH",
                Gauge,
                crate::io::batch_policy_failures() as f64,
            ),
            (
                "g3_checkpoint_failures",
                "Checkpoints that failed (retried with backoff)",
                Counter,
                sampled(&self.checkpoint_failures),
            ),
            (
                "g3_idle_naps",
                "Naps the idle worker took while lingering for new jobs",
                Counter,
                sampled(&self.idle_naps),
            ),
            (
                "g3_lookup_retries_busy",
                "Lookups answered RETRY because the index was busy",
                Counter,
                sampled(&self.lookup_retries_busy),
            ),
        ]
    }

    /// How the bytes move: the I/O engine, the region's pages, staging and GPUDirect Storage.
    fn engine_metrics(&self) -> Vec<TierMetric> {
        let mut out = vec![TierMetric::engine_info(
            "g3_engine_info",
            "The I/O engine in use (value 1)",
            self.engine.lock().clone(),
            self.engine_fallback.lock().is_some(),
        )];
        out.extend(TierMetric::rows([
            (
                "g3_region_huge_pages",
                "Share (0 to 1) of the primary rows the tier moves that are backed by 2 MiB pages \
                 (one DMA segment per 2 MiB); below 1 the reason is logged once",
                Gauge,
                sampled(&self.region_huge_page_ppm) / 1e6,
            ),
            (
                "g3_paths_unrecorded",
                "Paths whose filesystem kvtier could not record (no writable state directory): a \
                 restart cannot tell that filesystem, unmounted, from an empty directory there",
                Gauge,
                sampled(&self.paths_unrecorded),
            ),
            (
                "g3_staged_bytes",
                "Bytes copied through the engine's own 2 MiB-page staging buffers because the \
                 primary region is in 4 KiB pages (0 when it does not stage; the reason is logged \
                 once)",
                Counter,
                self.staged_bytes
                    .lock()
                    .as_ref()
                    .map_or(0.0, |c| sampled(c)),
            ),
        ]));
        let gds = self.gds.lock().clone();
        out.push(
            TierMetric::new(
                "g3_gds_info",
                "GPUDirect Storage: mode off, cpu_fallback, ready, p2p or compat, and why (value 1)",
                Gauge,
                1.0,
            )
            .with_label("mode", gds.state.as_str().to_string())
            .with_label("reason", gds.reason),
        );
        out
    }
}

/// The metrics of path `i` (label `path`).
fn path_metrics(i: usize, p: &PathStatus) -> impl Iterator<Item = TierMetric> {
    TierMetric::rows([
        (
            "g3_direct_io",
            "1 when the path uses O_DIRECT, 0 when it fell back to buffered I/O",
            Gauge,
            f64::from(u8::from(p.direct)),
        ),
        (
            "g3_path_healthy",
            "0 after a failed write or fsync on the path, or once its slab is not what the \
             path names (no further writes)",
            Gauge,
            f64::from(u8::from(!p.poisoned.load(Ordering::Relaxed))),
        ),
        (
            "g3_wrong_filesystem",
            "1 when the path was found on another filesystem than its tier was created on \
             (not mounted?) and the tier runs without it",
            Gauge,
            sampled_flag(&p.wrong_filesystem),
        ),
    ])
    .map(move |m| m.with_label("path", i.to_string()))
}
