//! A compact open-addressing hash index from a 64-bit hash to a dense `u32` id, and the seeded
//! key hash it is used with.
//!
//! The index stores only `u32` buckets (about 5.3 bytes per entry at its 0.75 maximum load):
//! the entries themselves (keys, fingerprints) live in the caller's arrays, and the caller
//! supplies equality and the hash of an id (needed only in rare cases, see below). Each bucket
//! packs, from the low bits up: the id (`id + 1`, 0 = empty), a small saturating field with
//! the entry's probe displacement (its distance from its home bucket), and as many hash tag
//! bits as fit above them, so most non-matching probes are rejected without touching the
//! caller's arrays.
//!
//! Collisions are resolved by Robin Hood linear probing (an entry never sits closer to its
//! home than the entries it passed), so a search stops at the first entry closer to its home
//! than the search is to its own, and removal is backward-shift deletion (no tombstones,
//! probe lengths never degrade). The displacement field lets insertion and deletion decide
//! every move from the bucket alone; only an entry whose field is saturated (displacement of
//! at least `2^bits - 1`, rare at this load) needs the caller's hash of its id, a random
//! access into the caller's arrays. The capacity is fixed at construction: nothing allocates
//! afterwards.

use super::huge_arrays::huge_slice;

pub(crate) use crate::hash::KeyHasher;

/// Most bits a bucket gives to the displacement field (a field of 4 bits is exact up to 14,
/// and at a 0.75 load about 1 entry in 2,000 is displaced farther).
const MAX_DISP_BITS: u32 = 4;

/// Open-addressing index: `hash -> id`, ids in `0..max_ids`.
#[derive(Debug)]
pub(crate) struct IndexTable {
    buckets: Box<[u32]>,
    id_mask: u32,
    /// Where the displacement field starts (`id_bits`, at most 31 so the shift is defined).
    disp_shift: u32,
    /// The displacement field in place.
    disp_mask: u32,
    /// Saturated field value: a field below it is the exact displacement, this value means
    /// "at least this much". 0 when there is no room for a field (every entry saturated).
    disp_max: u32,
    /// Where the tag bits start (32 or more: no tag).
    tag_shift: u32,
    /// The tag bits in place.
    tag_mask: u32,
    len: usize,
    max_ids: usize,
}

impl IndexTable {
    /// An empty index for ids `0..max_ids` (`max_ids < u32::MAX`).
    pub(crate) fn with_capacity(max_ids: usize) -> Self {
        // Encoded ids are `id + 1` in `1..=max_ids`, so `id_bits` must represent `max_ids`.
        let id_bits = Self::id_bits_for(max_ids);
        // Share the bits above the id between displacement and tag, at most 4 for the
        // displacement (4 leaves 7 tag bits for a million ids).
        let spare = 32 - id_bits;
        Self::with_layout(max_ids, (spare / 2).min(MAX_DISP_BITS))
    }

    fn id_bits_for(max_ids: usize) -> u32 {
        (usize::BITS - max_ids.leading_zeros()).clamp(1, 32)
    }

    /// An empty index whose buckets give `disp_bits` bits to the displacement field (the
    /// rest above the id to the tag).
    pub(crate) fn with_layout(max_ids: usize, disp_bits: u32) -> Self {
        debug_assert!(max_ids < u32::MAX as usize);
        let id_bits = Self::id_bits_for(max_ids);
        debug_assert!(id_bits + disp_bits <= 32);
        let low_mask = |bits: u32| {
            if bits >= 32 {
                u32::MAX
            } else {
                (1u32 << bits) - 1
            }
        };
        let id_mask = low_mask(id_bits);
        let disp_max = low_mask(disp_bits);
        let disp_shift = id_bits.min(31);
        let tag_shift = id_bits + disp_bits;
        // Maximum load 0.75; at least one empty bucket always exists, so probes terminate.
        let num_buckets = (max_ids + max_ids / 3 + 1).max(2);
        IndexTable {
            buckets: huge_slice(num_buckets, || 0u32),
            id_mask,
            disp_shift,
            disp_mask: disp_max << disp_shift,
            disp_max,
            tag_shift,
            tag_mask: !low_mask(tag_shift),
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
        // Low hash bits (the home position uses the high ones), shifted above the field.
        if self.tag_shift >= 32 {
            0
        } else {
            (hash as u32) << self.tag_shift
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

    /// How far bucket `to` lies after bucket `from`, wrapping around the end.
    #[inline]
    fn distance(&self, from: usize, to: usize) -> usize {
        if to >= from {
            to - from
        } else {
            to + self.buckets.len() - from
        }
    }

    /// The displacement field of bucket value `b`.
    #[inline]
    fn field(&self, b: u32) -> u32 {
        (b & self.disp_mask) >> self.disp_shift
    }

    /// The field recording displacement `d` (saturated above the field's range).
    #[inline]
    fn field_for(&self, d: usize) -> u32 {
        (d.min(self.disp_max as usize) as u32) << self.disp_shift
    }

    /// The exact displacement of the entry `b` held in bucket `j`: from its field, or, when
    /// the field is saturated, from its hash.
    #[inline]
    fn displacement(&self, j: usize, b: u32, hash_of: &mut impl FnMut(u32) -> u64) -> usize {
        let f = self.field(b);
        if f < self.disp_max {
            f as usize
        } else {
            self.distance(self.home(hash_of((b & self.id_mask) - 1)), j)
        }
    }

    /// Prefetches the first bucket a search for `hash` reads (a hint only).
    #[inline]
    pub(crate) fn prefetch(&self, hash: u64) {
        if let Some(b) = self.buckets.get(self.home(hash)) {
            super::huge_arrays::prefetch(b);
        }
    }

    /// The bucket holding the entry with tag and id bits `target`, searching from the home of
    /// `hash`; `eq` confirms a tag match (the id is decoded from the bucket).
    #[inline]
    fn position(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Option<usize> {
        let tag = self.tag(hash);
        let mut i = self.home(hash);
        let mut dist = 0usize;
        loop {
            let b = self.buckets[i];
            if b == 0 {
                return None;
            }
            let f = self.field(b);
            // An entry closer to its home than we are to ours: Robin Hood would have placed
            // the searched entry here or earlier, so it is absent.
            if f < self.disp_max && (f as usize) < dist {
                return None;
            }
            if b & self.tag_mask == tag && eq((b & self.id_mask) - 1) {
                return Some(i);
            }
            i = self.next(i);
            dist += 1;
        }
    }

    /// The id whose entry has `hash` and satisfies `eq`, if any.
    #[inline]
    pub(crate) fn find(&self, hash: u64, eq: impl FnMut(u32) -> bool) -> Option<u32> {
        let i = self.position(hash, eq)?;
        Some((self.buckets[i] & self.id_mask) - 1)
    }

    /// Adds `id` under `hash`. The caller guarantees the id is not present and `id < max_ids`;
    /// `hash_of` gives the hash of any other id (called only for saturated fields).
    pub(crate) fn insert(&mut self, hash: u64, id: u32, mut hash_of: impl FnMut(u32) -> u64) {
        debug_assert!((id as usize) < self.max_ids && self.len < self.max_ids);
        let mut carried = self.tag(hash) | (id + 1);
        let mut dist = 0usize;
        let mut i = self.home(hash);
        loop {
            let b = self.buckets[i];
            if b == 0 {
                self.buckets[i] = carried | self.field_for(dist);
                break;
            }
            // Robin Hood: the carried entry takes the bucket of an entry closer to its home,
            // which is carried on instead. A saturated field is at least `disp_max`, so it
            // only needs resolving when the carried entry has come farther than that.
            let f = self.field(b);
            let resident = if f < self.disp_max {
                f as usize
            } else if dist <= self.disp_max as usize {
                dist
            } else {
                self.displacement(i, b, &mut hash_of)
            };
            if resident < dist {
                self.buckets[i] = carried | self.field_for(dist);
                carried = b & !self.disp_mask;
                dist = resident;
            }
            i = self.next(i);
            dist += 1;
        }
        self.len += 1;
    }

    /// Removes `id` (stored under `hash`); `hash_of` gives the hash of any other id (called
    /// only for saturated fields). Returns false if `id` was not found.
    pub(crate) fn remove(
        &mut self,
        hash: u64,
        id: u32,
        mut hash_of: impl FnMut(u32) -> u64,
    ) -> bool {
        let Some(i) = self.position(hash, |x| x == id) else {
            return false;
        };
        // Backward-shift deletion: every later entry of the run that is not at its home
        // moves back one bucket, one step closer to its home.
        let mut hole = i;
        let mut j = self.next(i);
        loop {
            let b = self.buckets[j];
            if b == 0 {
                break;
            }
            let d = self.displacement(j, b, &mut hash_of);
            if d == 0 {
                break;
            }
            self.buckets[hole] = (b & !self.disp_mask) | self.field_for(d - 1);
            hole = j;
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

    /// Checks every bucket's field and the Robin Hood order against the hashes of the ids
    /// (O(buckets)); the first violation found, if any.
    pub(crate) fn check_layout(&self, mut hash_of: impl FnMut(u32) -> u64) -> Result<(), String> {
        let n = self.buckets.len();
        let mut count = 0;
        for j in 0..n {
            let b = self.buckets[j];
            if b == 0 {
                continue;
            }
            count += 1;
            let id = (b & self.id_mask) - 1;
            let hash = hash_of(id);
            if b & self.tag_mask != self.tag(hash) {
                return Err(format!("index bucket {j}: id {id} has the wrong tag"));
            }
            let d = self.distance(self.home(hash), j);
            if self.field(b) != (d.min(self.disp_max as usize) as u32) {
                return Err(format!(
                    "index bucket {j}: id {id} displaced {d} but its field says {}",
                    self.field(b)
                ));
            }
            // Every bucket between its home and here holds an entry displaced at least as
            // far as this one was there.
            let mut k = self.home(hash);
            for step in 0..d {
                let o = self.buckets[k];
                if o == 0 {
                    return Err(format!("index bucket {j}: id {id} is past an empty bucket"));
                }
                let od = self.distance(self.home(hash_of((o & self.id_mask) - 1)), k);
                if od < step {
                    return Err(format!(
                        "index bucket {k}: Robin Hood order broken by id {id}"
                    ));
                }
                k = self.next(k);
            }
        }
        if count != self.len {
            return Err(format!(
                "index holds {count} entries, length says {}",
                self.len
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A hash whose home bucket in a table of `n` buckets is `bucket`, with `low` in its low
    /// (tag) bits.
    fn hash_at(n: usize, bucket: usize, low: u64) -> u64 {
        let base = ((bucket as u128) << 64).div_ceil(n as u128) as u64;
        base + low
    }

    /// Random inserts and removals against a HashMap model, with every layout check after
    /// each step; `homes` home buckets in all (few: long runs, saturated fields, wrap-around
    /// at the end of the table). Returns how often `hash_of` was called.
    fn run_model(cap: usize, disp_bits: u32, homes: usize, seed: u64) -> usize {
        let mut t = IndexTable::with_layout(cap, disp_bits);
        let n = t.buckets.len();
        let mut state = seed;
        let mut rand = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            state >> 33
        };
        // Homes near the end of the table, so runs wrap around to bucket 0.
        let hashes: Vec<u64> = (0..cap)
            .map(|i| hash_at(n, n - 1 - (rand() as usize % homes.min(n)), i as u64 & 3))
            .collect();
        let mut model: HashMap<u32, u64> = HashMap::new();
        let calls = std::cell::Cell::new(0usize);
        let hash_of = |x: u32| {
            calls.set(calls.get() + 1);
            hashes[x as usize]
        };
        for _ in 0..600 {
            let id = (rand() % cap as u64) as u32;
            let hash = hashes[id as usize];
            if model.remove(&id).is_some() {
                assert!(t.remove(hash, id, hash_of));
            } else {
                t.insert(hash, id, hash_of);
                model.insert(id, hash);
            }
            assert_eq!(t.len(), model.len());
            let before = calls.get();
            t.check_layout(|x| hashes[x as usize])
                .unwrap_or_else(|e| panic!("cap {cap} bits {disp_bits}: {e}"));
            for x in 0..cap as u32 {
                let found = t.find(hashes[x as usize], |y| y == x);
                assert_eq!(found.is_some(), model.contains_key(&x), "cap {cap} id {x}");
                if let Some(y) = found {
                    assert_eq!(y, x);
                }
            }
            assert_eq!(calls.get(), before, "find never needs hash_of");
        }
        t.clear();
        assert_eq!(t.len(), 0);
        assert!(t.find(hashes[0], |_| true).is_none());
        calls.get()
    }

    #[test]
    fn insert_find_remove_against_hashmap() {
        for cap in [1usize, 2, 3, 7, 64, 300] {
            for disp_bits in [0, 1, 2, 4] {
                for homes in [1, 3, cap.max(2)] {
                    run_model(
                        cap,
                        disp_bits,
                        homes,
                        cap as u64 * 31 + u64::from(disp_bits),
                    );
                }
            }
        }
    }

    #[test]
    fn saturated_fields_fall_back_to_hash_of_and_wide_fields_do_not() {
        // One home for every id: displacements up to the cluster length, so narrow fields
        // saturate and need `hash_of`.
        assert!(run_model(64, 1, 1, 7) > 0);
        assert!(run_model(64, 0, 3, 7) > 0);
        // Spread homes with a 4-bit field: displacements stay below 15 at this load, so no
        // insertion or removal reads a hash.
        let mut t = IndexTable::with_layout(48, 4);
        let n = t.buckets.len();
        let hashes: Vec<u64> = (0..48).map(|i| hash_at(n, (i * 5) % n, 0)).collect();
        let panic_hash = |_: u32| -> u64 { panic!("hash_of called with exact fields") };
        for id in 0..48u32 {
            t.insert(hashes[id as usize], id, panic_hash);
        }
        t.check_layout(|x| hashes[x as usize]).unwrap();
        for id in (0..48u32).step_by(3) {
            assert!(t.remove(hashes[id as usize], id, panic_hash));
        }
        t.check_layout(|x| hashes[x as usize]).unwrap();
    }

    #[test]
    fn default_layout_keeps_tag_bits() {
        let t = IndexTable::with_capacity(1 << 20);
        // 21 id bits, 4 displacement bits, 7 tag bits.
        assert_eq!(t.disp_max, 15);
        assert_eq!(t.tag_shift, 25);
        let t = IndexTable::with_capacity(3);
        assert_eq!((t.disp_max, t.tag_shift), (15, 6));
    }

    #[test]
    fn removing_an_absent_id_reports_false() {
        let mut t = IndexTable::with_capacity(4);
        t.insert(1 << 40, 0, |_| 1 << 40);
        assert!(!t.remove(1 << 40, 1, |_| 1 << 40));
        assert!(!t.remove((5 << 50) | 3, 2, |_| 1 << 40));
        assert_eq!(t.len(), 1);
    }
}
