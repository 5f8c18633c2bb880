//! kvtier: a storage engine for LLM KV cache outside GPU memory.
//!
//! # Embedding
//! [`Builder`] turns a configuration (a file, a JSON or TOML string, or a typed
//! [`KvtierConfig`]) into a running [`TieringManager`], or into a single [`SecondaryTier`] over
//! a region the embedder owns (vLLM's, adopted in place with [`PrimaryRegion::adopt`]: that is
//! what the Python package `python/` does). The scheduler side then calls the manager; every
//! call returns in microseconds, and I/O runs on kvtier's own threads.
//!
//! ```no_run
//! use kvtier::{Builder, ChunkKey, LookupResult, RequestContext, ScheduleEndContext};
//!
//! # fn main() -> kvtier::Result<()> {
//! // `secondary_tiers: [{"type": "nvme", "paths": [...], "capacity_bytes": "1TiB"}]`
//! let layout = kvtier::canonical::LayoutDescriptor::load("layouts/llama-3.1-8b.toml")?;
//! let mut manager = Builder::from_file("kvtier.json")?.layout(layout, 1).build()?;
//!
//! let req = RequestContext::new("request-1");
//! manager.on_new_request(&req);
//! match manager.lookup(&ChunkKey::new(b"block hash"), &req) {
//!     LookupResult::Hit => { /* prepare_load, copy the row to the GPU, complete_load */ }
//!     // A promotion from a secondary tier started: ask again after the step ends.
//!     LookupResult::HitPending => {}
//!     // Not known yet, e.g. an NVMe tier still recovering its index after a restart.
//!     LookupResult::Retry => {}
//!     LookupResult::Miss => { /* compute, then prepare_store / complete_store */ }
//! }
//! manager.on_schedule_end(&ScheduleEndContext::default())?;
//! manager.on_request_finished(&req);
//! manager.shutdown()?;
//! # Ok(())
//! # }
//! ```
//!
//! **Lookups answer RETRY while an index recovers.** A persistent (`nvme`) tier opens at once
//! and rebuilds its index from its last checkpoint and journal on its own I/O thread; until
//! that is done its `lookup` (and so the manager's) answers RETRY, never a wrong MISS or HIT.
//! With the default `checkpoint_journal_bytes` (64 MiB of journal at most) that takes
//! milliseconds to about a second ([`embed`] has the details; the `g3_recovery_seconds`
//! metric shows it). `examples/store_evict_load.rs` stores, evicts and loads a chunk.
//!
//! # Layers
//! The modules form layers; each imports only from its own layer or the ones below it, and
//! no two modules of one folder import each other (`tests/architecture.rs` checks both on
//! every test run and prints the import graph with `-- --nocapture`). From the bottom:
//!
//! 1. [`error`], [`key`], `hash`, [`size`]: the vocabulary every layer speaks.
//! 2. [`geometry`]: the one place that turns sizes into rows (row stride, row alignment,
//!    rows for a byte budget, slots per file).
//! 3. [`metrics`]: a small Prometheus text-exposition registry (owned, never global).
//! 4. [`region`]: the primary memory region (rows of `row_stride` bytes).
//! 5. [`io`]: I/O engines (io_uring, psync, fault injection) and path probes.
//! 6. [`contract`]: the tier contract: job vocabulary and the `SecondaryTier` trait.
//! 7. [`config`]: configuration model, parsing and one `validate` per type.
//! 8. [`canonical`]: the canonical layout that makes stored bytes portable across TP sizes.
//! 9. `primary`: the CPU primary tier (slots, ref counts, LRU / ARC eviction).
//! 10. [`g3`]: the G3 NVMe tier (slab files, persistent index, recovery); [`fs`]: the
//!     file-per-chunk tier for shared file systems (vLLM `fs` tier compatible), which reuses
//!     a few of G3's pieces.
//! 11. [`tiering`]: the manager with vLLM's multi-tier semantics and back-pressure.
//! 12. [`embed`]: the front door: one [`Builder`] from a configuration to a running manager or
//!     a single tier (used by `kvtier serve`, `kvtier bench` and the Python package).
//! 13. [`node`]: the node-local service (one G3 pool shared by every engine process of a
//!     host over a Unix socket) and its client, [`node::NodeClient`].
//!
//! # What is public
//! The embedding face is re-exported here: [`Builder`], [`TieringManager`] and
//! [`ScheduleEndContext`], [`SecondaryTier`] with the job vocabulary ([`TransferJob`],
//! [`JobResult`], [`LookupResult`], [`RequestContext`]), [`PrimaryRegion`], [`KvtierConfig`],
//! [`ChunkKey`], [`Error`]. The modules the `kvtier` command line and the Python package build
//! with are public, each with the face its `mod.rs` exports: [`config`] (and the byte
//! [`size`]s it reads), [`canonical`] (layout descriptors, digests), [`contract`], [`embed`],
//! [`node`] (the service, its client and its tier), [`g3`] (the NVMe tier, its config, offline
//! [`g3::admin`], GDS status), [`fs`], [`io`] (I/O engines and path probes), [`tiering`],
//! [`region`], [`geometry`], [`metrics`]. Their inner files are private.
//!
//! The cargo feature `test-support` is for kvtier's own tests, benches and the
//! `kvtier-replay` driver only: it makes the inner modules public (not a stable API) and
//! compiles in the fixtures and fault injection only tests use (`io::FaultyEngine`, a manual
//! clock, the memory tier's inline engine, the node service's job hold). A shipped build has
//! none of them. The command line is its own crate (`cli/`).

/// Declares modules that are private to the crate in a shipped build and public with the
/// `test-support` feature, which kvtier's own tests, benches and the `kvtier-replay` driver
/// turn on to look inside. Used at the crate root and in each module's `mod.rs`: a module's
/// face is what it declares `pub` and re-exports, its inner files stay private.
macro_rules! test_visible {
    ($($(#[$attr:meta])* mod $name:ident;)*) => {$(
        $(#[$attr])*
        #[cfg(feature = "test-support")]
        pub mod $name;
        $(#[$attr])*
        #[cfg(not(feature = "test-support"))]
        pub(crate) mod $name;
    )*};
}

// The face: what an embedder builds with and what the `kvtier` command line needs. Each
// module's own face is what its `mod.rs` makes public; its inner files are `test_visible`.
pub mod canonical;
pub mod config;
pub mod contract;
pub mod embed;
pub mod error;
pub mod fs;
pub mod g3;
pub mod geometry;
pub mod io;
pub mod key;
pub mod metrics;
pub mod node;
pub mod region;
pub mod size;
pub mod tiering;

test_visible! {
    mod hash;
    mod primary;
}

pub use config::KvtierConfig;
pub use contract::job::{JobResult, LookupResult, RequestContext, TransferJob};
pub use contract::secondary::SecondaryTier;
pub use embed::Builder;
pub use error::{Error, ErrorKind, Result};
pub use key::ChunkKey;
pub use region::PrimaryRegion;
pub use tiering::manager::{ScheduleEndContext, TieringManager};

/// Reports that a test is skipped because this machine lacks a capability (io_uring, fio,
/// a mount, a privilege). The line goes straight to the process's stderr, bypassing the test
/// harness's output capture, so a skip is visible in every test log and never passes silently.
#[macro_export]
macro_rules! skip_test {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "SKIP [{}]: {}",
            module_path!(),
            format_args!($($arg)*)
        );
    }};
}
