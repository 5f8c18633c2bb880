//! Start-up validation of a canonical layout request (vLLM's `_validate_canonical_refs`):
//! every layer must have a mapping, and a namespace shared across topologies must only ever
//! receive portable bytes. Fails closed with errors that say how to turn canonical layout off.

use crate::canonical::descriptor::LayoutDescriptor;
use crate::canonical::mapping::LayerMapping;
#[cfg(any(test, feature = "test-support"))]
use crate::canonical::mapping::MappingKind;
use crate::error::{Error, ErrorKind, Result};

/// What validation found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CanonicalStatus {
    /// Every layer's canonical bytes are the same for every parallel configuration.
    pub all_layers_portable: bool,
}

/// Validates one worker's layer mappings for a canonical layout request.
///
/// * Any layer without a mapping → [`ErrorKind::Unsupported`]: the layout could not be
///   certified; the message names the layer and says to set `canonical_layout = false`.
/// * `namespace_shared` (the storage namespace was collapsed across topologies on a static
///   portability claim) but some layer uses the opaque fallback →
///   [`ErrorKind::IncompatibleLayout`].
///
/// On success logs `Canonical KV layout enabled (all_layers_portable=...)`.
pub fn validate_canonical(
    layers: &[LayerMapping],
    namespace_shared: bool,
) -> Result<CanonicalStatus> {
    if let Some(lm) = layers.iter().find(|lm| lm.mapping.is_none()) {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "canonical_layout was requested but the KV cache layout could not be certified for canonical offload: layer {} (rank {} of TP {}) has no mapping: {}. Offload workers must be exactly the TP group, and only NHD/HND attention or MLA pages are supported. Set canonical_layout = false (remove canonical_layout from kv_connector_extra_config) to store in the per-rank direct layout",
                lm.layer_name,
                lm.rank,
                lm.tp,
                lm.reason.as_deref().unwrap_or("not certified")
            ),
        )
        .with("layer", lm.layer_name.clone())
        .with("rank", lm.rank.to_string()));
    }
    let not_portable = layers
        .iter()
        .find(|lm| lm.mapping.as_ref().is_some_and(|m| !m.parallelism_agnostic));
    let all_layers_portable = not_portable.is_none();
    if let (true, Some(lm)) = (namespace_shared, not_portable) {
        return Err(Error::new(
            ErrorKind::IncompatibleLayout,
            format!(
                "canonical_layout could not certify every layer as parallelism-agnostic (layer {} uses the per-rank opaque fallback: {}), but the storage namespace is shared across topologies. Set canonical_layout = false (remove canonical_layout from kv_connector_extra_config) or disable parallel-agnostic secondary tiers",
                lm.layer_name,
                lm.reason.as_deref().unwrap_or("not portable")
            ),
        )
        .with("layer", lm.layer_name.clone())
        .with("rank", lm.rank.to_string()));
    }
    log::info!("Canonical KV layout enabled (all_layers_portable={all_layers_portable})");
    Ok(CanonicalStatus {
        all_layers_portable,
    })
}

/// The static portability claim made before any worker starts (vLLM's
/// `is_parallelism_agnostic` with `canonical_layout`): every layer passes the certified cases
/// and the worker group is exactly the TP group. kvtier collapses its namespace across TP sizes
/// only on this claim, and [`validate_canonical`] then re-checks it against the real mappings.
pub fn static_portability_claim(
    desc: &LayoutDescriptor,
    tp: u32,
    world_size: u32,
    canonical: bool,
) -> bool {
    canonical && world_size == tp && desc.check_tp(tp).is_ok() && desc.kv_layout.is_certifiable()
}

/// Whether a layer set contains any opaque-fallback layer.
#[cfg(any(test, feature = "test-support"))]
pub fn has_fallback(layers: &[LayerMapping]) -> bool {
    layers
        .iter()
        .any(|lm| lm.kind == MappingKind::OpaqueFallback)
}
