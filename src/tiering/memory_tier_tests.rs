use super::*;

fn job(id: u64, keys: &[ChunkKey], rows: &[u32], promotion: bool) -> TransferJob {
    TransferJob {
        job_id: id,
        keys: keys.to_vec(),
        chunk_ids: rows.to_vec(),
        is_promotion: promotion,
        req_id: "t".into(),
        submit_time: Instant::now(),
    }
}

#[test]
fn threaded_round_trip_capacity_events_and_drain() {
    let region = Arc::new(PrimaryRegion::create(4, 4096).unwrap());
    let mut o = MemoryTierOptions::new("1:memory");
    o.capacity_chunks = Some(2);
    o.mode = ExecMode::Threaded {
        latency: Duration::from_millis(1),
    };
    let mut t = MemoryTier::start(region.clone(), o).unwrap();
    let keys: Vec<ChunkKey> = (0..3u8).map(|i| ChunkKey::new([i])).collect();
    for (i, k) in keys.iter().enumerate() {
        // This test is the only user of the region; no job is in flight.
        region.write_row(i).unwrap().fill(i as u8 + 1);
        t.submit_store(job(i as u64, std::slice::from_ref(k), &[i as u32], false));
        t.drain_jobs();
    }
    assert!(t.has_pending_work(), "results not collected yet");
    let done = t.get_finished_jobs();
    assert_eq!(done.len(), 3);
    assert!(
        done.iter()
            .all(|r| r.success && r.transfer_bytes == Some(4096))
    );
    assert!(!t.has_pending_work());
    assert_eq!(t.len(), 2, "capacity 2: the oldest key was evicted");
    let req = RequestContext::new("r");
    assert_eq!(t.lookup(&keys[0], &req), LookupResult::Miss);
    assert_eq!(t.lookup(&keys[2], &req), LookupResult::Hit);
    let ev = t.take_events();
    assert!(
        ev.iter()
            .any(|e| e.removed && e.keys == vec![keys[0].clone()])
    );
    assert!(
        ev.iter()
            .all(|e| e.ownership.as_deref() == Some("1:memory"))
    );
    // Load key 2 into row 3; a missing key fails with successful_keys.
    t.submit_load(job(10, &[keys[2].clone(), keys[0].clone()], &[3, 0], true));
    t.drain_jobs();
    let r = t.get_finished_jobs().pop().unwrap();
    assert!(!r.success);
    assert_eq!(r.successful_keys, Some(vec![keys[2].clone()]));
    // No job is in flight.
    assert!(region.read_row(3).unwrap().iter().all(|&b| b == 3));
    t.shutdown().unwrap();
    t.submit_store(job(11, &keys[..1], &[0], false));
    let r = t.get_finished_jobs();
    assert_eq!(r.len(), 1);
    assert!(
        !r[0].success,
        "a closed tier fails jobs, still reporting them"
    );
    drop(t);
    assert_eq!(
        Arc::strong_count(&region),
        1,
        "the thread released the region"
    );
}
