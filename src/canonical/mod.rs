//! The canonical KV layout: descriptors, per-rank mappings, tiling checks, digests, gather/scatter.
//!
//! A chunk is stored as the whole unsharded block (all KV heads, all tokens), so bytes stored
//! under one TP size load under another (contract §8). The pieces, in the order they are used:
//!
//! 1. [`LayoutDescriptor`] (`descriptor`): a model's KV geometry, from a TOML file in `layouts/`.
//! 2. [`derive_mappings`] (`mapping`): per layer and rank, the copy runs from the local page
//!    into the canonical page, the writer election and the portability flag.
//! 3. [`verify_tiling`] (`tiling`): runs partition each local page and the elected writers tile
//!    each canonical page exactly once.
//! 4. [`validate_canonical`] (`validate`): the seed's `_validate_canonical_refs` rules.
//! 5. [`RowPlan`] with [`gather`](fn@gather) / [`scatter`] (`gather`): move bytes between a
//!    rank's local chunk and the canonical area of a primary row.
//! 6. [`digest::vllm_digest`] and [`digest::namespace_digest`]: what storage is keyed by.
//!
//! Where kvtier sees the engine's tensors, [`check_views`] (`views`) derives the page
//! encoding from their shapes and strides and refuses a descriptor that claims another;
//! [`prepare_canonical_from_views`] does it before preparing.
//!
//! Where vLLM's workers write the canonical pages themselves (kvtier as vLLM's tier),
//! [`VllmSpecFields::canonical_area`] sizes the area of the row they fill from a descriptor
//! (`shipped` or a file), checked against vLLM's configuration.

mod copy;
test_visible! {
    mod descriptor;
    mod digest;
    mod gather;
    mod mapping;
    mod shipped;
    mod tiling;
    mod validate;
    mod views;
}
mod spec_area;

pub use descriptor::{AttentionKind, KvLayout, KvSplit, LayoutDescriptor};
pub use digest::{
    NamespaceParams, VllmDigestFields, VllmSpecFields, digest_from_hex, engine_pool_namespace,
    namespace_digest, namespace_hex, vllm_digest,
};
pub use gather::{ByteCopy, Direction, RowPlan, gather, rank_page_range, scatter};
pub use mapping::{
    CanonicalPageMapping, CopyRun, LayerMapping, MappingKind, ParallelConfig, canonical_page_ids,
    derive_all_ranks, derive_mappings, derive_mappings_for,
};
pub use shipped::{SHIPPED_LAYOUTS, resolve_layout, shipped_layout};
pub use tiling::verify_tiling;
pub use validate::{CanonicalStatus, static_portability_claim, validate_canonical};
pub use views::{
    EncodingSource, LayerView, PageEncoding, allocated_encoding, allocator_views, check_views,
    resolve_encoding,
};

/// The Llama-3.1-8B descriptor text (`layouts/llama-3.1-8b.toml`), embedded in the binary.
pub const DEFAULT_LAYOUT_TOML: &str = include_str!("../../layouts/llama-3.1-8b.toml");

/// The default layout (Llama-3.1-8B-Instruct, bf16, 16-token blocks, NHD, K|V packed): 2 MiB per
/// block at TP 1. Used by `kvtier bench` when no layout is given.
pub fn default_layout() -> LayoutDescriptor {
    match LayoutDescriptor::from_toml_str(DEFAULT_LAYOUT_TOML) {
        Ok(d) => d,
        // The embedded file is checked by a unit test; failing here is a build defect.
        Err(e) => panic!("embedded default layout is invalid: {e}"),
    }
}

/// Everything one rank needs for the canonical path, checked: all ranks' mappings (tiling
/// verified), this rank's validation result and its [`RowPlan`].
#[derive(Debug, Clone)]
pub struct PreparedCanonical {
    /// `mappings[rank][layer]` for every rank of the TP group.
    pub mappings: Vec<Vec<LayerMapping>>,
    /// Validation result for this rank.
    pub status: CanonicalStatus,
    /// This rank's gather / scatter plan.
    pub plan: RowPlan,
    /// The page encoding the plan assumes.
    pub encoding: PageEncoding,
    /// Where it came from: the descriptor, or the layers' views (checked).
    pub encoding_source: EncodingSource,
}

/// Derives every rank's mappings for `cfg`, verifies tiling, validates this rank's layers (with
/// `namespace_shared` as in [`validate_canonical`]) and builds this rank's plan.
pub fn prepare_canonical(
    desc: &LayoutDescriptor,
    cfg: &ParallelConfig,
    blocks_per_chunk: u32,
    namespace_shared: bool,
) -> crate::Result<PreparedCanonical> {
    let mappings = (0..cfg.tp)
        .map(|rank| derive_mappings_for(desc, &ParallelConfig { rank, ..*cfg }))
        .collect::<crate::Result<Vec<_>>>()?;
    verify_tiling(&mappings)?;
    let mine = mappings.get(cfg.rank as usize).ok_or_else(|| {
        crate::Error::new(
            crate::ErrorKind::Config,
            format!("rank {} is out of range for TP size {}", cfg.rank, cfg.tp),
        )
    })?;
    let status = validate_canonical(mine, namespace_shared)?;
    let plan = RowPlan::new(mine, blocks_per_chunk)?;
    Ok(PreparedCanonical {
        mappings,
        status,
        plan,
        encoding: PageEncoding::of_descriptor(desc),
        encoding_source: EncodingSource::Descriptor,
    })
}

/// [`prepare_canonical`] for a caller that holds the engine's KV-cache tensors: the page
/// encoding is derived from this rank's layer `views` and checked against the descriptor
/// first ([`check_views`]), so a descriptor that misdescribes the tensors is refused instead
/// of scattering bytes to the wrong place.
pub fn prepare_canonical_from_views(
    desc: &LayoutDescriptor,
    cfg: &ParallelConfig,
    blocks_per_chunk: u32,
    namespace_shared: bool,
    views: &[LayerView],
) -> crate::Result<PreparedCanonical> {
    let encoding = check_views(desc, cfg.tp, views)?;
    let mut prepared = prepare_canonical(desc, cfg, blocks_per_chunk, namespace_shared)?;
    prepared.encoding = encoding;
    prepared.encoding_source = EncodingSource::Views;
    Ok(prepared)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_layout_is_llama_8b_with_2_mib_blocks() {
        let d = default_layout();
        assert_eq!(d.model_name, "meta-llama/Llama-3.1-8B-Instruct");
        assert_eq!(d.canonical_bytes_per_block(), 2 * 1024 * 1024);
        assert_eq!(d.worker_kv_bytes_per_block(1).unwrap(), 2 * 1024 * 1024);
        assert_eq!(d.worker_kv_bytes_per_block(4).unwrap(), 512 * 1024);
    }
}
