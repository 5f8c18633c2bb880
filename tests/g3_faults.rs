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
use kvtier::g3::journal::JOURNAL_FILE_NAME;
use kvtier::g3::slab::SLAB_FILE_NAME;
use kvtier::g3::{G3Tier, G3TierConfig, geometry_namespace};
use kvtier::io::{FaultPlan, FaultyEngine, MetaFault, MetaFile, MetaOp, open_engine};
use kvtier::region::PrimaryRegion;
use std::sync::Arc;

fn open_faulty(cfg: G3TierConfig, r: &Arc<PrimaryRegion>, plan: FaultPlan) -> G3Tier {
    let factory: kvtier::g3::EngineFactory = Box::new(move |k, reg, files, opts| {
        FaultyEngine::wrap_handle(open_engine(k, reg, files, opts)?, plan)
    });
    let t = G3Tier::open_with_engine(
        cfg,
        r.clone(),
        geometry_namespace(STRIDE),
        "t".into(),
        None,
        factory,
    )
    .unwrap();
    assert!(t.wait_recovered(Duration::from_secs(30)));
    t
}

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
fn failed_write_poisons_the_path() {
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
    let res = run(&mut t, job(1, &[0, 1, 2, 3], &[0, 1, 2, 3], false));
    assert!(!res.success);
    assert_eq!(res.transfer_bytes, Some(2 * STRIDE as u64));
    assert_eq!(lookup(&mut t, 0), LookupResult::Hit);
    assert_eq!(lookup(&mut t, 1), LookupResult::Hit);
    assert_eq!(lookup(&mut t, 2), LookupResult::Miss);
    assert_eq!(metric(&t, "g3_path_healthy"), 0.0);
    fill_row(&r, 4, 4);
    let res = run(&mut t, job(2, &[4], &[4], false));
    assert!(!res.success);
    assert_eq!(res.error.as_ref().unwrap().kind(), ErrorKind::Poisoned);
    // Earlier chunks stay readable.
    clear_row(&r, 5);
    assert!(run(&mut t, job(3, &[1], &[5], true)).success);
    assert!(row_is(&r, 5, 1));
}

#[test]
fn failed_fdatasync_fails_the_store_and_poisons_the_path() {
    let d = tmpdir();
    let r = region(8);
    // fsync = always (the default): each group commit syncs the slab before journaling.
    let mut t = open_faulty(
        config(&[d.path()], 8),
        &r,
        FaultPlan::new().fail_syncs_after(1),
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
    assert_eq!(metric(&t, "g3_path_healthy"), 0.0);
    // The path takes no more writes; what was durable before stays readable.
    let res = run(&mut t, job(3, &[2], &[2], false));
    assert_eq!(res.error.as_ref().unwrap().kind(), ErrorKind::Poisoned);
    clear_row(&r, 5);
    assert!(run(&mut t, job(4, &[0], &[5], true)).success);
    assert!(row_is(&r, 5, 0));
    t.close_without_checkpoint().unwrap();
    // After a restart only the key whose sync succeeded is there.
    let mut t = open(config(&[d.path()], 8), &r);
    assert_eq!(lookup(&mut t, 0), LookupResult::Hit);
    assert_eq!(lookup(&mut t, 1), LookupResult::Miss);
    assert_eq!(lookup(&mut t, 2), LookupResult::Miss);
    clear_row(&r, 6);
    assert!(run(&mut t, job(5, &[0], &[6], true)).success);
    assert!(row_is(&r, 6, 0));
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
    let mut t = open_faulty(
        config(&[d.path()], 8),
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
