//! Round trip of a full KV block through the canonical layout: shard it per rank as vLLM
//! holds it, gather into a canonical primary row (elected writers only), store the row in the
//! G3 tier, load it back under every TP size the model allows, scatter, and compare byte for
//! byte with that TP's independently encoded shards. Also the direct (per-rank) path: it loads
//! under the same topology and the G3 tier refuses it under any other.

mod canonical_support;

use std::sync::Arc;

use canonical_support::{
    all_layouts, encode_local_chunk, g3_transfer, open_g3, open_g3_slots, reduced,
};
use kvtier::canonical::digest::{NamespaceParams, check_namespace, namespace_digest};
use kvtier::canonical::gather::rank_page_range;
use kvtier::canonical::{
    KvLayout, KvSplit, LayoutDescriptor, ParallelConfig, PreparedCanonical, prepare_canonical,
};
use kvtier::contract::secondary::SecondaryTier;
use kvtier::region::PrimaryRegion;

const TPS: [u32; 4] = [1, 2, 4, 8];
const SENTINEL: u8 = 0xEE;

fn prepare(desc: &LayoutDescriptor, tp: u32, rank: u32, bpc: u32) -> PreparedCanonical {
    prepare_canonical(desc, &ParallelConfig::tp(tp, rank), bpc, true)
        .unwrap_or_else(|e| panic!("{} TP {tp} rank {rank}: {e}", desc.model_name))
}

/// Reference shards of chunk `chunk`: `[rank]` local chunks at TP `tp`.
fn shards(desc: &LayoutDescriptor, tp: u32, bpc: u32, chunk: u64) -> Vec<Vec<u8>> {
    (0..tp)
        .map(|rank| encode_local_chunk(desc, tp, rank, chunk, bpc))
        .collect()
}

/// Stores every rank's shard of `tp_store` into `row`, checking that exactly the canonical
/// area was written once and that it equals the unsharded block (the TP 1 encoding).
fn store_all_ranks(
    desc: &LayoutDescriptor,
    tp_store: u32,
    bpc: u32,
    chunk: u64,
    local: &[Vec<u8>],
    canonical: &[u8],
    row: &mut [u8],
) {
    row.fill(SENTINEL);
    let mut written = 0;
    let mut area = 0;
    for rank in 0..tp_store {
        let p = prepare(desc, tp_store, rank, bpc);
        assert!(p.status.all_layers_portable);
        area = p.plan.canonical_area_bytes;
        written += p.plan.gather(&local[rank as usize], row, chunk).unwrap();
    }
    assert_eq!(
        written, area,
        "{} TP {tp_store}: elected writers must write the canonical area exactly once",
        desc.model_name
    );
    assert_eq!(canonical.len() as u64, area);
    assert!(
        row[..canonical.len()] == canonical[..],
        "{} TP {tp_store} chunk {chunk}: canonical area differs from the unsharded block",
        desc.model_name
    );
    assert!(
        row[canonical.len()..].iter().all(|&b| b == SENTINEL),
        "padding written"
    );
}

/// Loads `row` under `tp_load` and compares every rank's shard with its reference encoding.
fn load_all_ranks(
    desc: &LayoutDescriptor,
    tp_load: u32,
    bpc: u32,
    expected: &[Vec<u8>],
    row: &[u8],
    tp_store: u32,
) {
    for rank in 0..tp_load {
        let p = prepare(desc, tp_load, rank, bpc);
        let mut local = vec![0u8; p.plan.local_chunk_bytes as usize];
        let n = p.plan.scatter(row, &mut local).unwrap();
        assert_eq!(n, p.plan.local_chunk_bytes);
        assert!(
            local == expected[rank as usize],
            "{}: stored at TP {tp_store}, loaded at TP {tp_load} rank {rank}: bytes differ",
            desc.model_name
        );
    }
}

/// The full matrix for one descriptor: every TP size stores its chunks (gathered into a primary
/// row of vLLM's size for that TP) into one G3 store opened under its own namespace, with slots
/// of the canonical area; then every TP size reopens that same store (its namespace is equal:
/// the layout is portable, and neither the namespace nor the slots depend on vLLM's row, which
/// is twice the canonical area for Qwen2.5-3B at TP 4 and 8), loads every chunk into its own
/// row, scatters and compares. Nothing here overrides a row stride or a namespace.
fn round_trip(desc: &LayoutDescriptor, bpc: u32, chunks: &[u64]) {
    let tps = desc.allowed_tp(&TPS);
    assert!(!tps.is_empty(), "{}: no TP size allowed", desc.model_name);
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let slots = (tps.len() * chunks.len()) as u64;
    let params = |tp| NamespaceParams::new(desc, tp, bpc, true).unwrap();
    let canonical_stride = desc.canonical_row_stride(bpc).unwrap();
    for &tp in &tps {
        let p = params(tp);
        assert_eq!(
            p.slot_bytes, canonical_stride,
            "{} TP {tp}",
            desc.model_name
        );
        assert_eq!(
            namespace_digest(desc, &p),
            namespace_digest(desc, &params(tps[0])),
            "{} TP {tp}: one namespace for every TP size",
            desc.model_name
        );
    }
    // vLLM's row for `tp`, and the G3 tier's slots: the canonical area (a prefix of the row).
    let open = |tp: u32| {
        let p = params(tp);
        let region = Arc::new(PrimaryRegion::create(2, p.row_stride).unwrap());
        let g3 = open_g3_slots(
            dir.path(),
            &region,
            namespace_digest(desc, &p),
            slots,
            p.slot_prefix(),
        );
        (region, g3)
    };
    let key = |i: usize, c: usize| (i * chunks.len() + c) as u64;
    let canonical: Vec<Vec<u8>> = chunks
        .iter()
        .map(|&c| encode_local_chunk(desc, 1, 0, c, bpc))
        .collect();
    let by_tp: Vec<Vec<Vec<Vec<u8>>>> = tps
        .iter()
        .map(|&tp| chunks.iter().map(|&c| shards(desc, tp, bpc, c)).collect())
        .collect();
    for (i, &tp_store) in tps.iter().enumerate() {
        let (region, g3) = open(tp_store);
        let mut g3 = g3.unwrap();
        for (c, &chunk) in chunks.iter().enumerate() {
            // This test is the only user of the region; no I/O is in flight.
            let mut row = region.write_row(0).unwrap();
            store_all_ranks(
                desc,
                tp_store,
                bpc,
                chunk,
                &by_tp[i][c],
                &canonical[c],
                &mut row,
            );
            drop(row);
            g3_transfer(&mut g3, key(i, c), 0, false);
        }
        g3.shutdown().unwrap();
    }
    for (j, &tp_load) in tps.iter().enumerate() {
        let (region, g3) = open(tp_load);
        let mut g3 = g3.unwrap_or_else(|e| {
            panic!(
                "{} TP {tp_load}: portable store refused: {e}",
                desc.model_name
            )
        });
        for (i, &tp_store) in tps.iter().enumerate() {
            for (c, expected) in by_tp[j].iter().enumerate() {
                // As above.
                region.write_row(1).unwrap().fill(SENTINEL);
                g3_transfer(&mut g3, key(i, c), 1, true);
                // As above; the load has completed.
                let row = region.read_row(1).unwrap();
                // The transfer covers the slot (the canonical area's prefix of the row) only.
                assert!(
                    row[canonical_stride as usize..]
                        .iter()
                        .all(|&b| b == SENTINEL),
                    "{} TP {tp_load}: a load wrote past the canonical area",
                    desc.model_name
                );
                load_all_ranks(desc, tp_load, bpc, expected, &row, tp_store);
            }
        }
        g3.shutdown().unwrap();
    }
}

/// Every shipped descriptor, reduced (3 layers, 4 tokens), 3 blocks per chunk, chunks whose
/// page ids rotate the writer election.
#[test]
fn reduced_descriptors_round_trip_across_tp() {
    for (name, d) in all_layouts() {
        eprintln!("round trip (reduced): {name}");
        round_trip(&reduced(&d, 3, 4), 3, &[0, 1, 5]);
    }
}

/// Every page encoding (NHD / HND, split / packed) on a reduced GQA model with replication
/// (2 KV heads, TP up to 8) and one without (8 KV heads).
#[test]
fn every_page_encoding_round_trips() {
    for (name, d) in all_layouts() {
        if d.is_mla() || !(name.starts_with("qwen2.5-3b") || name.starts_with("llama-3.1-8b")) {
            continue;
        }
        for layout in [KvLayout::Nhd, KvLayout::Hnd] {
            for split in [KvSplit::Split, KvSplit::Packed] {
                let mut v = reduced(&d, 2, 3);
                v.kv_layout = layout;
                v.kv_split = Some(split);
                eprintln!("round trip: {name} {layout:?} {split:?}");
                round_trip(&v, 2, &[0, 3]);
            }
        }
    }
}

/// The real descriptors at full size, one block.
#[test]
fn real_descriptors_round_trip_one_block() {
    for (name, d) in all_layouts() {
        eprintln!("round trip (full size): {name}");
        round_trip(&d, 1, &[1]);
    }
}

/// The direct layout: each rank's page whole at `rank * page`. A G3 store written under one TP
/// size reopens and loads under the same topology; under any other TP size the tier refuses to
/// open it (the namespace digests differ). Rows share one stride so that only the namespace
/// can tell the topologies apart.
#[test]
fn direct_path_loads_only_under_the_same_topology() {
    for (name, d) in all_layouts() {
        let d = reduced(&d, 2, 4);
        let bpc = 2;
        let tps = d.allowed_tp(&TPS);
        let stride = tps
            .iter()
            .map(|&tp| NamespaceParams::new(&d, tp, bpc, false).unwrap().row_stride)
            .max()
            .unwrap();
        let ns = |tp| {
            let mut p = NamespaceParams::new(&d, tp, bpc, false).unwrap();
            (p.row_stride, p.slot_bytes) = (stride, stride);
            namespace_digest(&d, &p)
        };
        let region = Arc::new(PrimaryRegion::create(2, stride).unwrap());
        for &tp in &tps {
            let dir = tempfile::tempdir_in("/tmp").unwrap();
            let replicated = NamespaceParams::new(&d, tp, bpc, false)
                .unwrap()
                .replicated_layout;
            let page = d.worker_kv_bytes_per_block(tp).unwrap() * u64::from(bpc);
            let slot = |rank: u32| if replicated { 0 } else { rank };
            {
                // This test is the only user of the region; no I/O is in flight.
                let mut row = region.write_row(0).unwrap();
                row.fill(SENTINEL);
                for rank in 0..tp {
                    let r = rank_page_range(page, slot(rank));
                    let local = encode_local_chunk(&d, tp, rank, 7, bpc);
                    row[r.start as usize..r.end as usize].copy_from_slice(&local);
                }
            }
            let mut g3 = open_g3(dir.path(), &region, ns(tp), 2).unwrap();
            g3_transfer(&mut g3, 1, 0, false);
            g3.shutdown().unwrap();
            // Same topology: reopens, loads, every rank finds its own page.
            let mut g3 = open_g3(dir.path(), &region, ns(tp), 2).unwrap();
            // As above.
            region.write_row(1).unwrap().fill(0);
            g3_transfer(&mut g3, 1, 1, true);
            g3.shutdown().unwrap();
            // As above; the load has completed.
            let row = region.read_row(1).unwrap();
            for rank in 0..tp {
                let r = rank_page_range(page, slot(rank));
                let expected = encode_local_chunk(&d, tp, rank, 7, bpc);
                assert!(
                    row[r.start as usize..r.end as usize] == expected[..],
                    "{name} TP {tp} rank {rank}"
                );
            }
            // Any other topology: refused before a byte is read.
            for &other in tps.iter().filter(|&&o| o != tp) {
                let e = open_g3(dir.path(), &region, ns(other), 2)
                    .expect_err("direct bytes must be refused under another TP");
                assert_eq!(
                    e.kind(),
                    kvtier::ErrorKind::IncompatibleLayout,
                    "{name}: {e}"
                );
                check_namespace("direct store", &ns(tp), &ns(other)).unwrap_err();
            }
        }
    }
}
