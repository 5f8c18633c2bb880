//! Lookups that never block the scheduler, after vLLM 0.33.0's `AsyncLookupManager`
//! (`tiering/async_lookup.py`, contract §3.4): the first lookup of a key answers RETRY and
//! queues it; [`AsyncLookup::flush`] (from `on_schedule_end`) posts the step's keys to the
//! lookup threads, which check whether each chunk file exists with the right size; the next
//! lookup applies the verdicts. Verdicts are cached per key with a generation and the ids of
//! the requests that asked, dropped when the last request finishes (unless a check is in
//! flight), and flipped to MISS after a failed load (`mark_miss`, the livelock fix of vLLM
//! issue #49176).
//!
//! Beyond vLLM: the cache is **bounded** (`lookup_cache_entries`: the oldest resolved verdicts
//! go first; when only unresolved checks are left a new key is answered MISS, counted in
//! `fs_lookup_overflows`), and a check that takes longer than `lookup_timeout_ms` is answered
//! MISS (`fs_lookup_timeouts`) so that a hung file system stalls no request for ever. The
//! checks run on several threads, since one existence check on a network file system can
//! take milliseconds.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use crate::error::{Error, ErrorKind, Result};
use crate::fs::chunk_file::exists_complete;
use crate::fs::worker::{Cmd, Shared};
use crate::key::ChunkKey;

/// Keys per message to the lookup threads (so that one step's keys spread over them).
const PROBE_BATCH: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Asked this step, not yet posted.
    Pending,
    /// Posted to the lookup threads.
    InFlight,
    /// A verdict is known.
    Resolved,
}

#[derive(Debug)]
struct State {
    generation: u64,
    phase: Phase,
    result: Option<bool>,
    requests: Vec<Arc<str>>,
    asked: Instant,
}

/// A verdict from a lookup thread: key, generation, exists.
type Verdict = (ChunkKey, u64, bool);

/// The scheduler-side state of the asynchronous lookups (owned by the tier, used only by
/// the thread that holds it) and the lookup threads.
pub(crate) struct AsyncLookup {
    sh: Arc<Shared>,
    states: HashMap<ChunkKey, State>,
    req_keys: HashMap<Arc<str>, HashSet<ChunkKey>>,
    next_generation: u64,
    batch: Vec<(ChunkKey, u64)>,
    need_drain: bool,
    /// Resolved verdicts in the order they resolved (for the bound; may hold stale entries).
    resolved: VecDeque<(ChunkKey, u64)>,
    /// Keys posted and not yet answered.
    in_flight: usize,
    cap: usize,
    timeout: Duration,
    probes_tx: Option<Sender<Vec<(ChunkKey, u64)>>>,
    results_rx: Receiver<Vec<Verdict>>,
    threads: Vec<JoinHandle<()>>,
}

impl AsyncLookup {
    /// Starts `threads` lookup threads that report complete files they find to the
    /// coordinator (`seen_tx`), so that its catalog knows them.
    pub fn start(
        sh: Arc<Shared>,
        threads: usize,
        cap: usize,
        timeout: Duration,
        seen_tx: Sender<Cmd>,
    ) -> Result<Self> {
        let (probes_tx, probes_rx) = crossbeam_channel::unbounded::<Vec<(ChunkKey, u64)>>();
        let (results_tx, results_rx) = crossbeam_channel::unbounded();
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let rx = probes_rx.clone();
            let tx = results_tx.clone();
            let seen = seen_tx.clone();
            let sh = sh.clone();
            let h = crate::io::spawn_io_thread(format!("kvtier-fs-lookup-{i}"), move || {
                while let Ok(keys) = rx.recv() {
                    let (verdicts, found) = probe(&sh, keys);
                    if !found.is_empty() {
                        let _ = seen.send(Cmd::Seen(found));
                    }
                    let _ = tx.send(verdicts);
                }
            })
            .map_err(|e| {
                Error::new(
                    ErrorKind::Io,
                    format!("cannot start an fs lookup thread: {e}"),
                )
                .with_source(e)
            })?;
            handles.push(h);
        }
        Ok(AsyncLookup {
            sh,
            states: HashMap::new(),
            req_keys: HashMap::new(),
            next_generation: 0,
            batch: Vec::new(),
            need_drain: false,
            resolved: VecDeque::new(),
            in_flight: 0,
            cap: cap.max(1),
            timeout,
            probes_tx: Some(probes_tx),
            results_rx,
            threads: handles,
        })
    }

    /// `Some(true)` = present, `Some(false)` = absent, `None` = not known yet (RETRY).
    pub fn lookup(&mut self, key: &ChunkKey, req_id: &Arc<str>) -> Option<bool> {
        if self.need_drain {
            self.drain_results();
            self.need_drain = false;
        }
        if !self.states.contains_key(key) {
            if self.states.len() >= self.cap && !self.make_room() {
                self.sh
                    .metrics
                    .lookup_overflows
                    .fetch_add(1, Ordering::Relaxed);
                return Some(false);
            }
            let generation = self.next_generation;
            self.next_generation += 1;
            self.states.insert(
                key.clone(),
                State {
                    generation,
                    phase: Phase::Pending,
                    result: None,
                    requests: Vec::new(),
                    asked: Instant::now(),
                },
            );
            self.batch.push((key.clone(), generation));
            self.gauge();
        }
        let state = self.states.get_mut(key)?;
        if !state.requests.iter().any(|r| r == req_id) {
            state.requests.push(req_id.clone());
            self.req_keys
                .entry(req_id.clone())
                .or_default()
                .insert(key.clone());
        }
        let m = &self.sh.metrics;
        match state.result {
            Some(r) => Some(r),
            None if state.asked.elapsed() > self.timeout => {
                m.lookup_timeouts.fetch_add(1, Ordering::Relaxed);
                *m.last_lookup_timeout.lock() = Some(Instant::now());
                Some(false)
            }
            None => {
                m.lookup_retries.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Drops the oldest resolved verdicts until one more fits; false if none could go.
    fn make_room(&mut self) -> bool {
        while self.states.len() >= self.cap {
            let Some((key, generation)) = self.resolved.pop_front() else {
                return false;
            };
            if self
                .states
                .get(&key)
                .is_some_and(|s| s.generation == generation && s.phase == Phase::Resolved)
            {
                self.states.remove(&key);
            }
        }
        true
    }

    /// Posts this step's new keys to the lookup threads (once per step, from
    /// `on_schedule_end`), after applying the verdicts that arrived.
    pub fn flush(&mut self) {
        self.drain_results();
        self.need_drain = true;
        let batch = std::mem::take(&mut self.batch);
        let mut posted = Vec::with_capacity(batch.len());
        for (key, generation) in batch {
            let Some(state) = self.states.get_mut(&key) else {
                continue;
            };
            if state.generation != generation || state.phase != Phase::Pending {
                continue;
            }
            state.phase = Phase::InFlight;
            posted.push((key, generation));
        }
        if posted.is_empty() {
            return;
        }
        self.in_flight += posted.len();
        let Some(tx) = &self.probes_tx else { return };
        for chunk in posted.chunks(PROBE_BATCH) {
            // The lookup threads live as long as this sender.
            let _ = tx.send(chunk.to_vec());
        }
    }

    /// Applies the verdicts the lookup threads sent.
    pub fn drain_results(&mut self) {
        while let Ok(verdicts) = self.results_rx.try_recv() {
            self.in_flight = self.in_flight.saturating_sub(verdicts.len());
            for (key, generation, found) in verdicts {
                let Some(state) = self.states.get_mut(&key) else {
                    continue;
                };
                if state.generation != generation || state.phase != Phase::InFlight {
                    continue;
                }
                if state.requests.is_empty() {
                    self.states.remove(&key);
                    continue;
                }
                state.result = Some(found);
                state.phase = Phase::Resolved;
                self.resolved.push_back((key, generation));
            }
        }
        // The order queue holds stale entries too; keep it from outgrowing the cache.
        if self.resolved.len() > 2 * self.cap {
            let states = &self.states;
            self.resolved.retain(|(k, g)| {
                states
                    .get(k)
                    .is_some_and(|s| s.generation == *g && s.phase == Phase::Resolved)
            });
        }
        self.gauge();
    }

    /// Forces the cached verdicts of `keys` to MISS (a failed load, an eviction). Entries
    /// still pending or in flight keep their own coming result.
    pub fn mark_miss<'a>(&mut self, keys: impl IntoIterator<Item = &'a ChunkKey>) {
        for key in keys {
            if let Some(s) = self.states.get_mut(key)
                && s.phase == Phase::Resolved
            {
                s.result = Some(false);
            }
        }
    }

    /// Releases the verdicts only `req_id` held (`on_request_finished`); checks in flight are
    /// kept until their result arrives.
    pub fn cleanup(&mut self, req_id: &str) {
        let Some(keys) = self.req_keys.remove(req_id) else {
            return;
        };
        for key in keys {
            let Some(state) = self.states.get_mut(&key) else {
                continue;
            };
            state.requests.retain(|r| &**r != req_id);
            if state.requests.is_empty() && state.phase != Phase::InFlight {
                self.states.remove(&key);
            }
        }
        self.gauge();
    }

    /// Whether keys wait to be posted or checks are in flight.
    pub fn has_pending_work(&self) -> bool {
        !self.batch.is_empty() || self.in_flight > 0
    }

    /// Stops the lookup threads and applies their last verdicts.
    pub fn shutdown(&mut self) {
        drop(self.probes_tx.take());
        for h in self.threads.drain(..) {
            if h.join().is_err() {
                log::error!("an fs lookup thread panicked");
            }
        }
        self.drain_results();
    }

    fn gauge(&self) {
        self.sh
            .metrics
            .lookup_cache_entries
            .store(self.states.len() as u64, Ordering::Relaxed);
    }
}

impl Drop for AsyncLookup {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Checks each key's file: present when it is a regular file of exactly one row. A key that
/// cannot name a file, or a failing check, counts as absent (as in vLLM).
fn probe(sh: &Shared, keys: Vec<(ChunkKey, u64)>) -> (Vec<Verdict>, Vec<(ChunkKey, u64)>) {
    let stride = sh.stride();
    sh.metrics
        .lookup_probes
        .fetch_add(keys.len() as u64, Ordering::Relaxed);
    let mut found = Vec::new();
    let verdicts = keys
        .into_iter()
        .map(|(key, generation)| {
            let present = sh
                .mapper
                .file_path(&key)
                .is_ok_and(|p| exists_complete(&p, stride));
            if present {
                found.push((key.clone(), stride));
            }
            (key, generation, present)
        })
        .collect();
    (verdicts, found)
}
