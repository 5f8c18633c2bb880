//! Configuration: vLLM's `kv_connector_extra_config` shape read from JSON or TOML, merged and
//! validated into the resolved [`KvtierConfig`].
//!
//! * `model`: the resolved (validated) types every other module consumes.
//! * `size`: human byte sizes (`"64GiB"`).
//! * `backpressure`: the field-by-field back-pressure merge, presets and defaults.
//! * `in_flight`: the one rule of every tier's `max_bytes_in_flight`.
//! * `validate`: one `validate` per resolved type ([`KvtierConfig::validate`],
//!   [`TierConfig::validate`], [`BackpressureConfig::validate`]), the value rules every way
//!   in runs (the parser runs them after it has checked the shape of the tree).
//! * parsing walks the `serde_json::Value` tree so that every error names the full key path
//!   (`secondary_tiers[1].backpresure`), the value found and what is allowed. TOML is read into
//!   the same tree first.
//!
//! The reference of every key is `docs/configuration.md`.

test_visible! {
    mod backpressure;
    mod in_flight;
    mod model;
    mod size;
}
mod fields;
mod parse;
mod validate;

use std::path::Path;

use serde_json::Value;

use crate::error::{Error, ErrorKind, Result};

pub use in_flight::{check_max_bytes_in_flight, max_bytes_in_flight};
pub use model::{
    BackpressureConfig, ChunkSizing, EvictionPolicyKind, KvtierConfig, ServiceConfig, TierConfig,
};
pub use parse::{
    KVTIER_KEYS, ResolvedConfig, SERVICE_KEYS, TIER_COMMON_KEYS, VLLM_OWNED_KEYS, WRAPPER_KEYS,
    resolve, resolve_tier_entry,
};
pub use size::{ByteSize, format_size_human, parse_size};

/// The text format of a configuration file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// JSON (`.json`), e.g. the value of vLLM's `--kv-transfer-config`.
    Json,
    /// TOML (`.toml`).
    Toml,
}

impl Format {
    /// The format named by the file extension (`.json` or `.toml`, case-insensitive).
    pub fn from_path(path: &Path) -> Result<Format> {
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        match ext.as_deref() {
            Some("json") => Ok(Format::Json),
            Some("toml") => Ok(Format::Toml),
            _ => Err(Error::new(
                ErrorKind::Config,
                format!(
                    "{}: cannot tell the configuration format from the file name",
                    path.display()
                ),
            )
            .with("path", path.display().to_string())
            .with("expected", "a .json or .toml extension")),
        }
    }

    /// `"json"` or `"toml"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Json => "json",
            Format::Toml => "toml",
        }
    }
}

/// Parses text in `format` into a value tree, without validating the keys.
/// Syntax errors are [`ErrorKind::Config`] errors with the line and column, on one line.
pub fn parse_value(text: &str, format: Format) -> Result<Value> {
    match format {
        Format::Json => serde_json::from_str(text).map_err(|e| {
            // serde_json appends " at line L column C"; the position goes in the context.
            let full = e.to_string();
            let what = full.split(" at line ").next().unwrap_or(&full);
            Error::new(ErrorKind::Config, format!("invalid JSON: {what}"))
                .with("line", e.line().to_string())
                .with("column", e.column().to_string())
        }),
        Format::Toml => toml::from_str::<Value>(text).map_err(|e| {
            let mut err = Error::new(
                ErrorKind::Config,
                format!("invalid TOML: {}", e.message().trim().replace('\n', " ")),
            );
            if let Some(span) = e.span() {
                let (line, column) = line_col(text, span.start);
                err = err
                    .with("line", line.to_string())
                    .with("column", column.to_string());
            }
            err
        }),
    }
}

/// 1-based line and column of byte offset `at` in `text`.
fn line_col(text: &str, at: usize) -> (usize, usize) {
    let before = &text[..at.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

/// Resolves a value and logs the notes (defaults filled where vLLM differs, ignored keys).
pub fn from_value(value: Value) -> Result<KvtierConfig> {
    let resolved = resolve(&value)?;
    for note in &resolved.notes {
        log::warn!("kvtier config: {note}");
    }
    Ok(resolved.config)
}

/// Parses and validates text in `format`.
pub fn parse_str(text: &str, format: Format) -> Result<KvtierConfig> {
    from_value(parse_value(text, format)?)
}

/// Parses and validates a JSON configuration.
pub fn from_json_str(text: &str) -> Result<KvtierConfig> {
    parse_str(text, Format::Json)
}

/// Parses and validates a TOML configuration.
pub fn from_toml_str(text: &str) -> Result<KvtierConfig> {
    parse_str(text, Format::Toml)
}

/// Reads, parses and validates a configuration file, keeping the notes.
/// An unreadable file is an [`ErrorKind::InvalidPath`] error naming the path.
pub fn load_resolved(path: &Path) -> Result<ResolvedConfig> {
    let format = Format::from_path(path)?;
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::new(
            ErrorKind::InvalidPath,
            format!("cannot read configuration file {}: {e}", path.display()),
        )
        .with("path", path.display().to_string())
        .with_source(e)
    })?;
    let in_file = |e: Error| error_in_file(path, e);
    let value = parse_value(&text, format).map_err(in_file)?;
    resolve(&value).map_err(in_file)
}

/// The same error with `<path>: ` in front of its message and the path in its context.
pub fn error_in_file(path: &Path, e: Error) -> Error {
    let mut out = Error::new(e.kind(), format!("{}: {}", path.display(), e.message()));
    for (k, v) in e.context() {
        out = out.with(k, v.clone());
    }
    out.with("path", path.display().to_string())
}

/// Reads, parses and validates a configuration file (`.json` or `.toml`); notes are logged.
pub fn load(path: &Path) -> Result<KvtierConfig> {
    let resolved = load_resolved(path)?;
    for note in &resolved.notes {
        log::warn!("kvtier config {}: {note}", path.display());
    }
    Ok(resolved.config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_from_extension() {
        assert_eq!(
            Format::from_path(Path::new("a/b.JSON")).unwrap(),
            Format::Json
        );
        assert_eq!(
            Format::from_path(Path::new("b.toml")).unwrap(),
            Format::Toml
        );
        let e = Format::from_path(Path::new("b.yaml")).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.to_string().contains("b.yaml"), "{e}");
    }

    #[test]
    fn syntax_errors_are_one_line_with_position() {
        let e = parse_value("{\"a\": 1,\n \"b\" }", Format::Json).unwrap_err();
        assert_eq!(e.context_value("line"), Some("2"));
        assert!(!e.to_string().contains('\n'), "{e}");
        let e = parse_value("a = 1\nb = = 2\n", Format::Toml).unwrap_err();
        assert_eq!(e.context_value("line"), Some("2"));
        assert!(!e.to_string().contains('\n'), "{e}");
    }

    #[test]
    fn line_col_counts_from_one() {
        assert_eq!(line_col("ab\ncd", 4), (2, 2));
        assert_eq!(line_col("", 0), (1, 1));
    }
}
