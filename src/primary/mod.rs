//! The CPU primary tier: slots over the primary region's rows, ref counts and eviction, with
//! the semantics of vLLM 0.33.0's `CPUPrimaryTierOffloadingManager` (contract section 5).
//!
//! Each row of the [`PrimaryRegion`] is a slot. A resident slot holds one [`ChunkKey`] and a
//! `ref_cnt`: -1 while its write is in flight (lookup answers `HitPending`, not evictable), 0
//! when ready (`Hit`, evictable), N > 0 while N readers hold it pinned (`Hit`, not evictable).
//! Which ready slot to evict is the [`EvictionPolicy`]'s choice (LRU or ARC).
//!
//! Every operation costs O(1) per key (eviction O(1) per victim plus the pinned or in-flight
//! entries it passes over at the least recent end; see [`policy`]), except
//! [`PrimaryTier::reset_cache`] and [`PrimaryTier::check_consistency`], which are
//! O(capacity). The semantics are vLLM 0.33.0's `CPUOffloadingManager` with its LRU and ARC
//! policies, proven by `tests/python/test_manager_vs_vllm.py`; `reset_cache` deviates on
//! purpose (docs/primary.md, "Deviations from vLLM 0.33.0"). One table entry holds a slot's key (inline up to 36 bytes), its
//! `ref_cnt` and its slot id, so a lookup costs one random memory access; nothing allocates
//! per resident chunk (keys longer than 36 bytes aside), so memory is fixed by the capacity
//! (see [`PrimaryTier::memory_footprint`]). The large arrays ask for transparent huge pages.
//!
//! Keys are opaque byte strings. Calls that would unbalance a ref count (`complete_load` on an
//! unpinned key, `prepare_load` on a missing or in-flight key...) return
//! [`ErrorKind::Contract`] and change nothing; they never panic.

mod index;
mod huge_arrays;
mod pins;
test_visible! {
    mod policy;
}
mod requests;
mod store;
mod table;

use std::sync::Arc;

use crate::config::model::EvictionPolicyKind;
use crate::contract::job::{LookupResult, Medium, OffloadingEvent, RequestContext};
use crate::error::{Error, ErrorKind, Result};
use crate::key::ChunkKey;
use crate::region::PrimaryRegion;

use index::KeyHasher;
use policy::{EvictionPolicy, PolicyStats, build_policy};
use requests::RequestLog;
use table::{Found, IN_FLIGHT, SlotTable};

pub use store::PrepareStoreOutput;

/// Occupancy of the primary tier, in slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrimaryUsage {
    /// Number of slots (rows).
    pub total: usize,
    /// Resident slots (ready, pinned or in flight).
    pub used: usize,
    /// Slots pinned by readers (`ref_cnt > 0`).
    pub pinned_for_read: usize,
    /// Slots reserved for a write in flight (`ref_cnt == -1`).
    pub reserved_for_write: usize,
    /// Ready, unpinned slots (`ref_cnt == 0`): what eviction may take.
    pub evictable: usize,
}

impl PrimaryUsage {
    /// vLLM's `kv_offload_cpu_cache_usage_perc`, `..._write_usage_perc` and
    /// `..._read_usage_perc`: slots in use (pinned or being written, not every resident
    /// slot), slots being written, and the difference, each over the total (computed as
    /// vLLM computes them, so the floats are equal).
    pub fn usage_fractions(&self) -> (f64, f64, f64) {
        if self.total == 0 {
            return (0.0, 0.0, 0.0);
        }
        let total = self.total as f64;
        let usage = (self.used - self.evictable) as f64 / total;
        let write = self.reserved_for_write as f64 / total;
        (usage, write, f64::max(usage - write, 0.0))
    }
}

/// Running totals since construction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrimaryCounters {
    /// Stores refused because too few slots could be evicted (`prepare_store` -> `None`).
    pub stores_refused: u64,
    /// Keys evicted to make room.
    pub evicted: u64,
    /// Keys published by a successful `complete_store`.
    pub stored: u64,
    /// Keys released by a failed `complete_store`.
    pub store_failures: u64,
    /// Keys dropped by `reset_cache`.
    pub reset_dropped: u64,
    /// Calls (or keys) that broke the protocol and were ignored or refused.
    pub contract_violations: u64,
}

/// Heap bytes of the tier's fixed structures (request records and keys longer than 36 bytes
/// excluded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryFootprint {
    /// Number of slots.
    pub slots: usize,
    /// Slot table: 48-byte entries (key inline up to 36 bytes, `ref_cnt`, slot) at load
    /// <= 0.8, plus the high 32 bits of each slot's key hash (to find a slot's entry).
    pub slot_table_bytes: usize,
    /// Eviction policy (links, state, ARC ghosts).
    pub policy_bytes: usize,
}

impl MemoryFootprint {
    /// Sum of the parts.
    pub fn total_bytes(&self) -> usize {
        self.slot_table_bytes + self.policy_bytes
    }

    /// Bytes per slot. Keys of up to 36 bytes are stored inside the slot, so this is the
    /// whole cost of a resident chunk with such a key; a longer key shares the caller's
    /// allocation, which comes on top.
    pub fn bytes_per_chunk(&self) -> f64 {
        self.total_bytes() as f64 / self.slots.max(1) as f64
    }
}

/// The CPU primary tier manager. `Send`; one owner (the tiering manager) drives it.
#[derive(Debug)]
pub struct PrimaryTier {
    region: Arc<PrimaryRegion>,
    slots: SlotTable,
    policy: Box<dyn EvictionPolicy>,
    events_enabled: bool,
    events: Vec<OffloadingEvent>,
    requests: RequestLog,
    pinned: usize,
    in_flight: usize,
    counters: PrimaryCounters,
    victims: Vec<u32>,
}

/// The largest number of slots a tier manages (slot ids are `u32`, `u32::MAX` is reserved).
pub const MAX_CHUNKS: usize = u32::MAX as usize - 1;

fn contract_error(op: &str, key: &ChunkKey, what: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Contract, format!("{op}: chunk key {key} {what}"))
        .with("key", key.to_hex())
}

impl PrimaryTier {
    /// A tier over every row of `region` (`num_chunks = region.num_rows()`, at most
    /// [`MAX_CHUNKS`]; rows beyond that are left unused with a warning) with the named
    /// policy. `enable_events` turns on stored/removed events ([`PrimaryTier::take_events`]).
    pub fn new(
        region: Arc<PrimaryRegion>,
        policy: EvictionPolicyKind,
        enable_events: bool,
    ) -> Self {
        let n = Self::capacity_for(&region);
        Self::build(region, build_policy(policy, n), enable_events)
    }

    /// A tier with a caller-supplied policy, which must have been built for
    /// `min(region.num_rows(), MAX_CHUNKS)` slots.
    pub fn with_policy(
        region: Arc<PrimaryRegion>,
        policy: Box<dyn EvictionPolicy>,
        enable_events: bool,
    ) -> Result<Self> {
        let n = Self::capacity_for(&region);
        if policy.capacity() != n {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "eviction policy {} was built for {} slots but the region has {n} rows",
                    policy.name(),
                    policy.capacity()
                ),
            )
            .with("expected", n.to_string())
            .with("found", policy.capacity().to_string()));
        }
        Ok(Self::build(region, policy, enable_events))
    }

    fn capacity_for(region: &PrimaryRegion) -> usize {
        let rows = region.num_rows();
        if rows > MAX_CHUNKS {
            log::warn!(
                "primary region has {rows} rows; the primary tier manages only the first {MAX_CHUNKS}"
            );
        }
        rows.min(MAX_CHUNKS)
    }

    fn build(region: Arc<PrimaryRegion>, policy: Box<dyn EvictionPolicy>, events: bool) -> Self {
        let n = policy.capacity();
        PrimaryTier {
            region,
            slots: SlotTable::new(n, KeyHasher::random()),
            policy,
            events_enabled: events,
            events: Vec::new(),
            requests: RequestLog::default(),
            pinned: 0,
            in_flight: 0,
            counters: PrimaryCounters::default(),
            victims: Vec::new(),
        }
    }

    /// Number of slots (rows).
    pub fn num_chunks(&self) -> usize {
        self.slots.capacity()
    }

    /// The region whose rows the slots name.
    pub fn region(&self) -> &Arc<PrimaryRegion> {
        &self.region
    }

    /// The policy's name (`"lru"`, `"arc"`).
    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    #[inline]
    fn hash(&self, key: &ChunkKey) -> u64 {
        self.slots.hash(key.as_bytes())
    }

    #[inline]
    fn find(&self, key: &ChunkKey) -> Option<Found> {
        self.slots.find(key.as_bytes())
    }

    /// The hashes of `keys`; for a batch, their first table entries are prefetched as well,
    /// so the searches that follow overlap their memory latency.
    fn hash_batch(&self, keys: &[ChunkKey]) -> Vec<u64> {
        let prefetch = keys.len() > 1;
        keys.iter()
            .map(|k| {
                let h = self.hash(k);
                if prefetch {
                    self.slots.warm(h);
                }
                h
            })
            .collect()
    }

    /// `Miss`, `Hit` (ready or pinned) or `HitPending` (write in flight).
    pub fn lookup(&self, key: &ChunkKey) -> LookupResult {
        match self.find(key) {
            None => LookupResult::Miss,
            Some(f) if self.slots.ref_at(f.pos) == IN_FLIGHT => LookupResult::HitPending,
            Some(_) => LookupResult::Hit,
        }
    }

    /// [`PrimaryTier::lookup`] for each of `keys`, appended to `out` in order. Faster per key
    /// than one `lookup` per key: the memory accesses of up to 16 keys overlap.
    pub fn lookup_many(&self, keys: &[ChunkKey], out: &mut Vec<LookupResult>) {
        const WINDOW: usize = 16;
        let mut hashes = [0u64; WINDOW];
        out.reserve(keys.len());
        for chunk in keys.chunks(WINDOW) {
            for (h, k) in hashes.iter_mut().zip(chunk) {
                *h = self.hash(k);
                self.slots.warm(*h);
            }
            for (&h, k) in hashes.iter().zip(chunk) {
                out.push(match self.slots.find_hashed(h, k.as_bytes()) {
                    None => LookupResult::Miss,
                    Some(f) if self.slots.ref_at(f.pos) == IN_FLIGHT => LookupResult::HitPending,
                    Some(_) => LookupResult::Hit,
                });
            }
        }
    }

    /// The slot (row) holding `key`, in any state.
    pub fn chunk_id(&self, key: &ChunkKey) -> Option<u32> {
        self.find(key).map(|f| f.slot)
    }

    /// `key`'s `ref_cnt` (-1 in flight, 0 ready, N pinned), if resident.
    pub fn ref_count(&self, key: &ChunkKey) -> Option<i32> {
        self.find(key).map(|f| self.slots.ref_at(f.pos))
    }

    fn push_event(&mut self, keys: Vec<ChunkKey>, removed: bool, metadata_only: bool) {
        if !self.events_enabled || keys.is_empty() {
            return;
        }
        self.events.push(OffloadingEvent {
            keys,
            medium: Medium::Cpu,
            removed,
            locality: None,
            ownership: None,
            removal_expected: false,
            metadata_only,
        });
    }

    /// Marks `keys` as recently used right away (vLLM's policy `touch`, applied tail before
    /// head, so `keys[0]` ends up most recent): LRU moves them to the most recent end; ARC
    /// moves ready T1 entries to T2 (an entry in flight stays in T1), T2 entries to T2's
    /// front, and adapts its target for keys with a ghost.
    pub fn touch(&mut self, keys: &[ChunkKey]) {
        for key in keys.iter().rev() {
            let hash = self.hash(key);
            match self.slots.find_hashed(hash, key.as_bytes()) {
                Some(f) => {
                    let ready = self.slots.ref_at(f.pos) != IN_FLIGHT;
                    self.policy.touch(f.slot, ready);
                }
                None => self.policy.touch_absent(hash),
            }
        }
    }

    /// Commits what `req` recorded (vLLM's `on_request_finished`): every key it met, tail
    /// before head (groups by index), as reuse (its loads, and the ready keys its stores
    /// offered; also when it inserted the key again later), as its own insertion, or as
    /// merely seen; then forgets the record. Keys no longer resident are skipped.
    pub fn on_request_finished(&mut self, req: &RequestContext) {
        let plan = self.requests.take_commit_plan(&req.req_id);
        if plan.is_empty() {
            return;
        }
        // Three passes so that the memory accesses of the whole batch overlap: hash and
        // prefetch the table entries, find the slots and prefetch their policy nodes, apply.
        let hashes: Vec<u64> = plan
            .iter()
            .map(|(k, _)| {
                let h = self.hash(k);
                self.slots.warm(h);
                h
            })
            .collect();
        let slots: Vec<Option<u32>> = plan
            .iter()
            .zip(&hashes)
            .map(|((k, _), &h)| {
                let slot = self.slots.find_hashed(h, k.as_bytes()).map(|f| f.slot);
                if let Some(s) = slot {
                    self.policy.prefetch(s);
                }
                slot
            })
            .collect();
        for ((_, commit), slot) in plan.iter().zip(slots) {
            if let Some(s) = slot {
                self.policy.commit(s, *commit);
            }
        }
    }

    /// Requests with recorded accesses not yet committed by `on_request_finished`.
    pub fn open_requests(&self) -> usize {
        self.requests.open_requests()
    }

    /// Events since the last call (medium CPU, no ownership, no locality); empty unless
    /// events were enabled. A `metadata_only` removal (failed write) lists only the keys that
    /// are not resident again by now, and is dropped when none is left (as vLLM).
    pub fn take_events(&mut self) -> Vec<OffloadingEvent> {
        let mut events = std::mem::take(&mut self.events);
        events.retain_mut(|e| {
            if e.metadata_only {
                e.keys.retain(|k| self.slots.find(k.as_bytes()).is_none());
            }
            !e.keys.is_empty()
        });
        events
    }

    /// Occupancy now.
    pub fn usage(&self) -> PrimaryUsage {
        PrimaryUsage {
            total: self.slots.capacity(),
            used: self.slots.resident(),
            pinned_for_read: self.pinned,
            reserved_for_write: self.in_flight,
            evictable: self.policy.num_evictable(),
        }
    }

    /// Running totals.
    pub fn counters(&self) -> PrimaryCounters {
        self.counters
    }

    /// The policy's sizes (ARC lists and target included).
    pub fn policy_stats(&self) -> PolicyStats {
        self.policy.stats()
    }

    /// Heap bytes of the fixed structures.
    pub fn memory_footprint(&self) -> MemoryFootprint {
        MemoryFootprint {
            slots: self.slots.capacity(),
            slot_table_bytes: self.slots.heap_bytes(),
            policy_bytes: self.policy.heap_bytes(),
        }
    }

    /// Keys whose write is in flight (`ref_cnt == -1`: a `prepare_store` or `prepare_write`
    /// not yet completed), in slot order. O(capacity).
    pub fn writes_in_flight(&self) -> Vec<ChunkKey> {
        let mut slots: Vec<u32> = self
            .slots
            .iter_resident()
            .filter(|(_, r, _)| *r == IN_FLIGHT)
            .map(|(slot, _, _)| slot)
            .collect();
        slots.sort_unstable();
        slots
            .into_iter()
            .filter_map(|s| self.slots.key_of(s))
            .collect()
    }

    /// Drops every ready, unpinned entry (`ref_cnt == 0`) and returns how many. Pinned
    /// entries (`ref_cnt > 0`) and writes in flight (`ref_cnt == -1`) stay, with their slots,
    /// so outstanding `complete_load` / `complete_read` / `complete_store` calls still
    /// balance. Dropped keys produce one removal event (not `metadata_only`: they were
    /// published), in slot order. The policy's history (ARC ghosts and target) is cleared; request records
    /// stay and skip keys that are gone. O(capacity).
    pub fn reset_cache(&mut self) -> usize {
        let mut ready: Vec<u32> = self
            .slots
            .iter_resident()
            .filter(|(_, r, _)| *r == 0)
            .map(|(slot, _, _)| slot)
            .collect();
        ready.sort_unstable();
        let mut dropped = Vec::new();
        let mut n = 0;
        for id in ready {
            if self.events_enabled {
                dropped.extend(self.slots.key_of(id));
            }
            self.policy.remove(id);
            n += usize::from(self.slots.remove(id));
        }
        self.policy.reset_history();
        self.counters.reset_dropped += n as u64;
        self.push_event(dropped, true, false);
        n
    }

    /// Checks every internal invariant (index, slots, counters, policy). O(capacity); for
    /// tests and diagnostics. The error names the first broken invariant.
    pub fn check_consistency(&self) -> Result<()> {
        let fail = |msg: String| Err(Error::new(ErrorKind::Internal, msg));
        if let Err(e) = self.slots.check() {
            return fail(e);
        }
        if let Err(e) = self.policy.check_consistency() {
            return fail(e);
        }
        let (mut pinned, mut in_flight, mut ready, mut resident) = (0, 0, 0, 0);
        for (slot, r, _) in self.slots.iter_resident() {
            resident += 1;
            match r {
                IN_FLIGHT => in_flight += 1,
                0 => ready += 1,
                r if r > 0 => pinned += 1,
                r => return fail(format!("slot {slot} has ref_cnt {r}")),
            }
        }
        let stats = self.policy.stats();
        let checks = [
            ("resident counter", self.slots.resident(), resident),
            ("pinned counter", self.pinned, pinned),
            ("in-flight counter", self.in_flight, in_flight),
            ("policy entries", stats.resident, resident),
            ("policy evictable", stats.evictable, ready),
        ];
        for (what, have, want) in checks {
            if have != want {
                return fail(format!("{what} is {have} but {want} slots qualify"));
            }
        }
        Ok(())
    }
}
