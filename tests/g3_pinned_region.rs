//! The G3 tier on the region a vLLM deployment really hands over (pinned in 4 KiB pages before
//! kvtier adopts it): its rows are staged through the engine's own 2 MiB pages and checksummed
//! in the same pass as the copy (`IoCompletion::row_crc`). The bytes must round-trip, and a
//! chunk whose bytes on disk changed must still fail its CRC check on load.

mod g3_common;

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use g3_common::*;
use kvtier::ErrorKind;
use kvtier::contract::secondary::SecondaryTier;
use kvtier::g3::{G3Tier, G3TierConfig, geometry_namespace};
use kvtier::region::{AdoptHugePages, PrimaryRegion};

const ROW: usize = 2 << 20;
const ROWS: usize = 8;

fn pinned_region() -> Option<Arc<PrimaryRegion>> {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() || kvtier::g3::slab::available_bytes(shm).unwrap_or(0) < 128 << 20 {
        kvtier::skip_test!("/dev/shm is missing or has under 128 MiB free");
        return None;
    }
    match PrimaryRegion::create_vllm_shaped_pinned(
        ROWS,
        ROW as u64,
        shm,
        AdoptHugePages::Auto,
        true,
    ) {
        Ok(r) if r.huge_pages() => {
            kvtier::skip_test!("/dev/shm gives 2 MiB pages here: nothing to stage");
            None
        }
        Ok(r) => Some(Arc::new(r)),
        Err(e) if e.kind() == ErrorKind::Unsupported => {
            kvtier::skip_test!("cannot pin here: {e}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

fn open_uring(r: &Arc<PrimaryRegion>, dir: &Path) -> G3Tier {
    let mut cfg = G3TierConfig::new(vec![dir.to_path_buf()], 8 * ROW as u64);
    cfg.io_engine = kvtier::io::IoEngineKind::Uring;
    let t = G3Tier::open(
        cfg,
        r.clone(),
        geometry_namespace(ROW as u64),
        "t".into(),
        None,
    )
    .unwrap();
    assert!(t.wait_recovered(Duration::from_secs(30)));
    t
}

#[test]
fn staged_rows_round_trip_and_a_changed_byte_on_disk_still_fails_its_crc() {
    let Some(region) = pinned_region() else {
        return;
    };
    let d = tmpdir();
    let mut t = open_uring(&region, d.path());
    if metric(&t, "g3_region_huge_pages") != 0.0 {
        panic!("a pinned region reported in 2 MiB pages");
    }
    for r in 0..4 {
        fill_row(&region, r, 100 + u64::from(r));
    }
    let res = run(&mut t, job(1, &[100, 101, 102, 103], &[0, 1, 2, 3], false));
    assert!(res.success, "{res:?}");
    let staged = metric(&t, "g3_staged_bytes");
    if staged == 0.0 {
        let control = PrimaryRegion::create(32, ROW as u64).unwrap();
        if control.huge_page_share() < 0.5 {
            kvtier::skip_test!("no free 2 MiB blocks for the staging memory now");
            return;
        }
        panic!("2 MiB rows of a pinned region were not staged");
    }
    assert_eq!(staged, (4 * ROW) as f64);
    for r in 0..ROWS as u32 {
        clear_row(&region, r);
    }
    let res = run(&mut t, job(2, &[103, 100, 102, 101], &[4, 5, 6, 7], true));
    assert!(res.success, "{res:?}");
    for (row, chunk) in [(4, 103u64), (5, 100), (6, 102), (7, 101)] {
        assert!(row_is(&region, row, chunk), "row {row} lacks chunk {chunk}");
    }
    assert_eq!(metric(&t, "g3_staged_bytes"), (8 * ROW) as f64);

    // One byte of chunk 102 changes on disk: its load must fail the CRC check (the CRC the
    // staging copy computed is of the bytes read), the others load.
    let want = pattern(102, ROW);
    let slab = std::fs::read_dir(d.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .max_by_key(|p| p.metadata().map(|m| m.len()).unwrap_or(0))
        .unwrap();
    let bytes = std::fs::read(&slab).unwrap();
    let at = bytes
        .chunks(4096)
        .position(|c| c == &want[..4096])
        .expect("chunk 102's bytes are in the slab")
        * 4096;
    let file = std::fs::OpenOptions::new().write(true).open(&slab).unwrap();
    file.write_all_at(&[bytes[at + 777] ^ 0x40], (at + 777) as u64)
        .unwrap();
    file.sync_all().unwrap();
    drop(file);
    let before = metric(&t, "g3_checksum_failures");
    let res = run(&mut t, job(3, &[100, 102, 103], &[0, 1, 2], true));
    assert!(!res.success, "{res:?}");
    let ok: Vec<_> = res.successful_keys.clone().unwrap_or_default();
    assert!(!ok.contains(&key(102)), "{res:?}");
    assert!(ok.contains(&key(100)) && ok.contains(&key(103)), "{res:?}");
    assert_eq!(metric(&t, "g3_checksum_failures"), before + 1.0);
    t.shutdown().unwrap();
}
