//! [`NodeClient`]: an engine's connection to the node service.
//!
//! The client connects, presents its row stride and compatibility digest (a mismatch is
//! refused at once, with both digests in the error), registers its primary region (by the
//! path of its shared file or by passing its descriptor), and then looks keys up and submits
//! store and load jobs naming rows of that region. Submitting never waits for the transfer:
//! the service moves the bytes between its G3 slots and the region directly and reports
//! each job once, collected with [`NodeClient::finished_jobs`]. When the connection is lost
//! every job still outstanding is reported failed (`Closed`), never as done.

use std::collections::HashMap;
use std::os::fd::BorrowedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;

use crate::contract::job::{JobResult, LookupResult};
use crate::error::{Error, ErrorKind, Result};
use crate::key::ChunkKey;
use crate::node::protocol::{Frame, InventoryEvent, JobRequest, Reply, Request};
use crate::node::socket::{FrameReader, write_frame, write_frame_with_fd};

/// How long a request that expects an answer (lookup, status) waits for it.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a registration waits: the service maps the region and collapses it into 2 MiB
/// pages first (about 0.2 s per GiB when the pages are not huge yet).
pub const REGISTER_TIMEOUT: Duration = Duration::from_secs(600);

/// What an engine says about itself when it connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientHello {
    /// A name for the service's status and logs (vLLM's engine id).
    pub engine: String,
    /// Bytes per row of the engine's region.
    pub row_stride: u64,
    /// The engine's compatibility (namespace) digest.
    pub digest: [u8; 32],
}

/// What the service said when the session opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceInfo {
    /// The service's slot size: the bytes of each engine row it stores (the row's first
    /// ones; an engine's rows must be at least this large).
    pub row_stride: u64,
    /// The service's compatibility digest.
    pub digest: [u8; 32],
    /// The service's kvtier version.
    pub version: String,
}

type JobKeys = Arc<Mutex<HashMap<u64, (u64, Vec<ChunkKey>)>>>;
type Waiters = Arc<Mutex<HashMap<u64, Sender<Reply>>>>;
/// Lookups sent without waiting: their keys by request number.
type AsyncLookups = Arc<Mutex<HashMap<u64, Vec<ChunkKey>>>>;
/// Answers to lookups sent without waiting: the keys and one verdict each.
pub type LookupAnswer = (Vec<ChunkKey>, Vec<LookupResult>);

/// Requests other than lookups and jobs sent without waiting, by request number.
#[derive(Debug)]
enum Pending {
    /// A `HINT`: its request id and keys.
    Hint(String, Vec<ChunkKey>),
    /// A `TAKE_EVENTS`.
    Events,
}

/// What arrived for a request sent without waiting (other than lookups).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AsyncAnswer {
    /// The verdicts of a `HINT` (request id, keys, one verdict each).
    Hinted(String, Vec<ChunkKey>, Vec<LookupResult>),
    /// Inventory events.
    Events(Vec<InventoryEvent>),
}
type PendingMap = Arc<Mutex<HashMap<u64, Pending>>>;

/// A connection to the node service (see the module docs).
pub struct NodeClient {
    stream: UnixStream,
    write_lock: Mutex<()>,
    next_seq: AtomicU64,
    waiters: Waiters,
    jobs: JobKeys,
    finished_tx: Sender<JobResult>,
    finished_rx: Receiver<JobResult>,
    async_lookups: AsyncLookups,
    answers_rx: Receiver<LookupAnswer>,
    pending: PendingMap,
    async_rx: Receiver<AsyncAnswer>,
    connected: Arc<AtomicBool>,
    reader: Option<JoinHandle<()>>,
    service: ServiceInfo,
}

impl std::fmt::Debug for NodeClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeClient")
            .field("service", &self.service)
            .field("connected", &self.is_connected())
            .finish_non_exhaustive()
    }
}

fn lost() -> Error {
    Error::new(
        ErrorKind::Closed,
        "the connection to the kvtier node service was lost",
    )
}

/// Ends connection attempts from another thread ([`NodeClient::connect_abortable`]): the
/// socket of the attempt in progress is shut down, so that a handshake or a registration
/// waiting for the service's answer returns at once with an error, and every later attempt
/// fails before it connects. (A `connect` the kernel itself holds, on a listener whose
/// backlog is full, is not interrupted.)
#[derive(Debug, Default)]
pub(crate) struct ConnectAbort {
    aborted: AtomicBool,
    /// The socket of the attempt in progress (a duplicate), until [`ConnectAbort::release`].
    socket: Mutex<Option<UnixStream>>,
}

impl ConnectAbort {
    /// Aborts the attempt in progress and every later one.
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
        if let Some(s) = self.socket.lock().take() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    /// True once [`ConnectAbort::abort`] was called.
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Acquire)
    }

    /// Forgets the socket of the last attempt (its connection is then no longer ended by an
    /// abort): call once the attempt is over, the connection in use or dropped.
    pub fn release(&self) {
        drop(self.socket.lock().take());
    }

    /// Keeps a duplicate of `stream` to shut down on abort; an error if already aborted.
    fn watch(&self, stream: &UnixStream) -> Result<()> {
        let mut held = self.socket.lock();
        // Checked under the lock `abort` takes after setting the flag: either this sees the
        // flag, or `abort` sees the socket.
        if self.is_aborted() {
            return Err(Error::new(
                ErrorKind::Cancelled,
                "connection attempt to the kvtier node service aborted",
            ));
        }
        *held = Some(
            stream
                .try_clone()
                .map_err(|e| Error::new(ErrorKind::Io, format!("cannot clone the socket: {e}")))?,
        );
        Ok(())
    }
}

impl NodeClient {
    /// Connects to the service at `socket_path` and opens a session. Refusals (uid not
    /// allowed, another digest or row stride, another protocol version) are errors carrying
    /// the service's message.
    pub fn connect(socket_path: &Path, hello: &ClientHello) -> Result<NodeClient> {
        Self::connect_abortable(socket_path, hello, None)
    }

    /// [`NodeClient::connect`], which another thread can end through `abort` while it waits
    /// for the service (the socket stays watched by `abort` until
    /// [`ConnectAbort::release`]: a registration on the new connection is aborted as well).
    pub(crate) fn connect_abortable(
        socket_path: &Path,
        hello: &ClientHello,
        abort: Option<&ConnectAbort>,
    ) -> Result<NodeClient> {
        if abort.is_some_and(ConnectAbort::is_aborted) {
            return Err(Error::new(
                ErrorKind::Cancelled,
                "connection attempt to the kvtier node service aborted",
            ));
        }
        let stream = UnixStream::connect(socket_path)
            .map_err(|e| Error::io("connect to the kvtier node service at", socket_path, e))?;
        if let Some(a) = abort {
            a.watch(&stream)?;
        }
        stream
            .set_read_timeout(Some(REPLY_TIMEOUT))
            .map_err(|e| Error::new(ErrorKind::Io, format!("socket timeout: {e}")))?;
        let req = Request::Hello {
            row_stride: hello.row_stride,
            digest: hello.digest,
            engine: hello.engine.clone(),
        };
        // A refused peer may find the socket closed before its HELLO is read: the refusal
        // frame the service wrote first is still there to read.
        let sent = write_frame(&stream, &req.to_frame(1)?);
        let read_side = stream
            .try_clone()
            .map_err(|e| Error::new(ErrorKind::Io, format!("cannot clone the socket: {e}")))?;
        let mut reader = FrameReader::new(read_side);
        let frame = match reader.read_frame() {
            Ok(Some(f)) => f,
            Ok(None) | Err(_) => {
                sent?;
                return Err(Error::new(
                    ErrorKind::Closed,
                    format!(
                        "the kvtier node service at {} closed the connection without an answer",
                        socket_path.display()
                    ),
                ));
            }
        };
        let service = match Reply::from_frame(&frame)? {
            Reply::Welcome {
                row_stride,
                digest,
                version,
            } => ServiceInfo {
                row_stride,
                digest,
                version,
            },
            Reply::Error { kind, message } => return Err(Error::new(kind, message)),
            other => {
                return Err(Error::new(
                    ErrorKind::Contract,
                    format!("the service answered HELLO with {other:?}"),
                ));
            }
        };
        stream
            .set_read_timeout(None)
            .map_err(|e| Error::new(ErrorKind::Io, format!("socket timeout: {e}")))?;
        let (finished_tx, finished_rx) = crossbeam_channel::unbounded();
        let waiters: Waiters = Default::default();
        let jobs: JobKeys = Default::default();
        let connected = Arc::new(AtomicBool::new(true));
        let async_lookups: AsyncLookups = Default::default();
        let (answers_tx, answers_rx) = crossbeam_channel::unbounded();
        let pending: PendingMap = Default::default();
        let (async_tx, async_rx) = crossbeam_channel::unbounded();
        let reader = {
            let routes = Routes {
                pending: pending.clone(),
                async_answers: async_tx,
                waiters: waiters.clone(),
                jobs: jobs.clone(),
                finished: finished_tx.clone(),
                async_lookups: async_lookups.clone(),
                answers: answers_tx,
                connected: connected.clone(),
            };
            std::thread::Builder::new()
                .name("kvtier-node-client".into())
                .spawn(move || read_replies(reader, routes))
                .map_err(|e| Error::new(ErrorKind::Io, format!("cannot start a thread: {e}")))?
        };
        Ok(NodeClient {
            stream,
            write_lock: Mutex::new(()),
            next_seq: AtomicU64::new(2),
            waiters,
            jobs,
            finished_tx,
            finished_rx,
            async_lookups,
            answers_rx,
            pending,
            async_rx,
            connected,
            reader: Some(reader),
            service,
        })
    }

    /// Connects as an observer (no region, no digest check): only [`NodeClient::status`]
    /// works on such a connection.
    pub fn observe(socket_path: &Path) -> Result<NodeClient> {
        Self::connect(
            socket_path,
            &ClientHello {
                engine: "observer".into(),
                row_stride: 0,
                digest: [0; 32],
            },
        )
    }

    /// What the service said at connect.
    pub fn service(&self) -> &ServiceInfo {
        &self.service
    }

    /// False once the connection is lost (every outstanding job has then been reported).
    pub fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Acquire)
    }

    fn send(&self, frame: &Frame, fd: Option<BorrowedFd<'_>>) -> Result<()> {
        let _w = self.write_lock.lock();
        match fd {
            Some(fd) => write_frame_with_fd(&self.stream, frame, fd),
            None => write_frame(&self.stream, frame),
        }
    }

    fn call(&self, req: &Request, fd: Option<BorrowedFd<'_>>) -> Result<Reply> {
        self.call_within(req, fd, REPLY_TIMEOUT)
    }

    fn call_within(
        &self,
        req: &Request,
        fd: Option<BorrowedFd<'_>>,
        timeout: Duration,
    ) -> Result<Reply> {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let frame = req.to_frame(seq)?;
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.waiters.lock().insert(seq, tx);
        if !self.is_connected() {
            self.waiters.lock().remove(&seq);
            return Err(lost());
        }
        if let Err(e) = self.send(&frame, fd) {
            self.waiters.lock().remove(&seq);
            return Err(e);
        }
        match rx.recv_timeout(timeout) {
            Ok(Reply::Error { kind, message }) => Err(Error::new(kind, message)),
            Ok(r) => Ok(r),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                self.waiters.lock().remove(&seq);
                Err(Error::new(
                    ErrorKind::Closed,
                    format!(
                        "the kvtier node service did not answer within {} s",
                        timeout.as_secs()
                    ),
                ))
            }
            Err(_) => Err(lost()),
        }
    }

    fn expect_registered(&self, r: Reply) -> Result<()> {
        match r {
            Reply::Registered { .. } => Ok(()),
            other => Err(Error::new(
                ErrorKind::Contract,
                format!("the service answered a registration with {other:?}"),
            )),
        }
    }

    /// Registers the engine's region by the path of its shared file (the service maps
    /// `num_rows` rows of the service's row stride from offset 0; the file must belong to
    /// this process's uid).
    pub fn register_path(&self, path: &Path, num_rows: u64) -> Result<()> {
        let path = path.to_str().ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidPath,
                format!("{} is not UTF-8", path.display()),
            )
        })?;
        let r = self.call_within(
            &Request::RegisterPath {
                num_rows,
                path: path.to_string(),
            },
            None,
            REGISTER_TIMEOUT,
        )?;
        self.expect_registered(r)
    }

    /// Registers the engine's region by passing `fd` (a memfd or shared file open for
    /// reading and writing) to the service.
    pub fn register_fd(&self, fd: BorrowedFd<'_>, num_rows: u64) -> Result<()> {
        let r = self.call_within(
            &Request::RegisterFd { num_rows },
            Some(fd),
            REGISTER_TIMEOUT,
        )?;
        self.expect_registered(r)
    }

    /// Looks `keys` up (one round trip; HIT means a load will find the key).
    pub fn lookup(&self, keys: &[ChunkKey]) -> Result<Vec<LookupResult>> {
        match self.call(
            &Request::Lookup {
                keys: keys.to_vec(),
            },
            None,
        )? {
            Reply::Lookup(r) if r.len() == keys.len() => Ok(r),
            other => Err(Error::new(
                ErrorKind::Contract,
                format!("the service answered a lookup with {other:?}"),
            )),
        }
    }

    /// Sends a lookup of `keys` and returns at once; the verdicts arrive with
    /// [`NodeClient::lookup_answers`] (MISS for every key when the service refuses the
    /// request; nothing when the connection is lost).
    pub fn request_lookup(&self, keys: Vec<ChunkKey>) -> Result<()> {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let frame = Request::Lookup { keys: keys.clone() }.to_frame(seq)?;
        if !self.is_connected() {
            return Err(lost());
        }
        self.async_lookups.lock().insert(seq, keys);
        self.send(&frame, None).inspect_err(|_| {
            self.async_lookups.lock().remove(&seq);
        })
    }

    /// Sends a request the service does not answer.
    fn send_unanswered(&self, req: &Request) -> Result<()> {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let frame = req.to_frame(seq)?;
        if !self.is_connected() {
            return Err(lost());
        }
        self.send(&frame, None)
    }

    fn send_pending(&self, req: &Request, pending: Pending) -> Result<()> {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let frame = req.to_frame(seq)?;
        if !self.is_connected() {
            return Err(lost());
        }
        self.pending.lock().insert(seq, pending);
        self.send(&frame, None).inspect_err(|_| {
            self.pending.lock().remove(&seq);
        })
    }

    /// Sends a prefetch hint for request `req_id` (the service stages `keys` from G3 into
    /// its DRAM pool and holds them until [`NodeClient::hint_done`]) and returns at once; the
    /// verdicts arrive with [`NodeClient::async_answers`].
    pub fn request_hint(&self, req_id: &str, keys: Vec<ChunkKey>) -> Result<()> {
        let req = Request::Hint {
            req_id: req_id.to_string(),
            keys: keys.clone(),
        };
        self.send_pending(&req, Pending::Hint(req_id.to_string(), keys))
    }

    /// Request `req_id` finished: the service discards its hinted keys no load used. No
    /// answer.
    pub fn hint_done(&self, req_id: &str) -> Result<()> {
        self.send_unanswered(&Request::HintDone {
            req_id: req_id.to_string(),
        })
    }

    /// Tells the service that `keys` were used (vLLM's `touch`): it moves the ones G3 holds
    /// to the most recently used end of G3's LRU. No answer.
    pub fn touch(&self, keys: Vec<ChunkKey>) -> Result<()> {
        self.send_unanswered(&Request::Touch { keys })
    }

    /// Asks for the inventory events since the last ask (the first ask subscribes) and
    /// returns at once; they arrive with [`NodeClient::async_answers`].
    pub fn request_events(&self) -> Result<()> {
        self.send_pending(&Request::TakeEvents, Pending::Events)
    }

    /// Hint verdicts and events that arrived since the last call.
    pub fn async_answers(&self) -> Vec<AsyncAnswer> {
        self.async_rx.try_iter().collect()
    }

    /// Verdicts of [`NodeClient::request_lookup`] that arrived since the last call.
    pub fn lookup_answers(&self) -> Vec<LookupAnswer> {
        self.answers_rx.try_iter().collect()
    }

    /// Waits until no job is outstanding (each has been reported) or `timeout` passes;
    /// true when none is left.
    pub fn wait_outstanding(&self, timeout: Option<Duration>) -> bool {
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        loop {
            if self.jobs.lock().is_empty() {
                return true;
            }
            if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The service's status document (JSON: its tier and every connected engine).
    pub fn status(&self) -> Result<String> {
        match self.call(&Request::Status, None)? {
            Reply::Status(s) => Ok(s),
            other => Err(Error::new(
                ErrorKind::Contract,
                format!("the service answered STATUS with {other:?}"),
            )),
        }
    }

    fn submit(&self, load: bool, job_id: u64, keys: Vec<ChunkKey>, rows: Vec<u32>) {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let job_keys = keys.clone();
        let job = JobRequest { job_id, rows, keys };
        let req = if load {
            Request::Load(job)
        } else {
            Request::Store(job)
        };
        let frame = match req.to_frame(seq) {
            Ok(f) => f,
            Err(e) => {
                let _ = self.finished_tx.send(JobResult::failed(job_id, e));
                return;
            }
        };
        self.jobs.lock().insert(seq, (job_id, job_keys));
        let sent = if self.is_connected() {
            self.send(&frame, None)
        } else {
            Err(lost())
        };
        if let Err(e) = sent {
            // Reported here unless the reader, seeing the connection drop, already did.
            if self.jobs.lock().remove(&seq).is_some() {
                let _ = self.finished_tx.send(JobResult::failed(job_id, e));
            }
        }
    }

    /// Submits a store (rows of the region -> the service's G3 slots). Returns at once; the
    /// rows must stay unchanged until the job is reported.
    pub fn submit_store(&self, job_id: u64, keys: Vec<ChunkKey>, rows: Vec<u32>) {
        self.submit(false, job_id, keys, rows);
    }

    /// Submits a load (G3 slots -> rows of the region). Returns at once; the rows hold the
    /// keys' bytes once the job is reported successful (or, for a failed job, the rows of its
    /// `successful_keys`).
    pub fn submit_load(&self, job_id: u64, keys: Vec<ChunkKey>, rows: Vec<u32>) {
        self.submit(true, job_id, keys, rows);
    }

    /// Every job reported since the last call.
    pub fn finished_jobs(&self) -> Vec<JobResult> {
        self.finished_rx.try_iter().collect()
    }

    /// Waits up to `timeout` for the next job to be reported.
    pub fn wait_finished(&self, timeout: Duration) -> Option<JobResult> {
        self.finished_rx.recv_timeout(timeout).ok()
    }

    /// Jobs submitted and not yet collected with [`NodeClient::finished_jobs`].
    pub fn outstanding_jobs(&self) -> usize {
        self.jobs.lock().len() + self.finished_rx.len()
    }

    /// True once the connection is lost and every job that was outstanding then has been
    /// reported (the reply reader has stopped): nothing more will arrive on this connection.
    pub fn is_finished(&self) -> bool {
        !self.is_connected() && self.reader.as_ref().is_none_or(JoinHandle::is_finished)
    }
}

impl Drop for NodeClient {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        if let Some(t) = self.reader.take() {
            let _ = t.join();
        }
    }
}

/// Where the reader thread sends what arrives.
struct Routes {
    pending: PendingMap,
    async_answers: Sender<AsyncAnswer>,
    waiters: Waiters,
    jobs: JobKeys,
    finished: Sender<JobResult>,
    async_lookups: AsyncLookups,
    answers: Sender<LookupAnswer>,
    connected: Arc<AtomicBool>,
}

fn read_replies(mut reader: FrameReader, r: Routes) {
    let why = loop {
        let frame = match reader.read_frame() {
            Ok(Some(f)) => f,
            Ok(None) => break lost(),
            Err(e) => break Error::new(ErrorKind::Closed, format!("{}: {e}", lost())),
        };
        let reply = match Reply::from_frame(&frame) {
            Ok(reply) => reply,
            Err(e) => break e,
        };
        if let Reply::JobDone(done) = &reply {
            // Reported before it leaves the outstanding set: a drain never sees neither.
            let entry = r.jobs.lock().get(&frame.seq).cloned();
            match entry {
                Some((job_id, keys)) if job_id == done.job_id => {
                    let _ = r.finished.send(done.to_result(&keys));
                    r.jobs.lock().remove(&frame.seq);
                }
                _ => log::warn!(
                    "node client: the service reported job {} that is not outstanding",
                    done.job_id
                ),
            }
            continue;
        }
        if let Some(keys) = r.async_lookups.lock().remove(&frame.seq) {
            let verdicts = match reply {
                Reply::Lookup(v) if v.len() == keys.len() => v,
                other => {
                    log::warn!("node client: a lookup was answered with {other:?}");
                    vec![LookupResult::Miss; keys.len()]
                }
            };
            let _ = r.answers.send((keys, verdicts));
            continue;
        }
        if let Some(p) = r.pending.lock().remove(&frame.seq) {
            let answer = match (p, reply) {
                (Pending::Hint(req_id, keys), Reply::Hinted(v)) if v.len() == keys.len() => {
                    AsyncAnswer::Hinted(req_id, keys, v)
                }
                (Pending::Events, Reply::Events(events)) => AsyncAnswer::Events(events),
                (Pending::Hint(req_id, keys), other) => {
                    log::warn!("node client: a hint was answered with {other:?}");
                    let n = keys.len();
                    AsyncAnswer::Hinted(req_id, keys, vec![LookupResult::Miss; n])
                }
                (Pending::Events, other) => {
                    log::warn!("node client: an events request was answered with {other:?}");
                    AsyncAnswer::Events(Vec::new())
                }
            };
            let _ = r.async_answers.send(answer);
            continue;
        }
        if let Reply::Error { kind, message } = &reply
            && let Some((job_id, _)) = r.jobs.lock().remove(&frame.seq)
        {
            // An error answering a job request reports that job.
            let e = Error::new(*kind, message.clone());
            let _ = r.finished.send(JobResult::failed(job_id, e));
            continue;
        }
        if let Some(tx) = r.waiters.lock().remove(&frame.seq) {
            let _ = tx.send(reply);
        }
    };
    r.connected.store(false, Ordering::Release);
    r.waiters.lock().clear();
    r.async_lookups.lock().clear();
    r.pending.lock().clear();
    let gone: Vec<_> = r.jobs.lock().drain().collect();
    for (_, (job_id, _)) in gone {
        let _ = r.finished.send(JobResult::failed(job_id, why.duplicate()));
    }
}
