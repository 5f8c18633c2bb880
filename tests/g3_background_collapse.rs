//! An adopted region whose collapse does not fit the constructor's budget: the collapse goes
//! on in the background while the G3 tier serves. One test in its own binary (process): it
//! sets `KVTIER_COLLAPSE_BUDGET_MS`, which every adoption in the process reads.

mod g3_common;

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use g3_common::*;
use kvtier::contract::secondary::SecondaryTier;
use kvtier::g3::{G3Tier, G3TierConfig, geometry_namespace};
use kvtier::region::{AdoptHugePages, PrimaryRegion};

const ROW: usize = 2 << 20;

/// An unpinned vLLM-shaped region whose collapse does not fit the constructor's budget (here
/// 0 ms, `KVTIER_COLLAPSE_BUDGET_MS`): the constructor returns at once, the collapse goes on in
/// the background while the tier stores and loads (the bytes round-trip throughout), and the
/// region ends in 2 MiB pages as the kernel's page flags say.
#[test]
fn a_collapse_continues_in_the_background_while_the_tier_serves() {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() || kvtier::g3::slab::available_bytes(shm).unwrap_or(0) < 128 << 20 {
        kvtier::skip_test!("/dev/shm is missing or has under 128 MiB free");
        return;
    }
    // SAFETY: the only test of this binary, and no other thread of it reads or writes the
    // environment while it is changed.
    unsafe { std::env::set_var("KVTIER_COLLAPSE_BUDGET_MS", "0") };
    let rows = 32;
    let region = Arc::new(
        PrimaryRegion::create_vllm_shaped(rows, ROW as u64, shm, AdoptHugePages::Auto).unwrap(),
    );
    // SAFETY: as above (the collapse thread the region started does not read it).
    unsafe { std::env::remove_var("KVTIER_COLLAPSE_BUDGET_MS") };
    if region
        .small_pages_reason()
        .is_some_and(|w| !w.contains("background"))
    {
        kvtier::skip_test!(
            "no collapse here: {}",
            region.small_pages_reason().unwrap_or_default()
        );
        return;
    }
    let d = tmpdir();
    let mut cfg = G3TierConfig::new(vec![d.path().to_path_buf()], 32 * ROW as u64);
    cfg.io_engine = kvtier::io::IoEngineKind::Uring;
    let mut t = G3Tier::open(
        cfg,
        region.clone(),
        geometry_namespace(ROW as u64),
        "t".into(),
        None,
    )
    .unwrap();
    assert!(t.wait_recovered(Duration::from_secs(30)));
    for round in 0..4u64 {
        let keys: Vec<u64> = (0..8).map(|i| 1000 * round + i).collect();
        for (r, k) in keys.iter().enumerate() {
            fill_row(&region, r as u32, *k);
        }
        let res = run(
            &mut t,
            job(10 + round, &keys, &(0..8).collect::<Vec<_>>(), false),
        );
        assert!(res.success, "{res:?}");
        let res = run(
            &mut t,
            job(20 + round, &keys, &(8..16).collect::<Vec<_>>(), true),
        );
        assert!(res.success, "{res:?}");
        for (r, k) in keys.iter().enumerate() {
            assert!(
                row_is(&region, 8 + r as u32, *k),
                "round {round}, row {}",
                8 + r
            );
        }
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while region.huge_page_share() < 1.0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    if region.huge_page_share() < 1.0 {
        kvtier::skip_test!(
            "the background collapse got {:.0} % (memory fragmented?)",
            region.huge_page_share() * 100.0
        );
        return;
    }
    assert!(region.huge_pages());
    assert!(!region.collapsing_in_background());
    // The kernel agrees: every 2 MiB page of kvtier's mapping is a huge page.
    if let Ok(pagemap) = std::fs::File::open("/proc/self/pagemap") {
        for i in 0..rows {
            let addr = region.base_ptr() as usize + i * ROW;
            let mut e = [0u8; 8];
            pagemap
                .read_exact_at(&mut e, (addr / 4096 * 8) as u64)
                .unwrap();
            let pfn = u64::from_le_bytes(e) & ((1 << 55) - 1);
            if pfn == 0 {
                kvtier::skip_test!("no frame numbers in pagemap (not root)");
                break;
            }
            let flags = std::fs::File::open("/proc/kpageflags").unwrap();
            let mut f = [0u8; 8];
            flags.read_exact_at(&mut f, pfn * 8).unwrap();
            assert!(
                u64::from_le_bytes(f) & (1 << 22) != 0,
                "page {i} is not huge"
            );
        }
    }
    assert_eq!(metric(&t, "g3_region_huge_pages"), 1.0);
    t.shutdown().unwrap();
}
