//! Flag values shared by several commands: the `--io-engine` names, `--path` directories and
//! `--layout` files.

use std::path::{Path, PathBuf};

use crate::canonical::{LayoutDescriptor, default_layout};
use crate::error::{Error, ErrorKind, Result};
use crate::io::IoEngineKind;

/// Parses an `--io-engine` value.
pub fn parse_engine(s: &str) -> std::result::Result<IoEngineKind, String> {
    match s.to_ascii_lowercase().as_str() {
        "auto" => Ok(IoEngineKind::Auto),
        "uring" | "io_uring" => Ok(IoEngineKind::Uring),
        "psync" => Ok(IoEngineKind::Psync),
        _ => Err(format!(
            "unknown I/O engine {s:?} (use auto, uring or psync)"
        )),
    }
}

/// A path the user named must be an existing directory.
pub fn check_dir(p: &Path) -> Result<()> {
    match std::fs::metadata(p) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(Error::new(
            ErrorKind::InvalidPath,
            format!("{} is not a directory", p.display()),
        )),
        Err(e) => Err(Error::io("open directory", p, e)),
    }
}

/// The directories of repeatable `--path` flags: the system temp dir when none is given; each
/// must be an existing directory, named once.
pub fn path_dirs(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let dirs = if paths.is_empty() {
        vec![std::env::temp_dir()]
    } else {
        paths.to_vec()
    };
    for (i, p) in dirs.iter().enumerate() {
        check_dir(p)?;
        if dirs[..i].contains(p) {
            return Err(Error::config(
                "--path",
                format!("{} is given twice", p.display()),
            ));
        }
    }
    Ok(dirs)
}

/// The `--layout` descriptor, or the default layout (Llama-3.1-8B) without one.
pub fn load_layout(path: Option<&Path>) -> Result<LayoutDescriptor> {
    match path {
        Some(p) => LayoutDescriptor::load(p),
        None => Ok(default_layout()),
    }
}

/// Parses `argv` (without the program name) into a command's arguments, for unit tests.
#[cfg(test)]
pub(crate) fn parse_for_test<A: clap::Args + clap::FromArgMatches>(argv: &[&str]) -> A {
    let mut full = vec!["x"];
    full.extend_from_slice(argv);
    let matches = A::augment_args(clap::Command::new("x"))
        .try_get_matches_from(full)
        .unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    A::from_arg_matches(&matches).unwrap_or_else(|e| panic!("{argv:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_names() {
        assert_eq!(parse_engine("io_uring"), Ok(IoEngineKind::Uring));
        assert_eq!(parse_engine("PSYNC"), Ok(IoEngineKind::Psync));
        assert!(parse_engine("spdk").is_err());
    }
}
