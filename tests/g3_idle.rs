//! How the G3 worker waits for work: it lingers (naps, not registered as a waiter) for
//! `idle_linger_ms` after its last work, then blocks; jobs submitted in either state run; with
//! lingering off it never naps; its threads run under SCHED_BATCH.

mod g3_common;

use std::time::Duration;

use g3_common::*;
use kvtier::contract::job::LookupResult;
use kvtier::contract::secondary::SecondaryTier;
use kvtier::g3::G3Tier;
use kvtier::io::IdlePolicy;
use kvtier::region::PrimaryRegion;

fn lingering(poll_ms: u64, linger_ms: u64) -> IdlePolicy {
    IdlePolicy {
        poll_interval: Duration::from_millis(poll_ms),
        linger: Duration::from_millis(linger_ms),
    }
}

/// Stores chunk `i` from row `row` and checks the job succeeded.
fn store(t: &mut G3Tier, r: &PrimaryRegion, id: u64, i: u64, row: u32) {
    fill_row(r, row, i);
    let res = run(t, job(id, &[i], &[row], false));
    assert!(res.success, "store {i}: {:?}", res.error);
}

/// Loads chunk `i` into row `row` and checks its bytes.
fn load(t: &mut G3Tier, r: &PrimaryRegion, id: u64, i: u64, row: u32) {
    clear_row(r, row);
    let res = run(t, job(id, &[i], &[row], true));
    assert!(res.success, "load {i}: {:?}", res.error);
    assert!(row_is(r, row, i), "row {row} does not hold chunk {i}");
}

#[test]
fn worker_lingers_after_work_then_blocks_and_still_takes_jobs() {
    let dir = tmpdir();
    let r = region(8);
    let mut cfg = config(&[dir.path()], 32);
    cfg.idle = lingering(1, 40);
    let mut t = open(cfg, &r);
    store(&mut t, &r, 1, 100, 0);
    // Within the linger the worker naps (about one per millisecond)...
    std::thread::sleep(Duration::from_millis(300));
    let after_linger = metric(&t, "g3_idle_naps");
    assert!(
        after_linger >= 5.0,
        "only {after_linger} naps while lingering"
    );
    // ...and the naps stop once the linger is over: the worker blocks.
    assert!(
        after_linger <= 100.0,
        "{after_linger} naps: the worker kept napping past its 40 ms linger"
    );
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        metric(&t, "g3_idle_naps"),
        after_linger,
        "the worker napped after its linger ended"
    );
    // A blocked worker is woken by the next job, and lingers again after it.
    store(&mut t, &r, 2, 101, 1);
    load(&mut t, &r, 3, 100, 2);
    load(&mut t, &r, 4, 101, 3);
    assert_eq!(lookup(&mut t, 101), LookupResult::Hit);
    std::thread::sleep(Duration::from_millis(200));
    assert!(metric(&t, "g3_idle_naps") > after_linger);
    t.shutdown().unwrap();
}

#[test]
fn jobs_submitted_while_the_worker_lingers_run() {
    let dir = tmpdir();
    let r = region(16);
    let mut cfg = config(&[dir.path()], 64);
    cfg.idle = lingering(1, 60_000);
    let mut t = open(cfg, &r);
    for step in 0..8u64 {
        // Each job arrives while the worker naps between looks at its channels.
        store(&mut t, &r, 10 + step, 200 + step, step as u32);
        std::thread::sleep(Duration::from_millis(3));
        load(&mut t, &r, 100 + step, 200 + step, 8 + step as u32);
    }
    assert!(metric(&t, "g3_idle_naps") > 0.0);
    t.shutdown().unwrap();
}

#[test]
fn loads_submitted_while_stores_are_in_flight_run() {
    let dir = tmpdir();
    let r = region(64);
    let mut cfg = config(&[dir.path()], 256);
    cfg.io_engine = kvtier::io::IoEngineKind::Auto;
    let mut t = open(cfg, &r);
    store(&mut t, &r, 1, 7, 0);
    // A burst of stores, and loads of a stored key behind it, without waiting in between.
    for j in 0..8u64 {
        let rows: Vec<u32> = (1 + j as u32 * 6..7 + j as u32 * 6).collect();
        let keys: Vec<u64> = (0..6).map(|k| 1000 + j * 6 + k).collect();
        for (&row, &k) in rows.iter().zip(&keys) {
            fill_row(&r, row, k);
        }
        t.submit_store(job(10 + j, &keys, &rows, false));
    }
    clear_row(&r, 60);
    t.submit_load(job(99, &[7], &[60], true));
    for res in results(&mut t, 9) {
        assert!(res.success, "job {}: {:?}", res.job_id, res.error);
    }
    assert!(row_is(&r, 60, 7));
    t.shutdown().unwrap();
}

#[test]
fn with_lingering_off_the_worker_never_naps() {
    let dir = tmpdir();
    let r = region(8);
    let mut cfg = config(&[dir.path()], 32);
    cfg.idle = IdlePolicy::BLOCK;
    let mut t = open(cfg, &r);
    for i in 0..4u64 {
        store(&mut t, &r, i, 300 + i, i as u32);
        std::thread::sleep(Duration::from_millis(5));
        load(&mut t, &r, 10 + i, 300 + i, 4 + i as u32);
    }
    assert_eq!(metric(&t, "g3_idle_naps"), 0.0);
    t.shutdown().unwrap();
}

/// Scheduling policy (field 41 of /proc/<tid>/stat) of this process's threads whose name
/// starts with `prefix`.
fn thread_policies(prefix: &str) -> Vec<(String, i32)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let comm = comm.trim_end().to_string();
        if !comm.starts_with(prefix) {
            continue;
        }
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        // `rest` starts at field 3 (state), so field 41 is its 39th entry.
        if let Some(p) = rest.split_whitespace().nth(38).and_then(|p| p.parse().ok()) {
            out.push((comm, p));
        }
    }
    out
}

#[test]
fn worker_and_engine_threads_run_under_sched_batch() {
    let dir = tmpdir();
    let r = region(8);
    let mut cfg = config(&[dir.path()], 32);
    cfg.io_engine = kvtier::io::IoEngineKind::Auto;
    let mut t = open(cfg, &r);
    store(&mut t, &r, 1, 1, 0);
    if kvtier::io::batch_policy_failures() > 0 {
        kvtier::skip_test!("this machine refuses SCHED_BATCH for kvtier's I/O threads");
        return;
    }
    let workers = thread_policies("kvtier-g3");
    assert!(!workers.is_empty(), "no G3 worker thread found");
    let engines: Vec<_> = thread_policies("kvtier-uring")
        .into_iter()
        .chain(thread_policies("kvtier-psync"))
        .collect();
    assert!(!engines.is_empty(), "no engine thread found");
    for (name, policy) in workers.iter().chain(&engines) {
        assert_eq!(*policy, libc::SCHED_BATCH, "thread {name}");
    }
    assert_eq!(metric(&t, "g3_io_threads_without_batch_policy"), 0.0);
    t.shutdown().unwrap();
}
