//! Eviction policies of the primary tier, behind one trait: [`LruPolicy`] and [`ArcPolicy`].
//!
//! A policy orders the resident slots (dense ids `0..capacity`) and picks victims. It never
//! sees keys, only slot ids and, for ARC's ghost lists, a 64-bit fingerprint of the key.
//! Every operation is O(1) (amortised for [`EvictionPolicy::evict`], see below) and nothing
//! allocates after construction.
//!
//! # Evictable and non-evictable entries
//! The tier tells the policy when an entry becomes evictable (`ref_cnt` reaches 0) or stops
//! being evictable (pinned by a reader, or protected during a store). Such changes do **not**
//! move the entry: a non-evictable entry keeps its place in its recency list, so pinning for a
//! cascade (`prepare_read`) leaves recency untouched. When eviction walks the least recently
//! used end of a list and meets a non-evictable entry, it moves it to a side list ("set
//! aside") and continues; when that entry becomes evictable again it goes back to the least
//! recently used end of its list, which is where it was when it was set aside. Each set-aside
//! is paid for by the pin that caused it, so eviction is amortised O(1) per victim.

mod arc;
mod ghost;
pub(crate) mod list;
mod lru;

pub use arc::ArcPolicy;
pub use lru::LruPolicy;

use crate::config::model::EvictionPolicyKind;

/// How a new entry enters the policy, decided by [`EvictionPolicy::admit`] before eviction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// First sight (LRU, or an ARC miss outside the ghost lists): the recency list (T1).
    Recent,
    /// Seen recently enough to be in an ARC ghost list: the frequency list (T2).
    Frequent,
}

/// ARC's internal sizes, for metrics and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ArcStats {
    /// Resident entries seen once (T1), pinned ones included.
    pub t1: usize,
    /// Resident entries seen at least twice (T2), pinned ones included.
    pub t2: usize,
    /// Ghosts of entries evicted from T1 (B1).
    pub b1: usize,
    /// Ghosts of entries evicted from T2 (B2).
    pub b2: usize,
    /// Adaptive target size of T1 (`p`), `0..=capacity`.
    pub target_t1: usize,
}

/// A snapshot of a policy's sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PolicyStats {
    /// Entries the policy holds (resident slots).
    pub resident: usize,
    /// Entries that may be evicted now.
    pub evictable: usize,
    /// ARC's lists and target; `None` for LRU.
    pub arc: Option<ArcStats>,
}

/// An eviction policy over slot ids `0..capacity`.
///
/// Callers (the primary tier) guarantee: `insert` only for a slot not in the policy; every
/// other per-slot call only for a slot in the policy; `evict` only asks for entries marked
/// evictable. A new entry is not evictable until [`EvictionPolicy::mark_evictable`].
pub trait EvictionPolicy: Send + std::fmt::Debug {
    /// Short name (`"lru"`, `"arc"`).
    fn name(&self) -> &'static str;

    /// Number of slots the policy was built for.
    fn capacity(&self) -> usize;

    /// Called once for each key about to be inserted, before the store evicts. ARC looks the
    /// fingerprint up in its ghost lists, adapts its target and forgets the ghost. The answer
    /// is passed back to [`EvictionPolicy::insert`].
    fn admit(&mut self, _fingerprint: u64) -> Admission {
        Admission::Recent
    }

    /// Adds `slot` as the most recent entry of the list chosen by `admission` (not evictable).
    fn insert(&mut self, slot: u32, admission: Admission);

    /// Drops `slot` without recording it as evicted (failed store, reset).
    fn remove(&mut self, slot: u32);

    /// `slot` may now be evicted (its `ref_cnt` reached 0). Idempotent.
    fn mark_evictable(&mut self, slot: u32);

    /// `slot` may not be evicted until marked evictable again. Idempotent; keeps its place.
    fn mark_non_evictable(&mut self, slot: u32);

    /// A real access (reuse): LRU moves it to the most recent end; ARC counts it as frequency
    /// (T1 -> T2, or to the front of T2).
    fn touch(&mut self, slot: u32);

    /// Recency without frequency (committing a request's own insertion): the most recent end
    /// of the entry's current list.
    fn refresh(&mut self, slot: u32) {
        self.touch(slot);
    }

    /// Entries that may be evicted now.
    fn num_evictable(&self) -> usize;

    /// Evicts exactly `n` evictable entries that are not in `protected` and appends their
    /// slots to `victims`, or returns false and changes nothing when fewer than `n` such
    /// entries exist. `protected` lists distinct evictable slots (the keys of the store being
    /// prepared); they keep their exact places. `fingerprint(slot)` gives the key fingerprint
    /// of a victim (ARC remembers it as a ghost).
    fn evict(
        &mut self,
        n: usize,
        protected: &[u32],
        fingerprint: &mut dyn FnMut(u32) -> u64,
        victims: &mut Vec<u32>,
    ) -> bool;

    /// Prefetches `slot`'s bookkeeping before a batch of operations on it (a hint only).
    fn prefetch(&self, _slot: u32) {}

    /// Prefetches what [`EvictionPolicy::admit`] of `fingerprint` will read first (ARC: its
    /// ghost-index bucket), so that it overlaps other work (a hint only).
    fn prefetch_admit(&self, _fingerprint: u64) {}

    /// Prefetches the bookkeeping of the entry most likely to be evicted next and returns
    /// its slot, so that a store can overlap that memory latency with its own lookups. A
    /// hint only: it changes nothing, and the actual victim may differ.
    fn prefetch_next_victim(&self) -> Option<u32> {
        None
    }

    /// Whether evictions are remembered (ARC's ghosts), so that a store calls
    /// [`EvictionPolicy::prefetch_next_victim_history`].
    fn keeps_history(&self) -> bool {
        false
    }

    /// Second step of [`EvictionPolicy::prefetch_next_victim`], called a little later so
    /// that loads depending on the first step's find their data (a hint only).
    fn prefetch_next_victim_history(&self) {}

    /// Forgets history that outlives entries (ARC ghosts and target); resident entries stay.
    fn reset_history(&mut self) {}

    /// Sizes, for metrics and tests.
    fn stats(&self) -> PolicyStats;

    /// Heap bytes held by the policy (fixed at construction).
    fn heap_bytes(&self) -> usize;

    /// Checks internal invariants; O(n), for tests and diagnostics.
    fn check_consistency(&self) -> Result<(), String>;
}

/// Builds the policy named by the configuration for `capacity` slots.
pub fn build_policy(kind: EvictionPolicyKind, capacity: usize) -> Box<dyn EvictionPolicy> {
    match kind {
        EvictionPolicyKind::Lru => Box::new(LruPolicy::new(capacity)),
        EvictionPolicyKind::Arc => Box::new(ArcPolicy::new(capacity)),
    }
}
