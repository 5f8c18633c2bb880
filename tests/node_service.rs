//! The node service with several engine processes: this test binary runs the service and
//! starts itself again as client processes (`child_process_entry`, driven by the
//! `KVTIER_NODE_CHILD` variable) that register regions in `/dev/shm` (as vLLM 0.33 makes
//! them) or pass a memfd, store and load through the service, and get killed mid-job.
//!
//! Byte equality is checked by this process reading the clients' region files itself, not
//! through kvtier.

mod node_common;

use std::io::{BufRead, BufReader, Read};
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvtier::config::{KvtierConfig, ServiceConfig};
use kvtier::node::start_from_config;
use kvtier::node::{ClientHello, NodeClient, NodeService};
use kvtier::{ChunkKey, ErrorKind, LookupResult, PrimaryRegion};
use serde_json::json;

use node_common::{key, payload_of};

/// Bytes per row (slot) in these tests.
const STRIDE: u64 = 64 * 1024;
/// Slots of the service's tier.
const SLOTS: u64 = 64;
/// Rows of each client's region.
const ROWS: u64 = 64;
/// The compatibility digest of the service in these tests.
const DIGEST: [u8; 32] = [0x42; 32];
const CHILD_VAR: &str = "KVTIER_NODE_CHILD";

struct Fixture {
    dir: tempfile::TempDir,
    service: Option<NodeService>,
    socket: PathBuf,
    shm_files: Vec<PathBuf>,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        drop(self.service.take());
        for f in &self.shm_files {
            let _ = std::fs::remove_file(f);
        }
    }
}

fn config(dir: &Path, mode: u32, uids: Vec<u32>) -> KvtierConfig {
    let mut cfg = kvtier::config::from_value(json!({
        "cpu_bytes_to_use": STRIDE * ROWS,
        "secondary_tiers": [{
            "type": "nvme",
            "paths": [dir.join("slabs").display().to_string()],
            "capacity_bytes": STRIDE * SLOTS,
            "direct_io": "auto",
        }],
    }))
    .unwrap();
    let mut service = ServiceConfig::new(dir.join("kvtier.sock"));
    service.socket_mode = mode;
    service.allowed_uids = uids;
    cfg.service = Some(service);
    cfg
}

fn fixture_with(mode: u32, uids: Vec<u32>) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), mode, uids);
    fixture_of(dir, &cfg, None)
}

/// The service of `cfg` (made by [`config`] for `dir`), storing `slot` bytes of each row
/// (`None`: the whole row), once its tier is ready.
fn fixture_of(dir: tempfile::TempDir, cfg: &KvtierConfig, slot: Option<u64>) -> Fixture {
    std::fs::create_dir(dir.path().join("slabs")).unwrap();
    let service = start_from_config(cfg, STRIDE, slot, DIGEST).unwrap();
    let socket = dir.path().join("kvtier.sock");
    let f = Fixture {
        dir,
        service: Some(service),
        socket,
        shm_files: Vec::new(),
    };
    wait_ready(&f);
    f
}

fn fixture() -> Fixture {
    fixture_with(0o600, Vec::new())
}

fn wait_ready(f: &Fixture) {
    let svc = f.service.as_ref().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !svc.is_ready() {
        assert!(Instant::now() < deadline, "the tier never recovered");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn hello(name: &str) -> ClientHello {
    ClientHello {
        engine: name.into(),
        row_stride: STRIDE,
        digest: DIGEST,
    }
}

/// A `/dev/shm` path for a client's region, unique to this test run.
fn shm_path(f: &mut Fixture, name: &str) -> PathBuf {
    let p = PathBuf::from(format!(
        "/dev/shm/kvtier_node_test_{}_{}_{name}.mmap",
        std::process::id(),
        f.dir.path().file_name().unwrap().to_string_lossy()
    ));
    f.shm_files.push(p.clone());
    p
}

/// A client in this process, its region (a memfd of `ROWS` rows) registered by descriptor.
fn client_in_this_process(f: &Fixture, name: &str) -> (PrimaryRegion, NodeClient) {
    let region = PrimaryRegion::create(ROWS as usize, STRIDE).unwrap();
    let c = NodeClient::connect(&f.socket, &hello(name)).unwrap();
    c.register_fd(region.fd().unwrap(), ROWS).unwrap();
    (region, c)
}

fn read_row(path: &Path, row: u64) -> Vec<u8> {
    use std::io::{Seek, SeekFrom};
    let mut file = std::fs::File::open(path).unwrap();
    file.seek(SeekFrom::Start(row * STRIDE)).unwrap();
    let mut buf = vec![0u8; STRIDE as usize];
    file.read_exact(&mut buf).unwrap();
    buf
}

/// What a child process does (JSON in `KVTIER_NODE_CHILD`).
#[derive(serde::Serialize, serde::Deserialize, Debug, Clone)]
struct ChildPlan {
    socket: PathBuf,
    name: String,
    /// `store`, `load`, `store-hang`, `load-hang`, `connect`.
    role: String,
    /// The region file (created like vLLM's: O_EXCL, 0600, ftruncate) or empty for a memfd
    /// passed by descriptor.
    region: String,
    tag: String,
    keys: u32,
    digest: [u8; 32],
}

/// A child process, killed if the test fails before it is waited for.
struct ChildGuard(Option<Child>);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl std::ops::Deref for ChildGuard {
    type Target = Child;
    fn deref(&self) -> &Child {
        self.0.as_ref().unwrap()
    }
}

impl std::ops::DerefMut for ChildGuard {
    fn deref_mut(&mut self) -> &mut Child {
        self.0.as_mut().unwrap()
    }
}

fn spawn_child(plan: &ChildPlan, uid: Option<u32>) -> ChildGuard {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(exe);
    cmd.args([
        "--exact",
        "child_process_entry",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_VAR, serde_json::to_string(plan).unwrap())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    if let Some(uid) = uid {
        use std::os::unix::process::CommandExt;
        cmd.uid(uid).gid(uid);
    }
    ChildGuard(Some(cmd.spawn().unwrap()))
}

/// Waits for the child's line starting with `CHILD:` and returns the rest.
fn child_line(child: &mut Child) -> String {
    let out = child.stdout.as_mut().unwrap();
    let mut r = BufReader::new(out);
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line).unwrap() == 0 {
            panic!("the child ended without reporting");
        }
        // libtest may print `test child_process_entry ... ` before it on the same line.
        if let Some(at) = line.find("CHILD:") {
            return line[at + "CHILD:".len()..].trim().to_string();
        }
    }
}

fn finish_child(mut child: ChildGuard) -> String {
    let line = child_line(&mut child);
    let status = child.0.take().unwrap().wait().unwrap();
    assert!(status.success(), "child failed: {line}");
    line
}

/// Not a test: the body of the client processes the tests start (does nothing unless
/// `KVTIER_NODE_CHILD` is set).
#[test]
fn child_process_entry() {
    let Ok(plan) = std::env::var(CHILD_VAR) else {
        return;
    };
    let plan: ChildPlan = serde_json::from_str(&plan).unwrap();
    let say = |s: String| {
        use std::io::Write;
        println!("CHILD:{s}");
        std::io::stdout().flush().unwrap();
    };
    let hello = ClientHello {
        engine: plan.name.clone(),
        row_stride: STRIDE,
        digest: plan.digest,
    };
    let client = match NodeClient::connect(&plan.socket, &hello) {
        Ok(c) => c,
        Err(e) => {
            say(format!("refused {} {}", e.kind(), e.message()));
            return;
        }
    };
    if plan.role == "connect" {
        say("connected".into());
        return;
    }
    // The region: a /dev/shm file as vLLM makes it, or a memfd passed by descriptor.
    let memfd;
    let base: *mut u8;
    if plan.region.is_empty() {
        memfd = PrimaryRegion::create(ROWS as usize, STRIDE).unwrap();
        client
            .register_fd(memfd.fd().unwrap().as_fd(), ROWS)
            .unwrap();
        base = memfd.base_ptr();
    } else {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&plan.region)
            .unwrap();
        file.set_len(ROWS * STRIDE).unwrap();
        let region = PrimaryRegion::map_shared_file(&file, ROWS as usize, STRIDE).unwrap();
        client.register_path(Path::new(&plan.region), ROWS).unwrap();
        base = region.base_ptr();
        std::mem::forget(region); // stays mapped for the process's life
    }
    let keys: Vec<ChunkKey> = (0..plan.keys).map(|i| key(&plan.tag, i)).collect();
    let rows: Vec<u32> = (0..plan.keys).collect();
    match plan.role.as_str() {
        "store" | "store-hang" => {
            // Random bytes in every row (this process alone knows them; the test reads them
            // back from the region file).
            let len = (ROWS * STRIDE) as usize;
            // SAFETY: the region is this process's own, mapped for `len` bytes.
            let all = unsafe { std::slice::from_raw_parts_mut(base, len) };
            let mut seed = std::process::id() as u64 | 1;
            for b in all.chunks_mut(8) {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                b.copy_from_slice(&seed.to_le_bytes()[..b.len()]);
            }
            client.submit_store(1, keys, rows);
        }
        "load" | "load-hang" => {
            let found = client.lookup(&keys).unwrap();
            if found.iter().any(|r| *r != LookupResult::Hit) {
                say(format!("lookup {found:?}"));
                std::process::exit(3);
            }
            client.submit_load(1, keys, rows);
        }
        other => panic!("unknown role {other}"),
    }
    if plan.role.ends_with("-hang") {
        say("submitted".into());
        // Killed by the test long before this ends.
        std::thread::sleep(Duration::from_secs(120));
        return;
    }
    let r = client
        .wait_finished(Duration::from_secs(60))
        .expect("job result");
    say(format!(
        "job {} success {} bytes {:?}",
        r.job_id, r.success, r.transfer_bytes
    ));
    if !r.success {
        std::process::exit(4);
    }
}

fn plan(f: &Fixture, name: &str, role: &str, region: &Path, tag: &str, keys: u32) -> ChildPlan {
    ChildPlan {
        socket: f.socket.clone(),
        name: name.into(),
        role: role.into(),
        region: region.display().to_string(),
        tag: tag.into(),
        keys,
        digest: DIGEST,
    }
}

#[test]
fn rank_a_stores_rank_b_loads_equal_bytes_through_the_service() {
    let mut f = fixture();
    let mode = std::fs::metadata(&f.socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the socket's default mode");
    let a_file = shm_path(&mut f, "a");
    let b_file = shm_path(&mut f, "b");
    let n = 24;
    let a = spawn_child(&plan(&f, "rank-a", "store", &a_file, "shared", n), None);
    let line = finish_child(a);
    assert!(line.contains("success true"), "{line}");
    let b = spawn_child(&plan(&f, "rank-b", "load", &b_file, "shared", n), None);
    let line = finish_child(b);
    assert!(line.contains("success true"), "{line}");
    for row in 0..u64::from(n) {
        let (x, y) = (read_row(&a_file, row), read_row(&b_file, row));
        assert!(x.iter().any(|b| *b != 0), "row {row} of rank A holds data");
        assert!(
            x == y,
            "row {row}: rank B loaded other bytes than rank A stored"
        );
    }
    // The rows beyond the job were not touched.
    assert!(read_row(&b_file, u64::from(n)).iter().all(|b| *b == 0));
    // Both sessions ended: nothing connected, nothing mapped.
    wait_no_engines(&f);
    assert_not_mapped(&a_file);
    assert_not_mapped(&b_file);
}

#[test]
fn a_region_passed_by_descriptor_stores_and_loads() {
    let mut f = fixture();
    let b_file = shm_path(&mut f, "b");
    let a = spawn_child(&plan(&f, "memfd-a", "store", Path::new(""), "fd", 8), None);
    assert!(finish_child(a).contains("success true"));
    // The loader's region is a file this process can read, the storer's was a memfd: what
    // rank A stored must equal what a third client, in this process, stores and loads back.
    let b = spawn_child(&plan(&f, "file-b", "load", &b_file, "fd", 8), None);
    assert!(finish_child(b).contains("success true"));
    let (region, c) = client_in_this_process(&f, "in-process");
    let keys: Vec<ChunkKey> = (0..8).map(|i| key("fd", i)).collect();
    c.submit_load(7, keys, (0..8).collect());
    let r = c.wait_finished(Duration::from_secs(30)).unwrap();
    assert!(r.success, "{:?}", r.error);
    for row in 0..8u64 {
        // The job is done; this test is the only user of the region.
        let mine = region.read_row(row as usize).unwrap();
        assert!(mine[..] == read_row(&b_file, row)[..], "row {row}");
        assert!(mine.iter().any(|b| *b != 0));
    }
}

#[test]
fn another_digest_is_refused_at_connect_with_both_digests() {
    let f = fixture();
    let mut h = hello("other-model");
    h.digest = [0x17; 32];
    let e = NodeClient::connect(&f.socket, &h).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::IncompatibleLayout, "{e}");
    let msg = e.to_string();
    assert!(msg.contains(&hex::encode([0x17u8; 32])), "{msg}");
    assert!(msg.contains(&hex::encode(DIGEST)), "{msg}");
    // Rows that cannot hold a slot (an engine of one namespace may have larger rows, never
    // smaller ones: `engines_whose_rows_hold_the_slot_share_the_pool_with_their_own_strides`).
    let mut h = hello("other-rows");
    h.row_stride = STRIDE / 2;
    let e = NodeClient::connect(&f.socket, &h).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::IncompatibleLayout, "{e}");
    assert!(e.to_string().contains("row stride"), "{e}");
    assert!(
        e.to_string()
            .contains(&format!("rows of {} bytes, smaller", STRIDE / 2)),
        "{e}"
    );
    assert!(
        e.to_string().contains(&format!("slots of {STRIDE} bytes")),
        "{e}"
    );
    assert!(f.service.as_ref().unwrap().engines_connected() == 0);
}

/// Engines of one namespace whose rows differ (vLLM's rows for replicated GQA heads at other
/// TP sizes) share the pool: each registers its region with its own row stride, the service
/// moves each row's first slot bytes and leaves the rest alone, through G3 and through the
/// DRAM staging pool. (The digest says what a slot holds; a row only has to hold one.)
#[test]
fn engines_whose_rows_hold_the_slot_share_the_pool_with_their_own_strides() {
    for dram_bytes in [0, STRIDE * 8] {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = config(dir.path(), 0o600, Vec::new());
        cfg.service.as_mut().unwrap().dram_bytes = dram_bytes;
        let f = fixture_of(dir, &cfg, None);
        let connect = |name: &str, stride: u64| {
            let region = PrimaryRegion::create(4, stride).unwrap();
            let mut h = hello(name);
            h.row_stride = stride;
            let c = NodeClient::connect(&f.socket, &h).unwrap();
            assert_eq!(c.service().row_stride, STRIDE, "the WELCOME names the slot");
            c.register_fd(region.fd().unwrap(), 4).unwrap();
            (region, c)
        };
        let (a_region, a) = connect("rows-1x", STRIDE);
        let (b_region, b) = connect("rows-4x", 4 * STRIDE);
        let status: serde_json::Value =
            serde_json::from_str(&f.service.as_ref().unwrap().status_json()).unwrap();
        let mut strides: Vec<u64> = status["engines"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["region"]["row_stride"].as_u64().unwrap())
            .collect();
        strides.sort_unstable();
        assert_eq!(strides, vec![STRIDE, 4 * STRIDE], "{status}");
        let slot = STRIDE as usize;
        let a_keys: Vec<ChunkKey> = (0..2).map(|i| key("rows-a", i)).collect();
        let b_keys: Vec<ChunkKey> = (0..2).map(|i| key("rows-b", i)).collect();
        for i in 0..2 {
            // No job is running; this test is the regions' only user.
            a_region
                .write_row(i)
                .unwrap()
                .copy_from_slice(&payload_of(&a_keys[i], STRIDE));
            // As above.
            let mut row = b_region.write_row(i).unwrap();
            row.fill(0x77);
            row[..slot].copy_from_slice(&payload_of(&b_keys[i], STRIDE));
            // As above.
            b_region.write_row(i + 2).unwrap().fill(0x77);
        }
        a.submit_store(1, a_keys.clone(), vec![0, 1]);
        b.submit_store(1, b_keys.clone(), vec![0, 1]);
        for c in [&a, &b] {
            let r = c.wait_finished(Duration::from_secs(30)).unwrap();
            assert!(r.success, "{:?}", r.error);
            assert_eq!(r.transfer_bytes, Some(2 * STRIDE), "slots were written");
        }
        // Twice: the second load of each key comes from the staging pool when there is one.
        for round in 0..2u64 {
            b.submit_load(2 + round, a_keys.clone(), vec![2, 3]);
            let r = b.wait_finished(Duration::from_secs(30)).unwrap();
            assert!(r.success, "{:?}", r.error);
            for (i, k) in a_keys.iter().enumerate() {
                // The load is reported; this test is the region's only user.
                let got = b_region.read_row(i + 2).unwrap();
                assert!(
                    got[..slot] == payload_of(k, STRIDE)[..],
                    "row {i}: the slot"
                );
                assert!(
                    got[slot..].iter().all(|b| *b == 0x77),
                    "dram {dram_bytes}, round {round}, row {i}: the bytes past the slot \
                     were not touched"
                );
                drop(got);
                // As above.
                b_region.write_row(i + 2).unwrap().fill(0x77);
            }
            a.submit_load(2 + round, b_keys.clone(), vec![2, 3]);
            let r = a.wait_finished(Duration::from_secs(30)).unwrap();
            assert!(r.success, "{:?}", r.error);
            for (i, k) in b_keys.iter().enumerate() {
                // The load is reported; this test is the region's only user.
                let got = a_region.read_row(i + 2).unwrap();
                assert!(got[..] == payload_of(k, STRIDE)[..], "row {i}");
            }
        }
        if dram_bytes > 0 {
            let status: serde_json::Value =
                serde_json::from_str(&f.service.as_ref().unwrap().status_json()).unwrap();
            assert!(
                status["staging"]["hits"].as_u64().unwrap() >= 4,
                "the second round came from the pool: {status}"
            );
        }
    }
}

#[test]
fn a_uid_not_on_the_allow_list_is_refused() {
    if !rustix::process::getuid().is_root() {
        kvtier::skip_test!("needs root to start a client under another uid");
        return;
    }
    // The socket is open to everyone; the peer check alone keeps uid 65534 out.
    let f = fixture_with(0o666, vec![0]);
    std::fs::set_permissions(f.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let exe = std::env::current_exe().unwrap();
    let readable = std::fs::metadata(&exe).unwrap().permissions().mode() & 0o005 == 0o005;
    if !readable {
        kvtier::skip_test!("the test binary is not executable by other users");
        return;
    }
    let mut p = plan(&f, "nobody", "connect", Path::new(""), "x", 0);
    p.socket = f.socket.clone();
    let child = spawn_child(&p, Some(65534));
    let line = finish_child(child);
    assert!(line.starts_with("refused permission_denied"), "{line}");
    assert!(line.contains("uid 65534"), "{line}");
    // The same test as root (allowed) connects.
    let ok = spawn_child(&p, None);
    assert_eq!(finish_child(ok), "connected");
}

#[test]
fn sigkill_of_a_client_mid_store_leaves_the_service_consistent() {
    let mut f = fixture();
    let a_file = shm_path(&mut f, "a");
    let n = 48;
    let mut a = spawn_child(
        &plan(&f, "doomed-store", "store-hang", &a_file, "k", n),
        None,
    );
    assert_eq!(child_line(&mut a), "submitted");
    a.kill().unwrap();
    a.wait().unwrap();
    wait_no_engines(&f);
    assert_not_mapped(&a_file);
    // Every key is either absent or holds exactly rank A's bytes: load what is there.
    let (region, c) = client_in_this_process(&f, "checker");
    let keys: Vec<ChunkKey> = (0..n).map(|i| key("k", i)).collect();
    let found = c.lookup(&keys).unwrap();
    let held: Vec<u32> = (0..n)
        .filter(|i| found[*i as usize] == LookupResult::Hit)
        .collect();
    eprintln!(
        "mid-store kill: {} of {n} keys were committed; service: {}",
        held.len(),
        f.service.as_ref().unwrap().status_json()
    );
    if !held.is_empty() {
        let hk = held.iter().map(|i| key("k", *i)).collect();
        c.submit_load(1, hk, (0..held.len() as u32).collect());
        let r = c.wait_finished(Duration::from_secs(30)).unwrap();
        assert!(r.success, "{:?}", r.error);
        for (row, i) in held.iter().enumerate() {
            // The job is done; this test is the only user of the region.
            let got = region.read_row(row).unwrap();
            assert!(got[..] == read_row(&a_file, u64::from(*i))[..], "key {i}");
        }
    }
    assert_all_slots_usable(&c, &region);
}

#[test]
fn sigkill_of_a_client_mid_load_leaves_the_service_consistent() {
    let mut f = fixture();
    let a_file = shm_path(&mut f, "a");
    let b_file = shm_path(&mut f, "b");
    let n = 48;
    let a = spawn_child(&plan(&f, "storer", "store", &a_file, "k", n), None);
    assert!(finish_child(a).contains("success true"));
    let mut b = spawn_child(&plan(&f, "doomed-load", "load-hang", &b_file, "k", n), None);
    assert_eq!(child_line(&mut b), "submitted");
    b.kill().unwrap();
    b.wait().unwrap();
    wait_no_engines(&f);
    assert_not_mapped(&b_file);
    // Everything rank A stored still loads, with its bytes.
    let (region, c) = client_in_this_process(&f, "checker");
    let keys: Vec<ChunkKey> = (0..n).map(|i| key("k", i)).collect();
    c.submit_load(1, keys, (0..n).collect());
    let r = c.wait_finished(Duration::from_secs(30)).unwrap();
    assert!(r.success, "{:?}", r.error);
    for row in 0..u64::from(n) {
        // The job is done; this test is the only user of the region.
        let got = region.read_row(row as usize).unwrap();
        assert!(got[..] == read_row(&a_file, row)[..], "row {row}");
    }
    // No pin of the killed load survives: every slot can be taken by new keys.
    assert_all_slots_usable(&c, &region);
}

/// Stores as many new keys as the tier has slots: that needs every old slot evicted, which a
/// leaked pin or reservation would forbid.
fn assert_all_slots_usable(c: &NodeClient, region: &PrimaryRegion) {
    let keys: Vec<ChunkKey> = (0..SLOTS as u32).map(|i| key("fresh", i)).collect();
    // No job of this client is running.
    region.write_row(0).unwrap().fill(0xEE);
    c.submit_store(99, keys.clone(), vec![0; keys.len()]);
    let r = c.wait_finished(Duration::from_secs(60)).unwrap();
    assert!(
        r.success,
        "a fresh store of every slot failed: {:?}",
        r.error
    );
    let found = c.lookup(&keys).unwrap();
    assert!(found.iter().all(|r| *r == LookupResult::Hit), "{found:?}");
}

fn wait_no_engines(f: &Fixture) {
    let svc = f.service.as_ref().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while svc.engines_connected() != 0 {
        assert!(
            Instant::now() < deadline,
            "sessions did not end: {}",
            svc.status_json()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// This process (the service) no longer maps `path`.
fn assert_not_mapped(path: &Path) {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let name = path.display().to_string();
    assert!(
        !maps.lines().any(|l| l.contains(&name)),
        "{name} is still mapped by the service"
    );
}

// ---- the service killed and restarted under load ---------------------------------------------

const SERVICE_VAR: &str = "KVTIER_NODE_SERVICE_CHILD";
/// Slots of the tier in the restart test (every key it stores fits: nothing is evicted).
const RESTART_SLOTS: u64 = 256;
/// Kills of the service in the restart test.
const KILLS: u64 = 3;
/// Keys per store job in the restart test.
const KEYS_PER_JOB: u32 = 4;

/// Not a test: the body of the service processes the restart test starts (does nothing unless
/// `KVTIER_NODE_SERVICE_CHILD` names the test's directory). Serves until stdin closes or it
/// is killed.
#[test]
fn service_process_entry() {
    let Ok(dir) = std::env::var(SERVICE_VAR) else {
        return;
    };
    let dir = PathBuf::from(dir);
    let mut cfg = config(&dir, 0o600, Vec::new());
    cfg.secondary_tiers[0]
        .params
        .insert("capacity_bytes".into(), json!(STRIDE * RESTART_SLOTS));
    let service = start_from_config(&cfg, STRIDE, None, DIGEST).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !service.with_tier(|t| t.is_recovered()) {
        assert!(Instant::now() < deadline, "the tier never recovered");
        std::thread::sleep(Duration::from_millis(5));
    }
    println!("SERVICE:ready");
    use std::io::Write;
    std::io::stdout().flush().unwrap();
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    service.shutdown().unwrap();
}

fn spawn_service(dir: &Path) -> ChildGuard {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args([
            "--exact",
            "service_process_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(SERVICE_VAR, dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let mut r = BufReader::new(out);
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            r.read_line(&mut line).unwrap() > 0,
            "the service process ended before it was ready"
        );
        if line.contains("SERVICE:ready") {
            break;
        }
    }
    ChildGuard(Some(child))
}

fn job(job_id: u64, keys: Vec<ChunkKey>, rows: Vec<u32>, load: bool) -> kvtier::TransferJob {
    kvtier::TransferJob {
        job_id,
        keys,
        chunk_ids: rows,
        is_promotion: load,
        req_id: "survival".into(),
        submit_time: Instant::now(),
    }
}

/// Waits (stepping the tier as an engine does) until job `id` is reported.
fn wait_job(t: &mut kvtier::node::NodeTier, id: u64) -> kvtier::JobResult {
    use kvtier::contract::secondary::SecondaryTier;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut done = t.get_finished_jobs();
        if let Some(at) = done.iter().position(|r| r.job_id == id) {
            assert_eq!(done.len(), 1, "one job at a time here: {done:?}");
            return done.swap_remove(at);
        }
        assert!(done.is_empty(), "a job nobody waits for: {done:?}");
        assert!(Instant::now() < deadline, "job {id} never reported");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The lookup verdict once it is no longer RETRY (the tier asks the service in the
/// background; MISS while it is disconnected).
fn settled_lookup(t: &mut kvtier::node::NodeTier, k: &ChunkKey) -> LookupResult {
    use kvtier::contract::secondary::SecondaryTier;
    let ctx = kvtier::RequestContext::new("survival");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match t.lookup(k, &ctx) {
            LookupResult::Retry => {
                assert!(Instant::now() < deadline, "lookup still RETRY after 60 s");
                std::thread::sleep(Duration::from_millis(1));
            }
            other => return other,
        }
    }
}

fn node_tier(socket: &Path, name: &str, region: &PrimaryRegion) -> kvtier::node::NodeTier {
    kvtier::node::NodeTier::connect(
        socket,
        &hello(name),
        kvtier::node::RegionSource::Fd(region.fd().unwrap()),
        ROWS,
        None,
    )
    .unwrap()
}

#[derive(Debug, Default)]
struct LoadReport {
    jobs_ok: u64,
    jobs_failed: u64,
    rows_checked: u64,
    reconnects: u64,
    losses: u64,
}

/// Engine A: stores jobs of fresh keys (rows filled with [`payload_of`]) until `stop`;
/// keys of jobs reported successful go to `committed`.
fn storer(
    socket: PathBuf,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    committed: std::sync::Arc<std::sync::Mutex<Vec<ChunkKey>>>,
) -> LoadReport {
    use kvtier::contract::secondary::SecondaryTier;
    let region = PrimaryRegion::create(ROWS as usize, STRIDE).unwrap();
    let mut t = node_tier(&socket, "storer", &region);
    let mut rep = LoadReport::default();
    let mut next = 0u32;
    let mut id = 0;
    while !stop.load(std::sync::atomic::Ordering::Acquire) {
        id += 1;
        // A failed job's keys are stored again by the next one (held ones are skipped).
        let keys: Vec<ChunkKey> = (next..next + KEYS_PER_JOB).map(|i| key("sv", i)).collect();
        assert!(
            u64::from(next + KEYS_PER_JOB) <= RESTART_SLOTS,
            "the test stores more than fits"
        );
        for (row, k) in keys.iter().enumerate() {
            // No job of this tier is running; this thread is the region's only user.
            region
                .write_row(row)
                .unwrap()
                .copy_from_slice(&payload_of(k, STRIDE));
        }
        t.submit_store(job(id, keys.clone(), (0..KEYS_PER_JOB).collect(), false));
        let r = wait_job(&mut t, id);
        if r.success {
            rep.jobs_ok += 1;
            next += KEYS_PER_JOB;
            committed.lock().unwrap().extend(keys);
        } else {
            rep.jobs_failed += 1;
            // Keys the job names as moved are committed too.
            let mut c = committed.lock().unwrap();
            for k in r.successful_keys.unwrap_or_default() {
                if !c.contains(&k) {
                    c.push(k);
                }
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    rep.reconnects = t.reconnects();
    rep.losses = t.connection_losses();
    // The same counts as the tier reports them to vLLM.
    let metric = |name: &str| {
        t.metrics()
            .into_iter()
            .find(|m| m.name == name)
            .unwrap_or_else(|| panic!("metric {name}"))
            .value
    };
    assert_eq!(metric("node_client_reconnects"), rep.reconnects as f64);
    assert_eq!(metric("node_client_connection_losses"), rep.losses as f64);
    assert_eq!(metric("node_client_connected"), 1.0);
    assert!(metric("node_client_reconnect_attempts") >= rep.reconnects as f64);
    assert!(metric("node_client_failed_jobs") >= rep.jobs_failed as f64);
    t.shutdown().unwrap();
    rep
}

/// Engine B: loads keys engine A committed (a HIT first) until `stop`, and checks every row a
/// load reports moved against [`payload_of`]: a wrong byte fails the test at once.
fn loader(
    socket: PathBuf,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    committed: std::sync::Arc<std::sync::Mutex<Vec<ChunkKey>>>,
) -> LoadReport {
    use kvtier::contract::secondary::SecondaryTier;
    let region = PrimaryRegion::create(ROWS as usize, STRIDE).unwrap();
    let mut t = node_tier(&socket, "loader", &region);
    let mut rep = LoadReport::default();
    let mut id = 0;
    let mut pick = 0usize;
    while !stop.load(std::sync::atomic::Ordering::Acquire) {
        let keys: Vec<ChunkKey> = {
            let c = committed.lock().unwrap();
            if c.is_empty() {
                drop(c);
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            (0..4)
                .map(|i| c[(pick + i * 7) % c.len()].clone())
                .collect()
        };
        pick += 1;
        let hits: Vec<ChunkKey> = keys
            .into_iter()
            .filter(|k| settled_lookup(&mut t, k) == LookupResult::Hit)
            .collect();
        if hits.is_empty() {
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        for row in 0..hits.len() {
            // As in `storer`; poison the rows so a load that moved nothing shows.
            region.write_row(row).unwrap().fill(0xA5);
        }
        id += 1;
        let n = hits.len() as u32;
        t.submit_load(job(id, hits.clone(), (0..n).collect(), true));
        let r = wait_job(&mut t, id);
        let moved: Vec<usize> = if r.success {
            rep.jobs_ok += 1;
            (0..hits.len()).collect()
        } else {
            rep.jobs_failed += 1;
            let ok = r.successful_keys.unwrap_or_default();
            (0..hits.len()).filter(|i| ok.contains(&hits[*i])).collect()
        };
        for i in moved {
            // The job is reported; this thread is the region's only user.
            let got = region.read_row(i).unwrap();
            assert!(
                got[..] == payload_of(&hits[i], STRIDE)[..],
                "load job {id} reported key {} moved but its row holds other bytes",
                hits[i]
            );
            rep.rows_checked += 1;
        }
    }
    rep.reconnects = t.reconnects();
    rep.losses = t.connection_losses();
    t.shutdown().unwrap();
    rep
}

#[test]
fn service_sigkill_under_load_clients_reconnect_and_committed_keys_load_exactly() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("slabs")).unwrap();
    let socket = dir.path().join("kvtier.sock");
    let mut service = spawn_service(dir.path());
    let stop = Arc::new(AtomicBool::new(false));
    let committed: Arc<Mutex<Vec<ChunkKey>>> = Default::default();
    let engines = [
        std::thread::spawn({
            let (s, st, c) = (socket.clone(), stop.clone(), committed.clone());
            move || storer(s, st, c)
        }),
        std::thread::spawn({
            let (s, st, c) = (socket.clone(), stop.clone(), committed.clone());
            move || loader(s, st, c)
        }),
    ];
    let wait_committed = |n: usize| {
        let deadline = Instant::now() + Duration::from_secs(60);
        while committed.lock().unwrap().len() < n {
            assert!(Instant::now() < deadline, "the engines made no progress");
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    // Under load: kill the service, leave the engines without it a while, start it again;
    // three times.
    let mut before_kills = Vec::new();
    for _ in 0..KILLS {
        let n = committed.lock().unwrap().len();
        wait_committed(n + 20);
        service.kill().unwrap();
        service.wait().unwrap();
        before_kills.push(committed.lock().unwrap().len());
        std::thread::sleep(Duration::from_millis(200));
        service = spawn_service(dir.path());
    }
    let n = committed.lock().unwrap().len();
    wait_committed(n + 20);
    stop.store(true, Ordering::Release);
    let [a, b] = engines.map(|t| t.join().unwrap());
    eprintln!("storer {a:?}\nloader {b:?}");
    for (name, r) in [("storer", &a), ("loader", &b)] {
        assert_eq!(
            r.losses, KILLS,
            "{name} lost its connection at each kill: {r:?}"
        );
        assert_eq!(
            r.reconnects, KILLS,
            "{name} reconnected by itself each time: {r:?}"
        );
        assert!(r.jobs_ok > 0, "{name} did work: {r:?}");
    }
    // It stored without pause, so some of its jobs met a dead service.
    assert!(a.jobs_failed > 0, "the storer saw failed jobs: {a:?}");
    assert!(b.rows_checked > 0, "the loader loaded rows: {b:?}");
    // Every key reported stored, before the kill and after, loads with its bytes from the
    // restarted service.
    let region = PrimaryRegion::create(ROWS as usize, STRIDE).unwrap();
    let mut t = node_tier(&socket, "checker", &region);
    let info: std::collections::HashMap<_, _> =
        kvtier::contract::secondary::SecondaryTier::config_info(&t)
            .into_iter()
            .collect();
    assert_eq!(info["kvtier_service_socket"], socket.display().to_string());
    assert_eq!(info["kvtier_service_region"], "fd");
    assert_eq!(info["kvtier_slot_bytes"], STRIDE.to_string());
    assert_eq!(info["kvtier_namespace"], hex::encode(DIGEST));
    let keys = committed.lock().unwrap().clone();
    for (j, chunk) in keys.chunks(ROWS as usize).enumerate() {
        for k in chunk {
            assert_eq!(settled_lookup(&mut t, k), LookupResult::Hit, "key {k}");
        }
        let id = j as u64 + 1;
        let n = chunk.len() as u32;
        kvtier::contract::secondary::SecondaryTier::submit_load(
            &mut t,
            job(id, chunk.to_vec(), (0..n).collect(), true),
        );
        let r = wait_job(&mut t, id);
        assert!(r.success, "{:?}", r.error);
        for (row, k) in chunk.iter().enumerate() {
            // The job is reported; this test is the region's only user.
            let got = region.read_row(row).unwrap();
            assert!(
                got[..] == payload_of(k, STRIDE)[..],
                "key {k} after the restart"
            );
        }
    }
    eprintln!(
        "{} keys stored (counts at the kills: {before_kills:?}) load byte-exact after the \
         restarts",
        keys.len()
    );
}

#[test]
fn with_a_slot_prefix_the_rows_first_bytes_move_and_the_rest_stays() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 0o600, Vec::new());
    let slot = STRIDE / 2;
    let f = fixture_of(dir, &cfg, Some(slot));
    let status: serde_json::Value =
        serde_json::from_str(&f.service.as_ref().unwrap().status_json()).unwrap();
    assert_eq!(status["slot_bytes"], slot, "{status}");
    assert_eq!(status["row_stride"], STRIDE, "{status}");
    let (a_region, a) = client_in_this_process(&f, "prefix-a");
    let (b_region, b) = client_in_this_process(&f, "prefix-b");
    let keys: Vec<ChunkKey> = (0..4).map(|i| key("prefix", i)).collect();
    for (row, k) in keys.iter().enumerate() {
        // No job is running; this test is the regions' only user.
        a_region
            .write_row(row)
            .unwrap()
            .copy_from_slice(&payload_of(k, STRIDE));
        // As above.
        b_region.write_row(row).unwrap().fill(0x77);
    }
    a.submit_store(1, keys.clone(), (0..4).collect());
    let r = a.wait_finished(Duration::from_secs(30)).unwrap();
    assert!(r.success, "{:?}", r.error);
    assert_eq!(
        r.transfer_bytes,
        Some(4 * slot),
        "slots of {slot} bytes were written"
    );
    b.submit_load(2, keys.clone(), (0..4).collect());
    let r = b.wait_finished(Duration::from_secs(30)).unwrap();
    assert!(r.success, "{:?}", r.error);
    let slot = slot as usize;
    for (row, k) in keys.iter().enumerate() {
        // The jobs are reported; this test is the region's only user.
        let got = b_region.read_row(row).unwrap();
        assert!(
            got[..slot] == payload_of(k, STRIDE)[..slot],
            "row {row}: the slot's bytes"
        );
        assert!(
            got[slot..].iter().all(|b| *b == 0x77),
            "row {row}: the bytes past the slot were not touched"
        );
    }
}

#[test]
fn a_restarted_service_with_another_digest_is_refused_until_the_right_one_returns() {
    use kvtier::contract::secondary::{HealthState, SecondaryTier};
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kvtier.sock");
    let start = |sub: &str, digest: [u8; 32]| {
        let d = dir.path().join(sub);
        std::fs::create_dir_all(d.join("slabs")).unwrap();
        let mut cfg = config(&d, 0o600, Vec::new());
        cfg.service.as_mut().unwrap().socket_path = socket.clone();
        start_from_config(&cfg, STRIDE, None, digest).unwrap()
    };
    let service = start("a", DIGEST);
    let region = PrimaryRegion::create(ROWS as usize, STRIDE).unwrap();
    let mut t = node_tier(&socket, "digest-check", &region);
    service.shutdown().unwrap();
    let other = [0x17; 32];
    let wrong = start("b", other);
    // The tier notices the loss on its next call, then its attempts are refused.
    let deadline = Instant::now() + Duration::from_secs(30);
    let why = loop {
        let _ = t.get_finished_jobs();
        let h = t.health();
        if let Some(p) = h.problems.iter().find(|p| p.contains("digest")) {
            assert_eq!(h.state, HealthState::Degraded, "{h:?}");
            break p.clone();
        }
        assert!(Instant::now() < deadline, "no refusal seen: {h:?}");
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(why.contains(&hex::encode(other)), "{why}");
    assert!(why.contains(&hex::encode(DIGEST)), "{why}");
    assert!(!t.ready());
    assert!(
        wrong.engines_connected() == 0,
        "the wrong service took the engine"
    );
    assert_eq!(
        t.lookup(&key("x", 0), &kvtier::RequestContext::new("r")),
        LookupResult::Miss
    );
    wrong.shutdown().unwrap();
    let _right = start("a", DIGEST);
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
    assert_eq!(t.reconnects(), 1);
    assert_eq!(t.health().state, HealthState::Ok);
    t.shutdown().unwrap();
}

/// Descriptors of this process open on `path`.
fn descriptors_on(path: &Path) -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|target| target == path)
        .count()
}

#[test]
fn shutdown_stops_and_joins_a_reconnection_waiting_for_a_service_that_never_answers() {
    use kvtier::contract::secondary::SecondaryTier;
    use std::os::unix::net::UnixListener;
    let mut f = fixture();
    let region_path = shm_path(&mut f, "reconnect-stop");
    let region = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&region_path)
        .unwrap();
    region.set_len(ROWS * STRIDE).unwrap();
    let mut t = kvtier::node::NodeTier::connect(
        &f.socket,
        &hello("reconnect-stop"),
        kvtier::node::RegionSource::Fd(region.as_fd()),
        ROWS,
        None,
    )
    .unwrap();
    // The tier keeps a duplicate of the region's descriptor to register it again; so does its
    // reconnection thread, through the tier's connector. The service (in this process) keeps
    // the descriptor it was registered with while the region is registered.
    assert_eq!(descriptors_on(&region_path), 3);
    // The service goes, and something that accepts connections and never answers takes its
    // socket.
    f.service.take().unwrap().shutdown().unwrap();
    let listener = UnixListener::bind(&f.socket).unwrap();
    listener.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut attempt = loop {
        // The tier notices the loss on its next call and starts reconnecting.
        let _ = t.get_finished_jobs();
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("accept: {e}"),
        }
        assert!(Instant::now() < deadline, "no reconnection attempt");
        std::thread::sleep(Duration::from_millis(5));
    };
    attempt.set_nonblocking(false).unwrap();
    attempt
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    // The attempt sent its HELLO and now waits for the answer (for up to 30 s).
    let mut header = [0u8; 16];
    attempt.read_exact(&mut header).unwrap();
    assert_eq!(u16::from_le_bytes([header[4], header[5]]), 0x0001, "HELLO");
    t.shutdown().unwrap();
    drop(t);
    // The reconnection thread is gone: nothing holds the tier's connector (and its duplicate
    // of the region's descriptor) any more...
    assert_eq!(
        descriptors_on(&region_path),
        1,
        "the reconnection thread outlived the tier's shutdown"
    );
    // ... and its attempt's socket is closed: this side reads the end of the stream.
    let mut rest = Vec::new();
    attempt.read_to_end(&mut rest).unwrap();
}

/// The node service's client tier, like every tier (`tests/tier_refused_jobs.rs`): a job it
/// cannot run (a row outside the registered region, keys and rows that differ in number, a
/// key it does not hold, a job after shutdown) is reported failed through
/// `get_finished_jobs`, once, and writes no row.
#[test]
fn a_job_the_node_tier_cannot_run_is_reported_failed() {
    use kvtier::contract::secondary::SecondaryTier;
    let f = fixture();
    let region = PrimaryRegion::create(ROWS as usize, STRIDE).unwrap();
    let mut t = node_tier(&f.socket, "refused", &region);
    let k = key("refused", 0);
    let jobs = [
        job(1, vec![k.clone()], vec![ROWS as u32], false),
        job(2, vec![k.clone()], vec![u32::MAX], true),
        job(3, vec![k.clone(), key("refused", 1)], vec![0], false),
        job(4, vec![key("refused", 9)], vec![0], true),
    ];
    for j in jobs {
        let (id, load) = (j.job_id, j.is_promotion);
        if load {
            t.submit_load(j);
        } else {
            t.submit_store(j);
        }
        let r = wait_job(&mut t, id);
        assert!(!r.success && r.error.is_some(), "job {id}: {r:?}");
    }
    // Every job is reported; this test is the region's only user.
    let zero = (0..ROWS as usize).all(|i| region.read_row(i).unwrap().iter().all(|b| *b == 0));
    assert!(zero, "a job that could not run wrote a row");
    t.shutdown().unwrap();
    t.submit_store(job(5, vec![k], vec![0], false));
    let r = wait_job(&mut t, 5);
    assert!(!r.success && r.error.is_some(), "{r:?}");
    assert!(t.get_finished_jobs().is_empty() && !t.has_pending_work());
}

// ---- the test hook: a service that holds jobs in flight ---------------------------------------

/// The status document of `svc`, parsed.
fn status_of(svc: &NodeService) -> serde_json::Value {
    serde_json::from_str(&svc.status_json()).unwrap()
}

/// Waits until the service holds `n` jobs after their I/O (`test_hold.held_jobs`).
fn wait_held(svc: &NodeService, n: u64) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let status = status_of(svc);
        if status["test_hold"]["held_jobs"] == n {
            return status;
        }
        assert!(Instant::now() < deadline, "never {n} jobs held: {status}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `kvtier::node::start_holding_jobs` (built with `internals`, what the Python tests kill an
/// engine mid-job with): while the hold file exists a store whose G3 writes are done stays in
/// flight (the service says so, the engine is not told), and it finishes once the file is gone;
/// a held store whose engine disconnects is cancelled and commits nothing. A service started
/// without the hook shows none (`test_hold` null).
#[test]
fn a_service_holding_jobs_keeps_them_in_flight_while_the_hold_file_exists() {
    let plain = fixture();
    assert!(status_of(plain.service.as_ref().unwrap())["test_hold"].is_null());
    drop(plain);

    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("slabs")).unwrap();
    let cfg = config(dir.path(), 0o600, Vec::new());
    let hold = dir.path().join("hold-jobs");
    let service = kvtier::node::start_holding_jobs(&cfg, STRIDE, None, DIGEST, &hold).unwrap();
    let f = Fixture {
        socket: dir.path().join("kvtier.sock"),
        dir,
        service: Some(service),
        shm_files: Vec::new(),
    };
    wait_ready(&f);
    let svc = f.service.as_ref().unwrap();
    let (region, c) = client_in_this_process(&f, "held");
    let kept: Vec<ChunkKey> = (0..4).map(|i| key("held", i)).collect();
    std::fs::write(&hold, b"").unwrap();
    c.submit_store(1, kept.clone(), (0..4).collect());
    let status = wait_held(svc, 1);
    assert_eq!(status["engines"][0]["jobs_in_flight"], 1, "{status}");
    assert_eq!(status["tier"]["active_transfers"], 1.0, "{status}");
    std::thread::sleep(Duration::from_millis(50));
    assert!(c.finished_jobs().is_empty(), "a held job was reported");
    std::fs::remove_file(&hold).unwrap();
    let r = c.wait_finished(Duration::from_secs(30)).unwrap();
    assert!(r.success, "{:?}", r.error);
    let status = status_of(svc);
    assert_eq!(status["test_hold"]["held_jobs"], 0, "{status}");
    assert_eq!(status["test_hold"]["held_total"], 1, "{status}");
    assert!(
        c.lookup(&kept)
            .unwrap()
            .iter()
            .all(|r| *r == LookupResult::Hit)
    );

    // Held again, and the engine goes away: the store is abandoned.
    let dropped: Vec<ChunkKey> = (0..4).map(|i| key("dropped", i)).collect();
    std::fs::write(&hold, b"").unwrap();
    c.submit_store(2, dropped.clone(), (0..4).collect());
    let cancelled_before = wait_held(svc, 1)["cancelled_jobs"].as_u64().unwrap();
    drop(c);
    drop(region);
    wait_no_engines(&f);
    let status = status_of(svc);
    assert_eq!(status["test_hold"]["held_jobs"], 0, "{status}");
    assert_eq!(
        status["cancelled_jobs"].as_u64().unwrap(),
        cancelled_before + 1,
        "{status}"
    );
    assert_eq!(status["tier"]["active_transfers"], 0.0, "{status}");
    std::fs::remove_file(&hold).unwrap();
    let (_region, checker) = client_in_this_process(&f, "checker");
    assert!(
        checker
            .lookup(&kept)
            .unwrap()
            .iter()
            .all(|r| *r == LookupResult::Hit)
    );
    assert!(
        checker
            .lookup(&dropped)
            .unwrap()
            .iter()
            .all(|r| *r == LookupResult::Miss)
    );
}
