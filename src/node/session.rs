//! One engine's connection to the node service: the handshake (compatibility digest, and a
//! row stride whose rows hold the service's slot: each engine has its own), its region (mapped here, with an I/O engine of its own over the G3 slab files),
//! lookups, and its store and load jobs, which move rows directly between G3 slots and the
//! engine's rows through the tier's direct-slot grants (`crate::g3::direct`).
//!
//! The service's threads never load or store an engine's rows through the mapping: CRCs and
//! copies go through the region file's descriptor (`crate::node::region_file`), so an engine
//! that shrinks its region file fails its own jobs ([`ErrorKind::RegionLost`]) and its session
//! ends, where a CPU access would have raised `SIGBUS` in the whole service.
//!
//! When the connection ends, for any reason (a clean close, SIGKILL of the engine, a protocol
//! error, its region lost), the session cancels the jobs still queued, finishes the one in
//! flight as failed (its reserved slots are released, its pins dropped, nothing of it is
//! committed), stops the I/O engine, unmaps the region and leaves the registry.

use std::cell::RefCell;
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TrySendError};
use parking_lot::Mutex;

use crate::contract::job::{JobResult, LookupResult, RequestContext};
use crate::contract::secondary::SecondaryTier;
use crate::error::{Error, ErrorKind, Result};
use crate::g3::G3Tier;
use crate::g3::direct::{DirectSlots, GrantedSlot};
use crate::io::{EngineHandle, EngineOptions, IoDir, IoEngineKind, IoRequest, open_engine};
use crate::key::ChunkKey;
use crate::node::engines::{EngineEntry, EngineRegistry, RegionInfo};
use crate::node::events::EventBus;
use crate::node::prefetch::Staging;
use crate::node::protocol::{EventMedium, Frame, JobDone, JobRequest, Reply, Request};
use crate::node::region_file::{CRC_CHUNK, RegionFile};
use crate::node::socket::{FrameReader, is_read_write, write_frame};
use crate::node::staging::{FILL_WAIT, Reserve};
use crate::region::PrimaryRegion;

/// Jobs one engine may have queued at the service; beyond that a job fails at once.
pub const MAX_QUEUED_JOBS_PER_ENGINE: usize = 1024;
/// How long the service waits for a `HELLO`, and for a stalled engine to take a reply.
pub const SOCKET_TIMEOUT: Duration = Duration::from_secs(10);

/// What every session of one service shares.
pub struct ServiceShared {
    /// The G3 tier (lookups).
    pub tier: Mutex<G3Tier>,
    /// Its direct-slot grants (stores and loads).
    pub slots: DirectSlots,
    /// The engine kind for each region (`io_engine` of the tier).
    pub io_engine: IoEngineKind,
    /// Whether the slab files are O_DIRECT.
    pub o_direct: bool,
    /// Requests in flight per region's engine.
    pub queue_depth: u32,
    /// Bytes per row the service was planned for (`kvtier serve --layout --tp`; the status
    /// document's `row_stride`). Each engine presents its own row stride, at least
    /// `slot_bytes`: engines of one namespace at other TP sizes may have larger rows
    /// (replicated GQA heads).
    pub row_stride: u64,
    /// Bytes per slot: each row's first `slot_bytes` are stored (the whole row, or the
    /// canonical area of a larger row).
    pub slot_bytes: u64,
    /// The compatibility digest engines must present.
    pub digest: [u8; 32],
    /// Uids allowed to connect.
    pub allowed_uids: Vec<u32>,
    /// The connected engines.
    pub engines: EngineRegistry,
    /// Set when the service stops: sessions end.
    pub stopping: AtomicBool,
    /// The DRAM staging pool and its prefetch thread (`service.dram_bytes` > 0).
    pub staging: Option<Staging>,
    /// Inventory events for the engines that ask for them.
    pub events: Arc<EventBus>,
}

impl ServiceShared {
    /// Moves the G3 tier's events (STORAGE) to the engines' queues.
    fn pump_tier_events(&self) {
        let events = self.tier.lock().take_events();
        for e in events {
            self.events
                .publish(EventMedium::Storage, e.removed, &e.keys);
        }
    }
}

impl std::fmt::Debug for ServiceShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceShared")
            .field("row_stride", &self.row_stride)
            .field("digest", &hex::encode(self.digest))
            .finish_non_exhaustive()
    }
}

/// A mapped region and the I/O engine moving its rows.
struct MappedRegion {
    region: Arc<PrimaryRegion>,
    engine: EngineHandle,
    /// The region file: every CPU access to the rows goes through it.
    file: RegionFile,
    /// Why the region is lost, once it is (every later job fails with it).
    lost: Mutex<Option<Error>>,
}

/// A job on its way to the session's job thread.
struct QueuedJob {
    seq: u64,
    load: bool,
    job: JobRequest,
}

/// Runs one connection until it ends (the peer's uid is already checked).
pub fn run(sh: Arc<ServiceShared>, stream: UnixStream, uid: u32, pid: i32) {
    let (entry, row_stride) = match handshake(&sh, &stream, uid, pid) {
        Ok(Some(accepted)) => accepted,
        Ok(None) => return observe(&sh, stream),
        Err(e) => {
            sh.engines.refused.fetch_add(1, Ordering::Relaxed);
            log::warn!("node service: refused pid {pid} (uid {uid}): {e}");
            return;
        }
    };
    log::info!(
        "node service: engine {:?} connected (pid {pid}, uid {uid}, connection {})",
        entry.name,
        entry.id
    );
    let mut s = Session {
        sh: sh.clone(),
        entry: entry.clone(),
        row_stride,
        writer: Arc::new(Mutex::new(stream.try_clone().ok())),
        region: None,
        jobs_tx: None,
        job_thread: None,
        cancelled: Arc::new(AtomicBool::new(false)),
        hints: HashMap::new(),
    };
    let end = match stream.try_clone() {
        Ok(read_side) => s.serve(FrameReader::new(read_side)),
        Err(e) => Err(Error::new(
            ErrorKind::Io,
            format!("cannot clone the socket: {e}"),
        )),
    };
    match &end {
        Ok(()) => log::info!("node service: engine {:?} disconnected", entry.name),
        Err(e) => log::warn!(
            "node service: engine {:?} (pid {pid}) dropped: {e}",
            entry.name
        ),
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
    s.close();
    sh.engines.remove(entry.id);
}

/// Reads the `HELLO`, checks the digest and that the engine's rows hold a slot, answers
/// `WELCOME` (with the slot size) or the refusal. Returns the engine and its row stride.
///
/// A `HELLO` with row stride 0 and an all-zero digest opens an observer session (`kvtier
/// service status`): `Ok(None)`.
fn handshake(
    sh: &ServiceShared,
    stream: &UnixStream,
    uid: u32,
    pid: i32,
) -> Result<Option<(Arc<EngineEntry>, u64)>> {
    stream
        .set_read_timeout(Some(SOCKET_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(SOCKET_TIMEOUT)))
        .map_err(|e| Error::new(ErrorKind::Io, format!("socket timeouts: {e}")))?;
    let mut reader = FrameReader::new(
        stream
            .try_clone()
            .map_err(|e| Error::new(ErrorKind::Io, format!("cannot clone the socket: {e}")))?,
    );
    let frame = reader
        .read_frame()?
        .ok_or_else(|| Error::new(ErrorKind::Closed, "closed before HELLO"))?;
    let refuse = |e: Error| {
        let _ = write_frame(stream, &error_reply(&e).to_frame(frame.seq));
        e
    };
    let (row_stride, digest, engine) = match Request::from_frame(&frame) {
        Ok(Request::Hello {
            row_stride,
            digest,
            engine,
        }) => (row_stride, digest, engine),
        Ok(_) => {
            return Err(refuse(Error::new(
                ErrorKind::Contract,
                "the first request must be HELLO",
            )));
        }
        Err(e) => return Err(refuse(e)),
    };
    let welcome = Reply::Welcome {
        row_stride: sh.slot_bytes,
        digest: sh.digest,
        version: env!("CARGO_PKG_VERSION").to_string(),
    };
    if row_stride == 0 && digest == [0; 32] {
        write_frame(stream, &welcome.to_frame(frame.seq))?;
        return Ok(None);
    }
    if digest != sh.digest {
        // An engine whose rows are larger than the slots presents its whole row unless its
        // tier entry names the layout (the canonical area, replicated GQA heads).
        let layout_hint = if row_stride > sh.slot_bytes {
            format!(
                "; its rows ({row_stride} bytes) are larger than the service's slots ({} \
                 bytes): if they hold the model's canonical area (replicated KV heads with \
                 canonical_layout), set the tier entry's layout key (a shipped layout name \
                 or a descriptor path) so that the engine presents the area",
                sh.slot_bytes
            )
        } else {
            String::new()
        };
        return Err(refuse(Error::new(
            ErrorKind::IncompatibleLayout,
            format!(
                "compatibility digest mismatch: engine {engine:?} has {}, the service has {} \
                 (the model, dtype, layout, TP size, blocks per chunk or canonical_layout \
                 differ; start the engine with the service's configuration or run a service \
                 for it){layout_hint}",
                hex::encode(digest),
                hex::encode(sh.digest)
            ),
        )));
    }
    if row_stride < sh.slot_bytes {
        return Err(refuse(Error::new(
            ErrorKind::IncompatibleLayout,
            format!(
                "row stride mismatch: engine {engine:?} has rows of {row_stride} bytes, smaller \
                 than the service's slots of {} bytes (each row must hold a slot)",
                sh.slot_bytes
            ),
        )));
    }
    // Past the handshake, an engine may stay quiet as long as it likes; a reply it does not
    // take within the timeout still ends the session.
    stream
        .set_read_timeout(None)
        .map_err(|e| Error::new(ErrorKind::Io, format!("socket timeout: {e}")))?;
    write_frame(stream, &welcome.to_frame(frame.seq))?;
    Ok(Some((sh.engines.add(engine, uid, pid), row_stride)))
}

/// An observer session: `STATUS` only, until the peer closes or a read times out.
fn observe(sh: &ServiceShared, stream: UnixStream) {
    let Ok(read_side) = stream.try_clone() else {
        return;
    };
    let mut reader = FrameReader::new(read_side);
    while let Ok(Some(frame)) = reader.read_frame() {
        let reply = match Request::from_frame(&frame) {
            Ok(Request::Status) => Reply::Status(status_json(sh)),
            Ok(_) => error_reply(&Error::new(
                ErrorKind::Contract,
                "an observer session (row stride 0) may only ask for STATUS",
            )),
            Err(e) => error_reply(&e),
        };
        if write_frame(&stream, &reply.to_frame(frame.seq)).is_err() {
            return;
        }
    }
}

fn error_reply(e: &Error) -> Reply {
    Reply::Error {
        kind: e.kind(),
        message: e.to_string(),
    }
}

struct Session {
    sh: Arc<ServiceShared>,
    entry: Arc<EngineEntry>,
    /// Bytes per row of this engine's region (at least the service's slot).
    row_stride: u64,
    /// The write side; `None` once it failed (the engine is gone or stalled).
    writer: Arc<Mutex<Option<UnixStream>>>,
    region: Option<Arc<MappedRegion>>,
    jobs_tx: Option<Sender<QueuedJob>>,
    job_thread: Option<std::thread::JoinHandle<()>>,
    cancelled: Arc<AtomicBool>,
    /// Keys held in the staging pool for each hinted request of this engine.
    hints: HashMap<String, Vec<ChunkKey>>,
}

fn send(writer: &Mutex<Option<UnixStream>>, frame: &Frame) {
    let mut w = writer.lock();
    if let Some(stream) = w.as_ref()
        && let Err(e) = write_frame(stream, frame)
    {
        log::warn!("node service: an engine does not take its replies ({e}); dropping it");
        let _ = stream.shutdown(std::net::Shutdown::Both);
        *w = None;
    }
}

impl Session {
    fn reply(&self, seq: u64, r: &Reply) {
        send(&self.writer, &r.to_frame(seq));
    }

    /// Answers request `seq` with `e`, counted as the engine's error.
    fn refuse(&self, seq: u64, e: &Error) {
        self.entry.counters.errors.fetch_add(1, Ordering::Relaxed);
        self.reply(seq, &error_reply(e));
    }

    fn serve(&mut self, mut reader: FrameReader) -> Result<()> {
        loop {
            if self.sh.stopping.load(Ordering::Relaxed) {
                return Ok(());
            }
            let Some(frame) = reader.read_frame()? else {
                return Ok(());
            };
            let req = match Request::from_frame(&frame) {
                Ok(r) => r,
                Err(e) => {
                    self.refuse(frame.seq, &e);
                    continue;
                }
            };
            match req {
                Request::Hello { .. } => self.refuse(
                    frame.seq,
                    &Error::new(ErrorKind::Contract, "HELLO was already sent"),
                ),
                Request::RegisterPath { num_rows, path } => {
                    let r = open_region_file(&path, self.entry.uid)
                        .and_then(|fd| self.register(fd, num_rows, "path", path.clone()));
                    self.answer_register(frame.seq, num_rows, r);
                }
                Request::RegisterFd { num_rows } => {
                    let r = match reader.take_fd() {
                        Some(fd) if is_read_write(&fd) => {
                            self.register(fd, num_rows, "fd", "fd".into())
                        }
                        Some(_) => Err(Error::new(
                            ErrorKind::Config,
                            "the region descriptor is not open for reading and writing",
                        )),
                        None => Err(Error::new(
                            ErrorKind::Contract,
                            "REGISTER_FD arrived without a descriptor (SCM_RIGHTS)",
                        )),
                    };
                    self.answer_register(frame.seq, num_rows, r);
                }
                Request::Lookup { keys } => {
                    let ctx = RequestContext::new("node-service");
                    let staged =
                        |k: &ChunkKey| self.sh.staging.as_ref().is_some_and(|s| s.pool.contains(k));
                    let mut from_pool = Vec::new();
                    let results = {
                        let mut tier = self.sh.tier.lock();
                        keys.iter()
                            .map(|k| {
                                if staged(k) {
                                    from_pool.push(k.clone());
                                    LookupResult::Hit
                                } else {
                                    tier.lookup(k, &ctx)
                                }
                            })
                            .collect()
                    };
                    // G3's lookup refreshes a key's recency; the pool's answer does as well.
                    if let Some(st) = &self.sh.staging {
                        st.touch_g3(from_pool);
                    }
                    self.entry
                        .counters
                        .lookups
                        .fetch_add(keys.len() as u64, Ordering::Relaxed);
                    self.reply(frame.seq, &Reply::Lookup(results));
                }
                Request::Store(job) => self.enqueue(frame.seq, false, job),
                Request::Load(job) => self.enqueue(frame.seq, true, job),
                Request::Status => {
                    let json = status_json(&self.sh);
                    self.reply(frame.seq, &Reply::Status(json));
                }
                Request::Hint { req_id, keys } => {
                    let verdicts = match &self.sh.staging {
                        Some(st) => {
                            let (verdicts, held) = st.hint(&self.sh.tier, &keys);
                            self.hints.entry(req_id).or_default().extend(held);
                            verdicts
                        }
                        // No pool: the verdicts are plain lookups.
                        None => {
                            let ctx = RequestContext::new("node-service-hint");
                            let mut tier = self.sh.tier.lock();
                            keys.iter().map(|k| tier.lookup(k, &ctx)).collect()
                        }
                    };
                    self.reply(frame.seq, &Reply::Hinted(verdicts));
                }
                Request::HintDone { req_id } => self.release_hint(&req_id),
                // vLLM's touch: G3's LRU, through its worker's queue (never waits).
                Request::Touch { keys } => match &self.sh.staging {
                    Some(st) => st.touch_g3(keys),
                    None => {
                        self.sh.slots.touch(keys);
                    }
                },
                Request::TakeEvents => {
                    if !self.sh.events.has_subscribers() {
                        self.sh.tier.lock().set_events_enabled(true);
                    }
                    self.sh.pump_tier_events();
                    let events = self.sh.events.take(self.entry.id);
                    self.reply(frame.seq, &Reply::Events(events));
                }
            }
        }
    }

    fn answer_register(&self, seq: u64, num_rows: u64, r: Result<()>) {
        match r {
            Ok(()) => self.reply(seq, &Reply::Registered { num_rows }),
            Err(e) => {
                log::warn!(
                    "node service: engine {:?}: region refused: {e}",
                    self.entry.name
                );
                self.refuse(seq, &e);
            }
        }
    }

    fn register(&mut self, fd: OwnedFd, num_rows: u64, source: &str, path: String) -> Result<()> {
        if self.region.is_some() {
            return Err(Error::new(
                ErrorKind::Contract,
                "a region is already registered on this connection",
            ));
        }
        let rows = usize::try_from(num_rows)
            .map_err(|_| Error::new(ErrorKind::Config, "num_rows does not fit this machine"))?;
        let region = Arc::new(PrimaryRegion::map_shared_file(&fd, rows, self.row_stride)?);
        // Before io_uring pins its pages: any shrink from here on is seen (`RegionFile`).
        let file = RegionFile::new(fd, &self.entry.name, &path, region.len() as u64)?;
        let opts = EngineOptions {
            queue_depth: self.sh.queue_depth,
            o_direct: self.sh.o_direct,
            ..EngineOptions::default()
        };
        let engine = open_engine(
            self.sh.io_engine,
            region.clone(),
            self.sh.slots.files()?,
            &opts,
        )?;
        *self.entry.region.lock() = Some(RegionInfo {
            source: source.to_string(),
            path,
            num_rows,
            row_stride: self.row_stride,
            io_engine: engine.info.name.clone(),
            huge_page_share: region.huge_page_share(),
            small_pages_reason: region.small_pages_reason().map(str::to_string),
            staged_bytes: engine
                .engine
                .staged_bytes()
                .map(crate::node::engines::StagedBytes),
        });
        let mapped = Arc::new(MappedRegion {
            region,
            engine,
            file,
            lost: Mutex::new(None),
        });
        let (tx, rx) = crossbeam_channel::bounded(MAX_QUEUED_JOBS_PER_ENGINE);
        let worker = JobWorker {
            sh: self.sh.clone(),
            entry: self.entry.clone(),
            writer: self.writer.clone(),
            mapped: mapped.clone(),
            cancelled: self.cancelled.clone(),
            chunk: RefCell::new(vec![0; CRC_CHUNK]),
        };
        let thread =
            crate::io::spawn_io_thread(format!("kvtier-node-{}", self.entry.id), move || {
                worker.run(rx)
            })
            .map_err(|e| Error::new(ErrorKind::Io, format!("cannot start a job thread: {e}")))?;
        self.region = Some(mapped);
        self.jobs_tx = Some(tx);
        self.job_thread = Some(thread);
        Ok(())
    }

    fn enqueue(&self, seq: u64, load: bool, job: JobRequest) {
        let fail = |e: Error| {
            let r = JobResult::failed(job.job_id, e);
            let c = &self.entry.counters;
            c.failed_jobs.fetch_add(1, Ordering::Relaxed);
            c.errors.fetch_add(1, Ordering::Relaxed);
            self.reply(seq, &Reply::JobDone(JobDone::from_result(&r, &job.keys)));
        };
        let (Some(tx), Some(mapped)) = (&self.jobs_tx, &self.region) else {
            return fail(Error::new(
                ErrorKind::Contract,
                "no region is registered on this connection (REGISTER_PATH or REGISTER_FD first)",
            ));
        };
        if let Some(e) = mapped.lost.lock().as_ref() {
            return fail(e.duplicate());
        }
        let rows = mapped.region.num_rows();
        if let Some(bad) = job.rows.iter().find(|r| **r as usize >= rows) {
            return fail(Error::new(
                ErrorKind::Contract,
                format!("row {bad} is outside the registered region of {rows} rows"),
            ));
        }
        let c = &self.entry.counters;
        c.jobs_in_flight.fetch_add(1, Ordering::Relaxed);
        match tx.try_send(QueuedJob { seq, load, job }) {
            Ok(()) => {}
            Err(TrySendError::Full(q)) | Err(TrySendError::Disconnected(q)) => {
                c.jobs_in_flight.fetch_sub(1, Ordering::Relaxed);
                let r = JobResult::failed(
                    q.job.job_id,
                    Error::new(
                        ErrorKind::NoSpace,
                        format!(
                            "{MAX_QUEUED_JOBS_PER_ENGINE} jobs of this engine are queued at \
                             the service; job {} refused",
                            q.job.job_id
                        ),
                    ),
                );
                c.failed_jobs.fetch_add(1, Ordering::Relaxed);
                c.errors.fetch_add(1, Ordering::Relaxed);
                self.reply(
                    q.seq,
                    &Reply::JobDone(JobDone::from_result(&r, &q.job.keys)),
                );
            }
        }
    }

    /// The hinted request finished: its staged keys no load used are discarded.
    fn release_hint(&mut self, req_id: &str) {
        if let (Some(keys), Some(st)) = (self.hints.remove(req_id), &self.sh.staging) {
            for k in &keys {
                st.pool.release(k);
            }
        }
    }

    /// Ends the session: cancels queued jobs, waits for the running one, stops the engine and
    /// unmaps the region.
    fn close(&mut self) {
        let hinted: Vec<String> = self.hints.keys().cloned().collect();
        for req_id in hinted {
            self.release_hint(&req_id);
        }
        self.sh.events.unsubscribe(self.entry.id);
        if !self.sh.events.has_subscribers() {
            let mut tier = self.sh.tier.lock();
            tier.set_events_enabled(false);
            // Nobody asks any more: what is buffered would be stale for the next one.
            drop(tier.take_events());
        }
        self.cancelled.store(true, Ordering::Release);
        drop(self.jobs_tx.take());
        if let Some(t) = self.job_thread.take() {
            let _ = t.join();
        }
        if let Some(mapped) = self.region.take() {
            mapped.engine.engine.shutdown();
            match Arc::try_unwrap(mapped) {
                // The engine's last reference to the region goes with it: unmapped here.
                Ok(m) => drop(m),
                Err(_) => log::error!("node service: a region is still referenced at close"),
            }
        }
        *self.entry.region.lock() = None;
    }
}

/// Opens an engine's region file for mapping: a regular file (no symlink) owned by the peer's
/// uid, so that an engine can make the service map only what it could map itself.
fn open_region_file(path: &str, peer_uid: u32) -> Result<OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    let p = std::path::Path::new(path);
    let fd = rustix::fs::open(
        p,
        OFlags::RDWR | OFlags::CLOEXEC | OFlags::NOFOLLOW | OFlags::NONBLOCK,
        Mode::empty(),
    )
    .map_err(|e| Error::io("open the region file", p, std::io::Error::from(e)))?;
    let st = rustix::fs::fstat(&fd)
        .map_err(|e| Error::io("fstat the region file", p, std::io::Error::from(e)))?;
    if st.st_uid != peer_uid {
        return Err(Error::new(
            ErrorKind::PermissionDenied,
            format!(
                "{path} belongs to uid {}, not to the engine's uid {peer_uid}",
                st.st_uid
            ),
        ));
    }
    Ok(fd)
}

/// The status document (`STATUS`, `kvtier service status`).
pub fn status_json(sh: &ServiceShared) -> String {
    let tier = sh.tier.lock();
    let info = tier.info();
    let doc = serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "digest": hex::encode(sh.digest),
        "row_stride": sh.row_stride,
        "slot_bytes": sh.slot_bytes,
        "tier": {
            "paths": info.slab_paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
            "total_slots": info.total_slots,
            "used_slots": tier.len(),
            // Transfers started and not finished: each holds pins (load) or reserved slots.
            "active_transfers": tier
                .metrics()
                .iter()
                .find(|m| m.name == "g3_active_jobs")
                .map_or(0.0, |m| m.value),
            "engine": info.engine,
            "ready": tier.is_recovered(),
        },
        "staging": sh.staging.as_ref().map(|st| {
            let c = &st.pool.counters;
            let n = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
            serde_json::json!({
                "slots": st.pool.num_slots(),
                "used_slots": st.pool.used_slots(),
                "held_slots": st.pool.held_slots(),
                "hits": n(&c.hits),
                "g3_loads": n(&c.g3_loads),
                "evictions": n(&c.evictions),
                "discarded": n(&c.discarded),
                "prefetched": n(&st.counters.staged),
                "g3_touches": n(&st.counters.g3_touches),
            })
        }),
        "event_subscribers": sh.events.subscribers(),
        "engines": sh.engines.status(),
        "refused_connections": sh.engines.refused.load(Ordering::Relaxed),
        "cancelled_jobs": sh.engines.cancelled_jobs.load(Ordering::Relaxed),
        "disconnects": sh.engines.disconnects.load(Ordering::Relaxed),
        "test_hold": crate::node::test_hold::status(),
        "regions_lost": sh.engines.regions_lost.load(Ordering::Relaxed),
        "last_region_lost": sh.engines.last_region_lost.lock().clone(),
    });
    doc.to_string()
}

/// Runs one engine's jobs in order.
struct JobWorker {
    sh: Arc<ServiceShared>,
    entry: Arc<EngineEntry>,
    writer: Arc<Mutex<Option<UnixStream>>>,
    mapped: Arc<MappedRegion>,
    cancelled: Arc<AtomicBool>,
    /// The buffer rows are read through for their CRC ([`CRC_CHUNK`] bytes).
    chunk: RefCell<Vec<u8>>,
}

impl JobWorker {
    fn run(self, rx: Receiver<QueuedJob>) {
        for q in rx.iter() {
            if self.cancelled.load(Ordering::Acquire) {
                self.sh
                    .engines
                    .cancelled_jobs
                    .fetch_add(1, Ordering::Relaxed);
                let c = &self.entry.counters;
                c.jobs_in_flight.fetch_sub(1, Ordering::Relaxed);
                continue;
            }
            let lost = self.mapped.lost.lock().as_ref().map(Error::duplicate);
            let r = match lost {
                Some(e) => JobResult::failed(q.job.job_id, e),
                None => self.transfer(q.load, &q.job),
            };
            let newly_lost = match &r.error {
                Some(e) if e.kind() == ErrorKind::RegionLost => {
                    self.mapped.lost.lock().is_none().then(|| e.duplicate())
                }
                _ => None,
            };
            self.report(&q, &r);
            if let Some(e) = newly_lost {
                self.end_for_lost_region(e, &rx);
            }
        }
    }

    /// Counts a finished job and sends its `JOB_DONE`.
    fn report(&self, q: &QueuedJob, r: &JobResult) {
        let c = &self.entry.counters;
        let done = JobDone::from_result(r, &q.job.keys);
        if q.load {
            c.loads.fetch_add(1, Ordering::Relaxed);
            c.bytes_loaded
                .fetch_add(done.transfer_bytes, Ordering::Relaxed);
        } else {
            c.stores.fetch_add(1, Ordering::Relaxed);
            c.bytes_stored
                .fetch_add(done.transfer_bytes, Ordering::Relaxed);
        }
        if !r.success {
            c.failed_jobs.fetch_add(1, Ordering::Relaxed);
        }
        c.jobs_in_flight.fetch_sub(1, Ordering::Relaxed);
        send(&self.writer, &Reply::JobDone(done).to_frame(q.seq));
    }

    /// The engine's region file was shrunk: the region is marked lost (later jobs
    /// fail with `e` at once), the jobs already queued fail with it, the loss is recorded for
    /// `STATUS` and `/metrics`, and the session ends (its reader sees the socket's read side
    /// shut), which unmaps the region and releases the pages io_uring pinned.
    fn end_for_lost_region(&self, e: Error, rx: &Receiver<QueuedJob>) {
        log::warn!("node service: {e}");
        self.sh.engines.region_lost(&self.entry, &e);
        *self.mapped.lost.lock() = Some(e.duplicate());
        while let Ok(q) = rx.try_recv() {
            self.report(&q, &JobResult::failed(q.job.job_id, e.duplicate()));
        }
        if let Some(stream) = self.writer.lock().as_ref() {
            let _ = stream.shutdown(std::net::Shutdown::Read);
        }
    }

    /// Runs a job: a load through the staging pool when there is one, else straight between
    /// G3 and the engine's rows.
    ///
    /// The region file is checked before (a region already shrunk fails at once, saying what
    /// happened) and after: no key of a job whose region shrank meanwhile reports success
    /// (the G3 part checks it again before anything is committed).
    fn transfer(&self, load: bool, job: &JobRequest) -> JobResult {
        if let Err(e) = self.mapped.file.check("before the job") {
            return JobResult::failed(job.job_id, e);
        }
        let r = match self.sh.staging.as_ref().filter(|_| load) {
            Some(st) => self.load_through_staging(st, job),
            None => self.transfer_g3(load, job, &mut Vec::new()),
        };
        if let Err(e) = self.mapped.file.check("after the job") {
            // A copy that failed says more than the check.
            let e = match r.error {
                Some(copy) if copy.kind() == ErrorKind::RegionLost => copy,
                _ => e,
            };
            return JobResult::failed(job.job_id, e);
        }
        r
    }

    /// A load: each key the pool holds is copied from it into the engine's row (its CRC
    /// checked); the rest are read from G3, and what G3 vouched for is copied into the pool
    /// for the other engines.
    fn load_through_staging(&self, st: &Staging, job: &JobRequest) -> JobResult {
        let started = Instant::now();
        let (region, file) = (&self.mapped.region, &self.mapped.file);
        let stride = region.row_stride();
        let pool_stride = st.pool.row_stride();
        let mut from_pool = Vec::new();
        let (mut keys, mut rows) = (Vec::new(), Vec::new());
        for (k, &row) in job.keys.iter().zip(&job.rows) {
            if region.row_offset(row as usize).is_err() {
                keys.push(k.clone());
                rows.push(row);
                continue;
            }
            let copy = |slot: usize, bytes: &[u8]| {
                let pool_fd = st.pool.region().fd().ok_or_else(|| {
                    Error::new(ErrorKind::Internal, "the staging pool has no descriptor")
                })?;
                // The service's mapping of the engine's row `row`, a whole row (at least a
                // slot) long, mapped while this job runs; the engine gave the row to this job
                // to fill and reads it only after JOB_DONE.
                file.copy_into_row(
                    region,
                    row as usize,
                    bytes.len(),
                    pool_fd,
                    slot as u64 * pool_stride,
                )
            };
            match st.pool.copy_out_with(k, FILL_WAIT, copy) {
                Ok(Some(_)) => from_pool.push(k.clone()),
                Ok(None) => {
                    keys.push(k.clone());
                    rows.push(row);
                }
                // The engine's row is gone (its region file was shrunk): the job fails.
                Err(e) => return JobResult::failed(job.job_id, e),
            }
        }
        let pool_bytes = from_pool.len() as u64 * self.sh.slot_bytes;
        // A G3 load would have pinned these keys, making them G3's most recently used.
        st.touch_g3(from_pool.clone());
        st.pool
            .counters
            .g3_loads
            .fetch_add(keys.len() as u64, Ordering::Relaxed);
        if keys.is_empty() {
            return JobResult::ok(job.job_id, started.elapsed(), pool_bytes);
        }
        let rest = JobRequest {
            job_id: job.job_id,
            rows,
            keys,
        };
        let mut crcs = Vec::new();
        let mut r = self.transfer_g3(true, &rest, &mut crcs);
        let (keys, rows) = (&rest.keys, &rest.rows);
        for (i, k) in keys.iter().enumerate() {
            let vouched = r.success || r.successful_keys.as_ref().is_some_and(|ok| ok.contains(k));
            let (true, Some(&Some(crc))) = (vouched, crcs.get(i)) else {
                continue;
            };
            if let Reserve::Reserved(slot) = st.pool.reserve(k, false) {
                // The slot holds the row's first slot_bytes, what G3 stored; read through
                // the region file (a lost row fails the copy, and the job, see `transfer`).
                // The slot was reserved to this thread just now; its lease ends before the
                // commit reads it.
                let read = match st.pool.fill_bytes(slot) {
                    Ok(mut dst) => file.read_into(u64::from(rows[i]) * stride, &mut dst),
                    Err(e) => Err(e),
                };
                match read {
                    Ok(()) => {
                        st.pool.commit(slot, crc);
                    }
                    Err(_) => st.pool.abort(slot),
                }
            }
        }
        r.transfer_time = Some(started.elapsed());
        r.transfer_bytes = Some(r.transfer_bytes.unwrap_or(0) + pool_bytes);
        if !r.success {
            let mut ok = r.successful_keys.take().unwrap_or_default();
            ok.extend(from_pool);
            r.successful_keys = Some(ok);
        }
        r
    }

    /// Moves the job's rows between the engine's region and the granted slots, then reports
    /// each key's CRC (or error) to the tier, which commits or checks them. `crcs` gets each
    /// key's CRC as moved (`None`: not moved), what the tier checked.
    fn transfer_g3(&self, load: bool, job: &JobRequest, crcs: &mut Vec<Option<u32>>) -> JobResult {
        let slots = &self.sh.slots;
        let keys: Vec<ChunkKey> = job.keys.clone();
        let grant = if load {
            slots.begin_load(job.job_id, keys)
        } else {
            slots.begin_store(job.job_id, keys)
        };
        let grant = match grant {
            Ok(g) => g,
            Err(e) => return JobResult::failed(job.job_id, e),
        };
        let region = &self.mapped.region;
        let stride = region.row_stride() as usize;
        let slot = self.sh.slot_bytes as usize;
        let n = job.keys.len();
        let mut results: Vec<Result<u32>> = (0..n)
            .map(|_| Err(Error::new(ErrorKind::Internal, "not moved")))
            .collect();
        // A store's CRC is taken from the row before it is written; it counts only once the
        // write has completed.
        let mut store_crcs = vec![0u32; if load { 0 } else { n }];
        let mut reqs = Vec::new();
        let engine = &self.mapped.engine.engine;
        // A staged transfer is checksummed by the engine in the same pass as its copy (a
        // kernel copy through the region file, see `io/uring/staging.rs`), and the CRC comes
        // with its completion.
        let staged = engine.stages(slot);
        for (i, g) in grant.slots.iter().enumerate() {
            if let GrantedSlot::Ready { file, offset, .. } = g {
                let row = job.rows[i] as usize;
                if !load && !staged {
                    match self.row_crc(row) {
                        Ok(crc) => store_crcs[i] = crc,
                        Err(e) => {
                            let all = (0..n).map(|_| Err(e.duplicate())).collect();
                            return slots.finish(grant, all);
                        }
                    }
                }
                reqs.push(IoRequest {
                    dir: if load { IoDir::Read } else { IoDir::Write },
                    file: *file,
                    file_offset: *offset,
                    region_offset: row * stride,
                    len: slot,
                    tag: i as u64,
                });
            }
        }
        let started = Instant::now();
        // A store of an engine that went away is abandoned (its reserved slots released,
        // nothing committed). A load is finished: the tier turns every key reported failed
        // into a miss, so cancelling one would throw good chunks away; the rows it fills are
        // still mapped here and nobody reads them.
        if !load && self.cancelled.load(Ordering::Acquire) {
            return self.cancel(grant, n);
        }
        if !reqs.is_empty() {
            if let Err(e) = engine.submit(&reqs) {
                let all = (0..n).map(|_| Err(e.duplicate())).collect();
                return slots.finish(grant, all);
            }
            for _ in 0..reqs.len() {
                let Ok(c) = engine.completions().recv() else {
                    break;
                };
                let i = c.tag as usize;
                results[i] = match (c.result, c.row_crc) {
                    (Ok(_), Some(crc)) => Ok(crc),
                    (Ok(_), None) if load => self.row_crc(job.rows[i] as usize),
                    // Not staged after all (a background collapse made the row's pages
                    // huge meanwhile): the row, still pinned, is checksummed now.
                    (Ok(_), None) if staged => self.row_crc(job.rows[i] as usize),
                    (Ok(_), None) => Ok(store_crcs[i]),
                    (Err(e), _) => Err(e),
                };
            }
        }
        crate::node::test_hold::hold(&self.cancelled);
        if !load && self.cancelled.load(Ordering::Acquire) {
            return self.cancel(grant, n);
        }
        log::trace!(
            "node service: job {} of {} moved in {:?}",
            job.job_id,
            self.entry.name,
            started.elapsed()
        );
        // A region shrunk while its rows moved: nothing of the job commits (a store's bytes
        // may have come from pages the file no longer holds) and no chunk is blamed (a load
        // keeps its chunk, a store fences no path: `ErrorKind::RegionLost`).
        if let Err(e) = self.mapped.file.check("after the transfer") {
            results = (0..n).map(|_| Err(e.duplicate())).collect();
        }
        *crcs = results.iter().map(|r| r.as_ref().ok().copied()).collect();
        slots.finish(grant, results)
    }

    /// Finishes a store's grant with every key failed (nothing committed, reserved slots
    /// released).
    fn cancel(&self, grant: crate::g3::direct::DirectGrant, n: usize) -> JobResult {
        self.sh
            .engines
            .cancelled_jobs
            .fetch_add(1, Ordering::Relaxed);
        let e = || Error::new(ErrorKind::Cancelled, "the engine disconnected");
        self.sh
            .slots
            .finish(grant, (0..n).map(|_| Err(e())).collect())
    }

    /// The CRC-32 of the row's first `slot_bytes` (what its slot holds), read through the
    /// region file: a row the file lost is an error ([`ErrorKind::RegionLost`]), not a signal.
    fn row_crc(&self, row: usize) -> Result<u32> {
        let offset = row as u64 * self.mapped.region.row_stride();
        let mut chunk = self.chunk.borrow_mut();
        self.mapped
            .file
            .crc(offset, self.sh.slot_bytes as usize, &mut chunk)
    }
}
