//! Reading a G3 tier's `params`: its known keys, and each value by its type (a byte count, a
//! string, one of a few names), with errors that name `secondary_tiers[i].<key>`.

use std::path::PathBuf;

use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// Every key a `type = "nvme"` tier accepts in its params (`module_path` is accepted and
/// ignored, since vLLM's factory passes it along for out-of-tree tiers).
pub const KNOWN_KEYS: &[&str] = &[
    "paths",
    "capacity_bytes",
    "max_bytes_in_flight",
    "io_engine",
    "direct_io",
    "fsync",
    "checkpoint_journal_bytes",
    "max_journal_bytes",
    "checkpoint_interval_s",
    "max_queued_jobs",
    "idle_poll_us",
    "idle_linger_ms",
    "gds",
    "region_huge_pages",
    "admission",
    "eviction_policy",
    "module_path",
    "layout",
    "enable_kv_events",
    "on_wrong_filesystem",
];

/// A tier's `params`, read key by key; errors name `<prefix>.<key>`.
pub(super) struct Params<'a> {
    pub(super) map: &'a Map<String, Value>,
    pub(super) prefix: String,
}

impl Params<'_> {
    /// The full name of `key`, for errors.
    pub(super) fn path(&self, key: &str) -> String {
        format!("{}.{key}", self.prefix)
    }

    /// Refuses a key no `type = "nvme"` tier knows, suggesting the closest known one.
    pub(super) fn check_known_keys(&self) -> Result<()> {
        for key in self.map.keys() {
            if !KNOWN_KEYS.contains(&key.as_str()) {
                let mut e = Error::config(self.path(key), "unknown key for a tier of type nvme");
                if let Some(s) = closest_key(key) {
                    e = e.with("did_you_mean", s);
                }
                return Err(e.with("known_keys", KNOWN_KEYS.join(", ")));
            }
        }
        Ok(())
    }

    /// `paths`: one directory or a list of them (required).
    pub(super) fn paths(&self) -> Result<Vec<PathBuf>> {
        match self.map.get("paths") {
            None => Err(Error::config(
                self.path("paths"),
                "required (one or more directories)",
            )),
            Some(Value::String(s)) => Ok(vec![PathBuf::from(s)]),
            Some(Value::Array(a)) => a
                .iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::String(s) => Ok(PathBuf::from(s)),
                    other => Err(Error::config(
                        format!("{}[{i}]", self.path("paths")),
                        format!("expected a directory path string, found {other}"),
                    )),
                })
                .collect(),
            Some(other) => Err(Error::config(
                self.path("paths"),
                format!("expected a list of directories, found {other}"),
            )),
        }
    }

    /// `key` as a byte count, when set.
    pub(super) fn size(&self, key: &str) -> Result<Option<u64>> {
        self.map
            .get(key)
            .map(|v| size_value(v, &self.path(key)))
            .transpose()
    }

    /// `key` as a string, when set.
    pub(super) fn str(&self, key: &str) -> Result<Option<&str>> {
        self.map
            .get(key)
            .map(|v| str_value(v, &self.path(key)))
            .transpose()
    }

    /// `key` as one of `choices` (by name), when set.
    pub(super) fn choice<T: Copy>(&self, key: &str, choices: &[(&str, T)]) -> Result<Option<T>> {
        let Some(found) = self.str(key)? else {
            return Ok(None);
        };
        match choices.iter().find(|(name, _)| *name == found) {
            Some((_, c)) => Ok(Some(*c)),
            None => {
                let names: Vec<&str> = choices.iter().map(|(name, _)| *name).collect();
                Err(bad_choice(&self.path(key), found, &names))
            }
        }
    }
}

fn closest_key(key: &str) -> Option<&'static str> {
    KNOWN_KEYS
        .iter()
        .map(|k| (strsim::jaro_winkler(key, k), *k))
        .filter(|(score, _)| *score >= 0.75)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k)
}

pub(super) fn bad_choice(key_path: &str, found: &str, allowed: &[&str]) -> Error {
    Error::config(key_path, format!("unknown value {found:?}"))
        .with("expected", allowed.join(" | "))
        .with("found", found.to_string())
}

fn str_value<'a>(v: &'a Value, key_path: &str) -> Result<&'a str> {
    v.as_str()
        .ok_or_else(|| Error::config(key_path, format!("expected a string, found {v}")))
}

fn size_value(v: &Value, key_path: &str) -> Result<u64> {
    match v {
        Value::Number(n) => n.as_u64().ok_or_else(|| {
            Error::config(key_path, format!("expected a byte count >= 0, found {n}"))
        }),
        Value::String(s) => parse_size(s).map_err(|why| Error::config(key_path, why)),
        other => Err(Error::config(
            key_path,
            format!("expected a byte count (e.g. 68719476736 or \"64GiB\"), found {other}"),
        )),
    }
}

/// Parses a byte count with the crate's one size parser ([`crate::config::size::parse_size`]):
/// an integer or a number with a unit (`64GiB`, `1.5 KiB`, `2MB`).
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    crate::config::size::parse_size(s).map_err(|e| e.to_string())
}
