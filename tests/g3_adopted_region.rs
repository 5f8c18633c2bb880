//! A region adopted as the Python tier adopts vLLM 0.33's shared offload region (a `/dev/shm`
//! file mapped with 4 KiB pages, pre-faulted with MADV_POPULATE_WRITE): kvtier's huge-page
//! mapping of it moves the same bytes vLLM's mapping sees, in both directions, through the G3
//! tier's io_uring path; the fallback to 4 KiB pages is chosen for what cannot be collapsed.

mod g3_common;

use std::ffi::c_void;
use std::path::Path;
use std::sync::Arc;

use g3_common::*;
use kvtier::contract::secondary::SecondaryTier;
use kvtier::g3::{G3Tier, geometry_namespace};
use kvtier::region::{AdoptHugePages, PrimaryRegion};
use rustix::mm::{Advice, MapFlags, ProtFlags, madvise, mmap, mmap_anonymous, munmap};

/// 512 KiB rows: a huge page holds 4, and row 5 straddles nothing (8 rows = 2 huge pages).
const ROW: usize = 512 << 10;
const ROWS: usize = 8;

/// vLLM's mapping of its region: a /dev/shm file mapped whole at an address of the kernel's
/// choosing, unlinked, pre-faulted, its descriptor kept open.
struct VllmMapping {
    ptr: *mut c_void,
    len: usize,
    _file: std::fs::File,
}

impl VllmMapping {
    fn new(len: usize) -> Option<Self> {
        let dir = Path::new("/dev/shm");
        if kvtier::g3::slab::available_bytes(dir)? < 64 << 20 {
            return None;
        }
        // One name per mapping: the tests of this file run in parallel in one process.
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = dir.join(format!("kvtier_test_adopt_{}_{n}.mmap", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
        std::fs::remove_file(&path).unwrap();
        file.set_len(len as u64).unwrap();
        // SAFETY: a fresh shared mapping of a file of `len` bytes.
        let ptr = unsafe {
            mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &file,
                0,
            )
        }
        .unwrap();
        // SAFETY: our own mapping.
        unsafe { madvise(ptr, len, Advice::LinuxPopulateWrite) }.unwrap();
        Some(VllmMapping {
            ptr,
            len,
            _file: file,
        })
    }

    fn row(&self, r: usize) -> &[u8] {
        // SAFETY: inside the mapping; no job writes the row while the test reads it.
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<u8>().add(r * ROW), ROW) }
    }

    /// Writes `bytes` (one row, or one byte repeated) into row `r`, as vLLM's copies would.
    fn write(&self, r: usize, bytes: &[u8]) {
        // SAFETY: inside the mapping; no job touches the row while the test writes it.
        unsafe {
            let dst = self.ptr.cast::<u8>().add(r * ROW);
            if bytes.len() == 1 {
                std::ptr::write_bytes(dst, bytes[0], ROW);
            } else {
                assert_eq!(bytes.len(), ROW);
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, ROW);
            }
        }
    }
}

impl Drop for VllmMapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping; every region adopting it is gone.
        unsafe { munmap(self.ptr, self.len) }.unwrap();
    }
}

fn open_uring(r: &Arc<PrimaryRegion>, dir: &Path) -> G3Tier {
    let mut cfg = kvtier::g3::G3TierConfig::new(vec![dir.to_path_buf()], 16 * ROW as u64);
    cfg.io_engine = kvtier::io::IoEngineKind::Auto;
    let t = G3Tier::open(
        cfg,
        r.clone(),
        geometry_namespace(ROW as u64),
        "t".into(),
        None,
    )
    .unwrap();
    assert!(t.wait_recovered(std::time::Duration::from_secs(30)));
    t
}

fn round_trip_through_vllms_view(mode: AdoptHugePages) -> bool {
    let Some(vllm) = VllmMapping::new(ROW * ROWS) else {
        kvtier::skip_test!("skipping: /dev/shm is missing or has less than 64 MiB free");
        return false;
    };
    // SAFETY: `vllm` outlives the region and the tier (both dropped at the end of this scope).
    let region = Arc::new(
        unsafe { PrimaryRegion::adopt_shared(vllm.ptr.cast(), ROW as u64, ROWS, mode) }.unwrap(),
    );
    let share = region.huge_page_share();
    let huge = share > 0.0;
    if huge {
        assert_ne!(
            region.base_ptr(),
            vllm.ptr.cast::<u8>(),
            "huge pages: own mapping"
        );
        assert_eq!(region.base_ptr() as usize % (2 << 20), 0);
        assert_eq!(region.huge_pages(), share == 1.0);
        assert_eq!(region.small_pages_reason().is_none(), share == 1.0);
    } else {
        assert_eq!(
            region.base_ptr(),
            vllm.ptr.cast::<u8>(),
            "4 KiB: vLLM's mapping"
        );
        assert!(!region.huge_pages());
        assert!(region.small_pages_reason().is_some());
    }
    // Written by vLLM, seen by kvtier's mapping, stored, cleared in vLLM's view, loaded back
    // into other rows, seen by vLLM.
    for r in 0..4 {
        vllm.write(r, &pattern(r as u64, ROW));
    }
    assert!(row_is(&region, 2, 2), "kvtier's view differs from vLLM's");
    let d = tmpdir();
    let mut t = open_uring(&region, d.path());
    assert_eq!(
        metric(&t, "g3_region_huge_pages"),
        (share * 1e6).round() / 1e6
    );
    let res = run(&mut t, job(1, &[0, 1, 2, 3], &[0, 1, 2, 3], false));
    assert!(res.success, "{res:?}");
    for r in 0..ROWS {
        vllm.write(r, &[0]);
    }
    let res = run(&mut t, job(2, &[3, 0, 2, 1], &[4, 5, 6, 7], true));
    assert!(res.success, "{res:?}");
    for (row, chunk) in [(4, 3u64), (5, 0), (6, 2), (7, 1)] {
        assert!(
            vllm.row(row) == pattern(chunk, ROW).as_slice(),
            "row {row}: vLLM's view lacks chunk {chunk}"
        );
    }
    assert!(vllm.row(0).iter().all(|&b| b == 0));
    t.shutdown().unwrap();
    drop(t);
    drop(region);
    // The bytes stay vLLM's after kvtier lets go.
    assert!(vllm.row(4) == pattern(3, ROW).as_slice());
    huge
}

#[test]
fn adopted_shm_region_with_huge_pages_round_trips_through_vllms_view() {
    if !round_trip_through_vllms_view(AdoptHugePages::Auto) {
        kvtier::skip_test!("note: MADV_COLLAPSE unavailable here; the 4 KiB path was checked");
    }
}

#[test]
fn adopted_shm_region_in_4k_pages_round_trips_through_vllms_view() {
    assert!(!round_trip_through_vllms_view(AdoptHugePages::Never));
}

#[test]
fn memory_that_is_not_a_shared_file_keeps_its_pages_with_a_reason() {
    let len = 4 << 20;
    // SAFETY: fresh private anonymous memory, unmapped below.
    let anon = unsafe {
        mmap_anonymous(
            std::ptr::null_mut(),
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::PRIVATE,
        )
    }
    .unwrap();
    // SAFETY: `anon` outlives the region.
    let r =
        unsafe { PrimaryRegion::adopt_shared(anon.cast(), ROW as u64, 8, AdoptHugePages::Auto) }
            .unwrap();
    assert!(!r.huge_pages());
    assert_eq!(r.base_ptr(), anon.cast::<u8>());
    let why = r.small_pages_reason().unwrap();
    assert!(why.contains("not a shared mapping"), "{why}");
    drop(r);
    // Smaller than one huge page: nothing to collapse.
    // SAFETY: as above.
    let r = unsafe { PrimaryRegion::adopt_shared(anon.cast(), 4096, 16, AdoptHugePages::Auto) }
        .unwrap();
    assert!(
        r.small_pages_reason()
            .unwrap()
            .contains("smaller than one 2 MiB page")
    );
    drop(r);
    // SAFETY: our own mapping, no region uses it any more.
    unsafe { munmap(anon, len) }.unwrap();
}

#[test]
fn vllm_shaped_region_is_adopted_through_the_same_path() {
    let dir = Path::new("/dev/shm");
    if !dir.is_dir() {
        kvtier::skip_test!("skipping: no /dev/shm");
        return;
    }
    let r = PrimaryRegion::create_vllm_shaped(8, ROW as u64, dir, AdoptHugePages::Never).unwrap();
    assert!(!r.is_owned() && !r.huge_pages());
    fill_row(&r, 7, 7);
    assert!(row_is(&r, 7, 7));
    let r = PrimaryRegion::create_vllm_shaped(8, ROW as u64, dir, AdoptHugePages::Auto).unwrap();
    fill_row(&r, 3, 9);
    assert!(row_is(&r, 3, 9));
    // Nothing is left behind in /dev/shm (the file is unlinked once mapped, as vLLM does).
    let leftovers = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&format!("kvtier_vllm_offload_{}_", std::process::id()))
        })
        .count();
    assert_eq!(leftovers, 0);
}

/// The node service maps an engine's `/dev/shm` file itself (`map_shared_file`): it gets the
/// same 2 MiB pages the in-process tier's adoption gets on this machine, and the owner's
/// mapping sees every byte written through it.
#[test]
fn a_shared_file_mapped_by_the_service_gets_the_huge_pages_adoption_gets() {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = Path::new("/dev/shm");
    if !dir.is_dir() {
        kvtier::skip_test!("skipping: no /dev/shm");
        return;
    }
    const ROWS: usize = 4;
    let path = dir.join(format!(
        "kvtier_map_shared_test_{}.mmap",
        std::process::id()
    ));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    file.set_len((ROWS * ROW) as u64).unwrap();
    // The owner's mapping (the engine's), then the service's own.
    let owner = PrimaryRegion::map_shared_file(&file, ROWS, ROW as u64).unwrap();
    fill_row(&owner, 1, 5);
    let service = PrimaryRegion::map_shared_file(&file, ROWS, ROW as u64).unwrap();
    assert_eq!(
        service.base_ptr() as usize % (2 << 20),
        0,
        "mapped at a 2 MiB boundary"
    );
    assert!(row_is(&service, 1, 5), "the owner's bytes stay");
    fill_row(&service, 2, 6);
    assert!(row_is(&owner, 2, 6), "the owner sees the service's writes");
    let adopted =
        PrimaryRegion::create_vllm_shaped(ROWS, ROW as u64, dir, AdoptHugePages::Auto).unwrap();
    eprintln!(
        "huge-page share: service mapping {} ({:?}), adoption {} ({:?})",
        service.huge_page_share(),
        service.small_pages_reason(),
        adopted.huge_page_share(),
        adopted.small_pages_reason()
    );
    if adopted.huge_page_share() > 0.0 {
        assert!(
            service.huge_page_share() > 0.0,
            "adoption collapses on this machine, the service's mapping must too: {:?}",
            service.small_pages_reason()
        );
    } else {
        assert!(service.small_pages_reason().is_some());
    }
    assert_eq!(service.huge_pages(), service.small_pages_reason().is_none());
}
