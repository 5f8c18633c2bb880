//! Lookup and promotion (contract doc §3.4, §6.1).

use super::{ActiveJob, TieringManager};
use crate::contract::job::{LookupResult, RequestContext, TransferJob};
use crate::error::{Error, ErrorKind};
use crate::key::ChunkKey;

impl TieringManager {
    /// Looks a chunk up: primary `Hit`/`HitPending` wins; while promotions are held after a
    /// reset the answer is `Miss`; otherwise the secondary tiers allowed by the request's
    /// filter are asked in order, and the first `Hit` starts a promotion (`HitPending`, or
    /// `Miss` if the primary cannot allocate a row). Any `Retry` gives `Retry`; else `Miss`.
    pub fn lookup(&mut self, key: &ChunkKey, req: &RequestContext) -> LookupResult {
        self.maybe_process_finished_jobs();
        let t0 = self.clock.now();
        match self.primary.lookup(key) {
            LookupResult::Hit => {
                self.record_lookup(0, key, req, true, t0);
                return LookupResult::Hit;
            }
            LookupResult::HitPending => return LookupResult::HitPending,
            _ => self.record_lookup(0, key, req, false, t0),
        }
        if self.promotions_held {
            return LookupResult::Miss;
        }
        let mut retry = false;
        for i in 0..self.tiers.len() {
            let tier = &mut self.tiers[i].tier;
            if !req.load_tier_filter.allows(tier.medium(), tier.locality()) {
                continue;
            }
            let t0 = self.clock.now();
            match tier.lookup(key, req) {
                LookupResult::Hit => {
                    self.record_lookup(i + 1, key, req, true, t0);
                    return self.initiate_promotion(i, key, req);
                }
                LookupResult::Miss => self.record_lookup(i + 1, key, req, false, t0),
                LookupResult::Retry => {
                    self.note_retry(i + 1, key, req);
                    retry = true;
                }
                LookupResult::HitPending => {
                    let e = Error::new(
                        ErrorKind::Contract,
                        format!(
                            "secondary tier {} answered HitPending for key {key}",
                            self.tiers[i].label
                        ),
                    );
                    self.contract_error(e);
                    retry = true;
                }
            }
        }
        if retry {
            LookupResult::Retry
        } else {
            LookupResult::Miss
        }
    }

    fn record_lookup(
        &mut self,
        idx: usize,
        key: &ChunkKey,
        req: &RequestContext,
        hit: bool,
        t0: std::time::Instant,
    ) {
        let Some(track) = self
            .requests
            .get_mut(&req.req_id)
            .and_then(|st| st.tracking.as_mut())
        else {
            return;
        };
        // One hash for the common case: a key already resolved is not inserted again.
        if !track.resolved.insert((idx, key.clone())) {
            return;
        }
        let now = self.clock.now();
        let first_retry = if track.first_retry.is_empty() {
            None
        } else {
            track.first_retry.remove(&(idx, key.clone()))
        };
        let s = self.metrics.lookup[idx];
        let r = &mut self.metrics.registry;
        r.inc(s.queries, 1.0);
        if hit {
            r.inc(s.hits, 1.0);
        }
        r.observe(
            s.sync_delay,
            now.saturating_duration_since(t0).as_secs_f64(),
        );
        if let Some(first) = first_retry {
            r.observe(
                s.async_delay,
                now.saturating_duration_since(first).as_secs_f64(),
            );
        }
    }

    fn note_retry(&mut self, idx: usize, key: &ChunkKey, req: &RequestContext) {
        let now = self.clock.now();
        if let Some(track) = self
            .requests
            .get_mut(&req.req_id)
            .and_then(|st| st.tracking.as_mut())
        {
            track.first_retry.entry((idx, key.clone())).or_insert(now);
        }
    }

    fn initiate_promotion(
        &mut self,
        tier: usize,
        key: &ChunkKey,
        req: &RequestContext,
    ) -> LookupResult {
        let Some(out) = self.primary.prepare_write(std::slice::from_ref(key), req) else {
            let s = self.metrics.promotion_allocation_failures;
            self.metrics.registry.inc(s, 1.0);
            return LookupResult::Miss;
        };
        if out.keys_to_store.is_empty() {
            // Present after all (cannot happen after a primary miss): answer what it is.
            return self.primary.lookup(key);
        }
        let sources = self.load_sources.entry(req.req_id.clone()).or_default();
        for k in &out.keys_to_store {
            sources.insert(k.clone(), tier);
        }
        let entry = self.pending_promotions.entry(tier, &req.req_id);
        entry.keys.extend(out.keys_to_store);
        entry.chunk_ids.extend(out.chunk_ids);
        LookupResult::HitPending
    }

    /// One load job per (tier, request) with every key promoted this step, in the order
    /// each (tier, request) first promoted.
    pub(super) fn flush_pending_promotions(&mut self) {
        let now = self.clock.now();
        for (tier, list) in self.pending_promotions.take() {
            for p in list {
                let job_id = self.next_id();
                let n = p.keys.len();
                self.jobs.insert(
                    job_id,
                    ActiveJob {
                        tier,
                        keys: p.keys.clone(),
                        is_promotion: true,
                        submit_time: now,
                        req_id: p.req_id.clone(),
                    },
                );
                let slot = &mut self.tiers[tier];
                slot.active_promotions += 1;
                slot.promotion_rows += n;
                slot.tier.submit_load(TransferJob {
                    job_id,
                    keys: p.keys,
                    chunk_ids: p.chunk_ids,
                    is_promotion: true,
                    req_id: p.req_id,
                    submit_time: now,
                });
            }
        }
    }
}
