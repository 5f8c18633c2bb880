//! Gather / scatter throughput for Llama-3.1-8B (2 MiB per block at TP 1) at TP 1/2/4/8,
//! against a plain memcpy of the same bytes. Each iteration moves one whole chunk: every rank
//! of the TP group gathers its share into the row (store), or scatters it back (load).
//!
//! `cargo bench --bench canonical` runs the criterion groups and then prints a ratio table;
//! `KVTIER_BENCH_RATIO_ONLY=1` prints only the table (`KVTIER_BENCH_ROUNDS`, default 41, sets
//! its number of rounds). The target is >= 0.8 of memcpy.
//!
//! Like with like: memcpy copies one contiguous block of exactly the bytes a gather (or scatter)
//! of the whole TP group moves, between two buffers of that size, so both sides read and write
//! the same footprint (2 MiB in, 2 MiB out). Every buffer is page aligned, as primary rows and
//! pinned worker pages are (`KVTIER_BENCH_OFFSET=16` shifts every buffer 16 bytes past the page,
//! where a `Vec` of this size lands), and filled with non-zero bytes before timing (no shared
//! zero pages); every destination goes through `black_box`, so no copy can be elided.
//!
//! Each round runs 8 consecutive calls of memcpy, of gather and of scatter (the side order
//! rotating per round, so a busy machine slows all three alike) and keeps each side's fastest
//! call: its buffers warm, preempted calls dropped. The round's two ratios (memcpy time over
//! gather / scatter time) are recorded; the table prints their median over the rounds with the
//! 10th-90th percentile spread, and the median throughputs.
//!
//! The page encoding is the shipped descriptor's (`packed`, what vLLM 0.33 allocates);
//! `KVTIER_BENCH_KV_SPLIT=split` measures the `split` description the descriptors carried
//! before issue 13, for side-by-side runs.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use kvtier::canonical::{
    KvSplit, LayoutDescriptor, ParallelConfig, RowPlan, default_layout, prepare_canonical,
};

const TPS: [u32; 4] = [1, 2, 4, 8];
const BLOCKS_PER_CHUNK: u32 = 1;
/// Consecutive calls of each side per round; a round keeps each side's fastest call (buffers
/// warm, preempted calls dropped).
const CALLS_PER_ROUND: usize = 8;

/// Llama-3.1-8B, with the page encoding `KVTIER_BENCH_KV_SPLIT` names (`packed`, the default,
/// or `split`).
fn bench_layout() -> LayoutDescriptor {
    let mut desc = default_layout();
    match std::env::var("KVTIER_BENCH_KV_SPLIT").as_deref() {
        Err(_) | Ok("packed") => {}
        Ok("split") => desc.kv_split = Some(KvSplit::Split),
        Ok(other) => panic!("KVTIER_BENCH_KV_SPLIT={other}: expected packed or split"),
    }
    desc
}

/// Every buffer starts this many bytes past a page boundary (`KVTIER_BENCH_OFFSET`, default 0).
fn buffer_offset() -> usize {
    std::env::var("KVTIER_BENCH_OFFSET")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// A buffer starting [`buffer_offset`] bytes past a 4 KiB boundary, as primary rows (page
/// aligned, multiples of 4096) and pinned worker pages are, rather than wherever the allocator
/// puts a `Vec` (16 bytes past a page for large ones, which splits every head fragment over an
/// extra cache line).
struct Buf {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl Buf {
    fn pattern(len: u64, seed: u64) -> Buf {
        let len = len as usize;
        let mut storage = vec![0u8; len + 8192];
        let start = storage.as_ptr().align_offset(4096) + buffer_offset();
        for (i, x) in storage[start..start + len].iter_mut().enumerate() {
            *x = ((i as u64 * 31 + seed) % 251 + 1) as u8;
        }
        Buf {
            storage,
            start,
            len,
        }
    }

    fn get(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }

    fn get_mut(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

struct Setup {
    plans: Vec<RowPlan>,
    locals: Vec<Buf>,
    row: Buf,
    bytes: u64,
}

fn setup(tp: u32) -> Setup {
    let desc = bench_layout();
    let plans: Vec<RowPlan> = (0..tp)
        .map(|rank| {
            prepare_canonical(&desc, &ParallelConfig::tp(tp, rank), BLOCKS_PER_CHUNK, true)
                .expect("Llama-3.1-8B prepares at every TP")
                .plan
        })
        .collect();
    let locals = plans
        .iter()
        .zip(0u64..)
        .map(|(p, seed)| Buf::pattern(p.local_chunk_bytes, seed))
        .collect();
    let area = plans[0].canonical_area_bytes;
    let bytes = desc.canonical_bytes_per_block() * u64::from(BLOCKS_PER_CHUNK);
    assert_eq!(area, bytes, "the canonical area is the bytes moved");
    let total_local: u64 = plans.iter().map(|p| p.local_chunk_bytes).sum();
    assert_eq!(
        total_local, bytes,
        "no replicated heads for Llama-3.1-8B at TP <= 8"
    );
    // The row is exactly the canonical area, like the memcpy destination.
    Setup {
        plans,
        locals,
        row: Buf::pattern(area, 99),
        bytes,
    }
}

fn gather_all(s: &mut Setup, chunk: u64) {
    for (p, l) in s.plans.iter().zip(&s.locals) {
        p.gather(black_box(l.get()), black_box(s.row.get_mut()), chunk)
            .expect("gather");
    }
    black_box(s.row.get_mut());
}

fn scatter_all(s: &mut Setup) {
    for (p, l) in s.plans.iter().zip(s.locals.iter_mut()) {
        p.scatter(black_box(s.row.get()), black_box(l.get_mut()))
            .expect("scatter");
        black_box(l.get_mut());
    }
}

fn memcpy(dst: &mut [u8], src: &[u8]) {
    black_box(&mut *dst).copy_from_slice(black_box(src));
    black_box(dst);
}

/// Time of one call.
fn once(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

/// The `q` quantile (0..=1) of `v` (sorted in place), nearest rank.
fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// Ratio row for one TP size: `rounds` rounds of [`CALLS_PER_ROUND`] consecutive memcpy, gather
/// and scatter calls each (side order rotating), the fastest call of each side per round, ratios
/// per round, their median and 10th-90th percentile printed.
fn ratio_row(tp: u32, rounds: usize, src: &[u8], dst: &mut [u8]) {
    let mut s = setup(tp);
    assert_eq!(src.len() as u64, s.bytes);
    let mut chunk = 0u64;
    // Warm every buffer and code path once.
    memcpy(dst, src);
    gather_all(&mut s, chunk);
    scatter_all(&mut s);
    let (mut m, mut g, mut sc) = (Vec::new(), Vec::new(), Vec::new());
    let (mut rg, mut rs) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let mut best = [f64::MAX; 3];
        for k in 0..3 {
            let which = (k + round) % 3;
            for _ in 0..CALLS_PER_ROUND {
                let t = match which {
                    0 => once(|| memcpy(dst, src)),
                    1 => once(|| {
                        chunk += 1;
                        gather_all(&mut s, chunk);
                    }),
                    _ => once(|| scatter_all(&mut s)),
                };
                best[which] = best[which].min(t);
            }
        }
        m.push(best[0]);
        g.push(best[1]);
        sc.push(best[2]);
        rg.push(best[0] / best[1]);
        rs.push(best[0] / best[2]);
    }
    let gbps = |v: &mut Vec<f64>| s.bytes as f64 / quantile(v, 0.5) / 1e9;
    let (mg, ms, mm) = (gbps(&mut g), gbps(&mut sc), gbps(&mut m));
    let spread = |v: &mut Vec<f64>| (quantile(v, 0.5), quantile(v, 0.1), quantile(v, 0.9));
    let ((g50, g10, g90), (s50, s10, s90)) = (spread(&mut rg), spread(&mut rs));
    println!(
        "TP {tp}: memcpy {mm:>6.2} GB/s | gather {mg:>6.2} GB/s, {g50:.2} of memcpy (p10-p90 {g10:.2}-{g90:.2}) | scatter {ms:>6.2} GB/s, {s50:.2} of memcpy (p10-p90 {s10:.2}-{s90:.2})"
    );
}

fn main() {
    let desc = bench_layout();
    let bytes = desc.canonical_bytes_per_block() * u64::from(BLOCKS_PER_CHUNK);
    let encoding = desc.split().as_str();
    let src_buf = Buf::pattern(bytes, 7);
    let mut dst_buf = Buf::pattern(bytes, 3);
    let (src, dst) = (src_buf.get(), dst_buf.get_mut());
    let rounds = std::env::var("KVTIER_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or(41);
    let offset = buffer_offset();
    let table = |dst: &mut [u8]| {
        println!(
            "canonical gather/scatter vs memcpy, Llama-3.1-8B ({encoding} pages), {bytes} bytes per chunk, buffers {offset} B past a page, {rounds} rounds of the best of {CALLS_PER_ROUND} calls per side, median ratio (p10-p90)"
        );
        for tp in TPS {
            ratio_row(tp, rounds, src, dst);
        }
    };
    if std::env::var_os("KVTIER_BENCH_RATIO_ONLY").is_some() {
        table(dst);
        return;
    }
    let mut c = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    let mut group = c.benchmark_group("canonical_llama_3_1_8b");
    group.throughput(Throughput::Bytes(bytes));
    group.bench_function("memcpy", |b| b.iter(|| memcpy(dst, src)));
    for tp in TPS {
        let mut s = setup(tp);
        group.bench_function(format!("gather_tp{tp}"), |b| {
            let mut chunk = 0u64;
            b.iter(|| {
                chunk += 1;
                gather_all(&mut s, chunk);
            });
        });
        group.bench_function(format!("scatter_tp{tp}"), |b| {
            b.iter(|| scatter_all(&mut s))
        });
    }
    group.finish();
    c.final_summary();
    println!();
    table(dst);
}
