//! The G3 tier's configuration: the `secondary_tiers[i]` keys of a `type = "nvme"` entry,
//! parsed from [`TierConfig::params`] and validated.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;

use crate::config::in_flight::{check_max_bytes_in_flight, max_bytes_in_flight};
use crate::config::model::EvictionPolicyKind;
use crate::config::model::TierConfig;
use crate::contract::admission::AdmissionKind;
use crate::error::{Error, Result};
use crate::geometry::ChunkGeometry;
use crate::io::{IdlePolicy, IoEngineKind};
use crate::region::AdoptHugePages;
use crate::size::{count, format_size_human};

mod params;

#[cfg(any(test, feature = "test-support"))]
pub use params::{KNOWN_KEYS, parse_size};
use params::{Params, bad_choice};

/// Default cap on bytes moving between the primary and the slabs at once (unless a row is
/// larger: [`crate::config::in_flight`]).
#[cfg(any(test, feature = "test-support"))]
pub use crate::config::in_flight::DEFAULT_MAX_BYTES_IN_FLIGHT;
/// Default number of jobs that may wait in the tier's queue before new ones fail fast.
pub const DEFAULT_MAX_QUEUED_JOBS: usize = 4096;
/// Largest `max_queued_jobs` (the job channels preallocate one slot per queued job).
pub const MAX_QUEUED_JOBS_LIMIT: usize = 65_536;
/// Default journal size that triggers a checkpoint.
pub const DEFAULT_CHECKPOINT_JOURNAL_BYTES: u64 = 64 << 20;
/// Smallest `max_journal_bytes`.
pub const MIN_MAX_JOURNAL_BYTES: u64 = 64 << 10;

/// The default `max_journal_bytes`: four times `checkpoint_journal_bytes`, at least 64 MiB.
pub fn default_max_journal_bytes(checkpoint_journal_bytes: u64) -> u64 {
    checkpoint_journal_bytes.saturating_mul(4).max(64 << 20)
}

/// Whether O_DIRECT is mandatory (`direct_io`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DirectIoMode {
    /// A path without working O_DIRECT is a start-up error (default).
    #[default]
    Required,
    /// Fall back to buffered I/O on such a path, with one warning and a metric.
    Auto,
}

impl DirectIoMode {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            DirectIoMode::Required => "required",
            DirectIoMode::Auto => "auto",
        }
    }
}

/// Whether chunks may move between GPU memory and the slots by GPUDirect Storage (`gds`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GdsMode {
    /// Never: GPU chunks go through the primary row (the CPU path). The default.
    #[default]
    Off,
    /// When GDS can start here; otherwise the CPU path, with the reason logged once and
    /// exported (`g3_gds_info`).
    Auto,
    /// GDS or a start-up error naming what is missing.
    Required,
}

impl GdsMode {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            GdsMode::Off => "off",
            GdsMode::Auto => "auto",
            GdsMode::Required => "required",
        }
    }
}

/// When metadata and data are forced to stable storage (`fsync`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FsyncPolicy {
    /// Before a store job is reported: `fdatasync` of the slabs written, then of the journal
    /// (default). A reported store survives power loss.
    #[default]
    Always,
    /// Never per job; only at checkpoints and shutdown. A crash may lose recent stores (they
    /// become misses, never wrong bytes: every slot is CRC-checked).
    Never,
}

impl FsyncPolicy {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FsyncPolicy::Always => "always",
            FsyncPolicy::Never => "never",
        }
    }
}

/// What a tier does when a path is on another filesystem than the tier was created on
/// (`on_wrong_filesystem`; see `docs/g3.md`, "The wrong disk").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WrongFilesystem {
    /// Refuse to open, naming the path and both filesystems (default).
    #[default]
    Refuse,
    /// Run without the tier: it serves nothing (lookups miss, jobs fail), and its health
    /// and `g3_wrong_filesystem{path}` say why. Only where the tier is built from a
    /// configuration (`kvtier serve`, [`crate::Builder`], the Python package).
    Degraded,
}

impl WrongFilesystem {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            WrongFilesystem::Refuse => "refuse",
            WrongFilesystem::Degraded => "degraded",
        }
    }
}

/// Validated configuration of one G3 tier.
#[derive(Debug, Clone, PartialEq)]
pub struct G3TierConfig {
    /// One directory per device; a slab file is created in each.
    pub paths: Vec<PathBuf>,
    /// Total capacity over all paths, split evenly, rounded down to whole slots.
    pub capacity_bytes: u64,
    /// Cap on bytes of I/O submitted and not yet completed; `None` (the key not set):
    /// max(64 MiB, one row). See [`G3TierConfig::max_bytes_in_flight_for`].
    pub max_bytes_in_flight: Option<u64>,
    /// Which I/O engine moves the bytes.
    pub io_engine: IoEngineKind,
    /// Whether O_DIRECT is mandatory.
    pub direct_io: DirectIoMode,
    /// Durability policy.
    pub fsync: FsyncPolicy,
    /// Journal size (bytes) after which the index is checkpointed and the journal restarted.
    pub checkpoint_journal_bytes: u64,
    /// Journal size past which stores are refused (checkpoints are failing) until a
    /// checkpoint succeeds.
    pub max_journal_bytes: u64,
    /// Longest time between checkpoints while the journal has records (`None`: size only).
    pub checkpoint_interval: Option<Duration>,
    /// Jobs that may wait in the queue; beyond this a submission fails at once.
    pub max_queued_jobs: usize,
    /// How the worker waits once it has no work (`idle_poll_us`, `idle_linger_ms`).
    pub idle: IdlePolicy,
    /// GPUDirect Storage (`gds`).
    pub gds: GdsMode,
    /// Which offered keys the tier writes (`admission`: `all` or `tinylfu`; see
    /// [`crate::contract::admission`]).
    pub admission: AdmissionKind,
    /// How the tier picks the entry a store evicts when it is full (`eviction_policy`: `lru`
    /// or `arc`, as the primary's top-level key; default `lru`). Admission weighs a candidate
    /// against the entry this policy would evict.
    pub eviction_policy: EvictionPolicyKind,
    /// Bytes of each primary row the tier stores: a prefix of the row, so slots can be
    /// smaller than rows. `None`: the whole row. Not a config key: the embedding sets it (a
    /// canonical layout stores only its canonical area, which is shorter than vLLM's row for
    /// GQA models with replicated KV heads; see docs/canonical.md).
    pub slot_bytes: Option<u64>,
    /// Whether a primary region the tier *adopts* (vLLM's `/dev/shm` region, adopted by the
    /// Python tier) may be moved through kvtier's own 2 MiB-page mapping of it
    /// (`region_huge_pages`: `auto` or `never`; see
    /// [`crate::region::PrimaryRegion::adopt_shared`]). kvtier's own region ignores it.
    pub region_huge_pages: AdoptHugePages,
    /// `layout`, only in vLLM's entry (type `KvtierTier`): the layout descriptor (a shipped
    /// name or a path) that names the canonical area of vLLM's rows; the Python package
    /// checks it against vLLM's configuration and sets [`G3TierConfig::slot_bytes`] from it
    /// (docs/canonical.md). `None`: whole rows.
    pub layout: Option<String>,
    /// `enable_kv_events` (default false): whether this tier records stored / removed
    /// events. As in vLLM 0.33's fs tier, only together with the host's global KV-events
    /// switch ([`crate::Builder::events`], vLLM's `--kv-events-config`): events flow when
    /// both are on.
    pub enable_kv_events: bool,
    /// What to do when a path is found on another filesystem than the tier was created on
    /// (`on_wrong_filesystem`).
    pub on_wrong_filesystem: WrongFilesystem,
}

impl G3TierConfig {
    /// A configuration with defaults for everything but the paths and capacity.
    pub fn new(paths: Vec<PathBuf>, capacity_bytes: u64) -> Self {
        G3TierConfig {
            paths,
            capacity_bytes,
            max_bytes_in_flight: None,
            io_engine: IoEngineKind::Auto,
            direct_io: DirectIoMode::Required,
            fsync: FsyncPolicy::Always,
            checkpoint_journal_bytes: DEFAULT_CHECKPOINT_JOURNAL_BYTES,
            max_journal_bytes: default_max_journal_bytes(DEFAULT_CHECKPOINT_JOURNAL_BYTES),
            checkpoint_interval: Some(Duration::from_secs(60)),
            max_queued_jobs: DEFAULT_MAX_QUEUED_JOBS,
            idle: IdlePolicy::default(),
            gds: GdsMode::Off,
            admission: AdmissionKind::All,
            eviction_policy: EvictionPolicyKind::Lru,
            slot_bytes: None,
            region_huge_pages: AdoptHugePages::Auto,
            layout: None,
            enable_kv_events: false,
            on_wrong_filesystem: WrongFilesystem::Refuse,
        }
    }

    /// Bytes per slot for primary rows of `row_stride` bytes: [`G3TierConfig::slot_bytes`]
    /// when set (a positive multiple of 4096 no larger than the row), else the row.
    pub fn slot_bytes_for(&self, row_stride: u64) -> Result<u64> {
        let Some(slot) = self.slot_bytes else {
            return Ok(row_stride);
        };
        let align = crate::geometry::ROW_ALIGNMENT as u64;
        if slot == 0 || !slot.is_multiple_of(align) || slot > row_stride {
            return Err(Error::config(
                "slot_bytes",
                format!(
                    "must be a positive multiple of {align} no larger than the row ({row_stride}), found {slot}"
                ),
            ));
        }
        Ok(slot)
    }

    /// Parses and validates the tier's `params`. Unknown keys are errors naming
    /// `secondary_tiers[i].<key>` with the closest known key.
    pub fn from_tier(tc: &TierConfig) -> Result<Self> {
        let p = Params {
            map: &tc.params,
            prefix: tc.key_path(),
        };
        p.check_known_keys()?;
        let paths = p.paths()?;
        let capacity_bytes = p.size("capacity_bytes")?;
        let mut cfg = G3TierConfig::new(paths, capacity_bytes.unwrap_or(0));
        if let Some(n) = p.size("max_bytes_in_flight")? {
            cfg.max_bytes_in_flight = Some(n);
        }
        if let Some(e) = p.choice("io_engine", &IO_ENGINES)? {
            cfg.io_engine = e;
        }
        if let Some(m) = p.choice("direct_io", &DIRECT_IO_MODES)? {
            cfg.direct_io = m;
        }
        if let Some(f) = p.choice("fsync", &FSYNC_POLICIES)? {
            cfg.fsync = f;
        }
        if let Some(n) = p.size("checkpoint_journal_bytes")? {
            cfg.checkpoint_journal_bytes = n;
        }
        cfg.max_journal_bytes = default_max_journal_bytes(cfg.checkpoint_journal_bytes);
        if let Some(n) = p.size("max_journal_bytes")? {
            cfg.max_journal_bytes = n;
        }
        if let Some(v) = p.map.get("checkpoint_interval_s") {
            let secs = v
                .as_f64()
                .filter(|s| (0.0..=MAX_CHECKPOINT_INTERVAL_S as f64).contains(s))
                .ok_or_else(|| checkpoint_interval_error(&p.path("checkpoint_interval_s"), v))?;
            // In range, so the conversion cannot fail (nor overflow any later arithmetic).
            cfg.checkpoint_interval = (secs > 0.0)
                .then(|| Duration::try_from_secs_f64(secs).ok())
                .flatten();
        }
        if let Some(v) = p.map.get("max_queued_jobs") {
            cfg.max_queued_jobs = v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| queued_jobs_error(&p.path("max_queued_jobs"), v))?;
        }
        if let Some(g) = p.choice("gds", &GDS_MODES)? {
            cfg.gds = g;
        }
        if let Some(name) = p.str("admission")? {
            cfg.admission = AdmissionKind::parse(name)
                .ok_or_else(|| bad_choice(&p.path("admission"), name, &AdmissionKind::CHOICES))?;
        }
        if let Some(name) = p.str("eviction_policy")? {
            // Case-insensitive, as the primary's top-level `eviction_policy`.
            cfg.eviction_policy = match name.to_ascii_lowercase().as_str() {
                "lru" => EvictionPolicyKind::Lru,
                "arc" => EvictionPolicyKind::Arc,
                _ => {
                    return Err(bad_choice(
                        &p.path("eviction_policy"),
                        name,
                        &["lru", "arc"],
                    ));
                }
            };
        }
        if let Some(h) = p.choice("region_huge_pages", &REGION_HUGE_PAGES)? {
            cfg.region_huge_pages = h;
        }
        if let Some(w) = p.choice("on_wrong_filesystem", &WRONG_FILESYSTEM)? {
            cfg.on_wrong_filesystem = w;
        }
        // Only vLLM's entry may carry `layout`; the tier factory refuses it elsewhere.
        cfg.layout = p.str("layout")?.map(str::to_string);
        if let Some(v) = p.map.get("enable_kv_events") {
            cfg.enable_kv_events = v.as_bool().ok_or_else(|| {
                Error::config(
                    p.path("enable_kv_events"),
                    format!("expected true or false, found {v}"),
                )
            })?;
        }
        if let Some(v) = p.map.get("idle_poll_us") {
            cfg.idle.poll_interval = Duration::from_micros(idle_value(v, &p.path("idle_poll_us"))?);
        }
        if let Some(v) = p.map.get("idle_linger_ms") {
            cfg.idle.linger = Duration::from_millis(idle_value(v, &p.path("idle_linger_ms"))?);
        }
        cfg.validate(&p.prefix, None)?;
        if capacity_bytes.is_none() {
            return Err(Error::config(p.path("capacity_bytes"), "required"));
        }
        Ok(cfg)
    }

    /// The one rule set of a G3 tier's configuration, run by every way in: the config parser
    /// ([`G3TierConfig::from_tier`], so `kvtier config check` and `kvtier serve`), the tier
    /// factory and [`crate::g3::G3Tier::open`] (so `kvtier bench` and programmatic callers).
    ///
    /// Errors name `<key_prefix>.<key>` (`secondary_tiers[2].max_queued_jobs`; the bare key
    /// for an empty prefix). With the primary's `row_stride` known, the capacity is checked
    /// too: at least one slot per path and fewer than 2^32 - 1 slots in all; and
    /// `max_bytes_in_flight` holds at least one row (`crate::config::in_flight`). Slots are
    /// [`G3TierConfig::slot_bytes_for`] the row.
    pub fn validate(&self, key_prefix: &str, row_stride: Option<u64>) -> Result<()> {
        let kp = |k: &str| {
            if key_prefix.is_empty() {
                k.to_string()
            } else {
                format!("{key_prefix}.{k}")
            }
        };
        if self.paths.is_empty() {
            return Err(Error::config(kp("paths"), "needs at least one directory"));
        }
        if let Some(i) = self.paths.iter().position(|p| p.as_os_str().is_empty()) {
            return Err(Error::config(
                format!("{}[{i}]", kp("paths")),
                "expected a directory path string, found \"\"",
            ));
        }
        let row_stride = row_stride.map(|r| self.slot_bytes_for(r)).transpose()?;
        check_max_bytes_in_flight(
            &kp("max_bytes_in_flight"),
            self.max_bytes_in_flight,
            row_stride,
        )?;
        let floor = self.checkpoint_journal_bytes.max(MIN_MAX_JOURNAL_BYTES);
        if self.max_journal_bytes < floor {
            return Err(Error::config(
                kp("max_journal_bytes"),
                format!(
                    "must be at least checkpoint_journal_bytes and 64 KiB ({}), found {}",
                    format_size_human(floor),
                    format_size_human(self.max_journal_bytes)
                ),
            ));
        }
        if !(1..=MAX_QUEUED_JOBS_LIMIT).contains(&self.max_queued_jobs) {
            return Err(queued_jobs_error(
                &kp("max_queued_jobs"),
                self.max_queued_jobs,
            ));
        }
        if let Some(iv) = self.checkpoint_interval
            && iv > Duration::from_secs(MAX_CHECKPOINT_INTERVAL_S)
        {
            return Err(checkpoint_interval_error(
                &kp("checkpoint_interval_s"),
                format!("{} s", iv.as_secs_f64()),
            ));
        }
        if self.idle.poll_interval.as_micros() > IDLE_VALUE_LIMIT.into() {
            return Err(idle_error(
                &kp("idle_poll_us"),
                self.idle.poll_interval.as_micros(),
            ));
        }
        if self.idle.linger.as_millis() > IDLE_VALUE_LIMIT.into() {
            return Err(idle_error(
                &kp("idle_linger_ms"),
                self.idle.linger.as_millis(),
            ));
        }
        let Some(row_stride) = row_stride else {
            return Ok(());
        };
        let n = self.paths.len();
        if ChunkGeometry::slots_per_file(self.capacity_bytes, n, row_stride) == 0 {
            return Err(Error::config(
                kp("capacity_bytes"),
                format!(
                    "{} holds no slot of {} on each of {}",
                    format_size_human(self.capacity_bytes),
                    format_size_human(row_stride),
                    count(n as u64, "path")
                ),
            ));
        }
        let total = ChunkGeometry::total_slots(self.capacity_bytes, n, row_stride);
        if total >= u64::from(u32::MAX) {
            return Err(Error::config(
                kp("capacity_bytes"),
                format!(
                    "{total} slots of {} exceed the 2^32 - 1 slot limit",
                    format_size_human(row_stride)
                ),
            ));
        }
        Ok(())
    }
}

impl G3TierConfig {
    /// The cap on bytes in flight for rows of `row_stride` bytes: `max_bytes_in_flight`, or
    /// max(64 MiB, one row) when it is not set.
    pub fn max_bytes_in_flight_for(&self, row_stride: u64) -> u64 {
        max_bytes_in_flight(self.max_bytes_in_flight, row_stride)
    }
}

/// Largest `checkpoint_interval_s` (one year): every deadline computed from it stays far
/// from any overflow of `Instant` or `Duration` arithmetic.
pub const MAX_CHECKPOINT_INTERVAL_S: u64 = 365 * 24 * 3600;

fn checkpoint_interval_error(key_path: &str, found: impl std::fmt::Display) -> Error {
    Error::config(
        key_path,
        format!(
            "expected a number of seconds from 0 (size-triggered checkpoints only) to \
             {MAX_CHECKPOINT_INTERVAL_S} (one year), found {found}"
        ),
    )
}

/// Largest `idle_poll_us` / `idle_linger_ms`.
const IDLE_VALUE_LIMIT: u32 = 1_000_000;

fn queued_jobs_error(key_path: &str, found: impl std::fmt::Display) -> Error {
    Error::config(
        key_path,
        format!("expected a whole number from 1 to {MAX_QUEUED_JOBS_LIMIT}, found {found}"),
    )
}

fn idle_error(key_path: &str, found: impl std::fmt::Display) -> Error {
    Error::config(
        key_path,
        format!("expected a whole number from 0 to {IDLE_VALUE_LIMIT}, found {found}"),
    )
}

/// An `idle_*` value: a whole number (its range is checked by [`G3TierConfig::validate`]).
fn idle_value(v: &Value, key_path: &str) -> Result<u64> {
    v.as_u64().ok_or_else(|| idle_error(key_path, v))
}

/// The choices of `io_engine`, in the order errors list them.
const IO_ENGINES: [(&str, IoEngineKind); 3] = [
    ("auto", IoEngineKind::Auto),
    ("uring", IoEngineKind::Uring),
    ("psync", IoEngineKind::Psync),
];
/// The choices of `direct_io`.
const DIRECT_IO_MODES: [(&str, DirectIoMode); 2] = [
    ("required", DirectIoMode::Required),
    ("auto", DirectIoMode::Auto),
];
/// The choices of `fsync`.
const FSYNC_POLICIES: [(&str, FsyncPolicy); 2] = [
    ("always", FsyncPolicy::Always),
    ("never", FsyncPolicy::Never),
];
/// The choices of `gds`.
const GDS_MODES: [(&str, GdsMode); 3] = [
    ("off", GdsMode::Off),
    ("auto", GdsMode::Auto),
    ("required", GdsMode::Required),
];
/// The choices of `region_huge_pages`.
const REGION_HUGE_PAGES: [(&str, AdoptHugePages); 2] = [
    ("auto", AdoptHugePages::Auto),
    ("never", AdoptHugePages::Never),
];
/// The choices of `on_wrong_filesystem`.
const WRONG_FILESYSTEM: [(&str, WrongFilesystem); 2] = [
    ("refuse", WrongFilesystem::Refuse),
    ("degraded", WrongFilesystem::Degraded),
];

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tier(params: Value) -> TierConfig {
        TierConfig {
            index: 2,
            tier_type: "nvme".into(),
            locality: None,
            backpressure: None,
            params: params.as_object().cloned().unwrap_or_default(),
        }
    }

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("64GiB"), Ok(64 << 30));
        assert_eq!(parse_size("1.5 KiB"), Ok(1536));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("2MB"), Ok(2_000_000));
        assert_eq!(parse_size("1_024 K"), Ok(1 << 20));
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("0.3B").is_err());
        assert!(parse_size("99999999999TiB").is_err());
    }

    #[test]
    fn full_config_parses() {
        let c = G3TierConfig::from_tier(&tier(json!({
            "paths": ["/a", "/b"], "capacity_bytes": "1GiB", "max_bytes_in_flight": 1048576,
            "io_engine": "psync", "direct_io": "auto", "fsync": "never",
            "checkpoint_journal_bytes": "1MiB", "checkpoint_interval_s": 0, "max_queued_jobs": 7
        })))
        .unwrap();
        assert_eq!(c.paths, vec![PathBuf::from("/a"), PathBuf::from("/b")]);
        assert_eq!(c.capacity_bytes, 1 << 30);
        assert_eq!(c.max_bytes_in_flight, Some(1 << 20));
        assert_eq!(c.io_engine, IoEngineKind::Psync);
        assert_eq!(c.direct_io, DirectIoMode::Auto);
        assert_eq!(c.fsync, FsyncPolicy::Never);
        assert_eq!(c.checkpoint_journal_bytes, 1 << 20);
        // Four times the checkpoint size, at least 64 MiB.
        assert_eq!(c.max_journal_bytes, 64 << 20);
        assert_eq!(c.checkpoint_interval, None);
        assert_eq!(c.max_queued_jobs, 7);
        assert_eq!(c.idle, IdlePolicy::default());
        assert_eq!(c.gds, GdsMode::Off);
        let off = G3TierConfig::from_tier(&tier(json!({
            "paths": "/x", "capacity_bytes": 8192, "idle_poll_us": 20, "idle_linger_ms": 0,
            "gds": "required"
        })))
        .unwrap();
        assert_eq!(off.gds, GdsMode::Required);
        assert_eq!(c.region_huge_pages, AdoptHugePages::Auto);
        let never = G3TierConfig::from_tier(&tier(json!({
            "paths": "/x", "capacity_bytes": 8192, "region_huge_pages": "never"
        })))
        .unwrap();
        assert_eq!(never.region_huge_pages, AdoptHugePages::Never);
        assert_eq!(off.idle.poll_interval, Duration::from_micros(20));
        assert!(!off.idle.lingers());
        let d =
            G3TierConfig::from_tier(&tier(json!({"paths": "/x", "capacity_bytes": 8192}))).unwrap();
        assert_eq!(d.direct_io, DirectIoMode::Required);
        assert_eq!(d.max_bytes_in_flight, None);
        assert_eq!(d.max_bytes_in_flight_for(4096), DEFAULT_MAX_BYTES_IN_FLIGHT);
    }

    #[test]
    fn unknown_key_names_path_and_suggests() {
        let e = G3TierConfig::from_tier(&tier(json!({
            "paths": ["/a"], "capacity_bytes": 1, "max_bytes_inflight": 5
        })))
        .unwrap_err();
        assert_eq!(e.kind(), crate::error::ErrorKind::Config);
        assert_eq!(
            e.context_value("key"),
            Some("secondary_tiers[2].max_bytes_inflight")
        );
        assert_eq!(e.context_value("did_you_mean"), Some("max_bytes_in_flight"));
    }

    #[test]
    fn layout_is_a_string() {
        let mut t = tier(json!({"paths": ["/a"], "capacity_bytes": 1, "layout": "qwen2.5-3b"}));
        let cfg = G3TierConfig::from_tier(&t).unwrap();
        assert_eq!(cfg.layout.as_deref(), Some("qwen2.5-3b"));
        t.params.insert("layout".into(), json!(3));
        let e = G3TierConfig::from_tier(&t).unwrap_err();
        assert_eq!(e.context_value("key"), Some("secondary_tiers[2].layout"));
    }

    #[test]
    fn bad_values_name_their_key() {
        let cases = [
            (json!({"capacity_bytes": 1}), "secondary_tiers[2].paths"),
            (json!({"paths": []}), "secondary_tiers[2].paths"),
            (
                json!({"paths": ["/a"]}),
                "secondary_tiers[2].capacity_bytes",
            ),
            (
                json!({"paths": [3], "capacity_bytes": 1}),
                "secondary_tiers[2].paths[0]",
            ),
            (
                json!({"paths": ["/a"], "capacity_bytes": "big"}),
                "secondary_tiers[2].capacity_bytes",
            ),
            (
                json!({"paths": ["/a"], "capacity_bytes": 1, "io_engine": "spdk"}),
                "secondary_tiers[2].io_engine",
            ),
            (
                json!({"paths": ["/a"], "capacity_bytes": 1, "direct_io": "off"}),
                "secondary_tiers[2].direct_io",
            ),
            (
                json!({"paths": ["/a"], "capacity_bytes": 1, "region_huge_pages": "always"}),
                "secondary_tiers[2].region_huge_pages",
            ),
            (
                json!({"paths": ["/a"], "capacity_bytes": 1, "region_huge_pages": false}),
                "secondary_tiers[2].region_huge_pages",
            ),
            (
                json!({"paths": ["/a"], "capacity_bytes": 1, "max_bytes_in_flight": 0}),
                "secondary_tiers[2].max_bytes_in_flight",
            ),
            (
                json!({"paths": ["/a"], "capacity_bytes": 1, "max_queued_jobs": 65537}),
                "secondary_tiers[2].max_queued_jobs",
            ),
            (
                json!({"paths": ["/a"], "capacity_bytes": 1, "idle_poll_us": -1}),
                "secondary_tiers[2].idle_poll_us",
            ),
            (
                json!({"paths": ["/a"], "capacity_bytes": 1, "idle_linger_ms": "50ms"}),
                "secondary_tiers[2].idle_linger_ms",
            ),
            (
                json!({"paths": ["/a"], "capacity_bytes": 1, "idle_linger_ms": 1_000_001}),
                "secondary_tiers[2].idle_linger_ms",
            ),
            (
                json!({"paths": ["/a"], "capacity_bytes": 1, "gds": "on"}),
                "secondary_tiers[2].gds",
            ),
            (
                json!({"paths": ["/a"], "capacity_bytes": 1, "gds": true}),
                "secondary_tiers[2].gds",
            ),
            (
                json!({"paths": ["/a"], "capacity_bytes": 1, "max_journal_bytes": "1KiB"}),
                "secondary_tiers[2].max_journal_bytes",
            ),
            (
                json!({"paths": ["/a"], "capacity_bytes": 1,
                       "checkpoint_journal_bytes": "1GiB", "max_journal_bytes": "512MiB"}),
                "secondary_tiers[2].max_journal_bytes",
            ),
        ];
        for (params, key) in cases {
            let e = G3TierConfig::from_tier(&tier(params.clone())).unwrap_err();
            assert_eq!(e.context_value("key"), Some(key), "{params}: {e}");
        }
    }
}

#[cfg(test)]
mod slot_bytes_tests {
    use super::*;

    #[test]
    fn slots_are_the_row_or_a_page_aligned_prefix_of_it() {
        let mut cfg = G3TierConfig::new(vec![PathBuf::from("/tmp/x")], 1 << 30);
        assert_eq!(cfg.slot_bytes_for(3 << 20).unwrap(), 3 << 20);
        cfg.slot_bytes = Some(1 << 20);
        assert_eq!(cfg.slot_bytes_for(3 << 20).unwrap(), 1 << 20);
        cfg.validate("", Some(3 << 20)).unwrap();
        for bad in [0, 1000, 4 << 20] {
            cfg.slot_bytes = Some(bad);
            let e = cfg.validate("", Some(3 << 20)).unwrap_err();
            assert!(e.to_string().contains("slot_bytes"), "{e}");
        }
    }
}
