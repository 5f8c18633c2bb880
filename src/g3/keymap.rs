//! A compact open-addressing table from key hash to slot, for the index.
//!
//! Each bucket is one `u64`: the low 32 bits of the key's hash in the high half, `slot + 1` in
//! the low half (0 = empty). Linear probing at load factor <= 1/2 with backward-shift
//! deletion (no tombstones). The table stores no keys: callers confirm a candidate slot by
//! comparing the key kept in their slot table. 8 bytes per bucket instead of a hash map's
//! key + value + control bytes keeps recovery of millions of entries cache- and TLB-friendly;
//! large tables are advised to use transparent huge pages.

use crate::region::mem_hints::{HUGE_PAGE, advise_huge_slice, advise_huge_spare};

/// A slot number within the stripe set.
pub type Slot = u32;

/// Hash-to-slot table.
#[derive(Debug, Clone)]
pub struct KeyTable {
    buckets: Vec<u64>,
    mask: usize,
    len: usize,
}

const EMPTY: u64 = 0;

fn pack(hash: u64, slot: Slot) -> u64 {
    ((hash & 0xffff_ffff) << 32) | (u64::from(slot) + 1)
}

fn slot_of(b: u64) -> Slot {
    ((b & 0xffff_ffff) - 1) as Slot
}

impl KeyTable {
    /// A table for up to `entries` entries.
    pub fn with_capacity(entries: usize) -> Self {
        // At most 2^32 buckets: the home position is recomputed from the stored 32 hash bits.
        let n = (entries.saturating_mul(2))
            .max(16)
            .next_power_of_two()
            .min(1 << 32);
        let buckets = vec![EMPTY; n];
        advise_huge_pages(&buckets);
        KeyTable {
            buckets,
            mask: n - 1,
            len: 0,
        }
    }

    /// Entries held.
    #[cfg(any(test, feature = "test-support"))]
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    #[cfg(any(test, feature = "test-support"))]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn home(&self, hash32: u64) -> usize {
        (hash32 as usize) & self.mask
    }

    /// Hints the CPU to load the bucket where `hash` starts probing (recovery issues these a
    /// batch ahead, so that the cache misses of many inserts overlap).
    pub fn prefetch(&self, hash: u64) {
        prefetch(&self.buckets[self.home(hash & 0xffff_ffff)]);
    }

    /// The slot whose key has `hash` and satisfies `is_key`, if any.
    pub fn find(&self, hash: u64, mut is_key: impl FnMut(Slot) -> bool) -> Option<Slot> {
        let tag = hash & 0xffff_ffff;
        let mut i = self.home(tag);
        loop {
            let b = self.buckets[i];
            if b == EMPTY {
                return None;
            }
            if b >> 32 == tag && is_key(slot_of(b)) {
                return Some(slot_of(b));
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Inserts `slot` under `hash`. The caller guarantees the key is not present and that the
    /// table holds fewer entries than its capacity.
    pub fn insert(&mut self, hash: u64, slot: Slot) {
        debug_assert!(self.len < self.buckets.len() / 2 + 1);
        let b = pack(hash, slot);
        let mut i = self.home(hash & 0xffff_ffff);
        while self.buckets[i] != EMPTY {
            i = (i + 1) & self.mask;
        }
        self.buckets[i] = b;
        self.len += 1;
    }

    /// Removes the entry `(hash, slot)`. Returns whether it was present.
    pub fn remove(&mut self, hash: u64, slot: Slot) -> bool {
        let want = pack(hash, slot);
        let mut i = self.home(hash & 0xffff_ffff);
        loop {
            let b = self.buckets[i];
            if b == EMPTY {
                return false;
            }
            if b == want {
                break;
            }
            i = (i + 1) & self.mask;
        }
        // Backward-shift deletion: pull later members of the probe run into the hole when
        // their home position allows it.
        self.buckets[i] = EMPTY;
        self.len -= 1;
        let mut hole = i;
        let mut j = (i + 1) & self.mask;
        loop {
            let b = self.buckets[j];
            if b == EMPTY {
                return true;
            }
            let home = self.home(b >> 32);
            if (j.wrapping_sub(home) & self.mask) >= (j.wrapping_sub(hole) & self.mask) {
                self.buckets[hole] = b;
                self.buckets[j] = EMPTY;
                hole = j;
            }
            j = (j + 1) & self.mask;
        }
    }
}

pub(crate) use crate::region::mem_hints::prefetch;

/// Asks for transparent huge pages over the page-aligned part of a large vector (a hint: the
/// result is ignored; small vectors are left alone).
pub fn advise_huge_pages<T>(v: &[T]) {
    advise_range(std::mem::size_of_val(v), || advise_huge_slice(v));
}

/// [`advise_huge_pages`] over a vector's unused capacity, before it is first written (pages
/// already touched are not backed by huge pages until the kernel collapses them later).
pub fn advise_huge_pages_spare<T>(v: &mut Vec<T>) {
    let bytes = std::mem::size_of_val(v.spare_capacity_mut());
    advise_range(bytes, || advise_huge_spare(v));
}

/// `advise` for a table of `bytes`, given only to tables of at least two huge
/// pages (a refusal only leaves the table in small pages).
fn advise_range(bytes: usize, advise: impl FnOnce() -> rustix::io::Result<()>) {
    if bytes >= 2 * HUGE_PAGE {
        let _ = advise();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn insert_find_remove_against_a_model() {
        let mut t = KeyTable::with_capacity(64);
        let mut model: HashMap<Slot, u64> = HashMap::new();
        // Colliding hashes (same low bits) exercise probe runs and backward shifts.
        let hash = |s: Slot| u64::from(s % 7) * 0x1_0000_0000 + u64::from(s % 5);
        let mut x = 12345u64;
        for _ in 0..5000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let s = (x % 64) as Slot;
            if let std::collections::hash_map::Entry::Vacant(e) = model.entry(s) {
                t.insert(hash(s), s);
                e.insert(hash(s));
            } else {
                assert!(t.remove(hash(s), s));
                model.remove(&s);
            }
            assert_eq!(t.len(), model.len());
            for probe in 0..64 {
                let found = t.find(hash(probe), |c| c == probe);
                assert_eq!(found.is_some(), model.contains_key(&probe), "slot {probe}");
            }
        }
        assert!(!t.remove(hash(99), 99));
    }
}
