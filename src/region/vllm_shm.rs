//! A region made the way vLLM 0.33 makes its shared offload region, for benchmarks and tests
//! that must see what the Python tier sees.
//!
//! `vllm/v1/kv_offload/cpu/shared_offload_region.py` (one segment, the default): a file in
//! `/dev/shm` created with `O_CREAT | O_EXCL | O_RDWR, 0o600`, sized with `ftruncate`, mapped
//! whole with Python's `mmap.mmap(fd, size, MAP_SHARED, PROT_READ | PROT_WRITE)` (an address of
//! the kernel's choosing, 4 KiB pages), unlinked once every worker has mapped it, its
//! descriptor kept open, and pre-faulted with `MADV_POPULATE_WRITE`. [`OwnerMapping`] does
//! exactly that; [`super::PrimaryRegion::create_vllm_shaped`] then adopts it through
//! [`super::PrimaryRegion::adopt_shared`], the path the Python tier (`kvtier.vllm.KvtierTier`)
//! takes.

use std::ffi::c_void;
use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::ptr::null_mut;

use rustix::mm::{Advice, MapFlags, ProtFlags, madvise, mmap, munmap};

use crate::error::{Error, ErrorKind, Result};

/// The "owner" side: vLLM's mapping of its `/dev/shm` file. Unpinned, unmapped (and its
/// descriptor closed) on drop.
#[derive(Debug)]
pub(super) struct OwnerMapping {
    pub(super) ptr: *mut c_void,
    len: usize,
    _file: File,
    /// The long-term pin `cudaHostRegister` takes, when asked for ([`OwnerMapping::pin`]).
    pin: Option<super::pin::LongTermPin>,
}

impl OwnerMapping {
    /// Creates `dir/kvtier_vllm_offload_<pid>_<n>.mmap` of `len` bytes, maps it, unlinks it and
    /// pre-faults it, as vLLM does.
    pub(super) fn create(dir: &Path, len: usize) -> Result<Self> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path: PathBuf = dir.join(format!(
            "kvtier_vllm_offload_{}_{n}.mmap",
            std::process::id()
        ));
        if let Ok(vfs) = rustix::fs::statvfs(dir) {
            let free = vfs.f_bavail.saturating_mul(vfs.f_frsize);
            if free < len as u64 {
                return Err(Error::new(
                    ErrorKind::NoSpace,
                    format!(
                        "{}: {free} bytes free, the vLLM-shaped region needs {len}",
                        dir.display()
                    ),
                ));
            }
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| Error::io("create the vLLM-shaped region", &path, e))?;
        let unlink = || {
            let _ = std::fs::remove_file(&path);
        };
        if let Err(e) = file.set_len(len as u64) {
            unlink();
            return Err(Error::io("size the vLLM-shaped region", &path, e));
        }
        // SAFETY: a fresh shared mapping, at an address of the kernel's choosing, of a file of
        // `len` bytes: what Python's mmap.mmap(fd, len) does.
        let mapped = unsafe {
            mmap(
                null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &file,
                0,
            )
        };
        unlink();
        let ptr = mapped
            .map_err(|e| Error::io("map the vLLM-shaped region", &path, std::io::Error::from(e)))?;
        let owner = OwnerMapping {
            ptr,
            len,
            _file: file,
            pin: None,
        };
        // SAFETY: the range is exactly the mapping above.
        unsafe { madvise(ptr, len, Advice::LinuxPopulateWrite) }.map_err(|e| {
            Error::new(
                ErrorKind::NoSpace,
                format!(
                    "MADV_POPULATE_WRITE of the vLLM-shaped region failed: {}",
                    std::io::Error::from(e)
                ),
            )
        })?;
        Ok(owner)
    }

    /// Pins the whole mapping as `cudaHostRegister` does in vLLM's GPU workers before kvtier
    /// adopts the region (see `super::pin`).
    pub(super) fn pin(&mut self) -> Result<()> {
        // SAFETY: our own mapping, unmapped only in `drop`, after the pin is released.
        let pin =
            unsafe { super::pin::LongTermPin::new(self.ptr.cast(), self.len) }.map_err(|e| {
                Error::new(
                    ErrorKind::Unsupported,
                    format!(
                        "cannot pin the vLLM-shaped region ({} bytes) as cudaHostRegister does \
                     (an io_uring buffer registration of it failed: {e}; it needs io_uring and \
                     RLIMIT_MEMLOCK or CAP_IPC_LOCK)",
                        self.len
                    ),
                )
                .with_source(e)
            })?;
        self.pin = Some(pin);
        Ok(())
    }
}

impl Drop for OwnerMapping {
    fn drop(&mut self) {
        // Unpinned before it is unmapped.
        self.pin = None;
        // SAFETY: our own mapping; the region that used it is dropped first (field order).
        if let Err(e) = unsafe { munmap(self.ptr, self.len) } {
            log::error!("munmap of the vLLM-shaped region failed: {e}");
        }
    }
}
