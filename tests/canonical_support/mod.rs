//! Shared helpers for the canonical-layout tests: a deterministic full KV block and an
//! independent reference encoder that shards it the way vLLM holds it per rank. The encoder
//! works from (layer, K/V, token, head, dim) coordinates and never uses the copy runs, so the
//! tests compare the mappings against an independent definition of the page layouts.
#![allow(dead_code)]

use std::path::PathBuf;

use kvtier::canonical::{KvLayout, KvSplit, LayoutDescriptor};

/// Every descriptor in `layouts/`, with its file name.
pub fn all_layouts() -> Vec<(String, LayoutDescriptor)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("layouts");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("layouts/ exists")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 6,
        "expected at least six layouts, found {}",
        files.len()
    );
    files
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let d = LayoutDescriptor::load(&p).unwrap_or_else(|e| panic!("{name}: {e}"));
            (name, d)
        })
        .collect()
}

/// A smaller copy of `desc` (fewer layers and tokens, same head grid) for fast tests.
pub fn reduced(desc: &LayoutDescriptor, layers: u32, tokens: u32) -> LayoutDescriptor {
    let mut d = desc.clone();
    d.num_layers = layers;
    d.tokens_per_block = tokens;
    d.tokens_per_hash = None;
    d.validate().expect("reduced descriptor is valid");
    d
}

fn mix(mut x: u64) -> u64 {
    // splitmix64 finaliser.
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The element bytes of the full (unsharded) KV block at `(layer, page, kv, token, head, dim)`.
pub fn element(layer: u32, page: u64, kv: u64, token: u64, head: u64, dim: u64) -> u64 {
    mix(
        (((u64::from(layer) * 1_000_003 + page) * 7 + kv) * 1_000_033)
            ^ (token << 40)
            ^ (head << 24)
            ^ dim,
    )
}

/// The KV heads rank `rank` holds at TP `tp`: vLLM shards `total / tp` heads per rank, or,
/// when `tp > total`, gives every group of `tp / total` consecutive ranks the same single head.
pub fn heads_of_rank(total: u32, tp: u32, rank: u32) -> std::ops::Range<u64> {
    if tp <= total {
        let per = u64::from(total / tp);
        u64::from(rank) * per..(u64::from(rank) + 1) * per
    } else {
        let head = u64::from(rank / (tp / total));
        head..head + 1
    }
}

/// One layer's page for canonical page id `page` as rank `rank` of TP `tp` holds it.
pub fn encode_page(desc: &LayoutDescriptor, tp: u32, rank: u32, layer: u32, page: u64) -> Vec<u8> {
    let e = desc.element_size().unwrap() as usize;
    let t_n = u64::from(desc.tokens_per_block);
    let mut out = Vec::new();
    let mut put = |v: u64| out.extend_from_slice(&v.to_le_bytes()[..e]);
    if desc.is_mla() {
        let width = u64::from(desc.kv_lora_rank.unwrap() + desc.qk_rope_head_dim.unwrap());
        for t in 0..t_n {
            for c in 0..width {
                put(element(layer, page, 0, t, 0, c));
            }
        }
        return out;
    }
    let heads = heads_of_rank(desc.num_kv_heads.unwrap(), tp, rank);
    let hd = u64::from(desc.head_dim.unwrap());
    match (desc.kv_split.unwrap(), desc.kv_layout) {
        (KvSplit::Split, KvLayout::Nhd) => {
            for kv in 0..2 {
                for t in 0..t_n {
                    for h in heads.clone() {
                        for d in 0..hd {
                            put(element(layer, page, kv, t, h, d));
                        }
                    }
                }
            }
        }
        (KvSplit::Split, KvLayout::Hnd) => {
            for kv in 0..2 {
                for h in heads.clone() {
                    for t in 0..t_n {
                        for d in 0..hd {
                            put(element(layer, page, kv, t, h, d));
                        }
                    }
                }
            }
        }
        (KvSplit::Packed, KvLayout::Nhd) => {
            for t in 0..t_n {
                for h in heads.clone() {
                    for kv in 0..2 {
                        for d in 0..hd {
                            put(element(layer, page, kv, t, h, d));
                        }
                    }
                }
            }
        }
        (KvSplit::Packed, KvLayout::Hnd) => {
            for h in heads.clone() {
                for t in 0..t_n {
                    for kv in 0..2 {
                        for d in 0..hd {
                            put(element(layer, page, kv, t, h, d));
                        }
                    }
                }
            }
        }
        // Uncertified layouts: any fixed per-rank encoding will do (the bytes are opaque).
        (_, _) => {
            for h in heads.clone() {
                for kv in 0..2 {
                    for t in 0..t_n {
                        for d in 0..hd {
                            put(element(layer, page, kv, t, h, d));
                        }
                    }
                }
            }
        }
    }
    out
}

/// Rank `rank`'s local chunk `chunk` (vLLM's direct worker-page encoding: layer after layer,
/// `blocks_per_chunk` pages each).
pub fn encode_local_chunk(
    desc: &LayoutDescriptor,
    tp: u32,
    rank: u32,
    chunk: u64,
    bpc: u32,
) -> Vec<u8> {
    let mut out = Vec::new();
    for layer in 0..desc.num_layers {
        for j in 0..u64::from(bpc) {
            out.extend(encode_page(
                desc,
                tp,
                rank,
                layer,
                chunk * u64::from(bpc) + j,
            ));
        }
    }
    out
}

/// A G3 tier over slab files in `dir`, with slots of `region.row_stride()` bytes, keyed by
/// `namespace`. Opening an existing store under another namespace is refused by the tier.
pub fn open_g3(
    dir: &std::path::Path,
    region: &std::sync::Arc<kvtier::region::PrimaryRegion>,
    namespace: [u8; 32],
    slots: u64,
) -> kvtier::Result<kvtier::g3::G3Tier> {
    open_g3_slots(dir, region, namespace, slots, None)
}

/// [`open_g3`] with slots of `slot_bytes` (a prefix of each row; `None`: the whole row).
pub fn open_g3_slots(
    dir: &std::path::Path,
    region: &std::sync::Arc<kvtier::region::PrimaryRegion>,
    namespace: [u8; 32],
    slots: u64,
    slot_bytes: Option<u64>,
) -> kvtier::Result<kvtier::g3::G3Tier> {
    let slot = slot_bytes.unwrap_or(region.row_stride());
    let mut cfg = kvtier::g3::G3TierConfig::new(vec![dir.to_path_buf()], slots * slot);
    cfg.slot_bytes = slot_bytes;
    cfg.io_engine = kvtier::io::IoEngineKind::Psync;
    cfg.fsync = kvtier::g3::FsyncPolicy::Never;
    let t = kvtier::g3::G3Tier::open(
        cfg,
        region.clone(),
        namespace,
        "canonical-test".into(),
        None,
    )?;
    assert!(
        t.wait_recovered(std::time::Duration::from_secs(30)),
        "G3 recovery timed out"
    );
    Ok(t)
}

/// A chunk key derived from a small id.
pub fn g3_key(id: u64) -> kvtier::key::ChunkKey {
    let mut b = vec![0x4Bu8; 32];
    b.extend_from_slice(&id.to_le_bytes());
    kvtier::key::ChunkKey::new(b)
}

/// Stores (`load == false`) or loads one key to / from `row` and waits for the result.
pub fn g3_transfer(t: &mut kvtier::g3::G3Tier, key: u64, row: u32, load: bool) {
    use kvtier::contract::secondary::SecondaryTier;
    let job = kvtier::contract::job::TransferJob {
        job_id: key,
        keys: vec![g3_key(key)],
        chunk_ids: vec![row],
        is_promotion: load,
        req_id: std::sync::Arc::from("canonical"),
        submit_time: std::time::Instant::now(),
    };
    if load {
        t.submit_load(job);
    } else {
        t.submit_store(job);
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let done = t.get_finished_jobs();
        if let Some(r) = done.first() {
            assert_eq!(done.len(), 1);
            assert!(
                r.success,
                "G3 {} of key {key} failed: {r:?}",
                if load { "load" } else { "store" }
            );
            return;
        }
        assert!(std::time::Instant::now() < deadline, "G3 job timed out");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}
