//! Compatibility digests (contract §8.4).
//!
//! * [`vllm_digest`]: exactly vLLM 0.33.0's `FileMapper` digest: the field dict serialised as
//!   Python's `json.dumps(fields, sort_keys=True, separators=(",", ":"))` writes it (ASCII only,
//!   non-ASCII escaped as `\uXXXX`), sha256, first 12 hex digits.
//! * [`namespace_digest`]: kvtier's own sha256 over a superset: the vLLM fields plus the KV
//!   memory layout (also on the direct path, where vLLM omits it), the page encoding and head
//!   grid, `row_stride`, the model revision and the format versions. The G3 superblock stores
//!   these 32 bytes and refuses a mismatch.

use std::fmt::Write as _;

use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use crate::canonical::descriptor::{CANONICAL_FORMAT_VERSION, KvLayout, LayoutDescriptor};
use crate::error::{Error, ErrorKind, Result};

/// Version of kvtier's namespace field set; bump when its meaning changes.
pub const NAMESPACE_VERSION: u32 = 1;

/// One offloaded KV-cache group as the vLLM digest lists it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct KvCacheGroupFields {
    /// DCP-adjusted tokens per block.
    pub tokens_per_block: u32,
    /// Layer names of the group.
    pub layer_names: Vec<String>,
}

/// The inputs of vLLM's `FileMapper` digest (contract §8.4 field table).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VllmDigestFields {
    /// `config.model.name`.
    pub model_name: String,
    /// `config.cache.tokens_per_hash`.
    pub tokens_per_hash: u32,
    /// `blocks_per_file` (fs / obj / p2p pass `blocks_per_chunk`).
    pub blocks_per_file: u32,
    /// TP size (forced to 1 in the JSON when parallel-agnostic).
    pub tp_size: u32,
    /// PP size (forced to 1 when parallel-agnostic).
    pub pp_size: u32,
    /// PCP size (forced to 1 when parallel-agnostic).
    pub pcp_size: u32,
    /// DCP size (forced to 1 when parallel-agnostic).
    pub dcp_size: u32,
    /// KV cache dtype without a `torch.` prefix.
    pub dtype: String,
    /// Offloaded groups.
    pub kv_cache_groups: Vec<KvCacheGroupFields>,
    /// Whether the namespace is parallel-agnostic (`parallel_agnostic: false` otherwise).
    pub parallel_agnostic: bool,
    /// Replicated layout (`replicated_layout: true` only when also parallel-agnostic).
    pub replicated_layout: bool,
    /// `canonical_format` (e.g. `v1-nhd`) when the canonical layout is on.
    pub canonical_format: Option<String>,
}

impl VllmDigestFields {
    /// The field dict exactly as vLLM builds it.
    pub fn to_json(&self) -> Value {
        let one = |v: u32| if self.parallel_agnostic { 1 } else { v };
        let groups: Vec<Value> = self
            .kv_cache_groups
            .iter()
            .map(|g| json!({"tokens_per_block": g.tokens_per_block, "layer_names": g.layer_names}))
            .collect();
        let mut m = Map::new();
        m.insert("model_name".into(), json!(self.model_name));
        m.insert("tokens_per_hash".into(), json!(self.tokens_per_hash));
        m.insert("blocks_per_file".into(), json!(self.blocks_per_file));
        m.insert("tp_size".into(), json!(one(self.tp_size)));
        m.insert("pp_size".into(), json!(one(self.pp_size)));
        m.insert("pcp_size".into(), json!(one(self.pcp_size)));
        m.insert("dcp_size".into(), json!(one(self.dcp_size)));
        m.insert("dtype".into(), json!(self.dtype));
        m.insert("kv_cache_groups".into(), Value::Array(groups));
        m.insert("inference_engine".into(), json!("vllm"));
        if !self.parallel_agnostic {
            m.insert("parallel_agnostic".into(), json!(false));
        }
        if self.parallel_agnostic && self.replicated_layout {
            m.insert("replicated_layout".into(), json!(true));
        }
        if let Some(f) = &self.canonical_format {
            m.insert("canonical_format".into(), json!(f));
        }
        Value::Object(m)
    }

    /// The fields vLLM would hash for `desc` under `params` (single KV-cache group of all
    /// layers, PP = PCP = DCP = 1). Parallel-agnostic as vLLM decides it (§8.3/§8.4): canonical
    /// with every layer portable, or the direct-path static claim (plain attention with heads
    /// split exactly), or a replicated layout.
    pub fn from_descriptor(desc: &LayoutDescriptor, params: &NamespaceParams) -> Self {
        VllmDigestFields {
            model_name: desc.model_name.clone(),
            tokens_per_hash: desc.tokens_per_hash(),
            blocks_per_file: params.blocks_per_chunk,
            tp_size: params.tp,
            pp_size: 1,
            pcp_size: 1,
            dcp_size: 1,
            dtype: desc.dtype.clone(),
            kv_cache_groups: vec![KvCacheGroupFields {
                tokens_per_block: desc.tokens_per_block,
                layer_names: desc.layer_names(),
            }],
            parallel_agnostic: vllm_parallel_agnostic(desc, params),
            replicated_layout: params.replicated_layout,
            canonical_format: params
                .canonical
                .then(|| desc.kv_layout.canonical_format_id()),
        }
    }
}

/// vLLM's decision whether the storage namespace is parallel-agnostic (see
/// [`VllmDigestFields::from_descriptor`]). Note that on the direct path vLLM 0.33.0 claims
/// agnosticism for exactly-split heads even though the row bytes differ by TP size; kvtier's
/// [`namespace_digest`] always adds the topology on the direct path.
pub fn vllm_parallel_agnostic(desc: &LayoutDescriptor, params: &NamespaceParams) -> bool {
    if params.replicated_layout {
        return true;
    }
    if params.canonical {
        params.all_layers_portable
    } else {
        !desc.is_mla() && params.tp > 0 && desc.total_kv_heads().is_multiple_of(params.tp)
    }
}

/// vLLM's digest: the 12 hex digits and the exact JSON object that was hashed.
pub fn vllm_digest(fields: &VllmDigestFields) -> (String, Value) {
    let value = fields.to_json();
    (vllm_digest_of_value(&value), value)
}

/// vLLM's digest of an arbitrary field object.
pub fn vllm_digest_of_value(fields: &Value) -> String {
    let text = python_json_dumps(fields);
    let hash = Sha256::digest(text.as_bytes());
    hex::encode(hash)[..12].to_string()
}

/// `json.dumps(value, sort_keys=True, separators=(",", ":"))` with Python's defaults
/// (`ensure_ascii=True`): keys sorted by code point, no spaces, every character outside
/// printable ASCII escaped as lower-case `\uXXXX` (astral characters as surrogate pairs).
/// Floats use Python's `repr` rules for the common cases (`1.0`, `0.5`, `1e+16`).
pub fn python_json_dumps(value: &Value) -> String {
    let mut out = String::new();
    write_value(&mut out, value);
    out
}

fn write_value(out: &mut String, value: &Value) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                let _ = write!(out, "{i}");
            } else if let Some(u) = n.as_u64() {
                let _ = write!(out, "{u}");
            } else if let Some(f) = n.as_f64() {
                out.push_str(&python_float_repr(f));
            }
        }
        Value::String(s) => write_string(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(out, v);
            }
            out.push(']');
        }
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            // Python sorts str keys by code point; UTF-8 byte order is the same order.
            keys.sort();
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(out, k);
                out.push(':');
                write_value(out, &map[k.as_str()]);
            }
            out.push('}');
        }
    }
}

fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            ' '..='~' => out.push(ch),
            _ => {
                let mut units = [0u16; 2];
                for u in ch.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
        }
    }
    out.push('"');
}

/// Python's `repr(float)` for finite values (shortest round-trip digits; exponent form below
/// 1e-4 and from 1e16). Non-finite values print as Python's `NaN` / `Infinity`.
fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    let abs = f.abs();
    if abs != 0.0 && !(1e-4..1e16).contains(&abs) {
        // Rust's `{:e}` is shortest round-trip too: `1e16`, `1.5e-5`; Python writes `1e+16`,
        // `1.5e-05` (sign always, at least two exponent digits).
        let s = format!("{f:e}");
        let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let (sign, digits) = match exp.strip_prefix('-') {
            Some(d) => ('-', d),
            None => ('+', exp),
        };
        return format!("{mantissa}e{sign}{digits:0>2}");
    }
    let s = format!("{f:?}");
    if s.contains('.') || s.contains('e') {
        s
    } else {
        format!("{s}.0")
    }
}

/// Inputs of kvtier's namespace besides the descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NamespaceParams {
    /// TP size.
    pub tp: u32,
    /// Blocks per chunk (vLLM's `blocks_per_file`).
    pub blocks_per_chunk: u32,
    /// Row stride of the primary rows (vLLM's sizing).
    pub row_stride: u64,
    /// Bytes of each row a persistent tier stores (its slot size): the canonical row stride
    /// ([`LayoutDescriptor::canonical_row_stride`], the same at every TP size) for the
    /// canonical layout, the whole row for the direct one. Enters the namespace as
    /// `row_stride`. Smaller than `row_stride` only for GQA with replicated KV heads (vLLM
    /// sizes the row for one copy per rank; the canonical area is its prefix).
    pub slot_bytes: u64,
    /// Whether chunks are stored in the canonical layout.
    pub canonical: bool,
    /// Whether every layer's mapping is parallelism-agnostic (from validation).
    pub all_layers_portable: bool,
    /// Whether the row holds one copy instead of one per worker (MLA).
    pub replicated_layout: bool,
}

impl NamespaceParams {
    /// Parameters for `desc` at TP `tp` with vLLM's row sizing: replicated layout for MLA
    /// (canonical, or direct with TP > 1), `row_stride` from [`LayoutDescriptor::vllm_row_stride`],
    /// `slot_bytes` the canonical row stride (canonical) or the row (direct), and portability
    /// from the descriptor's layout (certified layouts are portable).
    pub fn new(
        desc: &LayoutDescriptor,
        tp: u32,
        blocks_per_chunk: u32,
        canonical: bool,
    ) -> Result<Self> {
        desc.check_tp(tp)?;
        let replicated_layout = desc.is_mla() && (canonical || tp > 1);
        let row_stride = desc.vllm_row_stride(tp, blocks_per_chunk, replicated_layout)?;
        let slot_bytes = if canonical {
            desc.canonical_row_stride(blocks_per_chunk)?
        } else {
            row_stride
        };
        if slot_bytes > row_stride {
            return Err(Error::new(
                ErrorKind::Internal,
                format!(
                    "{}: canonical area ({slot_bytes} bytes) exceeds vLLM's row ({row_stride} bytes) at TP {tp}",
                    desc.model_name
                ),
            ));
        }
        Ok(NamespaceParams {
            tp,
            blocks_per_chunk,
            row_stride,
            slot_bytes,
            canonical,
            all_layers_portable: canonical && desc.kv_layout.is_certifiable(),
            replicated_layout,
        })
    }
}

impl NamespaceParams {
    /// `slot_bytes` when a tier stores only a prefix of the row (the canonical area of a row
    /// vLLM sizes larger: replicated GQA heads), else `None` (whole rows). What
    /// `crate::tiering::factory::TierBuildContext::slot_bytes` takes.
    pub fn slot_prefix(&self) -> Option<u64> {
        (self.slot_bytes < self.row_stride).then_some(self.slot_bytes)
    }
}

/// kvtier's namespace field object (serialised like the vLLM digest, then sha256).
pub fn namespace_fields(desc: &LayoutDescriptor, params: &NamespaceParams) -> Value {
    let (vllm_hex, vllm_fields) = vllm_digest(&VllmDigestFields::from_descriptor(desc, params));
    let mut m = Map::new();
    m.insert("kvtier_namespace_version".into(), json!(NAMESPACE_VERSION));
    m.insert("vllm_fields".into(), vllm_fields);
    m.insert("vllm_digest".into(), json!(vllm_hex));
    if let Some(rev) = &desc.revision {
        m.insert("model_revision".into(), json!(rev));
    }
    m.insert(
        "attention".into(),
        serde_json::to_value(desc.attention).unwrap_or(Value::Null),
    );
    m.insert("num_layers".into(), json!(desc.num_layers));
    m.insert("kv_cache_layout".into(), json!(desc.kv_layout.as_str()));
    m.insert("kv_split".into(), json!(desc.split().as_str()));
    m.insert("element_size".into(), json!(desc.element_size()));
    m.insert("tokens_per_block".into(), json!(desc.tokens_per_block));
    m.insert("num_kv_heads".into(), json!(desc.num_kv_heads));
    m.insert("head_dim".into(), json!(desc.head_dim));
    m.insert("kv_lora_rank".into(), json!(desc.kv_lora_rank));
    m.insert("qk_rope_head_dim".into(), json!(desc.qk_rope_head_dim));
    m.insert(
        "canonical_page_bytes".into(),
        json!(desc.canonical_page_size()),
    );
    // The bytes a tier stores per chunk (the canonical area for the canonical layout), so
    // one namespace serves every TP size even where vLLM's row is larger (replicated GQA).
    m.insert("row_stride".into(), json!(params.slot_bytes));
    m.insert("blocks_per_chunk".into(), json!(params.blocks_per_chunk));
    let storage = if params.canonical {
        "canonical"
    } else {
        "direct"
    };
    m.insert("storage".into(), json!(storage));
    if params.canonical {
        m.insert(
            "canonical_format".into(),
            json!(desc.kv_layout.canonical_format_id()),
        );
        m.insert(
            "canonical_format_version".into(),
            json!(CANONICAL_FORMAT_VERSION),
        );
    }
    // One namespace for every topology only when the bytes really are topology-free.
    if !(params.canonical && params.all_layers_portable) {
        m.insert(
            "topology".into(),
            json!({"tp": params.tp, "pp": 1, "pcp": 1, "dcp": 1}),
        );
    }
    Value::Object(m)
}

/// kvtier's namespace digest: sha256 of `namespace_fields` serialised like vLLM's digest.
pub fn namespace_digest(desc: &LayoutDescriptor, params: &NamespaceParams) -> [u8; 32] {
    let text = python_json_dumps(&namespace_fields(desc, params));
    Sha256::digest(text.as_bytes()).into()
}

/// The namespace of a pool that vLLM engines serving `desc` with `params` open, as they
/// present it with the tier entry's `layout` key ([`VllmSpecFields::of_layout_engine`]): what
/// `kvtier serve` with a `service` section serves and `kvtier tier format` writes by default.
/// kvtier's in-process tiers (`kvtier serve` without a service section, `kvtier bench`,
/// [`crate::Builder::layout`]) use the descriptor namespace [`namespace_digest`] instead.
pub fn engine_pool_namespace(
    desc: &LayoutDescriptor,
    params: &NamespaceParams,
) -> Result<[u8; 32]> {
    VllmSpecFields::of_layout_engine(desc, params)?.namespace_digest()
}

/// [`namespace_digest`] as 64 lower-case hex digits.
pub fn namespace_hex(desc: &LayoutDescriptor, params: &NamespaceParams) -> String {
    hex::encode(namespace_digest(desc, params))
}

/// A namespace digest written as 64 hex digits (either case), as [`namespace_hex`] and the
/// command line write it; `None` for anything else.
pub fn digest_from_hex(text: &str) -> Option<[u8; 32]> {
    hex::decode(text).ok()?.try_into().ok()
}

/// Refuses stored data whose namespace differs from the current one. `what` names the store
/// (a path or tier) for the message.
#[cfg(any(test, feature = "test-support"))]
pub fn check_namespace(what: &str, stored: &[u8; 32], current: &[u8; 32]) -> Result<()> {
    if stored == current {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::IncompatibleLayout,
        format!(
            "{what}: stored KV data was written under another layout namespace (model, dtype, block size, KV layout, row stride or topology differ); refusing to load it"
        ),
    )
    .with("expected", hex::encode(current))
    .with("found", hex::encode(stored)))
}

/// What vLLM's scheduler knows about the bytes it offloads (its normalised `OffloadingConfig`
/// and the row stride of the region it sized): the inputs of the namespace of a tier that vLLM
/// drives, where kvtier sees no layout descriptor (the Python package's `KvtierTier` reads
/// them from the `offloading_spec` vLLM passes). Field names follow `OffloadingConfig`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct VllmSpecFields {
    /// `config.model.name`.
    pub model_name: String,
    /// `config.model.dtype` (the KV cache dtype, as vLLM prints it).
    pub dtype: String,
    /// `config.cache.tokens_per_hash`.
    pub tokens_per_hash: u32,
    /// `config.cache.blocks_per_chunk` (vLLM's tiers pass it as `blocks_per_file`).
    pub blocks_per_chunk: u32,
    /// `config.parallel.tp_size`.
    pub tp_size: u32,
    /// `config.parallel.pp_size`.
    pub pp_size: u32,
    /// `config.parallel.pcp_size`.
    pub pcp_size: u32,
    /// `config.parallel.dcp_size`.
    pub dcp_size: u32,
    /// `config.parallel.world_size`.
    pub world_size: u32,
    /// `config.parallel.is_parallelism_agnostic` (vLLM's static portability claim).
    pub is_parallelism_agnostic: bool,
    /// `config.groups`: tokens per block and layer names of each offloaded group.
    pub kv_cache_groups: Vec<KvCacheGroupFields>,
    /// `config.replicated_layout` (one copy per row instead of one per worker).
    pub replicated_layout: bool,
    /// `config.canonical_layout`.
    pub canonical_layout: bool,
    /// `config.kv_cache_layout`: the `KVCacheLayout` member name (`LBNHC`, `LBHNC`, ...).
    pub kv_cache_layout: Option<String>,
    /// `config.worker_kv_bytes_per_block`.
    pub worker_kv_bytes_per_block: u64,
    /// The region's row stride (`primary_kv_view.strides[0]`).
    pub row_stride: u64,
    /// Bytes of each row the tier stores, when a layout descriptor names the canonical area
    /// ([`VllmSpecFields::canonical_area`]); `None` (the default, and what the Python package
    /// sends): the whole row. Enters the namespace as `row_stride`, so replicated GQA shares
    /// one namespace over TP sizes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot_bytes: Option<u64>,
}

impl VllmSpecFields {
    /// What a vLLM 0.33 engine serving `desc` with `params` presents (through the Python
    /// package's `KvtierTier`, as `spec_fields` reads vLLM's spec): the fields vLLM's
    /// `build_offloading_config` and its CPU spec derive for one group of full-attention (or
    /// MLA) layers at TP `params.tp` with no other parallelism (PP, PCP, DCP 1, world size =
    /// TP), the V1 model runner, the `mp` executor on one node and the descriptor's KV cache
    /// layout. The node service (`kvtier serve --layout --tp`) serves the namespace of these
    /// fields, so that engines of that model and configuration are accepted; checked against
    /// vLLM's own code for every shipped descriptor by `tests/python/test_canonical_vs_vllm.py`.
    pub fn of_engine(desc: &LayoutDescriptor, params: &NamespaceParams) -> Result<Self> {
        let tp = params.tp;
        // vLLM's gate: one full-attention group whose heads split exactly over TP ...
        let exact_split = !desc.is_mla() && tp > 0 && desc.total_kv_heads().is_multiple_of(tp);
        // ... widened for the canonical layout to every layer its static check certifies:
        // MLA, and attention heads that split or replicate evenly (what `check_tp` allows).
        let is_parallelism_agnostic = exact_split || params.canonical;
        Ok(VllmSpecFields {
            model_name: desc.model_name.clone(),
            dtype: desc.dtype.clone(),
            tokens_per_hash: desc.tokens_per_hash(),
            blocks_per_chunk: params.blocks_per_chunk,
            tp_size: tp,
            pp_size: 1,
            pcp_size: 1,
            dcp_size: 1,
            world_size: tp,
            is_parallelism_agnostic,
            kv_cache_groups: vec![KvCacheGroupFields {
                tokens_per_block: desc.tokens_per_block,
                layer_names: desc.layer_names(),
            }],
            replicated_layout: params.replicated_layout,
            canonical_layout: params.canonical,
            kv_cache_layout: Some(desc.kv_layout.vllm_name().to_string()),
            worker_kv_bytes_per_block: desc.worker_kv_bytes_per_block(tp)?,
            row_stride: params.row_stride,
            slot_bytes: None,
        })
    }

    /// What a vLLM 0.33 engine serving `desc` with `params` presents when its tier entry
    /// names the layout (the `layout` key of `kvtier.vllm.KvtierTier`, in process or in
    /// client mode): [`VllmSpecFields::of_engine`] with `slot_bytes` the canonical area where
    /// it is shorter than the row ([`NamespaceParams::slot_prefix`]). The namespace names the
    /// bytes a pool stores, so replicated GQA (Qwen2.5-3B at TP 4 and 8, rows of two and four
    /// times the area) shares one namespace over TP sizes; where the area is the row (every
    /// other shipped layout, and the direct layout) it is [`VllmSpecFields::of_engine`]'s.
    pub fn of_layout_engine(desc: &LayoutDescriptor, params: &NamespaceParams) -> Result<Self> {
        Ok(VllmSpecFields {
            slot_bytes: params.slot_prefix(),
            ..Self::of_engine(desc, params)?
        })
    }

    /// Parses the JSON object the Python package sends (every field required). Errors name
    /// the field.
    pub fn from_json(text: &str) -> Result<Self> {
        serde_json::from_str(text).map_err(|e| {
            Error::new(
                ErrorKind::Config,
                format!("invalid vLLM offloading fields: {e}"),
            )
        })
    }

    /// Whether vLLM collapses the storage namespace over topologies: fs, obj and p2p ask for
    /// it and vLLM grants it for a portable or replicated configuration (contract §8.4).
    pub fn parallel_agnostic(&self) -> bool {
        self.is_parallelism_agnostic || self.replicated_layout
    }

    /// `canonical_format_id(kv_cache_layout)` when the canonical layout is on.
    pub(crate) fn canonical_format(&self) -> Result<Option<String>> {
        if !self.canonical_layout {
            return Ok(None);
        }
        let name = self.kv_cache_layout.as_deref().ok_or_else(|| {
            Error::config(
                "kv_cache_layout",
                "canonical_layout is on but vLLM reported no KV cache layout",
            )
        })?;
        let layout = KvLayout::from_vllm_name(name).ok_or_else(|| {
            Error::config("kv_cache_layout", "not a vLLM 0.33 KVCacheLayout member")
                .with("found", name.to_string())
                .with("expected", "LBHNC, LBNHC, LHBNC, BLHNC, BLNHC or BHLNC")
        })?;
        Ok(Some(layout.canonical_format_id()))
    }

    /// The fields of vLLM's own `FileMapper` digest for these inputs, as its fs tier builds
    /// them (`FileMapper.from_offloading_spec(..., parallel_agnostic=True)`).
    pub fn vllm_digest_fields(&self) -> Result<VllmDigestFields> {
        let agnostic = self.parallel_agnostic();
        Ok(VllmDigestFields {
            model_name: self.model_name.clone(),
            tokens_per_hash: self.tokens_per_hash,
            blocks_per_file: self.blocks_per_chunk,
            tp_size: self.tp_size,
            pp_size: self.pp_size,
            pcp_size: self.pcp_size,
            dcp_size: self.dcp_size,
            dtype: self.dtype.clone(),
            kv_cache_groups: self.kv_cache_groups.clone(),
            parallel_agnostic: agnostic,
            replicated_layout: agnostic && self.replicated_layout,
            canonical_format: self.canonical_format()?,
        })
    }

    /// kvtier's namespace field object for these inputs: vLLM's fields and digest, plus what
    /// vLLM leaves out: the KV cache layout (on the direct path too), the storage kind, the
    /// row stride and, unless the rows are canonical and portable over topologies, the
    /// topology itself (TP, PP, PCP, DCP, world size and bytes per worker block).
    pub fn namespace_fields(&self) -> Result<Value> {
        let (vllm_hex, vllm_fields) = vllm_digest(&self.vllm_digest_fields()?);
        let mut m = Map::new();
        m.insert("kvtier_namespace_version".into(), json!(NAMESPACE_VERSION));
        m.insert("source".into(), json!("vllm_offloading_config"));
        m.insert("vllm_fields".into(), vllm_fields);
        m.insert("vllm_digest".into(), json!(vllm_hex));
        m.insert("kv_cache_layout".into(), json!(self.kv_cache_layout));
        // The bytes stored per chunk: the canonical area when a layout names it (equal to
        // the row except for replicated GQA heads), else the row.
        m.insert(
            "row_stride".into(),
            json!(self.slot_bytes.unwrap_or(self.row_stride)),
        );
        let storage = if self.canonical_layout {
            "canonical"
        } else {
            "direct"
        };
        m.insert("storage".into(), json!(storage));
        if let Some(format) = self.canonical_format()? {
            m.insert("canonical_format".into(), json!(format));
            m.insert(
                "canonical_format_version".into(),
                json!(CANONICAL_FORMAT_VERSION),
            );
        }
        if !(self.canonical_layout && self.parallel_agnostic()) {
            m.insert(
                "topology".into(),
                json!({
                    "tp": self.tp_size, "pp": self.pp_size, "pcp": self.pcp_size,
                    "dcp": self.dcp_size, "world_size": self.world_size,
                    "worker_kv_bytes_per_block": self.worker_kv_bytes_per_block,
                }),
            );
        }
        Ok(Value::Object(m))
    }

    /// sha256 of [`VllmSpecFields::namespace_fields`] serialised like vLLM's digest: what the
    /// tier's slab superblocks carry.
    pub fn namespace_digest(&self) -> Result<[u8; 32]> {
        let text = python_json_dumps(&self.namespace_fields()?);
        Ok(Sha256::digest(text.as_bytes()).into())
    }
}

#[cfg(test)]
mod vllm_spec_tests {
    use super::*;

    #[test]
    fn a_digest_reads_from_64_hex_digits_only() {
        let text = "00112233445566778899aabbccddeeff00112233445566778899AABBCCDDEEFF";
        let d = digest_from_hex(text).unwrap();
        assert_eq!((d[0], d[1], d[15], d[31]), (0x00, 0x11, 0xff, 0xff));
        assert_eq!(digest_from_hex(&text[..62]), None);
        assert_eq!(digest_from_hex(&format!("{text}00")), None);
        assert_eq!(digest_from_hex(&text.replace('a', "g")), None);
    }

    fn fields(tp: u32, canonical: bool, agnostic: bool) -> VllmSpecFields {
        VllmSpecFields {
            model_name: "org/model".into(),
            dtype: "bfloat16".into(),
            tokens_per_hash: 16,
            blocks_per_chunk: 4,
            tp_size: tp,
            pp_size: 1,
            pcp_size: 1,
            dcp_size: 1,
            world_size: tp,
            is_parallelism_agnostic: agnostic,
            kv_cache_groups: vec![KvCacheGroupFields {
                tokens_per_block: 16,
                layer_names: vec!["l.0".into(), "l.1".into()],
            }],
            replicated_layout: false,
            canonical_layout: canonical,
            kv_cache_layout: Some("LBNHC".into()),
            worker_kv_bytes_per_block: 65536 / u64::from(tp),
            row_stride: 262_144,
            slot_bytes: None,
        }
    }

    #[test]
    fn canonical_portable_rows_share_one_namespace_over_tp_sizes() {
        let a = fields(1, true, true).namespace_digest().unwrap();
        let b = fields(4, true, true).namespace_digest().unwrap();
        assert_eq!(a, b);
        let v = fields(4, true, true).namespace_fields().unwrap();
        assert!(v.get("topology").is_none());
        assert_eq!(v["canonical_format"], "v1-nhd");
    }

    #[test]
    fn direct_rows_and_other_layouts_get_their_own_namespace() {
        // vLLM collapses the direct path for exactly split heads; kvtier keeps the topology.
        let a = fields(1, false, true).namespace_digest().unwrap();
        let b = fields(2, false, true).namespace_digest().unwrap();
        assert_ne!(a, b);
        assert_eq!(
            vllm_digest(&fields(1, false, true).vllm_digest_fields().unwrap()).0,
            vllm_digest(&fields(2, false, true).vllm_digest_fields().unwrap()).0
        );
        let mut hnd = fields(1, false, true);
        hnd.kv_cache_layout = Some("LBHNC".into());
        assert_ne!(a, hnd.namespace_digest().unwrap());
        let mut canonical_hnd = fields(1, true, true);
        canonical_hnd.kv_cache_layout = Some("LBHNC".into());
        assert_eq!(
            canonical_hnd.namespace_fields().unwrap()["canonical_format"],
            "v1-hnd"
        );
        canonical_hnd.kv_cache_layout = Some("XYZ".into());
        let e = canonical_hnd.namespace_digest().unwrap_err();
        assert_eq!(e.context_value("key"), Some("kv_cache_layout"));
    }

    #[test]
    fn the_python_packages_json_is_read_strictly() {
        let text = serde_json::json!({
            "model_name": "m", "dtype": "float16", "tokens_per_hash": 16, "blocks_per_chunk": 1,
            "tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1, "world_size": 1,
            "is_parallelism_agnostic": false,
            "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["a"]}],
            "replicated_layout": false, "canonical_layout": false, "kv_cache_layout": null,
            "worker_kv_bytes_per_block": 4096, "row_stride": 4096
        });
        let f = VllmSpecFields::from_json(&text.to_string()).unwrap();
        assert!(!f.vllm_digest_fields().unwrap().parallel_agnostic);
        let mut extra = text.clone();
        extra["surprise"] = serde_json::json!(1);
        assert!(VllmSpecFields::from_json(&extra.to_string()).is_err());
    }
}
