//! Model layout descriptors: the KV-cache geometry of one model as a serving framework holds it.
//!
//! A descriptor is a small TOML file (see `layouts/`). Parsing rejects unknown keys and
//! impossible geometry with an error that names the file and the key.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};
use crate::geometry::ChunkGeometry;

/// The attention kind of a model's KV-caching layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionKind {
    /// Multi-head attention: as many KV heads as attention heads.
    Mha,
    /// Grouped-query attention: fewer KV heads than attention heads (MQA included).
    Gqa,
    /// Multi-head latent attention: one compressed latent (plus rope part) per token.
    Mla,
}

/// The KV memory layout of a layer's page (vLLM's `KVCacheLayout` family).
///
/// `NHD` (`LBNHC`: token-major, heads inside) and `HND` (`LBHNC`: head-major) are certified for
/// the canonical layout; the other names are accepted but get the opaque per-rank fallback.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvLayout {
    /// Tokens outermost, then heads, then the head dimension (`LBNHC`).
    #[serde(rename = "NHD", alias = "LBNHC")]
    Nhd,
    /// Heads outermost, then tokens, then the head dimension (`LBHNC`).
    #[serde(rename = "HND", alias = "LBHNC")]
    Hnd,
    /// `LHBNC`: not certified for the canonical layout.
    #[serde(rename = "LHBNC")]
    Lhbnc,
    /// `BLHNC` (cross-layer): not certified for the canonical layout.
    #[serde(rename = "BLHNC")]
    Blhnc,
    /// `BLNHC` (cross-layer): not certified for the canonical layout.
    #[serde(rename = "BLNHC")]
    Blnhc,
    /// `BHLNC` (cross-layer): not certified for the canonical layout.
    #[serde(rename = "BHLNC")]
    Bhlnc,
}

impl KvLayout {
    /// The name as written in descriptors (`NHD`, `HND`, or the `KVCacheLayout` member name).
    pub fn as_str(self) -> &'static str {
        match self {
            KvLayout::Nhd => "NHD",
            KvLayout::Hnd => "HND",
            KvLayout::Lhbnc => "LHBNC",
            KvLayout::Blhnc => "BLHNC",
            KvLayout::Blnhc => "BLNHC",
            KvLayout::Bhlnc => "BHLNC",
        }
    }

    /// vLLM's `canonical_format_id`: `v1-nhd`, `v1-hnd`, otherwise `v1-<lower-cased name>`.
    pub fn canonical_format_id(self) -> String {
        let family = match self {
            KvLayout::Nhd => "nhd".to_string(),
            KvLayout::Hnd => "hnd".to_string(),
            other => other.as_str().to_ascii_lowercase(),
        };
        format!("v{CANONICAL_FORMAT_VERSION}-{family}")
    }

    /// The layout of vLLM's `KVCacheLayout` member `name` (`LBNHC` is NHD, `LBHNC` is HND), as
    /// vLLM reports it in `OffloadingConfig.kv_cache_layout`.
    pub fn vllm_name(self) -> &'static str {
        match self {
            KvLayout::Nhd => "LBNHC",
            KvLayout::Hnd => "LBHNC",
            KvLayout::Lhbnc => "LHBNC",
            KvLayout::Blhnc => "BLHNC",
            KvLayout::Blnhc => "BLNHC",
            KvLayout::Bhlnc => "BHLNC",
        }
    }

    /// The layout of vLLM's `KVCacheLayout` member `name` (the inverse of
    /// [`KvLayout::vllm_name`]).
    pub fn from_vllm_name(name: &str) -> Option<Self> {
        Some(match name {
            "LBNHC" => KvLayout::Nhd,
            "LBHNC" => KvLayout::Hnd,
            "LHBNC" => KvLayout::Lhbnc,
            "BLHNC" => KvLayout::Blhnc,
            "BLNHC" => KvLayout::Blnhc,
            "BHLNC" => KvLayout::Bhlnc,
            _ => return None,
        })
    }

    /// Whether canonical mappings can be certified for this layout.
    pub fn is_certifiable(self) -> bool {
        matches!(self, KvLayout::Nhd | KvLayout::Hnd)
    }
}

/// vLLM's `CANONICAL_FORMAT_VERSION`.
pub const CANONICAL_FORMAT_VERSION: u32 = 1;

/// How K and V sit in one layer's page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvSplit {
    /// K and V halves: page shape `(2, tokens, heads, head_dim)` (NHD) or `(2, heads, tokens,
    /// head_dim)` (HND).
    Split,
    /// K and V side by side per head and token: `(tokens, heads, 2 * head_dim)` (NHD) or
    /// `(heads, tokens, 2 * head_dim)` (HND).
    Packed,
    /// One latent vector per token (MLA): `(tokens, kv_lora_rank + qk_rope_head_dim)`.
    Latent,
}

impl KvSplit {
    /// The name as written in descriptors.
    pub fn as_str(self) -> &'static str {
        match self {
            KvSplit::Split => "split",
            KvSplit::Packed => "packed",
            KvSplit::Latent => "latent",
        }
    }
}

/// KV cache element types and their sizes.
pub const DTYPES: &[(&str, u64)] = &[
    ("bfloat16", 2),
    ("float16", 2),
    ("float32", 4),
    ("fp8", 1),
    ("fp8_e4m3", 1),
    ("fp8_e5m2", 1),
];

/// The most layers, heads, tokens or dims a descriptor may declare (sanity bound).
const MAX_DIM: u32 = 1 << 16;

/// One model's KV-cache geometry. Fields are public for reading; build one with
/// [`LayoutDescriptor::load`] / [`LayoutDescriptor::from_toml_str`] (which validate), and call
/// [`LayoutDescriptor::validate`] again after changing a field.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayoutDescriptor {
    /// The model as the serving framework names it (`config.model.name`, e.g. the HF id).
    pub model_name: String,
    /// The model revision (commit or tag), when pinned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// KV-caching layers.
    pub num_layers: u32,
    /// Attention kind.
    pub attention: AttentionKind,
    /// Query heads (decides which TP sizes the model allows).
    pub num_attention_heads: u32,
    /// KV heads (MHA / GQA only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_kv_heads: Option<u32>,
    /// Head dimension (MHA / GQA only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<u32>,
    /// MLA compressed latent width per token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_lora_rank: Option<u32>,
    /// MLA decoupled rope width per token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qk_rope_head_dim: Option<u32>,
    /// KV cache dtype as vLLM prints it (`bfloat16`, `float16`, `float32`, `fp8`, ...).
    pub dtype: String,
    /// Tokens per GPU block.
    pub tokens_per_block: u32,
    /// Tokens per prefix-cache hash unit (default: `tokens_per_block`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_hash: Option<u32>,
    /// KV memory layout of a page.
    pub kv_layout: KvLayout,
    /// K/V split or packed (attention); `latent` or absent for MLA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_split: Option<KvSplit>,
    /// Layer name with `{i}` for the layer index, e.g. `model.layers.{i}.self_attn.attn`.
    pub layer_name_pattern: String,
}

fn bad(origin: &str, key: &str, msg: impl Into<String>) -> Error {
    Error::config(format!("{origin}: {key}"), msg).with("path", origin.to_string())
}

impl LayoutDescriptor {
    /// Reads and validates a descriptor file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io("read layout", path, e))?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses and validates a descriptor from TOML text.
    pub fn from_toml_str(text: &str) -> Result<Self> {
        Self::parse(text, "<layout>")
    }

    fn parse(text: &str, origin: &str) -> Result<Self> {
        let desc: LayoutDescriptor = toml::from_str(text).map_err(|e| {
            Error::new(
                ErrorKind::Config,
                format!("{origin}: invalid layout descriptor: {}", e.message()),
            )
            .with("path", origin.to_string())
            .with(
                "line",
                e.span()
                    .map(|s| {
                        (text[..s.start.min(text.len())].matches('\n').count() + 1).to_string()
                    })
                    .unwrap_or_else(|| "?".into()),
            )
        })?;
        desc.validate_as(origin)?;
        Ok(desc)
    }

    /// The descriptor as TOML text (round-trips through [`LayoutDescriptor::from_toml_str`]).
    pub fn to_toml_string(&self) -> Result<String> {
        toml::to_string(self).map_err(|e| {
            Error::new(
                ErrorKind::Internal,
                format!("serialising layout descriptor: {e}"),
            )
        })
    }

    /// Checks the geometry; errors name the key and what was expected.
    pub fn validate(&self) -> Result<()> {
        self.validate_as(&self.model_name)
    }

    fn validate_as(&self, origin: &str) -> Result<()> {
        if self.model_name.trim().is_empty() {
            return Err(bad(origin, "model_name", "must not be empty"));
        }
        if let Some(r) = &self.revision
            && r.trim().is_empty()
        {
            return Err(bad(origin, "revision", "must not be empty when given"));
        }
        let dim = |key: &str, v: u32| -> Result<()> {
            if v == 0 || v > MAX_DIM {
                return Err(bad(
                    origin,
                    key,
                    format!("must be between 1 and {MAX_DIM}, found {v}"),
                ));
            }
            Ok(())
        };
        dim("num_layers", self.num_layers)?;
        dim("num_attention_heads", self.num_attention_heads)?;
        dim("tokens_per_block", self.tokens_per_block)?;
        if let Some(h) = self.tokens_per_hash {
            dim("tokens_per_hash", h)?;
            if !self.tokens_per_block.is_multiple_of(h) {
                return Err(bad(
                    origin,
                    "tokens_per_hash",
                    format!(
                        "must divide tokens_per_block ({}), found {h}",
                        self.tokens_per_block
                    ),
                ));
            }
        }
        if self.element_size().is_none() {
            let known: Vec<_> = DTYPES.iter().map(|(n, _)| *n).collect();
            return Err(bad(
                origin,
                "dtype",
                format!(
                    "unknown dtype {:?}; expected one of {}",
                    self.dtype,
                    known.join(", ")
                ),
            ));
        }
        if self.layer_name_pattern.matches("{i}").count() != 1 {
            return Err(bad(
                origin,
                "layer_name_pattern",
                format!(
                    "must contain `{{i}}` exactly once (the layer index), found {:?}",
                    self.layer_name_pattern
                ),
            ));
        }
        match self.attention {
            AttentionKind::Mha | AttentionKind::Gqa => self.validate_attention(origin, dim)?,
            AttentionKind::Mla => self.validate_mla(origin, dim)?,
        }
        // Every size below must fit in u64 with room to spare.
        self.canonical_page_bytes()
            .and_then(|p| p.checked_mul(u64::from(self.num_layers)))
            .and_then(|b| b.checked_mul(u64::from(MAX_DIM)))
            .ok_or_else(|| {
                bad(
                    origin,
                    "num_layers",
                    "geometry overflows 64-bit byte counts",
                )
            })?;
        Ok(())
    }

    fn validate_attention(
        &self,
        origin: &str,
        dim: impl Fn(&str, u32) -> Result<()>,
    ) -> Result<()> {
        let kind = if self.attention == AttentionKind::Mha {
            "mha"
        } else {
            "gqa"
        };
        for key in ["kv_lora_rank", "qk_rope_head_dim"] {
            let present = match key {
                "kv_lora_rank" => self.kv_lora_rank.is_some(),
                _ => self.qk_rope_head_dim.is_some(),
            };
            if present {
                return Err(bad(
                    origin,
                    key,
                    format!("is for attention = \"mla\" only, not {kind:?}"),
                ));
            }
        }
        let kv = self.num_kv_heads.ok_or_else(|| {
            bad(
                origin,
                "num_kv_heads",
                format!("is required for attention = {kind:?}"),
            )
        })?;
        let hd = self.head_dim.ok_or_else(|| {
            bad(
                origin,
                "head_dim",
                format!("is required for attention = {kind:?}"),
            )
        })?;
        dim("num_kv_heads", kv)?;
        dim("head_dim", hd)?;
        let heads = self.num_attention_heads;
        if !heads.is_multiple_of(kv) {
            return Err(bad(
                origin,
                "num_kv_heads",
                format!("must divide num_attention_heads ({heads}), found {kv}"),
            ));
        }
        if self.attention == AttentionKind::Mha && kv != heads {
            return Err(bad(
                origin,
                "num_kv_heads",
                format!(
                    "attention = \"mha\" needs num_kv_heads == num_attention_heads ({heads}), found {kv}; use \"gqa\""
                ),
            ));
        }
        if self.attention == AttentionKind::Gqa && kv == heads {
            return Err(bad(
                origin,
                "attention",
                format!(
                    "\"gqa\" needs fewer KV heads than attention heads (both {heads}); use \"mha\""
                ),
            ));
        }
        match self.kv_split {
            Some(KvSplit::Split) | Some(KvSplit::Packed) => Ok(()),
            Some(KvSplit::Latent) => Err(bad(
                origin,
                "kv_split",
                format!(
                    "\"latent\" is for MLA only; attention = {kind:?} takes \"split\" or \"packed\""
                ),
            )),
            None => Err(bad(
                origin,
                "kv_split",
                format!("is required for attention = {kind:?}: \"split\" or \"packed\""),
            )),
        }
    }

    fn validate_mla(&self, origin: &str, dim: impl Fn(&str, u32) -> Result<()>) -> Result<()> {
        if self.num_kv_heads.is_some() || self.head_dim.is_some() {
            let key = if self.num_kv_heads.is_some() {
                "num_kv_heads"
            } else {
                "head_dim"
            };
            return Err(bad(
                origin,
                key,
                "is not used with attention = \"mla\" (give kv_lora_rank and qk_rope_head_dim)",
            ));
        }
        let lora = self.kv_lora_rank.ok_or_else(|| {
            bad(
                origin,
                "kv_lora_rank",
                "is required for attention = \"mla\"",
            )
        })?;
        let rope = self.qk_rope_head_dim.ok_or_else(|| {
            bad(
                origin,
                "qk_rope_head_dim",
                "is required for attention = \"mla\"",
            )
        })?;
        dim("kv_lora_rank", lora)?;
        dim("qk_rope_head_dim", rope)?;
        match self.kv_split {
            None | Some(KvSplit::Latent) => Ok(()),
            Some(other) => Err(bad(
                origin,
                "kv_split",
                format!(
                    "attention = \"mla\" stores one latent per token; {:?} does not apply (use \"latent\" or omit it)",
                    other.as_str()
                ),
            )),
        }
    }

    /// Bytes per KV element, or `None` for an unknown dtype.
    pub fn element_size(&self) -> Option<u64> {
        DTYPES
            .iter()
            .find(|(n, _)| *n == self.dtype)
            .map(|(_, s)| *s)
    }

    fn elem(&self) -> u64 {
        self.element_size().unwrap_or(1)
    }

    /// Whether this is an MLA model.
    pub fn is_mla(&self) -> bool {
        self.attention == AttentionKind::Mla
    }

    /// The page encoding (`split` / `packed` / `latent`).
    pub fn split(&self) -> KvSplit {
        if self.is_mla() {
            KvSplit::Latent
        } else {
            self.kv_split.unwrap_or(KvSplit::Split)
        }
    }

    /// KV heads of the whole model (1 for MLA: the latent acts as one shared head).
    pub fn total_kv_heads(&self) -> u32 {
        if self.is_mla() {
            1
        } else {
            self.num_kv_heads.unwrap_or(1)
        }
    }

    /// Elements per token per head in a page: `2 * head_dim` for attention (K and V), the
    /// latent plus rope width for MLA.
    pub fn elements_per_token_head(&self) -> u64 {
        if self.is_mla() {
            u64::from(self.kv_lora_rank.unwrap_or(0))
                + u64::from(self.qk_rope_head_dim.unwrap_or(0))
        } else {
            2 * u64::from(self.head_dim.unwrap_or(0))
        }
    }

    /// Tokens per prefix-cache hash unit.
    pub fn tokens_per_hash(&self) -> u32 {
        self.tokens_per_hash.unwrap_or(self.tokens_per_block)
    }

    /// The name of layer `i` from the layer-name pattern.
    pub fn layer_name(&self, i: u32) -> String {
        self.layer_name_pattern.replacen("{i}", &i.to_string(), 1)
    }

    /// All layer names in order.
    pub fn layer_names(&self) -> Vec<String> {
        (0..self.num_layers).map(|i| self.layer_name(i)).collect()
    }

    fn canonical_page_bytes(&self) -> Option<u64> {
        u64::from(self.tokens_per_block)
            .checked_mul(u64::from(self.total_kv_heads()))?
            .checked_mul(self.elements_per_token_head())?
            .checked_mul(self.elem())
    }

    /// Bytes of one layer's unsharded page (all KV heads, all tokens of a block, one copy).
    pub fn canonical_page_size(&self) -> u64 {
        self.canonical_page_bytes().unwrap_or(0)
    }

    /// Bytes of one block over all layers, unsharded and stored once (the canonical block).
    pub fn canonical_bytes_per_block(&self) -> u64 {
        self.canonical_page_size() * u64::from(self.num_layers)
    }

    /// Checks that the model can run at TP size `tp` (tp divides the attention heads, and KV
    /// heads either split evenly or replicate evenly).
    pub fn check_tp(&self, tp: u32) -> Result<()> {
        let err = |msg: String| {
            Err(Error::new(ErrorKind::Unsupported, msg)
                .with("model", self.model_name.clone())
                .with("tp", tp.to_string()))
        };
        if tp == 0 || tp > MAX_DIM {
            return err(format!(
                "TP size must be between 1 and {MAX_DIM}, found {tp}"
            ));
        }
        if !self.num_attention_heads.is_multiple_of(tp) {
            return err(format!(
                "{}: TP size {tp} does not divide its {} attention heads",
                self.model_name, self.num_attention_heads
            ));
        }
        let kv = self.total_kv_heads();
        if !self.is_mla() && !kv.is_multiple_of(tp) && !tp.is_multiple_of(kv) {
            return err(format!(
                "{}: TP size {tp} neither divides nor is a multiple of its {kv} KV heads",
                self.model_name
            ));
        }
        Ok(())
    }

    /// The TP sizes among `candidates` that the model allows.
    pub fn allowed_tp(&self, candidates: &[u32]) -> Vec<u32> {
        candidates
            .iter()
            .copied()
            .filter(|&t| self.check_tp(t).is_ok())
            .collect()
    }

    /// KV heads one rank holds at TP `tp` (`max(1, total / tp)`; MLA: the one latent).
    pub fn local_kv_heads(&self, tp: u32) -> Result<u32> {
        self.check_tp(tp)?;
        Ok((self.total_kv_heads() / tp).max(1))
    }

    /// Bytes of one layer's page on one rank at TP `tp`.
    pub fn local_page_size(&self, tp: u32) -> Result<u64> {
        let heads = u64::from(self.local_kv_heads(tp)?);
        Ok(u64::from(self.tokens_per_block) * heads * self.elements_per_token_head() * self.elem())
    }

    /// Bytes one rank holds per GPU block, all layers (vLLM's `worker_kv_bytes_per_block`).
    pub fn worker_kv_bytes_per_block(&self, tp: u32) -> Result<u64> {
        Ok(self.local_page_size(tp)? * u64::from(self.num_layers))
    }

    /// The row stride vLLM sizes for this model (§4.1 of the contract):
    /// `round_up(worker_kv_bytes_per_block * copies * blocks_per_chunk, ROW_ALIGNMENT)` where
    /// `copies` is 1 with a replicated layout and `tp` otherwise; [`ChunkGeometry`] computes it.
    pub fn vllm_row_stride(&self, tp: u32, blocks_per_chunk: u32, replicated: bool) -> Result<u64> {
        if blocks_per_chunk == 0 {
            return Err(Error::config("blocks_per_chunk", "must be > 0, found 0"));
        }
        let copies = if replicated { 1 } else { u64::from(tp) };
        let raw = ChunkGeometry::raw_bytes_per_chunk(
            self.worker_kv_bytes_per_block(tp)?,
            copies,
            blocks_per_chunk,
        )?;
        ChunkGeometry::row_stride_for(raw)
    }

    /// The smallest row stride holding one canonical chunk:
    /// `round_up(canonical_bytes_per_block * blocks_per_chunk, ROW_ALIGNMENT)` (computed by
    /// [`ChunkGeometry`]). Equal for every TP size, so rows of this stride can be shared across
    /// topologies.
    pub fn canonical_row_stride(&self, blocks_per_chunk: u32) -> Result<u64> {
        if blocks_per_chunk == 0 {
            return Err(Error::config("blocks_per_chunk", "must be > 0, found 0"));
        }
        let raw = ChunkGeometry::raw_bytes_per_chunk(
            self.canonical_bytes_per_block(),
            1,
            blocks_per_chunk,
        )?;
        ChunkGeometry::row_stride_for(raw)
    }

    /// Whether vLLM would choose its replicated layout (one copy instead of one per worker):
    /// MLA and TP > 1 (single node, `mp` executor and `world_size == tp` assumed).
    pub fn vllm_replicated_layout(&self, tp: u32) -> bool {
        self.is_mla() && tp > 1
    }
}
