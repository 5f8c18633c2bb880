//! Run planning: a rank's canonical copy runs (from kvtier's `RowPlan`, offsets in the rank's
//! local chunk and in the row) mapped through where the rank's KV pages sit in GPU memory, into
//! strided copies between GPU addresses and row offsets.
//!
//! The local chunk is the canonical plan's: layer after layer, each layer's `blocks_per_chunk`
//! pages of `page_bytes`, contiguous. In GPU memory a layer's page of block `b` is split into
//! [`PagePart`]s (one part when K and V sit together, two for a layer whose K and V halves are
//! separate tensors), part `p` of block `b` at `p.base + b * p.block_stride`. A run's fragments
//! are grouped while they stay inside one part of one page, where the GPU address advances
//! with the local offset; each group becomes one [`DeviceCopy`] (a 2-D copy on the GPU).

use crate::error::{Result, plan_error};

/// One strided copy of the canonical plan for one chunk: fragment `i` moves `size` bytes
/// between local-chunk offset `local + i * local_stride` and row offset `row + i * row_stride`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// First fragment in the local chunk.
    pub local: u64,
    /// First fragment in the row.
    pub row: u64,
    /// Bytes per fragment.
    pub size: u64,
    /// Fragments.
    pub count: u64,
    /// Distance between fragments in the local chunk.
    pub local_stride: u64,
    /// Distance between fragments in the row.
    pub row_stride: u64,
}

/// A byte range of every page of one layer that sits at one place in GPU memory: bytes
/// `[page_offset, page_offset + len)` of block `b`'s page are at `base + b * block_stride`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagePart {
    /// Start of the part in the page.
    pub page_offset: u64,
    /// Bytes of the part.
    pub len: u64,
    /// GPU address of block 0's part.
    pub base: u64,
    /// Bytes between consecutive blocks' parts.
    pub block_stride: u64,
}

/// One layer's pages in GPU memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerPages {
    /// Bytes of one page (the plan's local page size).
    pub page_bytes: u64,
    /// The parts, tiling `[0, page_bytes)` in order.
    pub parts: Vec<PagePart>,
}

impl LayerPages {
    /// A layer whose pages are contiguous: block `b`'s page at `base + b * block_stride`.
    pub fn contiguous(page_bytes: u64, base: u64, block_stride: u64) -> Self {
        LayerPages {
            page_bytes,
            parts: vec![PagePart {
                page_offset: 0,
                len: page_bytes,
                base,
                block_stride,
            }],
        }
    }

    /// A layer whose K and V halves are separate tensors (vLLM's `(2, num_blocks, ...)`
    /// layout): block `b`'s K half at `k_base + b * block_stride`, its V half at
    /// `v_base + b * block_stride`, each `page_bytes / 2`.
    pub fn split_kv(page_bytes: u64, k_base: u64, v_base: u64, block_stride: u64) -> Self {
        let half = page_bytes / 2;
        LayerPages {
            page_bytes,
            parts: vec![
                PagePart {
                    page_offset: 0,
                    len: half,
                    base: k_base,
                    block_stride,
                },
                PagePart {
                    page_offset: half,
                    len: page_bytes - half,
                    base: v_base,
                    block_stride,
                },
            ],
        }
    }
}

/// Where one rank's KV pages sit in GPU memory, layer after layer in the plan's layer order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuLayout {
    layers: Vec<LayerPages>,
    blocks_per_chunk: u64,
    /// Start of each layer's pages in the local chunk, and the local chunk's length last.
    local_bases: Vec<u64>,
}

impl GpuLayout {
    /// Checks that every layer's parts tile its page in order and builds the layout for
    /// chunks of `blocks_per_chunk` blocks.
    pub fn new(layers: Vec<LayerPages>, blocks_per_chunk: u64) -> Result<Self> {
        if blocks_per_chunk == 0 {
            return Err(plan_error("blocks_per_chunk must be > 0"));
        }
        let mut local_bases = Vec::with_capacity(layers.len() + 1);
        let mut base = 0u64;
        for (l, layer) in layers.iter().enumerate() {
            let mut at = 0u64;
            for p in &layer.parts {
                if p.page_offset != at || p.len == 0 {
                    return Err(plan_error(format!(
                        "layer {l}: page parts must tile the page in order (part at {} of {} \
                         bytes, expected one at {at})",
                        p.page_offset, p.len
                    )));
                }
                at = at
                    .checked_add(p.len)
                    .ok_or_else(|| plan_error(format!("layer {l}: part length overflows")))?;
            }
            if at != layer.page_bytes || at == 0 {
                return Err(plan_error(format!(
                    "layer {l}: parts cover {at} bytes of a {}-byte page",
                    layer.page_bytes
                )));
            }
            local_bases.push(base);
            base = layer
                .page_bytes
                .checked_mul(blocks_per_chunk)
                .and_then(|b| b.checked_add(base))
                .ok_or_else(|| plan_error("local chunk size overflows"))?;
        }
        local_bases.push(base);
        Ok(GpuLayout {
            layers,
            blocks_per_chunk,
            local_bases,
        })
    }

    /// Bytes of the rank's local chunk.
    pub fn local_chunk_bytes(&self) -> u64 {
        self.local_bases.last().copied().unwrap_or(0)
    }

    /// The layers.
    pub fn layers(&self) -> &[LayerPages] {
        &self.layers
    }

    /// Blocks per chunk.
    pub fn blocks_per_chunk(&self) -> u64 {
        self.blocks_per_chunk
    }

    /// Where local offset `local` is: the page part holding it, the GPU address of the byte,
    /// and one past the last local offset inside that part of that page.
    fn locate(&self, local: u64, blocks: &[u64]) -> Result<(u64, u64)> {
        let l = match self.local_bases.binary_search(&local) {
            Ok(i) => i,
            Err(i) => i.saturating_sub(1),
        };
        let layer = self.layers.get(l).ok_or_else(|| {
            plan_error(format!(
                "local offset {local} is past the local chunk ({} bytes)",
                self.local_chunk_bytes()
            ))
        })?;
        let within = local - self.local_bases[l];
        let j = within / layer.page_bytes;
        let in_page = within % layer.page_bytes;
        let block = *blocks
            .get(j as usize)
            .ok_or_else(|| plan_error(format!("page {j} of layer {l} has no block id")))?;
        let part = layer
            .parts
            .iter()
            .find(|p| in_page < p.page_offset + p.len)
            .ok_or_else(|| plan_error(format!("layer {l}: offset {in_page} in no part")))?;
        let addr = block
            .checked_mul(part.block_stride)
            .and_then(|o| o.checked_add(part.base))
            .and_then(|a| a.checked_add(in_page - part.page_offset))
            .ok_or_else(|| plan_error(format!("block {block}: GPU address overflows")))?;
        let part_end = self.local_bases[l] + j * layer.page_bytes + part.page_offset + part.len;
        Ok((addr, part_end))
    }
}

/// One strided copy between GPU memory and a row: fragment `i` moves `size` bytes between
/// GPU address `device + i * device_stride` and row offset `row + i * row_stride`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceCopy {
    /// GPU address of the first fragment.
    pub device: u64,
    /// Row offset of the first fragment.
    pub row: u64,
    /// Bytes per fragment.
    pub size: u64,
    /// Fragments.
    pub count: u64,
    /// Distance between fragments in GPU memory.
    pub device_stride: u64,
    /// Distance between fragments in the row.
    pub row_stride: u64,
}

impl DeviceCopy {
    /// Bytes moved.
    pub fn bytes(&self) -> u64 {
        self.size * self.count
    }

    /// One past the last row byte touched.
    pub fn row_end(&self) -> u64 {
        self.row + (self.count - 1) * self.row_stride + self.size
    }

    /// One past the last GPU byte touched.
    pub fn device_end(&self) -> u64 {
        self.device + (self.count - 1) * self.device_stride + self.size
    }

    /// Appends `next` when it continues this copy contiguously on both sides.
    fn try_extend(&mut self, next: &DeviceCopy) -> bool {
        let contiguous = |c: &DeviceCopy| c.count == 1;
        if contiguous(self)
            && contiguous(next)
            && self.device + self.size == next.device
            && self.row + self.size == next.row
        {
            self.size += next.size;
            return true;
        }
        false
    }
}

/// The copies that move one chunk's runs, for the chunk whose pages are the GPU blocks
/// `blocks` (one id per block of the chunk, in order). Contiguous copies are merged.
pub fn plan_chunk(runs: &[Run], layout: &GpuLayout, blocks: &[u64]) -> Result<Vec<DeviceCopy>> {
    if blocks.len() as u64 != layout.blocks_per_chunk {
        return Err(plan_error(format!(
            "a chunk has {} blocks, {} block ids given",
            layout.blocks_per_chunk,
            blocks.len()
        )));
    }
    let mut out: Vec<DeviceCopy> = Vec::new();
    let mut push = |c: DeviceCopy| {
        if let Some(last) = out.last_mut()
            && last.try_extend(&c)
        {
            return;
        }
        out.push(c);
    };
    for run in runs {
        if run.size == 0 || run.count == 0 {
            continue;
        }
        let mut i = 0u64;
        while i < run.count {
            let overflow = || plan_error(format!("run {run:?} overflows"));
            let local = run
                .local_stride
                .checked_mul(i)
                .and_then(|o| o.checked_add(run.local))
                .ok_or_else(overflow)?;
            let row = run
                .row_stride
                .checked_mul(i)
                .and_then(|o| o.checked_add(run.row))
                .ok_or_else(overflow)?;
            let (addr, part_end) = layout.locate(local, blocks)?;
            if local + run.size > part_end {
                // The fragment straddles two parts (or pages): copy it piece by piece.
                let mut at = 0u64;
                while at < run.size {
                    let (a, end) = layout.locate(local + at, blocks)?;
                    let n = (end - (local + at)).min(run.size - at);
                    push(DeviceCopy {
                        device: a,
                        row: row + at,
                        size: n,
                        count: 1,
                        device_stride: 0,
                        row_stride: 0,
                    });
                    at += n;
                }
                i += 1;
                continue;
            }
            // Fragments i.. that stay inside this part of this page.
            let fit = match (part_end - run.size - local).checked_div(run.local_stride) {
                Some(q) => (q + 1).min(run.count - i),
                None => run.count - i,
            };
            push(DeviceCopy {
                device: addr,
                row,
                size: run.size,
                count: fit,
                device_stride: if fit > 1 { run.local_stride } else { 0 },
                row_stride: if fit > 1 { run.row_stride } else { 0 },
            });
            i += fit;
        }
    }
    Ok(out)
}

/// Whether `copies` write every byte of `[0, area)` of the row exactly once (so a staged row
/// holds nothing stale): true for a rank that is the elected writer of the whole canonical
/// area (TP 1, or a replicated layout's writer).
pub fn covers_exactly(copies: &[DeviceCopy], area: u64) -> bool {
    let mut spans: Vec<(u64, u64)> = Vec::new();
    for c in copies {
        if c.count > 1 && c.row_stride == c.size {
            spans.push((c.row, c.row + c.bytes()));
        } else {
            for i in 0..c.count {
                let r = c.row + i * c.row_stride;
                spans.push((r, r + c.size));
            }
        }
    }
    spans.sort_unstable();
    let mut at = 0u64;
    for (s, e) in spans {
        if s != at {
            return false;
        }
        at = e;
    }
    at == area
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference: byte by byte, the GPU address of every local offset by the layout formula.
    fn addr_of(layout: &GpuLayout, blocks: &[u64], local: u64) -> u64 {
        let mut base = 0;
        for layer in layout.layers() {
            let span = layer.page_bytes * layout.blocks_per_chunk();
            if local < base + span {
                let j = (local - base) / layer.page_bytes;
                let off = (local - base) % layer.page_bytes;
                let p = layer
                    .parts
                    .iter()
                    .find(|p| off >= p.page_offset && off < p.page_offset + p.len)
                    .unwrap();
                return p.base + blocks[j as usize] * p.block_stride + off - p.page_offset;
            }
            base += span;
        }
        panic!("offset {local} outside");
    }

    fn pairs_of_copies(copies: &[DeviceCopy]) -> Vec<(u64, u64)> {
        let mut v = Vec::new();
        for c in copies {
            for i in 0..c.count {
                for b in 0..c.size {
                    v.push((
                        c.device + i * c.device_stride + b,
                        c.row + i * c.row_stride + b,
                    ));
                }
            }
        }
        v.sort_unstable();
        v
    }

    fn pairs_of_runs(runs: &[Run], layout: &GpuLayout, blocks: &[u64]) -> Vec<(u64, u64)> {
        let mut v = Vec::new();
        for r in runs {
            for i in 0..r.count {
                for b in 0..r.size {
                    let l = r.local + i * r.local_stride + b;
                    v.push((addr_of(layout, blocks, l), r.row + i * r.row_stride + b));
                }
            }
        }
        v.sort_unstable();
        v
    }

    #[test]
    fn copies_move_the_bytes_the_runs_name() {
        // Two layers: one with K/V apart (page 512: halves of 256), one contiguous (page 384).
        let layout = GpuLayout::new(
            vec![
                LayerPages::split_kv(512, 1 << 20, 3 << 20, 1024),
                LayerPages::contiguous(384, 8 << 20, 4096),
            ],
            3,
        )
        .unwrap();
        assert_eq!(layout.local_chunk_bytes(), 3 * 512 + 3 * 384);
        let blocks = [7u64, 2, 11];
        let runs = [
            // Head fragments of 64 B every 128 B across a whole layer (crossing halves and pages).
            Run {
                local: 0,
                row: 0,
                size: 64,
                count: 24,
                local_stride: 64,
                row_stride: 128,
            },
            // A straddling fragment: 300 bytes from 100 crosses the K/V boundary at 256.
            Run {
                local: 100,
                row: 5000,
                size: 300,
                count: 1,
                local_stride: 300,
                row_stride: 300,
            },
            // The second layer, contiguous across its three pages.
            Run {
                local: 1536,
                row: 6000,
                size: 1152,
                count: 1,
                local_stride: 1152,
                row_stride: 1152,
            },
        ];
        let copies = plan_chunk(&runs, &layout, &blocks).unwrap();
        assert_eq!(
            pairs_of_copies(&copies),
            pairs_of_runs(&runs, &layout, &blocks)
        );
        // Grouped, not one copy per fragment: each half of each page is one strided copy.
        assert!(copies.len() < 24, "{copies:?}");
        let strided = copies.iter().filter(|c| c.count > 1).count();
        assert!(strided >= 6, "{copies:?}");
    }

    #[test]
    fn contiguous_blocks_merge_into_one_copy() {
        // Pages of consecutive blocks next to each other in GPU memory and in the row.
        let layout = GpuLayout::new(vec![LayerPages::contiguous(4096, 0x10000, 4096)], 4).unwrap();
        let runs = [Run {
            local: 0,
            row: 0,
            size: 16384,
            count: 1,
            local_stride: 0,
            row_stride: 0,
        }];
        let copies = plan_chunk(&runs, &layout, &[3, 4, 5, 6]).unwrap();
        assert_eq!(
            copies,
            vec![DeviceCopy {
                device: 0x10000 + 3 * 4096,
                row: 0,
                size: 16384,
                count: 1,
                device_stride: 0,
                row_stride: 0
            }]
        );
        // Out-of-order blocks split it.
        assert_eq!(plan_chunk(&runs, &layout, &[3, 9, 5, 6]).unwrap().len(), 3);
    }

    #[test]
    fn bad_layouts_and_block_lists_are_errors() {
        assert!(GpuLayout::new(vec![LayerPages::contiguous(0, 0, 0)], 1).is_err());
        let gap = LayerPages {
            page_bytes: 100,
            parts: vec![PagePart {
                page_offset: 10,
                len: 90,
                base: 0,
                block_stride: 100,
            }],
        };
        assert!(GpuLayout::new(vec![gap], 1).is_err());
        assert!(GpuLayout::new(vec![LayerPages::contiguous(64, 0, 64)], 0).is_err());
        let layout = GpuLayout::new(vec![LayerPages::contiguous(64, 0, 64)], 2).unwrap();
        let runs = [Run {
            local: 0,
            row: 0,
            size: 128,
            count: 1,
            local_stride: 0,
            row_stride: 0,
        }];
        assert!(plan_chunk(&runs, &layout, &[1]).is_err());
        let past = [Run {
            local: 100,
            row: 0,
            size: 64,
            count: 1,
            local_stride: 0,
            row_stride: 0,
        }];
        assert!(plan_chunk(&past, &layout, &[1, 2]).is_err());
        let huge = GpuLayout::new(vec![LayerPages::contiguous(64, u64::MAX - 10, 64)], 1).unwrap();
        let one = [Run {
            local: 0,
            row: 0,
            size: 64,
            count: 1,
            local_stride: 0,
            row_stride: 0,
        }];
        assert!(plan_chunk(&one, &huge, &[5]).is_err());
    }

    #[test]
    fn coverage_is_exact() {
        let c = |row, size, count, rs| DeviceCopy {
            device: 0,
            row,
            size,
            count,
            device_stride: size,
            row_stride: rs,
        };
        assert!(covers_exactly(&[c(0, 64, 4, 128), c(64, 64, 4, 128)], 512));
        assert!(!covers_exactly(&[c(0, 64, 4, 128)], 512));
        assert!(!covers_exactly(&[c(0, 64, 4, 128), c(0, 64, 4, 128)], 512));
        assert!(covers_exactly(&[c(0, 512, 1, 0)], 512));
        assert!(!covers_exactly(&[c(0, 512, 1, 0)], 1024));
    }
}
