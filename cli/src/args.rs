//! What several commands share, defined once: the argument groups for the model layout
//! (`--layout`, `--tp`), the row (`--blocks-per-chunk`), the directories (`--path`) and the
//! byte budget in flight (`--max-bytes-in-flight`), and the flag value parsers
//! (`--io-engine` names, directories, layout files).

use std::path::{Path, PathBuf};

use crate::size::parse_size;
use kvtier::canonical::{LayoutDescriptor, default_layout};
use kvtier::config::{check_max_bytes_in_flight, max_bytes_in_flight};
use kvtier::error::{Error, ErrorKind, Result};
use kvtier::io::IoEngineKind;

/// `--layout FILE --tp N`: the model whose rows a command sizes, and the tensor-parallel size.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// Model layout descriptor (a TOML file, or the name of a shipped one: `qwen2.5-3b`,
    /// `llama-3.1-8b`, ... as in `layouts/`) that sizes the rows. Default: Llama-3.1-8B, bf16,
    /// 16-token blocks.
    #[arg(long, value_name = "FILE")]
    pub layout: Option<PathBuf>,
    /// Tensor-parallel size the rows are sized for.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub tp: u32,
}

impl ModelArgs {
    /// The `--layout` descriptor, or the default layout without one.
    pub fn load(&self) -> Result<LayoutDescriptor> {
        load_layout(self.layout.as_deref())
    }
}

/// `--layout FILE --tp N --blocks-per-chunk N`: the row a command stores (model, tensor
/// parallelism and GPU blocks per chunk).
#[derive(Debug, Clone, clap::Args)]
pub struct RowArgs {
    /// The model and its tensor-parallel size.
    #[command(flatten)]
    pub model: ModelArgs,
    /// GPU blocks per chunk (row).
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub blocks_per_chunk: u32,
}

/// `--path DIR` (repeatable): the directories a command works in, one file each, rows
/// striped across them in this order. Default: the system temp dir.
#[derive(Debug, Clone, clap::Args)]
pub struct PathArgs {
    /// Directory to work in (repeat for several devices; rows are striped across them).
    /// Default: the system temp dir.
    #[arg(long = "path", value_name = "DIR")]
    pub paths: Vec<PathBuf>,
}

impl PathArgs {
    /// The directories ([`path_dirs`]): existing, each named once, the temp dir by default.
    pub fn dirs(&self) -> Result<Vec<PathBuf>> {
        path_dirs(&self.paths)
    }
}

/// `--max-bytes-in-flight SIZE`: the cap on bytes of I/O in flight (an `nvme` tier's
/// `max_bytes_in_flight`, under the same rule: [`kvtier::config::in_flight`]).
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct InFlightArgs {
    /// Cap on bytes of I/O in flight (the nvme tier's max_bytes_in_flight), at least one row;
    /// the depth in rows is this divided by the row size. Default: 64 MiB, or one row when a
    /// row is larger.
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub max_bytes_in_flight: Option<u64>,
}

impl InFlightArgs {
    /// How errors name the flag: with the config key it sets.
    pub const KEY: &'static str = "--max-bytes-in-flight (the nvme tier's max_bytes_in_flight)";

    /// The cap for rows of `row_stride` bytes, by the one rule of `max_bytes_in_flight`: the
    /// flag's value if it holds a row (else a config error naming the flag and the key), or
    /// max(64 MiB, one row) without the flag.
    pub fn for_row(&self, row_stride: u64) -> Result<u64> {
        check_max_bytes_in_flight(Self::KEY, self.max_bytes_in_flight, Some(row_stride))?;
        Ok(max_bytes_in_flight(self.max_bytes_in_flight, row_stride))
    }
}

/// A configuration rule's error about `key` for a value the user gave as `flag`: the message
/// names both (`--capacity (capacity_bytes): ...`). Other errors pass unchanged.
pub fn name_flag(e: Error, key: &str, flag: &str) -> Error {
    if e.kind() != ErrorKind::Config || e.context_value("key") != Some(key) {
        return e;
    }
    let both = format!("{flag} ({key})");
    let rest = e
        .message()
        .strip_prefix(&format!("{key}: "))
        .unwrap_or(e.message());
    let mut out = Error::new(ErrorKind::Config, format!("{both}: {rest}"));
    for (k, v) in e.context() {
        out = out.with(k, if *k == "key" { both.clone() } else { v.clone() });
    }
    out
}

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
        // A shipped layout's name (`qwen2.5-3b`, as the vLLM tier entry's `layout` key takes
        // it) where no such file exists.
        Some(p) if !p.exists() => match p.to_str().and_then(kvtier::canonical::shipped_layout) {
            Some(shipped) => shipped,
            None => LayoutDescriptor::load(p),
        },
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
    fn a_flag_is_named_with_the_key_it_sets() {
        let e = name_flag(
            Error::config("capacity_bytes", "1 MiB holds no slot").with("found", "1"),
            "capacity_bytes",
            "--capacity",
        );
        assert_eq!(
            e.to_string(),
            "--capacity (capacity_bytes): 1 MiB holds no slot (found: 1)"
        );
        assert_eq!(e.context_value("key"), Some("--capacity (capacity_bytes)"));
        let other = name_flag(Error::config("paths", "x"), "capacity_bytes", "--capacity");
        assert_eq!(other.to_string(), "paths: x");
    }

    #[test]
    fn engine_names() {
        assert_eq!(parse_engine("io_uring"), Ok(IoEngineKind::Uring));
        assert_eq!(parse_engine("PSYNC"), Ok(IoEngineKind::Psync));
        assert!(parse_engine("spdk").is_err());
    }
}
