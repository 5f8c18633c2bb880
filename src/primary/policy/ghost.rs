//! ARC's ghost lists B1 and B2: fingerprints of recently evicted keys, each list bounded by the
//! cache capacity (as vLLM 0.33.0 bounds them), preallocated, O(1) per operation.
//!
//! A ghost is a 64-bit fingerprint of the key (not the key), so ghosts cost 17 bytes each
//! plus their index bucket and keep no key bytes alive. Two keys with the same fingerprint
//! would share a ghost; with 64-bit fingerprints and at most `capacity` ghosts this is
//! vanishingly rare, and it could only steer the adaptive target, never what is stored.
//!
//! A pushed ghost joins its list at once (lengths, order and drops are exact at every step),
//! but its fingerprint enters the ghost index only when the index is next searched (or after
//! [`PENDING_MAX`] pushes): pushing happens during an eviction, right after the victim's
//! fingerprint has been computed, and inserting it then would wait for a random index bucket.
//! The push prefetches that bucket instead, and the deferred insertion finds it in cache. A
//! search always sees every ghost, because it first inserts the pending ones.

use super::list::{Link, List, NIL, new_links};
use crate::primary::index::IndexTable;
use crate::primary::huge_arrays::huge_slice;

/// Which ghost list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ghost {
    /// Evicted from T1.
    B1,
    /// Evicted from T2.
    B2,
}

const FREE: u8 = 0;
const IN_B1: u8 = 1;
const IN_B2: u8 = 2;
/// Flag on `which`: in its list, fingerprint not yet in the index.
const PENDING: u8 = 4;

/// Most ghosts whose index insertion waits (a store evicting more inserts the earlier ones).
pub(crate) const PENDING_MAX: usize = 64;

#[derive(Debug)]
pub(crate) struct GhostLists {
    fps: Box<[u64]>,
    links: Box<[Link]>,
    which: Box<[u8]>,
    b1: List,
    b2: List,
    /// Unused ghost nodes, chained through `links[..].next`.
    free_head: u32,
    /// Most ghosts per list.
    per_list: usize,
    index: IndexTable,
    /// Ghosts in their lists whose fingerprints are not in `index` yet, oldest first.
    pending: Vec<u32>,
}

impl GhostLists {
    /// Room for `per_list` ghosts in each of B1 and B2.
    pub(crate) fn new(per_list: usize) -> Self {
        let capacity = per_list.saturating_mul(2);
        let mut g = GhostLists {
            fps: huge_slice(capacity, || 0u64),
            links: new_links(capacity),
            which: huge_slice(capacity, || FREE),
            b1: List::default(),
            b2: List::default(),
            free_head: NIL,
            per_list,
            index: IndexTable::with_capacity(capacity),
            pending: Vec::with_capacity(PENDING_MAX),
        };
        g.rebuild_free_chain();
        g
    }

    fn rebuild_free_chain(&mut self) {
        self.free_head = NIL;
        for i in (0..self.fps.len() as u32).rev() {
            self.links[i as usize] = Link {
                prev: NIL,
                next: self.free_head,
            };
            self.free_head = i;
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.fps.len()
    }

    pub(crate) fn len(&self, g: Ghost) -> usize {
        match g {
            Ghost::B1 => self.b1.len(),
            Ghost::B2 => self.b2.len(),
        }
    }

    pub(crate) fn total(&self) -> usize {
        self.b1.len() + self.b2.len()
    }

    /// The indexed ghost of `fp` (pending ghosts are not searched).
    fn find_indexed(&self, fp: u64) -> Option<u32> {
        let fps = &self.fps;
        self.index.find(fp, |id| fps[id as usize] == fp)
    }

    /// Inserts the pending ghosts into the index, oldest first; an indexed ghost with the
    /// same fingerprint is dropped (the newer replaces it).
    fn flush_pending(&mut self) {
        let mut i = 0;
        while i < self.pending.len() {
            let id = self.pending[i];
            i += 1;
            let fp = self.fps[id as usize];
            if let Some(old) = self.find_indexed(fp) {
                self.remove_id(old);
            }
            self.which[id as usize] &= !PENDING;
            let fps = &self.fps;
            self.index.insert(fp, id, |other| fps[other as usize]);
        }
        self.pending.clear();
    }

    /// The list holding the ghost of `fp`, which becomes the most recent ghost of that list.
    pub(crate) fn hit(&mut self, fp: u64) -> Option<Ghost> {
        self.flush_pending();
        let id = self.find_indexed(fp)?;
        if self.which[id as usize] & IN_B1 != 0 {
            self.b1.unlink(&mut self.links, id);
            self.b1.push_front(&mut self.links, id);
            Some(Ghost::B1)
        } else {
            self.b2.unlink(&mut self.links, id);
            self.b2.push_front(&mut self.links, id);
            Some(Ghost::B2)
        }
    }

    /// Removes the ghost of `fp`, saying which list held it.
    pub(crate) fn take(&mut self, fp: u64) -> Option<Ghost> {
        self.flush_pending();
        let id = self.find_indexed(fp)?;
        let g = self.remove_id(id);
        Some(g)
    }

    fn remove_id(&mut self, id: u32) -> Ghost {
        let which = self.which[id as usize];
        let g = if which & IN_B1 != 0 {
            self.b1.unlink(&mut self.links, id);
            Ghost::B1
        } else {
            self.b2.unlink(&mut self.links, id);
            Ghost::B2
        };
        if which & PENDING != 0 {
            if let Some(k) = self.pending.iter().position(|&p| p == id) {
                self.pending.remove(k);
            }
        } else {
            let fps = &self.fps;
            self.index
                .remove(fps[id as usize], id, |other| fps[other as usize]);
        }
        self.which[id as usize] = FREE;
        self.links[id as usize] = Link {
            prev: NIL,
            next: self.free_head,
        };
        self.free_head = id;
        g
    }

    /// Drops the least recent ghost of `g`; false if that list is empty.
    pub(crate) fn pop_lru(&mut self, g: Ghost) -> bool {
        let list = match g {
            Ghost::B1 => &self.b1,
            Ghost::B2 => &self.b2,
        };
        match list.back() {
            Some(id) => {
                self.remove_id(id);
                true
            }
            None => false,
        }
    }

    /// Adds `fp` as the most recent ghost of `g`. When `g` is full its least recent ghost
    /// makes room first (the same ghosts remain as vLLM's "push every victim, then trim each
    /// list to the capacity"). An existing ghost with the same fingerprint is replaced when
    /// the new one enters the index (before the next search).
    pub(crate) fn push(&mut self, g: Ghost, fp: u64) {
        if self.per_list == 0 {
            return;
        }
        if self.pending.len() >= PENDING_MAX {
            self.flush_pending();
        }
        if self.len(g) >= self.per_list {
            self.pop_lru(g);
        }
        let id = self.free_head;
        if id == NIL {
            return;
        }
        self.free_head = self.links[id as usize].next;
        self.links[id as usize] = Link::UNLINKED;
        self.fps[id as usize] = fp;
        match g {
            Ghost::B1 => {
                self.b1.push_front(&mut self.links, id);
                self.which[id as usize] = IN_B1 | PENDING;
            }
            Ghost::B2 => {
                self.b2.push_front(&mut self.links, id);
                self.which[id as usize] = IN_B2 | PENDING;
            }
        }
        self.pending.push(id);
        self.index.prefetch(fp);
    }

    /// Forgets every ghost.
    pub(crate) fn clear(&mut self) {
        self.b1.clear();
        self.b2.clear();
        self.which.fill(FREE);
        self.index.clear();
        self.pending.clear();
        self.rebuild_free_chain();
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        std::mem::size_of_val(&*self.fps)
            + std::mem::size_of_val(&*self.links)
            + std::mem::size_of_val(&*self.which)
            + self.index.heap_bytes()
            + self.pending.capacity() * std::mem::size_of::<u32>()
    }

    pub(crate) fn check_consistency(&self) -> Result<(), String> {
        let mut n = 0;
        let mut pending = 0;
        for (list, tag) in [(&self.b1, IN_B1), (&self.b2, IN_B2)] {
            for id in list.iter(&self.links) {
                n += 1;
                let which = self.which[id as usize];
                if which & !PENDING != tag {
                    return Err(format!("arc ghost {id} in the wrong list"));
                }
                if which & PENDING != 0 {
                    pending += 1;
                    if !self.pending.contains(&id) {
                        return Err(format!("arc ghost {id} marked pending but not queued"));
                    }
                } else if self.find_indexed(self.fps[id as usize]) != Some(id) {
                    return Err(format!("arc ghost {id} missing from the ghost index"));
                }
            }
        }
        if pending != self.pending.len() {
            return Err(format!(
                "arc ghosts: {pending} marked pending, {} queued",
                self.pending.len()
            ));
        }
        if n != self.total() || self.index.len() + pending != n {
            return Err(format!(
                "arc ghosts: {n} linked, lengths {} + {}, index {} + {pending} pending",
                self.b1.len(),
                self.b2.len(),
                self.index.len()
            ));
        }
        let mut free = 0;
        let mut cur = self.free_head;
        while cur != NIL {
            free += 1;
            if free > self.capacity() {
                return Err("arc ghost free chain loops".into());
            }
            cur = self.links[cur as usize].next;
        }
        if free + n != self.capacity() {
            return Err(format!(
                "arc ghosts leak: {free} free + {n} used != {}",
                self.capacity()
            ));
        }
        self.index
            .check_layout(|id| self.fps[id as usize])
            .map_err(|e| format!("arc ghost {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_per_list_and_take_finds_the_list() {
        let mut g = GhostLists::new(2);
        g.push(Ghost::B1, 10);
        g.push(Ghost::B2, 20);
        g.push(Ghost::B1, 11);
        assert_eq!(g.hit(10), Some(Ghost::B1)); // 10 becomes the most recent of B1
        g.push(Ghost::B1, 12); // B1 full: its least recent ghost (11) makes room
        assert_eq!((g.len(Ghost::B1), g.len(Ghost::B2)), (2, 1));
        assert_eq!(g.take(11), None);
        assert_eq!(g.take(20), Some(Ghost::B2));
        g.push(Ghost::B2, 12); // replaces the B1 ghost of the same fingerprint
        assert_eq!(g.take(12), Some(Ghost::B2));
        assert_eq!(g.take(10), Some(Ghost::B1));
        assert_eq!(g.total(), 0);
        g.check_consistency().unwrap();
        g.clear();
        assert_eq!(g.total(), 0);
        g.check_consistency().unwrap();
    }

    #[test]
    fn deferred_index_insertion_matches_a_list_model() {
        use std::collections::VecDeque;
        // Capacities below and above PENDING_MAX, so pending ghosts get dropped by pushes
        // and pops before they reach the index, and long runs of pushes force a flush.
        for cap in [1usize, 5, 70, 200] {
            let mut g = GhostLists::new(cap);
            let per_list = cap;
            let mut model: [VecDeque<u64>; 2] = [VecDeque::new(), VecDeque::new()];
            let mut state = cap as u64 + 99;
            let mut next_fp = 1u64;
            for _ in 0..3000 {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let r = state >> 33;
                let list = (r & 1) as usize;
                let which = [Ghost::B1, Ghost::B2][list];
                match (r >> 1) % 8 {
                    0..=4 => {
                        // Unique fingerprints spread over the index (multiplied out).
                        let fp = next_fp.wrapping_mul(0x9E37_79B9_7F4A_7C15);
                        next_fp += 1;
                        g.push(which, fp);
                        if model[list].len() == per_list {
                            model[list].pop_back();
                        }
                        model[list].push_front(fp);
                    }
                    5 | 6 => {
                        // Take a ghost that may or may not still be there.
                        let back = (r >> 4) % next_fp;
                        let fp = (next_fp - back).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                        let expect = (0..2).find_map(|l| {
                            let k = model[l].iter().position(|&x| x == fp)?;
                            model[l].remove(k);
                            Some([Ghost::B1, Ghost::B2][l])
                        });
                        assert_eq!(g.take(fp), expect, "cap {cap} fp {fp:#x}");
                    }
                    _ => {
                        assert_eq!(g.pop_lru(which), model[list].pop_back().is_some());
                    }
                }
                assert_eq!(g.len(Ghost::B1), model[0].len());
                assert_eq!(g.len(Ghost::B2), model[1].len());
                g.check_consistency()
                    .unwrap_or_else(|e| panic!("cap {cap}: {e}"));
            }
        }
    }
}
