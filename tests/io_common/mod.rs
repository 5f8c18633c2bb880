//! Shared helpers for the I/O engine tests: fixtures under /tmp, row patterns, completion
//! collection with a deadline (a lost completion fails the test instead of hanging it).

#![allow(dead_code)]

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvtier::Result;
use kvtier::io::{
    EngineInfo, EngineOptions, FaultPlan, FaultyEngine, IoEngine, IoEngineKind, open_engine,
};
use kvtier::region::PrimaryRegion;

/// Which engine a test runs against.
#[derive(Debug, Clone)]
pub enum Engine {
    /// pread/pwrite pool.
    Psync,
    /// io_uring.
    Uring,
    /// The fault injector around another engine.
    Faulty(Box<Engine>, Box<FaultPlan>),
}

impl Engine {
    /// `inner` wrapped in a fault injector with an empty plan.
    pub fn faulty(inner: Engine) -> Engine {
        Engine::Faulty(Box::new(inner), Box::default())
    }

    /// The same engine with `plan` (only for `Faulty`).
    pub fn with_plan(self, plan: FaultPlan) -> Engine {
        match self {
            Engine::Faulty(inner, _) => Engine::Faulty(inner, Box::new(plan)),
            other => other,
        }
    }
}

/// A region, one O_DIRECT file under /tmp and an engine over them.
pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub path: PathBuf,
    pub region: Arc<PrimaryRegion>,
    pub engine: Arc<dyn IoEngine>,
    pub info: EngineInfo,
    /// The fault injector, when the engine is one.
    pub faults: Option<Arc<FaultyEngine>>,
}

/// Opens `path` read-write with O_DIRECT, creating it.
pub fn open_direct(path: &std::path::Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap_or_else(|e| panic!("open {} with O_DIRECT: {e}", path.display()))
}

impl Fixture {
    /// `rows` rows of `stride` bytes; the O_DIRECT file starts `file_len` bytes long (zeros).
    /// `None` (with the reason printed) when the engine cannot run here.
    pub fn new(
        engine: Engine,
        rows: usize,
        stride: usize,
        file_len: u64,
        queue_depth: u32,
    ) -> Option<Fixture> {
        Fixture::build(engine, rows, stride, file_len, queue_depth, true)
    }

    /// As [`Fixture::new`], with the file opened with or without O_DIRECT.
    pub fn build(
        engine: Engine,
        rows: usize,
        stride: usize,
        file_len: u64,
        queue_depth: u32,
        o_direct: bool,
    ) -> Option<Fixture> {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let path = dir.path().join("slab");
        let file = if o_direct {
            open_direct(&path)
        } else {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .unwrap()
        };
        file.set_len(file_len).unwrap();
        let region = Arc::new(PrimaryRegion::create(rows, stride as u64).unwrap());
        let opts = EngineOptions {
            queue_depth,
            psync_threads: 3,
            o_direct,
        };
        let (base, plan) = match &engine {
            Engine::Faulty(inner, plan) => (inner.as_ref().clone(), Some(plan.as_ref().clone())),
            other => (other.clone(), None),
        };
        let kind = match base {
            Engine::Psync => IoEngineKind::Psync,
            Engine::Uring => IoEngineKind::Uring,
            Engine::Faulty(..) => panic!("nested fault injectors are not supported here"),
        };
        let handle = match open_engine(kind, region.clone(), vec![file], &opts) {
            Ok(h) => h,
            Err(e) if e.kind() == kvtier::ErrorKind::Unsupported => {
                kvtier::skip_test!("{engine:?} engine unavailable here: {e}");
                return None;
            }
            Err(e) => panic!("open_engine({engine:?}): {e}"),
        };
        let (engine, faults): (Arc<dyn IoEngine>, _) = match plan {
            Some(plan) => {
                let f = Arc::new(FaultyEngine::new(handle.engine, plan).unwrap());
                (f.clone(), Some(f))
            }
            None => (handle.engine, None),
        };
        Some(Fixture {
            dir,
            path,
            region,
            engine,
            info: handle.info,
            faults,
        })
    }
}

/// Fills `row` with a pattern derived from `seed` (distinct per row and per position).
pub fn fill_row(region: &PrimaryRegion, row: usize, seed: u64) {
    // Tests own the region; no transfer touches this row right now.
    let mut bytes = region.write_row(row).unwrap();
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = (seed.wrapping_mul(31).wrapping_add(i as u64 * 7) % 251) as u8;
    }
}

/// A copy of `row`.
pub fn row_bytes(region: &PrimaryRegion, row: usize) -> Vec<u8> {
    // Tests own the region; no transfer touches this row right now.
    region.read_row(row).unwrap().to_vec()
}

/// Waits for `n` completions (30 s each at most) and returns them by tag; a tag seen twice or
/// a missing completion fails the test.
pub fn collect(engine: &dyn IoEngine, n: usize) -> HashMap<u64, Result<usize>> {
    let mut out = HashMap::new();
    for _ in 0..n {
        let c = engine
            .completions()
            .recv_timeout(Duration::from_secs(30))
            .expect("a completion did not arrive within 30 s");
        assert!(
            out.insert(c.tag, c.result).is_none(),
            "tag {} completed twice",
            c.tag
        );
    }
    out
}

/// The region file behind `region` (a vLLM-shaped region in the owner's mapping), opened
/// through this process's descriptor of it.
pub fn region_file_of(region: &kvtier::region::PrimaryRegion) -> std::fs::File {
    let base = region.base_ptr() as usize;
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let inode: u64 = maps
        .lines()
        .find_map(|l| {
            let (range, rest) = l.split_once(' ')?;
            let (s, e) = range.split_once('-')?;
            let (s, e) = (
                usize::from_str_radix(s, 16).ok()?,
                usize::from_str_radix(e, 16).ok()?,
            );
            (s <= base && base < e).then(|| rest.split_whitespace().nth(3)?.parse().ok())?
        })
        .unwrap();
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        if std::fs::metadata(entry.path()).is_ok_and(|m| m.ino() == inode && m.nlink() == 0) {
            return std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(entry.path())
                .unwrap();
        }
    }
    panic!("no descriptor of the region file (inode {inode})");
}
