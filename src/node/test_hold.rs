//! Test support: holding jobs in flight at the service, so that a test can kill an engine
//! while the service really has one of its jobs (its rows moved, not yet committed or
//! reported), and prove it from `STATUS`.
//!
//! Only a build with the `test-support` feature has the hook, and only a service started with
//! [`crate::node::start_holding_jobs`] uses it (`kvtier-replay node-serve` with `hold_file`,
//! for the Python tests): every job, once its G3 I/O has completed, waits while the hold file
//! exists, until its engine disconnects (the job then ends as it would: a store is abandoned,
//! a load completed) or for at most [`MAX_HOLD`]. `STATUS` shows the hook and the jobs it
//! holds now (`test_hold`); a service without it shows `null` there.

#[cfg(feature = "test-support")]
use std::path::PathBuf;
#[cfg(feature = "test-support")]
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
#[cfg(feature = "test-support")]
use std::time::{Duration, Instant};

/// The longest a job is held.
#[cfg(feature = "test-support")]
pub const MAX_HOLD: Duration = Duration::from_secs(120);

/// The test hooks of one service: empty (and never consulted) in a build without the
/// `test-support` feature.
#[derive(Debug, Default)]
pub struct TestHooks {
    /// Holds jobs after their I/O while a file exists.
    #[cfg(feature = "test-support")]
    pub hold: Option<JobHold>,
}

impl TestHooks {
    /// The hooks' state for `STATUS` (`null` without a hook).
    pub fn status(&self) -> serde_json::Value {
        #[cfg(feature = "test-support")]
        if let Some(h) = &self.hold {
            return h.status();
        }
        serde_json::Value::Null
    }
}

/// Holds each job after its I/O while the file exists (see the module docs).
#[cfg(feature = "test-support")]
#[derive(Debug)]
pub struct JobHold {
    file: PathBuf,
    /// Jobs held now.
    held: AtomicU64,
    /// Jobs held so far.
    held_total: AtomicU64,
}

#[cfg(feature = "test-support")]
impl JobHold {
    /// A hold on `file` (logged as a warning: a service that holds jobs is a test's).
    pub fn new(file: PathBuf) -> JobHold {
        log::warn!(
            "node service: test hook on: jobs wait after their I/O while {} exists",
            file.display()
        );
        JobHold {
            file,
            held: AtomicU64::new(0),
            held_total: AtomicU64::new(0),
        }
    }

    /// Waits while the hold file exists, `cancelled` is unset and [`MAX_HOLD`] has not
    /// passed.
    pub fn hold(&self, cancelled: &AtomicBool) {
        if !self.file.exists() {
            return;
        }
        self.held.fetch_add(1, Ordering::Relaxed);
        self.held_total.fetch_add(1, Ordering::Relaxed);
        let until = Instant::now() + MAX_HOLD;
        while self.file.exists() && !cancelled.load(Ordering::Acquire) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.held.fetch_sub(1, Ordering::Relaxed);
    }

    /// The hold's state for `STATUS`.
    fn status(&self) -> serde_json::Value {
        serde_json::json!({
            "file": self.file.display().to_string(),
            "held_jobs": self.held.load(Ordering::Relaxed),
            "held_total": self.held_total.load(Ordering::Relaxed),
        })
    }
}
