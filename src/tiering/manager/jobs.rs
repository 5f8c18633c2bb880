//! Processing of finished jobs (contract doc §3.5, §7.4, §9.2): every job must be reported
//! exactly once, by the tier that received it; a breach is a contract error (logged, counted,
//! returned by the next `poll` / `on_schedule_end`), never ignored and never a panic.

use std::collections::HashSet;

use super::{ActiveJob, TieringManager};
use crate::contract::job::JobResult;
use crate::error::{Error, ErrorKind};
use crate::key::ChunkKey;

impl TieringManager {
    /// Collects and processes every finished job of every tier.
    pub(super) fn process_finished_jobs(&mut self) {
        for t in 0..self.tiers.len() {
            let results = self.tiers[t].tier.get_finished_jobs();
            for r in results {
                self.process_result(t, r);
            }
        }
    }

    fn process_result(&mut self, t: usize, r: JobResult) {
        let owner = self.jobs.get(&r.job_id).map(|j| j.tier);
        match owner {
            None => {
                let e = Error::new(
                    ErrorKind::Contract,
                    format!(
                        "tier {} reported job {} which is unknown or already reported",
                        self.tiers[t].label, r.job_id
                    ),
                );
                self.contract_error(e);
                return;
            }
            Some(o) if o != t => {
                let e = Error::new(
                    ErrorKind::Contract,
                    format!(
                        "tier {} reported job {} which belongs to tier {}",
                        self.tiers[t].label, r.job_id, self.tiers[o].label
                    ),
                );
                self.contract_error(e);
                return;
            }
            Some(_) => {}
        }
        let Some(job) = self.jobs.remove(&r.job_id) else {
            return;
        };
        if job.is_promotion {
            self.complete_promotion(t, job, r);
        } else {
            self.complete_cascade(t, job, r);
        }
    }

    fn complete_promotion(&mut self, t: usize, job: ActiveJob, r: JobResult) {
        let latency = self.clock.now().saturating_duration_since(job.submit_time);
        let loaded = if r.success {
            self.primary.complete_write(&job.keys, true);
            job.keys.len()
        } else {
            let ok: HashSet<ChunkKey> = r
                .successful_keys
                .clone()
                .unwrap_or_default()
                .into_iter()
                .collect();
            let in_job: HashSet<&ChunkKey> = job.keys.iter().collect();
            if ok.iter().any(|k| !in_job.contains(k)) {
                let e = Error::new(
                    ErrorKind::Contract,
                    format!(
                        "tier {} reported successful_keys outside promotion job {}",
                        self.tiers[t].label, r.job_id
                    ),
                );
                self.contract_error(e);
            }
            let (good, bad): (Vec<ChunkKey>, Vec<ChunkKey>) =
                job.keys.iter().cloned().partition(|k| ok.contains(k));
            if !good.is_empty() {
                self.primary.complete_write(&good, true);
            }
            if !bad.is_empty() {
                // vLLM forgets a failed key's source when it is this tier's kind of source.
                let medium = self.tiers[t].tier.medium();
                if let Some(sources) = self.load_sources.get_mut(&job.req_id) {
                    for k in &bad {
                        if sources
                            .get(k)
                            .is_some_and(|&src| self.tiers[src].tier.medium() == medium)
                        {
                            sources.remove(k);
                        }
                    }
                }
                self.primary.complete_write(&bad, false);
            }
            log::warn!(
                "promotion job {} from tier {} failed for {} of {} key(s): {}",
                r.job_id,
                self.tiers[t].label,
                bad.len(),
                job.keys.len(),
                r.error
                    .as_ref()
                    .map_or_else(|| "no error given".to_string(), |e| e.to_string())
            );
            good.len()
        };
        let s = self.metrics.tiers[t];
        let reg = &mut self.metrics.registry;
        reg.inc(s.read_bytes, (loaded as u64 * self.row_stride) as f64);
        if !r.success {
            reg.inc(s.promotion_failures, 1.0);
        }
        let hist = if r.success {
            s.latency_success
        } else {
            s.latency_failure
        };
        reg.observe(hist, latency.as_secs_f64());
        // vLLM adds a failed promotion's time only when some of its keys did load.
        if let Some(tt) = r.transfer_time
            && (r.success || loaded > 0)
        {
            self.metrics.add_transfer_time(t, true, tt.as_secs_f64());
        }
        let slot = &mut self.tiers[t];
        slot.active_promotions = slot.active_promotions.saturating_sub(1);
        slot.promotion_rows = slot.promotion_rows.saturating_sub(job.keys.len());
    }

    fn complete_cascade(&mut self, t: usize, job: ActiveJob, r: JobResult) {
        if let Err(e) = self.primary.complete_read(&job.keys) {
            let label = self.tiers[t].label.clone();
            self.contract_error(e.with("tier", label));
        }
        let s = self.metrics.tiers[t];
        let bytes = job.keys.len() as u64 * self.row_stride;
        self.feed_detector(t, &job, &r, bytes);
        if r.success {
            self.metrics.registry.inc(s.write_bytes, bytes as f64);
            if let Some(tt) = r.transfer_time {
                self.metrics.add_transfer_time(t, false, tt.as_secs_f64());
            }
        } else {
            self.metrics.registry.inc(s.cascade_failures, 1.0);
            log::warn!(
                "store job {} to tier {} failed: {}",
                r.job_id,
                self.tiers[t].label,
                r.error
                    .as_ref()
                    .map_or_else(|| "no error given".to_string(), |e| e.to_string())
            );
        }
        let slot = &mut self.tiers[t];
        slot.active_cascades = slot.active_cascades.saturating_sub(1);
        slot.cascade_rows = slot.cascade_rows.saturating_sub(job.keys.len());
    }

    /// vLLM's `_update_backpressure`, call for call: the pressure state is refreshed (idle
    /// decay, which may clear pressure and start the cooldown) *before* the completion or
    /// failure is folded in, and again after; a change is logged (`row_bytes` stands in for a
    /// missing `transfer_bytes`).
    fn feed_detector(&mut self, t: usize, job: &ActiveJob, r: &JobResult, row_bytes: u64) {
        let slot = &mut self.tiers[t];
        let Some(d) = &mut slot.detector else {
            return;
        };
        let label = &slot.label;
        let was = d.is_under_pressure();
        if r.success {
            d.update(job.submit_time, r.transfer_bytes.unwrap_or(row_bytes));
        } else {
            d.on_store_failed();
        }
        if d.is_under_pressure() != was {
            let state = if d.is_under_pressure() {
                "activated"
            } else {
                "cleared"
            };
            log::info!(
                "Tier {label} back-pressure {state} (store_latency_ema {}, consecutive_store_failures {})",
                d.ema(),
                d.consecutive_failures()
            );
        }
    }
}
