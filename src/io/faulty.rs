//! The `faulty` engine: wraps another engine and injects faults, deterministically, for tests.
//!
//! Operations are numbered from 1 in the order [`IoEngine::submit`] receives them (every
//! request counts, valid or not). A [`FaultPlan`] names which operations fail with EIO, which
//! move only part of their bytes (the wrapper really transfers the shorter length through the
//! inner engine, then reports [`ErrorKind::ShortIo`]: a short transfer is never a success),
//! which reads get a bit flipped in the buffer after they complete, the latency added to every
//! completion, after how many writes every further write fails, and which operations on the
//! tier's metadata files (journal, checkpoint, their directory) fail with which `errno`
//! ([`MetaFault`], through [`IoEngine::meta_fault`]), and which reads, writes or syncs of
//! which data file fail with which `errno` ([`DataFault`]: EINTR, EAGAIN, ECANCELED, ENOSPC,
//! EIO, ...). An injected EINTR or EAGAIN stands for a file that kept answering it past the
//! engines' bounded resubmission (`MAX_TRANSIENT_RETRIES` in `io/files.rs`).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Select, Sender};
use parking_lot::{Mutex, RwLock};

use crate::error::{Error, ErrorKind, Result};
use crate::io::files::{dir_name, os_error, request_error};
use crate::io::{
    EngineHandle, EngineInfo, IoCompletion, IoDir, IoEngine, IoRequest, MetaFile, MetaOp,
};
use crate::region::PrimaryRegion;

/// Flip bit `bit` of byte `byte` (counted from the start of the request's buffer) after
/// operation `op` completes successfully as a read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BitFlip {
    /// Operation number (1-based).
    pub op: u64,
    /// Byte within the transferred range.
    pub byte: usize,
    /// Bit within the byte (0..8).
    pub bit: u8,
}

/// The builders, equality (a gate compares by identity) and counting that [`MetaFault`] and
/// [`DataFault`] share: both name their target (`file`, `op`) and fail the matching
/// operations after the first `skip`, `times` of them, while `gate` is set.
macro_rules! fault_rule {
    ($rule:ident) => {
        impl $rule {
            /// Lets the first `n` matching operations through.
            pub fn after(mut self, n: u64) -> Self {
                self.skip = n;
                self
            }

            /// Fails only `n` operations.
            pub fn times(mut self, n: u64) -> Self {
                self.times = Some(n);
                self
            }

            /// Applies only while `gate` is true.
            pub fn while_set(mut self, gate: Arc<AtomicBool>) -> Self {
                self.gate = Some(gate);
                self
            }
        }

        impl PartialEq for $rule {
            fn eq(&self, o: &Self) -> bool {
                let gate = match (&self.gate, &o.gate) {
                    (None, None) => true,
                    (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                    _ => false,
                };
                gate && (self.file, self.op, self.errno, self.skip, self.times)
                    == (o.file, o.op, o.errno, o.skip, o.times)
            }
        }

        impl Eq for $rule {}

        impl FaultRule for $rule {
            fn gate_open(&self) -> bool {
                self.gate.as_ref().is_none_or(|g| g.load(Ordering::SeqCst))
            }
            fn fails(&self, n: u64) -> bool {
                n > self.skip && self.times.is_none_or(|t| n <= self.skip + t)
            }
            fn errno(&self) -> i32 {
                self.errno
            }
        }
    };
}

/// What [`first_failure`] needs of a rule (implemented by `fault_rule!`).
trait FaultRule {
    /// Whether the rule applies now (no gate, or its gate is set).
    fn gate_open(&self) -> bool;
    /// Whether the `n`-th matching operation (1-based) fails.
    fn fails(&self, n: u64) -> bool;
    /// The error it fails them with.
    fn errno(&self) -> i32;
}

/// Counts an operation against every rule of `rules` that `targets` it (while its gate is
/// open; `seen` holds the counts, one per rule) and returns the errno of the first rule that
/// fails it.
fn first_failure<R: FaultRule>(
    rules: &[R],
    seen: &mut Vec<u64>,
    targets: impl Fn(&R) -> bool,
) -> Option<i32> {
    if rules.is_empty() {
        return None;
    }
    seen.resize(rules.len(), 0);
    let mut hit = None;
    for (rule, seen) in rules.iter().zip(seen.iter_mut()) {
        if !targets(rule) || !rule.gate_open() {
            continue;
        }
        *seen += 1;
        if rule.fails(*seen) && hit.is_none() {
            hit = Some(rule.errno());
        }
    }
    hit
}

/// Fail operations `op` on the metadata file `file` with `errno`: the matching operations
/// after the first `skip`, `times` of them (`None`: every one), while `gate` (if any) is set.
#[derive(Debug, Clone)]
pub struct MetaFault {
    /// Which file.
    pub file: MetaFile,
    /// Which operation.
    pub op: MetaOp,
    /// The error, e.g. `libc::ENOSPC`.
    pub errno: i32,
    /// Matching operations that go through before the first failure.
    pub skip: u64,
    /// How many fail (`None`: all after `skip`).
    pub times: Option<u64>,
    /// When given, the rule applies only while this is true (a test switches a fault on and
    /// off, e.g. a disk that fills up and is freed again).
    pub gate: Option<Arc<AtomicBool>>,
}

impl MetaFault {
    /// Every operation `op` on `file` fails with `errno`.
    pub fn new(file: MetaFile, op: MetaOp, errno: i32) -> Self {
        MetaFault {
            file,
            op,
            errno,
            skip: 0,
            times: None,
            gate: None,
        }
    }
}

fault_rule!(MetaFault);

/// The kind of data-file operation a [`DataFault`] matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DataOp {
    /// A read transfer.
    Read,
    /// A write transfer.
    Write,
    /// [`IoEngine::sync_data`].
    Sync,
}

/// Fail operations `op` on data file `file` (`None`: any file) with `errno`: the matching
/// operations after the first `skip`, `times` of them (`None`: every one), while `gate` (if
/// any) is set. A failed transfer moves no byte.
#[derive(Debug, Clone)]
pub struct DataFault {
    /// Which file (its index in the engine's file table), or any.
    pub file: Option<usize>,
    /// Which kind of operation.
    pub op: DataOp,
    /// The error, e.g. `libc::EINTR`.
    pub errno: i32,
    /// Matching operations that go through before the first failure.
    pub skip: u64,
    /// How many fail (`None`: all after `skip`).
    pub times: Option<u64>,
    /// When given, the rule applies only while this is true.
    pub gate: Option<Arc<AtomicBool>>,
}

impl DataFault {
    /// Every operation `op` on any data file fails with `errno`.
    pub fn new(op: DataOp, errno: i32) -> Self {
        DataFault {
            file: None,
            op,
            errno,
            skip: 0,
            times: None,
            gate: None,
        }
    }

    /// Only operations on file `file`.
    pub fn on_file(mut self, file: usize) -> Self {
        self.file = Some(file);
        self
    }
}

fault_rule!(DataFault);

/// Which faults to inject. Empty (the default) injects nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// Operations that fail with EIO without reaching the inner engine.
    pub eio_on: HashSet<u64>,
    /// Operations that move only this many bytes (then fail with ShortIo).
    pub short_on: HashMap<u64, usize>,
    /// Bits flipped in read buffers after the read completes.
    pub flips: Vec<BitFlip>,
    /// Delay added to every completion.
    pub latency: Duration,
    /// Once this many writes have been accepted, every later write fails with EIO.
    pub fail_writes_after: Option<u64>,
    /// Once this many `sync_data` calls have succeeded, every later one fails with EIO.
    pub fail_syncs_after: Option<u64>,
    /// Faults of the metadata files' operations (see [`MetaFault`]).
    pub meta: Vec<MetaFault>,
    /// Faults of the data files' operations (see [`DataFault`]).
    pub data: Vec<DataFault>,
}

impl FaultPlan {
    /// A plan that injects nothing.
    pub fn new() -> Self {
        FaultPlan::default()
    }

    /// Operation `op` fails with EIO.
    pub fn eio_on(mut self, op: u64) -> Self {
        self.eio_on.insert(op);
        self
    }

    /// Operation `op` moves only `keep` bytes and fails with ShortIo.
    pub fn short_on(mut self, op: u64, keep: usize) -> Self {
        self.short_on.insert(op, keep);
        self
    }

    /// After read `op` completes, bit `bit` of byte `byte` of its buffer is flipped.
    pub fn flip_bit(mut self, op: u64, byte: usize, bit: u8) -> Self {
        self.flips.push(BitFlip {
            op,
            byte,
            bit: bit % 8,
        });
        self
    }

    /// Every completion is delayed by `latency`.
    pub fn latency(mut self, latency: Duration) -> Self {
        self.latency = latency;
        self
    }

    /// The first `n` writes go through; every later write fails with EIO.
    pub fn fail_writes_after(mut self, n: u64) -> Self {
        self.fail_writes_after = Some(n);
        self
    }

    /// The first `n` `sync_data` calls go through; every later one fails with EIO.
    pub fn fail_syncs_after(mut self, n: u64) -> Self {
        self.fail_syncs_after = Some(n);
        self
    }

    /// Adds a metadata-file fault.
    pub fn meta(mut self, fault: MetaFault) -> Self {
        self.meta.push(fault);
        self
    }

    /// Adds a data-file fault.
    pub fn data(mut self, fault: DataFault) -> Self {
        self.data.push(fault);
        self
    }
}

/// Counts of what was injected so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultCounts {
    /// Operations failed with EIO (including writes after the write limit).
    pub eio: u64,
    /// Operations cut short.
    pub short: u64,
    /// Bits flipped.
    pub flips: u64,
    /// `sync_data` calls failed.
    pub sync_failures: u64,
    /// Metadata-file operations failed.
    pub meta_failures: u64,
    /// Data-file operations failed by a [`DataFault`].
    pub data_failures: u64,
}

/// What to do when an operation's inner completion arrives.
#[derive(Debug, Clone, Copy)]
enum OnComplete {
    Pass,
    Short,
    Flip { byte: usize, bit: u8 },
}

struct Pending {
    req: IoRequest,
    on_complete: OnComplete,
}

#[derive(Default)]
struct State {
    next_op: u64,
    writes: u64,
    syncs: u64,
    /// Keyed by operation number, which is the tag the inner engine sees.
    pending: HashMap<u64, Pending>,
    counts: FaultCounts,
    /// Matching operations seen so far, per metadata rule.
    meta_seen: Vec<u64>,
    /// Matching operations seen so far, per data rule.
    data_seen: Vec<u64>,
}

impl State {
    /// The errno of the first [`DataFault`] that fails this operation, counting it against
    /// every rule it matches.
    fn data_fault(&mut self, rules: &[DataFault], op: DataOp, file: usize) -> Option<i32> {
        let hit = first_failure(rules, &mut self.data_seen, |r| {
            r.op == op && r.file.is_none_or(|f| f == file)
        });
        if hit.is_some() {
            self.counts.data_failures += 1;
        }
        hit
    }
}

enum Control {
    Injected(IoCompletion),
    Stop,
}

/// Wraps an engine and injects the faults of a [`FaultPlan`].
pub struct FaultyEngine {
    inner: Arc<dyn IoEngine>,
    plan: FaultPlan,
    state: Arc<Mutex<State>>,
    control: RwLock<Option<Sender<Control>>>,
    done_rx: Receiver<IoCompletion>,
    forwarder: Mutex<Option<JoinHandle<()>>>,
    flips_done: Arc<AtomicU64>,
}

impl FaultyEngine {
    /// Wraps `inner`. Its completions must not be read by anyone else from now on.
    pub fn new(inner: Arc<dyn IoEngine>, plan: FaultPlan) -> Result<Self> {
        let state = Arc::new(Mutex::new(State::default()));
        let (ctl_tx, ctl_rx) = crossbeam_channel::unbounded();
        let (done_tx, done_rx) = crossbeam_channel::unbounded();
        let flips_done = Arc::new(AtomicU64::new(0));
        let fwd = Forwarder {
            inner_rx: inner.completions().clone(),
            ctl_rx,
            done_tx,
            state: state.clone(),
            region: inner.region().clone(),
            latency: plan.latency,
            flips_done: flips_done.clone(),
        };
        let thread = super::spawn_io_thread("kvtier-faulty".to_string(), move || fwd.run())
            .map_err(|e| {
                Error::new(
                    ErrorKind::Io,
                    format!("cannot start the fault forwarder: {e}"),
                )
                .with_source(e)
            })?;
        Ok(FaultyEngine {
            inner,
            plan,
            state,
            control: RwLock::new(Some(ctl_tx)),
            done_rx,
            forwarder: Mutex::new(Some(thread)),
            flips_done,
        })
    }

    /// Wraps a started engine, keeping its info (the name gets the `faulty(...)` prefix).
    pub fn wrap_handle(handle: EngineHandle, plan: FaultPlan) -> Result<EngineHandle> {
        let engine = FaultyEngine::new(handle.engine, plan)?;
        let info = EngineInfo {
            name: engine.name(),
            ..handle.info
        };
        Ok(EngineHandle {
            engine: Arc::new(engine),
            info,
        })
    }

    /// What has been injected so far.
    pub fn counts(&self) -> FaultCounts {
        let mut c = self.state.lock().counts;
        c.flips = self.flips_done.load(Ordering::Relaxed);
        c
    }

    /// Decides the fault for operation `op`; `Err` completes it at once without the inner
    /// engine, `Ok` forwards the (possibly shortened) request.
    fn plan_op(&self, st: &mut State, op: u64, req: &IoRequest) -> Result<(IoRequest, OnComplete)> {
        // The label is only built for an injected error, not for every operation.
        let eio = |done| {
            os_error(
                req,
                &format!("file #{}", req.file),
                done,
                0,
                std::io::Error::from_raw_os_error(libc::EIO),
            )
            .with("injected", "true")
        };
        if req.dir == IoDir::Write {
            st.writes += 1;
            if let Some(limit) = self.plan.fail_writes_after
                && st.writes > limit
            {
                st.counts.eio += 1;
                return Err(eio(0).with("injected_rule", "fail_writes_after"));
            }
        }
        if self.plan.eio_on.contains(&op) {
            st.counts.eio += 1;
            return Err(eio(0));
        }
        let kind = match req.dir {
            IoDir::Read => DataOp::Read,
            IoDir::Write => DataOp::Write,
        };
        if let Some(errno) = st.data_fault(&self.plan.data, kind, req.file) {
            return Err(os_error(
                req,
                &format!("file #{}", req.file),
                0,
                0,
                std::io::Error::from_raw_os_error(errno),
            )
            .with("injected", "true"));
        }
        let inner_req = IoRequest { tag: op, ..*req };
        if let Some(&keep) = self.plan.short_on.get(&op) {
            st.counts.short += 1;
            let keep = keep.min(req.len.saturating_sub(1));
            if keep == 0 {
                return Err(injected_short(req, 0));
            }
            return Ok((
                IoRequest {
                    len: keep,
                    ..inner_req
                },
                OnComplete::Short,
            ));
        }
        if let Some(f) = self.plan.flips.iter().find(|f| f.op == op)
            && req.dir == IoDir::Read
        {
            return Ok((
                inner_req,
                OnComplete::Flip {
                    byte: f.byte,
                    bit: f.bit,
                },
            ));
        }
        Ok((inner_req, OnComplete::Pass))
    }
}

fn injected_short(req: &IoRequest, moved: usize) -> Error {
    request_error(
        ErrorKind::ShortIo,
        format!(
            "short {} (injected): {moved} of {} bytes at offset {} moved",
            dir_name(req.dir),
            req.len,
            req.file_offset
        ),
        req,
        &format!("file #{}", req.file),
    )
    .with("expected", req.len.to_string())
    .with("found", moved.to_string())
    .with("injected", "true")
}

impl IoEngine for FaultyEngine {
    fn name(&self) -> String {
        format!("faulty({})", self.inner.name())
    }

    fn submit(&self, reqs: &[IoRequest]) -> Result<()> {
        let guard = self.control.read();
        let Some(ctl) = guard.as_ref() else {
            return Err(Error::new(
                ErrorKind::Closed,
                "the faulty engine is shut down",
            ));
        };
        let mut forward = Vec::with_capacity(reqs.len());
        {
            let mut st = self.state.lock();
            for req in reqs {
                st.next_op += 1;
                let op = st.next_op;
                match self.plan_op(&mut st, op, req) {
                    Ok((inner_req, on_complete)) => {
                        st.pending.insert(
                            op,
                            Pending {
                                req: *req,
                                on_complete,
                            },
                        );
                        forward.push(inner_req);
                    }
                    Err(e) => {
                        let _ = ctl.send(Control::Injected(IoCompletion {
                            tag: req.tag,
                            result: Err(e),
                            row_crc: None,
                        }));
                    }
                }
            }
        }
        if let Err(e) = self.inner.submit(&forward) {
            let mut st = self.state.lock();
            for r in &forward {
                st.pending.remove(&r.tag);
            }
            return Err(e);
        }
        Ok(())
    }

    fn completions(&self) -> &Receiver<IoCompletion> {
        &self.done_rx
    }

    fn region(&self) -> &Arc<PrimaryRegion> {
        self.inner.region()
    }

    fn sync_data(&self, file: usize) -> Result<()> {
        {
            let mut st = self.state.lock();
            st.syncs += 1;
            if self.plan.fail_syncs_after.is_some_and(|n| st.syncs > n) {
                st.counts.sync_failures += 1;
                return Err(Error::new(
                    ErrorKind::Io,
                    format!("fdatasync of file #{file} failed (injected EIO)"),
                )
                .with("errno", libc::EIO.to_string())
                .with("injected", "true"));
            }
            if let Some(errno) = st.data_fault(&self.plan.data, DataOp::Sync, file) {
                let err = std::io::Error::from_raw_os_error(errno);
                let kind = if errno == libc::ENOSPC {
                    ErrorKind::NoSpace
                } else {
                    ErrorKind::Io
                };
                return Err(Error::new(
                    kind,
                    format!("fdatasync of file #{file} failed (injected): {err}"),
                )
                .with("errno", errno.to_string())
                .with("injected", "true"));
            }
        }
        self.inner.sync_data(file)
    }

    fn meta_fault(&self, file: MetaFile, op: MetaOp) -> Option<std::io::Error> {
        if self.plan.meta.is_empty() {
            return None;
        }
        let mut st = self.state.lock();
        let errno = first_failure(&self.plan.meta, &mut st.meta_seen, |r| {
            r.file == file && r.op == op
        })?;
        st.counts.meta_failures += 1;
        Some(std::io::Error::from_raw_os_error(errno))
    }

    fn attach_file(&self, file: std::fs::File, label: String, o_direct: bool) -> Result<usize> {
        self.inner.attach_file(file, label, o_direct)
    }

    fn detach_file(&self, file: usize) -> Result<std::fs::File> {
        self.inner.detach_file(file)
    }

    fn shutdown(&self) {
        let Some(ctl) = self.control.write().take() else {
            return;
        };
        // Every inner completion is queued once this returns; the forwarder then drains them.
        self.inner.shutdown();
        let _ = ctl.send(Control::Stop);
        if let Some(t) = self.forwarder.lock().take()
            && t.join().is_err()
        {
            log::error!("the fault forwarder thread panicked");
        }
    }
}

impl Drop for FaultyEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Thread that maps inner completions back to the caller's tags, applies faults and latency.
struct Forwarder {
    inner_rx: Receiver<IoCompletion>,
    ctl_rx: Receiver<Control>,
    done_tx: Sender<IoCompletion>,
    state: Arc<Mutex<State>>,
    region: Arc<PrimaryRegion>,
    latency: Duration,
    flips_done: Arc<AtomicU64>,
}

impl Forwarder {
    fn run(self) {
        let mut delayed: VecDeque<(Instant, IoCompletion)> = VecDeque::new();
        let mut stopping = false;
        loop {
            let now = Instant::now();
            while delayed.front().is_some_and(|(due, _)| *due <= now) {
                if let Some((_, c)) = delayed.pop_front() {
                    let _ = self.done_tx.send(c);
                }
            }
            if stopping && delayed.is_empty() && self.state.lock().pending.is_empty() {
                break;
            }
            let mut sel = Select::new();
            let i_inner = sel.recv(&self.inner_rx);
            let i_ctl = if stopping {
                None
            } else {
                Some(sel.recv(&self.ctl_rx))
            };
            let oper = match delayed.front() {
                Some((due, _)) => match sel.select_deadline(*due) {
                    Ok(o) => o,
                    Err(_) => continue,
                },
                None => sel.select(),
            };
            let out = if oper.index() == i_inner {
                match oper.recv(&self.inner_rx) {
                    Ok(c) => self.map(c),
                    Err(_) => {
                        log::error!("faulty: the inner engine's completion channel closed");
                        break;
                    }
                }
            } else if Some(oper.index()) == i_ctl {
                match oper.recv(&self.ctl_rx) {
                    Ok(Control::Injected(c)) => Some(c),
                    Ok(Control::Stop) | Err(_) => {
                        stopping = true;
                        None
                    }
                }
            } else {
                None
            };
            if let Some(c) = out {
                delayed.push_back((Instant::now() + self.latency, c));
            }
        }
    }

    fn map(&self, c: IoCompletion) -> Option<IoCompletion> {
        let Some(p) = self.state.lock().pending.remove(&c.tag) else {
            log::error!("faulty: completion for unknown operation {}", c.tag);
            return None;
        };
        let result = match (c.result, p.on_complete) {
            (Err(e), _) => Err(e),
            (Ok(moved), OnComplete::Short) => Err(injected_short(&p.req, moved)),
            (Ok(n), OnComplete::Flip { byte, bit }) => {
                if byte < p.req.len {
                    // SAFETY: `region_offset + byte < region_offset + len <= region.len()`
                    // (the inner engine validated the request before completing it Ok). The
                    // caller owns this range until it receives the completion, which has not
                    // been delivered yet; nothing else writes it now.
                    unsafe {
                        let p = self.region.base_ptr().add(p.req.region_offset + byte);
                        *p ^= 1u8 << bit;
                    }
                    self.flips_done.fetch_add(1, Ordering::Relaxed);
                }
                Ok(n)
            }
            (Ok(n), OnComplete::Pass) => Ok(n),
        };
        // The inner engine's CRC is dropped: a fault may change the bytes after it.
        Some(IoCompletion {
            tag: p.req.tag,
            result,
            row_crc: None,
        })
    }
}
