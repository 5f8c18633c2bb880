//! Descriptor parsing (impossible descriptors rejected with clear errors) and the start-up
//! validation rules of the seed's `_validate_canonical_refs`.

mod canonical_support;

use canonical_support::all_layouts;
use kvtier::ErrorKind;
use kvtier::canonical::{
    KvLayout, LayoutDescriptor, MappingKind, ParallelConfig, derive_mappings, derive_mappings_for,
    prepare_canonical, validate_canonical,
};

const LLAMA: &str = include_str!("../layouts/llama-3.1-8b.toml");
const DEEPSEEK: &str = include_str!("../layouts/deepseek-v3.toml");

#[test]
fn shipped_layouts_have_public_geometry() {
    let want = [
        ("deepseek-v3.toml", 61u32, 61 * 16 * 576 * 2u64),
        ("llama-2-7b.toml", 32, 32 * 2 * 16 * 32 * 128 * 2),
        ("llama-3.1-70b.toml", 80, 80 * 2 * 16 * 8 * 128 * 2),
        ("llama-3.1-8b.toml", 32, 2 * 1024 * 1024),
        ("mistral-7b.toml", 32, 32 * 2 * 16 * 8 * 128 * 2),
        ("qwen2.5-3b.toml", 36, 36 * 2 * 16 * 2 * 128 * 2),
        ("qwen2.5-7b.toml", 28, 28 * 2 * 16 * 4 * 128 * 2),
        ("qwen3-32b.toml", 64, 64 * 2 * 16 * 8 * 128 * 2),
    ];
    let all = all_layouts();
    for (file, layers, bytes) in want {
        let (_, d) = all
            .iter()
            .find(|(n, _)| n == file)
            .unwrap_or_else(|| panic!("{file} missing"));
        assert_eq!(d.num_layers, layers, "{file}");
        assert_eq!(d.canonical_bytes_per_block(), bytes, "{file}");
        // Round trip through TOML.
        assert_eq!(
            &LayoutDescriptor::from_toml_str(&d.to_toml_string().unwrap()).unwrap(),
            d
        );
    }
    let qwen7 = &all.iter().find(|(n, _)| n == "qwen2.5-7b.toml").unwrap().1;
    assert_eq!(qwen7.allowed_tp(&[1, 2, 4, 8]), vec![1, 2, 4]);
    let e = qwen7.check_tp(8).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    assert!(
        e.to_string()
            .contains("does not divide its 28 attention heads"),
        "{e}"
    );
    // MLA: every rank holds the whole latent.
    let ds = &all.iter().find(|(n, _)| n == "deepseek-v3.toml").unwrap().1;
    assert_eq!(
        ds.worker_kv_bytes_per_block(8).unwrap(),
        ds.canonical_bytes_per_block()
    );
}

fn rejects(text: &str, key: &str, needle: &str) {
    let e =
        LayoutDescriptor::from_toml_str(text).expect_err(&format!("must reject ({key}): {text}"));
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    let msg = e.to_string();
    assert!(msg.contains(key), "error must name {key}: {msg}");
    assert!(msg.contains(needle), "error must say {needle:?}: {msg}");
}

#[test]
fn impossible_descriptors_are_rejected_with_clear_errors() {
    rejects(
        &LLAMA.replace("num_kv_heads = 8", "num_kv_heads = 7"),
        "num_kv_heads",
        "must divide num_attention_heads (32), found 7",
    );
    rejects(
        &LLAMA.replace("attention = \"gqa\"", "attention = \"mha\""),
        "num_kv_heads",
        "needs num_kv_heads == num_attention_heads",
    );
    rejects(
        &LLAMA.replace("tokens_per_block = 16", "tokens_per_block = 0"),
        "tokens_per_block",
        "found 0",
    );
    rejects(
        &LLAMA.replace("bfloat16", "bf16"),
        "dtype",
        "unknown dtype \"bf16\"",
    );
    rejects(
        &LLAMA.replace("{i}", "N"),
        "layer_name_pattern",
        "`{i}` exactly once",
    );
    rejects(
        &LLAMA.replace("kv_split = \"packed\"", ""),
        "kv_split",
        "is required",
    );
    rejects(
        &LLAMA.replace("kv_split = \"packed\"", "kv_split = \"latent\""),
        "kv_split",
        "MLA only",
    );
    rejects(
        &LLAMA.replace("head_dim = 128", "head_dim = 128\nkv_lora_rank = 512"),
        "kv_lora_rank",
        "mla",
    );
    rejects(
        &LLAMA.replace("head_dim = 128", ""),
        "head_dim",
        "is required",
    );
    rejects(
        &format!("{LLAMA}\nhead_dimm = 3\n"),
        "head_dimm",
        "unknown field",
    );
    rejects(
        &LLAMA.replace("\"NHD\"", "\"NDH\""),
        "NDH",
        "unknown variant",
    );
    rejects(
        &LLAMA.replace(
            "tokens_per_block = 16",
            "tokens_per_block = 16\ntokens_per_hash = 5",
        ),
        "tokens_per_hash",
        "must divide tokens_per_block (16)",
    );
    rejects(
        &DEEPSEEK.replace("kv_lora_rank = 512", "head_dim = 128"),
        "head_dim",
        "not used with attention = \"mla\"",
    );
    rejects(
        &DEEPSEEK.replace("kv_split = \"latent\"", "kv_split = \"packed\""),
        "kv_split",
        "does not apply",
    );
    rejects(
        &LLAMA.replace("num_layers = 32", "num_layers = 4294967295"),
        "num_layers",
        "between 1 and",
    );
}

#[test]
fn load_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.toml");
    std::fs::write(&path, LLAMA.replace("num_kv_heads = 8", "num_kv_heads = 0")).unwrap();
    let e = LayoutDescriptor::load(&path).unwrap_err();
    assert!(e.to_string().contains(&path.display().to_string()), "{e}");
    assert!(e.to_string().contains("num_kv_heads"), "{e}");
    let missing = dir.path().join("nope.toml");
    let e = LayoutDescriptor::load(&missing).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidPath);
}

#[test]
fn unmapped_layer_is_refused_with_how_to_turn_canonical_off() {
    let d = LayoutDescriptor::from_toml_str(LLAMA).unwrap();
    // Offload workers not exactly the TP group: no mapping at all.
    let cfg = ParallelConfig {
        tp: 2,
        rank: 1,
        world_size: 4,
        dcp: 1,
        pcp: 1,
    };
    let layers = derive_mappings_for(&d, &cfg).unwrap();
    assert!(
        layers
            .iter()
            .all(|l| l.kind == MappingKind::Unmapped && l.mapping.is_none())
    );
    let e = validate_canonical(&layers, false).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    let msg = e.to_string();
    assert!(msg.contains("could not be certified"), "{msg}");
    assert!(msg.contains("model.layers.0.self_attn.attn"), "{msg}");
    assert!(msg.contains("world_size 4 != tp 2"), "{msg}");
    assert!(msg.contains("Set canonical_layout = false"), "{msg}");
    let e = prepare_canonical(&d, &cfg, 1, false).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
}

#[test]
fn fallback_layers_are_refused_in_a_shared_namespace_only() {
    let mut d = LayoutDescriptor::from_toml_str(LLAMA).unwrap();
    d.kv_layout = KvLayout::Lhbnc;
    let layers = derive_mappings(&d, 4, 2).unwrap();
    assert!(layers.iter().all(|l| l.kind == MappingKind::OpaqueFallback));
    let m = layers[0].mapping.as_ref().unwrap();
    assert!(!m.parallelism_agnostic);
    assert_eq!(m.canonical_page_size_bytes, 4 * m.local_page_size_bytes);
    assert_eq!(m.runs[0].canonical_offset, 2 * m.local_page_size_bytes);
    // Exact-topology namespace: allowed, but not portable.
    let status = validate_canonical(&layers, false).unwrap();
    assert!(!status.all_layers_portable);
    // Namespace shared across topologies: refused.
    let e = validate_canonical(&layers, true).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::IncompatibleLayout);
    let msg = e.to_string();
    assert!(
        msg.contains("could not certify every layer as parallelism-agnostic"),
        "{msg}"
    );
    assert!(msg.contains("LHBNC"), "{msg}");
    assert!(msg.contains("Set canonical_layout = false"), "{msg}");
    assert!(
        msg.contains("disable parallel-agnostic secondary tiers"),
        "{msg}"
    );
}

#[test]
fn certified_layouts_are_portable() {
    for (name, d) in all_layouts() {
        for tp in d.allowed_tp(&[1, 2, 4, 8]) {
            let p = prepare_canonical(&d, &ParallelConfig::tp(tp, tp - 1), 2, true)
                .unwrap_or_else(|e| panic!("{name} TP {tp}: {e}"));
            assert!(p.status.all_layers_portable, "{name} TP {tp}");
            assert_eq!(
                p.plan.canonical_area_bytes,
                2 * d.canonical_bytes_per_block()
            );
        }
    }
}

#[test]
fn unsupported_parallel_configs_are_clear_errors() {
    let d = LayoutDescriptor::from_toml_str(LLAMA).unwrap();
    let e = derive_mappings_for(
        &d,
        &ParallelConfig {
            tp: 2,
            rank: 0,
            world_size: 2,
            dcp: 2,
            pcp: 1,
        },
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    assert!(e.to_string().contains("context parallelism"), "{e}");
    let e = derive_mappings(&d, 2, 2).unwrap_err();
    assert!(
        e.to_string()
            .contains("rank 2 is out of range for TP size 2"),
        "{e}"
    );
    let e = derive_mappings(&d, 3, 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    assert!(e.to_string().contains("TP size 3"), "{e}");
}
