//! The scheduler side every tier with a worker thread shares (G3, fs): the worker's thread
//! and command channel, the results and events it sends back, the [`JobLedger`], and the
//! calls that enqueue a job, collect results, drain and stop. A tier plugs in how a job is
//! sent (its own command type `C`).

use std::sync::atomic::Ordering;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

use crate::contract::job::{JobResult, OffloadingEvent, TransferJob};
use crate::contract::ledger::{JobLedger, queue_full, stop_worker};
use crate::contract::worker::JobCounters;
use crate::error::{Error, ErrorKind, Result};

/// How a tier names itself and its worker in errors.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TierNames {
    /// The tier (`G3`, `fs`).
    pub tier: &'static str,
    /// Its worker thread (`worker`, `coordinator`).
    pub worker: &'static str,
}

/// Why a job could not be sent to the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SendRefused {
    /// The channel is full.
    Full,
    /// The worker is gone.
    Closed,
}

/// The tier's end of its worker.
#[derive(Debug)]
pub(crate) struct TierFront<C> {
    names: TierNames,
    cmd_tx: Option<Sender<C>>,
    results_rx: Receiver<JobResult>,
    events_rx: Receiver<OffloadingEvent>,
    ledger: JobLedger,
    worker: Option<JoinHandle<()>>,
    max_queued_jobs: usize,
}

/// Starts a tier's worker thread `thread` running `body`; the error names the tier's worker.
pub(crate) fn spawn_worker(
    names: TierNames,
    thread: String,
    body: impl FnOnce() + Send + 'static,
) -> Result<JoinHandle<()>> {
    crate::io::spawn_io_thread(thread, body).map_err(|e| {
        Error::new(
            ErrorKind::Io,
            format!(
                "cannot start the {} {} thread: {e}",
                names.tier, names.worker
            ),
        )
        .with_source(e)
    })
}

impl<C> TierFront<C> {
    /// The front of a started worker: commands go on `cmd_tx`, results and events come back
    /// on `results_rx` and `events_rx`; at most `max_queued_jobs` jobs wait.
    pub fn new(
        names: TierNames,
        cmd_tx: Sender<C>,
        results_rx: Receiver<JobResult>,
        events_rx: Receiver<OffloadingEvent>,
        worker: JoinHandle<()>,
        max_queued_jobs: usize,
    ) -> Self {
        TierFront {
            names,
            cmd_tx: Some(cmd_tx),
            results_rx,
            events_rx,
            ledger: JobLedger::default(),
            worker: Some(worker),
            max_queued_jobs,
        }
    }

    /// The command channel, until the tier is stopped.
    pub fn commands(&self) -> Option<&Sender<C>> {
        self.cmd_tx.as_ref()
    }

    /// Hands `job` to the worker through `send` (with the command channel), or reports it at
    /// once: an empty or malformed job, a full queue (`jobs_rejected`), a stopped tier. The
    /// job counts in `queued_jobs` from the send until the worker starts it.
    pub fn enqueue(
        &mut self,
        job: TransferJob,
        m: &dyn JobCounters,
        send: impl FnOnce(&Sender<C>, TransferJob) -> std::result::Result<(), SendRefused>,
    ) {
        let job_id = job.job_id;
        if !self.ledger.admit(&job) {
            return;
        }
        let tier = self.names.tier;
        if m.queued_jobs().load(Ordering::Relaxed) >= self.max_queued_jobs as u64 {
            m.jobs_rejected().fetch_add(1, Ordering::Relaxed);
            self.ledger
                .refuse(job_id, queue_full(tier, job_id, self.max_queued_jobs));
            return;
        }
        let Some(tx) = &self.cmd_tx else {
            let e = Error::new(ErrorKind::Closed, format!("the {tier} tier is shut down"));
            self.ledger.refuse(job_id, e);
            return;
        };
        m.queued_jobs().fetch_add(1, Ordering::Relaxed);
        if let Err(why) = send(tx, job) {
            m.queued_jobs().fetch_sub(1, Ordering::Relaxed);
            let e = match why {
                SendRefused::Full => {
                    m.jobs_rejected().fetch_add(1, Ordering::Relaxed);
                    Error::new(
                        ErrorKind::NoSpace,
                        format!("{tier} job channel is full; job {job_id} refused"),
                    )
                }
                SendRefused::Closed => Error::new(
                    ErrorKind::Closed,
                    format!("the {tier} {} thread has stopped", self.names.worker),
                ),
            };
            self.ledger.refuse(job_id, e);
        }
    }

    /// The results reported since the last call, each once.
    pub fn finished(&mut self) -> Vec<JobResult> {
        self.ledger.collect(&self.results_rx)
    }

    /// Jobs submitted and not yet collected.
    pub fn outstanding(&self) -> usize {
        self.ledger.outstanding()
    }

    /// The events sent since the last call.
    pub fn take_events(&self) -> Vec<OffloadingEvent> {
        self.events_rx.try_iter().collect()
    }

    /// Sends the command `drain` builds around an acknowledgement and waits for it (the
    /// worker cancels what has not started and finishes the rest). Nothing once stopped.
    pub fn drain(&self, drain: impl FnOnce(Sender<()>) -> C) {
        let Some(tx) = &self.cmd_tx else { return };
        let (ack_tx, ack_rx) = crossbeam_channel::bounded(1);
        if tx.send(drain(ack_tx)).is_ok() {
            let _ = ack_rx.recv();
        }
    }

    /// Sends the command `shutdown` builds, waits for its answer and joins the worker (see
    /// [`stop_worker`]). Ok at once when already stopped.
    pub fn stop(&mut self, shutdown: impl FnOnce(Sender<Result<()>>) -> C) -> Result<()> {
        let Some(tx) = self.cmd_tx.take() else {
            return Ok(());
        };
        stop_worker(tx, shutdown, self.worker.take(), self.names.tier)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::worker::tests::{Counters, job};

    enum Cmd {
        Job(TransferJob),
        Drain(Sender<()>),
        Shutdown(Sender<Result<()>>),
    }

    fn message(r: &JobResult) -> (ErrorKind, String) {
        let e = r.error.as_ref().expect("an error");
        (e.kind(), e.message().to_string())
    }

    #[test]
    fn refused_jobs_are_reported_at_once_with_the_tier_named() {
        let names = TierNames {
            tier: "T",
            worker: "helper",
        };
        let (cmd_tx, cmd_rx) = crossbeam_channel::unbounded::<Cmd>();
        let (results_tx, results_rx) = crossbeam_channel::unbounded();
        let (_events_tx, events_rx) = crossbeam_channel::unbounded();
        // The worker: reports each job, answers drains and the shutdown.
        let worker = spawn_worker(names, "kvtier-test-front".into(), move || {
            while let Ok(cmd) = cmd_rx.recv() {
                match cmd {
                    Cmd::Job(j) => {
                        let _ = results_tx.send(JobResult::ok(j.job_id, Default::default(), 1));
                    }
                    Cmd::Drain(ack) => {
                        let _ = ack.send(());
                    }
                    Cmd::Shutdown(ack) => {
                        let _ = ack.send(Ok(()));
                        return;
                    }
                }
            }
        })
        .unwrap();
        let m = Counters::default();
        let mut f = TierFront::new(names, cmd_tx, results_rx, events_rx, worker, 1);
        let send = |tx: &Sender<Cmd>, j| tx.send(Cmd::Job(j)).map_err(|_| SendRefused::Closed);
        f.enqueue(job(1, 0), &m, send);
        f.enqueue(job(2, 1), &m, |_, _| Err(SendRefused::Full));
        f.enqueue(job(3, 1), &m, |_, _| Err(SendRefused::Closed));
        assert_eq!(
            m.queued_jobs.load(Ordering::Relaxed),
            0,
            "refused sends are not queued"
        );
        m.queued_jobs.store(1, Ordering::Relaxed);
        f.enqueue(job(4, 1), &m, send);
        m.queued_jobs.store(0, Ordering::Relaxed);
        f.enqueue(job(5, 1), &m, send);
        assert_eq!(
            m.queued_jobs.load(Ordering::Relaxed),
            1,
            "job 5 went to the worker"
        );
        assert_eq!(m.jobs_rejected.load(Ordering::Relaxed), 2);
        f.drain(Cmd::Drain);
        assert_eq!(f.outstanding(), 5);
        let out = f.finished();
        assert_eq!(f.outstanding(), 0);
        let ids: Vec<_> = out.iter().map(|r| (r.job_id, r.success)).collect();
        assert_eq!(
            ids,
            [(1, true), (2, false), (3, false), (4, false), (5, true)]
        );
        assert_eq!(
            message(&out[1]),
            (
                ErrorKind::NoSpace,
                "T job channel is full; job 2 refused".into()
            )
        );
        assert_eq!(
            message(&out[2]),
            (ErrorKind::Closed, "the T helper thread has stopped".into())
        );
        assert_eq!(
            message(&out[3]),
            (
                ErrorKind::NoSpace,
                "T job queue is full (1 jobs); job 4 refused".into()
            )
        );
        f.stop(Cmd::Shutdown).unwrap();
        assert!(f.commands().is_none());
        f.stop(Cmd::Shutdown).expect("stopping twice is fine");
        // (The worker would have counted job 5 off when it started it.)
        m.queued_jobs.store(0, Ordering::Relaxed);
        f.enqueue(job(6, 1), &m, send);
        let out = f.finished();
        assert_eq!(
            message(&out[0]),
            (ErrorKind::Closed, "the T tier is shut down".into())
        );
    }
}
