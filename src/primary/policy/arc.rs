//! Adaptive Replacement Cache (Megiddo and Modha, FAST 2003) over intrusive lists.
//!
//! * T1: resident entries seen once; T2: resident entries reused at least once.
//! * B1 / B2: fingerprints of entries evicted from T1 / T2 (ghosts), `|T1| + |B1| <= c` and
//!   `|B1| + |B2| <= c` for capacity `c`.
//! * `p`: the adaptive target size of T1. A new key whose ghost is in B1 means T1 was too
//!   small: `p += max(1, |B2| / |B1|)`; a ghost in B2 means T2 was too small:
//!   `p -= max(1, |B1| / |B2|)`. Either way the key enters T2.
//! * Eviction (REPLACE) takes the least recent evictable entry of T1 when `|T1| > p` (or
//!   `|T1| == p` and the incoming key was a B2 ghost), else of T2; if the chosen list has no
//!   evictable entry, the other one.
//!
//! Only real reuse counts as frequency: [`EvictionPolicy::touch`] moves T1 -> T2, while
//! [`EvictionPolicy::refresh`] (a request committing its own insertions) only refreshes
//! recency inside the entry's list. Non-evictable entries are handled as in LRU (kept in
//! place, set aside when eviction meets them).

use super::ghost::{Ghost, GhostLists};
use crate::primary::mem_hints::huge_slice;

use super::list::{Link, List, new_links, prefetch_node};
use super::{Admission, ArcStats, EvictionPolicy, PolicyStats};

const IN_T1: u8 = 1;
const IN_T2: u8 = 2;
const ASIDE: u8 = 4;
const EVICTABLE: u8 = 8;
const PROTECTED: u8 = 16;

/// ARC. Per slot: 8 bytes of links and 1 byte of state; ghosts: 17 bytes plus about 5.3
/// bytes of index per ghost, at most `capacity` ghosts.
#[derive(Debug)]
pub struct ArcPolicy {
    links: Box<[Link]>,
    state: Box<[u8]>,
    t1: List,
    t2: List,
    aside: List,
    t1_len: usize,
    t2_len: usize,
    ev_t1: usize,
    ev_t2: usize,
    p: usize,
    incoming_from_b2: bool,
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
            aside: List::default(),
            t1_len: 0,
            t2_len: 0,
            ev_t1: 0,
            ev_t2: 0,
            p: 0,
            incoming_from_b2: false,
            ghosts: GhostLists::new(capacity),
        }
    }

    fn cap(&self) -> usize {
        self.state.len()
    }

    /// Unlinks `slot` from whichever list holds it; membership and counters unchanged.
    fn unlink(&mut self, slot: u32) {
        let st = self.state[slot as usize];
        if st & ASIDE != 0 {
            self.aside.unlink(&mut self.links, slot);
        } else if st & IN_T1 != 0 {
            self.t1.unlink(&mut self.links, slot);
        } else if st & IN_T2 != 0 {
            self.t2.unlink(&mut self.links, slot);
        }
        self.state[slot as usize] = st & !ASIDE;
    }

    /// Whether inserting a new key into T1 now would trim B1 (drop its least recent ghost).
    fn would_trim_b1(&self) -> bool {
        self.t1_len + self.ghosts.len(Ghost::B1) >= self.cap()
    }

    fn trim_b1(&mut self) {
        while self.t1_len + self.ghosts.len(Ghost::B1) > self.cap() {
            if !self.ghosts.pop_lru(Ghost::B1) {
                break;
            }
        }
    }

    /// Evicts one evictable, unprotected entry of T1 (`from_t1`) or T2 (the list must hold
    /// one); protected entries met on the way go to `held`, pinned ones to the side list.
    fn evict_one(
        &mut self,
        from_t1: bool,
        held: &mut List,
        fingerprint: &mut dyn FnMut(u32) -> u64,
    ) -> Option<u32> {
        loop {
            let list = if from_t1 { &mut self.t1 } else { &mut self.t2 };
            let slot = list.pop_back(&mut self.links)?;
            let st = self.state[slot as usize];
            if st & PROTECTED != 0 {
                held.push_back(&mut self.links, slot);
                continue;
            }
            if st & EVICTABLE == 0 {
                self.aside.push_front(&mut self.links, slot);
                self.state[slot as usize] = st | ASIDE;
                continue;
            }
            self.state[slot as usize] = 0;
            let fp = fingerprint(slot);
            if from_t1 {
                self.t1_len -= 1;
                self.ev_t1 -= 1;
                self.ghosts.push(Ghost::B1, fp);
            } else {
                self.t2_len -= 1;
                self.ev_t2 -= 1;
                self.ghosts.push(Ghost::B2, fp);
            }
            return Some(slot);
        }
    }
}

impl EvictionPolicy for ArcPolicy {
    fn name(&self) -> &'static str {
        "arc"
    }

    fn capacity(&self) -> usize {
        self.cap()
    }

    fn admit(&mut self, fingerprint: u64) -> Admission {
        let b1 = self.ghosts.len(Ghost::B1);
        let b2 = self.ghosts.len(Ghost::B2);
        match self.ghosts.take(fingerprint) {
            Some(Ghost::B1) => {
                let delta = if b1 >= b2 { 1 } else { b2 / b1.max(1) };
                self.p = (self.p + delta).min(self.cap());
                Admission::Frequent
            }
            Some(Ghost::B2) => {
                let delta = if b2 >= b1 { 1 } else { b1 / b2.max(1) };
                self.p = self.p.saturating_sub(delta);
                self.incoming_from_b2 = true;
                Admission::Frequent
            }
            None => Admission::Recent,
        }
    }

    fn insert(&mut self, slot: u32, admission: Admission) {
        debug_assert_eq!(self.state[slot as usize], 0, "slot {slot} inserted twice");
        match admission {
            Admission::Recent => {
                self.t1.push_front(&mut self.links, slot);
                self.state[slot as usize] = IN_T1;
                self.t1_len += 1;
                self.trim_b1();
            }
            Admission::Frequent => {
                self.t2.push_front(&mut self.links, slot);
                self.state[slot as usize] = IN_T2;
                self.t2_len += 1;
            }
        }
        self.incoming_from_b2 = false;
    }

    fn remove(&mut self, slot: u32) {
        let st = self.state[slot as usize];
        if st & (IN_T1 | IN_T2) == 0 {
            return;
        }
        self.unlink(slot);
        let ev = st & EVICTABLE != 0;
        if st & IN_T1 != 0 {
            self.t1_len -= 1;
            self.ev_t1 -= usize::from(ev);
        } else {
            self.t2_len -= 1;
            self.ev_t2 -= usize::from(ev);
        }
        self.state[slot as usize] = 0;
    }

    fn mark_evictable(&mut self, slot: u32) {
        let st = self.state[slot as usize];
        if st & EVICTABLE != 0 || st & (IN_T1 | IN_T2) == 0 {
            return;
        }
        if st & ASIDE != 0 {
            self.aside.unlink(&mut self.links, slot);
            if st & IN_T1 != 0 {
                self.t1.push_back(&mut self.links, slot);
            } else {
                self.t2.push_back(&mut self.links, slot);
            }
        }
        if st & IN_T1 != 0 {
            self.ev_t1 += 1;
        } else {
            self.ev_t2 += 1;
        }
        self.state[slot as usize] = (st & !ASIDE) | EVICTABLE;
    }

    fn mark_non_evictable(&mut self, slot: u32) {
        let st = self.state[slot as usize];
        if st & EVICTABLE == 0 {
            return;
        }
        if st & IN_T1 != 0 {
            self.ev_t1 -= 1;
        } else {
            self.ev_t2 -= 1;
        }
        self.state[slot as usize] = st & !EVICTABLE;
    }

    fn touch(&mut self, slot: u32) {
        let st = self.state[slot as usize];
        if st & (IN_T1 | IN_T2) == 0 {
            return;
        }
        self.unlink(slot);
        let ev = usize::from(st & EVICTABLE != 0);
        if st & IN_T1 != 0 {
            self.t1_len -= 1;
            self.ev_t1 -= ev;
            self.t2_len += 1;
            self.ev_t2 += ev;
        }
        self.t2.push_front(&mut self.links, slot);
        self.state[slot as usize] = IN_T2 | (st & EVICTABLE);
    }

    fn refresh(&mut self, slot: u32) {
        let st = self.state[slot as usize];
        if st & (IN_T1 | IN_T2) == 0 {
            return;
        }
        self.unlink(slot);
        if st & IN_T1 != 0 {
            self.t1.push_front(&mut self.links, slot);
        } else {
            self.t2.push_front(&mut self.links, slot);
        }
        self.state[slot as usize] = st & !ASIDE;
    }

    fn num_evictable(&self) -> usize {
        self.ev_t1 + self.ev_t2
    }

    fn prefetch(&self, slot: u32) {
        prefetch_node(&self.links, &self.state, slot);
    }

    fn keeps_history(&self) -> bool {
        true
    }

    fn prefetch_next_victim_history(&self) {
        self.ghosts.prefetch_oldest_index(self.would_trim_b1());
    }

    fn prefetch_admit(&self, fingerprint: u64) {
        self.ghosts.prefetch_index(fingerprint);
    }

    fn prefetch_next_victim(&self) -> Option<u32> {
        self.ghosts.prefetch_oldest(self.would_trim_b1());
        let (first, second) = if self.t1_len > self.p {
            (&self.t1, &self.t2)
        } else {
            (&self.t2, &self.t1)
        };
        let s = first.back().or_else(|| second.back())?;
        prefetch_node(&self.links, &self.state, s);
        Some(s)
    }

    fn evict(
        &mut self,
        n: usize,
        protected: &[u32],
        fingerprint: &mut dyn FnMut(u32) -> u64,
        victims: &mut Vec<u32>,
    ) -> bool {
        if n + protected.len() > self.num_evictable() {
            return false;
        }
        let (mut prot1, mut prot2) = (0, 0);
        for &s in protected {
            let st = self.state[s as usize];
            if st & IN_T1 != 0 {
                prot1 += 1;
            } else {
                prot2 += 1;
            }
            self.state[s as usize] = st | PROTECTED;
        }
        let mut held = List::default();
        for _ in 0..n {
            let avail1 = self.ev_t1 - prot1;
            let avail2 = self.ev_t2 - prot2;
            let prefer_t1 = self.t1_len > self.p
                || (self.t1_len > 0 && self.t1_len == self.p && self.incoming_from_b2);
            let from_t1 = if avail1 == 0 {
                false
            } else if avail2 == 0 {
                true
            } else {
                prefer_t1
            };
            match self.evict_one(from_t1, &mut held, fingerprint) {
                Some(slot) => victims.push(slot),
                // Unreachable while the counters are right; `check_consistency` reports it.
                None => break,
            }
        }
        // Put protected entries back where they were, each in its own list.
        while let Some(slot) = held.pop_back(&mut self.links) {
            if self.state[slot as usize] & IN_T1 != 0 {
                self.t1.push_back(&mut self.links, slot);
            } else {
                self.t2.push_back(&mut self.links, slot);
            }
        }
        for &s in protected {
            self.state[s as usize] &= !PROTECTED;
        }
        self.incoming_from_b2 = false;
        true
    }

    fn reset_history(&mut self) {
        self.ghosts.clear();
        self.p = 0;
        self.incoming_from_b2 = false;
    }

    fn stats(&self) -> PolicyStats {
        PolicyStats {
            resident: self.t1_len + self.t2_len,
            evictable: self.num_evictable(),
            arc: Some(ArcStats {
                t1: self.t1_len,
                t2: self.t2_len,
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
        let (mut t1, mut t2, mut e1, mut e2) = (0, 0, 0, 0);
        let mut linked = vec![false; self.cap()];
        for (list, name) in [(&self.t1, "t1"), (&self.t2, "t2"), (&self.aside, "aside")] {
            let mut count = 0;
            for s in list.iter(&self.links) {
                count += 1;
                if std::mem::replace(&mut linked[s as usize], true) {
                    return Err(format!("arc: slot {s} linked twice"));
                }
                let st = self.state[s as usize];
                let ok = match name {
                    "t1" => st & (IN_T1 | ASIDE) == IN_T1,
                    "t2" => st & (IN_T2 | ASIDE) == IN_T2,
                    _ => st & ASIDE != 0 && st & EVICTABLE == 0,
                };
                if !ok {
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
        for (s, &st) in self.state.iter().enumerate() {
            let ev = usize::from(st & EVICTABLE != 0);
            if st & IN_T1 != 0 {
                t1 += 1;
                e1 += ev;
            } else if st & IN_T2 != 0 {
                t2 += 1;
                e2 += ev;
            }
            if (st & (IN_T1 | IN_T2) != 0) != linked[s] {
                return Err(format!("arc: slot {s} membership and linkage disagree"));
            }
        }
        if (t1, t2, e1, e2) != (self.t1_len, self.t2_len, self.ev_t1, self.ev_t2) {
            return Err(format!(
                "arc counters (t1 {}, t2 {}, ev1 {}, ev2 {}) but found ({t1}, {t2}, {e1}, {e2})",
                self.t1_len, self.t2_len, self.ev_t1, self.ev_t2
            ));
        }
        if self.p > self.cap() || self.t1_len + self.ghosts.len(Ghost::B1) > self.cap() {
            return Err(format!(
                "arc bounds: p {}, |T1| {} + |B1| {} > c {}",
                self.p,
                self.t1_len,
                self.ghosts.len(Ghost::B1),
                self.cap()
            ));
        }
        if self.ghosts.total() > self.cap() {
            return Err("arc: more ghosts than capacity".into());
        }
        self.ghosts.check_consistency()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(p: &mut ArcPolicy, slots: std::ops::Range<u32>) {
        for s in slots {
            let adm = p.admit(1000 + u64::from(s));
            p.insert(s, adm);
            p.mark_evictable(s);
        }
    }

    #[test]
    fn touch_promotes_refresh_does_not() {
        let mut p = ArcPolicy::new(4);
        fill(&mut p, 0..4);
        p.refresh(0);
        p.touch(1);
        let a = p.stats().arc.unwrap();
        assert_eq!((a.t1, a.t2), (3, 1));
        // p = 0 -> T1 is over target: evict T1's least recent (2, then 3), not the T2 entry.
        let mut v = Vec::new();
        assert!(p.evict(2, &[], &mut |s| 1000 + u64::from(s), &mut v));
        assert_eq!(v, vec![2, 3]);
        assert_eq!(p.stats().arc.unwrap().b1, 2);
        p.check_consistency().unwrap();
    }

    #[test]
    fn ghost_hit_in_b1_raises_target_and_enters_t2() {
        let mut p = ArcPolicy::new(2);
        fill(&mut p, 0..2);
        let mut v = Vec::new();
        assert!(p.evict(1, &[], &mut |s| 1000 + u64::from(s), &mut v));
        assert_eq!(v, vec![0]);
        assert_eq!(p.admit(1000), Admission::Frequent);
        assert_eq!(p.stats().arc.unwrap().target_t1, 1);
        p.insert(0, Admission::Frequent);
        let a = p.stats().arc.unwrap();
        assert_eq!((a.t1, a.t2, a.b1), (1, 1, 0));
        p.check_consistency().unwrap();
    }
}
