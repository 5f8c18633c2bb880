//! The `uring` engine: one dedicated io_uring thread per engine.
//!
//! * The region is registered as fixed buffers in pieces of at most 1 GiB, each a whole number
//!   of rows, and transfers use READ_FIXED / WRITE_FIXED. A request must lie inside one piece.
//!   When registration fails (ENOMEM under a memlock limit, EFAULT for file-backed memory) the
//!   engine uses plain READ / WRITE instead and says why ([`UringEngine::fallback_reason`]).
//! * At start the ring asks the kernel which opcodes it supports (`IORING_REGISTER_PROBE`):
//!   without READ, WRITE or POLL_ADD the engine refuses to start, naming the missing opcode
//!   (`auto` then uses psync and says why); without READ_FIXED / WRITE_FIXED it uses plain
//!   READ / WRITE and names them in its fallback reason.
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
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::thread::JoinHandle;

use io_uring::{IoUring, Probe, opcode};
use rustix::event::{EventfdFlags, eventfd};

mod ring;
mod staging;

use parking_lot::Mutex;
use ring::RingThread;

use crate::error::{Error, ErrorKind, Result};
use crate::geometry::ChunkGeometry;
use crate::io::files::FileTable;
use crate::io::queue::{RequestQueue, engine_methods_from_fields};
use crate::io::{IoEngine, IoRequest};
use crate::region::PrimaryRegion;

/// Default submission queue size.
pub const DEFAULT_QUEUE_DEPTH: u32 = 128;

/// The largest single registered buffer the kernel accepts (the region pins with the same
/// limit).
pub const MAX_REGISTERED_BUFFER: usize = crate::region::MAX_REGISTERED_BUFFER;

/// The most bytes one SQE moves (larger unregistered requests continue in further SQEs).
const MAX_SQE_LEN: usize = 1 << 30;

/// `user_data` of the eventfd poll that wakes the ring thread.
const WAKE_TAG: u64 = u64::MAX;

/// io_uring on a dedicated thread.
pub struct UringEngine {
    region: Arc<PrimaryRegion>,
    files: Arc<FileTable>,
    queue: RequestQueue,
    wake: Arc<Wake>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Registered piece size; `None` when the region is not registered.
    piece: Option<usize>,
    fallback_reason: Option<String>,
    /// Bytes moved through the staging slots, when the engine stages (see [`staging`]).
    staged_bytes: Option<Arc<std::sync::atomic::AtomicU64>>,
    /// The request lengths that are staged (`min..=max`), when the engine stages.
    stage_lens: Option<(usize, usize)>,
}

/// How a submitter wakes a ring thread blocked in `submit_and_wait`.
pub(crate) struct Wake {
    pub(crate) fd: OwnedFd,
    /// True while the ring thread is (about to be) blocked in the kernel with I/O in flight.
    pub(crate) waiting: AtomicBool,
}

impl Wake {
    /// A non-blocking eventfd, nobody waiting yet.
    fn new() -> Result<Self> {
        let fd = eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC).map_err(|e| {
            let e = std::io::Error::from(e);
            Error::new(ErrorKind::Io, format!("eventfd failed: {e}")).with_source(e)
        })?;
        Ok(Wake {
            fd,
            waiting: AtomicBool::new(false),
        })
    }

    // An eventfd's counter is a host-endian u64 by definition (eventfd(2)).
    #[allow(clippy::host_endian_bytes)]
    pub(crate) fn ring(&self) {
        // A full counter (EAGAIN) already means "wake up", so the result is not needed.
        let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
    }

    pub(crate) fn drain(&self) {
        // Non-blocking: an empty counter (EAGAIN) means there was nothing to drain.
        let mut v = [0u8; 8];
        let _ = rustix::io::read(&self.fd, &mut v);
    }
}

/// The io_uring opcodes kvtier submits, as the kernel reports them (`IORING_REGISTER_PROBE`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OpcodeSupport {
    /// Names of the opcodes the ring needs in every mode that the kernel lacks.
    required_missing: Vec<&'static str>,
    /// Names of the fixed-buffer opcodes the kernel lacks.
    fixed_missing: Vec<&'static str>,
}

/// Opcodes every ring needs: plain transfers (also the fallback when the region is not
/// registered) and the eventfd poll that wakes the ring thread.
pub const REQUIRED_OPCODES: [(&str, u8); 3] = [
    ("READ", opcode::Read::CODE),
    ("WRITE", opcode::Write::CODE),
    ("POLL_ADD", opcode::PollAdd::CODE),
];

/// Opcodes of transfers from and to the registered region; without them the engine uses
/// [`REQUIRED_OPCODES`]' READ / WRITE and says why.
pub const FIXED_BUFFER_OPCODES: [(&str, u8); 2] = [
    ("READ_FIXED", opcode::ReadFixed::CODE),
    ("WRITE_FIXED", opcode::WriteFixed::CODE),
];

impl OpcodeSupport {
    /// Asks the kernel which opcodes `ring` supports (and `allowed` accepts).
    pub(crate) fn of(
        ring: &IoUring,
        allowed: impl Fn(u8) -> bool,
    ) -> std::result::Result<Self, String> {
        let mut probe = Probe::new();
        ring.submitter().register_probe(&mut probe).map_err(|e| {
            format!(
                "the kernel cannot list its io_uring opcodes (IORING_REGISTER_PROBE needs \
                 Linux >= 5.6): {e}"
            )
        })?;
        Ok(Self::from_support(|code| {
            probe.is_supported(code) && allowed(code)
        }))
    }

    /// The verdict for a kernel that supports exactly the opcodes `is_supported` accepts.
    pub(crate) fn from_support(is_supported: impl Fn(u8) -> bool) -> Self {
        let missing = |ops: &[(&'static str, u8)]| {
            ops.iter()
                .filter(|(_, code)| !is_supported(*code))
                .map(|(name, _)| *name)
                .collect()
        };
        OpcodeSupport {
            required_missing: missing(&REQUIRED_OPCODES),
            fixed_missing: missing(&FIXED_BUFFER_OPCODES),
        }
    }

    /// Why the ring cannot be used at all, naming the missing opcodes.
    pub(crate) fn missing_required(&self) -> Option<String> {
        (!self.required_missing.is_empty()).then(|| {
            format!(
                "the kernel's io_uring lacks the {} opcode(s) kvtier needs",
                self.required_missing.join(", ")
            )
        })
    }

    /// Why transfers cannot use the registered region, naming the missing opcodes.
    pub(crate) fn missing_fixed(&self) -> Option<String> {
        (!self.fixed_missing.is_empty()).then(|| {
            format!(
                "the kernel's io_uring lacks the {} opcode(s) of registered buffers",
                self.fixed_missing.join(", ")
            )
        })
    }
}

/// How the region is split into registered buffers: pieces of at most `max_piece` bytes, each a
/// whole number of rows; `None` when one row is already larger.
fn piece_bytes(region: &PrimaryRegion, max_piece: usize) -> Option<usize> {
    let rows = ChunkGeometry::rows_in(max_piece as u64, region.row_stride()) as usize;
    (rows > 0).then(|| rows * region.row_stride() as usize)
}

/// Registers `region` as fixed buffers, or says why not.
/// `staging` (the engine's staging memory, see [`staging`]) is registered after the region's
/// pieces; its buffer index is returned with the piece size.
///
/// With `region_too` false only the staging memory is registered (the region is collapsing in
/// the background, and a registration would pin its pages); the piece size is then `None`.
fn register_region(
    ring: &IoUring,
    region: &PrimaryRegion,
    max_piece: usize,
    staging: Option<(*mut u8, usize)>,
    region_too: bool,
) -> std::result::Result<(Option<usize>, Option<u16>), String> {
    let Some(piece) = piece_bytes(region, max_piece) else {
        return Err(format!(
            "row_stride {} exceeds the {max_piece}-byte limit of one registered buffer",
            region.row_stride()
        ));
    };
    let mut iovecs = Vec::new();
    let mut off = if region_too { 0 } else { region.len() };
    while off < region.len() {
        let len = piece.min(region.len() - off);
        iovecs.push(libc::iovec {
            // SAFETY: `off < len()`, inside the mapping.
            iov_base: unsafe { region.base_ptr().add(off) }.cast(),
            iov_len: len,
        });
        off += len;
    }
    let staging_index = staging.map(|(base, len)| {
        iovecs.push(libc::iovec {
            iov_base: base.cast(),
            iov_len: len,
        });
        iovecs.len() - 1
    });
    if iovecs.len() > usize::from(u16::MAX) {
        return Err(format!(
            "the region needs {} registered buffers; at most {} are addressable",
            iovecs.len(),
            u16::MAX
        ));
    }
    // SAFETY: every iovec lies inside the region, which the ring thread keeps alive (it holds
    // an `Arc`) until after it unregisters the buffers, or inside the staging memory, which
    // the ring thread owns until then too; nothing moves either mapping.
    match unsafe { ring.submitter().register_buffers(&iovecs) } {
        Ok(()) => Ok((region_too.then_some(piece), staging_index.map(|i| i as u16))),
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

/// A ring of `depth` entries (twice as many completion entries) on a kernel that supports
/// every opcode kvtier needs, counting those `allowed` rejects as missing.
fn new_ring(depth: u32, allowed: impl Fn(u8) -> bool) -> Result<(IoUring, OpcodeSupport)> {
    let ring = IoUring::builder()
        .setup_cqsize(depth * 2)
        .build(depth)
        .map_err(|e| {
            Error::new(
                ErrorKind::Unsupported,
                format!("cannot set up an io_uring with {depth} entries: {e}"),
            )
            .with_source(e)
        })?;
    let opcodes =
        OpcodeSupport::of(&ring, allowed).map_err(|why| Error::new(ErrorKind::Unsupported, why))?;
    if let Some(why) = opcodes.missing_required() {
        return Err(Error::new(ErrorKind::Unsupported, why));
    }
    Ok((ring, opcodes))
}

/// Registers `files` as the ring's fixed files; false (with a warning) when the kernel refuses.
fn register_files(ring: &IoUring, files: &FileTable) -> bool {
    files.len() > 0
        && match ring.submitter().register_files(&files.raw_fds()) {
            Ok(()) => true,
            Err(e) => {
                log::warn!(
                    "io_uring: registering {} files failed ({e}); using plain fds",
                    files.len()
                );
                false
            }
        }
}

/// Registers the region (and the staging memory, whose buffer index `staging` then takes) as
/// fixed buffers when the kernel has the fixed-buffer opcodes. Returns the registered piece
/// size, and why transfers do not use the registered region when they do not.
fn register_buffers(
    ring: &IoUring,
    region: &PrimaryRegion,
    opcodes: &OpcodeSupport,
    staging: Option<&mut staging::Staging>,
    max_piece: usize,
) -> (Option<usize>, Option<String>) {
    if let Some(reason) = opcodes.missing_fixed() {
        return (None, Some(reason));
    }
    let memory = staging.as_deref().map(staging::Staging::memory);
    // A region still collapsing in the background is not registered (that would pin its
    // pages and stop the collapse); its rows go through staging or, once in 2 MiB pages,
    // through unregistered READ / WRITE.
    let region_too = memory.is_none() || !region.collapsing_in_background();
    match register_region(ring, region, max_piece, memory, region_too) {
        Ok((piece, index)) => {
            if let Some(s) = staging {
                s.buffer_index = index;
            }
            (piece, None)
        }
        Err(reason) => (None, Some(reason)),
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
        Self::with_piece_limit(region, files, queue_depth, o_direct, MAX_REGISTERED_BUFFER)
    }

    /// As [`UringEngine::new`], registering pieces of at most `max_piece` bytes (tests use a
    /// small limit to exercise several pieces without a 1 GiB region).
    pub(crate) fn with_piece_limit(
        region: Arc<PrimaryRegion>,
        files: Vec<std::fs::File>,
        queue_depth: u32,
        o_direct: bool,
        max_piece: usize,
    ) -> std::result::Result<Self, (Error, Vec<std::fs::File>)> {
        Self::start(
            region,
            files,
            queue_depth,
            o_direct,
            max_piece,
            |_| true,
            None,
        )
    }

    /// As [`UringEngine::new`], with every CQE result passed through `filter(tag, result)`
    /// before the ring thread acts on it (tests stand in for a kernel that answers EINTR or
    /// EAGAIN with it).
    #[cfg(test)]
    pub(crate) fn with_cqe_filter(
        region: Arc<PrimaryRegion>,
        files: Vec<std::fs::File>,
        filter: ring::CqeFilter,
    ) -> std::result::Result<Self, (Error, Vec<std::fs::File>)> {
        Self::start(
            region,
            files,
            8,
            false,
            MAX_REGISTERED_BUFFER,
            |_| true,
            Some(filter),
        )
    }

    /// As [`UringEngine::with_piece_limit`], treating the opcodes `allowed` rejects as missing
    /// from the kernel too (tests stand in for older kernels with it), and passing every CQE
    /// result through `cqe_filter` when given (tests only, see `with_cqe_filter`).
    pub(crate) fn start(
        region: Arc<PrimaryRegion>,
        files: Vec<std::fs::File>,
        queue_depth: u32,
        o_direct: bool,
        max_piece: usize,
        allowed: impl Fn(u8) -> bool,
        cqe_filter: Option<ring::CqeFilter>,
    ) -> std::result::Result<Self, (Error, Vec<std::fs::File>)> {
        let max_piece = max_piece.min(MAX_REGISTERED_BUFFER);
        let depth = queue_depth.max(1);
        let set_up = new_ring(depth, allowed).and_then(|(ring, opcodes)| {
            let wake = Wake::new()?;
            Ok((ring, opcodes, wake))
        });
        let (ring, opcodes, wake) = match set_up {
            Ok(s) => s,
            Err(e) => return Err((e, files)),
        };
        let wake = Arc::new(wake);
        let files = Arc::new(FileTable::new(files, o_direct));
        let fixed_files = register_files(&ring, &files);
        // Fallback reasons are logged by the caller, which knows whether it falls back further
        // (to psync).
        let mut staging = staging::Staging::plan(&region, &files);
        let (piece, fallback_reason) =
            register_buffers(&ring, &region, &opcodes, staging.as_mut(), max_piece);
        let staged_bytes = staging.as_ref().map(|s| s.staged_bytes.clone());
        let stage_lens = staging.as_ref().map(staging::Staging::lens);
        let (queue, req_rx) = RequestQueue::new("uring", "the ring thread exited unexpectedly");
        let mut worker = RingThread {
            ring,
            files: files.clone(),
            region: region.clone(),
            piece,
            fixed_files,
            rx: req_rx,
            done: queue.completion_sender(),
            wake: wake.clone(),
            depth: depth as usize,
            ops: Vec::new(),
            free: Vec::new(),
            in_flight: 0,
            ready: VecDeque::new(),
            poll_armed: false,
            reaped: Vec::new(),
            cqe_filter,
            staging,
        };
        let spawned = crate::io::spawn_io_thread("kvtier-uring".to_string(), move || worker.run());
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
            queue,
            wake,
            thread: Mutex::new(Some(thread)),
            piece,
            fallback_reason,
            staged_bytes,
            stage_lens,
        })
    }

    /// Whether the region is registered and transfers use READ_FIXED / WRITE_FIXED.
    pub fn fixed_buffers(&self) -> bool {
        self.piece.is_some()
    }

    /// Why fixed buffers are not used, if they are not.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fallback_reason.as_deref()
    }

    /// Bytes per registered buffer piece (a whole number of rows, at most 1 GiB).
    #[cfg(any(test, feature = "test-support"))]
    pub fn piece_bytes(&self) -> Option<usize> {
        self.piece
    }
}

impl IoEngine for UringEngine {
    fn name(&self) -> String {
        "uring".to_string()
    }

    engine_methods_from_fields!();

    fn submit(&self, reqs: &[IoRequest]) -> Result<()> {
        let sent = self.queue.submit(reqs, &self.files, &self.region)?;
        // Pairs with the fence in `RingThread::wait`: either the ring thread sees the new
        // requests before it blocks, or we see it waiting and wake it.
        fence(Ordering::SeqCst);
        if sent && self.wake.waiting.load(Ordering::SeqCst) {
            self.wake.ring();
        }
        Ok(())
    }

    fn staged_bytes(&self) -> Option<Arc<std::sync::atomic::AtomicU64>> {
        self.staged_bytes.clone()
    }

    fn stages(&self, len: usize) -> bool {
        self.stage_lens
            .is_some_and(|(min, max)| len >= min && len <= max)
    }

    fn shutdown(&self) {
        self.queue.close();
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

#[cfg(test)]
mod tests;
