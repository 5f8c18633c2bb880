//! The primary memory region: `num_rows` rows of `row_stride` bytes, page-aligned, shared.
//!
//! Row `c` is `[base + c * row_stride, base + (c + 1) * row_stride)`. Every transfer in kvtier
//! (GPU <-> primary, primary <-> NVMe) moves whole rows, so the row is the unit of alignment:
//! `row_stride` is a multiple of 4096 and the base is page-aligned, which is what O_DIRECT and
//! io_uring fixed buffers need.
//!
//! # Memory and aliasing model
//! The region is memory that other agents write behind Rust's back: the kernel (io_uring, DMA),
//! GPU copies, and, for an adopted region, another runtime. kvtier therefore never keeps a
//! long-lived `&[u8]` or `&mut [u8]` over it. The I/O engines reach rows through raw
//! addresses ([`PrimaryRegion::row_ptr`], [`PrimaryRegion::base_ptr`]); CPU code reads and
//! writes a row through a lease ([`PrimaryRegion::read_row`], [`PrimaryRegion::write_row`]),
//! a guard that derefs to the row's bytes and refuses, with an error naming the row, a lease
//! that would overlap a write (see [`RowRead`] for exactly what a lease guarantees). Who may
//! touch a row at all (a row reserved for a write has one writer; a pinned row has readers
//! only) stays the slot manager's business. The region itself guarantees that every row
//! address stays valid and unmoved until the region is dropped, and it is only dropped once
//! every holder of its `Arc` (I/O engines with registered buffers included) has let go.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use rustix::fs::MemfdFlags;
use rustix::mm::{Advice, madvise};

use crate::error::{Error, ErrorKind, Result};
use crate::geometry::{ChunkGeometry, ROW_ALIGNMENT};

mod backing;
mod huge_pages;
pub(crate) mod mem_hints;
mod pin;
pub(crate) use pin::MAX_REGISTERED_BUFFER;
mod rows;
mod shared_alias;
mod shared_file;
mod vllm_shm;

pub use backing::MeasuredBacking;
pub use rows::{RowCopyError, RowRead, RowWrite};

/// What the warnings about an adopted region in 4 KiB pages tell the operator to do.
pub const HOST_FIX_HINT: &str = "the host fix: mount /dev/shm with huge=within_size (`mount -o \
     remount,huge=within_size /dev/shm`; docs/vllm.md), so that vLLM's region gets 2 MiB pages";

/// Where the region's memory comes from.
#[derive(Debug)]
enum Backing {
    /// A memfd mapped `MAP_SHARED`; kvtier owns and unmaps it.
    Memfd { fd: OwnedFd },
    /// Memory owned by someone else (e.g. vLLM's shared offload region); never unmapped here.
    Adopted,
    /// Another process's shared file (its `/dev/shm` region or a memfd it passed over a
    /// socket) mapped `MAP_SHARED` here ([`PrimaryRegion::map_shared_file`]); unmapped on drop.
    SharedFile,
    /// Memory owned by someone else, reached through kvtier's own 2 MiB-page mapping of the
    /// same shared memory (unmapped here; the owner's mapping is never touched).
    AdoptedAlias { _alias: shared_alias::Alias },
    /// A region made as vLLM makes its shared offload region, then adopted
    /// ([`PrimaryRegion::create_vllm_shaped`]): the adopted backing first, so that it goes
    /// before the owner's mapping it reaches.
    VllmShaped {
        _adopted: Box<Backing>,
        _owner: Box<vllm_shm::OwnerMapping>,
    },
}

/// Whether [`PrimaryRegion::adopt_shared`] may back the adopted memory with 2 MiB pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdoptHugePages {
    /// Use 2 MiB pages where the memory is a shared tmpfs file (as vLLM's region is) and the
    /// kernel collapses it; otherwise keep its 4 KiB pages (logged once).
    Auto,
    /// Keep the owner's mapping and its pages (for measurements of the 4 KiB case).
    Never,
}

/// A page-aligned region of rows. Shared between threads behind an `Arc`.
#[derive(Debug)]
pub struct PrimaryRegion {
    base: NonNull<u8>,
    row_stride: usize,
    num_rows: usize,
    backing: Backing,
    prefault: PrefaultMethod,
    /// Whether the rows kvtier moves are backed by 2 MiB pages (see [`huge_pages`] and
    /// [`shared_alias`]).
    huge_pages: bool,
    /// Why the rows stay in 4 KiB pages, when they do.
    small_pages_reason: Option<String>,
    /// The share of the region's bytes in 2 MiB pages (0 to 1).
    huge_page_share: f64,
    /// How the pages kvtier moves were found backed (`/proc/self/smaps`), when measured.
    measured: Option<MeasuredBacking>,
    /// The file mapped by [`PrimaryRegion::map_shared_file`] (another process's), for copies
    /// that must fail rather than raise `SIGBUS` if its owner shrinks it.
    copy_fd: Option<OwnedFd>,
    /// A collapse the constructor had no time to finish, running in the background (stopped
    /// before the mapping goes, see `Drop`).
    collapser: Option<huge_pages::Collapser>,
    /// One lease word per row, for [`PrimaryRegion::read_row`] and
    /// [`PrimaryRegion::write_row`].
    leases: rows::Leases,
}

/// The share (0 to 1) of the whole 2 MiB pages of `len` bytes that `m` found PMD-mapped.
fn whole_page_share(m: MeasuredBacking, len: usize) -> f64 {
    m.share_of_whole_pages(len)
}

/// How the region's pages were faulted in at creation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefaultMethod {
    /// `madvise(MADV_POPULATE_WRITE)` (Linux >= 5.14).
    PopulateWrite,
    /// One write per page, used when `MADV_POPULATE_WRITE` is unavailable.
    TouchPages,
    /// Not pre-faulted (adopted memory is the owner's business).
    None,
}

// SAFETY: the region is a plain block of memory; all access goes through raw pointers whose
// exclusivity is arbitrated by the slot manager (see the module docs). The pointer itself is
// never mutated after construction.
unsafe impl Send for PrimaryRegion {}
// SAFETY: as above; `&PrimaryRegion` only hands out addresses and leased views (`rows`).
unsafe impl Sync for PrimaryRegion {}

/// Checks a region's geometry: the stride (a [`ChunkGeometry::check_row_stride`] row stride)
/// and the region's length, both as byte counts in memory.
fn check_geometry(row_stride: u64, num_rows: usize) -> Result<(usize, usize)> {
    ChunkGeometry::check_row_stride(row_stride)?;
    if num_rows == 0 {
        return Err(Error::new(
            ErrorKind::Config,
            "the primary region needs at least one row",
        ));
    }
    let overflow = || {
        Error::new(
            ErrorKind::Config,
            format!("{num_rows} rows of {row_stride} bytes overflow the address space"),
        )
    };
    let stride = usize::try_from(row_stride).map_err(|_| overflow())?;
    let len = num_rows.checked_mul(stride).ok_or_else(overflow)?;
    Ok((stride, len))
}

impl PrimaryRegion {
    /// Creates an anonymous shared region (memfd, `MAP_SHARED`) of `num_rows` rows and
    /// pre-faults it, so that it can be registered with io_uring and used for O_DIRECT.
    pub fn create(num_rows: usize, row_stride: u64) -> Result<Self> {
        let (row_stride, len) = check_geometry(row_stride, num_rows)?;
        let fd = rustix::fs::memfd_create(c"kvtier-primary", MemfdFlags::CLOEXEC).map_err(|e| {
            Error::new(ErrorKind::Io, "memfd_create failed").with_source(std::io::Error::from(e))
        })?;
        if let Err(e) = rustix::fs::ftruncate(&fd, len as u64) {
            let err = std::io::Error::from(e);
            return Err(Error::new(
                ErrorKind::NoSpace,
                format!("cannot size the primary region to {len} bytes: {err}"),
            )
            .with_source(err));
        }
        let ptr = huge_pages::map_shared(&fd, len).map_err(|err| {
            Error::new(
                ErrorKind::NoSpace,
                format!("cannot map the primary region ({len} bytes): {err}"),
            )
            .with_source(err)
        })?;
        let base = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| Error::new(ErrorKind::Internal, "mmap returned a null address"))?;
        let mut region = PrimaryRegion {
            base,
            row_stride,
            num_rows,
            backing: Backing::Memfd { fd },
            prefault: PrefaultMethod::None,
            huge_pages: false,
            small_pages_reason: None,
            huge_page_share: 0.0,
            measured: None,
            copy_fd: None,
            collapser: None,
            leases: rows::Leases::new(num_rows),
        };
        region.huge_page_share = huge_pages::collapse(region.base.as_ptr(), len);
        region.prefault = region.prefault_pages();
        // What the kernel reports, not what MADV_COLLAPSE returned.
        region.measured = backing::measure(region.base.as_ptr(), len);
        if let Some(m) = region.measured {
            region.huge_page_share = whole_page_share(m, len);
        }
        region.huge_pages = region.huge_page_share == 1.0;
        if !region.huge_pages {
            region.small_pages_reason = Some(if len < huge_pages::HUGE_PAGE {
                "the region is smaller than one 2 MiB page".to_string()
            } else {
                format!(
                    "MADV_COLLAPSE left {:.0} % in 4 KiB pages (see the log)",
                    (1.0 - region.huge_page_share) * 100.0
                )
            });
        }
        Ok(region)
    }

    /// Wraps memory owned by someone else (for example vLLM's `SharedOffloadRegion`, handed
    /// over by pointer). Nothing is mapped, faulted or unmapped here.
    ///
    /// # Safety
    /// `base` must point to `num_rows * row_stride` bytes that are readable and writable and
    /// stay mapped, unmoved, for the whole life of the returned value and of every clone of the
    /// `Arc` it is put in (I/O engines keep one until their last completion).
    pub unsafe fn adopt(base: *mut u8, row_stride: u64, num_rows: usize) -> Result<Self> {
        let (row_stride, _) = check_geometry(row_stride, num_rows)?;
        let base = NonNull::new(base)
            .ok_or_else(|| Error::new(ErrorKind::Config, "cannot adopt a null region pointer"))?;
        if !(base.as_ptr() as usize).is_multiple_of(ROW_ALIGNMENT) {
            return Err(Error::new(
                ErrorKind::Misaligned,
                format!(
                    "adopted region base {:p} is not {ROW_ALIGNMENT}-byte aligned",
                    base.as_ptr()
                ),
            ));
        }
        Ok(PrimaryRegion {
            base,
            row_stride,
            num_rows,
            backing: Backing::Adopted,
            prefault: PrefaultMethod::None,
            huge_pages: false,
            small_pages_reason: Some("adopted as it is (PrimaryRegion::adopt)".to_string()),
            huge_page_share: 0.0,
            measured: None,
            copy_fd: None,
            collapser: None,
            leases: rows::Leases::new(num_rows),
        })
    }

    /// Adopts memory owned by someone else, as [`PrimaryRegion::adopt`] does, and with
    /// [`AdoptHugePages::Auto`] gives kvtier's own I/O 2 MiB pages where it can: when the
    /// memory is a `MAP_SHARED` mapping of one tmpfs file (vLLM 0.33's shared offload region
    /// in `/dev/shm`), kvtier maps the same file range again at a 2 MiB boundary, collapses it
    /// into huge pages (`MADV_COLLAPSE`; the data and the owner's mapping stay as they are, the
    /// physical pages become contiguous for every mapping) and moves rows through that mapping.
    /// Otherwise the owner's mapping is used with its 4 KiB pages. Either way the outcome is
    /// logged once and readable from [`PrimaryRegion::huge_pages`] and
    /// [`PrimaryRegion::small_pages_reason`]. Collapsing copies the region once (about
    /// 0.2 s per GiB on the development machine, see `docs/performance.md`); the pages are
    /// measured first (nothing to collapse on a huge-page tmpfs), and what does not fit 0.9 s
    /// continues in the background ([`PrimaryRegion::collapsing_in_background`]), so that
    /// this returns in about a second for any region size.
    ///
    /// # Safety
    /// As [`PrimaryRegion::adopt`]: `base` must point to `num_rows * row_stride` readable and
    /// writable bytes that stay mapped, unmoved, for the life of the returned value and every
    /// clone of the `Arc` it is put in.
    pub unsafe fn adopt_shared(
        base: *mut u8,
        row_stride: u64,
        num_rows: usize,
        mode: AdoptHugePages,
    ) -> Result<Self> {
        // SAFETY: the caller's promise, passed on.
        let mut region = unsafe { Self::adopt(base, row_stride, num_rows) }?;
        if mode == AdoptHugePages::Never {
            // The owner's mapping as it is; its memory may still be in 2 MiB pages (a
            // huge-page tmpfs), which is what a DMA segment follows: measured, not assumed.
            region.measured = shared_alias::probe_backing(region.base.as_ptr(), region.len());
            region.huge_page_share = region
                .measured
                .map_or(0.0, |m| whole_page_share(m, region.len()));
            region.huge_pages = region.huge_page_share == 1.0;
            region.small_pages_reason =
                (!region.huge_pages).then(|| "huge pages turned off for this region".to_string());
            log::info!(
                "adopted primary region ({} bytes): kept in the owner's mapping (huge pages \
                 turned off), {:.0} % of it in 2 MiB pages (measured)",
                region.len(),
                region.huge_page_share * 100.0
            );
            return Ok(region);
        }
        let started = std::time::Instant::now();
        match shared_alias::alias_and_collapse(region.base.as_ptr(), region.len()) {
            shared_alias::AliasOutcome::Huge {
                collapser,
                alias,
                share,
                shortfall,
                already_huge,
                measured,
            } => {
                region.measured = measured;
                region.collapser = collapser;
                region.base = NonNull::new(alias.base).ok_or_else(|| {
                    Error::new(ErrorKind::Internal, "the huge-page mapping is null")
                })?;
                region.backing = Backing::AdoptedAlias { _alias: alias };
                region.huge_page_share = share;
                region.huge_pages = shortfall.is_none();
                let took = started.elapsed().as_secs_f64();
                let how = if already_huge {
                    "already 2 MiB pages: the tmpfs gives them".to_string()
                } else {
                    format!("collapsed in {took:.2} s")
                };
                match &shortfall {
                    None => log::info!(
                        "adopted primary region ({} bytes): kvtier moves its rows through its \
                         own mapping of the same shared memory in 2 MiB pages (measured in \
                         /proc/self/smaps; {how}; the owner's mapping is unchanged)",
                        region.len()
                    ),
                    Some(why) => log::warn!(
                        "adopted primary region ({} bytes): kvtier moves its rows through its \
                         own mapping of the same shared memory, {:.0} % of it in 2 MiB pages \
                         (measured in /proc/self/smaps; {why}; {took:.2} s); large rows are \
                         staged through kvtier's own 2 MiB pages (a copy); {HOST_FIX_HINT}",
                        region.len(),
                        share * 100.0
                    ),
                }
                region.small_pages_reason = shortfall;
            }
            shared_alias::AliasOutcome::SmallPages(why) => {
                region.measured = backing::measure(region.base.as_ptr(), region.len());
                log::warn!(
                    "adopted primary region ({} bytes) stays in 4 KiB pages (measured: {:.0} % \
                     in 2 MiB pages): {why}; large rows are staged through kvtier's own 2 MiB \
                     pages (a copy) so that O_DIRECT transfers are not split into many DMA \
                     segments; {HOST_FIX_HINT}",
                    region.len(),
                    region
                        .measured
                        .map_or(0.0, |m| whole_page_share(m, region.len()))
                        * 100.0
                );
                region.small_pages_reason = Some(why);
            }
        }
        Ok(region)
    }

    /// A region made the way vLLM 0.33 makes its shared offload region (a file in `dir`,
    /// normally `/dev/shm`, mapped as Python's `mmap` maps it, 4 KiB pages, unlinked, pre-faulted
    /// with `MADV_POPULATE_WRITE`; see `vllm_shm`), adopted through
    /// [`PrimaryRegion::adopt_shared`] as the Python tier adopts vLLM's. For benchmarks and
    /// tests that must measure what kvtier does inside vLLM.
    pub fn create_vllm_shaped(
        num_rows: usize,
        row_stride: u64,
        dir: &std::path::Path,
        mode: AdoptHugePages,
    ) -> Result<Self> {
        Self::create_vllm_shaped_pinned(num_rows, row_stride, dir, mode, false)
    }

    /// As [`PrimaryRegion::create_vllm_shaped`], and with `pinned` the region is long-term
    /// pinned before kvtier adopts it, as vLLM's GPU workers pin it with `cudaHostRegister`
    /// (`vllm/v1/kv_offload/cpu/host_register.py`, from `create_worker` in
    /// `kv_offload/cpu/gpu_worker.py`) before the scheduler builds its secondary tiers: what a
    /// real deployment hands kvtier. The pin is an io_uring fixed-buffer registration of the
    /// owner's mapping (the same `FOLL_LONGTERM` pin), held until the region is dropped.
    pub fn create_vllm_shaped_pinned(
        num_rows: usize,
        row_stride: u64,
        dir: &std::path::Path,
        mode: AdoptHugePages,
        pinned: bool,
    ) -> Result<Self> {
        let (_, len) = check_geometry(row_stride, num_rows)?;
        let mut owner = vllm_shm::OwnerMapping::create(dir, len)?;
        if pinned {
            owner.pin()?;
        }
        // SAFETY: `owner` maps `len` bytes read-write and moves into the returned region,
        // whose backing drops the adopted view before it.
        let mut region =
            unsafe { Self::adopt_shared(owner.ptr.cast(), row_stride, num_rows, mode) }?;
        region.prefault = PrefaultMethod::PopulateWrite;
        let adopted = std::mem::replace(&mut region.backing, Backing::Adopted);
        region.backing = Backing::VllmShaped {
            _adopted: Box::new(adopted),
            _owner: Box::new(owner),
        };
        Ok(region)
    }

    fn prefault_pages(&self) -> PrefaultMethod {
        // SAFETY: the range is exactly our own mapping.
        let populated = unsafe {
            madvise(
                self.base.as_ptr().cast(),
                self.len(),
                Advice::LinuxPopulateWrite,
            )
        };
        match populated {
            Ok(()) => return PrefaultMethod::PopulateWrite,
            Err(e) => log::info!(
                "MADV_POPULATE_WRITE unavailable ({}); pre-faulting the primary region page by \
                 page",
                std::io::Error::from(e)
            ),
        }
        let page = ROW_ALIGNMENT;
        let mut off = 0;
        while off < self.len() {
            // SAFETY: `off < len`, inside our mapping; nobody else holds the region yet. A
            // volatile read-modify-write of one byte faults the page in without changing it.
            unsafe {
                let p = self.base.as_ptr().add(off);
                std::ptr::write_volatile(p, std::ptr::read_volatile(p));
            }
            off += page;
        }
        PrefaultMethod::TouchPages
    }

    /// Whether the rows kvtier moves are backed by 2 MiB pages, so that they are physically
    /// contiguous and a large O_DIRECT transfer is one DMA segment per 2 MiB (false for memory
    /// adopted with [`PrimaryRegion::adopt`]; see [`PrimaryRegion::adopt_shared`]).
    pub fn huge_pages(&self) -> bool {
        match &self.collapser {
            Some(c) => c.map.share() >= 1.0,
            None => self.huge_pages,
        }
    }

    /// Whether every byte of `[offset, offset + len)` of the region is in 2 MiB pages now
    /// (while a collapse continues in the background this changes as it goes).
    pub fn range_in_huge_pages(&self, offset: usize, len: usize) -> bool {
        match &self.collapser {
            Some(c) => c
                .map
                .range_is_huge(self.base.as_ptr() as usize + offset, len),
            None => self.huge_pages,
        }
    }

    /// Whether a collapse of the region is still running in the background (its rows are
    /// then not registered with io_uring, which would pin them; see `docs/performance.md`).
    pub fn collapsing_in_background(&self) -> bool {
        self.collapser.as_ref().is_some_and(|c| c.map.share() < 1.0)
    }

    /// The share (0 to 1) of the region's bytes kvtier moves through 2 MiB pages: 1 with
    /// [`PrimaryRegion::huge_pages`], between 0 and 1 when an adopted region collapsed only
    /// partly (free 2 MiB blocks of memory ran short).
    pub fn huge_page_share(&self) -> f64 {
        match &self.collapser {
            Some(c) => c.map.share(),
            None => self.huge_page_share,
        }
    }

    /// How the pages kvtier moves were found backed in `/proc/self/smaps` when the region was
    /// made or adopted (`None` where it was not measured: [`PrimaryRegion::adopt`], or no
    /// smaps).
    pub fn measured_backing(&self) -> Option<MeasuredBacking> {
        self.measured
    }

    /// The pages in words, for logs, reports and status: `2 MiB pages (measured)`, or
    /// `4 KiB pages, N % in 2 MiB pages (measured): why`.
    pub fn pages_description(&self) -> String {
        let how = if self.collapser.is_some() {
            "collapsing in the background"
        } else if self.measured.is_some() {
            "measured"
        } else {
            "not measured"
        };
        let share = self.huge_page_share();
        match self.small_pages_reason() {
            _ if self.collapser.is_some() && share >= 1.0 => format!("2 MiB pages ({how}, done)"),
            None => format!("2 MiB pages ({how})"),
            Some(why) if share > 0.0 => format!(
                "{:.0} % in 2 MiB pages, the rest 4 KiB ({how}): {why}",
                share * 100.0
            ),
            Some(why) => format!("4 KiB pages ({how}): {why}"),
        }
    }

    /// Why (some of) the rows stay in 4 KiB pages (`None` when
    /// [`PrimaryRegion::huge_pages`]).
    pub fn small_pages_reason(&self) -> Option<&str> {
        self.small_pages_reason.as_deref()
    }

    /// The other process's file this region maps ([`PrimaryRegion::map_shared_file`]), for
    /// kernel copies (`pread`) that fail with a short count or `EFAULT`, where a CPU access
    /// to a page its owner truncated away would raise `SIGBUS`. `None` for other regions.
    pub fn shared_file(&self) -> Option<BorrowedFd<'_>> {
        self.copy_fd.as_ref().map(AsFd::as_fd)
    }

    /// Bytes per row (a multiple of 4096): a row stride, `u64` as everywhere in kvtier
    /// ([`crate::geometry`]).
    pub fn row_stride(&self) -> u64 {
        self.row_stride as u64
    }

    /// Number of rows.
    pub fn num_rows(&self) -> usize {
        self.num_rows
    }

    /// Total bytes (`num_rows * row_stride`).
    pub fn len(&self) -> usize {
        self.num_rows * self.row_stride
    }

    /// Always false: a region has at least one row.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The base address. Valid for `len()` bytes while `self` lives.
    pub fn base_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// How the pages were faulted in.
    pub fn prefault_method(&self) -> PrefaultMethod {
        self.prefault
    }

    /// Whether kvtier created (and will unmap) this memory.
    pub fn is_owned(&self) -> bool {
        matches!(self.backing, Backing::Memfd { .. })
    }

    /// The memfd behind an owned region (to share it with another process), if any.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        match &self.backing {
            Backing::Memfd { fd } => Some(fd.as_fd()),
            Backing::Adopted
            | Backing::SharedFile
            | Backing::AdoptedAlias { .. }
            | Backing::VllmShaped { .. } => None,
        }
    }
}

impl Drop for PrimaryRegion {
    fn drop(&mut self) {
        // The background collapse stops (and its thread is joined) before any mapping goes.
        drop(self.collapser.take());
        if let Backing::Memfd { .. } | Backing::SharedFile = self.backing {
            // SAFETY: we mapped exactly this range in `create` or `map_shared_file` and no one
            // holds the region any more (it is dropped only when the last `Arc` goes, engines
            // included).
            if let Err(e) = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.len()) } {
                log::error!("munmap of the primary region failed: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests;
