//! Reserving and publishing rows: `prepare_store` / `complete_store` and their promotion
//! aliases `prepare_write` / `complete_write` (contract sections 5.2 and 6.1).

use std::collections::HashSet;

use crate::contract::job::RequestContext;
use crate::key::ChunkKey;

use super::PrimaryTier;
use super::table::IN_FLIGHT;

/// What `prepare_store` reserved.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PrepareStoreOutput {
    /// Keys that need writing, in the order offered (present keys and duplicates dropped).
    pub keys_to_store: Vec<ChunkKey>,
    /// Rows reserved for them (`ref_cnt == -1`), parallel to `keys_to_store`.
    pub chunk_ids: Vec<u32>,
    /// Keys evicted to make room.
    pub evicted_keys: Vec<ChunkKey>,
}

/// Above this many new keys, duplicates are found with a hash set instead of a scan.
const SMALL_BATCH: usize = 16;

impl PrimaryTier {
    /// Reserves rows for the keys of `keys` that are not resident (vLLM's
    /// `CPUOffloadingManager.prepare_store`).
    ///
    /// Keys already resident are not stored again: ready ones are recorded as reuse for
    /// `req`, in-flight ones are ignored. Before any refusal, the store misses are shown to
    /// the policy (once per request and key: ARC adapts to their ghosts) and the offered keys
    /// are recorded for `req`. When fewer slots than needed are free, ready entries are
    /// evicted (never pinned or in-flight ones, never the keys of this very store); if that
    /// cannot make enough room the store is refused with `None`. Otherwise the new keys get
    /// rows with `ref_cnt = -1` (lookups answer `HitPending`), evicted keys are reported (and
    /// produce one removal event), and an output is returned, empty when there is nothing to
    /// store.
    pub fn prepare_store(
        &mut self,
        keys: &[ChunkKey],
        req: &RequestContext,
    ) -> Option<PrepareStoreOutput> {
        // 1. Classify without changing anything.
        let mut new: Vec<(usize, u64)> = Vec::new();
        let mut seen: Option<HashSet<&[u8]>> = None;
        let mut reused: Vec<usize> = Vec::new();
        // Indices of the keys the request's record gets (ready resident keys and first
        // occurrences of new ones), in the order offered.
        let mut recorded: Vec<usize> = Vec::with_capacity(keys.len());
        let mut protected: Vec<u32> = Vec::new();
        let hashes = self.hash_batch(keys);
        for (i, (key, &hash)) in keys.iter().zip(&hashes).enumerate() {
            if let Some(f) = self.slots.find_hashed(hash, key.as_bytes()) {
                match self.slots.ref_at(f.pos) {
                    IN_FLIGHT => {}
                    0 => {
                        reused.push(i);
                        recorded.push(i);
                        protected.push(f.slot);
                    }
                    _ => {
                        reused.push(i);
                        recorded.push(i);
                    }
                }
                continue;
            }
            let dup = match &mut seen {
                Some(set) => !set.insert(key.as_bytes()),
                None => {
                    let dup = new.iter().any(|&(j, h)| h == hash && keys[j] == *key);
                    if !dup && new.len() >= SMALL_BATCH {
                        let mut set: HashSet<&[u8]> =
                            new.iter().map(|&(j, _)| keys[j].as_bytes()).collect();
                        set.insert(key.as_bytes());
                        seen = Some(set);
                    }
                    dup
                }
            };
            if !dup {
                new.push((i, hash));
                recorded.push(i);
            }
        }

        // 2. Store misses and the request's record, before any refusal (as vLLM).
        let access = self.requests.get(&req.req_id);
        access.record(
            recorded.iter().map(|&i| &keys[i]),
            reused.iter().map(|&i| &keys[i]),
        );
        for &(i, h) in new.iter().rev() {
            if access.first_store_miss(&keys[i]) {
                self.policy.on_store_miss(h);
            }
        }
        if new.is_empty() {
            return Some(PrepareStoreOutput::default());
        }

        // 3. Evict, atomically, or refuse.
        let to_evict = new.len().saturating_sub(self.slots.free());
        let mut victims = std::mem::take(&mut self.victims);
        victims.clear();
        if to_evict > 0 {
            let slots = &self.slots;
            let mut fingerprint = |id: u32| slots.hash_of(id);
            if !self
                .policy
                .evict(to_evict, &protected, &mut fingerprint, &mut victims)
            {
                self.counters.stores_refused += 1;
                self.victims = victims;
                return None;
            }
        }
        let mut evicted_keys = Vec::with_capacity(victims.len());
        for &id in &victims {
            if let Some(key) = self.slots.key_of(id) {
                evicted_keys.push(key);
                self.slots.remove(id);
            }
        }
        self.victims = victims;
        self.counters.evicted += evicted_keys.len() as u64;
        if self.events_enabled && !evicted_keys.is_empty() {
            self.push_event(evicted_keys.clone(), true, false);
        }

        // 4. Allocate and insert with ref_cnt = -1.
        let mut out = PrepareStoreOutput {
            keys_to_store: Vec::with_capacity(new.len()),
            chunk_ids: Vec::with_capacity(new.len()),
            evicted_keys,
        };
        for &(i, hash) in &new {
            let key = &keys[i];
            let Some(id) = self.slots.insert(hash, key) else {
                // Unreachable: the eviction made the room.
                log::error!("primary tier: no free slot for {key} after eviction; skipped");
                continue;
            };
            self.policy.insert(id, hash);
            self.in_flight += 1;
            out.keys_to_store.push(key.clone());
            out.chunk_ids.push(id);
        }
        self.requests
            .get(&req.req_id)
            .inserted(out.keys_to_store.iter());
        Some(out)
    }

    /// Publishes or releases rows reserved by `prepare_store`. Success: `ref_cnt` -1 -> 0
    /// (ready, evictable) and one stored event. Failure: the slot is removed and freed with
    /// one `metadata_only` removal event. Keys that are not in flight are skipped, logged and
    /// counted as contract violations (a duplicate or stray completion changes nothing).
    pub fn complete_store(&mut self, keys: &[ChunkKey], success: bool) {
        let mut done = Vec::new();
        let mut count = 0u64;
        let hashes = self.hash_batch(keys);
        for (key, &hash) in keys.iter().zip(&hashes) {
            let f = match self.slots.find_hashed(hash, key.as_bytes()) {
                Some(f) if self.slots.ref_at(f.pos) == IN_FLIGHT => f,
                found => {
                    self.counters.contract_violations += 1;
                    log::warn!(
                        "complete_store: chunk key {key} is {}; ignored",
                        if found.is_some() {
                            "not in flight"
                        } else {
                            "not resident"
                        }
                    );
                    continue;
                }
            };
            self.in_flight -= 1;
            count += 1;
            if success {
                self.slots.set_ref_at(f.pos, 0);
                self.policy.mark_evictable(f.slot);
            } else {
                self.policy.remove(f.slot);
                self.slots.remove(f.slot);
            }
            if self.events_enabled {
                done.push(key.clone());
            }
        }
        if success {
            self.counters.stored += count;
            self.push_event(done, false, false);
        } else {
            self.counters.store_failures += count;
            self.push_event(done, true, true);
        }
    }

    /// Reserves rows for a promotion (secondary tier -> primary): the same as
    /// [`PrimaryTier::prepare_store`].
    pub fn prepare_write(
        &mut self,
        keys: &[ChunkKey],
        req: &RequestContext,
    ) -> Option<PrepareStoreOutput> {
        self.prepare_store(keys, req)
    }

    /// Publishes (success) or releases (failure) promoted rows: the same as
    /// [`PrimaryTier::complete_store`].
    pub fn complete_write(&mut self, keys: &[ChunkKey], success: bool) {
        self.complete_store(keys, success);
    }
}
