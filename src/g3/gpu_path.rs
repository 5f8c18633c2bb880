//! The GPU data path of a G3 tier (cargo feature `gds`): whole chunks moved between GPU blocks
//! and the tier's slots by a [`kvtier_gds::device::Device`] (cuFile on a GPU, host memory in
//! tests), under the tier's index, journal and CRC rules ([`crate::g3::slot_grants`]).
//!
//! A chunk's row is the canonical row the CPU path builds: the copy runs of this rank's
//! [`RowPlan`] (the same runs `gather` / `scatter` use) are mapped through the GPU block table
//! ([`GpuLayout`]) into 2-D device copies that assemble the row in a device staging row (store)
//! or spread it into the blocks (load, after its CRC checked). So a chunk stored here loads
//! through the CPU path and the reverse, and a load works at any TP size: each rank reads the
//! whole row and copies its share.
//!
//! A store needs this rank to write every byte of the row's canonical area: TP 1, or a layout
//! where this rank is the elected writer of every page. At TP > 1 the ranks' fragments
//! interleave within each row, which only the shared primary row (the CPU path) assembles.

use kvtier_gds::device::{Device, FileId};
use kvtier_gds::exec::{Executor, LoadChunk, SlotLocation, StoreChunk};
use kvtier_gds::plan::{DeviceCopy, GpuLayout, Run, covers_exactly, plan_chunk};
use kvtier_gds::{GdsError, GdsErrorKind};

use crate::canonical::{Direction, RowPlan};
use crate::contract::job::JobResult;
use crate::error::{Error, ErrorKind, Result};
use crate::g3::slot_grants::{GrantedSlot, SlotGrants};
use crate::key::ChunkKey;

/// One chunk in GPU memory: its key, its chunk id (the writer election of replicated pages
/// depends on it) and the GPU block id of each of its blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuChunk {
    /// The chunk's key.
    pub key: ChunkKey,
    /// The chunk id (index of the chunk in its request).
    pub chunk_id: u64,
    /// GPU block ids, one per block of the chunk.
    pub blocks: Vec<u64>,
}

/// A kvtier error for a GDS error: I/O kinds stay I/O (a failed write poisons its path, as on
/// the CPU path), device-side failures are internal.
pub fn gds_error(e: GdsError) -> Error {
    let kind = match e.kind {
        GdsErrorKind::Unavailable => ErrorKind::Unsupported,
        GdsErrorKind::CuFile | GdsErrorKind::Io => ErrorKind::Io,
        GdsErrorKind::ShortIo => ErrorKind::ShortIo,
        GdsErrorKind::Checksum => ErrorKind::Checksum,
        GdsErrorKind::Cuda | GdsErrorKind::Plan => ErrorKind::Internal,
    };
    Error::new(kind, format!("GPUDirect Storage: {}", e.message))
}

/// The plan's runs for chunk `chunk_id` in direction `dir`, offsets absolute.
pub fn chunk_runs(plan: &RowPlan, chunk_id: u64, dir: Direction) -> Vec<Run> {
    let mut runs = Vec::new();
    plan.for_each_run(chunk_id, dir, |local, row, r| {
        runs.push(Run {
            local,
            row,
            size: r.fragment_size,
            count: r.num_fragments,
            local_stride: r.local_stride,
            row_stride: r.canonical_stride,
        })
    });
    runs
}

/// Moves chunks between GPU blocks on `D` and a live G3 tier's slots.
pub struct GpuPath<'d, D: Device> {
    slots: SlotGrants,
    files: Vec<FileId>,
    exec: Executor<'d, D>,
    plan: RowPlan,
    layout: GpuLayout,
}

impl<'d, D: Device> std::fmt::Debug for GpuPath<'d, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuPath")
            .field("rank", &self.plan.rank)
            .field("tp", &self.plan.tp)
            .field("exec", &self.exec)
            .finish_non_exhaustive()
    }
}

impl<'d, D: Device> GpuPath<'d, D> {
    /// A GPU path for this rank's `plan`, its pages at `layout` in `dev`'s memory, into the
    /// tier behind `slots`, with at most `max_bytes_in_flight` of file I/O outstanding.
    /// Registers the slab files with the device.
    pub fn new(
        dev: &'d D,
        slots: SlotGrants,
        plan: RowPlan,
        layout: GpuLayout,
        max_bytes_in_flight: u64,
    ) -> Result<Self> {
        let layers_match = layout.layers().len() == plan.layers.len()
            && layout
                .layers()
                .iter()
                .zip(&plan.layers)
                .all(|(g, p)| g.page_bytes == p.mapping.local_page_size_bytes)
            && layout.blocks_per_chunk() == u64::from(plan.blocks_per_chunk);
        if !layers_match {
            return Err(Error::new(
                ErrorKind::IncompatibleLayout,
                format!(
                    "the GPU block table ({} layers, {} blocks per chunk) does not match the \
                     rank's plan ({} layers, {} blocks per chunk, page sizes per layer)",
                    layout.layers().len(),
                    layout.blocks_per_chunk(),
                    plan.layers.len(),
                    plan.blocks_per_chunk
                ),
            ));
        }
        if plan.canonical_area_bytes > slots.row_stride() {
            return Err(Error::new(
                ErrorKind::IncompatibleLayout,
                format!(
                    "the canonical area ({} bytes) does not fit the tier's {}-byte slots",
                    plan.canonical_area_bytes,
                    slots.row_stride()
                ),
            ));
        }
        let files = slots
            .files()?
            .into_iter()
            .map(|f| dev.register_file(f).map_err(gds_error))
            .collect::<Result<Vec<_>>>()?;
        let exec =
            Executor::new(dev, slots.row_stride(), max_bytes_in_flight).map_err(gds_error)?;
        Ok(GpuPath {
            slots,
            files,
            exec,
            plan,
            layout,
        })
    }

    fn slot(&self, file: usize, offset: u64) -> SlotLocation {
        SlotLocation {
            file: self.files[file],
            offset,
        }
    }

    fn copies(&self, c: &GpuChunk, dir: Direction) -> Result<Vec<DeviceCopy>> {
        let runs = chunk_runs(&self.plan, c.chunk_id, dir);
        let copies = plan_chunk(&runs, &self.layout, &c.blocks).map_err(gds_error)?;
        if dir == Direction::Store && !covers_exactly(&copies, self.plan.canonical_area_bytes) {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "rank {} of TP {} writes only part of chunk {}'s row: a GPUDirect store \
                     needs one rank to hold the whole row (TP 1, or the writer of every page); \
                     store through the primary row (the CPU path) instead",
                    self.plan.rank, self.plan.tp, c.chunk_id
                ),
            ));
        }
        Ok(copies)
    }

    /// Stores `chunks` from GPU memory into slots; the result by the tier's rules (keys
    /// already held are skipped).
    pub fn store(&self, job_id: u64, chunks: &[GpuChunk]) -> JobResult {
        let keys = chunks.iter().map(|c| c.key.clone()).collect();
        let grant = match self.slots.begin_store(job_id, keys) {
            Ok(g) => g,
            Err(e) => return JobResult::failed(job_id, e),
        };
        let mut results: Vec<Result<u32>> = (0..chunks.len())
            .map(|_| Err(Error::new(ErrorKind::Internal, "not moved")))
            .collect();
        let mut todo: Vec<(usize, Vec<DeviceCopy>, SlotLocation)> = Vec::new();
        for (i, (c, g)) in chunks.iter().zip(&grant.slots).enumerate() {
            if let GrantedSlot::Ready { file, offset, .. } = g {
                match self.copies(c, Direction::Store) {
                    Ok(copies) => todo.push((i, copies, self.slot(*file, *offset))),
                    Err(e) => results[i] = Err(e),
                }
            }
        }
        let stores: Vec<StoreChunk<'_>> = todo
            .iter()
            .map(|(_, copies, slot)| StoreChunk {
                copies,
                slot: *slot,
            })
            .collect();
        for ((i, _, _), r) in todo.iter().zip(self.exec.store(&stores)) {
            results[*i] = r.map_err(gds_error);
        }
        self.slots.finish(grant, results)
    }

    /// Loads `chunks` from their slots into GPU memory; a chunk's blocks are written only
    /// after its row passed the CRC check. Failed keys become misses.
    pub fn load(&self, job_id: u64, chunks: &[GpuChunk]) -> JobResult {
        let keys = chunks.iter().map(|c| c.key.clone()).collect();
        let grant = match self.slots.begin_load(job_id, keys) {
            Ok(g) => g,
            Err(e) => return JobResult::failed(job_id, e),
        };
        let mut results: Vec<Result<u32>> = (0..chunks.len())
            .map(|_| Err(Error::new(ErrorKind::Internal, "not moved")))
            .collect();
        let mut todo: Vec<(usize, Vec<DeviceCopy>, SlotLocation, u32)> = Vec::new();
        for (i, (c, g)) in chunks.iter().zip(&grant.slots).enumerate() {
            if let GrantedSlot::Ready { file, offset, crc } = g {
                match self.copies(c, Direction::Load) {
                    Ok(copies) => todo.push((i, copies, self.slot(*file, *offset), *crc)),
                    Err(e) => results[i] = Err(e),
                }
            }
        }
        let loads: Vec<LoadChunk<'_>> = todo
            .iter()
            .map(|(_, copies, slot, crc)| LoadChunk {
                copies,
                slot: *slot,
                crc: *crc,
            })
            .collect();
        for ((i, ..), r) in todo.iter().zip(self.exec.load(&loads)) {
            results[*i] = r.map_err(gds_error);
        }
        self.slots.finish(grant, results)
    }
}
