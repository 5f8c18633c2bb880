//! What every session of one service shares ([`ServiceShared`]), a mapped region, a queued
//! job, and how a reply is sent.

use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use parking_lot::Mutex;

use crate::contract::secondary::SecondaryTier;
use crate::error::Error;
use crate::g3::G3Tier;
use crate::g3::slot_grants::SlotGrants;
use crate::io::{EngineHandle, IoEngineKind};
use crate::node::engines::EngineRegistry;
use crate::node::events::EventBus;
use crate::node::prefetch::Staging;
use crate::node::protocol::{EventMedium, Frame, JobRequest, Reply};
use crate::node::region_file::RegionFile;
use crate::node::socket::write_frame;
use crate::node::test_hold::TestHooks;
use crate::region::PrimaryRegion;

/// Jobs one engine may have queued at the service; beyond that a job fails at once.
pub(super) const MAX_QUEUED_JOBS_PER_ENGINE: usize = 1024;
/// How long the service waits for a `HELLO`, and for a stalled engine to take a reply.
pub const SOCKET_TIMEOUT: Duration = Duration::from_secs(10);

/// What every session of one service shares.
pub struct ServiceShared {
    /// The G3 tier (lookups).
    pub tier: Mutex<G3Tier>,
    /// Its slot grants (stores and loads).
    pub slots: SlotGrants,
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
    /// A test's hooks (none in a build without `test-support`).
    pub hooks: TestHooks,
}

impl ServiceShared {
    /// Moves the G3 tier's events (STORAGE) to the engines' queues.
    pub(super) fn pump_tier_events(&self) {
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
pub(super) struct MappedRegion {
    pub(super) region: Arc<PrimaryRegion>,
    pub(super) engine: EngineHandle,
    /// The region file: every CPU access to the rows goes through it.
    pub(super) file: RegionFile,
    /// Why the region is lost, once it is (every later job fails with it).
    pub(super) lost: Mutex<Option<Error>>,
}

/// A job on its way to the session's job thread.
pub(super) struct QueuedJob {
    pub(super) seq: u64,
    pub(super) load: bool,
    pub(super) job: JobRequest,
}

/// The `ERROR` reply saying `e`.
pub(super) fn error_reply(e: &Error) -> Reply {
    Reply::Error {
        kind: e.kind(),
        message: e.to_string(),
    }
}

/// Sends `frame` on the session's write side; an engine that does not take it is dropped
/// (the write side shut down and forgotten).
pub(super) fn send(writer: &Mutex<Option<UnixStream>>, frame: &Frame) {
    let mut w = writer.lock();
    if let Some(stream) = w.as_ref()
        && let Err(e) = write_frame(stream, frame)
    {
        log::warn!("node service: an engine does not take its replies ({e}); dropping it");
        let _ = stream.shutdown(std::net::Shutdown::Both);
        *w = None;
    }
}
