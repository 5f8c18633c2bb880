//! The engines connected to the node service: who they are, their regions and their counters,
//! for `STATUS` and the service's own bookkeeping.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use serde::Serialize;

/// Counters of one connection (monotonic while it lives).
#[derive(Debug, Default)]
pub struct EngineCounters {
    /// Store jobs finished.
    pub stores: AtomicU64,
    /// Load jobs finished.
    pub loads: AtomicU64,
    /// Jobs that failed (any key).
    pub failed_jobs: AtomicU64,
    /// Bytes written to G3 from this engine's rows.
    pub bytes_stored: AtomicU64,
    /// Bytes read from G3 into this engine's rows.
    pub bytes_loaded: AtomicU64,
    /// Keys looked up.
    pub lookups: AtomicU64,
    /// Jobs queued or running now.
    pub jobs_in_flight: AtomicU64,
    /// Requests answered with an error (malformed, out of order, a region refused, a job
    /// refused before it started).
    pub errors: AtomicU64,
}

/// The region an engine registered.
#[derive(Debug, Clone, Serialize)]
pub struct RegionInfo {
    /// `path` or `fd`.
    pub source: String,
    /// The path (or `fd` for a descriptor).
    pub path: String,
    /// Rows mapped.
    pub num_rows: u64,
    /// Bytes per row.
    pub row_stride: u64,
    /// The I/O engine moving its rows (`uring`, `psync`).
    pub io_engine: String,
    /// Share (0 to 1) of the region the service maps in 2 MiB pages.
    pub huge_page_share: f64,
    /// Why (some of) it stays in 4 KiB pages (`None` when all of it is in 2 MiB pages).
    pub small_pages_reason: Option<String>,
    /// Bytes its I/O engine staged through the engine's own 2 MiB pages because the region
    /// is in 4 KiB pages (`IoEngine::staged_bytes`; `None` when it does not stage).
    #[serde(skip)]
    pub staged_bytes: Option<std::sync::Arc<AtomicU64>>,
}

/// One connected engine.
#[derive(Debug)]
pub struct EngineEntry {
    /// Connection number (unique for the service's life).
    pub id: u64,
    /// The name it gave in `HELLO`.
    pub name: String,
    /// Its uid and pid (`SO_PEERCRED`).
    pub uid: u32,
    /// Its pid.
    pub pid: i32,
    /// Its region once registered.
    pub region: Mutex<Option<RegionInfo>>,
    /// Its counters.
    pub counters: EngineCounters,
}

/// An engine's region that was lost: its file was shrunk while registered.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct LostRegion {
    /// The engine's name.
    pub engine: String,
    /// Its pid.
    pub pid: i32,
    /// The region's path (`fd` for a descriptor).
    pub path: String,
    /// Bytes registered.
    pub expected_bytes: u64,
    /// Bytes the file held when the loss was seen (`None`: its size could not be read).
    pub found_bytes: Option<u64>,
    /// The error the engine's job failed with.
    pub error: String,
}

/// One engine as `STATUS` shows it.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct EngineStatus {
    /// Connection number.
    pub id: u64,
    /// Engine name.
    pub name: String,
    /// Peer uid.
    pub uid: u32,
    /// Peer pid.
    pub pid: i32,
    /// The region, when registered (`path`, `num_rows`, `row_stride`, `io_engine`).
    pub region: Option<serde_json::Value>,
    /// Store jobs finished.
    pub stores: u64,
    /// Load jobs finished.
    pub loads: u64,
    /// Failed jobs.
    pub failed_jobs: u64,
    /// Bytes stored.
    pub bytes_stored: u64,
    /// Bytes loaded.
    pub bytes_loaded: u64,
    /// Keys looked up.
    pub lookups: u64,
    /// Jobs queued or running.
    pub jobs_in_flight: u64,
    /// Requests answered with an error.
    #[serde(default)]
    pub errors: u64,
}

/// Every connected engine, plus totals of those gone.
#[derive(Debug, Default)]
pub struct EngineRegistry {
    next_id: AtomicU64,
    engines: Mutex<BTreeMap<u64, Arc<EngineEntry>>>,
    /// Connections refused (uid, digest, row stride, protocol).
    pub refused: AtomicU64,
    /// Jobs cancelled because their engine went away.
    pub cancelled_jobs: AtomicU64,
    /// Sessions ended.
    pub disconnects: AtomicU64,
    /// Regions lost (an engine shrank its region file while registered; each ended
    /// its session).
    pub regions_lost: AtomicU64,
    /// The last region lost.
    pub last_region_lost: Mutex<Option<LostRegion>>,
}

impl EngineRegistry {
    /// Adds an engine and returns its entry.
    pub fn add(&self, name: String, uid: u32, pid: i32) -> Arc<EngineEntry> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let e = Arc::new(EngineEntry {
            id,
            name,
            uid,
            pid,
            region: Mutex::new(None),
            counters: EngineCounters::default(),
        });
        self.engines.lock().insert(id, e.clone());
        e
    }

    /// Removes engine `id` (its session has ended and its region is unmapped).
    pub fn remove(&self, id: u64) {
        if self.engines.lock().remove(&id).is_some() {
            self.disconnects.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Records that `engine`'s region was lost with `e` (an [`crate::ErrorKind::RegionLost`]
    /// error, whose context names the path and sizes).
    pub fn region_lost(&self, engine: &EngineEntry, e: &crate::error::Error) {
        let number = |key: &str| e.context_value(key).and_then(|v| v.parse::<u64>().ok());
        let lost = LostRegion {
            engine: engine.name.clone(),
            pid: engine.pid,
            path: e.context_value("path").unwrap_or("?").to_string(),
            expected_bytes: number("expected_bytes").unwrap_or(0),
            found_bytes: number("found_bytes"),
            error: e.to_string(),
        };
        self.regions_lost.fetch_add(1, Ordering::Relaxed);
        *self.last_region_lost.lock() = Some(lost);
    }

    /// Each connected engine's name and the huge-page share of its region, if registered.
    pub fn region_huge_page_shares(&self) -> Vec<(String, f64)> {
        self.engines
            .lock()
            .values()
            .filter_map(|e| {
                let r = e.region.lock();
                r.as_ref().map(|r| (e.name.clone(), r.huge_page_share))
            })
            .collect()
    }

    /// Each connected engine's name and the bytes its region's I/O engine staged, for those
    /// that stage.
    pub fn region_staged_bytes(&self) -> Vec<(String, u64)> {
        self.engines
            .lock()
            .values()
            .filter_map(|e| {
                let r = e.region.lock();
                let staged = r.as_ref()?.staged_bytes.as_ref()?;
                Some((e.name.clone(), staged.load(Ordering::Relaxed)))
            })
            .collect()
    }

    /// How many engines are connected now.
    pub fn len(&self) -> usize {
        self.engines.lock().len()
    }

    /// Engines connected now, by connection number.
    pub fn status(&self) -> Vec<EngineStatus> {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        self.engines
            .lock()
            .values()
            .map(|e| {
                let c = &e.counters;
                EngineStatus {
                    id: e.id,
                    name: e.name.clone(),
                    uid: e.uid,
                    pid: e.pid,
                    region: e
                        .region
                        .lock()
                        .as_ref()
                        .and_then(|r| serde_json::to_value(r).ok()),
                    stores: load(&c.stores),
                    loads: load(&c.loads),
                    failed_jobs: load(&c.failed_jobs),
                    bytes_stored: load(&c.bytes_stored),
                    bytes_loaded: load(&c.bytes_loaded),
                    lookups: load(&c.lookups),
                    jobs_in_flight: load(&c.jobs_in_flight),
                    errors: load(&c.errors),
                }
            })
            .collect()
    }
}
