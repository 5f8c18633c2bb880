//! The front door for embedders: one [`Builder`] turns a configuration (a file, a JSON or TOML
//! string, or a typed [`KvtierConfig`]) into a running [`TieringManager`] or a single
//! [`SecondaryTier`]. `kvtier serve`, `kvtier bench` and the Python package (`python/`, vLLM's
//! out-of-tree tier) all build through it.
//!
//! The primary region comes from one of two places:
//! * a model layout ([`Builder::layout`]): the region is sized the way vLLM sizes it
//!   (`cpu_bytes_to_use`, `blocks_per_chunk` or `block_size`, the layout's bytes per block at
//!   the TP size), created and pre-faulted here, and persistent tiers get the layout's
//!   namespace digest;
//! * a region the embedder already has ([`Builder::region`]), for example vLLM's shared
//!   offload region adopted in place with [`PrimaryRegion::adopt`]; the namespace then comes
//!   from [`Builder::namespace`] (for vLLM: [`crate::canonical::digest::VllmSpecFields`]).
//!
//! Which namespace a pool of slabs is formatted for is [`PoolOpener`]'s to say: vLLM engines
//! and the node service, or kvtier's in-process tiers (this builder's, with a layout).
//!
//! # Lookups while the index recovers
//! A persistent (`nvme`) tier opens at once and recovers its index on its own I/O thread.
//! Until recovery has finished its `lookup` answers RETRY (the manager answers RETRY too, and
//! vLLM's scheduler asks again next step), stores wait in the tier's queue and loads are
//! served only for keys the tier has answered HIT. Recovery reads the last checkpoint and the
//! journal written after it: with the default `checkpoint_journal_bytes` (64 MiB of journal
//! at most) it takes milliseconds to about a second, measured by the `g3_recovery_seconds`
//! metric and `kvtier tier inspect`. [`SecondaryTier::ready`] says when it is over.

mod memory;
mod opener;

use std::path::Path;
use std::sync::Arc;

pub use memory::mem_available;
pub use opener::PoolOpener;

use crate::canonical::{LayoutDescriptor, NamespaceParams, VllmDigestFields};
use crate::config::{self, KvtierConfig, TierConfig};
use crate::contract::secondary::{MetricDescriptor, SecondaryTier};
use crate::error::{Error, ErrorKind, Result};
use crate::geometry::ChunkGeometry;
use crate::region::PrimaryRegion;
use crate::tiering::clock::Clock;
use crate::tiering::factory::{TierBuildContext, TierConstructor, TierFactory, VLLM_TIER_CLASS};
use crate::tiering::manager::{ManagerOptions, TieringManager, tier_label};

/// What the builder derives from the configuration and the model before it allocates
/// anything ([`Builder::plan`]).
#[derive(Debug, Clone)]
pub struct Plan {
    /// GPU blocks per chunk (`blocks_per_chunk`, or `block_size` over the layout's tokens per
    /// block).
    pub blocks_per_chunk: u32,
    /// The inputs of the storage namespace.
    pub params: NamespaceParams,
    /// The primary region: row stride, rows, bytes.
    pub geometry: ChunkGeometry,
}

/// The model whose rows the region holds.
#[derive(Debug, Clone)]
struct Model {
    layout: LayoutDescriptor,
    tp: u32,
}

/// Builds a running [`TieringManager`] ([`Builder::build`]) or one secondary tier
/// ([`Builder::build_tier`]) from a configuration. See the [module docs](self).
#[derive(Debug)]
pub struct Builder {
    config: KvtierConfig,
    model: Option<Model>,
    region: Option<Arc<PrimaryRegion>>,
    options: ManagerOptions,
    factory: TierFactory,
    check_memory: bool,
    /// A tier handed over on its own ([`Builder::for_tier`]).
    lone_tier: Option<TierConfig>,
}

impl Builder {
    /// A builder for a typed configuration (its rules are checked when building).
    pub fn new(config: KvtierConfig) -> Self {
        Builder {
            config,
            model: None,
            region: None,
            options: ManagerOptions::default(),
            factory: TierFactory::with_builtins(),
            check_memory: true,
            lone_tier: None,
        }
    }

    /// A builder for one `secondary_tiers` entry handed over on its own, as vLLM's factory
    /// hands each tier its own keys ([`crate::config::resolve_tier_entry`] reads one):
    /// [`Builder::build_tier`] with the entry's index builds it over the region given with
    /// [`Builder::region`].
    pub fn for_tier(tier: TierConfig) -> Self {
        let mut builder = Self::new(KvtierConfig::new(1));
        builder.lone_tier = Some(tier);
        builder
    }

    /// Reads a configuration file (`.json` or `.toml`: vLLM's `kv_connector_extra_config` or
    /// the whole `--kv-transfer-config` object). Errors name the file and the key.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        Ok(Self::new(config::load(path.as_ref())?))
    }

    /// Parses a JSON configuration (the same shape as a file).
    pub fn from_json(text: &str) -> Result<Self> {
        Ok(Self::new(config::from_json_str(text)?))
    }

    /// Parses a TOML configuration (the same shape as a file).
    pub fn from_toml(text: &str) -> Result<Self> {
        Ok(Self::new(config::from_toml_str(text)?))
    }

    /// The configuration being built.
    pub fn config(&self) -> &KvtierConfig {
        &self.config
    }

    /// Sizes and creates the primary region for `layout` at TP `tp` (as vLLM sizes it) and
    /// gives persistent tiers the layout's namespace digest. With [`Builder::region`] as well,
    /// the region's row stride must be the layout's.
    pub fn layout(mut self, layout: LayoutDescriptor, tp: u32) -> Self {
        self.model = Some(Model { layout, tp });
        self
    }

    /// Uses an existing region (created with [`PrimaryRegion::create`] or adopted with
    /// [`PrimaryRegion::adopt`]) instead of creating one.
    pub fn region(mut self, region: Arc<PrimaryRegion>) -> Self {
        self.region = Some(region);
        self
    }

    /// The storage namespace digest persistent tiers check their slabs against (overrides the
    /// layout's; without either, the geometry namespace of the row stride).
    pub fn namespace(mut self, digest: [u8; 32]) -> Self {
        self.options.namespace = Some(digest);
        self
    }

    /// Bytes of each row the slot tiers (`nvme`) store: a prefix of the row (default: what the
    /// layout's namespace names, the canonical area for the canonical layout; without a
    /// layout, the whole row). See `TierBuildContext::slot_bytes`.
    pub fn slot_bytes(mut self, bytes: u64) -> Self {
        self.options.slot_bytes = Some(bytes);
        self
    }

    /// vLLM's `FileMapper` fields of the model (`FileMapper.get_run_config()`), which name an
    /// `fs` tier's folder (overrides the layout's).
    pub fn file_mapper_fields(mut self, fields: serde_json::Value) -> Self {
        self.options.file_mapper_fields = Some(fields);
        self
    }

    /// The clock for job stamps, latencies and back-pressure (tests inject a manual one).
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.options.clock = clock;
        self
    }

    /// The metric name prefix (default `kvtier:`; `vllm:` for vLLM's dashboards).
    pub fn metrics_prefix(mut self, prefix: &str) -> Self {
        self.options.metrics_prefix = prefix.to_string();
        self
    }

    /// Whether the primary and the tiers record stored/removed events (default off: nobody
    /// drains them otherwise).
    pub fn events(mut self, enabled: bool) -> Self {
        self.options.enable_events = enabled;
        self
    }

    /// Whether to refuse a region larger than the memory available (default on; only for a
    /// region created here).
    pub fn check_memory(mut self, enabled: bool) -> Self {
        self.check_memory = enabled;
        self
    }

    /// Adds (or replaces) a secondary tier type.
    pub fn register_tier(mut self, tier_type: &str, ctor: TierConstructor) -> Self {
        self.factory.register(tier_type, ctor);
        self
    }

    /// Builds the manager: the primary over the region, then every secondary tier in config
    /// order. On failure everything already started is shut down.
    pub fn build(self) -> Result<TieringManager> {
        self.config.validate()?;
        let resolved = self.resolve_region()?;
        let mut options = self.options;
        options.namespace = resolved.namespace;
        options.file_mapper_fields = resolved.file_mapper_fields;
        options.slot_bytes = resolved.slot_bytes;
        TieringManager::from_config(&self.config, resolved.region, &self.factory, options)
    }

    /// Builds only `secondary_tiers[index]` over the region (an embedder with its own manager,
    /// such as vLLM, drives it through the [`SecondaryTier`] contract). Its label and event
    /// ownership id is `<index+1>:<type>`.
    pub fn build_tier(self, index: usize) -> Result<Box<dyn SecondaryTier>> {
        self.config.validate()?;
        if let Some(t) = &self.lone_tier {
            t.validate()?;
        }
        let Some(tc) = self
            .lone_tier
            .iter()
            .chain(&self.config.secondary_tiers)
            .find(|t| t.index == index)
        else {
            return Err(Error::config(
                format!("secondary_tiers[{index}]"),
                format!(
                    "no such tier: the configuration has {} secondary tier(s)",
                    self.config.secondary_tiers.len()
                ),
            ));
        };
        let resolved = self.resolve_region()?;
        let label = tier_label(tc.index, &tc.tier_type);
        let mut ctx = TierBuildContext::new(resolved.region, self.options.clock.clone(), label);
        ctx.namespace = resolved.namespace;
        ctx.file_mapper_fields = resolved.file_mapper_fields;
        ctx.slot_bytes = resolved.slot_bytes;
        ctx.events = self.options.enable_events;
        self.factory.create(tc, &ctx)
    }

    /// Sizes the region for the layout ([`Builder::layout`]) and checks every secondary tier
    /// against it with the factory's rules (a known type, its keys, its values for this row
    /// size). Touches no path and allocates nothing: `kvtier serve` and `kvtier config check`
    /// run it before anything starts.
    pub fn plan(&self) -> Result<Plan> {
        let Some(model) = &self.model else {
            return Err(Error::new(
                ErrorKind::Config,
                "planning the region needs a model layout (Builder::layout)",
            ));
        };
        let layout = &model.layout;
        let blocks_per_chunk = self
            .config
            .chunk
            .blocks_per_chunk(Some(layout.tokens_per_block))?;
        let params = NamespaceParams::new(
            layout,
            model.tp,
            blocks_per_chunk,
            self.config.canonical_layout,
        )
        .map_err(|e| Error::config("--tp", e.message().to_string()))?;
        let copies = if params.replicated_layout {
            1
        } else {
            model.tp
        };
        let geometry = ChunkGeometry::derive(
            layout.worker_kv_bytes_per_block(model.tp)?,
            copies,
            blocks_per_chunk,
            self.config.cpu_bytes_to_use,
        )?;
        geometry.region_dims()?;
        for tier in &self.config.secondary_tiers {
            self.factory.check(tier, geometry.row_stride)?;
        }
        Ok(Plan {
            blocks_per_chunk,
            params,
            geometry,
        })
    }

    /// The region to build on and the names persistent tiers store under.
    fn resolve_region(&self) -> Result<Resolved> {
        let Some(model) = &self.model else {
            let region = self.region.clone().ok_or_else(|| {
                Error::new(
                    ErrorKind::Config,
                    "the builder needs a primary region: give it a model layout \
                     (Builder::layout) or a region (Builder::region)",
                )
            })?;
            return Ok(Resolved {
                region,
                namespace: self.options.namespace,
                file_mapper_fields: self.options.file_mapper_fields.clone(),
                slot_bytes: self.options.slot_bytes,
            });
        };
        let layout = &model.layout;
        let Plan {
            params, geometry, ..
        } = self.plan()?;
        // The builder's tiers are in-process ones: their pools carry the descriptor namespace.
        let namespace = match self.options.namespace {
            Some(n) => n,
            None => PoolOpener::InProcess.namespace(layout, &params)?,
        };
        let namespace = Some(namespace);
        let file_mapper_fields = self
            .options
            .file_mapper_fields
            .clone()
            .or_else(|| Some(VllmDigestFields::from_descriptor(layout, &params).to_json()));
        // Slot tiers store what the namespace names: the canonical area, or the whole row.
        let slot_bytes = self.options.slot_bytes.or(params.slot_prefix());
        if let Some(region) = &self.region {
            if region.row_stride() != geometry.row_stride {
                return Err(Error::new(
                    ErrorKind::IncompatibleLayout,
                    format!(
                        "the region's rows are {} bytes but {} at TP {} needs rows of {} bytes",
                        region.row_stride(),
                        layout.model_name,
                        model.tp,
                        geometry.row_stride
                    ),
                ));
            }
            return Ok(Resolved {
                region: region.clone(),
                namespace,
                file_mapper_fields,
                slot_bytes,
            });
        }
        let (rows, _) = geometry.region_dims()?;
        if self.check_memory {
            check_region_memory(geometry.region_bytes, mem_available())?;
        }
        log::info!(
            "primary region: {rows} rows of {} ({})",
            crate::config::size::format_size_human(geometry.row_stride),
            crate::config::size::format_size_human(geometry.region_bytes)
        );
        Ok(Resolved {
            region: Arc::new(PrimaryRegion::create(rows, geometry.row_stride)?),
            namespace,
            file_mapper_fields,
            slot_bytes,
        })
    }
}

/// What [`Builder::resolve_region`] settles: the region and the names of persistent tiers.
struct Resolved {
    region: Arc<PrimaryRegion>,
    namespace: Option<[u8; 32]>,
    file_mapper_fields: Option<serde_json::Value>,
    slot_bytes: Option<u64>,
}

/// The metrics a tier of `tier_type` reports (`nvme`, or [`VLLM_TIER_CLASS`], the same
/// tier), without opening one: `None` for a type that declares none up front.
pub fn tier_metric_descriptors(tier_type: &str) -> Option<Vec<MetricDescriptor>> {
    is_nvme(tier_type).then(crate::g3::metrics::G3Metrics::descriptors)
}

/// The label names of [`SecondaryTier::config_info`] for a tier of `tier_type`, without
/// opening one.
pub fn tier_config_info_keys(tier_type: &str) -> Option<&'static [&'static str]> {
    is_nvme(tier_type).then_some(&crate::g3::tier::CONFIG_INFO_KEYS[..])
}

/// How a G3 tier's entry wants an adopted primary region backed (its `region_huge_pages` key:
/// `auto`, the default, or `never`), for the embedder that adopts the region before it builds
/// the tier (the Python tier adopts vLLM's with [`PrimaryRegion::adopt_shared`]). The whole
/// entry is checked, so a bad value is an error naming `secondary_tiers[i].region_huge_pages`.
pub fn region_huge_pages(tier: &TierConfig) -> Result<crate::region::AdoptHugePages> {
    crate::g3::G3TierConfig::from_tier(tier).map(|c| c.region_huge_pages)
}

/// Forgets every chunk of the G3 tier `tier` (an `nvme` entry) describes: its slabs stay and
/// their slots become free, exactly as `kvtier tier clear PATH...` does. The tier must not be
/// open (this takes the slab locks); a tier of another type is refused naming its key.
pub fn clear_tier(tier: &TierConfig) -> Result<()> {
    if !is_nvme(&tier.tier_type) {
        return Err(Error::config(
            format!("{}.type", tier.key_path()),
            format!(
                "only a G3 (nvme) tier can be cleared, not {:?}",
                tier.tier_type
            ),
        ));
    }
    let cfg = crate::g3::G3TierConfig::from_tier(tier)?;
    crate::g3::admin::clear(&cfg.paths)
}

/// Whether a tier of `tier_type` is a G3 tier (`nvme`, or [`VLLM_TIER_CLASS`], the same tier).
pub fn is_nvme(tier_type: &str) -> bool {
    tier_type == "nvme" || tier_type == VLLM_TIER_CLASS
}

/// The primary region is pre-faulted when it is created, so a `cpu_bytes_to_use` larger than
/// the memory available would push the machine into swap or the OOM killer instead of failing:
/// refuse it up front (a user mistake).
fn check_region_memory(region_bytes: u64, available: Option<u64>) -> Result<()> {
    match available {
        Some(avail) if region_bytes > avail => Err(Error::config(
            "cpu_bytes_to_use",
            format!(
                "the primary region needs {} (pre-faulted at start), but only {} of memory is \
                 available; lower cpu_bytes_to_use",
                crate::config::size::format_size_human(region_bytes),
                crate::config::size::format_size_human(avail)
            ),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests;
