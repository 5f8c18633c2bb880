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

use crate::canonical::mapping::{CanonicalPageMapping, CopyRun, LayerMapping, MappingKind};
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
        let bpc = u64::from(self.blocks_per_chunk);
        let mut copied = 0u64;
        for lp in &self.layers {
            let m = &lp.mapping;
            let (lsize, csize) = (
                m.local_page_size_bytes as usize,
                m.canonical_page_size_bytes as usize,
            );
            for j in 0..bpc {
                if !m.is_writer(chunk_id * bpc + j) {
                    continue;
                }
                let l0 = (lp.local_base + j * m.local_page_size_bytes) as usize;
                let c0 = (lp.row_base + j * m.canonical_page_size_bytes) as usize;
                let (src, dst) = (&local[l0..l0 + lsize], &mut row[c0..c0 + csize]);
                for run in &m.runs {
                    copied += copy_run(
                        &mut dst[run.canonical_offset as usize..],
                        run.canonical_stride as usize,
                        &src[run.local_offset as usize..],
                        run.local_stride as usize,
                        run,
                    )
                    .map_err(|e| self.run_error(lp, e))?;
                }
            }
        }
        Ok(copied)
    }

    /// Load: copies every fragment of the rank's share from `row` into `local`. Returns the
    /// bytes copied (always `local_chunk_bytes` for a verified plan).
    pub fn scatter(&self, row: &[u8], local: &mut [u8]) -> Result<u64> {
        self.check_lengths(local.len(), row.len())?;
        let mut copied = 0u64;
        for lp in &self.layers {
            let m = &lp.mapping;
            let (lsize, csize) = (
                m.local_page_size_bytes as usize,
                m.canonical_page_size_bytes as usize,
            );
            for j in 0..u64::from(self.blocks_per_chunk) {
                let l0 = (lp.local_base + j * m.local_page_size_bytes) as usize;
                let c0 = (lp.row_base + j * m.canonical_page_size_bytes) as usize;
                let (src, dst) = (&row[c0..c0 + csize], &mut local[l0..l0 + lsize]);
                for run in &m.runs {
                    copied += copy_run(
                        &mut dst[run.local_offset as usize..],
                        run.local_stride as usize,
                        &src[run.canonical_offset as usize..],
                        run.canonical_stride as usize,
                        run,
                    )
                    .map_err(|e| self.run_error(lp, e))?;
                }
            }
        }
        Ok(copied)
    }

    fn run_error(&self, lp: &LayerPlan, run: CopyRun) -> Error {
        Error::new(
            ErrorKind::Internal,
            format!(
                "layer {}: copy run {run:?} reaches outside its page",
                lp.layer_name
            ),
        )
        .with("rank", self.rank.to_string())
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

/// Copies the `num_fragments` fragments of `run` from `src` (fragment `i` at `i * src_stride`)
/// to `dst` (at `i * dst_stride`); both slices start at the run's first fragment. Returns the
/// bytes copied, or the run if it reaches past either slice (a plan built by [`RowPlan::new`]
/// never does). Head fragments are small (256 B for one bf16 head of 128 at TP 8), where a call
/// into `memcpy` costs as much as the copy, so the common sizes are copied as fixed-size arrays
/// (inlined vector moves) with the size dispatch hoisted out of the fragment loop.
fn copy_run(
    dst: &mut [u8],
    dst_stride: usize,
    src: &[u8],
    src_stride: usize,
    run: &CopyRun,
) -> Result<u64, CopyRun> {
    let (size, n) = (run.fragment_size as usize, run.num_fragments as usize);
    let ok = if n == 1 {
        match (dst.get_mut(..size), src.get(..size)) {
            (Some(d), Some(s)) => {
                d.copy_from_slice(s);
                true
            }
            _ => false,
        }
    } else if dst_stride == 0 || src_stride == 0 {
        false
    } else {
        match size {
            128 => strided::<128>(dst, dst_stride, src, src_stride, n),
            256 => strided::<256>(dst, dst_stride, src, src_stride, n),
            512 => strided::<512>(dst, dst_stride, src, src_stride, n),
            1024 => strided::<1024>(dst, dst_stride, src, src_stride, n),
            _ => strided_any(dst, dst_stride, src, src_stride, n, size),
        }
    };
    if ok { Ok(run.bytes()) } else { Err(*run) }
}

fn strided<const N: usize>(dst: &mut [u8], ds: usize, src: &[u8], ss: usize, n: usize) -> bool {
    let mut done = 0;
    for (d, s) in dst.chunks_mut(ds).zip(src.chunks(ss)).take(n) {
        let d = d
            .get_mut(..N)
            .and_then(|d| <&mut [u8; N]>::try_from(d).ok());
        let s = s.get(..N).and_then(|s| <&[u8; N]>::try_from(s).ok());
        let (Some(d), Some(s)) = (d, s) else {
            return false;
        };
        *d = *s;
        done += 1;
    }
    done == n
}

fn strided_any(dst: &mut [u8], ds: usize, src: &[u8], ss: usize, n: usize, size: usize) -> bool {
    let mut done = 0;
    for (d, s) in dst.chunks_mut(ds).zip(src.chunks(ss)).take(n) {
        let (Some(d), Some(s)) = (d.get_mut(..size), s.get(..size)) else {
            return false;
        };
        d.copy_from_slice(s);
        done += 1;
    }
    done == n
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canonical::{LayoutDescriptor, derive_mappings};

    fn qwen_3b_reduced() -> LayoutDescriptor {
        let text = include_str!("../../layouts/qwen2.5-3b.toml")
            .replace("num_layers = 36", "num_layers = 2")
            .replace("tokens_per_block = 16", "tokens_per_block = 4");
        LayoutDescriptor::from_toml_str(&text).unwrap()
    }

    /// The flat copy list moves exactly the bytes gather and scatter move.
    #[test]
    fn copy_list_matches_gather_and_scatter() {
        let d = qwen_3b_reduced();
        for tp in [1, 2, 4, 8] {
            for rank in 0..tp {
                let plan = RowPlan::new(&derive_mappings(&d, tp, rank).unwrap(), 3).unwrap();
                let local: Vec<u8> = (0..plan.local_chunk_bytes)
                    .map(|i| (i % 253) as u8)
                    .collect();
                let n = plan.canonical_area_bytes as usize;
                for chunk in [0u64, 1, 2, 5] {
                    let (mut a, mut b) = (vec![0u8; n], vec![0u8; n]);
                    let moved = plan.gather(&local, &mut a, chunk).unwrap();
                    let list = plan.copy_list(chunk, Direction::Store);
                    assert_eq!(list.iter().map(|c| c.len).sum::<u64>(), moved);
                    for c in &list {
                        let (l, r, len) = (
                            c.local_offset as usize,
                            c.row_offset as usize,
                            c.len as usize,
                        );
                        b[r..r + len].copy_from_slice(&local[l..l + len]);
                    }
                    assert_eq!(a, b, "TP {tp} rank {rank} chunk {chunk}");
                }
                let row: Vec<u8> = (0..n).map(|i| (i % 241) as u8).collect();
                let (mut x, mut y) = (vec![0u8; local.len()], vec![0u8; local.len()]);
                assert_eq!(plan.scatter(&row, &mut x).unwrap(), plan.local_chunk_bytes);
                for c in plan.copy_list(0, Direction::Load) {
                    let (l, r, len) = (
                        c.local_offset as usize,
                        c.row_offset as usize,
                        c.len as usize,
                    );
                    y[l..l + len].copy_from_slice(&row[r..r + len]);
                }
                assert_eq!(x, y, "TP {tp} rank {rank}");
            }
        }
    }

    #[test]
    fn wrong_buffer_sizes_are_errors() {
        let d = qwen_3b_reduced();
        let plan = RowPlan::new(&derive_mappings(&d, 2, 1).unwrap(), 1).unwrap();
        let local = vec![0u8; plan.local_chunk_bytes as usize];
        let mut short_row = vec![0u8; plan.canonical_area_bytes as usize - 1];
        let e = plan.gather(&local, &mut short_row, 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Contract);
        let mut row = vec![0u8; plan.canonical_area_bytes as usize];
        let e = plan.gather(&local[1..], &mut row, 0).unwrap_err();
        assert!(e.to_string().contains("local chunk buffer"), "{e}");
    }

    #[test]
    fn unmapped_layers_cannot_be_planned() {
        let d = qwen_3b_reduced();
        let cfg = crate::canonical::ParallelConfig {
            tp: 2,
            rank: 0,
            world_size: 3,
            dcp: 1,
            pcp: 1,
        };
        let layers = crate::canonical::derive_mappings_for(&d, &cfg).unwrap();
        let e = RowPlan::new(&layers, 1).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert!(e.to_string().contains("canonical_layout = false"), "{e}");
    }
}
