//! The slot table: one 24-byte slot per primary row (its key and `ref_cnt`) and the slot
//! allocator (fresh slots `0..n` first, then a last-freed-first free list).

use crate::key::ChunkKey;

use super::policy::list::NIL;

/// One primary row's slot.
///
/// * resident: `key` is `Some`, `ref_cnt` is -1 (write in flight), 0 (ready) or > 0 (pinned
///   by that many readers);
/// * free: `key` is `None` and `ref_cnt` holds the next free slot's id (`NIL` as -1), which
///   chains the free list through the table without a separate array.
#[derive(Debug)]
pub(crate) struct Slot {
    pub(crate) key: Option<ChunkKey>,
    pub(crate) ref_cnt: i32,
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
            slots: (0..n)
                .map(|_| Slot {
                    key: None,
                    ref_cnt: NIL as i32,
                })
                .collect(),
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
    pub(crate) fn alloc(&mut self, key: ChunkKey) -> Option<u32> {
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
        slot.key = Some(key);
        slot.ref_cnt = IN_FLIGHT;
        self.resident += 1;
        Some(id)
    }

    /// Frees resident slot `id` (last freed, first reused) and returns its key.
    pub(crate) fn release(&mut self, id: u32) -> Option<ChunkKey> {
        let slot = &mut self.slots[id as usize];
        let key = slot.key.take()?;
        slot.ref_cnt = self.free_head as i32;
        self.free_head = id;
        self.resident -= 1;
        Some(key)
    }

    /// Resident slots with their ids. O(n).
    pub(crate) fn iter_resident(&self) -> impl Iterator<Item = (u32, &ChunkKey, i32)> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.key.as_ref().map(|k| (i as u32, k, s.ref_cnt)))
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
            if s.key.is_some() {
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
        assert_eq!(t.alloc(k(0)), Some(0));
        assert_eq!(t.alloc(k(1)), Some(1));
        assert_eq!(t.release(0).map(|k| k.as_bytes()[0]), Some(0));
        // A fresh slot is still available: it comes before the freed one.
        assert_eq!(t.alloc(k(2)), Some(2));
        assert_eq!(t.release(2).map(|k| k.as_bytes()[0]), Some(2));
        assert_eq!(t.alloc(k(3)), Some(2));
        assert_eq!(t.alloc(k(4)), Some(0));
        assert_eq!(t.alloc(k(5)), None);
        assert_eq!(t.release(1).map(|k| k.as_bytes()[0]), Some(1));
        assert!(t.release(1).is_none());
        assert_eq!(t.resident(), 2);
        t.check_free_list().unwrap();
        assert_eq!(std::mem::size_of::<Slot>(), 24);
    }
}
