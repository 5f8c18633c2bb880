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
//!
//! [`RowPlan::new`] compiles the runs once into copy programs (private module
//! `canonical::copy`): strided copies with absolute offsets, merged across halves, pages and
//! layers. Load has one program; store has one per residue of the chunk id modulo the writer
//! rotation period (the lcm of the layers' `num_writers`), so a call only picks a program and
//! runs it.

use serde::Serialize;

use crate::canonical::copy::{CopyProgram, StridedCopy};
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

/// Store programs are precompiled for writer rotation periods up to this; longer periods (never
/// produced by [`crate::canonical::derive_mappings`], where the period divides the TP size up to
/// this) compile the chunk's program on each call.
const MAX_PRECOMPILED_PERIOD: u64 = 64;

/// The plan's runs compiled into copy programs by [`RowPlan::new`].
#[derive(Clone, Default, PartialEq, Eq)]
struct CompiledPlan {
    /// Every run of every page (load).
    load: CopyProgram,
    /// Writer rotation period: the lcm of the layers' `num_writers`.
    period: u64,
    /// Store programs by `chunk_id % period`; empty when `period` exceeds
    /// [`MAX_PRECOMPILED_PERIOD`].
    store: Vec<CopyProgram>,
}

impl std::fmt::Debug for CompiledPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledPlan")
            .field("load_bytes", &self.load.bytes())
            .field("period", &self.period)
            .field("store_programs", &self.store.len())
            .finish()
    }
}

/// Everything one rank needs to gather / scatter chunks of `blocks_per_chunk` blocks.
///
/// The public fields describe the plan; what [`RowPlan::gather`] and [`RowPlan::scatter`] move
/// is compiled from them by [`RowPlan::new`], so build plans with `new` rather than editing the
/// fields of an existing one.
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
    /// The runs above compiled into copy programs.
    #[serde(skip)]
    compiled: CompiledPlan,
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
        let mut plan = RowPlan {
            rank,
            tp,
            blocks_per_chunk,
            layers,
            local_chunk_bytes: local_base,
            canonical_area_bytes: row_base,
            compiled: CompiledPlan::default(),
        };
        plan.compiled = plan.compile()?;
        Ok(plan)
    }

    /// Compiles the load program and the store programs of every writer residue.
    fn compile(&self) -> Result<CompiledPlan> {
        let mut period = 1u64;
        for lp in &self.layers {
            let w = u64::from(lp.mapping.num_writers.max(1));
            period = period.saturating_mul(w / gcd(period, w));
        }
        let load = self.program(None)?;
        let store = if period <= MAX_PRECOMPILED_PERIOD {
            (0..period)
                .map(|r| self.program(Some(r)))
                .collect::<Result<_>>()?
        } else {
            Vec::new()
        };
        Ok(CompiledPlan {
            load,
            period,
            store,
        })
    }

    /// The copy program of chunk `store_chunk` (elected writers' pages only), or of a load
    /// (every page) for `None`.
    fn program(&self, store_chunk: Option<u64>) -> Result<CopyProgram> {
        let mut program = CopyProgram::default();
        let mut ok = true;
        let dir = if store_chunk.is_some() {
            Direction::Store
        } else {
            Direction::Load
        };
        self.for_each_run(store_chunk.unwrap_or(0), dir, |local, row, run| {
            let op = (|| {
                Some(StridedCopy {
                    local: usize::try_from(local).ok()?,
                    row: usize::try_from(row).ok()?,
                    size: usize::try_from(run.fragment_size).ok()?,
                    count: usize::try_from(run.num_fragments).ok()?,
                    local_stride: usize::try_from(run.local_stride).ok()?,
                    row_stride: usize::try_from(run.canonical_stride).ok()?,
                })
            })();
            ok &= op.and_then(|op| program.push(op)).is_some();
        });
        if ok {
            Ok(program)
        } else {
            Err(Error::new(
                ErrorKind::Internal,
                "canonical copy plan does not fit the address space".to_string(),
            )
            .with("rank", self.rank.to_string()))
        }
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

    /// Calls `f(local_start, row_start, run)` for every run of every page to move for chunk
    /// `chunk_id`, in plan order (layer, page, run); the starts are the run's first fragment.
    /// (The GPUDirect Storage path maps these runs onto GPU blocks.)
    pub fn for_each_run(
        &self,
        chunk_id: u64,
        dir: Direction,
        mut f: impl FnMut(u64, u64, &CopyRun),
    ) {
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
                    f(
                        local_page + run.local_offset,
                        row_page + run.canonical_offset,
                        run,
                    );
                }
            }
        }
    }

    /// Calls `f(local_offset, row_offset, len)` for every fragment to move for chunk `chunk_id`.
    fn for_each_copy(&self, chunk_id: u64, dir: Direction, mut f: impl FnMut(u64, u64, u64)) {
        self.for_each_run(chunk_id, dir, |local, row, run| {
            for (l, c) in run.fragments() {
                f(
                    local + l - run.local_offset,
                    row + c - run.canonical_offset,
                    run.fragment_size,
                );
            }
        });
    }

    /// Store: copies the elected-writer fragments of chunk `chunk_id` from `local` into `row`.
    /// Returns the bytes copied. Runs at memcpy speed with 64-byte aligned buffers (primary
    /// rows are page aligned); unaligned ones make head fragments straddle extra cache lines.
    pub fn gather(&self, local: &[u8], row: &mut [u8], chunk_id: u64) -> Result<u64> {
        self.check_lengths(local.len(), row.len())?;
        let c = &self.compiled;
        let moved = match c.store.get((chunk_id % c.period.max(1)) as usize) {
            Some(program) => program.local_to_row(local, row),
            None => self.program(Some(chunk_id))?.local_to_row(local, row),
        };
        moved.ok_or_else(|| self.extent_error())
    }

    /// Load: copies every fragment of the rank's share from `row` into `local`. Returns the
    /// bytes copied (always `local_chunk_bytes` for a verified plan).
    pub fn scatter(&self, row: &[u8], local: &mut [u8]) -> Result<u64> {
        self.check_lengths(local.len(), row.len())?;
        self.compiled
            .load
            .row_to_local(row, local)
            .ok_or_else(|| self.extent_error())
    }

    /// A compiled program reaching past buffers that passed `check_lengths`: the public fields
    /// were changed after [`RowPlan::new`].
    fn extent_error(&self) -> Error {
        Error::new(
            ErrorKind::Internal,
            format!(
                "copy plan reaches past its buffers (local chunk {} bytes, canonical area {} bytes); build plans with RowPlan::new",
                self.local_chunk_bytes, self.canonical_area_bytes
            ),
        )
        .with("rank", self.rank.to_string())
    }

    /// The flat copy list for chunk `chunk_id` (adjacent copies merged).
    pub fn copy_list(&self, chunk_id: u64, dir: Direction) -> Vec<ByteCopy> {
        let mut out: Vec<ByteCopy> = Vec::new();
        self.for_each_copy(chunk_id, dir, |l, c, n| {
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

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Store through a plan (see [`RowPlan::gather`]).
pub fn gather(plan: &RowPlan, local: &[u8], row: &mut [u8], chunk_id: u64) -> Result<u64> {
    plan.gather(local, row, chunk_id)
}

/// Load through a plan (see [`RowPlan::scatter`]).
pub fn scatter(plan: &RowPlan, row: &[u8], local: &mut [u8]) -> Result<u64> {
    plan.scatter(row, local)
}

/// The per-rank (non-canonical) layout: rank `rank`'s worker page sits whole at
/// `rank * local_chunk_bytes` in the row. Returns that byte range.
pub fn rank_page_range(local_chunk_bytes: u64, rank: u32) -> std::ops::Range<u64> {
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

    /// Llama-3.1-8B's runs (packed K|V pages, as vLLM allocates them) continue across pages
    /// and layers: one strided copy per rank of the rank's heads per token (TP 1: one
    /// contiguous copy of the whole chunk), for load and for store.
    #[test]
    fn llama_plans_compile_to_one_copy() {
        let d = crate::canonical::default_layout();
        for tp in [1u32, 2, 4, 8] {
            let plan = RowPlan::new(&derive_mappings(&d, tp, tp - 1).unwrap(), 2).unwrap();
            let ops = plan.compiled.load.ops();
            assert_eq!(ops.len(), 1, "TP {tp}: {ops:?}");
            assert_eq!(plan.compiled.load.bytes(), plan.local_chunk_bytes);
            assert_eq!(ops[0].size * ops[0].count, plan.local_chunk_bytes as usize);
            assert_eq!(
                ops[0].size,
                if tp == 1 { 4 << 20 } else { 4096 / tp as usize }
            );
            assert_eq!(plan.compiled.store, vec![plan.compiled.load.clone()]);
        }
    }

    /// A writer rotation period too long to precompile compiles each chunk's store program
    /// on the call, with the same result as the copy list.
    #[test]
    fn long_writer_periods_compile_per_call() {
        let d = qwen_3b_reduced();
        let mut layers = derive_mappings(&d, 2, 1).unwrap();
        for (lm, writers) in layers.iter_mut().zip([9u32, 8]) {
            let m = lm.mapping.as_mut().unwrap();
            (m.num_writers, m.writer_index) = (writers, 5);
        }
        let plan = RowPlan::new(&layers, 3).unwrap();
        assert_eq!(plan.compiled.period, 72);
        assert!(plan.compiled.store.is_empty());
        let local: Vec<u8> = (0..plan.local_chunk_bytes)
            .map(|i| (i % 249) as u8)
            .collect();
        let n = plan.canonical_area_bytes as usize;
        let mut any_written = false;
        for chunk in 0..30u64 {
            let (mut a, mut b) = (vec![0u8; n], vec![0u8; n]);
            let moved = plan.gather(&local, &mut a, chunk).unwrap();
            any_written |= moved > 0;
            for c in plan.copy_list(chunk, Direction::Store) {
                let (l, r, len) = (
                    c.local_offset as usize,
                    c.row_offset as usize,
                    c.len as usize,
                );
                b[r..r + len].copy_from_slice(&local[l..l + len]);
            }
            assert_eq!(a, b, "chunk {chunk}");
        }
        assert!(any_written);
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
