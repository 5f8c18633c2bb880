//! How a kvtier I/O thread waits once it has run out of work.
//!
//! Waking a thread that is blocked in the kernel costs the waker a system call, and when the
//! sleeping thread's CPU is idle it also costs an inter-processor interrupt. On the 2-vCPU VM
//! kvtier is developed on, a send to a blocked thread took 2-3 us at the median and 9-10 us at
//! p99 (over 20 us at p99.9): more than the whole budget of a scheduler call. So after its last
//! piece of work an I/O thread *lingers*: for [`IdlePolicy::linger`] it sleeps in short naps of
//! [`IdlePolicy::poll_interval`] and looks at its queues between naps, not registered as a
//! waiter, so a submission from the scheduler is a queue push and nothing more. Only when the
//! linger runs out does it block on its channels; the next submission then pays one wake-up.
//!
//! The price, both bounded and configurable: a job submitted during a linger waits up to one
//! nap before it starts, and a lingering thread wakes `1 / poll_interval` times a second (each
//! wake is a timer interrupt and a few microseconds of CPU). `IdlePolicy::BLOCK` turns lingering
//! off: an idle thread blocks at once and every first submission wakes it.

use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvError, TryRecvError};

/// Default nap while lingering.
pub const DEFAULT_IDLE_POLL_INTERVAL: Duration = Duration::from_micros(50);
/// Default time an I/O thread lingers after its last work (longer than a typical engine step,
/// so that a busy server's threads never need a wake-up).
pub const DEFAULT_IDLE_LINGER: Duration = Duration::from_millis(50);

/// How an I/O thread waits once it has no work (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdlePolicy {
    /// Nap between two looks at the queues while lingering.
    pub poll_interval: Duration,
    /// How long after its last work the thread lingers before it blocks. Zero: never linger.
    pub linger: Duration,
}

impl Default for IdlePolicy {
    fn default() -> Self {
        IdlePolicy {
            poll_interval: DEFAULT_IDLE_POLL_INTERVAL,
            linger: DEFAULT_IDLE_LINGER,
        }
    }
}

impl IdlePolicy {
    /// Never linger: block as soon as there is no work.
    pub const BLOCK: IdlePolicy = IdlePolicy {
        poll_interval: Duration::ZERO,
        linger: Duration::ZERO,
    };

    /// True when the thread lingers at all.
    pub fn lingers(&self) -> bool {
        !self.linger.is_zero() && !self.poll_interval.is_zero()
    }

    /// Naps until `ready()` returns true (checked before each nap), `deadline` passes, or the
    /// linger that began at `last_work` runs out. Returns the number of naps taken.
    pub fn linger(
        &self,
        last_work: Instant,
        deadline: Option<Instant>,
        mut ready: impl FnMut() -> bool,
    ) -> u64 {
        if !self.lingers() {
            return 0;
        }
        let until = last_work + self.linger;
        let until = deadline.map_or(until, |d| d.min(until));
        let mut naps = 0;
        while !ready() {
            let now = Instant::now();
            if now >= until {
                break;
            }
            std::thread::sleep(self.poll_interval.min(until - now));
            naps += 1;
        }
        naps
    }

    /// Receives the next message, lingering first (with `last_work` updated to now when a
    /// message arrives). Errors once the channel is empty and disconnected.
    pub fn recv<T>(&self, rx: &Receiver<T>, last_work: &mut Instant) -> Result<T, RecvError> {
        let mut got = None;
        let mut gone = false;
        self.linger(*last_work, None, || match rx.try_recv() {
            Ok(v) => {
                got = Some(v);
                true
            }
            Err(TryRecvError::Disconnected) => {
                gone = true;
                true
            }
            Err(TryRecvError::Empty) => false,
        });
        let result = match got {
            Some(v) => Ok(v),
            None if gone => Err(RecvError),
            None => rx.recv(),
        };
        if result.is_ok() {
            *last_work = Instant::now();
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_never_naps() {
        let naps = IdlePolicy::BLOCK.linger(Instant::now(), None, || false);
        assert_eq!(naps, 0);
    }

    #[test]
    fn linger_stops_when_work_is_ready() {
        let p = IdlePolicy {
            poll_interval: Duration::from_micros(100),
            linger: Duration::from_secs(60),
        };
        let mut calls = 0;
        let naps = p.linger(Instant::now(), None, || {
            calls += 1;
            calls > 3
        });
        assert_eq!(naps, 3);
    }

    #[test]
    fn linger_ends_at_the_deadline_or_after_the_linger() {
        let p = IdlePolicy {
            poll_interval: Duration::from_millis(1),
            linger: Duration::from_millis(20),
        };
        let start = Instant::now();
        p.linger(start, Some(start + Duration::from_millis(5)), || false);
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(5), "{took:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
        // A linger that began long ago is already over: no nap.
        let old = Instant::now() - Duration::from_secs(1);
        assert_eq!(p.linger(old, None, || false), 0);
    }

    #[test]
    fn recv_gets_messages_sent_while_lingering_and_ends_on_disconnect() {
        let p = IdlePolicy {
            poll_interval: Duration::from_micros(200),
            linger: Duration::from_secs(60),
        };
        let (tx, rx) = crossbeam_channel::unbounded();
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            tx.send(7u32).unwrap();
        });
        let mut last = Instant::now();
        assert_eq!(p.recv(&rx, &mut last), Ok(7));
        sender.join().unwrap();
        // The sender is gone: recv returns an error instead of lingering for a minute.
        let start = Instant::now();
        assert_eq!(p.recv(&rx, &mut last), Err(RecvError));
        assert!(start.elapsed() < Duration::from_secs(30));
    }
}
