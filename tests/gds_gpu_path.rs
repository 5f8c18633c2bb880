//! The GPUDirect Storage data path against the CPU path, with host memory standing in for GPU
//! memory (`kvtier_gds::device::HostDevice`, every address checked): a chunk stored from "GPU"
//! blocks is an ordinary G3 slot that the CPU path loads (same bytes as `RowPlan::gather`, same
//! CRC, same journal: it survives a restart); a chunk stored by the CPU path (TP 2, two ranks
//! gathering into the shared row) loads into the blocks of every TP 4 rank (same bytes as
//! `RowPlan::scatter`); a corrupted slot fails its key before its blocks are touched.
#![cfg(feature = "gds")]

mod g3_common;

use std::sync::Arc;

use g3_common::{job, run, tmpdir};
use kvtier::canonical::{LayoutDescriptor, RowPlan, derive_mappings};
use kvtier::contract::job::LookupResult;
use kvtier::contract::secondary::SecondaryTier;
use kvtier::g3::gpu_path::{GpuChunk, GpuPath};
use kvtier::g3::{G3Tier, G3TierConfig, geometry_namespace};
use kvtier::key::ChunkKey;
use kvtier::region::PrimaryRegion;
use kvtier_gds::device::{Device, HostDevice};
use kvtier_gds::plan::{GpuLayout, LayerPages};

const BLOCKS_PER_CHUNK: u32 = 2;
/// GPU blocks per layer in each rank's "KV cache".
const GPU_BLOCKS: u64 = 8;

fn layout() -> LayoutDescriptor {
    let text = include_str!("../layouts/qwen2.5-3b.toml")
        .replace("num_layers = 36", "num_layers = 2")
        .replace("tokens_per_block = 16", "tokens_per_block = 4");
    LayoutDescriptor::from_toml_str(&text).unwrap()
}

fn plan(tp: u32, rank: u32) -> RowPlan {
    RowPlan::new(
        &derive_mappings(&layout(), tp, rank).unwrap(),
        BLOCKS_PER_CHUNK,
    )
    .unwrap()
}

fn stride() -> usize {
    (plan(1, 0).canonical_area_bytes as usize).next_multiple_of(4096)
}

fn key(i: u64) -> ChunkKey {
    ChunkKey::new(format!("gds-chunk-{i:04}").into_bytes())
}

fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// One rank's "GPU": a host device holding, per layer, separate K and V tensors of
/// `GPU_BLOCKS` blocks (vLLM's `(2, num_blocks, ...)` layout), and the block table for them.
struct Gpu {
    dev: HostDevice,
    /// Per layer: (K base, V base, half-page bytes).
    tensors: Vec<(u64, u64, u64)>,
}

impl Gpu {
    fn new(plan: &RowPlan, seed: Option<u64>) -> Gpu {
        let dev = HostDevice::new();
        let tensors = plan
            .layers
            .iter()
            .enumerate()
            .map(|(l, lp)| {
                let half = lp.mapping.local_page_size_bytes / 2;
                let (k, v) = (
                    dev.alloc(half * GPU_BLOCKS).unwrap(),
                    dev.alloc(half * GPU_BLOCKS).unwrap(),
                );
                if let Some(s) = seed {
                    dev.upload(
                        k,
                        &bytes((half * GPU_BLOCKS) as usize, s * 100 + l as u64 * 2),
                    )
                    .unwrap();
                    dev.upload(
                        v,
                        &bytes((half * GPU_BLOCKS) as usize, s * 100 + l as u64 * 2 + 1),
                    )
                    .unwrap();
                }
                (k, v, half)
            })
            .collect();
        Gpu { dev, tensors }
    }

    fn table(&self) -> GpuLayout {
        GpuLayout::new(
            self.tensors
                .iter()
                .map(|&(k, v, half)| LayerPages::split_kv(2 * half, k, v, half))
                .collect(),
            u64::from(BLOCKS_PER_CHUNK),
        )
        .unwrap()
    }

    /// The rank's local chunk (the plan's encoding: per layer, per block, K half then V half)
    /// for the chunk made of `blocks`, read from "GPU memory".
    fn local_chunk(&self, blocks: &[u64]) -> Vec<u8> {
        let mut out = Vec::new();
        for &(k, v, half) in &self.tensors {
            for &b in blocks {
                out.extend(self.dev.download(k + b * half, half).unwrap());
                out.extend(self.dev.download(v + b * half, half).unwrap());
            }
        }
        out
    }
}

fn open_tier(dir: &std::path::Path, region: &Arc<PrimaryRegion>) -> G3Tier {
    let mut cfg = G3TierConfig::new(vec![dir.to_path_buf()], 16 * stride() as u64);
    cfg.io_engine = kvtier::io::IoEngineKind::Psync;
    let t = G3Tier::open(
        cfg,
        region.clone(),
        geometry_namespace(stride() as u64),
        "gds-test".into(),
        None,
    )
    .unwrap();
    assert!(t.wait_recovered(std::time::Duration::from_secs(30)));
    t
}

fn row(r: &PrimaryRegion, i: u32) -> Vec<u8> {
    // The test owns the region; no transfer targets it now.
    r.read_row(i as usize).unwrap().to_vec()
}

fn chunks(blocks: &[[u64; 2]]) -> Vec<GpuChunk> {
    blocks
        .iter()
        .enumerate()
        .map(|(i, b)| GpuChunk {
            key: key(i as u64),
            chunk_id: i as u64,
            blocks: b.to_vec(),
        })
        .collect()
}

const BLOCKS: [[u64; 2]; 3] = [[3, 5], [0, 1], [6, 2]];

#[test]
fn a_gpu_store_is_an_ordinary_slot_the_cpu_path_loads() {
    let d = tmpdir();
    let region = Arc::new(PrimaryRegion::create(4, stride() as u64).unwrap());
    let mut tier = open_tier(d.path(), &region);
    let p1 = plan(1, 0);
    let gpu = Gpu::new(&p1, Some(1));
    let path = GpuPath::new(
        &gpu.dev,
        tier.slot_grants().unwrap(),
        p1.clone(),
        gpu.table(),
        2 * stride() as u64,
    )
    .unwrap();
    let res = path.store(7, &chunks(&BLOCKS));
    assert!(res.success, "{res:?}");
    assert_eq!(res.job_id, 7);
    assert_eq!(res.transfer_bytes, Some(3 * stride() as u64));
    for i in 0..3 {
        assert_eq!(tier.lookup(&key(i), &g3_common::req()), LookupResult::Hit);
    }
    // Storing again skips held keys, like a store job.
    assert!(path.store(8, &chunks(&BLOCKS[..1])).success);
    drop(path);
    // The CPU path loads each into a primary row: the canonical row `gather` builds from the
    // same local chunk, zero padding, and the worker's CRC check over the row passed.
    let check = |tier: &mut G3Tier| {
        let res = run(tier, job(1, &[], &[], true));
        assert!(res.success);
        let mut j = job(2, &[], &[0, 1, 2], true);
        j.keys = (0..3).map(key).collect();
        let res = run(tier, j);
        assert!(res.success, "{res:?}");
        for (i, b) in BLOCKS.iter().enumerate() {
            let mut want = vec![0u8; stride()];
            p1.gather(&gpu.local_chunk(b), &mut want, i as u64).unwrap();
            assert!(row(&region, i as u32) == want, "chunk {i}");
        }
    };
    check(&mut tier);
    // Journaled like any store: after a restart the CPU path still finds and loads them.
    tier.shutdown().unwrap();
    drop(tier);
    for i in 0..3 {
        // The test owns the region.
        region.write_row(i).unwrap().fill(0xAA);
    }
    let mut tier = open_tier(d.path(), &region);
    check(&mut tier);
    tier.shutdown().unwrap();
}

#[test]
fn a_cpu_store_at_tp2_loads_into_every_tp4_rank_and_tp1() {
    let d = tmpdir();
    let region = Arc::new(PrimaryRegion::create(4, stride() as u64).unwrap());
    let mut tier = open_tier(d.path(), &region);
    let area = plan(1, 0).canonical_area_bytes as usize;
    // Canonical rows, then what each TP 2 rank holds of them (`scatter`); both ranks gather
    // into the shared primary row and the CPU path stores it.
    let canon: Vec<Vec<u8>> = (0..2)
        .map(|c| {
            let mut r = bytes(area, 50 + c);
            r.resize(stride(), 0);
            r
        })
        .collect();
    for (c, want) in canon.iter().enumerate() {
        // The test owns the region.
        let mut r = region.write_row(c).unwrap();
        r.fill(0);
        for rank in 0..2 {
            let p = plan(2, rank);
            let mut local = vec![0u8; p.local_chunk_bytes as usize];
            p.scatter(want, &mut local).unwrap();
            p.gather(&local, &mut r, c as u64).unwrap();
        }
        assert!(r[..] == want[..], "TP 2 ranks rebuild the canonical row");
    }
    let mut j = job(3, &[], &[0, 1], false);
    j.keys = vec![key(0), key(1)];
    assert!(run(&mut tier, j).success);
    // Every TP 4 rank loads its share into its own "GPU" blocks; so does TP 1.
    let tp4_blocks = [[7u64, 1], [4, 0]];
    for (tp, ranks) in [(4u32, 0..4u32), (1, 0..1)] {
        for rank in ranks {
            let p = plan(tp, rank);
            let gpu = Gpu::new(&p, None);
            let path = GpuPath::new(
                &gpu.dev,
                tier.slot_grants().unwrap(),
                p.clone(),
                gpu.table(),
                stride() as u64,
            )
            .unwrap();
            let res = path.load(9, &chunks(&tp4_blocks));
            assert!(res.success, "TP {tp} rank {rank}: {res:?}");
            for (c, b) in tp4_blocks.iter().enumerate() {
                let mut want = vec![0u8; p.local_chunk_bytes as usize];
                p.scatter(&canon[c], &mut want).unwrap();
                assert!(gpu.local_chunk(b) == want, "TP {tp} rank {rank} chunk {c}");
            }
        }
    }
    // A TP 2 rank holds only part of each row: a GPU store is refused with the reason, and
    // nothing is committed.
    let p = plan(2, 0);
    let gpu = Gpu::new(&p, Some(3));
    let path = GpuPath::new(
        &gpu.dev,
        tier.slot_grants().unwrap(),
        p,
        gpu.table(),
        stride() as u64,
    )
    .unwrap();
    let mut c = chunks(&[[1, 2]]);
    c[0].key = key(40);
    let res = path.store(10, &c);
    assert!(!res.success);
    let e = res.error.unwrap();
    assert_eq!(e.kind(), kvtier::ErrorKind::Unsupported);
    assert!(e.to_string().contains("writes only part"), "{e}");
    assert_eq!(tier.lookup(&key(40), &g3_common::req()), LookupResult::Miss);
    drop(path);
    tier.shutdown().unwrap();
}

#[test]
fn a_corrupt_slot_fails_its_key_before_its_blocks_are_touched() {
    let d = tmpdir();
    let region = Arc::new(PrimaryRegion::create(4, stride() as u64).unwrap());
    let mut tier = open_tier(d.path(), &region);
    let p1 = plan(1, 0);
    let src = Gpu::new(&p1, Some(2));
    let path = GpuPath::new(
        &src.dev,
        tier.slot_grants().unwrap(),
        p1.clone(),
        src.table(),
        stride() as u64,
    )
    .unwrap();
    assert!(path.store(1, &chunks(&BLOCKS)).success);
    drop(path);
    // Flip one byte of chunk 1's slot on disk (found by its bytes).
    let slab = d.path().join("kvtier-g3.slab");
    let mut disk = std::fs::read(&slab).unwrap();
    let mut want = vec![0u8; stride()];
    p1.gather(&src.local_chunk(&BLOCKS[1]), &mut want, 1)
        .unwrap();
    let at = disk
        .windows(64)
        .position(|w| w == &want[..64])
        .expect("chunk 1 is on disk");
    disk[at + 100] ^= 0x40;
    std::fs::write(&slab, &disk).unwrap();
    let dst = Gpu::new(&p1, None);
    let path = GpuPath::new(
        &dst.dev,
        tier.slot_grants().unwrap(),
        p1.clone(),
        dst.table(),
        stride() as u64,
    )
    .unwrap();
    let res = path.load(2, &chunks(&[[0, 1], [2, 3], [4, 5]]));
    assert!(!res.success);
    assert_eq!(res.successful_keys.as_deref(), Some(&[key(0), key(2)][..]));
    assert_eq!(res.error.unwrap().kind(), kvtier::ErrorKind::Checksum);
    assert!(
        dst.local_chunk(&[2, 3]).iter().all(|&b| b == 0),
        "failed key's blocks untouched"
    );
    let mut good = vec![0u8; p1.local_chunk_bytes as usize];
    p1.scatter(
        &{
            let mut r = vec![0u8; stride()];
            p1.gather(&src.local_chunk(&BLOCKS[2]), &mut r, 2).unwrap();
            r
        },
        &mut good,
    )
    .unwrap();
    assert!(dst.local_chunk(&[4, 5]) == good);
    // The failed key is now a miss; the checksum failure is counted.
    assert_eq!(tier.lookup(&key(1), &g3_common::req()), LookupResult::Miss);
    assert_eq!(g3_common::metric(&tier, "g3_checksum_failures"), 1.0);
    drop(path);
    tier.shutdown().unwrap();
}
