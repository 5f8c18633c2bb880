//! Memory hints: large fixed arrays backed by transparent huge pages where the kernel allows
//! it, and a read prefetch.
//!
//! The slot table, key index and policy arrays are tens of MB for a million slots and are
//! accessed at random, so with 4 KiB pages almost every access misses the TLB (and in a VM
//! a TLB miss is a two-dimensional page walk). Asking for huge pages (`MADV_HUGEPAGE`, which
//! works when `/sys/kernel/mm/transparent_hugepage/enabled` is `always` or `madvise`) before
//! the memory is first touched removes most of those misses. It is only advice: when the
//! kernel refuses, the arrays work the same on small pages, and that is logged once.

use std::sync::Once;

const HUGE_PAGE: usize = 2 << 20;

/// A boxed slice of `n` values from `init`, whose 2 MiB-aligned interior is advised as
/// huge pages before it is written.
pub(crate) fn huge_slice<T>(n: usize, mut init: impl FnMut() -> T) -> Box<[T]> {
    let mut v: Vec<T> = Vec::with_capacity(n);
    advise_huge(v.as_mut_ptr().cast::<u8>(), n * std::mem::size_of::<T>());
    v.resize_with(n, &mut init);
    v.into_boxed_slice()
}

/// Asks the CPU to bring the cache line holding `value` closer (no effect on correctness).
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

fn advise_huge(ptr: *mut u8, len: usize) {
    if len < HUGE_PAGE {
        return;
    }
    let addr = ptr as usize;
    let start = addr.next_multiple_of(HUGE_PAGE);
    let end = (addr + len) / HUGE_PAGE * HUGE_PAGE;
    if end <= start {
        return;
    }
    // SAFETY: `[start, end)` lies inside the allocation that `ptr` heads (`len` bytes of a
    // live Vec's capacity); MADV_HUGEPAGE only changes how the kernel backs those pages and
    // never their contents or validity.
    let advised = unsafe {
        rustix::mm::madvise(
            start as *mut std::ffi::c_void,
            end - start,
            rustix::mm::Advice::LinuxHugepage,
        )
    };
    if let Err(err) = advised {
        static WARN: Once = Once::new();
        WARN.call_once(|| {
            log::info!(
                "primary tier: madvise(MADV_HUGEPAGE) failed ({err}); slot arrays use small \
                 pages (slower random access)"
            );
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_slice_initialises_every_element() {
        let mut next = 0u32;
        let s = huge_slice(3 * HUGE_PAGE / 4 + 5, || {
            next += 1;
            next
        });
        assert_eq!(s.len(), 3 * HUGE_PAGE / 4 + 5);
        assert!(s.iter().enumerate().all(|(i, &x)| x as usize == i + 1));
        assert!(huge_slice(0, || 1u8).is_empty());
    }
}
