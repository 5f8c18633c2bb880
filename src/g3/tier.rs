//! [`G3Tier`]: the G3 NVMe tier behind the [`SecondaryTier`] contract.
//!
//! Every contract call validates, enqueues to the worker thread (see `worker.rs`) and returns
//! in microseconds; only [`SecondaryTier::drain_jobs`] and [`SecondaryTier::shutdown`] block.

use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crossbeam_channel::Sender;

use crate::contract::front::{SendRefused, TierFront, TierNames, spawn_worker};
use crate::contract::job::{
    JobResult, Locality, LookupResult, Medium, OffloadingEvent, RequestContext, TransferJob,
};
use crate::contract::secondary::{HealthState, SecondaryTier, TierHealth, TierMetric};
use crate::contract::worker::EventSink;
use crate::error::{Error, ErrorKind, Result};
use crate::g3::admission::AdmissionGate;
use crate::g3::config::G3TierConfig;
use crate::g3::metrics::G3Metrics;
use crate::g3::slab::{self, SlabSpec};
use crate::g3::worker::{Cmd, Shared, Worker, WorkerInit};
use crate::geometry::ChunkGeometry;
use crate::io::{EngineHandle, EngineOptions, IoEngineKind, open_engine};
use crate::key::ChunkKey;
use crate::region::PrimaryRegion;

/// The label names of [`SecondaryTier::config_info`] for a G3 tier, in order.
pub const CONFIG_INFO_KEYS: [&str; 6] = [
    "kvtier_io_engine",
    "kvtier_direct_io",
    "kvtier_paths",
    "kvtier_slots",
    "kvtier_slot_bytes",
    "kvtier_namespace",
];

/// How a G3 tier names itself and its worker in errors.
const NAMES: TierNames = TierNames {
    tier: "G3",
    worker: "worker",
};

/// Channel slots beyond `max_queued_jobs`, for drain and shutdown commands.
const CONTROL_SLACK: usize = 16;

/// Longest a lookup waits for the index lock before answering RETRY.
const LOOKUP_LOCK_WAIT: std::time::Duration = std::time::Duration::from_micros(100);

/// Facts about an open tier, for logs, the CLI and tests.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct G3Info {
    /// Slab file of each path, in stripe order.
    pub slab_paths: Vec<PathBuf>,
    /// Whether each path uses O_DIRECT.
    pub direct_io: Vec<bool>,
    /// Filesystem type of each path.
    pub fs_types: Vec<String>,
    /// Bytes per slot.
    pub row_stride: u64,
    /// Slots over all paths.
    pub total_slots: u64,
    /// Stripe set uuid (hex).
    pub set_uuid: String,
    /// True when this open created the slabs.
    pub created: bool,
    /// The I/O engine's name.
    pub engine: String,
    /// GPUDirect Storage at open (`gds` key).
    pub gds: crate::g3::gds::GdsStatus,
}

/// Builds the I/O engine for the slab files (tests wrap the real engine in a fault injector).
pub type EngineFactory = Box<
    dyn FnOnce(IoEngineKind, Arc<PrimaryRegion>, Vec<File>, &EngineOptions) -> Result<EngineHandle>,
>;

/// Duplicates of the slabs' data descriptors, in stripe order.
fn data_descriptors(set: &slab::SlabSet) -> Result<Vec<File>> {
    set.files
        .iter()
        .map(|f| f.data.try_clone().map_err(|e| Error::io("dup", &f.path, e)))
        .collect()
}

/// The G3 NVMe tier.
pub struct G3Tier {
    shared: Arc<Shared>,
    /// The worker: commands (loads among them), results, events.
    front: TierFront<Cmd>,
    /// Store jobs, on a channel of their own (see the worker's module docs).
    store_tx: Option<Sender<TransferJob>>,
    locality: Option<Locality>,
    checkpoint_interval: Option<std::time::Duration>,
    info: G3Info,
    /// Duplicates of the slabs' data descriptors, for [`G3Tier::slot_grants`].
    direct_files: Arc<Vec<File>>,
    /// The namespace digest the slabs carry.
    namespace: [u8; 32],
    /// The admission gate (`admission` key); `None` with `all`.
    admission: Option<AdmissionGate>,
    /// The primary region, whose share of 2 MiB pages (it moves while a collapse runs in the
    /// background) the metrics report.
    region: Arc<PrimaryRegion>,
}

impl std::fmt::Debug for G3Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("G3Tier")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

impl G3Tier {
    /// Opens (creating on first use) the slab files in `cfg.paths`, starts the I/O engine and
    /// the worker, which recovers the index in the background (lookups answer RETRY until it
    /// is done). Slots are `region.row_stride()` bytes, or the row's first `cfg.slot_bytes`.
    pub fn open(
        cfg: G3TierConfig,
        region: Arc<PrimaryRegion>,
        namespace: [u8; 32],
        tier_id: String,
        locality: Option<Locality>,
    ) -> Result<Self> {
        Self::open_with_engine(
            cfg,
            region,
            namespace,
            tier_id,
            locality,
            Box::new(open_engine),
        )
    }

    /// [`G3Tier::open`] with a custom engine factory.
    pub fn open_with_engine(
        cfg: G3TierConfig,
        region: Arc<PrimaryRegion>,
        namespace: [u8; 32],
        tier_id: String,
        locality: Option<Locality>,
        make_engine: EngineFactory,
    ) -> Result<Self> {
        cfg.validate("", Some(region.row_stride()))?;
        // Slots hold a prefix of each row (the whole row unless `slot_bytes` says less).
        let row_stride = cfg.slot_bytes_for(region.row_stride())?;
        let gds = crate::g3::gds::status_at_open(cfg.gds, &cfg.paths)?;
        let spec = SlabSpec {
            row_stride,
            capacity_bytes: cfg.capacity_bytes,
            namespace,
            direct_io: cfg.direct_io,
        };
        let set = slab::open_set(&cfg.paths, &spec)?;
        let files = data_descriptors(&set)?;
        let direct_files = Arc::new(data_descriptors(&set)?);
        let all_direct = set.files.iter().all(|f| f.direct);
        let per_flight =
            ChunkGeometry::rows_in_flight(cfg.max_bytes_in_flight_for(row_stride), row_stride)
                .min(4096) as u32;
        let opts = EngineOptions {
            queue_depth: per_flight.max(crate::io::uring::DEFAULT_QUEUE_DEPTH.min(per_flight * 2)),
            o_direct: all_direct,
            ..EngineOptions::default()
        };
        let handle = make_engine(cfg.io_engine, region.clone(), files, &opts)?;
        let info = G3Info {
            slab_paths: set.files.iter().map(|f| f.path.clone()).collect(),
            direct_io: set.files.iter().map(|f| f.direct).collect(),
            fs_types: set.files.iter().map(|f| f.fs_type.clone()).collect(),
            row_stride,
            total_slots: set.total_slots(),
            set_uuid: hex::encode(set.set_uuid()),
            created: set.created,
            engine: handle.info.name.clone(),
            gds: gds.clone(),
        };
        let metrics = G3Metrics::default();
        *metrics.engine.lock() = handle.info.name.clone();
        *metrics.engine_fallback.lock() = handle.info.fallback_reason.clone();
        *metrics.staged_bytes.lock() = handle.engine.staged_bytes();
        *metrics.gds.lock() = gds;
        metrics
            .paths_unrecorded
            .store(set.unrecorded_paths as u64, Ordering::Relaxed);
        let shared = Arc::new(Shared::new(metrics, &set));
        // Bounded channels keep their slots in one preallocated ring: an unbounded channel
        // allocates a block every 31 messages on the sending (scheduler) thread and frees it on
        // the worker, and on the development VM that allocation made one submission in 31
        // take 20-40 us. At most `max_queued_jobs` jobs are ever queued (checked before each
        // send), so a job never finds its channel full; the slack is for drain and shutdown.
        let admission = cfg
            .admission
            .build(usize::try_from(info.total_slots).unwrap_or(usize::MAX))
            .map(AdmissionGate::new);
        let capacity = cfg.max_queued_jobs + CONTROL_SLACK;
        let (cmd_tx, cmd_rx) = crossbeam_channel::bounded(capacity);
        let (store_tx, store_rx) = crossbeam_channel::bounded(capacity);
        let (results_tx, results_rx) = crossbeam_channel::unbounded();
        let (events_tx, events_rx) = crossbeam_channel::unbounded();
        let worker = Worker::new(WorkerInit {
            sh: shared.clone(),
            engine: handle.engine.clone(),
            set,
            cfg: cfg.clone(),
            events: EventSink::new(events_tx, tier_id.clone(), locality),
            cmd_rx,
            store_rx,
            results_tx,
        });
        let engine = handle.engine;
        let thread = spawn_worker(NAMES, format!("kvtier-g3-{tier_id}"), move || worker.run())
            .inspect_err(|_| engine.shutdown())?;
        Ok(G3Tier {
            region: region.clone(),
            shared,
            front: TierFront::new(
                NAMES,
                cmd_tx,
                results_rx,
                events_rx,
                thread,
                cfg.max_queued_jobs,
            ),
            store_tx: Some(store_tx),
            locality,
            checkpoint_interval: cfg.checkpoint_interval,
            info,
            direct_files,
            namespace,
            admission,
        })
    }

    /// Facts about the open tier.
    pub fn info(&self) -> &G3Info {
        &self.info
    }

    /// Whether stored/removed events are recorded for [`SecondaryTier::take_events`] (on after
    /// [`G3Tier::open`]). Turn them off when nobody drains them: the queue would only grow.
    pub fn set_events_enabled(&self, enabled: bool) {
        self.shared.events.store(enabled, Ordering::Relaxed);
    }

    /// A handle for another data path (GPUDirect Storage) to move rows into and out of this
    /// tier's slots under its index, journal and CRC rules (see `crate::g3::direct`).
    pub fn slot_grants(&self) -> Result<crate::g3::slot_grants::SlotGrants> {
        let cmd_tx = self
            .front
            .commands()
            .cloned()
            .ok_or_else(|| Error::new(ErrorKind::Closed, "the G3 tier is shut down"))?;
        Ok(crate::g3::slot_grants::SlotGrants {
            cmd_tx,
            files: self.direct_files.clone(),
            row_stride: self.info.row_stride,
        })
    }

    /// The GPUDirect Storage state now (a GPU data path that starts cuFile updates it).
    pub fn gds_status(&self) -> crate::g3::gds::GdsStatus {
        self.shared.metrics.gds.lock().clone()
    }

    /// True once the index has been recovered (lookups then answer HIT or MISS).
    pub fn is_recovered(&self) -> bool {
        self.shared.metrics.recovered.load(Ordering::Acquire)
    }

    /// Number of committed entries (0 until recovered).
    pub fn len(&self) -> usize {
        self.shared.index.lock().as_ref().map_or(0, |ix| ix.len())
    }

    /// True when no entry is committed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Blocks until recovery has finished (for tools and tests; the tier itself never waits).
    pub fn wait_recovered(&self, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        while !self.is_recovered() {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        true
    }

    fn enqueue(&mut self, job: TransferJob, load: bool) {
        let store_tx = &self.store_tx;
        self.front
            .enqueue(job, &self.shared.metrics, |cmd_tx, job| {
                let refused = |full: bool| {
                    if full {
                        SendRefused::Full
                    } else {
                        SendRefused::Closed
                    }
                };
                match (load, store_tx) {
                    (true, _) => cmd_tx
                        .try_send(Cmd::Load(job))
                        .map_err(|e| refused(e.is_full())),
                    (false, Some(tx)) => tx.try_send(job).map_err(|e| refused(e.is_full())),
                    (false, None) => Err(SendRefused::Closed),
                }
            });
    }

    /// Stops like a crash would leave things: finishes started jobs, cancels queued ones, but
    /// writes no checkpoint (the journal stays as it is). For crash-recovery tests and tools.
    pub fn close_without_checkpoint(mut self) -> Result<()> {
        self.stop(false)
    }

    fn stop(&mut self, checkpoint: bool) -> Result<()> {
        let result = self.front.stop(|ack| Cmd::Shutdown(ack, checkpoint));
        drop(self.store_tx.take());
        result
    }
}

impl SecondaryTier for G3Tier {
    fn tier_type(&self) -> &str {
        "nvme"
    }

    fn medium(&self) -> Option<Medium> {
        Some(Medium::Storage)
    }

    fn locality(&self) -> Option<Locality> {
        self.locality
    }

    fn lookup(&mut self, key: &ChunkKey, _req: &RequestContext) -> LookupResult {
        if !self.is_recovered() {
            return LookupResult::Retry;
        }
        // The worker holds the lock only briefly, except while it snapshots the index for a
        // checkpoint; rather than wait for that, answer RETRY (asked again next step).
        let Some(mut guard) = self.shared.index.try_lock_for(LOOKUP_LOCK_WAIT) else {
            self.shared
                .metrics
                .lookup_retries_busy
                .fetch_add(1, Ordering::Relaxed);
            return LookupResult::Retry;
        };
        let hit = guard.as_mut().is_some_and(|ix| ix.touch(key));
        drop(guard);
        if let Some(gate) = &mut self.admission {
            gate.on_lookup(key);
        }
        if hit {
            LookupResult::Hit
        } else {
            LookupResult::Miss
        }
    }

    /// Refreshes the recency of the keys it holds (its LRU capacity eviction); skipped while
    /// the index is busy (a checkpoint snapshot), like a lookup that would answer RETRY.
    fn touch(&mut self, keys: &[ChunkKey], _req: &RequestContext) {
        if let Some(mut guard) = self.shared.index.try_lock_for(LOOKUP_LOCK_WAIT)
            && let Some(ix) = guard.as_mut()
        {
            for key in keys {
                ix.touch(key);
            }
        }
    }

    fn submit_store(&mut self, job: TransferJob) {
        let job = match &mut self.admission {
            None => job,
            Some(gate) => {
                let guard = if self.shared.metrics.recovered.load(Ordering::Acquire) {
                    self.shared.index.try_lock_for(LOOKUP_LOCK_WAIT)
                } else {
                    None
                };
                let index = guard.as_ref().and_then(|g| g.as_ref());
                gate.filter(
                    job,
                    index,
                    &self.shared.metrics.admission,
                    self.info.row_stride,
                )
            }
        };
        self.enqueue(job, false);
    }

    fn submit_load(&mut self, job: TransferJob) {
        self.enqueue(job, true);
    }

    fn get_finished_jobs(&mut self) -> Vec<JobResult> {
        let out = self.front.finished();
        if let Some(gate) = &mut self.admission {
            for r in &out {
                gate.on_finished(r.job_id, r.success);
            }
        }
        out
    }

    fn has_pending_work(&self) -> bool {
        self.front.outstanding() > 0
    }

    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        self.front.take_events()
    }

    fn drain_jobs(&mut self) {
        self.front.drain(Cmd::Drain);
    }

    fn shutdown(&mut self) -> Result<()> {
        self.stop(true)
    }

    fn metrics(&self) -> Vec<TierMetric> {
        self.shared.metrics.region_huge_page_ppm.store(
            (self.region.huge_page_share() * 1e6).round() as u64,
            Ordering::Relaxed,
        );
        self.shared.metrics.sample(&self.shared.paths)
    }

    fn health(&self) -> TierHealth {
        use std::sync::atomic::Ordering::Relaxed;
        let sh = &self.shared;
        let m = &sh.metrics;
        let mut h = TierHealth::default();
        if let Some(e) = sh.failed.lock().as_ref() {
            let what = if m.recovery_failed.load(Relaxed) {
                "index recovery failed, the tier serves nothing"
            } else {
                "the tier stopped serving"
            };
            h.add(HealthState::Failed, format!("{what}: {e}"));
        } else if !self.is_recovered() {
            h.add(
                HealthState::Degraded,
                "recovering its index (lookups answer RETRY)",
            );
        }
        if let Some(e) = sh.final_checkpoint_error.lock().as_ref() {
            h.add(
                HealthState::Failed,
                format!(
                    "the final checkpoint failed ({e}); the journal keeps the acknowledged \
                     stores for the next start"
                ),
            );
        }
        if let Some(p) = sh.journal_problem.lock().as_ref()
            && h.state != HealthState::Failed
        {
            h.add(HealthState::Degraded, format!("stores refused: {p}"));
        }
        for (i, p) in sh.paths.iter().enumerate() {
            if p.poisoned.load(Relaxed) {
                let why = p.problem.lock().clone().unwrap_or_default();
                let path = self.info.slab_paths[i].display();
                h.add(
                    HealthState::Degraded,
                    format!("path {i} ({path}) takes no writes: {why}"),
                );
            }
        }
        if let Some(e) = sh.checkpoint_error.lock().as_ref() {
            h.add(HealthState::Degraded, format!("checkpoints failing: {e}"));
        }
        if let (Some(iv), Some(age)) = (self.checkpoint_interval, m.checkpoint_age())
            && m.journal_bytes.load(Relaxed) > crate::g3::record::FILE_HEADER_SIZE as u64
            && age
                > iv.saturating_mul(2)
                    .saturating_add(std::time::Duration::from_secs(60))
        {
            h.add(
                HealthState::Degraded,
                format!("no checkpoint for {} s", age.as_secs()),
            );
        }
        h
    }

    fn ready(&self) -> bool {
        self.is_recovered()
    }

    fn config_info(&self) -> Vec<(&'static str, String)> {
        let direct = self.info.direct_io.iter().filter(|d| **d).count();
        let direct_io = if direct == self.info.direct_io.len() {
            "direct"
        } else if direct == 0 {
            "buffered"
        } else {
            "mixed"
        };
        let values = [
            self.info.engine.clone(),
            direct_io.to_string(),
            self.info.slab_paths.len().to_string(),
            self.info.total_slots.to_string(),
            self.info.row_stride.to_string(),
            hex::encode(self.namespace),
        ];
        CONFIG_INFO_KEYS.into_iter().zip(values).collect()
    }
}

impl Drop for G3Tier {
    fn drop(&mut self) {
        if let Err(e) = self.stop(true) {
            log::error!("G3 tier shutdown on drop failed: {e}");
        }
    }
}
