//! kvtier: a storage engine for LLM KV cache outside GPU memory.
//!
//! * [`region`]: the primary memory region (rows of `row_stride` bytes).
//! * [`primary`]: the CPU primary tier (slots, ref counts, LRU / ARC eviction).
//! * [`io`]: I/O engines (io_uring, psync, fault injection) and path probes.
//! * [`g3`]: the G3 NVMe tier (slab files, persistent index, recovery).
//! * [`canonical`]: the canonical layout that makes stored bytes portable across TP sizes.
//! * [`contract`]: the tier contract: job vocabulary and the `SecondaryTier` trait.
//! * [`tiering`]: the manager with vLLM's multi-tier semantics and back-pressure.
//! * [`metrics`]: a small Prometheus text-exposition registry (owned, never global).
//! * [`config`]: configuration model, merge and validation.
//! * [`geometry`]: chunk geometry (row stride, rows) derived from the KV layout and pool size.
//! * [`cli`]: the `kvtier` command line.

pub mod canonical;
pub mod cli;
pub mod config;
pub mod contract;
pub mod error;
pub mod g3;
pub mod geometry;
pub mod hash;
pub mod io;
pub mod key;
pub mod metrics;
pub mod primary;
pub mod region;
pub mod tiering;

pub use error::{Error, ErrorKind, Result};
pub use key::ChunkKey;

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
