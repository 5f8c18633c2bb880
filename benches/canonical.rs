//! Gather / scatter throughput for Llama-3.1-8B (2 MiB per block at TP 1) at TP 1/2/4/8,
//! against a plain memcpy of the same bytes. Each iteration moves one whole chunk: every rank
//! of the TP group gathers its share into the row (store), or scatters it back (load).
//!
//! `cargo bench --bench canonical` runs the criterion groups and then prints a ratio table
//! (memcpy, gather and scatter passes interleaved, best pass of each) against memcpy; the
//! target is >= 0.8. `KVTIER_BENCH_RATIO_ONLY=1` prints only the table.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use kvtier::canonical::{ParallelConfig, RowPlan, default_layout, prepare_canonical};

const TPS: [u32; 4] = [1, 2, 4, 8];
const BLOCKS_PER_CHUNK: u32 = 1;

struct Setup {
    plans: Vec<RowPlan>,
    locals: Vec<Vec<u8>>,
    row: Vec<u8>,
    bytes: u64,
}

fn setup(tp: u32) -> Setup {
    let desc = default_layout();
    let plans: Vec<RowPlan> = (0..tp)
        .map(|rank| {
            prepare_canonical(&desc, &ParallelConfig::tp(tp, rank), BLOCKS_PER_CHUNK, true)
                .expect("Llama-3.1-8B prepares at every TP")
                .plan
        })
        .collect();
    let locals = plans
        .iter()
        .map(|p| {
            (0..p.local_chunk_bytes)
                .map(|i| (i * 31 % 251) as u8)
                .collect()
        })
        .collect();
    let stride = desc.canonical_row_stride(BLOCKS_PER_CHUNK).expect("stride") as usize;
    Setup {
        plans,
        locals,
        row: vec![0u8; stride],
        bytes: desc.canonical_bytes_per_block(),
    }
}

fn gather_all(s: &mut Setup, chunk: u64) {
    for (p, l) in s.plans.iter().zip(&s.locals) {
        p.gather(l, &mut s.row, chunk).expect("gather");
    }
}

fn scatter_all(s: &mut Setup) {
    for (p, l) in s.plans.iter().zip(s.locals.iter_mut()) {
        p.scatter(&s.row, l).expect("scatter");
    }
}

/// Average time of one call over a pass of 20 calls.
fn pass(mut f: impl FnMut()) -> Duration {
    let t = Instant::now();
    for _ in 0..20 {
        f();
    }
    t.elapsed() / 20
}

/// Ratio table for one TP size: memcpy, gather and scatter passes interleaved (so a busy
/// machine slows all three alike), best pass of each kept.
fn ratio_row(tp: u32, src: &[u8], dst: &mut [u8]) {
    let mut s = setup(tp);
    let (mut m, mut g, mut sc) = (Duration::MAX, Duration::MAX, Duration::MAX);
    let mut chunk = 0u64;
    for _ in 0..15 {
        m = m.min(pass(|| dst.copy_from_slice(black_box(src))));
        g = g.min(pass(|| {
            chunk += 1;
            gather_all(&mut s, chunk);
        }));
        sc = sc.min(pass(|| scatter_all(&mut s)));
    }
    let gbps = |d: Duration| s.bytes as f64 / d.as_secs_f64() / 1e9;
    println!(
        "TP {tp}: memcpy {:>6.2} GB/s | gather {:>6.2} GB/s ({:.2} of memcpy) | scatter {:>6.2} GB/s ({:.2} of memcpy)",
        gbps(m),
        gbps(g),
        m.as_secs_f64() / g.as_secs_f64(),
        gbps(sc),
        m.as_secs_f64() / sc.as_secs_f64()
    );
}

fn main() {
    let bytes = default_layout().canonical_bytes_per_block();
    let src = vec![7u8; bytes as usize];
    let mut dst = vec![0u8; bytes as usize];
    if std::env::var_os("KVTIER_BENCH_RATIO_ONLY").is_some() {
        println!("canonical gather/scatter vs memcpy, Llama-3.1-8B, {bytes} bytes per chunk");
        for tp in TPS {
            ratio_row(tp, &src, &mut dst);
        }
        return;
    }
    let mut c = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    let mut group = c.benchmark_group("canonical_llama_3_1_8b");
    group.throughput(Throughput::Bytes(bytes));
    group.bench_function("memcpy", |b| {
        b.iter(|| dst.copy_from_slice(black_box(&src)));
    });
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

    println!("\ncanonical gather/scatter vs memcpy, Llama-3.1-8B, {bytes} bytes per chunk");
    for tp in TPS {
        ratio_row(tp, &src, &mut dst);
    }
}
