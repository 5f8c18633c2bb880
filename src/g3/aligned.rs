//! A heap buffer aligned to 4096 bytes, for O_DIRECT reads and writes outside the primary
//! region (superblocks, admin verification). The only `unsafe` here is allocation.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

use crate::error::{Error, ErrorKind, Result};
use crate::geometry::ROW_ALIGNMENT as BUF_ALIGN;

/// A zero-initialised, 4096-aligned byte buffer.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer is plain owned memory, like a `Vec<u8>`.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (`len` > 0, a multiple of 4096).
    pub fn new(len: usize) -> Result<Self> {
        if len == 0 || !len.is_multiple_of(BUF_ALIGN) {
            return Err(Error::new(
                ErrorKind::Misaligned,
                format!("aligned buffer length {len} is not a positive multiple of {BUF_ALIGN}"),
            ));
        }
        let layout = Layout::from_size_align(len, BUF_ALIGN)
            .map_err(|e| Error::new(ErrorKind::Internal, format!("buffer layout: {e}")))?;
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            Error::new(
                ErrorKind::NoSpace,
                format!("cannot allocate {len} aligned bytes"),
            )
        })?;
        Ok(AlignedBuf { ptr, layout })
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` owns `layout.size()` initialised (zeroed) bytes for our lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the view exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this layout and not freed before.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        let mut b = AlignedBuf::new(8192).unwrap();
        assert_eq!(b.as_slice().as_ptr() as usize % BUF_ALIGN, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[5] = 7;
        assert_eq!(b.as_slice()[5], 7);
        assert!(AlignedBuf::new(100).is_err());
    }
}
