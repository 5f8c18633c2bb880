//! The node-local service: one kvtier process per host owns the G3 pool for every engine
//! process on it (`kvtier serve` with a `service` section; `docs/node-service.md`).
//!
//! Several engine processes (the data-parallel ranks of one vLLM, or several vLLMs) connect to
//! the service's Unix socket. The socket file has the configured mode (0600 by default) and
//! each peer's uid, taken with `SO_PEERCRED`, must be on the allow list. An engine presents
//! its row stride and compatibility digest (refused at once on a mismatch, with both digests
//! in the error) and registers its primary region: the path of its `/dev/shm` file (vLLM
//! 0.33's tiering region, which is not unlinked) or the file's descriptor, passed with
//! `SCM_RIGHTS`. The service maps the region and moves rows between it and the G3 slots with
//! an I/O engine of that region's own (io_uring with the region registered as fixed buffers
//! where possible), through the tier's slot grants: no byte of KV crosses the socket.
//! A chunk stored by one engine is loadable by every other. The service's own threads touch
//! an engine's rows only through kernel copies on the region file (`region_file`), so an
//! engine that shrinks its file fails its own jobs and never brings the service down.
//!
//! # The face
//! [`NodeService`] (started from a configuration with [`start_from_config`]) is the service;
//! [`NodeClient`] an engine's connection to it, introduced by a [`ClientHello`] and answered
//! with a [`ServiceInfo`]; [`NodeTier`] the service as an engine's secondary tier, over a
//! region given as a [`RegionSource`]. A client's answers to requests sent without waiting are
//! [`AsyncAnswer`]s and [`LookupAnswer`]s, its inventory events [`InventoryEvent`]s of an
//! [`EventMedium`]; [`PREFETCH_ACTION`] and [`PREFETCH_VERSION`] name kvtier's prefetch action
//! in a request's `kv_hints`. Everything else (the wire protocol, the sessions, the staging
//! pool) is private to the crate; `docs/node-service.md` describes it, the protocol byte for
//! byte.
//!
//! # Inside
//! * `protocol`: the little-endian frames, byte for byte.
//! * `socket`: frames with descriptors, `SO_PEERCRED`, binding the socket with its mode.
//! * `engines`: the registry of connected engines and their counters.
//! * `staging`: the DRAM staging pool (`service.dram_bytes`): G3 chunks in the service's
//!   memory for every engine.
//! * `prefetch`: hints (`HINT`) and the reads from G3 into the staging pool they start.
//! * `hints`: kvtier's prefetch action in a request's `kv_hints` (vLLM's `KvHintsEnvelope`).
//! * `events`: inventory events (staging pool: CPU, G3: STORAGE) for the engines.
//! * `region_file`: an engine's region file, read and written through the kernel, checked
//!   for a resize before and after every job.
//! * `session`: one engine's connection, its region and jobs, and the cleanup when it ends.
//! * `server`: [`NodeService`], the listener and the peer check.
//! * `service_metrics`: the service's metrics in Prometheus text.
//! * `client`: [`NodeClient`], the engine's side.
//! * `tier`: [`NodeTier`], the service as an engine's secondary tier (client mode).
//! * `test_hold`: test support (`test-support` only), a service that holds jobs in flight
//!   (`start_holding_jobs`).

mod client;
mod engines;
mod events;
mod hints;
mod prefetch;
mod protocol;
mod region_file;
mod server;
mod service_metrics;
mod session;
mod socket;
mod staging;
mod test_hold;
mod tier;

pub use client::{AsyncAnswer, ClientHello, LookupAnswer, NodeClient, ServiceInfo};
pub use hints::{PREFETCH_ACTION, PREFETCH_VERSION};
pub use protocol::{EventMedium, InventoryEvent};
#[cfg(feature = "test-support")]
pub use server::start_holding_jobs;
pub use server::{NodeService, start_from_config};
pub use tier::{NodeTier, RegionSource};
