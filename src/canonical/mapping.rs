//! Per-layer canonical page mappings: how one rank's local page scatters into the canonical
//! page, as copy runs, with the writer election for replicated bytes (contract §8.1, §8.2).
//!
//! This module is the only place that reasons about TP ranks and heads; everything downstream
//! (tiling checks, gather / scatter, a future GPUDirect path) consumes the byte runs.

use serde::Serialize;

use crate::canonical::descriptor::{KvLayout, KvSplit, LayoutDescriptor};
use crate::error::{Error, ErrorKind, Result};

/// A strided copy: fragment `i` covers local bytes `[local_offset + i * local_stride, +fragment_size)`
/// and canonical bytes `[canonical_offset + i * canonical_stride, +fragment_size)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct CopyRun {
    /// Start of fragment 0 in the local page.
    pub local_offset: u64,
    /// Start of fragment 0 in the canonical page.
    pub canonical_offset: u64,
    /// Bytes per fragment.
    pub fragment_size: u64,
    /// Number of fragments.
    pub num_fragments: u64,
    /// Distance between fragments in the local page.
    pub local_stride: u64,
    /// Distance between fragments in the canonical page.
    pub canonical_stride: u64,
}

impl CopyRun {
    /// A run of one contiguous fragment.
    pub fn contiguous(local_offset: u64, canonical_offset: u64, size: u64) -> Self {
        CopyRun {
            local_offset,
            canonical_offset,
            fragment_size: size,
            num_fragments: 1,
            local_stride: size,
            canonical_stride: size,
        }
    }

    /// `(local_start, canonical_start)` of every fragment.
    pub fn fragments(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        (0..self.num_fragments).map(move |i| {
            (
                self.local_offset + i * self.local_stride,
                self.canonical_offset + i * self.canonical_stride,
            )
        })
    }

    /// Total bytes the run copies.
    pub fn bytes(&self) -> u64 {
        self.fragment_size * self.num_fragments
    }

    /// One past the last local byte touched, or `None` on overflow.
    pub fn local_end(&self) -> Option<u64> {
        end(
            self.local_offset,
            self.local_stride,
            self.fragment_size,
            self.num_fragments,
        )
    }

    /// One past the last canonical byte touched, or `None` on overflow.
    pub fn canonical_end(&self) -> Option<u64> {
        end(
            self.canonical_offset,
            self.canonical_stride,
            self.fragment_size,
            self.num_fragments,
        )
    }

    /// The same copy as one fragment when both sides are contiguous.
    fn collapsed(self) -> Self {
        if self.num_fragments > 1
            && self.local_stride == self.fragment_size
            && self.canonical_stride == self.fragment_size
        {
            CopyRun::contiguous(self.local_offset, self.canonical_offset, self.bytes())
        } else {
            self
        }
    }
}

fn end(offset: u64, stride: u64, size: u64, n: u64) -> Option<u64> {
    if n == 0 {
        return Some(offset);
    }
    stride
        .checked_mul(n - 1)?
        .checked_add(offset)?
        .checked_add(size)
}

/// How one rank's page of one layer maps into the canonical page (vLLM's
/// `CanonicalPageMapping`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CanonicalPageMapping {
    /// Bytes of the canonical page (the layer's share of the row per block).
    pub canonical_page_size_bytes: u64,
    /// Bytes of the rank's local page.
    pub local_page_size_bytes: u64,
    /// Copy runs covering the whole local page.
    pub runs: Vec<CopyRun>,
    /// Ranks holding identical bytes (the writer rotation period).
    pub num_writers: u32,
    /// This rank's index among them.
    pub writer_index: u32,
    /// Whether the canonical bytes are the same for every parallel configuration.
    pub parallelism_agnostic: bool,
}

impl CanonicalPageMapping {
    /// Whether this rank writes canonical page `page_id` on store (rotating election).
    pub fn is_writer(&self, page_id: u64) -> bool {
        self.num_writers <= 1
            || page_id % u64::from(self.num_writers) == u64::from(self.writer_index)
    }
}

/// How a layer's mapping was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MappingKind {
    /// Certified head / latent mapping (portable across TP sizes).
    Certified,
    /// Each rank's page whole at `rank * page`: exact topology only.
    OpaqueFallback,
    /// No mapping: canonical layout cannot be used.
    Unmapped,
}

/// The mapping of one layer on one rank, with the reason when it is not certified.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LayerMapping {
    /// Layer index.
    pub layer: u32,
    /// Layer name (from the descriptor's pattern).
    pub layer_name: String,
    /// The rank this mapping is for.
    pub rank: u32,
    /// TP size.
    pub tp: u32,
    /// Certified, fallback or none.
    pub kind: MappingKind,
    /// The byte mapping; `None` for [`MappingKind::Unmapped`].
    pub mapping: Option<CanonicalPageMapping>,
    /// Why the layer is not certified, when it is not.
    pub reason: Option<String>,
}

/// The parallel configuration a mapping is derived for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ParallelConfig {
    /// Tensor-parallel size.
    pub tp: u32,
    /// This worker's TP rank.
    pub rank: u32,
    /// Offload workers (must equal `tp * pcp` for any mapping).
    pub world_size: u32,
    /// Decode context parallel size (only 1 supported).
    pub dcp: u32,
    /// Prefill context parallel size (only 1 supported).
    pub pcp: u32,
}

impl ParallelConfig {
    /// Plain TP: `world_size == tp`, no context parallelism.
    pub fn tp(tp: u32, rank: u32) -> Self {
        ParallelConfig {
            tp,
            rank,
            world_size: tp,
            dcp: 1,
            pcp: 1,
        }
    }
}

/// Mappings of every layer for `rank` of a plain TP group of size `tp`.
pub fn derive_mappings(desc: &LayoutDescriptor, tp: u32, rank: u32) -> Result<Vec<LayerMapping>> {
    derive_mappings_for(desc, &ParallelConfig::tp(tp, rank))
}

/// Mappings of every layer for every rank: `result[rank][layer]`.
pub fn derive_all_ranks(desc: &LayoutDescriptor, tp: u32) -> Result<Vec<Vec<LayerMapping>>> {
    (0..tp).map(|r| derive_mappings(desc, tp, r)).collect()
}

/// Mappings of every layer for one worker of `cfg`.
///
/// Errors: invalid descriptor, a TP size the model does not allow, a rank out of range, or
/// DCP / PCP > 1 (not supported yet). A worker group that is not exactly the TP group gets
/// [`MappingKind::Unmapped`] layers (canonical layout must then be refused by validation).
pub fn derive_mappings_for(
    desc: &LayoutDescriptor,
    cfg: &ParallelConfig,
) -> Result<Vec<LayerMapping>> {
    desc.validate()?;
    desc.check_tp(cfg.tp)?;
    if cfg.rank >= cfg.tp {
        return Err(Error::new(
            ErrorKind::Config,
            format!("rank {} is out of range for TP size {}", cfg.rank, cfg.tp),
        )
        .with("expected", format!("0..{}", cfg.tp))
        .with("found", cfg.rank.to_string()));
    }
    if cfg.dcp != 1 || cfg.pcp != 1 {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "canonical mappings with decode/prefill context parallelism (dcp {}, pcp {}) are not supported yet; run with dcp = pcp = 1 or set canonical_layout = false",
                cfg.dcp, cfg.pcp
            ),
        ));
    }
    let unmapped_reason = (cfg.world_size != cfg.tp * cfg.pcp).then(|| {
        format!(
            "offload workers must be exactly the TP group (world_size {} != tp {} x pcp {})",
            cfg.world_size, cfg.tp, cfg.pcp
        )
    });
    let mut out = Vec::with_capacity(desc.num_layers as usize);
    for layer in 0..desc.num_layers {
        let (kind, mapping, reason) = if let Some(reason) = &unmapped_reason {
            (MappingKind::Unmapped, None, Some(reason.clone()))
        } else if !desc.kv_layout.is_certifiable() {
            let reason = format!(
                "KV layout {} is not certified for the canonical layout (only NHD and HND are)",
                desc.kv_layout.as_str()
            );
            (
                MappingKind::OpaqueFallback,
                Some(opaque_mapping(desc, cfg.tp, cfg.rank)?),
                Some(reason),
            )
        } else {
            (
                MappingKind::Certified,
                Some(certified_mapping(desc, cfg.tp, cfg.rank)?),
                None,
            )
        };
        out.push(LayerMapping {
            layer,
            layer_name: desc.layer_name(layer),
            rank: cfg.rank,
            tp: cfg.tp,
            kind,
            mapping,
            reason,
        });
    }
    Ok(out)
}

/// The opaque fallback: the rank's page whole at `rank * page`, one writer, not portable.
fn opaque_mapping(desc: &LayoutDescriptor, tp: u32, rank: u32) -> Result<CanonicalPageMapping> {
    let page = desc.local_page_size(tp)?;
    Ok(CanonicalPageMapping {
        canonical_page_size_bytes: page * u64::from(tp),
        local_page_size_bytes: page,
        runs: vec![CopyRun::contiguous(0, u64::from(rank) * page, page)],
        num_writers: 1,
        writer_index: 0,
        parallelism_agnostic: false,
    })
}

/// Certified mapping for NHD / HND attention pages (split or packed) and MLA latents.
fn certified_mapping(desc: &LayoutDescriptor, tp: u32, rank: u32) -> Result<CanonicalPageMapping> {
    let elem = desc.element_size().unwrap_or(1);
    let tokens = u64::from(desc.tokens_per_block);
    let canonical = desc.canonical_page_size();
    let local = desc.local_page_size(tp)?;
    if desc.is_mla() {
        // Every rank holds the whole latent: stored once, writers rotating over all ranks.
        return Ok(CanonicalPageMapping {
            canonical_page_size_bytes: canonical,
            local_page_size_bytes: local,
            runs: vec![CopyRun::contiguous(0, 0, local)],
            num_writers: tp,
            writer_index: rank,
            parallelism_agnostic: true,
        });
    }
    let total = desc.total_kv_heads();
    let (shard, replication) = if total.is_multiple_of(tp) {
        (rank, 1)
    } else {
        // GQA with tp > kv heads: `tp / total` consecutive ranks hold the same head.
        let replicas = tp / total;
        (rank / replicas, replicas)
    };
    let local_heads = u64::from(desc.local_kv_heads(tp)?);
    let all_heads = u64::from(total);
    let head_dim = u64::from(desc.head_dim.unwrap_or(0));
    let first_head = u64::from(shard) * local_heads;
    let run = match (desc.split(), desc.kv_layout) {
        (KvSplit::Split, KvLayout::Nhd) => {
            // (2, tokens, heads, head_dim): per half and token, the rank's heads are adjacent.
            let frag = local_heads * head_dim * elem;
            let row = all_heads * head_dim * elem;
            let halves = tokens_runs(tokens, frag, row, first_head * head_dim * elem);
            let local_half = tokens * frag;
            let canonical_half = tokens * row;
            vec![
                halves,
                CopyRun {
                    local_offset: local_half,
                    canonical_offset: canonical_half + halves.canonical_offset,
                    ..halves
                },
            ]
        }
        (KvSplit::Split, _) => {
            // (2, heads, tokens, head_dim): per half, the rank's heads are one block.
            let frag = local_heads * tokens * head_dim * elem;
            vec![CopyRun {
                local_offset: 0,
                canonical_offset: first_head * tokens * head_dim * elem,
                fragment_size: frag,
                num_fragments: 2,
                local_stride: frag,
                canonical_stride: all_heads * tokens * head_dim * elem,
            }]
        }
        (KvSplit::Packed, KvLayout::Nhd) => {
            // (tokens, heads, 2 * head_dim).
            let frag = local_heads * 2 * head_dim * elem;
            let row = all_heads * 2 * head_dim * elem;
            vec![tokens_runs(
                tokens,
                frag,
                row,
                first_head * 2 * head_dim * elem,
            )]
        }
        (KvSplit::Packed, _) => {
            // (heads, tokens, 2 * head_dim).
            let frag = local_heads * tokens * 2 * head_dim * elem;
            vec![CopyRun::contiguous(
                0,
                first_head * tokens * 2 * head_dim * elem,
                frag,
            )]
        }
        (KvSplit::Latent, _) => {
            return Err(Error::new(
                ErrorKind::Internal,
                format!(
                    "{}: latent page encoding on a non-MLA model",
                    desc.model_name
                ),
            ));
        }
    };
    Ok(CanonicalPageMapping {
        canonical_page_size_bytes: canonical,
        local_page_size_bytes: local,
        runs: merge_runs(run),
        num_writers: replication,
        writer_index: rank % replication,
        parallelism_agnostic: true,
    })
}

/// One fragment per token: `frag` local bytes per token, `row` canonical bytes per token.
fn tokens_runs(tokens: u64, frag: u64, row: u64, canonical_offset: u64) -> CopyRun {
    CopyRun {
        local_offset: 0,
        canonical_offset,
        fragment_size: frag,
        num_fragments: tokens,
        local_stride: frag,
        canonical_stride: row,
    }
}

/// Collapses contiguous runs and joins neighbours that continue each other on both sides, so
/// TP 1 becomes one copy of the whole page.
fn merge_runs(runs: Vec<CopyRun>) -> Vec<CopyRun> {
    let mut out: Vec<CopyRun> = Vec::with_capacity(runs.len());
    for run in runs.into_iter().map(CopyRun::collapsed) {
        if let Some(last) = out.last_mut()
            && last.num_fragments == 1
            && run.num_fragments == 1
            && last.local_offset + last.fragment_size == run.local_offset
            && last.canonical_offset + last.fragment_size == run.canonical_offset
        {
            *last = CopyRun::contiguous(
                last.local_offset,
                last.canonical_offset,
                last.fragment_size + run.fragment_size,
            );
            continue;
        }
        out.push(run);
    }
    out
}

/// vLLM's `_canonical_page_ids`: canonical page ids of `count` sub-blocks, starting
/// `skip_count` sub-blocks into the first chunk. Page id of sub-block `j` of chunk `c` is
/// `c * blocks_per_chunk + j`.
pub fn canonical_page_ids(
    chunk_ids: &[u64],
    blocks_per_chunk: u32,
    count: usize,
    skip_count: usize,
) -> Vec<u64> {
    let bpc = u64::from(blocks_per_chunk);
    chunk_ids
        .iter()
        .flat_map(|&c| (0..bpc).map(move |j| c * bpc + j))
        .skip(skip_count)
        .take(count)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_ids_match_contract_example() {
        let ids = canonical_page_ids(&[3, 7, 9], 4, 10, 2);
        assert_eq!(ids, vec![14, 15, 28, 29, 30, 31, 36, 37, 38, 39]);
    }

    #[test]
    fn merge_joins_contiguous_runs() {
        let runs = vec![CopyRun::contiguous(0, 0, 8), CopyRun::contiguous(8, 8, 8)];
        assert_eq!(merge_runs(runs), vec![CopyRun::contiguous(0, 0, 16)]);
        let strided = CopyRun {
            local_offset: 0,
            canonical_offset: 0,
            fragment_size: 4,
            num_fragments: 3,
            local_stride: 4,
            canonical_stride: 8,
        };
        assert_eq!(merge_runs(vec![strided]), vec![strided]);
    }
}
