//! What the GDS data path needs of a GPU, as a trait, and [`HostDevice`]: host memory standing
//! in for GPU memory, with every address checked against its allocations, so the planning
//! and the executor run (and are tested) on a machine without a GPU.
//!
//! Addresses are plain `u64`s: GPU virtual addresses on [`crate::cuda::CudaDevice`], host
//! addresses of the stand-in's allocations on [`HostDevice`].

use std::alloc::Layout;
use std::fs::File;
use std::os::unix::fs::FileExt;

use parking_lot::Mutex;

use crate::error::{GdsError, GdsErrorKind, Result};
use crate::plan::DeviceCopy;

/// Alignment of every allocation (O_DIRECT and cuFile's page size).
pub const ALIGN: usize = 4096;

/// A slab file registered with a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileId(pub usize);

/// Which way a copy moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// GPU blocks -> row (store).
    ToRow,
    /// Row -> GPU blocks (load).
    FromRow,
}

/// The operations the GDS executor uses. Implementations are shared by the executor's I/O
/// threads (`Sync`).
pub trait Device: Send + Sync {
    /// What this device is, for reports.
    fn describe(&self) -> String;
    /// Allocates `len` bytes of zeroed device memory, [`ALIGN`]-aligned, ready for file I/O
    /// (registered with cuFile on a GPU).
    fn alloc(&self, len: u64) -> Result<u64>;
    /// Frees an allocation made by [`Device::alloc`].
    fn free(&self, addr: u64);
    /// Sets `len` bytes at `addr` to zero.
    fn zero(&self, addr: u64, len: u64) -> Result<()>;
    /// Registers a slab file (its O_DIRECT descriptor) for file I/O.
    fn register_file(&self, file: File) -> Result<FileId>;
    /// Runs `copies` between GPU memory and the device row at `row` (`row_len` bytes), in the
    /// direction `flow`; returns when the bytes have moved.
    fn copy_device_row(
        &self,
        row: u64,
        row_len: u64,
        copies: &[DeviceCopy],
        flow: Flow,
    ) -> Result<()>;
    /// Runs `copies` between GPU memory and a host row (the CPU path: the pinned primary row).
    ///
    /// # Safety
    /// `row` must be valid for reads and writes of `row_len` bytes for the whole call, and
    /// nothing else may access those bytes meanwhile.
    unsafe fn copy_host_row(
        &self,
        row: *mut u8,
        row_len: usize,
        copies: &[DeviceCopy],
        flow: Flow,
    ) -> Result<()>;
    /// [`Device::copy_host_row`] for a row the caller holds as `&mut [u8]` (a primary row's
    /// write lease), which is what the contract asks: valid for its length, and nobody else's
    /// for the call.
    fn copy_row(&self, row: &mut [u8], copies: &[DeviceCopy], flow: Flow) -> Result<()> {
        // SAFETY: `row` is an exclusive borrow of `row.len()` bytes, alive for the whole call.
        unsafe { self.copy_host_row(row.as_mut_ptr(), row.len(), copies, flow) }
    }
    /// The CRC-32 of each [`crate::crc::PIECE_BYTES`] piece of `len` bytes at `addr`.
    fn crc_pieces(&self, addr: u64, len: u64) -> Result<Vec<u32>>;
    /// Writes `len` bytes from device address `src` at `offset` of a registered file; returns
    /// the bytes written.
    fn write_file(&self, file: FileId, offset: u64, src: u64, len: u64) -> Result<u64>;
    /// Reads `len` bytes at `offset` of a registered file into device address `dst`; returns
    /// the bytes read.
    fn read_file(&self, file: FileId, offset: u64, dst: u64, len: u64) -> Result<u64>;
}

/// One allocation of the host stand-in.
struct HostAlloc {
    addr: usize,
    len: usize,
    layout: Layout,
}

/// Host memory standing in for GPU memory. Every address a call names must lie inside one
/// live allocation (checked, an error otherwise), so a planning mistake shows as an error in
/// tests instead of touching memory it should not. File I/O is `pread`/`pwrite` on the
/// registered descriptor (O_DIRECT slab descriptors work: allocations are 4 KiB aligned).
#[derive(Default)]
pub struct HostDevice {
    allocs: Mutex<Vec<HostAlloc>>,
    files: Mutex<Vec<File>>,
}

impl std::fmt::Debug for HostDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostDevice")
            .field("allocations", &self.allocs.lock().len())
            .finish()
    }
}

fn range_error(addr: u64, len: u64) -> GdsError {
    GdsError::new(
        GdsErrorKind::Plan,
        format!("device range {addr:#x}+{len} lies in no allocation"),
    )
}

impl HostDevice {
    /// An empty stand-in device.
    pub fn new() -> Self {
        HostDevice::default()
    }

    /// Checks that `[addr, addr + len)` lies inside one allocation.
    fn check(&self, addr: u64, len: u64) -> Result<()> {
        let end = addr
            .checked_add(len)
            .ok_or_else(|| range_error(addr, len))?;
        let ok = self
            .allocs
            .lock()
            .iter()
            .any(|a| addr >= a.addr as u64 && end <= (a.addr + a.len) as u64);
        if ok {
            Ok(())
        } else {
            Err(range_error(addr, len))
        }
    }

    /// Checks every fragment extent of `copies` on the device side.
    fn check_copies(&self, copies: &[DeviceCopy]) -> Result<()> {
        for c in copies {
            if c.count == 0 || c.size == 0 {
                continue;
            }
            self.check(c.device, c.device_end() - c.device)?;
        }
        Ok(())
    }

    /// Copies `data` to `addr` (test set-up: filling "GPU memory").
    pub fn upload(&self, addr: u64, data: &[u8]) -> Result<()> {
        self.check(addr, data.len() as u64)?;
        // SAFETY: the range lies inside a live allocation (checked) that `data` (a borrow of
        // caller memory) cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len()) };
        Ok(())
    }

    /// The `len` bytes at `addr` (test check: reading "GPU memory").
    pub fn download(&self, addr: u64, len: u64) -> Result<Vec<u8>> {
        self.check(addr, len)?;
        let mut out = vec![0u8; len as usize];
        // SAFETY: the range lies inside a live allocation (checked).
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(out)
    }

    /// Moves the fragments of `copies` between device memory and the row at `row`.
    ///
    /// # Safety
    /// The device side of every copy was checked; `row` must be valid for `row_len` bytes and
    /// not overlap the device ranges.
    unsafe fn run_copies(
        &self,
        row: *mut u8,
        row_len: usize,
        copies: &[DeviceCopy],
        flow: Flow,
    ) -> Result<()> {
        for c in copies {
            if c.count == 0 || c.size == 0 {
                continue;
            }
            if c.row_end() > row_len as u64 {
                return Err(GdsError::new(
                    GdsErrorKind::Plan,
                    format!(
                        "copy reaches row byte {} of a {row_len}-byte row",
                        c.row_end()
                    ),
                ));
            }
            for i in 0..c.count {
                let d = (c.device + i * c.device_stride) as *mut u8;
                // SAFETY: `row_end` is inside the row (checked above), so is every fragment.
                let r = unsafe { row.add((c.row + i * c.row_stride) as usize) };
                let (src, dst) = match flow {
                    Flow::ToRow => (d as *const u8, r),
                    Flow::FromRow => (r as *const u8, d),
                };
                // SAFETY: the device fragment lies in a live allocation (the caller checked the
                // copy's extent), the row fragment inside the row; they do not overlap.
                unsafe { std::ptr::copy_nonoverlapping(src, dst, c.size as usize) };
            }
        }
        Ok(())
    }

    fn file(&self, id: FileId) -> Result<File> {
        let files = self.files.lock();
        let f = files.get(id.0).ok_or_else(|| {
            GdsError::new(
                GdsErrorKind::Plan,
                format!("file {} is not registered", id.0),
            )
        })?;
        f.try_clone()
            .map_err(|e| GdsError::new(GdsErrorKind::Io, format!("dup of a slab descriptor: {e}")))
    }
}

impl Drop for HostDevice {
    fn drop(&mut self) {
        for a in self.allocs.get_mut().drain(..) {
            // SAFETY: allocated in `alloc` with this layout, freed once (drained).
            unsafe { std::alloc::dealloc(a.addr as *mut u8, a.layout) };
        }
    }
}

impl Device for HostDevice {
    fn describe(&self) -> String {
        "host memory standing in for a GPU".into()
    }

    fn alloc(&self, len: u64) -> Result<u64> {
        let size = usize::try_from(len.max(1)).map_err(|_| range_error(0, len))?;
        let layout = Layout::from_size_align(size.next_multiple_of(ALIGN), ALIGN)
            .map_err(|e| GdsError::new(GdsErrorKind::Plan, format!("allocation of {len}: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            return Err(GdsError::new(
                GdsErrorKind::Unavailable,
                format!("out of memory allocating {len} bytes"),
            ));
        }
        self.allocs.lock().push(HostAlloc {
            addr: p as usize,
            len: size,
            layout,
        });
        Ok(p as u64)
    }

    fn free(&self, addr: u64) {
        let mut allocs = self.allocs.lock();
        if let Some(i) = allocs.iter().position(|a| a.addr as u64 == addr) {
            let a = allocs.swap_remove(i);
            // SAFETY: allocated in `alloc` with this layout; removed from the list, so freed
            // once.
            unsafe { std::alloc::dealloc(a.addr as *mut u8, a.layout) };
        }
    }

    fn zero(&self, addr: u64, len: u64) -> Result<()> {
        self.check(addr, len)?;
        // SAFETY: the range lies inside a live allocation (checked).
        unsafe { std::ptr::write_bytes(addr as *mut u8, 0, len as usize) };
        Ok(())
    }

    fn register_file(&self, file: File) -> Result<FileId> {
        let mut files = self.files.lock();
        files.push(file);
        Ok(FileId(files.len() - 1))
    }

    fn copy_device_row(
        &self,
        row: u64,
        row_len: u64,
        copies: &[DeviceCopy],
        flow: Flow,
    ) -> Result<()> {
        self.check(row, row_len)?;
        self.check_copies(copies)?;
        // SAFETY: the row and every copy's device extent lie in live allocations (checked);
        // a plan never names the staging row as GPU blocks.
        unsafe { self.run_copies(row as *mut u8, row_len as usize, copies, flow) }
    }

    unsafe fn copy_host_row(
        &self,
        row: *mut u8,
        row_len: usize,
        copies: &[DeviceCopy],
        flow: Flow,
    ) -> Result<()> {
        self.check_copies(copies)?;
        // SAFETY: the caller's contract for `row`; device extents checked.
        unsafe { self.run_copies(row, row_len, copies, flow) }
    }

    fn crc_pieces(&self, addr: u64, len: u64) -> Result<Vec<u32>> {
        let bytes = self.download(addr, len)?;
        Ok(crate::crc::piece_crcs_host(&bytes))
    }

    fn write_file(&self, file: FileId, offset: u64, src: u64, len: u64) -> Result<u64> {
        self.check(src, len)?;
        let f = self.file(file)?;
        // SAFETY: the range lies inside a live allocation (checked); the executor does not
        // write a row while it is being written to the file.
        let buf = unsafe { std::slice::from_raw_parts(src as *const u8, len as usize) };
        f.write_at(buf, offset)
            .map(|n| n as u64)
            .map_err(|e| GdsError::new(GdsErrorKind::Io, format!("pwrite at {offset}: {e}")))
    }

    fn read_file(&self, file: FileId, offset: u64, dst: u64, len: u64) -> Result<u64> {
        self.check(dst, len)?;
        let f = self.file(file)?;
        // SAFETY: the range lies inside a live allocation (checked); nothing else touches the
        // row while it is read into.
        let buf = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len as usize) };
        f.read_at(buf, offset)
            .map(|n| n as u64)
            .map_err(|e| GdsError::new(GdsErrorKind::Io, format!("pread at {offset}: {e}")))
    }
}
