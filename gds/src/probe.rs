//! Is GPUDirect Storage possible here? The CUDA driver library, the cuFile library and the
//! nvidia-fs kernel module, looked up without calling into CUDA (cudarc panics when a library it
//! loads dynamically is missing, so nothing calls it before this says the library is there).
//!
//! cuFile is looked up under cudarc's candidate names and under `libcufile.so.0`, the only
//! name CUDA runtime images ship (cudarc 0.19 does not try it); kvtier loads cuFile itself
//! (see [`crate::cuda`]), so either name works.

use std::path::Path;

/// The libraries GDS needs, as found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Libraries {
    /// The CUDA driver library name that loaded.
    pub driver: String,
    /// The cuFile library name or path that loaded.
    pub cufile: String,
    /// The nvidia-fs module's version (`/proc/driver/nvidia-fs/version`), when loaded;
    /// without it cuFile can only run in compatibility mode.
    pub nvidia_fs: Option<String>,
}

/// Whether GDS can be tried here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Availability {
    /// The libraries load; starting the driver may still fail (no GPU, cuFile refuses).
    Present(Libraries),
    /// GDS cannot start; the reason names what is missing and where it was looked for.
    Absent(String),
}

impl Availability {
    /// The reason GDS cannot start, if it cannot.
    pub fn absent_reason(&self) -> Option<&str> {
        match self {
            Availability::Absent(r) => Some(r),
            Availability::Present(_) => None,
        }
    }
}

/// The names cuFile is looked up under: cudarc's candidates, then `libcufile.so.0`, then the
/// same two names in the usual CUDA directories (`$CUDA_HOME/lib64`, `/usr/local/cuda/lib64`,
/// `/usr/local/cuda/targets/<arch>-linux/lib`).
pub fn cufile_candidates() -> Vec<String> {
    let mut names = cudarc::get_lib_name_candidates("cufile");
    names.push("libcufile.so.0".into());
    let mut dirs: Vec<String> = Vec::new();
    if let Ok(h) = std::env::var("CUDA_HOME") {
        dirs.push(format!("{h}/lib64"));
    }
    dirs.push("/usr/local/cuda/lib64".into());
    dirs.push(format!(
        "/usr/local/cuda/targets/{}-linux/lib",
        std::env::consts::ARCH
    ));
    for d in dirs {
        for n in ["libcufile.so.0", "libcufile.so"] {
            let p = format!("{d}/{n}");
            if Path::new(&p).exists() {
                names.push(p);
            }
        }
    }
    names
}

/// The nvidia-fs module's version, when the module is loaded.
pub fn nvidia_fs_version() -> Option<String> {
    std::fs::read_to_string("/proc/driver/nvidia-fs/version")
        .ok()
        .map(|s| s.lines().next().unwrap_or("").trim().to_string())
        .or_else(|| {
            Path::new("/proc/driver/nvidia-fs")
                .exists()
                .then(|| "loaded".into())
        })
}

/// Looks for the driver and cuFile libraries (loading them, which is how the dynamic loader
/// would find them) and nvidia-fs. Never calls into CUDA.
pub fn probe() -> Availability {
    // SAFETY: `is_culib_present` only tries to load the driver library by name (running its
    // initialisers, as any CUDA program does) and unloads it; it calls no CUDA function.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Availability::Absent(format!(
            "the CUDA driver library is not installed (looked for {} on the loader path)",
            short_list(&unix_names(
                &cudarc::get_lib_name_candidates("cuda"),
                "cuda"
            ))
        ));
    }
    let driver = cudarc::get_lib_name_candidates("cuda")
        .into_iter()
        .find(|n| crate::cuda::loads(n))
        .unwrap_or_else(|| "libcuda".into());
    let candidates = cufile_candidates();
    let Some(cufile) = candidates.iter().find(|n| crate::cuda::loads(n)).cloned() else {
        return Availability::Absent(format!(
            "the cuFile library (GPUDirect Storage) is not installed (looked for {} on the \
             loader path and in the CUDA directories)",
            short_list(&unix_names(&candidates, "cufile"))
        ));
    };
    Availability::Present(Libraries {
        driver,
        cufile,
        nvidia_fs: nvidia_fs_version(),
    })
}

/// The candidates spelled `lib<name>.so[.N]` (cudarc also tries Windows-style names).
fn unix_names(names: &[String], name: &str) -> Vec<String> {
    let stem = format!("lib{name}.so");
    let mut v: Vec<String> = names
        .iter()
        .filter(|n| n.starts_with(&stem))
        .cloned()
        .collect();
    v.sort();
    v.dedup();
    v
}

/// The first few names of a candidate list, for a one-line reason.
fn short_list(names: &[String]) -> String {
    let mut s: Vec<&str> = names.iter().take(4).map(String::as_str).collect();
    if names.len() > 4 {
        s.push("...");
    }
    s.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cufile_is_looked_up_under_the_runtime_image_name() {
        let c = cufile_candidates();
        assert!(c.iter().any(|n| n == "libcufile.so"), "{c:?}");
        assert!(c.iter().any(|n| n == "libcufile.so.0"), "{c:?}");
    }

    /// On a machine without CUDA this says "absent" with the reason; it never panics (a
    /// cudarc call without its library would).
    #[test]
    fn probe_answers_without_panicking() {
        match probe() {
            Availability::Absent(reason) => {
                assert!(reason.contains("not installed"), "{reason}");
                eprintln!("GDS absent here: {reason}");
            }
            Availability::Present(l) => eprintln!("GDS libraries present: {l:?}"),
        }
    }
}
