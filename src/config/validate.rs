//! The value rules of the resolved configuration types, one `validate` per type:
//! [`KvtierConfig::validate`], [`TierConfig::validate`], [`BackpressureConfig::validate`]
//! (the `nvme` tier's own keys: `crate::g3::G3TierConfig::validate`).
//!
//! Parsing ([`super::resolve`]) checks the shape of the value tree (types, known keys,
//! required keys) and then runs these rules, so `kvtier config check`, `kvtier serve`,
//! `kvtier bench` and an embedding that builds a [`KvtierConfig`] itself all get the same
//! answer. Errors name the full key path.

use std::path::PathBuf;

use serde_json::Value;

use super::backpressure::{DETECTOR_CLS, POLICY_CLASSES};
use super::fields::{index, join, range_error};
use super::model::{BackpressureConfig, ChunkSizing, KvtierConfig, ServiceConfig, TierConfig};
use crate::error::{Error, Result};

impl KvtierConfig {
    /// The rules of the whole configuration: `cpu_bytes_to_use` > 0, a positive chunk size,
    /// `store_threshold` 0 or 1, a usable `engine_id`, every tier valid
    /// ([`TierConfig::validate`]) at its own position, and no directory shared by two
    /// `nvme` tiers. Keys are named from the root of `kv_connector_extra_config`.
    pub fn validate(&self) -> Result<()> {
        self.validate_at("")
    }

    /// [`KvtierConfig::validate`] with key paths under `prefix` (`kv_connector_extra_config`
    /// when the configuration was wrapped in vLLM's `kv_transfer_config`).
    pub(crate) fn validate_at(&self, prefix: &str) -> Result<()> {
        let path = |k: &str| join(prefix, k);
        if self.cpu_bytes_to_use == 0 {
            return Err(range_error(&path("cpu_bytes_to_use"), "> 0 bytes", 0));
        }
        match self.chunk {
            ChunkSizing::BlockSizeTokens(0) => {
                return Err(range_error(
                    &path("block_size"),
                    "a positive integer number of tokens (a multiple of the GPU block size)",
                    0,
                ));
            }
            ChunkSizing::BlocksPerChunk(0) => {
                return Err(range_error(
                    &path("blocks_per_chunk"),
                    "a positive integer (GPU blocks per chunk)",
                    0,
                ));
            }
            _ => {}
        }
        if self.store_threshold >= 2 {
            return Err(store_threshold_error(
                &path("store_threshold"),
                self.store_threshold,
            ));
        }
        if let Some(id) = &self.engine_id {
            check_engine_id(&path("engine_id"), id)?;
        }
        if let Some(service) = &self.service {
            service.validate(&path("service"))?;
        }
        let tiers_path = path("secondary_tiers");
        for (i, t) in self.secondary_tiers.iter().enumerate() {
            if t.index != i {
                return Err(Error::config(
                    index(&tiers_path, i),
                    format!("holds the tier of position {} (index must be {i})", t.index),
                ));
            }
            t.validate_at(&tiers_path)?;
        }
        check_nvme_paths_distinct(&self.secondary_tiers, &tiers_path)
    }
}

/// `store_threshold` >= 2: vLLM's tiering spec rejects it.
impl ServiceConfig {
    /// The rules of the `service` object at `service_path`: an absolute socket path that fits
    /// a Unix socket address (107 bytes), permission bits within `0o777` that let the owner
    /// read and write.
    pub fn validate(&self, service_path: &str) -> Result<()> {
        let path = |k: &str| join(service_path, k);
        let socket = self.socket_path.as_os_str().len();
        if !self.socket_path.is_absolute() || socket == 0 || socket > 107 {
            return Err(range_error(
                &path("socket_path"),
                "an absolute path of at most 107 bytes (a Unix socket address)",
                self.socket_path.display(),
            ));
        }
        if self.socket_mode > 0o777 || self.socket_mode & 0o600 != 0o600 {
            return Err(range_error(
                &path("socket_mode"),
                "permission bits within 0777 that include 0600 (the owner reads and writes)",
                format!("{:04o}", self.socket_mode),
            ));
        }
        Ok(())
    }
}

impl ServiceConfig {
    /// Slots of the DRAM staging pool for slots of `row_stride` bytes: `dram_bytes /
    /// row_stride` (0 when `dram_bytes` is 0). A pool smaller than one slot, or larger than
    /// `available` bytes (the caller passes `MemAvailable`), is refused naming
    /// `service.dram_bytes`.
    pub fn staging_slots(
        &self,
        service_path: &str,
        row_stride: u64,
        available: Option<u64>,
    ) -> Result<usize> {
        if self.dram_bytes == 0 {
            return Ok(0);
        }
        let key = join(service_path, "dram_bytes");
        if row_stride == 0 || self.dram_bytes < row_stride {
            return Err(range_error(
                &key,
                &format!(
                    "0 (no staging pool) or at least one slot of {row_stride} bytes (the row \
                     stride)"
                ),
                self.dram_bytes,
            ));
        }
        if let Some(avail) = available
            && self.dram_bytes > avail
        {
            return Err(range_error(
                &key,
                &format!(
                    "at most the memory available now ({} = {avail} bytes, MemAvailable)",
                    crate::size::format_size_human(avail)
                ),
                self.dram_bytes,
            ));
        }
        usize::try_from(self.dram_bytes / row_stride)
            .map_err(|_| range_error(&key, "a size this machine can address", self.dram_bytes))
    }
}

pub(crate) fn store_threshold_error(key_path: &str, found: impl ToString) -> Error {
    Error::config(
        key_path,
        "values >= 2 are not supported with tiering (vLLM's TieringOffloadingSpec rejects them); \
         use 0 or 1, or remove the key",
    )
    .with("found", found.to_string())
}

/// An engine id names `/dev/shm/vllm_offload_<engine_id>.mmap`: non-empty, no `/`, no NUL.
pub(crate) fn check_engine_id(key_path: &str, id: &str) -> Result<()> {
    if id.is_empty() || id.contains('/') || id.contains('\0') {
        return Err(range_error(
            key_path,
            "a non-empty string without '/' or NUL (it names /dev/shm/vllm_offload_<engine_id>.mmap)",
            format!("{id:?}"),
        ));
    }
    Ok(())
}

/// Two `nvme` tiers on one directory would fight over its slab (the second would find it
/// locked by its own process): refuse that, naming both tiers. Directories that exist are
/// compared by their canonical path, so `/a/x` and `/a/./x/` match.
fn check_nvme_paths_distinct(tiers: &[TierConfig], tiers_path: &str) -> Result<()> {
    let mut seen: Vec<(PathBuf, usize)> = Vec::new();
    for t in tiers.iter().filter(|t| t.tier_type == "nvme") {
        let Some(Value::Array(paths)) = t.params.get("paths") else {
            continue;
        };
        for (k, p) in paths.iter().enumerate() {
            let Some(p) = p.as_str() else { continue };
            let key = std::fs::canonicalize(p).unwrap_or_else(|_| PathBuf::from(p));
            if let Some((_, j)) = seen.iter().find(|(q, j)| *q == key && *j != t.index) {
                return Err(Error::config(
                    format!("{tiers_path}[{}].paths[{k}]", t.index),
                    format!(
                        "{p} is also a path of {tiers_path}[{j}]; each nvme tier needs its own \
                         directories"
                    ),
                ));
            }
            seen.push((key, t.index));
        }
    }
    Ok(())
}

impl TierConfig {
    /// The rules every tier entry follows, whatever its type: a non-empty type, valid
    /// back-pressure settings ([`BackpressureConfig::validate`]), and none at all for `p2p`.
    /// The type's own keys (`params`) are the tier's business (`nvme`:
    /// `crate::g3::G3TierConfig::validate`). Keys are named `secondary_tiers[i]....`.
    pub fn validate(&self) -> Result<()> {
        self.validate_at("secondary_tiers")
    }

    pub(crate) fn validate_at(&self, tiers_path: &str) -> Result<()> {
        let tier_path = index(tiers_path, self.index);
        if self.tier_type.trim().is_empty() {
            return Err(range_error(
                &join(&tier_path, "type"),
                "a non-empty tier type",
                format!("{:?}", self.tier_type),
            ));
        }
        let Some(bp) = &self.backpressure else {
            return Ok(());
        };
        if self.tier_type == "p2p" {
            return Err(Error::config(
                join(&tier_path, "backpressure"),
                "the p2p tier refuses back-pressure (store latency is not a usable signal for P2P); \
                 remove backpressure from this tier and from the top level",
            ));
        }
        bp.validate(&tier_path)
    }
}

impl BackpressureConfig {
    /// The rules of a tier's back-pressure settings, as vLLM's `EMABackpressureDetector`
    /// checks them: known detector and policy classes, `0 < alpha <= 1`,
    /// `0 <= low_water_s <= high_water_s`, `failure_threshold >= 1` and `cooldown_s >= 0`
    /// (`decay_half_life_s <= 0` is vLLM's "no idle decay"). Unset fields are not checked (they
    /// take valid defaults).
    /// `tier_path` is the tier's key path (`secondary_tiers[0]`); errors name
    /// `<tier_path>.backpressure.<key>`.
    pub fn validate(&self, tier_path: &str) -> Result<()> {
        let key = |k: &str| format!("{tier_path}.backpressure.{k}");
        if let Some(cls) = &self.backpressure_cls
            && cls != DETECTOR_CLS
        {
            return Err(Error::config(
                key("backpressure_cls"),
                format!("unknown detector class {cls:?} (kvtier implements {DETECTOR_CLS})"),
            )
            .with("expected", DETECTOR_CLS)
            .with("found", cls.clone()));
        }
        if let Some(p) = &self.policy_cls
            && !POLICY_CLASSES.contains(&p.as_str())
        {
            return Err(Error::config(
                key("policy_cls"),
                format!("unknown back-pressure policy {p:?}"),
            )
            .with("expected", POLICY_CLASSES.join(" or "))
            .with("found", p.clone()));
        }
        if let Some(a) = self.alpha
            && !(a > 0.0 && a <= 1.0)
        {
            return Err(Error::config(key("alpha"), "must satisfy 0 < alpha <= 1")
                .with("found", a.to_string()));
        }
        if let Some(high) = self.high_water_s
            && (high.is_nan() || high <= 0.0)
        {
            return Err(
                Error::config(key("high_water_s"), "must be > 0").with("found", high.to_string())
            );
        }
        if let Some(low) = self.low_water_s {
            let high = self.high_water_s.unwrap_or(f64::INFINITY);
            if !(low >= 0.0 && low <= high) {
                return Err(
                    Error::config(key("low_water_s"), "must be >= 0 and <= high_water_s")
                        .with("expected", format!("<= {high}"))
                        .with("found", low.to_string()),
                );
            }
        }
        if self.failure_threshold == Some(0) {
            return Err(Error::config(key("failure_threshold"), "must be >= 1").with("found", "0"));
        }
        // decay_half_life_s <= 0 means no idle decay, as in vLLM; only NaN is refused.
        if let Some(d) = self.decay_half_life_s
            && d.is_nan()
        {
            return Err(
                Error::config(key("decay_half_life_s"), "must be a number").with("found", "NaN")
            );
        }
        if let Some(c) = self.cooldown_s
            && (c.is_nan() || c < 0.0)
        {
            return Err(Error::config(key("cooldown_s"), "must be >= 0 seconds")
                .with("found", c.to_string()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programmatic_configs_get_the_parser_rules() {
        assert!(KvtierConfig::new(1 << 20).validate().is_ok());
        let e = KvtierConfig::new(0).validate().unwrap_err();
        assert_eq!(e.context_value("key"), Some("cpu_bytes_to_use"));
        let mut c = KvtierConfig::new(1 << 20);
        c.chunk = ChunkSizing::BlocksPerChunk(0);
        assert_eq!(
            c.validate().unwrap_err().context_value("key"),
            Some("blocks_per_chunk")
        );
        let mut c = KvtierConfig::new(1 << 20);
        c.engine_id = Some("a/b".into());
        assert_eq!(
            c.validate().unwrap_err().context_value("key"),
            Some("engine_id")
        );
        let mut c = KvtierConfig::new(1 << 20);
        c.secondary_tiers.push(TierConfig::new(1, "memory"));
        assert_eq!(
            c.validate().unwrap_err().context_value("key"),
            Some("secondary_tiers[0]")
        );
        c.secondary_tiers[0].index = 0;
        c.validate().unwrap();
        c.secondary_tiers[0].tier_type = " ".into();
        assert_eq!(
            c.validate().unwrap_err().context_value("key"),
            Some("secondary_tiers[0].type")
        );
    }

    #[test]
    fn backpressure_rules_name_the_field() {
        let ok = BackpressureConfig {
            high_water_s: Some(0.1),
            low_water_s: Some(0.05),
            ..Default::default()
        };
        ok.validate("secondary_tiers[0]").unwrap();
        for (bad, field) in [
            (
                BackpressureConfig {
                    high_water_s: Some(0.0),
                    ..Default::default()
                },
                "high_water_s",
            ),
            (
                BackpressureConfig {
                    low_water_s: Some(-1.0),
                    ..Default::default()
                },
                "low_water_s",
            ),
            (
                BackpressureConfig {
                    alpha: Some(f64::NAN),
                    ..Default::default()
                },
                "alpha",
            ),
            (
                BackpressureConfig {
                    cooldown_s: Some(-1.0),
                    ..Default::default()
                },
                "cooldown_s",
            ),
            (
                BackpressureConfig {
                    decay_half_life_s: Some(f64::NAN),
                    ..Default::default()
                },
                "decay_half_life_s",
            ),
        ] {
            let e = bad.validate("secondary_tiers[1]").unwrap_err();
            assert_eq!(
                e.context_value("key"),
                Some(format!("secondary_tiers[1].backpressure.{field}").as_str()),
                "{e}"
            );
        }
    }
}
