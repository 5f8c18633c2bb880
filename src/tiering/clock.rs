//! The manager's clock: job `submit_time`s, store latencies for back-pressure, cooldowns and
//! idle decay all read it, so tests can inject a [`ManualClock`] and stay deterministic.

use std::fmt::Debug;
#[cfg(any(test, feature = "test-support"))]
use std::sync::Arc;
#[cfg(any(test, feature = "test-support"))]
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;
#[cfg(any(test, feature = "test-support"))]
use std::time::Duration;

/// A monotonic time source.
pub trait Clock: Send + Sync + Debug {
    /// The current instant.
    fn now(&self) -> Instant;
}

/// The real monotonic clock (`Instant::now`).
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A clock that only moves when told to (tests, simulations). Cheap to clone; clones share time.
#[cfg(any(test, feature = "test-support"))]
#[derive(Debug, Clone)]
pub struct ManualClock {
    base: Instant,
    offset_ns: Arc<AtomicU64>,
}

#[cfg(any(test, feature = "test-support"))]
impl ManualClock {
    /// A clock starting at the current real instant.
    pub fn new() -> Self {
        ManualClock {
            base: Instant::now(),
            offset_ns: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Moves time forward by `d`.
    pub fn advance(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.offset_ns.fetch_add(ns, Ordering::SeqCst);
    }

    /// Moves time forward by `secs` seconds (non-negative, finite).
    pub fn advance_secs(&self, secs: f64) {
        if secs.is_finite() && secs > 0.0 {
            self.advance(Duration::from_secs_f64(secs));
        }
    }

    /// Time elapsed since the clock was created.
    pub fn elapsed(&self) -> Duration {
        Duration::from_nanos(self.offset_ns.load(Ordering::SeqCst))
    }
}

#[cfg(any(test, feature = "test-support"))]
impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(any(test, feature = "test-support"))]
impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.base + self.elapsed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_advanced_and_clones_share_time() {
        let c = ManualClock::new();
        let t0 = c.now();
        assert_eq!(c.now(), t0);
        let c2 = c.clone();
        c2.advance(Duration::from_millis(1500));
        assert_eq!(c.now() - t0, Duration::from_millis(1500));
        c.advance_secs(-1.0);
        c.advance_secs(f64::NAN);
        assert_eq!(c.elapsed(), Duration::from_millis(1500));
    }
}
