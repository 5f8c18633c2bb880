//! Memory hints for kvtier's own in-process arrays (the primary tier's slot arrays, the G3 key
//! index): transparent huge pages for their 2 MiB-aligned interior, and a read prefetch; and
//! for rows a device has loaded into: taking their lines out of the CPU caches once they are
//! checked. Only advice: a refused hint changes speed, never contents. The unsafe calls live
//! here so that the tiers above use them as safe functions.

/// Huge-page size the hints align to.
pub(crate) use super::huge_pages::HUGE_PAGE;

/// Asks the CPU to bring the cache line holding `value` closer (no effect on correctness, and
/// none off x86-64).
#[inline(always)]
pub(crate) fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` needs SSE, which every x86-64 CPU has; a prefetch never faults
    // and `value` is a valid reference anyway.
    unsafe {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        _mm_prefetch::<_MM_HINT_T0>((value as *const T).cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

/// x86-64's cache line size, which [`evict_from_caches`] steps by.
const CACHE_LINE: usize = 64;

/// Writes back (when dirty) and drops every cache line holding a byte of `bytes` from every
/// CPU cache (`CLFLUSH`), so that the next device write into this memory does not meet copies
/// of it in the caches. No effect on contents, and none off x86-64.
///
/// Used on a loaded row after its CRC check has read it (`docs/performance.md`, "Small
/// rows": on a virtualised disk, reads into rows whose lines were left in the caches took up to
/// 1.5x as long).
pub(crate) fn evict_from_caches(bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    // Counted from the start of the line holding the first byte: that byte, then the first
    // byte of each further line, also when `bytes` does not start on a line boundary.
    let misalignment = bytes.as_ptr() as usize % CACHE_LINE;
    #[cfg(target_arch = "x86_64")]
    for from_line_start in (0..misalignment + bytes.len()).step_by(CACHE_LINE) {
        let offset = from_line_start.saturating_sub(misalignment);
        // SAFETY: `CLFLUSH` needs SSE2, which every x86-64 CPU has; `offset < bytes.len()`,
        // so the address lies inside the borrowed slice, and flushing a line never changes
        // what memory holds.
        unsafe { std::arch::x86_64::_mm_clflush(bytes.as_ptr().add(offset)) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = misalignment;
}

/// `MADV_HUGEPAGE` over the 2 MiB-aligned interior of `v`'s elements. `Ok` when there is no
/// whole huge page inside.
pub(crate) fn advise_huge_slice<T>(v: &[T]) -> rustix::io::Result<()> {
    advise_interior(v.as_ptr() as usize, std::mem::size_of_val(v))
}

/// `MADV_HUGEPAGE` over the 2 MiB-aligned interior of `v`'s unused capacity, before it is
/// first written (pages already touched are backed by huge pages only once the kernel
/// collapses them).
pub(crate) fn advise_huge_spare<T>(v: &mut Vec<T>) -> rustix::io::Result<()> {
    let spare = v.spare_capacity_mut();
    advise_interior(spare.as_ptr() as usize, std::mem::size_of_val(spare))
}

/// The advice over `[start, start + bytes)`, which the two callers above take from a live
/// allocation they borrow.
fn advise_interior(start: usize, bytes: usize) -> rustix::io::Result<()> {
    let aligned = start.next_multiple_of(HUGE_PAGE);
    let end = (start + bytes) / HUGE_PAGE * HUGE_PAGE;
    if end <= aligned {
        return Ok(());
    }
    // SAFETY: `[aligned, end)` lies inside the borrowed allocation `[start, start + bytes)`;
    // MADV_HUGEPAGE only changes how the kernel backs those pages, never their contents or
    // validity.
    unsafe {
        rustix::mm::madvise(
            aligned as *mut std::ffi::c_void,
            end - aligned,
            rustix::mm::Advice::LinuxHugepage,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicting_lines_from_the_caches_keeps_every_byte() {
        // Lengths around the line size, and a start off a line boundary.
        let v: Vec<u8> = (0..3 * CACHE_LINE + 17)
            .map(|i| (i * 7 + 3) as u8)
            .collect();
        for (start, len) in [
            (0, 0),
            (0, 1),
            (0, CACHE_LINE),
            (5, 2 * CACHE_LINE + 9),
            (0, v.len()),
        ] {
            let before = v[start..start + len].to_vec();
            evict_from_caches(&v[start..start + len]);
            assert_eq!(v[start..start + len], before[..]);
        }
        // The same bytes are still read back after their lines were flushed.
        assert_eq!(v[100], (100 * 7 + 3) as u8);
    }

    #[test]
    fn advice_covers_only_whole_interior_huge_pages() {
        // Too small for a whole aligned huge page: nothing to advise, never an error.
        assert!(advise_huge_slice(&[0u8; 4096]).is_ok());
        let mut v: Vec<u8> = Vec::with_capacity(3 * HUGE_PAGE);
        // Kernels without THP may refuse; either way the vector is untouched and usable.
        let _ = advise_huge_spare(&mut v);
        v.resize(3 * HUGE_PAGE, 7);
        assert!(v.iter().all(|&b| b == 7));
    }
}
