//! The primary region a benchmark runs on (`kvtier bench --region`, `kvtier fio-compare
//! --region`): kvtier's own, or one made and adopted as vLLM 0.33's.

use crate::error::{Error, Result};
use crate::region::PrimaryRegion;

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
        }
    }

    /// Creates the region.
    pub fn create(self, rows: usize, row: usize) -> Result<PrimaryRegion> {
        use crate::region::AdoptHugePages;
        let shm = std::path::Path::new(VLLM_SHM_DIR);
        let mode = match self {
            BenchRegion::Own => return PrimaryRegion::create(rows, row),
            BenchRegion::Vllm => AdoptHugePages::Auto,
            BenchRegion::Vllm4k => AdoptHugePages::Never,
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
        PrimaryRegion::create_vllm_shaped(rows, row, shm, mode)
    }
}

/// How a region's rows are backed, in the report's words.
pub fn pages_note(region: &PrimaryRegion) -> String {
    match region.small_pages_reason() {
        None => "2 MiB pages".to_string(),
        Some(why) => format!("4 KiB pages ({why})"),
    }
}
