//! What a `NodeTier` counts: the connection's life (losses, reconnections, failed jobs) and
//! the hints it was given, as tier metrics.

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::contract::secondary::{TierMetric, TierMetricKind};

/// Counts of the connection's life (the tier's `node_client_*` metrics).
#[derive(Debug, Default)]
pub(super) struct LinkStats {
    pub(super) losses: AtomicU64,
    pub(super) reconnects: AtomicU64,
    pub(super) attempts: AtomicU64,
    pub(super) failed_jobs: AtomicU64,
    /// Why the last reconnection attempt failed (for health).
    pub(super) last_error: Mutex<Option<String>>,
}

impl LinkStats {
    /// The metrics, `connected` saying whether the tier is connected now.
    pub(super) fn sample(&self, connected: bool) -> Vec<TierMetric> {
        use TierMetricKind::{Counter, Gauge};
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        [
            (
                "node_client_connected",
                "1 while the engine is connected to the kvtier node service",
                Gauge,
                f64::from(u8::from(connected)),
            ),
            (
                "node_client_connection_losses",
                "Connections to the node service lost (service crashed, killed or restarted)",
                Counter,
                load(&self.losses),
            ),
            (
                "node_client_reconnects",
                "Connections to the node service opened again after a loss",
                Counter,
                load(&self.reconnects),
            ),
            (
                "node_client_reconnect_attempts",
                "Attempts to reconnect to the node service",
                Counter,
                load(&self.attempts),
            ),
            (
                "node_client_failed_jobs",
                "Jobs of this engine reported failed (by the service or for a lost connection)",
                Counter,
                load(&self.failed_jobs),
            ),
        ]
        .into_iter()
        .map(|(name, help, kind, value)| TierMetric::new(name, help, kind, value))
        .collect()
    }
}

/// What the tier counted of the hints it was given.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct HintCounters {
    /// kvtier prefetch actions applied.
    pub(super) applied: u64,
    /// Actions of other types (or versions), ignored.
    pub(super) ignored: u64,
    /// kvtier prefetch actions whose payload was refused.
    pub(super) invalid: u64,
    /// Keys sent to the service in hints.
    pub(super) keys: u64,
    /// Lookups answered from a hint's verdict.
    pub(super) lookups_answered: u64,
}

impl HintCounters {
    /// The metrics (`node_hint_*`).
    pub(super) fn sample(&self) -> Vec<TierMetric> {
        let values = [
            self.applied,
            self.ignored,
            self.invalid,
            self.keys,
            self.lookups_answered,
        ];
        HINT_METRICS
            .iter()
            .zip(values)
            .map(|((name, help), v)| TierMetric::new(name, help, TierMetricKind::Counter, v as f64))
            .collect()
    }
}

const HINT_METRICS: [(&str, &str); 5] = [
    (
        "node_hint_actions_applied",
        "kvtier.prefetch hint actions sent to the node service",
    ),
    (
        "node_hint_actions_ignored",
        "Hint actions of another type or version, ignored",
    ),
    (
        "node_hint_actions_invalid",
        "kvtier.prefetch hint actions whose payload was refused",
    ),
    (
        "node_hint_keys",
        "Keys the tier asked the service to prefetch",
    ),
    (
        "node_hint_lookups",
        "Lookups answered at once from a hint's verdict",
    ),
];
