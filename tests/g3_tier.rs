//! G3 tier behaviour through the SecondaryTier contract: round trip, persistence, eviction,
//! striping, exactly-once reporting, skip, drain.

mod g3_common;

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::time::Duration;

use g3_common::*;
use kvtier::contract::job::{LookupResult, Medium};
use kvtier::contract::secondary::SecondaryTier;
use kvtier::error::ErrorKind;
use kvtier::g3::G3Tier;
use kvtier::io::{FaultPlan, FaultyEngine, open_engine};

#[test]
fn store_then_load_round_trips_bytes() {
    let d = tmpdir();
    let r = region(8);
    let mut t = open(config(&[d.path()], 16), &r);
    assert_eq!(t.tier_type(), "nvme");
    assert_eq!(t.medium(), Some(Medium::Storage));
    assert_eq!(
        t.info().direct_io,
        vec![true],
        "/tmp is ext4 and supports O_DIRECT"
    );
    for i in 0..4u32 {
        fill_row(&r, i, u64::from(i));
    }
    assert_eq!(lookup(&mut t, 0), LookupResult::Miss);
    let res = run(&mut t, job(1, &[0, 1, 2, 3], &[0, 1, 2, 3], false));
    assert!(res.success, "{res:?}");
    assert_eq!(res.transfer_bytes, Some(4 * STRIDE as u64));
    assert!(res.transfer_time.is_some());
    for i in 0..4 {
        assert_eq!(lookup(&mut t, i), LookupResult::Hit);
    }
    let ev = t.take_events();
    assert_eq!(ev.len(), 1);
    assert!(!ev[0].removed && ev[0].removal_expected);
    assert_eq!(ev[0].ownership.as_deref(), Some("g3-test"));
    assert_eq!(ev[0].keys.len(), 4);
    // Load into other rows, in another order.
    let res = run(&mut t, job(2, &[3, 1], &[4, 5], true));
    assert!(res.success, "{res:?}");
    assert_eq!(res.transfer_bytes, Some(2 * STRIDE as u64));
    assert!(row_is(&r, 4, 3) && row_is(&r, 5, 1));
    assert!(!t.has_pending_work());
    assert_eq!(metric(&t, "g3_keys_loaded"), 2.0);
    t.shutdown().unwrap();
}

#[test]
fn index_survives_restart() {
    let d = tmpdir();
    let r = region(4);
    {
        let mut t = open(config(&[d.path()], 8), &r);
        fill_row(&r, 0, 10);
        fill_row(&r, 1, 11);
        assert!(run(&mut t, job(1, &[10, 11], &[0, 1], false)).success);
        t.shutdown().unwrap();
    }
    {
        let mut t = open(config(&[d.path()], 8), &r);
        assert!(!t.info().created);
        assert_eq!(lookup(&mut t, 10), LookupResult::Hit);
        assert_eq!(lookup(&mut t, 12), LookupResult::Miss);
        clear_row(&r, 2);
        assert!(run(&mut t, job(2, &[11], &[2], true)).success);
        assert!(row_is(&r, 2, 11));
        // Records written after the last checkpoint are replayed from the journal.
        fill_row(&r, 3, 13);
        assert!(run(&mut t, job(3, &[13], &[3], false)).success);
        t.close_without_checkpoint().unwrap();
    }
    let mut t = open(config(&[d.path()], 8), &r);
    assert_eq!(t.len(), 3);
    clear_row(&r, 0);
    assert!(run(&mut t, job(4, &[13], &[0], true)).success);
    assert!(row_is(&r, 0, 13));
    assert!(metric(&t, "g3_recovery_records") >= 1.0);
}

#[test]
fn lookup_answers_retry_while_recovering() {
    let d = tmpdir();
    let r = region(1);
    let cfg = config(&[d.path()], 4);
    open(cfg.clone(), &r).shutdown().unwrap();
    // Append many journal records so recovery takes a while: 300k inserts cycling over the
    // 4 slots (the last one per slot wins).
    let set_uuid = {
        let rep = kvtier::g3::admin::inspect(&cfg.paths).unwrap();
        rep.files[0].superblock.set_uuid
    };
    let ckpt_seq = kvtier::g3::admin::inspect(&cfg.paths)
        .unwrap()
        .checkpoint_seq;
    let dir = kvtier::g3::index_dir::IndexDir::open(d.path()).unwrap();
    let mut w = kvtier::g3::journal::JournalWriter::create(&dir, set_uuid, ckpt_seq).unwrap();
    for i in 0..300_000u64 {
        w.insert(&key(i), (i % 4) as u32, 0, i + 1);
    }
    w.flush(true).unwrap();
    drop(w);
    let mut t = G3Tier::open(
        cfg,
        r.clone(),
        kvtier::g3::geometry_namespace(STRIDE as u64),
        "t".into(),
        None,
    )
    .unwrap();
    assert_eq!(lookup(&mut t, 299_999), LookupResult::Retry);
    assert!(t.wait_recovered(Duration::from_secs(60)));
    assert_eq!(lookup(&mut t, 299_999), LookupResult::Hit);
    assert_eq!(lookup(&mut t, 0), LookupResult::Miss);
    assert_eq!(t.len(), 4);
}

#[test]
fn lru_eviction_keeps_capacity_and_journals_removals() {
    let d = tmpdir();
    let r = region(8);
    let mut t = open(config(&[d.path()], 4), &r);
    assert_eq!(t.info().total_slots, 4);
    for i in 0..6u32 {
        fill_row(&r, i, u64::from(i));
    }
    assert!(run(&mut t, job(1, &[0, 1, 2, 3], &[0, 1, 2, 3], false)).success);
    t.take_events();
    assert_eq!(lookup(&mut t, 0), LookupResult::Hit); // 0 becomes most recently used
    assert!(run(&mut t, job(2, &[4, 5], &[4, 5], false)).success);
    assert_eq!(lookup(&mut t, 1), LookupResult::Miss);
    assert_eq!(lookup(&mut t, 2), LookupResult::Miss);
    for i in [0, 3, 4, 5] {
        assert_eq!(lookup(&mut t, i), LookupResult::Hit, "key {i}");
    }
    let removed: Vec<_> = t.take_events().into_iter().filter(|e| e.removed).collect();
    assert_eq!(removed.len(), 1);
    assert_eq!(removed[0].keys, vec![key(1), key(2)]);
    assert_eq!(metric(&t, "g3_evictions"), 2.0);
    assert_eq!(metric(&t, "g3_free_slots"), 0.0);
    clear_row(&r, 6);
    assert!(run(&mut t, job(3, &[5], &[6], true)).success);
    assert!(row_is(&r, 6, 5));
    // The eviction is in the journal: after a crash-like close, 1 and 2 stay gone.
    t.close_without_checkpoint().unwrap();
    let mut t = open(config(&[d.path()], 4), &r);
    assert_eq!(lookup(&mut t, 1), LookupResult::Miss);
    assert_eq!(lookup(&mut t, 4), LookupResult::Hit);
    assert_eq!(t.len(), 4);
}

#[test]
fn slots_are_striped_across_two_paths() {
    let (a, b) = (tmpdir(), tmpdir());
    let r = region(4);
    let mut t = open(config(&[a.path(), b.path()], 4), &r);
    assert_eq!(t.info().slab_paths.len(), 2);
    for i in 0..4u32 {
        fill_row(&r, i, 100 + u64::from(i));
    }
    assert!(run(&mut t, job(1, &[100, 101, 102, 103], &[0, 1, 2, 3], false)).success);
    t.shutdown().unwrap();
    // Slot s lives in file s % 2 at 4096 + (s / 2) * stride; free slots are handed out in order.
    let files: Vec<_> = [a.path(), b.path()]
        .iter()
        .map(|d| std::fs::File::open(d.join(kvtier::g3::slab::SLAB_FILE_NAME)).unwrap())
        .collect();
    for s in 0..4u64 {
        let mut buf = vec![0u8; STRIDE];
        files[(s % 2) as usize]
            .read_exact_at(&mut buf, 4096 + (s / 2) * STRIDE as u64)
            .unwrap();
        assert_eq!(buf, pattern(100 + s, STRIDE), "slot {s}");
    }
}

#[test]
fn every_job_is_reported_exactly_once() {
    let d = tmpdir();
    let r = region(8);
    let mut t = open(config(&[d.path()], 8), &r);
    for i in 0..8u32 {
        fill_row(&r, i, u64::from(i));
    }
    t.submit_store(job(1, &[0, 1], &[0, 1], false));
    t.submit_store(job(2, &[], &[], false)); // empty
    t.submit_store(job(3, &[1, 2, 2], &[1, 2, 2], false)); // 1 may be held already, 2 twice
    t.submit_load(job(4, &[], &[], true)); // empty load
    t.submit_load(job(5, &[9], &[5], true)); // never stored
    t.submit_store(job(6, &[3], &[3, 4], false)); // keys and rows disagree
    t.submit_store(job(7, &[7], &[99], false)); // row out of range
    assert!(t.has_pending_work());
    t.drain_jobs();
    let res = results(&mut t, 7);
    let by_id: HashMap<u64, _> = res.iter().map(|r| (r.job_id, r)).collect();
    assert_eq!(by_id.len(), 7);
    assert!(by_id[&1].success && by_id[&2].success && by_id[&3].success && by_id[&4].success);
    assert_eq!(by_id[&2].transfer_bytes, Some(0));
    assert!(!by_id[&5].success);
    assert_eq!(by_id[&5].successful_keys, None);
    assert_eq!(
        by_id[&6].error.as_ref().unwrap().kind(),
        ErrorKind::Contract
    );
    assert_eq!(
        by_id[&7].error.as_ref().unwrap().kind(),
        ErrorKind::Contract
    );
    assert!(!t.has_pending_work());
    assert!(t.get_finished_jobs().is_empty());
    // Job 3 wrote only key 2, once.
    assert_eq!(metric(&t, "g3_keys_stored"), 3.0);
}

#[test]
fn storing_a_held_key_moves_nothing() {
    let d = tmpdir();
    let r = region(2);
    let mut t = open(config(&[d.path()], 4), &r);
    fill_row(&r, 0, 1);
    assert!(run(&mut t, job(1, &[1], &[0], false)).success);
    let again = run(&mut t, job(2, &[1], &[0], false));
    assert!(again.success);
    assert_eq!(again.transfer_bytes, Some(0));
    assert_eq!(metric(&t, "g3_stores_skipped"), 1.0);
}

#[test]
fn drain_finishes_started_jobs_and_cancels_queued_ones() {
    let d = tmpdir();
    let r = region(8);
    let mut cfg = config(&[d.path()], 8);
    cfg.max_bytes_in_flight = Some(STRIDE as u64); // one row at a time
    let factory: kvtier::g3::EngineFactory = Box::new(|k, reg, files, opts| {
        FaultyEngine::wrap_handle(
            open_engine(k, reg, files, opts)?,
            FaultPlan::new().latency(Duration::from_millis(100)),
        )
    });
    let mut t = G3Tier::open_with_engine(
        cfg,
        r.clone(),
        kvtier::g3::geometry_namespace(STRIDE as u64),
        "t".into(),
        None,
        factory,
    )
    .unwrap();
    assert!(t.wait_recovered(Duration::from_secs(30)));
    for i in 0..4u32 {
        fill_row(&r, i, u64::from(i));
    }
    for i in 0..4u64 {
        t.submit_store(job(i + 1, &[i], &[i as u32], false));
    }
    t.drain_jobs();
    let res = results(&mut t, 4);
    let by_id: HashMap<u64, _> = res.iter().map(|r| (r.job_id, r)).collect();
    assert!(
        by_id[&1].success,
        "the started job completes: {:?}",
        by_id[&1]
    );
    for id in 2..=4 {
        let r = by_id[&id];
        assert!(!r.success);
        assert_eq!(r.error.as_ref().unwrap().kind(), ErrorKind::Cancelled);
    }
    assert_eq!(lookup(&mut t, 0), LookupResult::Hit);
    assert_eq!(lookup(&mut t, 1), LookupResult::Miss);
    assert_eq!(metric(&t, "g3_jobs_cancelled"), 3.0);
    t.shutdown().unwrap();
}

#[test]
fn round_trip_with_every_engine() {
    use kvtier::io::IoEngineKind;
    for kind in [IoEngineKind::Uring, IoEngineKind::Psync, IoEngineKind::Auto] {
        let d = tmpdir();
        let r = region(4);
        let mut cfg = config(&[d.path()], 8);
        cfg.io_engine = kind;
        cfg.max_bytes_in_flight = Some(2 * STRIDE as u64);
        let mut t = match G3Tier::open(
            cfg,
            r.clone(),
            kvtier::g3::geometry_namespace(STRIDE as u64),
            "t".into(),
            None,
        ) {
            Ok(t) => t,
            Err(e) if kind == IoEngineKind::Uring && e.kind() == ErrorKind::Unsupported => {
                kvtier::skip_test!("the uring engine: {e}");
                continue;
            }
            Err(e) => panic!("{kind:?}: {e}"),
        };
        assert!(t.wait_recovered(Duration::from_secs(30)));
        for i in 0..3u32 {
            fill_row(&r, i, 40 + u64::from(i));
        }
        assert!(
            run(&mut t, job(1, &[40, 41, 42], &[0, 1, 2], false)).success,
            "{kind:?}"
        );
        clear_row(&r, 3);
        assert!(run(&mut t, job(2, &[41], &[3], true)).success, "{kind:?}");
        assert!(row_is(&r, 3, 41), "{kind:?} ({})", t.info().engine);
        t.shutdown().unwrap();
    }
}

#[test]
fn journal_size_triggers_checkpoints_and_state_survives() {
    let d = tmpdir();
    let r = region(4);
    let mut cfg = config(&[d.path()], 8);
    cfg.checkpoint_journal_bytes = 200; // about three records
    cfg.fsync = kvtier::g3::FsyncPolicy::Never;
    let mut t = open(cfg.clone(), &r);
    for i in 0..4u32 {
        fill_row(&r, i, 60 + u64::from(i));
        assert!(
            run(
                &mut t,
                job(u64::from(i) + 1, &[60 + u64::from(i)], &[i], false)
            )
            .success
        );
    }
    assert!(
        metric(&t, "g3_checkpoints") >= 1.0,
        "no checkpoint was written"
    );
    t.close_without_checkpoint().unwrap();
    let rep = kvtier::g3::admin::inspect(&cfg.paths).unwrap();
    assert!(rep.checkpoint_seq >= 2, "seq {}", rep.checkpoint_seq);
    assert!(rep.warnings.is_empty(), "{:?}", rep.warnings);
    let mut t = open(cfg, &r);
    assert_eq!(t.len(), 4);
    clear_row(&r, 0);
    assert!(run(&mut t, job(9, &[62], &[0], true)).success);
    assert!(row_is(&r, 0, 62));
}

#[test]
fn interval_checkpoint_fires_while_idle() {
    let d = tmpdir();
    let r = region(1);
    let mut cfg = config(&[d.path()], 4);
    cfg.checkpoint_interval = Some(Duration::from_millis(20));
    let mut t = open(cfg, &r);
    fill_row(&r, 0, 1);
    assert!(run(&mut t, job(1, &[1], &[0], false)).success);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while metric(&t, "g3_checkpoints") < 1.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no interval checkpoint"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let journal = d.path().join(kvtier::g3::journal::JOURNAL_FILE_NAME);
    assert_eq!(
        std::fs::metadata(journal).unwrap().len(),
        kvtier::g3::journal::FILE_HEADER_SIZE as u64,
        "the journal restarts empty after a checkpoint"
    );
}

/// A child process started by another thread holds a copy of every descriptor of this one
/// until its exec; a tier closed a moment ago must still reopen (it used to fail as "locked").
#[test]
fn reopens_at_once_while_another_thread_starts_processes() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let d = tmpdir();
    let r = region(2);
    let stop = Arc::new(AtomicBool::new(false));
    let spawning = stop.clone();
    let spawner = std::thread::spawn(move || {
        let mut started = 0u32;
        while !spawning.load(Ordering::Relaxed) {
            if std::process::Command::new("true").status().is_ok() {
                started += 1;
            }
        }
        started
    });
    let mut failures = Vec::new();
    for _ in 0..100 {
        match G3Tier::open(
            config(&[d.path()], 8),
            r.clone(),
            kvtier::g3::geometry_namespace(STRIDE as u64),
            "t".into(),
            None,
        ) {
            Ok(mut t) => t.shutdown().unwrap(),
            Err(e) => failures.push(e.to_string()),
        }
    }
    stop.store(true, Ordering::Relaxed);
    assert!(spawner.join().unwrap() > 0, "no process was started");
    assert!(
        failures.is_empty(),
        "{} reopens failed: {:?}",
        failures.len(),
        failures.first()
    );
}
