//! A compact open-addressing hash index from a 64-bit hash to a dense `u32` id, and the seeded
//! key hash it is used with.
//!
//! The index stores only `u32` buckets (about 5.3 bytes per entry at its 0.75 maximum load):
//! the entries themselves (keys, fingerprints) live in the caller's arrays, and the caller
//! supplies equality and, on removal, the hash of an id. Each bucket packs the id (`id + 1` in
//! the low bits, 0 = empty) with as many hash tag bits as fit above it, so most non-matching
//! probes are rejected without touching the caller's arrays. Collisions are resolved by linear
//! probing and removal uses backward-shift deletion, so there are no tombstones and probe
//! lengths never degrade. The capacity is fixed at construction: nothing allocates afterwards.

use super::mem_hints::huge_slice;

pub(crate) use crate::hash::KeyHasher;

/// Open-addressing index: `hash -> id`, ids in `0..max_ids`.
#[derive(Debug)]
pub(crate) struct IndexTable {
    buckets: Box<[u32]>,
    id_bits: u32,
    id_mask: u32,
    len: usize,
    max_ids: usize,
}

impl IndexTable {
    /// An empty index for ids `0..max_ids` (`max_ids < u32::MAX`).
    pub(crate) fn with_capacity(max_ids: usize) -> Self {
        debug_assert!(max_ids < u32::MAX as usize);
        // Encoded ids are `id + 1` in `1..=max_ids`, so `id_bits` must represent `max_ids`.
        let id_bits = (usize::BITS - max_ids.leading_zeros()).clamp(1, 32);
        let id_mask = if id_bits == 32 {
            u32::MAX
        } else {
            (1u32 << id_bits) - 1
        };
        // Maximum load 0.75; at least one empty bucket always exists, so probes terminate.
        let num_buckets = (max_ids + max_ids / 3 + 1).max(2);
        IndexTable {
            buckets: huge_slice(num_buckets, || 0u32),
            id_bits,
            id_mask,
            len: 0,
            max_ids,
        }
    }

    /// Number of entries.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes held by the bucket array.
    pub(crate) fn heap_bytes(&self) -> usize {
        std::mem::size_of_val(&*self.buckets)
    }

    #[inline]
    fn home(&self, hash: u64) -> usize {
        ((u128::from(hash) * self.buckets.len() as u128) >> 64) as usize
    }

    #[inline]
    fn tag(&self, hash: u64) -> u32 {
        // Low hash bits (the home position uses the high ones), shifted above the id.
        if self.id_bits >= 32 {
            0
        } else {
            (hash as u32) << self.id_bits
        }
    }

    #[inline]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.buckets.len() {
            0
        } else {
            i + 1
        }
    }

    /// Prefetches the first bucket a search for `hash` reads (a hint only).
    #[inline]
    pub(crate) fn prefetch(&self, hash: u64) {
        if let Some(b) = self.buckets.get(self.home(hash)) {
            super::mem_hints::prefetch(b);
        }
    }

    /// The id whose entry has `hash` and satisfies `eq`, if any.
    #[inline]
    pub(crate) fn find(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
        let tag = self.tag(hash);
        let tag_mask = !self.id_mask;
        let mut i = self.home(hash);
        loop {
            let b = self.buckets[i];
            if b == 0 {
                return None;
            }
            if b & tag_mask == tag {
                let id = (b & self.id_mask) - 1;
                if eq(id) {
                    return Some(id);
                }
            }
            i = self.next(i);
        }
    }

    /// Adds `id` under `hash`. The caller guarantees the id is not present and `id < max_ids`.
    pub(crate) fn insert(&mut self, hash: u64, id: u32) {
        debug_assert!((id as usize) < self.max_ids && self.len < self.max_ids);
        let entry = self.tag(hash) | (id + 1);
        let mut i = self.home(hash);
        while self.buckets[i] != 0 {
            i = self.next(i);
        }
        self.buckets[i] = entry;
        self.len += 1;
    }

    /// Removes `id` (stored under `hash`); `hash_of` gives the hash of any other id, needed to
    /// shift later entries back. Returns false if `id` was not found.
    pub(crate) fn remove(
        &mut self,
        hash: u64,
        id: u32,
        mut hash_of: impl FnMut(u32) -> u64,
    ) -> bool {
        let n = self.buckets.len();
        let target = self.tag(hash) | (id + 1);
        let mut i = self.home(hash);
        loop {
            let b = self.buckets[i];
            if b == 0 {
                return false;
            }
            if b == target {
                break;
            }
            i = self.next(i);
        }
        // Backward-shift deletion: pull later members of the cluster into the hole when
        // their home position allows it.
        let mut hole = i;
        let mut j = self.next(i);
        loop {
            let b = self.buckets[j];
            if b == 0 {
                break;
            }
            let home = self.home(hash_of((b & self.id_mask) - 1));
            let dist_entry = (j + n - home) % n;
            let dist_hole = (j + n - hole) % n;
            if dist_entry >= dist_hole {
                self.buckets[hole] = b;
                hole = j;
            }
            j = self.next(j);
        }
        self.buckets[hole] = 0;
        self.len -= 1;
        true
    }

    /// Removes every entry.
    pub(crate) fn clear(&mut self) {
        self.buckets.fill(0);
        self.len = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn insert_find_remove_against_hashmap() {
        // Few home positions (tiny table, forced collisions via a weak hash) exercise the
        // wrap-around and backward-shift paths.
        for cap in [1usize, 2, 3, 7, 64] {
            let mut t = IndexTable::with_capacity(cap);
            let hashes: Vec<u64> = (0..cap as u64).map(|i| ((i % 3) << 62) | i).collect();
            let mut model: HashMap<u32, u64> = HashMap::new();
            let mut state = 12345u64;
            for _ in 0..2000 {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
                let id = ((state >> 33) % cap as u64) as u32;
                let hash = hashes[id as usize];
                if model.remove(&id).is_some() {
                    assert!(t.remove(hash, id, |x| hashes[x as usize]));
                } else {
                    t.insert(hash, id);
                    model.insert(id, hash);
                }
                assert_eq!(t.len(), model.len());
                for x in 0..cap as u32 {
                    let found = t.find(hashes[x as usize], |y| y == x);
                    assert_eq!(found.is_some(), model.contains_key(&x), "cap {cap} id {x}");
                }
            }
            t.clear();
            assert_eq!(t.len(), 0);
            assert!(t.find(hashes[0], |_| true).is_none());
        }
    }

    #[test]
    fn removing_an_absent_id_reports_false() {
        let mut t = IndexTable::with_capacity(4);
        t.insert(1 << 40, 0);
        assert!(!t.remove(1 << 40, 1, |_| 1 << 40));
        assert!(!t.remove((5 << 50) | 3, 2, |_| 1 << 40));
        assert_eq!(t.len(), 1);
    }
}
