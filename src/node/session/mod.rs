//! One engine's connection to the node service: the handshake (compatibility digest, and a
//! row stride whose rows hold the service's slot: each engine has its own), its region
//! (mapped here, with an I/O engine of its own over the G3 slab files), lookups, and its store
//! and load jobs, which move rows directly between G3 slots and the engine's rows through the
//! tier's slot grants (`crate::g3::slot_grants`).
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
//!
//! * `shared`: what every session of one service shares, and the replies' sending.
//! * `handshake`: `HELLO` and its answer; observer sessions (`STATUS` only).
//! * `jobs`: one engine's job thread, moving rows between G3 slots and the engine's region.
//! * `status`: the status document.

mod handshake;
mod jobs;
mod shared;
mod status;

use std::cell::RefCell;
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crossbeam_channel::{Sender, TrySendError};
use parking_lot::Mutex;

use crate::contract::job::{JobResult, LookupResult, RequestContext};
use crate::contract::secondary::SecondaryTier;
use crate::error::{Error, ErrorKind, Result};
use crate::io::{EngineOptions, open_engine};
use crate::key::ChunkKey;
use crate::node::engines::{EngineEntry, RegionInfo};
use crate::node::protocol::{JobDone, JobRequest, Reply, Request};
use crate::node::region_file::{CRC_CHUNK, RegionFile};
use crate::node::socket::{FrameReader, is_read_write};
use crate::region::PrimaryRegion;
use handshake::{handshake, observe};
use jobs::JobWorker;
use shared::{MAX_QUEUED_JOBS_PER_ENGINE, MappedRegion, QueuedJob, error_reply, send};

pub use shared::{SOCKET_TIMEOUT, ServiceShared};
pub use status::status_json;

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
            staged_bytes: engine.engine.staged_bytes(),
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
