//! Hint-driven prefetch: G3 -> the DRAM staging pool ([`crate::node::staging`]) before a
//! request's loads arrive, on a thread of the service with an I/O engine of its own over the
//! pool's memory (io_uring with the pool registered as fixed buffers where the kernel allows).
//!
//! An engine's `HINT` names a request and the keys it will look up. For each key the service
//! answers a verdict at once: HIT when the pool holds it or G3 does (its read into the pool
//! is then queued here), MISS or RETRY as G3's index says. The hinted keys are held in the
//! pool (not evicted) until the engine says the request finished (`HINT_DONE`) or
//! disconnects; then the ones no load copied are discarded.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, TrySendError};
use parking_lot::Mutex;

use crate::contract::job::{LookupResult, RequestContext};
use crate::contract::secondary::SecondaryTier;
use crate::error::{Error, ErrorKind, Result};
use crate::g3::G3Tier;
use crate::g3::slot_grants::{GrantedSlot, SlotGrants};
use crate::io::{EngineHandle, EngineOptions, IoDir, IoEngineKind, IoRequest, open_engine};
use crate::key::ChunkKey;
use crate::metrics::{MetricKind, Registry};
use crate::node::staging::{Reserve, StagingPool};

/// Prefetch batches queued at most; past that a hint's keys are not prefetched (counted).
const MAX_QUEUED_BATCHES: usize = 256;
/// Job ids of prefetch reads (the tier only echoes them): high bit set.
const PREFETCH_JOB_BASE: u64 = 1 << 63;

/// Counters of hints and prefetches (on the service's `/metrics`).
#[derive(Debug, Default)]
pub struct PrefetchCounters {
    /// Keys named by hints.
    pub hinted_keys: AtomicU64,
    /// Keys whose G3 read into the pool was queued.
    pub queued: AtomicU64,
    /// Keys read from G3 into the pool and checked.
    pub staged: AtomicU64,
    /// Keys whose prefetch failed (G3 no longer held them, I/O error, CRC mismatch).
    pub failed: AtomicU64,
    /// Keys not prefetched: the pool had no free slot or the queue was full.
    pub dropped: AtomicU64,
    /// Keys served from the pool (loads, lookups, hints) whose recency in G3's LRU was
    /// refreshed, as a G3 read of them would have refreshed it.
    pub g3_touches: AtomicU64,
    /// Keys served from the pool whose G3 touch was dropped (the G3 worker's queue was full).
    pub g3_touches_dropped: AtomicU64,
}

/// A batch of reserved slots to fill: `(key, slot)`.
type Batch = Vec<(ChunkKey, usize)>;

/// The staging pool and its prefetch thread.
pub struct Staging {
    /// The pool.
    pub pool: Arc<StagingPool>,
    /// Hint and prefetch counters.
    pub counters: Arc<PrefetchCounters>,
    tx: Mutex<Option<Sender<Batch>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// G3's slots (touches of keys the pool served).
    g3: SlotGrants,
    /// The prefetch engine's name (`uring`, `psync`).
    pub io_engine: String,
}

impl std::fmt::Debug for Staging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staging")
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

impl Staging {
    /// Starts the prefetch thread for `pool`, reading G3 through `slots` with an engine of
    /// `kind`.
    pub fn start(
        pool: Arc<StagingPool>,
        slots: SlotGrants,
        kind: IoEngineKind,
        opts: &EngineOptions,
    ) -> Result<Staging> {
        let engine = open_engine(kind, pool.region().clone(), slots.files()?, opts)?;
        let io_engine = engine.info.name.clone();
        let counters = Arc::new(PrefetchCounters::default());
        let (tx, rx) = crossbeam_channel::bounded(MAX_QUEUED_BATCHES);
        let worker = Worker {
            pool: pool.clone(),
            slots: slots.clone(),
            engine,
            counters: counters.clone(),
        };
        let thread =
            crate::io::spawn_io_thread("kvtier-node-prefetch".into(), move || worker.run(rx))
                .map_err(|e| {
                    Error::new(
                        ErrorKind::Io,
                        format!("cannot start the prefetch thread: {e}"),
                    )
                })?;
        Ok(Staging {
            pool,
            counters,
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            g3: slots,
            io_engine,
        })
    }

    /// Counts `keys`, served from the pool, as accesses in G3's LRU, exactly as a G3 read of
    /// them would (a pin moves a key to the most recently used end), so that G3 does not
    /// evict a chunk only because the pool keeps serving it. Never waits: one batch is queued
    /// for G3's worker, which applies it before any later store (every transfer of the service
    /// goes through the same queue). A full queue drops the batch: counted, and logged once.
    pub fn touch_g3(&self, keys: Vec<ChunkKey>) {
        let n = keys.len() as u64;
        if n == 0 {
            return;
        }
        if self.g3.touch(keys) {
            self.counters.g3_touches.fetch_add(n, Ordering::Relaxed);
        } else if self
            .counters
            .g3_touches_dropped
            .fetch_add(n, Ordering::Relaxed)
            == 0
        {
            log::warn!(
                "node service: G3's worker queue is full or closed; chunks served from the \
                 staging pool are not refreshed in G3's LRU (node_staging_g3_touches_dropped_total)"
            );
        }
    }

    /// A hint's verdicts: HIT for keys the pool holds (held once more) or G3 holds (a slot is
    /// reserved and held, and its read queued), else G3's MISS or RETRY. Returns the verdicts
    /// and the keys now held for the hint (to [`StagingPool::release`] when it ends).
    pub fn hint(
        &self,
        tier: &Mutex<G3Tier>,
        keys: &[ChunkKey],
    ) -> (Vec<LookupResult>, Vec<ChunkKey>) {
        let c = &self.counters;
        c.hinted_keys
            .fetch_add(keys.len() as u64, Ordering::Relaxed);
        let mut verdicts = Vec::with_capacity(keys.len());
        let mut held = Vec::new();
        let mut batch = Batch::new();
        let ctx = RequestContext::new("node-service-hint");
        let mut staged = Vec::new();
        for k in keys {
            if self.pool.hold_if_present(k) {
                held.push(k.clone());
                staged.push(k.clone());
                verdicts.push(LookupResult::Hit);
                continue;
            }
            let g3 = tier.lock().lookup(k, &ctx);
            if g3 != LookupResult::Hit {
                verdicts.push(g3);
                continue;
            }
            verdicts.push(LookupResult::Hit);
            match self.pool.reserve(k, true) {
                Reserve::Present => held.push(k.clone()),
                Reserve::Reserved(slot) => {
                    held.push(k.clone());
                    batch.push((k.clone(), slot));
                }
                Reserve::Full => {
                    c.dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        // A staged key's hint is a lookup served by the pool: it counts in G3 as the G3
        // lookup of an unstaged key does.
        self.touch_g3(staged);
        if !batch.is_empty() {
            let n = batch.len() as u64;
            let sent = match self.tx.lock().as_ref() {
                Some(tx) => tx.try_send(batch),
                None => Err(TrySendError::Disconnected(batch)),
            };
            match sent {
                Ok(()) => {
                    c.queued.fetch_add(n, Ordering::Relaxed);
                }
                Err(TrySendError::Full(b)) | Err(TrySendError::Disconnected(b)) => {
                    c.dropped.fetch_add(n, Ordering::Relaxed);
                    let mut unread = HashSet::with_capacity(b.len());
                    for (k, slot) in b {
                        self.pool.abort(slot);
                        unread.insert(k);
                    }
                    held.retain(|h| !unread.contains(h));
                }
            }
        }
        (verdicts, held)
    }

    /// The pool's and the hints' series on the service's `/metrics`.
    pub fn render_metrics(&self, reg: &mut Registry) -> Result<()> {
        let p = &self.pool.counters;
        let c = &self.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let gauges = [
            (
                "node_staging_slots",
                "Slots of the DRAM staging pool",
                self.pool.num_slots(),
            ),
            (
                "node_staging_used_slots",
                "Slots of the staging pool holding a chunk or being filled",
                self.pool.used_slots(),
            ),
            (
                "node_staging_held_slots",
                "Slots of the staging pool held by hints of requests not finished",
                self.pool.held_slots(),
            ),
        ];
        for (name, help, v) in gauges {
            let f = reg.family(name, help, MetricKind::Gauge, &[])?;
            let id = reg.series(f, &[])?;
            reg.set(id, v as f64);
        }
        let counters = [
            (
                "node_staging_hits_total",
                "Keys of loads served from the staging pool (no G3 read)",
                load(&p.hits),
            ),
            (
                "node_staging_g3_loads_total",
                "Keys of loads the staging pool did not hold (read from G3)",
                load(&p.g3_loads),
            ),
            (
                "node_staging_inserts_total",
                "Chunks copied into the staging pool (after a G3 load or by a prefetch)",
                load(&p.inserts),
            ),
            (
                "node_staging_evictions_total",
                "Chunks evicted from the staging pool (least recently used)",
                load(&p.evictions),
            ),
            (
                "node_staging_full_total",
                "Chunks not staged because every slot was being read or held by a hint",
                load(&p.full),
            ),
            (
                "node_staging_crc_mismatches_total",
                "Staged copies whose CRC-32 did not match (not kept, or the load read G3)",
                load(&p.crc_mismatches),
            ),
            (
                "node_staging_discarded_total",
                "Prefetched chunks discarded unused when their request finished",
                load(&p.discarded),
            ),
            (
                "node_staging_fill_waits_total",
                "Loads that waited for a prefetch still reading their chunk",
                load(&p.fill_waits),
            ),
            (
                "node_hint_keys_total",
                "Keys named by engines' prefetch hints",
                load(&c.hinted_keys),
            ),
            (
                "node_prefetch_queued_total",
                "Keys whose G3 read into the staging pool was queued",
                load(&c.queued),
            ),
            (
                "node_prefetch_staged_total",
                "Keys read from G3 into the staging pool and checked",
                load(&c.staged),
            ),
            (
                "node_prefetch_failed_total",
                "Keys whose prefetch failed (not in G3 any more, I/O error)",
                load(&c.failed),
            ),
            (
                "node_prefetch_dropped_total",
                "Hinted keys not prefetched (no free slot, or the prefetch queue was full)",
                load(&c.dropped),
            ),
            (
                "node_staging_g3_touches_total",
                "Keys served from the staging pool (loads, lookups, hints) counted as accesses \
                 in G3's LRU",
                load(&c.g3_touches),
            ),
            (
                "node_staging_g3_touches_dropped_total",
                "Keys served from the staging pool whose G3 LRU touch was dropped (G3's worker \
                 queue full)",
                load(&c.g3_touches_dropped),
            ),
        ];
        for (name, help, v) in counters {
            let f = reg.family(name, help, MetricKind::Counter, &[])?;
            let id = reg.series(f, &[])?;
            reg.inc(id, v as f64);
        }
        Ok(())
    }

    /// Stops the prefetch thread (queued reads finish first).
    pub fn stop(&self) {
        drop(self.tx.lock().take());
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Worker {
    pool: Arc<StagingPool>,
    slots: SlotGrants,
    engine: EngineHandle,
    counters: Arc<PrefetchCounters>,
}

impl Worker {
    fn run(self, rx: Receiver<Batch>) {
        let mut next = PREFETCH_JOB_BASE;
        for batch in rx {
            next += 1;
            self.fill(next, batch);
        }
        self.engine.engine.shutdown();
    }

    /// Reads one batch from G3 into its reserved slots; commits the keys G3 vouched for.
    fn fill(&self, job_id: u64, batch: Batch) {
        let keys: Vec<ChunkKey> = batch.iter().map(|(k, _)| k.clone()).collect();
        let grant = match self.slots.begin_load(job_id, keys) {
            Ok(g) => g,
            Err(e) => {
                log::warn!("node service: a prefetch could not start: {e}");
                return self.fail(&batch);
            }
        };
        let stride = self.pool.row_stride() as usize;
        let n = batch.len();
        let mut results: Vec<Result<u32>> = (0..n)
            .map(|_| Err(Error::new(ErrorKind::Internal, "not read")))
            .collect();
        let mut reqs = Vec::new();
        for (i, g) in grant.slots.iter().enumerate() {
            if let GrantedSlot::Ready { file, offset, .. } = g {
                reqs.push(IoRequest {
                    dir: IoDir::Read,
                    file: *file,
                    file_offset: *offset,
                    region_offset: batch[i].1 * stride,
                    len: stride,
                    tag: i as u64,
                });
            }
        }
        if !reqs.is_empty() {
            match self.engine.engine.submit(&reqs) {
                Err(e) => {
                    for r in &mut results {
                        *r = Err(e.duplicate());
                    }
                }
                Ok(()) => {
                    for _ in 0..reqs.len() {
                        let Ok(c) = self.engine.engine.completions().recv() else {
                            break;
                        };
                        let i = c.tag as usize;
                        // The slot was reserved for this batch; its read is done.
                        results[i] = c.result.and_then(|_| {
                            let bytes = self.pool.region().read_row(batch[i].1)?;
                            Ok(crc32fast::hash(&bytes))
                        });
                    }
                }
            }
        }
        let crcs: Vec<Option<u32>> = results.iter().map(|r| r.as_ref().ok().copied()).collect();
        let r = self.slots.finish(grant, results);
        for (i, (k, slot)) in batch.iter().enumerate() {
            let vouched = r.success || r.successful_keys.as_ref().is_some_and(|ok| ok.contains(k));
            match crcs[i] {
                // `crc` is the slot's own hash (above): G3 vouched for it, not hashed again.
                Some(crc) if vouched && self.pool.commit_hashed(*slot, crc, crc) => {
                    self.counters.staged.fetch_add(1, Ordering::Relaxed);
                }
                // commit found a CRC mismatch or a finished request (counted there): freed.
                Some(_) if vouched => {}
                _ => {
                    self.counters.failed.fetch_add(1, Ordering::Relaxed);
                    self.pool.abort(*slot);
                }
            }
        }
    }

    fn fail(&self, batch: &Batch) {
        for (_, slot) in batch {
            self.counters.failed.fetch_add(1, Ordering::Relaxed);
            self.pool.abort(*slot);
        }
    }
}
