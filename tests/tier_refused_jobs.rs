//! A job a tier cannot run (a chunk id outside the region, keys and chunk ids that differ in
//! number, a key given twice, a job after shutdown) is reported through `get_finished_jobs`,
//! exactly once, like any other job, never a panic or a silent loss: vLLM's manager asserts
//! that every job it submitted is reported, and vLLM's own tiers report such jobs failed (its
//! fs tier's `test_out_of_bounds_block_id_smoke`). The same checks for every tier type of
//! kvtier that runs in process: G3, fs and the memory tier (the node service's client tier:
//! `tests/node_service.rs`, `a_job_the_node_tier_cannot_run_is_reported_failed`).

#[allow(unused_imports)] // only some of its re-exports of g3_common are used here
mod fs_common;

use fs_common::g3_common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier::contract::job::{JobResult, TransferJob};
use kvtier::contract::secondary::SecondaryTier;
use kvtier::region::PrimaryRegion;
use kvtier::tiering::memory_tier::{MemoryTier, MemoryTierOptions};

const ROWS: usize = 8;

fn job(id: u64, keys: &[u64], rows: &[u32], load: bool) -> TransferJob {
    g3_common::job(id, keys, rows, load)
}

/// Every job reported within 30 s, each once (a second report of an id fails).
fn reported(t: &mut dyn SecondaryTier, ids: &[u64]) -> Vec<JobResult> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut out: Vec<JobResult> = Vec::new();
    while out.len() < ids.len() {
        assert!(Instant::now() < deadline, "reported so far: {out:?}");
        for r in t.get_finished_jobs() {
            assert!(
                !out.iter().any(|o| o.job_id == r.job_id),
                "job {} twice",
                r.job_id
            );
            out.push(r);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    out.sort_by_key(|r| r.job_id);
    assert_eq!(out.iter().map(|r| r.job_id).collect::<Vec<_>>(), ids);
    out
}

fn region_is_zero(r: &PrimaryRegion) -> bool {
    // Every job of the test has been reported; nothing else uses the region.
    (0..r.num_rows()).all(|i| r.read_row(i).unwrap().iter().all(|b| *b == 0))
}

/// The checks every tier must pass; `r` is the tier's region, all zeros, `ROWS` rows.
fn refuses_by_reporting(t: &mut dyn SecondaryTier, r: &PrimaryRegion) {
    let past = ROWS as u32;
    t.submit_store(job(1, &[1], &[past], false));
    t.submit_load(job(2, &[1], &[u32::MAX], true));
    let mut short = job(3, &[1, 2], &[0], false);
    short.chunk_ids.truncate(1);
    t.submit_store(short);
    t.submit_load(job(4, &[9], &[0], true)); // never stored
    let got = reported(t, &[1, 2, 3, 4]);
    for g in &got {
        assert!(!g.success, "job {} must fail: {g:?}", g.job_id);
        assert!(
            g.error.is_some(),
            "job {} failed without saying why",
            g.job_id
        );
    }
    assert!(region_is_zero(r), "a job that could not run wrote a row");
    // A key given twice in one store is reported (stored once or refused, never lost).
    g3_common::fill_row(r, 0, 5);
    g3_common::fill_row(r, 1, 5);
    t.submit_store(job(5, &[5, 5], &[0, 1], false));
    reported(t, &[5]);
    t.shutdown().expect("shutdown");
    t.submit_store(job(6, &[7], &[0], false));
    t.submit_load(job(7, &[5], &[2], true));
    let got = reported(t, &[6, 7]);
    assert!(
        got.iter().all(|g| !g.success && g.error.is_some()),
        "{got:?}"
    );
    assert!(!t.has_pending_work());
    assert!(t.get_finished_jobs().is_empty());
}

fn zeroed_region() -> Arc<PrimaryRegion> {
    Arc::new(PrimaryRegion::create(ROWS, g3_common::STRIDE as u64).unwrap())
}

#[test]
fn g3_reports_the_jobs_it_cannot_run() {
    let dir = g3_common::tmpdir();
    let r = zeroed_region();
    let mut t = g3_common::open(g3_common::config(&[dir.path()], 16), &r);
    assert!(t.wait_recovered(Duration::from_secs(20)));
    refuses_by_reporting(&mut t, &r);
}

#[test]
fn fs_reports_the_jobs_it_cannot_run() {
    let dir = tempfile::tempdir().unwrap();
    let r = zeroed_region();
    let mut t = fs_common::open(fs_common::config(dir.path(), 16), &r);
    refuses_by_reporting(&mut t, &r);
}

#[test]
fn the_memory_tier_reports_the_jobs_it_cannot_run() {
    let r = zeroed_region();
    let mut t = MemoryTier::start(r.clone(), MemoryTierOptions::new("memory")).unwrap();
    refuses_by_reporting(&mut t, &r);
}
