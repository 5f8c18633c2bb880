//! The slot table: one 48-byte slot per primary row (its key and `ref_cnt`) and the slot
//! allocator (fresh slots `0..n` first, then a last-freed-first free list).
//!
//! Keys of up to [`INLINE_KEY_LEN`] bytes (vLLM's 36-byte sha256 keys and 20-byte xxhash
//! keys) are copied into the slot, so a lookup compares bytes next to the `ref_cnt` instead
//! of following a pointer to a separate allocation, and a resident chunk costs no heap
//! allocation of its own. Longer keys keep a shared handle to the caller's bytes.

use crate::key::ChunkKey;

use super::hugepage::huge_slice;
use super::policy::list::NIL;

/// Longest key stored inside the slot.
pub(crate) const INLINE_KEY_LEN: usize = 36;

/// A resident slot's key.
#[derive(Debug)]
pub(crate) enum StoredKey {
    /// No key: the slot is free.
    Free,
    /// A short key, copied in.
    Inline {
        len: u8,
        bytes: [u8; INLINE_KEY_LEN],
    },
    /// A long key, shared with the caller.
    Shared(ChunkKey),
}

impl StoredKey {
    fn new(key: &ChunkKey) -> Self {
        let b = key.as_bytes();
        if b.len() <= INLINE_KEY_LEN {
            let mut bytes = [0u8; INLINE_KEY_LEN];
            bytes[..b.len()].copy_from_slice(b);
            StoredKey::Inline {
                len: b.len() as u8,
                bytes,
            }
        } else {
            StoredKey::Shared(key.clone())
        }
    }

    /// The key's bytes; `None` for a free slot.
    #[inline]
    pub(crate) fn bytes(&self) -> Option<&[u8]> {
        match self {
            StoredKey::Free => None,
            StoredKey::Inline { len, bytes } => Some(&bytes[..*len as usize]),
            StoredKey::Shared(k) => Some(k.as_bytes()),
        }
    }

    /// The key as a [`ChunkKey`] (a new allocation for an inline key).
    pub(crate) fn to_key(&self) -> Option<ChunkKey> {
        match self {
            StoredKey::Free => None,
            StoredKey::Inline { len, bytes } => Some(ChunkKey::new(&bytes[..*len as usize])),
            StoredKey::Shared(k) => Some(k.clone()),
        }
    }
}

/// One primary row's slot.
///
/// * resident: `key` holds the key, `ref_cnt` is -1 (write in flight), 0 (ready) or > 0
///   (pinned by that many readers);
/// * free: `key` is `Free` and `ref_cnt` holds the next free slot's id (`NIL` as -1), which
///   chains the free list through the table without a separate array.
#[derive(Debug)]
pub(crate) struct Slot {
    pub(crate) key: StoredKey,
    pub(crate) ref_cnt: i32,
}

impl Slot {
    /// Whether the slot holds exactly `key`.
    #[inline]
    pub(crate) fn holds(&self, key: &[u8]) -> bool {
        self.key.bytes() == Some(key)
    }
}

/// `ref_cnt` of a slot whose write is in flight.
pub(crate) const IN_FLIGHT: i32 = -1;

#[derive(Debug)]
pub(crate) struct SlotTable {
    slots: Box<[Slot]>,
    next_fresh: u32,
    free_head: u32,
    resident: usize,
}

impl SlotTable {
    /// `n` free slots (`n < u32::MAX`).
    pub(crate) fn new(n: usize) -> Self {
        SlotTable {
            slots: huge_slice(n, || Slot {
                key: StoredKey::Free,
                ref_cnt: NIL as i32,
            }),
            next_fresh: 0,
            free_head: NIL,
            resident: 0,
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    pub(crate) fn resident(&self) -> usize {
        self.resident
    }

    pub(crate) fn free(&self) -> usize {
        self.slots.len() - self.resident
    }

    #[inline]
    pub(crate) fn get(&self, id: u32) -> &Slot {
        &self.slots[id as usize]
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, id: u32) -> &mut Slot {
        &mut self.slots[id as usize]
    }

    /// Takes a slot for `key` with `ref_cnt = -1`: a fresh one while any remain, else the most
    /// recently freed one. `None` when full.
    pub(crate) fn alloc(&mut self, key: &ChunkKey) -> Option<u32> {
        let id = if (self.next_fresh as usize) < self.slots.len() {
            self.next_fresh += 1;
            self.next_fresh - 1
        } else if self.free_head != NIL {
            let id = self.free_head;
            self.free_head = self.slots[id as usize].ref_cnt as u32;
            id
        } else {
            return None;
        };
        let slot = &mut self.slots[id as usize];
        slot.key = StoredKey::new(key);
        slot.ref_cnt = IN_FLIGHT;
        self.resident += 1;
        Some(id)
    }

    /// Frees resident slot `id` (last freed, first reused); false if it was free.
    pub(crate) fn release(&mut self, id: u32) -> bool {
        let slot = &mut self.slots[id as usize];
        if matches!(slot.key, StoredKey::Free) {
            return false;
        }
        slot.key = StoredKey::Free;
        slot.ref_cnt = self.free_head as i32;
        self.free_head = id;
        self.resident -= 1;
        true
    }

    /// Resident slots with their ids. O(n).
    pub(crate) fn iter_resident(&self) -> impl Iterator<Item = (u32, &[u8], i32)> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.key.bytes().map(|k| (i as u32, k, s.ref_cnt)))
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        std::mem::size_of_val(&*self.slots)
    }

    /// Free-list length and loop check; O(n).
    pub(crate) fn check_free_list(&self) -> Result<(), String> {
        let mut n = 0usize;
        let mut cur = self.free_head;
        while cur != NIL {
            n += 1;
            let s = self
                .slots
                .get(cur as usize)
                .ok_or_else(|| format!("free list points outside the table ({cur})"))?;
            if s.key.bytes().is_some() {
                return Err(format!("resident slot {cur} is on the free list"));
            }
            if cur >= self.next_fresh {
                return Err(format!("never-used slot {cur} is on the free list"));
            }
            if n > self.slots.len() {
                return Err("free list loops".into());
            }
            cur = s.ref_cnt as u32;
        }
        let unused = self.slots.len() - self.next_fresh as usize;
        if n + unused + self.resident != self.slots.len() {
            return Err(format!(
                "slot leak: {n} free + {unused} never used + {} resident != {}",
                self.resident,
                self.slots.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_first_then_last_freed_first() {
        let mut t = SlotTable::new(3);
        let k = |b: u8| ChunkKey::new([b]);
        assert_eq!(t.alloc(&k(0)), Some(0));
        assert_eq!(t.alloc(&k(1)), Some(1));
        assert!(t.release(0));
        // A fresh slot is still available: it comes before the freed one.
        assert_eq!(t.alloc(&k(2)), Some(2));
        assert!(t.release(2));
        assert_eq!(t.alloc(&k(3)), Some(2));
        assert_eq!(t.alloc(&k(4)), Some(0));
        assert_eq!(t.alloc(&k(5)), None);
        assert!(t.release(1));
        assert!(!t.release(1));
        assert_eq!(t.resident(), 2);
        assert_eq!(t.get(2).key.to_key(), Some(k(3)));
        t.check_free_list().unwrap();
        assert_eq!(std::mem::size_of::<Slot>(), 48);
    }

    #[test]
    fn short_keys_inline_long_keys_shared() {
        let mut t = SlotTable::new(3);
        let short = ChunkKey::new([9u8; INLINE_KEY_LEN]);
        let long = ChunkKey::new([9u8; INLINE_KEY_LEN + 1]);
        let empty = ChunkKey::new([]);
        for k in [&short, &long, &empty] {
            let id = t.alloc(k).unwrap();
            assert!(t.get(id).holds(k.as_bytes()));
            assert_eq!(t.get(id).key.to_key().as_ref(), Some(k));
        }
        assert!(matches!(t.get(0).key, StoredKey::Inline { .. }));
        assert!(matches!(t.get(1).key, StoredKey::Shared(_)));
        assert!(!t.get(0).holds(long.as_bytes()));
        assert!(!t.get(2).holds(&[0]));
    }
}
