//! Faults: corrupted slots, injected EIO / short transfers / bit flips, poisoned paths, a
//! torn or corrupt journal tail.

mod g3_common;

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

use g3_common::*;
use kvtier::contract::job::LookupResult;
use kvtier::contract::secondary::SecondaryTier;
use kvtier::error::ErrorKind;
use kvtier::g3::G3Tier;
use kvtier::g3::journal::JOURNAL_FILE_NAME;
use kvtier::g3::slab::SLAB_FILE_NAME;
use kvtier::io::{DataFault, DataOp, FaultPlan, MetaFault, MetaFile, MetaOp};
use kvtier::region::PrimaryRegion;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

fn store_four(t: &mut G3Tier, r: &PrimaryRegion) {
    for i in 0..4u32 {
        fill_row(r, i, u64::from(i));
    }
    let res = run(t, job(1, &[0, 1, 2, 3], &[0, 1, 2, 3], false));
    assert!(res.success, "{res:?}");
    t.take_events();
}

fn keys_of(res: &kvtier::contract::job::JobResult) -> Vec<kvtier::key::ChunkKey> {
    let mut k = res.successful_keys.clone().unwrap_or_default();
    k.sort();
    k
}

fn sorted(ids: &[u64]) -> Vec<kvtier::key::ChunkKey> {
    let mut k: Vec<_> = ids.iter().map(|&i| key(i)).collect();
    k.sort();
    k
}

#[test]
fn flipped_bit_on_disk_fails_that_key_only() {
    let d = tmpdir();
    let r = region(8);
    let mut t = open(config(&[d.path()], 8), &r);
    store_four(&mut t, &r);
    // Slot 1 holds key 1 (free slots are handed out in order): flip one bit of it on disk.
    let slab = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(d.path().join(SLAB_FILE_NAME))
        .unwrap();
    let off = 4096 + STRIDE as u64 + 1234;
    let mut b = [0u8; 1];
    slab.read_exact_at(&mut b, off).unwrap();
    slab.write_all_at(&[b[0] ^ 0x10], off).unwrap();
    slab.sync_all().unwrap();
    for row in 4..8 {
        clear_row(&r, row);
    }
    let res = run(&mut t, job(2, &[0, 1, 2, 3], &[4, 5, 6, 7], true));
    assert!(!res.success);
    assert_eq!(keys_of(&res), sorted(&[0, 2, 3]));
    assert_eq!(res.error.as_ref().unwrap().kind(), ErrorKind::Checksum);
    assert!(row_is(&r, 4, 0) && row_is(&r, 6, 2) && row_is(&r, 7, 3));
    assert_eq!(metric(&t, "g3_checksum_failures"), 1.0);
    // The key is a miss from now on (no promotion livelock) and its slot is released.
    assert_eq!(lookup(&mut t, 1), LookupResult::Miss);
    let ev = t.take_events();
    assert!(
        ev.iter().any(|e| e.removed && e.keys == vec![key(1)]),
        "{ev:?}"
    );
    t.close_without_checkpoint().unwrap();
    let mut t = open(config(&[d.path()], 8), &r);
    assert_eq!(
        lookup(&mut t, 1),
        LookupResult::Miss,
        "the removal was journaled"
    );
    assert_eq!(lookup(&mut t, 2), LookupResult::Hit);
}

#[test]
fn bit_flipped_during_read_is_caught() {
    let d = tmpdir();
    let r = region(8);
    // Ops 1-4 are the store's writes; ops 5-8 the load's reads; op 7 gets a bit flipped.
    let mut t = open_faulty(
        config(&[d.path()], 8),
        &r,
        FaultPlan::new().flip_bit(7, 100, 3),
    );
    store_four(&mut t, &r);
    let res = run(&mut t, job(2, &[0, 1, 2, 3], &[4, 5, 6, 7], true));
    assert!(!res.success);
    assert_eq!(keys_of(&res), sorted(&[0, 1, 3]));
    assert_eq!(metric(&t, "g3_checksum_failures"), 1.0);
    assert_eq!(lookup(&mut t, 2), LookupResult::Miss);
}

#[test]
fn eio_mid_load_gives_per_key_results() {
    let d = tmpdir();
    let r = region(8);
    let mut t = open_faulty(config(&[d.path()], 8), &r, FaultPlan::new().eio_on(6));
    store_four(&mut t, &r);
    let res = run(&mut t, job(2, &[0, 1, 2, 3], &[4, 5, 6, 7], true));
    assert!(!res.success);
    assert_eq!(keys_of(&res), sorted(&[0, 2, 3]));
    assert_eq!(
        res.transfer_bytes,
        Some(3 * STRIDE as u64),
        "bytes actually moved"
    );
    assert_eq!(lookup(&mut t, 1), LookupResult::Miss);
    assert_eq!(lookup(&mut t, 0), LookupResult::Hit);
    assert_eq!(metric(&t, "g3_io_errors"), 1.0);
    // Reads do not poison a path.
    assert_eq!(metric(&t, "g3_path_healthy"), 1.0);
    // A failed load forgets the key even for a plain EIO (docs/g3.md: re-offering HIT on a
    // failing device would livelock); the forgetting is journaled and survives a reopen.
    t.shutdown().unwrap();
    drop(t);
    let mut t = open(config(&[d.path()], 8), &r);
    assert_eq!(lookup(&mut t, 1), LookupResult::Miss);
    assert_eq!(lookup(&mut t, 0), LookupResult::Hit);
    // The transient error cost a recompute, never wrong bytes: stored again, it loads.
    fill_row(&r, 1, 1);
    assert!(run(&mut t, job(3, &[1], &[1], false)).success);
    clear_row(&r, 5);
    assert!(run(&mut t, job(4, &[1], &[5], true)).success);
    assert!(row_is(&r, 5, 1));
}

#[test]
fn failed_write_fences_the_path() {
    let d = tmpdir();
    let r = region(8);
    let mut t = open_faulty(
        config(&[d.path()], 8),
        &r,
        FaultPlan::new().fail_writes_after(2),
    );
    for i in 0..4u32 {
        fill_row(&r, i, u64::from(i));
    }
    assert!(run(&mut t, job(1, &[0, 1], &[0, 1], false)).success);
    t.take_events();
    let res = run(&mut t, job(2, &[2, 3], &[2, 3], false));
    assert!(!res.success);
    assert_eq!(res.transfer_bytes, Some(0));
    // The path is fenced: the entries it held leave the index (removed events, journaled).
    for i in 0..4 {
        assert_eq!(lookup(&mut t, i), LookupResult::Miss, "key {i}");
    }
    assert_eq!(metric(&t, "g3_path_healthy"), 0.0);
    assert_eq!(metric(&t, "g3_entries_fenced"), 2.0);
    let removed: Vec<_> = t
        .take_events()
        .into_iter()
        .filter(|e| e.removed)
        .flat_map(|e| e.keys)
        .collect();
    assert_eq!(removed, vec![key(0), key(1)]);
    fill_row(&r, 4, 4);
    let res = run(&mut t, job(3, &[4], &[4], false));
    assert!(!res.success);
    assert_eq!(res.error.as_ref().unwrap().kind(), ErrorKind::Poisoned);
    t.close_without_checkpoint().unwrap();
    let mut t = open(config(&[d.path()], 8), &r);
    assert_eq!(
        lookup(&mut t, 0),
        LookupResult::Miss,
        "the fence was journaled"
    );
    assert_eq!(
        lookup(&mut t, 1),
        LookupResult::Miss,
        "the fence was journaled"
    );
}

#[test]
fn failed_fdatasync_fails_the_store_and_fences_the_path() {
    let (a, b) = (tmpdir(), tmpdir());
    let r = region(8);
    // fsync = always (the default): each group commit syncs the slab before journaling.
    // Slots alternate between the paths: key 0 -> path 0, key 1 -> path 1, key 2 -> path 0.
    let mut t = open_faulty(
        config(&[a.path(), b.path()], 8),
        &r,
        FaultPlan::new().data(DataFault::new(DataOp::Sync, libc::EIO).on_file(1)),
    );
    for i in 0..3u32 {
        fill_row(&r, i, u64::from(i));
    }
    assert!(run(&mut t, job(1, &[0], &[0], false)).success);
    // The second commit's fdatasync fails: the written bytes are not known to be durable, so
    // the store is not reported as success and the key is never journaled or served.
    let res = run(&mut t, job(2, &[1], &[1], false));
    assert!(
        !res.success,
        "a store whose fdatasync failed reported success"
    );
    let err = res.error.as_ref().unwrap();
    assert_eq!(err.kind(), ErrorKind::Io, "{err}");
    assert!(err.to_string().contains("fdatasync"), "{err}");
    assert_eq!(lookup(&mut t, 1), LookupResult::Miss);
    assert_eq!(metric(&t, "g3_path_healthy"), 1.0, "one path of two");
    // The other path goes on taking writes; what it holds stays readable.
    assert!(run(&mut t, job(3, &[2], &[2], false)).success);
    clear_row(&r, 5);
    assert!(run(&mut t, job(4, &[0], &[5], true)).success);
    assert!(row_is(&r, 5, 0));
    t.close_without_checkpoint().unwrap();
    // After a restart only the keys whose sync succeeded are there.
    let mut t = open(config(&[a.path(), b.path()], 8), &r);
    assert_eq!(lookup(&mut t, 0), LookupResult::Hit);
    assert_eq!(lookup(&mut t, 1), LookupResult::Miss);
    assert_eq!(lookup(&mut t, 2), LookupResult::Hit);
    clear_row(&r, 6);
    assert!(run(&mut t, job(5, &[2], &[6], true)).success);
    assert!(row_is(&r, 6, 2));
}

/// Issue 20 item 1: a failed path's entries stayed in the LRU, the eviction scan (256
/// entries) walked past them, and once they filled the LRU end every store failed with
/// NoSpace although the healthy path had entries to evict. Now the failed path is fenced
/// (its entries dropped, journaled) and the healthy path keeps storing, evicting and loading.
#[test]
fn a_failed_path_is_fenced_and_the_healthy_path_keeps_evicting() {
    let (a, b) = (tmpdir(), tmpdir());
    const SLOTS: u64 = 600;
    const JOB: u64 = 60;
    let r = region(JOB as usize);
    let gate = Arc::new(AtomicBool::new(false));
    let plan = FaultPlan::new().data(
        DataFault::new(DataOp::Write, libc::EIO)
            .on_file(1)
            .while_set(gate.clone()),
    );
    let mut cfg = config(&[a.path(), b.path()], SLOTS);
    cfg.fsync = kvtier::g3::FsyncPolicy::Never;
    let mut t = open_faulty(cfg.clone(), &r, plan);
    let rows: Vec<u32> = (0..JOB as u32).collect();
    let store = |t: &mut G3Tier, first: u64, id: u64| {
        let keys: Vec<u64> = (first..first + JOB).collect();
        for (&row, &k) in rows.iter().zip(&keys) {
            fill_row(&r, row, k);
        }
        run(t, job(id, &keys, &rows, false))
    };
    // Fill every slot: key i sits in slot i, on path i % 2.
    for n in 0..SLOTS / JOB {
        assert!(store(&mut t, n * JOB, n).success);
    }
    t.take_events();
    // Path 1 fails: the first job's writes there fail, the path is fenced.
    gate.store(true, Ordering::SeqCst);
    let res = store(&mut t, 10_000, 100);
    assert!(!res.success);
    assert_eq!(metric(&t, "g3_path_healthy"), 1.0, "one path of two");
    let fenced = metric(&t, "g3_entries_fenced");
    assert!(fenced >= (SLOTS / 2 - JOB) as f64, "{fenced}");
    // Twice the healthy path's capacity in new keys: every store succeeds by eviction there.
    for n in 0..2 * SLOTS / 2 / JOB {
        let res = store(&mut t, 20_000 + n * JOB, 200 + n);
        assert!(res.success, "store {n} after the fence: {res:?}");
    }
    assert_eq!(metric(&t, "g3_stores_refused"), 0.0);
    for i in (1..SLOTS).step_by(2).take(20) {
        assert_eq!(lookup(&mut t, i), LookupResult::Miss, "fenced key {i}");
    }
    // The newest keys load with their own bytes.
    let newest: Vec<u64> = (20_000 + 9 * JOB..20_000 + 10 * JOB).collect();
    rows.iter().for_each(|&row| clear_row(&r, row));
    let res = run(&mut t, job(999, &newest, &rows, true));
    assert!(res.success, "{res:?}");
    for (&row, &k) in rows.iter().zip(&newest) {
        assert!(row_is(&r, row, k), "key {k}");
    }
    t.close_without_checkpoint().unwrap();
    let mut t = open(cfg, &r);
    assert_eq!(
        lookup(&mut t, 1),
        LookupResult::Miss,
        "the fence was journaled"
    );
    assert_eq!(lookup(&mut t, newest[0]), LookupResult::Hit);
}

/// Issue 20 item 5: EINTR, EAGAIN (once the engine's bounded resubmission gave up) and
/// ECANCELED fail that key only; ENOSPC on a slab write fences the path. Per file and per
/// operation kind.
#[test]
fn transient_errors_fail_the_key_and_enospc_fences_the_path() {
    for errno in [libc::EINTR, libc::EAGAIN, libc::ECANCELED, libc::ENOSPC] {
        let (a, b) = (tmpdir(), tmpdir());
        let r = region(8);
        let plan = FaultPlan::new()
            .data(DataFault::new(DataOp::Write, errno).on_file(1).times(1))
            .data(DataFault::new(DataOp::Read, errno).on_file(0).times(1));
        let mut t = open_faulty(config(&[a.path(), b.path()], 8), &r, plan);
        for i in 0..4u32 {
            fill_row(&r, i, u64::from(i));
        }
        // Keys 0, 2 -> path 0; keys 1, 3 -> path 1 (whose first write fails).
        let res = run(&mut t, job(1, &[0, 1], &[0, 1], false));
        assert!(!res.success, "errno {errno}");
        let e = res.error.unwrap();
        assert_eq!(e.context_value("errno"), Some(errno.to_string().as_str()));
        assert_eq!(lookup(&mut t, 0), LookupResult::Hit);
        assert_eq!(lookup(&mut t, 1), LookupResult::Miss);
        let transient = errno != libc::ENOSPC;
        assert_eq!(
            metric(&t, "g3_path_healthy"),
            if transient { 2.0 } else { 1.0 },
            "errno {errno}"
        );
        // Later stores succeed: on both paths, or on the healthy one once the other is fenced.
        let res = run(&mut t, job(2, &[2, 3], &[2, 3], false));
        assert!(res.success, "errno {errno}: {res:?}");
        assert_eq!(
            metric(&t, "g3_path_healthy"),
            if transient { 2.0 } else { 1.0 },
            "errno {errno}"
        );
        // The first read of path 0 fails: that key only.
        (4..8).for_each(|row| clear_row(&r, row));
        let res = run(&mut t, job(3, &[0, 2], &[4, 5], true));
        assert!(!res.success);
        let loaded = res.successful_keys.unwrap_or_default();
        assert_eq!(loaded.len(), 1, "errno {errno}");
        let k = if loaded[0] == key(0) { 0 } else { 2 };
        assert!(row_is(&r, 4 + k as u32 / 2, k));
    }
}

#[test]
fn failed_final_checkpoint_is_counted_and_the_journal_recovers_everything() {
    let d = tmpdir();
    let r = region(8);
    let mut cfg = config(&[d.path()], 8);
    cfg.fsync = kvtier::g3::FsyncPolicy::Never;
    // The shutdown checkpoint cannot create its file (the first checkpoint, at open, can).
    let plan = FaultPlan::new()
        .meta(MetaFault::new(MetaFile::Checkpoint, MetaOp::Create, libc::EIO).after(1));
    let mut t = open_faulty(cfg, &r, plan);
    for i in 0..3u32 {
        fill_row(&r, i, u64::from(i));
    }
    assert!(run(&mut t, job(1, &[0, 1, 2], &[0, 1, 2], false)).success);
    // The region is safe to unmap (the engine stopped), so shutdown succeeds; the failure is
    // counted instead.
    t.shutdown().unwrap();
    assert_eq!(metric(&t, "g3_checkpoint_failures"), 1.0);
    assert_eq!(metric(&t, "g3_checkpoints"), 0.0);
    drop(t);
    let mut t = open(config(&[d.path()], 8), &r);
    for i in 0..3u64 {
        assert_eq!(lookup(&mut t, i), LookupResult::Hit, "key {i}");
        clear_row(&r, 5);
        assert!(run(&mut t, job(10 + i, &[i], &[5], true)).success);
        assert!(row_is(&r, 5, i));
    }
}

#[test]
fn short_write_is_never_success() {
    let d = tmpdir();
    let r = region(4);
    let e = tmpdir();
    // Key 0 -> path 0, key 1 -> path 1 (whose write is cut short, which fences that path).
    let mut t = open_faulty(
        config(&[d.path(), e.path()], 8),
        &r,
        FaultPlan::new().short_on(2, 4096),
    );
    fill_row(&r, 0, 0);
    fill_row(&r, 1, 1);
    let res = run(&mut t, job(1, &[0, 1], &[0, 1], false));
    assert!(!res.success);
    assert_eq!(res.error.as_ref().unwrap().kind(), ErrorKind::ShortIo);
    assert_eq!(lookup(&mut t, 1), LookupResult::Miss);
    assert_eq!(lookup(&mut t, 0), LookupResult::Hit);
    assert_eq!(metric(&t, "g3_path_healthy"), 1.0);
}

fn journal_len(dir: &Path) -> u64 {
    std::fs::metadata(dir.join(JOURNAL_FILE_NAME))
        .unwrap()
        .len()
}

#[test]
fn torn_journal_tail_is_cut_off() {
    let d = tmpdir();
    let r = region(4);
    let mut t = open(config(&[d.path()], 8), &r);
    for i in 0..3u32 {
        fill_row(&r, i, u64::from(i));
    }
    assert!(run(&mut t, job(1, &[0, 1], &[0, 1], false)).success);
    assert!(run(&mut t, job(2, &[2], &[2], false)).success);
    t.close_without_checkpoint().unwrap();
    // Tear key 2's record (the last one) in half.
    let len = journal_len(d.path());
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(d.path().join(JOURNAL_FILE_NAME))
        .unwrap();
    f.set_len(len - 20).unwrap();
    drop(f);
    let mut t = open(config(&[d.path()], 8), &r);
    assert_eq!(lookup(&mut t, 0), LookupResult::Hit);
    assert_eq!(lookup(&mut t, 1), LookupResult::Hit);
    assert_eq!(lookup(&mut t, 2), LookupResult::Miss);
    assert!(metric(&t, "g3_recovery_cut_bytes") > 0.0);
    // The journal was cut back to its valid prefix and accepts new records.
    fill_row(&r, 3, 3);
    assert!(run(&mut t, job(3, &[3], &[3], false)).success);
    t.close_without_checkpoint().unwrap();
    let mut t = open(config(&[d.path()], 8), &r);
    assert_eq!(lookup(&mut t, 3), LookupResult::Hit);
    assert_eq!(metric(&t, "g3_recovery_cut_bytes"), 0.0);
}

#[test]
fn garbage_after_the_journal_is_ignored() {
    let d = tmpdir();
    let r = region(2);
    let mut t = open(config(&[d.path()], 8), &r);
    fill_row(&r, 0, 7);
    assert!(run(&mut t, job(1, &[7], &[0], false)).success);
    t.close_without_checkpoint().unwrap();
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(d.path().join(JOURNAL_FILE_NAME))
        .unwrap();
    f.write_all(&[0x5A; 57]).unwrap();
    drop(f);
    let mut t = open(config(&[d.path()], 8), &r);
    assert_eq!(lookup(&mut t, 7), LookupResult::Hit);
    assert_eq!(metric(&t, "g3_recovery_cut_bytes"), 57.0);
    clear_row(&r, 1);
    assert!(run(&mut t, job(2, &[7], &[1], true)).success);
    assert!(row_is(&r, 1, 7));
}

#[test]
fn journal_write_failure_refuses_stores_and_keeps_loads() {
    let d = tmpdir();
    let Some(_m) = Mount::new("tmpfs", "size=256k", d.path()) else {
        return;
    };
    let r = region(4);
    let mut cfg = config(&[d.path()], 4);
    cfg.checkpoint_interval = None;
    let mut t = open(cfg.clone(), &r);
    fill_row(&r, 0, 1);
    assert!(run(&mut t, job(1, &[1], &[0], false)).success);
    // Fill the filesystem so the next journal append hits ENOSPC.
    let filler = d.path().join("filler");
    let mut f = std::fs::File::create(&filler).unwrap();
    while f.write_all(&[0u8; 4096]).is_ok() {}
    drop(f);
    // Stores (with evictions) append records until the journal needs a new page.
    let mut failed_key = None;
    for k in 100..400u64 {
        fill_row(&r, 1, k);
        let res = run(&mut t, job(k, &[k], &[1], false));
        if !res.success {
            assert_eq!(
                res.error.as_ref().unwrap().kind(),
                ErrorKind::NoSpace,
                "{res:?}"
            );
            failed_key = Some(k);
            break;
        }
        // Keep key 1 most recently used so it is never evicted.
        assert_eq!(lookup(&mut t, 1), LookupResult::Hit);
    }
    let k = failed_key.expect("the journal never ran out of space");
    assert_eq!(
        lookup(&mut t, k),
        LookupResult::Miss,
        "an unjournaled store is not a hit"
    );
    assert_eq!(metric(&t, "g3_journal_healthy"), 0.0);
    fill_row(&r, 2, 3);
    let res = run(&mut t, job(3, &[3], &[2], false));
    assert!(!res.success);
    assert_eq!(res.error.as_ref().unwrap().kind(), ErrorKind::Poisoned);
    // Loads of committed keys still work.
    clear_row(&r, 3);
    assert!(run(&mut t, job(4000, &[1], &[3], true)).success);
    assert!(row_is(&r, 3, 1));
    // With space back, the shutdown checkpoint restores a clean journal.
    std::fs::remove_file(&filler).unwrap();
    t.shutdown().unwrap();
    drop(t);
    let mut t = open(cfg, &r);
    assert_eq!(metric(&t, "g3_journal_healthy"), 1.0);
    assert_eq!(lookup(&mut t, 1), LookupResult::Hit);
    assert!(run(&mut t, job(5000, &[3], &[2], false)).success);
}

/// Issue 20 item 2: a path whose fdatasync fails must not stop checkpoints (the journal then
/// grew until every store was refused). The failed path is fenced at the checkpoint, the
/// checkpoint goes on for the healthy path, and the journal stays bounded.
#[test]
fn checkpoints_go_on_for_the_healthy_path_and_the_journal_stays_bounded() {
    let (a, b) = (tmpdir(), tmpdir());
    let r = region(8);
    let mut cfg = config(&[a.path(), b.path()], 64);
    cfg.fsync = kvtier::g3::FsyncPolicy::Never;
    cfg.checkpoint_journal_bytes = 4 << 10;
    cfg.max_journal_bytes = 64 << 10;
    cfg.checkpoint_interval = None;
    let plan = FaultPlan::new().data(DataFault::new(DataOp::Sync, libc::EIO).on_file(1));
    let mut t = open_faulty(cfg.clone(), &r, plan);
    let rows: Vec<u32> = (0..8).collect();
    let mut peak = 0.0f64;
    // About 1600 records of ~90 bytes: far more than max_journal_bytes without checkpoints.
    for n in 0..200u64 {
        let keys: Vec<u64> = (n * 8..n * 8 + 8).collect();
        for (&row, &k) in rows.iter().zip(&keys) {
            fill_row(&r, row, k);
        }
        let res = run(&mut t, job(n, &keys, &rows, false));
        assert!(res.success, "store {n}: {res:?}");
        peak = peak.max(metric(&t, "g3_journal_bytes"));
    }
    assert_eq!(metric(&t, "g3_path_healthy"), 1.0, "path 1 is fenced");
    assert_eq!(metric(&t, "g3_stores_refused"), 0.0);
    assert!(metric(&t, "g3_checkpoints") >= 10.0, "checkpoints stopped");
    assert!(peak < (16 << 10) as f64, "the journal grew to {peak} bytes");
    t.close_without_checkpoint().unwrap();
    let mut t = open(cfg, &r);
    let last: Vec<u64> = (199 * 8..200 * 8).collect();
    let res = run(&mut t, job(1000, &last, &rows, true));
    assert!(res.success, "{res:?}");
    for (&row, &k) in rows.iter().zip(&last) {
        assert!(row_is(&r, row, k), "key {k}");
    }
}

/// Issue 20 item 3: a journal poisoned while it holds no record (its first append failed) is
/// repaired by a checkpoint even with `checkpoint_interval_s = 0`, and its state is visible
/// in `g3_journal_info{state}` while it refuses records.
#[test]
fn a_journal_poisoned_while_empty_is_repaired() {
    let d = tmpdir();
    let r = region(4);
    let mut cfg = config(&[d.path()], 8);
    cfg.checkpoint_interval = None;
    let gate = Arc::new(AtomicBool::new(false));
    // Every journal append fails while the gate is set (a disk that is full for a while).
    let plan = FaultPlan::new().meta(
        MetaFault::new(MetaFile::Journal, MetaOp::Write, libc::ENOSPC).while_set(gate.clone()),
    );
    let mut t = open_faulty(cfg, &r, plan);
    let state = |t: &G3Tier| {
        t.metrics()
            .into_iter()
            .find(|m| m.name == "g3_journal_info")
            .and_then(|m| {
                m.labels
                    .iter()
                    .find(|(k, _)| *k == "state")
                    .map(|(_, v)| v.clone())
            })
            .unwrap()
    };
    assert_eq!(state(&t), "healthy");
    gate.store(true, Ordering::SeqCst);
    fill_row(&r, 0, 0);
    let res = run(&mut t, job(1, &[0], &[0], false));
    assert_eq!(
        res.error.as_ref().unwrap().kind(),
        ErrorKind::NoSpace,
        "{res:?}"
    );
    assert_eq!(lookup(&mut t, 0), LookupResult::Miss);
    assert_eq!(metric(&t, "g3_journal_healthy"), 0.0);
    assert_eq!(state(&t), "poisoned");
    // The disk has room again: the repair needs no new record and no interval.
    gate.store(false, Ordering::SeqCst);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while metric(&t, "g3_journal_healthy") == 0.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the journal poisoned while empty was never repaired"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(state(&t), "healthy");
    assert!(run(&mut t, job(2, &[0], &[0], false)).success);
    assert_eq!(lookup(&mut t, 0), LookupResult::Hit);
}

/// The evictions of the store jobs a worker starts together are journaled in one write before
/// their slab writes are submitted. When that write fails, the jobs' keys fail and no slab
/// write is made: the evicted keys' bytes stay intact in their slots, so a restart that
/// replays the journal (which never learned of the evictions) serves them with their own
/// bytes, not the failed jobs'.
#[test]
fn an_eviction_the_journal_could_not_record_never_overwrites_its_slot() {
    // Every write in flight at once; then one row at a time, so that the jobs' other writes
    // wait in the worker's queue when the journal write fails (the jobs after the first then
    // start once the journal refuses records, and may be refused as Poisoned).
    evictions_not_recorded_leave_their_slots(None, &[ErrorKind::NoSpace]);
    evictions_not_recorded_leave_their_slots(
        Some(STRIDE as u64),
        &[ErrorKind::NoSpace, ErrorKind::Poisoned],
    );
}

/// The test above with `max_bytes_in_flight`; `later` are the error kinds the jobs after the
/// first may fail with.
fn evictions_not_recorded_leave_their_slots(max_bytes_in_flight: Option<u64>, later: &[ErrorKind]) {
    let d = tmpdir();
    let r = region(12);
    let mut cfg = config(&[d.path()], 4);
    cfg.checkpoint_interval = None;
    cfg.max_bytes_in_flight = max_bytes_in_flight;
    let gate = Arc::new(AtomicBool::new(false));
    let plan = FaultPlan::new().meta(
        MetaFault::new(MetaFile::Journal, MetaOp::Write, libc::ENOSPC).while_set(gate.clone()),
    );
    let mut t = open_faulty(cfg.clone(), &r, plan);
    for k in 0..4u64 {
        fill_row(&r, k as u32, k);
    }
    assert!(run(&mut t, job(1, &[0, 1, 2, 3], &[0, 1, 2, 3], false)).success);
    // Every slot is taken: each of these six keys (in three jobs, submitted together so that
    // the worker starts them together) evicts one.
    gate.store(true, Ordering::SeqCst);
    for (i, k) in (10..16u64).enumerate() {
        fill_row(&r, 4 + i as u32, k);
    }
    for (n, pair) in [[10u64, 11], [12, 13], [14, 15]].iter().enumerate() {
        let rows = [4 + 2 * n as u32, 5 + 2 * n as u32];
        t.submit_store(job(2 + n as u64, pair, &rows, false));
    }
    let mut res = results(&mut t, 3);
    res.sort_by_key(|r| r.job_id);
    for r in &res {
        assert!(!r.success, "{r:?}");
        let kind = r.error.as_ref().unwrap().kind();
        if r.job_id == 2 {
            assert_eq!(kind, ErrorKind::NoSpace, "{r:?}");
        } else {
            assert!(later.contains(&kind), "{r:?}");
        }
    }
    for k in 10..16 {
        assert_eq!(lookup(&mut t, k), LookupResult::Miss, "key {k}");
    }
    // Closed while the journal still refuses records: it holds the four stores only.
    t.close_without_checkpoint().unwrap();
    let mut t = open(cfg, &r);
    for k in 0..4u64 {
        assert_eq!(lookup(&mut t, k), LookupResult::Hit, "key {k}");
        clear_row(&r, 10);
        let res = run(&mut t, job(10 + k, &[k], &[10], true));
        assert!(res.success, "key {k} came back damaged: {res:?}");
        assert!(row_is(&r, 10, k), "key {k}");
    }
}
