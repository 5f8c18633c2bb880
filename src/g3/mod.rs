//! The G3 NVMe tier: preallocated slab files whose slots are exactly one primary row.
//!
//! * `config`: the tier's config keys ([`G3TierConfig`]).
//! * `format`: the slab superblock, striping, the geometry namespace.
//! * `dirs`: checking that the tier's directories take files, syncing them.
//! * `fs_record`: which filesystem each path lives on, remembered outside the tier, so a
//!   restart never creates a tier on the disk below an unmounted one.
//! * `slab`: creating, locking, preallocating and opening slab files.
//! * `index`: the in-memory key -> slot index.
//! * `record`: the record codec of the index files; `record_reader` streams them.
//! * `index_dir`: the open directory of the index files; `journal` appends to the journal,
//!   `checkpoint` writes checkpoint generations, `recovery` rebuilds the index.
//! * `tier`: [`G3Tier`], the [`crate::contract::secondary::SecondaryTier`] implementation,
//!   driven by the worker thread in `worker`.
//! * `slot_grants`: `slot_grants::SlotGrants`, slots moved by another data path (GPUDirect Storage).
//! * `gpu_path` (feature `gds`): chunks moved between GPU blocks and slots by GDS.
//! * [`gds`]: whether GPUDirect Storage can run for the tier (`gds` key), and why not.
//! * `admission`: the admission gate of store jobs (`admission` key) and its counters.
//! * `offline`: `offline::OfflineTier`, an entry running without its slabs (a path on
//!   another filesystem, `on_wrong_filesystem = "degraded"`).
//! * [`admin`]: format / inspect / verify / list / clear, for the CLI.

pub mod admin;
test_visible! {
    mod admission;
    mod aligned;
    mod checkpoint;
    mod config;
    mod slot_grants;
    mod dirs;
    mod format;
    mod fs_record;
    mod index;
    mod index_dir;
    mod journal;
    mod keymap;
    mod metrics;
    mod offline;
    mod record;
    mod record_reader;
    mod recovery;
    mod slab;
    mod slot_key;
    mod tier;
}
pub mod gds;
#[cfg(feature = "gds")]
pub mod gpu_path;
mod worker;

pub use config::{DirectIoMode, FsyncPolicy, G3TierConfig, GdsMode, WrongFilesystem};
pub use format::{MISMATCH_NAMESPACE, MISMATCH_ROW_STRIDE, geometry_namespace};
pub use fs_record::Records;
pub use journal::CHECKPOINT_FILE_NAME;
pub use slab::{SLAB_FILE_NAME, available_bytes};
pub use tier::{EngineFactory, G3Info, G3Tier};
