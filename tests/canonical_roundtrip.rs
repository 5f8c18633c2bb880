//! Round trip of a full KV block through the canonical layout: shard it per rank as vLLM
//! holds it, gather into a canonical primary row (elected writers only), then load it back
//! under every TP size the model allows, scatter, and compare byte for byte with that TP's
//! independently encoded shards. Also the direct (per-rank) path: same topology only.

mod canonical_support;

use canonical_support::{all_layouts, encode_local_chunk, reduced};
use kvtier::canonical::digest::{NamespaceParams, check_namespace, namespace_digest};
use kvtier::canonical::gather::direct_row_range;
use kvtier::canonical::{
    KvLayout, KvSplit, LayoutDescriptor, ParallelConfig, PreparedCanonical, prepare_canonical,
};
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

/// The full matrix for one descriptor: store at each TP, load at every TP, through a row of
/// a primary region (the G3 tier is not on this branch yet; see docs/canonical.md).
fn round_trip(desc: &LayoutDescriptor, bpc: u32, chunks: &[u64]) {
    let tps = desc.allowed_tp(&TPS);
    assert!(!tps.is_empty(), "{}: no TP size allowed", desc.model_name);
    let stride = desc.canonical_row_stride(bpc).unwrap() as usize;
    let region = PrimaryRegion::create(1, stride).unwrap();
    // Portable namespaces agree across TP for rows of the same stride.
    let ns = |tp| {
        let mut p = NamespaceParams::new(desc, tp, bpc, true).unwrap();
        p.row_stride = stride as u64;
        namespace_digest(desc, &p)
    };
    for &chunk in chunks {
        let canonical = encode_local_chunk(desc, 1, 0, chunk, bpc);
        let by_tp: Vec<Vec<Vec<u8>>> = tps.iter().map(|&tp| shards(desc, tp, bpc, chunk)).collect();
        for (i, &tp_store) in tps.iter().enumerate() {
            // SAFETY: this test is the only user of the region.
            let row = unsafe { region.row_mut(0).unwrap() };
            store_all_ranks(desc, tp_store, bpc, chunk, &by_tp[i], &canonical, row);
            for (j, &tp_load) in tps.iter().enumerate() {
                check_namespace("test row", &ns(tp_store), &ns(tp_load)).unwrap();
                // SAFETY: as above; the mutable view is no longer used.
                let row = unsafe { region.row(0).unwrap() };
                load_all_ranks(desc, tp_load, bpc, &by_tp[j], row, tp_store);
            }
        }
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

/// The direct layout: each rank's page whole at `rank * page`; loads under the same topology,
/// refused (namespace mismatch) under any other.
#[test]
fn direct_path_loads_only_under_the_same_topology() {
    for (name, d) in all_layouts() {
        let d = reduced(&d, 2, 4);
        let bpc = 2;
        let tps = d.allowed_tp(&TPS);
        let ns = |tp| namespace_digest(&d, &NamespaceParams::new(&d, tp, bpc, false).unwrap());
        for &tp in &tps {
            let params = NamespaceParams::new(&d, tp, bpc, false).unwrap();
            let mut row = vec![SENTINEL; params.row_stride as usize];
            let page = d.worker_kv_bytes_per_block(tp).unwrap() * u64::from(bpc);
            let slot = |rank: u32| if params.replicated_layout { 0 } else { rank };
            for rank in 0..tp {
                let r = direct_row_range(page, slot(rank));
                let local = encode_local_chunk(&d, tp, rank, 7, bpc);
                row[r.start as usize..r.end as usize].copy_from_slice(&local);
            }
            for rank in 0..tp {
                let r = direct_row_range(page, slot(rank));
                let expected = encode_local_chunk(&d, tp, rank, 7, bpc);
                assert!(
                    row[r.start as usize..r.end as usize] == expected[..],
                    "{name} TP {tp} rank {rank}"
                );
            }
            for &other in &tps {
                let verdict = check_namespace("direct row", &ns(tp), &ns(other));
                if other == tp {
                    verdict.unwrap();
                } else {
                    let e = verdict.expect_err("direct bytes must be refused under another TP");
                    assert_eq!(
                        e.kind(),
                        kvtier::ErrorKind::IncompatibleLayout,
                        "{name}: {e}"
                    );
                }
            }
        }
    }
}
