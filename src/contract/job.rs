//! The job and lookup vocabulary shared by the manager and every tier, after vLLM 0.33.0's
//! `kv_offload/base.py` and `tiering/base.py` (contract doc sections 3.1, 3.4, 3.5, 3.9).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::Error;
use crate::key::ChunkKey;

/// Job ids come from one manager-wide counter, unique across all tiers.
pub type JobId = u64;

/// Answer to a lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LookupResult {
    /// Not present.
    Miss,
    /// Present and loadable now (a promise: a load will follow).
    Hit,
    /// Present in the primary with its write still in flight (primary and manager only).
    HitPending,
    /// Not known yet; ask again later (secondary tiers and manager only).
    Retry,
}

/// Storage medium of a tier (vLLM `Medium`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    /// Host memory.
    Cpu,
    /// Disk or object storage.
    Storage,
}

impl Medium {
    /// vLLM's string value (`"CPU"`, `"STORAGE"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Cpu => "CPU",
            Medium::Storage => "STORAGE",
        }
    }
}

/// Where a tier's data lives relative to this host (vLLM `Locality`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Locality {
    /// On this host.
    Local,
    /// Across a network.
    Remote,
}

impl Locality {
    /// vLLM's string value (`"LOCAL"`, `"REMOTE"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Locality::Local => "LOCAL",
            Locality::Remote => "REMOTE",
        }
    }

    /// Parses `"LOCAL"` / `"REMOTE"` (case-insensitive).
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_uppercase().as_str() {
            "LOCAL" => Some(Locality::Local),
            "REMOTE" => Some(Locality::Remote),
            _ => None,
        }
    }
}

/// What a tier asks to receive for a request (vLLM `OffloadPolicy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OffloadPolicy {
    /// Only newly computed chunks are cascaded (default).
    #[default]
    ChunkLevel,
    /// Every chunk of the request, including those already in the primary.
    RequestLevel,
}

/// One matcher of a [`TierFilter`]; `None` on either side matches anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierMatcher {
    /// Medium to match.
    pub medium: Option<Medium>,
    /// Locality to match.
    pub locality: Option<Locality>,
}

/// Which secondary tiers a request may load from (vLLM `TierFilter`). The primary is always
/// consulted.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum TierFilter {
    /// Every tier.
    #[default]
    All,
    /// Only tiers matching one of these; an empty list allows no secondary tier.
    Only(Vec<TierMatcher>),
}

impl TierFilter {
    /// Whether a tier with this medium and locality may be asked.
    pub fn allows(&self, medium: Option<Medium>, locality: Option<Locality>) -> bool {
        match self {
            TierFilter::All => true,
            TierFilter::Only(ms) => ms.iter().any(|m| {
                (m.medium.is_none() || medium.is_none() || m.medium == medium)
                    && (m.locality.is_none() || locality.is_none() || m.locality == locality)
            }),
        }
    }
}

/// Per-request context passed to tiers (vLLM `ReqContext`, reduced to what tiers use).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestContext {
    /// The request id.
    pub req_id: Arc<str>,
    /// Which secondary tiers this request may load from.
    pub load_tier_filter: TierFilter,
    /// The orchestrator's hints for this request (vLLM `ReqContext.kv_hints`), if any.
    pub kv_hints: Option<Arc<crate::contract::hints::KvHintsEnvelope>>,
}

impl RequestContext {
    /// A context for `req_id` that may load from every tier.
    pub fn new(req_id: impl Into<Arc<str>>) -> Self {
        RequestContext {
            req_id: req_id.into(),
            load_tier_filter: TierFilter::All,
            kv_hints: None,
        }
    }

    /// This context with the orchestrator's hints.
    pub fn with_kv_hints(mut self, hints: crate::contract::hints::KvHintsEnvelope) -> Self {
        self.kv_hints = Some(Arc::new(hints));
        self
    }
}

/// A batch transfer between the primary and one secondary tier (vLLM `TransferJob`).
#[derive(Debug, Clone)]
pub struct TransferJob {
    /// Manager-wide unique id.
    pub job_id: JobId,
    /// Chunk keys, parallel to `chunk_ids`.
    pub keys: Vec<ChunkKey>,
    /// Primary rows: read from (store) or written to (promotion).
    pub chunk_ids: Vec<u32>,
    /// True: tier -> primary (load). False: primary -> tier (store / cascade).
    pub is_promotion: bool,
    /// The request the job belongs to.
    pub req_id: Arc<str>,
    /// When the manager built the job (monotonic).
    pub submit_time: Instant,
}

/// The outcome of one job, reported exactly once by the tier that received it.
#[derive(Debug, Clone)]
pub struct JobResult {
    /// The job's id.
    pub job_id: JobId,
    /// True iff every key succeeded.
    pub success: bool,
    /// On failure of a promotion: the keys that did load (subset of the job's keys).
    pub successful_keys: Option<Vec<ChunkKey>>,
    /// Time spent moving the bytes.
    pub transfer_time: Option<Duration>,
    /// Bytes actually moved (skipped keys move nothing).
    pub transfer_bytes: Option<u64>,
    /// The first error, for logs and metrics (not part of vLLM's result).
    pub error: Option<Error>,
}

impl JobResult {
    /// A successful result.
    pub fn ok(job_id: JobId, transfer_time: Duration, transfer_bytes: u64) -> Self {
        JobResult {
            job_id,
            success: true,
            successful_keys: None,
            transfer_time: Some(transfer_time),
            transfer_bytes: Some(transfer_bytes),
            error: None,
        }
    }

    /// A failed result with no successful keys.
    pub fn failed(job_id: JobId, error: Error) -> Self {
        JobResult {
            job_id,
            success: false,
            successful_keys: None,
            transfer_time: None,
            transfer_bytes: None,
            error: Some(error),
        }
    }
}

/// A change in what a tier holds (vLLM `OffloadingEvent`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffloadingEvent {
    /// The keys concerned.
    pub keys: Vec<ChunkKey>,
    /// Medium of the tier.
    pub medium: Medium,
    /// True for a removal, false for a store.
    pub removed: bool,
    /// Locality of the tier, if known.
    pub locality: Option<Locality>,
    /// Secondary-tier id (`None` = primary).
    pub ownership: Option<String>,
    /// The tier evicts on its own; keep metadata until its removal event.
    pub removal_expected: bool,
    /// A failed allocation released without a public eviction.
    pub metadata_only: bool,
}
