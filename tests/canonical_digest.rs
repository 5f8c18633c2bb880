//! Digest tests: vLLM FileMapper digest known answers (computed independently with Python's
//! json.dumps), Python-compatible serialisation, and kvtier's namespace: equal across TP when
//! portable, different whenever anything that changes the bytes differs.

mod canonical_support;

use canonical_support::all_layouts;
use kvtier::canonical::digest::{
    KvCacheGroupFields, NamespaceParams, VllmDigestFields, namespace_digest, namespace_fields,
    namespace_hex, python_json_dumps, vllm_digest, vllm_digest_of_value,
};
use kvtier::canonical::{KvLayout, LayoutDescriptor};
use serde_json::json;

fn layout(file: &str) -> LayoutDescriptor {
    all_layouts()
        .into_iter()
        .find(|(n, _)| n == file)
        .unwrap_or_else(|| panic!("layouts/{file} missing"))
        .1
}

fn vllm(
    desc: &LayoutDescriptor,
    tp: u32,
    bpc: u32,
    canonical: bool,
) -> (String, serde_json::Value) {
    let p = NamespaceParams::new(desc, tp, bpc, canonical).unwrap();
    vllm_digest(&VllmDigestFields::from_descriptor(desc, &p))
}

// Known answers. Each was produced independently of kvtier with (L = layer-name list):
//   python3 -c 'import json,hashlib; L=lambda n:[f"model.layers.{i}.self_attn.attn" for i in range(n)];
//     f={...}; print(hashlib.sha256(json.dumps(f,sort_keys=True,separators=(",",":")).encode()).hexdigest()[:12])'
// with the dict `f` given above each assertion.

#[test]
fn known_answer_llama_8b_canonical_tp2() {
    // f={"model_name":"meta-llama/Llama-3.1-8B-Instruct","tokens_per_hash":16,"blocks_per_file":1,
    //    "tp_size":1,"pp_size":1,"pcp_size":1,"dcp_size":1,"dtype":"bfloat16",
    //    "kv_cache_groups":[{"tokens_per_block":16,"layer_names":L(32)}],
    //    "inference_engine":"vllm","canonical_format":"v1-nhd"}
    let d = layout("llama-3.1-8b.toml");
    assert_eq!(vllm(&d, 2, 1, true).0, "81b5c61c1522");
    // Portable: every TP size gives the same digest.
    for tp in [1, 4, 8] {
        assert_eq!(vllm(&d, tp, 1, true).0, "81b5c61c1522");
    }
}

#[test]
fn known_answer_qwen_3b_direct_tp4_not_agnostic() {
    // f={"model_name":"Qwen/Qwen2.5-3B-Instruct","tokens_per_hash":16,"blocks_per_file":1,
    //    "tp_size":4,"pp_size":1,"pcp_size":1,"dcp_size":1,"dtype":"bfloat16",
    //    "kv_cache_groups":[{"tokens_per_block":16,"layer_names":L(36)}],
    //    "inference_engine":"vllm","parallel_agnostic":False}
    let d = layout("qwen2.5-3b.toml");
    let (hex, fields) = vllm(&d, 4, 1, false);
    assert_eq!(hex, "f39dea712e3a");
    assert_eq!(fields["parallel_agnostic"], json!(false));
    assert_eq!(fields["tp_size"], json!(4));
    assert!(fields.get("canonical_format").is_none());
}

#[test]
fn known_answer_deepseek_canonical_replicated() {
    // f={"model_name":"deepseek-ai/DeepSeek-V3","tokens_per_hash":16,"blocks_per_file":4,
    //    "tp_size":1,"pp_size":1,"pcp_size":1,"dcp_size":1,"dtype":"bfloat16",
    //    "kv_cache_groups":[{"tokens_per_block":16,"layer_names":L(61)}],
    //    "inference_engine":"vllm","replicated_layout":True,"canonical_format":"v1-nhd"}
    let d = layout("deepseek-v3.toml");
    assert_eq!(vllm(&d, 8, 4, true).0, "fcde84b18fdf");
}

#[test]
fn known_answer_qwen3_hnd_canonical() {
    // f={"model_name":"Qwen/Qwen3-32B","tokens_per_hash":16,"blocks_per_file":2,
    //    "tp_size":1,"pp_size":1,"pcp_size":1,"dcp_size":1,"dtype":"bfloat16",
    //    "kv_cache_groups":[{"tokens_per_block":16,"layer_names":L(64)}],
    //    "inference_engine":"vllm","canonical_format":"v1-hnd"}
    let d = layout("qwen3-32b.toml");
    assert_eq!(vllm(&d, 4, 2, true).0, "3e6a6025e48f");
}

#[test]
fn known_answer_non_ascii_matches_python_ensure_ascii() {
    // f={"model_name":"Ünïcode/模型-😀 \"q\" \\ \t\x7f","tokens_per_hash":8,"blocks_per_file":3,
    //    "tp_size":2,"pp_size":1,"pcp_size":1,"dcp_size":1,"dtype":"fp8",
    //    "kv_cache_groups":[{"tokens_per_block":16,"layer_names":["blk.0.é","blk.1.é"]}],
    //    "inference_engine":"vllm","parallel_agnostic":False,"canonical_format":"v1-lhbnc"}
    let fields = VllmDigestFields {
        model_name: "Ünïcode/模型-😀 \"q\" \\ \t\u{7f}".into(),
        tokens_per_hash: 8,
        blocks_per_file: 3,
        tp_size: 2,
        pp_size: 1,
        pcp_size: 1,
        dcp_size: 1,
        dtype: "fp8".into(),
        kv_cache_groups: vec![KvCacheGroupFields {
            tokens_per_block: 16,
            layer_names: vec!["blk.0.é".into(), "blk.1.é".into()],
        }],
        parallel_agnostic: false,
        replicated_layout: false,
        canonical_format: Some(KvLayout::Lhbnc.canonical_format_id()),
    };
    let (hex, value) = vllm_digest(&fields);
    // print(json.dumps(f, sort_keys=True, separators=(",",":")))
    let python = r#"{"blocks_per_file":3,"canonical_format":"v1-lhbnc","dcp_size":1,"dtype":"fp8","inference_engine":"vllm","kv_cache_groups":[{"layer_names":["blk.0.\u00e9","blk.1.\u00e9"],"tokens_per_block":16}],"model_name":"\u00dcn\u00efcode/\u6a21\u578b-\ud83d\ude00 \"q\" \\ \t\u007f","parallel_agnostic":false,"pcp_size":1,"pp_size":1,"tokens_per_hash":8,"tp_size":2}"#;
    assert_eq!(python_json_dumps(&value), python);
    assert_eq!(hex, "141fcfce6337");
    assert_eq!(vllm_digest_of_value(&value), hex);
}

#[test]
fn floats_serialise_like_python_repr() {
    // python3 -c 'import json; print(json.dumps([1.0,0.5,1e16,1.5e-5,123456789.125,0.0001,-2.5e22,1e15,0.1]))'
    let v = json!([
        1.0,
        0.5,
        1e16,
        1.5e-5,
        123456789.125,
        0.0001,
        -2.5e22,
        1e15,
        0.1
    ]);
    assert_eq!(
        python_json_dumps(&v),
        "[1.0,0.5,1e+16,1.5e-05,123456789.125,0.0001,-2.5e+22,1000000000000000.0,0.1]"
    );
}

#[test]
fn parallel_sizes_forced_to_one_only_when_agnostic() {
    let d = layout("llama-3.1-8b.toml");
    // Canonical and portable: tp_size 1, no parallel_agnostic key, canonical_format present.
    let (_, f) = vllm(&d, 8, 1, true);
    assert_eq!(f["tp_size"], json!(1));
    assert!(f.get("parallel_agnostic").is_none());
    assert_eq!(f["canonical_format"], json!("v1-nhd"));
    assert_eq!(
        f["kv_cache_groups"][0]["layer_names"][31],
        json!("model.layers.31.self_attn.attn")
    );
    // An uncertified layout (opaque fallback) is never agnostic.
    let mut opaque = d.clone();
    opaque.kv_layout = KvLayout::Blhnc;
    let (_, f) = vllm(&opaque, 2, 1, true);
    assert_eq!(f["tp_size"], json!(2));
    assert_eq!(f["parallel_agnostic"], json!(false));
    assert_eq!(f["canonical_format"], json!("v1-blhnc"));
}

fn ns(d: &LayoutDescriptor, tp: u32, canonical: bool, stride: Option<u64>) -> [u8; 32] {
    let mut p = NamespaceParams::new(d, tp, 2, canonical).unwrap();
    if let Some(s) = stride {
        (p.row_stride, p.slot_bytes) = (s, s);
    }
    namespace_digest(d, &p)
}

#[test]
fn namespace_equal_across_tp_when_portable() {
    for (name, d) in all_layouts() {
        let stride = d.canonical_row_stride(2).unwrap();
        let tps = d.allowed_tp(&[1, 2, 4, 8]);
        // No override: the namespace names the canonical area, not vLLM's row.
        let first = ns(&d, tps[0], true, None);
        for &tp in &tps[1..] {
            assert_eq!(ns(&d, tp, true, None), first, "{name} TP {tp}");
            // The direct path always names its topology, so it never matches another TP.
            assert_ne!(
                ns(&d, tp, false, None),
                ns(&d, tps[0], false, None),
                "{name} direct TP {tp}"
            );
        }
        assert_ne!(
            ns(&d, tps[0], false, Some(stride)),
            first,
            "{name}: direct vs canonical"
        );
    }
}

/// Qwen2.5-3B holds 2 KV heads: at TP 4 and 8 vLLM's row (one copy per rank) is 2 and 4 times the
/// canonical area, whose bytes are the same at every TP size; slots and namespace follow the
/// canonical area.
#[test]
fn replicated_gqa_shares_one_namespace_with_slots_of_the_canonical_area() {
    let d = layout("qwen2.5-3b.toml");
    let canonical = d.canonical_row_stride(2).unwrap();
    for tp in [1, 2, 4, 8] {
        let p = NamespaceParams::new(&d, tp, 2, true).unwrap();
        assert_eq!(p.slot_bytes, canonical, "TP {tp}");
        let expected_row = canonical * u64::from((tp / 2).max(1));
        assert_eq!(p.row_stride, expected_row, "TP {tp}");
        assert_eq!(ns(&d, tp, true, None), ns(&d, 1, true, None), "TP {tp}");
    }
    // The direct layout stores whole rows, per topology.
    let p = NamespaceParams::new(&d, 4, 2, false).unwrap();
    assert_eq!(p.slot_bytes, p.row_stride);
}

#[test]
fn namespace_differs_when_bytes_could_differ() {
    let d = layout("llama-3.1-8b.toml");
    let row_stride = d.canonical_row_stride(2).unwrap();
    let stride = Some(row_stride);
    let base = ns(&d, 2, true, stride);
    let mut variants: Vec<(&str, LayoutDescriptor)> = Vec::new();
    let mut v = d.clone();
    v.dtype = "float16".into();
    variants.push(("dtype", v));
    let mut v = d.clone();
    v.tokens_per_block = 32;
    variants.push(("block size", v));
    let mut v = d.clone();
    v.kv_layout = KvLayout::Hnd;
    variants.push(("layout", v));
    let mut v = d.clone();
    v.model_name = "meta-llama/Llama-3.1-8B".into();
    variants.push(("model", v));
    let mut v = d.clone();
    v.revision = Some("0e9e39f249a16976918f6564b8830bc894c89659".into());
    variants.push(("revision", v));
    let mut v = d.clone();
    v.kv_split = Some(kvtier::canonical::KvSplit::Split);
    variants.push(("split/packed", v));
    for (what, v) in &variants {
        v.validate().unwrap();
        assert_ne!(
            ns(v, 2, true, stride),
            base,
            "namespace must change with {what}"
        );
    }
    assert_ne!(ns(&d, 2, true, Some(row_stride + 4096)), base, "row_stride");
    // The direct path covers the KV layout too (vLLM 0.33.0's digest does not: issue #55904).
    let mut hnd = d.clone();
    hnd.kv_layout = KvLayout::Hnd;
    assert_eq!(
        vllm(&d, 2, 1, false).0,
        vllm(&hnd, 2, 1, false).0,
        "vLLM's own gap"
    );
    assert_ne!(ns(&d, 2, false, None), ns(&hnd, 2, false, None));
}

#[test]
fn namespace_known_answer_and_fields() {
    let d = layout("llama-3.1-8b.toml");
    let p = NamespaceParams::new(&d, 2, 1, true).unwrap();
    let fields = namespace_fields(&d, &p);
    assert_eq!(fields["vllm_digest"], json!("81b5c61c1522"));
    assert_eq!(fields["kv_cache_layout"], json!("NHD"));
    assert_eq!(fields["row_stride"], json!(2 * 1024 * 1024));
    assert!(fields.get("topology").is_none());
    let text = python_json_dumps(&fields);
    let reparsed: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(reparsed, fields);
    assert_eq!(namespace_hex(&d, &p), NAMESPACE_LLAMA_8B_CANONICAL_TP2);
}

/// kvtier's namespace for Llama-3.1-8B, canonical, TP 2, 1 block per chunk, computed
/// independently from the field table in docs/canonical.md:
///   python3 -c 'import json,hashlib; L=[f"model.layers.{i}.self_attn.attn" for i in range(32)];
///     v={"model_name":"meta-llama/Llama-3.1-8B-Instruct","tokens_per_hash":16,"blocks_per_file":1,
///        "tp_size":1,"pp_size":1,"pcp_size":1,"dcp_size":1,"dtype":"bfloat16",
///        "kv_cache_groups":[{"tokens_per_block":16,"layer_names":L}],"inference_engine":"vllm",
///        "canonical_format":"v1-nhd"};
///     f={"kvtier_namespace_version":1,"vllm_fields":v,"vllm_digest":"81b5c61c1522","attention":"gqa",
///        "num_layers":32,"kv_cache_layout":"NHD","kv_split":"packed","element_size":2,
///        "tokens_per_block":16,"num_kv_heads":8,"head_dim":128,"kv_lora_rank":None,
///        "qk_rope_head_dim":None,"canonical_page_bytes":65536,"row_stride":2097152,
///        "blocks_per_chunk":1,"storage":"canonical","canonical_format":"v1-nhd",
///        "canonical_format_version":1};
///     print(hashlib.sha256(json.dumps(f,sort_keys=True,separators=(",",":")).encode()).hexdigest())'
const NAMESPACE_LLAMA_8B_CANONICAL_TP2: &str =
    "a58ce8dbc553070e1308fb53e44f339391c1e73929a710dc256e03b14fc8ef78";
