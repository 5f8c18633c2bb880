//! The stack `kvtier bench` runs on: a primary region and tier, one G3 tier on fresh
//! directories (or, with `--tier fs`, one fs tier in a fresh directory), and the tiering
//! manager over them (no back-pressure: the bench must store every chunk it later verifies).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::config::EvictionPolicyKind;
use crate::contract::secondary::SecondaryTier;
use crate::error::{Error, ErrorKind, Result};
use crate::fs::{FsTier, FsTierConfig};
use crate::g3::{FsyncPolicy, G3Tier, G3TierConfig};
use crate::io::IoEngineKind;
use crate::primary::PrimaryTier;
use crate::region::PrimaryRegion;
use crate::tiering::manager::{ManagerOptions, TierSpec, TieringManager};

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
    /// Keep the directories when done.
    pub keep: bool,
    /// `Some`: an fs tier (in the first directory) named by these vLLM FileMapper fields,
    /// instead of a G3 tier.
    pub fs_fields: Option<serde_json::Value>,
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
}

/// The running stack. [`BenchTier::close`] shuts it down and removes the directories unless
/// they are kept.
pub struct BenchTier {
    /// The manager the bench drives.
    pub manager: TieringManager,
    dirs: Vec<tempfile::TempDir>,
    engine: String,
    /// Whether each tier directory uses O_DIRECT.
    direct: Vec<bool>,
    keep: bool,
}

impl BenchTier {
    /// Makes the directories, opens the G3 tier there and builds the manager.
    pub fn open(opts: &TierOptions) -> Result<Self> {
        let parents = crate::cli::args::path_dirs(&opts.parent_dirs)?;
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
        let row = usize::try_from(opts.row_stride)
            .map_err(|_| Error::config("--layout", "row stride too large"))?;
        let region = Arc::new(PrimaryRegion::create(rows, row)?);
        let (tier, engine, direct): (Box<dyn SecondaryTier>, String, Vec<bool>) =
            match &opts.fs_fields {
                Some(fields) => {
                    let mut cfg = FsTierConfig::new(dirs[0].path(), opts.capacity);
                    cfg.max_bytes_in_flight = Some(opts.max_bytes_in_flight);
                    cfg.io_engine = opts.io_engine;
                    let tier = FsTier::open(
                        cfg,
                        region.clone(),
                        fields.clone(),
                        opts.namespace,
                        "1:fs".to_string(),
                        None,
                    )?;
                    let (engine, direct) = (tier.info().engine.clone(), tier.info().direct_io);
                    (Box::new(tier), engine, vec![direct])
                }
                None => {
                    let tier = Self::open_g3(opts, &dirs, region.clone())?;
                    let info = tier.info().clone();
                    (Box::new(tier), info.engine, info.direct_io)
                }
            };
        let primary = PrimaryTier::new(region, EvictionPolicyKind::Lru, false);
        let manager = TieringManager::with_tiers(
            primary,
            vec![TierSpec {
                tier,
                backpressure: None,
            }],
            ManagerOptions::default(),
        )?;
        Ok(BenchTier {
            manager,
            dirs,
            engine,
            direct,
            keep: opts.keep,
        })
    }

    fn open_g3(
        opts: &TierOptions,
        dirs: &[tempfile::TempDir],
        region: Arc<PrimaryRegion>,
    ) -> Result<G3Tier> {
        let mut cfg = G3TierConfig::new(
            dirs.iter().map(|d| d.path().to_path_buf()).collect(),
            opts.capacity,
        );
        cfg.max_bytes_in_flight = Some(opts.max_bytes_in_flight);
        cfg.io_engine = opts.io_engine;
        cfg.idle.linger = opts.idle_linger;
        // Stores are reported once their data and index records are durable (the default).
        cfg.fsync = FsyncPolicy::Always;
        let tier = G3Tier::open(cfg, region, opts.namespace, "1:nvme".to_string(), None)?;
        if !tier.wait_recovered(Duration::from_secs(60)) {
            return Err(Error::new(
                ErrorKind::Internal,
                "the fresh G3 tier did not finish opening its index within 60 s",
            ));
        }
        Ok(tier)
    }

    /// The tier's directories, engine and direct-I/O mode.
    pub fn facts(&self) -> TierFacts {
        let direct = self.direct.iter().filter(|d| **d).count();
        let direct_io = if direct == self.direct.len() {
            "direct (O_DIRECT)"
        } else if direct == 0 {
            "buffered"
        } else {
            "mixed"
        };
        TierFacts {
            dirs: self.dirs.iter().map(|d| d.path().to_path_buf()).collect(),
            io_engine: self.engine.clone(),
            direct_io: direct_io.to_string(),
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
        for d in self.dirs {
            let path = d.path().to_path_buf();
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
