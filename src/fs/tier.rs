//! [`FsTier`]: the file-per-chunk tier behind the [`SecondaryTier`] contract.
//!
//! Every contract call validates, enqueues and returns in microseconds; lookups answer from
//! the catalog or the verdict cache, or RETRY while a background check runs. Only
//! [`SecondaryTier::drain_jobs`] and [`SecondaryTier::shutdown`] block.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::Receiver;
use parking_lot::Mutex;
use serde_json::Value;

use crate::contract::front::{SendRefused, TierFront, TierNames, spawn_worker};
use crate::contract::job::{
    JobId, JobResult, Locality, LookupResult, Medium, OffloadingEvent, RequestContext, TransferJob,
};
use crate::contract::secondary::{HealthState, SecondaryTier, TierHealth, TierMetric};
use crate::contract::worker::EventSink;
use crate::error::{Error, ErrorKind, Result};
use crate::fs::catalog::Catalog;
use crate::fs::chunk_file::{DirCache, PublishMode, probe_publish};
use crate::fs::config::{FsTierConfig, Integrity};
use crate::fs::folder;
use crate::fs::integrity::probe_xattr;
use crate::fs::lookup::AsyncLookup;
use crate::fs::mapper::FileMapper;
use crate::fs::metrics::FsMetrics;
use crate::fs::scan;
use crate::fs::worker::{Cmd, Shared, Worker, WorkerInit};
use crate::g3::{DirectIoMode, EngineFactory};
use crate::geometry::ChunkGeometry;
use crate::io::{DirectIoProbe, EngineOptions, open_engine, probe_direct_io};
use crate::key::ChunkKey;
use crate::region::PrimaryRegion;

/// How the fs tier names itself and its worker in errors.
const NAMES: TierNames = TierNames {
    tier: "fs",
    worker: "coordinator",
};

/// Channel slots beyond `max_queued_jobs`, for drain and shutdown commands and the lookup
/// and scan threads' reports.
const CONTROL_SLACK: usize = 64;

/// How long a lookup timeout keeps the tier degraded.
const HEALTH_WINDOW: Duration = Duration::from_secs(60);

/// Longest a lookup waits for the catalog lock before it asks the verdict cache instead.
const LOOKUP_LOCK_WAIT: Duration = Duration::from_micros(100);

/// Facts about an open tier, for logs, the CLI and tests.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FsInfo {
    /// `<root_dir>/<model>_<digest12>`, the folder of `config.json`.
    pub base_path: PathBuf,
    /// `<base_path>_r0`, the folder of the chunk files.
    pub data_dir: PathBuf,
    /// vLLM's 12-digit digest.
    pub digest: String,
    /// Filesystem type of `root_dir`.
    pub fs_type: String,
    /// Whether chunk files use O_DIRECT.
    pub direct_io: bool,
    /// The I/O engine's name.
    pub engine: String,
    /// How files are published (`noreplace`, `link`, `rename`).
    pub publish: &'static str,
    /// `xattr` or `none`.
    pub integrity: &'static str,
    /// Bytes per chunk file.
    pub row_stride: u64,
}

/// The file-per-chunk tier (`type = "fs"`).
pub struct FsTier {
    sh: Arc<Shared>,
    lookup: AsyncLookup,
    /// The coordinator: commands, results, events.
    front: TierFront<Cmd>,
    invalidated_rx: Receiver<Vec<ChunkKey>>,
    /// Keys of loads in progress, to mark the failed ones MISS when they are reported.
    load_keys: HashMap<JobId, Vec<ChunkKey>>,
    scan: Option<JoinHandle<()>>,
    scan_stop: Arc<AtomicBool>,
    locality: Option<Locality>,
    capacity: u64,
    info: FsInfo,
}

impl std::fmt::Debug for FsTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsTier")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

impl FsTier {
    /// Whether the tier records stored / removed events (on when opened; the tier factory
    /// applies `enable_kv_events` and the host's KV-events switch, as vLLM's fs tier does).
    pub fn set_events_enabled(&self, enabled: bool) {
        self.sh.events.store(enabled, Ordering::Relaxed);
    }

    /// Opens the tier under `cfg.root_dir` for chunks of `region.row_stride()` bytes.
    /// `fields` are vLLM's FileMapper fields of the model (they name the folder, see
    /// [`FileMapper`]); `namespace` is kvtier's namespace digest, kept in the folder's
    /// `kvtier.json`.
    pub fn open(
        cfg: FsTierConfig,
        region: Arc<PrimaryRegion>,
        fields: Value,
        namespace: [u8; 32],
        tier_id: String,
        locality: Option<Locality>,
    ) -> Result<Self> {
        Self::open_with_engine(
            cfg,
            region,
            fields,
            namespace,
            tier_id,
            locality,
            Box::new(open_engine),
        )
    }

    /// [`FsTier::open`] with a custom engine factory (tests wrap the engine in a fault
    /// injector).
    pub fn open_with_engine(
        cfg: FsTierConfig,
        region: Arc<PrimaryRegion>,
        fields: Value,
        namespace: [u8; 32],
        tier_id: String,
        locality: Option<Locality>,
        make_engine: EngineFactory,
    ) -> Result<Self> {
        let stride = region.row_stride();
        cfg.validate("", Some(stride))?;
        let probe = probe_direct_io(&cfg.root_dir).map_err(|e| root_error(&cfg, e))?;
        let mapper = FileMapper::new(&cfg.root_dir, fields)?;
        let (publish, direct) = prepare_root(&cfg, &mapper, &namespace, &probe, &tier_id)?;
        let rows_in_flight =
            ChunkGeometry::rows_in_flight(cfg.max_bytes_in_flight_for(stride), stride).min(4096)
                as u32;
        let opts = EngineOptions {
            queue_depth: rows_in_flight,
            psync_threads: cfg.io_threads,
            o_direct: direct,
        };
        let handle = make_engine(cfg.io_engine, region.clone(), Vec::new(), &opts)?;
        let info = FsInfo {
            base_path: mapper.base_path().to_path_buf(),
            data_dir: mapper.data_dir().to_path_buf(),
            digest: mapper.digest().to_string(),
            fs_type: probe.fs_type.to_string(),
            direct_io: direct,
            engine: handle.info.name.clone(),
            publish: publish.as_str(),
            integrity: cfg.integrity.as_str(),
            row_stride: stride,
        };
        let metrics = FsMetrics::default();
        *metrics.engine.lock() = handle.info.name.clone();
        *metrics.engine_fallback.lock() = handle.info.fallback_reason.clone();
        *metrics.publish_mode.lock() = publish.as_str();
        metrics.direct_io.store(direct, Ordering::Relaxed);
        metrics
            .writes_records
            .store(cfg.integrity == Integrity::Xattr, Ordering::Relaxed);
        let sh = Arc::new(Shared {
            catalog: Mutex::new(Catalog::new(cfg.capacity_bytes)),
            metrics,
            mapper,
            region,
            engine: handle.engine.clone(),
            direct,
            publish,
            integrity: cfg.integrity,
            fsync: cfg.fsync,
            dirs: DirCache::default(),
            events: AtomicBool::new(true),
        });
        let (cmd_tx, cmd_rx) = crossbeam_channel::bounded(cfg.max_queued_jobs + CONTROL_SLACK);
        let (results_tx, results_rx) = crossbeam_channel::unbounded();
        let (events_tx, events_rx) = crossbeam_channel::unbounded();
        let (invalidated_tx, invalidated_rx) = crossbeam_channel::unbounded();
        let engine = handle.engine;
        let started = Worker::spawn_pool(WorkerInit {
            sh: sh.clone(),
            max_bytes_in_flight: cfg.max_bytes_in_flight_for(stride),
            io_threads: cfg.io_threads,
            events: EventSink::new(events_tx, tier_id.clone(), locality),
            cmd_rx,
            results_tx,
            invalidated_tx,
        })
        .and_then(|w| spawn_worker(NAMES, format!("kvtier-fs-{tier_id}"), move || w.run()));
        let worker = started.inspect_err(|_| engine.shutdown())?;
        let mut tier = FsTier {
            lookup: AsyncLookup::start(
                sh.clone(),
                cfg.lookup_threads,
                cfg.lookup_cache_entries,
                cfg.lookup_timeout,
                cmd_tx.clone(),
            )?,
            sh: sh.clone(),
            front: TierFront::new(
                NAMES,
                cmd_tx.clone(),
                results_rx,
                events_rx,
                worker,
                cfg.max_queued_jobs,
            ),
            invalidated_rx,
            load_keys: HashMap::new(),
            scan: None,
            scan_stop: Arc::new(AtomicBool::new(false)),
            locality,
            capacity: cfg.capacity_bytes,
            info,
        };
        tier.scan = Some(scan::spawn(
            sh,
            cfg.stale_temp_age,
            tier.scan_stop.clone(),
            cmd_tx,
        )?);
        Ok(tier)
    }

    /// Facts about the open tier.
    pub fn info(&self) -> &FsInfo {
        &self.info
    }

    /// The vLLM naming this tier uses.
    pub fn mapper(&self) -> &FileMapper {
        &self.sh.mapper
    }

    /// True once the start-up scan has handed its files to the catalog.
    pub fn is_scanned(&self) -> bool {
        self.sh.metrics.scan_done.load(Ordering::Acquire)
    }

    /// Blocks until the start-up scan has finished (for tools and tests).
    pub fn wait_scanned(&self, timeout: Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        while !self.is_scanned() {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// Chunk files this process knows and their bytes.
    pub fn known(&self) -> (usize, u64) {
        let c = self.sh.catalog.lock();
        (c.len(), c.bytes())
    }

    fn enqueue(&mut self, job: TransferJob, load: bool) {
        let load_keys = &mut self.load_keys;
        self.front.enqueue(job, &self.sh.metrics, |tx, job| {
            let job_id = job.job_id;
            let cmd = if load {
                load_keys.insert(job_id, job.keys.clone());
                Cmd::Load(job)
            } else {
                Cmd::Store(job)
            };
            tx.try_send(cmd).map_err(|e| {
                load_keys.remove(&job_id);
                if e.is_full() {
                    SendRefused::Full
                } else {
                    SendRefused::Closed
                }
            })
        });
    }

    fn stop(&mut self) -> Result<()> {
        self.lookup.shutdown();
        self.scan_stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.scan.take()
            && h.join().is_err()
        {
            log::error!("the fs scan thread panicked");
        }
        self.front.stop(Cmd::Shutdown)
    }
}

/// Prepares the tier's folder under `root_dir` (its `config.json` and `kvtier.json`) and
/// checks what the file system offers: how files are published, whether O_DIRECT works
/// (required or not, by `direct_io`), whether CRC records can be kept. Returns the publish
/// mode and whether chunk files use O_DIRECT.
fn prepare_root(
    cfg: &FsTierConfig,
    mapper: &FileMapper,
    namespace: &[u8; 32],
    probe: &DirectIoProbe,
    tier_id: &str,
) -> Result<(PublishMode, bool)> {
    std::fs::create_dir_all(mapper.data_dir()).map_err(|e| {
        Error::new(
            ErrorKind::InvalidPath,
            format!(
                "cannot create the fs tier folder {}: {e}",
                mapper.data_dir().display()
            ),
        )
        .with("path", mapper.data_dir().display().to_string())
        .with_source(e)
    })?;
    let publish = probe_publish(mapper.data_dir())?;
    folder::prepare(mapper, namespace, publish)?;
    let direct = probe.o_direct;
    if !direct {
        match cfg.direct_io {
            DirectIoMode::Required => {
                probe.require_direct_io()?;
            }
            DirectIoMode::Auto => log::warn!(
                "fs tier {tier_id}: O_DIRECT does not work in {} ({}: {}); using buffered \
                 I/O (fs_direct_io = 0)",
                cfg.root_dir.display(),
                probe.fs_type,
                probe.o_direct_error.as_deref().unwrap_or("unknown reason")
            ),
        }
    }
    match cfg.integrity {
        Integrity::Xattr => probe_xattr(mapper.data_dir()).map_err(|why| {
            Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{} ({}) does not keep user extended attributes ({why}); the fs tier \
                     keeps each chunk file's CRC32 there. Enable them (e.g. the user_xattr \
                     mount option) or set integrity = \"none\" to store without CRCs",
                    cfg.root_dir.display(),
                    probe.fs_type
                ),
            )
            .with("path", cfg.root_dir.display().to_string())
            .with("filesystem", probe.fs_type.to_string())
        })?,
        Integrity::None => log::warn!(
            "fs tier {tier_id}: integrity = none: chunk files are stored without a CRC32 \
             record; loads of them are counted in fs_files_loaded_unverified"
        ),
    }
    if publish != PublishMode::NoReplace {
        log::warn!(
            "fs tier {tier_id}: {} lacks renameat2(RENAME_NOREPLACE); publishing files \
             with {}",
            cfg.root_dir.display(),
            publish.as_str()
        );
    }
    Ok((publish, direct))
}

/// A `root_dir` that cannot be used is the user's mistake: say which key and directory.
fn root_error(cfg: &FsTierConfig, e: Error) -> Error {
    let mut out = Error::new(e.kind(), format!("fs tier root_dir: {}", e.message()))
        .with("path", cfg.root_dir.display().to_string());
    for (k, v) in e.context() {
        if *k != "path" {
            out = out.with(k, v.clone());
        }
    }
    out
}

impl SecondaryTier for FsTier {
    fn tier_type(&self) -> &str {
        "fs"
    }

    fn medium(&self) -> Option<Medium> {
        Some(Medium::Storage)
    }

    fn locality(&self) -> Option<Locality> {
        self.locality
    }

    /// Refreshes the recency of the keys its catalog holds (its LRU capacity eviction);
    /// skipped while the catalog is busy.
    fn touch(&mut self, keys: &[ChunkKey], _req: &RequestContext) {
        if let Some(mut c) = self.sh.catalog.try_lock_for(LOOKUP_LOCK_WAIT) {
            for key in keys {
                c.touch(key);
            }
        }
    }

    fn lookup(&mut self, key: &ChunkKey, req: &RequestContext) -> LookupResult {
        while let Ok(keys) = self.invalidated_rx.try_recv() {
            self.lookup.mark_miss(&keys);
        }
        if let Some(mut c) = self.sh.catalog.try_lock_for(LOOKUP_LOCK_WAIT)
            && c.touch(key)
        {
            self.sh
                .metrics
                .lookup_catalog_hits
                .fetch_add(1, Ordering::Relaxed);
            return LookupResult::Hit;
        }
        match self.lookup.lookup(key, &req.req_id) {
            Some(true) => LookupResult::Hit,
            Some(false) => LookupResult::Miss,
            None => LookupResult::Retry,
        }
    }

    fn submit_store(&mut self, job: TransferJob) {
        self.enqueue(job, false);
    }

    fn submit_load(&mut self, job: TransferJob) {
        self.enqueue(job, true);
    }

    fn get_finished_jobs(&mut self) -> Vec<JobResult> {
        let out = self.front.finished();
        for r in &out {
            let Some(keys) = self.load_keys.remove(&r.job_id) else {
                continue;
            };
            if r.success {
                continue;
            }
            // The livelock rule: a key whose load failed is a MISS from now on.
            let loaded = r.successful_keys.as_deref().unwrap_or(&[]);
            self.lookup
                .mark_miss(keys.iter().filter(|k| !loaded.contains(k)));
        }
        out
    }

    fn on_request_finished(&mut self, req: &RequestContext) {
        self.lookup.cleanup(&req.req_id);
    }

    fn on_schedule_end(&mut self) {
        self.lookup.flush();
    }

    fn has_pending_work(&self) -> bool {
        self.front.outstanding() > 0
            || self.lookup.has_pending_work()
            || self.sh.metrics.evictions_in_flight.load(Ordering::Relaxed) > 0
    }

    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        self.front.take_events()
    }

    fn drain_jobs(&mut self) {
        self.front.drain(Cmd::Drain);
    }

    fn shutdown(&mut self) -> Result<()> {
        self.stop()
    }

    fn metrics(&self) -> Vec<TierMetric> {
        self.sh.metrics.sample(self.capacity)
    }

    fn config_info(&self) -> Vec<(&'static str, String)> {
        let direct = if self.info.direct_io {
            "direct"
        } else {
            "buffered"
        };
        vec![
            ("kvtier_io_engine", self.info.engine.clone()),
            ("kvtier_direct_io", direct.to_string()),
            ("kvtier_fs_digest", self.info.digest.clone()),
        ]
    }

    fn health(&self) -> TierHealth {
        let m = &self.sh.metrics;
        let mut h = TierHealth::default();
        if let Some(why) = m.failed.lock().as_ref() {
            h.add(
                HealthState::Failed,
                format!("the fs tier serves nothing: {why}"),
            );
        }
        let failures = m.eviction_failures.load(Ordering::Relaxed);
        if failures > 0 {
            h.add(
                HealthState::Degraded,
                format!(
                    "{failures} chunk file(s) could not be removed: capacity_bytes may be exceeded"
                ),
            );
        }
        if m.last_lookup_timeout
            .lock()
            .is_some_and(|t| t.elapsed() < HEALTH_WINDOW)
        {
            h.add(
                HealthState::Degraded,
                format!(
                    "existence checks timed out in the last {} s (is {} hanging?); lookups \
                     answer MISS meanwhile",
                    HEALTH_WINDOW.as_secs(),
                    self.info.base_path.display()
                ),
            );
        }
        h
    }
}

impl Drop for FsTier {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            log::error!("fs tier shutdown on drop failed: {e}");
        }
    }
}
