//! [`NodeTier`]: the node service as an engine's secondary tier (the [`SecondaryTier`]
//! contract over a [`NodeClient`]), what the Python package's `KvtierTier` runs in client
//! mode (`service_socket_path`).
//!
//! Lookups never wait for the socket: a key the tier has no fresh verdict for is asked of the
//! service in the background and answered RETRY (vLLM's scheduler asks again next step, when
//! the verdict is there). A verdict is used once and only while it is fresh
//! ([`VERDICT_TTL`]), so a chunk another engine stores becomes visible within that time.
//! Stores and loads are forwarded as they come and reported once each; when the connection is
//! lost every outstanding job is reported failed and lookups answer MISS.

use std::collections::{HashMap, HashSet};
use std::os::fd::BorrowedFd;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::contract::job::{
    JobResult, Locality, LookupResult, Medium, RequestContext, TransferJob,
};
use crate::contract::secondary::{HealthState, SecondaryTier, TierHealth};
use crate::error::Result;
use crate::key::ChunkKey;
use crate::node::client::{ClientHello, NodeClient};

/// How long a verdict from the service stays usable.
pub const VERDICT_TTL: Duration = Duration::from_secs(1);
/// Verdicts kept at most (older ones are dropped first when it is reached).
const MAX_VERDICTS: usize = 65536;

/// Where an engine's primary region comes from.
#[derive(Debug, Clone, Copy)]
pub enum RegionSource<'a> {
    /// The path of its shared file (vLLM: `/dev/shm/vllm_offload_<engine_id>.mmap`).
    Path(&'a Path),
    /// A descriptor of the file, passed to the service.
    Fd(BorrowedFd<'a>),
}

/// The node service as a secondary tier (see the module docs).
pub struct NodeTier {
    client: Option<NodeClient>,
    locality: Option<Locality>,
    verdicts: HashMap<ChunkKey, (LookupResult, Instant)>,
    asked: HashSet<ChunkKey>,
}

impl std::fmt::Debug for NodeTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeTier")
            .field("client", &self.client)
            .finish_non_exhaustive()
    }
}

impl NodeTier {
    /// Connects to the service at `socket` and registers `num_rows` rows of `region`.
    pub fn connect(
        socket: &Path,
        hello: &ClientHello,
        region: RegionSource<'_>,
        num_rows: u64,
        locality: Option<Locality>,
    ) -> Result<NodeTier> {
        let client = NodeClient::connect(socket, hello)?;
        match region {
            RegionSource::Path(p) => client.register_path(p, num_rows)?,
            RegionSource::Fd(fd) => client.register_fd(fd, num_rows)?,
        }
        Ok(NodeTier {
            client: Some(client),
            locality,
            verdicts: HashMap::new(),
            asked: HashSet::new(),
        })
    }

    /// The connection (`None` after shutdown).
    pub fn client(&self) -> Option<&NodeClient> {
        self.client.as_ref()
    }

    fn absorb(&mut self) {
        let Some(c) = &self.client else { return };
        let now = Instant::now();
        for (keys, results) in c.lookup_answers() {
            for (k, r) in keys.into_iter().zip(results) {
                self.asked.remove(&k);
                self.verdicts.insert(k, (r, now));
            }
        }
        if self.verdicts.len() > MAX_VERDICTS {
            self.verdicts.retain(|_, (_, t)| t.elapsed() < VERDICT_TTL);
        }
    }
}

impl SecondaryTier for NodeTier {
    fn tier_type(&self) -> &str {
        "node"
    }

    fn medium(&self) -> Option<Medium> {
        Some(Medium::Storage)
    }

    fn locality(&self) -> Option<Locality> {
        self.locality
    }

    fn lookup(&mut self, key: &ChunkKey, _req: &RequestContext) -> LookupResult {
        self.absorb();
        if let Some((verdict, at)) = self.verdicts.remove(key)
            && at.elapsed() < VERDICT_TTL
        {
            return verdict;
        }
        let Some(c) = self.client.as_ref().filter(|c| c.is_connected()) else {
            return LookupResult::Miss;
        };
        if !self.asked.contains(key) {
            if c.request_lookup(vec![key.clone()]).is_err() {
                return LookupResult::Miss;
            }
            self.asked.insert(key.clone());
        }
        LookupResult::Retry
    }

    fn submit_store(&mut self, job: TransferJob) {
        match &self.client {
            Some(c) => c.submit_store(job.job_id, job.keys, job.chunk_ids),
            None => log::error!("node tier: store job {} after shutdown", job.job_id),
        }
    }

    fn submit_load(&mut self, job: TransferJob) {
        match &self.client {
            Some(c) => c.submit_load(job.job_id, job.keys, job.chunk_ids),
            None => log::error!("node tier: load job {} after shutdown", job.job_id),
        }
    }

    fn get_finished_jobs(&mut self) -> Vec<JobResult> {
        self.client
            .as_ref()
            .map_or_else(Vec::new, NodeClient::finished_jobs)
    }

    fn has_pending_work(&self) -> bool {
        self.client
            .as_ref()
            .is_some_and(|c| c.outstanding_jobs() > 0)
    }

    fn drain_jobs(&mut self) {
        if let Some(c) = &self.client {
            c.wait_outstanding(None);
        }
    }

    fn shutdown(&mut self) -> Result<()> {
        self.drain_jobs();
        // The service stops using this engine's region when the session ends (it unmaps it).
        drop(self.client.take());
        Ok(())
    }

    fn health(&self) -> TierHealth {
        let mut h = TierHealth::default();
        match &self.client {
            Some(c) if c.is_connected() => {}
            Some(_) => h.add(
                HealthState::Failed,
                "the connection to the kvtier node service was lost",
            ),
            None => h.add(HealthState::Failed, "shut down"),
        }
        h
    }

    fn ready(&self) -> bool {
        self.client.as_ref().is_some_and(NodeClient::is_connected)
    }
}
