//! GPU -> primary stores and the cascade to every secondary tier (contract doc §6.2, §7.4),
//! and GPU loads from the primary.

use std::collections::HashSet;
use std::sync::Arc;

use super::{ActiveJob, TieringManager};
use crate::contract::job::{LookupResult, OffloadPolicy, RequestContext, TransferJob};
use crate::error::Result;
use crate::key::ChunkKey;
use crate::primary::PrepareStoreOutput;
use crate::tiering::backpressure::StoreDecision;

impl TieringManager {
    /// Reserves primary rows for a GPU -> primary store (after processing finished jobs).
    /// `None`: the primary cannot make room; nothing changed. Tiers that asked for
    /// `RequestLevel` get the request's chunks already in the primary at once; chunks whose
    /// primary write is still in flight are parked and retried at the end of the step.
    pub fn prepare_store(
        &mut self,
        keys: &[ChunkKey],
        req: &RequestContext,
    ) -> Option<PrepareStoreOutput> {
        self.process_finished_jobs();
        let out = self.primary.prepare_store(keys, req)?;
        self.note_evicted(&out.evicted_keys);
        let Some(st) = self.requests.get_mut(&req.req_id) else {
            return Some(out);
        };
        st.pending_primary_stores += out.keys_to_store.len();
        let request_level: Vec<usize> = st
            .policies
            .iter()
            .enumerate()
            .filter(|(_, p)| **p == OffloadPolicy::RequestLevel)
            .map(|(i, _)| i)
            .collect();
        if request_level.is_empty() {
            return Some(out);
        }
        let new: HashSet<&ChunkKey> = out.keys_to_store.iter().collect();
        let mut ready = Vec::new();
        let mut parked = Vec::new();
        for k in keys.iter().filter(|k| !new.contains(k)) {
            match self.primary.lookup(k) {
                LookupResult::Hit => ready.push(k.clone()),
                LookupResult::HitPending => parked.push(k.clone()),
                _ => {}
            }
        }
        for t in request_level {
            self.create_store_job(t, &ready, &req.req_id);
        }
        if !parked.is_empty() {
            self.parked_cascades
                .entry(req.req_id.clone())
                .or_default()
                .extend(parked);
        }
        Some(out)
    }

    /// The GPU -> primary copy finished. On success the chunks become readable and every
    /// secondary tier gets a store job (through its back-pressure gate), each pinning the
    /// rows until that tier reports; on failure the rows are freed.
    pub fn complete_store(&mut self, keys: &[ChunkKey], req: &RequestContext, success: bool) {
        self.primary.complete_store(keys, success);
        if let Some(st) = self.requests.get_mut(&req.req_id) {
            st.pending_primary_stores = st.pending_primary_stores.saturating_sub(keys.len());
        }
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
        self.maybe_finalize(&req.req_id);
    }

    /// Pins chunks for a primary -> GPU load.
    pub fn prepare_load(&mut self, keys: &[ChunkKey], req: &RequestContext) -> Result<Vec<u32>> {
        self.primary.prepare_load(keys, req)
    }

    /// Records an access to resident chunks (primary recency only; vLLM 0.33.0's scheduler
    /// never calls it).
    pub fn touch(&mut self, keys: &[ChunkKey]) {
        self.primary.touch(keys);
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

    /// Parked REQUEST_LEVEL cascades whose primary write has completed are submitted; those
    /// still in flight stay parked; those that vanished (failed write) are dropped.
    pub(super) fn flush_parked_cascades(&mut self) {
        let parked = std::mem::take(&mut self.parked_cascades);
        let mut touched = Vec::new();
        for (req_id, keys) in parked {
            let mut ready = Vec::new();
            let mut still = Vec::new();
            for k in keys {
                match self.primary.lookup(&k) {
                    LookupResult::Hit => ready.push(k),
                    LookupResult::HitPending => still.push(k),
                    _ => {}
                }
            }
            let tiers: Vec<usize> = self
                .requests
                .get(&req_id)
                .map(|st| {
                    st.policies
                        .iter()
                        .enumerate()
                        .filter(|(_, p)| **p == OffloadPolicy::RequestLevel)
                        .map(|(i, _)| i)
                        .collect()
                })
                .unwrap_or_default();
            for t in tiers {
                self.create_store_job(t, &ready, &req_id);
            }
            if !still.is_empty() {
                self.parked_cascades.insert(req_id.clone(), still);
            }
            touched.push(req_id);
        }
        for id in touched {
            self.maybe_finalize(&id);
        }
    }
}
