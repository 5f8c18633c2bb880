//! The scheduler-side bookkeeping every tier with a worker thread shares (G3, fs): which jobs
//! are reported without reaching the worker (empty, malformed, refused), how many jobs are not
//! reported yet, and the shutdown handshake with the worker.

use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

use crate::contract::job::{JobId, JobResult, TransferJob};
use crate::error::{Error, ErrorKind, Result};

/// Jobs submitted and not yet reported, and the results reported without the worker.
#[derive(Debug, Default)]
pub struct JobLedger {
    outstanding: usize,
    local: Vec<JobResult>,
}

impl JobLedger {
    /// Counts `job` as submitted. False (the job is then reported here) when it must not go
    /// to the worker: an empty job succeeds at once (the contract wants a result even then),
    /// a job whose keys and rows differ in number fails.
    pub fn admit(&mut self, job: &TransferJob) -> bool {
        self.outstanding += 1;
        if job.keys.is_empty() {
            self.local
                .push(JobResult::ok(job.job_id, Default::default(), 0));
            return false;
        }
        if job.keys.len() != job.chunk_ids.len() {
            let e = Error::new(
                ErrorKind::Contract,
                format!(
                    "job {} has {} keys but {} chunk ids",
                    job.job_id,
                    job.keys.len(),
                    job.chunk_ids.len()
                ),
            );
            self.local.push(JobResult::failed(job.job_id, e));
            return false;
        }
        true
    }

    /// Reports an admitted job failed at once with `e` (queue full, tier shut down).
    pub fn refuse(&mut self, job_id: JobId, e: Error) {
        self.local.push(JobResult::failed(job_id, e));
    }

    /// The results reported here and those the worker sent on `rx`, each once.
    pub fn collect(&mut self, rx: &Receiver<JobResult>) -> Vec<JobResult> {
        let mut out = std::mem::take(&mut self.local);
        out.extend(rx.try_iter());
        self.outstanding = self.outstanding.saturating_sub(out.len());
        out
    }

    /// Jobs submitted and not yet collected.
    pub fn outstanding(&self) -> usize {
        self.outstanding
    }
}

/// The error for a job refused because `max` jobs already wait in `tier`'s queue.
pub fn queue_full(tier: &str, job_id: JobId, max: usize) -> Error {
    Error::new(
        ErrorKind::NoSpace,
        format!("{tier} job queue is full ({max} jobs); job {job_id} refused"),
    )
}

/// Sends the worker its shutdown command (built by `command` around the acknowledgement
/// sender), waits for the acknowledgement and joins the thread. `tier` names it in errors.
/// An error means the worker may not have stopped its I/O: keep the primary region mapped.
pub fn stop_worker<C>(
    tx: Sender<C>,
    command: impl FnOnce(Sender<Result<()>>) -> C,
    worker: Option<JoinHandle<()>>,
    tier: &str,
) -> Result<()> {
    let (ack_tx, ack_rx) = crossbeam_channel::bounded(1);
    let sent = tx.send(command(ack_tx)).is_ok();
    drop(tx);
    let result = if sent {
        ack_rx.recv().unwrap_or_else(|_| {
            Err(Error::new(
                ErrorKind::Internal,
                format!("the {tier} worker exited without shutting down"),
            ))
        })
    } else {
        Err(Error::new(
            ErrorKind::Internal,
            format!("the {tier} worker thread was already gone"),
        ))
    };
    if let Some(h) = worker
        && h.join().is_err()
    {
        return Err(Error::new(
            ErrorKind::Internal,
            format!(
                "the {tier} worker thread panicked; I/O may still reference the primary region"
            ),
        ));
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(id: JobId, keys: usize, rows: usize) -> TransferJob {
        TransferJob {
            job_id: id,
            keys: (0..keys as u8).map(|i| crate::ChunkKey::new([i])).collect(),
            chunk_ids: (0..rows as u32).collect(),
            is_promotion: false,
            req_id: "r".into(),
            submit_time: std::time::Instant::now(),
        }
    }

    #[test]
    fn local_results_are_collected_once_with_the_worker_results() {
        let mut l = JobLedger::default();
        assert!(!l.admit(&job(1, 0, 0)));
        assert!(!l.admit(&job(2, 2, 1)));
        assert!(l.admit(&job(3, 1, 1)));
        l.refuse(3, queue_full("fs", 3, 7));
        assert!(l.admit(&job(4, 1, 1)));
        let (tx, rx) = crossbeam_channel::unbounded();
        tx.send(JobResult::ok(4, Default::default(), 1)).unwrap();
        let out = l.collect(&rx);
        let ids: Vec<_> = out.iter().map(|r| (r.job_id, r.success)).collect();
        assert_eq!(ids, [(1, true), (2, false), (3, false), (4, true)]);
        assert_eq!(out[1].error.as_ref().unwrap().kind(), ErrorKind::Contract);
        assert_eq!(out[2].error.as_ref().unwrap().kind(), ErrorKind::NoSpace);
        assert_eq!(l.outstanding(), 0);
        assert!(l.collect(&rx).is_empty());
    }

    #[test]
    fn stopping_a_gone_worker_is_an_error() {
        let (tx, rx) = crossbeam_channel::unbounded::<Sender<Result<()>>>();
        drop(rx);
        let e = stop_worker(tx, |ack| ack, None, "t").unwrap_err();
        assert!(e.to_string().contains("already gone"), "{e}");
        let (tx, rx) = crossbeam_channel::unbounded::<Sender<Result<()>>>();
        let h = std::thread::spawn(move || {
            let ack = rx.recv().unwrap();
            ack.send(Ok(())).unwrap();
        });
        stop_worker(tx, |ack| ack, Some(h), "t").unwrap();
    }
}
