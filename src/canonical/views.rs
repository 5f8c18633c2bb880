//! The page encoding of the tensors themselves: a layer's KV-cache view (shape and strides, as
//! the serving engine allocated it) says how K, V, heads and tokens sit in a page. Where kvtier
//! gathers rows from an engine's tensors, this is the truth and the descriptor's `kv_layout` /
//! `kv_split` a claim to check: [`check_views`] derives the encoding from every layer's view
//! and refuses a descriptor that says otherwise.
//!
//! Views follow vLLM 0.33.0's per-layer tensors (`create_kv_cache_views`,
//! `vllm/v1/kv_cache_interface.py`): dimension 0 indexes blocks (its stride is not part of the
//! page encoding), the rest is one block's page, strides in elements:
//!
//! | Encoding | Shape | Strides after the block dimension |
//! | --- | --- | --- |
//! | packed NHD | `[B, heads, tokens, 2*dim]` | `[2*dim, heads*2*dim, 1]` |
//! | packed HND | `[B, heads, tokens, 2*dim]` | `[tokens*2*dim, 2*dim, 1]` |
//! | split NHD | `[B, 2, tokens, heads, dim]` | `[tokens*heads*dim, heads*dim, dim, 1]` |
//! | split HND | `[B, 2, tokens, heads, dim]` | `[tokens*heads*dim, dim, tokens*dim, 1]` |
//! | latent (MLA) | `[B, 1, tokens, lora+rope]` | `[any, lora+rope, 1]` |
//!
//! A dimension of size 1 matches any stride (its stride places nothing), so for example a
//! one-head page is both NHD and HND: the bytes are the same.

use serde::{Deserialize, Serialize};

use crate::canonical::descriptor::{KvLayout, KvSplit, LayoutDescriptor};
use crate::error::{Error, ErrorKind, Result};

/// One layer's KV-cache tensor as the engine holds it: shape, strides in elements, and the
/// element size in bytes (metadata only).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerView {
    /// Sizes, dimension 0 being the block index.
    pub shape: Vec<u64>,
    /// Strides in elements, one per dimension.
    pub stride: Vec<u64>,
    /// Bytes per element.
    pub element_size: u64,
}

/// How a page is encoded: the KV layout family and where K and V sit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PageEncoding {
    /// Heads before tokens (`HND`) or tokens before heads (`NHD`).
    pub kv_layout: KvLayout,
    /// K and V halves, packed per head and token, or one latent.
    pub kv_split: KvSplit,
}

impl PageEncoding {
    /// The descriptor's claim.
    pub fn of_descriptor(desc: &LayoutDescriptor) -> Self {
        PageEncoding {
            kv_layout: desc.kv_layout,
            kv_split: desc.split(),
        }
    }

    /// `packed NHD`, `split HND`, `latent NHD`, ...
    pub fn describe(&self) -> String {
        format!("{} {}", self.kv_split.as_str(), self.kv_layout.as_str())
    }
}

/// Where the page encoding kvtier works with came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EncodingSource {
    /// The descriptor's `kv_layout` / `kv_split`, unchecked against tensors (kvtier saw none).
    Descriptor,
    /// Derived from the layers' views and checked against the descriptor.
    Views,
    /// Derived from the layer tensors kvtier allocated itself as vLLM 0.33's allocator does
    /// ([`allocator_views`]: `kvtier bench`, `--gds`) and checked against the descriptor.
    Allocated,
}

impl EncodingSource {
    /// `descriptor`, `views` or `allocated`.
    pub fn as_str(self) -> &'static str {
        match self {
            EncodingSource::Descriptor => "descriptor",
            EncodingSource::Views => "views",
            EncodingSource::Allocated => "allocated",
        }
    }
}

/// The per-layer KV-cache views vLLM 0.33.0's allocator creates for `desc`'s model at TP
/// `tp` over `num_blocks` blocks (`allocate_kv_cache` -> `create_kv_cache_views` over one
/// buffer, layers outermost): every attention layer `[blocks, heads, tokens, 2*dim]` (K and V
/// side by side in the last dimension, strides NHD `[page, 2*dim, heads*2*dim, 1]` or HND
/// `[page, tokens*2*dim, 2*dim, 1]`), an MLA layer `[blocks, 1, tokens, lora+rope]`. Built
/// from the model's geometry and its `kv_layout`, never from its `kv_split`, so
/// [`check_views`] over them checks the descriptor's encoding against what vLLM allocates
/// (`tests/python/test_canonical_vs_vllm.py` compares them with vLLM's own views). `None` for
/// the uncertified layouts (`LHBNC`, cross-layer `BL*`), whose pages are moved opaquely.
pub fn allocator_views(
    desc: &LayoutDescriptor,
    tp: u32,
    num_blocks: u64,
) -> Result<Option<Vec<LayerView>>> {
    let tokens = u64::from(desc.tokens_per_block);
    let heads = u64::from(desc.local_kv_heads(tp)?);
    let content = desc.elements_per_token_head();
    let page = heads * tokens * content;
    let stride = match (desc.is_mla(), desc.kv_layout) {
        (true, _) => vec![page, content, content, 1],
        (false, KvLayout::Nhd) => vec![page, content, heads * content, 1],
        (false, KvLayout::Hnd) => vec![page, tokens * content, content, 1],
        _ => return Ok(None),
    };
    let view = LayerView {
        shape: vec![num_blocks, heads, tokens, content],
        stride,
        element_size: desc.element_size().unwrap_or(1),
    };
    Ok(Some(vec![view; desc.num_layers as usize]))
}

/// The page encoding of the layer tensors kvtier allocates itself for `desc` at TP `tp`, as
/// vLLM's allocator would ([`allocator_views`], checked by [`check_views`]: a descriptor that
/// claims another encoding is refused), and its source; for an uncertified layout, the
/// descriptor's own claim.
pub fn allocated_encoding(
    desc: &LayoutDescriptor,
    tp: u32,
) -> Result<(PageEncoding, EncodingSource)> {
    let views = allocator_views(desc, tp, 1)?;
    let (encoding, source) = resolve_encoding(desc, tp, views.as_deref())?;
    let source = match source {
        EncodingSource::Views => EncodingSource::Allocated,
        other => other,
    };
    Ok((encoding, source))
}

/// The shape and the in-page strides (after the block dimension) a page of `encoding` has
/// for `desc` at TP `tp`; `None` for an encoding that does not apply to the model.
fn expected(
    desc: &LayoutDescriptor,
    tp: u32,
    encoding: PageEncoding,
) -> Result<Option<(Vec<u64>, Vec<u64>)>> {
    let tokens = u64::from(desc.tokens_per_block);
    let heads = u64::from(desc.local_kv_heads(tp)?);
    let content = desc.elements_per_token_head();
    let dim = content / 2;
    Ok(Some(
        match (encoding.kv_split, encoding.kv_layout, desc.is_mla()) {
            (KvSplit::Latent, KvLayout::Nhd | KvLayout::Hnd, true) => {
                (vec![1, tokens, content], vec![tokens * content, content, 1])
            }
            (KvSplit::Packed, KvLayout::Nhd, false) => (
                vec![heads, tokens, content],
                vec![content, heads * content, 1],
            ),
            (KvSplit::Packed, KvLayout::Hnd, false) => (
                vec![heads, tokens, content],
                vec![tokens * content, content, 1],
            ),
            (KvSplit::Split, KvLayout::Nhd, false) => (
                vec![2, tokens, heads, dim],
                vec![tokens * heads * dim, heads * dim, dim, 1],
            ),
            (KvSplit::Split, KvLayout::Hnd, false) => (
                vec![2, tokens, heads, dim],
                vec![tokens * heads * dim, dim, tokens * dim, 1],
            ),
            _ => return Ok(None),
        },
    ))
}

/// Whether `view`'s page (dimensions after the first) is `shape` with `strides`, dimensions
/// of size 1 matching any stride.
fn page_matches(view: &LayerView, shape: &[u64], strides: &[u64]) -> bool {
    view.shape.len() == shape.len() + 1
        && view.stride.len() == view.shape.len()
        && view.shape[1..] == *shape
        && shape
            .iter()
            .zip(&view.stride[1..])
            .zip(strides)
            .all(|((&n, &got), &want)| n == 1 || got == want)
}

/// The certified page encodings `view` holds for `desc` at TP `tp` (several only when a
/// dimension of size 1 makes them byte-identical; empty when none fits).
pub fn encodings_of_view(
    desc: &LayoutDescriptor,
    tp: u32,
    view: &LayerView,
) -> Result<Vec<PageEncoding>> {
    let mut found = Vec::new();
    for kv_split in [KvSplit::Packed, KvSplit::Split, KvSplit::Latent] {
        for kv_layout in [KvLayout::Nhd, KvLayout::Hnd] {
            let encoding = PageEncoding {
                kv_layout,
                kv_split,
            };
            if let Some((shape, strides)) = expected(desc, tp, encoding)?
                && page_matches(view, &shape, &strides)
            {
                found.push(encoding);
            }
        }
    }
    Ok(found)
}

/// `a, b, c`.
fn join(v: &[u64]) -> String {
    v.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
}

/// The page encoding to work with and where it came from: derived from `views` and checked
/// ([`check_views`]) when the caller has them, else the descriptor's claim.
pub fn resolve_encoding(
    desc: &LayoutDescriptor,
    tp: u32,
    views: Option<&[LayerView]>,
) -> Result<(PageEncoding, EncodingSource)> {
    Ok(match views {
        Some(views) => (check_views(desc, tp, views)?, EncodingSource::Views),
        None => (
            PageEncoding::of_descriptor(desc),
            EncodingSource::Descriptor,
        ),
    })
}

/// Derives the page encoding of every layer from `views` (one per layer, in layer order) and
/// checks it against the descriptor: the element size, the page shape for TP `tp`, and the
/// encoding (`kv_layout`, `kv_split`). Returns the encoding (the descriptor's, now confirmed).
///
/// Errors (`IncompatibleLayout`) name the layer, what its view holds and what the descriptor
/// claims: the descriptor is a claim, the tensors are what the bytes really are. Uncertified
/// layouts (`LHBNC`, cross-layer `BL*`) are not checked here: their pages take the opaque
/// per-rank fallback, which never reinterprets bytes.
pub fn check_views(desc: &LayoutDescriptor, tp: u32, views: &[LayerView]) -> Result<PageEncoding> {
    desc.validate()?;
    let claim = PageEncoding::of_descriptor(desc);
    let err = |layer: Option<u32>, msg: String| {
        let mut e = Error::new(ErrorKind::IncompatibleLayout, msg)
            .with("model", desc.model_name.clone())
            .with("tp", tp.to_string());
        if let Some(l) = layer {
            e = e.with("layer", desc.layer_name(l));
        }
        e
    };
    if views.len() != desc.num_layers as usize {
        return Err(err(
            None,
            format!(
                "{} KV-cache views were given but the descriptor has {} layers",
                views.len(),
                desc.num_layers
            ),
        ));
    }
    if !desc.kv_layout.is_certifiable() {
        return Ok(claim);
    }
    let elem = desc.element_size().unwrap_or(1);
    for (layer, view) in (0u32..).zip(views) {
        let name = desc.layer_name(layer);
        if view.element_size != elem {
            return Err(err(
                Some(layer),
                format!(
                    "layer {layer} ({name}): the view holds {}-byte elements but the descriptor's dtype {} has {elem}",
                    view.element_size, desc.dtype
                ),
            ));
        }
        let found = encodings_of_view(desc, tp, view)?;
        if found.contains(&claim) {
            continue;
        }
        let (shape, strides) = expected(desc, tp, claim)?.unwrap_or_default();
        let holds = match found.first() {
            Some(e) => format!("a {} page", e.describe()),
            None => "no page encoding kvtier knows".to_string(),
        };
        return Err(err(
            Some(layer),
            format!(
                "layer {layer} ({name}): the KV-cache view (shape [{}], strides [{}] elements) holds {holds}, but the descriptor says kv_split = {:?}, kv_layout = {:?} (a page of shape [blocks, {}] with strides [_, {}]); fix the descriptor to what the tensors hold",
                join(&view.shape),
                join(&view.stride),
                claim.kv_split.as_str(),
                claim.kv_layout.as_str(),
                join(&shape),
                join(&strides),
            ),
        ));
    }
    Ok(claim)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen_3b() -> LayoutDescriptor {
        LayoutDescriptor::from_toml_str(include_str!("../../layouts/qwen2.5-3b.toml")).unwrap()
    }

    fn packed_nhd(heads: u64) -> LayerView {
        LayerView {
            shape: vec![4, heads, 16, 256],
            stride: vec![heads * 16 * 256, 256, heads * 256, 1],
            element_size: 2,
        }
    }

    #[test]
    fn a_packed_view_confirms_a_packed_descriptor() {
        let d = qwen_3b();
        let views = vec![packed_nhd(2); 36];
        let e = check_views(&d, 1, &views).unwrap();
        assert_eq!(e.describe(), "packed NHD");
        // TP 4: one head per rank, which is NHD and HND alike.
        let found = encodings_of_view(&d, 4, &packed_nhd(1)).unwrap();
        assert_eq!(found.len(), 2);
        check_views(&d, 4, &vec![packed_nhd(1); 36]).unwrap();
    }

    #[test]
    fn a_split_descriptor_is_refused_by_packed_views() {
        let mut d = qwen_3b();
        d.kv_split = Some(KvSplit::Split);
        let e = check_views(&d, 2, &vec![packed_nhd(1); 36]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::IncompatibleLayout);
        let msg = e.to_string();
        assert!(
            msg.contains("layer 0 (model.layers.0.self_attn.attn)"),
            "{msg}"
        );
        assert!(msg.contains("holds a packed NHD page"), "{msg}");
        assert!(msg.contains("kv_split = \"split\""), "{msg}");
    }

    #[test]
    fn allocated_tensors_confirm_packed_descriptors_and_refuse_split_ones() {
        let d = qwen_3b();
        let views = allocator_views(&d, 1, 4).unwrap().unwrap();
        assert_eq!(views[0], packed_nhd(2));
        assert_eq!(
            allocator_views(&d, 4, 4).unwrap().unwrap()[35],
            packed_nhd(1)
        );
        let (e, source) = allocated_encoding(&d, 2).unwrap();
        assert_eq!(
            (e.describe().as_str(), source),
            ("packed NHD", EncodingSource::Allocated)
        );
        let mut split = d.clone();
        split.kv_split = Some(KvSplit::Split);
        let err = allocated_encoding(&split, 2).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::IncompatibleLayout);
        assert!(err.to_string().contains("holds a packed NHD page"), "{err}");
        let mut lhbnc = d;
        lhbnc.kv_layout = KvLayout::Lhbnc;
        assert_eq!(
            allocated_encoding(&lhbnc, 1).unwrap().1,
            EncodingSource::Descriptor
        );
    }

    #[test]
    fn wrong_counts_sizes_and_strides_are_named() {
        let d = qwen_3b();
        let e = check_views(&d, 1, &vec![packed_nhd(2); 3]).unwrap_err();
        assert!(e.to_string().contains("3 KV-cache views"), "{e}");
        let mut bad = vec![packed_nhd(2); 36];
        bad[7].element_size = 1;
        let e = check_views(&d, 1, &bad).unwrap_err();
        assert!(e.to_string().contains("layer 7"), "{e}");
        let mut bad = vec![packed_nhd(2); 36];
        bad[5].stride[1] = 16 * 256; // HND strides: heads outermost
        bad[5].stride[2] = 256;
        let e = check_views(&d, 1, &bad).unwrap_err();
        assert!(e.to_string().contains("holds a packed HND page"), "{e}");
        let mut bad = vec![packed_nhd(2); 36];
        bad[2].shape[3] = 128;
        let e = check_views(&d, 1, &bad).unwrap_err();
        assert!(
            e.to_string().contains("no page encoding kvtier knows"),
            "{e}"
        );
    }
}
