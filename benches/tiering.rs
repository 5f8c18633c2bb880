//! Tiering manager benchmark.
//!
//! 1. Per-call latency (p50 / p99 / max) of `lookup`, `prepare_store`, `complete_store` (the
//!    cascade submit), `on_schedule_end` (the promotion submit) and `poll` through the manager,
//!    under a mixed store + load workload on a `memory` tier and, when /tmp allows it, a G3
//!    (`nvme`) tier.
//! 2. End-to-end promotion throughput through the manager versus the same tier's raw load
//!    throughput (jobs submitted straight to the tier), for the same keys and batch size.
//!
//! Run: `cargo bench --bench tiering` (env: `KVTIER_BENCH_ROWS`, `KVTIER_BENCH_STRIDE`,
//! `KVTIER_BENCH_STEPS`, `KVTIER_BENCH_G3_DIR` (default /tmp; `none` to skip G3)).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier::config::EvictionPolicyKind;
use kvtier::g3::{FsyncPolicy, G3Tier, G3TierConfig, geometry_namespace};
use kvtier::key::ChunkKey;
use kvtier::primary::PrimaryTier;
use kvtier::region::PrimaryRegion;
use kvtier::tiering::job::{LookupResult, RequestContext, TransferJob};
use kvtier::tiering::memory_tier::{MemoryTier, MemoryTierOptions, XorShift64};
use kvtier::tiering::secondary::SecondaryTier;
use kvtier::tiering::{ManagerOptions, ScheduleEndContext, TierSpec, TieringManager};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn key(i: u64) -> ChunkKey {
    let mut b = i.to_le_bytes().to_vec();
    b.extend_from_slice(&[0xAB; 28]);
    ChunkKey::new(b)
}

fn fill(region: &PrimaryRegion, row: u32, seed: u64) {
    // SAFETY: the benchmark holds `row` reserved (prepare_store) while it writes it.
    let dst = unsafe { region.row_mut(row as usize) }.expect("row in range");
    for (i, b) in dst.iter_mut().enumerate().step_by(512) {
        *b = (seed as usize + i) as u8;
    }
}

#[derive(Default)]
struct Samples(Vec<Duration>);

impl Samples {
    fn time<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        self.0.push(t.elapsed());
        r
    }

    fn report(&mut self, name: &str) {
        if self.0.is_empty() {
            return;
        }
        self.0.sort();
        let q = |p: f64| self.0[((self.0.len() - 1) as f64 * p) as usize].as_secs_f64() * 1e6;
        println!(
            "  {name:<16} n={:<7} p50={:>7.2} us  p99={:>7.2} us  max={:>9.2} us",
            self.0.len(),
            q(0.5),
            q(0.99),
            q(1.0)
        );
    }
}

fn manager(region: Arc<PrimaryRegion>, tier: Box<dyn SecondaryTier>) -> TieringManager {
    let primary = PrimaryTier::new(region, EvictionPolicyKind::Lru, false);
    let spec = TierSpec {
        tier,
        backpressure: None,
    };
    TieringManager::with_tiers(primary, vec![spec], ManagerOptions::default()).expect("manager")
}

fn memory_tier(region: &Arc<PrimaryRegion>) -> Box<dyn SecondaryTier> {
    Box::new(MemoryTier::start(region.clone(), MemoryTierOptions::new("1:memory")).expect("tier"))
}

fn g3_tier(region: &Arc<PrimaryRegion>, dir: &std::path::Path, rows: usize) -> Option<G3Tier> {
    if let Err(e) = std::fs::create_dir_all(dir) {
        eprintln!("skipping G3: cannot create {}: {e}", dir.display());
        return None;
    }
    let stride = region.row_stride();
    let mut cfg = G3TierConfig::new(vec![dir.to_path_buf()], (4 * rows * stride) as u64);
    cfg.fsync = FsyncPolicy::Never;
    let ns = geometry_namespace(stride);
    match G3Tier::open(cfg, region.clone(), ns, "1:nvme".into(), None) {
        Ok(t) => {
            // Wait for recovery (lookups answer RETRY until then).
            let probe = RequestContext::new("probe");
            let mut t = t;
            let start = Instant::now();
            while t.lookup(&key(u64::MAX), &probe) == LookupResult::Retry {
                if start.elapsed() > Duration::from_secs(30) {
                    eprintln!("G3 recovery did not finish in 30 s; skipping");
                    return None;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Some(t)
        }
        Err(e) => {
            eprintln!("skipping G3: {e}");
            None
        }
    }
}

/// Mixed workload: each step one request looks up 8 chunks of a recurring document (primary
/// hits, tier hits that start promotions, misses), stores the missing ones (cascade), and the
/// step ends; `poll` runs once per step.
fn per_call_latency(label: &str, mut m: TieringManager, steps: usize) {
    let mut rng = XorShift64::new(7);
    let mut lk = Samples::default();
    let mut ps = Samples::default();
    let mut cs = Samples::default();
    let mut se = Samples::default();
    let mut po = Samples::default();
    let docs = (m.primary().num_chunks() / 8 * 3) as u64;
    for step in 0..steps {
        let ctx = RequestContext::new(format!("r{step}"));
        m.on_new_request(&ctx);
        let doc = rng.below(docs);
        let keys: Vec<_> = (0..8).map(|c| key(doc * 8 + c)).collect();
        let mut missing = Vec::new();
        for k in &keys {
            if lk.time(|| m.lookup(k, &ctx)) == LookupResult::Miss {
                missing.push(k.clone());
            }
        }
        if let Some(out) = ps.time(|| m.prepare_store(&missing, &ctx)) {
            for (i, &c) in out.chunk_ids.iter().enumerate() {
                fill(m.region(), c, step as u64 + i as u64);
            }
            cs.time(|| m.complete_store(&out.keys_to_store, &ctx, true));
        }
        m.on_request_finished(&ctx);
        let sched = ScheduleEndContext {
            new_req_ids: vec![ctx.req_id.clone()],
            preempted_req_ids: Vec::new(),
        };
        se.time(|| m.on_schedule_end(&sched))
            .expect("no contract violation");
        po.time(|| m.poll()).expect("no contract violation");
    }
    while m.has_pending_work() {
        m.poll().expect("poll");
        std::thread::yield_now();
    }
    println!("per-call latency, {label} tier, {steps} steps:");
    lk.report("lookup");
    ps.report("prepare_store");
    cs.report("complete_store");
    se.report("on_schedule_end");
    po.report("poll");
    let text = m.metrics_text();
    let hits: Vec<_> = text
        .lines()
        .filter(|l| l.contains("chunk_hits_total") || l.contains("read_bytes_total"))
        .collect();
    println!("  {}", hits.join("\n  "));
    m.shutdown().expect("shutdown");
}

/// Stores `n` keys into `tier` directly (rows 0..n of `region`), then measures raw load
/// throughput: all loads submitted at once in jobs of `batch` keys.
fn raw_load_throughput(
    tier: &mut dyn SecondaryTier,
    region: &PrimaryRegion,
    n: usize,
    batch: usize,
) -> f64 {
    for (j, chunk) in (0..n).collect::<Vec<_>>().chunks(batch).enumerate() {
        for &i in chunk {
            fill(region, i as u32, i as u64);
        }
        tier.submit_store(TransferJob {
            job_id: j as u64,
            keys: chunk.iter().map(|&i| key(i as u64)).collect(),
            chunk_ids: chunk.iter().map(|&i| i as u32).collect(),
            is_promotion: false,
            req_id: "store".into(),
            submit_time: Instant::now(),
        });
    }
    wait_all(tier, n.div_ceil(batch));
    let start = Instant::now();
    let jobs = n.div_ceil(batch);
    for (j, chunk) in (0..n).collect::<Vec<_>>().chunks(batch).enumerate() {
        tier.submit_load(TransferJob {
            job_id: 1_000_000 + j as u64,
            keys: chunk.iter().map(|&i| key(i as u64)).collect(),
            chunk_ids: chunk.iter().map(|&i| i as u32).collect(),
            is_promotion: true,
            req_id: "load".into(),
            submit_time: Instant::now(),
        });
    }
    wait_all(tier, jobs);
    (n * region.row_stride()) as f64 / start.elapsed().as_secs_f64()
}

fn wait_all(tier: &mut dyn SecondaryTier, jobs: usize) {
    let mut done = 0;
    while done < jobs {
        for r in tier.get_finished_jobs() {
            assert!(r.success, "job {} failed: {:?}", r.job_id, r.error);
            done += 1;
        }
        std::thread::yield_now();
    }
}

/// Promotes `n` keys (held by the manager's tier) through the manager: lookups in batches of
/// `batch` keys per request, one `on_schedule_end`, then polling until every key is a HIT.
fn manager_promotion_throughput(m: &mut TieringManager, n: usize, batch: usize) -> f64 {
    let start = Instant::now();
    let mut reqs = Vec::new();
    for (b, chunk) in (0..n).collect::<Vec<_>>().chunks(batch).enumerate() {
        let ctx = RequestContext::new(format!("p{b}"));
        m.on_new_request(&ctx);
        for &i in chunk {
            let r = m.lookup(&key(i as u64), &ctx);
            assert_eq!(r, LookupResult::HitPending, "key {i}");
        }
        reqs.push(ctx);
    }
    m.on_schedule_end(&ScheduleEndContext::default())
        .expect("submit");
    while m.has_pending_work() {
        m.poll().expect("poll");
        std::thread::yield_now();
    }
    let secs = start.elapsed().as_secs_f64();
    for ctx in &reqs {
        m.on_request_finished(ctx);
    }
    (n * m.region().row_stride()) as f64 / secs
}

/// Builds a tier over a region (or `None` to skip).
type MakeTier<'a> = dyn Fn(&Arc<PrimaryRegion>) -> Option<Box<dyn SecondaryTier>> + 'a;

fn throughput(label: &str, make: &MakeTier<'_>, rows: usize, stride: usize) {
    let n = rows / 2;
    let batch = 64;
    let region = Arc::new(PrimaryRegion::create(rows, stride).expect("region"));
    let Some(mut raw) = make(&region) else { return };
    let raw_bps = raw_load_throughput(raw.as_mut(), &region, n, batch);
    // Through the manager: the same tier instance, its data kept, the primary empty.
    let mut m = manager(region.clone(), raw);
    let managed_bps = manager_promotion_throughput(&mut m, n, batch);
    let mib = |b: f64| b / (1u64 << 20) as f64;
    println!(
        "promotion throughput, {label} tier, {n} chunks of {stride} B in jobs of {batch}: raw load {:.0} MiB/s, through the manager {:.0} MiB/s ({:.1} % of raw)",
        mib(raw_bps),
        mib(managed_bps),
        100.0 * managed_bps / raw_bps
    );
    m.shutdown().expect("shutdown");
}

fn main() {
    let rows = env("KVTIER_BENCH_ROWS", 2048);
    let stride = env("KVTIER_BENCH_STRIDE", 64 * 1024);
    let steps = env("KVTIER_BENCH_STEPS", 20_000);
    let g3_dir = std::env::var("KVTIER_BENCH_G3_DIR").unwrap_or_else(|_| "/tmp".into());
    println!(
        "kvtier tiering benchmark: {rows} primary rows of {stride} B (measured on a busy machine unless stated otherwise)"
    );

    let region = Arc::new(PrimaryRegion::create(rows, stride).expect("region"));
    per_call_latency(
        "memory",
        manager(region.clone(), memory_tier(&region)),
        steps,
    );
    throughput("memory", &|r| Some(memory_tier(r)), rows, stride);

    if g3_dir == "none" {
        return;
    }
    let tmp = match tempfile::tempdir_in(PathBuf::from(&g3_dir)) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("skipping G3: cannot create a directory under {g3_dir}: {e}");
            return;
        }
    };
    let region = Arc::new(PrimaryRegion::create(rows, stride).expect("region"));
    if let Some(t) = g3_tier(&region, &tmp.path().join("lat"), rows) {
        per_call_latency("nvme (G3)", manager(region.clone(), Box::new(t)), steps / 4);
    }
    let dir = tmp.path().join("thr");
    throughput(
        "nvme (G3)",
        &|r| g3_tier(r, &dir, rows).map(|t| Box::new(t) as Box<dyn SecondaryTier>),
        rows,
        stride,
    );
}
