//! Staging large transfers of a region in 4 KiB pages through the engine's own 2 MiB pages.
//!
//! Why: an O_DIRECT transfer is one DMA segment per physically contiguous run of its buffer.
//! A region in scattered 4 KiB pages (what vLLM 0.33 hands kvtier: its `/dev/shm` region is
//! pinned by `cudaHostRegister` before kvtier adopts it, so it cannot be collapsed) makes a
//! 2 MiB row 512 segments, more than a block device takes per request (`max_segments`, 254 on
//! virtio-blk, 127 or 33 on many NVMe drives): the block layer splits every row into several
//! requests, and the tier ran at 0.7-0.8 of its speed on its own region.
//!
//! How: the engine owns a small buffer (64 MiB by default) of its own memory, collapsed into
//! 2 MiB pages and registered with the ring, cut into row-sized slots. A write of a region range
//! at least [`Staging::min_len`] long first copies the range into a free slot and writes from
//! it; a read reads into a slot and copies it into the region once the read completed, before
//! the completion is sent, so callers see the same completions as before. A request waits for a
//! free slot (in order) when every slot is taken. Short transfers resume inside the slot.
//!
//! The copies read or write the region range the request names, which its caller owns for the
//! request's duration (a write's rows are pinned, a read's reserved). For a region that maps
//! another process's file (the node service, [`PrimaryRegion::shared_file`]) they are kernel
//! copies (`pread` from that file, `pread` from the slot's memfd into the mapping), which fail
//! (short count, `EFAULT`) where a CPU access to a page its owner truncated away would raise
//! `SIGBUS`; otherwise plain `memcpy`.
//!
//! When: only for a region not wholly in 2 MiB pages ([`PrimaryRegion::huge_page_share`]
//! below 1), and only for requests longer than the slab device takes in one request at 4 KiB
//! per segment (its `queue/max_segments` times 4 KiB; 128 when unknown), since a shorter one is
//! not split and the copy would only cost CPU. `KVTIER_STAGING=never` turns staging off and
//! `KVTIER_STAGING=always` stages every request that fits a slot (for measurements, see
//! `docs/performance.md`).

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, ErrorKind, Result};
use crate::io::files::FileTable;
use crate::io::{IoDir, IoRequest};
use crate::region::PrimaryRegion;

/// Bytes of staging memory per engine (whole slots; at least two).
pub(crate) const STAGING_BYTES: usize = 64 << 20;

/// Segments assumed per device request when the device does not say.
const DEFAULT_MAX_SEGMENTS: usize = 128;

/// `KVTIER_STAGING`: `auto` (default), `always` or `never`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Auto,
    Always,
    Never,
}

fn mode() -> Mode {
    match std::env::var("KVTIER_STAGING").as_deref() {
        Ok("always") => Mode::Always,
        Ok("never") => Mode::Never,
        Ok("auto") | Err(_) => Mode::Auto,
        Ok(other) => {
            log::warn!("KVTIER_STAGING={other:?} is not auto, always or never; using auto");
            Mode::Auto
        }
    }
}

/// The smallest `queue/max_segments` of the block devices holding `files` (`None` when sysfs
/// does not say for any).
fn max_segments(files: &FileTable) -> Option<usize> {
    (0..files.len())
        .filter_map(|i| {
            let dev = std::fs::metadata(format!("/proc/self/fd/{}", files.raw_fd(i)))
                .ok()?
                .dev();
            let (maj, min) = (rustix::fs::major(dev), rustix::fs::minor(dev));
            let base = format!("/sys/dev/block/{maj}:{min}");
            // A partition's queue is its disk's.
            [
                format!("{base}/queue/max_segments"),
                format!("{base}/../queue/max_segments"),
            ]
            .iter()
            .find_map(|p| std::fs::read_to_string(p).ok()?.trim().parse().ok())
        })
        .min()
}

/// The engine's staging slots and the requests waiting for one.
pub(crate) struct Staging {
    /// kvtier's own memory in 2 MiB pages, one slot per row.
    buf: PrimaryRegion,
    /// Bytes per slot.
    slot_len: usize,
    /// Requests of at least this many bytes (and at most `slot_len`) are staged.
    min_len: usize,
    free: Vec<usize>,
    /// Registered buffer index of `buf`, when the ring registered it.
    pub(super) buffer_index: Option<u16>,
    /// Op slots waiting for a staging slot, in arrival order.
    pub(super) waiting: VecDeque<usize>,
    /// Bytes moved through staging (for the tier's metrics).
    pub(super) staged_bytes: Arc<AtomicU64>,
}

impl Staging {
    /// Staging for `region`'s transfers to and from `files`, or `None` where it has nothing to
    /// win (the region is in 2 MiB pages, or rows are too short to be split) or cannot be
    /// made (no 2 MiB pages for the staging memory either). What was chosen is logged once
    /// per engine.
    pub(crate) fn plan(region: &PrimaryRegion, files: &FileTable) -> Option<Staging> {
        let mode = mode();
        if mode == Mode::Never
            || (mode == Mode::Auto && (region.huge_page_share() >= 1.0 || region.len() < 2 << 20))
        {
            return None;
        }
        let slot_len = region.row_stride() as usize;
        let min_len = match mode {
            Mode::Always => 4096,
            _ => (max_segments(files).unwrap_or(DEFAULT_MAX_SEGMENTS) * 4096).saturating_add(1),
        };
        if slot_len < min_len {
            return None;
        }
        let slots = (STAGING_BYTES / slot_len).max(2);
        let buf = match PrimaryRegion::create(slots, slot_len as u64) {
            // Mostly huge is worth it (free 2 MiB blocks can run short on a busy host).
            Ok(b) if b.huge_page_share() >= 0.5 => b,
            Ok(b) => {
                log::warn!(
                    "not staging transfers of the region in 4 KiB pages: the staging buffer \
                     did not get 2 MiB pages either ({})",
                    b.small_pages_reason().unwrap_or("unknown")
                );
                return None;
            }
            Err(e) => {
                log::warn!("not staging transfers of the region in 4 KiB pages: {e}");
                return None;
            }
        };
        log::warn!(
            "the primary region ({} bytes) is {:.0} % in 2 MiB pages: transfers of {} bytes \
             and more are staged through {} bytes of kvtier's own 2 MiB pages (one copy each, \
             metric g3_staged_bytes), so that the device does not split them; {}",
            region.len(),
            region.huge_page_share() * 100.0,
            min_len,
            buf.len(),
            crate::region::HOST_FIX_HINT
        );
        Some(Staging {
            free: (0..slots).rev().collect(),
            buf,
            slot_len,
            min_len,
            buffer_index: None,
            waiting: VecDeque::new(),
            staged_bytes: Arc::new(AtomicU64::new(0)),
        })
    }

    /// The request lengths staged (`min..=max`).
    pub(super) fn lens(&self) -> (usize, usize) {
        (self.min_len, self.slot_len)
    }

    /// The staging memory (to register with the ring).
    pub(super) fn memory(&self) -> (*mut u8, usize) {
        (self.buf.base_ptr(), self.buf.len())
    }

    /// Whether `req` goes through staging.
    pub(super) fn wants(&self, req: &IoRequest) -> bool {
        self.wants_len(req.len)
    }

    /// A free slot, if any.
    pub(super) fn take(&mut self) -> Option<usize> {
        self.free.pop()
    }

    /// Returns `slot` to the free list.
    pub(super) fn release(&mut self, slot: usize) {
        self.free.push(slot);
    }

    /// Address of byte `at` of slot `slot`.
    pub(super) fn ptr(&self, slot: usize, at: usize) -> *mut u8 {
        // SAFETY: `slot` < slots and `at` < `slot_len` (callers stay inside their slot).
        unsafe { self.buf.base_ptr().add(slot * self.slot_len + at) }
    }

    /// Whether a request of `len` bytes goes through staging.
    pub(super) fn wants_len(&self, len: usize) -> bool {
        len >= self.min_len && len <= self.slot_len
    }

    /// Copies the region range a write names into `slot` and returns the CRC-32 of the bytes,
    /// computed in the same pass (chunk by chunk, while each chunk is in cache).
    pub(super) fn copy_in(
        &self,
        region: &PrimaryRegion,
        req: &IoRequest,
        slot: usize,
    ) -> Result<u32> {
        let dst = self.ptr(slot, 0);
        let crc = match region.shared_file() {
            // SAFETY: the slot is this request's alone until it is released; it is both what
            // the read fills and what is checksummed.
            Some(fd) => unsafe {
                pread_crc(
                    fd.as_fd(),
                    dst,
                    dst,
                    req.len,
                    req.region_offset as u64,
                    "the region file",
                )
            }?,
            // SAFETY: the range was validated inside the region on submission and the caller
            // does not write it while its write is in flight; the slot is ours.
            None => unsafe { copy_crc(dst, region.base_ptr().add(req.region_offset), req.len) },
        };
        self.staged_bytes
            .fetch_add(req.len as u64, Ordering::Relaxed);
        Ok(crc)
    }

    /// Copies `slot` into the region range a completed read names and returns the CRC-32 of
    /// the bytes, computed in the same pass.
    pub(super) fn copy_out(
        &self,
        region: &PrimaryRegion,
        req: &IoRequest,
        slot: usize,
    ) -> Result<u32> {
        // SAFETY: validated on submission: the range lies inside the region; the caller
        // reserved it for this read (nobody else reads or writes it meanwhile).
        let dst = unsafe { region.base_ptr().add(req.region_offset) };
        let src = self.ptr(slot, 0);
        let crc = match region.shared_file() {
            Some(_) => {
                // A kernel copy into the mapping: EFAULT instead of SIGBUS on a lost page.
                let memfd = self.buf.fd().ok_or_else(|| {
                    Error::new(ErrorKind::Internal, "the staging buffer has no memfd")
                })?;
                // The CRC of the slot's bytes (ours; the copy is what the kernel put there):
                // never a CPU read of the other process's mapping.
                // SAFETY: see above: the kernel writes the region range, we only name it; the
                // slot is ours and holds the read's bytes.
                unsafe {
                    pread_crc(
                        memfd,
                        dst,
                        src,
                        req.len,
                        (slot * self.slot_len) as u64,
                        "the engine's region (mapping lost?)",
                    )
                }?
            }
            // SAFETY: see above; the slot holds the read's bytes and is ours.
            None => unsafe { copy_crc(dst, src, req.len) },
        };
        self.staged_bytes
            .fetch_add(req.len as u64, Ordering::Relaxed);
        Ok(crc)
    }
}

/// Reads `len` bytes of `fd` at `file_off` into `dst`, [`COPY_CHUNK`] at a time, and returns
/// the CRC-32 of `checked`'s same `len` bytes, each chunk hashed right after its read (while it
/// is in cache). `checked` is `dst` itself, or the bytes the read copies from when `dst` is
/// another process's mapping the CPU must not read.
///
/// # Safety
/// `dst` is writable for `len` bytes by the kernel and `checked` readable for `len` bytes once
/// each chunk is read; nobody else touches either meanwhile.
unsafe fn pread_crc(
    fd: std::os::fd::BorrowedFd<'_>,
    dst: *mut u8,
    checked: *const u8,
    len: usize,
    file_off: u64,
    what: &str,
) -> Result<u32> {
    let mut h = crc32fast::Hasher::new();
    let mut off = 0;
    while off < len {
        let n = COPY_CHUNK.min(len - off);
        // SAFETY: the caller's contract: `[dst + off, + n)` is writable and ours.
        let chunk = unsafe { std::slice::from_raw_parts_mut(dst.add(off), n) };
        pread_exact(fd, chunk, file_off + off as u64, what)?;
        // SAFETY: the caller's contract: `[checked + off, + n)` is readable and ours.
        h.update(unsafe { std::slice::from_raw_parts(checked.add(off), n) });
        off += n;
    }
    Ok(h.finalize())
}

/// Bytes copied (and then checksummed while still in cache) at a time.
const COPY_CHUNK: usize = 64 << 10;

/// Copies `len` bytes from `src` to `dst` and returns their CRC-32, chunk by chunk: each chunk
/// is copied, then checksummed from the source lines the copy just brought into cache. The
/// destination is written with non-temporal stores where the CPU has AVX2 (neither the
/// device reading a staging slot nor the GPU reading a row needs it in this core's cache, and
/// streaming stores skip reading the destination lines first).
///
/// # Safety
/// `src` is readable and `dst` writable for `len` bytes, they do not overlap, and nobody
/// writes `src` or touches `dst` meanwhile.
unsafe fn copy_crc(dst: *mut u8, src: *const u8, len: usize) -> u32 {
    let mut h = crc32fast::Hasher::new();
    let mut off = 0;
    while off < len {
        let n = COPY_CHUNK.min(len - off);
        // SAFETY: `off + n <= len`; the caller's promise.
        unsafe {
            copy_chunk(dst.add(off), src.add(off), n);
            h.update(std::slice::from_raw_parts(src.add(off), n));
        }
        off += n;
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SFENCE has no operands; it orders the streaming stores before what follows
    // (the SQE that hands the slot to the device, or the completion that hands the row over).
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
    h.finalize()
}

/// One chunk of [`copy_crc`].
///
/// # Safety
/// As [`copy_crc`].
unsafe fn copy_chunk(dst: *mut u8, src: *const u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && (dst as usize).is_multiple_of(32) {
        // SAFETY: AVX2 is present; the caller's promise on the ranges; `dst` is 32-aligned.
        unsafe { stream_copy(dst, src, n) };
        return;
    }
    // SAFETY: the caller's promise.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
}

/// Copies with 32-byte non-temporal stores (the tail under 128 bytes with a plain copy).
///
/// # Safety
/// AVX2 is available, `dst` is 32-byte aligned, and the ranges are as [`copy_crc`] needs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_copy(dst: *mut u8, src: *const u8, n: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};
    let body = n / 128 * 128;
    let mut i = 0;
    while i < body {
        // SAFETY: `i + 128 <= n`, inside both ranges; `dst + i` is 32-aligned.
        unsafe {
            let s = src.add(i).cast::<__m256i>();
            let d = dst.add(i).cast::<__m256i>();
            let a = _mm256_loadu_si256(s);
            let b = _mm256_loadu_si256(s.add(1));
            let c = _mm256_loadu_si256(s.add(2));
            let e = _mm256_loadu_si256(s.add(3));
            _mm256_stream_si256(d, a);
            _mm256_stream_si256(d.add(1), b);
            _mm256_stream_si256(d.add(2), c);
            _mm256_stream_si256(d.add(3), e);
        }
        i += 128;
    }
    // SAFETY: the tail lies inside both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src.add(body), dst.add(body), n - body) };
}

/// `pread` of exactly `dst.len()` bytes at `offset`; a short count or an error is
/// [`ErrorKind::RegionLost`] (the region's owner shrank or unmapped its file).
fn pread_exact(
    fd: std::os::fd::BorrowedFd<'_>,
    dst: &mut [u8],
    offset: u64,
    what: &str,
) -> Result<()> {
    let mut done = 0;
    while done < dst.len() {
        match rustix::io::pread(fd, &mut dst[done..], offset + done as u64) {
            Ok(0) => {
                return Err(Error::new(
                    ErrorKind::RegionLost,
                    format!(
                        "staging copy through {what} (fd {}) came up short at byte {} of {} \
                         (offset {offset})",
                        fd.as_raw_fd(),
                        done,
                        dst.len()
                    ),
                ));
            }
            Ok(n) => done += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => {
                return Err(Error::new(
                    ErrorKind::RegionLost,
                    format!(
                        "staging copy through {what} failed at byte {done} of {} (offset \
                         {offset}): {}",
                        dst.len(),
                        std::io::Error::from(e)
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Direction helper for the ring: whether a completed op needs its slot copied out.
pub(super) fn copies_out(dir: IoDir) -> bool {
    dir == IoDir::Read
}
