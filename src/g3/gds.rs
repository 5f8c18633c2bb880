//! GPUDirect Storage for a G3 tier: whether it can run (the `gds` key), and what the tier
//! reports about it (`g3_gds_info`, `kvtier version`, `kvtier tier inspect`).
//!
//! At open, `gds = "auto"` or `"required"` looks for the CUDA driver and cuFile libraries (the
//! `gds/` crate's probe, which never calls into CUDA) and checks that the slab directories are
//! on a filesystem GDS can use. If it cannot run, `auto` falls back to the CPU path (GPU ->
//! pinned primary row -> O_DIRECT), logging the reason once and exporting it; `required` is a
//! start-up error naming it. Whether cuFile then runs peer-to-peer or in its compatibility mode
//! is known once a GPU data path starts the cuFile driver, which updates the state.

use std::path::PathBuf;

use crate::error::{Error, ErrorKind, Result};
use crate::g3::config::GdsMode;

/// What a tier's GDS data path is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GdsState {
    /// `gds = "off"`.
    #[default]
    Off,
    /// GDS cannot run here; GPU chunks take the CPU path.
    CpuFallback,
    /// The libraries are here; the mode is known once a GPU data path starts cuFile.
    Ready,
    /// cuFile moves bytes peer-to-peer between the GPU and the NVMe device.
    #[serde(rename = "p2p")]
    PeerToPeer,
    /// cuFile runs in its compatibility mode (POSIX I/O through host bounce buffers).
    Compat,
}

impl GdsState {
    /// The `mode` label of `g3_gds_info`.
    pub fn as_str(self) -> &'static str {
        match self {
            GdsState::Off => "off",
            GdsState::CpuFallback => "cpu_fallback",
            GdsState::Ready => "ready",
            GdsState::PeerToPeer => "p2p",
            GdsState::Compat => "compat",
        }
    }
}

/// The state with its reason (why it fell back, or what was found).
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct GdsStatus {
    /// The state.
    pub state: GdsState,
    /// Why, in one line.
    pub reason: String,
}

impl std::fmt::Display for GdsStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.state.as_str(), self.reason)
    }
}

/// Whether this build has the GDS data path (cargo feature `gds`).
pub const BUILT_IN: bool = cfg!(feature = "gds");

/// Why GDS cannot run for slabs in `dirs` (`Err`), or what was found (`Ok`).
pub fn availability(dirs: &[PathBuf]) -> std::result::Result<String, String> {
    #[cfg(not(feature = "gds"))]
    {
        let _ = dirs;
        Err("this kvtier was built without GPUDirect Storage (cargo feature `gds`)".into())
    }
    #[cfg(feature = "gds")]
    {
        use kvtier_gds::mode::{FsClass, classify_fs};
        use kvtier_gds::probe::{Availability, probe};
        let libs = match probe() {
            Availability::Absent(reason) => return Err(reason),
            Availability::Present(libs) => libs,
        };
        for d in dirs {
            if let Ok(magic) = crate::io::probe::statfs_magic(d)
                && let FsClass::Unsupported(name) = classify_fs(magic)
            {
                return Err(format!(
                    "{} is on {name}, which cannot back GPUDirect Storage",
                    d.display()
                ));
            }
        }
        Ok(format!(
            "driver {}, cuFile {}, nvidia-fs {}",
            libs.driver,
            libs.cufile,
            libs.nvidia_fs
                .as_deref()
                .unwrap_or("not loaded (compatibility mode only)")
        ))
    }
}

/// The tier's GDS state at open for `mode` and the slab directories `dirs`: `Off`, `Ready`,
/// or (`auto`) `CpuFallback` with the reason logged once; `required` without GDS is an
/// [`ErrorKind::Unsupported`] error naming the key and the reason.
pub fn status_at_open(mode: GdsMode, dirs: &[PathBuf]) -> Result<GdsStatus> {
    if mode == GdsMode::Off {
        return Ok(GdsStatus {
            state: GdsState::Off,
            reason: "gds = \"off\"".into(),
        });
    }
    match availability(dirs) {
        Ok(found) => Ok(GdsStatus {
            state: GdsState::Ready,
            reason: found,
        }),
        Err(why) if mode == GdsMode::Auto => {
            log::warn!(
                "GPUDirect Storage cannot run for the G3 tier on {}: {why}; GPU chunks take the \
                 CPU path (GPU -> primary row -> O_DIRECT) (gds = \"auto\")",
                display_dirs(dirs)
            );
            Ok(GdsStatus {
                state: GdsState::CpuFallback,
                reason: why,
            })
        }
        Err(why) => Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "gds = \"required\" but GPUDirect Storage cannot run for the G3 tier on {}: \
                 {why}; set gds = \"auto\" to use the CPU path instead",
                display_dirs(dirs)
            ),
        )
        .with("key", "gds")
        .with("reason", why)),
    }
}

/// What GDS would do for slabs in `dirs` on this machine, without opening a tier or logging:
/// `cpu_fallback` with the reason it cannot run, else `ready` (for `kvtier version` and
/// `kvtier tier inspect`).
pub fn probe_status(dirs: &[PathBuf]) -> GdsStatus {
    match availability(dirs) {
        Ok(found) => GdsStatus {
            state: GdsState::Ready,
            reason: found,
        },
        Err(why) => GdsStatus {
            state: GdsState::CpuFallback,
            reason: why,
        },
    }
}

/// The lines `kvtier version` prints about GDS: whether this build has it, and what it would
/// do here (for slabs in the system temp dir).
pub fn version_lines() -> String {
    let built = if BUILT_IN {
        "built in (cargo feature `gds`, cuFile and CUDA loaded at run time)"
    } else {
        "not built in (rebuild with `--features gds`)"
    };
    format!(
        "gds: {built}\ngds here: {}",
        probe_status(&[std::env::temp_dir()])
    )
}

fn display_dirs(dirs: &[PathBuf]) -> String {
    dirs.iter()
        .map(|d| d.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_is_off_without_looking() {
        let s = status_at_open(GdsMode::Off, &[PathBuf::from("/nonexistent")]).unwrap();
        assert_eq!(s.state, GdsState::Off);
        assert_eq!(s.state.as_str(), "off");
    }
}
