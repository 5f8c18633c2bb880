//! The `fs` tier: one file per chunk under a directory that several hosts may share through
//! a distributed file system (Lustre, CephFS, GPFS, GlusterFS, NFS), with vLLM 0.33.0's
//! `fs` tier file names and contents, so that both load each other's chunks.
//!
//! * `config`: the tier's config keys.
//! * `mapper`: vLLM's `FileMapper` naming (folder digest, `config.json`, file paths).
//! * `folder`: checks and writes `config.json` and kvtier's `kvtier.json` in the folder.
//! * `integrity`: the CRC32 record kept in a user extended attribute of each file.
//! * `chunk_file`: the blocking steps of a store (temporary file, publish without replace)
//!   and of a load (open, size check, record).
//! * `catalog`: the files this process knows, LRU, and eviction above the capacity.
//! * `lookup`: lookups that answer RETRY while a background existence check runs, with a
//!   bounded verdict cache.
//! * `scan`: the start-up scan that seeds the catalog and removes stale temporary files.
//! * `worker`: the coordinator (byte budget, jobs) and the I/O threads around the engine.
//! * `tier`: [`FsTier`], the [`crate::contract::secondary::SecondaryTier`].
//!
//! Deployment and guarantees: `docs/fs-tier.md`.

test_visible! {
    mod catalog;
    mod chunk_file;
    mod config;
    mod folder;
    mod integrity;
    mod mapper;
    mod metrics;
    mod tier;
}
mod lookup;
mod scan;
mod sys;
mod worker;

pub use config::{FsSync, FsTierConfig, Integrity};
pub use mapper::FileMapper;
pub use tier::{FsInfo, FsTier};
