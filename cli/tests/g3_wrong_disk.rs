//! The wrong disk (issue 28 item 7): a tier whose path is a mount point remembers the
//! filesystem it was created on; with that filesystem unmounted (the mount point a bare
//! directory of the root disk again) a restart refuses, naming the path and both filesystems,
//! or runs degraded where its entry says so, and never creates a slab there. Real ext4 on a
//! loop device, unmounted between two runs; skipped with the reason where that cannot be
//! made. Covers every way a tier is created: `Builder` (the Python package's way in),
//! `kvtier serve`, `kvtier tier format` and `repair`.

mod cli_common;
#[path = "../../tests/g3_common/mod.rs"]
mod g3_common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cli_common::{assert_success, get, kvtier, send_signal, start_serve, stderr};
use g3_common::{LoopExt4, STRIDE, fill_row, key, pattern, region, tmpdir};
use kvtier::Builder;
use kvtier::contract::job::{LookupResult, RequestContext, TransferJob};
use kvtier::contract::secondary::{HealthState, SecondaryTier};
use kvtier::error::ErrorKind;
use kvtier::g3::fs_record::{FsIdentity, Records, state_dir};
use kvtier::region::PrimaryRegion;

/// A loop ext4 mounted in a fresh temp dir, or `None` with the reason printed.
fn loop_fs() -> Option<(tempfile::TempDir, LoopExt4)> {
    if state_dir().is_none() {
        kvtier::skip_test!("no state directory for kvtier's records (no KVTIER_STATE_DIR, HOME)");
        return None;
    }
    let d = tmpdir();
    match LoopExt4::new(d.path(), 32) {
        Ok(fs) => Some((d, fs)),
        Err(e) => {
            kvtier::skip_test!("no loop device with ext4 here: {e}");
            None
        }
    }
}

/// vLLM's entry for the Python tier (`type = KvtierTier`) on `path`, plus `extra` keys.
fn entry(path: &Path, extra: serde_json::Value) -> String {
    let mut tier = serde_json::json!({
        "type": "KvtierTier", "module_path": "kvtier.vllm", "paths": [path],
        "capacity_bytes": "64KiB", "direct_io": "auto", "io_engine": "psync",
    });
    for (k, v) in extra.as_object().unwrap() {
        tier[k] = v.clone();
    }
    serde_json::json!({"cpu_bytes_to_use": 4 * STRIDE, "secondary_tiers": [tier]}).to_string()
}

/// What the Python package does (`KvtierTier.__init__`): `Builder::for_tier`-style build of
/// the one entry over the given region.
fn build(json: &str, r: &Arc<PrimaryRegion>) -> kvtier::Result<Box<dyn SecondaryTier>> {
    Builder::from_json(json)?
        .region(r.clone())
        .namespace([7; 32])
        .build_tier(0)
}

fn wait_ready(t: &dyn SecondaryTier) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !t.ready() {
        assert!(Instant::now() < deadline, "the tier did not recover");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn job(id: u64, k: u64, load: bool) -> TransferJob {
    g3_common::job(id, &[k], &[0], load)
}

/// Runs one job to its result.
fn run(t: &mut dyn SecondaryTier, j: TransferJob) -> kvtier::contract::job::JobResult {
    let id = j.job_id;
    if j.is_promotion {
        t.submit_load(j);
    } else {
        t.submit_store(j);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(r) = t.get_finished_jobs().into_iter().find(|r| r.job_id == id) {
            return r;
        }
        assert!(Instant::now() < deadline, "job {id} never finished");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

fn metric(t: &dyn SecondaryTier, name: &str, path: &str) -> Option<f64> {
    t.metrics()
        .into_iter()
        .find(|m| m.name == name && m.labels.iter().any(|(k, v)| *k == "path" && v == path))
        .map(|m| m.value)
}

/// The Builder (the Python package's way in): a tier created on the mounted filesystem is
/// refused once that filesystem is unmounted, naming the path and both filesystems; with
/// `on_wrong_filesystem = "degraded"` the entry runs without it (health and metric say so);
/// `tier format` and `repair` refuse the bare directory too; nothing is created there; after
/// the remount every chunk is found.
#[test]
fn an_unmounted_tier_filesystem_is_refused_not_replaced() {
    let Some((_d, fs)) = loop_fs() else { return };
    let mnt = fs.mnt.canonicalize().unwrap();
    let on_loop = FsIdentity::of(&mnt).unwrap();
    let r = region(2);
    let mut t = build(&entry(&mnt, serde_json::json!({})), &r).unwrap();
    wait_ready(t.as_ref());
    fill_row(&r, 0, 5);
    assert!(run(t.as_mut(), job(1, 5, false)).success);
    t.shutdown().unwrap();
    drop(t);
    let record = Records::default_location().unwrap().file_of(&mnt);
    assert!(
        record.exists(),
        "no record of {} at {}",
        mnt.display(),
        record.display()
    );

    fs.unmount().unwrap();
    assert!(
        entries(&mnt).is_empty(),
        "the bare mount point is not empty"
    );
    let below = FsIdentity::of(&mnt).unwrap();
    assert!(!below.same_filesystem(&on_loop), "{below:?} vs {on_loop:?}");

    let e = build(&entry(&mnt, serde_json::json!({})), &r)
        .err()
        .expect("a tier on the filesystem below was opened");
    let m = e.to_string();
    assert_eq!(e.kind(), ErrorKind::InvalidPath, "{m}");
    assert!(m.contains(&mnt.display().to_string()), "{m}");
    assert!(
        m.contains(&on_loop.describe()) && m.contains(&below.describe()),
        "both filesystems must be named: {m}"
    );
    assert!(m.contains("Mount it"), "{m}");
    assert!(
        entries(&mnt).is_empty(),
        "created {:?} on the wrong disk",
        entries(&mnt)
    );

    // Degraded where the entry allows it: serves nothing, says so, writes nothing.
    let degraded = entry(&mnt, serde_json::json!({"on_wrong_filesystem": "degraded"}));
    let mut t = build(&degraded, &r).unwrap();
    assert!(t.ready());
    let req = RequestContext::new("r");
    assert_eq!(t.lookup(&key(5), &req), LookupResult::Miss);
    let h = t.health();
    assert_eq!(h.state, HealthState::Degraded, "{h:?}");
    assert!(
        h.problems
            .iter()
            .any(|p| p.contains(&mnt.display().to_string())),
        "{h:?}"
    );
    assert_eq!(metric(t.as_ref(), "g3_wrong_filesystem", "0"), Some(1.0));
    assert_eq!(metric(t.as_ref(), "g3_path_healthy", "0"), Some(0.0));
    let res = run(t.as_mut(), job(2, 6, false));
    assert!(
        !res.success,
        "a store reported success with no slab: {res:?}"
    );
    t.shutdown().unwrap();
    drop(t);
    assert!(
        entries(&mnt).is_empty(),
        "created {:?} on the wrong disk",
        entries(&mnt)
    );

    // The admin commands that create slabs refuse the bare directory as well.
    let m = kvtier(&[
        "tier",
        "format",
        mnt.to_str().unwrap(),
        "--capacity",
        "16MiB",
        "--yes",
    ]);
    assert_eq!(m.status.code(), Some(2), "{}", stderr(&m));
    assert!(stderr(&m).contains("--new-filesystem"), "{}", stderr(&m));
    let m = kvtier(&["tier", "repair", mnt.to_str().unwrap(), "--yes"]);
    assert_ne!(m.status.code(), Some(0), "{}", stderr(&m));
    assert!(
        entries(&mnt).is_empty(),
        "created {:?} on the wrong disk",
        entries(&mnt)
    );

    // Mounted again: the tier and its chunk are there.
    fs.mount().unwrap();
    let mut t = build(&entry(&mnt, serde_json::json!({})), &r).unwrap();
    wait_ready(t.as_ref());
    assert_eq!(t.lookup(&key(5), &req), LookupResult::Hit);
    g3_common::clear_row(&r, 1);
    let mut j = g3_common::job(3, &[5], &[1], true);
    j.is_promotion = true;
    assert!(run(t.as_mut(), j).success);
    // The test owns every row of its region; no I/O targets row 1 now.
    let row = r.read_row(1).unwrap();
    assert_eq!(row[..], pattern(5, r.row_stride() as usize)[..]);
    assert_eq!(t.health().state, HealthState::Ok);
    t.shutdown().unwrap();
}

/// A disk replaced on purpose: `kvtier tier format --new-filesystem` creates the tier on the
/// filesystem now at the path and records it, after which it opens there.
#[test]
fn format_new_filesystem_moves_the_record() {
    let Some((_d, fs)) = loop_fs() else { return };
    let mnt = fs.mnt.canonicalize().unwrap();
    let p = mnt.to_str().unwrap();
    let format = |extra: &[&str]| {
        let mut args = vec!["tier", "format", p, "--capacity", "16MiB", "--yes"];
        args.extend_from_slice(extra);
        kvtier(&args)
    };
    assert_success(&format(&[]));
    fs.unmount().unwrap();
    let refused = format(&[]);
    assert_eq!(refused.status.code(), Some(2), "{}", stderr(&refused));
    assert!(entries(&mnt).is_empty());
    assert_success(&format(&["--new-filesystem"]));
    assert!(mnt.join("kvtier-g3.slab").exists());
    // From now on the directory below is the tier's filesystem: formats need no flag.
    assert_success(&format(&[]));
    for f in entries(&mnt) {
        std::fs::remove_file(mnt.join(f)).unwrap();
    }
}

/// A `kvtier serve` child, killed if the test ends (or fails) while it runs.
struct Serving(std::process::Child);

impl Serving {
    /// Waits for the child (killed already, or exited) and reads what it printed.
    fn wait_with_output_ref(&mut self) -> std::process::Output {
        use std::io::Read;
        let status = self.0.wait().unwrap();
        let mut stdout = Vec::new();
        let mut stderr = Vec::new();
        if let Some(mut o) = self.0.stdout.take() {
            o.read_to_end(&mut stdout).unwrap();
        }
        if let Some(mut e) = self.0.stderr.take() {
            e.read_to_end(&mut stderr).unwrap();
        }
        std::process::Output {
            status,
            stdout,
            stderr,
        }
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// `kvtier serve`: creates the tier on the mounted filesystem; after an unmount it exits 2
/// naming the path and both filesystems and creates nothing; a config with
/// `on_wrong_filesystem = "degraded"` serves, `/healthz` says degraded and `/metrics` has
/// `g3_wrong_filesystem 1`.
#[test]
fn serve_refuses_an_unmounted_tier_filesystem() {
    let Some((d, fs)) = loop_fs() else { return };
    let mnt = fs.mnt.canonicalize().unwrap();
    let cfg = |name: &str, extra: &str| -> PathBuf {
        let p = d.path().join(name);
        std::fs::write(
            &p,
            format!(
                r#"{{"cpu_bytes_to_use": "8MiB",
                    "secondary_tiers": [{{"type": "nvme", "paths": ["{}"],
                                          "capacity_bytes": "16MiB"{extra}}}]}}"#,
                mnt.display()
            ),
        )
        .unwrap();
        p
    };
    let plain = cfg("kvtier.json", "");
    let degraded = cfg("degraded.json", r#", "on_wrong_filesystem": "degraded""#);
    let serve = |c: &Path| {
        let (child, addr) = start_serve(&[
            "--config",
            c.to_str().unwrap(),
            "--metrics-addr",
            "127.0.0.1:0",
        ]);
        (Serving(child), addr)
    };
    let stop = |mut s: Serving| {
        send_signal(&s.0, libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = s.0.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "serve did not stop");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let (child, addr) = serve(&plain);
    let (head, _) = get(&addr, "/healthz");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(stop(child).success());
    assert!(mnt.join("kvtier-g3.slab").exists());

    fs.unmount().unwrap();
    // Must refuse at once; a serve that runs (on the wrong disk) is stopped after a while.
    let running = cli_common::command(&[
        "serve",
        "--config",
        plain.to_str().unwrap(),
        "--metrics-addr",
        "127.0.0.1:0",
    ])
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    let mut running = Serving(running);
    let deadline = Instant::now() + Duration::from_secs(30);
    while running.0.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = running.0.kill();
    let out = running.wait_with_output_ref();
    let m = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{m}");
    assert!(m.contains(&mnt.display().to_string()), "{m}");
    assert!(
        m.contains("ext4 (uuid "),
        "the tier's filesystem is not named: {m}"
    );
    assert!(
        m.contains("is on ext4"),
        "the filesystem found is not named: {m}"
    );
    assert!(
        entries(&mnt).is_empty(),
        "created {:?} on the wrong disk",
        entries(&mnt)
    );
    eprintln!("serve's refusal: {m}");

    let (child, addr) = serve(&degraded);
    let (head, body) = get(&addr, "/healthz");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(body.starts_with("degraded"), "{body}");
    assert!(body.contains("runs without its slabs"), "{body}");
    let (_, metrics) = get(&addr, "/metrics");
    let line = metrics
        .lines()
        .find(|l| l.contains("g3_wrong_filesystem{") && l.contains("path=\"0\""))
        .unwrap_or_else(|| panic!("no g3_wrong_filesystem series: {metrics}"));
    let value: f64 = line.split_whitespace().last().unwrap().parse().unwrap();
    assert_eq!(value, 1.0, "{line}");
    stop(child);
    assert!(
        entries(&mnt).is_empty(),
        "created {:?} on the wrong disk",
        entries(&mnt)
    );

    fs.mount().unwrap();
    let (child, addr) = serve(&plain);
    let deadline = Instant::now() + Duration::from_secs(20);
    let (head, body) = loop {
        let (head, body) = get(&addr, "/healthz");
        if body.starts_with("ok") || Instant::now() > deadline {
            break (head, body);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        head.starts_with("HTTP/1.1 200") && body.starts_with("ok"),
        "{head} {body}"
    );
    assert!(stop(child).success());
}

/// A tier made before records existed (no record) still opens, and gains its record, after
/// which an unmount is caught.
#[test]
fn a_tier_without_a_record_opens_and_gains_it() {
    let Some((_d, fs)) = loop_fs() else { return };
    let mnt = fs.mnt.canonicalize().unwrap();
    let r = region(2);
    let mut t = build(&entry(&mnt, serde_json::json!({})), &r).unwrap();
    wait_ready(t.as_ref());
    t.shutdown().unwrap();
    drop(t);
    // What a tier created by a kvtier without records looks like.
    let record = Records::default_location().unwrap().file_of(&mnt);
    std::fs::remove_file(&record).unwrap();
    let mut t = build(&entry(&mnt, serde_json::json!({})), &r).unwrap();
    wait_ready(t.as_ref());
    t.shutdown().unwrap();
    drop(t);
    assert!(record.exists(), "the existing tier did not gain its record");
    fs.unmount().unwrap();
    let e = build(&entry(&mnt, serde_json::json!({})), &r)
        .err()
        .expect("the unmount was not caught");
    assert!(e.to_string().contains("Mount it"), "{e}");
    assert!(entries(&mnt).is_empty());
}

/// No silent fallback: a state directory that takes no record (here one below `/dev/null`)
/// leaves the tier running, and `g3_paths_unrecorded` counts the path.
#[test]
fn a_path_that_cannot_be_recorded_is_counted() {
    use std::io::{BufRead, BufReader};
    let d = tmpdir();
    let cfg = cli_common::write_config(d.path());
    let child = cli_common::command(&[
        "serve",
        "--config",
        cfg.to_str().unwrap(),
        "--metrics-addr",
        "127.0.0.1:0",
    ])
    .env("KVTIER_STATE_DIR", "/dev/null/kvtier-state")
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    let mut serving = Serving(child);
    let mut line = String::new();
    BufReader::new(serving.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("kvtier serve: listening on http://")
        .and_then(|s| s.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("unexpected first line: {line:?}"))
        .to_string();
    let (_, metrics) = get(&addr, "/metrics");
    let value: f64 = metrics
        .lines()
        .find(|l| l.contains("g3_paths_unrecorded{"))
        .and_then(|l| l.split_whitespace().last())
        .unwrap_or_else(|| panic!("no g3_paths_unrecorded: {metrics}"))
        .parse()
        .unwrap();
    assert_eq!(value, 1.0);
    send_signal(&serving.0, libc::SIGTERM);
    let status = serving.0.wait().unwrap();
    assert!(status.success(), "{status:?}");
}

/// A tier moved with its files (copied onto another filesystem at the same path) is no wrong
/// disk: the slab found there is the recorded set, so it opens with its chunks, and the record
/// follows it.
#[test]
fn a_tier_moved_with_its_files_opens_and_the_record_follows() {
    let Some((d, fs)) = loop_fs() else { return };
    let mnt = fs.mnt.canonicalize().unwrap();
    let r = region(2);
    let req = RequestContext::new("r");
    let mut t = build(&entry(&mnt, serde_json::json!({})), &r).unwrap();
    wait_ready(t.as_ref());
    fill_row(&r, 0, 5);
    assert!(run(t.as_mut(), job(1, 5, false)).success);
    t.shutdown().unwrap();
    drop(t);
    let copy = d.path().join("copy");
    std::fs::create_dir(&copy).unwrap();
    for f in entries(&mnt)
        .into_iter()
        .filter(|f| f.starts_with("kvtier-g3"))
    {
        std::fs::copy(mnt.join(&f), copy.join(&f)).unwrap();
    }
    fs.unmount().unwrap();
    for f in entries(&copy) {
        std::fs::copy(copy.join(&f), mnt.join(&f)).unwrap();
    }
    let mut t = build(&entry(&mnt, serde_json::json!({})), &r).unwrap();
    wait_ready(t.as_ref());
    assert_eq!(t.lookup(&key(5), &req), LookupResult::Hit);
    t.shutdown().unwrap();
    drop(t);
    let rec = Records::default_location().unwrap().read(&mnt).unwrap();
    assert!(
        rec.fs.same_filesystem(&FsIdentity::of(&mnt).unwrap()),
        "the record did not follow the tier: {rec:?}"
    );
    for f in entries(&mnt) {
        std::fs::remove_file(mnt.join(f)).unwrap();
    }
}
