//! Spawning kvtier's background I/O threads.
//!
//! Every thread that a scheduler call hands work to (the G3 worker, the ring thread, psync
//! workers, the memory tier's executor, the node service's job and prefetch threads) is woken
//! by that call. Under Linux's default policy a freshly woken thread may preempt the waker on
//! the waker's CPU, so the scheduler's
//! microsecond call would wait for the I/O thread's whole burst of work (measured on a 2-vCPU
//! VM: a send to a sleeping thread took 18-20 us at the median that way, 2-3 us without it).
//! These threads therefore run under `SCHED_BATCH`: same priority and share of CPU as normal
//! threads, but a wakeup never preempts the running thread; the woken thread waits for the
//! next tick or for an idle CPU. Throughput work loses nothing, and the caller keeps its CPU.
//!
//! They also get a timer slack of 5 us instead of 50 us, since their idle naps are short.
//!
//! If the policy cannot be set (a seccomp filter, say), the thread still runs under the
//! default policy; that is logged once, counted by [`batch_policy_failures`] and exported by
//! each G3 tier as `g3_io_threads_without_batch_policy`.

use std::io;
use std::num::NonZeroU64;
use std::sync::Once;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;

static BATCH_FAILURES: AtomicU64 = AtomicU64::new(0);
static LOG_ONCE: Once = Once::new();

/// Spawns a named I/O thread that runs `body` under `SCHED_BATCH` (see the module docs).
pub fn spawn_io_thread<F, T>(name: String, body: F) -> io::Result<JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    std::thread::Builder::new().name(name).spawn(move || {
        set_batch_policy();
        set_timer_slack();
        body()
    })
}

/// How many I/O threads could not switch to `SCHED_BATCH` in this process.
pub fn batch_policy_failures() -> u64 {
    BATCH_FAILURES.load(Ordering::Relaxed)
}

/// The calling thread's scheduling policy (`libc::SCHED_*`). Raw libc here and in
/// `set_batch_policy`: neither std nor rustix has `sched_getscheduler`/`sched_setscheduler`.
#[cfg(test)]
pub fn current_policy() -> i32 {
    // SAFETY: sched_getscheduler(0) reads the calling thread's policy; no memory is passed.
    unsafe { libc::sched_getscheduler(0) }
}

/// Timer slack of I/O threads: their naps (see `IdlePolicy`) are tens of microseconds, and
/// the default slack of 50 us would double them.
const IO_TIMER_SLACK_NS: NonZeroU64 = NonZeroU64::new(5_000).expect("nonzero");

fn set_timer_slack() {
    if let Err(e) = rustix::thread::set_current_timer_slack(Some(IO_TIMER_SLACK_NS)) {
        log::debug!(
            "cannot set the I/O thread's timer slack: {}",
            io::Error::from(e)
        );
    }
}

fn set_batch_policy() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid sched_param that outlives the call; pid 0 is this thread.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
    if rc != 0 {
        let err = io::Error::last_os_error();
        BATCH_FAILURES.fetch_add(1, Ordering::Relaxed);
        LOG_ONCE.call_once(|| {
            log::warn!(
                "cannot run kvtier I/O threads under SCHED_BATCH ({err}); they keep the default \
                 policy, so waking them may delay the scheduler's calls"
            );
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_threads_run_under_sched_batch() {
        let before = current_policy();
        let policy = spawn_io_thread("kvtier-test".into(), current_policy)
            .expect("spawn")
            .join()
            .expect("join");
        if batch_policy_failures() > 0 {
            crate::skip_test!("this machine refuses SCHED_BATCH");
            return;
        }
        assert_eq!(policy, libc::SCHED_BATCH);
        assert_eq!(current_policy(), before, "the caller's policy is untouched");
    }
}
