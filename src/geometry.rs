//! Chunk geometry: the one place that turns sizes into rows. From one worker's KV bytes per
//! GPU block, the number of copies, the blocks per chunk and the primary pool size it derives
//! the row stride and the number of rows; it also converts a byte budget into rows and a slab
//! capacity into slots. Everything else asks it.
//!
//! vLLM 0.33.0 `CPUOffloadingSpec.__init__` (contract §4.1):
//! ```text
//! raw_bytes_per_chunk  = worker_kv_bytes_per_block * copies * blocks_per_chunk
//! row_stride           = round_up(raw_bytes_per_chunk, 4096)
//! page_size_per_worker = raw_bytes_per_chunk / copies
//! num_chunks           = cpu_bytes_to_use / row_stride
//! ```
//! `copies` is 1 for a replicated layout (one copy shared by all workers), else the local
//! world size (each worker owns one page of every row).
//!
//! A row stride is a `u64` byte count everywhere in kvtier (this geometry, the primary
//! region's constructors and [`crate::region::PrimaryRegion::row_stride`], G3 slots, configs,
//! the node protocol); code that indexes memory converts it where it does.
//!
//! | Conversion | Function |
//! | --- | --- |
//! | bytes of one chunk | [`ChunkGeometry::raw_bytes_per_chunk`] |
//! | row stride (= G3 slot size) | [`ChunkGeometry::row_stride_for`], checked by [`ChunkGeometry::check_row_stride`] |
//! | rows in a byte budget (pool, bench bytes) | [`ChunkGeometry::rows_in`] |
//! | rows in flight for `max_bytes_in_flight` | [`ChunkGeometry::rows_in_flight`] |
//! | slots per slab file, slots of a slab set | [`ChunkGeometry::slots_per_file`], [`ChunkGeometry::total_slots`] |
//!
//! ```
//! use kvtier::geometry::{ChunkGeometry, ROW_ALIGNMENT};
//!
//! // 512 B per worker-block x 2 workers x 3 blocks per chunk = 3072 B, padded to one page.
//! let g = ChunkGeometry::derive(512, 2, 3, 1 << 20).unwrap();
//! assert_eq!(g.row_stride, ROW_ALIGNMENT as u64);
//! assert_eq!(g.num_chunks, 256);
//! assert_eq!(ChunkGeometry::rows_in_flight(10_000, g.row_stride), 2);
//! ```

use serde::Serialize;

use crate::error::{Error, ErrorKind, Result};
use crate::size::format_size_human;

/// Row alignment: the page size, and the alignment O_DIRECT needs. Every row of the primary
/// region is aligned to it in address and length, every G3 slot (one row) in file offset and
/// length, and every O_DIRECT transfer and buffer with it. The one definition in kvtier.
pub const ROW_ALIGNMENT: usize = 4096;

/// [`ROW_ALIGNMENT`] for byte counts.
const ROW_ALIGNMENT_BYTES: u64 = ROW_ALIGNMENT as u64;

/// The derived layout of the primary region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ChunkGeometry {
    /// One worker's KV bytes per GPU block (input).
    pub worker_kv_bytes_per_block: u64,
    /// Copies of each block in a row: 1 replicated, else the local world size (input).
    pub copies: u32,
    /// GPU blocks per chunk (input).
    pub blocks_per_chunk: u32,
    /// KV bytes in one chunk, all copies: `worker_kv_bytes_per_block * copies * blocks_per_chunk`.
    pub raw_bytes_per_chunk: u64,
    /// Bytes between rows: `raw_bytes_per_chunk` rounded up to [`ROW_ALIGNMENT`]. Every
    /// transfer moves whole rows of this size.
    pub row_stride: u64,
    /// Unused tail of each row: `row_stride - raw_bytes_per_chunk`.
    pub padding: u64,
    /// Bytes of a row owned by one worker in the direct layout: `raw_bytes_per_chunk / copies`.
    pub page_size_per_worker: u64,
    /// Rows in the region: `cpu_bytes_to_use / row_stride`.
    pub num_chunks: u64,
    /// Bytes of the region actually used: `num_chunks * row_stride` (<= `cpu_bytes_to_use`).
    pub region_bytes: u64,
}

fn geometry_error(message: String) -> Error {
    Error::new(ErrorKind::Config, message)
}

impl ChunkGeometry {
    /// Derives the geometry. Errors (all [`ErrorKind::Config`]): a zero input, arithmetic
    /// overflow, or a pool too small for one row.
    pub fn derive(
        worker_kv_bytes_per_block: u64,
        copies: u32,
        blocks_per_chunk: u32,
        cpu_bytes_to_use: u64,
    ) -> Result<ChunkGeometry> {
        for (name, v) in [
            ("worker_kv_bytes_per_block", worker_kv_bytes_per_block),
            ("copies", u64::from(copies)),
            ("blocks_per_chunk", u64::from(blocks_per_chunk)),
            ("cpu_bytes_to_use", cpu_bytes_to_use),
        ] {
            if v == 0 {
                return Err(
                    geometry_error(format!("chunk geometry: {name} must be > 0"))
                        .with("found", "0"),
                );
            }
        }
        let raw_bytes_per_chunk = Self::raw_bytes_per_chunk(
            worker_kv_bytes_per_block,
            u64::from(copies),
            blocks_per_chunk,
        )?;
        let row_stride = Self::row_stride_for(raw_bytes_per_chunk)?;
        let num_chunks = Self::rows_in(cpu_bytes_to_use, row_stride);
        if num_chunks == 0 {
            return Err(geometry_error(format!(
                "chunk geometry: cpu_bytes_to_use ({}) holds no chunk of {}; raise \
                 cpu_bytes_to_use or lower blocks_per_chunk",
                format_size_human(cpu_bytes_to_use),
                format_size_human(row_stride)
            ))
            .with("row_stride", row_stride.to_string()));
        }
        Ok(ChunkGeometry {
            worker_kv_bytes_per_block,
            copies,
            blocks_per_chunk,
            raw_bytes_per_chunk,
            row_stride,
            padding: row_stride - raw_bytes_per_chunk,
            // Exact: raw_bytes_per_chunk is a multiple of copies by construction.
            page_size_per_worker: raw_bytes_per_chunk / u64::from(copies),
            num_chunks,
            // Cannot overflow: num_chunks * row_stride <= cpu_bytes_to_use.
            region_bytes: num_chunks * row_stride,
        })
    }

    /// KV bytes of one chunk, all copies: `bytes_per_block * copies * blocks_per_chunk`
    /// ([`ErrorKind::Config`] if it overflows 64 bits).
    pub fn raw_bytes_per_chunk(
        bytes_per_block: u64,
        copies: u64,
        blocks_per_chunk: u32,
    ) -> Result<u64> {
        bytes_per_block
            .checked_mul(copies)
            .and_then(|b| b.checked_mul(u64::from(blocks_per_chunk)))
            .ok_or_else(|| {
                geometry_error(format!(
                    "chunk geometry: {bytes_per_block} bytes per block x {copies} copies x \
                     {blocks_per_chunk} blocks per chunk overflows 64 bits"
                ))
            })
    }

    /// The row stride of a chunk of `raw_bytes_per_chunk` bytes: rounded up to
    /// [`ROW_ALIGNMENT`]. A G3 slot is exactly one row, so this is the slot size too.
    /// [`ErrorKind::Config`] if the rounding overflows 64 bits.
    pub fn row_stride_for(raw_bytes_per_chunk: u64) -> Result<u64> {
        raw_bytes_per_chunk
            .checked_next_multiple_of(ROW_ALIGNMENT_BYTES)
            .ok_or_else(|| {
                geometry_error(format!(
                    "chunk geometry: a chunk of {raw_bytes_per_chunk} bytes rounded up to \
                     {ROW_ALIGNMENT} overflows 64 bits"
                ))
            })
    }

    /// Whether `bytes` is a positive multiple of [`ROW_ALIGNMENT`] (a valid row stride, or an
    /// O_DIRECT-aligned length).
    pub fn is_row_aligned(bytes: u64) -> bool {
        bytes != 0 && bytes.is_multiple_of(ROW_ALIGNMENT_BYTES)
    }

    /// Checks a row size the user gives as `key` (a flag such as `--row-size`) by the row
    /// stride rule: a positive multiple of [`ROW_ALIGNMENT`], else an [`ErrorKind::Config`]
    /// error naming `key` and the value.
    pub fn check_row_size(key: &str, bytes: u64) -> Result<()> {
        if Self::is_row_aligned(bytes) {
            return Ok(());
        }
        Err(Error::config(
            key,
            format!("{bytes} is not a positive multiple of {ROW_ALIGNMENT}"),
        ))
    }

    /// Checks a row stride given from outside (an adopted region, a caller's dimensions):
    /// a positive multiple of [`ROW_ALIGNMENT`], else [`ErrorKind::Misaligned`].
    pub fn check_row_stride(row_stride: u64) -> Result<()> {
        if Self::is_row_aligned(row_stride) {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::Misaligned,
            format!("row_stride {row_stride} is not a positive multiple of {ROW_ALIGNMENT}"),
        )
        .with("expected", format!("multiple of {ROW_ALIGNMENT}"))
        .with("found", row_stride.to_string()))
    }

    /// Whole rows of `row_stride` bytes in a byte budget (rounded down; 0 for a zero stride).
    pub fn rows_in(bytes: u64, row_stride: u64) -> u64 {
        bytes.checked_div(row_stride).unwrap_or(0)
    }

    /// Rows a tier may have in flight under `max_bytes_in_flight`: the whole rows in the
    /// budget, and at least one (a budget under one row moves one row at a time).
    pub fn rows_in_flight(max_bytes_in_flight: u64, row_stride: u64) -> u64 {
        Self::rows_in(max_bytes_in_flight, row_stride).max(1)
    }

    /// Slots per slab file for a total capacity split evenly over `n_paths` files, rounded
    /// down to whole slots of `row_stride` bytes (0 without paths or stride).
    pub fn slots_per_file(capacity_bytes: u64, n_paths: usize, row_stride: u64) -> u64 {
        if n_paths == 0 {
            return 0;
        }
        Self::rows_in(capacity_bytes / n_paths as u64, row_stride)
    }

    /// Slots of a whole slab set: [`ChunkGeometry::slots_per_file`] times the number of files
    /// (saturating: a sum that large is refused by whoever asks).
    pub fn total_slots(capacity_bytes: u64, n_paths: usize, row_stride: u64) -> u64 {
        Self::slots_per_file(capacity_bytes, n_paths, row_stride).saturating_mul(n_paths as u64)
    }

    /// `(num_rows, row_stride)` as `usize` for [`crate::region::PrimaryRegion::create`].
    pub fn region_dims(&self) -> Result<(usize, usize)> {
        let to_usize = |v: u64, what: &str| {
            usize::try_from(v).map_err(|_| {
                geometry_error(format!(
                    "chunk geometry: {what} {v} does not fit this platform"
                ))
            })
        };
        Ok((
            to_usize(self.num_chunks, "num_chunks")?,
            to_usize(self.row_stride, "row_stride")?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contract_worked_example() {
        // 512 B per worker-block x 2 workers x 2 blocks per chunk, 100 MiB pool.
        let g = ChunkGeometry::derive(512, 2, 2, 100 << 20).unwrap();
        assert_eq!(g.raw_bytes_per_chunk, 2048);
        assert_eq!(g.row_stride, 4096);
        assert_eq!(g.padding, 2048);
        assert_eq!(g.page_size_per_worker, 1024);
        assert_eq!(g.num_chunks, 25_600);
        assert_eq!(g.region_bytes, 100 << 20);
        assert_eq!(g.region_dims().unwrap(), (25_600, 4096));
    }

    #[test]
    fn llama_3_1_8b_tp1() {
        // 32 layers x (K, V) x 8 KV heads x 128 dims x 2 bytes (bf16) x 16 tokens per block.
        let per_block = 32 * 2 * 8 * 128 * 2 * 16;
        assert_eq!(per_block, 2 << 20);
        let g = ChunkGeometry::derive(per_block, 1, 1, 64 << 30).unwrap();
        assert_eq!(g.row_stride, 2 << 20);
        assert_eq!(g.padding, 0);
        assert_eq!(g.page_size_per_worker, 2 << 20);
        assert_eq!(g.num_chunks, 32 * 1024);
        // TP2, direct layout: each worker holds half the heads; 4 blocks per chunk.
        let g = ChunkGeometry::derive(per_block / 2, 2, 4, 64 << 30).unwrap();
        assert_eq!(g.row_stride, 8 << 20);
        assert_eq!(g.page_size_per_worker, 4 << 20);
        assert_eq!(g.num_chunks, 8 * 1024);
    }

    #[test]
    fn unaligned_rows_are_padded_and_pool_remainder_unused() {
        // 4 workers x 1000 B x 3 blocks = 12000 B -> 12288 B rows.
        let g = ChunkGeometry::derive(1000, 4, 3, 1_000_000).unwrap();
        assert_eq!(g.raw_bytes_per_chunk, 12_000);
        assert_eq!(g.row_stride, 12_288);
        assert_eq!(g.padding, 288);
        assert_eq!(g.page_size_per_worker, 3000);
        assert_eq!(g.num_chunks, 1_000_000 / 12_288);
        assert!(g.region_bytes <= 1_000_000);
        assert!(ChunkGeometry::is_row_aligned(g.row_stride));
    }

    #[test]
    fn rejects_zero_inputs() {
        for (b, c, n, p, name) in [
            (0, 1, 1, 1 << 20, "worker_kv_bytes_per_block"),
            (512, 0, 1, 1 << 20, "copies"),
            (512, 1, 0, 1 << 20, "blocks_per_chunk"),
            (512, 1, 1, 0, "cpu_bytes_to_use"),
        ] {
            let e = ChunkGeometry::derive(b, c, n, p).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Config);
            assert!(e.to_string().contains(name), "{e}");
        }
    }

    #[test]
    fn rejects_pool_smaller_than_one_row() {
        let e = ChunkGeometry::derive(2 << 20, 1, 1, (2 << 20) - 1).unwrap_err();
        assert!(e.to_string().contains("holds no chunk"), "{e}");
        assert_eq!(e.context_value("row_stride"), Some("2097152"));
    }

    #[test]
    fn rejects_overflow() {
        let e = ChunkGeometry::derive(u64::MAX / 2, 2, 2, u64::MAX).unwrap_err();
        assert!(e.to_string().contains("overflows"), "{e}");
        // The product fits but rounding up to 4096 does not.
        let e = ChunkGeometry::derive(u64::MAX, 1, 1, u64::MAX).unwrap_err();
        assert!(e.to_string().contains("overflows"), "{e}");
    }

    #[test]
    fn row_stride_rounds_up_to_the_alignment_and_checks_given_strides() {
        assert_eq!(ChunkGeometry::row_stride_for(1).unwrap(), 4096);
        assert_eq!(ChunkGeometry::row_stride_for(4096).unwrap(), 4096);
        assert_eq!(ChunkGeometry::row_stride_for(4097).unwrap(), 8192);
        assert!(ChunkGeometry::row_stride_for(u64::MAX).is_err());
        ChunkGeometry::check_row_stride(8192).unwrap();
        for bad in [0, 2048, 4097] {
            let e = ChunkGeometry::check_row_stride(bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Misaligned);
            assert_eq!(e.context_value("found"), Some(bad.to_string().as_str()));
        }
    }

    #[test]
    fn a_row_size_from_the_user_is_a_config_error_naming_its_flag() {
        ChunkGeometry::check_row_size("--row-size", 4096).unwrap();
        ChunkGeometry::check_row_size("--row-size", 2 << 20).unwrap();
        for bad in [0, 1000, 4097] {
            let e = ChunkGeometry::check_row_size("--row-size", bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Config);
            assert_eq!(e.context_value("key"), Some("--row-size"));
            assert_eq!(
                e.message(),
                format!("--row-size: {bad} is not a positive multiple of 4096")
            );
        }
    }

    #[test]
    fn byte_budgets_become_whole_rows() {
        assert_eq!(ChunkGeometry::rows_in(10 * 4096 + 4095, 4096), 10);
        assert_eq!(ChunkGeometry::rows_in(4095, 4096), 0);
        assert_eq!(ChunkGeometry::rows_in(4096, 0), 0);
        // In flight: at least one row, even under a budget smaller than a row.
        assert_eq!(ChunkGeometry::rows_in_flight(64 << 20, 2 << 20), 32);
        assert_eq!(ChunkGeometry::rows_in_flight(1 << 20, 2 << 20), 1);
    }

    #[test]
    fn capacity_splits_into_whole_slots_per_file() {
        assert_eq!(ChunkGeometry::slots_per_file(100 * 8192 + 5, 3, 8192), 33);
        assert_eq!(ChunkGeometry::total_slots(100 * 8192 + 5, 3, 8192), 99);
        assert_eq!(ChunkGeometry::slots_per_file(1 << 20, 0, 8192), 0);
        assert_eq!(ChunkGeometry::slots_per_file(1 << 20, 2, 0), 0);
        assert_eq!(
            ChunkGeometry::total_slots(u64::MAX, 1, 4096),
            u64::MAX / 4096
        );
    }
}
