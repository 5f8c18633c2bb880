//! The node service's DRAM staging pool (`service.dram_bytes`) and hint-driven prefetch,
//! with several engine connections (each its own region, as separate processes would have).
//!
//! That a load was served from the pool and not from G3 is shown without trusting the pool's
//! own counters: after the pool holds a chunk, the test garbles the chunk's G3 slot on disk;
//! a load from G3 would then fail its CRC (the control key shows it does), so a load that
//! returns the stored bytes came from the pool.

#[path = "../../tests/node_common/mod.rs"]
mod node_common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvtier::config::{KvtierConfig, ServiceConfig};
use kvtier::contract::hints::KvHintsEnvelope;
use kvtier::contract::job::{Locality, Medium, OffloadingEvent};
use kvtier::contract::secondary::SecondaryTier;
use kvtier::g3::slot_grants::GrantedSlot;
use kvtier::node::AsyncAnswer;
use kvtier::node::EventMedium;
use kvtier::node::start_from_config;
use kvtier::node::{ClientHello, NodeClient, NodeService, NodeTier, RegionSource};
use kvtier::{ChunkKey, LookupResult, PrimaryRegion, RequestContext, TransferJob};
use serde_json::json;

use node_common::key;

const STRIDE: u64 = 64 * 1024;
const SLOTS: u64 = 32;
const ROWS: u64 = 16;
const DIGEST: [u8; 32] = [0x5a; 32];

struct Fixture {
    _dir: tempfile::TempDir,
    service: Option<NodeService>,
    socket: PathBuf,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        drop(self.service.take());
    }
}

fn config(dir: &Path, dram_bytes: serde_json::Value) -> kvtier::Result<KvtierConfig> {
    kvtier::config::from_value(json!({
        "cpu_bytes_to_use": STRIDE * ROWS,
        "service": {
            "socket_path": dir.join("kvtier.sock").display().to_string(),
            "dram_bytes": dram_bytes,
        },
        "secondary_tiers": [{
            "type": "nvme",
            "paths": [dir.join("slabs").display().to_string()],
            "capacity_bytes": STRIDE * SLOTS,
            "direct_io": "auto",
        }],
    }))
}

fn fixture(staging_slots: u64) -> Fixture {
    fixture_with_slots_of(staging_slots, None)
}

/// A service whose G3 slots (and staging slots) hold each row's first `slot_bytes` (`None`:
/// whole rows).
fn fixture_with_slots_of(staging_slots: u64, slot_bytes: Option<u64>) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("slabs")).unwrap();
    let slot = slot_bytes.unwrap_or(STRIDE);
    let cfg = config(dir.path(), json!(staging_slots * slot)).unwrap();
    let service = start_from_config(&cfg, STRIDE, slot_bytes, DIGEST).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !service.is_ready() {
        assert!(Instant::now() < deadline, "the tier never recovered");
        std::thread::sleep(Duration::from_millis(5));
    }
    let socket = dir.path().join("kvtier.sock");
    Fixture {
        _dir: dir,
        service: Some(service),
        socket,
    }
}

fn hello(name: &str) -> ClientHello {
    ClientHello {
        engine: name.into(),
        row_stride: STRIDE,
        digest: DIGEST,
    }
}

/// An engine connection with its own region (a memfd passed by descriptor).
fn engine(f: &Fixture, name: &str) -> (PrimaryRegion, NodeClient) {
    let region = PrimaryRegion::create(ROWS as usize, STRIDE).unwrap();
    let c = NodeClient::connect(&f.socket, &hello(name)).unwrap();
    c.register_fd(region.fd().unwrap(), ROWS).unwrap();
    (region, c)
}

/// The node service as an engine's secondary tier (client mode), its region by descriptor.
fn client_tier(f: &Fixture, name: &str, locality: Option<Locality>) -> (PrimaryRegion, NodeTier) {
    let region = PrimaryRegion::create(ROWS as usize, STRIDE).unwrap();
    let tier = NodeTier::connect(
        &f.socket,
        &hello(name),
        RegionSource::Fd(region.fd().unwrap()),
        ROWS,
        locality,
    )
    .unwrap();
    (region, tier)
}

fn fill(region: &PrimaryRegion, row: usize, seed: u64) -> Vec<u8> {
    // The test owns the region and no job uses the row now.
    let mut bytes = region.write_row(row).unwrap();
    let mut x = seed | 1;
    for b in bytes.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        b.copy_from_slice(&x.to_le_bytes()[..b.len()]);
    }
    bytes.to_vec()
}

fn row(region: &PrimaryRegion, row: usize) -> Vec<u8> {
    // No job uses the row now.
    region.read_row(row).unwrap().to_vec()
}

fn run(c: &NodeClient, load: bool, job: u64, keys: &[ChunkKey], rows: &[u32]) -> bool {
    if load {
        c.submit_load(job, keys.to_vec(), rows.to_vec());
    } else {
        c.submit_store(job, keys.to_vec(), rows.to_vec());
    }
    let r = c
        .wait_finished(Duration::from_secs(60))
        .expect("a job result");
    assert_eq!(r.job_id, job);
    r.success
}

fn status(f: &Fixture) -> serde_json::Value {
    serde_json::from_str(&f.service.as_ref().unwrap().status_json()).unwrap()
}

fn metric(f: &Fixture, name: &str) -> f64 {
    let text = f.service.as_ref().unwrap().metrics_text("kvtier_").unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("kvtier_{name} ")))
        .unwrap_or_else(|| panic!("no {name} in\n{text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// Overwrites the G3 slot of `k` on disk with other bytes (the index keeps its CRC).
fn garble_g3_slot(f: &Fixture, k: &ChunkKey, expected: &[u8]) {
    let svc = f.service.as_ref().unwrap();
    let slots = svc.with_tier(|t| t.slot_grants()).unwrap();
    let paths = svc.with_tier(|t| t.info().slab_paths.clone());
    let grant = slots.begin_load(u64::MAX - 1, vec![k.clone()]).unwrap();
    let GrantedSlot::Ready { file, offset, .. } = grant.slots[0] else {
        panic!("{k:?} is not in G3: {:?}", grant.slots[0]);
    };
    // The pin is released with the stored bytes' CRC: the index stays as it is.
    let r = slots.finish(grant, vec![Ok(crc32fast::hash(expected))]);
    assert!(r.success, "{r:?}");
    let slab = std::fs::OpenOptions::new()
        .write(true)
        .open(&paths[file])
        .unwrap();
    slab.write_all_at(&vec![0xEE; expected.len()], offset)
        .unwrap();
    slab.sync_all().unwrap();
}

#[test]
fn rank_a_stores_rank_b_loads_from_g3_rank_c_is_served_from_staging() {
    let f = fixture(8);
    let (ra, a) = engine(&f, "rank-a");
    let (rb, b) = engine(&f, "rank-b");
    let (rc, c) = engine(&f, "rank-c");
    let keys: Vec<ChunkKey> = (0..4).map(|i| key("shared", i)).collect();
    let rows: Vec<u32> = (0..4).collect();
    let stored: Vec<Vec<u8>> = (0..4).map(|i| fill(&ra, i, 77 + i as u64)).collect();
    assert!(run(&a, false, 1, &keys, &rows));
    assert_eq!(
        status(&f)["staging"]["used_slots"],
        0,
        "a store stages nothing"
    );

    // B loads the first three: read from G3, and kept in the pool for the others.
    assert!(run(&b, true, 2, &keys[..3], &rows[..3]));
    for (i, bytes) in stored[..3].iter().enumerate() {
        assert_eq!(&row(&rb, i), bytes, "B's row {i}");
    }
    let st = status(&f);
    assert_eq!(st["staging"]["g3_loads"], 3, "{st}");
    assert_eq!(st["staging"]["used_slots"], 3, "{st}");

    // G3's copies of all four go bad on disk; the fourth (never loaded) is the control.
    for (k, bytes) in keys.iter().zip(&stored) {
        garble_g3_slot(&f, k, bytes);
    }
    assert!(
        !run(&c, true, 3, &keys[3..], &rows[3..]),
        "a load from G3 of a garbled slot must fail its CRC"
    );
    // C's load of the first three never touches G3: the bytes are A's.
    assert!(run(&c, true, 4, &keys[..3], &rows[..3]));
    for (i, bytes) in stored[..3].iter().enumerate() {
        assert_eq!(&row(&rc, i), bytes, "C's row {i}");
    }
    assert_eq!(metric(&f, "node_staging_hits_total"), 3.0);
    assert_eq!(metric(&f, "node_staging_g3_loads_total"), 4.0);
    // Lookups answer HIT for staged chunks even when G3 no longer has them (the control
    // key failed its CRC and left G3's index).
    let found = c.lookup(&keys).unwrap();
    assert_eq!(found[..3], [LookupResult::Hit; 3]);
    assert_eq!(found[3], LookupResult::Miss);
}

#[test]
fn a_slot_shorter_than_the_row_is_staged_and_served_as_the_rows_prefix() {
    let slot = STRIDE / 4;
    let f = fixture_with_slots_of(4, Some(slot));
    let (ra, a) = engine(&f, "rank-a");
    let (_rb, b) = engine(&f, "rank-b");
    let (rc, c) = engine(&f, "rank-c");
    let keys: Vec<ChunkKey> = (0..2).map(|i| key("prefix", i)).collect();
    let stored: Vec<Vec<u8>> = (0..2).map(|i| fill(&ra, i, 31 + i as u64)).collect();
    assert!(run(&a, false, 1, &keys, &[0, 1]));
    assert!(run(&b, true, 2, &keys, &[0, 1]));
    for (k, bytes) in keys.iter().zip(&stored) {
        garble_g3_slot(&f, k, &bytes[..slot as usize]);
    }
    // C's rows past the slot keep what C had there.
    let tails: Vec<Vec<u8>> = (2..4).map(|i| fill(&rc, i, 500 + i as u64)).collect();
    assert!(run(&c, true, 3, &keys, &[2, 3]));
    for i in 0..2 {
        let got = row(&rc, 2 + i);
        assert_eq!(
            got[..slot as usize],
            stored[i][..slot as usize],
            "row {i}'s slot"
        );
        assert_eq!(
            got[slot as usize..],
            tails[i][slot as usize..],
            "row {i}'s tail"
        );
    }
    assert_eq!(status(&f)["staging"]["hits"], 2);
}

#[test]
fn the_pool_evicts_least_recently_used_and_says_so_in_cpu_events() {
    let f = fixture(3);
    let (ra, a) = engine(&f, "rank-a");
    let (_rb, b) = engine(&f, "rank-b");
    // B subscribes to inventory events before anything happens.
    b.request_events().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while b.async_answers().is_empty() {
        assert!(Instant::now() < deadline, "no answer to TAKE_EVENTS");
        std::thread::sleep(Duration::from_millis(2));
    }
    let keys: Vec<ChunkKey> = (0..5).map(|i| key("lru", i)).collect();
    let rows: Vec<u32> = (0..5).collect();
    for i in 0..5 {
        fill(&ra, i, 5 + i as u64);
    }
    assert!(run(&a, false, 1, &keys, &rows));
    // Loads one at a time: 0, 1, 2 fill the pool; 0 again makes 1 the oldest; 3 evicts 1,
    // 4 evicts 2.
    for (job, i) in [(2, 0), (3, 1), (4, 2), (5, 0), (6, 3), (7, 4)] {
        assert!(run(&a, true, job, &keys[i..=i], &rows[i..=i]));
    }
    let st = status(&f);
    assert_eq!(st["staging"]["used_slots"], 3, "{st}");
    assert_eq!(st["staging"]["evictions"], 2, "{st}");
    assert_eq!(st["staging"]["hits"], 1, "{st}");
    let mut events = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        for ans in b.async_answers() {
            if let AsyncAnswer::Events(e) = ans {
                events.extend(e);
            }
        }
        let cpu_removed: Vec<ChunkKey> = events
            .iter()
            .filter(|e| e.medium == EventMedium::Cpu && e.removed)
            .flat_map(|e| e.keys.clone())
            .collect();
        if cpu_removed.len() >= 2 {
            assert_eq!(cpu_removed, vec![keys[1].clone(), keys[2].clone()]);
            break;
        }
        assert!(Instant::now() < deadline, "no CPU removals in {events:?}");
        b.request_events().unwrap();
        std::thread::sleep(Duration::from_millis(10));
    }
    let cpu_stored: Vec<ChunkKey> = events
        .iter()
        .filter(|e| e.medium == EventMedium::Cpu && !e.removed)
        .flat_map(|e| e.keys.clone())
        .collect();
    assert_eq!(cpu_stored, [0, 1, 2, 3, 4].map(|i| keys[i].clone()));
    let g3_stored: Vec<ChunkKey> = events
        .iter()
        .filter(|e| e.medium == EventMedium::Storage && !e.removed)
        .flat_map(|e| e.keys.clone())
        .collect();
    assert_eq!(g3_stored, keys, "G3's stores come as STORAGE events");
}

/// Stores `keys` through engine `c` (region `region`), ROWS keys a job (jobs 1, 2, ...),
/// the bytes of key i seeded with `seed + i`; returns the bytes and the last job id.
fn fill_g3(
    region: &PrimaryRegion,
    c: &NodeClient,
    keys: &[ChunkKey],
    seed: u64,
) -> (Vec<Vec<u8>>, u64) {
    let mut stored = Vec::new();
    let mut job = 0;
    for (j, chunk) in keys.chunks(ROWS as usize).enumerate() {
        let rows: Vec<u32> = (0..chunk.len() as u32).collect();
        for r in 0..chunk.len() {
            stored.push(fill(region, r, seed + (j * ROWS as usize + r) as u64));
        }
        job += 1;
        assert!(run(c, false, job, chunk, &rows));
    }
    (stored, job)
}

/// Whether G3's own index holds `k` (not the pool): a direct load grant is ready only for a
/// committed key. The grant is finished with the key's own CRC, so nothing is dropped.
fn g3_holds(f: &Fixture, k: &ChunkKey) -> bool {
    let slots = f
        .service
        .as_ref()
        .unwrap()
        .with_tier(|t| t.slot_grants())
        .unwrap();
    let grant = slots.begin_load(u64::MAX - 2, vec![k.clone()]).unwrap();
    let held = match grant.slots[0] {
        GrantedSlot::Ready { crc, .. } => Some(crc),
        _ => None,
    };
    let r = slots.finish(
        grant,
        vec![held.ok_or_else(|| kvtier::Error::new(kvtier::ErrorKind::Internal, "not held"))],
    );
    assert_eq!(r.success, held.is_some(), "{r:?}");
    held.is_some()
}

#[test]
fn chunks_served_only_from_the_pool_stay_recent_in_g3_and_untouched_ones_are_evicted() {
    let f = fixture(4);
    let total = status(&f)["tier"]["total_slots"].as_u64().unwrap() as u32;
    let (ra, a) = engine(&f, "rank-a");
    let (rb, b) = engine(&f, "rank-b");
    let (rc, c) = engine(&f, "rank-c");
    let keys: Vec<ChunkKey> = (0..total + 3).map(|i| key("recency", i)).collect();
    // A fills G3 to capacity, ROWS keys a job.
    let (stored, mut job) = fill_g3(&ra, &a, &keys[..total as usize], 3000);
    assert_eq!(status(&f)["tier"]["used_slots"], total, "G3 is full");
    // B loads 0, 1 and 2 from G3: G3 pins them (its most recently used) and the pool keeps
    // them.
    job += 1;
    assert!(run(&b, true, job, &keys[..3], &[0, 1, 2]));
    assert_eq!(row(&rb, 2), stored[2]);
    // G3's lookups of every other key (none staged) make 0, 1 and 2 its least recently used.
    let rest = &keys[3..total as usize];
    let deadline = Instant::now() + Duration::from_secs(20);
    while b
        .lookup(rest)
        .unwrap()
        .iter()
        .any(|r| *r != LookupResult::Hit)
    {
        assert!(Instant::now() < deadline, "G3 lookups never all HIT");
        std::thread::sleep(Duration::from_millis(5));
    }
    // C is served only by the pool: a load of 0, a lookup of 1, a hint of 2.
    let before = status(&f)["staging"].clone();
    job += 1;
    assert!(run(&c, true, job, &keys[..1], &[0]));
    assert_eq!(row(&rc, 0), stored[0]);
    assert_eq!(c.lookup(&keys[1..2]).unwrap(), [LookupResult::Hit]);
    c.request_hint("req-r", keys[2..3].to_vec()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    'hinted: loop {
        for ans in c.async_answers() {
            if let AsyncAnswer::Hinted(_, _, verdicts) = ans {
                assert_eq!(verdicts, [LookupResult::Hit]);
                break 'hinted;
            }
        }
        assert!(Instant::now() < deadline, "no answer to the HINT");
        std::thread::sleep(Duration::from_millis(2));
    }
    let after = status(&f)["staging"].clone();
    assert_eq!(
        after["hits"],
        before["hits"].as_u64().unwrap() + 1,
        "{after}"
    );
    assert_eq!(
        after["g3_loads"], before["g3_loads"],
        "C read nothing from G3: {after}"
    );
    assert_eq!(after["prefetched"], before["prefetched"], "{after}");

    // A stores three more keys: G3 evicts three, its least recently used.
    let fresh = &keys[total as usize..];
    for r in 0..3 {
        fill(&ra, r, 9000 + r as u64);
    }
    job += 1;
    assert!(run(&a, false, job, fresh, &[0, 1, 2]));
    let evicted: Vec<usize> = (0..total as usize + 3)
        .filter(|&i| !g3_holds(&f, &keys[i]))
        .collect();
    assert_eq!(
        evicted,
        [3, 4, 5],
        "the keys the pool served (0, 1, 2) were accessed after 3, 4, 5"
    );
    assert_eq!(metric(&f, "node_staging_g3_touches_total"), 3.0);
    assert_eq!(metric(&f, "node_staging_g3_touches_dropped_total"), 0.0);
}

fn prefetch_envelope(keys: &[ChunkKey]) -> KvHintsEnvelope {
    let hex: Vec<String> = keys.iter().map(|k| hex::encode(k.as_bytes())).collect();
    KvHintsEnvelope::from_json(
        &json!({
            "protocol_version": "1",
            "message_id": "m-1",
            "actions": [
                {"action_id": "p", "action_type": "kvtier.prefetch", "action_version": "1",
                 "payload": {"keys": hex}},
                {"action_id": "r", "action_type": "router.affinity", "action_version": "1",
                 "payload": {"worker": 3}},
            ],
        })
        .to_string(),
    )
    .unwrap()
}

fn wait_for(f: &Fixture, what: &str, cond: impl Fn(&serde_json::Value) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let st = status(f);
        if cond(&st) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {st}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_hint_makes_the_later_lookup_hit_from_staging_and_finishing_discards_the_unused() {
    let f = fixture(8);
    let (ra, a) = engine(&f, "rank-a");
    let keys: Vec<ChunkKey> = (0..4).map(|i| key("hinted", i)).collect();
    let rows: Vec<u32> = (0..4).collect();
    let stored: Vec<Vec<u8>> = (0..4).map(|i| fill(&ra, i, 900 + i as u64)).collect();
    assert!(run(&a, false, 1, &keys, &rows));

    // Rank B: the node service as its secondary tier (client mode).
    let (rb, mut tier) = client_tier(&f, "rank-b", None);
    // Without a hint the first lookup cannot know: RETRY while it asks.
    let plain = RequestContext::new("plain");
    tier.on_new_request(&plain);
    assert_eq!(tier.lookup(&keys[0], &plain), LookupResult::Retry);

    let req = RequestContext::new("req-7").with_kv_hints(prefetch_envelope(&keys));
    tier.on_new_request(&req);
    wait_for(&f, "the hint's keys staged", |st| {
        st["staging"]["prefetched"] == 4
    });
    // The hint's verdicts come with the HINT's answer.
    let deadline = Instant::now() + Duration::from_secs(20);
    while tier.hint_verdicts() < keys.len() {
        assert!(Instant::now() < deadline, "no answer to the HINT");
        std::thread::sleep(Duration::from_millis(2));
    }
    for k in &keys[1..3] {
        assert_eq!(
            tier.lookup(k, &req),
            LookupResult::Hit,
            "no RETRY for {k:?}"
        );
    }
    // Load two of the four; G3 is garbled first, so these bytes can only come from the pool.
    for (k, bytes) in keys.iter().zip(&stored) {
        garble_g3_slot(&f, k, bytes);
    }
    tier.submit_load(TransferJob {
        job_id: 10,
        keys: keys[1..3].to_vec(),
        chunk_ids: vec![5, 6],
        is_promotion: true,
        req_id: req.req_id.clone(),
        submit_time: Instant::now(),
    });
    tier.drain_jobs();
    let done = tier.get_finished_jobs();
    assert!(done.len() == 1 && done[0].success, "{done:?}");
    assert_eq!(row(&rb, 5), stored[1]);
    assert_eq!(row(&rb, 6), stored[2]);
    let st = status(&f);
    assert_eq!(st["staging"]["hits"], 2, "{st}");
    assert_eq!(st["staging"]["g3_loads"], 0, "{st}");
    assert_eq!(
        st["staging"]["held_slots"], 4,
        "held until the request finishes: {st}"
    );

    // The unknown action was ignored and counted; the prefetch action applied.
    let m: std::collections::HashMap<&str, f64> =
        tier.metrics().iter().map(|m| (m.name, m.value)).collect();
    assert_eq!(m["node_hint_actions_ignored"], 1.0);
    assert_eq!(m["node_hint_actions_applied"], 1.0);
    assert_eq!(m["node_hint_keys"], 4.0);
    assert_eq!(m["node_hint_lookups"], 2.0);

    // Finishing the request discards the two staged chunks it never loaded.
    tier.on_request_finished(&req);
    wait_for(&f, "the unused chunks discarded", |st| {
        st["staging"]["discarded"] == 2
    });
    let st = status(&f);
    assert_eq!(st["staging"]["used_slots"], 2, "{st}");
    assert_eq!(st["staging"]["held_slots"], 0, "{st}");
    // And the tier no longer answers from the hint: a lookup of a discarded key it never
    // looked up before asks the service.
    assert_eq!(tier.lookup(&keys[3], &req), LookupResult::Retry);
    tier.shutdown().unwrap();
}

#[test]
fn events_of_a_client_mode_tier_name_their_medium() {
    let f = fixture(4);
    let (ra, a) = engine(&f, "rank-a");
    let (_rb, mut tier) = client_tier(&f, "rank-b", Some(Locality::Local));
    assert!(tier.take_events().is_empty(), "the first call subscribes");
    // Wait until the subscription is in before anything happens.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !tier.events_subscribed() {
        assert!(Instant::now() < deadline);
        assert!(tier.take_events().is_empty());
        std::thread::sleep(Duration::from_millis(5));
    }
    let keys: Vec<ChunkKey> = (0..2).map(|i| key("ev", i)).collect();
    fill(&ra, 0, 1);
    fill(&ra, 1, 2);
    assert!(run(&a, false, 1, &keys, &[0, 1]));
    assert!(run(&a, true, 2, &keys, &[2, 3]));
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !(seen
        .iter()
        .any(|e: &OffloadingEvent| e.medium == Medium::Cpu)
        && seen.iter().any(|e| e.medium == Medium::Storage))
    {
        assert!(Instant::now() < deadline, "{seen:?}");
        seen.extend(tier.take_events());
        std::thread::sleep(Duration::from_millis(5));
    }
    for e in &seen {
        assert!(!e.removed);
        assert_eq!(e.keys, keys, "{e:?}");
        assert_eq!(e.locality, Some(Locality::Local));
        assert!(e.removal_expected);
    }
    tier.shutdown().unwrap();
}

#[test]
fn dram_bytes_mistakes_are_named() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("slabs")).unwrap();
    let e = config(dir.path(), json!("lots")).unwrap_err();
    assert!(e.to_string().contains("service.dram_bytes"), "{e}");
    let e = config(dir.path(), json!(-1)).unwrap_err();
    assert!(e.to_string().contains("service.dram_bytes"), "{e}");
    let small = config(dir.path(), json!(STRIDE - 1)).unwrap();
    let e = start_from_config(&small, STRIDE, None, DIGEST).unwrap_err();
    assert!(
        e.to_string().contains("service.dram_bytes") && e.to_string().contains("one slot"),
        "{e}"
    );
    let huge = config(dir.path(), json!("1000TiB")).unwrap();
    let e = start_from_config(&huge, STRIDE, None, DIGEST).unwrap_err();
    assert!(
        e.to_string().contains("service.dram_bytes") && e.to_string().contains("MemAvailable"),
        "{e}"
    );
    // The rule is the configuration's own, with the key path given.
    let mut s = ServiceConfig::new("/run/kvtier.sock");
    s.dram_bytes = 3 * STRIDE + 5;
    assert_eq!(s.staging_slots("service", STRIDE, None).unwrap(), 3);
}

#[test]
fn service_bench_reports_each_side_and_the_hint_side_comes_from_the_pool() {
    // One request per side, then three at once (each from an engine of its own).
    for concurrent in [1, 3] {
        service_bench_run(concurrent);
    }
}

fn service_bench_run(concurrent: u32) {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["service", "bench", "--dir"])
        .arg(dir.path())
        .args([
            "--row-size",
            "64KiB",
            "--chunks",
            "4",
            "--rounds",
            "2",
            "--lead-ms",
            "20",
            "--step-us",
            "500",
            "--concurrent-requests",
            &concurrent.to_string(),
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let side = |name: &str| {
        doc["sides"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["side"] == name)
            .unwrap_or_else(|| panic!("no side {name} in {doc}"))
            .clone()
    };
    // Behaviour, not timing: without a hint the lookups answer RETRY first and the chunks
    // come from G3; with one they HIT at once and every chunk comes from the pool; a second
    // engine's load of chunks the first one staged comes from the pool too.
    let (g3, hint, staged) = (side("g3"), side("hint"), side("staged"));
    assert!(g3["retry_steps_median"].as_f64().unwrap() >= 1.0, "{doc}");
    assert_eq!(g3["pool_hits_per_round_median"], 0.0, "{doc}");
    assert_eq!(hint["retry_steps_median"], 0.0, "{doc}");
    assert_eq!(hint["pool_hits_per_round_median"], 4.0, "{doc}");
    assert_eq!(staged["pool_hits_per_round_median"], 4.0, "{doc}");
    assert!(doc["store_gbps_median"].as_f64().unwrap() > 0.0, "{doc}");
    assert_eq!(doc["concurrent_requests"], concurrent, "{doc}");
    for s in [&g3, &hint, &staged] {
        // Every request of every round is measured.
        assert_eq!(
            s["lookup_to_loaded_ms"].as_array().unwrap().len(),
            2 * concurrent as usize,
            "{doc}"
        );
    }
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "the benchmark removes its folder"
    );
}

#[test]
fn vllms_touch_through_a_client_mode_tier_refreshes_g3s_lru() {
    let f = fixture(4);
    let total = status(&f)["tier"]["total_slots"].as_u64().unwrap() as u32;
    let (ra, a) = engine(&f, "rank-a");
    let keys: Vec<ChunkKey> = (0..total + 2).map(|i| key("touched", i)).collect();
    let (_, mut job) = fill_g3(&ra, &a, &keys[..total as usize], 7000);
    // G3's lookups of all but keys 0 and 1 make those two its least recently used.
    let deadline = Instant::now() + Duration::from_secs(20);
    while a
        .lookup(&keys[2..total as usize])
        .unwrap()
        .iter()
        .any(|r| *r != LookupResult::Hit)
    {
        assert!(Instant::now() < deadline, "G3 lookups never all HIT");
        std::thread::sleep(Duration::from_millis(5));
    }
    // vLLM's manager touches key 0 in every tier; the client-mode tier tells the service.
    let (_rb, mut tier) = client_tier(&f, "rank-b", None);
    tier.touch(&keys[..1], &RequestContext::new("touching"));
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(&f, "node_staging_g3_touches_total") < 1.0 {
        assert!(
            Instant::now() < deadline,
            "the touch never reached the service"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    // Two new keys: G3 evicts its two least recently used, now 1 and 2.
    fill(&ra, 0, 1);
    fill(&ra, 1, 2);
    job += 1;
    assert!(run(&a, false, job, &keys[total as usize..], &[0, 1]));
    let evicted: Vec<usize> = (0..total as usize + 2)
        .filter(|&i| !g3_holds(&f, &keys[i]))
        .collect();
    assert_eq!(evicted, [1, 2], "key 0 was touched after 1 and 2");
    tier.shutdown().unwrap();
}
