//! The slot table: which key each primary row (slot) holds and its `ref_cnt`, indexed by key,
//! plus the slot allocator (fresh slots `0..n` first, then a last-freed-first free list).
//!
//! One open-addressing table of 48-byte entries holds, for each resident slot, the key bytes
//! (inline up to [`INLINE_KEY_LEN`] bytes: vLLM's 36-byte sha256 keys and 20-byte xxhash
//! keys), the `ref_cnt` and the slot id, so a lookup that hits costs one random memory access
//! (the entry) instead of two (an index bucket, then a slot). Collisions use Robin Hood linear
//! probing: each entry records its distance from its home position, an insertion displaces
//! entries closer to their home, and a search stops as soon as it meets an entry closer to
//! its home than the key would be, so misses are as short as hits. Each entry also has an
//! 8-bit hash tag. Removal is backward-shift deletion (no tombstones). To go from a slot to
//! its entry (evictions), `slot_hash[slot]` keeps the high 32 bits of the key's hash, which
//! fix the home position; the entry is then found by probing for the slot id, so entries can
//! move without any per-slot bookkeeping being rewritten. Maximum load 0.8: about 60 bytes of entries
//! plus 4 bytes of `slot_hash` per slot. Keys longer than the inline size keep their first bytes
//! inline and the whole key in a side map (rare; vLLM never produces them).

use std::collections::HashMap;

use crate::key::ChunkKey;

use super::index::KeyHasher;
use super::huge_arrays::huge_slice;
use super::policy::list::NIL;

/// Longest key stored entirely inside its entry.
pub(crate) const INLINE_KEY_LEN: usize = 36;
/// `len` of an entry whose key is longer than [`INLINE_KEY_LEN`].
const LONG: u8 = u8::MAX;

/// How far ahead (in entries, 48 bytes each) walks along a run prefetch.
const RUN_AHEAD: usize = 4;

/// `ref_cnt` of a slot whose write is in flight.
pub(crate) const IN_FLIGHT: i32 = -1;

#[derive(Debug, Clone, Copy)]
#[repr(C)]
struct Entry {
    /// 0: empty; else slot id + 1.
    slot1: u32,
    ref_cnt: i32,
    len: u8,
    tag: u8,
    /// Distance from the home position (saturates at `u16::MAX`, which then disables the
    /// early stop past this entry: never reached in practice).
    dist: u16,
    key: [u8; INLINE_KEY_LEN],
}

const EMPTY: Entry = Entry {
    slot1: 0,
    ref_cnt: 0,
    len: 0,
    tag: 0,
    dist: 0,
    key: [0; INLINE_KEY_LEN],
};

/// A resident key found in the table: its slot and current entry position (valid until the
/// next removal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Found {
    pub(crate) slot: u32,
    pub(crate) pos: u32,
}

#[derive(Debug)]
pub(crate) struct SlotTable {
    hasher: KeyHasher,
    entries: Box<[Entry]>,
    /// Resident slot -> high 32 bits of its key's hash; free slot -> next free slot (`NIL`
    /// ends the chain).
    slot_hash: Box<[u32]>,
    long_keys: HashMap<u32, ChunkKey>,
    next_fresh: u32,
    free_head: u32,
    resident: usize,
}

impl SlotTable {
    /// `n` free slots (`n < u32::MAX`).
    pub(crate) fn new(n: usize, hasher: KeyHasher) -> Self {
        let num_entries = (n + n / 4 + 1).max(2);
        SlotTable {
            hasher,
            entries: huge_slice(num_entries, || EMPTY),
            slot_hash: huge_slice(n, || NIL),
            long_keys: HashMap::new(),
            next_fresh: 0,
            free_head: NIL,
            resident: 0,
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.slot_hash.len()
    }

    pub(crate) fn resident(&self) -> usize {
        self.resident
    }

    pub(crate) fn free(&self) -> usize {
        self.capacity() - self.resident
    }

    /// The key hash used by the table (also the ARC ghost fingerprint).
    #[inline]
    pub(crate) fn hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash(key)
    }

    /// Home position from the high 32 bits of a hash.
    #[inline]
    fn home_hi(&self, hi: u32) -> usize {
        ((u128::from(hi) * self.entries.len() as u128) >> 32) as usize
    }

    #[inline]
    fn home(&self, hash: u64) -> usize {
        self.home_hi((hash >> 32) as u32)
    }

    #[inline]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.entries.len() {
            0
        } else {
            i + 1
        }
    }

    #[inline]
    fn matches(&self, e: &Entry, tag: u8, key: &[u8]) -> bool {
        if e.tag != tag {
            return false;
        }
        if let Ok(full) = <&[u8; INLINE_KEY_LEN]>::try_from(key) {
            // The common length, compared as a fixed-size array: inline, no call.
            e.len as usize == INLINE_KEY_LEN && e.key == *full
        } else if key.len() <= INLINE_KEY_LEN {
            e.len as usize == key.len() && e.key[..key.len()] == *key
        } else {
            e.len == LONG
                && e.key[..] == key[..INLINE_KEY_LEN]
                && self
                    .long_keys
                    .get(&(e.slot1 - 1))
                    .is_some_and(|k| k.as_bytes() == key)
        }
    }

    /// The resident entry for `key` (with its precomputed `hash`).
    #[inline]
    pub(crate) fn find_hashed(&self, hash: u64, key: &[u8]) -> Option<Found> {
        let tag = hash as u8;
        let mut i = self.home(hash);
        let mut dist = 0u16;
        loop {
            let e = &self.entries[i];
            if e.slot1 == 0 || e.dist < dist {
                return None;
            }
            dist = dist.saturating_add(1);
            if self.matches(e, tag, key) {
                return Some(Found {
                    slot: e.slot1 - 1,
                    pos: i as u32,
                });
            }
            i = self.next(i);
        }
    }

    /// Loads the first entry `hash` probes, so that a later `find_hashed` finds it in cache.
    /// Several of these in a row overlap their memory latency.
    #[inline]
    pub(crate) fn warm(&self, hash: u64) {
        super::huge_arrays::prefetch(&self.entries[self.home(hash)]);
    }

    /// Inside a walk along a run of entries (insertion, backward shift): prefetches the
    /// entry [`RUN_AHEAD`] positions on, so that the walk does not wait for each new cache
    /// line in turn (a hint only).
    #[inline]
    fn prefetch_ahead(&self, i: usize) {
        if let Some(e) = self.entries.get(i + RUN_AHEAD) {
            super::huge_arrays::prefetch(e);
        }
    }

    /// The resident entry for `key`.
    #[inline]
    pub(crate) fn find(&self, key: &[u8]) -> Option<Found> {
        self.find_hashed(self.hash(key), key)
    }

    /// `ref_cnt` of the entry at `pos`.
    #[inline]
    pub(crate) fn ref_at(&self, pos: u32) -> i32 {
        self.entries[pos as usize].ref_cnt
    }

    /// Sets `ref_cnt` of the entry at `pos`.
    #[inline]
    pub(crate) fn set_ref_at(&mut self, pos: u32, r: i32) {
        self.entries[pos as usize].ref_cnt = r;
    }

    /// Takes a slot for `key` (not resident; `hash` its hash) with `ref_cnt = -1`: a fresh
    /// slot while any remain, else the most recently freed one. `None` when full.
    pub(crate) fn insert(&mut self, hash: u64, key: &ChunkKey) -> Option<u32> {
        let slot = if (self.next_fresh as usize) < self.capacity() {
            self.next_fresh += 1;
            self.next_fresh - 1
        } else if self.free_head != NIL {
            let s = self.free_head;
            self.free_head = self.slot_hash[s as usize];
            s
        } else {
            return None;
        };
        let b = key.as_bytes();
        let mut e = Entry {
            slot1: slot + 1,
            ref_cnt: IN_FLIGHT,
            len: b.len() as u8,
            tag: hash as u8,
            dist: 0,
            key: [0; INLINE_KEY_LEN],
        };
        if b.len() <= INLINE_KEY_LEN {
            e.key[..b.len()].copy_from_slice(b);
        } else {
            e.len = LONG;
            e.key.copy_from_slice(&b[..INLINE_KEY_LEN]);
            self.long_keys.insert(slot, key.clone());
        }
        // Robin Hood: carry the entry forward, swapping it with any entry that is closer to
        // its home, until an empty position takes whatever is being carried.
        let mut carried = e;
        let mut i = self.home(hash);
        loop {
            self.prefetch_ahead(i);
            let here = self.entries[i];
            if here.slot1 == 0 || here.dist < carried.dist {
                self.entries[i] = carried;
                if here.slot1 == 0 {
                    break;
                }
                carried = here;
            }
            carried.dist = carried.dist.saturating_add(1);
            i = self.next(i);
        }
        self.slot_hash[slot as usize] = (hash >> 32) as u32;
        self.resident += 1;
        Some(slot)
    }

    /// The key bytes of the entry at position `i` (occupied).
    fn entry_key(&self, i: usize) -> &[u8] {
        let e = &self.entries[i];
        if e.len == LONG {
            self.long_keys
                .get(&(e.slot1 - 1))
                .map_or(&e.key[..], |k| k.as_bytes())
        } else {
            &e.key[..e.len as usize]
        }
    }

    /// The key of resident `slot` (a new handle for an inline key).
    pub(crate) fn key_of(&self, slot: u32) -> Option<ChunkKey> {
        let i = self.resident_pos(slot)?;
        let e = &self.entries[i];
        if e.len == LONG {
            self.long_keys.get(&slot).cloned()
        } else {
            Some(ChunkKey::new(&e.key[..e.len as usize]))
        }
    }

    /// Hash of resident `slot`'s key.
    pub(crate) fn hash_of(&self, slot: u32) -> u64 {
        self.resident_pos(slot)
            .map_or(0, |i| self.hash(self.entry_key(i)))
    }

    /// The entry position of resident `slot`: probe from its key's home for its slot id.
    fn resident_pos(&self, slot: u32) -> Option<usize> {
        let hi = *self.slot_hash.get(slot as usize)?;
        let mut i = self.home_hi(hi);
        let mut dist = 0u16;
        loop {
            let e = &self.entries[i];
            if e.slot1 == 0 || e.dist < dist {
                return None;
            }
            if e.slot1 == slot + 1 {
                return Some(i);
            }
            dist = dist.saturating_add(1);
            i = self.next(i);
        }
    }

    /// Removes resident `slot` and frees it (last freed, first reused); false if it was free.
    pub(crate) fn remove(&mut self, slot: u32) -> bool {
        let Some(mut hole) = self.resident_pos(slot) else {
            return false;
        };
        // Backward shift: pull each following displaced entry one step closer to its home.
        let mut j = self.next(hole);
        loop {
            self.prefetch_ahead(j);
            let e = self.entries[j];
            if e.slot1 == 0 || e.dist == 0 {
                break;
            }
            let mut moved = e;
            if moved.dist != u16::MAX {
                moved.dist -= 1;
            }
            self.entries[hole] = moved;
            hole = j;
            j = self.next(j);
        }
        self.entries[hole] = EMPTY;
        if !self.long_keys.is_empty() {
            self.long_keys.remove(&slot);
        }
        self.slot_hash[slot as usize] = self.free_head;
        self.free_head = slot;
        self.resident -= 1;
        true
    }

    /// Resident slots with their `ref_cnt` and key bytes. O(capacity).
    pub(crate) fn iter_resident(&self) -> impl Iterator<Item = (u32, i32, &[u8])> + '_ {
        (0..self.entries.len())
            .filter(|&i| self.entries[i].slot1 != 0)
            .map(|i| {
                let e = &self.entries[i];
                (e.slot1 - 1, e.ref_cnt, self.entry_key(i))
            })
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        std::mem::size_of_val(&*self.entries) + std::mem::size_of_val(&*self.slot_hash)
    }

    /// Checks positions, the free list and that every key is found at its entry. O(n).
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut count = 0;
        for (slot, _, key) in self.iter_resident() {
            count += 1;
            let found = self.find(key);
            if found.map(|f| f.slot) != Some(slot) {
                return Err(format!("slot {slot}: its key is not found at its entry"));
            }
            if found.map(|f| f.pos as usize) != self.resident_pos(slot) {
                return Err(format!("slot {slot}: its hash does not lead to its entry"));
            }
            if self.slot_hash[slot as usize] != (self.hash(key) >> 32) as u32 {
                return Err(format!("slot {slot}: stale key hash"));
            }
        }
        if count != self.resident {
            return Err(format!("{count} entries but {} resident", self.resident));
        }
        let n = self.entries.len();
        for i in 0..n {
            let e = &self.entries[i];
            if e.slot1 == 0 {
                continue;
            }
            let actual = (i + n - self.home(self.hash(self.entry_key(i)))) % n;
            if e.dist != u16::MAX && usize::from(e.dist) != actual {
                return Err(format!(
                    "entry {i}: distance {} recorded, {actual} actual",
                    e.dist
                ));
            }
        }
        let mut free = 0usize;
        let mut cur = self.free_head;
        while cur != NIL {
            free += 1;
            if cur >= self.next_fresh || self.resident_pos(cur).is_some() {
                return Err(format!("slot {cur} on the free list is resident or unused"));
            }
            if free > self.capacity() {
                return Err("free list loops".into());
            }
            cur = self.slot_hash[cur as usize];
        }
        let unused = self.capacity() - self.next_fresh as usize;
        if free + unused + self.resident != self.capacity() {
            return Err(format!(
                "slot leak: {free} free + {unused} never used + {} resident != {}",
                self.resident,
                self.capacity()
            ));
        }
        if self.long_keys.len() > self.resident {
            return Err("stale long keys".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(n: usize) -> SlotTable {
        SlotTable::new(n, KeyHasher::with_seed(3))
    }

    fn put(t: &mut SlotTable, k: &ChunkKey) -> Option<u32> {
        let h = t.hash(k.as_bytes());
        t.insert(h, k)
    }

    #[test]
    fn fresh_first_then_last_freed_first() {
        let mut t = table(3);
        let k = |b: u8| ChunkKey::new([b]);
        assert_eq!(put(&mut t, &k(0)), Some(0));
        assert_eq!(put(&mut t, &k(1)), Some(1));
        assert!(t.remove(0));
        // A fresh slot is still available: it comes before the freed one.
        assert_eq!(put(&mut t, &k(2)), Some(2));
        assert!(t.remove(2));
        assert_eq!(put(&mut t, &k(3)), Some(2));
        assert_eq!(put(&mut t, &k(4)), Some(0));
        assert_eq!(put(&mut t, &k(5)), None);
        assert!(t.remove(1));
        assert!(!t.remove(1));
        assert_eq!(t.resident(), 2);
        assert_eq!(t.key_of(2), Some(k(3)));
        assert_eq!(t.key_of(1), None);
        t.check().unwrap();
        assert_eq!(std::mem::size_of::<Entry>(), 48);
    }

    #[test]
    fn keys_of_every_length_round_trip_through_removals() {
        // Long keys sharing their inline prefix, the empty key, and many short ones, with
        // removals in between, exercise the long-key path and backward shifting.
        let mut keys: Vec<ChunkKey> = (0..40u8).map(|i| ChunkKey::new([i; 36])).collect();
        keys.push(ChunkKey::new([]));
        keys.push(ChunkKey::new([7u8; 37]));
        keys.push(ChunkKey::new([7u8; 80]));
        let mut t = table(keys.len());
        for k in &keys {
            put(&mut t, k).unwrap();
        }
        for (slot, k) in keys.iter().enumerate() {
            assert_eq!(t.find(k.as_bytes()).map(|f| f.slot), Some(slot as u32));
            assert_eq!(t.key_of(slot as u32).as_ref(), Some(k));
        }
        assert!(t.find(&[7u8; 36]).is_some(), "key 7 of the first 40");
        assert!(t.find(&[7u8; 38]).is_none());
        for slot in (0..keys.len() as u32).step_by(3) {
            assert!(t.remove(slot));
        }
        t.check().unwrap();
        for (slot, k) in keys.iter().enumerate() {
            let want = (slot % 3 != 0).then_some(slot as u32);
            assert_eq!(t.find(k.as_bytes()).map(|f| f.slot), want, "slot {slot}");
        }
        let f = t.find(keys[1].as_bytes()).unwrap();
        assert_eq!(t.ref_at(f.pos), IN_FLIGHT);
        t.set_ref_at(f.pos, 5);
        assert_eq!(t.iter_resident().find(|e| e.0 == 1).map(|e| e.1), Some(5));
    }

    #[test]
    fn random_inserts_and_removals_match_a_map_at_full_load() {
        use std::collections::HashMap;
        let n = 200;
        let mut t = table(n);
        let mut model: HashMap<u32, u32> = HashMap::new(); // key id -> slot
        let key = |i: u32| ChunkKey::new(i.to_le_bytes().repeat(9));
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for step in 0..6000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let k = (state % 400) as u32;
            match model.get(&k) {
                Some(&slot) => {
                    assert!(t.remove(slot));
                    model.remove(&k);
                }
                None if model.len() < n => {
                    let kk = key(k);
                    let slot = put(&mut t, &kk).unwrap();
                    model.insert(k, slot);
                }
                None => {}
            }
            if step % 97 == 0 {
                t.check().unwrap();
                for i in 0..400 {
                    let want = model.get(&i).copied();
                    assert_eq!(t.find(key(i).as_bytes()).map(|f| f.slot), want);
                }
            }
        }
        t.check().unwrap();
    }
}
