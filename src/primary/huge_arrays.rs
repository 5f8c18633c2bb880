//! The primary tier's large fixed arrays, backed by transparent huge pages where the kernel
//! allows it (through `region::mem_hints`), and a read prefetch.
//!
//! The slot table, key index and policy arrays are tens of MB for a million slots and are
//! accessed at random, so with 4 KiB pages almost every access misses the TLB (and in a VM
//! a TLB miss is a two-dimensional page walk). Asking for huge pages (`MADV_HUGEPAGE`, which
//! works when `/sys/kernel/mm/transparent_hugepage/enabled` is `always` or `madvise`) before
//! the memory is first touched removes most of those misses. It is only advice: when the
//! kernel refuses, the arrays work the same on small pages, and that is logged once.

use std::sync::Once;

use crate::region::mem_hints::advise_huge_spare;
#[cfg(test)]
use crate::region::mem_hints::HUGE_PAGE;

/// A boxed slice of `n` values from `init`, whose 2 MiB-aligned interior is advised as
/// huge pages before it is written.
pub(crate) fn huge_slice<T>(n: usize, mut init: impl FnMut() -> T) -> Box<[T]> {
    let mut v: Vec<T> = Vec::with_capacity(n);
    advise_huge(&mut v);
    v.resize_with(n, &mut init);
    v.into_boxed_slice()
}

pub(crate) use crate::region::mem_hints::prefetch;

/// Advises the interior of `v`'s spare capacity as huge pages; a refusal is logged once.
fn advise_huge<T>(v: &mut Vec<T>) {
    if let Err(err) = advise_huge_spare(v) {
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
