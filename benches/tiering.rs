//! Tiering manager benchmark.
//!
//! 1. Per-call latency (p50 / p99 / max) of `lookup` (split into primary hits and lookups that
//!    reach the tier), `prepare_store`, `complete_store` (the cascade submit),
//!    `on_schedule_end` (the promotion submit) and `poll` through the manager, under a mixed
//!    store + load workload, on a `memory` tier and, when /tmp allows it, a G3 (`nvme`) tier,
//!    in four scenarios: steps back to back (the I/O threads always busy); steps paced by a
//!    pause (as a real step waits for the GPU; the I/O threads run out of work in between and
//!    linger) spent busy, as an engine core polling for the GPU's results, or asleep; and
//!    paced asleep with lingering off (every step's first submission wakes a blocked thread).
//!    Each also reports a control (fixed work that calls nothing: the machine's own noise),
//!    the promotion latency from lookup to HIT, the process CPU and the G3 worker's idle naps.
//! 2. End-to-end promotion throughput through the manager versus the same tier's raw load
//!    throughput (jobs submitted straight to the tier), for the same keys and batch size, in
//!    alternating pairs; medians are reported.
//!
//! Run: `cargo bench --bench tiering` (env: `KVTIER_BENCH_ROWS`, `KVTIER_BENCH_STRIDE`,
//! `KVTIER_BENCH_STEPS`, `KVTIER_BENCH_PAIRS`, `KVTIER_BENCH_GAP_US` (the pause of the paced
//! scenarios, default 250), `KVTIER_BENCH_G3_DIR` (default /tmp; `none` to skip G3)).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier::config::EvictionPolicyKind;
use kvtier::contract::job::{LookupResult, RequestContext, TransferJob};
use kvtier::contract::secondary::SecondaryTier;
use kvtier::g3::{FsyncPolicy, G3Tier, G3TierConfig, geometry_namespace};
use kvtier::io::IdlePolicy;
use kvtier::key::ChunkKey;
use kvtier::primary::PrimaryTier;
use kvtier::region::PrimaryRegion;
use kvtier::tiering::memory_tier::{MemoryTier, MemoryTierOptions, XorShift64};
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
    // The benchmark holds `row` reserved (prepare_store) while it writes it.
    let mut dst = region.write_row(row as usize).expect("row in range");
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
            "  {name:<26} n={:<7} p50={:>7.2} us  p99={:>7.2} us  max={:>9.2} us",
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

fn memory_tier(region: &Arc<PrimaryRegion>, idle: IdlePolicy) -> Box<dyn SecondaryTier> {
    let mut opts = MemoryTierOptions::new("1:memory");
    opts.idle = idle;
    Box::new(MemoryTier::start(region.clone(), opts).expect("tier"))
}

fn g3_tier(
    region: &Arc<PrimaryRegion>,
    dir: &std::path::Path,
    rows: usize,
    idle: IdlePolicy,
) -> Option<G3Tier> {
    if let Err(e) = std::fs::create_dir_all(dir) {
        eprintln!("skipping G3: cannot create {}: {e}", dir.display());
        return None;
    }
    let stride = region.row_stride();
    let mut cfg = G3TierConfig::new(vec![dir.to_path_buf()], 4 * rows as u64 * stride);
    cfg.fsync = FsyncPolicy::Never;
    cfg.idle = idle;
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
/// Process CPU time (user + system) so far.
fn cpu_time() -> Duration {
    // SAFETY: getrusage writes one `rusage` into the zeroed value we pass.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// The value of the first metric line starting with `prefix` (0 if none).
fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// How the benchmark thread spends the pause between steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pause {
    /// No pause: steps back to back.
    None,
    /// Asleep: the thread gives up its CPU (which may halt).
    Sleep(Duration),
    /// Busy: the thread keeps its CPU (as an engine core polling for the GPU's results does).
    Busy(Duration),
}

impl Pause {
    fn wait(self) {
        match self {
            Pause::None => {}
            Pause::Sleep(d) => std::thread::sleep(d),
            Pause::Busy(d) => {
                let t = Instant::now();
                while t.elapsed() < d {
                    std::hint::spin_loop();
                }
            }
        }
    }

    fn describe(self) -> String {
        match self {
            Pause::None => "no pause between steps".into(),
            Pause::Sleep(d) => format!("{} us asleep between steps", d.as_micros()),
            Pause::Busy(d) => format!("{} us busy between steps", d.as_micros()),
        }
    }
}

fn per_call_latency(label: &str, mut m: TieringManager, steps: usize, pause: Pause) {
    let (wall0, cpu0) = (Instant::now(), cpu_time());
    let mut rng = XorShift64::new(7);
    let mut lk = Samples::default();
    let mut lk_primary = Samples::default();
    let mut ctl = Samples::default();
    let mut promo = Samples::default();
    let mut promoting: Vec<(ChunkKey, Instant)> = Vec::new();
    let control_buf = vec![7u8; 2048];
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
        // The machine's own noise at this point of the step: fixed work that calls nothing.
        ctl.time(|| crc32fast::hash(std::hint::black_box(&control_buf)));
        let mut missing = Vec::new();
        for k in &keys {
            let t = Instant::now();
            let r = m.lookup(k, &ctx);
            let e = t.elapsed();
            if r == LookupResult::Hit {
                lk_primary.0.push(e);
            } else {
                lk.0.push(e);
            }
            if r == LookupResult::Miss {
                missing.push(k.clone());
            }
            if r == LookupResult::HitPending && !m.primary().lookup(k).eq(&LookupResult::Hit) {
                promoting.push((k.clone(), t));
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
        // Promotions that landed (HIT in the primary) or failed (gone), untimed.
        promoting.retain(|(k, since)| match m.primary().lookup(k) {
            LookupResult::Hit => {
                promo.0.push(since.elapsed());
                false
            }
            LookupResult::HitPending => true,
            _ => false,
        });
        pause.wait();
    }
    while m.has_pending_work() {
        m.poll().expect("poll");
        std::thread::yield_now();
    }
    let wall = wall0.elapsed().as_secs_f64();
    let cpu = (cpu_time() - cpu0).as_secs_f64();
    println!(
        "per-call latency, {label}, {steps} steps, {}:",
        pause.describe()
    );
    ctl.report("control (fixed work)");
    lk_primary.report("lookup, primary hit");
    lk.report("lookup, tier asked");
    ps.report("prepare_store");
    cs.report("complete_store");
    se.report("on_schedule_end");
    po.report("poll");
    promo.report("promotion (lookup to HIT)");
    let text = m.metrics_text();
    let written = metric(
        &text,
        "kvtier:kv_offload_tiering_write_bytes_total{tier=\"1:",
    );
    let naps = metric(&text, "kvtier:g3_idle_naps_total{");
    println!(
        "  {:.0} MiB cascaded; process CPU {:.0} % of one core; idle naps {:.0}/s",
        written / (1u64 << 20) as f64,
        100.0 * cpu / wall,
        naps / wall,
    );
    m.shutdown().expect("shutdown");
}

/// Submits one job per `batch` keys of `0..n` (rows `0..n` of the region) and waits for all.
fn run_jobs(tier: &mut dyn SecondaryTier, n: usize, batch: usize, load: bool, first_id: u64) {
    let all: Vec<usize> = (0..n).collect();
    let chunks: Vec<&[usize]> = all.chunks(batch).collect();
    for (j, chunk) in chunks.iter().enumerate() {
        let job = TransferJob {
            job_id: first_id + j as u64,
            keys: chunk.iter().map(|&i| key(i as u64)).collect(),
            chunk_ids: chunk.iter().map(|&i| i as u32).collect(),
            is_promotion: load,
            req_id: if load { "load" } else { "store" }.into(),
            submit_time: Instant::now(),
        };
        if load {
            tier.submit_load(job);
        } else {
            tier.submit_store(job);
        }
    }
    let mut done = 0;
    while done < chunks.len() {
        for r in tier.get_finished_jobs() {
            assert!(r.success, "job {} failed: {:?}", r.job_id, r.error);
            done += 1;
        }
        std::thread::yield_now();
    }
}

/// Stores keys `0..n` into `tier` straight from rows `0..n` (keys it already holds are
/// skipped), untimed.
fn store_keys(tier: &mut dyn SecondaryTier, region: &PrimaryRegion, n: usize, batch: usize) {
    for i in 0..n {
        fill(region, i as u32, i as u64);
    }
    run_jobs(tier, n, batch, false, 0);
}

/// Raw load throughput: `rounds` times, every key loaded straight from the tier in jobs of
/// `batch` keys, all submitted at once.
fn raw_load_throughput(tier: &mut dyn SecondaryTier, n: usize, batch: usize, rounds: usize) -> f64 {
    let start = Instant::now();
    for r in 0..rounds {
        run_jobs(tier, n, batch, true, 1_000_000 * (r as u64 + 1));
    }
    start.elapsed().as_secs_f64()
}

/// The same loads as promotions through the manager: `rounds` times, lookups in requests of
/// `batch` keys, one `on_schedule_end`, then polling until every promotion landed; between
/// rounds (untimed) the primary is reset so that every key is promoted again.
fn manager_promotion_time(m: &mut TieringManager, n: usize, batch: usize, rounds: usize) -> f64 {
    let mut secs = 0.0;
    for round in 0..rounds {
        let start = Instant::now();
        let mut reqs = Vec::new();
        for (b, chunk) in (0..n).collect::<Vec<_>>().chunks(batch).enumerate() {
            let ctx = RequestContext::new(format!("p{round}-{b}"));
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
        secs += start.elapsed().as_secs_f64();
        for ctx in &reqs {
            m.on_request_finished(ctx);
        }
        m.reset_cache().expect("reset");
        m.on_reset_flushed();
    }
    secs
}

/// Builds a tier over a region (or `None` to skip).
type MakeTier<'a> = dyn Fn(&Arc<PrimaryRegion>) -> Option<Box<dyn SecondaryTier>> + 'a;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Raw tier loads versus promotions through the manager, in `pairs` alternating pairs (each
/// side gets a freshly opened tier holding the same keys); medians are reported.
fn throughput(label: &str, make: &MakeTier<'_>, rows: usize, stride: usize, pairs: usize) {
    let n = rows / 2;
    let batch = 64;
    let rounds = 4;
    let region = Arc::new(PrimaryRegion::create(rows, stride as u64).expect("region"));
    let bytes = (rounds * n * stride) as f64;
    let (mut raw, mut managed, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for pair in 0..pairs {
        let mut one = [0.0; 2];
        // Alternate which side runs first, so that drift in the disk's speed cancels out.
        for side in [pair % 2, 1 - pair % 2] {
            let Some(mut tier) = make(&region) else {
                return;
            };
            store_keys(tier.as_mut(), &region, n, batch);
            if side == 0 {
                one[0] = raw_load_throughput(tier.as_mut(), n, batch, rounds);
                tier.shutdown().expect("shutdown");
            } else {
                let mut m = manager(region.clone(), tier);
                one[1] = manager_promotion_time(&mut m, n, batch, rounds);
                m.shutdown().expect("shutdown");
            }
        }
        raw.push(bytes / one[0]);
        managed.push(bytes / one[1]);
        ratios.push(one[0] / one[1]);
    }
    let mib = |b: f64| b / (1u64 << 20) as f64;
    let ratio = median(&mut ratios); // sorts `ratios`
    println!(
        "promotion throughput, {label} tier, {rounds} x {n} chunks of {stride} B in jobs of {batch}, median of {pairs} alternating pairs: raw load {:.0} MiB/s, through the manager {:.0} MiB/s; manager/raw per pair: median {:.1} % (min {:.1} %, max {:.1} %)",
        mib(median(&mut raw)),
        mib(median(&mut managed)),
        100.0 * ratio,
        100.0 * ratios[0],
        100.0 * ratios[ratios.len() - 1],
    );
}

fn main() {
    let rows = env("KVTIER_BENCH_ROWS", 2048);
    let stride = env("KVTIER_BENCH_STRIDE", 64 * 1024);
    let steps = env("KVTIER_BENCH_STEPS", 20_000);
    let pairs = env("KVTIER_BENCH_PAIRS", 7).max(1);
    let step_gap = Duration::from_micros(env("KVTIER_BENCH_GAP_US", 250) as u64);
    let g3_dir = std::env::var("KVTIER_BENCH_G3_DIR").unwrap_or_else(|_| "/tmp".into());
    println!("kvtier tiering benchmark: {rows} primary rows of {stride} B");

    // Back to back, the I/O threads always have work. Paced (a real step also waits for the
    // GPU), they run out of work between steps and either linger (the default) or block, and
    // then the next step's first submission has to wake them. The pause is spent busy (as an
    // engine core polling for the GPU's results) or asleep (the CPU may halt, and on a VM the
    // next step then starts with cold caches).
    let default = IdlePolicy::default();
    let scenarios = [
        ("steps back to back", Pause::None, default),
        ("steps paced, busy pause", Pause::Busy(step_gap), default),
        (
            "steps paced, sleeping pause",
            Pause::Sleep(step_gap),
            default,
        ),
        (
            "steps paced, sleeping pause, idle linger off",
            Pause::Sleep(step_gap),
            IdlePolicy::BLOCK,
        ),
    ];
    for (what, pause, idle) in scenarios {
        let region = Arc::new(PrimaryRegion::create(rows, stride as u64).expect("region"));
        let n = if pause == Pause::None {
            steps
        } else {
            steps / 4
        };
        let m = manager(region.clone(), memory_tier(&region, idle));
        per_call_latency(&format!("memory tier, {what}"), m, n, pause);
    }
    throughput(
        "memory",
        &|r| Some(memory_tier(r, default)),
        rows,
        stride,
        pairs,
    );

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
    // Back to back, the steps store faster than the disk writes: the primary fills with rows
    // pinned for the cascade and most promotions find no free row. Paced, the disk keeps up
    // and loads flow too.
    for (i, (what, pause, idle)) in scenarios.into_iter().enumerate() {
        let region = Arc::new(PrimaryRegion::create(rows, stride as u64).expect("region"));
        let dir = tmp.path().join(format!("lat-{i}"));
        if let Some(t) = g3_tier(&region, &dir, rows, idle) {
            let m = manager(region.clone(), Box::new(t));
            per_call_latency(&format!("nvme (G3) tier, {what}"), m, steps / 4, pause);
        }
    }
    let dir = tmp.path().join("thr");
    throughput(
        "nvme (G3)",
        &|r| g3_tier(r, &dir, rows, default).map(|t| Box::new(t) as Box<dyn SecondaryTier>),
        rows,
        stride,
        pairs,
    );
}
