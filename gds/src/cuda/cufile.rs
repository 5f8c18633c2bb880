//! cuFile, loaded by kvtier itself: cudarc 0.19 looks for `libcufile.so` and `.so.N` names but
//! not `libcufile.so.0`, the only name CUDA runtime images ship, and panics when its load
//! fails. The entry points are resolved here from whichever name [`crate::probe`] found, with
//! cudarc's `cufile::sys` types for the ABI. The library stays loaded (`RTLD_NODELETE`, it
//! keeps thread-local state).

use std::ffi::c_void;

use cudarc::cufile::sys::{
    CUfileDescr_t, CUfileDrvProps_t, CUfileError_t, CUfileHandle_t, CUfileOpError,
};

use crate::error::{GdsError, GdsErrorKind, Result};

type DriverOpen = unsafe extern "C" fn() -> CUfileError_t;
type GetProperties = unsafe extern "C" fn(*mut CUfileDrvProps_t) -> CUfileError_t;
type HandleRegister =
    unsafe extern "C" fn(*mut CUfileHandle_t, *mut CUfileDescr_t) -> CUfileError_t;
type HandleDeregister = unsafe extern "C" fn(CUfileHandle_t);
type BufRegister = unsafe extern "C" fn(*const c_void, usize, i32) -> CUfileError_t;
type BufDeregister = unsafe extern "C" fn(*const c_void) -> CUfileError_t;
type Read = unsafe extern "C" fn(CUfileHandle_t, *mut c_void, usize, i64, i64) -> isize;
type Write = unsafe extern "C" fn(CUfileHandle_t, *const c_void, usize, i64, i64) -> isize;

/// The cuFile entry points kvtier uses.
pub struct CuFile {
    /// The library name or path that loaded.
    pub name: String,
    pub(crate) driver_open: DriverOpen,
    pub(crate) get_properties: GetProperties,
    pub(crate) handle_register: HandleRegister,
    pub(crate) handle_deregister: HandleDeregister,
    pub(crate) buf_register: BufRegister,
    pub(crate) buf_deregister: BufDeregister,
    pub(crate) read: Read,
    pub(crate) write: Write,
    _lib: libloading::os::unix::Library,
}

impl std::fmt::Debug for CuFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CuFile").field("name", &self.name).finish()
    }
}

fn unavailable(msg: String) -> GdsError {
    GdsError::new(GdsErrorKind::Unavailable, msg)
}

impl CuFile {
    /// Loads `name` and resolves every entry point (a missing one is an error, not a panic).
    pub fn load(name: &str) -> Result<Self> {
        // SAFETY: loading runs the library's initialisers, as linking against it would.
        let lib = unsafe {
            libloading::os::unix::Library::open(
                Some(name),
                libc::RTLD_NOW | libc::RTLD_LOCAL | libc::RTLD_NODELETE,
            )
        }
        .map_err(|e| unavailable(format!("cannot load {name}: {e}")))?;
        macro_rules! sym {
            ($t:ty, $s:literal) => {{
                // SAFETY: the symbol is cuFile's C entry point of this name; `$t` is its
                // signature in cufile.h (the types are cudarc's bindings of that header).
                let f: libloading::os::unix::Symbol<$t> = unsafe { lib.get($s) }
                    .map_err(|e| unavailable(format!("{name} has no {}: {e}", stringify!($s))))?;
                *f
            }};
        }
        Ok(CuFile {
            name: name.to_string(),
            driver_open: sym!(DriverOpen, b"cuFileDriverOpen"),
            get_properties: sym!(GetProperties, b"cuFileDriverGetProperties"),
            handle_register: sym!(HandleRegister, b"cuFileHandleRegister"),
            handle_deregister: sym!(HandleDeregister, b"cuFileHandleDeregister"),
            buf_register: sym!(BufRegister, b"cuFileBufRegister"),
            buf_deregister: sym!(BufDeregister, b"cuFileBufDeregister"),
            read: sym!(Read, b"cuFileRead"),
            write: sym!(Write, b"cuFileWrite"),
            _lib: lib,
        })
    }
}

/// `Ok` for `CU_FILE_SUCCESS`, else an error naming the call and both codes.
pub(crate) fn check(what: &str, e: CUfileError_t) -> Result<()> {
    if e.err == CUfileOpError::CU_FILE_SUCCESS {
        Ok(())
    } else {
        Err(GdsError::new(
            GdsErrorKind::CuFile,
            format!("{what} failed: {:?} (CUDA {:?})", e.err, e.cu_err),
        ))
    }
}
