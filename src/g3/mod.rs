//! The G3 NVMe tier: preallocated slab files whose slots are exactly one primary row.

pub mod config;
pub mod format;

pub use config::{DirectIoMode, FsyncPolicy, G3TierConfig};
pub use format::geometry_namespace;
pub mod aligned;
pub mod slab;
pub mod index;
pub mod journal;
pub mod recovery;
