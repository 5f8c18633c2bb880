//! The G3 tier's admission gate (config key `admission`): which keys of a store job the tier
//! writes, decided on the scheduler's thread before the job is queued, by the policy of
//! [`crate::contract::admission`] against the entries the tier would evict for them.
//!
//! A rejected key is dropped from the job like a key the tier already holds: the job still
//! succeeds, and its `transfer_bytes` count only what was written (vLLM's manager then feeds
//! its back-pressure detector only the bytes that moved, and releases the pins of every key of
//! the job as it does for any finished store).
//!
//! A job's keys are one request's blocks in prefix order, and a lookup stops at the first
//! miss, so a key is reachable only while every key before it is held. The gate therefore
//! keeps the job's admitted keys a prefix: every key before the last admitted one is admitted
//! too (a key the policy rejected there would otherwise end the reusable prefix and strand
//! the admitted keys after it).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::contract::admission::AdmissionPolicy;
use crate::contract::job::{JobId, TransferJob};
use crate::contract::secondary::{TierMetric, TierMetricKind};
use crate::g3::index::Index;
use crate::hash::FastMap;
use crate::key::ChunkKey;

/// Admission counters of one tier (`g3_admission_blocks`, `g3_admission_bytes`, label
/// `outcome` = `admitted` | `rejected` | `unchecked`).
#[derive(Debug, Default)]
pub struct AdmissionCounters {
    /// Keys admitted (written, or queued to be).
    pub admitted_blocks: AtomicU64,
    /// Keys rejected (not written).
    pub rejected_blocks: AtomicU64,
    /// Slot bytes of the admitted keys.
    pub admitted_bytes: AtomicU64,
    /// Slot bytes of the rejected keys.
    pub rejected_bytes: AtomicU64,
    /// Keys admitted without a decision: the index could not be read (recovering, or busy
    /// with a checkpoint snapshot for longer than a lookup waits).
    pub unchecked_blocks: AtomicU64,
    /// Slot bytes of the keys admitted without a decision.
    pub unchecked_bytes: AtomicU64,
}

impl AdmissionCounters {
    /// The samples (present whatever the policy, so dashboards see zeros with `all`).
    pub fn sample(&self) -> Vec<TierMetric> {
        let mut out = Vec::with_capacity(6);
        let series = [
            (
                "g3_admission_blocks",
                "Store keys the admission policy admitted or rejected (unchecked: admitted \
                 without a decision, the index busy)",
                [
                    &self.admitted_blocks,
                    &self.rejected_blocks,
                    &self.unchecked_blocks,
                ],
            ),
            (
                "g3_admission_bytes",
                "Slot bytes of the store keys the admission policy admitted or rejected \
                 (unchecked: admitted without a decision, the index busy)",
                [
                    &self.admitted_bytes,
                    &self.rejected_bytes,
                    &self.unchecked_bytes,
                ],
            ),
        ];
        for (name, help, [admitted, rejected, unchecked]) in series {
            for (outcome, v) in [
                ("admitted", admitted),
                ("rejected", rejected),
                ("unchecked", unchecked),
            ] {
                let mut m = TierMetric::new(
                    name,
                    help,
                    TierMetricKind::Counter,
                    v.load(Ordering::Relaxed) as f64,
                );
                m.labels.push(("outcome", outcome.to_string()));
                out.push(m);
            }
        }
        out
    }
}

/// The policy, and the admitted keys of each store job until it is reported.
#[derive(Debug)]
pub struct AdmissionGate {
    policy: Box<dyn AdmissionPolicy>,
    pending: FastMap<JobId, Vec<ChunkKey>>,
    /// Whether the first store admitted without a decision was logged.
    warned_unchecked: bool,
}

impl AdmissionGate {
    /// A gate asking `policy`.
    pub fn new(policy: Box<dyn AdmissionPolicy>) -> Self {
        AdmissionGate {
            policy,
            pending: FastMap::default(),
            warned_unchecked: false,
        }
    }

    /// A lookup asked for `key`.
    pub fn on_lookup(&mut self, key: &ChunkKey) {
        self.policy.record_access(key);
    }

    /// Drops the keys of `job` the policy rejects (and their rows), counting both outcomes in
    /// `counters` at `slot_bytes` each. Keys the index already holds pass untouched (the
    /// worker skips them) and count as neither. `index`: `None` when it could not be read now
    /// (recovering, or busy with a checkpoint snapshot); then every key is admitted without a
    /// decision (counted `unchecked`, logged once).
    pub fn filter(
        &mut self,
        mut job: TransferJob,
        index: Option<&Index>,
        counters: &AdmissionCounters,
        slot_bytes: u64,
    ) -> TransferJob {
        if job.keys.len() != job.chunk_ids.len() || job.keys.is_empty() {
            // The ledger reports these itself.
            return job;
        }
        let Some(ix) = index else {
            if !self.warned_unchecked {
                self.warned_unchecked = true;
                log::warn!(
                    "G3 admission: store job {} admitted without a decision (the index is \
                     recovering or busy with a checkpoint); counted in \
                     g3_admission_blocks{{outcome=\"unchecked\"}}, logged once",
                    job.job_id
                );
            }
            for key in &job.keys {
                self.policy.record_access(key);
            }
            let k = job.keys.len() as u64;
            counters.unchecked_blocks.fetch_add(k, Ordering::Relaxed);
            counters
                .unchecked_bytes
                .fetch_add(k * slot_bytes, Ordering::Relaxed);
            return job;
        };
        let n = job.keys.len();
        let mut keep = vec![true; n];
        let mut admitted = Vec::new();
        let mut rejected = 0u64;
        let fresh: Vec<usize> = (0..n).filter(|&i| !ix.is_held(&job.keys[i])).collect();
        let free = ix.free_slots();
        let victims = ix.eviction_candidates(fresh.len().saturating_sub(free));
        let mut last_admitted = None;
        for i in fresh {
            let key = &job.keys[i];
            self.policy.record_access(key);
            let victim = admitted
                .len()
                .checked_sub(free)
                .and_then(|v| victims.get(v));
            if self.policy.should_admit(key, victim) {
                admitted.push(key.clone());
                last_admitted = Some(i);
            } else {
                keep[i] = false;
                rejected += 1;
            }
        }
        // Prefix closure: admit every rejected key before the last admitted one.
        if let Some(last) = last_admitted {
            for (k, key) in keep[..last].iter_mut().zip(&job.keys) {
                if !*k {
                    *k = true;
                    rejected -= 1;
                    admitted.push(key.clone());
                }
            }
        }
        if rejected > 0 {
            let mut it = keep.iter();
            job.keys.retain(|_| *it.next().unwrap_or(&true));
            let mut it = keep.iter();
            job.chunk_ids.retain(|_| *it.next().unwrap_or(&true));
        }
        let a = admitted.len() as u64;
        counters.admitted_blocks.fetch_add(a, Ordering::Relaxed);
        counters
            .admitted_bytes
            .fetch_add(a * slot_bytes, Ordering::Relaxed);
        counters
            .rejected_blocks
            .fetch_add(rejected, Ordering::Relaxed);
        counters
            .rejected_bytes
            .fetch_add(rejected * slot_bytes, Ordering::Relaxed);
        if !admitted.is_empty() {
            self.policy.on_admitted(&admitted);
            self.pending.insert(job.job_id, admitted);
        }
        job
    }

    /// A job was reported: tells the policy how the store of its admitted keys ended.
    pub fn on_finished(&mut self, job_id: JobId, success: bool) {
        if let Some(keys) = self.pending.remove(&job_id) {
            self.policy.on_completed(&keys, success);
        }
    }
}
