//! [`OfflineTier`]: a G3 tier entry that runs without its slabs, because a path was found on
//! another filesystem than the tier was created on (its disk not mounted) and the entry says
//! `on_wrong_filesystem = "degraded"`. It serves nothing: lookups miss, every job is reported
//! failed with the reason, and its health (degraded) and `g3_wrong_filesystem{path} 1` say
//! why. Nothing is created or written on any of its paths.

use std::path::PathBuf;
use std::sync::atomic::Ordering;

use crate::contract::job::{
    JobResult, Locality, LookupResult, Medium, RequestContext, TransferJob,
};
use crate::contract::secondary::{HealthState, SecondaryTier, TierHealth, TierMetric};
use crate::error::{Error, ErrorKind, Result};
use crate::g3::config::G3TierConfig;
use crate::g3::fs_record::FsGuard;
use crate::g3::metrics::{G3Metrics, PathStatus};
use crate::g3::tier::CONFIG_INFO_KEYS;
use crate::key::ChunkKey;

/// A G3 tier entry running without its slabs (see the module docs).
#[derive(Debug)]
pub struct OfflineTier {
    locality: Option<Locality>,
    /// Why it runs without its slabs (the refusal an open would have returned).
    reason: String,
    paths: Vec<PathStatus>,
    metrics: G3Metrics,
    finished: Vec<JobResult>,
}

impl OfflineTier {
    /// The stand-in for the tier of `cfg`, whose open was refused with `refusal` (a path on
    /// another filesystem than recorded). Marks which paths are on another filesystem.
    pub fn new(cfg: &G3TierConfig, locality: Option<Locality>, refusal: &Error) -> Self {
        let dirs: Vec<PathBuf> = cfg
            .paths
            .iter()
            .map(|p| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone()))
            .collect();
        let wrong: Vec<PathBuf> = FsGuard::load(&dirs)
            .map(|g| g.mismatches().into_iter().map(|(d, _, _)| d).collect())
            .unwrap_or_default();
        let named = refusal.context_value("path").map(PathBuf::from);
        let paths = dirs
            .iter()
            .map(|d| {
                let p = PathStatus {
                    direct: false,
                    poisoned: true.into(),
                    problem: parking_lot::Mutex::new(Some(refusal.message().to_string())),
                    lost: Default::default(),
                    wrong_filesystem: Default::default(),
                };
                let is_wrong = wrong.contains(d) || named.as_ref() == Some(d);
                p.wrong_filesystem.store(is_wrong, Ordering::Relaxed);
                p
            })
            .collect();
        OfflineTier {
            locality,
            reason: refusal.message().to_string(),
            paths,
            metrics: G3Metrics::default(),
            finished: Vec::new(),
        }
    }

    fn refuse(&mut self, job: TransferJob) {
        let e = Error::new(
            ErrorKind::InvalidPath,
            format!(
                "job {}: the G3 tier runs without its slabs: {}",
                job.job_id, self.reason
            ),
        );
        self.finished.push(JobResult::failed(job.job_id, e));
    }
}

impl SecondaryTier for OfflineTier {
    fn tier_type(&self) -> &str {
        "nvme"
    }

    fn medium(&self) -> Option<Medium> {
        Some(Medium::Storage)
    }

    fn locality(&self) -> Option<Locality> {
        self.locality
    }

    fn lookup(&mut self, _key: &ChunkKey, _req: &RequestContext) -> LookupResult {
        LookupResult::Miss
    }

    fn submit_store(&mut self, job: TransferJob) {
        self.refuse(job);
    }

    fn submit_load(&mut self, job: TransferJob) {
        self.refuse(job);
    }

    fn get_finished_jobs(&mut self) -> Vec<JobResult> {
        std::mem::take(&mut self.finished)
    }

    fn has_pending_work(&self) -> bool {
        !self.finished.is_empty()
    }

    fn drain_jobs(&mut self) {}

    fn shutdown(&mut self) -> Result<()> {
        Ok(())
    }

    fn metrics(&self) -> Vec<TierMetric> {
        self.metrics.sample(&self.paths)
    }

    fn health(&self) -> TierHealth {
        let mut h = TierHealth::default();
        h.add(
            HealthState::Degraded,
            format!(
                "runs without its slabs and serves nothing (on_wrong_filesystem = degraded): {}",
                self.reason
            ),
        );
        h
    }

    fn ready(&self) -> bool {
        true
    }

    fn config_info(&self) -> Vec<(&'static str, String)> {
        let values = [
            "none".to_string(),
            "none".to_string(),
            self.paths.len().to_string(),
            "0".to_string(),
            "0".to_string(),
            String::new(),
        ];
        CONFIG_INFO_KEYS.into_iter().zip(values).collect()
    }
}
