//! Choosing and starting an engine: [`open_engine`] resolves `auto`, and says which engine runs,
//! whether fixed buffers are in use, and why it fell back when it did.

use std::fs::File;
use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result};
use crate::io::psync::{DEFAULT_PSYNC_THREADS, PsyncEngine};
use crate::io::uring::{DEFAULT_QUEUE_DEPTH, UringEngine};
use crate::io::{IoEngine, IoEngineKind};
use crate::region::PrimaryRegion;

/// How to build an engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineOptions {
    /// io_uring submission queue entries (and the cap on requests in flight in the ring).
    pub queue_depth: u32,
    /// Worker threads of the psync engine.
    pub psync_threads: usize,
    /// The files were opened with O_DIRECT: offsets, lengths and buffer addresses must be
    /// 4096-aligned, and misaligned requests fail with [`ErrorKind::Misaligned`] before they are
    /// submitted.
    pub o_direct: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            queue_depth: DEFAULT_QUEUE_DEPTH,
            psync_threads: DEFAULT_PSYNC_THREADS,
            o_direct: true,
        }
    }
}

/// What was started, for logs and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineInfo {
    /// The engine's name (`"uring"`, `"psync"`).
    pub name: String,
    /// The engine that runs ([`IoEngineKind::Uring`] or [`IoEngineKind::Psync`], never `Auto`).
    pub kind: IoEngineKind,
    /// Whether the region is registered as io_uring fixed buffers (READ_FIXED / WRITE_FIXED).
    pub fixed_buffers: bool,
    /// Why something less than "io_uring with fixed buffers" runs: `auto` chose psync because
    /// io_uring setup or buffer registration failed, or an explicit `uring` runs unregistered
    /// buffers because registration failed.
    /// `None` when nothing fell back (or psync was asked for).
    pub fallback_reason: Option<String>,
}

/// A started engine and what it is.
pub struct EngineHandle {
    /// The engine, shareable between the submitting and the completing side.
    pub engine: Arc<dyn IoEngine>,
    /// Which engine it is and whether it fell back.
    pub info: EngineInfo,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

/// Starts the engine `kind` over `files`, transferring to and from `region`.
///
/// * `Uring`: io_uring or an error. If the region cannot be registered as fixed buffers
///   (ENOMEM under a memlock limit, EFAULT for file-backed memory), it still runs, with plain
///   READ/WRITE opcodes; the reason is logged once and returned in the info.
/// * `Psync`: the pread/pwrite pool.
/// * `Auto`: `Uring` when a ring can be set up here and the region registers as fixed buffers,
///   else `Psync`, with the reason logged once and returned in [`EngineInfo::fallback_reason`].
pub fn open_engine(
    kind: IoEngineKind,
    region: Arc<PrimaryRegion>,
    files: Vec<File>,
    opts: &EngineOptions,
) -> Result<EngineHandle> {
    if opts.queue_depth == 0 {
        return Err(Error::new(
            ErrorKind::Config,
            "io queue_depth must be at least 1",
        ));
    }
    match kind {
        IoEngineKind::Psync => open_psync(region, files, opts, None),
        IoEngineKind::Uring => {
            let engine = UringEngine::new(region, files, opts.queue_depth, opts.o_direct)
                .map_err(|(e, _)| e)?;
            if let Some(reason) = engine.fallback_reason() {
                log::warn!("io_uring: {reason}; using unregistered READ/WRITE opcodes");
            }
            Ok(uring_handle(engine))
        }
        IoEngineKind::Auto => {
            // Duplicates of the descriptors, for psync in case io_uring does not work out.
            let spare = files
                .iter()
                .map(File::try_clone)
                .collect::<std::io::Result<Vec<_>>>()
                .map_err(|e| {
                    Error::new(
                        ErrorKind::Io,
                        format!("cannot duplicate file descriptors: {e}"),
                    )
                    .with_source(e)
                })?;
            let why = match UringEngine::new(region.clone(), files, opts.queue_depth, opts.o_direct)
            {
                Ok(engine) => match engine.fallback_reason().map(str::to_string) {
                    None => return Ok(uring_handle(engine)),
                    Some(reason) => {
                        engine.shutdown();
                        reason
                    }
                },
                Err((e, _)) => e.to_string(),
            };
            let reason = format!("io_uring unusable here ({why}); using psync");
            log::warn!("{reason}");
            open_psync(region, spare, opts, Some(reason))
        }
    }
}

fn uring_handle(engine: UringEngine) -> EngineHandle {
    let info = EngineInfo {
        name: engine.name(),
        kind: IoEngineKind::Uring,
        fixed_buffers: engine.fixed_buffers(),
        fallback_reason: engine.fallback_reason().map(str::to_string),
    };
    EngineHandle {
        engine: Arc::new(engine),
        info,
    }
}

fn open_psync(
    region: Arc<PrimaryRegion>,
    files: Vec<File>,
    opts: &EngineOptions,
    fallback_reason: Option<String>,
) -> Result<EngineHandle> {
    let engine = PsyncEngine::new(region, files, opts.psync_threads, opts.o_direct)?;
    Ok(EngineHandle {
        info: EngineInfo {
            name: engine.name(),
            kind: IoEngineKind::Psync,
            fixed_buffers: false,
            fallback_reason,
        },
        engine: Arc::new(engine),
    })
}
