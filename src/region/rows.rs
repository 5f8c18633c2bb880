//! Row access: addresses for the I/O engines, and leased views for CPU code.
//!
//! CPU code reads or writes a row through a lease: [`PrimaryRegion::read_row`] returns a
//! [`RowRead`] (derefs to `&[u8]`), [`PrimaryRegion::write_row`] a [`RowWrite`] (derefs to
//! `&mut [u8]`). Each row has one atomic lease word in its region: any number of read leases,
//! or one write lease. A lease that would overlap a write lease (or a write lease that would
//! overlap any lease) is refused with an [`ErrorKind::Contract`] error naming the row; it never
//! waits. The lease ends when the guard is dropped. Taking and ending a lease costs one atomic
//! operation each (a compare-and-swap, then a subtraction or a store), on the row's own word.
//!
//! What a lease guarantees, and what it does not, is written on [`RowRead`].

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

use super::PrimaryRegion;
use crate::error::{Error, ErrorKind, Result};

/// The lease word of a row held by a writer; below it, the number of readers.
const WRITER: u32 = u32::MAX;

/// One lease word per row (see the module docs).
pub(super) struct Leases(Box<[AtomicU32]>);

impl Leases {
    /// Words for `rows` rows, all free.
    pub(super) fn new(rows: usize) -> Self {
        Leases((0..rows).map(|_| AtomicU32::new(0)).collect())
    }
}

impl fmt::Debug for Leases {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let held = self
            .0
            .iter()
            .filter(|w| w.load(Ordering::Relaxed) != 0)
            .count();
        write!(f, "Leases {{ rows: {}, held: {held} }}", self.0.len())
    }
}

impl PrimaryRegion {
    /// Byte offset of `row` from the base, or an error if `row` is out of range.
    pub fn row_offset(&self, row: usize) -> Result<usize> {
        if row >= self.num_rows {
            return Err(Error::new(
                ErrorKind::Contract,
                format!(
                    "row {row} is out of range (region has {} rows)",
                    self.num_rows
                ),
            ));
        }
        Ok(row * self.row_stride)
    }

    /// Address of `row`, for I/O engines and device copies. Valid for `row_stride` bytes while
    /// the region lives; who may write there is the slot states' business (see [`RowRead`]). CPU
    /// code reads and writes rows with [`PrimaryRegion::read_row`] and
    /// [`PrimaryRegion::write_row`].
    pub fn row_ptr(&self, row: usize) -> Result<*mut u8> {
        let off = self.row_offset(row)?;
        // SAFETY: `off + row_stride <= len`, inside the mapping.
        Ok(unsafe { self.base.as_ptr().add(off) })
    }

    /// A read lease on `row`: a shared view of its bytes until the guard is dropped. Refused
    /// (an [`ErrorKind::Contract`] error naming the row) while the row is leased for writing,
    /// or when `row` is out of range. See [`RowRead`] for what a lease
    /// guarantees.
    pub fn read_row(&self, row: usize) -> Result<RowRead<'_>> {
        let ptr = self.row_ptr(row)?;
        let word = &self.leases.0[row];
        word.fetch_update(Ordering::Acquire, Ordering::Relaxed, |n| {
            n.checked_add(1).filter(|&m| m < WRITER)
        })
        .map_err(|n| self.refused(row, "read", n))?;
        Ok(RowRead {
            word,
            bytes: row_bytes(ptr),
            len: self.row_stride,
            row,
            _view: PhantomData,
        })
    }

    /// A write lease on `row`: an exclusive view of its bytes until the guard is dropped.
    /// Refused (an [`ErrorKind::Contract`] error naming the row) while the row has any other
    /// lease, or when `row` is out of range. See [`RowRead`] for what a lease guarantees.
    pub fn write_row(&self, row: usize) -> Result<RowWrite<'_>> {
        let ptr = self.row_ptr(row)?;
        let word = &self.leases.0[row];
        word.compare_exchange(0, WRITER, Ordering::Acquire, Ordering::Relaxed)
            .map_err(|n| self.refused(row, "write", n))?;
        Ok(RowWrite {
            word,
            bytes: row_bytes(ptr),
            len: self.row_stride,
            row,
            _view: PhantomData,
        })
    }

    /// Copies `len` bytes of the file `src` from `src_offset` into the start of `row`, the
    /// kernel writing them (`pread` with the row's address as the buffer, under a write lease
    /// on the row): where the row's page is gone (the owner of a shared file shrank it), the
    /// copy fails with `EFAULT` instead of raising `SIGBUS` as a CPU store would. The outer
    /// error is a refused lease or a range outside the row; the inner one the copy's
    /// failure: [`RowCopyError`].
    pub fn copy_file_into_row(
        &self,
        row: usize,
        len: usize,
        src: BorrowedFd<'_>,
        src_offset: u64,
    ) -> Result<std::result::Result<(), RowCopyError>> {
        let lease = self.write_row(row)?;
        if len > lease.len {
            return Err(Error::new(
                ErrorKind::Contract,
                format!(
                    "a copy of {len} bytes does not fit row {row} ({} bytes)",
                    lease.len
                ),
            ));
        }
        let dst = lease.bytes.as_ptr();
        let mut done = 0;
        while done < len {
            let Ok(at) = i64::try_from(src_offset + done as u64) else {
                return Ok(Err(RowCopyError::SourceOffset));
            };
            // SAFETY: `dst + done .. dst + len` lies inside the row (checked above), leased
            // for writing; no Rust reference to it is made here: the kernel writes it or fails
            // with EFAULT. rustix's `pread` takes only slices, which would assert that the
            // bytes are accessible: libc with the raw pointer.
            let n = unsafe {
                libc::pread(
                    src.as_raw_fd(),
                    dst.add(done).cast::<libc::c_void>(),
                    len - done,
                    at,
                )
            };
            match n {
                0 => return Ok(Err(RowCopyError::Short)),
                n if n > 0 => done += n as usize,
                _ => {
                    let e = std::io::Error::last_os_error();
                    if e.raw_os_error() != Some(libc::EINTR) {
                        return Ok(Err(RowCopyError::Os(e)));
                    }
                }
            }
        }
        Ok(Ok(()))
    }

    fn refused(&self, row: usize, wanted: &str, word: u32) -> Error {
        let held = match word {
            WRITER => "it is leased for writing".to_string(),
            n => format!("it is leased to {n} reader(s)"),
        };
        Error::new(
            ErrorKind::Contract,
            format!(
                "a {wanted} lease on row {row} of the primary region is refused: {held} (a row \
                 has one writer or any number of readers)"
            ),
        )
        .with("row", row.to_string())
    }
}

/// Why [`PrimaryRegion::copy_file_into_row`] stopped.
#[derive(Debug)]
pub enum RowCopyError {
    /// The source ended first (`pread` returned 0).
    Short,
    /// The source offset does not fit `off_t`.
    SourceOffset,
    /// `pread` failed (`EFAULT`: the row's page is gone).
    Os(std::io::Error),
}

fn row_bytes(ptr: *mut u8) -> NonNull<u8> {
    // A row address is inside the region's mapping, whose base is non-null.
    NonNull::new(ptr).unwrap_or(NonNull::dangling())
}

/// A read lease on one row ([`PrimaryRegion::read_row`]): derefs to the row's bytes; the lease
/// ends on drop.
///
/// # What a lease guarantees, and what it does not
/// * The view is in bounds (exactly the row's `row_stride` bytes) and stays valid while the
///   guard lives: the region outlives the guard (it borrows the region).
/// * Among leases of the same [`PrimaryRegion`] value, a write lease is exclusive and read
///   leases exclude writes: two guards can never give two live `&mut [u8]` (or a `&mut` and a
///   `&`) over the same row, whatever the callers do.
/// * Ending a lease publishes its writes (release) to the next lease of the row (acquire), on
///   any thread.
///
/// It does not arbitrate writers that are not CPU code of this region: the kernel (an I/O
/// engine's `O_DIRECT` transfer or io_uring fixed-buffer copy), a GPU copy, another mapping of
/// the same memory (another [`PrimaryRegion`] value over the same shared file, or another
/// process such as vLLM). Those reach the rows through [`PrimaryRegion::row_ptr`] and
/// [`PrimaryRegion::base_ptr`] under the slot states that the caller holds: a row reserved for
/// a load is written by exactly one transfer and read only after it completed; a pinned row is
/// only read. A caller that takes a lease on a row it has not reserved or pinned that way can
/// see the row's bytes change while it looks at them (torn data, which the CRCs kvtier keeps
/// catch), never memory outside the row.
pub struct RowRead<'a> {
    word: &'a AtomicU32,
    bytes: NonNull<u8>,
    len: usize,
    row: usize,
    _view: PhantomData<&'a [u8]>,
}

/// A write lease on one row ([`PrimaryRegion::write_row`]): derefs (mutably) to the row's
/// bytes; the lease ends on drop.
pub struct RowWrite<'a> {
    word: &'a AtomicU32,
    bytes: NonNull<u8>,
    len: usize,
    row: usize,
    _view: PhantomData<&'a mut [u8]>,
}

// SAFETY: a `RowRead` is a `&[u8]` plus a lease word it decrements atomically; both may move
// to and be shared with other threads.
unsafe impl Send for RowRead<'_> {}
// SAFETY: as above.
unsafe impl Sync for RowRead<'_> {}
// SAFETY: a `RowWrite` is a `&mut [u8]` plus a lease word it resets atomically.
unsafe impl Send for RowWrite<'_> {}
// SAFETY: `&RowWrite` only gives `&[u8]`.
unsafe impl Sync for RowWrite<'_> {}

impl RowRead<'_> {
    /// The row leased.
    pub fn row(&self) -> usize {
        self.row
    }
}

impl RowWrite<'_> {
    /// The row leased.
    pub fn row(&self) -> usize {
        self.row
    }
}

impl Deref for RowRead<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `bytes` is the row's address, valid for `len` bytes while the region (which
        // this guard borrows) lives; the read lease excludes write leases (module docs).
        unsafe { std::slice::from_raw_parts(self.bytes.as_ptr(), self.len) }
    }
}

impl Deref for RowWrite<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: as `RowRead`; the write lease excludes every other lease.
        unsafe { std::slice::from_raw_parts(self.bytes.as_ptr(), self.len) }
    }
}

impl DerefMut for RowWrite<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes this the only view through this lease.
        unsafe { std::slice::from_raw_parts_mut(self.bytes.as_ptr(), self.len) }
    }
}

impl Drop for RowRead<'_> {
    fn drop(&mut self) {
        self.word.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for RowWrite<'_> {
    fn drop(&mut self) {
        self.word.store(0, Ordering::Release);
    }
}

impl fmt::Debug for RowRead<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RowRead {{ row: {}, len: {} }}", self.row, self.len)
    }
}

impl fmt::Debug for RowWrite<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RowWrite {{ row: {}, len: {} }}", self.row, self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_lease_excludes_every_other_lease_until_dropped() {
        let r = PrimaryRegion::create(4, 4096).unwrap();
        let mut w = r.write_row(2).unwrap();
        w.fill(0x5A);
        for e in [r.read_row(2).unwrap_err(), r.write_row(2).unwrap_err()] {
            assert_eq!(e.kind(), ErrorKind::Contract);
            assert_eq!(e.context_value("row"), Some("2"), "{e}");
            assert!(e.message().contains("leased for writing"), "{e}");
        }
        // Other rows are free.
        assert!(r.write_row(1).is_ok());
        drop(w);
        let a = r.read_row(2).unwrap();
        assert!(a.iter().all(|&b| b == 0x5A));
        assert_eq!(a.len(), 4096);
        assert_eq!(a.row(), 2);
        drop(a);
        assert!(r.write_row(2).is_ok());
    }

    #[test]
    fn read_leases_share_a_row_and_exclude_a_writer_until_the_last_is_dropped() {
        let r = PrimaryRegion::create(2, 4096).unwrap();
        let a = r.read_row(0).unwrap();
        let b = r.read_row(0).unwrap();
        let e = r.write_row(0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Contract);
        assert!(e.message().contains("2 reader(s)"), "{e}");
        drop(a);
        assert!(r.write_row(0).is_err(), "one reader is left");
        drop(b);
        let mut w = r.write_row(0).unwrap();
        w[7] = 9;
        drop(w);
        assert_eq!(r.read_row(0).unwrap()[7], 9);
    }

    #[test]
    fn a_lease_out_of_range_is_refused() {
        let r = PrimaryRegion::create(2, 4096).unwrap();
        assert_eq!(r.read_row(2).unwrap_err().kind(), ErrorKind::Contract);
        assert_eq!(
            r.write_row(usize::MAX).unwrap_err().kind(),
            ErrorKind::Contract
        );
    }

    #[test]
    fn a_write_on_one_thread_is_seen_by_a_read_lease_on_another() {
        let r = std::sync::Arc::new(PrimaryRegion::create(1, 8192).unwrap());
        let writer = {
            let r = r.clone();
            std::thread::spawn(move || r.write_row(0).unwrap().fill(0xC3))
        };
        writer.join().unwrap();
        assert!(r.read_row(0).unwrap().iter().all(|&b| b == 0xC3));
    }
}
