//! GPU -> primary stores and the cascade to every secondary tier (contract doc §6.2, §7.4),
//! and GPU loads from the primary.

use std::collections::HashSet;
use std::sync::Arc;

use super::{ActiveJob, TieringManager};
use crate::contract::job::{LookupResult, RequestContext, TransferJob};
use crate::error::Result;
use crate::key::ChunkKey;
use crate::primary::PrepareStoreOutput;
use crate::tiering::backpressure::StoreDecision;

impl TieringManager {
    /// Reserves primary rows for a GPU -> primary store, after collecting finished jobs (which
    /// also counts as this step's poll). `None`: the primary cannot make room. Tiers that
    /// asked for `RequestLevel` get the request's chunks already in the primary at once;
    /// chunks whose primary write is still in flight are parked and retried at the end of
    /// the step.
    pub fn prepare_store(
        &mut self,
        keys: &[ChunkKey],
        req: &RequestContext,
    ) -> Option<PrepareStoreOutput> {
        self.polled_this_step = true;
        self.process_finished_jobs();
        let out = self.primary.prepare_store(keys, req)?;
        let Some(st) = self.requests.get_mut(&req.req_id) else {
            return Some(out);
        };
        if !out.keys_to_store.is_empty() {
            st.pending_primary_stores += 1;
        }
        if st.request_level.is_empty() {
            return Some(out);
        }
        let new: HashSet<&ChunkKey> = out.keys_to_store.iter().collect();
        let existing: Vec<ChunkKey> = keys.iter().filter(|k| !new.contains(k)).cloned().collect();
        if !existing.is_empty() {
            self.cascade_existing(&req.req_id, existing);
        }
        Some(out)
    }

    /// vLLM's `_cascade_existing_chunks_to_request_level_tiers`: ready keys go to every
    /// request-level tier of the request now, keys whose primary write is in flight are
    /// parked, absent keys are dropped.
    fn cascade_existing(&mut self, req_id: &Arc<str>, keys: Vec<ChunkKey>) {
        let mut ready = Vec::new();
        let mut parked = Vec::new();
        for k in keys {
            match self.primary.lookup(&k) {
                LookupResult::Hit => ready.push(k),
                LookupResult::HitPending => parked.push(k),
                _ => {}
            }
        }
        let Some(st) = self.requests.get_mut(req_id) else {
            return;
        };
        if !parked.is_empty() {
            st.pending_cascade_keys.extend(parked);
            self.parked_cascades.insert(st.arrival, req_id.clone());
        }
        if ready.is_empty() {
            return;
        }
        let tiers = st.request_level.clone();
        for t in tiers {
            self.create_store_job(t, &ready, req_id);
        }
    }

    /// The GPU -> primary copy finished. On success the chunks become readable and every
    /// secondary tier gets a store job (through its back-pressure gate), each pinning the
    /// rows until that tier reports; on failure the rows are freed.
    ///
    /// A store prepared before the last [`reset_cache`](TieringManager::reset_cache) (whose
    /// rows kvtier kept in flight, where vLLM drops them and never completes the store) only
    /// publishes or frees its rows: as in vLLM, no tier hears of it and the request's pending
    /// stores, zeroed by the reset, are not counted down again.
    pub fn complete_store(&mut self, keys: &[ChunkKey], req: &RequestContext, success: bool) {
        // A set lookup per key, and more only when this call completes a store from before
        // the reset.
        if !self.stale_stores.is_empty() && keys.iter().any(|k| self.stale_stores.contains(k)) {
            let (stale, fresh): (Vec<ChunkKey>, Vec<ChunkKey>) = keys
                .iter()
                .cloned()
                .partition(|k| self.stale_stores.contains(k));
            for k in &stale {
                self.stale_stores.remove(k);
            }
            self.primary.complete_store(&stale, success);
            if fresh.is_empty() {
                return;
            }
            return self.complete_store(&fresh, req, success);
        }
        self.primary.complete_store(keys, success);
        if success {
            let ready: Vec<ChunkKey> = keys
                .iter()
                .filter(|k| self.primary.lookup(k) == LookupResult::Hit)
                .cloned()
                .collect();
            for t in 0..self.tiers.len() {
                self.create_store_job(t, &ready, &req.req_id);
            }
        }
        if let Some(st) = self.requests.get_mut(&req.req_id) {
            st.pending_primary_stores = st.pending_primary_stores.saturating_sub(1);
        }
        self.maybe_finalize(&req.req_id);
    }

    /// Pins chunks for a primary -> GPU load.
    pub fn prepare_load(&mut self, keys: &[ChunkKey], req: &RequestContext) -> Result<Vec<u32>> {
        self.primary.prepare_load(keys, req)
    }

    /// Marks chunks as recently used in the primary (see `crate::primary::PrimaryTier::touch`)
    /// and tells every secondary tier (vLLM 0.33.0's scheduler never calls it).
    pub fn touch(&mut self, keys: &[ChunkKey], req: &RequestContext) {
        self.primary.touch(keys);
        for t in &mut self.tiers {
            t.tier.touch(keys, req);
        }
    }

    /// Unpins chunks after a primary -> GPU load.
    pub fn complete_load(&mut self, keys: &[ChunkKey]) -> Result<()> {
        self.primary.complete_load(keys)
    }

    /// A store job to tier `t` if its back-pressure gate admits it: pins the rows
    /// (`prepare_read`) and submits. A dropped store creates no job and pins nothing.
    pub(super) fn create_store_job(&mut self, t: usize, keys: &[ChunkKey], req_id: &Arc<str>) {
        if keys.is_empty() {
            return;
        }
        if let Some(d) = &mut self.tiers[t].detector
            && d.should_store(keys.len()) == StoreDecision::Drop
        {
            return;
        }
        let chunk_ids = match self.primary.prepare_read(keys) {
            Ok(ids) => ids,
            Err(e) => {
                let label = self.tiers[t].label.clone();
                self.contract_error(e.with("tier", label));
                return;
            }
        };
        let job_id = self.next_id();
        let now = self.clock.now();
        self.jobs.insert(
            job_id,
            ActiveJob {
                tier: t,
                keys: keys.to_vec(),
                is_promotion: false,
                submit_time: now,
                req_id: req_id.clone(),
            },
        );
        let slot = &mut self.tiers[t];
        slot.active_cascades += 1;
        slot.cascade_rows += keys.len();
        slot.tier.submit_store(TransferJob {
            job_id,
            keys: keys.to_vec(),
            chunk_ids,
            is_promotion: false,
            req_id: req_id.clone(),
            submit_time: now,
        });
    }

    /// Parked request-level cascades are retried in the order the requests arrived (ready
    /// keys submitted, keys still in flight parked again, vanished keys dropped), each
    /// request finalized right after its own retry.
    pub(super) fn flush_parked_cascades(&mut self) {
        let parked = std::mem::take(&mut self.parked_cascades);
        for (_, req_id) in parked {
            let Some(st) = self.requests.get_mut(&req_id) else {
                continue;
            };
            let keys = std::mem::take(&mut st.pending_cascade_keys);
            if !keys.is_empty() {
                self.cascade_existing(&req_id, keys);
            }
            self.maybe_finalize(&req_id);
        }
    }
}
