//! `kvtier._native`: the native half of the Python package. `kvtier.vllm.KvtierTier` (pure
//! Python, vLLM's `SecondaryTierManager`) forwards every call here; this module adopts vLLM's
//! primary region in place and runs kvtier's G3 tier over it, built by the library's
//! [`kvtier::Builder`].
//!
//! Every method that may wait (a lock, the index, I/O, a drain) runs with the GIL released, so
//! the rest of the Python process keeps running.

use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use kvtier::canonical::VllmSpecFields;
use kvtier::contract::job::{JobResult, LookupResult, RequestContext, TransferJob};
use kvtier::contract::secondary::{SecondaryTier, TierMetric, TierMetricKind};
use kvtier::tiering::VLLM_TIER_CLASS;
use kvtier::{Builder, ChunkKey, Error, ErrorKind, PrimaryRegion};

mod sglang;

pyo3::create_exception!(
    kvtier._native,
    ConfigError,
    PyValueError,
    "A configuration value kvtier cannot use (the message names the key and what it expects)."
);
pyo3::create_exception!(
    kvtier._native,
    PathError,
    PyOSError,
    "A path or file kvtier cannot use: missing, not a directory, locked, without room, on a \
     filesystem without what the configuration requires, or an I/O error on it. `filename` is \
     the path and `errno` the OS error number when kvtier has them; the message says why."
);
pyo3::create_exception!(
    kvtier._native,
    KvtierError,
    PyRuntimeError,
    "kvtier failed (a tier that is shut down, data kvtier refuses to trust, an internal error)."
);

/// The Python exception class of each error kind (documented in `docs/vllm.md`, "Errors"):
/// a value problem is a [`ConfigError`] (a `ValueError`), a path problem a [`PathError`] (an
/// `OSError`), everything else a [`KvtierError`] (a `RuntimeError`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PyErrorClass {
    Config,
    Path,
    Kvtier,
}

fn error_class(kind: ErrorKind) -> PyErrorClass {
    match kind {
        ErrorKind::Config
        | ErrorKind::IncompatibleLayout
        | ErrorKind::Misaligned
        | ErrorKind::Contract => PyErrorClass::Config,
        ErrorKind::InvalidPath
        | ErrorKind::Io
        | ErrorKind::ShortIo
        | ErrorKind::NoSpace
        | ErrorKind::Locked
        | ErrorKind::PermissionDenied
        | ErrorKind::Unsupported
        | ErrorKind::Corrupt => PyErrorClass::Path,
        ErrorKind::Checksum
        | ErrorKind::Poisoned
        | ErrorKind::Closed
        | ErrorKind::Cancelled
        | ErrorKind::Internal
        | ErrorKind::RegionLost => PyErrorClass::Kvtier,
        // A kind added later: a runtime failure until it is placed above (and documented).
        _ => PyErrorClass::Kvtier,
    }
}

fn to_py(e: Error) -> PyErr {
    let message = e.to_string();
    match error_class(e.kind()) {
        PyErrorClass::Config => ConfigError::new_err(message),
        PyErrorClass::Kvtier => KvtierError::new_err(message),
        PyErrorClass::Path => {
            let errno = e
                .raw_os_error()
                .or_else(|| e.context_value("errno").and_then(|v| v.parse().ok()));
            let path = e.context_value("path").map(str::to_string);
            Python::attach(|py| {
                let err = PathError::new_err(message.clone());
                let value = err.value(py);
                // `OSError` keeps these as plain attributes: `errno`, `strerror` (the reason)
                // and `filename` (the path), as Python's own path errors carry them.
                let _ = value.setattr("errno", errno);
                let _ = value.setattr("strerror", message);
                let _ = value.setattr("filename", path);
                err
            })
        }
    }
}

/// Every kind with its Python class name, for the documentation test.
#[pyfunction]
fn error_classes() -> Vec<(&'static str, &'static str)> {
    ErrorKind::ALL
        .into_iter()
        .map(|k| {
            let class = match error_class(k) {
                PyErrorClass::Config => "ConfigError",
                PyErrorClass::Path => "PathError",
                PyErrorClass::Kvtier => "KvtierError",
            };
            (k.as_str(), class)
        })
        .collect()
}

/// kvtier's log lines (a path falling back to buffered I/O, a failed checkpoint) on stderr,
/// `kvtier: LEVEL message`, at `$KVTIER_LOG` (`error`, `warn` (default), `info`, `debug`).
struct StderrLogger {
    level: log::LevelFilter,
}

impl log::Log for StderrLogger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= self.level
    }

    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            use std::io::Write as _;
            let line = format!("kvtier: {} {}\n", record.level(), record.args());
            let _ = std::io::stderr().write_all(line.as_bytes());
        }
    }

    fn flush(&self) {}
}

/// Installs [`StderrLogger`] unless the process already has a `log` logger.
fn install_logger() {
    let level = std::env::var("KVTIER_LOG")
        .ok()
        .and_then(|l| l.parse().ok())
        .unwrap_or(log::LevelFilter::Warn);
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        let logger: &'static StderrLogger = Box::leak(Box::new(StderrLogger { level }));
        if log::set_logger(logger).is_ok() {
            log::set_max_level(level);
        }
    });
}

/// Lookup answers as small integers (`kvtier.vllm` maps them to vLLM's `LookupResult`).
const MISS: u8 = 0;
const HIT: u8 = 1;
const RETRY: u8 = 2;

/// One finished job: `(job_id, success, successful_keys, transfer_time_s, transfer_bytes,
/// error)`.
type JobTuple<'py> = (
    u64,
    bool,
    Option<Vec<Bound<'py, PyBytes>>>,
    Option<f64>,
    Option<u64>,
    Option<String>,
);

/// One metric sample: `(name, kind, labels, value)`.
type MetricTuple = (String, &'static str, Vec<(String, String)>, f64);

/// A G3 tier over vLLM's primary region.
#[pyclass(frozen, module = "kvtier._native", name = "Tier")]
struct Tier {
    tier: Mutex<Option<Box<dyn SecondaryTier>>>,
    /// The Python object that holds vLLM's buffer exported (a ctypes view of the region):
    /// kept until the tier has stopped, so the mapping outlives every transfer.
    anchor: Mutex<Option<Py<PyAny>>>,
    /// Jobs reported failed without reaching the tier (they could not run, or came after
    /// shutdown), handed back by the next `get_finished_jobs`.
    refused: Mutex<Vec<JobResult>>,
    /// Context for lookups (the G3 tier ignores the request).
    req: RequestContext,
    num_rows: usize,
    vllm_digest: String,
    namespace: String,
}

impl Tier {
    fn with_tier<T>(&self, f: impl FnOnce(&mut dyn SecondaryTier) -> T) -> PyResult<T> {
        let mut guard = self.tier.lock();
        match guard.as_mut() {
            Some(t) => Ok(f(t.as_mut())),
            None => Err(KvtierError::new_err("the kvtier tier is shut down")),
        }
    }

    /// The job vLLM submitted, or why kvtier cannot run it (reported as a failed job, as vLLM's
    /// own tiers report it, never raised into the scheduler). `chunk_ids` are int64, little
    /// endian; `None` when they were not integers.
    fn job(
        &self,
        job_id: u64,
        keys: &[Bound<'_, PyBytes>],
        chunk_ids: Option<&[u8]>,
        load: bool,
    ) -> Result<TransferJob, Error> {
        let contract = |msg: String| Error::new(ErrorKind::Contract, msg);
        let Some(chunk_ids) = chunk_ids else {
            return Err(contract(format!(
                "job {job_id}: chunk ids are not integers"
            )));
        };
        if chunk_ids.len() != keys.len() * 8 {
            return Err(contract(format!(
                "job {job_id}: {} keys but {} chunk ids",
                keys.len(),
                chunk_ids.len() / 8
            )));
        }
        let rows = chunk_ids
            .chunks_exact(8)
            .map(|b| {
                let id = i64::from_le_bytes(b.try_into().expect("chunks of 8 bytes"));
                u32::try_from(id)
                    .ok()
                    .filter(|&r| (r as usize) < self.num_rows)
                    .ok_or_else(|| {
                        contract(format!(
                            "job {job_id}: chunk id {id} is not a row of the primary region \
                             (0..{})",
                            self.num_rows
                        ))
                    })
            })
            .collect::<Result<Vec<u32>, Error>>()?;
        Ok(TransferJob {
            job_id,
            keys: keys.iter().map(|k| ChunkKey::new(k.as_bytes())).collect(),
            chunk_ids: rows,
            is_promotion: load,
            req_id: self.req.req_id.clone(),
            submit_time: Instant::now(),
        })
    }

    /// Hands a job to the tier, or reports it failed at the next `get_finished_jobs` when it
    /// cannot run (see [`Tier::job`]) or the tier is shut down.
    fn submit(
        &self,
        py: Python<'_>,
        job_id: u64,
        keys: &[Bound<'_, PyBytes>],
        chunk_ids: Option<&[u8]>,
        load: bool,
    ) {
        let job = match self.job(job_id, keys, chunk_ids, load) {
            Ok(job) => job,
            Err(e) => {
                self.refused.lock().push(JobResult::failed(job_id, e));
                return;
            }
        };
        py.detach(|| {
            let mut guard = self.tier.lock();
            match guard.as_mut() {
                Some(t) if load => t.submit_load(job),
                Some(t) => t.submit_store(job),
                None => {
                    let e = Error::new(
                        ErrorKind::Closed,
                        format!("job {job_id}: the kvtier tier is shut down"),
                    );
                    self.refused.lock().push(JobResult::failed(job_id, e));
                }
            }
        })
    }
}

/// What both constructors of [`Tier`] take from vLLM's view and spec.
struct RegionSpec {
    /// Rows of the primary region.
    num_rows: usize,
    /// The spec's namespace digest.
    namespace: [u8; 32],
    /// vLLM's digest of the spec, in hex.
    vllm_digest: String,
    /// Bytes of each row the tier stores when a `layout` names a canonical area shorter than
    /// the row (replicated GQA heads); `None`: whole rows.
    slot_prefix: Option<u64>,
}

impl RegionSpec {
    /// Checks that `length` bytes are whole rows of `row_stride` bytes, the row stride of
    /// `spec` (JSON of kvtier's `VllmSpecFields`), and computes the spec's digests. `layout`
    /// (`(key path, value)` of the entry's `layout`) names the canonical area the tier stores,
    /// checked against the spec; the namespace then names the area instead of the row.
    fn new(
        length: usize,
        row_stride: usize,
        spec: &str,
        layout: Option<(&str, &str)>,
    ) -> PyResult<Self> {
        if row_stride == 0 || !length.is_multiple_of(row_stride) {
            return Err(ConfigError::new_err(format!(
                "the primary region ({length} bytes) is not whole rows of {row_stride} bytes"
            )));
        }
        install_logger();
        let num_rows = length / row_stride;
        let mut spec = VllmSpecFields::from_json(spec).map_err(to_py)?;
        if spec.row_stride != row_stride as u64 {
            return Err(ConfigError::new_err(format!(
                "the view's row stride {row_stride} differs from the spec's {}",
                spec.row_stride
            )));
        }
        if let Some((key, value)) = layout {
            let (desc, _) = kvtier::canonical::resolve_layout(key, value).map_err(to_py)?;
            spec.slot_bytes = Some(spec.canonical_area(&desc, key).map_err(to_py)?);
        }
        let slot_prefix = spec.slot_bytes.filter(|&b| b < spec.row_stride);
        let namespace = spec.namespace_digest().map_err(to_py)?;
        let vllm_digest =
            kvtier::canonical::vllm_digest(&spec.vllm_digest_fields().map_err(to_py)?).0;
        Ok(RegionSpec {
            num_rows,
            namespace,
            vllm_digest,
            slot_prefix,
        })
    }

    /// The Python object over `tier` (`anchor`: see [`Tier::anchor`]).
    fn tier(self, tier: Box<dyn SecondaryTier>, anchor: Option<Py<PyAny>>) -> Tier {
        Tier {
            tier: Mutex::new(Some(tier)),
            anchor: Mutex::new(anchor),
            refused: Mutex::new(Vec::new()),
            req: RequestContext::new("kvtier.vllm"),
            num_rows: self.num_rows,
            vllm_digest: self.vllm_digest,
            namespace: hex::encode(self.namespace),
        }
    }
}

#[pymethods]
impl Tier {
    /// Adopts `length` bytes at `base` (rows of `row_stride` bytes) and opens
    /// `secondary_tiers[tier_index]` (`tier_entry`: the entry as JSON) over them, namespaced by
    /// `spec` (JSON of kvtier's `VllmSpecFields`). `anchor` must keep the memory mapped until
    /// [`Tier::shutdown`] has returned.
    #[new]
    #[pyo3(signature = (base, length, row_stride, anchor, tier_entry, tier_index, spec, events))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        base: usize,
        length: usize,
        row_stride: usize,
        anchor: Py<PyAny>,
        tier_entry: &str,
        tier_index: usize,
        spec: &str,
        events: bool,
    ) -> PyResult<Self> {
        let entry: serde_json::Value = serde_json::from_str(tier_entry)
            .map_err(|e| ConfigError::new_err(format!("invalid tier entry: {e}")))?;
        let tier_config = kvtier::config::resolve_tier_entry(tier_index, &entry).map_err(to_py)?;
        if tier_config.tier_type != VLLM_TIER_CLASS {
            return Err(ConfigError::new_err(format!(
                "secondary_tiers[{tier_index}].type: expected {VLLM_TIER_CLASS:?}, found {:?}",
                tier_config.tier_type
            )));
        }
        // `region_huge_pages`: `auto` (kvtier's own 2 MiB-page mapping of vLLM's region where
        // it can) or `never` (vLLM's mapping, 4 KiB pages); a bad value names the key.
        let huge_pages = kvtier::embed::region_huge_pages(&tier_config).map_err(to_py)?;
        let layout_key = format!("{}.layout", tier_config.key_path());
        // A `layout` that is not a string was refused with the whole entry just above.
        let layout = tier_config
            .params
            .get("layout")
            .and_then(serde_json::Value::as_str);
        let rs = RegionSpec::new(
            length,
            row_stride,
            spec,
            layout.map(|v| (layout_key.as_str(), v)),
        )?;
        let (num_rows, namespace, slot_prefix) = (rs.num_rows, rs.namespace, rs.slot_prefix);
        let tier = py
            .detach(move || {
                // SAFETY: `anchor` holds vLLM's buffer exported, so `length` bytes at `base`
                // stay mapped and unmoved; this object keeps `anchor` until the tier (and
                // with it every clone of the region's `Arc` held by its I/O engine) has
                // stopped, and never drops it when stopping failed.
                // With 2 MiB pages where vLLM's /dev/shm file allows (kvtier's own second
                // mapping of it; vLLM's mapping and bytes stay as they are), unless the
                // entry's `region_huge_pages` says `never`.
                let region = unsafe {
                    PrimaryRegion::adopt_shared(
                        base as *mut u8,
                        row_stride as u64,
                        num_rows,
                        huge_pages,
                    )
                }?;
                let mut builder = Builder::for_tier(tier_config)
                    .region(Arc::new(region))
                    .namespace(namespace)
                    .events(events);
                if let Some(bytes) = slot_prefix {
                    builder = builder.slot_bytes(bytes);
                }
                builder.build_tier(tier_index)
            })
            .map_err(to_py)?;
        Ok(rs.tier(tier, Some(anchor)))
    }

    /// A tier in client mode: connects to the kvtier node service at `socket` (which owns
    /// the G3 pool of the host), presents the namespace digest of `spec` (JSON of kvtier's
    /// `VllmSpecFields`) and registers vLLM's primary region by the path of its shared file
    /// (`region_path`, `length` bytes of rows of `row_stride` bytes). `engine` names this
    /// engine in the service's status. `layout` (the tier entry's `layout` key, a shipped
    /// layout name or a descriptor path; errors name `secondary_tiers[tier_index].layout`)
    /// names the canonical area the service stores, checked against `spec` as in process: the
    /// namespace then names the area instead of the row (replicated GQA heads).
    #[staticmethod]
    #[pyo3(signature = (socket, region_path, length, row_stride, spec, engine, locality=None, layout=None, tier_index=0))]
    #[allow(clippy::too_many_arguments)]
    fn connect(
        py: Python<'_>,
        socket: &str,
        region_path: &str,
        length: usize,
        row_stride: usize,
        spec: &str,
        engine: &str,
        locality: Option<&str>,
        layout: Option<&str>,
        tier_index: usize,
    ) -> PyResult<Self> {
        let layout_key = format!("secondary_tiers[{tier_index}].layout");
        let rs = RegionSpec::new(
            length,
            row_stride,
            spec,
            layout.map(|v| (layout_key.as_str(), v)),
        )?;
        let locality = match locality {
            None => None,
            Some(l) => Some(kvtier::contract::job::Locality::parse(l).ok_or_else(|| {
                ConfigError::new_err(format!("locality {l:?}: expected LOCAL or REMOTE"))
            })?),
        };
        let hello = kvtier::node::ClientHello {
            engine: engine.to_string(),
            row_stride: row_stride as u64,
            digest: rs.namespace,
        };
        let tier = py
            .detach(|| {
                kvtier::node::NodeTier::connect(
                    std::path::Path::new(socket),
                    &hello,
                    kvtier::node::RegionSource::Path(std::path::Path::new(region_path)),
                    rs.num_rows as u64,
                    locality,
                )
            })
            .map_err(to_py)?;
        Ok(rs.tier(Box::new(tier), None))
    }

    /// 0 = MISS, 1 = HIT, 2 = RETRY (also while the index recovers).
    fn lookup(&self, py: Python<'_>, key: &[u8]) -> PyResult<u8> {
        let key = ChunkKey::new(key);
        py.detach(|| {
            self.with_tier(|t| match t.lookup(&key, &self.req) {
                LookupResult::Hit => HIT,
                LookupResult::Retry | LookupResult::HitPending => RETRY,
                LookupResult::Miss => MISS,
            })
        })
    }

    /// Marks keys as recently used (vLLM's `touch`, forwarded to the tier).
    fn touch(&self, py: Python<'_>, keys: Vec<Bound<'_, PyBytes>>) -> PyResult<()> {
        let keys: Vec<ChunkKey> = keys.iter().map(|k| ChunkKey::new(k.as_bytes())).collect();
        py.detach(|| self.with_tier(|t| t.touch(&keys, &self.req)))
    }

    /// Queues a store job (rows -> slots); `chunk_ids` are the job's row ids as int64, little
    /// endian (`numpy.ndarray.tobytes()`), or `None` when vLLM's were not integers. A job that
    /// cannot run is reported failed by `get_finished_jobs`, never raised.
    #[pyo3(signature = (job_id, keys, chunk_ids))]
    fn submit_store(
        &self,
        py: Python<'_>,
        job_id: u64,
        keys: Vec<Bound<'_, PyBytes>>,
        chunk_ids: Option<&[u8]>,
    ) {
        self.submit(py, job_id, &keys, chunk_ids, false);
    }

    /// Queues a load job (slots -> rows), like [`Tier::submit_store`].
    #[pyo3(signature = (job_id, keys, chunk_ids))]
    fn submit_load(
        &self,
        py: Python<'_>,
        job_id: u64,
        keys: Vec<Bound<'_, PyBytes>>,
        chunk_ids: Option<&[u8]>,
    ) {
        self.submit(py, job_id, &keys, chunk_ids, true);
    }

    /// Every job finished since the last call, once each (also after shutdown: the jobs
    /// refused since).
    fn get_finished_jobs<'py>(&self, py: Python<'py>) -> Vec<JobTuple<'py>> {
        let results: Vec<JobResult> = py.detach(|| {
            let mut out = std::mem::take(&mut *self.refused.lock());
            if let Some(t) = self.tier.lock().as_mut() {
                out.extend(t.get_finished_jobs());
            }
            out
        });
        results
            .into_iter()
            .map(|r| {
                let keys = r
                    .successful_keys
                    .map(|ks| ks.iter().map(|k| PyBytes::new(py, k.as_bytes())).collect());
                (
                    r.job_id,
                    r.success,
                    keys,
                    r.transfer_time.map(|d| d.as_secs_f64()),
                    r.transfer_bytes,
                    r.error.map(|e| e.to_string()),
                )
            })
            .collect()
    }

    /// True while jobs are outstanding (refused ones not yet reported included).
    fn has_pending_work(&self, py: Python<'_>) -> bool {
        py.detach(|| {
            // One lock at a time (`submit` takes `refused` while holding `tier`).
            let refused = !self.refused.lock().is_empty();
            refused
                || self
                    .tier
                    .lock()
                    .as_ref()
                    .is_some_and(|t| t.has_pending_work())
        })
    }

    /// True once lookups answer HIT or MISS (the index has been recovered).
    fn ready(&self, py: Python<'_>) -> PyResult<bool> {
        py.detach(|| self.with_tier(|t| t.ready()))
    }

    /// A request starts; `kv_hints` is the JSON of its `KvHintsEnvelope` (vLLM's
    /// `msgspec.to_builtins`), if it has one. A tier of the node service starts kvtier's
    /// prefetch actions (`docs/node-service.md`); other tiers ignore hints.
    #[pyo3(signature = (req_id, kv_hints=None))]
    fn on_new_request(&self, py: Python<'_>, req_id: &str, kv_hints: Option<&str>) -> PyResult<()> {
        let mut req = RequestContext::new(req_id);
        if let Some(json) = kv_hints {
            let envelope =
                kvtier::contract::hints::KvHintsEnvelope::from_json(json).map_err(to_py)?;
            req = req.with_kv_hints(envelope);
        }
        py.detach(|| {
            self.with_tier(|t| {
                // The Python side answers vLLM's RequestOffloadingContext itself.
                let _ = t.on_new_request(&req);
            })
        })
    }

    /// A request finished (what its hints staged and it did not use is discarded).
    fn on_request_finished(&self, py: Python<'_>, req_id: &str) -> PyResult<()> {
        let req = RequestContext::new(req_id);
        py.detach(|| self.with_tier(|t| t.on_request_finished(&req)))
    }

    /// Stored / removed events since the last call: `(keys, removed, medium)`, medium `"CPU"`
    /// (the node service's DRAM staging pool) or `"STORAGE"` (G3).
    #[allow(clippy::type_complexity)]
    fn take_events<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Vec<(Vec<Bound<'py, PyBytes>>, bool, &'static str)>> {
        let events = py.detach(|| self.with_tier(|t| t.take_events()))?;
        Ok(events
            .into_iter()
            .map(|e| {
                let keys = e
                    .keys
                    .iter()
                    .map(|k| PyBytes::new(py, k.as_bytes()))
                    .collect();
                (keys, e.removed, e.medium.as_str())
            })
            .collect())
    }

    /// Blocks (GIL released) until every submitted job has completed or failed.
    fn drain_jobs(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.with_tier(|t| t.drain_jobs()))
    }

    /// Drains, writes the checkpoint and stops the tier's threads (GIL released); then lets go
    /// of the region. On an error the region stays anchored (I/O may still reference it) and
    /// the error is raised. A second call does nothing.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        let result = py.detach(|| {
            let mut guard = self.tier.lock();
            let Some(tier) = guard.as_mut() else {
                return Ok(());
            };
            tier.shutdown()?;
            // The worker has joined: no I/O references the region any more.
            guard.take();
            Ok(())
        });
        result.map_err(to_py)?;
        if self.tier.lock().is_none() {
            drop(self.anchor.lock().take());
        }
        Ok(())
    }

    /// The tier's metrics now: `(name, kind, labels, value)`, kind `counter` or `gauge`.
    fn metrics(&self, py: Python<'_>) -> PyResult<Vec<MetricTuple>> {
        let samples = py.detach(|| self.with_tier(|t| t.metrics()))?;
        Ok(metric_tuples(samples))
    }

    /// The tier's static facts: `(label name, value)` pairs.
    fn config_info(&self, py: Python<'_>) -> PyResult<Vec<(String, String)>> {
        let info = py.detach(|| self.with_tier(|t| t.config_info()))?;
        Ok(info.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
    }

    /// vLLM's own digest of these inputs (`FileMapper`, 12 hex digits).
    #[getter]
    fn vllm_digest(&self) -> String {
        self.vllm_digest.clone()
    }

    /// kvtier's namespace digest (64 hex digits), which the slab superblocks carry.
    #[getter]
    fn namespace(&self) -> String {
        self.namespace.clone()
    }
}

/// A tier's metric samples as the Python side takes them: `(name, kind, labels, value)`.
fn metric_tuples(samples: Vec<TierMetric>) -> Vec<MetricTuple> {
    samples
        .into_iter()
        .map(|m| {
            (
                m.name.to_string(),
                kind_name(m.kind),
                m.labels
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v))
                    .collect(),
                m.value,
            )
        })
        .collect()
}

fn kind_name(kind: TierMetricKind) -> &'static str {
    match kind {
        TierMetricKind::Counter => "counter",
        TierMetricKind::Gauge => "gauge",
    }
}

/// Every metric a tier reports: `(name, help, kind, label names)`, without opening one. The
/// in-process tier's (`g3_*`) and the client mode's (`node_client_*`): vLLM declares them per
/// class, before it knows which mode each entry runs.
#[pyfunction]
fn metric_descriptors() -> Vec<(&'static str, &'static str, &'static str, Vec<&'static str>)> {
    kvtier::embed::tier_metric_descriptors(VLLM_TIER_CLASS)
        .unwrap_or_default()
        .into_iter()
        .chain(kvtier::node::NodeTier::metric_descriptors())
        .map(|d| (d.name, d.help, kind_name(d.kind), d.label_names))
        .collect()
}

/// The label names of [`Tier::config_info`], without opening a tier: those of the in-process
/// tier, or with `client` those of the client mode (`service_socket_path`).
#[pyfunction]
#[pyo3(signature = (client=false))]
fn config_info_keys(client: bool) -> Vec<&'static str> {
    if client {
        return kvtier::node::NodeTier::CONFIG_INFO_KEYS.to_vec();
    }
    kvtier::embed::tier_config_info_keys(VLLM_TIER_CLASS)
        .unwrap_or_default()
        .to_vec()
}

/// `(vllm_digest, kvtier_namespace_hex, namespace_fields_json)` for a spec (JSON of
/// `VllmSpecFields`), without opening a tier.
#[pyfunction]
fn namespace_of(spec: &str) -> PyResult<(String, String, String)> {
    let spec = VllmSpecFields::from_json(spec).map_err(to_py)?;
    let (vllm, _) = kvtier::canonical::vllm_digest(&spec.vllm_digest_fields().map_err(to_py)?);
    let fields = spec.namespace_fields().map_err(to_py)?;
    let digest = spec.namespace_digest().map_err(to_py)?;
    Ok((vllm, hex::encode(digest), fields.to_string()))
}

/// kvtier's version.
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Tier>()?;
    sglang::register(m)?;
    m.add_function(wrap_pyfunction!(metric_descriptors, m)?)?;
    m.add_function(wrap_pyfunction!(config_info_keys, m)?)?;
    m.add_function(wrap_pyfunction!(namespace_of, m)?)?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add("ConfigError", m.py().get_type::<ConfigError>())?;
    m.add("KvtierError", m.py().get_type::<KvtierError>())?;
    let path_error = m.py().get_type::<PathError>();
    // The message is kvtier's own (it names the path and the reason); `OSError` would print
    // `[Errno N] strerror: 'filename'` instead, repeating the path.
    let message_only = m.py().eval(
        c"lambda self: str(self.args[0]) if self.args else ''",
        None,
        None,
    )?;
    path_error.setattr("__str__", message_only)?;
    m.add("PathError", path_error)?;
    m.add_function(wrap_pyfunction!(error_classes, m)?)?;
    Ok(())
}
