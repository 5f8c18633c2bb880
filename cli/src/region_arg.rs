//! The primary region a benchmark runs on (`kvtier bench --region`, `kvtier fio-compare
//! --region`): kvtier's own, or one made and adopted as vLLM 0.33's.

use kvtier::error::{Error, Result};
use kvtier::region::PrimaryRegion;

/// Where `kvtier bench`'s primary region comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum BenchRegion {
    /// kvtier's own region (a memfd collapsed into 2 MiB pages).
    #[value(name = "own")]
    #[serde(rename = "own")]
    Own,
    /// A region made as vLLM 0.33 makes its shared offload region (a /dev/shm file in 4 KiB
    /// pages) and adopted as the Python tier adopts it (with 2 MiB pages where it can).
    #[value(name = "vllm")]
    #[serde(rename = "vllm")]
    Vllm,
    /// The same vLLM-shaped region adopted with huge pages turned off: what kvtier did with
    /// vLLM's 4 KiB pages before (the baseline).
    #[value(name = "vllm-4k")]
    #[serde(rename = "vllm-4k")]
    Vllm4k,
    /// What a vLLM 0.33 deployment really hands kvtier: the vLLM-shaped region long-term
    /// pinned (as `cudaHostRegister` pins it in vLLM's GPU workers) before kvtier adopts it, so
    /// that it cannot be collapsed and stays in 4 KiB pages.
    #[value(name = "vllm-pinned")]
    #[serde(rename = "vllm-pinned")]
    VllmPinned,
    /// The same, pinned, with the host fix: the file on a tmpfs mounted `huge=within_size`
    /// (`/dev/shm` when it is mounted so, else a private tmpfs mounted for the run, which
    /// needs root), so that vLLM's own pre-fault allocates 2 MiB pages.
    #[value(name = "vllm-pinned-huge")]
    #[serde(rename = "vllm-pinned-huge")]
    VllmPinnedHuge,
}

/// Where the vLLM-shaped region's file goes (vLLM: `/dev/shm/vllm_offload_<engine>.mmap`).
pub const VLLM_SHM_DIR: &str = "/dev/shm";

impl BenchRegion {
    /// The name on the command line and in the report.
    pub fn name(self) -> &'static str {
        match self {
            BenchRegion::Own => "own",
            BenchRegion::Vllm => "vllm",
            BenchRegion::Vllm4k => "vllm-4k",
            BenchRegion::VllmPinned => "vllm-pinned",
            BenchRegion::VllmPinnedHuge => "vllm-pinned-huge",
        }
    }

    /// Creates the region.
    pub fn create(self, rows: usize, row: u64) -> Result<PrimaryRegion> {
        use kvtier::region::AdoptHugePages;
        let shm = std::path::Path::new(VLLM_SHM_DIR);
        let (mode, pinned) = match self {
            BenchRegion::Own => return PrimaryRegion::create(rows, row),
            BenchRegion::Vllm => (AdoptHugePages::Auto, false),
            BenchRegion::Vllm4k => (AdoptHugePages::Never, false),
            BenchRegion::VllmPinned => (AdoptHugePages::Auto, true),
            BenchRegion::VllmPinnedHuge => {
                let len = (rows as u64).saturating_mul(row);
                return with_huge_tmpfs(len, |dir| {
                    PrimaryRegion::create_vllm_shaped_pinned(
                        rows,
                        row,
                        dir,
                        AdoptHugePages::Auto,
                        true,
                    )
                });
            }
        };
        if !shm.is_dir() {
            return Err(Error::config(
                "--region",
                format!(
                    "{} needs {VLLM_SHM_DIR} (where vLLM puts its region), which is missing",
                    self.name()
                ),
            ));
        }
        PrimaryRegion::create_vllm_shaped_pinned(rows, row, shm, mode, pinned)
    }
}

/// The `huge=` option of the tmpfs mounted at `dir` (`never` when it has none), from
/// `/proc/mounts`; `None` when `dir` is no tmpfs mount point.
pub fn tmpfs_huge_option(dir: &str) -> Option<String> {
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    // The last entry for a mount point is the one in effect.
    let line = mounts.lines().rev().find(|l| {
        let mut f = l.split_whitespace();
        let (_, point, fstype) = (f.next(), f.next(), f.next());
        point == Some(dir) && fstype == Some("tmpfs")
    })?;
    let opts = line.split_whitespace().nth(3).unwrap_or("");
    Some(
        opts.split(',')
            .find_map(|o| o.strip_prefix("huge="))
            .unwrap_or("never")
            .to_string(),
    )
}

/// Whether a tmpfs with this `huge=` option gives a file sized with `ftruncate` and then
/// pre-faulted (vLLM's region) 2 MiB pages.
pub fn huge_option_gives_huge_pages(huge: &str) -> bool {
    matches!(huge, "within_size" | "always")
}

/// Runs `make` with a directory on a tmpfs mounted `huge=within_size`: `/dev/shm` when it is
/// mounted so (or `huge=always`), else a private tmpfs of `len` bytes (plus slack) mounted in a
/// temporary directory and lazily unmounted (`umount -l`) as soon as `make` returns (a region
/// file there is unlinked and stays mapped; the mount goes with its last mapping).
fn with_huge_tmpfs(
    len: u64,
    make: impl FnOnce(&std::path::Path) -> Result<PrimaryRegion>,
) -> Result<PrimaryRegion> {
    if tmpfs_huge_option(VLLM_SHM_DIR).is_some_and(|h| huge_option_gives_huge_pages(&h)) {
        return make(std::path::Path::new(VLLM_SHM_DIR));
    }
    let dir = tempfile::Builder::new()
        .prefix("kvtier-huge-shm-")
        .tempdir()
        .map_err(|e| Error::config("--region", format!("cannot make a temporary dir: {e}")))?;
    let size = len.saturating_add(16 << 20);
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o"])
        .arg(format!("size={size},huge=within_size,mode=0700"))
        .arg("kvtier-huge-shm")
        .arg(dir.path())
        .output();
    match mounted {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            return Err(Error::config(
                "--region",
                format!(
                    "vllm-pinned-huge needs a tmpfs mounted huge=within_size: {VLLM_SHM_DIR} is \
                     not, and mounting one in {} failed ({}; root is needed)",
                    dir.path().display(),
                    String::from_utf8_lossy(&o.stderr).trim()
                ),
            ));
        }
        Err(e) => {
            return Err(Error::config(
                "--region",
                format!("vllm-pinned-huge: cannot run mount: {e}"),
            ));
        }
    }
    let made = make(dir.path());
    let unmounted = std::process::Command::new("umount")
        .arg("-l")
        .arg(dir.path())
        .status();
    if !unmounted.is_ok_and(|s| s.success()) {
        log::warn!(
            "could not unmount the temporary tmpfs at {}",
            dir.path().display()
        );
    }
    made
}

/// How a region's rows are backed, in the report's words (measured, see
/// [`PrimaryRegion::pages_description`]).
pub fn pages_note(region: &PrimaryRegion) -> String {
    region.pages_description()
}
