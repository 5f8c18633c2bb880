//! [`NodeService`]: the listening socket, the peer check and one session per engine over one
//! G3 tier.

use std::collections::HashMap;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;

use parking_lot::Mutex;

use crate::config::{KvtierConfig, ServiceConfig, TierConfig};
use crate::contract::secondary::SecondaryTier;
use crate::embed::is_nvme;
use crate::error::{Error, ErrorKind, Result};
use crate::g3::{G3Tier, G3TierConfig};
use crate::geometry::ChunkGeometry;
use crate::io::EngineOptions;
use crate::node::events::EventBus;
use crate::node::prefetch::Staging;
use crate::node::protocol::Reply;
use crate::node::service_metrics;
use crate::node::session::{self, ServiceShared};
use crate::node::socket::{bind_listener, peer_credentials, write_frame};
use crate::node::staging::StagingPool;
use crate::node::test_hold::TestHooks;
use crate::region::PrimaryRegion;
use crate::tiering::manager::tier_label;

/// Live sessions: a handle on each connection (to end it) and its thread.
type Sessions = Arc<Mutex<HashMap<u64, (UnixStream, JoinHandle<()>)>>>;

/// The node-local service: one G3 tier shared by every engine process that connects to its
/// Unix socket (see the [module docs](crate::node)).
pub struct NodeService {
    sh: Arc<ServiceShared>,
    socket_path: PathBuf,
    tier_label: String,
    accept: Option<JoinHandle<()>>,
    sessions: Sessions,
}

impl std::fmt::Debug for NodeService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeService")
            .field("socket_path", &self.socket_path)
            .finish_non_exhaustive()
    }
}

/// Opens the one `nvme` tier of `config` for engine rows of `row_stride` bytes (slots of
/// `slot_bytes`, the rows' first bytes, or whole rows when `None`, as
/// [`crate::canonical::NamespaceParams::slot_prefix`] says; slabs under the compatibility
/// digest `digest`) and starts the service on its `service` socket.
pub fn start_from_config(
    config: &KvtierConfig,
    row_stride: u64,
    slot_bytes: Option<u64>,
    digest: [u8; 32],
) -> Result<NodeService> {
    start_with_hooks(config, row_stride, slot_bytes, digest, TestHooks::default())
}

/// Test support (`test-support` only): [`start_from_config`] for a service that holds every job
/// after its G3 I/O while `hold_file` exists, until its engine disconnects (at most two
/// minutes); `STATUS` shows the jobs held (`test_hold`). A test kills an engine while the
/// service has one of its jobs in flight with it.
#[cfg(feature = "test-support")]
pub fn start_holding_jobs(
    config: &KvtierConfig,
    row_stride: u64,
    slot_bytes: Option<u64>,
    digest: [u8; 32],
    hold_file: &std::path::Path,
) -> Result<NodeService> {
    let hooks = TestHooks {
        hold: Some(crate::node::test_hold::JobHold::new(
            hold_file.to_path_buf(),
        )),
    };
    start_with_hooks(config, row_stride, slot_bytes, digest, hooks)
}

fn start_with_hooks(
    config: &KvtierConfig,
    row_stride: u64,
    slot_bytes: Option<u64>,
    digest: [u8; 32],
    hooks: TestHooks,
) -> Result<NodeService> {
    let service = config.service.as_ref().ok_or_else(|| {
        Error::config(
            "service",
            "missing: the node service needs a service section with its socket_path",
        )
    })?;
    let (nvme, others): (Vec<&TierConfig>, Vec<&TierConfig>) = config
        .secondary_tiers
        .iter()
        .partition(|t| is_nvme(&t.tier_type));
    if nvme.len() != 1 || !others.is_empty() {
        return Err(Error::config(
            "secondary_tiers",
            format!(
                "the node service owns exactly one nvme tier; this configuration has {} nvme \
                 tier(s){}",
                nvme.len(),
                if others.is_empty() {
                    String::new()
                } else {
                    let others: Vec<String> = others
                        .iter()
                        .map(|t| format!("{} ({})", t.key_path(), t.tier_type))
                        .collect();
                    format!(" and tiers it cannot serve: {}", others.join(", "))
                }
            ),
        ));
    }
    let tc = nvme[0];
    let mut g3 = G3TierConfig::from_tier(tc)?;
    // Slots hold what the namespace names, as every other builder of a slot tier sets it.
    g3.slot_bytes = slot_bytes;
    g3.validate(&tc.key_path(), Some(row_stride))?;
    let in_flight = g3.max_bytes_in_flight_for(g3.slot_bytes_for(row_stride)?);
    // The tier's own engine never moves a row (every transfer goes through an engine's
    // region): one row is all it is given.
    let own = Arc::new(PrimaryRegion::create(1, row_stride)?);
    let label = tier_label(tc.index, &tc.tier_type);
    let tier = G3Tier::open(g3, own, digest, label.clone(), tc.locality)?;
    tier.set_events_enabled(false);
    NodeService::start(service, tier, label, digest, row_stride, in_flight, hooks)
}

impl NodeService {
    /// Starts serving `tier` (opened with `digest` as its namespace; `tier_label` names it
    /// in metrics, `1:nvme`) on the socket of `cfg`, for engines whose rows are `row_stride`
    /// bytes (the tier's slots hold each row's first slot-size bytes). `max_bytes_in_flight`
    /// bounds each engine's I/O queue; `hooks` are a test's.
    pub(crate) fn start(
        cfg: &ServiceConfig,
        tier: G3Tier,
        tier_label: String,
        digest: [u8; 32],
        row_stride: u64,
        max_bytes_in_flight: u64,
        hooks: TestHooks,
    ) -> Result<NodeService> {
        cfg.validate("service")?;
        let info = tier.info().clone();
        if info.row_stride > row_stride {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "the tier's slots ({} bytes) are larger than the engines' rows ({row_stride} \
                     bytes)",
                    info.row_stride
                ),
            ));
        }
        let slots = tier.slot_grants()?;
        let allowed_uids = if cfg.allowed_uids.is_empty() {
            vec![rustix::process::getuid().as_raw()]
        } else {
            cfg.allowed_uids.clone()
        };
        let io_engine = match info.engine.as_str() {
            "psync" => crate::io::IoEngineKind::Psync,
            _ => crate::io::IoEngineKind::Auto,
        };
        let per_flight =
            ChunkGeometry::rows_in_flight(max_bytes_in_flight, info.row_stride).clamp(1, 4096);
        let o_direct = info.direct_io.iter().all(|d| *d);
        let events = Arc::new(EventBus::default());
        let staging_slots =
            cfg.staging_slots("service", info.row_stride, crate::embed::mem_available())?;
        let staging = if staging_slots == 0 {
            None
        } else {
            let pool = Arc::new(StagingPool::new(
                staging_slots,
                info.row_stride,
                events.clone(),
            )?);
            let opts = EngineOptions {
                queue_depth: per_flight as u32,
                o_direct,
                ..EngineOptions::default()
            };
            let st = Staging::start(pool, slots.clone(), io_engine, &opts)?;
            log::info!(
                "node service: DRAM staging pool of {staging_slots} slots ({} bytes; prefetch \
                 engine {})",
                staging_slots as u64 * info.row_stride,
                st.io_engine
            );
            Some(st)
        };
        let sh = Arc::new(ServiceShared {
            tier: Mutex::new(tier),
            slots,
            io_engine,
            o_direct,
            queue_depth: per_flight as u32,
            row_stride,
            slot_bytes: info.row_stride,
            digest,
            allowed_uids,
            engines: Default::default(),
            stopping: Default::default(),
            staging,
            events,
            hooks,
        });
        let listener = bind_listener(&cfg.socket_path, cfg.socket_mode)?;
        let sessions: Sessions = Default::default();
        let accept = {
            let sh = sh.clone();
            let sessions = sessions.clone();
            std::thread::Builder::new()
                .name("kvtier-node-accept".into())
                .spawn(move || accept_loop(listener, sh, sessions))
                .map_err(|e| {
                    Error::new(
                        ErrorKind::Io,
                        format!("cannot start the accept thread: {e}"),
                    )
                })?
        };
        log::info!(
            "node service listening on {} (mode {:04o}, uids {:?})",
            cfg.socket_path.display(),
            cfg.socket_mode,
            sh.allowed_uids
        );
        Ok(NodeService {
            sh,
            socket_path: cfg.socket_path.clone(),
            tier_label,
            accept: Some(accept),
            sessions,
        })
    }

    /// The tier's label in metrics and health (`1:nvme`).
    pub fn tier_label(&self) -> &str {
        &self.tier_label
    }

    /// Engine processes connected now (a session past its handshake; observers not counted).
    pub fn engines_connected(&self) -> usize {
        self.sh.engines.len()
    }

    /// The status document `kvtier service status` prints (JSON).
    pub fn status_json(&self) -> String {
        session::status_json(&self.sh)
    }

    /// The service's metrics in Prometheus text (names under `prefix`): the tier's own
    /// metrics (label `tier`), and per connected engine (label `engine`) its connections,
    /// jobs, bytes, failed jobs, errors, lookups, jobs in flight and the share of its region
    /// in 2 MiB pages, plus connections and refusals.
    pub fn metrics_text(&self, prefix: &str) -> Result<String> {
        service_metrics::render(&self.sh, &self.tier_label, prefix)
    }

    /// The tier's health.
    pub fn health(&self) -> crate::contract::secondary::TierHealth {
        self.sh.tier.lock().health()
    }

    /// True once the tier has recovered its index (from its journal and slabs): lookups and
    /// loads see what was committed before the service started.
    pub fn is_ready(&self) -> bool {
        self.sh.tier.lock().is_recovered()
    }

    /// Runs `f` on the service's G3 tier (tests that look at its slots; `test-support` only).
    #[cfg(feature = "test-support")]
    pub fn with_tier<R>(&self, f: impl FnOnce(&G3Tier) -> R) -> R {
        f(&self.sh.tier.lock())
    }

    /// Stops accepting, ends every session (their queued jobs are cancelled, the running ones
    /// finish as failed, regions are unmapped), shuts the tier down (final checkpoint) and
    /// removes the socket file.
    pub fn shutdown(mut self) -> Result<()> {
        self.stop()
    }

    fn stop(&mut self) -> Result<()> {
        let Some(accept) = self.accept.take() else {
            return Ok(());
        };
        self.sh.stopping.store(true, Ordering::Release);
        // Wake the accept loop with a connection of our own.
        let _ = UnixStream::connect(&self.socket_path);
        let _ = accept.join();
        let sessions: Vec<_> = self.sessions.lock().drain().collect();
        for (_, (stream, _)) in &sessions {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
        for (_, (_, t)) in sessions {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.socket_path);
        if let Some(st) = &self.sh.staging {
            st.stop();
        }
        self.sh.tier.lock().shutdown()
    }
}

impl Drop for NodeService {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            log::error!("node service shutdown on drop failed: {e}");
        }
    }
}

fn accept_loop(listener: UnixListener, sh: Arc<ServiceShared>, sessions: Sessions) {
    let mut next = 0u64;
    for conn in listener.incoming() {
        if sh.stopping.load(Ordering::Acquire) {
            return;
        }
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                log::warn!("node service: accept failed: {e}");
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            }
        };
        let (uid, pid) = match peer_credentials(&stream) {
            Ok(c) => c,
            Err(e) => {
                log::warn!("node service: {e}");
                continue;
            }
        };
        if !sh.allowed_uids.contains(&uid) {
            sh.engines.refused.fetch_add(1, Ordering::Relaxed);
            let e = Error::new(
                ErrorKind::PermissionDenied,
                format!(
                    "uid {uid} may not use this kvtier service (allowed uids: {:?}; \
                     service.allowed_uids in its configuration)",
                    sh.allowed_uids
                ),
            );
            log::warn!("node service: refused pid {pid}: {e}");
            let _ = stream.set_write_timeout(Some(session::SOCKET_TIMEOUT));
            let reply = Reply::Error {
                kind: e.kind(),
                message: e.to_string(),
            };
            let _ = write_frame(&stream, &reply.to_frame(0));
            continue;
        }
        let Ok(handle) = stream.try_clone() else {
            continue;
        };
        next += 1;
        let id = next;
        let sh2 = sh.clone();
        let sessions2 = sessions.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("kvtier-node-session-{id}"))
            .spawn(move || {
                session::run(sh2, stream, uid, pid);
                sessions2.lock().remove(&id);
            });
        match spawned {
            Ok(t) => {
                let mut s = sessions.lock();
                // A session that already ended removed nothing; keep only live ones.
                if !t.is_finished() {
                    s.insert(id, (handle, t));
                }
            }
            Err(e) => log::error!("node service: cannot start a session thread: {e}"),
        }
    }
}
