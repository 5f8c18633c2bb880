//! How bytes move between the primary region and files: the I/O engine trait and its
//! implementations (`uring`, `psync`, `faulty`), plus path probes.
//!
//! An engine owns a table of open files and holds the [`PrimaryRegion`] whose rows are the only
//! buffers it transfers to or from (registered as io_uring fixed buffers where possible). A
//! request names a file by index, a file offset, and a byte range of the region. The engine
//! completes each request exactly once: `Ok(len)` only when all `len` bytes moved (short
//! transfers are resubmitted for the remainder or failed), otherwise an error. Engines never
//! busy-spin: their threads block when idle.

use std::sync::Arc;

// Fault injection: compiled only for tests (`test-support`), never shipped.
#[cfg(any(test, feature = "test-support"))]
pub mod faulty;
test_visible! {
    mod probe;
    mod psync;
    mod uring;
}
mod files;
mod idle;
mod meta;
mod open;
mod queue;
mod thread;

#[cfg(any(test, feature = "test-support"))]
pub use faulty::{DataFault, DataOp, FaultPlan, FaultyEngine, MetaFault};
pub(crate) use files::{is_transient, posix_fallocate};
pub use idle::{DEFAULT_IDLE_LINGER, DEFAULT_IDLE_POLL_INTERVAL, IdlePolicy};
#[cfg(feature = "test-support")]
pub use meta::{MetaFile, MetaOp};
#[cfg(not(feature = "test-support"))]
pub(crate) use meta::{MetaFile, MetaOp};
#[cfg(feature = "test-support")]
pub use open::EngineHandle;
#[cfg(not(feature = "test-support"))]
pub(crate) use open::EngineHandle;
pub use open::{EngineInfo, EngineOptions, open_engine};
pub use probe::{DirectIoProbe, probe_direct_io, probe_io_uring, statfs_magic};
pub(crate) use probe::{FilesystemFacts, filesystem_facts};
#[cfg(feature = "test-support")]
pub use thread::batch_policy_failures;
#[cfg(not(feature = "test-support"))]
pub(crate) use thread::batch_policy_failures;
pub(crate) use thread::spawn_io_thread;

use crossbeam_channel::Receiver;

use crate::error::Result;
use crate::region::PrimaryRegion;

/// Direction of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IoDir {
    /// File -> region.
    Read,
    /// Region -> file.
    Write,
}

/// One transfer between a file and a range of the engine's region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoRequest {
    /// Read or write.
    pub dir: IoDir,
    /// Index into the engine's file table.
    pub file: usize,
    /// Byte offset in the file (4096-aligned for O_DIRECT files).
    pub file_offset: u64,
    /// Byte offset of the buffer inside the region (4096-aligned).
    pub region_offset: usize,
    /// Bytes to move (a multiple of 4096 for O_DIRECT files).
    pub len: usize,
    /// Caller's tag, returned in the completion.
    pub tag: u64,
}

/// The tag of the transfer of key `index` of a tier's active job `serial` (the two halves of
/// the `u64`), so that a completion leads straight back to its job and key.
pub(crate) fn job_tag(serial: u32, index: usize) -> u64 {
    (u64::from(serial) << 32) | (index as u64 & 0xffff_ffff)
}

/// The job serial and key index of a [`job_tag`].
pub(crate) fn split_job_tag(tag: u64) -> (u32, usize) {
    ((tag >> 32) as u32, (tag & 0xffff_ffff) as usize)
}

/// The completion of one [`IoRequest`].
#[derive(Debug)]
pub struct IoCompletion {
    /// The request's tag.
    pub tag: u64,
    /// `Ok(len)` iff every byte moved; otherwise why not.
    pub result: Result<usize>,
    /// The CRC-32 (`crc32fast`) of the request's bytes, when the engine computed it in the
    /// same pass as a staging copy ([`IoEngine::stages`]): of the bytes written (a write) or
    /// copied into the region (a read). `None` otherwise.
    pub row_crc: Option<u32>,
}

/// Which engine to use (config key `io_engine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoEngineKind {
    /// io_uring when it works here, else psync with the reason logged once and exported.
    #[default]
    Auto,
    /// io_uring or an error.
    Uring,
    /// pread/pwrite on a small thread pool.
    Psync,
}

/// A pluggable I/O engine.
pub trait IoEngine: Send + Sync {
    /// `"uring"`, `"psync"`, `"faulty(uring)"`, ...
    fn name(&self) -> String;

    /// Queues requests and returns at once. Each request completes exactly once on
    /// [`IoEngine::completions`]. Requests are validated (file index, region bounds, and
    /// alignment when the file is O_DIRECT); an invalid request completes with an error rather
    /// than failing the call. Returns an error only when the engine is shut down.
    fn submit(&self, reqs: &[IoRequest]) -> Result<()>;

    /// Where completions arrive.
    fn completions(&self) -> &Receiver<IoCompletion>;

    /// The region the engine transfers to and from.
    fn region(&self) -> &Arc<PrimaryRegion>;

    /// When the engine stages large transfers of a region in 4 KiB pages through its own
    /// 2 MiB pages (the `uring` engine, see `io/uring/staging.rs`): the counter of bytes it
    /// copied that way. `None` when it does not stage.
    fn staged_bytes(&self) -> Option<Arc<std::sync::atomic::AtomicU64>> {
        None
    }

    /// Whether a request of `len` bytes is staged, so that its successful completion carries
    /// [`IoCompletion::row_crc`] (the caller need not checksum the bytes itself).
    fn stages(&self, _len: usize) -> bool {
        false
    }

    /// Waits for every submitted request to complete, then stops the engine's threads and
    /// releases registrations. Idempotent.
    fn shutdown(&self);

    /// `fdatasync` of file `file`: every write that completed before the call is durable
    /// when it returns `Ok`. Blocks the caller (the G3 worker's group commit).
    fn sync_data(&self, file: usize) -> Result<()>;

    /// Test support: called before each operation on a tier's metadata files (the G3 journal, checkpoint
    /// and their directory): `Some(error)` makes that operation fail with `error` without
    /// running it. Real engines inject nothing; the `faulty` engine follows its plan.
    #[cfg(any(test, feature = "test-support"))]
    fn meta_fault(&self, _file: MetaFile, _op: MetaOp) -> Option<std::io::Error> {
        None
    }

    /// Adds a file opened for a few transfers of its own (a file-per-chunk tier's chunk file)
    /// to the engine's file table and returns its index for [`IoRequest::file`]. `label` names
    /// it in errors; `o_direct` says it was opened with O_DIRECT (requests on it are then
    /// checked for 4096-byte alignment). Such a file is never registered with io_uring.
    fn attach_file(&self, file: std::fs::File, label: String, o_direct: bool) -> Result<usize>;

    /// Removes a file added by [`IoEngine::attach_file`] and hands it back. Refused (the file
    /// stays attached) while a transfer on it is in flight, that is until its completion has
    /// been sent; an index that names no attached file is an [`crate::ErrorKind::Contract`]
    /// error.
    fn detach_file(&self, file: usize) -> Result<std::fs::File>;
}
