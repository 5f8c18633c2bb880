//! The tier factory: a tier type name (`secondary_tiers[i].type`) -> a constructor.
//!
//! Built in: `nvme` ([`G3Tier`], kvtier's NVMe slab tier; also under the name
//! [`VLLM_TIER_CLASS`], so that the `secondary_tiers` entry vLLM loads from the Python package
//! means the same tier to `kvtier serve`), `fs` ([`FsTier`], one file per chunk on a shared
//! file system) and `memory` ([`MemoryTier`], for tests and examples). Tests and embedders
//! can register more with [`TierFactory::register`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::config::TierConfig;
use crate::contract::secondary::SecondaryTier;
use crate::error::{Error, ErrorKind, Result};
use crate::fs::{FsTier, FsTierConfig};
use crate::g3::fs_record::MISMATCH_FILESYSTEM;
use crate::g3::offline::OfflineTier;
use crate::g3::{G3Tier, G3TierConfig, WrongFilesystem, geometry_namespace};
use crate::region::PrimaryRegion;
use crate::tiering::clock::Clock;
use crate::tiering::memory_tier::{ExecMode, MemoryTier, MemoryTierOptions};

/// The class name of kvtier's tier in the Python package (`kvtier.vllm.KvtierTier`): vLLM's
/// factory takes the entry's `type` as the class name, so a `secondary_tiers` entry
/// `{"type": "KvtierTier", "module_path": "kvtier.vllm", ...}` is an `nvme` tier here.
pub const VLLM_TIER_CLASS: &str = "KvtierTier";

/// What a constructor gets besides its own config entry.
#[derive(Debug, Clone)]
pub struct TierBuildContext {
    /// The primary region every transfer reads from or writes to.
    pub region: Arc<PrimaryRegion>,
    /// The manager's clock.
    pub clock: Arc<dyn Clock>,
    /// The tier's metric label and event ownership id, `<index+1>:<type>`.
    pub tier_label: String,
    /// The storage namespace digest for persistent tiers. `None`: the geometry-only
    /// namespace of the row stride ([`geometry_namespace`]), until canonical layout digests
    /// are supplied by the caller.
    pub namespace: Option<[u8; 32]>,
    /// vLLM's FileMapper fields of the model (`FileMapper.get_run_config()`), which name an
    /// `fs` tier's folder. `None`: no `fs` tier can be built.
    pub file_mapper_fields: Option<Value>,
    /// Bytes of each row a slot tier (`nvme`) stores: a prefix of the row (`None`: the whole
    /// row). With the canonical layout this is the canonical area, which is shorter than
    /// vLLM's row for GQA models with replicated KV heads (Qwen2.5-3B at TP 4 and 8), so the
    /// slots and the namespace are the same at every TP size.
    pub slot_bytes: Option<u64>,
    /// Whether the tier records stored/removed events for
    /// [`SecondaryTier::take_events`]
    /// (off unless someone drains them: an undrained event queue only grows).
    pub events: bool,
}

impl TierBuildContext {
    /// A context with the geometry-only namespace.
    pub fn new(region: Arc<PrimaryRegion>, clock: Arc<dyn Clock>, tier_label: String) -> Self {
        TierBuildContext {
            region,
            clock,
            tier_label,
            namespace: None,
            file_mapper_fields: None,
            slot_bytes: None,
            events: false,
        }
    }

    /// The namespace to use: the supplied digest or the geometry namespace.
    pub fn namespace(&self) -> [u8; 32] {
        self.namespace
            .unwrap_or_else(|| geometry_namespace(self.region.row_stride()))
    }
}

/// A tier constructor.
pub type TierConstructor =
    Arc<dyn Fn(&TierConfig, &TierBuildContext) -> Result<Box<dyn SecondaryTier>> + Send + Sync>;

/// A tier type's configuration rules: its keys and values for rows of `row_stride` bytes,
/// checked without touching a path (what `kvtier config check` and `kvtier serve` both run
/// before anything is allocated).
pub type TierCheck = Arc<dyn Fn(&TierConfig, u64) -> Result<()> + Send + Sync>;

/// Maps tier type names to constructors and configuration rules.
#[derive(Clone)]
pub struct TierFactory {
    ctors: BTreeMap<String, TierConstructor>,
    checks: BTreeMap<String, TierCheck>,
}

impl std::fmt::Debug for TierFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierFactory")
            .field("types", &self.ctors.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Default for TierFactory {
    fn default() -> Self {
        Self::with_builtins()
    }
}

impl TierFactory {
    /// A factory with no types.
    pub fn empty() -> Self {
        TierFactory {
            ctors: BTreeMap::new(),
            checks: BTreeMap::new(),
        }
    }

    /// A factory with kvtier's built-in tier types.
    pub fn with_builtins() -> Self {
        let mut f = Self::empty();
        f.register("memory", Arc::new(build_memory_tier));
        f.register_check(
            "memory",
            Arc::new(|cfg, _| check_memory_tier(cfg).map(drop)),
        );
        f.register("nvme", Arc::new(build_nvme_tier));
        f.register_check("nvme", Arc::new(check_nvme_tier));
        f.register("fs", Arc::new(build_fs_tier));
        f.register_check("fs", Arc::new(check_fs_tier));
        f.register(VLLM_TIER_CLASS, Arc::new(build_nvme_tier));
        f.register_check(VLLM_TIER_CLASS, Arc::new(check_nvme_tier));
        f
    }

    /// Adds (or replaces) a type.
    pub fn register(&mut self, tier_type: &str, ctor: TierConstructor) {
        self.ctors.insert(tier_type.to_string(), ctor);
    }

    /// Adds (or replaces) the configuration rules of a registered type, run by
    /// [`TierFactory::check`] and before every [`TierFactory::create`].
    pub fn register_check(&mut self, tier_type: &str, check: TierCheck) {
        self.checks.insert(tier_type.to_string(), check);
    }

    /// Checks one tier's configuration for rows of `row_stride` bytes without building it:
    /// a type the factory does not know is an error naming `secondary_tiers[i].type` (with
    /// the closest known type); a known type's keys and values are checked by its rules.
    /// `kvtier serve` and `kvtier config check` both run this, so they accept the same
    /// configurations.
    pub fn check(&self, cfg: &TierConfig, row_stride: u64) -> Result<()> {
        if !self.ctors.contains_key(&cfg.tier_type) {
            return Err(self.unknown_type(cfg));
        }
        match self.checks.get(&cfg.tier_type) {
            Some(check) => check(cfg, row_stride),
            None => Ok(()),
        }
    }

    fn unknown_type(&self, cfg: &TierConfig) -> Error {
        let mut e = Error::config(
            format!("{}.type", cfg.key_path()),
            format!("unknown secondary tier type {:?}", cfg.tier_type),
        )
        .with("expected", self.types().join(", "))
        .with("found", cfg.tier_type.clone());
        if let Some(best) = self
            .types()
            .into_iter()
            .filter(|t| strsim::levenshtein(t, &cfg.tier_type) <= 2)
            .min_by_key(|t| strsim::levenshtein(t, &cfg.tier_type))
        {
            e = e.with("did_you_mean", best);
        }
        e
    }

    /// The registered type names.
    pub fn types(&self) -> Vec<&str> {
        self.ctors.keys().map(String::as_str).collect()
    }

    /// Builds the tier of `cfg.tier_type`, after [`TierFactory::check`] with the region's
    /// row stride.
    pub fn create(
        &self,
        cfg: &TierConfig,
        ctx: &TierBuildContext,
    ) -> Result<Box<dyn SecondaryTier>> {
        self.check(cfg, ctx.region.row_stride())?;
        match self.ctors.get(&cfg.tier_type) {
            Some(ctor) => ctor(cfg, ctx),
            None => Err(self.unknown_type(cfg)),
        }
    }
}

fn param_u64(cfg: &TierConfig, key: &str) -> Result<Option<u64>> {
    match cfg.params.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            Error::config(
                format!("{}.{key}", cfg.key_path()),
                "must be a non-negative integer",
            )
            .with("found", v.to_string())
        }),
    }
}

/// The rules of an `nvme` tier's params for rows of `row_stride` bytes
/// ([`G3TierConfig::from_tier`] and [`G3TierConfig::validate`]).
pub fn check_nvme_tier(cfg: &TierConfig, row_stride: u64) -> Result<()> {
    let g3 = G3TierConfig::from_tier(cfg)?;
    refuse_layout_outside_vllm(cfg, &g3)?;
    g3.validate(&cfg.key_path(), Some(row_stride))
}

/// `layout` belongs to vLLM's entry ([`VLLM_TIER_CLASS`]), where the Python package sizes the
/// canonical area from it; kvtier's own `nvme` entries take the layout from `--layout` or
/// [`crate::Builder::layout`].
fn refuse_layout_outside_vllm(cfg: &TierConfig, g3: &G3TierConfig) -> Result<()> {
    if g3.layout.is_some() && cfg.tier_type != VLLM_TIER_CLASS {
        return Err(Error::config(
            format!("{}.layout", cfg.key_path()),
            "only in vLLM's entry (type KvtierTier); kvtier's own configuration takes the \
             layout from --layout (kvtier serve, bench, tier format) or Builder::layout",
        ));
    }
    Ok(())
}

/// The rules of an `fs` tier's params for rows of `row_stride` bytes
/// ([`FsTierConfig::from_tier`] and [`FsTierConfig::validate`]).
pub fn check_fs_tier(cfg: &TierConfig, row_stride: u64) -> Result<()> {
    FsTierConfig::from_tier(cfg)?.validate(&cfg.key_path(), Some(row_stride))
}

/// Builds an `nvme` tier ([`G3Tier`]) from its params (see `docs/g3.md`).
pub fn build_nvme_tier(cfg: &TierConfig, ctx: &TierBuildContext) -> Result<Box<dyn SecondaryTier>> {
    let mut g3 = G3TierConfig::from_tier(cfg)?;
    refuse_layout_outside_vllm(cfg, &g3)?;
    g3.slot_bytes = ctx.slot_bytes;
    g3.validate(&cfg.key_path(), Some(ctx.region.row_stride()))?;
    let tier_events = g3.enable_kv_events;
    let opened = G3Tier::open(
        g3.clone(),
        ctx.region.clone(),
        ctx.namespace(),
        ctx.tier_label.clone(),
        cfg.locality,
    );
    let tier = match opened {
        Ok(t) => t,
        Err(e)
            if g3.on_wrong_filesystem == WrongFilesystem::Degraded
                && e.context_value("mismatch") == Some(MISMATCH_FILESYSTEM) =>
        {
            log::error!(
                "{}: {e}; running without this tier (on_wrong_filesystem = \"degraded\")",
                cfg.key_path()
            );
            return Ok(Box::new(OfflineTier::new(&g3, cfg.locality, &e)));
        }
        Err(e) => return Err(e),
    };
    tier.set_events_enabled(events_enabled(cfg, ctx, tier_events));
    Ok(Box::new(tier))
}

/// vLLM's fs tier's rule for a tier's KV events: on when the tier asks for them
/// (`enable_kv_events`) and the manager records them; a tier asking while the manager does not
/// is told so in the log.
fn events_enabled(cfg: &TierConfig, ctx: &TierBuildContext, tier_events: bool) -> bool {
    if tier_events && !ctx.events {
        log::warn!(
            "{}.enable_kv_events is set but KV events are off for the manager; the tier \
             records none",
            cfg.key_path()
        );
    }
    ctx.events && tier_events
}

/// Builds an `fs` tier ([`FsTier`]) from its params (see `docs/fs-tier.md`).
pub fn build_fs_tier(cfg: &TierConfig, ctx: &TierBuildContext) -> Result<Box<dyn SecondaryTier>> {
    let fs = FsTierConfig::from_tier(cfg)?;
    fs.validate(&cfg.key_path(), Some(ctx.region.row_stride()))?;
    let Some(fields) = ctx.file_mapper_fields.clone() else {
        return Err(Error::new(
            ErrorKind::Config,
            format!(
                "{}: an fs tier names its folder after the model's vLLM FileMapper fields, and \
                 none were given (kvtier serve and bench derive them from --layout and --tp)",
                cfg.key_path()
            ),
        ));
    };
    let tier_events = fs.enable_kv_events;
    let tier = FsTier::open(
        fs,
        ctx.region.clone(),
        fields,
        ctx.namespace(),
        ctx.tier_label.clone(),
        cfg.locality,
    )?;
    tier.set_events_enabled(events_enabled(cfg, ctx, tier_events));
    Ok(Box::new(tier))
}

/// A `memory` tier's params: `capacity_chunks` (optional, at least 1), `latency_us`
/// (optional, simulated per-job latency on its thread).
pub fn check_memory_tier(cfg: &TierConfig) -> Result<(Option<usize>, Duration)> {
    const KNOWN: [&str; 2] = ["capacity_chunks", "latency_us"];
    if let Some(k) = cfg.params.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(Error::config(
            format!("{}.{k}", cfg.key_path()),
            "unknown key for a memory tier",
        )
        .with("expected", KNOWN.join(", ")));
    }
    let capacity = match param_u64(cfg, "capacity_chunks")? {
        Some(0) => {
            return Err(Error::config(
                format!("{}.capacity_chunks", cfg.key_path()),
                "must be at least 1 (leave it out for no limit)",
            ));
        }
        Some(c) => Some(usize::try_from(c).unwrap_or(usize::MAX)),
        None => None,
    };
    let latency = Duration::from_micros(param_u64(cfg, "latency_us")?.unwrap_or(0));
    Ok((capacity, latency))
}

/// Builds a `memory` tier (keys: [`check_memory_tier`]).
pub fn build_memory_tier(
    cfg: &TierConfig,
    ctx: &TierBuildContext,
) -> Result<Box<dyn SecondaryTier>> {
    let (capacity_chunks, latency) = check_memory_tier(cfg)?;
    let mut opts = MemoryTierOptions::new(ctx.tier_label.clone());
    opts.locality = cfg.locality;
    opts.capacity_chunks = capacity_chunks;
    opts.mode = ExecMode::Threaded { latency };
    Ok(Box::new(MemoryTier::start(ctx.region.clone(), opts)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use crate::tiering::clock::SystemClock;

    fn tier_cfg(t: &str, params: serde_json::Value) -> TierConfig {
        TierConfig {
            index: 2,
            tier_type: t.into(),
            locality: None,
            backpressure: None,
            params: params.as_object().cloned().unwrap_or_default(),
        }
    }

    #[test]
    fn layout_is_taken_in_vllms_entry_and_refused_in_an_nvme_one() {
        let params = serde_json::json!({"paths": ["/a"], "capacity_bytes": 4096, "layout": "x"});
        let e = check_nvme_tier(&tier_cfg("nvme", params.clone()), 4096).unwrap_err();
        assert_eq!(e.context_value("key"), Some("secondary_tiers[2].layout"));
        check_nvme_tier(&tier_cfg(VLLM_TIER_CLASS, params), 4096).unwrap();
    }

    #[test]
    fn unknown_types_and_keys_are_config_errors_naming_the_key() {
        let f = TierFactory::with_builtins();
        let ctx = TierBuildContext::new(
            Arc::new(PrimaryRegion::create(2, 4096).unwrap()),
            Arc::new(SystemClock),
            "3:memory".into(),
        );
        let e = f
            .create(&tier_cfg("memroy", serde_json::json!({})), &ctx)
            .err()
            .expect("must fail");
        assert_eq!(e.kind(), ErrorKind::Config);
        assert_eq!(e.context_value("key"), Some("secondary_tiers[2].type"));
        assert_eq!(e.context_value("did_you_mean"), Some("memory"));
        let e = f
            .create(
                &tier_cfg("memory", serde_json::json!({"capacity": 3})),
                &ctx,
            )
            .err()
            .expect("must fail");
        assert_eq!(e.context_value("key"), Some("secondary_tiers[2].capacity"));
        let e = f
            .create(
                &tier_cfg("memory", serde_json::json!({"capacity_chunks": -3})),
                &ctx,
            )
            .err()
            .expect("must fail");
        assert_eq!(
            e.context_value("key"),
            Some("secondary_tiers[2].capacity_chunks")
        );
        let mut t = f
            .create(
                &tier_cfg("memory", serde_json::json!({"capacity_chunks": 3})),
                &ctx,
            )
            .unwrap();
        assert_eq!(t.tier_type(), "memory");
        t.shutdown().unwrap();
    }
}
