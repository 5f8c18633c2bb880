//! An engine that shrinks its region file while the node service has it registered: the
//! service must stay up (a CPU access to a lost page of a shared mapping is `SIGBUS`, which
//! would kill this whole test process with it), the engine's jobs fail with an error naming
//! it, its region and both sizes, no key of them reports success, its session ends, the chunks
//! in G3 stay, and another engine keeps storing and loading equal bytes.
//!
//! Engine A registers a `/dev/shm` file by path, as vLLM 0.33's region is registered; this
//! process writes and truncates that file through the file system only (it never maps it).
//! Engine B passes a memfd. The service has a DRAM staging pool, so that A's loads come both
//! from G3 and from the pool.

mod cli_common;
#[path = "../../tests/node_common/mod.rs"]
mod node_common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvtier::config::KvtierConfig;
use kvtier::node::start_from_config;
use kvtier::node::{ClientHello, NodeClient, NodeService};
use kvtier::{ChunkKey, ErrorKind, JobResult, PrimaryRegion};
use serde_json::json;

use node_common::{key, payload_of};

const STRIDE: u64 = 64 * 1024;
const ROWS: u64 = 16;
const SLOTS: u64 = 32;
const STAGING_SLOTS: u64 = 8;
const DIGEST: [u8; 32] = [0x3c; 32];

struct Fixture {
    _dir: tempfile::TempDir,
    service: Option<NodeService>,
    socket: PathBuf,
    shm_file: PathBuf,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        drop(self.service.take());
        let _ = std::fs::remove_file(&self.shm_file);
    }
}

fn config(dir: &Path) -> KvtierConfig {
    kvtier::config::from_value(json!({
        "cpu_bytes_to_use": STRIDE * ROWS,
        "service": {
            "socket_path": dir.join("kvtier.sock").display().to_string(),
            "dram_bytes": STAGING_SLOTS * STRIDE,
        },
        "secondary_tiers": [{
            "type": "nvme",
            "paths": [dir.join("slabs").display().to_string()],
            "capacity_bytes": STRIDE * SLOTS,
            "direct_io": "auto",
        }],
    }))
    .unwrap()
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("slabs")).unwrap();
    let service = start_from_config(&config(dir.path()), STRIDE, None, DIGEST).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !service.with_tier(|t| t.is_recovered()) {
        assert!(Instant::now() < deadline, "the tier never recovered");
        std::thread::sleep(Duration::from_millis(5));
    }
    let shm_file = PathBuf::from(format!(
        "/dev/shm/kvtier_shrink_test_{}_{}.mmap",
        std::process::id(),
        dir.path().file_name().unwrap().to_string_lossy()
    ));
    Fixture {
        socket: dir.path().join("kvtier.sock"),
        _dir: dir,
        service: Some(service),
        shm_file,
    }
}

fn connect(f: &Fixture, name: &str) -> NodeClient {
    let hello = ClientHello {
        engine: name.into(),
        row_stride: STRIDE,
        digest: DIGEST,
    };
    NodeClient::connect(&f.socket, &hello).unwrap()
}

/// Engine B: a memfd region passed by descriptor, registered.
fn engine_b(f: &Fixture) -> (PrimaryRegion, NodeClient) {
    let region = PrimaryRegion::create(ROWS as usize, STRIDE).unwrap();
    let b = connect(f, "rank-b");
    b.register_fd(region.fd().unwrap(), ROWS).unwrap();
    (region, b)
}

/// A region file's bytes: row `i` holds `keys[i]`'s payload, the rows after them zeros.
fn region_file_of(keys: &[ChunkKey]) -> Vec<u8> {
    let mut bytes = vec![0u8; (ROWS * STRIDE) as usize];
    for (i, k) in keys.iter().enumerate() {
        bytes[i * STRIDE as usize..][..STRIDE as usize].copy_from_slice(&payload_of(k, STRIDE));
    }
    bytes
}

fn run_job(c: &NodeClient, id: u64, load: bool, keys: &[ChunkKey], rows: &[u32]) -> JobResult {
    if load {
        c.submit_load(id, keys.to_vec(), rows.to_vec());
    } else {
        c.submit_store(id, keys.to_vec(), rows.to_vec());
    }
    let r = c
        .wait_finished(Duration::from_secs(60))
        .expect("the job is answered");
    assert_eq!(r.job_id, id);
    r
}

fn status(f: &Fixture) -> serde_json::Value {
    serde_json::from_str(&f.service.as_ref().unwrap().status_json()).unwrap()
}

/// Engine B (a memfd passed by descriptor) stores `keys` from `rows` and loads them into
/// `into`; every loaded row must hold its key's bytes.
fn b_stores_and_loads(b: &NodeClient, region: &PrimaryRegion, id: u64, keys: &[ChunkKey]) {
    let rows: Vec<u32> = (0..keys.len() as u32).collect();
    for (k, &row) in keys.iter().zip(&rows) {
        // No job of B runs now; this test is the only user of B's rows.
        region
            .write_row(row as usize)
            .unwrap()
            .copy_from_slice(&payload_of(k, STRIDE));
    }
    let r = run_job(b, id, false, keys, &rows);
    assert!(r.success, "engine B's store: {:?}", r.error);
    b_loads(b, region, id + 1, keys);
}

/// Engine B loads `keys` into its last rows and checks their bytes.
fn b_loads(b: &NodeClient, region: &PrimaryRegion, id: u64, keys: &[ChunkKey]) {
    let into: Vec<u32> = (0..keys.len() as u32)
        .map(|i| ROWS as u32 - 1 - i)
        .collect();
    for &row in &into {
        // As above.
        region.write_row(row as usize).unwrap().fill(0);
    }
    let r = run_job(b, id, true, keys, &into);
    assert!(r.success, "engine B's load: {:?}", r.error);
    for (k, &row) in keys.iter().zip(&into) {
        // The job is done.
        let got = region.read_row(row as usize).unwrap();
        assert!(
            got[..] == payload_of(k, STRIDE)[..],
            "engine B loaded other bytes for {k}"
        );
    }
}

#[derive(Debug, Clone, Copy)]
enum Case {
    /// A stores from rows its file lost.
    Store,
    /// A loads a chunk only G3 holds into a row its file lost.
    LoadFromG3,
    /// A loads a chunk the staging pool holds into a row its file lost.
    LoadFromPool,
}

fn shrink_case(case: Case, shrink_to: u64) {
    let f = fixture();
    let (b_region, b) = engine_b(&f);

    // Engine A's region: a /dev/shm file whose rows 0..4 hold a-0..a-3.
    let a_keys: Vec<ChunkKey> = (0..4).map(|i| key("a", i)).collect();
    std::fs::write(&f.shm_file, region_file_of(&a_keys)).unwrap();
    let a = connect(&f, "rank-a");
    a.register_path(&f.shm_file, ROWS).unwrap();
    let r = run_job(&a, 1, false, &a_keys, &[0, 1, 2, 3]);
    assert!(
        r.success,
        "engine A's store before the shrink: {:?}",
        r.error
    );
    // B loads a-0 and a-1: from G3, and now they are staged.
    b_loads(&b, &b_region, 100, &a_keys[..2]);
    assert!(status(&f)["staging"]["used_slots"].as_u64().unwrap() >= 2);

    // Engine A shrinks its region file (its last row is gone either way).
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f.shm_file)
        .unwrap()
        .set_len(shrink_to)
        .unwrap();
    let last = ROWS as u32 - 1;
    let (load, keys, rows) = match case {
        Case::Store => (
            false,
            vec![key("a", 10), key("a", 11)],
            vec![last - 1, last],
        ),
        Case::LoadFromG3 => (true, vec![a_keys[2].clone()], vec![last]),
        Case::LoadFromPool => (true, vec![a_keys[0].clone()], vec![last]),
    };
    let r = run_job(&a, 2, load, &keys, &rows);
    assert!(
        !r.success,
        "{case:?}: a job into a lost region reported success"
    );
    assert!(
        r.successful_keys.as_ref().is_none_or(|k| k.is_empty()),
        "{case:?}: keys reported loaded: {:?}",
        r.successful_keys
    );
    let e = r.error.expect("the failure says why");
    assert_eq!(e.kind(), ErrorKind::RegionLost, "{case:?}: {e}");
    let msg = e.to_string();
    for part in [
        "rank-a".to_string(),
        f.shm_file.display().to_string(),
        format!("{} bytes registered", ROWS * STRIDE),
        format!("holds {shrink_to} bytes now"),
    ] {
        assert!(msg.contains(&part), "{case:?}: {part:?} not in {msg}");
    }
    // The session of A ends; B's stays.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let names: Vec<String> = status(&f)["engines"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["name"].as_str().unwrap().to_string())
            .collect();
        if names == ["rank-b"] {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "engines still connected: {names:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let r = run_job(&a, 3, true, &a_keys[..1], &[0]);
    assert!(!r.success, "a job of the ended session: {r:?}");

    // The service is up: B stores and loads equal bytes, and every chunk A stored before the
    // shrink is still in G3 (a failed load into a lost row blames no chunk).
    let b_keys: Vec<ChunkKey> = (0..4).map(|i| key("b", i)).collect();
    b_stores_and_loads(&b, &b_region, 200, &b_keys);
    b_loads(&b, &b_region, 300, &a_keys);
    let svc = f.service.as_ref().unwrap();
    let keys_in_g3 = svc.with_tier(|t| t.len());
    assert_eq!(
        keys_in_g3, 8,
        "{case:?}: A's 4 and B's 4 chunks, nothing of the failed store"
    );

    // What happened is visible: STATUS, /metrics and `kvtier service status`.
    let doc = status(&f);
    assert_eq!(doc["regions_lost"], 1);
    let lost = &doc["last_region_lost"];
    assert_eq!(lost["engine"], "rank-a");
    assert_eq!(lost["path"], f.shm_file.display().to_string());
    assert_eq!(lost["expected_bytes"], ROWS * STRIDE);
    assert_eq!(lost["found_bytes"], shrink_to);
    let metrics = svc.metrics_text("kvtier:").unwrap();
    assert!(
        metrics.contains("kvtier:node_regions_lost_total 1"),
        "{metrics}"
    );
    let socket = f.socket.display().to_string();
    let out = cli_common::kvtier(&["service", "status", "--socket", &socket]);
    cli_common::assert_success(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    let line = format!(
        "1 region lost (shrunk by its engine while registered); the last: engine \
         rank-a (pid {}), region {}, {} bytes registered, {shrink_to} bytes found",
        std::process::id(),
        f.shm_file.display(),
        ROWS * STRIDE
    );
    assert!(text.contains(&line), "{line:?} not in:\n{text}");
}

#[test]
fn a_store_from_a_region_shrunk_to_nothing_fails_and_the_service_stays_up() {
    shrink_case(Case::Store, 0);
}

#[test]
fn a_load_from_g3_into_a_region_shrunk_to_half_fails_and_keeps_the_chunk() {
    shrink_case(Case::LoadFromG3, ROWS * STRIDE / 2);
}

#[test]
fn a_load_from_the_staging_pool_into_a_shrunk_region_fails() {
    shrink_case(Case::LoadFromPool, ROWS * STRIDE / 2);
}

/// The shrink lands while A's jobs run (a thread truncates the file after a few ms while A
/// loads without pause, from the staging pool and from G3): the job it hits must fail with
/// the region named, whether the check before the job, a copy in it, or the check after it
/// saw the loss, and the service must stay up. Rounds repeat (a fresh session and file each)
/// until one shrink landed inside a job (its job passed the check before it), at most 20.
#[test]
fn a_shrink_while_jobs_run_fails_the_job_it_hits_and_the_service_stays_up() {
    let mut f = fixture();
    let (b_region, b) = engine_b(&f);
    let a_keys: Vec<ChunkKey> = (0..8).map(|i| key("a", i)).collect();
    let bytes = region_file_of(&a_keys);
    let mut inside = 0;
    let mut rounds = 0;
    let mut job_id = 1000;
    while rounds < 20 && inside == 0 {
        rounds += 1;
        let path = PathBuf::from(format!("{}.{rounds}", f.shm_file.display()));
        std::fs::write(&path, &bytes).unwrap();
        // Removed by the fixture if this round fails.
        f.shm_file = path.clone();
        let a = connect(&f, "rank-a");
        a.register_path(&path, ROWS).unwrap();
        if rounds == 1 {
            job_id += 1;
            let r = run_job(&a, job_id, false, &a_keys, &(0..8).collect::<Vec<_>>());
            assert!(r.success, "{:?}", r.error);
            // Half of them staged: A's loads come from the pool and from G3.
            b_loads(&b, &b_region, 900, &a_keys[..4]);
        }
        let shrinker = {
            let path = path.clone();
            let delay = Duration::from_micros(500 + 700 * rounds as u64);
            std::thread::spawn(move || {
                std::thread::sleep(delay);
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .unwrap()
                    .set_len(0)
                    .unwrap();
            })
        };
        let failure = loop {
            job_id += 1;
            let r = run_job(&a, job_id, true, &a_keys, &(8..16).collect::<Vec<_>>());
            if !r.success {
                break r;
            }
            assert!(job_id < 1_000_000, "the shrink never failed a job");
        };
        shrinker.join().unwrap();
        let _ = std::fs::remove_file(&path);
        assert!(
            failure
                .successful_keys
                .as_ref()
                .is_none_or(|k| k.is_empty()),
            "keys reported loaded: {:?}",
            failure.successful_keys
        );
        let e = failure.error.expect("the failure says why");
        assert_eq!(e.kind(), ErrorKind::RegionLost, "{e}");
        assert!(e.to_string().contains(&path.display().to_string()), "{e}");
        println!("round {rounds}: {e}");
        if !e.to_string().contains("seen before the job") {
            inside += 1;
        }
        // The service is up and B works.
        b_loads(&b, &b_region, 2 * job_id, &a_keys);
    }
    println!("{rounds} rounds; the shrink landed inside a job in {inside}");
    assert!(
        inside > 0,
        "in {rounds} rounds no shrink landed inside a job"
    );
}

/// Engine A as vLLM's tier in client mode (`NodeTier`): after its region was lost, its
/// reconnection attempts are refused while the file is short (health says why), and once the
/// file is whole again it reconnects by itself and stores and loads equal bytes.
#[test]
fn a_node_tier_whose_region_was_lost_reconnects_once_its_file_is_whole_again() {
    use kvtier::contract::secondary::HealthState;
    use kvtier::contract::secondary::SecondaryTier;
    let f = fixture();
    let t_keys: Vec<ChunkKey> = (0..2).map(|i| key("t", i)).collect();
    let bytes = region_file_of(&t_keys);
    std::fs::write(&f.shm_file, &bytes).unwrap();
    let mut t = kvtier::node::NodeTier::connect(
        &f.socket,
        &ClientHello {
            engine: "tier-a".into(),
            row_stride: STRIDE,
            digest: DIGEST,
        },
        kvtier::node::RegionSource::Path(&f.shm_file),
        ROWS,
        None,
    )
    .unwrap();
    let job = |id: u64, load: bool, keys: Vec<ChunkKey>, rows: Vec<u32>| kvtier::TransferJob {
        job_id: id,
        keys,
        chunk_ids: rows,
        is_promotion: load,
        req_id: "shrink".into(),
        submit_time: Instant::now(),
    };
    let wait = |t: &mut kvtier::node::NodeTier, id: u64| -> JobResult {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(r) = t.get_finished_jobs().into_iter().find(|r| r.job_id == id) {
                return r;
            }
            assert!(Instant::now() < deadline, "job {id} never reported");
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&f.shm_file)
        .unwrap();
    file.set_len(0).unwrap();
    t.submit_store(job(1, false, vec![key("t", 0)], vec![0]));
    let r = wait(&mut t, 1);
    assert!(!r.success);
    assert_eq!(
        r.error.as_ref().map(|e| e.kind()),
        Some(ErrorKind::RegionLost),
        "{r:?}"
    );
    // Refused while the file is short: health says why.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let _ = t.get_finished_jobs();
        let h = t.health();
        if h.problems.iter().any(|p| p.contains("holds 0 bytes")) {
            assert_eq!(h.state, HealthState::Degraded, "{h:?}");
            break;
        }
        assert!(Instant::now() < deadline, "no refusal seen: {h:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(!t.ready());
    // The engine makes its file whole again (its rows rewritten): the tier reconnects by
    // itself, and what it stores loads back equal.
    std::fs::write(&f.shm_file, &bytes).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !t.ready() {
        let _ = t.get_finished_jobs();
        assert!(
            Instant::now() < deadline,
            "never reconnected: {:?}",
            t.health()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(t.health().state, HealthState::Ok);
    t.submit_store(job(2, false, vec![key("t", 0), key("t", 1)], vec![0, 1]));
    let r = wait(&mut t, 2);
    assert!(r.success, "{:?}", r.error);
    t.submit_load(job(3, true, vec![key("t", 0), key("t", 1)], vec![8, 9]));
    let r = wait(&mut t, 3);
    assert!(r.success, "{:?}", r.error);
    let now = std::fs::read(&f.shm_file).unwrap();
    for (i, row) in [8usize, 9].into_iter().enumerate() {
        let got = &now[row * STRIDE as usize..][..STRIDE as usize];
        assert!(
            got == payload_of(&key("t", i as u32), STRIDE).as_slice(),
            "row {row}"
        );
    }
    t.shutdown().unwrap();
}
