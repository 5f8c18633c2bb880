//! kill -9 during a store storm: a child process (this test binary, re-run in child mode)
//! stores continuously; the parent kills it with SIGKILL mid-storm and reopens the slabs.
//! Every indexed key must load with a valid CRC and its own bytes; the most recently
//! reported keys must be there; nothing half-written may be a hit.

mod g3_common;

use std::collections::VecDeque;
use std::io::Write;
use std::process::Command;
use std::time::{Duration, Instant};

use g3_common::*;
use kvtier::contract::job::LookupResult;
use kvtier::contract::secondary::SecondaryTier;

const CHILD_ENV: &str = "KVTIER_G3_STORM_DIR";
const SLOTS: u64 = 256;
const KEYS_PER_JOB: u64 = 4;
const GROUPS: u64 = 4;

/// Child mode: stores 4-key jobs with up to 4 in flight, forever, appending each reported
/// key to `progress`. Run only by `kill_9_during_store_storm`.
#[test]
#[ignore = "child process of kill_9_during_store_storm"]
fn store_storm_child() {
    let Some(dir) = std::env::var_os(CHILD_ENV) else {
        kvtier::skip_test!("{CHILD_ENV} is not set (this is a child-mode helper)");
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    let data = dir.join("slab");
    let r = region((GROUPS * KEYS_PER_JOB) as usize);
    let mut t = open(config(&[&data], SLOTS), &r);
    let mut progress = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("progress"))
        .unwrap();
    let mut next_key = 0u64;
    let mut free: VecDeque<u64> = (0..GROUPS).collect();
    let mut in_flight: Vec<(u64, u64, Vec<u64>)> = Vec::new(); // (job id, group, keys)
    let mut job_id = 0;
    loop {
        while let Some(g) = free.pop_front() {
            let keys: Vec<u64> = (next_key..next_key + KEYS_PER_JOB).collect();
            next_key += KEYS_PER_JOB;
            let rows: Vec<u32> = (0..KEYS_PER_JOB)
                .map(|i| (g * KEYS_PER_JOB + i) as u32)
                .collect();
            for (k, row) in keys.iter().zip(&rows) {
                fill_row(&r, *row, *k);
            }
            job_id += 1;
            t.submit_store(job(job_id, &keys, &rows, false));
            in_flight.push((job_id, g, keys));
        }
        for res in t.get_finished_jobs() {
            let pos = in_flight
                .iter()
                .position(|(id, _, _)| *id == res.job_id)
                .unwrap();
            let (_, g, keys) = in_flight.remove(pos);
            assert!(res.success, "{res:?}");
            for k in keys {
                writeln!(progress, "{k}").unwrap();
            }
            free.push_back(g);
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn reported(dir: &std::path::Path) -> Vec<u64> {
    std::fs::read_to_string(dir.join("progress"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.parse().ok())
        .collect()
}

#[test]
fn kill_9_during_store_storm() {
    let d = tmpdir();
    std::fs::create_dir(d.path().join("slab")).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args([
            "store_storm_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, d.path())
        .spawn()
        .unwrap();
    // Let it run past the capacity (so evictions happen too), then kill it mid-storm.
    let deadline = Instant::now() + Duration::from_secs(60);
    while reported(d.path()).len() < (SLOTS + 64) as usize {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the storm child exited early"
        );
        assert!(
            Instant::now() < deadline,
            "the storm child made too little progress"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let done = reported(d.path());

    let r = region(1);
    let mut t = open(config(&[&d.path().join("slab")], SLOTS), &r);
    let listed = kvtier::g3::admin::list_keys(&[d.path().join("slab")]).unwrap();
    assert!(!listed.is_empty());
    for (checked, e) in (0u64..).zip(&listed) {
        let k = kvtier::key::ChunkKey::from_hex(&e.key).unwrap();
        let i = u64::from_le_bytes(k.as_bytes()[32..40].try_into().unwrap());
        clear_row(&r, 0);
        let res = run(&mut t, job(1_000_000 + checked, &[i], &[0], true));
        assert!(res.success, "indexed key {i} failed to load: {res:?}");
        assert!(row_is(&r, 0, i), "key {i} loaded someone else's bytes");
    }
    // The newest reported keys cannot have been evicted: they must have survived the kill.
    for &i in done.iter().rev().take(64) {
        assert_eq!(
            lookup(&mut t, i),
            LookupResult::Hit,
            "reported key {i} was lost"
        );
    }
    assert_eq!(metric(&t, "g3_checksum_failures"), 0.0);
    eprintln!(
        "kill -9 storm: {} keys reported, {} indexed after restart, all verified",
        done.len(),
        listed.len()
    );
}
