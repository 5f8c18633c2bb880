//! The coordinator driven by hand.

use super::*;
use crate::contract::job::OffloadingEvent;
use crate::io::{EngineOptions, IoEngineKind, open_engine};
use serde_json::json;
use std::collections::HashSet;
use std::time::{Duration, Instant};

const STRIDE: usize = 4096;

fn key(n: u8) -> ChunkKey {
    ChunkKey::new(vec![n, 0, 0, 0, 0, 0, 0, 0])
}

fn store_job(job_id: u64, keys: &[u8], rows: &[u32]) -> TransferJob {
    TransferJob {
        job_id,
        keys: keys.iter().map(|&n| key(n)).collect(),
        chunk_ids: rows.to_vec(),
        is_promotion: false,
        req_id: Arc::from("r"),
        submit_time: Instant::now(),
    }
}

/// A coordinator with one I/O thread and room for one file, driven by hand (its `run`
/// loop is not started), so that steps arrive in exactly the order a test chooses.
fn worker(dir: &std::path::Path) -> (Worker, Receiver<OffloadingEvent>) {
    let region = Arc::new(PrimaryRegion::create(4, STRIDE as u64).unwrap());
    let opts = EngineOptions {
        queue_depth: 4,
        psync_threads: 1,
        o_direct: false,
    };
    let handle = open_engine(IoEngineKind::Psync, region.clone(), Vec::new(), &opts).unwrap();
    let mapper = FileMapper::new(dir, json!({"model_name": "m", "tokens_per_hash": 16})).unwrap();
    let sh = Arc::new(Shared {
        catalog: Mutex::new(Catalog::new(STRIDE as u64)),
        metrics: FsMetrics::default(),
        mapper,
        region,
        engine: handle.engine,
        direct: false,
        publish: PublishMode::Link,
        integrity: Integrity::None,
        fsync: FsSync::Never,
        dirs: DirCache::default(),
        events: AtomicBool::new(true),
    });
    let (_cmd_tx, cmd_rx) = crossbeam_channel::unbounded();
    let (results_tx, _results_rx) = crossbeam_channel::unbounded();
    let (events_tx, events_rx) = crossbeam_channel::unbounded();
    let (invalidated_tx, _invalidated_rx) = crossbeam_channel::unbounded();
    let w = Worker::spawn_pool(WorkerInit {
        sh,
        max_bytes_in_flight: 4 * STRIDE as u64,
        io_threads: 1,
        events: EventSink::new(events_tx, "fs".into(), None),
        cmd_rx,
        results_tx,
        invalidated_tx,
    })
    .unwrap();
    (w, events_rx)
}

/// Runs the eviction the coordinator handed its I/O thread and takes its step.
fn take_eviction(w: &mut Worker) {
    let step = w
        .steps_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the eviction's step");
    assert!(matches!(step, Step::Evicted { .. }));
    w.step(step);
}

#[test]
fn a_key_evicted_before_its_store_job_is_reported_is_not_announced_after_its_removal() {
    let dir = tempfile::tempdir().unwrap();
    let (mut w, events) = worker(dir.path());
    // Job 1 stores keys 1 and 2; job 2 stores key 3. The tier holds one file.
    w.start_job(store_job(1, &[1, 2], &[0, 1]), false);
    w.start_job(store_job(2, &[3], &[2]), false);
    let stored = || Ok(KeyOutcome::Stored(Published::New));
    // Key 1 finishes first; job 1 still waits for key 2 (completions come in any order,
    // and a staged engine may hold a request back for a while).
    w.finished(job_tag(0, 0), stored());
    // Job 2's key 3 finishes: the tier is over its capacity, key 1 (least recently used)
    // goes, and its removal is announced.
    w.finished(job_tag(1, 0), stored());
    take_eviction(&mut w);
    // Key 2 finishes: job 1 is reported (then key 3 goes to make room for key 2).
    w.finished(job_tag(0, 1), stored());
    take_eviction(&mut w);
    let mut held = HashSet::new();
    while let Ok(e) = events.try_recv() {
        for k in e.keys {
            if e.removed {
                held.remove(&k);
            } else {
                held.insert(k);
            }
        }
    }
    let known: HashSet<ChunkKey> = w.sh.catalog.lock().keys_lru_first().into_iter().collect();
    assert_eq!(known, HashSet::from([key(2)]), "the files the tier knows");
    assert_eq!(
        held, known,
        "the events' account of the tier vs its catalog"
    );
    w.close().unwrap();
}
