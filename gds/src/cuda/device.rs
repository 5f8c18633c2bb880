//! [`CudaDevice`]: the [`Device`] trait on an NVIDIA GPU. Memory and 2-D copies through cudarc's
//! driver API, file I/O through cuFile ([`super::cufile`]), the row CRC over a pinned host copy.
//!
//! **CRC.** Each row's CRC-32 is computed over a pinned host copy of the staging row
//! (`cuMemcpyDtoH`, then crc32fast per 4 KiB piece, composed like the CPU path's whole-row
//! CRC): one extra device-to-host transfer of the row over PCIe and about 0.1 ms of one core
//! per 2 MiB row (crc32fast at 13-20 GB/s). A CRC kernel would avoid both; the composition
//! ([`crate::crc`]) is written for its per-piece output.
//!
//! Nothing here runs on the development machines (no GPU): this module is built and linted in
//! CI, and exercised by `gds/device-check.sh` on a machine with a GPU.

use std::ffi::c_void;
use std::fs::File;
use std::os::fd::AsRawFd;

use cudarc::driver::{result as cu, sys};
use parking_lot::Mutex;

use super::cufile::{CuFile, check};
use crate::device::{ALIGN, Device, FileId, Flow};
use crate::error::{GdsError, GdsErrorKind, Result};
use crate::mode::{DriverFacts, TransferMode};
use crate::plan::DeviceCopy;
use crate::probe::{Availability, probe};

fn cuda(what: &str, e: cudarc::driver::DriverError) -> GdsError {
    GdsError::new(GdsErrorKind::Cuda, format!("{what}: {e:?}"))
}

/// A registered slab file.
struct Registered {
    handle: cudarc::cufile::sys::CUfileHandle_t,
    _file: File,
}

/// One GPU with cuFile open.
pub struct CudaDevice {
    ordinal: i32,
    name: String,
    ctx: sys::CUcontext,
    cufile: CuFile,
    facts: DriverFacts,
    files: Mutex<Vec<Registered>>,
    allocs: Mutex<Vec<(u64, u64)>>,
}

// SAFETY: the context handle is a process-wide driver object usable from any thread once made
// current (every call does); cuFile handles are thread-safe per the cuFile API; the lists are
// behind mutexes.
unsafe impl Send for CudaDevice {}
// SAFETY: as above.
unsafe impl Sync for CudaDevice {}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("cufile", &self.cufile.name)
            .finish()
    }
}

impl CudaDevice {
    /// Opens GPU `ordinal` and the cuFile driver, after [`probe`] found the libraries (so no
    /// cudarc call can panic on a missing one). `Unavailable` when GDS cannot start.
    pub fn open(ordinal: i32) -> Result<Self> {
        let libs = match probe() {
            Availability::Absent(why) => {
                return Err(GdsError::new(GdsErrorKind::Unavailable, why));
            }
            Availability::Present(l) => l,
        };
        let unavailable = |what: &str, e: cudarc::driver::DriverError| {
            GdsError::new(GdsErrorKind::Unavailable, format!("{what}: {e:?}"))
        };
        cu::init().map_err(|e| unavailable("cuInit (no usable GPU?)", e))?;
        let dev = cu::device::get(ordinal).map_err(|e| unavailable("cuDeviceGet", e))?;
        let name = cu::device::get_name(dev).unwrap_or_else(|_| "GPU".into());
        // SAFETY: `dev` is a valid device from cuDeviceGet; the primary context is released
        // when the device is dropped.
        let ctx = unsafe { cu::primary_ctx::retain(dev) }
            .map_err(|e| unavailable("cuDevicePrimaryCtxRetain", e))?;
        // SAFETY: `ctx` was just retained.
        unsafe { cu::ctx::set_current(ctx) }.map_err(|e| unavailable("cuCtxSetCurrent", e))?;
        let cufile = CuFile::load(&libs.cufile)?;
        // SAFETY: cuFileDriverOpen takes no arguments; the library is loaded.
        check("cuFileDriverOpen", unsafe { (cufile.driver_open)() })
            .map_err(|e| GdsError::new(GdsErrorKind::Unavailable, e.message))?;
        // SAFETY: zeroed is a valid value of this plain C struct; the call fills it.
        let mut props: cudarc::cufile::sys::CUfileDrvProps_t = unsafe { std::mem::zeroed() };
        // SAFETY: `props` is a valid out-pointer.
        check("cuFileDriverGetProperties", unsafe {
            (cufile.get_properties)(&mut props)
        })?;
        let facts = DriverFacts {
            nvidia_fs: libs.nvidia_fs.is_some() && props.nvfs.major_version > 0,
            status_flags: props.nvfs.dstatusflags,
            control_flags: props.nvfs.dcontrolflags,
        };
        Ok(CudaDevice {
            ordinal,
            name,
            ctx,
            cufile,
            facts,
            files: Mutex::new(Vec::new()),
            allocs: Mutex::new(Vec::new()),
        })
    }

    /// What the cuFile driver reported.
    pub fn driver_facts(&self) -> DriverFacts {
        self.facts
    }

    /// The mode cuFile will use for a slab on a filesystem of `statfs` magic `fs_magic`, or
    /// why it cannot run there.
    pub fn mode_for(&self, fs_magic: u64) -> std::result::Result<(TransferMode, String), String> {
        crate::mode::decide(&self.facts, &crate::mode::classify_fs(fs_magic))
    }

    fn current(&self) -> Result<()> {
        // SAFETY: `ctx` is the retained primary context, alive as long as `self`.
        unsafe { cu::ctx::set_current(self.ctx) }.map_err(|e| cuda("cuCtxSetCurrent", e))
    }

    /// Pins `len` bytes of host memory at `ptr` for DMA (the primary region, on the CPU
    /// path); [`CudaDevice::unpin_host`] undoes it.
    ///
    /// # Safety
    /// The memory must stay mapped until unpinned.
    pub unsafe fn pin_host(&self, ptr: *mut u8, len: usize) -> Result<()> {
        self.current()?;
        // SAFETY: the caller's contract; flags 0 = portable default.
        let r = unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, 0) };
        r.result().map_err(|e| cuda("cuMemHostRegister", e))
    }

    /// Unpins memory pinned by [`CudaDevice::pin_host`].
    ///
    /// # Safety
    /// `ptr` must have been pinned by `pin_host` and no copy may be using it.
    pub unsafe fn unpin_host(&self, ptr: *mut u8) -> Result<()> {
        self.current()?;
        // SAFETY: the caller's contract.
        unsafe { sys::cuMemHostUnregister(ptr.cast()) }
            .result()
            .map_err(|e| cuda("cuMemHostUnregister", e))
    }

    /// Copies `data` to device address `addr` (test and benchmark set-up).
    pub fn upload(&self, addr: u64, data: &[u8]) -> Result<()> {
        self.current()?;
        // SAFETY: `addr` must name `data.len()` bytes of an allocation of this device; the
        // copy is synchronous, so `data` outlives it.
        unsafe { cu::memcpy_htod_sync(addr, data) }.map_err(|e| cuda("cuMemcpyHtoD", e))
    }

    /// The `len` bytes at device address `addr`.
    pub fn download(&self, addr: u64, len: u64) -> Result<Vec<u8>> {
        self.current()?;
        let mut out = vec![0u8; len as usize];
        // SAFETY: synchronous copy into an owned buffer of the right length.
        unsafe { cu::memcpy_dtoh_sync(&mut out, addr) }.map_err(|e| cuda("cuMemcpyDtoH", e))?;
        Ok(out)
    }

    /// One 2-D copy (`count` fragments of `size` bytes at two pitches).
    ///
    /// # Safety
    /// Both sides must be valid for every fragment: device addresses inside allocations, host
    /// pointers valid for the call.
    unsafe fn copy_2d(&self, c: &DeviceCopy, row: Side, flow: Flow) -> Result<()> {
        let dev = Side::Device(c.device, c.device_stride.max(c.size));
        let row = row.offset(c.row, c.row_stride.max(c.size));
        let (src, dst) = match flow {
            Flow::ToRow => (dev, row),
            Flow::FromRow => (row, dev),
        };
        // SAFETY: zeroed is a valid value of this plain C struct (null pointers, 0 sizes).
        let mut p: sys::CUDA_MEMCPY2D = unsafe { std::mem::zeroed() };
        match src {
            Side::Device(a, pitch) => {
                p.srcMemoryType = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE;
                p.srcDevice = a;
                p.srcPitch = pitch as usize;
            }
            Side::Host(h, pitch) => {
                p.srcMemoryType = sys::CUmemorytype::CU_MEMORYTYPE_HOST;
                p.srcHost = h as *const c_void;
                p.srcPitch = pitch as usize;
            }
        }
        match dst {
            Side::Device(a, pitch) => {
                p.dstMemoryType = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE;
                p.dstDevice = a;
                p.dstPitch = pitch as usize;
            }
            Side::Host(h, pitch) => {
                p.dstMemoryType = sys::CUmemorytype::CU_MEMORYTYPE_HOST;
                p.dstHost = h as *mut c_void;
                p.dstPitch = pitch as usize;
            }
        }
        p.WidthInBytes = c.size as usize;
        p.Height = c.count as usize;
        // SAFETY: the caller's contract; `p` describes exactly the fragments of `c`.
        unsafe { sys::cuMemcpy2D_v2(&p) }
            .result()
            .map_err(|e| cuda("cuMemcpy2D", e))
    }

    fn registered(&self, id: FileId) -> Result<cudarc::cufile::sys::CUfileHandle_t> {
        self.files
            .lock()
            .get(id.0)
            .map(|r| r.handle)
            .ok_or_else(|| {
                GdsError::new(
                    GdsErrorKind::Plan,
                    format!("file {} is not registered", id.0),
                )
            })
    }
}

/// One side of a 2-D copy: a device address or a host pointer, with its pitch.
#[derive(Clone, Copy)]
enum Side {
    Device(u64, u64),
    Host(usize, u64),
}

impl Side {
    fn offset(self, by: u64, pitch: u64) -> Side {
        match self {
            Side::Device(a, _) => Side::Device(a + by, pitch),
            Side::Host(h, _) => Side::Host(h + by as usize, pitch),
        }
    }
}

impl Device for CudaDevice {
    fn describe(&self) -> String {
        format!(
            "GPU {} ({}), cuFile {}",
            self.ordinal, self.name, self.cufile.name
        )
    }

    fn alloc(&self, len: u64) -> Result<u64> {
        self.current()?;
        let size = (len as usize).next_multiple_of(ALIGN);
        // SAFETY: plain allocation; freed in `free` / `drop`.
        let addr = unsafe { cu::malloc_sync(size) }.map_err(|e| cuda("cuMemAlloc", e))?;
        // SAFETY: the range was just allocated; zeroing it is the contract of `alloc`.
        unsafe { cu::memset_d8_sync(addr, 0, size) }.map_err(|e| cuda("cuMemsetD8", e))?;
        // SAFETY: a device allocation of `size` bytes; deregistered before it is freed.
        let reg = unsafe { (self.cufile.buf_register)(addr as *const c_void, size, 0) };
        if let Err(e) = check("cuFileBufRegister", reg) {
            // SAFETY: allocated above, not registered.
            let _ = unsafe { cu::free_sync(addr) };
            return Err(e);
        }
        self.allocs.lock().push((addr, size as u64));
        Ok(addr)
    }

    fn free(&self, addr: u64) {
        let mut allocs = self.allocs.lock();
        if let Some(i) = allocs.iter().position(|a| a.0 == addr) {
            allocs.swap_remove(i);
            let _ = self.current();
            // SAFETY: registered and allocated in `alloc`, removed from the list: once.
            unsafe {
                let _ = (self.cufile.buf_deregister)(addr as *const c_void);
                let _ = cu::free_sync(addr);
            }
        }
    }

    fn zero(&self, addr: u64, len: u64) -> Result<()> {
        self.current()?;
        // SAFETY: the executor zeroes only its own staging rows.
        unsafe { cu::memset_d8_sync(addr, 0, len as usize) }.map_err(|e| cuda("cuMemsetD8", e))
    }

    fn register_file(&self, file: File) -> Result<FileId> {
        self.current()?;
        // SAFETY: zeroed is a valid value of this plain C struct; the fields are set below.
        let mut descr: cudarc::cufile::sys::CUfileDescr_t = unsafe { std::mem::zeroed() };
        descr.type_ = cudarc::cufile::sys::CUfileFileHandleType::CU_FILE_HANDLE_TYPE_OPAQUE_FD;
        descr.handle.fd = file.as_raw_fd();
        let mut handle: cudarc::cufile::sys::CUfileHandle_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer and descriptor; the file is kept open (in `Registered`)
        // until the handle is deregistered.
        check("cuFileHandleRegister", unsafe {
            (self.cufile.handle_register)(&mut handle, &mut descr)
        })?;
        let mut files = self.files.lock();
        files.push(Registered {
            handle,
            _file: file,
        });
        Ok(FileId(files.len() - 1))
    }

    fn copy_device_row(
        &self,
        row: u64,
        _row_len: u64,
        copies: &[DeviceCopy],
        flow: Flow,
    ) -> Result<()> {
        self.current()?;
        for c in copies.iter().filter(|c| c.count > 0 && c.size > 0) {
            // SAFETY: the plan's copies name the caller's registered KV blocks and the
            // executor's staging row (its extent checked by the planner's row bounds).
            unsafe { self.copy_2d(c, Side::Device(row, 0), flow)? };
        }
        Ok(())
    }

    unsafe fn copy_host_row(
        &self,
        row: *mut u8,
        row_len: usize,
        copies: &[DeviceCopy],
        flow: Flow,
    ) -> Result<()> {
        self.current()?;
        for c in copies.iter().filter(|c| c.count > 0 && c.size > 0) {
            if c.row_end() > row_len as u64 {
                return Err(GdsError::new(
                    GdsErrorKind::Plan,
                    format!("copy reaches row byte {} of {row_len}", c.row_end()),
                ));
            }
            // SAFETY: the caller's contract for `row`; the row side is in bounds (checked).
            unsafe { self.copy_2d(c, Side::Host(row as usize, 0), flow)? };
        }
        Ok(())
    }

    fn crc_pieces(&self, addr: u64, len: u64) -> Result<Vec<u32>> {
        // The pinned staging copy (see the module docs).
        let host = self.download(addr, len)?;
        Ok(crate::crc::piece_crcs_host(&host))
    }

    fn write_file(&self, file: FileId, offset: u64, src: u64, len: u64) -> Result<u64> {
        let h = self.registered(file)?;
        self.current()?;
        // SAFETY: `src` is a registered device allocation of at least `len` bytes (a staging
        // row) that nothing writes until this returns; `h` is a live handle.
        let n =
            unsafe { (self.cufile.write)(h, src as *const c_void, len as usize, offset as i64, 0) };
        io_result("cuFileWrite", n)
    }

    fn read_file(&self, file: FileId, offset: u64, dst: u64, len: u64) -> Result<u64> {
        let h = self.registered(file)?;
        self.current()?;
        // SAFETY: `dst` is a registered device allocation of at least `len` bytes that
        // nothing else touches until this returns; `h` is a live handle.
        let n =
            unsafe { (self.cufile.read)(h, dst as *mut c_void, len as usize, offset as i64, 0) };
        io_result("cuFileRead", n)
    }
}

/// cuFileRead/Write return bytes moved, `-1` with errno, or `-CU_FILE_*` codes.
fn io_result(what: &str, n: isize) -> Result<u64> {
    if n >= 0 {
        Ok(n as u64)
    } else if n == -1 {
        Err(GdsError::new(
            GdsErrorKind::Io,
            format!("{what}: {}", std::io::Error::last_os_error()),
        ))
    } else {
        Err(GdsError::new(
            GdsErrorKind::CuFile,
            format!("{what}: cuFile error {}", -n),
        ))
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        let _ = self.current();
        for (addr, _) in self.allocs.get_mut().drain(..) {
            // SAFETY: registered and allocated in `alloc`; drained, so freed once.
            unsafe {
                let _ = (self.cufile.buf_deregister)(addr as *const c_void);
                let _ = cu::free_sync(addr);
            }
        }
        for r in self.files.get_mut().drain(..) {
            // SAFETY: registered in `register_file`; the file closes after (drop order).
            unsafe { (self.cufile.handle_deregister)(r.handle) };
        }
        if let Ok(dev) = cu::device::get(self.ordinal) {
            // SAFETY: retained in `open`, released once.
            let _ = unsafe { cu::primary_ctx::release(dev) };
        }
    }
}
