//! A deterministic synthetic scheduler driving the tiering manager: requests sharing prefixes
//! (so chunks recur), lookups with vLLM's prefix rule, GPU loads that verify every row's bytes,
//! GPU stores of deterministic bytes, finishes, one reset; invariants checked every step.
#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use kvtier::contract::job::{LookupResult, RequestContext};
use kvtier::key::ChunkKey;
use kvtier::tiering::clock::ManualClock;
use kvtier::tiering::memory_tier::XorShift64;
use kvtier::tiering::{ScheduleEndContext, TieringManager};

use crate::tiering_common::*;

enum Phase {
    Lookup {
        attempts: u32,
    },
    Holding {
        loaded: Vec<ChunkKey>,
        stored: Vec<ChunkKey>,
        release_at: u64,
    },
}

struct SimReq {
    ctx: RequestContext,
    keys: Vec<ChunkKey>,
    phase: Phase,
}

/// Counts that show the simulation exercised what it should.
#[derive(Debug, Default, Clone)]
pub struct SimStats {
    /// Rows verified byte for byte after `prepare_load`.
    pub verified_rows: u64,
    /// Of those, rows that came from a secondary tier (promotion).
    pub promoted_rows: u64,
    /// GPU stores refused by the primary.
    pub refused_stores: u64,
    /// Requests completed.
    pub requests: u64,
    /// Lookup answers seen: (hit, hit_pending, retry, miss).
    pub answers: [u64; 4],
}

/// The simulation.
pub struct Sim {
    /// The manager under test.
    pub m: TieringManager,
    clock: ManualClock,
    rng: XorShift64,
    logs: Vec<Arc<Mutex<AuditLog>>>,
    reqs: Vec<SimReq>,
    next_req: u64,
    step: u64,
    gpu_pins: HashMap<ChunkKey, usize>,
    /// What happened.
    pub stats: SimStats,
    docs: u64,
    real_io: bool,
}

impl Sim {
    /// A simulation over `m` (whose tiers are audited by `logs`). At most 6 requests of at most
    /// 11 chunks run at once: give the primary at least 64 rows so that promotions cannot
    /// thrash forever (which the livelock check would report).
    pub fn new(
        m: TieringManager,
        clock: ManualClock,
        logs: Vec<Arc<Mutex<AuditLog>>>,
        seed: u64,
    ) -> Self {
        Sim {
            m,
            clock,
            rng: XorShift64::new(seed),
            logs,
            reqs: Vec::new(),
            next_req: 0,
            step: 0,
            gpu_pins: HashMap::new(),
            stats: SimStats::default(),
            docs: 24,
            real_io: false,
        }
    }

    /// For tiers doing real I/O on their own threads: each step yields a little real time,
    /// and a request may wait longer for its promotions.
    pub fn with_real_io(mut self) -> Self {
        self.real_io = true;
        self
    }

    fn spawn(&mut self) {
        let doc = self.rng.below(self.docs);
        let len = 1 + self.rng.below(8);
        let ctx = req(&format!("req{}", self.next_req));
        self.next_req += 1;
        self.m.on_new_request(&ctx);
        // A shared prefix (chunks recur across requests) and a private tail (fresh stores).
        let tail = self.rng.below(4);
        let unique = 1_000_000 + self.next_req;
        let keys = (0..len)
            .map(|c| key(doc, c))
            .chain((0..tail).map(|c| key(unique, c)))
            .collect();
        self.reqs.push(SimReq {
            ctx,
            keys,
            phase: Phase::Lookup { attempts: 0 },
        });
    }

    /// vLLM's maximal-prefix rule: HIT counts, HIT_PENDING counts and defers, RETRY defers and
    /// keeps scanning, MISS stops. `None` = ask again next step.
    fn lookup_prefix(&mut self, i: usize) -> Option<usize> {
        let (ctx, keys) = (self.reqs[i].ctx.clone(), self.reqs[i].keys.clone());
        let mut count = 0;
        let mut defer = false;
        for k in &keys {
            match self.m.lookup(k, &ctx) {
                LookupResult::Hit => {
                    self.stats.answers[0] += 1;
                    count += 1
                }
                LookupResult::HitPending => {
                    self.stats.answers[1] += 1;
                    count += 1;
                    defer = true;
                }
                LookupResult::Retry => {
                    self.stats.answers[2] += 1;
                    defer = true
                }
                LookupResult::Miss => {
                    self.stats.answers[3] += 1;
                    break;
                }
            }
        }
        (!defer).then_some(count)
    }

    fn schedule(&mut self, i: usize) {
        let ctx = self.reqs[i].ctx.clone();
        let keys = self.reqs[i].keys.clone();
        let Phase::Lookup { attempts } = &mut self.reqs[i].phase else {
            return;
        };
        *attempts += 1;
        let limit = if self.real_io { 5000 } else { 200 };
        if *attempts >= limit {
            let states: Vec<_> = keys
                .iter()
                .map(|k| {
                    (
                        k.to_hex(),
                        self.m.primary().ref_count(k),
                        self.m.lookup(k, &ctx),
                    )
                })
                .collect();
            let outs: Vec<_> = self
                .logs
                .iter()
                .map(|l| {
                    l.lock()
                        .outstanding
                        .iter()
                        .map(|(id, (p, k))| (*id, *p, k.len()))
                        .collect::<Vec<_>>()
                })
                .collect();
            panic!(
                "stuck: {states:?} active jobs {} pending {} outstanding {outs:?} step {}",
                self.m.active_jobs(),
                self.m.has_pending_work(),
                self.step
            );
        }
        let Some(count) = self.lookup_prefix(i) else {
            return;
        };
        let loaded = keys[..count].to_vec();
        if !loaded.is_empty() {
            let rows = self
                .m
                .prepare_load(&loaded, &ctx)
                .expect("HIT chunks can be pinned");
            for (k, c) in loaded.iter().zip(rows) {
                assert!(
                    row_matches(self.m.region(), c, k),
                    "row {c} does not hold {k}'s bytes"
                );
                self.stats.verified_rows += 1;
                if self.m.get_load_source(k, &ctx).is_some() {
                    self.stats.promoted_rows += 1;
                }
                *self.gpu_pins.entry(k.clone()).or_default() += 1;
            }
        }
        let stored = match self.m.prepare_store(&keys[count..], &ctx) {
            Some(out) => {
                for (k, &c) in out.keys_to_store.iter().zip(&out.chunk_ids) {
                    write_row(self.m.region(), c, k);
                }
                out.keys_to_store
            }
            None => {
                self.stats.refused_stores += 1;
                Vec::new()
            }
        };
        let release_at = self.step + 1 + self.rng.below(3);
        self.reqs[i].phase = Phase::Holding {
            loaded,
            stored,
            release_at,
        };
    }

    fn release(&mut self, r: SimReq) {
        let Phase::Holding { loaded, stored, .. } = r.phase else {
            return;
        };
        if !loaded.is_empty() {
            self.m.complete_load(&loaded).expect("unpin");
            for k in &loaded {
                let n = self.gpu_pins.get_mut(k).expect("pinned");
                *n -= 1;
                if *n == 0 {
                    self.gpu_pins.remove(k);
                }
            }
        }
        let ok = self.rng.next_f64() > 0.03;
        self.m.complete_store(&stored, &r.ctx, ok);
        self.m.on_request_finished(&r.ctx);
        self.stats.requests += 1;
    }

    /// One scheduling step. `spawn` = whether new requests may arrive.
    pub fn step(&mut self, spawn: bool) {
        self.step += 1;
        self.clock.advance(Duration::from_millis(1));
        if self.real_io {
            std::thread::sleep(Duration::from_micros(100));
        }
        if spawn && self.reqs.len() < 6 && self.rng.next_f64() < 0.7 {
            self.spawn();
        }
        let mut new_ids = Vec::new();
        for i in 0..self.reqs.len() {
            if matches!(self.reqs[i].phase, Phase::Lookup { .. }) {
                self.schedule(i);
                if matches!(self.reqs[i].phase, Phase::Holding { .. }) {
                    new_ids.push(self.reqs[i].ctx.req_id.clone());
                }
            }
        }
        let now = self.step;
        let (done, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.reqs).into_iter().partition(
            |r| matches!(r.phase, Phase::Holding { release_at, .. } if release_at <= now),
        );
        self.reqs = keep;
        for r in done {
            self.release(r);
        }
        let ctx = ScheduleEndContext {
            new_req_ids: new_ids,
            preempted_req_ids: Vec::new(),
        };
        self.m.on_schedule_end(&ctx).expect("no contract violation");
        self.check_step();
    }

    /// Finishes every holding request, resets the cache, and lets promotions resume.
    pub fn reset(&mut self) {
        let (holding, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.reqs)
            .into_iter()
            .partition(|r| matches!(r.phase, Phase::Holding { .. }));
        self.reqs = keep;
        for r in holding {
            self.release(r);
        }
        self.m.reset_cache().expect("reset");
        self.check_step();
        self.m.on_reset_flushed();
    }

    fn store_pins(&self) -> HashSet<ChunkKey> {
        let mut s = HashSet::new();
        for l in &self.logs {
            s.extend(l.lock().store_pins.keys().cloned());
        }
        s
    }

    fn check_step(&mut self) {
        assert_eq!(self.m.contract_violations(), 0);
        self.m
            .primary()
            .check_consistency()
            .expect("primary consistent");
        for (i, l) in self.logs.iter().enumerate() {
            let l = l.lock();
            assert!(l.violations.is_empty(), "tier {i}: {:?}", l.violations);
        }
        let store_pins = self.store_pins();
        // Nothing pinned is evicted.
        for ev in self.m.take_events() {
            if ev.ownership.is_none() && ev.removed && !ev.metadata_only {
                for k in &ev.keys {
                    assert!(
                        !self.gpu_pins.contains_key(k),
                        "evicted {k} while a GPU load pins it"
                    );
                    assert!(
                        !store_pins.contains(k),
                        "evicted {k} while a store job pins it"
                    );
                }
            }
        }
        // Pins balance: pinned rows are exactly the GPU-load and store-job pins.
        let mut pinned: HashSet<ChunkKey> = self.gpu_pins.keys().cloned().collect();
        pinned.extend(store_pins);
        let u = self.m.primary().usage();
        assert_eq!(u.pinned_for_read, pinned.len(), "pinned rows vs pins held");
        for k in &pinned {
            let want = self.gpu_pins.get(k).copied().unwrap_or(0);
            let rc = self.m.primary().ref_count(k).expect("pinned key resident");
            assert!(
                rc as usize >= want.max(1),
                "{k}: ref_cnt {rc} < pins {want}"
            );
        }
        // Reserved rows: GPU stores not yet completed plus promotion jobs in flight.
        let mut reserved = 0;
        for r in &self.reqs {
            if let Phase::Holding { stored, .. } = &r.phase {
                reserved += stored.len();
            }
        }
        for l in &self.logs {
            reserved += l
                .lock()
                .outstanding
                .values()
                .filter(|(p, _)| *p)
                .map(|(_, k)| k.len())
                .sum::<usize>();
        }
        assert_eq!(
            u.reserved_for_write, reserved,
            "reserved rows vs writes in flight"
        );
    }

    /// Runs `steps` steps (with a reset half-way), then drains to quiescence and checks the
    /// final invariants. `held_gauge` names each tier's gauge of chunks held, if any.
    pub fn run(&mut self, steps: u64, held_gauge: &[Option<&str>]) -> SimStats {
        for s in 0..steps {
            if s == steps / 2 {
                self.reset();
            }
            self.step(true);
        }
        let mut guard = 0;
        while !self.reqs.is_empty() || self.m.has_pending_work() {
            self.clock.advance(Duration::from_millis(20));
            if self.real_io {
                std::thread::sleep(Duration::from_millis(1));
            }
            self.step(false);
            guard += 1;
            assert!(guard < 20000, "did not quiesce");
        }
        self.m.poll().expect("no contract violation");
        assert_eq!(self.m.active_jobs(), 0);
        let u = self.m.primary().usage();
        assert_eq!(
            (u.pinned_for_read, u.reserved_for_write),
            (0, 0),
            "no slot leaks"
        );
        self.m.refresh_metrics();
        let _ = self.m.take_events();
        for (i, l) in self.logs.iter().enumerate() {
            let l = l.lock();
            assert!(l.outstanding.is_empty(), "tier {i}: every job reported");
            let label = self.m.tier_label(i).expect("tier").to_string();
            let v = |n: &str| self.m.registry().value(n, &[&label]).unwrap_or(0.0);
            let stride = STRIDE as f64;
            assert_eq!(
                v("kv_offload_tiering_write_bytes"),
                l.stored_keys as f64 * stride,
                "tier {i}"
            );
            assert_eq!(
                v("kv_offload_tiering_read_bytes"),
                l.loaded_keys as f64 * stride,
                "tier {i}"
            );
            assert_eq!(
                v("kv_offload_tiering_cascade_job_failures"),
                l.failed_stores as f64
            );
            assert_eq!(
                v("kv_offload_tiering_promotion_job_failures"),
                l.failed_loads as f64
            );
            assert_eq!(v("kv_offload_tiering_active_cascade_jobs"), 0.0);
            if let Some(Some(g)) = held_gauge.get(i) {
                assert_eq!(
                    v(g),
                    l.held.len() as f64,
                    "tier {i}: {g} vs stored/removed events"
                );
            }
            let (q, h) = (
                v("kv_offload_tiering_chunk_queries"),
                v("kv_offload_tiering_chunk_hits"),
            );
            assert!(q >= h, "tier {i}: queries {q} < hits {h}");
        }
        self.stats.clone()
    }
}
