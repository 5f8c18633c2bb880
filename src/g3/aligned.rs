//! A heap buffer aligned to [`ROW_ALIGNMENT`], for O_DIRECT reads and writes outside the
//! primary region (superblocks, admin verification), held in an `aligned-vec` vector: no
//! allocator code and no `unsafe` here.

use aligned_vec::{AVec, ConstAlign};

use crate::error::{Error, ErrorKind, Result};
use crate::geometry::ROW_ALIGNMENT;

/// A zero-initialised byte buffer whose address and length are multiples of
/// [`ROW_ALIGNMENT`].
pub struct AlignedBuf {
    bytes: AVec<u8, ConstAlign<ROW_ALIGNMENT>>,
}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (`len` > 0, a multiple of [`ROW_ALIGNMENT`]). An
    /// allocation the system refuses is an [`ErrorKind::NoSpace`] error, not an abort.
    pub fn new(len: usize) -> Result<Self> {
        if len == 0 || !len.is_multiple_of(ROW_ALIGNMENT) {
            return Err(Error::new(
                ErrorKind::Misaligned,
                format!(
                    "aligned buffer length {len} is not a positive multiple of {ROW_ALIGNMENT}"
                ),
            ));
        }
        let mut bytes = AVec::new(ROW_ALIGNMENT);
        bytes.try_reserve_exact(len).map_err(|e| {
            Error::new(
                ErrorKind::NoSpace,
                format!("cannot allocate {len} aligned bytes: {e:?}"),
            )
        })?;
        bytes.resize(len, 0);
        Ok(AlignedBuf { bytes })
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.bytes.as_slice()
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.bytes.as_mut_slice()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        let mut b = AlignedBuf::new(8192).unwrap();
        assert_eq!(b.as_slice().len(), 8192);
        assert_eq!(b.as_slice().as_ptr() as usize % ROW_ALIGNMENT, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[5] = 7;
        assert_eq!(b.as_slice()[5], 7);
        assert!(AlignedBuf::new(100).is_err());
        assert!(AlignedBuf::new(0).is_err());
    }
}
