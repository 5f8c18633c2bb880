//! Tiling verification: every shipped layout tiles at every allowed TP, and deliberately broken
//! mappings are caught with an error naming the layer, rank and byte range.

mod canonical_support;

use canonical_support::{all_layouts, reduced};
use kvtier::ErrorKind;
use kvtier::canonical::{CopyRun, KvSplit, LayerMapping, derive_all_ranks, verify_tiling};

#[test]
fn every_layout_tiles_at_every_allowed_tp() {
    for (name, d) in all_layouts() {
        for tp in d.allowed_tp(&[1, 2, 4, 8]) {
            let all = derive_all_ranks(&d, tp).unwrap();
            verify_tiling(&all).unwrap_or_else(|e| panic!("{name} TP {tp}: {e}"));
            for ranks in &all {
                assert_eq!(ranks.len() as u32, d.num_layers);
                let local: u64 = ranks
                    .iter()
                    .map(|l| l.mapping.as_ref().unwrap().local_page_size_bytes)
                    .sum();
                assert_eq!(
                    local,
                    d.worker_kv_bytes_per_block(tp).unwrap(),
                    "{name} TP {tp}"
                );
            }
        }
    }
}

/// Llama-3.1-8B (8 KV heads) and Qwen2.5-3B (2 KV heads: replicated at TP 4), 2 layers, with
/// the `split` page encoding: the tiling check does not depend on the encoding, and the byte
/// ranges the tests below expect were worked out by hand for split K/V halves.
fn sample(file: &str, tp: u32) -> Vec<Vec<LayerMapping>> {
    let (_, d) = all_layouts().into_iter().find(|(n, _)| n == file).unwrap();
    let mut d = reduced(&d, 2, 4);
    d.kv_split = Some(KvSplit::Split);
    let all = derive_all_ranks(&d, tp).unwrap();
    verify_tiling(&all).unwrap();
    all
}

fn expect_broken(all: &[Vec<LayerMapping>], layer: &str, rank: u32, range: &str, what: &str) {
    let e = verify_tiling(all).expect_err("broken mapping must be caught");
    assert_eq!(e.kind(), ErrorKind::Internal);
    let msg = e.to_string();
    assert_eq!(e.context_value("layer"), Some(layer), "{msg}");
    assert_eq!(
        e.context_value("rank"),
        Some(rank.to_string().as_str()),
        "{msg}"
    );
    assert_eq!(e.context_value("range"), Some(range), "{msg}");
    assert!(msg.contains(what), "{msg}");
}

fn run_mut(all: &mut [Vec<LayerMapping>], rank: usize, layer: usize) -> &mut CopyRun {
    &mut all[rank][layer].mapping.as_mut().unwrap().runs[0]
}

#[test]
fn shifted_canonical_offset_is_caught() {
    // Llama reduced: 4 tokens, 8 heads, head dim 128, bf16; TP 2: 4 heads (1024 B) per token.
    let mut all = sample("llama-3.1-8b.toml", 2);
    run_mut(&mut all, 1, 1).canonical_offset -= 256;
    // Rank 1's first fragment now starts at 768 and overlaps rank 0's [0, 1024).
    expect_broken(
        &all,
        "model.layers.1.self_attn.attn",
        1,
        "[768, 1024)",
        "covered twice (ranks 0 and 1)",
    );
}

#[test]
fn missing_fragment_is_caught() {
    let mut all = sample("llama-3.1-8b.toml", 2);
    run_mut(&mut all, 0, 0).num_fragments -= 1;
    // The last token's K fragment of rank 0 (local bytes [3072, 4096)) is no longer copied.
    expect_broken(
        &all,
        "model.layers.0.self_attn.attn",
        0,
        "[3072, 4096)",
        "local page: not covered",
    );
}

#[test]
fn run_past_the_page_is_caught() {
    // TP 4: 2 heads (512 B) per token and half; the V run covers local [2048, 4096).
    let mut all = sample("llama-3.1-8b.toml", 4);
    let v_run = all[3][0].mapping.as_mut().unwrap().runs.last_mut().unwrap();
    v_run.local_offset += 64;
    expect_broken(
        &all,
        "model.layers.0.self_attn.attn",
        3,
        "[2112, 4160)",
        "reaches past the local page",
    );
}

#[test]
fn two_writers_for_one_replica_are_caught() {
    // Qwen2.5-3B at TP 4: ranks 0 and 1 hold head 0; both claiming writer index 0 writes the
    // same canonical bytes twice for even page ids and leaves them unwritten for odd ones.
    let mut all = sample("qwen2.5-3b.toml", 4);
    all[1][0].mapping.as_mut().unwrap().writer_index = 0;
    expect_broken(
        &all,
        "model.layers.0.self_attn.attn",
        1,
        "[0, 256)",
        "writer residue 0: covered twice",
    );
}

#[test]
fn no_writer_for_a_residue_is_caught() {
    let mut all = sample("qwen2.5-3b.toml", 4);
    // Ranks 2 and 3 hold head 1; with both at index 1 nobody writes head 1 of even pages.
    all[2][1].mapping.as_mut().unwrap().writer_index = 1;
    let e = verify_tiling(&all).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("layer 1 (model.layers.1.self_attn.attn)"),
        "{msg}"
    );
    assert!(msg.contains("writer residue 0: not covered"), "{msg}");
    assert_eq!(e.context_value("range"), Some("[256, 512)"), "{msg}");
}

#[test]
fn mismatched_canonical_page_size_is_caught() {
    let mut all = sample("llama-3.1-8b.toml", 2);
    all[1][0]
        .mapping
        .as_mut()
        .unwrap()
        .canonical_page_size_bytes += 4096;
    let e = verify_tiling(&all).unwrap_err();
    assert!(e.to_string().contains("canonical page size"), "{e}");
    assert_eq!(e.context_value("rank"), Some("1"));
}
