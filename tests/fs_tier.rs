//! The `fs` tier in one process: file names and contents as vLLM's fs tier has them, CRC
//! records, lookups that never block, failures that stay with their key, bad input, capacity
//! and eviction, the start-up scan, and faults injected into the engine. Files live under
//! /tmp (ext4 here: O_DIRECT alignment is enforced and user xattrs work).

mod fs_common;

use std::time::Duration;

use fs_common::*;
use kvtier::ErrorKind;
use kvtier::contract::job::LookupResult;
use kvtier::contract::secondary::SecondaryTier;
use kvtier::fs::integrity::{CrcRecord, XATTR_NAME};
use kvtier::fs::{FsTier, Integrity};
use kvtier::io::{EngineHandle, FaultPlan, FaultyEngine, open_engine};

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir_in("/tmp").unwrap()
}

fn xattr_of(path: &std::path::Path) -> Option<CrcRecord> {
    let f = std::fs::File::open(path).unwrap();
    CrcRecord::read_from(&f, path).unwrap()
}

#[test]
fn stored_files_are_exactly_the_rows_at_vllm_paths_with_a_crc_record() {
    let d = tmp();
    let r = region(8);
    let mut t = open(config(d.path(), 64), &r);
    assert!(t.info().direct_io, "ext4 under /tmp supports O_DIRECT");
    assert_eq!(t.info().publish, "noreplace");
    let res = store(&mut t, &r, 1, &[10, 11, 12]);
    assert!(res.success, "{res:?}");
    assert_eq!(res.transfer_bytes, Some(3 * STRIDE as u64));
    for k in [10, 11, 12] {
        let p = t.mapper().file_path(&key(k)).unwrap();
        let kb = key(k);
        let hex = hex::encode(&kb.as_bytes()[..kb.len() - 4]);
        let want = t
            .info()
            .data_dir
            .join(format!("{}/{}_g0/{hex}.bin", &hex[..3], &hex[3..5]));
        assert_eq!(p, want);
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(
            bytes,
            pattern(k, STRIDE),
            "file of key {k} is the row, no header"
        );
        assert_eq!(xattr_of(&p), Some(CrcRecord::of(&bytes)));
    }
    // The folder: vLLM's config.json and kvtier's marker, nothing else.
    let base = t.info().base_path.clone();
    assert_eq!(files_under(&base), ["config.json", "kvtier.json"]);
    assert_eq!(
        std::fs::read_to_string(base.join("config.json")).unwrap(),
        t.mapper().config_json()
    );
    assert!(temps_under(d.path()).is_empty());
    let events = t.take_events();
    assert_eq!(events.len(), 1);
    assert!(!events[0].removed && events[0].removal_expected);
    assert_eq!(events[0].keys.len(), 3);
    // Back into other rows, byte for byte.
    let res = load(&mut t, &r, 2, &[12, 10]);
    assert!(res.success, "{res:?}");
    assert!(row_is(&r, 0, 12) && row_is(&r, 1, 10));
    t.shutdown().unwrap();
}

#[test]
fn a_second_tier_on_the_same_root_finds_and_loads_the_chunks() {
    let d = tmp();
    let r = region(8);
    let mut a = open(config(d.path(), 64), &r);
    let r2 = region(8);
    let mut b = open(config(d.path(), 64), &r2);
    // b's start-up scan ends before a stores (else it may find the files first: a HIT).
    assert!(b.wait_scanned(Duration::from_secs(10)));
    assert!(store(&mut a, &r, 1, &[1, 2]).success);
    let rq = req("r1");
    // Unknown to b: RETRY first, then HIT once its background check ran.
    assert_eq!(b.lookup(&key(1), &rq), LookupResult::Retry);
    assert!(b.has_pending_work());
    assert_eq!(resolve(&mut b, 1, &rq), LookupResult::Hit);
    assert_eq!(resolve(&mut b, 3, &rq), LookupResult::Miss);
    let res = load(&mut b, &r2, 5, &[1, 2]);
    assert!(res.success, "{res:?}");
    assert!(row_is(&r2, 0, 1) && row_is(&r2, 1, 2));
    // A store of what is there writes nothing.
    let res = store(&mut b, &r2, 6, &[1]);
    assert!(res.success);
    assert_eq!(res.transfer_bytes, Some(0));
    b.on_request_finished(&rq);
    a.shutdown().unwrap();
    b.shutdown().unwrap();
}

#[test]
fn a_flipped_byte_fails_that_key_only_and_the_key_becomes_a_miss() {
    let d = tmp();
    let r = region(8);
    let mut t = open(config(d.path(), 64), &r);
    assert!(store(&mut t, &r, 1, &[1, 2, 3]).success);
    let p = t.mapper().file_path(&key(2)).unwrap();
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[STRIDE / 2] ^= 0x10;
    // Rewritten in place: same inode, the CRC record stays.
    std::fs::write(&p, &bytes).unwrap();
    let rq = req("r");
    assert_eq!(t.lookup(&key(2), &rq), LookupResult::Hit);
    let res = load(&mut t, &r, 2, &[1, 2, 3]);
    assert!(!res.success);
    let ok = res.successful_keys.clone().unwrap();
    assert_eq!(ok, vec![key(1), key(3)], "{res:?}");
    assert_eq!(res.error.as_ref().unwrap().kind(), ErrorKind::Checksum);
    assert!(row_is(&r, 0, 1) && row_is(&r, 2, 3));
    assert!(!p.exists(), "the corrupt file is removed");
    assert_eq!(resolve(&mut t, 2, &rq), LookupResult::Miss);
    assert_eq!(metric(&t, "fs_checksum_failures"), 1.0);
    t.shutdown().unwrap();
}

#[test]
fn a_file_of_the_wrong_size_fails_that_key() {
    let d = tmp();
    let r = region(8);
    let mut t = open(config(d.path(), 64), &r);
    assert!(store(&mut t, &r, 1, &[1, 2]).success);
    let p = t.mapper().file_path(&key(1)).unwrap();
    std::fs::write(&p, vec![0u8; STRIDE / 2]).unwrap();
    let res = load(&mut t, &r, 2, &[1, 2]);
    assert!(!res.success);
    assert_eq!(res.successful_keys, Some(vec![key(2)]));
    let e = res.error.unwrap();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(e.to_string().contains(&p.display().to_string()), "{e}");
    assert!(!p.exists(), "the broken file is removed");
    // A broken file met by a store is replaced, not taken for the chunk.
    std::fs::write(&p, vec![0u8; 100]).unwrap();
    assert!(store(&mut t, &r, 3, &[1]).success);
    assert_eq!(std::fs::read(&p).unwrap(), pattern(1, STRIDE));
    assert!(load(&mut t, &r, 4, &[1]).success);
    t.shutdown().unwrap();
}

#[test]
fn files_written_by_vllm_load_and_count_as_unverified() {
    let d = tmp();
    let r = region(8);
    let mut t = open(config(d.path(), 64), &r);
    // What vLLM's fs tier writes: the row's bytes at the FileMapper path, no attribute.
    let p = t.mapper().file_path(&key(42)).unwrap();
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, pattern(42, STRIDE)).unwrap();
    assert_eq!(xattr_of(&p), None);
    let rq = req("r");
    assert_eq!(resolve(&mut t, 42, &rq), LookupResult::Hit);
    let res = load(&mut t, &r, 1, &[42]);
    assert!(res.success, "{res:?}");
    assert!(row_is(&r, 0, 42));
    assert_eq!(metric(&t, "fs_files_loaded_unverified"), 1.0);
    assert_eq!(metric(&t, "fs_files_loaded_verified"), 0.0);
    t.shutdown().unwrap();
}

#[test]
fn bad_roots_and_foreign_folders_are_refused_naming_the_path() {
    let d = tmp();
    let r = region(2);
    let missing = d.path().join("nope");
    let e = FsTier::open(
        config(&missing, 4),
        r.clone(),
        fields(),
        [0; 32],
        "1:fs".into(),
        None,
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidPath, "{e}");
    assert!(
        e.to_string().contains("nope") && e.to_string().contains("root_dir"),
        "{e}"
    );
    let file = d.path().join("plain");
    std::fs::write(&file, b"x").unwrap();
    let e = FsTier::open(
        config(&file, 4),
        r.clone(),
        fields(),
        [0; 32],
        "t".into(),
        None,
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidPath, "{e}");
    assert!(e.to_string().contains("not a directory"), "{e}");
    // Read-only: refused before anything is written (as root, chmod does not stop writes,
    // so use a read-only bind of /proc's kind: /proc/self is never writable).
    let e = FsTier::open(
        config(std::path::Path::new("/proc/self"), 4),
        r.clone(),
        fields(),
        [0; 32],
        "t".into(),
        None,
    )
    .unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::InvalidPath | ErrorKind::NoSpace),
        "{e}"
    );
    // Another model's config.json in this model's folder.
    let t = open(config(d.path(), 4), &r);
    let cfg_path = t.info().base_path.join("config.json");
    drop(t);
    std::fs::write(&cfg_path, r#"{"model_name": "someone/else"}"#).unwrap();
    let e = FsTier::open(
        config(d.path(), 4),
        r.clone(),
        fields(),
        [7; 32],
        "t".into(),
        None,
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::IncompatibleLayout, "{e}");
    assert!(e.context_value("found").is_some() && e.context_value("expected").is_some());
    // kvtier's own namespace (the KV layout among it) differs.
    std::fs::write(
        &cfg_path,
        kvtier::fs::FileMapper::new(d.path(), fields())
            .unwrap()
            .config_json(),
    )
    .unwrap();
    let e = FsTier::open(
        config(d.path(), 4),
        r.clone(),
        fields(),
        [8; 32],
        "t".into(),
        None,
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::IncompatibleLayout, "{e}");
    assert_eq!(
        e.context_value("found"),
        Some(hex::encode([7u8; 32]).as_str())
    );
}

#[test]
fn capacity_is_enforced_by_evicting_the_least_recently_used_files() {
    let d = tmp();
    let r = region(8);
    let mut t = open(config(d.path(), 4), &r);
    assert!(t.wait_scanned(Duration::from_secs(10)));
    // One job per key, so that the recency order is the order of the stores.
    for k in 1..=4 {
        assert!(store(&mut t, &r, k, &[k]).success);
    }
    let rq = req("r");
    // Key 1 is used again: key 2 is now the least recently used, then key 3.
    assert_eq!(t.lookup(&key(1), &rq), LookupResult::Hit);
    assert!(store(&mut t, &r, 5, &[5, 6]).success);
    // Eviction runs on the I/O threads: wait for both removals to be reported.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut removed = Vec::new();
    while removed.len() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "eviction: {removed:?}"
        );
        removed.extend(
            t.take_events()
                .into_iter()
                .filter(|e| e.removed)
                .flat_map(|e| e.keys),
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    removed.sort();
    let mut want = vec![key(2), key(3)];
    want.sort();
    assert_eq!(removed, want);
    assert_eq!(t.known(), (4, 4 * STRIDE as u64));
    for (k, there) in [
        (1, true),
        (2, false),
        (3, false),
        (4, true),
        (5, true),
        (6, true),
    ] {
        assert_eq!(
            t.mapper().file_path(&key(k)).unwrap().exists(),
            there,
            "key {k}"
        );
    }
    // Evicted keys answer MISS at once (no stale verdict), after the next check.
    assert_eq!(resolve(&mut t, 2, &rq), LookupResult::Miss);
    t.shutdown().unwrap();
}

#[test]
fn the_start_up_scan_seeds_the_catalog_oldest_first_and_removes_stale_temps() {
    let d = tmp();
    let r = region(8);
    let mut t = open(config(d.path(), 64), &r);
    assert!(store(&mut t, &r, 1, &[1, 2, 3]).success);
    let data = t.info().data_dir.clone();
    let paths: Vec<_> = [1, 2, 3]
        .iter()
        .map(|&k| t.mapper().file_path(&key(k)).unwrap())
        .collect();
    t.shutdown().unwrap();
    drop(t);
    // Ages: key 2 oldest, then 1, then 3.
    let now = std::time::SystemTime::now();
    for (p, age_s) in paths.iter().zip([200u64, 300, 100]) {
        let when = now - Duration::from_secs(age_s);
        std::fs::File::options()
            .write(true)
            .open(p)
            .unwrap()
            .set_times(
                std::fs::FileTimes::new()
                    .set_accessed(when)
                    .set_modified(when),
            )
            .unwrap();
    }
    // A stale temporary file (a store killed an hour ago) and a fresh one (in progress).
    let stale = format!("{}_0123456789abcdef.tmp", paths[0].display());
    let fresh = format!("{}_fedcba9876543210.tmp", paths[0].display());
    std::fs::write(&stale, b"partial").unwrap();
    std::fs::write(&fresh, b"partial").unwrap();
    let old = now - Duration::from_secs(3600);
    std::fs::File::options()
        .write(true)
        .open(&stale)
        .unwrap()
        .set_times(std::fs::FileTimes::new().set_modified(old))
        .unwrap();
    // Capacity for two: the scan finds three and evicts the oldest (key 2).
    let mut t = open(config(d.path(), 2), &r);
    assert!(t.wait_scanned(Duration::from_secs(10)));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while paths[1].exists() {
        assert!(std::time::Instant::now() < deadline, "scan eviction");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(paths[0].exists() && paths[2].exists());
    assert!(!std::path::Path::new(&stale).exists());
    assert!(std::path::Path::new(&fresh).exists());
    assert_eq!(metric(&t, "fs_scanned_files"), 3.0);
    assert_eq!(metric(&t, "fs_stale_temps_removed"), 1.0);
    let rq = req("r");
    assert_eq!(
        t.lookup(&key(3), &rq),
        LookupResult::Hit,
        "known from the scan"
    );
    let _ = data;
    t.shutdown().unwrap();
}

fn open_faulty(
    cfg: kvtier::fs::FsTierConfig,
    r: &std::sync::Arc<kvtier::region::PrimaryRegion>,
    plan: FaultPlan,
) -> FsTier {
    FsTier::open_with_engine(
        cfg,
        r.clone(),
        fields(),
        [7; 32],
        "1:fs".into(),
        None,
        Box::new(
            move |kind, region, files, opts| -> kvtier::Result<EngineHandle> {
                FaultyEngine::wrap_handle(open_engine(kind, region, files, opts)?, plan)
            },
        ),
    )
    .unwrap()
}

#[test]
fn a_failed_write_fails_its_key_and_leaves_no_file() {
    let d = tmp();
    let r = region(8);
    let mut cfg = config(d.path(), 64);
    cfg.max_bytes_in_flight = Some(STRIDE as u64); // one at a time: op numbers follow key order
    let mut t = open_faulty(cfg, &r, FaultPlan::new().eio_on(2));
    let res = store(&mut t, &r, 1, &[1, 2, 3]);
    assert!(!res.success);
    assert_eq!(res.error.as_ref().unwrap().raw_os_error(), Some(libc::EIO));
    for (k, there) in [(1, true), (2, false), (3, true)] {
        assert_eq!(
            t.mapper().file_path(&key(k)).unwrap().exists(),
            there,
            "key {k}"
        );
    }
    assert!(
        temps_under(d.path()).is_empty(),
        "{:?}",
        temps_under(d.path())
    );
    t.shutdown().unwrap();
}

#[test]
fn a_short_or_corrupted_read_fails_its_key_never_returns_wrong_bytes() {
    let d = tmp();
    let r = region(8);
    let mut t = open(config(d.path(), 64), &r);
    assert!(store(&mut t, &r, 1, &[1, 2, 3]).success);
    t.shutdown().unwrap();
    drop(t);
    let mut cfg = config(d.path(), 64);
    cfg.max_bytes_in_flight = Some(STRIDE as u64);
    // Read 1 comes back short; read 3 gets a bit flipped in memory after the read.
    let plan = FaultPlan::new().short_on(1, 4096).flip_bit(3, 100, 3);
    let mut t = open_faulty(cfg, &r, plan);
    let res = load(&mut t, &r, 2, &[1, 2, 3]);
    assert!(!res.success);
    assert_eq!(res.successful_keys, Some(vec![key(2)]), "{res:?}");
    assert!(row_is(&r, 1, 2));
    t.shutdown().unwrap();
}

#[test]
fn integrity_none_stores_without_records_but_still_checks_others() {
    let d = tmp();
    let r = region(8);
    let mut t = open(config(d.path(), 64), &r);
    assert!(store(&mut t, &r, 1, &[1]).success);
    t.shutdown().unwrap();
    drop(t);
    let mut cfg = config(d.path(), 64);
    cfg.integrity = Integrity::None;
    let mut t = open(cfg, &r);
    assert!(store(&mut t, &r, 2, &[2]).success);
    assert_eq!(xattr_of(&t.mapper().file_path(&key(2)).unwrap()), None);
    let res = load(&mut t, &r, 3, &[1, 2]);
    assert!(res.success);
    assert_eq!(metric(&t, "fs_files_loaded_verified"), 1.0);
    assert_eq!(metric(&t, "fs_files_loaded_unverified"), 1.0);
    assert_eq!(metric(&t, "fs_crc_records_written"), 0.0);
    t.shutdown().unwrap();
}

#[test]
fn empty_mismatched_and_refused_jobs_are_reported_once() {
    let d = tmp();
    let r = region(8);
    let mut t = open(config(d.path(), 64), &r);
    t.submit_store(job(1, &[], &[], false));
    let mut bad = job(2, &[1, 2], &[0], true);
    t.submit_load(bad.clone());
    bad.job_id = 3;
    bad.chunk_ids = vec![0, 99];
    t.submit_load(bad);
    let mut all = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while all.len() < 3 {
        assert!(std::time::Instant::now() < deadline, "{all:?}");
        all.extend(t.get_finished_jobs());
        std::thread::sleep(Duration::from_millis(1));
    }
    let by = |id| all.iter().find(|r| r.job_id == id).unwrap();
    assert!(by(1).success);
    assert_eq!(by(2).error.as_ref().unwrap().kind(), ErrorKind::Contract);
    assert!(!by(3).success, "row 99 is out of the region");
    assert!(t.get_finished_jobs().is_empty());
    assert!(!t.has_pending_work());
    t.shutdown().unwrap();
    // After shutdown, jobs fail at once.
    t.submit_store(job(4, &[1], &[0], false));
    let r4 = t.get_finished_jobs();
    assert_eq!(r4[0].error.as_ref().unwrap().kind(), ErrorKind::Closed);
}

#[test]
fn drain_waits_for_started_jobs_and_cancels_queued_ones() {
    let d = tmp();
    let r = region(64);
    let mut cfg = config(d.path(), 1024);
    cfg.max_bytes_in_flight = Some(STRIDE as u64);
    let mut t = open(cfg, &r);
    for j in 0..16u64 {
        let keys: Vec<u64> = (j * 4..j * 4 + 4).collect();
        let rows: Vec<u32> = (j as u32 * 4..j as u32 * 4 + 4).collect();
        for (k, row) in keys.iter().zip(&rows) {
            fill_row(&r, *row, *k);
        }
        t.submit_store(job(j, &keys, &rows, false));
    }
    t.drain_jobs();
    let results = t.get_finished_jobs();
    assert_eq!(results.len(), 16, "every job reported after the drain");
    for res in &results {
        if !res.success {
            assert_eq!(res.error.as_ref().unwrap().kind(), ErrorKind::Cancelled);
        }
    }
    assert!(results.iter().any(|r| r.success));
    assert!(temps_under(d.path()).is_empty());
    t.shutdown().unwrap();
}

#[test]
fn lookups_answer_miss_when_the_verdict_cache_is_full_of_unresolved_checks() {
    let d = tmp();
    let r = region(4);
    let mut cfg = config(d.path(), 64);
    cfg.lookup_cache_entries = 16;
    let mut t = open(cfg, &r);
    let rq = req("r");
    for k in 0..16 {
        assert_eq!(t.lookup(&key(k), &rq), LookupResult::Retry);
    }
    // Sixteen unresolved entries: a seventeenth key cannot be cached and is a MISS.
    assert_eq!(t.lookup(&key(99), &rq), LookupResult::Miss);
    // Once they resolve, the oldest resolved verdicts make room.
    for k in 0..16 {
        assert_eq!(resolve(&mut t, k, &rq), LookupResult::Miss);
    }
    assert_eq!(t.lookup(&key(99), &rq), LookupResult::Retry);
    assert_eq!(metric(&t, "fs_lookup_overflows"), 1.0);
    assert!(metric(&t, "fs_lookup_cache_entries") <= 16.0);
    t.on_request_finished(&rq);
    t.shutdown().unwrap();
}

#[test]
fn an_unresolved_lookup_times_out_as_a_miss() {
    let d = tmp();
    let r = region(4);
    let mut cfg = config(d.path(), 64);
    cfg.lookup_timeout = Duration::from_millis(30);
    let mut t = open(cfg, &r);
    let rq = req("r");
    // Never flushed: the check never runs, as if the file system hung.
    assert_eq!(t.lookup(&key(1), &rq), LookupResult::Retry);
    assert_eq!(
        t.health().state,
        kvtier::contract::secondary::HealthState::Ok
    );
    std::thread::sleep(Duration::from_millis(40));
    assert_eq!(t.lookup(&key(1), &rq), LookupResult::Miss);
    let h = t.health();
    assert_eq!(h.state, kvtier::contract::secondary::HealthState::Degraded);
    assert!(h.problems[0].contains("timed out"), "{h:?}");
    t.shutdown().unwrap();
}

#[test]
fn fsync_always_and_uring_round_trip() {
    let d = tmp();
    let r = region(8);
    let mut cfg = config(d.path(), 64);
    cfg.fsync = kvtier::fs::FsSync::Always;
    cfg.io_engine = kvtier::io::IoEngineKind::Auto;
    let mut t = open(cfg, &r);
    assert!(store(&mut t, &r, 1, &[1, 2, 3, 4]).success);
    assert!(load(&mut t, &r, 2, &[4, 3, 2, 1]).success);
    for (row, k) in [4u64, 3, 2, 1].iter().enumerate() {
        assert!(row_is(&r, row as u32, *k));
    }
    t.shutdown().unwrap();
    let _ = XATTR_NAME;
}

#[test]
fn a_file_removed_by_another_host_fails_that_load_and_becomes_a_miss() {
    let d = tmp();
    let r = region(8);
    let mut t = open(config(d.path(), 64), &r);
    assert!(store(&mut t, &r, 1, &[1, 2, 3]).success);
    let rq = req("r");
    // Known from the store: a HIT, a promise another host can break.
    assert_eq!(t.lookup(&key(2), &rq), LookupResult::Hit);
    std::fs::remove_file(t.mapper().file_path(&key(2)).unwrap()).unwrap();
    let res = load(&mut t, &r, 2, &[1, 2, 3]);
    assert!(!res.success);
    assert_eq!(res.successful_keys, Some(vec![key(1), key(3)]));
    assert!(
        res.error.as_ref().unwrap().to_string().contains("is gone"),
        "{res:?}"
    );
    assert!(row_is(&r, 0, 1) && row_is(&r, 2, 3));
    assert_eq!(metric(&t, "fs_missing_files"), 1.0);
    // No longer known, and the failed load turned the verdict into a MISS.
    assert_eq!(resolve(&mut t, 2, &rq), LookupResult::Miss);
    t.shutdown().unwrap();
}

/// Hosts that share `root_dir` probe it at the same time, and their engines often have the
/// same pid (each in its own container). A probe named after the pid alone collides: the
/// O_DIRECT probe's exclusive create fails (the tier refused to start: "does not accept new
/// files") and the xattr probe truncated and removed the other host's file. Here files named
/// as such a host's probes (this pid) are already there: the tier opens and leaves them be.
#[test]
fn probes_of_another_host_with_the_same_pid_neither_stop_nor_lose_anything() {
    let d = tmp();
    let r = region(2);
    let pid = std::process::id();
    // The O_DIRECT probe's names: pid and a per-process count (this binary's other tests
    // open far fewer tiers than this).
    for n in 0..1024 {
        std::fs::write(d.path().join(format!(".kvtier-probe-{pid}-{n}")), b"").unwrap();
    }
    let data = kvtier::fs::FileMapper::new(d.path(), fields())
        .unwrap()
        .data_dir()
        .to_path_buf();
    std::fs::create_dir_all(&data).unwrap();
    let theirs = data.join(format!(".kvtier-xattr-probe-{pid}"));
    std::fs::write(&theirs, b"another host's probe").unwrap();
    let t = FsTier::open(
        config(d.path(), 4),
        r.clone(),
        fields(),
        [0; 32],
        "1:fs".into(),
        None,
    )
    .unwrap();
    drop(t);
    assert_eq!(std::fs::read(&theirs).unwrap(), b"another host's probe");
    let left = std::fs::read_dir(d.path())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with(".kvtier-probe-")
        })
        .count();
    assert_eq!(
        left, 1024,
        "the tier's own probe files are removed, the others kept"
    );
}

/// A process killed during its start-up probes leaves a probe file in the data folder. The
/// scan removes such files once they are stale (as it removes stale temporary files) and
/// keeps fresh ones (another host's probe may be running now).
#[test]
fn the_scan_removes_stale_probe_files_a_killed_start_left() {
    let d = tmp();
    let r = region(2);
    let data = kvtier::fs::FileMapper::new(d.path(), fields())
        .unwrap()
        .data_dir()
        .to_path_buf();
    std::fs::create_dir_all(&data).unwrap();
    let stale = [
        data.join(".kvtier-xattr-probe-7-0123456789abcdef"),
        data.join(".kvtier-publish-probe-0123456789abcdef-a"),
    ];
    let fresh = data.join(".kvtier-publish-probe-fedcba9876543210-b");
    let old = std::time::SystemTime::now() - Duration::from_secs(3600);
    for p in &stale {
        std::fs::write(p, b"").unwrap();
        std::fs::File::options()
            .write(true)
            .open(p)
            .unwrap()
            .set_times(std::fs::FileTimes::new().set_modified(old))
            .unwrap();
    }
    std::fs::write(&fresh, b"").unwrap();
    let t = open(config(d.path(), 4), &r);
    assert!(t.wait_scanned(Duration::from_secs(10)));
    for p in &stale {
        assert!(!p.exists(), "{} is still there", p.display());
    }
    assert!(fresh.exists());
    assert_eq!(metric(&t, "fs_stale_temps_removed"), 2.0);
    drop(t);
}
