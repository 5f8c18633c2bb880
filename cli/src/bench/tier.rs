//! The stack `kvtier bench` runs on: a primary region and tier, one G3 tier on fresh
//! directories (or, with `--tier fs`, one fs tier in a fresh directory), and the tiering
//! manager over them, built by the library's [`Builder`] from a configuration in the config
//! file's shape (no back-pressure: the bench must store every chunk it later verifies).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvtier::config::{EvictionPolicyKind, KvtierConfig, TierConfig};
use kvtier::embed::Builder;
use kvtier::error::{Error, ErrorKind, Result};
use kvtier::io::IoEngineKind;
use kvtier::tiering::TieringManager;

use crate::bench::args::BenchArgs;
use crate::bench::plan::Plan;
use crate::region_arg::{BenchRegion, pages_note};

/// How to build the stack.
#[derive(Debug, Clone)]
pub struct TierOptions {
    /// Where to make the tier's directories (one per path); empty = the system temp dir.
    pub parent_dirs: Vec<PathBuf>,
    /// G3 capacity over all paths.
    pub capacity: u64,
    /// Bytes per row and slot.
    pub row_stride: u64,
    /// Rows of the primary region.
    pub primary_rows: u64,
    /// G3 `max_bytes_in_flight`.
    pub max_bytes_in_flight: u64,
    /// G3 `io_engine`.
    pub io_engine: IoEngineKind,
    /// G3 `idle_linger_ms`.
    pub idle_linger: std::time::Duration,
    /// Namespace digest for the slab superblocks.
    pub namespace: [u8; 32],
    /// Bytes of each row a G3 slot holds (`None`: the whole row).
    pub slot_bytes: Option<u64>,
    /// Keep the directories when done.
    pub keep: bool,
    /// `Some`: an fs tier (in the first directory) named by these vLLM FileMapper fields,
    /// instead of a G3 tier.
    pub fs_fields: Option<serde_json::Value>,
    /// The primary region the stack runs on.
    pub region: BenchRegion,
}

impl TierOptions {
    /// The stack `args` and `plan` ask for: a G3 tier holding whole rows, on kvtier's own
    /// region, with the namespace `namespace`. Callers change what differs.
    pub(crate) fn of(args: &BenchArgs, plan: &Plan, namespace: [u8; 32]) -> Self {
        TierOptions {
            parent_dirs: args.path.paths.clone(),
            capacity: plan.capacity,
            row_stride: plan.row_stride,
            primary_rows: plan.chunks,
            max_bytes_in_flight: plan.max_bytes_in_flight,
            io_engine: args.io_engine,
            idle_linger: Duration::from_millis(args.idle_linger_ms),
            namespace,
            slot_bytes: None,
            keep: args.keep,
            fs_fields: None,
            region: BenchRegion::Own,
        }
    }
}

/// Facts for the report.
#[derive(Debug, Clone)]
pub struct TierFacts {
    /// The tier's directories.
    pub dirs: Vec<PathBuf>,
    /// Engine name.
    pub io_engine: String,
    /// `direct`, `buffered` or `mixed`.
    pub direct_io: String,
    /// How the primary region's rows are backed (`2 MiB pages`, `4 KiB pages (why)`).
    pub pages: String,
}

/// The running stack. [`BenchTier::close`] shuts it down and removes the directories unless
/// they are kept.
pub struct BenchTier {
    /// The manager the bench drives.
    pub manager: TieringManager,
    dirs: Vec<tempfile::TempDir>,
    /// The tier's `config_info` (engine, direct I/O, ...).
    info: Vec<(&'static str, String)>,
    /// How the primary region's rows are backed.
    pages: String,
    keep: bool,
}

impl BenchTier {
    /// Makes the directories and builds the manager with the tier there.
    pub fn open(opts: &TierOptions) -> Result<Self> {
        let parents = crate::args::path_dirs(&opts.parent_dirs)?;
        let mut dirs = Vec::with_capacity(parents.len());
        for parent in &parents {
            let dir = tempfile::Builder::new()
                .prefix("kvtier-bench-")
                .tempdir_in(parent)
                .map_err(|e| cannot_create_in(parent, e))?;
            dirs.push(dir);
        }
        let rows = usize::try_from(opts.primary_rows)
            .map_err(|_| Error::config("--bytes", "too many rows for this platform"))?;
        let region = Arc::new(opts.region.create(rows, opts.row_stride)?);
        let pages = pages_note(&region);
        let io_engine = match opts.io_engine {
            IoEngineKind::Auto => "auto",
            IoEngineKind::Uring => "uring",
            IoEngineKind::Psync => "psync",
        };
        let paths: Vec<String> = dirs
            .iter()
            .map(|d| d.path().display().to_string())
            .collect();
        let (tier_type, params) = match &opts.fs_fields {
            Some(_) => (
                "fs",
                serde_json::json!({
                    "root_dir": paths[0],
                    "capacity_bytes": opts.capacity,
                    "max_bytes_in_flight": opts.max_bytes_in_flight,
                    "io_engine": io_engine,
                }),
            ),
            // Stores are reported once their data and index records are durable (the default).
            None => (
                "nvme",
                serde_json::json!({
                    "paths": paths,
                    "capacity_bytes": opts.capacity,
                    "max_bytes_in_flight": opts.max_bytes_in_flight,
                    "io_engine": io_engine,
                    "idle_linger_ms": u64::try_from(opts.idle_linger.as_millis()).unwrap_or(u64::MAX),
                    "fsync": "always",
                }),
            ),
        };
        let mut tier = TierConfig::new(0, tier_type);
        tier.params = params.as_object().cloned().unwrap_or_default();
        let mut cfg = KvtierConfig::new(region.len() as u64);
        cfg.eviction_policy = EvictionPolicyKind::Lru;
        cfg.secondary_tiers = vec![tier];
        let mut builder = Builder::new(cfg).region(region).namespace(opts.namespace);
        if let Some(bytes) = opts.slot_bytes {
            builder = builder.slot_bytes(bytes);
        }
        if let Some(fields) = &opts.fs_fields {
            builder = builder.file_mapper_fields(fields.clone());
        }
        let manager = builder.build()?;
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !manager.tier(0).is_some_and(|t| t.ready()) {
            if std::time::Instant::now() >= deadline {
                return Err(Error::new(
                    ErrorKind::Internal,
                    "the fresh tier did not finish opening its index within 60 s",
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let info = manager.tier(0).map(|t| t.config_info()).unwrap_or_default();
        Ok(BenchTier {
            manager,
            dirs,
            info,
            pages,
            keep: opts.keep,
        })
    }

    /// The tier's directories, engine and direct-I/O mode.
    pub fn facts(&self) -> TierFacts {
        let info = |key: &str| {
            self.info
                .iter()
                .find(|(k, _)| *k == key)
                .map_or_else(String::new, |(_, v)| v.clone())
        };
        let direct_io = match info("kvtier_direct_io").as_str() {
            "direct" => "direct (O_DIRECT)".to_string(),
            other => other.to_string(),
        };
        TierFacts {
            dirs: self.dirs.iter().map(|d| d.path().to_path_buf()).collect(),
            io_engine: info("kvtier_io_engine"),
            direct_io,
            pages: self.pages.clone(),
        }
    }

    /// Shuts the manager (and tier) down; removes the directories unless kept. Returns whether
    /// they were kept.
    pub fn close(mut self) -> Result<bool> {
        self.manager.shutdown()?;
        if self.keep {
            for d in self.dirs {
                let _ = d.keep();
            }
            return Ok(true);
        }
        let records = kvtier::g3::Records::default_location();
        for d in self.dirs {
            let path = d.path().to_path_buf();
            // The tier goes with its directory: so does the record of its filesystem.
            if let Some(r) = &records {
                r.forget(&std::fs::canonicalize(&path).unwrap_or_else(|_| path.clone()));
            }
            d.close()
                .map_err(|e| Error::io("remove the bench tier", &path, e))?;
        }
        Ok(false)
    }
}

/// A `--path` the bench cannot create its directory in (read-only, not permitted, a pseudo
/// file system) is the user's to fix (exit 2); anything else is an I/O failure. `tempfile`
/// wraps the OS error with the path, which hides its errno, so the kind decides.
fn cannot_create_in(parent: &std::path::Path, e: std::io::Error) -> Error {
    use std::io::ErrorKind as Io;
    let users = matches!(
        e.kind(),
        Io::PermissionDenied | Io::ReadOnlyFilesystem | Io::NotFound | Io::NotADirectory
    );
    let message = format!(
        "--path: cannot create a directory in {}: {e}",
        parent.display()
    );
    let kind = if users {
        ErrorKind::InvalidPath
    } else {
        ErrorKind::Io
    };
    Error::new(kind, message).with_source(e)
}
