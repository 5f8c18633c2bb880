//! Gather (store) and scatter (load) between a rank's local chunk and the canonical area of a
//! primary row, driven by the run lists as data.
//!
//! Buffers:
//! * **local chunk**: one rank's bytes for one chunk in vLLM's direct worker-page encoding:
//!   layer after layer, each `local_page * blocks_per_chunk` bytes (its pages, contiguous).
//! * **row**: the primary row. The canonical area starts at byte 0: layer after layer, each
//!   `canonical_page * blocks_per_chunk` bytes; sub-block `j` of a layer at `j * canonical_page`
//!   inside it. The rest of the row is unused padding.
//!
//! Store copies only the runs of canonical pages this rank is the elected writer of; load
//! copies every run. [`RowPlan::copy_list`] flattens the same plan into `(local, row, len)`
//! triples for engines that move bytes themselves (GPUDirect Storage, DMA).

use serde::Serialize;

use crate::canonical::mapping::{CanonicalPageMapping, LayerMapping, MappingKind};
use crate::error::{Error, ErrorKind, Result};

/// Direction of a transfer between the local chunk and the row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// Local → row, elected writers only.
    Store,
    /// Row → local, every run.
    Load,
}

/// One contiguous copy between the local chunk and the row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ByteCopy {
    /// Offset in the local chunk buffer.
    pub local_offset: u64,
    /// Offset in the row.
    pub row_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// One layer's mapping with its positions in the local chunk and in the row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LayerPlan {
    /// Layer name.
    pub layer_name: String,
    /// The rank's mapping of this layer.
    pub mapping: CanonicalPageMapping,
    /// Start of this layer's pages in the local chunk.
    pub local_base: u64,
    /// Start of this layer's canonical pages in the row.
    pub row_base: u64,
}

/// Everything one rank needs to gather / scatter chunks of `blocks_per_chunk` blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RowPlan {
    /// The rank.
    pub rank: u32,
    /// TP size.
    pub tp: u32,
    /// GPU blocks per chunk.
    pub blocks_per_chunk: u32,
    /// Per-layer plans in layer order.
    pub layers: Vec<LayerPlan>,
    /// Bytes of the local chunk buffer.
    pub local_chunk_bytes: u64,
    /// Bytes of the canonical area at the start of the row.
    pub canonical_area_bytes: u64,
}

impl RowPlan {
    /// Builds the plan for one rank from its layer mappings. Fails if a layer has no mapping or
    /// a run reaches outside its pages (run [`crate::canonical::verify_tiling`] first for the full
    /// partition check).
    pub fn new(mappings: &[LayerMapping], blocks_per_chunk: u32) -> Result<Self> {
        if blocks_per_chunk == 0 {
            return Err(Error::config("blocks_per_chunk", "must be > 0, found 0"));
        }
        let bpc = u64::from(blocks_per_chunk);
        let mut layers = Vec::with_capacity(mappings.len());
        let (mut local_base, mut row_base) = (0u64, 0u64);
        for lm in mappings {
            let Some(m) = lm.mapping.clone() else {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!(
                        "layer {} has no canonical mapping ({}); set canonical_layout = false",
                        lm.layer_name,
                        lm.reason.as_deref().unwrap_or("not certified")
                    ),
                ));
            };
            debug_assert!(lm.kind != MappingKind::Unmapped);
            for run in &m.runs {
                let inside = run
                    .local_end()
                    .is_some_and(|e| e <= m.local_page_size_bytes)
                    && run
                        .canonical_end()
                        .is_some_and(|e| e <= m.canonical_page_size_bytes);
                if !inside {
                    return Err(Error::new(
                        ErrorKind::Internal,
                        format!(
                            "layer {}: copy run {run:?} reaches outside its pages",
                            lm.layer_name
                        ),
                    )
                    .with("rank", lm.rank.to_string()));
                }
            }
            let (local_len, row_len) = (
                m.local_page_size_bytes * bpc,
                m.canonical_page_size_bytes * bpc,
            );
            layers.push(LayerPlan {
                layer_name: lm.layer_name.clone(),
                mapping: m,
                local_base,
                row_base,
            });
            local_base += local_len;
            row_base += row_len;
        }
        let (rank, tp) = mappings.first().map_or((0, 1), |lm| (lm.rank, lm.tp));
        Ok(RowPlan {
            rank,
            tp,
            blocks_per_chunk,
            layers,
            local_chunk_bytes: local_base,
            canonical_area_bytes: row_base,
        })
    }

    fn check_lengths(&self, local: usize, row: usize) -> Result<()> {
        if local as u64 != self.local_chunk_bytes {
            return Err(Error::new(
                ErrorKind::Contract,
                format!(
                    "local chunk buffer has {local} bytes, the plan needs exactly {}",
                    self.local_chunk_bytes
                ),
            ));
        }
        if (row as u64) < self.canonical_area_bytes {
            return Err(Error::new(
                ErrorKind::Contract,
                format!(
                    "row has {row} bytes, the canonical area needs {}",
                    self.canonical_area_bytes
                ),
            ));
        }
        Ok(())
    }

    /// Calls `f(local_offset, row_offset, len)` for every fragment to move for chunk `chunk_id`.
    fn for_each_copy(&self, chunk_id: u64, dir: Direction, mut f: impl FnMut(usize, usize, usize)) {
        let bpc = u64::from(self.blocks_per_chunk);
        for lp in &self.layers {
            let m = &lp.mapping;
            for j in 0..bpc {
                if dir == Direction::Store && !m.is_writer(chunk_id * bpc + j) {
                    continue;
                }
                let local_page = lp.local_base + j * m.local_page_size_bytes;
                let row_page = lp.row_base + j * m.canonical_page_size_bytes;
                for run in &m.runs {
                    let size = run.fragment_size as usize;
                    let mut l = (local_page + run.local_offset) as usize;
                    let mut c = (row_page + run.canonical_offset) as usize;
                    for _ in 0..run.num_fragments {
                        f(l, c, size);
                        l += run.local_stride as usize;
                        c += run.canonical_stride as usize;
                    }
                }
            }
        }
    }

    /// Store: copies the elected-writer fragments of chunk `chunk_id` from `local` into `row`.
    /// Returns the bytes copied.
    pub fn gather(&self, local: &[u8], row: &mut [u8], chunk_id: u64) -> Result<u64> {
        self.check_lengths(local.len(), row.len())?;
        let mut copied = 0u64;
        self.for_each_copy(chunk_id, Direction::Store, |l, c, n| {
            row[c..c + n].copy_from_slice(&local[l..l + n]);
            copied += n as u64;
        });
        Ok(copied)
    }

    /// Load: copies every fragment of the rank's share from `row` into `local`. Returns the
    /// bytes copied (always `local_chunk_bytes` for a verified plan).
    pub fn scatter(&self, row: &[u8], local: &mut [u8]) -> Result<u64> {
        self.check_lengths(local.len(), row.len())?;
        let mut copied = 0u64;
        self.for_each_copy(0, Direction::Load, |l, c, n| {
            local[l..l + n].copy_from_slice(&row[c..c + n]);
            copied += n as u64;
        });
        Ok(copied)
    }

    /// The flat copy list for chunk `chunk_id` (adjacent copies merged).
    pub fn copy_list(&self, chunk_id: u64, dir: Direction) -> Vec<ByteCopy> {
        let mut out: Vec<ByteCopy> = Vec::new();
        self.for_each_copy(chunk_id, dir, |l, c, n| {
            let (l, c, n) = (l as u64, c as u64, n as u64);
            if let Some(last) = out.last_mut()
                && last.local_offset + last.len == l
                && last.row_offset + last.len == c
            {
                last.len += n;
                return;
            }
            out.push(ByteCopy {
                local_offset: l,
                row_offset: c,
                len: n,
            });
        });
        out
    }
}

/// Store through a plan (see [`RowPlan::gather`]).
pub fn gather(plan: &RowPlan, local: &[u8], row: &mut [u8], chunk_id: u64) -> Result<u64> {
    plan.gather(local, row, chunk_id)
}

/// Load through a plan (see [`RowPlan::scatter`]).
pub fn scatter(plan: &RowPlan, row: &[u8], local: &mut [u8]) -> Result<u64> {
    plan.scatter(row, local)
}

/// The direct (non-canonical) layout: rank `rank`'s worker page sits whole at
/// `rank * local_chunk_bytes` in the row. Returns that byte range.
pub fn direct_row_range(local_chunk_bytes: u64, rank: u32) -> std::ops::Range<u64> {
    let start = u64::from(rank) * local_chunk_bytes;
    start..start + local_chunk_bytes
}
