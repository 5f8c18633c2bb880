//! The `fs` tier's configuration: the `secondary_tiers[i]` keys of a `type = "fs"` entry,
//! parsed from [`TierConfig::params`] and validated. The reference is `docs/configuration.md`.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;

use crate::config::TierConfig;
use crate::config::in_flight::{check_max_bytes_in_flight, max_bytes_in_flight};
use crate::config::size::parse_size;
use crate::error::{Error, Result};
use crate::g3::DirectIoMode;
use crate::io::IoEngineKind;
use crate::size::format_size_human;

/// Default cap on bytes moving between the primary and chunk files at once (unless a row is
/// larger: [`crate::config::in_flight`]).
#[cfg(any(test, feature = "test-support"))]
pub use crate::config::in_flight::DEFAULT_MAX_BYTES_IN_FLIGHT;
/// Default number of threads for the blocking per-file steps (open, xattr, rename, close),
/// as many as vLLM's fs tier has threads of each kind.
pub const DEFAULT_IO_THREADS: usize = 16;
/// Default number of threads that check whether chunk files exist (lookups).
pub const DEFAULT_LOOKUP_THREADS: usize = 4;
/// Default bound on cached lookup verdicts.
pub const DEFAULT_LOOKUP_CACHE_ENTRIES: usize = 65_536;
/// Default time a lookup may stay unresolved before it is answered MISS.
pub const DEFAULT_LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);
/// Default age after which a temporary file found at start is someone's leftover.
pub const DEFAULT_STALE_TEMP_AGE: Duration = Duration::from_secs(600);
/// Default number of jobs that may wait before new ones fail fast.
pub const DEFAULT_MAX_QUEUED_JOBS: usize = 4096;
/// Largest `max_queued_jobs`.
pub const MAX_QUEUED_JOBS_LIMIT: usize = 65_536;
/// Largest `io_threads` / `lookup_threads`.
pub const MAX_THREADS: usize = 256;

/// When a stored chunk file is forced to stable storage (`fsync`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FsSync {
    /// Never (default, as vLLM's fs tier): a crash may lose recent files, whose CRC then
    /// fails (a miss, never wrong bytes).
    #[default]
    Never,
    /// `fdatasync` of each file before it is published, and of its directory after.
    Always,
}

impl FsSync {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FsSync::Never => "never",
            FsSync::Always => "always",
        }
    }
}

/// How stored chunks are made verifiable (`integrity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Integrity {
    /// A CRC32 record in the user extended attribute `user.kvtier.crc` of every file kvtier
    /// stores (default). A filesystem without user xattrs is refused at start.
    #[default]
    Xattr,
    /// No record is written (for filesystems without user xattrs, chosen explicitly): loads
    /// still check the records other hosts wrote, and count the rest as unverified.
    None,
}

impl Integrity {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Integrity::Xattr => "xattr",
            Integrity::None => "none",
        }
    }
}

/// Validated configuration of one `fs` tier.
#[derive(Debug, Clone, PartialEq)]
pub struct FsTierConfig {
    /// The shared directory (vLLM's `root_dir`); must exist and be writable.
    pub root_dir: PathBuf,
    /// Bytes of chunk files this process keeps under `root_dir` before it evicts.
    pub capacity_bytes: u64,
    /// Cap on bytes of chunk transfers in progress (stores and loads together); `None` (the
    /// key not set): max(64 MiB, one row). See [`FsTierConfig::max_bytes_in_flight_for`].
    pub max_bytes_in_flight: Option<u64>,
    /// Which I/O engine moves the bytes.
    pub io_engine: IoEngineKind,
    /// Whether O_DIRECT is mandatory (`auto` by default here: buffered with a warning).
    pub direct_io: DirectIoMode,
    /// Durability of stored files.
    pub fsync: FsSync,
    /// Integrity records.
    pub integrity: Integrity,
    /// vLLM's fs tier's `enable_kv_events` (default false): stored / removed events only when
    /// this and the host's KV-events switch are both on.
    pub enable_kv_events: bool,
    /// Threads for the blocking per-file steps (and psync engine threads).
    pub io_threads: usize,
    /// Threads that check existence for lookups.
    pub lookup_threads: usize,
    /// Bound on cached lookup verdicts.
    pub lookup_cache_entries: usize,
    /// A lookup still unresolved after this long is answered MISS.
    pub lookup_timeout: Duration,
    /// Temporary files older than this found at start are removed.
    pub stale_temp_age: Duration,
    /// Jobs that may wait; beyond this a submission fails at once.
    pub max_queued_jobs: usize,
}

/// Every key a `type = "fs"` tier accepts in its params (`module_path` is accepted and
/// ignored, as for `nvme`).
pub const KNOWN_KEYS: &[&str] = &[
    "root_dir",
    "capacity_bytes",
    "max_bytes_in_flight",
    "io_engine",
    "direct_io",
    "fsync",
    "integrity",
    "io_threads",
    "lookup_threads",
    "lookup_cache_entries",
    "lookup_timeout_ms",
    "stale_temp_s",
    "max_queued_jobs",
    "enable_kv_events",
    "module_path",
];

impl FsTierConfig {
    /// A configuration with defaults for everything but the directory and capacity.
    pub fn new(root_dir: impl Into<PathBuf>, capacity_bytes: u64) -> Self {
        FsTierConfig {
            root_dir: root_dir.into(),
            capacity_bytes,
            max_bytes_in_flight: None,
            io_engine: IoEngineKind::Auto,
            direct_io: DirectIoMode::Auto,
            fsync: FsSync::Never,
            integrity: Integrity::Xattr,
            enable_kv_events: false,
            io_threads: DEFAULT_IO_THREADS,
            lookup_threads: DEFAULT_LOOKUP_THREADS,
            lookup_cache_entries: DEFAULT_LOOKUP_CACHE_ENTRIES,
            lookup_timeout: DEFAULT_LOOKUP_TIMEOUT,
            stale_temp_age: DEFAULT_STALE_TEMP_AGE,
            max_queued_jobs: DEFAULT_MAX_QUEUED_JOBS,
        }
    }

    /// Parses and validates the tier's `params`. Every error names `secondary_tiers[i].<key>`.
    pub fn from_tier(tc: &TierConfig) -> Result<Self> {
        let prefix = tc.key_path();
        let kp = |k: &str| format!("{prefix}.{k}");
        for key in tc.params.keys() {
            if KNOWN_KEYS.contains(&key.as_str()) {
                continue;
            }
            let mut e = Error::config(kp(key), "unknown key for a tier of type fs");
            if matches!(key.as_str(), "n_read_threads" | "n_write_threads") {
                e = e.with(
                    "note",
                    "vLLM's fs keys; kvtier's fs tier has one pool of io_threads and caps bytes \
                     in flight instead",
                );
            }
            if let Some(s) = closest_key(key) {
                e = e.with("did_you_mean", s);
            }
            return Err(e.with("known_keys", KNOWN_KEYS.join(", ")));
        }
        let p = &tc.params;
        let root_dir = match p.get("root_dir") {
            None => return Err(Error::config(kp("root_dir"), "required (one directory)")),
            Some(Value::String(s)) if !s.is_empty() => PathBuf::from(s),
            Some(other) => {
                return Err(Error::config(
                    kp("root_dir"),
                    format!("expected a directory path string, found {other}"),
                ));
            }
        };
        let capacity_bytes = match p.get("capacity_bytes") {
            None => {
                return Err(Error::config(
                    kp("capacity_bytes"),
                    "required (the bytes of chunk files this process keeps before it evicts)",
                ));
            }
            Some(v) => size(v, &kp("capacity_bytes"))?,
        };
        let mut cfg = FsTierConfig::new(root_dir, capacity_bytes);
        if let Some(v) = p.get("max_bytes_in_flight") {
            cfg.max_bytes_in_flight = Some(size(v, &kp("max_bytes_in_flight"))?);
        }
        if let Some(v) = p.get("io_engine") {
            cfg.io_engine = match choice(v, &kp("io_engine"), &["auto", "uring", "psync"])? {
                "uring" => IoEngineKind::Uring,
                "psync" => IoEngineKind::Psync,
                _ => IoEngineKind::Auto,
            };
        }
        if let Some(v) = p.get("direct_io") {
            cfg.direct_io = match choice(v, &kp("direct_io"), &["auto", "required"])? {
                "required" => DirectIoMode::Required,
                _ => DirectIoMode::Auto,
            };
        }
        if let Some(v) = p.get("fsync") {
            cfg.fsync = match choice(v, &kp("fsync"), &["never", "always"])? {
                "always" => FsSync::Always,
                _ => FsSync::Never,
            };
        }
        if let Some(v) = p.get("integrity") {
            cfg.integrity = match choice(v, &kp("integrity"), &["xattr", "none"])? {
                "none" => Integrity::None,
                _ => Integrity::Xattr,
            };
        }
        if let Some(v) = p.get("io_threads") {
            cfg.io_threads = count(v, &kp("io_threads"))?;
        }
        if let Some(v) = p.get("lookup_threads") {
            cfg.lookup_threads = count(v, &kp("lookup_threads"))?;
        }
        if let Some(v) = p.get("lookup_cache_entries") {
            cfg.lookup_cache_entries = count(v, &kp("lookup_cache_entries"))?;
        }
        if let Some(v) = p.get("lookup_timeout_ms") {
            cfg.lookup_timeout = Duration::from_millis(whole(v, &kp("lookup_timeout_ms"))?);
        }
        if let Some(v) = p.get("stale_temp_s") {
            cfg.stale_temp_age = Duration::from_secs(whole(v, &kp("stale_temp_s"))?);
        }
        if let Some(v) = p.get("max_queued_jobs") {
            cfg.max_queued_jobs = count(v, &kp("max_queued_jobs"))?;
        }
        if let Some(v) = p.get("enable_kv_events") {
            cfg.enable_kv_events = v.as_bool().ok_or_else(|| {
                Error::config(
                    kp("enable_kv_events"),
                    format!("expected true or false, found {v}"),
                )
            })?;
        }
        cfg.validate(&prefix, None)?;
        Ok(cfg)
    }

    /// The cap on bytes in flight for rows of `row_stride` bytes: `max_bytes_in_flight`, or
    /// max(64 MiB, one row) when it is not set.
    pub fn max_bytes_in_flight_for(&self, row_stride: u64) -> u64 {
        max_bytes_in_flight(self.max_bytes_in_flight, row_stride)
    }

    /// The rules of every value, however the configuration was built (parser, code); with the
    /// row stride known (`Some`), also that the capacity holds at least one chunk file. Errors
    /// name `<key_prefix>.<key>` (just `<key>` for an empty prefix).
    pub fn validate(&self, key_prefix: &str, row_stride: Option<u64>) -> Result<()> {
        let kp = |k: &str| {
            if key_prefix.is_empty() {
                k.to_string()
            } else {
                format!("{key_prefix}.{k}")
            }
        };
        let range = |key: &str, found: u64, min: u64, max: u64| {
            if (min..=max).contains(&found) {
                Ok(())
            } else {
                Err(Error::config(
                    kp(key),
                    format!("expected a whole number from {min} to {max}, found {found}"),
                ))
            }
        };
        if self.root_dir.as_os_str().is_empty() {
            return Err(Error::config(
                kp("root_dir"),
                "expected a directory path string, found \"\"",
            ));
        }
        if self.capacity_bytes == 0 {
            return Err(Error::config(kp("capacity_bytes"), "must be > 0"));
        }
        check_max_bytes_in_flight(
            &kp("max_bytes_in_flight"),
            self.max_bytes_in_flight,
            row_stride,
        )?;
        range("io_threads", self.io_threads as u64, 1, MAX_THREADS as u64)?;
        range(
            "lookup_threads",
            self.lookup_threads as u64,
            1,
            MAX_THREADS as u64,
        )?;
        range(
            "lookup_cache_entries",
            self.lookup_cache_entries as u64,
            16,
            1 << 26,
        )?;
        let timeout_ms = u64::try_from(self.lookup_timeout.as_millis()).unwrap_or(u64::MAX);
        range("lookup_timeout_ms", timeout_ms, 1, 3_600_000)?;
        range("stale_temp_s", self.stale_temp_age.as_secs(), 1, 1 << 32)?;
        range(
            "max_queued_jobs",
            self.max_queued_jobs as u64,
            1,
            MAX_QUEUED_JOBS_LIMIT as u64,
        )?;
        if let Some(stride) = row_stride
            && self.capacity_bytes < stride
        {
            return Err(Error::config(
                kp("capacity_bytes"),
                format!(
                    "{} holds no chunk file of {} (one row)",
                    format_size_human(self.capacity_bytes),
                    format_size_human(stride)
                ),
            ));
        }
        Ok(())
    }
}

fn closest_key(key: &str) -> Option<&'static str> {
    KNOWN_KEYS
        .iter()
        .map(|k| (strsim::jaro_winkler(key, k), *k))
        .filter(|(score, _)| *score >= 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k)
}

/// A string value that must be one of `allowed`.
fn choice<'a>(v: &'a Value, key_path: &str, allowed: &[&str]) -> Result<&'a str> {
    let s = v
        .as_str()
        .ok_or_else(|| Error::config(key_path, format!("expected a string, found {v}")))?;
    if allowed.contains(&s) {
        Ok(s)
    } else {
        Err(Error::config(key_path, format!("unknown value {s:?}"))
            .with("expected", allowed.join(" | "))
            .with("found", s.to_string()))
    }
}

/// A whole number (`>= 0`); ranges are checked by [`FsTierConfig::validate`].
fn whole(v: &Value, key_path: &str) -> Result<u64> {
    v.as_u64()
        .ok_or_else(|| Error::config(key_path, format!("expected a whole number >= 0, found {v}")))
}

/// A whole number that fits `usize`.
fn count(v: &Value, key_path: &str) -> Result<usize> {
    usize::try_from(whole(v, key_path)?)
        .map_err(|_| Error::config(key_path, format!("{v} is too large")))
}

/// A byte count: an integer or a size string (`"64GiB"`); `> 0` is checked by
/// [`FsTierConfig::validate`].
fn size(v: &Value, key_path: &str) -> Result<u64> {
    match v {
        Value::Number(n) => n.as_u64().ok_or_else(|| {
            Error::config(key_path, format!("expected a byte count >= 0, found {n}"))
        }),
        Value::String(s) => parse_size(s).map_err(|e| Error::config(key_path, e.to_string())),
        other => Err(Error::config(
            key_path,
            format!("expected a byte count (e.g. 68719476736 or \"64GiB\"), found {other}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tier(params: Value) -> TierConfig {
        TierConfig {
            params: params.as_object().cloned().unwrap_or_default(),
            ..TierConfig::new(1, "fs")
        }
    }

    #[test]
    fn defaults_and_full_config() {
        let d = FsTierConfig::from_tier(&tier(json!({"root_dir": "/x", "capacity_bytes": "1GiB"})))
            .unwrap();
        assert_eq!(d, FsTierConfig::new("/x", 1 << 30));
        assert_eq!(d.direct_io, DirectIoMode::Auto);
        assert_eq!(d.integrity, Integrity::Xattr);
        let c = FsTierConfig::from_tier(&tier(json!({
            "root_dir": "/shared/kv", "capacity_bytes": 4096, "max_bytes_in_flight": "8MiB",
            "io_engine": "psync", "direct_io": "required", "fsync": "always",
            "integrity": "none", "io_threads": 3, "lookup_threads": 2,
            "lookup_cache_entries": 100, "lookup_timeout_ms": 250, "stale_temp_s": 60,
            "max_queued_jobs": 9, "module_path": "ignored"
        })))
        .unwrap();
        assert_eq!(c.root_dir, PathBuf::from("/shared/kv"));
        assert_eq!(c.max_bytes_in_flight, Some(8 << 20));
        assert_eq!(c.io_engine, IoEngineKind::Psync);
        assert_eq!(c.direct_io, DirectIoMode::Required);
        assert_eq!(c.fsync, FsSync::Always);
        assert_eq!(c.integrity, Integrity::None);
        assert_eq!((c.io_threads, c.lookup_threads), (3, 2));
        assert_eq!(c.lookup_cache_entries, 100);
        assert_eq!(c.lookup_timeout, Duration::from_millis(250));
        assert_eq!(c.stale_temp_age, Duration::from_secs(60));
        assert_eq!(c.max_queued_jobs, 9);
    }

    #[test]
    fn every_mistake_names_its_key() {
        let cases = [
            (json!({"capacity_bytes": 1}), "root_dir"),
            (json!({"root_dir": "", "capacity_bytes": 1}), "root_dir"),
            (json!({"root_dir": ["/a"], "capacity_bytes": 1}), "root_dir"),
            (json!({"root_dir": "/a"}), "capacity_bytes"),
            (
                json!({"root_dir": "/a", "capacity_bytes": 0}),
                "capacity_bytes",
            ),
            (
                json!({"root_dir": "/a", "capacity_bytes": "lots"}),
                "capacity_bytes",
            ),
            (
                json!({"root_dir": "/a", "capacity_bytes": 1, "max_bytes_in_flight": 0}),
                "max_bytes_in_flight",
            ),
            (
                json!({"root_dir": "/a", "capacity_bytes": 1, "io_engine": "spdk"}),
                "io_engine",
            ),
            (
                json!({"root_dir": "/a", "capacity_bytes": 1, "direct_io": "off"}),
                "direct_io",
            ),
            (
                json!({"root_dir": "/a", "capacity_bytes": 1, "fsync": true}),
                "fsync",
            ),
            (
                json!({"root_dir": "/a", "capacity_bytes": 1, "integrity": "sidecar"}),
                "integrity",
            ),
            (
                json!({"root_dir": "/a", "capacity_bytes": 1, "io_threads": 0}),
                "io_threads",
            ),
            (
                json!({"root_dir": "/a", "capacity_bytes": 1, "lookup_cache_entries": 2}),
                "lookup_cache_entries",
            ),
            (
                json!({"root_dir": "/a", "capacity_bytes": 1, "lookup_timeout_ms": -5}),
                "lookup_timeout_ms",
            ),
            (
                json!({"root_dir": "/a", "capacity_bytes": 1, "max_queued_jobs": 65537}),
                "max_queued_jobs",
            ),
        ];
        for (params, key) in cases {
            let e = FsTierConfig::from_tier(&tier(params.clone())).unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::Config, "{params}: {e}");
            let want = format!("secondary_tiers[1].{key}");
            assert_eq!(e.context_value("key"), Some(want.as_str()), "{params}: {e}");
        }
    }

    #[test]
    fn validate_checks_values_built_in_code_and_the_capacity_against_a_row() {
        let mut c = FsTierConfig::new("/x", 4096);
        c.validate("", Some(4096)).unwrap();
        let e = c.validate("t", Some(8192)).unwrap_err();
        assert_eq!(e.context_value("key"), Some("t.capacity_bytes"));
        c.io_threads = 0;
        let e = c.validate("", None).unwrap_err();
        assert_eq!(e.context_value("key"), Some("io_threads"));
    }

    #[test]
    fn unknown_keys_get_a_suggestion_and_vllm_thread_keys_a_note() {
        let e = FsTierConfig::from_tier(&tier(
            json!({"root_dir": "/a", "capacity_bytes": 1, "capacity_byte": 5}),
        ))
        .unwrap_err();
        assert_eq!(e.context_value("did_you_mean"), Some("capacity_bytes"));
        let e = FsTierConfig::from_tier(&tier(
            json!({"root_dir": "/a", "capacity_bytes": 1, "n_read_threads": 16}),
        ))
        .unwrap_err();
        assert!(
            e.context_value("note").unwrap().contains("io_threads"),
            "{e}"
        );
    }
}
