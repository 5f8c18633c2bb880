//! kvtier-gds: the GPUDirect Storage (cuFile) data path of kvtier's G3 tier.
//!
//! A chunk stored from GPU memory here is an ordinary G3 slot: the same slab file, slot size and
//! alignment, the same CRC-32 over the whole row and (through kvtier's direct-slot API) the same
//! journal record, so it loads through the CPU path, and the reverse. This crate knows nothing
//! of kvtier's types; kvtier (feature `gds`) turns its canonical copy runs into [`plan::Run`]s
//! and its slab files into registered files.
//!
//! * [`probe`]: are the CUDA driver and cuFile libraries (and nvidia-fs) here? Checked before
//!   any cudarc call, which would panic on a missing library.
//! * [`mode`]: peer-to-peer or cuFile's compatibility mode, from the driver properties.
//! * [`crc`]: CRC-32 composed from piece CRCs (computed on the device).
//! * [`plan`]: copy runs mapped through the GPU block table into 2-D device copies.
//! * [`device`]: the [`device::Device`] trait and [`device::HostDevice`], host memory standing
//!   in for a GPU (tests, and every machine without one).
//! * [`exec`]: stores and loads whole chunks through device staging rows.
//! * [`cuda`]: [`cuda::CudaDevice`], the real device (cudarc driver API, cuFile, a CRC kernel).

pub mod crc;
pub mod cuda;
pub mod device;
pub mod error;
pub mod exec;
pub mod mode;
pub mod plan;
pub mod probe;

pub use error::{GdsError, GdsErrorKind, Result};
