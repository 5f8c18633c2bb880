//! How the index picks the entry a store evicts: the intrusive LRU list over the slots (kept
//! under either policy: checkpoints write entries in its order) and, with `eviction_policy =
//! "arc"`, the primary's ARC over the committed slots.

use crate::config::model::EvictionPolicyKind;
use crate::g3::index::{EVICTION_SCAN_LIMIT, Index, NIL, Slot};
use crate::key::ChunkKey;
use crate::primary::policy::{ArcPolicy, EvictionPolicy};

impl Index {
    /// The keys the next `n` reservations beyond the free slots would evict, in eviction
    /// order (fewer when fewer entries can be evicted): what an admission policy weighs a
    /// candidate against. Changes nothing.
    pub fn eviction_candidates(&self, n: usize) -> Vec<ChunkKey> {
        if let Some(arc) = &self.arc {
            return arc
                .peek_victims(n)
                .into_iter()
                .filter_map(|s| self.slots[s as usize].key.to_chunk_key())
                .collect();
        }
        let mut out = Vec::new();
        let mut s = self.tail;
        let mut scanned = 0;
        while out.len() < n && s != NIL && scanned < EVICTION_SCAN_LIMIT + n {
            let e = &self.slots[s as usize];
            if !self.readers.contains_key(&s)
                && !self.dead_paths[self.path_of(s)]
                && let Some(k) = e.key.to_chunk_key()
            {
                out.push(k);
            }
            s = e.prev;
            scanned += 1;
        }
        out
    }

    /// The next victim of the configured policy (ARC removes it from its lists and keeps its
    /// fingerprint as a ghost).
    pub(super) fn victim(&mut self) -> Option<Slot> {
        let Some(arc) = &mut self.arc else {
            return self.lru_victim();
        };
        let (slots, hasher, v) = (&self.slots, &self.hasher, &mut self.arc_victims);
        v.clear();
        let mut fp = |s: u32| slots[s as usize].key.bytes().map_or(0, |k| hasher.hash(k));
        arc.evict(1, &[], &mut fp, v).then(|| v[0])
    }

    fn lru_victim(&self) -> Option<Slot> {
        let mut s = self.tail;
        for _ in 0..EVICTION_SCAN_LIMIT {
            if s == NIL {
                return None;
            }
            let e = &self.slots[s as usize];
            if !self.readers.contains_key(&s) && !self.dead_paths[self.path_of(s)] {
                return Some(s);
            }
            s = e.prev;
        }
        None
    }

    /// Chooses how victims are picked (`eviction_policy`). Switching to ARC seeds T1 with the
    /// committed entries in LRU order (the least recently used is T1's least recent entry),
    /// target 0 and no ghosts: after recovery that is the order of the checkpoint followed
    /// by the journal's inserts, so ARC's first victims are LRU's. Switching to LRU drops
    /// ARC's state (the LRU list is always kept).
    pub fn set_eviction_policy(&mut self, kind: EvictionPolicyKind) {
        match kind {
            EvictionPolicyKind::Lru => self.arc = None,
            EvictionPolicyKind::Arc => {
                self.arc = Some(Box::new(ArcPolicy::new(self.slots.len())));
                let mut s = self.tail;
                while s != NIL {
                    self.arc_insert(s);
                    s = self.slots[s as usize].prev;
                }
            }
        }
    }

    /// The configured eviction policy.
    #[cfg(any(test, feature = "test-support"))]
    pub fn eviction_policy(&self) -> EvictionPolicyKind {
        if self.arc.is_some() {
            EvictionPolicyKind::Arc
        } else {
            EvictionPolicyKind::Lru
        }
    }

    /// A slot just became committed: ARC inserts it at T1's front (its ghost forgotten), as
    /// evictable unless pinned or on a dead path.
    pub(super) fn arc_insert(&mut self, slot: Slot) {
        let Some(arc) = &mut self.arc else {
            return;
        };
        let fp = self.slots[slot as usize]
            .key
            .bytes()
            .map_or(0, |k| self.hasher.hash(k));
        arc.insert(slot, fp);
        if !self.readers.contains_key(&slot) && !self.dead_paths[slot as usize % self.n_paths] {
            arc.mark_evictable(slot);
        }
    }

    /// ARC's sizes (`None` under LRU), for tests and diagnostics.
    #[cfg(any(test, feature = "test-support"))]
    pub fn arc_stats(&self) -> Option<crate::primary::policy::ArcStats> {
        self.arc.as_ref().and_then(|a| a.stats().arc)
    }

    // The intrusive LRU list.

    pub(super) fn unlink(&mut self, s: Slot) {
        let (prev, next) = {
            let e = &self.slots[s as usize];
            (e.prev, e.next)
        };
        if prev != NIL {
            self.slots[prev as usize].next = next;
        } else if self.head == s {
            self.head = next;
        }
        if next != NIL {
            self.slots[next as usize].prev = prev;
        } else if self.tail == s {
            self.tail = prev;
        }
        let e = &mut self.slots[s as usize];
        e.prev = NIL;
        e.next = NIL;
    }

    pub(super) fn push_mru(&mut self, s: Slot) {
        let old = self.head;
        {
            let e = &mut self.slots[s as usize];
            e.prev = NIL;
            e.next = old;
        }
        if old != NIL {
            self.slots[old as usize].prev = s;
        } else {
            self.tail = s;
        }
        self.head = s;
    }
}
