//! The real device: CUDA through cudarc's driver API and cuFile through [`cufile`], loaded
//! only after [`crate::probe`] found both libraries.

pub mod cufile;
mod device;

pub use device::CudaDevice;

/// Whether the dynamic loader can load `name` (a bare name or a path). The library stays
/// loaded (`RTLD_NODELETE`): libcufile keeps thread-local state that must not be unmapped.
pub(crate) fn loads(name: &str) -> bool {
    // SAFETY: loading runs the library's initialisers, as linking against it would; nothing
    // from it is called here.
    unsafe {
        libloading::os::unix::Library::open(
            Some(name),
            libc::RTLD_LAZY | libc::RTLD_LOCAL | libc::RTLD_NODELETE,
        )
    }
    .is_ok()
}
