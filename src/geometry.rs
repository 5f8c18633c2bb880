//! Chunk geometry: from one worker's KV bytes per GPU block, the number of copies, the blocks
//! per chunk and the primary pool size, derive the row stride and the number of rows.
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

use serde::Serialize;

use crate::config::{ChunkSizing, KvtierConfig};
use crate::error::{Error, ErrorKind, Result};

/// Row alignment: the page size; every row is page-aligned in address and length.
pub const ROW_ALIGNMENT: u64 = crate::region::ROW_ALIGNMENT as u64;

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
        let overflow = || {
            geometry_error(format!(
                "chunk geometry: {worker_kv_bytes_per_block} bytes per block x {copies} copies x \
                 {blocks_per_chunk} blocks per chunk overflows 64 bits"
            ))
        };
        let raw_bytes_per_chunk = worker_kv_bytes_per_block
            .checked_mul(u64::from(copies))
            .and_then(|b| b.checked_mul(u64::from(blocks_per_chunk)))
            .ok_or_else(overflow)?;
        let row_stride = raw_bytes_per_chunk
            .checked_next_multiple_of(ROW_ALIGNMENT)
            .ok_or_else(overflow)?;
        let num_chunks = cpu_bytes_to_use / row_stride;
        if num_chunks == 0 {
            return Err(geometry_error(format!(
                "chunk geometry: cpu_bytes_to_use ({cpu_bytes_to_use} bytes) holds no chunk of \
                 {row_stride} bytes; raise cpu_bytes_to_use or lower blocks_per_chunk"
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

    /// Checks that a region handed over by its owner (vLLM's shared offload region, adopted by
    /// pointer) has this geometry: `row_stride` a multiple of [`ROW_ALIGNMENT`]
    /// ([`ErrorKind::Misaligned`] otherwise) and equal to the derived stride and row count
    /// ([`ErrorKind::IncompatibleLayout`] otherwise).
    pub fn verify_adopted(&self, row_stride: u64, num_rows: u64) -> Result<()> {
        if row_stride == 0 || !row_stride.is_multiple_of(ROW_ALIGNMENT) {
            return Err(Error::new(
                ErrorKind::Misaligned,
                format!("adopted region: row stride {row_stride} is not a positive multiple of {ROW_ALIGNMENT}"),
            )
            .with("found", row_stride.to_string()));
        }
        if row_stride != self.row_stride || num_rows != self.num_chunks {
            return Err(Error::new(
                ErrorKind::IncompatibleLayout,
                "adopted region does not match the configured chunk geometry",
            )
            .with(
                "expected",
                format!("{} rows of {} bytes", self.num_chunks, self.row_stride),
            )
            .with("found", format!("{num_rows} rows of {row_stride} bytes")));
        }
        Ok(())
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

impl ChunkSizing {
    /// GPU blocks per chunk. `block_size` (tokens) must be a positive multiple of
    /// `gpu_block_size_tokens`, which is needed only in that case.
    pub fn blocks_per_chunk(self, gpu_block_size_tokens: Option<u32>) -> Result<u32> {
        match self {
            ChunkSizing::BlocksPerChunk(n) => Ok(n),
            ChunkSizing::BlockSizeTokens(tokens) => {
                let Some(gpu) = gpu_block_size_tokens.filter(|g| *g > 0) else {
                    return Err(geometry_error(format!(
                        "block_size ({tokens} tokens) needs the GPU block size (tokens per GPU \
                         block) to give blocks per chunk"
                    )));
                };
                if tokens == 0 || !tokens.is_multiple_of(gpu) {
                    return Err(Error::config(
                        "block_size",
                        "must be a positive multiple of the GPU block size",
                    )
                    .with("found", tokens.to_string())
                    .with("gpu_block_size", gpu.to_string()));
                }
                Ok(tokens / gpu)
            }
        }
    }
}

impl KvtierConfig {
    /// The chunk geometry of this configuration for one worker's KV bytes per GPU block and
    /// the number of copies; `gpu_block_size_tokens` is needed only when `block_size` is set.
    pub fn geometry(
        &self,
        worker_kv_bytes_per_block: u64,
        copies: u32,
        gpu_block_size_tokens: Option<u32>,
    ) -> Result<ChunkGeometry> {
        let blocks_per_chunk = self.chunk.blocks_per_chunk(gpu_block_size_tokens)?;
        ChunkGeometry::derive(
            worker_kv_bytes_per_block,
            copies,
            blocks_per_chunk,
            self.cpu_bytes_to_use,
        )
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
        assert_eq!(g.row_stride % ROW_ALIGNMENT, 0);
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
    fn adopted_region_must_match() {
        let g = ChunkGeometry::derive(512, 2, 2, 100 << 20).unwrap();
        g.verify_adopted(4096, 25_600).unwrap();
        let e = g.verify_adopted(2048, 25_600).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Misaligned);
        let e = g.verify_adopted(8192, 12_800).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::IncompatibleLayout);
        assert_eq!(e.context_value("found"), Some("12800 rows of 8192 bytes"));
        let e = g.verify_adopted(4096, 25_599).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::IncompatibleLayout);
    }

    #[test]
    fn config_geometry_uses_its_sizing_and_pool() {
        let mut c = KvtierConfig::new(100 << 20);
        c.chunk = ChunkSizing::BlockSizeTokens(32);
        let g = c.geometry(512, 2, Some(16)).unwrap();
        assert_eq!((g.blocks_per_chunk, g.num_chunks), (2, 25_600));
        assert!(c.geometry(512, 2, None).is_err());
    }

    #[test]
    fn block_size_resolves_against_gpu_block_size() {
        assert_eq!(
            ChunkSizing::BlocksPerChunk(4)
                .blocks_per_chunk(None)
                .unwrap(),
            4
        );
        assert_eq!(
            ChunkSizing::BlockSizeTokens(64)
                .blocks_per_chunk(Some(16))
                .unwrap(),
            4
        );
        let e = ChunkSizing::BlockSizeTokens(40)
            .blocks_per_chunk(Some(16))
            .unwrap_err();
        assert!(
            e.to_string().contains("multiple of the GPU block size"),
            "{e}"
        );
        assert!(
            ChunkSizing::BlockSizeTokens(64)
                .blocks_per_chunk(None)
                .is_err()
        );
    }
}
