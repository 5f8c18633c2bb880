//! How a mapping is really backed: measured from `/proc/self/smaps`, never assumed.
//!
//! A page of a 2 MiB-aligned mapping is mapped by one PMD (one page-table entry for 2 MiB)
//! exactly when the memory behind it is one 2 MiB folio: the kernel maps a PMD-sized shmem
//! folio by PMD at fault time when the address and file offset allow it, and a 4 KiB folio
//! only by PTE. So the PMD-mapped bytes of kvtier's own 2 MiB-aligned mapping of a region
//! (`ShmemPmdMapped` for shmem: `/dev/shm` files and memfds; `FilePmdMapped` for other files;
//! `AnonHugePages` for anonymous memory), once every page of it is faulted in, are the bytes in
//! 2 MiB pages, whatever mapped them first and however they got there (`MADV_COLLAPSE`, a tmpfs
//! mounted `huge=within_size` or `huge=always`, `shmem_enabled=force`). A page pinned in 4 KiB
//! folios (for example by `cudaHostRegister`) stays PTE-mapped and counts as 4 KiB.
//!
//! `KernelPageSize` is reported too; it is the mapping's base page size (4 kB for shmem even
//! when huge), which is why the PMD counters are the measure.

use std::ffi::c_void;

use super::huge_pages::HUGE_PAGE;

/// What `/proc/self/smaps` says about a range of this process's address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MeasuredBacking {
    /// Bytes of the range covered by the mappings measured.
    pub bytes: u64,
    /// Of those, bytes mapped by PMDs (2 MiB pages).
    pub huge_bytes: u64,
    /// The largest `KernelPageSize` of the mappings (bytes).
    pub kernel_page_size: u64,
    /// Bytes of the range present in memory (`Rss`). Equal to `bytes` once the range is
    /// faulted in; less when only a sample of it was ([`MeasuredBacking::sampled`]).
    pub resident_bytes: u64,
    /// Only a sample of the range's 2 MiB pages was faulted in and measured (a large region:
    /// faulting all of it in would cost start-up time); the share is the sample's.
    pub sampled: bool,
}

impl MeasuredBacking {
    /// The share (0 to 1) of the measured bytes in 2 MiB pages.
    pub fn share(&self) -> f64 {
        if self.bytes == 0 {
            0.0
        } else {
            (self.huge_bytes as f64 / self.bytes as f64).min(1.0)
        }
    }

    /// The share (0 to 1) of the whole 2 MiB pages of a `len`-byte range (from its start,
    /// 2 MiB-aligned) in 2 MiB pages: of the resident bytes of a sample, else of every whole
    /// page (a partial last page can never be huge and does not count).
    pub fn share_of_whole_pages(&self, len: usize) -> f64 {
        let whole = (len / HUGE_PAGE * HUGE_PAGE) as u64;
        let base = if self.sampled {
            self.resident_bytes.min(whole)
        } else {
            whole
        };
        if base == 0 {
            0.0
        } else {
            (self.huge_bytes as f64 / base as f64).min(1.0)
        }
    }
}

/// One mapping's entry of an smaps file.
#[derive(Debug, Default, Clone, Copy)]
struct SmapsEntry {
    start: usize,
    end: usize,
    pmd_kb: u64,
    kernel_page_kb: u64,
    rss_kb: u64,
}

fn kb_field(line: &str, name: &str) -> Option<u64> {
    let rest = line.strip_prefix(name)?.strip_prefix(':')?;
    rest.trim().trim_end_matches("kB").trim().parse().ok()
}

/// The address range of an smaps line that starts a mapping (`start-end perms offset dev
/// inode [path]`); `None` for a field line (`Name:   value`).
fn mapping_header(line: &str) -> Option<(usize, usize)> {
    let mut fields = line.split_whitespace();
    let (start, end) = fields.next()?.split_once('-')?;
    // A field line's first token ends with ':'; a header has perms and an offset next.
    let perms = fields.next()?;
    if perms.len() != 4 {
        return None;
    }
    Some((
        usize::from_str_radix(start, 16).ok()?,
        usize::from_str_radix(end, 16).ok()?,
    ))
}

/// Parses the text of an smaps file into its mappings.
fn parse_smaps(text: &str) -> Vec<SmapsEntry> {
    let mut out: Vec<SmapsEntry> = Vec::new();
    for line in text.lines() {
        if let Some((start, end)) = mapping_header(line) {
            out.push(SmapsEntry {
                start,
                end,
                ..SmapsEntry::default()
            });
            continue;
        }
        let Some(cur) = out.last_mut() else { continue };
        for name in ["AnonHugePages", "ShmemPmdMapped", "FilePmdMapped"] {
            if let Some(kb) = kb_field(line, name) {
                cur.pmd_kb += kb;
            }
        }
        if let Some(kb) = kb_field(line, "KernelPageSize") {
            cur.kernel_page_kb = kb;
        }
        if let Some(kb) = kb_field(line, "Rss") {
            cur.rss_kb = kb;
        }
    }
    out
}

/// Sums the entries overlapping `[base, base + len)`. A mapping only partly inside the range
/// contributes its PMD bytes in proportion to the overlap.
fn measure_in(entries: &[SmapsEntry], base: usize, len: usize) -> MeasuredBacking {
    let end = base + len;
    let mut m = MeasuredBacking::default();
    for e in entries.iter().filter(|e| e.start < end && base < e.end) {
        let overlap = (e.end.min(end) - e.start.max(base)) as u64;
        let size = (e.end - e.start) as u64;
        let pmd = (e.pmd_kb * 1024).min(size);
        let rss = (e.rss_kb * 1024).min(size);
        let part = |v: u64| {
            if overlap == size {
                v
            } else {
                (v as u128 * overlap as u128 / size as u128) as u64
            }
        };
        m.bytes += overlap;
        m.huge_bytes += part(pmd);
        m.resident_bytes += part(rss);
        m.kernel_page_size = m.kernel_page_size.max(e.kernel_page_kb * 1024);
    }
    m
}

/// Measures `[base, base + len)` of this process from `/proc/self/smaps`; `None` when the file
/// cannot be read or no mapping holds the range. Pages not faulted in count as 4 KiB: fault the
/// range in first ([`populate_read`]).
pub fn measure(base: *const u8, len: usize) -> Option<MeasuredBacking> {
    let text = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let m = measure_in(&parse_smaps(&text), base as usize, len);
    (m.bytes > 0).then_some(m)
}

/// Regions up to this size are faulted in and measured whole; larger ones by a sample of
/// [`SAMPLE_PAGES`] 2 MiB pages spread evenly (faulting 64 GiB of 4 KiB pages in takes seconds
/// of start-up; the sample a few milliseconds).
pub const MEASURE_WHOLE_LIMIT: usize = 4 << 30;

/// 2 MiB pages measured in a large region.
pub const SAMPLE_PAGES: usize = 1024;

/// Faults in (for reading) and measures `[base, base + len)`, a 2 MiB-aligned mapping of this
/// process: whole up to [`MEASURE_WHOLE_LIMIT`], else a sample of its 2 MiB pages.
///
/// # Safety
/// The range is a mapping of this process that nobody unmaps meanwhile.
pub unsafe fn fault_in_and_measure(base: *mut u8, len: usize) -> Option<MeasuredBacking> {
    let pages = len / HUGE_PAGE;
    let sampled = len > MEASURE_WHOLE_LIMIT && pages > SAMPLE_PAGES;
    if sampled {
        for k in 0..SAMPLE_PAGES {
            let page = k * pages / SAMPLE_PAGES;
            // SAFETY: `page < pages`: the 2 MiB at it lie inside the caller's mapping.
            if let Err(e) = unsafe { populate_read(base.add(page * HUGE_PAGE), HUGE_PAGE) } {
                log::debug!("MADV_POPULATE_READ of a sampled page failed: {e}");
            }
        }
    } else {
        // SAFETY: the caller's promise.
        if let Err(e) = unsafe { populate_read(base, len) } {
            log::debug!("MADV_POPULATE_READ before measuring the region's pages failed: {e}");
        }
    }
    let mut m = measure(base, len)?;
    m.sampled = sampled;
    Some(m)
}

/// Faults every page of `[base, base + len)` in for reading (`MADV_POPULATE_READ`, Linux
/// 5.14 or newer), so that [`measure`] sees how each is backed. On shared memory that another
/// process already faulted in this allocates nothing.
///
/// # Safety
/// The range is a mapping of this process that nobody unmaps meanwhile.
pub unsafe fn populate_read(base: *mut u8, len: usize) -> std::io::Result<()> {
    // SAFETY: the caller's promise; POPULATE_READ changes no byte.
    unsafe {
        rustix::mm::madvise(
            base.cast::<c_void>(),
            len,
            rustix::mm::Advice::LinuxPopulateRead,
        )
    }
    .map_err(std::io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
7f0000000000-7f0000400000 rw-s 00000000 00:01 42                         /memfd:x (deleted)
Size:               4096 kB
KernelPageSize:        4 kB
AnonHugePages:         0 kB
ShmemPmdMapped:     2048 kB
FilePmdMapped:         0 kB
VmFlags: rd wr sh mr mw me ms
7f0000400000-7f0000800000 rw-s 00400000 00:01 42                         /memfd:x (deleted)
Size:               4096 kB
KernelPageSize:        4 kB
ShmemPmdMapped:     4096 kB
";

    #[test]
    fn smaps_sums_pmd_mapped_bytes_over_the_range() {
        let e = parse_smaps(SMAPS);
        assert_eq!(e.len(), 2);
        let whole = measure_in(&e, 0x7f00_0000_0000, 8 << 20);
        assert_eq!(whole.bytes, 8 << 20);
        assert_eq!(whole.huge_bytes, 6 << 20);
        assert_eq!(whole.kernel_page_size, 4096);
        assert!((whole.share() - 0.75).abs() < 1e-9);
        // Half of the second mapping only: half its PMD bytes.
        let half = measure_in(&e, 0x7f00_0040_0000, 2 << 20);
        assert_eq!((half.bytes, half.huge_bytes), (2 << 20, 2 << 20));
        assert_eq!(measure_in(&e, 0x1000, 4096).bytes, 0);
    }

    #[test]
    fn a_sampled_measure_is_a_share_of_the_resident_bytes() {
        let m = MeasuredBacking {
            bytes: 64 << 30,
            huge_bytes: 1 << 30,
            kernel_page_size: 4096,
            resident_bytes: 2 << 30,
            sampled: true,
        };
        assert!((m.share_of_whole_pages(64 << 30) - 0.5).abs() < 1e-9);
        let whole = MeasuredBacking {
            sampled: false,
            resident_bytes: 64 << 30,
            ..m
        };
        assert!((whole.share_of_whole_pages(64 << 30) - 1.0 / 64.0).abs() < 1e-9);
        // A partial last 2 MiB page never counts against the share.
        let tail = MeasuredBacking {
            bytes: (4 << 20) + 4096,
            huge_bytes: 4 << 20,
            resident_bytes: (4 << 20) + 4096,
            sampled: false,
            kernel_page_size: 4096,
        };
        assert_eq!(tail.share_of_whole_pages((4 << 20) + 4096), 1.0);
    }
}
