//! `kvtier version`: the version, how this binary was built (profile, minimum Rust version,
//! cargo features) and which I/O engines work on this machine, each with the reason when
//! one does not.

use std::process::ExitCode;

use crate::cli::output::out;
use crate::error::Result;

/// Every cargo feature of the crate, and whether this build has it. A feature added to
/// `Cargo.toml` is added here too.
pub const BUILD_FEATURES: [(&str, bool); 2] = [
    ("gds", cfg!(feature = "gds")),
    ("internals", cfg!(feature = "internals")),
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
    let uring = match crate::io::probe_io_uring() {
        Ok(()) => "available".to_string(),
        Err(why) => format!("unavailable ({why}); io_engine = \"auto\" uses psync"),
    };
    format!(
        "kvtier {}\nbuild: {profile} profile, rust-version {} or newer\nfeatures: {features}\n\
         engine uring: {uring}\nengine psync: available\n{}\n",
        env!("CARGO_PKG_VERSION"),
        env!("CARGO_PKG_RUST_VERSION"),
        crate::g3::gds::version_lines()
    )
}

/// Runs `kvtier version`.
pub fn run() -> Result<ExitCode> {
    out!("{}", report())?;
    Ok(ExitCode::SUCCESS)
}
