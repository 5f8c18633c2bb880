//! `kvtier version`: the version, how this binary was built (profile, minimum Rust version,
//! cargo features) and which I/O engines work on this machine, each with the reason when
//! one does not.

use std::process::ExitCode;

use crate::output::out;
use kvtier::error::Result;

/// Every cargo feature of the crate, and whether this build has it. A feature added to
/// `Cargo.toml` is added here too.
pub const BUILD_FEATURES: [(&str, bool); 2] = [
    ("gds", cfg!(feature = "gds")),
    ("test-support", cfg!(feature = "test-support")),
];

/// The report, one `key: value` line each.
pub fn report() -> String {
    let features: Vec<&str> = BUILD_FEATURES
        .iter()
        .filter(|(_, on)| *on)
        .map(|(name, _)| *name)
        .collect();
    let features = if features.is_empty() {
        "none".to_string()
    } else {
        features.join(", ")
    };
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let uring = match kvtier::io::probe_io_uring() {
        Ok(()) => "available".to_string(),
        Err(why) => format!("unavailable ({why}); io_engine = \"auto\" uses psync"),
    };
    format!(
        "kvtier {}\nbuild: {profile} profile, rust-version {} or newer\nfeatures: {features}\n\
         engine uring: {uring}\nengine psync: available\nvllm region pages: {}\n{}\n",
        env!("CARGO_PKG_VERSION"),
        env!("CARGO_PKG_RUST_VERSION"),
        vllm_region_pages(),
        kvtier::g3::gds::version_lines()
    )
}

/// Whether this host's `/dev/shm` gives vLLM 0.33's shared offload region 2 MiB pages: the
/// mount's `huge=` option and `transparent_hugepage/shmem_enabled`, then the proof: a 4 MiB
/// file made there as vLLM makes its region (sized, mapped, pre-faulted) and measured
/// (`PrimaryRegion::pages_description`). vLLM pins the region before kvtier adopts it, so
/// what the tmpfs gives is what kvtier gets (`docs/vllm.md`).
fn vllm_region_pages() -> String {
    use crate::region_arg::{VLLM_SHM_DIR, huge_option_gives_huge_pages, tmpfs_huge_option};
    let shmem_enabled =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
            .ok()
            .and_then(|s| {
                s.split_whitespace()
                    .find(|w| w.starts_with('['))
                    .map(|w| w.trim_matches(['[', ']']).to_string())
            })
            .unwrap_or_else(|| "unknown".to_string());
    let Some(huge) = tmpfs_huge_option(VLLM_SHM_DIR) else {
        return format!("{VLLM_SHM_DIR} is not a tmpfs mount here (vLLM puts its region there)");
    };
    let configured = shmem_enabled == "force"
        || (shmem_enabled != "deny" && huge_option_gives_huge_pages(&huge));
    let measured = kvtier::region::PrimaryRegion::create_vllm_shaped(
        2,
        2 << 20,
        std::path::Path::new(VLLM_SHM_DIR),
        kvtier::region::AdoptHugePages::Never,
    )
    .map(|r| r.huge_page_share());
    let setting = format!("{VLLM_SHM_DIR} huge={huge}, shmem_enabled={shmem_enabled}");
    match measured {
        Ok(share) if share >= 1.0 => {
            format!("2 MiB pages ({setting}; measured on a 4 MiB test file)")
        }
        Ok(share) => format!(
            "4 KiB pages ({setting}; measured on a 4 MiB test file: {:.0} % in 2 MiB pages{}); \
             vLLM pins its region in these pages and kvtier stages large rows through its own \
             2 MiB pages (a copy); fix: mount -o remount,huge=within_size {VLLM_SHM_DIR} \
             (docs/vllm.md)",
            share * 100.0,
            if configured {
                ", although the setting asks for huge pages: no free 2 MiB blocks?"
            } else {
                ""
            }
        ),
        Err(e) => format!("unknown ({setting}; the test file failed: {e})"),
    }
}

/// Runs `kvtier version`.
pub fn run() -> Result<ExitCode> {
    out!("{}", report())?;
    Ok(ExitCode::SUCCESS)
}
