//! Helpers shared by the G3 integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier::contract::job::{JobResult, RequestContext, TransferJob};
use kvtier::contract::secondary::SecondaryTier;
use kvtier::g3::{G3Tier, G3TierConfig, geometry_namespace};
use kvtier::io::{FaultPlan, FaultyEngine, open_engine};
use kvtier::key::ChunkKey;
use kvtier::region::PrimaryRegion;

pub const STRIDE: usize = 8192;

pub fn region(rows: usize) -> Arc<PrimaryRegion> {
    Arc::new(PrimaryRegion::create(rows, STRIDE as u64).unwrap())
}

pub fn key(i: u64) -> ChunkKey {
    let mut b = vec![0xC3u8; 32];
    b.extend_from_slice(&i.to_le_bytes());
    ChunkKey::new(b)
}

/// Deterministic bytes of chunk `i`.
pub fn pattern(i: u64, len: usize) -> Vec<u8> {
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn fill_row(r: &PrimaryRegion, row: u32, i: u64) {
    // Tests own every row of their region.
    let mut bytes = r.write_row(row as usize).unwrap();
    let want = pattern(i, bytes.len());
    bytes.copy_from_slice(&want);
}

pub fn clear_row(r: &PrimaryRegion, row: u32) {
    // Tests own every row of their region.
    r.write_row(row as usize).unwrap().fill(0);
}

pub fn row_is(r: &PrimaryRegion, row: u32, i: u64) -> bool {
    // Tests own every row of their region; no I/O targets it now.
    let got = r.read_row(row as usize).unwrap();
    got[..] == pattern(i, got.len())[..]
}

pub fn job(id: u64, keys: &[u64], rows: &[u32], load: bool) -> TransferJob {
    TransferJob {
        job_id: id,
        keys: keys.iter().map(|&k| key(k)).collect(),
        chunk_ids: rows.to_vec(),
        is_promotion: load,
        req_id: Arc::from("req"),
        submit_time: Instant::now(),
    }
}

pub fn req() -> RequestContext {
    RequestContext::new("req")
}

pub fn config(dirs: &[&Path], slots: u64) -> G3TierConfig {
    let mut c = G3TierConfig::new(
        dirs.iter()
            .map(|d| d.to_path_buf())
            .collect::<Vec<PathBuf>>(),
        slots * STRIDE as u64,
    );
    c.io_engine = kvtier::io::IoEngineKind::Psync;
    c
}

pub fn open(cfg: G3TierConfig, r: &Arc<PrimaryRegion>) -> G3Tier {
    let t = G3Tier::open(
        cfg,
        r.clone(),
        geometry_namespace(STRIDE as u64),
        "g3-test".into(),
        None,
    )
    .unwrap();
    assert!(t.wait_recovered(Duration::from_secs(30)));
    t
}

/// As [`open`], with an I/O engine that injects the faults of `plan`.
pub fn open_faulty(cfg: G3TierConfig, r: &Arc<PrimaryRegion>, plan: FaultPlan) -> G3Tier {
    let factory: kvtier::g3::EngineFactory = Box::new(move |k, reg, files, opts| {
        FaultyEngine::wrap_handle(open_engine(k, reg, files, opts)?, plan)
    });
    let t = G3Tier::open_with_engine(
        cfg,
        r.clone(),
        geometry_namespace(STRIDE as u64),
        "t".into(),
        None,
        factory,
    )
    .unwrap();
    assert!(t.wait_recovered(Duration::from_secs(30)));
    t
}

/// Polls until `n` results arrived (failing after 30 s).
pub fn results(t: &mut G3Tier, n: usize) -> Vec<JobResult> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut out = Vec::new();
    while out.len() < n {
        out.extend(t.get_finished_jobs());
        assert!(
            Instant::now() < deadline,
            "only {} of {n} results arrived",
            out.len()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(out.len(), n, "more results than jobs: {out:?}");
    out
}

/// Submits one job and waits for its result.
pub fn run(t: &mut G3Tier, j: TransferJob) -> JobResult {
    if j.is_promotion {
        t.submit_load(j);
    } else {
        t.submit_store(j);
    }
    results(t, 1).remove(0)
}

pub fn metric(t: &G3Tier, name: &str) -> f64 {
    t.metrics()
        .iter()
        .filter(|m| m.name == name)
        .map(|m| m.value)
        .sum()
}

pub fn tmpdir() -> tempfile::TempDir {
    tempfile::tempdir_in("/tmp").unwrap()
}

pub fn lookup(t: &mut G3Tier, i: u64) -> kvtier::contract::job::LookupResult {
    t.lookup(&key(i), &req())
}

/// A filesystem mounted for one test; unmounted on drop.
pub struct Mount(PathBuf);

impl Mount {
    /// Mounts a `fstype` filesystem with options `opts` on `dir`, or prints why not and
    /// returns `None` (the caller skips).
    pub fn new(fstype: &str, opts: &str, dir: &Path) -> Option<Mount> {
        let out = std::process::Command::new("mount")
            .args(["-t", fstype, "-o", opts, fstype])
            .arg(dir)
            .output()
            .ok()?;
        if out.status.success() {
            Some(Mount(dir.to_path_buf()))
        } else {
            eprintln!(
                "skipping: cannot mount {fstype} ({})",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            None
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

/// Runs `cmd args`; its stdout, or what failed.
pub fn run_cmd(cmd: &str, args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| format!("{cmd}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    } else {
        Err(format!(
            "{cmd} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Rewrites the superblock of the slab file `slab` with `edit` and gives it a valid CRC again
/// (`docs/format.md`: CRC-32 of bytes 0..4092, u32 LE at 4092), as a kvtier that wrote those
/// values would have.
pub fn rewrite_superblock(slab: &Path, edit: impl FnOnce(&mut [u8])) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(slab)
        .unwrap();
    let mut sb = vec![0u8; 4096];
    f.read_exact_at(&mut sb, 0).unwrap();
    edit(&mut sb);
    let crc = crc32fast::hash(&sb[..4092]);
    sb[4092..].copy_from_slice(&crc.to_le_bytes());
    f.write_all_at(&sb, 0).unwrap();
}

/// An ext4 filesystem in an image file on a loop device, mounted on `mnt` (the mount point
/// itself, the directory an unmount leaves bare); unmounted and detached on drop.
pub struct LoopExt4 {
    image: PathBuf,
    dev: String,
    /// The mount point.
    pub mnt: PathBuf,
}

impl LoopExt4 {
    /// Makes a `mb` MiB ext4 image in `dir` and mounts it on `dir/mnt`, or says why not.
    pub fn new(dir: &Path, mb: u64) -> Result<LoopExt4, String> {
        let image = dir.join("fs.img");
        let f = std::fs::File::create(&image).map_err(|e| e.to_string())?;
        f.set_len(mb << 20).map_err(|e| e.to_string())?;
        let dev = run_cmd("losetup", &["-f", "--show", &image.display().to_string()])?;
        let fs = LoopExt4 {
            image,
            dev,
            mnt: dir.join("mnt"),
        };
        run_cmd("mkfs.ext4", &["-q", "-F", &fs.dev])?;
        std::fs::create_dir_all(&fs.mnt).map_err(|e| e.to_string())?;
        fs.mount()?;
        Ok(fs)
    }

    /// Mounts the filesystem on its mount point.
    pub fn mount(&self) -> Result<(), String> {
        run_cmd("mount", &[&self.dev, &self.mnt.display().to_string()]).map(|_| ())
    }

    /// Detaches it at once (`umount -l`, what a lost or yanked disk looks like to a process
    /// still holding files on it): the mount point is bare, open files keep working.
    pub fn lazy_unmount(&self) -> Result<(), String> {
        run_cmd("umount", &["-l", &self.mnt.display().to_string()]).map(|_| ())
    }

    /// Unmounts it: the mount point is a bare directory of the filesystem below again.
    ///
    /// A tier just dropped can still hold its slabs for a moment: the kernel releases an
    /// io_uring instance's registered files on a work queue after the ring's descriptor is
    /// closed, so `umount` may answer "target is busy" for a few milliseconds. It is tried
    /// again for up to 5 s while that is the answer; any other error is returned at once.
    pub fn unmount(&self) -> Result<(), String> {
        let mnt = self.mnt.display().to_string();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            match run_cmd("umount", &[&mnt]) {
                Ok(_) => return Ok(()),
                Err(e) if e.contains("busy") && std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl Drop for LoopExt4 {
    fn drop(&mut self) {
        let _ = run_cmd("umount", &["-l", &self.mnt.display().to_string()]);
        let _ = run_cmd("losetup", &["-d", &self.dev]);
        let _ = std::fs::remove_file(&self.image);
    }
}
