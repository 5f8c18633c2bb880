//! Primary tier benchmark: 1M resident chunks (36-byte keys), LRU and ARC.
//!
//! * `query_key_fetch_only`: only reads the bytes of the query keys `lookup_hit` walks
//!   through (a baseline: about 1 ns, so the lookups below measure the lookup).
//! * `lookup_hit` / `lookup_miss`: `lookup` of random resident / absent keys (fresh key
//!   copies, so no pointer-equality shortcut).
//! * `lookup_many_hit_x64`: `lookup_many` of 64 random resident keys per call (throughput
//!   in keys).
//! * `store_cycle`: `prepare_store` of one new key (evicting one) + `complete_store`, the
//!   request finished every 256 cycles; includes building the key from bytes.
//! * `load_pin_unpin`: `prepare_load` + `complete_load` of one random resident key, the
//!   request finished every 256 cycles.
//! * `store_cycle_x16`, `load_pin_unpin_x16`: the same with 16 keys per call (throughput in
//!   keys), where the table entries of the batch are prefetched together.
//!
//! Before the timings it prints the memory per resident chunk measured with a counting
//! global allocator: right after construction, and with every slot resident (keys of up to
//! 36 bytes live inside the slot, so the two should agree).
//!
//! Run: `cargo bench --bench primary` (add `-- --measurement-time 2 --warm-up-time 1` for a
//! quick check).

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvtier::ChunkKey;
use kvtier::config::model::EvictionPolicyKind;
use kvtier::contract::job::{LookupResult, RequestContext};
use kvtier::primary::PrimaryTier;
use kvtier::region::PrimaryRegion;

const RESIDENT: usize = 1 << 20;
const QUERIES: usize = 1 << 16;
const ROW: usize = 4096;

/// Counts live heap bytes (requested and usable) while `COUNTING` is set.
struct CountingAlloc;

static COUNTING: AtomicBool = AtomicBool::new(true);
static REQUESTED: AtomicIsize = AtomicIsize::new(0);
static USABLE: AtomicIsize = AtomicIsize::new(0);

fn usable(p: *mut u8) -> isize {
    // SAFETY: `p` is a live pointer from the system allocator (malloc family).
    unsafe { libc::malloc_usable_size(p.cast()) as isize }
}

fn count(p: *mut u8, size: usize, sign: isize) {
    if !p.is_null() && COUNTING.load(Ordering::Relaxed) {
        REQUESTED.fetch_add(sign * size as isize, Ordering::Relaxed);
        USABLE.fetch_add(sign * usable(p), Ordering::Relaxed);
    }
}

// SAFETY: every call forwards to `System` with the same arguments; counting only reads the
// returned pointers.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: forwarded contract.
        let p = unsafe { System.alloc(l) };
        count(p, l.size(), 1);
        p
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        // SAFETY: forwarded contract.
        let p = unsafe { System.alloc_zeroed(l) };
        count(p, l.size(), 1);
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        count(p, l.size(), -1);
        // SAFETY: forwarded contract.
        unsafe { System.dealloc(p, l) }
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new_size: usize) -> *mut u8 {
        count(p, l.size(), -1);
        // SAFETY: forwarded contract.
        let q = unsafe { System.realloc(p, l, new_size) };
        if q.is_null() {
            count(p, l.size(), 1);
        } else {
            count(q, new_size, 1);
        }
        q
    }
}

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

fn live() -> (isize, isize) {
    (
        REQUESTED.load(Ordering::Relaxed),
        USABLE.load(Ordering::Relaxed),
    )
}

/// A 36-byte key that looks like a sha256 block hash plus a group id.
fn key(i: u64) -> ChunkKey {
    let mut b = [0u8; 36];
    let mut x = i;
    for chunk in b[..32].chunks_exact_mut(8) {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        chunk.copy_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    ChunkKey::new(b)
}

fn rng(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// A 1M-row region that is never touched: reserved address space, adopted.
fn region() -> Arc<PrimaryRegion> {
    let len = RESIDENT * ROW;
    // SAFETY: anonymous private mapping with no backing fd; checked for MAP_FAILED.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED, "cannot reserve {len} bytes");
    // SAFETY: the mapping is `len` bytes, page-aligned, and deliberately never unmapped, so
    // it outlives every holder of the region.
    let r = unsafe { PrimaryRegion::adopt(p.cast(), ROW as u64, RESIDENT) }.expect("adopt");
    Arc::new(r)
}

fn filled(policy: EvictionPolicyKind) -> PrimaryTier {
    let region = region();
    let base = live();
    let mut t = PrimaryTier::new(region, policy, false);
    let fixed = live();
    let req = RequestContext::new("fill");
    for batch in 0..(RESIDENT / 1024) as u64 {
        let ks: Vec<ChunkKey> = (batch * 1024..(batch + 1) * 1024).map(key).collect();
        let out = t.prepare_store(&ks, &req).expect("fill");
        t.complete_store(&out.keys_to_store, true);
    }
    t.on_request_finished(&req);
    // Every other key reused once (ARC: half in T2), as a mixed workload would leave it.
    for i in (0..RESIDENT as u64).step_by(2) {
        t.touch(&[key(i)]);
    }
    let full = live();
    let per = |a: isize, b: isize| (a - b) as f64 / RESIDENT as f64;
    let fp = t.memory_footprint();
    println!(
        "memory {policy:?}: {:.1} B/chunk after construction, {:.1} B/chunk with {RESIDENT} \
         resident 36-byte keys (requested bytes; allocator usable bytes {:.1}; computed from \
         the structures {:.1}); keys up to 36 bytes are stored inside the slot",
        per(fixed.0, base.0),
        per(full.0, base.0),
        per(full.1, base.1),
        fp.bytes_per_chunk(),
    );
    t
}

fn bench_policy(c: &mut Criterion, policy: EvictionPolicyKind) {
    COUNTING.store(true, Ordering::Relaxed);
    let mut t = filled(policy);
    COUNTING.store(false, Ordering::Relaxed);
    let name = format!("primary_{}", t.policy_name());
    let mut g = c.benchmark_group(&name);
    g.throughput(Throughput::Elements(1));

    let mut s = 0x1234_5678_9abc_def0u64;
    let hits: Vec<ChunkKey> = (0..QUERIES)
        .map(|_| key(rng(&mut s) % RESIDENT as u64))
        .collect();
    let misses: Vec<ChunkKey> = (0..QUERIES)
        .map(|_| key(u64::MAX / 2 + rng(&mut s) % (1 << 40)))
        .collect();

    let mut i = 0;
    // Baseline for the lookups below: only fetch the query key's bytes (the same walk over
    // `hits`), to show how much of a lookup is spent getting the query key.
    g.bench_function("query_key_fetch_only", |b| {
        b.iter(|| {
            i = (i + 1) & (QUERIES - 1);
            let k = hits[i].as_bytes();
            black_box(k[0] ^ k[k.len() - 1])
        })
    });
    g.bench_function("lookup_hit", |b| {
        b.iter(|| {
            i = (i + 1) & (QUERIES - 1);
            black_box(t.lookup(&hits[i]))
        })
    });
    // The same random resident keys, 64 per call: latency of up to 16 keys overlaps.
    g.throughput(Throughput::Elements(64));
    let mut res = Vec::with_capacity(64);
    let mut j = 0;
    g.bench_function("lookup_many_hit_x64", |b| {
        b.iter(|| {
            j = (j + 64) & (QUERIES - 1);
            res.clear();
            t.lookup_many(&hits[j..j + 64], &mut res);
            black_box(res.len())
        })
    });
    g.throughput(Throughput::Elements(1));
    g.bench_function("lookup_miss", |b| {
        b.iter(|| {
            i = (i + 1) & (QUERIES - 1);
            black_box(t.lookup(&misses[i]))
        })
    });

    let req = RequestContext::new("bench");
    let mut next = RESIDENT as u64 * 4;
    g.bench_function("store_cycle", |b| {
        b.iter(|| {
            next += 1;
            let k = [key(next)];
            let out = t.prepare_store(&k, &req).expect("store refused");
            debug_assert_eq!(out.evicted_keys.len(), 1);
            t.complete_store(&out.keys_to_store, true);
            if next & 255 == 0 {
                t.on_request_finished(&req);
            }
            black_box(out.chunk_ids[0])
        })
    });

    // The same with 16 keys per call (one request's new chunks), throughput in keys.
    g.throughput(Throughput::Elements(16));
    g.bench_function("store_cycle_x16", |b| {
        b.iter(|| {
            let ks: Vec<ChunkKey> = (0..16)
                .map(|_| {
                    next += 1;
                    key(next)
                })
                .collect();
            let out = t.prepare_store(&ks, &req).expect("store refused");
            t.complete_store(&out.keys_to_store, true);
            if next & 255 < 16 {
                t.on_request_finished(&req);
            }
            black_box(out.chunk_ids.len())
        })
    });
    g.throughput(Throughput::Elements(1));

    // Random resident keys: recently stored ones or survivors of the fill.
    let first_stored = RESIDENT as u64 * 4;
    let mut resident: Vec<ChunkKey> = Vec::with_capacity(QUERIES);
    while resident.len() < QUERIES {
        let r = rng(&mut s);
        let k = if r & 1 == 0 && next > first_stored {
            key(next - (r >> 1) % (next - first_stored).min(RESIDENT as u64))
        } else {
            key((r >> 1) % RESIDENT as u64)
        };
        if t.lookup(&k) == LookupResult::Hit {
            resident.push(k);
        }
    }
    let mut n = 0u64;
    g.bench_function("load_pin_unpin", |b| {
        b.iter(|| {
            i = (i + 1) & (QUERIES - 1);
            let k = std::slice::from_ref(&resident[i]);
            let ids = t.prepare_load(k, &req).expect("load");
            t.complete_load(k).expect("unload");
            n += 1;
            if n & 255 == 0 {
                t.on_request_finished(&req);
            }
            black_box(ids)
        })
    });
    g.throughput(Throughput::Elements(16));
    let mut m = 0usize;
    g.bench_function("load_pin_unpin_x16", |b| {
        b.iter(|| {
            m = (m + 16) & (QUERIES - 1);
            let ks = &resident[m..m + 16];
            let ids = t.prepare_load(ks, &req).expect("load");
            t.complete_load(ks).expect("unload");
            n += 16;
            if n & 255 < 16 {
                t.on_request_finished(&req);
            }
            black_box(ids)
        })
    });
    g.finish();
    t.on_request_finished(&req);
    t.check_consistency()
        .expect("consistent after the benchmark");
}

fn primary(c: &mut Criterion) {
    bench_policy(c, EvictionPolicyKind::Lru);
    bench_policy(c, EvictionPolicyKind::Arc);
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(20);
    targets = primary
}
criterion_main!(benches);
