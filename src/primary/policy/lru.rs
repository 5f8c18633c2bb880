//! Least-recently-used eviction over an intrusive recency list (vLLM 0.33.0's
//! `LRUCachePolicy` for requests without token positions: every use gives a key the newest
//! rank, and a pinned key keeps its rank).

use crate::primary::huge_arrays::huge_slice;

use super::list::{Link, List, more_recent, new_links};
use super::marks::{Marked, marked_methods};
use super::{Commit, EvictionPolicy, PolicyStats};

const IN_LIST: u8 = 1;
const EVICTABLE: u8 = 2;
const PROTECTED: u8 = 4;

/// LRU: one recency list (front = most recent) holding every resident entry, pinned or not.
/// Per slot: 8 bytes of links and 1 byte of state.
#[derive(Debug)]
pub struct LruPolicy {
    links: Box<[Link]>,
    state: Box<[u8]>,
    list: List,
    evictable: usize,
}

impl LruPolicy {
    /// An empty policy for `capacity` slots.
    pub fn new(capacity: usize) -> Self {
        LruPolicy {
            links: new_links(capacity),
            state: huge_slice(capacity, || 0u8),
            list: List::default(),
            evictable: 0,
        }
    }

    fn make_most_recent(&mut self, slot: u32) {
        if self.state[slot as usize] & IN_LIST != 0 {
            self.list.move_to_front(&mut self.links, slot);
        }
    }
}

impl Marked for LruPolicy {
    const RESIDENT: u8 = IN_LIST;
    const EVICTABLE: u8 = EVICTABLE;
    const PROTECTED: u8 = PROTECTED;

    fn marks(&mut self) -> (&mut [u8], &mut usize) {
        (&mut self.state, &mut self.evictable)
    }

    fn select(&self, n: usize, victims: &mut Vec<u32>) -> usize {
        let mut found = 0;
        let mut cur = self.list.back();
        while found < n {
            let Some(slot) = cur else { break };
            cur = more_recent(&self.links, slot);
            if self.state[slot as usize] & (EVICTABLE | PROTECTED) == EVICTABLE {
                victims.push(slot);
                found += 1;
            }
        }
        found
    }

    fn unlink(&mut self, slot: u32) {
        self.list.unlink(&mut self.links, slot);
    }
}

impl EvictionPolicy for LruPolicy {
    marked_methods!();

    fn name(&self) -> &'static str {
        "lru"
    }

    fn capacity(&self) -> usize {
        self.state.len()
    }

    fn insert(&mut self, slot: u32, _fingerprint: u64) {
        debug_assert_eq!(self.state[slot as usize], 0, "slot {slot} inserted twice");
        self.list.push_front(&mut self.links, slot);
        self.state[slot as usize] = IN_LIST;
    }

    fn touch(&mut self, slot: u32, _ready: bool) {
        self.make_most_recent(slot);
    }

    fn commit(&mut self, slot: u32, _how: Commit) {
        self.make_most_recent(slot);
    }

    fn stats(&self) -> PolicyStats {
        PolicyStats {
            resident: self.list.len(),
            evictable: self.evictable,
            arc: None,
        }
    }

    fn heap_bytes(&self) -> usize {
        std::mem::size_of_val(&*self.links) + std::mem::size_of_val(&*self.state)
    }

    fn check_consistency(&self) -> Result<(), String> {
        let mut seen = vec![false; self.state.len()];
        let mut count = 0;
        for s in self.list.iter(&self.links) {
            count += 1;
            if std::mem::replace(&mut seen[s as usize], true) {
                return Err(format!("lru: slot {s} linked twice"));
            }
            if self.state[s as usize] & IN_LIST == 0 {
                return Err(format!("lru: slot {s} is linked but its state says not"));
            }
        }
        if count != self.list.len() {
            return Err(format!(
                "lru: list length {} but {count} nodes",
                self.list.len()
            ));
        }
        let mut evictable = 0;
        for (s, st) in self.state.iter().enumerate() {
            if st & IN_LIST != 0 && !seen[s] {
                return Err(format!("lru: slot {s} claims the list but is not linked"));
            }
            if st & PROTECTED != 0 {
                return Err(format!("lru: slot {s} left protected"));
            }
            if st & EVICTABLE != 0 {
                evictable += 1;
            }
        }
        if evictable != self.evictable {
            return Err(format!(
                "lru: evictable count {} but {evictable} slots marked",
                self.evictable
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn evict(p: &mut LruPolicy, n: usize, protected: &[u32]) -> Option<Vec<u32>> {
        let mut v = Vec::new();
        p.evict(n, protected, &mut |_| 0, &mut v).then_some(v)
    }

    fn filled(n: u32) -> LruPolicy {
        let mut p = LruPolicy::new(n as usize);
        for s in 0..n {
            p.insert(s, 0);
            p.mark_evictable(s);
        }
        p
    }

    #[test]
    fn evicts_least_recent_first_and_touch_refreshes() {
        let mut p = filled(4);
        p.touch(0, true);
        assert_eq!(evict(&mut p, 2, &[]), Some(vec![1, 2]));
        assert_eq!(evict(&mut p, 3, &[]), None, "atomic: refused when too few");
        assert_eq!(p.num_evictable(), 2);
        assert_eq!(evict(&mut p, 2, &[]), Some(vec![3, 0]));
        p.check_consistency().unwrap();
    }

    #[test]
    fn pinned_and_protected_entries_keep_their_rank() {
        let mut p = filled(4);
        // Pin 0 (least recent) and 2; evicting one passes 0 over and takes 1.
        p.mark_non_evictable(0);
        p.mark_non_evictable(2);
        assert_eq!(evict(&mut p, 1, &[]), Some(vec![1]));
        // Unpinned in the other order: each keeps the rank it had.
        p.mark_evictable(2);
        p.mark_evictable(0);
        assert_eq!(evict(&mut p, 1, &[0]), Some(vec![2]), "0 protected");
        assert_eq!(evict(&mut p, 2, &[]), Some(vec![0, 3]));
        assert_eq!(p.stats().resident, 0);
        p.check_consistency().unwrap();
    }
}
