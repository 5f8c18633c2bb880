//! Several processes sharing one `fs` tier folder, as hosts share a distributed file system:
//! each scenario runs two real processes (this test binary re-run as a small driver, see
//! `fs_child_driver`), each with its own tier on its own path to the folder.
//!
//! * On a local directory (both processes on the same path): every run, everywhere.
//! * On GlusterFS: a two-brick replicated volume mounted twice (`tests/gluster/setup.sh`), one
//!   process per mount. Skipped, with the reason printed, where the mounts are absent. The
//!   mounts come from `KVTIER_GLUSTER_MOUNTS=A:B`, else `/mnt/kvtier-gl-a` and
//!   `/mnt/kvtier-gl-b` when /proc/mounts lists both as `fuse.glusterfs`.
//!
//! Scenarios: one stores, the other loads the same keys with equal bytes; both store the same
//! keys at once; one is killed with SIGKILL mid-store while the other loads, and no load ever
//! returns a partial or wrong chunk; a flipped byte in one file fails that key only.

mod fs_common;

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use fs_common::*;
use kvtier::contract::job::LookupResult;
use kvtier::contract::secondary::SecondaryTier;
use kvtier::fs::FsTier;

const MODE: &str = "KVTIER_FS_CHILD_MODE";
const ROOT: &str = "KVTIER_FS_CHILD_ROOT";
const KEYS: &str = "KVTIER_FS_CHILD_KEYS";
const OUT: &str = "KVTIER_FS_CHILD_OUT";
const ROUNDS: &str = "KVTIER_FS_CHILD_ROUNDS";

/// Keys per job, jobs in flight.
const PER_JOB: u64 = 4;
const WINDOW: usize = 4;

// ---------------------------------------------------------------------------------------
// The driver: one process, one tier.

/// Child mode (run only by the scenarios below, with the `KVTIER_FS_CHILD_*` variables):
/// * `store`: stores keys `a..b` in jobs of 4, appending `stored <k>` / `failed <k>` lines;
/// * `storm`: stores keys `a, a+1, ...` for ever (until killed), appending `stored <k>`;
/// * `load`: for `rounds` rounds, looks every key of `a..b` up (as a scheduler: RETRY until
///   the check ran) and loads the hits in jobs of 4, appending `ok <k>` (bytes equal),
///   `WRONG <k>` (a load that reported success with other bytes), `fail <k> <kind>` or
///   `miss <k>`; then the tier's counts of verified and unverified loads, and `done`.
#[test]
#[ignore = "child process of the fs_shared scenarios"]
fn fs_child_driver() {
    let Some(mode) = std::env::var_os(MODE) else {
        kvtier::skip_test!("{MODE} is not set (this is a child-mode helper)");
        return;
    };
    let root = PathBuf::from(std::env::var_os(ROOT).unwrap());
    let out = PathBuf::from(std::env::var_os(OUT).unwrap());
    let keys = std::env::var(KEYS).unwrap();
    let (a, b) = keys.split_once("..").unwrap();
    let (a, b): (u64, u64) = (a.parse().unwrap(), b.parse().unwrap());
    let rounds: u64 = std::env::var(ROUNDS).map_or(1, |r| r.parse().unwrap());
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&out)
        .unwrap();
    let r = region(PER_JOB as usize * WINDOW);
    let mut cfg = config(&root, 1 << 16);
    cfg.io_threads = 8;
    let mut t = open(cfg, &r);
    match mode.to_str().unwrap() {
        "store" => store_keys(&mut t, &r, a..b, &mut log),
        "storm" => store_keys(&mut t, &r, a..u64::MAX, &mut log),
        "load" => {
            for round in 0..rounds {
                load_keys(&mut t, &r, a..b, round, &mut log);
            }
            // Loads whose CRC record (written by whichever process stored the file) matched.
            for name in ["fs_files_loaded_verified", "fs_files_loaded_unverified"] {
                writeln!(log, "{name} {}", metric(&t, name)).unwrap();
            }
            writeln!(log, "done").unwrap();
        }
        other => panic!("unknown child mode {other}"),
    }
    t.shutdown().unwrap();
}

fn store_keys(
    t: &mut FsTier,
    r: &kvtier::region::PrimaryRegion,
    keys: std::ops::Range<u64>,
    log: &mut std::fs::File,
) {
    let mut next = keys.start;
    let mut free: Vec<usize> = (0..WINDOW).collect();
    let mut in_flight: HashMap<u64, (usize, Vec<u64>)> = HashMap::new();
    let mut job_id = 0;
    while next < keys.end || !in_flight.is_empty() {
        while next < keys.end
            && let Some(slot) = free.pop()
        {
            let ks: Vec<u64> = (next..(next + PER_JOB).min(keys.end)).collect();
            next += ks.len() as u64;
            let rows: Vec<u32> = (0..ks.len() as u32)
                .map(|i| slot as u32 * PER_JOB as u32 + i)
                .collect();
            for (k, row) in ks.iter().zip(&rows) {
                fill_row(r, *row, *k);
            }
            job_id += 1;
            t.submit_store(job(job_id, &ks, &rows, false));
            in_flight.insert(job_id, (slot, ks));
        }
        for res in t.get_finished_jobs() {
            let (slot, ks) = in_flight.remove(&res.job_id).unwrap();
            let word = if res.success { "stored" } else { "failed" };
            for k in ks {
                writeln!(log, "{word} {k}").unwrap();
            }
            free.push(slot);
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn load_keys(
    t: &mut FsTier,
    r: &kvtier::region::PrimaryRegion,
    keys: std::ops::Range<u64>,
    round: u64,
    log: &mut std::fs::File,
) {
    let rq = req(&format!("load-{round}"));
    let mut hits = Vec::new();
    for k in keys.clone() {
        match resolve(t, k, &rq) {
            LookupResult::Hit => hits.push(k),
            _ => writeln!(log, "miss {k}").unwrap(),
        }
    }
    t.on_request_finished(&rq);
    for (n, chunk) in hits.chunks(PER_JOB as usize).enumerate() {
        let rows: Vec<u32> = (0..chunk.len() as u32).collect();
        for row in &rows {
            clear_row(r, *row);
        }
        let id = (round << 32) | n as u64;
        t.submit_load(job(id, chunk, &rows, true));
        let res = wait_job(t, id);
        for (k, row) in chunk.iter().zip(&rows) {
            let loaded = res.success
                || res
                    .successful_keys
                    .as_ref()
                    .is_some_and(|ok| ok.contains(&key(*k)));
            if !loaded {
                let kind = res.error.as_ref().map_or("?", |e| e.kind().as_str());
                writeln!(log, "fail {k} {kind}").unwrap();
            } else if row_is(r, *row, *k) {
                writeln!(log, "ok {k}").unwrap();
            } else {
                writeln!(log, "WRONG {k}").unwrap();
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The parent side.

fn child(mode: &str, root: &Path, keys: std::ops::Range<u64>, out: &Path, rounds: u64) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "fs_child_driver",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(MODE, mode)
        .env(ROOT, root)
        .env(KEYS, format!("{}..{}", keys.start, keys.end))
        .env(OUT, out)
        .env(ROUNDS, rounds.to_string())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

fn finish(mut c: Child, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(status) = c.try_wait().unwrap() {
            assert!(status.success(), "{what} child failed: {status}");
            return;
        }
        if Instant::now() > deadline {
            let _ = c.kill();
            panic!("{what} child did not finish within 120 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The report lines of a child: word -> keys.
fn report(out: &Path) -> HashMap<String, Vec<u64>> {
    let mut m: HashMap<String, Vec<u64>> = HashMap::new();
    for line in std::fs::read_to_string(out).unwrap_or_default().lines() {
        let mut parts = line.split_whitespace();
        let word = parts.next().unwrap_or("").to_string();
        if let Some(k) = parts.next().and_then(|k| k.parse().ok()) {
            m.entry(word).or_default().push(k);
        } else {
            m.entry(word).or_default();
        }
    }
    m
}

fn count(m: &HashMap<String, Vec<u64>>, word: &str) -> usize {
    m.get(word).map_or(0, Vec::len)
}

/// Every chunk file under the folder is a complete row with the bytes of its key: no partial
/// file ever has a final name. Returns (files, temporary files).
fn check_files(root: &Path, universe: std::ops::Range<u64>) -> (usize, usize) {
    let m = kvtier::fs::FileMapper::new(root, fields()).unwrap();
    let by_key: HashMap<kvtier::ChunkKey, u64> = universe.map(|i| (key(i), i)).collect();
    let (mut files, mut temps) = (0, 0);
    for rel in files_under(m.data_dir()) {
        if rel.ends_with(".tmp") {
            temps += 1;
            continue;
        }
        let k = kvtier::fs::FileMapper::key_of(Path::new(&rel))
            .unwrap_or_else(|| panic!("unexpected file {rel}"));
        let i = by_key[&k];
        let bytes = std::fs::read(m.data_dir().join(&rel)).unwrap();
        assert_eq!(bytes.len(), STRIDE, "{rel}: partial chunk file");
        assert!(
            bytes == pattern(i, STRIDE),
            "{rel}: wrong bytes for key {i}"
        );
        files += 1;
    }
    (files, temps)
}

/// Two paths to one folder, and a place for the children's reports.
struct Roots {
    a: PathBuf,
    b: PathBuf,
    reports: tempfile::TempDir,
    /// Removed at the end (the GlusterFS sub-folder; a local one is a TempDir).
    cleanup: Option<PathBuf>,
    _local: Option<tempfile::TempDir>,
}

impl Drop for Roots {
    fn drop(&mut self) {
        if let Some(p) = &self.cleanup {
            let _ = std::fs::remove_dir_all(p);
        }
    }
}

impl Roots {
    fn local() -> Roots {
        let d = tempfile::tempdir_in("/tmp").unwrap();
        Roots {
            a: d.path().to_path_buf(),
            b: d.path().to_path_buf(),
            reports: tempfile::tempdir_in("/tmp").unwrap(),
            cleanup: None,
            _local: Some(d),
        }
    }

    /// A fresh sub-folder of the volume, seen through both mounts; `None` (with the reason
    /// printed) where GlusterFS is not mounted.
    fn gluster(scenario: &str) -> Option<Roots> {
        let (ma, mb) = match gluster_mounts() {
            Ok(m) => m,
            Err(why) => {
                kvtier::skip_test!("GlusterFS scenario {scenario} skipped: {why}");
                return None;
            }
        };
        let sub = format!(
            "kvtier-test-{}-{scenario}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        );
        std::fs::create_dir(ma.join(&sub)).unwrap();
        // The other mount sees the folder at once (a replicated volume, no client caching
        // of a new entry beyond the FUSE attribute timeout).
        let deadline = Instant::now() + Duration::from_secs(10);
        while !mb.join(&sub).is_dir() {
            assert!(
                Instant::now() < deadline,
                "{sub} never appeared on {}",
                mb.display()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Some(Roots {
            a: ma.join(&sub),
            b: mb.join(&sub),
            reports: tempfile::tempdir_in("/tmp").unwrap(),
            cleanup: Some(ma.join(&sub)),
            _local: None,
        })
    }

    fn out(&self, name: &str) -> PathBuf {
        self.reports.path().join(name)
    }
}

/// The two GlusterFS mount points, or why there are none.
fn gluster_mounts() -> Result<(PathBuf, PathBuf), String> {
    let mounts = std::fs::read_to_string("/proc/mounts").map_err(|e| e.to_string())?;
    let is_gluster = |p: &Path| {
        mounts.lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 2 && Path::new(f[1]) == p && f[2] == "fuse.glusterfs"
        })
    };
    let named = std::env::var("KVTIER_GLUSTER_MOUNTS").ok();
    let (a, b) = match &named {
        Some(v) => {
            let (a, b) = v
                .split_once(':')
                .ok_or("KVTIER_GLUSTER_MOUNTS must be A:B")?;
            (PathBuf::from(a), PathBuf::from(b))
        }
        None => (
            PathBuf::from("/mnt/kvtier-gl-a"),
            PathBuf::from("/mnt/kvtier-gl-b"),
        ),
    };
    for p in [&a, &b] {
        if !is_gluster(p) {
            return Err(format!(
                "{} is not a GlusterFS mount (run tests/gluster/setup.sh as root, or set \
                 KVTIER_GLUSTER_MOUNTS=A:B)",
                p.display()
            ));
        }
        // A mount whose client died (a killed earlier run) stays listed and answers
        // ENOTCONN: found by looking, it is no volume to test (setup.sh mounts it again);
        // named in KVTIER_GLUSTER_MOUNTS (setup.sh just checked it), it is a failure.
        let free = match rustix::fs::statvfs(p.as_path()) {
            Ok(st) => st.f_bavail.saturating_mul(st.f_frsize),
            Err(e) if named.is_none() => {
                return Err(format!(
                    "{} is listed as a GlusterFS mount but does not answer ({e}); run \
                     tests/gluster/setup.sh to mount it again",
                    p.display()
                ));
            }
            Err(e) => panic!("KVTIER_GLUSTER_MOUNTS names {}: {e}", p.display()),
        };
        if free < GLUSTER_MIN_FREE {
            return Err(format!(
                "{} has {} MiB free, the scenarios need {} MiB",
                p.display(),
                free >> 20,
                GLUSTER_MIN_FREE >> 20
            ));
        }
    }
    Ok((a, b))
}

/// Free bytes the GlusterFS scenarios need on the volume (each writes a few MiB, twice with
/// the replica).
const GLUSTER_MIN_FREE: u64 = 32 << 20;

// ---------------------------------------------------------------------------------------
// The scenarios.

/// One process stores 64 keys through path A; another loads them through path B: every
/// byte equal.
fn one_stores_the_other_loads(roots: &Roots) {
    let (s, l) = (roots.out("store"), roots.out("load"));
    finish(child("store", &roots.a, 0..64, &s, 1), "store");
    assert_eq!(count(&report(&s), "stored"), 64, "{:?}", report(&s));
    finish(child("load", &roots.b, 0..64, &l, 1), "load");
    let rep = report(&l);
    assert_eq!(count(&rep, "ok"), 64, "{rep:?}");
    assert_eq!(count(&rep, "WRONG"), 0);
    // Every load checked the CRC record the other process set through its own path.
    assert_eq!(
        rep.get("fs_files_loaded_verified"),
        Some(&vec![64]),
        "{rep:?}"
    );
    assert_eq!(
        rep.get("fs_files_loaded_unverified"),
        Some(&vec![0]),
        "{rep:?}"
    );
    assert_eq!(check_files(&roots.a, 0..64), (64, 0));
}

/// Both processes store the same 64 keys at the same time: both succeed, each file is
/// published once with the right bytes, no temporary file is left.
fn both_store_the_same_keys_at_once(roots: &Roots) {
    let (s1, s2, l) = (roots.out("s1"), roots.out("s2"), roots.out("load"));
    let c1 = child("store", &roots.a, 0..64, &s1, 1);
    let c2 = child("store", &roots.b, 0..64, &s2, 1);
    finish(c1, "store A");
    finish(c2, "store B");
    for s in [&s1, &s2] {
        let rep = report(s);
        assert_eq!(count(&rep, "stored"), 64, "{rep:?}");
    }
    assert_eq!(check_files(&roots.a, 0..64), (64, 0));
    finish(child("load", &roots.b, 0..64, &l, 1), "load");
    assert_eq!(count(&report(&l), "ok"), 64, "{:?}", report(&l));
}

/// One process stores new keys without pause; the other loads the first keys over and over;
/// the storing one is killed with SIGKILL in the middle. No load ever returns wrong or
/// partial bytes, no partial file has a final name, every key the killed process reported
/// stored loads, and a restart removes its leftover temporary files.
fn sigkill_mid_store_never_exposes_a_partial_chunk(roots: &Roots) {
    let (s, l, v) = (roots.out("storm"), roots.out("load"), roots.out("verify"));
    let mut storm = child("storm", &roots.a, 0..0, &s, 1);
    let deadline = Instant::now() + Duration::from_secs(60);
    while count(&report(&s), "stored") < 48 {
        assert!(
            storm.try_wait().unwrap().is_none(),
            "the storm child exited"
        );
        assert!(
            Instant::now() < deadline,
            "the storm child made too little progress"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // The loader races the storm (its keys are being written as it looks them up).
    let loader = child("load", &roots.b, 0..96, &l, 3);
    std::thread::sleep(Duration::from_millis(150));
    storm.kill().unwrap(); // SIGKILL
    storm.wait().unwrap();
    finish(loader, "load");
    let stored = report(&s).remove("stored").unwrap_or_default();
    let top = stored.iter().max().copied().unwrap_or(0) + PER_JOB * WINDOW as u64 + 1;
    let rep = report(&l);
    assert_eq!(
        count(&rep, "WRONG"),
        0,
        "a load returned wrong bytes: {rep:?}"
    );
    assert!(
        rep.contains_key("done"),
        "the loader did not finish: {rep:?}"
    );
    // On disk: every final name holds a complete, correct chunk.
    let (files, temps) = check_files(&roots.a, 0..top);
    assert!(
        files >= stored.len(),
        "{files} files, {} reported",
        stored.len()
    );
    // Everything the killed process reported loads, with its bytes.
    let max = stored.iter().max().copied().unwrap_or(0) + 1;
    finish(child("load", &roots.b, 0..max, &v, 1), "verify");
    let rep = report(&v);
    assert_eq!(count(&rep, "WRONG"), 0, "{rep:?}");
    for k in &stored {
        assert!(
            rep.get("ok").is_some_and(|ok| ok.contains(k)),
            "reported key {k} did not load: {rep:?}"
        );
    }
    // A restart with a short stale age removes the temporary files the kill left behind.
    let r = region(1);
    let mut cfg = config(&roots.b, 1 << 16);
    cfg.stale_temp_age = Duration::from_secs(1);
    if temps > 0 {
        std::thread::sleep(Duration::from_millis(1100));
    }
    let t = open(cfg, &r);
    assert!(t.wait_scanned(Duration::from_secs(60)));
    let (_, temps_after) = check_files(&roots.a, 0..top);
    eprintln!(
        "sigkill scenario: {} keys reported stored, {files} chunk files, {temps} temporary \
         files left by the kill, {temps_after} after a restart",
        stored.len()
    );
    assert_eq!(temps_after, 0);
}

/// A byte flipped in one stored file (through path A) fails that key only when the other
/// process loads through path B.
fn a_flipped_byte_fails_that_key_only(roots: &Roots) {
    let (s, l) = (roots.out("store"), roots.out("load"));
    finish(child("store", &roots.a, 0..16, &s, 1), "store");
    let m = kvtier::fs::FileMapper::new(&roots.a, fields()).unwrap();
    let p = m.file_path(&key(5)).unwrap();
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[1234] ^= 0x01;
    std::fs::write(&p, &bytes).unwrap();
    finish(child("load", &roots.b, 0..16, &l, 1), "load");
    let rep = report(&l);
    assert_eq!(count(&rep, "WRONG"), 0, "{rep:?}");
    assert_eq!(
        rep.get("fail").cloned().unwrap_or_default(),
        vec![5],
        "{rep:?}"
    );
    // Failed by the CRC record the storing process wrote, read through the other path.
    let text = std::fs::read_to_string(&l).unwrap();
    assert!(text.contains("fail 5 checksum"), "{text}");
    assert_eq!(count(&rep, "ok"), 15, "{rep:?}");
}

macro_rules! scenarios {
    ($($name:ident),* $(,)?) => {
        mod local {
            $(
                #[test]
                fn $name() {
                    super::$name(&super::Roots::local());
                }
            )*
        }
        mod gluster {
            $(
                #[test]
                fn $name() {
                    if let Some(roots) = super::Roots::gluster(stringify!($name)) {
                        super::$name(&roots);
                    }
                }
            )*
        }
    };
}

scenarios!(
    one_stores_the_other_loads,
    both_store_the_same_keys_at_once,
    sigkill_mid_store_never_exposes_a_partial_chunk,
    a_flipped_byte_fails_that_key_only,
);
