//! Backing an owned region with 2 MiB pages, so that every row is physically contiguous.
//!
//! Why: an O_DIRECT transfer is one DMA segment per physically contiguous run of pages. A
//! memfd pre-faulted page by page gets scattered 4 KiB pages, so a 2 MiB row is ~512 segments,
//! more than a block device takes per request (`max_segments`, 254 on virtio-blk): the block
//! layer splits every row into several requests and loads ran at about half of fio's speed
//! (fio's malloc'd buffers happen to come in runs of ~12 pages). With 2 MiB pages a 2 MiB row
//! is one segment.
//!
//! How: shmem huge pages need the memfd mapped at a 2 MiB-aligned address (file offset 0 at a
//! 2 MiB boundary); `MADV_COLLAPSE` (Linux >= 6.1) then backs the range with huge pages
//! whatever `/sys/kernel/mm/transparent_hugepage/shmem_enabled` says (unless it is `deny`).
//! Where that is unavailable the region keeps 4 KiB pages and says so once in the log and in
//! [`super::PrimaryRegion::huge_pages`].

use std::ffi::c_void;
use std::os::fd::{AsFd, OwnedFd};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::mm::{MapFlags, ProtFlags, mmap, mmap_anonymous, munmap};

/// The x86-64 PMD (transparent huge page) size.
pub const HUGE_PAGE: usize = 2 << 20;

/// `madvise` advice: synchronously collapse the range into huge pages (Linux >= 6.1). Raw
/// `libc::madvise` below because rustix's `Advice` has no `MADV_COLLAPSE`.
const MADV_COLLAPSE: libc::c_int = 25;

/// How long adopting or mapping another process's region may take at most, measured from the
/// start of the mapping (the measurement of its pages included; the collapse gets what is
/// left: about 0.7 s per GiB on the development machine, `docs/performance.md`); the collapse
/// then continues in the background ([`Collapser`]). kvtier's own region has no budget: its
/// collapse copies nothing (one page per huge page is faulted in first).
pub(super) const COLLAPSE_BUDGET: std::time::Duration = std::time::Duration::from_millis(900);

/// [`COLLAPSE_BUDGET`], or `KVTIER_COLLAPSE_BUDGET_MS` where set (tests and measurements of
/// the background collapse).
pub(super) fn collapse_budget() -> std::time::Duration {
    std::env::var("KVTIER_COLLAPSE_BUDGET_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(COLLAPSE_BUDGET, std::time::Duration::from_millis)
}

/// Which whole 2 MiB pages of a mapping are in 2 MiB pages while a collapse finishes in the
/// background (page `i` starts at `first + i * HUGE_PAGE`).
#[derive(Debug)]
pub struct HugeMap {
    first: usize,
    pages: Box<[AtomicBool]>,
    huge: std::sync::atomic::AtomicUsize,
    stop: AtomicBool,
}

impl HugeMap {
    /// A map of `count` pages from `first`, with the pages `done` says are huge.
    pub(super) fn new(first: usize, count: usize, done: &[bool]) -> HugeMap {
        let pages: Box<[AtomicBool]> = (0..count)
            .map(|i| AtomicBool::new(done.get(i).copied().unwrap_or(false)))
            .collect();
        let huge = done.iter().filter(|d| **d).count();
        HugeMap {
            first,
            pages,
            huge: std::sync::atomic::AtomicUsize::new(huge),
            stop: AtomicBool::new(false),
        }
    }

    fn mark(&self, i: usize) {
        if let Some(p) = self.pages.get(i)
            && !p.swap(true, Ordering::Relaxed)
        {
            self.huge.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The share (0 to 1) of the pages in 2 MiB pages now.
    pub fn share(&self) -> f64 {
        if self.pages.is_empty() {
            0.0
        } else {
            self.huge.load(Ordering::Relaxed) as f64 / self.pages.len() as f64
        }
    }

    /// Whether every 2 MiB page `[addr, addr + len)` touches is a huge page now.
    pub fn range_is_huge(&self, addr: usize, len: usize) -> bool {
        if len == 0 || addr < self.first {
            return false;
        }
        let a = (addr - self.first) / HUGE_PAGE;
        let b = (addr + len - 1 - self.first) / HUGE_PAGE;
        (a..=b).all(|i| self.pages.get(i).is_some_and(|p| p.load(Ordering::Relaxed)))
    }
}

/// A collapse finishing in the background: one thread works through the pages the
/// constructor had no time for, marking each in its [`HugeMap`]. Dropping it stops the thread
/// (after the page it is on) and waits for it, so that the mapping outlives the work.
#[derive(Debug)]
pub struct Collapser {
    pub(super) map: std::sync::Arc<HugeMap>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Collapser {
    /// Starts collapsing pages `from..map.pages.len()` of the mapping at `map.first`.
    ///
    /// # Safety
    /// The mapping of `map.pages.len()` huge pages at `map.first` stays mapped until the
    /// returned value is dropped.
    pub(super) unsafe fn start(map: std::sync::Arc<HugeMap>, from: usize) -> Option<Collapser> {
        let m = map.clone();
        let spawned = std::thread::Builder::new()
            .name("kvtier-collapse".into())
            .spawn(move || {
                let count = m.pages.len();
                let started = std::time::Instant::now();
                let mut failed = 0;
                let mut tried = 0;
                for i in from..count {
                    if m.stop.load(Ordering::Relaxed) {
                        return;
                    }
                    tried += 1;
                    // SAFETY: page `i < count` of the mapping, which outlives this thread (the
                    // caller's promise: dropping the Collapser joins it first).
                    match collapse_one((m.first + i * HUGE_PAGE) as *mut u8) {
                        Ok(()) => m.mark(i),
                        Err(e) => {
                            failed += 1;
                            // As at start-up: pages that all answer EAGAIN are pinned.
                            if failed == tried
                                && tried == PINNED_PROBE_PAGES
                                && e.raw_os_error() == Some(libc::EAGAIN)
                            {
                                log::info!(
                                    "background MADV_COLLAPSE stopped: the pages are pinned"
                                );
                                return;
                            }
                        }
                    }
                }
                log::info!(
                    "background MADV_COLLAPSE done in {:.1} s: {:.0} % of the region in 2 MiB \
                     pages ({failed} pages could not be collapsed)",
                    started.elapsed().as_secs_f64(),
                    m.share() * 100.0
                );
            });
        match spawned {
            Ok(t) => Some(Collapser {
                map,
                thread: Some(t),
            }),
            Err(e) => {
                log::warn!("cannot start the background collapse: {e}");
                None
            }
        }
    }
}

impl Drop for Collapser {
    fn drop(&mut self) {
        self.map.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            log::error!("the background collapse thread panicked");
        }
    }
}

/// Huge pages that must all answer EAGAIN before a collapse concludes the region is pinned.
const PINNED_PROBE_PAGES: usize = 16;

/// Set once the "no huge pages" fallback has been logged.
static FALLBACK_LOGGED: AtomicBool = AtomicBool::new(false);

/// Maps `len` bytes of `fd` read-write and shared, at a 2 MiB-aligned address when `len` is at
/// least one huge page.
pub(super) fn map_shared(fd: &OwnedFd, len: usize) -> std::io::Result<*mut c_void> {
    if len < HUGE_PAGE {
        // SAFETY: a fresh mapping (no address requested) of a valid fd of at least `len` bytes.
        return Ok(unsafe {
            mmap(
                null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                0,
            )
        }?);
    }
    map_shared_aligned(fd, 0, len)
}

/// Maps `len` bytes of `fd` from `offset` read-write and shared, at a 2 MiB-aligned address.
/// The file must hold at least `offset + len` bytes; for the mapping to take huge pages,
/// `offset` must be a multiple of 2 MiB.
pub(super) fn map_shared_aligned(
    fd: impl AsFd,
    offset: u64,
    len: usize,
) -> std::io::Result<*mut c_void> {
    let span = len + HUGE_PAGE;
    // SAFETY: reserves address space only (no access, no memory), at an address of the
    // kernel's choosing.
    let reserved = unsafe {
        mmap_anonymous(
            null_mut(),
            span,
            ProtFlags::empty(),
            MapFlags::PRIVATE | MapFlags::NORESERVE,
        )
    }?;
    let start = reserved as usize;
    let aligned = start.next_multiple_of(HUGE_PAGE);
    // SAFETY: `[aligned, aligned + len)` lies inside our own reservation, which MAP_FIXED
    // replaces; the file has at least `offset + len` bytes (the caller's promise).
    let mapped = unsafe {
        mmap(
            aligned as *mut c_void,
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED | MapFlags::FIXED,
            fd,
            offset,
        )
    };
    let ptr = match mapped {
        Ok(p) => p,
        Err(e) => {
            // SAFETY: unmaps exactly our own reservation, which nothing else uses.
            let _ = unsafe { munmap(reserved, span) };
            return Err(e.into());
        }
    };
    let head = aligned - start;
    let tail = span - head - len;
    // SAFETY: the head and tail are the unused ends of our own reservation, outside the
    // file mapping. Failing to return them only leaves reserved address space behind.
    unsafe {
        if head > 0 {
            let _ = munmap(reserved, head);
        }
        if tail > 0 {
            let _ = munmap((aligned + len) as *mut c_void, tail);
        }
    }
    Ok(ptr)
}

/// Backs the 2 MiB-aligned whole huge pages of the fresh mapping `[base, base + len)` with huge
/// pages, one huge page at a time. Returns the share (0 to 1) of those it collapsed; the first
/// shortfall in the process is logged.
///
/// `MADV_COLLAPSE` refuses a range with no page present, and collapsing fully populated 4 KiB
/// pages copies them, so one page per huge page is faulted in first and the rest is filled by
/// the collapse itself.
pub(super) fn collapse(base: *mut u8, len: usize) -> f64 {
    let whole = len / HUGE_PAGE;
    if whole == 0 || !(base as usize).is_multiple_of(HUGE_PAGE) {
        return 0.0;
    }
    // SAFETY: `whole` huge pages from `base` lie inside the caller's mapping.
    let (collapsed, last_error) = unsafe { collapse_pages(base, whole) };
    if let Some(err) = last_error
        && !FALLBACK_LOGGED.swap(true, Ordering::Relaxed)
    {
        log::warn!(
            "{} of {whole} huge pages of the primary region stay in 4 KiB pages (MADV_COLLAPSE \
             failed: {err}); O_DIRECT transfers of large rows there are split into many DMA \
             segments and run slower (needs Linux >= 6.1, transparent_hugepage/shmem_enabled \
             other than `deny` and free 2 MiB blocks of memory)",
            whole - collapsed
        );
    }
    collapsed as f64 / whole as f64
}

/// Collapses the `count` huge pages from `base` one at a time ([`collapse_one`]), then tries
/// the ones that failed once more: collapsing a huge page of 4 KiB pages copies it and frees
/// those pages, which can make the free 2 MiB block a failed page needs. Returns how many it
/// collapsed, and the last error of those it could not (how many only the second pass got is
/// logged).
///
/// # Safety
/// `base` is 2 MiB-aligned and `[base, base + count * HUGE_PAGE)` lies inside the caller's own
/// mapping.
pub(super) unsafe fn collapse_pages(
    base: *mut u8,
    count: usize,
) -> (usize, Option<std::io::Error>) {
    // SAFETY: the caller's promise, passed on.
    let (n, e, _) = unsafe { collapse_pages_with(base, count, None, &mut |_| {}) };
    (n, e)
}

/// [`collapse_pages`] within `budget` when given (see [`collapse_budget`]), calling `done(i)`
/// for each huge page `i` it collapsed, and returning where it stopped for lack of time (the
/// pages from there on were not tried), if it did.
///
/// # Safety
/// As [`collapse_pages`].
pub(super) unsafe fn collapse_pages_with(
    base: *mut u8,
    count: usize,
    budget: Option<std::time::Duration>,
    done: &mut dyn FnMut(usize),
) -> (usize, Option<std::io::Error>, Option<usize>) {
    // Without a budget: a century, as good as none.
    let budget = budget.unwrap_or(std::time::Duration::from_secs(3_000_000_000));
    let deadline = std::time::Instant::now() + budget;
    let mut failed = Vec::new();
    let mut last_error = None;
    for i in 0..count {
        if std::time::Instant::now() > deadline {
            // Start-up must not wait on a large region: what is left stays in 4 KiB pages
            // (the engine then stages large transfers through its own 2 MiB pages).
            let collapsed = i - failed.len();
            log::info!(
                "MADV_COLLAPSE stopped after {:.1} s: {collapsed} of {count} huge pages \
                 collapsed, {} not tried yet",
                budget.as_secs_f64(),
                count - i
            );
            let e = std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "stopped after {:.1} s with {} of {count} huge pages not tried yet",
                    budget.as_secs_f64(),
                    count - i
                ),
            );
            return (collapsed, Some(e), Some(i));
        }
        // SAFETY: `i < count`, inside the caller's mapping (the caller's promise).
        let r = collapse_one(unsafe { base.add(i * HUGE_PAGE) });
        if r.is_ok() {
            done(i);
        }
        if let Err(e) = r {
            let again = e.raw_os_error() == Some(libc::EAGAIN);
            failed.push(i);
            last_error = Some(e);
            // Every page so far refused with EAGAIN after its retries: the pages are pinned
            // (vLLM's region, pinned by cudaHostRegister); the rest would refuse too, and a
            // large region would spend its whole budget learning it.
            if again && failed.len() == i + 1 && i + 1 == PINNED_PROBE_PAGES && count > i + 1 {
                log::info!(
                    "MADV_COLLAPSE: the first {PINNED_PROBE_PAGES} huge pages all answered \
                     EAGAIN (pinned pages); not trying the other {}",
                    count - i - 1
                );
                return (0, last_error, None);
            }
        }
    }
    let first_pass = count - failed.len();
    if first_pass == 0 || failed.is_empty() {
        return (first_pass, last_error, None);
    }
    let mut second_pass = 0;
    last_error = None;
    for &i in &failed {
        if std::time::Instant::now() > deadline {
            break;
        }
        // SAFETY: as above.
        match collapse_one(unsafe { base.add(i * HUGE_PAGE) }) {
            Ok(()) => {
                done(i);
                second_pass += 1
            }
            Err(e) => last_error = Some(e),
        }
    }
    log::info!(
        "MADV_COLLAPSE: {first_pass} of {count} huge pages on the first pass, {second_pass} of \
         the {} left on the second",
        failed.len()
    );
    (first_pass + second_pass, last_error, None)
}

/// Collapses the huge page at `page` (2 MiB-aligned, inside our own mapping), asking again a
/// few times while the kernel answers EAGAIN (page briefly busy) or ENOMEM (no free 2 MiB block
/// yet; each try compacts memory a little).
fn collapse_one(page: *mut u8) -> std::io::Result<()> {
    let mut tries = 0;
    loop {
        // SAFETY: `page` starts a 2 MiB range of the caller's own mapping. A volatile read
        // faults a missing page in (shmem allocates on read) without writing the memory others
        // share; MADV_COLLAPSE keeps the contents of every page.
        let rc = unsafe {
            std::ptr::read_volatile(page);
            libc::madvise(page.cast(), HUGE_PAGE, MADV_COLLAPSE)
        };
        if rc == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        tries += 1;
        if tries >= 4 || !matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::ENOMEM)) {
            return Err(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::PrimaryRegion;

    /// Bytes of `[base, base + len)` mapped by PMDs (huge pages), from /proc/self/smaps.
    fn pmd_mapped_bytes(base: usize) -> Option<u64> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ')
                && let Some((start, _)) = range.split_once('-')
                && let Ok(start) = usize::from_str_radix(start, 16)
            {
                inside = start == base;
                continue;
            }
            if inside && let Some(kb) = line.strip_prefix("ShmemPmdMapped:") {
                return kb.trim().trim_end_matches("kB").trim().parse::<u64>().ok();
            }
        }
        None
    }

    #[test]
    fn large_regions_are_huge_page_aligned_zeroed_and_collapsed_where_supported() {
        let rows = 3;
        let row = HUGE_PAGE + 4096 * 3; // rows straddle huge pages; the tail is partial
        let r = PrimaryRegion::create(rows, row as u64).unwrap();
        assert_eq!(r.base_ptr() as usize % HUGE_PAGE, 0);
        for c in 0..rows {
            let mut bytes = r.write_row(c).unwrap();
            assert!(bytes.iter().all(|&b| b == 0), "row {c} is not zeroed");
            bytes.fill(c as u8 + 1);
        }
        for c in 0..rows {
            let bytes = r.read_row(c).unwrap();
            assert!(
                bytes.iter().all(|&b| b == c as u8 + 1),
                "row {c} lost its bytes"
            );
        }
        if !r.huge_pages() {
            crate::skip_test!("skipping the huge-page check: MADV_COLLAPSE is not available here");
            return;
        }
        let whole = (r.len() / HUGE_PAGE * HUGE_PAGE) as u64;
        match pmd_mapped_bytes(r.base_ptr() as usize) {
            Some(kb) => assert_eq!(kb * 1024, whole, "huge_pages() but not PMD-mapped"),
            None => crate::skip_test!("skipping the smaps check: /proc/self/smaps has no entry"),
        }
    }

    #[test]
    fn small_regions_keep_small_pages() {
        let r = PrimaryRegion::create(4, 64 << 10).unwrap();
        assert!(!r.huge_pages());
        assert_eq!(r.base_ptr() as usize % 4096, 0);
    }
}
