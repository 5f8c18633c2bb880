//! Eviction policies of the primary tier, behind one trait: [`LruPolicy`] and [`ArcPolicy`],
//! with the semantics of vLLM 0.33.0's `cpu/policies/lru.py` and `cpu/policies/arc.py`.
//!
//! A policy orders the resident slots (dense ids `0..capacity`) and picks victims. It never
//! sees keys, only slot ids and, for ARC's ghost lists, a 64-bit fingerprint of the key.
//! Nothing allocates after construction.
//!
//! # Evictable and non-evictable entries
//! The tier tells the policy when an entry becomes evictable (`ref_cnt` reaches 0) or stops
//! being evictable (pinned by a reader, or a write in flight). Such changes do **not** move
//! the entry: a pinned entry keeps its place (ARC) or its rank (LRU), as in vLLM, whose LRU
//! heap keeps a pinned key's rank and whose ARC scan skips pinned keys in place. Eviction
//! therefore walks from the least recent end past non-evictable and protected entries: it
//! costs O(victims + entries passed over), where the entries passed over are those pinned
//! or in flight at the least recent end (in a serving engine these are few: pins are short
//! and belong to recently used chunks).

mod arc;
mod ghost;
pub(crate) mod list;
mod lru;
mod marks;

pub use arc::ArcPolicy;
pub use lru::LruPolicy;

use crate::config::model::EvictionPolicyKind;

/// How a finishing request met one of its keys (vLLM's `on_request_finished` arguments).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Commit {
    /// The request reused the key (loaded it, or offered it ready to a store): recency, and
    /// frequency under ARC (T1 -> T2).
    Reused,
    /// The request only inserted the key: recency inside its current list.
    InsertedOnly,
    /// Recorded for the request but neither reused nor inserted by it (a store candidate
    /// that another request inserted): recency under LRU, nothing under ARC.
    Seen,
}

/// ARC's internal sizes, for metrics and tests.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ArcStats {
    /// Resident entries seen once (T1), pinned ones included.
    pub t1: usize,
    /// Resident entries seen at least twice (T2), pinned ones included.
    pub t2: usize,
    /// Ghosts of entries evicted from T1 (B1), at most the capacity.
    pub b1: usize,
    /// Ghosts of entries evicted from T2 (B2), at most the capacity.
    pub b2: usize,
    /// Adaptive target size of T1 (`p`), `0..=capacity`, a float as in vLLM.
    pub target_t1: f64,
}

/// A snapshot of a policy's sizes.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
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

    /// A store is about to insert the key of `fingerprint` (once per request and key, before
    /// the store may be refused): ARC adapts its target when the key has a ghost, which stays
    /// until the insert.
    fn on_store_miss(&mut self, _fingerprint: u64) {}

    /// Adds `slot` (key `fingerprint`) as the most recent entry (ARC: of T1, and its ghost is
    /// forgotten); not evictable.
    fn insert(&mut self, slot: u32, fingerprint: u64);

    /// Drops `slot` without recording it as evicted (failed store, reset).
    fn remove(&mut self, slot: u32);

    /// `slot` may now be evicted (its `ref_cnt` reached 0). Idempotent; keeps its place.
    fn mark_evictable(&mut self, slot: u32);

    /// `slot` may not be evicted until marked evictable again. Idempotent; keeps its place.
    fn mark_non_evictable(&mut self, slot: u32);

    /// `touch` of a resident key (`ready`: not in flight): LRU moves it to the most recent
    /// end; ARC moves a ready T1 entry to T2, a T1 entry in flight to the front of T1, a T2
    /// entry to the front of T2.
    fn touch(&mut self, slot: u32, ready: bool);

    /// `touch` of a key that is not resident: ARC adapts its target if the key has a ghost.
    fn touch_absent(&mut self, _fingerprint: u64) {}

    /// A finishing request's commit of one key (see [`Commit`]).
    fn commit(&mut self, slot: u32, how: Commit);

    /// Entries that may be evicted now.
    fn num_evictable(&self) -> usize;

    /// Evicts exactly `n` evictable entries that are not in `protected` and appends their
    /// slots to `victims` in eviction order, or returns false and changes nothing when fewer
    /// than `n` such entries exist. `protected` lists evictable slots (the keys of the store
    /// being prepared). `fingerprint(slot)` gives the key fingerprint of a victim (ARC
    /// remembers it as a ghost).
    fn evict(
        &mut self,
        n: usize,
        protected: &[u32],
        fingerprint: &mut dyn FnMut(u32) -> u64,
        victims: &mut Vec<u32>,
    ) -> bool;

    /// Prefetches `slot`'s bookkeeping before a batch of operations on it (a hint only).
    fn prefetch(&self, _slot: u32) {}

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
