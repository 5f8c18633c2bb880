//! The memory a vLLM 0.33 deployment really hands kvtier: its `/dev/shm` region, pinned by
//! `cudaHostRegister` in 4 KiB pages before kvtier adopts it (reproduced with the same
//! `FOLL_LONGTERM` pin, an io_uring buffer registration). kvtier must say how the memory is
//! backed (checked here against the kernel's own page flags, `/proc/self/pagemap` and
//! `/proc/kpageflags`, not against kvtier's measurement), and must move the right bytes through
//! its staging path, in-process and for the node service's mapped regions.

mod io_common;

use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use io_common::*;
use kvtier::ErrorKind;
use kvtier::io::{EngineOptions, IoDir, IoEngineKind, IoRequest, open_engine};
use kvtier::region::{AdoptHugePages, PrimaryRegion};

const ROW: usize = 2 << 20;
const ROWS: usize = 8;
const HUGE: usize = 2 << 20;

fn shm_ready() -> bool {
    let dir = Path::new("/dev/shm");
    if !dir.is_dir() || kvtier::g3::slab::available_bytes(dir).unwrap_or(0) < 128 << 20 {
        kvtier::skip_test!("/dev/shm is missing or has under 128 MiB free");
        return false;
    }
    true
}

/// The kernel's word on the page at `addr`: whether it is part of a transparent huge page
/// (`KPF_THP`, bit 22 of `/proc/kpageflags`). `None` where the physical frame cannot be read
/// (not root: `/proc/self/pagemap` hides frame numbers).
fn kernel_says_huge(addr: usize) -> Option<bool> {
    let pagemap = std::fs::File::open("/proc/self/pagemap").ok()?;
    let mut entry = [0u8; 8];
    pagemap
        .read_exact_at(&mut entry, (addr / 4096 * 8) as u64)
        .ok()?;
    let entry = u64::from_le_bytes(entry);
    let pfn = entry & ((1 << 55) - 1);
    if entry >> 63 == 0 || pfn == 0 {
        return None;
    }
    let flags = std::fs::File::open("/proc/kpageflags").ok()?;
    let mut f = [0u8; 8];
    flags.read_exact_at(&mut f, pfn * 8).ok()?;
    Some(u64::from_le_bytes(f) & (1 << 22) != 0)
}

/// The share of the region's whole 2 MiB pages the kernel says are huge pages.
fn kernel_share(region: &PrimaryRegion) -> Option<f64> {
    let whole = region.len() / HUGE;
    let mut huge = 0;
    for i in 0..whole {
        // SAFETY: inside the region; reading one byte faults nothing new in (pre-faulted).
        let addr = unsafe { region.base_ptr().add(i * HUGE) };
        // The region's pages are present; make sure of it without writing.
        // SAFETY: as above.
        let _ = unsafe { std::ptr::read_volatile(addr) };
        if kernel_says_huge(addr as usize)? {
            huge += 1;
        }
    }
    Some(huge as f64 / whole as f64)
}

/// Checks the region's reported backing against the kernel's page flags.
fn assert_reported_as_kernel_says(region: &PrimaryRegion, case: &str) {
    let m = region
        .measured_backing()
        .unwrap_or_else(|| panic!("{case}: the backing was not measured"));
    assert!(m.bytes >= region.len() as u64 / 2, "{case}: {m:?}");
    match kernel_share(region) {
        Some(k) => assert!(
            (k - region.huge_page_share()).abs() < 1e-9,
            "{case}: kvtier reports {} of the region in 2 MiB pages, the kernel {k} ({})",
            region.huge_page_share(),
            region.pages_description()
        ),
        None => kvtier::skip_test!("{case}: /proc/kpageflags unreadable (not root)"),
    }
}

/// A tmpfs mounted `huge=within_size` in a temporary directory (the host fix, on a private
/// mount); unmounted on drop.
struct HugeTmpfs {
    dir: tempfile::TempDir,
}

impl HugeTmpfs {
    fn mount() -> Option<HugeTmpfs> {
        let dir = tempfile::tempdir().ok()?;
        let out = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                "size=64m,huge=within_size",
                "kvtier-test",
            ])
            .arg(dir.path())
            .output()
            .ok()?;
        if !out.status.success() {
            kvtier::skip_test!(
                "cannot mount a huge=within_size tmpfs: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            return None;
        }
        Some(HugeTmpfs { dir })
    }
}

impl Drop for HugeTmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

fn shm_is_huge() -> bool {
    std::fs::read_to_string("/proc/mounts").is_ok_and(|m| {
        m.lines().any(|l| {
            l.split_whitespace().nth(1) == Some("/dev/shm")
                && (l.contains("huge=within_size") || l.contains("huge=always"))
        })
    })
}

#[test]
fn a_pinned_vllm_region_cannot_be_collapsed_and_is_reported_in_4k_pages() {
    if !shm_ready() {
        return;
    }
    if shm_is_huge() {
        kvtier::skip_test!("/dev/shm is mounted with huge pages here: nothing stays 4 KiB");
        return;
    }
    let shm = Path::new("/dev/shm");
    // The control: the same region unpinned collapses where MADV_COLLAPSE works here.
    let free = PrimaryRegion::create_vllm_shaped_pinned(
        ROWS,
        ROW as u64,
        shm,
        AdoptHugePages::Auto,
        false,
    )
    .unwrap();
    let pinned = match PrimaryRegion::create_vllm_shaped_pinned(
        ROWS,
        ROW as u64,
        shm,
        AdoptHugePages::Auto,
        true,
    ) {
        Ok(r) => r,
        Err(e) if e.kind() == ErrorKind::Unsupported => {
            kvtier::skip_test!("cannot pin here: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    assert_eq!(
        pinned.huge_page_share(),
        0.0,
        "{}",
        pinned.pages_description()
    );
    assert!(!pinned.huge_pages());
    let why = pinned.small_pages_reason().unwrap();
    assert!(
        why.contains("os error 11") && why.contains("pinned"),
        "{why}"
    );
    assert!(
        pinned
            .pages_description()
            .starts_with("4 KiB pages (measured)")
    );
    assert_reported_as_kernel_says(&pinned, "pinned");
    if free.huge_pages() {
        assert_reported_as_kernel_says(&free, "unpinned, collapsed");
    } else {
        kvtier::skip_test!(
            "the unpinned control did not collapse here: {:?}",
            free.small_pages_reason()
        );
    }
}

#[test]
fn an_own_region_is_reported_as_the_kernel_backs_it() {
    let r = PrimaryRegion::create(ROWS, ROW as u64).unwrap();
    assert_reported_as_kernel_says(&r, "own region");
}

#[test]
fn a_pinned_region_on_a_huge_page_tmpfs_is_reported_in_2mib_pages_without_a_collapse() {
    let Some(fs) = HugeTmpfs::mount() else { return };
    for mode in [AdoptHugePages::Never, AdoptHugePages::Auto] {
        let r = match PrimaryRegion::create_vllm_shaped_pinned(
            ROWS,
            ROW as u64,
            fs.dir.path(),
            mode,
            true,
        ) {
            Ok(r) => r,
            Err(e) if e.kind() == ErrorKind::Unsupported => {
                kvtier::skip_test!("cannot pin here: {e}");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        if kernel_share(&r) == Some(0.0) {
            kvtier::skip_test!("this kernel gave the huge=within_size tmpfs no 2 MiB pages");
            return;
        }
        // Pinned, so nothing could have been collapsed: the pages came from the tmpfs.
        assert_eq!(
            r.huge_page_share(),
            1.0,
            "{mode:?}: {}",
            r.pages_description()
        );
        assert!(r.huge_pages(), "{mode:?}");
        assert_eq!(r.small_pages_reason(), None);
        assert_reported_as_kernel_says(&r, "huge-page tmpfs");
    }
}

fn fill(region: &PrimaryRegion, row: usize, seed: u64) {
    fill_row(region, row, seed);
}

/// Writes rows 0..4 of `region` to a file, reads them back into rows 4..8 and compares.
fn round_trip(region: Arc<PrimaryRegion>, case: &str) {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let file = open_direct(&dir.path().join("slab"));
    file.set_len((4 * ROW) as u64).unwrap();
    let opts = EngineOptions {
        queue_depth: 8,
        ..EngineOptions::default()
    };
    let handle = match open_engine(IoEngineKind::Uring, region.clone(), vec![file], &opts) {
        Ok(h) => h,
        Err(e) if e.kind() == ErrorKind::Unsupported => {
            kvtier::skip_test!("{case}: io_uring unavailable: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let engine = handle.engine;
    if std::env::var("KVTIER_STAGING").as_deref() == Ok("never") {
        kvtier::skip_test!("{case}: KVTIER_STAGING=never");
        return;
    }
    let Some(staged) = engine.staged_bytes() else {
        // Staging needs 2 MiB pages of its own; on a host short of free 2 MiB blocks it
        // (rightly) does not start. Anywhere else this is a failure.
        let control = PrimaryRegion::create(32, ROW as u64).unwrap();
        if control.huge_page_share() < 0.5 {
            kvtier::skip_test!("{case}: no free 2 MiB blocks for the staging memory now");
            return;
        }
        panic!("{case}: 2 MiB rows in 4 KiB pages are not staged");
    };
    for r in 0..4 {
        fill(&region, r, 17 + r as u64);
    }
    let req = |dir, r: usize, slot: usize| IoRequest {
        dir,
        file: 0,
        file_offset: (slot * ROW) as u64,
        region_offset: r * ROW,
        len: ROW,
        tag: r as u64,
    };
    let writes: Vec<IoRequest> = (0..4).map(|r| req(IoDir::Write, r, r)).collect();
    engine.submit(&writes).unwrap();
    for (tag, res) in collect(engine.as_ref(), 4) {
        assert_eq!(res.unwrap(), ROW, "{case}: write {tag}");
    }
    let reads: Vec<IoRequest> = (0..4).map(|r| req(IoDir::Read, 4 + r, r)).collect();
    engine.submit(&reads).unwrap();
    for (tag, res) in collect(engine.as_ref(), 4) {
        assert_eq!(res.unwrap(), ROW, "{case}: read {tag}");
    }
    for r in 0..4 {
        assert!(
            row_bytes(&region, r) == row_bytes(&region, 4 + r),
            "{case}: row {r} came back different"
        );
    }
    assert_eq!(
        staged.load(std::sync::atomic::Ordering::Relaxed),
        (8 * ROW) as u64,
        "{case}"
    );
    engine.shutdown();
}

#[test]
fn a_pinned_region_moves_the_right_bytes_through_staging() {
    if !shm_ready() || shm_is_huge() {
        return;
    }
    let region = match PrimaryRegion::create_vllm_shaped_pinned(
        ROWS,
        ROW as u64,
        Path::new("/dev/shm"),
        AdoptHugePages::Auto,
        true,
    ) {
        Ok(r) => Arc::new(r),
        Err(e) if e.kind() == ErrorKind::Unsupported => {
            kvtier::skip_test!("cannot pin here: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    round_trip(region, "in-process");
}

#[test]
fn a_mapped_pinned_region_moves_the_right_bytes_and_a_shrunk_one_fails_its_copies() {
    if !shm_ready() || shm_is_huge() {
        return;
    }
    // The engine's side: its region, pinned, kept in its own mapping.
    let owner = match PrimaryRegion::create_vllm_shaped_pinned(
        ROWS,
        ROW as u64,
        Path::new("/dev/shm"),
        AdoptHugePages::Never,
        true,
    ) {
        Ok(r) => r,
        Err(e) if e.kind() == ErrorKind::Unsupported => {
            kvtier::skip_test!("cannot pin here: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let file = region_file_of(&owner);
    // The node service's side: maps the file (cannot collapse it: pinned).
    let mapped = Arc::new(PrimaryRegion::map_shared_file(&file.as_fd(), ROWS, ROW as u64).unwrap());
    assert_eq!(
        mapped.huge_page_share(),
        0.0,
        "{}",
        mapped.pages_description()
    );
    assert!(mapped.shared_file().is_some());
    round_trip(mapped.clone(), "node service mapping");
    // The engine shrinks its file to half: a staged store of a row past the end fails with
    // RegionLost (a kernel copy), where a CPU copy would have raised SIGBUS.
    file.set_len((ROWS / 2 * ROW) as u64).unwrap();
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let slab = open_direct(&dir.path().join("slab"));
    slab.set_len(ROW as u64).unwrap();
    let handle = open_engine(
        IoEngineKind::Uring,
        mapped.clone(),
        vec![slab],
        &EngineOptions::default(),
    )
    .unwrap();
    let engine = handle.engine;
    let store = IoRequest {
        dir: IoDir::Write,
        file: 0,
        file_offset: 0,
        region_offset: 6 * ROW,
        len: ROW,
        tag: 1,
    };
    let load = IoRequest {
        dir: IoDir::Read,
        region_offset: 7 * ROW,
        tag: 2,
        ..store
    };
    engine.submit(&[store, load]).unwrap();
    for (tag, res) in collect(engine.as_ref(), 2) {
        let e = res.expect_err("a staged copy past the region file's end succeeded");
        assert_eq!(e.kind(), ErrorKind::RegionLost, "tag {tag}: {e}");
    }
    engine.shutdown();
}
