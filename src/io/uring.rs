//! The `uring` engine: one dedicated io_uring thread per engine.
//!
//! * The region is registered as fixed buffers in pieces of at most 1 GiB, each a whole number
//!   of rows, and transfers use READ_FIXED / WRITE_FIXED. A request must lie inside one piece.
//!   When registration fails (ENOMEM under a memlock limit, EFAULT for file-backed memory) the
//!   engine uses plain READ / WRITE instead and says why ([`UringEngine::fallback_reason`]).
//! * Files are registered as fixed files when the kernel allows it.
//! * Requests arrive over a channel. With nothing in flight the ring thread blocks on that
//!   channel; with I/O in flight it blocks in `submit_and_wait(1)`, and a submitter that finds
//!   it waiting there wakes it through an eventfd polled by the ring. It never spins.
//! * A completion shorter than the remainder is resubmitted for the rest (buffer, offset and
//!   length advanced); 0 bytes is [`ErrorKind::ShortIo`]; a negative result is an I/O error
//!   with its errno.
//! * Buffers stay valid until their completion: the thread holds an `Arc<PrimaryRegion>`, and
//!   shutdown waits for every request before it unregisters and drops the ring.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use io_uring::{IoUring, opcode, types};
use parking_lot::{Mutex, RwLock};

use crate::error::{Error, ErrorKind, Result};
use crate::io::files::{FileTable, check_partial, os_error, short_error};
use crate::io::{IoCompletion, IoDir, IoEngine, IoRequest};
use crate::region::PrimaryRegion;

/// Default submission queue size.
pub const DEFAULT_QUEUE_DEPTH: u32 = 128;

/// The largest single registered buffer the kernel accepts.
pub const MAX_REGISTERED_BUFFER: usize = 1 << 30;

/// The most bytes one SQE moves (larger unregistered requests continue in further SQEs).
const MAX_SQE_LEN: usize = 1 << 30;

/// `user_data` of the eventfd poll that wakes the ring thread.
const WAKE_TAG: u64 = u64::MAX;

/// io_uring on a dedicated thread.
pub struct UringEngine {
    region: Arc<PrimaryRegion>,
    files: Arc<FileTable>,
    requests: RwLock<Option<Sender<IoRequest>>>,
    done_tx: Sender<IoCompletion>,
    done_rx: Receiver<IoCompletion>,
    wake: Arc<Wake>,
    thread: Mutex<Option<JoinHandle<()>>>,
    fixed_buffers: bool,
    fallback_reason: Option<String>,
}

/// How a submitter wakes a ring thread blocked in `submit_and_wait`.
struct Wake {
    fd: OwnedFd,
    /// True while the ring thread is (about to be) blocked in the kernel with I/O in flight.
    waiting: AtomicBool,
}

impl Wake {
    fn ring(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our own eventfd. A full counter (EAGAIN)
        // already means "wake up", so the result is not needed.
        unsafe {
            libc::write(self.fd.as_raw_fd(), (&raw const one).cast(), 8);
        }
    }

    fn drain(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads at most 8 bytes into a live u64; the fd is non-blocking.
        unsafe {
            libc::read(self.fd.as_raw_fd(), (&raw mut v).cast(), 8);
        }
    }
}

/// How the region is split into registered buffers: `piece_bytes` each (a whole number of rows).
fn piece_bytes(region: &PrimaryRegion) -> Option<usize> {
    let rows = MAX_REGISTERED_BUFFER / region.row_stride();
    (rows > 0).then(|| rows * region.row_stride())
}

/// Registers `region` as fixed buffers, or says why not.
fn register_region(ring: &IoUring, region: &PrimaryRegion) -> std::result::Result<usize, String> {
    let Some(piece) = piece_bytes(region) else {
        return Err(format!(
            "row_stride {} exceeds the 1 GiB limit of one registered buffer",
            region.row_stride()
        ));
    };
    let mut iovecs = Vec::new();
    let mut off = 0;
    while off < region.len() {
        let len = piece.min(region.len() - off);
        iovecs.push(libc::iovec {
            // SAFETY: `off < len()`, inside the mapping.
            iov_base: unsafe { region.base_ptr().add(off) }.cast(),
            iov_len: len,
        });
        off += len;
    }
    if iovecs.len() > usize::from(u16::MAX) {
        return Err(format!(
            "the region needs {} registered buffers; at most {} are addressable",
            iovecs.len(),
            u16::MAX
        ));
    }
    // SAFETY: every iovec lies inside the region, which the ring thread keeps alive (it holds
    // an `Arc`) until after it unregisters the buffers; nothing moves the mapping.
    match unsafe { ring.submitter().register_buffers(&iovecs) } {
        Ok(()) => Ok(piece),
        Err(e) => {
            let hint = match e.raw_os_error() {
                Some(libc::ENOMEM) => " (locked-memory limit, RLIMIT_MEMLOCK, too low)",
                Some(libc::EFAULT) => " (file-backed mappings cannot be registered)",
                _ => "",
            };
            Err(format!(
                "registering the {}-byte region as {} fixed buffers failed: {e}{hint}",
                region.len(),
                iovecs.len()
            ))
        }
    }
}

impl UringEngine {
    /// Sets up a ring of `queue_depth` entries, registers `region` and `files`, and starts the
    /// ring thread. On failure the files are handed back with the error (so that `auto` can
    /// fall back to psync with them).
    pub fn new(
        region: Arc<PrimaryRegion>,
        files: Vec<std::fs::File>,
        queue_depth: u32,
        o_direct: bool,
    ) -> std::result::Result<Self, (Error, Vec<std::fs::File>)> {
        let depth = queue_depth.max(1);
        let ring = match IoUring::builder().setup_cqsize(depth * 2).build(depth) {
            Ok(r) => r,
            Err(e) => {
                let err = Error::new(
                    ErrorKind::Unsupported,
                    format!("cannot set up an io_uring with {depth} entries: {e}"),
                )
                .with_source(e);
                return Err((err, files));
            }
        };
        // SAFETY: plain eventfd creation; the result is checked.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            let e = std::io::Error::last_os_error();
            let err = Error::new(ErrorKind::Io, format!("eventfd failed: {e}")).with_source(e);
            return Err((err, files));
        }
        // SAFETY: `raw` is a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let wake = Arc::new(Wake {
            fd,
            waiting: AtomicBool::new(false),
        });
        let files = Arc::new(FileTable::new(files, o_direct));
        let fixed_files = match ring.submitter().register_files(&files.raw_fds()) {
            Ok(()) => true,
            Err(e) => {
                log::warn!(
                    "io_uring: registering {} files failed ({e}); using plain fds",
                    files.len()
                );
                false
            }
        };
        let (piece, fallback_reason) = match register_region(&ring, &region) {
            Ok(piece) => (Some(piece), None),
            Err(reason) => {
                log::warn!("io_uring: {reason}; using unregistered READ/WRITE");
                (None, Some(reason))
            }
        };
        let (req_tx, req_rx) = crossbeam_channel::unbounded();
        let (done_tx, done_rx) = crossbeam_channel::unbounded();
        let mut worker = RingThread {
            ring,
            files: files.clone(),
            region: region.clone(),
            piece,
            fixed_files,
            rx: req_rx,
            done: done_tx.clone(),
            wake: wake.clone(),
            depth: depth as usize,
            ops: Vec::new(),
            free: Vec::new(),
            in_flight: 0,
            ready: VecDeque::new(),
            poll_armed: false,
        };
        let spawned = std::thread::Builder::new()
            .name("kvtier-uring".to_string())
            .spawn(move || worker.run());
        let thread = match spawned {
            Ok(t) => t,
            Err(e) => {
                let err = Error::new(ErrorKind::Io, format!("cannot start the ring thread: {e}"))
                    .with_source(e);
                // The closure (and its clone of the table) was dropped with the error.
                let files = Arc::try_unwrap(files)
                    .map(FileTable::into_files)
                    .unwrap_or_default();
                return Err((err, files));
            }
        };
        Ok(UringEngine {
            region,
            files,
            requests: RwLock::new(Some(req_tx)),
            done_tx,
            done_rx,
            wake,
            thread: Mutex::new(Some(thread)),
            fixed_buffers: piece.is_some(),
            fallback_reason,
        })
    }

    /// Whether the region is registered and transfers use READ_FIXED / WRITE_FIXED.
    pub fn fixed_buffers(&self) -> bool {
        self.fixed_buffers
    }

    /// Why fixed buffers are not used, if they are not.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fallback_reason.as_deref()
    }

    /// Bytes per registered buffer piece (a whole number of rows, at most 1 GiB).
    pub fn piece_bytes(&self) -> Option<usize> {
        self.fixed_buffers
            .then(|| piece_bytes(&self.region))
            .flatten()
    }
}

impl IoEngine for UringEngine {
    fn name(&self) -> String {
        "uring".to_string()
    }

    fn submit(&self, reqs: &[IoRequest]) -> Result<()> {
        let guard = self.requests.read();
        let Some(tx) = guard.as_ref() else {
            return Err(Error::new(
                ErrorKind::Closed,
                "the uring engine is shut down",
            ));
        };
        let mut sent = false;
        for req in reqs {
            if let Err(e) = self.files.validate(req, &self.region) {
                let _ = self.done_tx.send(IoCompletion {
                    tag: req.tag,
                    result: Err(e),
                });
                continue;
            }
            tx.send(*req).map_err(|_| {
                Error::new(ErrorKind::Internal, "the ring thread exited unexpectedly")
            })?;
            sent = true;
        }
        // Pairs with the fence in `RingThread::wait`: either the ring thread sees the new
        // requests before it blocks, or we see it waiting and wake it.
        fence(Ordering::SeqCst);
        if sent && self.wake.waiting.load(Ordering::SeqCst) {
            self.wake.ring();
        }
        Ok(())
    }

    fn completions(&self) -> &Receiver<IoCompletion> {
        &self.done_rx
    }

    fn region(&self) -> &Arc<PrimaryRegion> {
        &self.region
    }

    fn shutdown(&self) {
        drop(self.requests.write().take());
        // The ring thread may be blocked waiting for I/O; it exits once everything completed.
        self.wake.ring();
        if let Some(t) = self.thread.lock().take()
            && t.join().is_err()
        {
            log::error!("the io_uring thread panicked");
        }
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// One request in the ring's care.
struct Op {
    req: IoRequest,
    /// Bytes moved so far.
    done: usize,
}

/// State owned by the ring thread.
struct RingThread {
    ring: IoUring,
    files: Arc<FileTable>,
    region: Arc<PrimaryRegion>,
    /// Registered piece size, `None` when buffers are not registered.
    piece: Option<usize>,
    fixed_files: bool,
    rx: Receiver<IoRequest>,
    done: Sender<IoCompletion>,
    wake: Arc<Wake>,
    depth: usize,
    /// Slot table; the slot index is the SQE's `user_data`.
    ops: Vec<Option<Op>>,
    free: Vec<usize>,
    /// Ops whose SQE is in the kernel.
    in_flight: usize,
    /// Ops waiting for room in the ring (new, or a remainder to resubmit).
    ready: VecDeque<usize>,
    poll_armed: bool,
}

macro_rules! rw_entry {
    ($fd:expr, $dir:expr, $buf:expr, $len:expr, $off:expr, $piece:expr) => {
        match ($dir, $piece) {
            (IoDir::Read, Some(idx)) => opcode::ReadFixed::new($fd, $buf, $len, idx)
                .offset($off)
                .build(),
            (IoDir::Write, Some(idx)) => opcode::WriteFixed::new($fd, $buf.cast_const(), $len, idx)
                .offset($off)
                .build(),
            (IoDir::Read, None) => opcode::Read::new($fd, $buf, $len).offset($off).build(),
            (IoDir::Write, None) => opcode::Write::new($fd, $buf.cast_const(), $len)
                .offset($off)
                .build(),
        }
    };
}

impl RingThread {
    fn run(&mut self) {
        let mut closing = false;
        loop {
            if self.in_flight == 0 && self.ready.is_empty() {
                if closing {
                    break;
                }
                // Idle: block on the channel.
                match self.rx.recv() {
                    Ok(req) => self.accept(req),
                    Err(_) => break,
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(req) => self.accept(req),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        closing = true;
                        break;
                    }
                }
            }
            self.push_ready();
            if self.in_flight > 0 {
                self.wait(closing);
            }
            self.reap();
        }
        self.finish();
    }

    fn accept(&mut self, req: IoRequest) {
        let op = Op { req, done: 0 };
        let slot = match self.free.pop() {
            Some(s) => {
                self.ops[s] = Some(op);
                s
            }
            None => {
                self.ops.push(Some(op));
                self.ops.len() - 1
            }
        };
        self.ready.push_back(slot);
    }

    fn complete(&mut self, slot: usize, result: Result<usize>) {
        if let Some(op) = self.ops[slot].take() {
            self.free.push(slot);
            let _ = self.done.send(IoCompletion {
                tag: op.req.tag,
                result,
            });
        }
    }

    /// Moves ready ops into the submission queue while the ring has room.
    fn push_ready(&mut self) {
        while self.in_flight < self.depth {
            let Some(&slot) = self.ready.front() else {
                break;
            };
            let entry = match self.entry(slot) {
                Ok(e) => e,
                Err(e) => {
                    self.ready.pop_front();
                    self.complete(slot, Err(e));
                    continue;
                }
            };
            // SAFETY: the entry's buffer lies inside the region, which this thread keeps alive
            // (and registered) until every op has completed; the op's slot stays occupied
            // until its CQE is reaped, so `user_data` maps back to exactly one op.
            if unsafe { self.ring.submission().push(&entry) }.is_err() {
                break;
            }
            self.ready.pop_front();
            self.in_flight += 1;
        }
    }

    /// Builds the SQE for the remainder of op `slot`.
    fn entry(&self, slot: usize) -> Result<io_uring::squeue::Entry> {
        let op = self.ops[slot].as_ref().ok_or_else(|| {
            Error::new(
                ErrorKind::Internal,
                format!("io_uring op slot {slot} is empty"),
            )
        })?;
        let req = &op.req;
        let start = req.region_offset + op.done;
        let len = (req.len - op.done).min(MAX_SQE_LEN);
        let piece_index = match self.piece {
            Some(piece) => {
                let idx = req.region_offset / piece;
                if (req.region_offset + req.len).div_ceil(piece) != idx + 1 {
                    return Err(crate::io::files::request_error(
                        ErrorKind::Contract,
                        format!(
                            "region range [{}, +{}) straddles two registered buffer pieces of \
                             {piece} bytes; requests must stay within one piece (whole rows)",
                            req.region_offset, req.len
                        ),
                        req,
                        self.files.label(req.file),
                    ));
                }
                Some(u16::try_from(idx).map_err(|_| {
                    Error::new(ErrorKind::Internal, "registered buffer index out of range")
                })?)
            }
            None => None,
        };
        // SAFETY: validated on submission: start + len <= region.len().
        let buf = unsafe { self.region.base_ptr().add(start) };
        let off = req.file_offset + op.done as u64;
        let len = len as u32;
        let entry = if self.fixed_files {
            rw_entry!(
                types::Fixed(req.file as u32),
                req.dir,
                buf,
                len,
                off,
                piece_index
            )
        } else {
            let fd = types::Fd(self.files.raw_fd(req.file));
            rw_entry!(fd, req.dir, buf, len, off, piece_index)
        };
        Ok(entry.user_data(slot as u64))
    }

    /// Blocks until at least one completion (or a wake-up from a submitter).
    fn wait(&mut self, closing: bool) {
        if !self.poll_armed && !closing {
            let poll =
                opcode::PollAdd::new(types::Fd(self.wake.fd.as_raw_fd()), libc::POLLIN as u32)
                    .build()
                    .user_data(WAKE_TAG);
            // SAFETY: a poll on our eventfd uses no buffer; the fd outlives the ring.
            if unsafe { self.ring.submission().push(&poll) }.is_ok() {
                self.poll_armed = true;
            }
        }
        self.wake.waiting.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let want = if !closing && !self.rx.is_empty() {
            0
        } else {
            1
        };
        loop {
            match self.ring.submit_and_wait(want) {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                // EBUSY / EAGAIN: completions must be reaped first; the caller does that next.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY) | Some(libc::EAGAIN)) => {
                    break;
                }
                Err(e) => {
                    log::error!("io_uring submit_and_wait failed: {e}");
                    break;
                }
            }
        }
        self.wake.waiting.store(false, Ordering::SeqCst);
    }

    fn reap(&mut self) {
        let cqes: Vec<(u64, i32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (ud, res) in cqes {
            if ud == WAKE_TAG {
                self.poll_armed = false;
                self.wake.drain();
                continue;
            }
            let slot = ud as usize;
            self.in_flight -= 1;
            self.on_cqe(slot, res);
        }
    }

    fn on_cqe(&mut self, slot: usize, res: i32) {
        let Some(op) = self.ops.get_mut(slot).and_then(Option::as_mut) else {
            log::error!("io_uring completion for unknown slot {slot}");
            return;
        };
        let req = op.req;
        let label = self.files.label(req.file).to_string();
        if res < 0 {
            let errno = -res;
            if errno == libc::EINTR || errno == libc::EAGAIN {
                self.ready.push_back(slot);
                return;
            }
            let err = os_error(
                &req,
                &label,
                op.done,
                std::io::Error::from_raw_os_error(errno),
            );
            self.complete(slot, Err(err));
            return;
        }
        if res == 0 {
            let why = match req.dir {
                IoDir::Read => "end of file",
                IoDir::Write => "the write made no progress",
            };
            let err = short_error(&req, &label, op.done, why);
            self.complete(slot, Err(err));
            return;
        }
        op.done += res as usize;
        let done = op.done;
        if done >= req.len {
            self.complete(slot, Ok(req.len));
        } else if let Some(err) = check_partial(&req, &label, done, self.files.o_direct()) {
            self.complete(slot, Err(err));
        } else {
            // Resubmit the remainder ahead of newer work.
            self.ready.push_front(slot);
        }
    }

    fn finish(&mut self) {
        let submitter = self.ring.submitter();
        if self.piece.is_some()
            && let Err(e) = submitter.unregister_buffers()
        {
            log::warn!("io_uring: unregistering buffers failed: {e}");
        }
        if self.fixed_files
            && let Err(e) = submitter.unregister_files()
        {
            log::warn!("io_uring: unregistering files failed: {e}");
        }
    }
}
