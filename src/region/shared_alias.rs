//! Huge pages for an adopted region: a second, 2 MiB-aligned mapping of the same shared memory.
//!
//! vLLM 0.33 hands over a `/dev/shm` file that every process maps with Python's `mmap` (an
//! address of the kernel's choosing, 4 KiB pages) and pre-faults with `MADV_POPULATE_WRITE`
//! (`vllm/v1/kv_offload/cpu/shared_offload_region.py`). Every 2 MiB row of it is ~512
//! scattered pages, and an O_DIRECT transfer is one DMA segment per physically contiguous run:
//! a block device taking 254 segments per request splits every row into several requests.
//!
//! The fix needs nothing from vLLM. The region's pages live in the file's page cache, which
//! every mapping of the file shares. kvtier maps the same file range a second time at a 2 MiB
//! boundary (file offset congruent to the address modulo 2 MiB), asks `MADV_COLLAPSE`
//! (Linux >= 6.1) to back it with 2 MiB pages (the kernel copies the data into the huge page
//! and remaps every mapping of it: vLLM's own mapping sees the same bytes, now in physically
//! contiguous memory) and does its own I/O through that second mapping, so a 2 MiB row is one
//! DMA segment and io_uring registers one buffer segment per huge page.
//!
//! Used only when the range is a `MAP_SHARED` mapping of one file on tmpfs (shmem); the file is
//! reopened through `/proc/self/map_files` or a descriptor the process holds (vLLM keeps its
//! own open; the file may be unlinked) and checked to be the mapped inode. Anything else keeps
//! the caller's mapping and its 4 KiB pages, with the reason in [`AliasOutcome::SmallPages`].

use std::ffi::c_void;
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::MetadataExt;

use rustix::mm::munmap;

use super::backing::{MeasuredBacking, fault_in_and_measure, measure};
use super::huge_pages::{
    Collapser, HUGE_PAGE, HugeMap, collapse_budget, collapse_pages_with, map_shared_aligned,
};

/// `statfs.f_type` of tmpfs / shmem (`TMPFS_MAGIC`).
const TMPFS_MAGIC: i64 = 0x0102_1994;

/// What adopting a range with huge pages came to.
#[derive(Debug)]
pub(super) enum AliasOutcome {
    /// A 2 MiB-aligned mapping of the same memory, collapsed into huge pages (`share` of them;
    /// `shortfall` says why not all).
    Huge {
        collapser: Option<Collapser>,
        alias: Alias,
        share: f64,
        shortfall: Option<String>,
        already_huge: bool,
        measured: Option<MeasuredBacking>,
    },
    /// Keep the caller's mapping (4 KiB pages); the reason says why.
    SmallPages(String),
}

/// kvtier's own mapping of the adopted memory. Unmapped on drop.
#[derive(Debug)]
pub(super) struct Alias {
    /// Start of the mapping (2 MiB-aligned).
    map: *mut c_void,
    /// Bytes mapped.
    map_len: usize,
    /// Where the adopted range starts inside the mapping.
    pub(super) base: *mut u8,
}

impl Drop for Alias {
    fn drop(&mut self) {
        // SAFETY: `[map, map + map_len)` is the mapping made in `alias_and_collapse`, owned by
        // this value alone; the region drops it only after every user of its rows let go.
        if let Err(e) = unsafe { munmap(self.map, self.map_len) } {
            log::error!("munmap of the adopted region's huge-page mapping failed: {e}");
        }
    }
}

/// One line of `/proc/self/maps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct MapsEntry {
    pub(super) start: usize,
    pub(super) end: usize,
    pub(super) shared: bool,
    pub(super) offset: u64,
    pub(super) dev_major: u32,
    pub(super) dev_minor: u32,
    pub(super) inode: u64,
    pub(super) path: String,
}

/// Parses one `/proc/<pid>/maps` line; `None` for a line of another shape.
pub(super) fn parse_maps_line(line: &str) -> Option<MapsEntry> {
    let mut fields = line.splitn(6, ' ');
    let range = fields.next()?;
    let perms = fields.next()?;
    let offset = u64::from_str_radix(fields.next()?, 16).ok()?;
    let (major, minor) = fields.next()?.split_once(':')?;
    let inode = fields.next()?.parse().ok()?;
    let path = fields.next().unwrap_or("").trim_start().to_string();
    let (start, end) = range.split_once('-')?;
    Some(MapsEntry {
        start: usize::from_str_radix(start, 16).ok()?,
        end: usize::from_str_radix(end, 16).ok()?,
        shared: perms.as_bytes().get(3) == Some(&b's'),
        offset,
        dev_major: u32::from_str_radix(major, 16).ok()?,
        dev_minor: u32::from_str_radix(minor, 16).ok()?,
        inode,
        path,
    })
}

/// The mapping holding `addr` in this process.
fn mapping_of(addr: usize) -> Result<MapsEntry, String> {
    let maps = std::fs::read_to_string("/proc/self/maps")
        .map_err(|e| format!("cannot read /proc/self/maps: {e}"))?;
    maps.lines()
        .filter_map(parse_maps_line)
        .find(|m| m.start <= addr && addr < m.end)
        .ok_or_else(|| format!("no mapping holds address {addr:#x}"))
}

fn same_inode(meta: &std::fs::Metadata, m: &MapsEntry) -> bool {
    let dev = meta.dev();
    meta.ino() == m.inode
        && rustix::fs::major(dev) == m.dev_major
        && rustix::fs::minor(dev) == m.dev_minor
}

fn open_rw(path: &std::path::Path) -> Option<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .ok()
}

/// Opens the file behind mapping `m` read-write: through `/proc/self/map_files` (needs
/// `CAP_CHECKPOINT_RESTORE` or root), a descriptor of this process open on the same inode, or
/// its path; whichever it is must be the mapped inode.
fn open_mapped_file(m: &MapsEntry) -> Result<File, String> {
    let map_file = format!("/proc/self/map_files/{:x}-{:x}", m.start, m.end);
    let mut candidates = vec![std::path::PathBuf::from(map_file)];
    if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
        for entry in dir.flatten() {
            let path = entry.path();
            // `metadata` follows the link to the open file, unlinked or not.
            if std::fs::metadata(&path).is_ok_and(|meta| same_inode(&meta, m)) {
                candidates.push(path);
            }
        }
    }
    if !m.path.ends_with(" (deleted)") && m.path.starts_with('/') {
        candidates.push(m.path.clone().into());
    }
    for path in candidates {
        if let Some(f) = open_rw(&path)
            && f.metadata().is_ok_and(|meta| same_inode(&meta, m))
        {
            return Ok(f);
        }
    }
    Err(format!(
        "cannot reopen {} read-write (no /proc/self/map_files access, no descriptor open on it)",
        m.path
    ))
}

/// Finds the shared memory file behind `[base, base + len)`, maps the same range again at a
/// 2 MiB boundary and collapses it into huge pages. Never touches the caller's mapping.
pub(super) fn alias_and_collapse(base: *mut u8, len: usize) -> AliasOutcome {
    match try_alias(base, len) {
        Ok(outcome) => outcome,
        Err(why) => AliasOutcome::SmallPages(why),
    }
}

fn try_alias(base: *mut u8, len: usize) -> Result<AliasOutcome, String> {
    if len < HUGE_PAGE {
        return Err(format!(
            "the region ({len} bytes) is smaller than one 2 MiB page"
        ));
    }
    let addr = base as usize;
    let m = mapping_of(addr)?;
    if m.inode == 0 || !m.shared {
        return Err("the region is not a shared mapping of a file (MAP_SHARED)".into());
    }
    if addr + len > m.end {
        return Err(format!(
            "the region spans several mappings ({} of {len} bytes in the first)",
            m.end - addr
        ));
    }
    let file = open_mapped_file(&m)?;
    let offset = m.offset + (addr - m.start) as u64;
    let mapped = map_collapsed(file.as_fd(), offset, len, &m.path)?;
    if mapped.share == 0.0 && mapped.collapser.is_none() {
        // Nothing gained over the caller's own mapping: keep that one.
        return Err(mapped
            .shortfall
            .unwrap_or_else(|| "no huge page collapsed".into()));
    }
    Ok(AliasOutcome::Huge {
        collapser: mapped.collapser,
        alias: mapped.alias,
        share: mapped.share,
        shortfall: mapped.shortfall,
        already_huge: mapped.already_huge,
        measured: mapped.measured,
    })
}

/// A 2 MiB-aligned mapping of a file range and how much of it is in huge pages.
#[derive(Debug)]
pub(super) struct Collapsed {
    /// The collapse still running in the background, if any (declared before `alias`: it is
    /// dropped, and its thread stopped, before the mapping goes).
    pub(super) collapser: Option<Collapser>,
    pub(super) alias: Alias,
    /// Share (0 to 1) of its whole 2 MiB pages collapsed.
    pub(super) share: f64,
    /// Why not all (`None` when every page is huge).
    pub(super) shortfall: Option<String>,
    /// The pages were 2 MiB pages before anything was collapsed (a huge-page tmpfs).
    pub(super) already_huge: bool,
    /// What `/proc/self/smaps` said at the end, when it could tell.
    pub(super) measured: Option<MeasuredBacking>,
}

/// Maps `len` bytes of the file `fd` (`name` in messages) from `offset` shared, read-write,
/// at an address congruent to `offset` modulo 2 MiB, and collapses the mapping into 2 MiB
/// pages where the file is on tmpfs: what [`PrimaryRegion::adopt_shared`] does with the file
/// behind adopted memory, and the node service with an engine's region file
/// ([`PrimaryRegion::map_shared_file`]). Errors only when no such mapping can be made (the
/// range is under 2 MiB, the file shorter than it, `mmap` fails); a mapping left in 4 KiB
/// pages comes back with share 0 and the reason.
///
/// [`PrimaryRegion::adopt_shared`]: super::PrimaryRegion::adopt_shared
/// [`PrimaryRegion::map_shared_file`]: super::PrimaryRegion::map_shared_file
pub(super) fn map_collapsed(
    fd: BorrowedFd<'_>,
    offset: u64,
    len: usize,
    name: &str,
) -> Result<Collapsed, String> {
    // The start-up budget covers this whole function (mapping, measuring, collapsing), not
    // only the collapse: adoption adds at most about `collapse_budget()` to a constructor.
    let started = std::time::Instant::now();
    if len < HUGE_PAGE {
        return Err(format!(
            "the region ({len} bytes) is smaller than one 2 MiB page"
        ));
    }
    let alias = map_aligned_range(fd, offset, len, name)?;
    let (map, map_len) = (alias.map, alias.map_len);
    let fs = rustix::fs::fstatfs(fd).map_err(|e| format!("fstatfs failed: {e}"))?;
    if fs.f_type as i64 != TMPFS_MAGIC {
        return Ok(Collapsed {
            collapser: None,
            alias,
            share: 0.0,
            shortfall: Some(format!(
                "{name} is not on tmpfs/shmem (f_type {:#x})",
                fs.f_type
            )),
            already_huge: false,
            measured: None,
        });
    }
    let whole = map_len / HUGE_PAGE;
    // How the pages are backed before anything is done: on a tmpfs mounted
    // `huge=within_size` (the host fix, `docs/vllm.md`) they already are 2 MiB pages.
    let before = measure_mapping(map.cast(), map_len);
    if before.is_some_and(|m| m.share_of_whole_pages(map_len) >= 1.0) {
        return Ok(Collapsed {
            collapser: None,
            alias,
            share: 1.0,
            shortfall: None,
            already_huge: true,
            measured: before,
        });
    }
    let mut done = vec![false; whole];
    let budget = collapse_budget().saturating_sub(started.elapsed());
    // SAFETY: `map` is 2 MiB-aligned and its `whole` huge pages lie inside our own mapping.
    let (collapsed, last_error, untried) =
        unsafe { collapse_pages_with(map.cast(), whole, Some(budget), &mut |i| done[i] = true) };
    // Out of time with pages left: they are collapsed in the background while the tier
    // serves (the engine stages the rows that are not in 2 MiB pages yet).
    let collapser = untried.and_then(|from| {
        let huge = std::sync::Arc::new(HugeMap::new(map as usize, whole, &done));
        // SAFETY: the Collapser is dropped before the mapping (`Collapsed` and the region
        // drop it first).
        unsafe { Collapser::start(huge, from) }
    });
    if let Some(c) = collapser {
        return Ok(Collapsed {
            shortfall: Some(format!(
                "{:.0} % of {whole} huge pages collapsed at start-up; MADV_COLLAPSE continues \
                 in the background",
                c.map.share() * 100.0
            )),
            share: c.map.share(),
            collapser: Some(c),
            alias,
            already_huge: false,
            measured: None,
        });
    }
    Ok(collapse_outcome(alias, whole, collapsed, last_error))
}

/// The 2 MiB-aligned shared mapping of `len` bytes of `fd` from `offset` that
/// [`map_collapsed`] collapses: it starts at the 2 MiB boundary below `offset` and covers
/// whole huge pages where the file has them, so that the range's tail collapses too.
fn map_aligned_range(
    fd: BorrowedFd<'_>,
    offset: u64,
    len: usize,
    name: &str,
) -> Result<Alias, String> {
    let file_len = rustix::fs::fstat(fd)
        .map_err(|e| format!("cannot stat {name}: {e}"))?
        .st_size;
    let file_len = u64::try_from(file_len).unwrap_or(0);
    let head = (offset % HUGE_PAGE as u64) as usize;
    let map_offset = offset - head as u64;
    let wanted = (head + len).next_multiple_of(HUGE_PAGE) as u64;
    let map_len = wanted.min(file_len.saturating_sub(map_offset)) as usize;
    if map_len < head + len {
        return Err(format!(
            "{name} is shorter ({file_len} bytes) than the range to map"
        ));
    }
    // `map_offset` is a multiple of 2 MiB and the file holds `map_offset + map_len` bytes.
    let map = map_shared_aligned(fd, map_offset, map_len)
        .map_err(|e| format!("cannot map {name} at a 2 MiB boundary: {e}"))?;
    Ok(Alias {
        map,
        map_len,
        // SAFETY: `head < map_len`; inside the mapping just made.
        base: unsafe { map.cast::<u8>().add(head) },
    })
}

/// What [`map_collapsed`] reports once the collapse of `alias`'s `whole` huge pages is over
/// (`collapsed` of them by the calls, `last_error` the last failure): the share is what the
/// kernel reports afterwards, not what the calls returned.
fn collapse_outcome(
    alias: Alias,
    whole: usize,
    collapsed: usize,
    last_error: Option<std::io::Error>,
) -> Collapsed {
    let measured = measure_mapping(alias.map.cast(), alias.map_len);
    let share = measured.map_or(collapsed as f64 / whole as f64, |m| {
        m.share_of_whole_pages(alias.map_len)
    });
    if share == 0.0 {
        let e = last_error.map_or_else(|| "nothing to collapse".to_string(), |e| e.to_string());
        let pinned = if e.contains("os error 11") {
            "; EAGAIN on every page: they are pinned (vLLM pins its region with \
             cudaHostRegister before kvtier adopts it)"
        } else {
            ""
        };
        return Collapsed {
            collapser: None,
            alias,
            share: 0.0,
            shortfall: Some(format!(
                "MADV_COLLAPSE failed ({e}{pinned}; needs Linux >= 6.1, \
                 transparent_hugepage/shmem_enabled other than `deny`, free 2 MiB blocks of \
                 memory, and pages nobody pins)"
            )),
            already_huge: false,
            measured,
        };
    }
    // Even a partial collapse helps: every collapsed huge page is one DMA segment.
    let shortfall = (share < 1.0).then(|| {
        let e = last_error.map_or_else(|| "no error".to_string(), |e| e.to_string());
        format!(
            "{:.0} % of {whole} huge pages stayed in 4 KiB pages (MADV_COLLAPSE: {e})",
            (1.0 - share) * 100.0
        )
    });
    Collapsed {
        collapser: None,
        alias,
        share,
        shortfall,
        already_huge: false,
        measured,
    }
}

/// Faults `[base, base + len)` (kvtier's own mapping) in for reading and measures how it is
/// backed (`super::backing`); `None` when `/proc/self/smaps` cannot tell.
pub(super) fn measure_mapping(base: *mut u8, len: usize) -> Option<MeasuredBacking> {
    // SAFETY: the caller's own live mapping; POPULATE_READ changes no byte.
    unsafe { fault_in_and_measure(base, len) }
}

/// How the memory behind `[base, base + len)` (a mapping of this process, possibly at an
/// address that cannot take 2 MiB pages, like vLLM's own) is backed: measured through a
/// temporary 2 MiB-aligned mapping of the same file where it is a shared file mapping,
/// otherwise on the range itself.
pub(super) fn probe_backing(base: *mut u8, len: usize) -> Option<MeasuredBacking> {
    let direct = || measure(base, len);
    if len < HUGE_PAGE {
        return direct();
    }
    let Ok(m) = mapping_of(base as usize) else {
        return direct();
    };
    if m.inode == 0 || !m.shared || base as usize + len > m.end {
        return direct();
    }
    let Ok(file) = open_mapped_file(&m) else {
        return direct();
    };
    let offset = m.offset + (base as usize - m.start) as u64;
    let head = (offset % HUGE_PAGE as u64) as usize;
    let map_len = (head + len).next_multiple_of(4096);
    let map = map_shared_aligned(file.as_fd(), offset - head as u64, map_len).ok()?;
    let probe = Alias {
        map,
        map_len,
        base: map.cast(),
    };
    // SAFETY: `head + len <= map_len`, inside the probe mapping.
    let measured = measure_mapping(unsafe { probe.base.add(head) }, len);
    drop(probe);
    measured
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_parse() {
        let m = parse_maps_line(
            "7f1c2a000000-7f1c2a400000 rw-s 00200000 00:1a 123456                     \
             /dev/shm/vllm_offload_x.mmap (deleted)",
        )
        .unwrap();
        assert_eq!((m.start, m.end), (0x7f1c2a000000, 0x7f1c2a400000));
        assert!(m.shared);
        assert_eq!(m.offset, 0x200000);
        assert_eq!((m.dev_major, m.dev_minor, m.inode), (0, 0x1a, 123456));
        assert_eq!(m.path, "/dev/shm/vllm_offload_x.mmap (deleted)");
        let anon = parse_maps_line("7ffd1000-7ffd3000 rw-p 00000000 00:00 0 ").unwrap();
        assert!(!anon.shared);
        assert_eq!(anon.inode, 0);
        assert_eq!(anon.path, "");
        assert!(parse_maps_line("garbage").is_none());
    }
}
