//! Property test over random geometries: for any valid attention / MLA descriptor and any TP
//! size it allows, every rank's runs tile, and gather at one TP followed by scatter at another
//! reproduces that TP's independently encoded shards.

mod canonical_support;

use canonical_support::encode_local_chunk;
use kvtier::canonical::{
    KvLayout, KvSplit, LayoutDescriptor, ParallelConfig, derive_all_ranks, prepare_canonical,
    verify_tiling,
};
use proptest::prelude::*;

fn descriptor() -> impl Strategy<Value = LayoutDescriptor> {
    let attention = (
        prop::sample::select(vec![1u32, 2, 3, 4, 6, 8, 16]),
        1u32..4,
        1u32..24,
        prop::bool::ANY,
        prop::bool::ANY,
    )
        .prop_map(|(kv, group, head_dim, hnd, packed)| {
            let heads = kv * group;
            (
                format!(
                    "attention = \"{}\"\nnum_attention_heads = {heads}\nnum_kv_heads = {kv}\nhead_dim = {head_dim}\nkv_layout = \"{}\"\nkv_split = \"{}\"\n",
                    if group == 1 { "mha" } else { "gqa" },
                    if hnd { "HND" } else { "NHD" },
                    if packed { "packed" } else { "split" },
                ),
                heads,
            )
        });
    let mla = (1u32..40, 1u32..9, prop::sample::select(vec![8u32, 16, 128])).prop_map(|(lora, rope, heads)| {
        (
            format!("attention = \"mla\"\nnum_attention_heads = {heads}\nkv_lora_rank = {lora}\nqk_rope_head_dim = {rope}\nkv_layout = \"NHD\"\n"),
            heads,
        )
    });
    (
        prop_oneof![3 => attention, 1 => mla],
        1u32..4,
        1u32..6,
        prop::sample::select(vec!["bfloat16", "float32", "fp8"]),
    )
        .prop_map(|((body, _), layers, tokens, dtype)| {
            let text = format!(
                "model_name = \"prop/model\"\nnum_layers = {layers}\ndtype = \"{dtype}\"\ntokens_per_block = {tokens}\nlayer_name_pattern = \"l.{{i}}\"\n{body}"
            );
            LayoutDescriptor::from_toml_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"))
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn random_geometries_tile_and_round_trip(d in descriptor(), chunk in 0u64..5, bpc in 1u32..3) {
        let tps = d.allowed_tp(&[1, 2, 3, 4, 6, 8, 16]);
        prop_assert!(tps.contains(&1));
        let canonical = encode_local_chunk(&d, 1, 0, chunk, bpc);
        for &tp_store in &tps {
            let all = derive_all_ranks(&d, tp_store).unwrap();
            verify_tiling(&all).unwrap();
            let mut row = vec![0xEEu8; canonical.len() + 64];
            let mut written = 0;
            for rank in 0..tp_store {
                let p = prepare_canonical(&d, &ParallelConfig::tp(tp_store, rank), bpc, true).unwrap();
                written += p.plan.gather(&encode_local_chunk(&d, tp_store, rank, chunk, bpc), &mut row, chunk).unwrap();
            }
            prop_assert_eq!(written, canonical.len() as u64);
            prop_assert!(row[..canonical.len()] == canonical[..], "TP {} canonical area", tp_store);
            prop_assert!(row[canonical.len()..].iter().all(|&b| b == 0xEE));
            for &tp_load in &tps {
                for rank in 0..tp_load {
                    let p = prepare_canonical(&d, &ParallelConfig::tp(tp_load, rank), bpc, true).unwrap();
                    let mut local = vec![0u8; p.plan.local_chunk_bytes as usize];
                    p.plan.scatter(&row, &mut local).unwrap();
                    prop_assert!(
                        local == encode_local_chunk(&d, tp_load, rank, chunk, bpc),
                        "stored TP {} loaded TP {} rank {}", tp_store, tp_load, rank
                    );
                }
            }
        }
        // Every encoding is one of the certified ones.
        prop_assert!(matches!(d.kv_layout, KvLayout::Nhd | KvLayout::Hnd));
        prop_assert!(d.is_mla() || matches!(d.kv_split, Some(KvSplit::Split | KvSplit::Packed)));
    }
}
