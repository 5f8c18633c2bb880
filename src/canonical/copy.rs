//! Compiled copy programs: a plan's copy runs flattened once, at plan time, into strided copies
//! with absolute offsets in the local chunk and the row, merged wherever one continues another,
//! and the single loop that executes them.
//!
//! Merging keeps the fragment order, so a program moves exactly the bytes, in exactly the order,
//! that interpreting the runs one fragment at a time would. It pays off because runs continue
//! across K/V halves, pages and layers: Llama-3.1-8B at TP 8 is one copy of 1024 fragments of
//! 256 B (local stride 256, row stride 2048) per rank, and at TP 1 one contiguous 2 MiB copy.
//!
//! The loop runs without per-fragment bounds checks. That is sound because every op's extent is
//! computed (with overflow checks) when it is pushed, the program keeps the largest extent on
//! each side (a merged op touches exactly the bytes of the ops it was merged from), and
//! [`CopyProgram::local_to_row`] / [`CopyProgram::row_to_local`] refuse buffers shorter than
//! those extents before touching a byte. This module holds the only `unsafe` of the canonical layout.

use std::ptr;

/// One strided copy: fragment `i` moves `size` bytes between local offset
/// `local + i * local_stride` and row offset `row + i * row_stride`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StridedCopy {
    /// First fragment in the local chunk.
    pub local: usize,
    /// First fragment in the row.
    pub row: usize,
    /// Bytes per fragment.
    pub size: usize,
    /// Fragments.
    pub count: usize,
    /// Distance between fragments in the local chunk (0 when `count == 1`).
    pub local_stride: usize,
    /// Distance between fragments in the row (0 when `count == 1`).
    pub row_stride: usize,
}

impl StridedCopy {
    /// One past the last byte touched at `start` with `stride`, or `None` on overflow.
    fn end(&self, start: usize, stride: usize) -> Option<usize> {
        stride
            .checked_mul(self.count - 1)?
            .checked_add(start)?
            .checked_add(self.size)
    }

    /// The same copy with contiguous fragments folded into one, and no strides on single
    /// fragments (so that equal copies compare equal).
    fn normalized(self) -> Self {
        if self.count == 1 || (self.local_stride == self.size && self.row_stride == self.size) {
            StridedCopy {
                size: self.size * self.count,
                count: 1,
                local_stride: 0,
                row_stride: 0,
                ..self
            }
        } else {
            self
        }
    }

    /// Appends `next`'s fragments to `self` when they continue it on both sides (same fragment
    /// size, same strides, next start exactly one stride on). Returns whether it did.
    fn try_extend(&mut self, next: &StridedCopy) -> bool {
        if self.count == 1
            && next.count == 1
            && self.local + self.size == next.local
            && self.row + self.size == next.row
        {
            self.size += next.size;
            return true;
        }
        if self.size != next.size {
            return false;
        }
        let strides = if self.count > 1 {
            (self.local_stride, self.row_stride)
        } else if next.count > 1 {
            (next.local_stride, next.row_stride)
        } else {
            match (
                next.local.checked_sub(self.local),
                next.row.checked_sub(self.row),
            ) {
                (Some(l), Some(r)) if l >= self.size && r >= self.size => (l, r),
                _ => return false,
            }
        };
        if next.count > 1 && (next.local_stride, next.row_stride) != strides {
            return false;
        }
        let continues = strides
            .0
            .checked_mul(self.count)
            .and_then(|d| d.checked_add(self.local))
            == Some(next.local)
            && strides
                .1
                .checked_mul(self.count)
                .and_then(|d| d.checked_add(self.row))
                == Some(next.row);
        if !continues {
            return false;
        }
        let Some(count) = self.count.checked_add(next.count) else {
            return false;
        };
        self.count = count;
        (self.local_stride, self.row_stride) = strides;
        true
    }
}

/// Which way a program moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    /// Local chunk → row (gather, store).
    LocalToRow,
    /// Row → local chunk (scatter, load).
    RowToLocal,
}

/// A list of strided copies with the extents they reach on each side.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct CopyProgram {
    ops: Vec<StridedCopy>,
    /// Largest one-past-the-end local offset of any op.
    local_extent: usize,
    /// Largest one-past-the-end row offset of any op.
    row_extent: usize,
    /// Bytes the program moves.
    bytes: u64,
}

impl CopyProgram {
    /// Appends a copy, merging it into the previous one where it continues it. Empty copies are
    /// dropped. Returns `None` (leaving the program unchanged) if its extent overflows `usize`.
    pub(crate) fn push(&mut self, op: StridedCopy) -> Option<()> {
        if op.count == 0 || op.size == 0 {
            return Some(());
        }
        let local_end = op.end(op.local, op.local_stride)?;
        let row_end = op.end(op.row, op.row_stride)?;
        let bytes = u64::try_from(op.size.checked_mul(op.count)?)
            .ok()
            .and_then(|b| b.checked_add(self.bytes))?;
        let op = op.normalized();
        self.local_extent = self.local_extent.max(local_end);
        self.row_extent = self.row_extent.max(row_end);
        self.bytes = bytes;
        if let Some(last) = self.ops.last_mut()
            && last.try_extend(&op)
        {
            *last = last.normalized();
        } else {
            self.ops.push(op);
        }
        Some(())
    }

    /// Bytes the program moves.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The merged copies, in execution order.
    #[cfg(test)]
    pub(crate) fn ops(&self) -> &[StridedCopy] {
        &self.ops
    }

    /// Gather: copies the program's fragments from `local` into `row`. Returns the bytes
    /// moved, or `None`, before touching anything, if either buffer is shorter than the
    /// program's extent on that side.
    pub(crate) fn local_to_row(&self, local: &[u8], row: &mut [u8]) -> Option<u64> {
        self.execute(local, row, Flow::LocalToRow, Kernel::detect())
    }

    /// Scatter: copies the program's fragments from `row` into `local`. Returns the bytes
    /// moved, or `None`, before touching anything, if either buffer is shorter than the
    /// program's extent on that side.
    pub(crate) fn row_to_local(&self, row: &[u8], local: &mut [u8]) -> Option<u64> {
        self.execute(row, local, Flow::RowToLocal, Kernel::detect())
    }

    fn execute(&self, src: &[u8], dst: &mut [u8], flow: Flow, kernel: Kernel) -> Option<u64> {
        let (src_extent, dst_extent) = match flow {
            Flow::LocalToRow => (self.local_extent, self.row_extent),
            Flow::RowToLocal => (self.row_extent, self.local_extent),
        };
        if src.len() < src_extent || dst.len() < dst_extent {
            return None;
        }
        let (src, dst) = (src.as_ptr(), dst.as_mut_ptr());
        for op in &self.ops {
            let (s, ss, d, ds) = match flow {
                Flow::LocalToRow => (op.local, op.local_stride, op.row, op.row_stride),
                Flow::RowToLocal => (op.row, op.row_stride, op.local, op.local_stride),
            };
            // SAFETY: `push` computed, with overflow checks, one past the last byte this op
            // touches on each side (`start + (count - 1) * stride + size`) and the program's
            // extents are the maxima of those; the check above makes `src` and `dst` at least
            // that long. So every fragment lies inside its buffer, and `src.add(s)` /
            // `dst.add(d)` stay in bounds. `src` and `dst` come from a shared and an exclusive
            // borrow, so they do not overlap. `kernel` comes from `Kernel::detect`.
            unsafe { copy_strided(kernel, src.add(s), ss, dst.add(d), ds, op.size, op.count) };
        }
        Some(self.bytes)
    }
}

/// How fragments are copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    /// One `memcpy` per fragment.
    Memcpy,
    /// Inlined AVX2 vector moves for fragments that are a multiple of 32 bytes up to
    /// [`MAX_VECTOR_FRAGMENT`], `memcpy` for the others. Only [`Kernel::detect`] returns it,
    /// after checking that the CPU has AVX2.
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl Kernel {
    /// The fastest kernel this CPU supports (the check is a cached flag after the first call).
    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            return Kernel::Avx2;
        }
        Kernel::Memcpy
    }
}

/// Fragments up to this size (and a multiple of 32 bytes) are copied with inlined 32-byte
/// vector moves when the CPU has AVX2; larger ones go to `memcpy`, which is as fast there.
const MAX_VECTOR_FRAGMENT: usize = 4096;

/// Copies `count` fragments of `size` bytes, fragment `i` from `src + i * src_stride` to
/// `dst + i * dst_stride`.
///
/// Head fragments are small (256 B for one bf16 head of 128 at TP 8), where a `memcpy` call per
/// fragment costs about as much as the copy: with [`Kernel::Avx2`] they are copied by a loop
/// of 32-byte vector moves, specialised for the common sizes. Otherwise, and for large
/// fragments, each fragment is one `memcpy`.
///
/// # Safety
/// Every fragment must be readable at `src` and writable at `dst`, and no source fragment may
/// overlap a destination fragment. `kernel` must come from [`Kernel::detect`].
unsafe fn copy_strided(
    kernel: Kernel,
    src: *const u8,
    src_stride: usize,
    dst: *mut u8,
    dst_stride: usize,
    size: usize,
    count: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if kernel == Kernel::Avx2 && size.is_multiple_of(32) && size <= MAX_VECTOR_FRAGMENT {
        // SAFETY: the caller's contract, passed on unchanged; `Kernel::Avx2` comes from
        // `Kernel::detect`, which checked that the CPU has AVX2.
        unsafe { avx2::copy_strided(src, src_stride, dst, dst_stride, size, count) };
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = kernel;
    let (mut src, mut dst) = (src, dst);
    for _ in 0..count {
        // SAFETY: fragment `i` of the caller's contract (readable, writable, disjoint).
        unsafe { ptr::copy_nonoverlapping(src, dst, size) };
        // `wrapping_add`: after the last fragment the pointers may point past the buffers.
        src = src.wrapping_add(src_stride);
        dst = dst.wrapping_add(dst_stride);
    }
}

/// AVX2 fragment copies: unaligned 32-byte loads and stores, four loads then four stores per
/// 128-byte block (measured faster than alternating load / store pairs on the strided side).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_storeu_si256};

    /// [`super::copy_strided`] for fragments whose size is a multiple of 32.
    ///
    /// # Safety
    /// As [`super::copy_strided`]; the CPU must support AVX2 and `size % 32 == 0`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn copy_strided(
        src: *const u8,
        src_stride: usize,
        dst: *mut u8,
        dst_stride: usize,
        size: usize,
        count: usize,
    ) {
        // SAFETY: every arm passes the caller's contract on unchanged; the fixed-size arms
        // only pass `size` as a constant equal to it.
        unsafe {
            match size {
                128 => fragments(src, src_stride, dst, dst_stride, 128, count),
                256 => fragments(src, src_stride, dst, dst_stride, 256, count),
                512 => fragments(src, src_stride, dst, dst_stride, 512, count),
                1024 => fragments(src, src_stride, dst, dst_stride, 1024, count),
                2048 => fragments(src, src_stride, dst, dst_stride, 2048, count),
                _ => fragments(src, src_stride, dst, dst_stride, size, count),
            }
        }
    }

    /// `count` fragments of `size` bytes, `size` a multiple of 32. Inlined into each arm of
    /// [`copy_strided`], so for a constant `size` the inner loops are fully unrolled.
    ///
    /// # Safety
    /// As [`copy_strided`].
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn fragments(
        mut src: *const u8,
        src_stride: usize,
        mut dst: *mut u8,
        dst_stride: usize,
        size: usize,
        count: usize,
    ) {
        for _ in 0..count {
            let mut off = 0;
            while off + 128 <= size {
                // SAFETY: `off + 128 <= size`, so the 128 bytes at `off` lie inside this
                // fragment, readable at `src` and writable at `dst` (disjoint);
                // `loadu` / `storeu` need no alignment.
                unsafe {
                    let p = src.add(off);
                    let a = _mm256_loadu_si256(p.cast::<__m256i>());
                    let b = _mm256_loadu_si256(p.add(32).cast::<__m256i>());
                    let c = _mm256_loadu_si256(p.add(64).cast::<__m256i>());
                    let d = _mm256_loadu_si256(p.add(96).cast::<__m256i>());
                    let q = dst.add(off);
                    _mm256_storeu_si256(q.cast::<__m256i>(), a);
                    _mm256_storeu_si256(q.add(32).cast::<__m256i>(), b);
                    _mm256_storeu_si256(q.add(64).cast::<__m256i>(), c);
                    _mm256_storeu_si256(q.add(96).cast::<__m256i>(), d);
                }
                off += 128;
            }
            while off < size {
                // SAFETY: `off + 32 <= size` (size is a multiple of 32), so the 32 bytes at
                // `off` lie inside this fragment, readable at `src` and writable at `dst`.
                unsafe {
                    let v = _mm256_loadu_si256(src.add(off).cast::<__m256i>());
                    _mm256_storeu_si256(dst.add(off).cast::<__m256i>(), v);
                }
                off += 32;
            }
            // `wrapping_add`: after the last fragment the pointers may point past the buffers.
            src = src.wrapping_add(src_stride);
            dst = dst.wrapping_add(dst_stride);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(
        local: usize,
        row: usize,
        size: usize,
        count: usize,
        ls: usize,
        rs: usize,
    ) -> StridedCopy {
        StridedCopy {
            local,
            row,
            size,
            count,
            local_stride: ls,
            row_stride: rs,
        }
    }

    /// Reference: every fragment of every op, one at a time, in order, with bounds checks.
    fn naive(ops: &[StridedCopy], src: &[u8], dst: &mut [u8], to_row: bool) {
        for o in ops {
            for i in 0..o.count {
                let (l, r) = (o.local + i * o.local_stride, o.row + i * o.row_stride);
                let (s, d) = if to_row { (l, r) } else { (r, l) };
                dst[d..d + o.size].copy_from_slice(&src[s..s + o.size]);
            }
        }
    }

    fn kernels() -> Vec<Kernel> {
        let mut k = vec![Kernel::Memcpy];
        if Kernel::detect() != Kernel::Memcpy {
            k.push(Kernel::detect());
        } else {
            eprintln!("no vector kernel on this CPU: testing the memcpy kernel only");
        }
        k
    }

    #[test]
    fn continuing_copies_merge_in_order() {
        // Two K/V halves of one TP 8 page (16 x 256 B each), then the next layer's page.
        let mut p = CopyProgram::default();
        p.push(op(0, 256, 256, 16, 256, 2048)).unwrap();
        p.push(op(4096, 256 + 16 * 2048, 256, 16, 256, 2048))
            .unwrap();
        p.push(op(8192, 256 + 32 * 2048, 256, 32, 256, 2048))
            .unwrap();
        assert_eq!(p.ops(), &[op(0, 256, 256, 64, 256, 2048)]);
        assert_eq!(p.bytes(), 64 * 256);
        // Contiguous runs fold into one copy; a gap or another size starts a new op.
        let mut q = CopyProgram::default();
        q.push(op(0, 0, 64, 4, 64, 64)).unwrap();
        q.push(op(256, 256, 100, 1, 0, 0)).unwrap();
        q.push(op(1000, 2000, 100, 1, 0, 0)).unwrap();
        q.push(op(2000, 1000, 100, 1, 0, 0)).unwrap();
        assert_eq!(
            q.ops(),
            &[
                op(0, 0, 356, 1, 0, 0),
                op(1000, 2000, 100, 1, 0, 0),
                op(2000, 1000, 100, 1, 0, 0)
            ]
        );
        // Two single fragments one stride apart become a strided op that later ones extend.
        let mut r = CopyProgram::default();
        for i in 0..5 {
            r.push(op(i * 32, i * 96, 32, 1, 0, 0)).unwrap();
        }
        assert_eq!(
            r.ops(),
            &[op(0, 0, 160, 1, 0, 0)].map(|_| op(0, 0, 32, 5, 32, 96))
        );
    }

    #[test]
    fn programs_copy_what_naive_fragment_copies_copy() {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        let sizes = [
            1, 7, 32, 96, 128, 160, 256, 384, 512, 1024, 2048, 4096, 4128, 5000,
        ];
        for _case in 0..60 {
            let mut ops = Vec::new();
            let (mut l, mut r) = (next(64), next(64));
            let size = sizes[next(sizes.len())];
            for _ in 0..1 + next(6) {
                // Mostly continuing ops (to exercise merging), sometimes a jump or a new size.
                let size = if next(4) == 0 {
                    sizes[next(sizes.len())]
                } else {
                    size
                };
                let (ls, rs) = (size + next(3) * 64, size + next(3) * 96);
                let count = 1 + next(12);
                ops.push(op(l, r, size, count, ls, rs));
                l += count * ls + if next(3) == 0 { next(300) } else { 0 };
                r += count * rs + if next(3) == 0 { next(300) } else { 0 };
            }
            let mut p = CopyProgram::default();
            for o in &ops {
                p.push(*o).unwrap();
            }
            let local: Vec<u8> = (0..p.local_extent).map(|i| (i % 251) as u8).collect();
            let row: Vec<u8> = (0..p.row_extent).map(|i| (i % 241) as u8 ^ 0x5A).collect();
            let bytes: usize = ops.iter().map(|o| o.size * o.count).sum();
            for kernel in kernels() {
                let (mut want, mut got) = (vec![0xEE; row.len()], vec![0xEE; row.len()]);
                naive(&ops, &local, &mut want, true);
                let moved = p.execute(&local, &mut got, Flow::LocalToRow, kernel);
                assert_eq!(moved, Some(bytes as u64));
                assert!(want == got, "gather {kernel:?} {ops:?}");
                let (mut want, mut got) = (vec![0xEE; local.len()], vec![0xEE; local.len()]);
                naive(&ops, &row, &mut want, false);
                p.execute(&row, &mut got, Flow::RowToLocal, kernel).unwrap();
                assert!(want == got, "scatter {kernel:?} {ops:?}");
            }
        }
    }

    #[test]
    fn short_buffers_are_refused_untouched() {
        let mut p = CopyProgram::default();
        p.push(op(0, 64, 256, 4, 256, 1024)).unwrap();
        let local = vec![1u8; 1024];
        let mut row = vec![0u8; 64 + 3 * 1024 + 255];
        assert_eq!(p.local_to_row(&local, &mut row), None);
        assert!(row.iter().all(|&b| b == 0));
        let mut row = vec![0u8; 64 + 3 * 1024 + 256];
        assert_eq!(p.local_to_row(&local, &mut row), Some(1024));
        let mut short_local = vec![0u8; 1023];
        assert_eq!(p.row_to_local(&row, &mut short_local), None);
        assert!(short_local.iter().all(|&b| b == 0));
    }

    #[test]
    fn overflowing_copies_are_rejected() {
        let mut p = CopyProgram::default();
        assert_eq!(p.push(op(0, 0, 16, 3, usize::MAX / 2, 16)), None);
        assert_eq!(p.push(op(usize::MAX - 8, 0, 16, 1, 0, 0)), None);
        assert_eq!(p, CopyProgram::default());
    }
}
