//! [`NodeTier`]: the node service as an engine's secondary tier (the [`SecondaryTier`]
//! contract over a [`NodeClient`]), what the Python package's `KvtierTier` runs in client
//! mode (`service_socket_path`).
//!
//! Lookups never wait for the socket: a key the tier has no fresh verdict for is asked of the
//! service in the background and answered RETRY (vLLM's scheduler asks again next step, when
//! the verdict is there). A verdict is used once and only while it is fresh
//! ([`VERDICT_TTL`]), so a chunk another engine stores becomes visible within that time.
//! Stores and loads are forwarded as they come and reported once each.
//!
//! **When the service goes away** (it crashed, was killed or restarted), every job still
//! outstanding is reported failed, never done, and lookups answer MISS. The outage is logged
//! once; a background thread reconnects with exponential backoff (`RECONNECT_FIRST_DELAY`
//! doubling up to `RECONNECT_MAX_DELAY`, in `link`): it presents the same compatibility
//! digest and row stride again (a service that now has another digest is
//! refused, and the refusal logged once per outage), re-registers the same region, and the
//! tier uses the new connection from its next call on (verdicts of the old one are dropped).
//! Nothing of the engine's G3 data is lost: the service recovers its index from its journal
//! and what was committed before the outage loads again. The counts are in
//! [`NodeTier::metrics`] (`node_client_*`). Shutdown stops the reconnection and joins its
//! thread, ending an attempt that waits for the service's answer (see `stop_reconnect`).
//!
//! Why a job the old connection reported failed can never write into a row later: the kernel
//! finishes or cancels a dying process's I/O (its io_uring requests included) before its
//! descriptors close, and the socket closing is how the client learns of the death.
//!
//! A request whose `kv_hints` carry kvtier's prefetch action (`crate::node::hints`) has its
//! keys sent to the service at `on_new_request` (`HINT`): the service stages them from G3 in
//! its DRAM pool and answers a verdict per key, which the tier keeps until the request
//! finishes, so the request's lookups of those keys answer HIT at once (no RETRY round trip)
//! and its loads are served from DRAM. `on_request_finished` tells the service, which
//! discards what the request did not load. Actions of other types are ignored and counted
//! (`node_hint_actions_ignored`).
//!
//! * `link`: the connection's set-up (digest, row stride, region) and the reconnection.
//! * `counters`: the connection's and the hints' counts, as metrics.

mod counters;
mod link;

use std::collections::{HashMap, HashSet};
use std::os::fd::BorrowedFd;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::contract::job::{
    JobResult, Locality, LookupResult, Medium, OffloadPolicy, OffloadingEvent, RequestContext,
    TransferJob,
};
use crate::contract::secondary::{
    HealthState, MetricDescriptor, SecondaryTier, TierHealth, TierMetric,
};
use crate::error::{Error, ErrorKind, Result};
use crate::key::ChunkKey;
use crate::node::client::{AsyncAnswer, ClientHello, ConnectAbort, NodeClient};
use crate::node::protocol::EventMedium;
use counters::{HintCounters, LinkStats};
use link::{Connector, OwnedRegion, Reconnect, reconnect_loop, stop_reconnect};

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
    connector: Arc<Connector>,
    client: Option<NodeClient>,
    /// Connections that were lost, until every job they had is collected.
    retired: Vec<NodeClient>,
    reconnect: Option<Reconnect>,
    /// When the connection was lost (`None` while connected).
    outage_since: Option<Instant>,
    /// Jobs failed here without reaching the service (no connection, shut down).
    failed_here: Vec<JobResult>,
    shut_down: bool,
    locality: Option<Locality>,
    verdicts: HashMap<ChunkKey, (LookupResult, Instant)>,
    asked: HashSet<ChunkKey>,
    stats: Arc<LinkStats>,
    /// Hinted keys of each request not finished.
    hint_requests: HashMap<Arc<str>, Vec<ChunkKey>>,
    /// Per hinted key: how many unfinished requests hinted it, and the service's verdict.
    hinted: HashMap<ChunkKey, (u32, Option<LookupResult>)>,
    /// Events that arrived, not yet taken.
    events: Vec<OffloadingEvent>,
    /// A `TAKE_EVENTS` is unanswered.
    events_asked: bool,
    /// A `TAKE_EVENTS` was answered (the service queues events for this engine).
    events_subscribed: bool,
    hint_counters: HintCounters,
}

impl std::fmt::Debug for NodeTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeTier")
            .field("socket", &self.connector.socket)
            .field("client", &self.client)
            .field("reconnecting", &self.reconnect.is_some())
            .finish_non_exhaustive()
    }
}

impl NodeTier {
    /// The label names of [`SecondaryTier::config_info`], in its order.
    pub const CONFIG_INFO_KEYS: [&str; 4] = [
        "kvtier_service_socket",
        "kvtier_service_region",
        "kvtier_slot_bytes",
        "kvtier_namespace",
    ];

    /// Every metric a node tier reports (for a host that declares its metrics before a tier
    /// opens, as vLLM does).
    pub fn metric_descriptors() -> Vec<MetricDescriptor> {
        LinkStats::default()
            .sample(false)
            .into_iter()
            .chain(HintCounters::default().sample())
            .map(|m| MetricDescriptor {
                name: m.name,
                help: m.help,
                kind: m.kind,
                label_names: Vec::new(),
            })
            .collect()
    }

    /// Connects to the service at `socket` and registers `num_rows` rows of `region` (a
    /// descriptor is duplicated and kept for reconnecting).
    pub fn connect(
        socket: &Path,
        hello: &ClientHello,
        region: RegionSource<'_>,
        num_rows: u64,
        locality: Option<Locality>,
    ) -> Result<NodeTier> {
        let region = match region {
            RegionSource::Path(p) => OwnedRegion::Path(p.to_path_buf()),
            RegionSource::Fd(fd) => OwnedRegion::Fd(fd.try_clone_to_owned().map_err(|e| {
                Error::new(
                    ErrorKind::Io,
                    format!("cannot duplicate the region fd: {e}"),
                )
            })?),
        };
        let connector = Arc::new(Connector {
            socket: socket.to_path_buf(),
            hello: hello.clone(),
            region,
            num_rows,
        });
        let client = connector.connect(None)?;
        Ok(NodeTier {
            connector,
            client: Some(client),
            retired: Vec::new(),
            reconnect: None,
            outage_since: None,
            failed_here: Vec::new(),
            shut_down: false,
            locality,
            verdicts: HashMap::new(),
            asked: HashSet::new(),
            stats: Default::default(),
            hint_requests: HashMap::new(),
            hinted: HashMap::new(),
            events: Vec::new(),
            events_asked: false,
            events_subscribed: false,
            hint_counters: HintCounters::default(),
        })
    }

    /// The connection in use (`None` while reconnecting and after shutdown).
    pub fn client(&self) -> Option<&NodeClient> {
        self.client.as_ref().filter(|c| c.is_connected())
    }

    /// Connections lost since the tier opened.
    pub fn connection_losses(&self) -> u64 {
        self.stats.losses.load(Ordering::Relaxed)
    }

    /// Successful reconnections since the tier opened.
    pub fn reconnects(&self) -> u64 {
        self.stats.reconnects.load(Ordering::Relaxed)
    }

    /// Notices a lost connection (starting the reconnection) and takes a new one in.
    fn maintain(&mut self) {
        if self.shut_down {
            return;
        }
        if let Some(r) = &self.reconnect {
            match r.result.try_recv() {
                Ok(client) => self.install(client),
                Err(crossbeam_channel::TryRecvError::Empty) => {}
                Err(crossbeam_channel::TryRecvError::Disconnected) => {
                    // The thread ended without a connection (it cannot, short of a panic):
                    // start another.
                    self.reconnect = None;
                    self.start_reconnect();
                }
            }
        }
        if self.client.as_ref().is_some_and(|c| !c.is_connected()) {
            let lost = self.client.take().expect("checked");
            self.retired.push(lost);
            self.stats.losses.fetch_add(1, Ordering::Relaxed);
            self.outage_since = Some(Instant::now());
            log::warn!(
                "kvtier node tier {:?}: the connection to the node service at {} was lost; \
                 its jobs in flight fail, lookups answer MISS, reconnecting in the background",
                self.connector.hello.engine,
                self.connector.socket.display()
            );
            self.start_reconnect();
        }
    }

    fn start_reconnect(&mut self) {
        if self.reconnect.is_some() {
            return;
        }
        let abort = Arc::new(ConnectAbort::default());
        let (tx, rx) = crossbeam_channel::bounded(1);
        let connector = self.connector.clone();
        let stats = self.stats.clone();
        let abort2 = abort.clone();
        let spawned = std::thread::Builder::new()
            .name("kvtier-node-reconnect".into())
            .spawn(move || {
                if let Some(c) = reconnect_loop(&connector, &stats, &abort2) {
                    let _ = tx.send(c);
                }
            });
        match spawned {
            Ok(thread) => {
                self.reconnect = Some(Reconnect {
                    abort,
                    result: rx,
                    thread,
                })
            }
            // Tried again on the next call.
            Err(e) => log::error!("kvtier node tier: cannot start a reconnection thread: {e}"),
        }
    }

    fn install(&mut self, client: NodeClient) {
        if let Some(r) = self.reconnect.take() {
            let _ = r.thread.join();
        }
        let outage = self
            .outage_since
            .take()
            .map_or(0.0, |t| t.elapsed().as_secs_f64());
        self.stats.reconnects.fetch_add(1, Ordering::Relaxed);
        *self.stats.last_error.lock() = None;
        // Answers the old connection never gave are lost; its verdicts are stale, and so are
        // the hints' (a restarted service's pool is empty) and the events subscription.
        self.asked.clear();
        self.verdicts.clear();
        for v in self.hinted.values_mut() {
            v.1 = None;
        }
        self.events_asked = false;
        self.events_subscribed = false;
        log::info!(
            "kvtier node tier {:?}: reconnected to the node service at {} after {outage:.2} s \
             (digest {} checked, region {} registered again)",
            self.connector.hello.engine,
            self.connector.socket.display(),
            &hex::encode(self.connector.hello.digest)[..16],
            self.connector.region_text()
        );
        self.client = Some(client);
    }

    /// True once the service answered an events request: it queues this engine's events.
    pub fn events_subscribed(&mut self) -> bool {
        self.absorb();
        self.events_subscribed
    }

    /// Hinted keys of unfinished requests whose verdict the service has given.
    pub fn hint_verdicts(&mut self) -> usize {
        self.absorb();
        self.hinted.values().filter(|(_, v)| v.is_some()).count()
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
        for answer in c.async_answers() {
            match answer {
                AsyncAnswer::Hinted(_, keys, verdicts) => {
                    for (k, v) in keys.into_iter().zip(verdicts) {
                        if let Some(entry) = self.hinted.get_mut(&k) {
                            entry.1 = Some(v);
                        }
                    }
                }
                AsyncAnswer::Events(events) => {
                    self.events_asked = false;
                    self.events_subscribed = true;
                    for e in events {
                        self.events.push(OffloadingEvent {
                            keys: e.keys,
                            medium: match e.medium {
                                EventMedium::Cpu => Medium::Cpu,
                                EventMedium::Storage => Medium::Storage,
                            },
                            removed: e.removed,
                            locality: self.locality,
                            ownership: None,
                            removal_expected: true,
                            metadata_only: false,
                        });
                    }
                }
            }
        }
    }

    fn submit(&mut self, load: bool, job: TransferJob) {
        self.maintain();
        match self.client.as_ref() {
            Some(c) if load => c.submit_load(job.job_id, job.keys, job.chunk_ids),
            Some(c) => c.submit_store(job.job_id, job.keys, job.chunk_ids),
            None => {
                let why = if self.shut_down {
                    "the node tier is shut down"
                } else {
                    "no connection to the kvtier node service (reconnecting)"
                };
                self.failed_here.push(JobResult::failed(
                    job.job_id,
                    Error::new(ErrorKind::Closed, why),
                ));
            }
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
        self.maintain();
        self.absorb();
        // A hinted key the service staged (and holds until its request finishes).
        if let Some((_, Some(LookupResult::Hit))) = self.hinted.get(key) {
            self.hint_counters.lookups_answered += 1;
            return LookupResult::Hit;
        }
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
        self.submit(false, job);
    }

    fn submit_load(&mut self, job: TransferJob) {
        self.submit(true, job);
    }

    fn on_new_request(&mut self, req: &RequestContext) -> OffloadPolicy {
        let Some(envelope) = req.kv_hints.as_deref() else {
            return OffloadPolicy::default();
        };
        let plan = crate::node::hints::plan(envelope);
        let c = &mut self.hint_counters;
        c.applied += plan.applied;
        c.ignored += plan.ignored.len() as u64;
        c.invalid += plan.invalid.len() as u64;
        for (action_id, why) in &plan.invalid {
            log::warn!(
                "node tier: request {}: hint action {action_id:?} refused: {why}",
                req.req_id
            );
        }
        for (t, v) in &plan.ignored {
            log::debug!(
                "node tier: request {}: hint action {t:?} version {v:?} ignored",
                req.req_id
            );
        }
        let Some(client) = self.client.as_ref().filter(|c| c.is_connected()) else {
            return OffloadPolicy::default();
        };
        if plan.keys.is_empty() || client.request_hint(&req.req_id, plan.keys.clone()).is_err() {
            return OffloadPolicy::default();
        }
        c.keys += plan.keys.len() as u64;
        for k in &plan.keys {
            self.hinted.entry(k.clone()).or_insert((0, None)).0 += 1;
        }
        self.hint_requests
            .entry(req.req_id.clone())
            .or_default()
            .extend(plan.keys);
        OffloadPolicy::default()
    }

    fn on_request_finished(&mut self, req: &RequestContext) {
        let Some(keys) = self.hint_requests.remove(&req.req_id) else {
            return;
        };
        if let Some(c) = &self.client {
            let _ = c.hint_done(&req.req_id);
        }
        for k in keys {
            if let Some(entry) = self.hinted.get_mut(&k) {
                entry.0 -= 1;
                if entry.0 == 0 {
                    self.hinted.remove(&k);
                }
            }
        }
    }

    /// vLLM's `touch` (forwarded by its manager to every tier): sent to the service without
    /// waiting, which refreshes the keys in G3's LRU. Lost while disconnected.
    fn touch(&mut self, keys: &[ChunkKey], _req: &RequestContext) {
        if keys.is_empty() {
            return;
        }
        if let Some(c) = &self.client {
            let _ = c.touch(keys.to_vec());
        }
    }

    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        self.maintain();
        self.absorb();
        if !self.events_asked
            && let Some(c) = self.client.as_ref().filter(|c| c.is_connected())
            && c.request_events().is_ok()
        {
            self.events_asked = true;
        }
        std::mem::take(&mut self.events)
    }

    fn get_finished_jobs(&mut self) -> Vec<JobResult> {
        self.maintain();
        let mut out = std::mem::take(&mut self.failed_here);
        // A lost connection is dropped only once its reader has reported everything.
        let mut keep = Vec::new();
        for old in self.retired.drain(..) {
            let done = old.is_finished();
            out.extend(old.finished_jobs());
            if !done {
                keep.push(old);
            }
        }
        self.retired = keep;
        if let Some(c) = &self.client {
            out.extend(c.finished_jobs());
        }
        let failed = out.iter().filter(|r| !r.success).count() as u64;
        self.stats.failed_jobs.fetch_add(failed, Ordering::Relaxed);
        out
    }

    fn has_pending_work(&self) -> bool {
        !self.failed_here.is_empty()
            || self
                .retired
                .iter()
                .any(|c| c.outstanding_jobs() > 0 || !c.is_finished())
            || self
                .client
                .as_ref()
                .is_some_and(|c| c.outstanding_jobs() > 0)
    }

    fn drain_jobs(&mut self) {
        for old in &self.retired {
            while !old.is_finished() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        if let Some(c) = &self.client {
            c.wait_outstanding(None);
        }
    }

    fn shutdown(&mut self) -> Result<()> {
        self.shut_down = true;
        if let Some(r) = self.reconnect.take() {
            stop_reconnect(r, &self.connector.hello.engine);
        }
        self.drain_jobs();
        // The service stops using this engine's region when the session ends (it unmaps it).
        drop(self.client.take());
        self.retired.clear();
        Ok(())
    }

    fn metrics(&self) -> Vec<TierMetric> {
        let mut m = self.stats.sample(self.ready());
        m.extend(self.hint_counters.sample());
        m
    }

    fn config_info(&self) -> Vec<(&'static str, String)> {
        let values = [
            self.connector.socket.display().to_string(),
            self.connector.region_text(),
            // The bytes of each row the service stores (its WELCOME), the row until connected.
            self.client
                .as_ref()
                .map_or(self.connector.hello.row_stride, |c| c.service().row_stride)
                .to_string(),
            hex::encode(self.connector.hello.digest),
        ];
        Self::CONFIG_INFO_KEYS.into_iter().zip(values).collect()
    }

    fn health(&self) -> TierHealth {
        let mut h = TierHealth::default();
        if self.shut_down {
            h.add(HealthState::Failed, "shut down");
        } else if !self.client.as_ref().is_some_and(NodeClient::is_connected) {
            let why = self.stats.last_error.lock().clone();
            h.add(
                HealthState::Degraded,
                match why {
                    Some(e) => format!(
                        "the connection to the kvtier node service was lost; reconnecting \
                         (last attempt: {e})"
                    ),
                    None => "the connection to the kvtier node service was lost; reconnecting"
                        .to_string(),
                },
            );
        }
        h
    }

    fn ready(&self) -> bool {
        self.client.as_ref().is_some_and(NodeClient::is_connected)
    }
}
