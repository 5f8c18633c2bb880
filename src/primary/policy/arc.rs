//! Adaptive Replacement Cache as vLLM 0.33.0's `ARCCachePolicy` runs it, over intrusive lists.
//!
//! * T1: resident entries inserted and not yet reused; T2: resident entries reused.
//! * B1 / B2: fingerprints of entries evicted from T1 / T2 (ghosts), each at most the
//!   capacity (trimmed after an eviction).
//! * `p`: the adaptive target size of T1, a float in `0..=capacity`. A store miss or a touch
//!   of a key whose ghost is in B1 means T1 was too small: `p += max(1, |B2| / |B1|)`; a ghost
//!   in B2: `p -= max(1, |B1| / |B2|)` (float division), and the ghost becomes the most
//!   recent of its list. A store miss adapts once per request and key, before the store may
//!   be refused; the ghost stays until the key is inserted.
//! * Insertion: always the front of T1 (the key's ghost is forgotten).
//! * Eviction (REPLACE): for each victim, T1's least recent evictable entry while the
//!   simulated `|T1| >= floor(p)`, else T2's, else T1's; both scans only move forward
//!   (pinned, in-flight and protected entries are passed over in place).
//! * `touch`: a ready T1 entry moves to T2, one in flight stays in T1 (as its most recent
//!   entry), a T2 entry moves to T2's front; a ghost adapts `p`.
//! * A finishing request: its reused keys move T1 -> T2 (or to T2's front), the keys it only
//!   inserted move to the front of their list, the rest stay.

use super::ghost::{Ghost, GhostLists};
use crate::primary::huge_arrays::huge_slice;

use super::list::{Link, List, more_recent, new_links};
use super::marks::{Marked, marked_methods};
use super::{ArcStats, Commit, EvictionPolicy, PolicyStats};

const IN_T1: u8 = 1;
const IN_T2: u8 = 2;
const EVICTABLE: u8 = 4;
const PROTECTED: u8 = 8;

/// ARC. Per slot: 8 bytes of links and 1 byte of state; ghosts: 17 bytes plus about 5.3
/// bytes of index per ghost, at most `2 * capacity` ghosts.
#[derive(Debug)]
pub struct ArcPolicy {
    links: Box<[Link]>,
    state: Box<[u8]>,
    t1: List,
    t2: List,
    evictable: usize,
    p: f64,
    ghosts: GhostLists,
}

impl ArcPolicy {
    /// An empty policy for `capacity` slots.
    pub fn new(capacity: usize) -> Self {
        ArcPolicy {
            links: new_links(capacity),
            state: huge_slice(capacity, || 0u8),
            t1: List::default(),
            t2: List::default(),
            evictable: 0,
            p: 0.0,
            ghosts: GhostLists::new(capacity),
        }
    }

    fn cap(&self) -> usize {
        self.state.len()
    }

    /// vLLM's `_adapt_to_ghost_hit`.
    fn adapt(&mut self, fingerprint: u64) {
        let b1 = self.ghosts.len(Ghost::B1) as f64;
        let b2 = self.ghosts.len(Ghost::B2) as f64;
        match self.ghosts.hit(fingerprint) {
            Some(Ghost::B1) => {
                let delta = f64::max(1.0, b2 / b1);
                self.p = f64::min(self.p + delta, self.cap() as f64);
            }
            Some(Ghost::B2) => {
                let delta = f64::max(1.0, b1 / b2);
                self.p = f64::max(self.p - delta, 0.0);
            }
            None => {}
        }
    }

    fn move_to_t2(&mut self, slot: u32) {
        self.t1.unlink(&mut self.links, slot);
        self.t2.push_front(&mut self.links, slot);
        let st = self.state[slot as usize];
        self.state[slot as usize] = (st & !IN_T1) | IN_T2;
    }

    /// The list holding `slot` (by its state), with the links; `None`: in neither.
    fn list_of(&mut self, slot: u32) -> Option<(&mut List, &mut [Link])> {
        let st = self.state[slot as usize];
        if st & IN_T1 != 0 {
            Some((&mut self.t1, &mut self.links))
        } else if st & IN_T2 != 0 {
            Some((&mut self.t2, &mut self.links))
        } else {
            None
        }
    }

    fn make_most_recent(&mut self, slot: u32) {
        if let Some((list, links)) = self.list_of(slot) {
            list.move_to_front(links, slot);
        }
    }

    /// The next evictable, unprotected entry from `cur` towards the front.
    fn next_candidate(&self, cur: &mut Option<u32>) -> Option<u32> {
        while let Some(slot) = *cur {
            *cur = more_recent(&self.links, slot);
            if self.state[slot as usize] & (EVICTABLE | PROTECTED) == EVICTABLE {
                return Some(slot);
            }
        }
        None
    }
    /// Appends up to `n` victims in REPLACE order (evictable, unprotected entries), changing
    /// nothing; returns how many it found.
    fn select(&self, n: usize, victims: &mut Vec<u32>) -> usize {
        let target = self.p as usize;
        let mut virtual_t1 = self.t1.len();
        let mut c1 = self.t1.back();
        let mut c2 = self.t2.back();
        for found in 0..n {
            let mut pick = None;
            if virtual_t1 >= target
                && let Some(s) = self.next_candidate(&mut c1)
            {
                virtual_t1 -= 1;
                pick = Some(s);
            }
            if pick.is_none() {
                pick = self.next_candidate(&mut c2);
            }
            if pick.is_none() {
                pick = self.next_candidate(&mut c1);
                if pick.is_some() {
                    virtual_t1 -= 1;
                }
            }
            match pick {
                Some(s) => victims.push(s),
                None => return found,
            }
        }
        n
    }

    /// The slots the next `n` evictions would take, in order (fewer when fewer entries are
    /// evictable), with the current target: what an admission policy weighs a candidate
    /// against. Changes nothing.
    pub fn peek_victims(&self, n: usize) -> Vec<u32> {
        let mut v = Vec::with_capacity(n.min(self.evictable));
        self.select(n.min(self.evictable), &mut v);
        v
    }
}

impl Marked for ArcPolicy {
    const RESIDENT: u8 = IN_T1 | IN_T2;
    const EVICTABLE: u8 = EVICTABLE;
    const PROTECTED: u8 = PROTECTED;

    fn marks(&mut self) -> (&mut [u8], &mut usize) {
        (&mut self.state, &mut self.evictable)
    }

    fn select(&self, n: usize, victims: &mut Vec<u32>) -> usize {
        ArcPolicy::select(self, n, victims)
    }

    fn unlink(&mut self, slot: u32) {
        if let Some((list, links)) = self.list_of(slot) {
            list.unlink(links, slot);
        }
    }

    fn on_evicted(&mut self, slot: u32, fingerprint: &mut dyn FnMut(u32) -> u64) {
        let fp = fingerprint(slot);
        let ghost = if self.state[slot as usize] & IN_T1 != 0 {
            Ghost::B1
        } else {
            Ghost::B2
        };
        self.ghosts.push(ghost, fp);
    }
}

impl EvictionPolicy for ArcPolicy {
    marked_methods!();

    fn name(&self) -> &'static str {
        "arc"
    }

    fn capacity(&self) -> usize {
        self.cap()
    }

    fn on_store_miss(&mut self, fingerprint: u64) {
        self.adapt(fingerprint);
    }

    fn insert(&mut self, slot: u32, fingerprint: u64) {
        debug_assert_eq!(self.state[slot as usize], 0, "slot {slot} inserted twice");
        self.t1.push_front(&mut self.links, slot);
        self.state[slot as usize] = IN_T1;
        self.ghosts.take(fingerprint);
    }

    fn touch(&mut self, slot: u32, ready: bool) {
        if ready && self.state[slot as usize] & IN_T1 != 0 {
            self.move_to_t2(slot);
        } else {
            self.make_most_recent(slot);
        }
    }

    fn touch_absent(&mut self, fingerprint: u64) {
        self.adapt(fingerprint);
    }

    fn commit(&mut self, slot: u32, how: Commit) {
        match how {
            Commit::Reused if self.state[slot as usize] & IN_T1 != 0 => self.move_to_t2(slot),
            Commit::Reused | Commit::InsertedOnly => self.make_most_recent(slot),
            Commit::Seen => {}
        }
    }

    fn reset_history(&mut self) {
        self.ghosts.clear();
        self.p = 0.0;
    }

    fn stats(&self) -> PolicyStats {
        PolicyStats {
            resident: self.t1.len() + self.t2.len(),
            evictable: self.evictable,
            arc: Some(ArcStats {
                t1: self.t1.len(),
                t2: self.t2.len(),
                b1: self.ghosts.len(Ghost::B1),
                b2: self.ghosts.len(Ghost::B2),
                target_t1: self.p,
            }),
        }
    }

    fn heap_bytes(&self) -> usize {
        std::mem::size_of_val(&*self.links)
            + std::mem::size_of_val(&*self.state)
            + self.ghosts.heap_bytes()
    }

    fn check_consistency(&self) -> Result<(), String> {
        let mut linked = vec![false; self.cap()];
        for (list, flag, name) in [(&self.t1, IN_T1, "t1"), (&self.t2, IN_T2, "t2")] {
            let mut count = 0;
            for s in list.iter(&self.links) {
                count += 1;
                if std::mem::replace(&mut linked[s as usize], true) {
                    return Err(format!("arc: slot {s} linked twice"));
                }
                let st = self.state[s as usize];
                if st & (IN_T1 | IN_T2) != flag {
                    return Err(format!("arc: slot {s} in {name} has state {st:#x}"));
                }
            }
            if count != list.len() {
                return Err(format!(
                    "arc: {name} length {} but {count} nodes",
                    list.len()
                ));
            }
        }
        let mut evictable = 0;
        for (s, &st) in self.state.iter().enumerate() {
            if st & (IN_T1 | IN_T2) != 0 && !linked[s] {
                return Err(format!("arc: slot {s} claims a list but is not linked"));
            }
            if st & PROTECTED != 0 {
                return Err(format!("arc: slot {s} left protected"));
            }
            evictable += usize::from(st & EVICTABLE != 0);
        }
        if evictable != self.evictable {
            return Err(format!(
                "arc: evictable count {} but {evictable} slots marked",
                self.evictable
            ));
        }
        let cap = self.cap();
        if self.ghosts.len(Ghost::B1) > cap || self.ghosts.len(Ghost::B2) > cap {
            return Err("arc: a ghost list exceeds the capacity".into());
        }
        if !(0.0..=cap as f64).contains(&self.p) {
            return Err(format!("arc: target {} outside 0..={cap}", self.p));
        }
        self.ghosts.check_consistency()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn evict(p: &mut ArcPolicy, n: usize) -> Option<Vec<u32>> {
        let mut v = Vec::new();
        p.evict(n, &[], &mut |s| u64::from(s) + 100, &mut v)
            .then_some(v)
    }

    fn fill(p: &mut ArcPolicy, slots: std::ops::Range<u32>) {
        for s in slots {
            p.insert(s, u64::from(s) + 100);
            p.mark_evictable(s);
        }
    }

    #[test]
    fn touch_promotes_ready_entries_only() {
        let mut p = ArcPolicy::new(4);
        fill(&mut p, 0..2);
        p.insert(2, 102); // in flight
        p.touch(0, true);
        p.touch(2, false);
        let s = p.stats().arc.unwrap();
        assert_eq!((s.t1, s.t2), (2, 1));
        p.commit(1, Commit::InsertedOnly);
        assert_eq!(p.stats().arc.unwrap().t2, 1);
        p.commit(1, Commit::Reused);
        assert_eq!(p.stats().arc.unwrap().t2, 2);
        p.check_consistency().unwrap();
    }

    #[test]
    fn ghost_hits_adapt_a_float_target_before_insertion() {
        let mut p = ArcPolicy::new(4);
        fill(&mut p, 0..4);
        p.touch(3, true); // T2: 3
        assert_eq!(
            evict(&mut p, 2),
            Some(vec![0, 1]),
            "|T1| = 3 >= floor(p) = 0"
        );
        assert_eq!(evict(&mut p, 1), Some(vec![2]));
        assert_eq!(evict(&mut p, 1), Some(vec![3]), "T1 empty: T2");
        let s = p.stats().arc.unwrap();
        assert_eq!((s.b1, s.b2), (3, 1));
        p.on_store_miss(103); // B2 hit: p = max(0 - 3, 0)
        p.on_store_miss(100); // B1 hit: p += max(1, 1 / 3)
        assert_eq!(p.stats().arc.unwrap().target_t1, 1.0);
        p.insert(0, 100);
        let s = p.stats().arc.unwrap();
        assert_eq!(
            (s.t1, s.b1, s.b2),
            (1, 2, 1),
            "inserted into T1, its ghost gone"
        );
        p.check_consistency().unwrap();
    }
}
