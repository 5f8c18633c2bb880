//! The tier's link to the service: what it takes to open a session (the socket, the greeting,
//! the region), and the reconnection running in the background after a loss.

use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;

use super::counters::LinkStats;
use crate::error::{Error, ErrorKind, Result};
use crate::node::client::{ClientHello, ConnectAbort, NodeClient};

/// The wait before the second reconnection attempt (the first is immediate).
const RECONNECT_FIRST_DELAY: Duration = Duration::from_millis(20);
/// The longest wait between two reconnection attempts.
const RECONNECT_MAX_DELAY: Duration = Duration::from_secs(1);
/// How long shutdown waits for the reconnection thread to stop (see `stop_reconnect`).
const RECONNECT_JOIN_WAIT: Duration = Duration::from_secs(5);

/// The region as the tier keeps it for reconnecting (the descriptor duplicated).
#[derive(Debug)]
pub(super) enum OwnedRegion {
    Path(PathBuf),
    Fd(OwnedFd),
}

/// What it takes to open a session: the socket, the greeting and the region.
#[derive(Debug)]
pub(super) struct Connector {
    pub(super) socket: PathBuf,
    pub(super) hello: ClientHello,
    pub(super) region: OwnedRegion,
    pub(super) num_rows: u64,
}

impl Connector {
    /// Connects, checks the service's digest and that its slots fit this engine's rows,
    /// registers the region; `abort` ends an attempt waiting for the service.
    pub(super) fn connect(&self, abort: Option<&ConnectAbort>) -> Result<NodeClient> {
        let r = self.connect_and_register(abort);
        if let Some(a) = abort {
            a.release();
        }
        r
    }

    fn connect_and_register(&self, abort: Option<&ConnectAbort>) -> Result<NodeClient> {
        let client = NodeClient::connect_abortable(&self.socket, &self.hello, abort)?;
        let service = client.service();
        // The service refuses another digest itself; this also catches a service that
        // answered WELCOME with something else.
        if service.digest != self.hello.digest || service.row_stride > self.hello.row_stride {
            return Err(Error::new(
                ErrorKind::IncompatibleLayout,
                format!(
                    "the kvtier node service at {} has digest {} and slots of {} bytes; this \
                     engine has {} and rows of {} bytes",
                    self.socket.display(),
                    hex::encode(service.digest),
                    service.row_stride,
                    hex::encode(self.hello.digest),
                    self.hello.row_stride
                ),
            ));
        }
        match &self.region {
            OwnedRegion::Path(p) => client.register_path(p, self.num_rows)?,
            OwnedRegion::Fd(fd) => client.register_fd(fd.as_fd(), self.num_rows)?,
        }
        Ok(client)
    }

    /// The region as the tier's `config_info` names it: its path, or `fd`.
    pub(super) fn region_text(&self) -> String {
        match &self.region {
            OwnedRegion::Path(p) => p.display().to_string(),
            OwnedRegion::Fd(_) => "fd".into(),
        }
    }
}

/// A reconnection running in the background.
pub(super) struct Reconnect {
    /// Stops it, also in the middle of a connect attempt.
    pub(super) abort: Arc<ConnectAbort>,
    pub(super) result: Receiver<NodeClient>,
    pub(super) thread: JoinHandle<()>,
}

/// Stops a reconnection and joins its thread: an attempt waiting for the service's answer
/// (handshake or registration) is ended by shutting its socket down, and a connection already
/// made is dropped, which ends that session at the service. Waits at most
/// [`RECONNECT_JOIN_WAIT`]: only a `connect` the kernel holds (a listener whose backlog is
/// full) outlasts it, and that thread is then left to end by itself (logged).
pub(super) fn stop_reconnect(r: Reconnect, engine: &str) {
    r.abort.abort();
    drop(r.result);
    let deadline = Instant::now() + RECONNECT_JOIN_WAIT;
    while !r.thread.is_finished() {
        if Instant::now() >= deadline {
            log::warn!(
                "kvtier node tier {engine:?}: the reconnection thread did not stop within {} s \
                 (a connect to the service's socket is still held by the kernel); left to end \
                 by itself",
                RECONNECT_JOIN_WAIT.as_secs()
            );
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let _ = r.thread.join();
}

/// Connects until it works or `abort` is aborted; waits between attempts with exponential
/// backoff.
pub(super) fn reconnect_loop(
    c: &Connector,
    stats: &LinkStats,
    abort: &ConnectAbort,
) -> Option<NodeClient> {
    let mut delay = RECONNECT_FIRST_DELAY;
    let mut refusal_logged = false;
    loop {
        if abort.is_aborted() {
            return None;
        }
        stats.attempts.fetch_add(1, Ordering::Relaxed);
        match c.connect(Some(abort)) {
            Ok(client) => return Some(client),
            Err(e) => {
                // Nothing listening yet is the normal course of a restart; a refusal (another
                // digest, uid, row stride, a region file now too short) will not pass by
                // itself: said once per outage.
                let refused = matches!(
                    e.kind(),
                    ErrorKind::IncompatibleLayout
                        | ErrorKind::PermissionDenied
                        | ErrorKind::Contract
                        | ErrorKind::Config
                );
                if refused && !refusal_logged {
                    refusal_logged = true;
                    log::warn!(
                        "kvtier node tier {:?}: the node service at {} refuses this engine \
                         ({e}); still retrying",
                        c.hello.engine,
                        c.socket.display()
                    );
                } else {
                    log::debug!("kvtier node tier: reconnection attempt failed: {e}");
                }
                *stats.last_error.lock() = Some(e.to_string());
            }
        }
        let until = Instant::now() + delay;
        while Instant::now() < until {
            if abort.is_aborted() {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5).min(delay));
        }
        delay = (delay * 2).min(RECONNECT_MAX_DELAY);
    }
}
