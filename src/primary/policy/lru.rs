//! Least-recently-used eviction over an intrusive list (see the module docs of `policy` for
//! how non-evictable entries are handled).

use crate::primary::mem_hints::huge_slice;

use super::list::{Link, List, new_links, prefetch_node};
use super::{Admission, EvictionPolicy, PolicyStats};

const IN_MAIN: u8 = 1;
const IN_ASIDE: u8 = 2;
const EVICTABLE: u8 = 4;
const PROTECTED: u8 = 8;

/// LRU: one recency list (front = most recent) plus a side list for non-evictable entries
/// met by eviction. Per slot: 8 bytes of links and 1 byte of state.
#[derive(Debug)]
pub struct LruPolicy {
    links: Box<[Link]>,
    state: Box<[u8]>,
    main: List,
    aside: List,
    evictable: usize,
}

impl LruPolicy {
    /// An empty policy for `capacity` slots.
    pub fn new(capacity: usize) -> Self {
        LruPolicy {
            links: new_links(capacity),
            state: huge_slice(capacity, || 0u8),
            main: List::default(),
            aside: List::default(),
            evictable: 0,
        }
    }

    fn unlink(&mut self, slot: u32) {
        let st = self.state[slot as usize];
        if st & IN_MAIN != 0 {
            self.main.unlink(&mut self.links, slot);
        } else if st & IN_ASIDE != 0 {
            self.aside.unlink(&mut self.links, slot);
        }
        self.state[slot as usize] = st & !(IN_MAIN | IN_ASIDE);
    }
}

impl EvictionPolicy for LruPolicy {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn capacity(&self) -> usize {
        self.state.len()
    }

    fn insert(&mut self, slot: u32, _admission: Admission) {
        debug_assert_eq!(self.state[slot as usize], 0, "slot {slot} inserted twice");
        self.main.push_front(&mut self.links, slot);
        self.state[slot as usize] = IN_MAIN;
    }

    fn remove(&mut self, slot: u32) {
        self.unlink(slot);
        if self.state[slot as usize] & EVICTABLE != 0 {
            self.evictable -= 1;
        }
        self.state[slot as usize] = 0;
    }

    fn mark_evictable(&mut self, slot: u32) {
        let st = self.state[slot as usize];
        if st & EVICTABLE != 0 || st & (IN_MAIN | IN_ASIDE) == 0 {
            return;
        }
        if st & IN_ASIDE != 0 {
            // It was the least recent entry when eviction set it aside.
            self.aside.unlink(&mut self.links, slot);
            self.main.push_back(&mut self.links, slot);
        }
        self.state[slot as usize] = IN_MAIN | EVICTABLE;
        self.evictable += 1;
    }

    fn mark_non_evictable(&mut self, slot: u32) {
        let st = self.state[slot as usize];
        if st & EVICTABLE != 0 {
            self.state[slot as usize] = st & !EVICTABLE;
            self.evictable -= 1;
        }
    }

    fn touch(&mut self, slot: u32) {
        let st = self.state[slot as usize];
        if st & (IN_MAIN | IN_ASIDE) == 0 {
            return;
        }
        self.unlink(slot);
        self.main.push_front(&mut self.links, slot);
        self.state[slot as usize] = (st & EVICTABLE) | IN_MAIN;
    }

    fn num_evictable(&self) -> usize {
        self.evictable
    }

    fn prefetch(&self, slot: u32) {
        prefetch_node(&self.links, &self.state, slot);
    }

    fn prefetch_next_victim(&self) -> Option<u32> {
        let s = self.main.back()?;
        prefetch_node(&self.links, &self.state, s);
        Some(s)
    }

    fn evict(
        &mut self,
        n: usize,
        protected: &[u32],
        _fingerprint: &mut dyn FnMut(u32) -> u64,
        victims: &mut Vec<u32>,
    ) -> bool {
        if n + protected.len() > self.evictable {
            return false;
        }
        for &s in protected {
            self.state[s as usize] |= PROTECTED;
        }
        // Protected entries met at the back are held here, in walk order, and put back
        // afterwards exactly where they were.
        let mut held = List::default();
        let mut taken = 0;
        while taken < n {
            // Every evictable entry is in `main`, and enough of them are unprotected.
            let Some(slot) = self.main.pop_back(&mut self.links) else {
                break;
            };
            let st = self.state[slot as usize];
            if st & PROTECTED != 0 {
                held.push_back(&mut self.links, slot);
            } else if st & EVICTABLE != 0 {
                self.state[slot as usize] = 0;
                self.evictable -= 1;
                victims.push(slot);
                taken += 1;
            } else {
                self.aside.push_front(&mut self.links, slot);
                self.state[slot as usize] = IN_ASIDE;
            }
        }
        while let Some(slot) = held.pop_back(&mut self.links) {
            self.main.push_back(&mut self.links, slot);
        }
        for &s in protected {
            self.state[s as usize] &= !PROTECTED;
        }
        true
    }

    fn stats(&self) -> PolicyStats {
        PolicyStats {
            resident: self.main.len() + self.aside.len(),
            evictable: self.evictable,
            arc: None,
        }
    }

    fn heap_bytes(&self) -> usize {
        std::mem::size_of_val(&*self.links) + std::mem::size_of_val(&*self.state)
    }

    fn check_consistency(&self) -> Result<(), String> {
        let mut seen = vec![0u8; self.state.len()];
        for (list, flag) in [(&self.main, IN_MAIN), (&self.aside, IN_ASIDE)] {
            let mut count = 0;
            for s in list.iter(&self.links) {
                count += 1;
                if seen[s as usize] != 0 {
                    return Err(format!("lru: slot {s} linked twice"));
                }
                seen[s as usize] = flag;
                if self.state[s as usize] & flag == 0 {
                    return Err(format!(
                        "lru: slot {s} is in a list its state does not name"
                    ));
                }
            }
            if count != list.len() {
                return Err(format!("lru: list length {} but {count} nodes", list.len()));
            }
        }
        let mut evictable = 0;
        for (s, st) in self.state.iter().enumerate() {
            if st & (IN_MAIN | IN_ASIDE) != 0 && seen[s] == 0 {
                return Err(format!("lru: slot {s} claims a list but is not linked"));
            }
            if st & EVICTABLE != 0 {
                evictable += 1;
                if st & IN_MAIN == 0 {
                    return Err(format!("lru: evictable slot {s} is not in the main list"));
                }
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

    fn evict(p: &mut LruPolicy, n: usize) -> Option<Vec<u32>> {
        let mut v = Vec::new();
        p.evict(n, &[], &mut |_| 0, &mut v).then_some(v)
    }

    #[test]
    fn evicts_least_recent_first_and_touch_refreshes() {
        let mut p = LruPolicy::new(4);
        for s in 0..4 {
            p.insert(s, Admission::Recent);
            p.mark_evictable(s);
        }
        p.touch(0);
        assert_eq!(evict(&mut p, 2), Some(vec![1, 2]));
        assert_eq!(evict(&mut p, 3), None, "atomic: refused when too few");
        assert_eq!(p.num_evictable(), 2);
        assert_eq!(evict(&mut p, 2), Some(vec![3, 0]));
        p.check_consistency().unwrap();
    }

    #[test]
    fn pinned_entry_keeps_its_place_or_returns_to_the_back() {
        let mut p = LruPolicy::new(4);
        for s in 0..4 {
            p.insert(s, Admission::Recent);
            p.mark_evictable(s);
        }
        // Pin 0 (least recent) and 2, then evict one: 0 is set aside, 1 goes.
        p.mark_non_evictable(0);
        p.mark_non_evictable(2);
        assert_eq!(evict(&mut p, 1), Some(vec![1]));
        p.check_consistency().unwrap();
        // Unpinned: 0 returns as least recent; 2 never moved, so it is next after 0.
        p.mark_evictable(0);
        p.mark_evictable(2);
        assert_eq!(evict(&mut p, 3), Some(vec![0, 2, 3]));
        assert_eq!(p.stats().resident, 0);
        p.check_consistency().unwrap();
    }
}
