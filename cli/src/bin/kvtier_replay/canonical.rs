//! `kvtier-replay canonical`: kvtier's canonical-layout answers for the differential tests.
//!
//! Input: `{"queries": [query, ...]}`, each query
//! `{"layout": "layouts/x.toml" | "layout_toml": "<text>", "tp": 4, "ranks": [0, 1] (default
//! all), "blocks_per_chunk": 1, "canonical": true, "views": [view, ...]}`, where the optional
//! `views` are the layers' KV-cache tensors at that TP size, in layer order, each
//! `{"shape": [...], "stride": [...] (elements), "element_size": 2}`: kvtier then derives the
//! page encoding from them and refuses a descriptor that claims another (`check_views`).
//!
//! Output: `{"results": [result, ...]}`, each result
//! `{"tp", "canonical", "row_stride", "slot_bytes", "page_encoding": {"kv_layout", "kv_split",
//! "source"}, "all_layers_portable", "vllm_digest",
//! "vllm_digest_fields", "namespace", "engine_spec_fields", "engine_namespace", "ranks":
//! [{"rank", "layers": [layer, ...]}]}` (`engine_*`: what vLLM engines of that configuration
//! present to the node service, `VllmSpecFields::of_engine`) where a layer
//! is `{"layer_name", "kind", "reason", "canonical_page_size_bytes", "local_page_size_bytes",
//! "num_writers", "writer_index", "parallelism_agnostic", "runs": [CopyRun, ...]}` with vLLM's
//! `CopyRun` field names; or `{"error", "kind"}` when kvtier refuses the query.

use kvtier::canonical::digest::{self, NamespaceParams, VllmDigestFields, VllmSpecFields};
use kvtier::canonical::validate::static_portability_claim;
use kvtier::canonical::{
    LayerMapping, LayerView, LayoutDescriptor, ParallelConfig, derive_all_ranks, prepare_canonical,
    resolve_encoding, verify_tiling,
};
use serde_json::{Value, json};

use crate::json::{array, bool_or, error_entry, field, u32_or};

/// Answers every query of the document.
pub fn run(input: &Value) -> Result<Value, String> {
    let mut results = Vec::new();
    for q in array(input, "queries")? {
        results.push(query(q)?);
    }
    Ok(json!({ "results": results }))
}

fn descriptor(q: &Value) -> Result<kvtier::Result<LayoutDescriptor>, String> {
    if let Some(text) = q.get("layout_toml") {
        let text = text
            .as_str()
            .ok_or("field \"layout_toml\" must be a string")?;
        return Ok(LayoutDescriptor::from_toml_str(text));
    }
    let path = field(q, "layout")?
        .as_str()
        .ok_or("field \"layout\" must be a path string")?;
    Ok(LayoutDescriptor::load(path))
}

fn query(q: &Value) -> Result<Value, String> {
    let tp = u32_or(q, "tp", 0)?;
    let bpc = u32_or(q, "blocks_per_chunk", 1)?;
    let canonical = bool_or(q, "canonical", true)?;
    let ranks: Vec<u32> = match q.get("ranks") {
        None | Some(Value::Null) => (0..tp).collect(),
        Some(v) => v
            .as_array()
            .ok_or("field \"ranks\" must be an array")?
            .iter()
            .map(|r| r.as_u64().and_then(|r| u32::try_from(r).ok()))
            .collect::<Option<_>>()
            .ok_or("field \"ranks\" must hold ranks")?,
    };
    let views: Option<Vec<LayerView>> = match q.get("views") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            serde_json::from_value(v.clone())
                .map_err(|e| format!("field \"views\" must be a list of views: {e}"))?,
        ),
    };
    let answer =
        descriptor(q)?.and_then(|desc| answer(&desc, tp, &ranks, bpc, canonical, views.as_deref()));
    Ok(answer.unwrap_or_else(|e| error_entry(&e)))
}

fn answer(
    desc: &LayoutDescriptor,
    tp: u32,
    ranks: &[u32],
    bpc: u32,
    canonical: bool,
    views: Option<&[LayerView]>,
) -> kvtier::Result<Value> {
    let (encoding, source) = resolve_encoding(desc, tp, views)?;
    let mut params = NamespaceParams::new(desc, tp, bpc, canonical)?;
    // What `kvtier serve --layout --tp` serves: from the parameters before certification,
    // as the service plans them.
    let engine = VllmSpecFields::of_engine(desc, &params)?;
    let engine_namespace = hex::encode(engine.namespace_digest()?);
    let engine_fields = serde_json::to_value(&engine).map_err(|e| {
        kvtier::Error::new(kvtier::ErrorKind::Internal, format!("spec fields: {e}"))
    })?;
    let all: Vec<Vec<LayerMapping>> = if canonical {
        let shared = static_portability_claim(desc, tp, tp, true);
        let prepared = prepare_canonical(desc, &ParallelConfig::tp(tp, 0), bpc, shared)?;
        params.all_layers_portable = prepared.status.all_layers_portable;
        prepared.mappings
    } else {
        let all = derive_all_ranks(desc, tp)?;
        verify_tiling(&all)?;
        all
    };
    let mut per_rank = Vec::new();
    for &rank in ranks {
        let layers = all.get(rank as usize).ok_or_else(|| {
            kvtier::Error::new(
                kvtier::ErrorKind::Config,
                format!("rank {rank} is out of range for TP {tp}"),
            )
        })?;
        per_rank.push(json!({
            "rank": rank,
            "layers": layers.iter().map(layer_json).collect::<Vec<_>>(),
        }));
    }
    let (vllm_hex, vllm_fields) =
        digest::vllm_digest(&VllmDigestFields::from_descriptor(desc, &params));
    Ok(json!({
        "tp": tp,
        "canonical": canonical,
        "row_stride": params.row_stride,
        "slot_bytes": params.slot_bytes,
        "page_encoding": {
            "kv_layout": encoding.kv_layout.as_str(),
            "kv_split": encoding.kv_split.as_str(),
            "source": source.as_str(),
        },
        "all_layers_portable": canonical && params.all_layers_portable,
        "vllm_digest": vllm_hex,
        "vllm_digest_fields": vllm_fields,
        "namespace": digest::namespace_hex(desc, &params),
        "engine_spec_fields": engine_fields,
        "engine_namespace": engine_namespace,
        "ranks": per_rank,
    }))
}

fn layer_json(lm: &LayerMapping) -> Value {
    let m = lm.mapping.as_ref();
    json!({
        "layer_name": lm.layer_name,
        "kind": lm.kind,
        "reason": lm.reason,
        "canonical_page_size_bytes": m.map(|m| m.canonical_page_size_bytes),
        "local_page_size_bytes": m.map(|m| m.local_page_size_bytes),
        "num_writers": m.map(|m| m.num_writers),
        "writer_index": m.map(|m| m.writer_index),
        "parallelism_agnostic": m.map(|m| m.parallelism_agnostic),
        "runs": m.map(|m| m.runs.clone()),
    })
}
