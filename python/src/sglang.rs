//! `kvtier._native.SglangStore`: kvtier's G3 tier as SGLang's HiCache storage backend (the
//! native half of `kvtier.sglang.KvtierStorage`, `docs/sglang.md`).
//!
//! SGLang's host KV pool is adopted in place. A page of it is `pieces` runs of `piece_bytes`
//! each (one for an MLA page in `page_first`, K and V for an MHA page in `page_first`, one per
//! layer (and K/V) in `layer_first`), as SGLang's own `get_page_buffer_meta` lists them; the
//! region's rows are pieces, so piece `j` of the page that starts at host token `t` is row
//! `(offset_j + (t / page_size) * page_stride) / piece_bytes`. Each piece is one G3 slot (one
//! CRC-checked `O_DIRECT` transfer, no copy), keyed by SGLang's page key (and `#j` when a page
//! has more than one piece); a page is present when all of its pieces are. One page is one
//! job, so a batch's pages move concurrently on kvtier's I/O threads and fail one by one.
//!
//! SGLang calls the backend synchronously from its prefetch and backup threads (both at
//! once): every call here runs with the GIL released, submits, and waits for its own jobs;
//! finished jobs of other calls are handed over through [`SglangStore::finished`].

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use kvtier::config::TierConfig;
use kvtier::contract::job::{JobResult, LookupResult, RequestContext, TransferJob};
use kvtier::contract::secondary::SecondaryTier;
use kvtier::{Builder, ChunkKey, Error, PrimaryRegion};

use crate::{
    ConfigError, KvtierError, MetricTuple, PyErrorClass, error_class, install_logger,
    metric_tuples, to_py,
};

/// The key path kvtier's configuration errors give the entry; SGLang users wrote its keys in
/// `--hicache-storage-backend-extra-config`.
const ENTRY_PATH: &str = "secondary_tiers[0]";
const SGLANG_PATH: &str = "extra_config";

/// How long the constructor waits for the index to be recovered (a restart), so that the
/// first `batch_exists` already sees what the tier holds.
const READY_WAIT: Duration = Duration::from_secs(60);

/// How long `exists_prefix` waits for the node service's verdicts in client mode.
const LOOKUP_WAIT: Duration = Duration::from_secs(5);

/// A kvtier error, with the entry's key path renamed to SGLang's `extra_config`.
fn sg_err(e: Error) -> PyErr {
    let msg = e
        .to_string()
        .replace(&format!("{ENTRY_PATH}."), &format!("{SGLANG_PATH}."))
        .replace(ENTRY_PATH, SGLANG_PATH);
    match error_class(e.kind()) {
        PyErrorClass::Config => ConfigError::new_err(msg),
        PyErrorClass::Path | PyErrorClass::Kvtier => KvtierError::new_err(msg),
    }
}

/// Where a page's pieces lie in the adopted host pool.
#[derive(Debug, Clone)]
struct PageGeometry {
    /// Bytes of one piece (= the region's row stride = the slot size).
    piece_bytes: u64,
    /// Row of piece `j` of page 0.
    piece_rows: Vec<u64>,
    /// Rows from one page to the next (the page stride over the piece size).
    page_rows: u64,
    /// Tokens per page.
    page_size: u64,
    /// Pages of the pool.
    num_pages: u64,
}

impl PageGeometry {
    /// The rows of the page that starts at host token `start`, or why it is not a page.
    fn rows(&self, start: i64) -> Result<impl Iterator<Item = u32> + '_, String> {
        let Ok(s) = u64::try_from(start) else {
            return Err(format!("host index {start} is negative"));
        };
        if !s.is_multiple_of(self.page_size) || s / self.page_size >= self.num_pages {
            return Err(format!(
                "host index {start} is not the start of a page of the host pool ({} pages of \
                 {} tokens)",
                self.num_pages, self.page_size
            ));
        }
        let page = s / self.page_size;
        Ok(self
            .piece_rows
            .iter()
            .map(move |r| (r + page * self.page_rows) as u32))
    }

    /// The G3 keys of one page: SGLang's key, with `#j` per piece when there are several.
    fn keys(&self, key: &str) -> Vec<ChunkKey> {
        if self.piece_rows.len() == 1 {
            return vec![ChunkKey::new(key.as_bytes())];
        }
        (0..self.piece_rows.len())
            .map(|j| ChunkKey::new(format!("{key}#{j}").as_bytes()))
            .collect()
    }
}

/// One batch's outcome: per page whether it moved, the bytes kvtier really moved (pages already
/// held are skipped and move nothing) and the seconds the batch took.
type BatchOutcome = (Vec<bool>, u64, f64);

/// kvtier's G3 tier over SGLang's host KV pool (module docs).
#[pyclass(frozen, module = "kvtier._native", name = "SglangStore")]
pub(crate) struct SglangStore {
    tier: Mutex<Option<Box<dyn SecondaryTier>>>,
    /// Finished jobs collected by one caller for another (the prefetch and backup threads
    /// wait at the same time).
    finished: Mutex<HashMap<u64, JobResult>>,
    next_job: AtomicU64,
    /// Bumped by [`SglangStore::clear`], which replaces the tier: a caller still waiting for
    /// jobs of the tier before has every one it did not get reported failed.
    generation: AtomicU64,
    /// Keeps SGLang's host pool buffer referenced until the tier has stopped.
    anchor: Mutex<Option<Py<PyAny>>>,
    /// The in-process tier's configuration and region, to open it again after
    /// [`SglangStore::clear`]; `None` in client mode (the node service owns the pool).
    local: Option<(TierConfig, Arc<PrimaryRegion>)>,
    digest: [u8; 32],
    geometry: PageGeometry,
    req: RequestContext,
}

impl SglangStore {
    fn open(
        config: TierConfig,
        region: Arc<PrimaryRegion>,
        digest: [u8; 32],
    ) -> kvtier::Result<Box<dyn SecondaryTier>> {
        let tier = Builder::for_tier(config)
            .region(region)
            .namespace(digest)
            .build_tier(0)?;
        let started = Instant::now();
        while !tier.ready() && started.elapsed() < READY_WAIT {
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(tier)
    }

    fn with_tier<T>(&self, f: impl FnOnce(&mut dyn SecondaryTier) -> T) -> PyResult<T> {
        let mut guard = self.tier.lock();
        match guard.as_mut() {
            Some(t) => Ok(f(t.as_mut())),
            None => Err(KvtierError::new_err("the kvtier SGLang store is shut down")),
        }
    }

    /// Submits one job per page and waits for all of them (the GIL is released by the caller).
    fn transfer(&self, keys: &[String], starts: &[i64], load: bool) -> PyResult<BatchOutcome> {
        if keys.len() != starts.len() {
            return Err(PyValueError::new_err(format!(
                "{} keys but {} page starts",
                keys.len(),
                starts.len()
            )));
        }
        let mut jobs = Vec::with_capacity(keys.len());
        for (key, &start) in keys.iter().zip(starts) {
            let rows: Vec<u32> = self
                .geometry
                .rows(start)
                .map_err(|e| PyValueError::new_err(format!("page {key:?}: {e}")))?
                .collect();
            jobs.push(TransferJob {
                job_id: self.next_job.fetch_add(1, Ordering::Relaxed),
                keys: self.geometry.keys(key),
                chunk_ids: rows,
                is_promotion: load,
                req_id: self.req.req_id.clone(),
                submit_time: Instant::now(),
            });
        }
        let started = Instant::now();
        let ids: Vec<u64> = jobs.iter().map(|j| j.job_id).collect();
        let generation = self.with_tier(|t| {
            for job in jobs {
                if load {
                    t.submit_load(job);
                } else {
                    t.submit_store(job);
                }
            }
            // Read under the tier's lock: `clear` bumps it under the same lock.
            self.generation.load(Ordering::Acquire)
        })?;
        let mut outcome: HashMap<u64, JobResult> = HashMap::with_capacity(ids.len());
        let mut nap = Duration::from_micros(20);
        loop {
            let done = self.with_tier(|t| t.get_finished_jobs())?;
            let mut finished = self.finished.lock();
            finished.extend(done.into_iter().map(|r| (r.job_id, r)));
            for id in &ids {
                if let Some(r) = finished.remove(id) {
                    outcome.insert(*id, r);
                }
            }
            drop(finished);
            if outcome.len() == ids.len() {
                break;
            }
            if self.generation.load(Ordering::Acquire) != generation {
                // The tier was cleared: what it did not report is failed.
                for id in &ids {
                    outcome.entry(*id).or_insert_with(|| JobResult {
                        job_id: *id,
                        success: false,
                        successful_keys: None,
                        transfer_time: None,
                        transfer_bytes: None,
                        error: Some(Error::new(
                            kvtier::ErrorKind::Closed,
                            "the tier was cleared while the job ran",
                        )),
                    });
                }
                break;
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(1));
        }
        let seconds = started.elapsed().as_secs_f64();
        let mut bytes = 0;
        let ok = ids
            .iter()
            .map(|id| {
                let r = &outcome[id];
                bytes += r.transfer_bytes.unwrap_or(0);
                if let Some(e) = &r.error {
                    log::debug!("kvtier SGLang store: job {id} failed: {e}");
                }
                r.success
            })
            .collect();
        Ok((ok, bytes, seconds))
    }
}

#[pymethods]
impl SglangStore {
    /// Adopts SGLang's host pool (`length` bytes at `base`, rows of `piece_bytes`) and opens
    /// the G3 tier `tier_entry` (JSON of an `nvme` entry) over it. A page is the pieces at
    /// byte offsets `piece_offsets` (page 0) plus `page_stride` per page; `page_size` tokens
    /// per page, `num_pages` pages. `namespace` (64 hex digits: `kvtier.sglang` digests the
    /// namespace fields) is what the slabs carry. `anchor` must keep the pool mapped until
    /// [`SglangStore::shutdown`].
    #[new]
    #[pyo3(signature = (base, length, piece_bytes, piece_offsets, page_stride, page_size, num_pages, anchor, tier_entry, namespace))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        base: usize,
        length: usize,
        piece_bytes: u64,
        piece_offsets: Vec<u64>,
        page_stride: u64,
        page_size: u64,
        num_pages: u64,
        anchor: Py<PyAny>,
        tier_entry: &str,
        namespace: &str,
    ) -> PyResult<Self> {
        install_logger();
        let geometry = geometry(
            length,
            piece_bytes,
            &piece_offsets,
            page_stride,
            page_size,
            num_pages,
        )?;
        let entry: serde_json::Value = serde_json::from_str(tier_entry)
            .map_err(|e| ConfigError::new_err(format!("{SGLANG_PATH}: invalid JSON: {e}")))?;
        let config = kvtier::config::resolve_tier_entry(0, &entry).map_err(sg_err)?;
        let huge_pages = kvtier::embed::region_huge_pages(&config).map_err(sg_err)?;
        let digest = parse_digest(namespace)?;
        let rows = length / piece_bytes as usize;
        let cfg = config.clone();
        let (tier, region) = py
            .detach(move || {
                // SAFETY: `anchor` holds SGLang's host pool tensor, so `length` bytes at `base`
                // stay mapped and unmoved; this object keeps `anchor` until the tier (and with
                // it every clone of the region's `Arc` its I/O engine holds) has stopped, and
                // never drops it when stopping failed. Its `region` clone is only used to open
                // the tier again, under the same anchor.
                let region = Arc::new(unsafe {
                    PrimaryRegion::adopt_shared(base as *mut u8, piece_bytes, rows, huge_pages)
                }?);
                Self::open(cfg, region.clone(), digest).map(|t| (t, region))
            })
            .map_err(sg_err)?;
        Ok(SglangStore {
            tier: Mutex::new(Some(tier)),
            finished: Mutex::new(HashMap::new()),
            next_job: AtomicU64::new(1),
            generation: AtomicU64::new(0),
            anchor: Mutex::new(Some(anchor)),
            local: Some((config, region)),
            digest,
            geometry,
            req: RequestContext::new("kvtier.sglang"),
        })
    }

    /// A store in client mode: connects to kvtier's node service at `socket` (which owns the
    /// G3 pool every connected engine shares, `docs/node-service.md`), presents `namespace`
    /// (64 hex digits) with rows of `piece_bytes`, and registers SGLang's host pool by its
    /// file descriptor `fd` (SGLang's `"allocator": "shm"`: a memfd whose offset 0 is the
    /// pool's first byte). The geometry is as for
    /// the constructor; `engine` names this rank in the service's status.
    #[staticmethod]
    #[pyo3(signature = (socket, fd, length, piece_bytes, piece_offsets, page_stride, page_size, num_pages, anchor, namespace, engine))]
    #[allow(clippy::too_many_arguments)]
    fn connect(
        py: Python<'_>,
        socket: &str,
        fd: i32,
        length: usize,
        piece_bytes: u64,
        piece_offsets: Vec<u64>,
        page_stride: u64,
        page_size: u64,
        num_pages: u64,
        anchor: Py<PyAny>,
        namespace: &str,
        engine: &str,
    ) -> PyResult<Self> {
        install_logger();
        let geometry = geometry(
            length,
            piece_bytes,
            &piece_offsets,
            page_stride,
            page_size,
            num_pages,
        )?;
        let digest = parse_digest(namespace)?;
        // The descriptor opened again through /proc (a new descriptor of the same memfd,
        // closed when this call returns; the tier keeps a duplicate for reconnecting).
        let proc_path = format!("/proc/self/fd/{fd}");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&proc_path)
            .map_err(|e| {
                ConfigError::new_err(format!(
                    "SGLang host pool descriptor {fd} ({proc_path}): cannot open it for \
                     reading and writing: {e}"
                ))
            })?;
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        if size < length as u64 {
            return Err(ConfigError::new_err(format!(
                "SGLang host pool descriptor {fd}: its file holds {size} bytes, the pool \
                 {length}; kvtier needs the pool's own file (\"allocator\": \"shm\")"
            )));
        }
        let hello = kvtier::node::ClientHello {
            engine: engine.to_string(),
            row_stride: piece_bytes,
            digest,
        };
        let rows = length as u64 / piece_bytes;
        let tier = py
            .detach(|| {
                use std::os::fd::AsFd;
                kvtier::node::NodeTier::connect(
                    std::path::Path::new(socket),
                    &hello,
                    kvtier::node::RegionSource::Fd(file.as_fd()),
                    rows,
                    None,
                )
            })
            .map_err(sg_err)?;
        Ok(SglangStore {
            tier: Mutex::new(Some(Box::new(tier))),
            finished: Mutex::new(HashMap::new()),
            next_job: AtomicU64::new(1),
            generation: AtomicU64::new(0),
            anchor: Mutex::new(Some(anchor)),
            local: None,
            digest,
            geometry,
            req: RequestContext::new("kvtier.sglang"),
        })
    }

    /// How many of `keys`, from the first, are pages the tier holds whole (every piece
    /// present and loadable). A key asked while the index recovers counts as absent.
    fn exists_prefix(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<usize> {
        py.detach(|| {
            let pages: Vec<Vec<ChunkKey>> = keys.iter().map(|k| self.geometry.keys(k)).collect();
            if self.local.is_some() {
                // In process the index answers at once (RETRY only while it recovers).
                return self.with_tier(|t| {
                    pages
                        .iter()
                        .take_while(|p| {
                            p.iter()
                                .all(|ck| t.lookup(ck, &self.req) == LookupResult::Hit)
                        })
                        .count()
                });
            }
            // A client-mode tier asks the service and answers RETRY until its verdict is
            // back: ask again until every piece has one (SGLang's call is synchronous). A
            // piece still without one after LOOKUP_WAIT counts as absent.
            let mut verdict: Vec<Vec<Option<bool>>> =
                pages.iter().map(|p| vec![None; p.len()]).collect();
            let started = Instant::now();
            let mut nap = Duration::from_micros(20);
            loop {
                let pending = self.with_tier(|t| {
                    let mut pending = 0;
                    for (page, v) in pages.iter().zip(verdict.iter_mut()) {
                        for (ck, slot) in page.iter().zip(v.iter_mut()) {
                            if slot.is_none() {
                                match t.lookup(ck, &self.req) {
                                    LookupResult::Hit => *slot = Some(true),
                                    LookupResult::Miss | LookupResult::HitPending => {
                                        *slot = Some(false)
                                    }
                                    LookupResult::Retry => pending += 1,
                                }
                            }
                        }
                    }
                    pending
                })?;
                if pending == 0 || started.elapsed() >= LOOKUP_WAIT {
                    break;
                }
                std::thread::sleep(nap);
                nap = (nap * 2).min(Duration::from_millis(1));
            }
            Ok(verdict
                .iter()
                .take_while(|v| v.iter().all(|x| *x == Some(true)))
                .count())
        })
    }

    /// Stores the pages starting at host tokens `starts` under `keys` (one job per page, all
    /// in flight together); waits. Returns (per page stored, bytes written, seconds).
    fn store(&self, py: Python<'_>, keys: Vec<String>, starts: Vec<i64>) -> PyResult<BatchOutcome> {
        py.detach(|| self.transfer(&keys, &starts, false))
    }

    /// Loads the pages `keys` into the host pages starting at `starts`; a page whose bytes
    /// fail their CRC (or that is missing) is `False` and becomes a miss. Waits.
    fn load(&self, py: Python<'_>, keys: Vec<String>, starts: Vec<i64>) -> PyResult<BatchOutcome> {
        py.detach(|| self.transfer(&keys, &starts, true))
    }

    /// Forgets every page: stops the tier, frees every slot (`kvtier tier clear`) and opens
    /// it again over the same pool.
    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        let Some((config, region)) = &self.local else {
            return Err(KvtierError::new_err(
                "clear: this SGLang rank is a client of kvtier's node service, whose G3 pool \
                 every connected engine shares; stop the service and run `kvtier tier clear` \
                 on its paths to empty it",
            ));
        };
        py.detach(|| {
            let mut guard = self.tier.lock();
            let Some(tier) = guard.as_mut() else {
                return Err(KvtierError::new_err("the kvtier SGLang store is shut down"));
            };
            tier.shutdown().map_err(to_py)?;
            // Jobs of waiting callers were finished or failed by the shutdown: hand them over.
            let rest = tier.get_finished_jobs();
            self.finished
                .lock()
                .extend(rest.into_iter().map(|r| (r.job_id, r)));
            guard.take();
            self.generation.fetch_add(1, Ordering::AcqRel);
            kvtier::embed::clear_tier(config).map_err(to_py)?;
            let tier = Self::open(config.clone(), region.clone(), self.digest).map_err(to_py)?;
            *guard = Some(tier);
            Ok(())
        })
    }

    /// Drains, checkpoints and stops the tier (GIL released), then lets go of the pool. A
    /// second call does nothing; on an error the pool stays anchored.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| {
            let mut guard = self.tier.lock();
            if let Some(tier) = guard.as_mut() {
                tier.shutdown().map_err(to_py)?;
                guard.take();
            }
            Ok::<_, PyErr>(())
        })?;
        drop(self.anchor.lock().take());
        Ok(())
    }

    /// The tier's metrics now: `(name, kind, labels, value)` (as `Tier.metrics`).
    fn metrics(&self, py: Python<'_>) -> PyResult<Vec<MetricTuple>> {
        let samples = py.detach(|| self.with_tier(|t| t.metrics()))?;
        Ok(metric_tuples(samples))
    }

    /// kvtier's namespace digest (64 hex digits), which the slab superblocks carry.
    #[getter]
    fn namespace(&self) -> String {
        hex::encode(self.digest)
    }

    /// Whether this store is a client of kvtier's node service ([`SglangStore::connect`]).
    #[getter]
    fn client(&self) -> bool {
        self.local.is_none()
    }

    /// G3 slots per page (the page's pieces).
    #[getter]
    fn pieces(&self) -> usize {
        self.geometry.piece_rows.len()
    }

    /// Bytes of one piece (one slot).
    #[getter]
    fn piece_bytes(&self) -> u64 {
        self.geometry.piece_bytes
    }
}

/// A namespace digest given as 64 hex digits.
fn parse_digest(namespace: &str) -> PyResult<[u8; 32]> {
    kvtier::canonical::digest_from_hex(namespace).ok_or_else(|| {
        PyValueError::new_err(format!("namespace {namespace:?}: expected 64 hex digits"))
    })
}

/// Checks the page geometry SGLang's pool describes and turns it into rows.
fn geometry(
    length: usize,
    piece_bytes: u64,
    piece_offsets: &[u64],
    page_stride: u64,
    page_size: u64,
    num_pages: u64,
) -> PyResult<PageGeometry> {
    let bad = |what: String| ConfigError::new_err(format!("SGLang host pool: {what}"));
    let align = kvtier::geometry::ROW_ALIGNMENT as u64;
    if !kvtier::geometry::ChunkGeometry::is_row_aligned(piece_bytes) {
        return Err(bad(format!(
            "a page is stored as pieces of {piece_bytes} bytes, not a multiple of {align} \
             (what O_DIRECT needs); with layer_first a piece is one layer of a page: use \
             --hicache-mem-layout page_first (or page_first_direct), or a larger --page-size"
        )));
    }
    if piece_offsets.is_empty() || page_size == 0 || num_pages == 0 {
        return Err(bad("no pages".to_string()));
    }
    if !(length as u64).is_multiple_of(piece_bytes) {
        return Err(bad(format!(
            "its {length} bytes are not whole pieces of {piece_bytes} bytes"
        )));
    }
    let rows_total = length as u64 / piece_bytes;
    if rows_total > u64::from(u32::MAX) {
        return Err(bad(format!(
            "{rows_total} pieces are more than kvtier addresses"
        )));
    }
    if !page_stride.is_multiple_of(piece_bytes) {
        return Err(bad(format!(
            "pages are {page_stride} bytes apart, not whole pieces of {piece_bytes} bytes"
        )));
    }
    let page_rows = page_stride / piece_bytes;
    let mut piece_rows = Vec::with_capacity(piece_offsets.len());
    for &off in piece_offsets {
        if !off.is_multiple_of(piece_bytes) {
            return Err(bad(format!(
                "a piece at byte {off} of the pool is not at a multiple of {piece_bytes}"
            )));
        }
        let row = off / piece_bytes;
        if row + (num_pages - 1) * page_rows >= rows_total {
            return Err(bad(format!(
                "the last page's piece at row {row} + {} lies beyond the pool's {rows_total} \
                 pieces",
                (num_pages - 1) * page_rows
            )));
        }
        piece_rows.push(row);
    }
    Ok(PageGeometry {
        piece_bytes,
        piece_rows,
        page_rows,
        page_size,
        num_pages,
    })
}

/// Registers the class in `kvtier._native`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SglangStore>()
}
