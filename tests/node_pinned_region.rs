//! The node service on an engine's region as vLLM really hands it over: a `/dev/shm` file
//! pinned in 4 KiB pages (as `cudaHostRegister` pins it) before the engine registers it. The
//! service cannot collapse it, says so, stages its 2 MiB rows through its own 2 MiB pages with
//! the CRC computed in the copy, and the bytes round-trip (checked by reading the region file
//! itself, not through kvtier).

mod io_common;
mod node_common;

use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

use kvtier::config::ServiceConfig;
use kvtier::node::start_from_config;
use kvtier::node::{ClientHello, NodeClient};
use kvtier::region::{AdoptHugePages, PrimaryRegion};
use kvtier::{ChunkKey, ErrorKind};
use serde_json::json;

use io_common::region_file_of;
use node_common::{key, payload_of};

const STRIDE: u64 = 2 << 20;
const ROWS: u64 = 8;
const DIGEST: [u8; 32] = [0x29; 32];

#[test]
fn a_pinned_engine_region_is_staged_and_round_trips_through_the_service() {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() || kvtier::g3::slab::available_bytes(shm).unwrap_or(0) < 128 << 20 {
        kvtier::skip_test!("/dev/shm is missing or has under 128 MiB free");
        return;
    }
    let owner = match PrimaryRegion::create_vllm_shaped_pinned(
        ROWS as usize,
        STRIDE,
        shm,
        AdoptHugePages::Never,
        true,
    ) {
        Ok(r) if r.huge_pages() => {
            kvtier::skip_test!("/dev/shm gives 2 MiB pages here: nothing to stage");
            return;
        }
        Ok(r) => r,
        Err(e) if e.kind() == ErrorKind::Unsupported => {
            kvtier::skip_test!("cannot pin here: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let file = region_file_of(&owner);
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    std::fs::create_dir(dir.path().join("slabs")).unwrap();
    let mut cfg = kvtier::config::from_value(json!({
        "cpu_bytes_to_use": STRIDE * ROWS,
        "secondary_tiers": [{
            "type": "nvme",
            "paths": [dir.path().join("slabs").display().to_string()],
            "capacity_bytes": STRIDE * 8,
            "io_engine": "uring",
        }],
    }))
    .unwrap();
    cfg.service = Some(ServiceConfig::new(dir.path().join("kvtier.sock")));
    let service = match start_from_config(&cfg, STRIDE, None, DIGEST) {
        Ok(s) => s,
        Err(e) if e.kind() == ErrorKind::Unsupported => {
            kvtier::skip_test!("io_uring unavailable: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while !service.with_tier(|t| t.is_recovered()) {
        assert!(Instant::now() < deadline, "the tier never recovered");
        std::thread::sleep(Duration::from_millis(5));
    }
    let hello = ClientHello {
        engine: "pinned".into(),
        row_stride: STRIDE,
        digest: DIGEST,
    };
    let c = NodeClient::connect(&dir.path().join("kvtier.sock"), &hello).unwrap();
    c.register_fd(file.as_fd(), ROWS).unwrap();
    let status = service.status_json();
    assert!(status.contains("\"huge_page_share\":0.0"), "{status}");
    let keys: Vec<ChunkKey> = (0..4).map(|i| key("pinned", i)).collect();
    for (row, k) in keys.iter().enumerate() {
        file.write_all_at(&payload_of(k, STRIDE), row as u64 * STRIDE)
            .unwrap();
    }
    c.submit_store(1, keys.clone(), (0..4).collect());
    let r = c.wait_finished(Duration::from_secs(30)).unwrap();
    assert!(r.success, "{:?}", r.error);
    let metrics = service.metrics_text("kvtier:").unwrap();
    let staged = metrics
        .lines()
        .find(|l| l.starts_with("kvtier:node_engine_staged_bytes_total{engine=\"pinned\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
    let Some(staged) = staged else {
        let control = PrimaryRegion::create(32, STRIDE).unwrap();
        if control.huge_page_share() < 0.5 {
            kvtier::skip_test!("no free 2 MiB blocks for the staging memory now");
            return;
        }
        panic!("the pinned region's rows were not staged:\n{metrics}");
    };
    assert_eq!(staged, (4 * STRIDE) as f64, "{metrics}");
    // Loaded back, in another order, into the other rows.
    let order = [2usize, 0, 3, 1];
    c.submit_load(
        2,
        order.iter().map(|&i| keys[i].clone()).collect(),
        (4..8).collect(),
    );
    let r = c.wait_finished(Duration::from_secs(30)).unwrap();
    assert!(r.success, "{:?}", r.error);
    for (n, &i) in order.iter().enumerate() {
        let mut got = vec![0u8; STRIDE as usize];
        file.read_exact_at(&mut got, (4 + n as u64) * STRIDE)
            .unwrap();
        assert!(got == payload_of(&keys[i], STRIDE), "row {}", 4 + n);
    }
    // A second connection under the same engine name, with a pinned region of its own: the
    // engine's staged bytes are the two connections' together, as its other counters are.
    let before = staged_of(&service.metrics_text("kvtier:").unwrap());
    assert_eq!(before, Some((8 * STRIDE) as f64));
    let other = PrimaryRegion::create_vllm_shaped_pinned(
        ROWS as usize,
        STRIDE,
        shm,
        AdoptHugePages::Never,
        true,
    )
    .unwrap();
    let other_file = region_file_of(&other);
    let c2 = NodeClient::connect(&dir.path().join("kvtier.sock"), &hello).unwrap();
    c2.register_fd(other_file.as_fd(), ROWS).unwrap();
    let more: Vec<ChunkKey> = (10..12).map(|i| key("pinned", i)).collect();
    for (row, k) in more.iter().enumerate() {
        other_file
            .write_all_at(&payload_of(k, STRIDE), row as u64 * STRIDE)
            .unwrap();
    }
    c2.submit_store(1, more, vec![0, 1]);
    let r = c2.wait_finished(Duration::from_secs(30)).unwrap();
    assert!(r.success, "{:?}", r.error);
    let metrics = service.metrics_text("kvtier:").unwrap();
    assert_eq!(staged_of(&metrics), Some((10 * STRIDE) as f64), "{metrics}");
    drop(c2);
    drop(c);
    drop(service);
}

/// The `node_engine_staged_bytes_total` value of the engine named `pinned`.
fn staged_of(metrics: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| l.starts_with("kvtier:node_engine_staged_bytes_total{engine=\"pinned\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
}
