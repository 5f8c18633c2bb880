//! The worker side every tier with a worker thread shares (G3, fs): the job queue with its
//! byte cap, a job's per-key progress and its result, the thread loop that blocks when idle
//! and answers drains and the shutdown, and the stored / removed events.
//!
//! What differs between the tiers (how a key's transfer is executed, what the worker waits
//! on) stays in the tier: it implements [`WorkerLoop`] and turns each [`Next`] the queue hands
//! out into its own I/O.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use crossbeam_channel::Sender;

use crate::contract::job::{JobResult, Locality, Medium, OffloadingEvent, TransferJob};
use crate::error::{Error, ErrorKind, Result};
use crate::key::ChunkKey;

/// The job gauges and counters a tier's metrics keep (their names stay the tier's own).
pub(crate) trait JobCounters {
    /// Jobs submitted and not yet started.
    fn queued_jobs(&self) -> &AtomicU64;
    /// Jobs started and not yet reported.
    fn active_jobs(&self) -> &AtomicU64;
    /// Jobs cancelled by a drain or the shutdown before they started.
    fn jobs_cancelled(&self) -> &AtomicU64;
    /// Jobs refused because the queue was full.
    fn jobs_rejected(&self) -> &AtomicU64;
    /// Bytes of transfers handed to the I/O and not finished.
    fn bytes_in_flight(&self) -> &AtomicU64;
}

/// Implements [`JobCounters`] for a metrics type whose fields carry the trait's method names.
macro_rules! job_counters {
    ($metrics:ty) => {
        impl $crate::contract::worker::JobCounters for $metrics {
            fn queued_jobs(&self) -> &::std::sync::atomic::AtomicU64 {
                &self.queued_jobs
            }
            fn active_jobs(&self) -> &::std::sync::atomic::AtomicU64 {
                &self.active_jobs
            }
            fn jobs_cancelled(&self) -> &::std::sync::atomic::AtomicU64 {
                &self.jobs_cancelled
            }
            fn jobs_rejected(&self) -> &::std::sync::atomic::AtomicU64 {
                &self.jobs_rejected
            }
            fn bytes_in_flight(&self) -> &::std::sync::atomic::AtomicU64 {
                &self.bytes_in_flight
            }
        }
    };
}
pub(crate) use job_counters;

/// What the queue hands out next (see [`JobQueue::next`]).
#[derive(Debug)]
pub(crate) enum Next<U> {
    /// A unit of a started job, now charged to the byte budget: issue it.
    Unit(U),
    /// A queued job whose turn has come (`true`: a load): start it (its units go to
    /// [`JobQueue::push_unit`]).
    Job(TransferJob, bool),
}

/// Jobs waiting to start and the units (one key's transfer each, `unit_bytes` bytes) of
/// started jobs waiting for room under `max_bytes_in_flight`. Stores and loads share the
/// budget. A unit always goes when nothing is in flight, so a budget smaller than one unit
/// still makes progress.
#[derive(Debug)]
pub(crate) struct JobQueue<U> {
    cap: u64,
    unit_bytes: u64,
    jobs: VecDeque<(TransferJob, bool)>,
    units: VecDeque<U>,
    in_flight: u64,
    next_serial: u32,
}

impl<U> JobQueue<U> {
    /// An empty queue for `cap` bytes in flight, in units of `unit_bytes`.
    pub fn new(cap: u64, unit_bytes: u64) -> Self {
        JobQueue {
            cap,
            unit_bytes,
            jobs: VecDeque::new(),
            units: VecDeque::new(),
            in_flight: 0,
            next_serial: 0,
        }
    }

    /// A serial for a started job (its units' tags carry it; wraps around).
    pub fn next_serial(&mut self) -> u32 {
        let serial = self.next_serial;
        self.next_serial = serial.wrapping_add(1);
        serial
    }

    /// Queues a job (`load`: files to primary) behind the others.
    pub fn push_job(&mut self, job: TransferJob, load: bool) {
        self.jobs.push_back((job, load));
    }

    /// Queues a started job's unit behind the others.
    pub fn push_unit(&mut self, unit: U) {
        self.units.push_back(unit);
    }

    /// Takes out the waiting units `unwanted` picks (never charged to the budget) and returns
    /// them.
    pub fn take_units(&mut self, mut unwanted: impl FnMut(&U) -> bool) -> Vec<U> {
        let (taken, kept): (VecDeque<U>, VecDeque<U>) = std::mem::take(&mut self.units)
            .into_iter()
            .partition(|u| unwanted(u));
        self.units = kept;
        taken.into()
    }

    /// Queues a unit ahead of every other (it has waited already).
    pub fn push_unit_front(&mut self, unit: U) {
        self.units.push_front(unit);
    }

    /// The next unit while the budget has room for it (charged to the budget), else, when
    /// no unit waits and the budget is not spent, the next job (counted off `queued_jobs`).
    /// `None`: nothing may go now.
    pub fn next(&mut self, m: &dyn JobCounters) -> Option<Next<U>> {
        if !self.units.is_empty() {
            if self.in_flight > 0 && self.in_flight + self.unit_bytes > self.cap {
                return None;
            }
            self.in_flight += self.unit_bytes;
            return self.units.pop_front().map(Next::Unit);
        }
        if self.in_flight >= self.cap {
            return None;
        }
        let (job, load) = self.jobs.pop_front()?;
        m.queued_jobs().fetch_sub(1, Ordering::Relaxed);
        Some(Next::Job(job, load))
    }

    /// One unit handed out by [`JobQueue::next`] finished, or never went (its bytes return to
    /// the budget).
    pub fn release(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(self.unit_bytes);
    }

    /// Forgets every waiting unit and every byte in flight (the I/O engine is gone).
    pub fn forget_units(&mut self) {
        self.units.clear();
        self.in_flight = 0;
    }

    /// Publishes the bytes in flight to the `bytes_in_flight` gauge.
    pub fn publish(&self, m: &dyn JobCounters) {
        m.bytes_in_flight().store(self.in_flight, Ordering::Relaxed);
    }

    /// Bytes in flight now.
    pub fn in_flight(&self) -> u64 {
        self.in_flight
    }

    /// True when no job waits to start.
    pub fn no_jobs(&self) -> bool {
        self.jobs.is_empty()
    }

    /// True when no unit waits for the budget.
    pub fn no_units(&self) -> bool {
        self.units.is_empty()
    }

    /// Fails every job that has not started (a drain or the shutdown): `Cancelled`, counted
    /// in `jobs_cancelled`, each result sent on `results`. `tier` names the tier in the error.
    pub fn cancel_jobs(&mut self, tier: &str, m: &dyn JobCounters, results: &Sender<JobResult>) {
        while let Some((job, _)) = self.jobs.pop_front() {
            m.queued_jobs().fetch_sub(1, Ordering::Relaxed);
            m.jobs_cancelled().fetch_add(1, Ordering::Relaxed);
            let e = Error::new(
                ErrorKind::Cancelled,
                format!(
                    "{tier} job {} was cancelled by a drain before it started",
                    job.job_id
                ),
            );
            let _ = results.send(JobResult::failed(job.job_id, e));
        }
    }
}

/// Where one key of a started job stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyStatus {
    /// Not finished: its transfer waits or (G3) runs.
    Pending,
    /// Its transfer runs (fs: handed to the I/O threads).
    Running,
    /// Nothing to move (a store of a key already held).
    Skipped,
    /// Moved.
    Done,
    /// Failed (the job's first error says why).
    Failed,
}

/// A started job: its keys and rows, each key's status, and what the tier keeps besides
/// (`tier`).
#[derive(Debug)]
pub(crate) struct JobRun<T> {
    /// The caller's job id.
    pub job_id: u64,
    /// Files to primary (true) or primary to files.
    pub load: bool,
    /// The keys, in the job's order.
    pub keys: Vec<ChunkKey>,
    /// Each key's primary row.
    pub rows: Vec<u32>,
    /// Each key's status.
    pub status: Vec<KeyStatus>,
    /// Transfers not finished.
    pub remaining: usize,
    /// Bytes moved.
    pub bytes: u64,
    /// When it started.
    pub started: Instant,
    /// The first key failure.
    pub first_error: Option<Error>,
    /// What the tier keeps per job.
    pub tier: T,
}

impl<T> JobRun<T> {
    /// `job` started (`load`: files to primary), its keys all pending; counted in
    /// `active_jobs` until [`JobRun::into_result`].
    pub fn of(job: TransferJob, load: bool, tier: T, m: &dyn JobCounters) -> Self {
        Self::start(job.job_id, load, job.keys, job.chunk_ids, tier, m)
    }

    /// A job whose keys are all pending; counted in `active_jobs` until
    /// [`JobRun::into_result`].
    pub fn start(
        job_id: u64,
        load: bool,
        keys: Vec<ChunkKey>,
        rows: Vec<u32>,
        tier: T,
        m: &dyn JobCounters,
    ) -> Self {
        m.active_jobs().fetch_add(1, Ordering::Relaxed);
        let n = keys.len();
        JobRun {
            job_id,
            load,
            keys,
            rows,
            status: vec![KeyStatus::Pending; n],
            remaining: 0,
            bytes: 0,
            started: Instant::now(),
            first_error: None,
            tier,
        }
    }

    /// Key `i` failed with `e` (the job's error when it is the first).
    pub fn fail(&mut self, i: usize, e: Error) {
        self.status[i] = KeyStatus::Failed;
        if self.first_error.is_none() {
            self.first_error = Some(e);
        }
    }

    /// Key `i` has nothing to move (a store of a key already held), counted in `skipped`.
    pub fn skip(&mut self, i: usize, skipped: &AtomicU64) {
        self.status[i] = KeyStatus::Skipped;
        skipped.fetch_add(1, Ordering::Relaxed);
    }

    /// [`JobRun::fail`], the key named in the error's context.
    pub fn fail_key(&mut self, i: usize, e: Error) {
        let e = e.with("key", self.keys[i].to_hex());
        self.fail(i, e);
    }

    /// Keys with `status`.
    pub fn count(&self, status: KeyStatus) -> usize {
        self.status.iter().filter(|s| **s == status).count()
    }

    /// The keys that moved, in the job's order.
    pub fn done_keys(&self) -> Vec<ChunkKey> {
        self.keys
            .iter()
            .zip(&self.status)
            .filter(|(_, s)| **s == KeyStatus::Done)
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// The job's result (counted off `active_jobs`): success when every key moved or was
    /// skipped, nothing else; a failed job names `loaded` (when not empty) as the keys that
    /// did reach their rows.
    pub fn into_result(self, loaded: Option<Vec<ChunkKey>>, m: &dyn JobCounters) -> JobResult {
        let ok = self
            .status
            .iter()
            .all(|s| matches!(s, KeyStatus::Done | KeyStatus::Skipped));
        let elapsed = self.started.elapsed();
        m.active_jobs().fetch_sub(1, Ordering::Relaxed);
        if ok {
            return JobResult::ok(self.job_id, elapsed, self.bytes);
        }
        JobResult {
            job_id: self.job_id,
            success: false,
            successful_keys: loaded.filter(|l| !l.is_empty()),
            transfer_time: Some(elapsed),
            transfer_bytes: Some(self.bytes),
            error: self.first_error,
        }
    }
}

/// Where a tier's stored / removed events go, stamped with its id and locality.
#[derive(Debug)]
pub(crate) struct EventSink {
    tx: Sender<OffloadingEvent>,
    tier_id: String,
    locality: Option<Locality>,
}

impl EventSink {
    /// Events of tier `tier_id` at `locality`, sent on `tx`.
    pub fn new(tx: Sender<OffloadingEvent>, tier_id: String, locality: Option<Locality>) -> Self {
        EventSink {
            tx,
            tier_id,
            locality,
        }
    }

    /// The tier's id.
    pub fn tier_id(&self) -> &str {
        &self.tier_id
    }

    /// Sends that `keys` were stored (or `removed`), when `enabled` says events are recorded.
    pub fn send(&self, enabled: &AtomicBool, keys: Vec<ChunkKey>, removed: bool) {
        if !enabled.load(Ordering::Relaxed) {
            return;
        }
        let _ = self.tx.send(OffloadingEvent {
            keys,
            medium: Medium::Storage,
            removed,
            locality: self.locality,
            ownership: Some(self.tier_id.clone()),
            removal_expected: true,
            metadata_only: false,
        });
    }
}

/// A worker's drains and shutdown: who waits for the worker to be idle, and whether it stops
/// then.
#[derive(Debug)]
pub(crate) struct Lifecycle {
    drain_waiters: Vec<Sender<()>>,
    shutdown_ack: Option<Sender<Result<()>>>,
    commands_open: bool,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Lifecycle {
            drain_waiters: Vec::new(),
            shutdown_ack: None,
            commands_open: true,
        }
    }
}

impl Lifecycle {
    /// `ack` is signalled the next time the worker is idle.
    pub fn drain(&mut self, ack: Sender<()>) {
        self.drain_waiters.push(ack);
    }

    /// The worker stops (and answers `ack`) the next time it is idle.
    pub fn shutdown(&mut self, ack: Sender<Result<()>>) {
        self.shutdown_ack = Some(ack);
    }

    /// True once a shutdown was asked for.
    pub fn stopping(&self) -> bool {
        self.shutdown_ack.is_some()
    }

    /// The tier dropped its command channel: the worker stops when idle.
    pub fn commands_closed(&mut self) {
        self.commands_open = false;
    }

    /// True while the tier's command channel is connected.
    pub fn commands_open(&self) -> bool {
        self.commands_open
    }
}

/// What a tier's worker thread does; [`run_worker`] drives it.
pub(crate) trait WorkerLoop {
    /// Its drains and shutdown.
    fn life(&mut self) -> &mut Lifecycle;
    /// Takes what is waiting without blocking, issues what the byte budget allows and
    /// finishes what has completed.
    fn advance(&mut self);
    /// True when no job is queued, started or being finished.
    fn idle(&self) -> bool;
    /// Stops the worker's I/O (it is idle): the shutdown's answer.
    fn close(&mut self) -> Result<()>;
    /// Blocks until a command, a step or a completion arrives, and handles it.
    fn wait(&mut self);
}

/// The thread body: advance; when idle, answer the drains, and stop when a shutdown was asked
/// for (or the tier is gone); else block until something arrives.
pub(crate) fn run_worker(w: &mut impl WorkerLoop) {
    loop {
        w.advance();
        if w.idle() {
            let life = w.life();
            for d in life.drain_waiters.drain(..) {
                let _ = d.send(());
            }
            if life.shutdown_ack.is_some() || !life.commands_open {
                let result = w.close();
                if let Some(ack) = w.life().shutdown_ack.take() {
                    let _ = ack.send(result);
                }
                return;
            }
        }
        w.wait();
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crossbeam_channel::Receiver;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    /// The job counters of a test.
    #[derive(Default)]
    pub(crate) struct Counters {
        pub queued_jobs: AtomicU64,
        pub active_jobs: AtomicU64,
        pub jobs_cancelled: AtomicU64,
        pub jobs_rejected: AtomicU64,
        pub bytes_in_flight: AtomicU64,
    }

    job_counters!(Counters);

    /// Job `id` of `keys` keys (rows 0, 1, ...).
    pub(crate) fn job(id: u64, keys: usize) -> TransferJob {
        TransferJob {
            job_id: id,
            keys: (0..keys as u8).map(|i| ChunkKey::new([i])).collect(),
            chunk_ids: (0..keys as u32).collect(),
            is_promotion: false,
            req_id: "r".into(),
            submit_time: Instant::now(),
        }
    }

    fn unit(n: Option<Next<u32>>) -> Option<u32> {
        match n {
            Some(Next::Unit(u)) => Some(u),
            _ => None,
        }
    }

    #[test]
    fn the_byte_cap_holds_units_and_jobs_back_until_bytes_come_back() {
        let m = Counters::default();
        // Room for two units of 10 bytes.
        let mut q = JobQueue::<u32>::new(20, 10);
        q.push_job(job(1, 3), false);
        q.push_job(job(2, 1), true);
        m.queued_jobs.store(2, Ordering::Relaxed);
        let Some(Next::Job(j, false)) = q.next(&m) else {
            panic!("the first job starts");
        };
        assert_eq!(j.job_id, 1);
        assert_eq!(m.queued_jobs.load(Ordering::Relaxed), 1);
        (0..3).for_each(|u| q.push_unit(u));
        assert_eq!(unit(q.next(&m)), Some(0));
        assert_eq!(unit(q.next(&m)), Some(1));
        assert!(q.next(&m).is_none(), "a third unit would pass the cap");
        q.publish(&m);
        assert_eq!(m.bytes_in_flight.load(Ordering::Relaxed), 20);
        q.release();
        assert_eq!(unit(q.next(&m)), Some(2));
        assert!(q.no_units());
        assert!(
            q.next(&m).is_none(),
            "no job starts while the budget is spent"
        );
        assert_eq!(m.queued_jobs.load(Ordering::Relaxed), 1);
        q.release();
        let Some(Next::Job(j, true)) = q.next(&m) else {
            panic!("the second job starts once bytes came back");
        };
        assert_eq!(j.job_id, 2);
        assert_eq!(m.queued_jobs.load(Ordering::Relaxed), 0);
        assert!(q.no_jobs());
        assert_eq!(q.in_flight(), 10);
    }

    #[test]
    fn a_unit_larger_than_the_cap_goes_alone() {
        let m = Counters::default();
        let mut q = JobQueue::<u32>::new(5, 10);
        q.push_unit(7);
        q.push_unit_front(6);
        assert_eq!(
            unit(q.next(&m)),
            Some(6),
            "the unit put in front goes first"
        );
        assert!(q.next(&m).is_none());
        q.release();
        assert_eq!(unit(q.next(&m)), Some(7));
        q.forget_units();
        assert_eq!(q.in_flight(), 0);
    }

    #[test]
    fn cancelled_jobs_fail_with_the_tier_named() {
        let m = Counters::default();
        let mut q = JobQueue::<u32>::new(20, 10);
        q.push_job(job(4, 1), false);
        q.push_job(job(5, 1), true);
        m.queued_jobs.store(2, Ordering::Relaxed);
        let (tx, rx) = crossbeam_channel::unbounded();
        q.cancel_jobs("fs", &m, &tx);
        let out: Vec<JobResult> = rx.try_iter().collect();
        assert_eq!(out.iter().map(|r| r.job_id).collect::<Vec<_>>(), [4, 5]);
        let e = out[0].error.as_ref().unwrap();
        assert_eq!(e.kind(), ErrorKind::Cancelled);
        assert_eq!(
            e.message(),
            "fs job 4 was cancelled by a drain before it started"
        );
        assert!(!out[1].success);
        assert_eq!(m.queued_jobs.load(Ordering::Relaxed), 0);
        assert_eq!(m.jobs_cancelled.load(Ordering::Relaxed), 2);
        assert!(q.no_jobs());
    }

    #[test]
    fn a_job_succeeds_only_when_every_key_moved_or_was_skipped() {
        let m = Counters::default();
        let keys: Vec<ChunkKey> = (0..3u8).map(|i| ChunkKey::new([i])).collect();
        let mut a = JobRun::start(9, true, keys.clone(), vec![0, 1, 2], (), &m);
        assert_eq!(m.active_jobs.load(Ordering::Relaxed), 1);
        let skipped = AtomicU64::new(0);
        a.status[0] = KeyStatus::Done;
        a.skip(1, &skipped);
        a.status[2] = KeyStatus::Done;
        assert_eq!(skipped.load(Ordering::Relaxed), 1);
        let r = a.into_result(None, &m);
        assert!(r.success);
        assert_eq!(m.active_jobs.load(Ordering::Relaxed), 0);

        let mut a = JobRun::start(10, true, keys.clone(), vec![0, 1, 2], (), &m);
        a.status[0] = KeyStatus::Done;
        a.fail_key(1, Error::new(ErrorKind::Io, "boom"));
        a.fail(2, Error::new(ErrorKind::Io, "second"));
        assert_eq!(a.count(KeyStatus::Failed), 2);
        assert_eq!(a.done_keys(), vec![keys[0].clone()]);
        let loaded = Some(a.done_keys());
        let r = a.into_result(loaded, &m);
        assert!(!r.success);
        assert_eq!(r.successful_keys, Some(vec![keys[0].clone()]));
        let e = r.error.unwrap();
        assert_eq!(e.message(), "boom", "the first failure is the job's error");
        assert!(e.to_string().contains(&keys[1].to_hex()), "{e}");

        let mut a = JobRun::start(11, false, keys, vec![0, 1, 2], (), &m);
        a.fail(0, Error::new(ErrorKind::Io, "x"));
        let r = a.into_result(Some(Vec::new()), &m);
        assert_eq!(r.successful_keys, None, "no keys: none named");
        assert_eq!(m.active_jobs.load(Ordering::Relaxed), 0);
    }

    /// A worker whose jobs are counters: `Work(n)` starts n, `Done` finishes one.
    enum Msg {
        Work(usize),
        Done,
        Drain(Sender<()>),
        Shutdown(Sender<Result<()>>),
    }

    struct TestWorker {
        life: Lifecycle,
        rx: Receiver<Msg>,
        work: usize,
        advances: Arc<AtomicUsize>,
        closes: Arc<AtomicUsize>,
    }

    impl WorkerLoop for TestWorker {
        fn life(&mut self) -> &mut Lifecycle {
            &mut self.life
        }
        fn advance(&mut self) {
            self.advances.fetch_add(1, Ordering::SeqCst);
        }
        fn idle(&self) -> bool {
            self.work == 0
        }
        fn close(&mut self) -> Result<()> {
            self.closes.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        fn wait(&mut self) {
            match self.rx.recv() {
                Ok(Msg::Work(n)) => self.work += n,
                Ok(Msg::Done) => self.work -= 1,
                Ok(Msg::Drain(ack)) => self.life.drain(ack),
                Ok(Msg::Shutdown(ack)) => self.life.shutdown(ack),
                Err(_) => self.life.commands_closed(),
            }
        }
    }

    struct Running {
        tx: Sender<Msg>,
        advances: Arc<AtomicUsize>,
        closes: Arc<AtomicUsize>,
        thread: std::thread::JoinHandle<()>,
    }

    fn start() -> Running {
        let (tx, rx) = crossbeam_channel::unbounded();
        let advances = Arc::new(AtomicUsize::new(0));
        let closes = Arc::new(AtomicUsize::new(0));
        let mut w = TestWorker {
            life: Lifecycle::default(),
            rx,
            work: 0,
            advances: advances.clone(),
            closes: closes.clone(),
        };
        let thread = std::thread::spawn(move || run_worker(&mut w));
        Running {
            tx,
            advances,
            closes,
            thread,
        }
    }

    fn eventually(what: &str, f: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn an_idle_worker_blocks_until_something_arrives() {
        let r = start();
        eventually("the first turn", || r.advances.load(Ordering::SeqCst) == 1);
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(
            r.advances.load(Ordering::SeqCst),
            1,
            "an idle worker with nothing to do takes no further turn"
        );
        r.tx.send(Msg::Work(1)).unwrap();
        eventually("a turn per message", || {
            r.advances.load(Ordering::SeqCst) == 2
        });
        r.tx.send(Msg::Done).unwrap();
        eventually("a turn per message", || {
            r.advances.load(Ordering::SeqCst) == 3
        });
        assert_eq!(r.closes.load(Ordering::SeqCst), 0, "still running");
        drop(r.tx);
        r.thread.join().unwrap();
        assert_eq!(r.closes.load(Ordering::SeqCst), 1, "a gone tier stops it");
    }

    #[test]
    fn drains_and_the_shutdown_are_answered_only_when_the_work_is_done() {
        let r = start();
        r.tx.send(Msg::Work(2)).unwrap();
        let (drain_tx, drain_rx) = crossbeam_channel::bounded(1);
        r.tx.send(Msg::Drain(drain_tx)).unwrap();
        assert!(
            drain_rx.recv_timeout(Duration::from_millis(50)).is_err(),
            "a drain waits for started work"
        );
        r.tx.send(Msg::Done).unwrap();
        let (ack_tx, ack_rx) = crossbeam_channel::bounded(1);
        r.tx.send(Msg::Shutdown(ack_tx)).unwrap();
        assert!(drain_rx.recv_timeout(Duration::from_millis(50)).is_err());
        assert!(
            ack_rx.recv_timeout(Duration::from_millis(50)).is_err(),
            "the shutdown waits for started work"
        );
        assert_eq!(r.closes.load(Ordering::SeqCst), 0);
        r.tx.send(Msg::Done).unwrap();
        drain_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the drain is answered once idle");
        ack_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the shutdown is answered once idle")
            .unwrap();
        r.thread.join().unwrap();
        assert_eq!(
            r.closes.load(Ordering::SeqCst),
            1,
            "closed once, before the answer"
        );
    }
}
