//! A hook for tests of the node service only: holding jobs in flight at the service, so that a
//! test can kill an engine while the service really has one of its jobs (its rows moved, not
//! yet committed or reported), and prove it from `STATUS`.
//!
//! `KVTIER_TEST_NODE_HOLD_FILE=<path>` in the service's environment (read once, at the first
//! job; logged as a warning) makes every job, once its G3 I/O has completed, wait while the
//! file `<path>` exists, until its engine disconnects (the job then ends as it would: a store
//! is abandoned, a load completed) or for at most [`MAX_HOLD`]. `STATUS` shows the hook and
//! the jobs it holds now (`test_hold`). Without the variable nothing is held and `STATUS`
//! shows nothing of it.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The environment variable naming the hold file.
pub const HOLD_FILE_VAR: &str = "KVTIER_TEST_NODE_HOLD_FILE";
/// The longest a job is held.
pub const MAX_HOLD: Duration = Duration::from_secs(120);

/// Jobs held now.
static HELD: AtomicU64 = AtomicU64::new(0);
/// Jobs held so far.
static HELD_TOTAL: AtomicU64 = AtomicU64::new(0);

fn hold_file() -> Option<&'static PathBuf> {
    static FILE: OnceLock<Option<PathBuf>> = OnceLock::new();
    FILE.get_or_init(|| {
        let path = std::env::var_os(HOLD_FILE_VAR).map(PathBuf::from)?;
        log::warn!(
            "node service: test hook on ({HOLD_FILE_VAR}={}): jobs wait after their I/O while \
             that file exists",
            path.display()
        );
        Some(path)
    })
    .as_ref()
}

/// Waits while the hold file exists, `cancelled` is unset and [`MAX_HOLD`] has not passed
/// (returns at once without the hook).
pub fn hold(cancelled: &AtomicBool) {
    let Some(path) = hold_file() else {
        return;
    };
    if !path.exists() {
        return;
    }
    HELD.fetch_add(1, Ordering::Relaxed);
    HELD_TOTAL.fetch_add(1, Ordering::Relaxed);
    let until = Instant::now() + MAX_HOLD;
    while path.exists() && !cancelled.load(Ordering::Acquire) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    HELD.fetch_sub(1, Ordering::Relaxed);
}

/// The hook's state for `STATUS` (`None` without the hook).
pub fn status() -> Option<serde_json::Value> {
    let path = hold_file()?;
    Some(serde_json::json!({
        "file": path.display().to_string(),
        "held_jobs": HELD.load(Ordering::Relaxed),
        "held_total": HELD_TOTAL.load(Ordering::Relaxed),
    }))
}
