//! `kvtier serve`: runs the tiering manager with the configured tiers behind a metrics
//! endpoint until SIGTERM or Ctrl-C, then drains, checkpoints and exits 0.
//!
//! The region is sized like vLLM sizes it: the layout (default Llama-3.1-8B) and TP give the
//! bytes per GPU block, the config gives `blocks_per_chunk` (or `block_size`) and
//! `cpu_bytes_to_use`; `nvme` tiers get the layout's namespace digest for their superblocks.

pub mod http;
pub mod service;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use crate::canonical::{LayoutDescriptor, NamespaceParams, VllmDigestFields, namespace_digest};
use crate::cli::args::ModelArgs;
use crate::cli::serve::http::DEFAULT_METRICS_ADDR;
use crate::cli::serve::service::{Service, serve_until_signal};
use crate::cli::size::format_size;
use crate::config::KvtierConfig;
use crate::contract::secondary::{HealthState, TierHealth};
use crate::error::{Error, ErrorKind, Result};
use crate::geometry::ChunkGeometry;
use crate::region::PrimaryRegion;
use crate::tiering::factory::TierFactory;
use crate::tiering::manager::{ManagerOptions, TieringManager};

/// Arguments of `kvtier serve`.
#[derive(Debug, clap::Args)]
#[command(after_help = "Examples:
  kvtier serve --config docs/examples/kvtier.json
  kvtier serve --config kvtier.toml --metrics-addr 0.0.0.0:9464     # let other hosts scrape
  curl -s http://127.0.0.1:9464/metrics | grep kv_offload_tiering_write_bytes

SIGTERM or Ctrl-C drains the jobs in flight, writes the tiers' checkpoints and exits 0.")]
pub struct ServeArgs {
    /// Configuration file (vLLM's kv_connector_extra_config or kv_transfer_config; .json or .toml).
    #[arg(long, value_name = "FILE")]
    pub config: PathBuf,
    /// Address of the metrics endpoint (host:port; port 0 picks a free one). Loopback by default.
    #[arg(long, default_value = DEFAULT_METRICS_ADDR, value_name = "ADDR")]
    pub metrics_addr: String,
    /// The model whose rows the region holds, and its TP size (blocks per chunk come from
    /// the configuration).
    #[command(flatten)]
    pub model: ModelArgs,
    /// Metric name prefix (`vllm:` makes vLLM dashboards work unchanged).
    #[arg(long, default_value = crate::metrics::DEFAULT_PREFIX, value_name = "PREFIX")]
    pub metrics_prefix: String,
}

/// Runs `kvtier serve`.
pub fn run(args: ServeArgs) -> Result<ExitCode> {
    let cfg = crate::config::load(&args.config)?;
    let layout = args.model.load()?;
    // Every rule first (the ones `config check` runs too), then the address: a mistake in
    // either is found before the region is allocated and the slabs created.
    let plan =
        ServePlan::new(&cfg, &layout, args.model.tp).map_err(|e| in_file(&args.config, e))?;
    crate::metrics::Registry::new(args.metrics_prefix.as_str())
        .map_err(|e| Error::config("--metrics-prefix", e.message().to_string()))?;
    let listener = http::bind(&args.metrics_addr)?;
    let manager = build_manager(&cfg, &layout, &plan, &args.metrics_prefix).map_err(|e| {
        if e.kind() != ErrorKind::IncompatibleLayout {
            return e;
        }
        // Say which inputs make the namespace and how to format a tier that matches.
        Error::new(
            ErrorKind::IncompatibleLayout,
            format!(
                "{}; serve derives it from {} at --tp {}, blocks_per_chunk and \
                 canonical_layout = {} in {}: format the tier to match (`kvtier tier format \
                 PATH... --capacity SIZE --layout FILE --tp N --blocks-per-chunk N{}`)",
                e.message(),
                layout.model_name,
                args.model.tp,
                cfg.canonical_layout,
                args.config.display(),
                if cfg.canonical_layout {
                    " --canonical"
                } else {
                    ""
                }
            ),
        )
    })?;
    serve_until_signal(listener, Box::new(ManagerService { manager }))?;
    Ok(ExitCode::SUCCESS)
}

/// What `serve` derives from the configuration and the model before it allocates anything,
/// and every rule it applies to a configuration: [`ServePlan::new`] is also what `kvtier
/// config check` runs, so the two accept the same files.
#[derive(Debug, Clone)]
pub struct ServePlan {
    /// GPU blocks per chunk (`blocks_per_chunk`, or `block_size` over the layout's tokens per
    /// block).
    pub blocks_per_chunk: u32,
    /// The inputs of the storage namespace.
    pub params: NamespaceParams,
    /// The primary region: row stride, rows, bytes.
    pub geometry: ChunkGeometry,
}

impl ServePlan {
    /// Sizes the region for `layout` at `tp` and checks every secondary tier against it with
    /// the tier factory's rules ([`TierFactory::check`]: a known type, its keys, its values
    /// for this row size: capacity of at least one row, `max_bytes_in_flight` of at least one
    /// row, ...). Touches no path and allocates nothing.
    pub fn new(cfg: &KvtierConfig, layout: &LayoutDescriptor, tp: u32) -> Result<Self> {
        let blocks_per_chunk = cfg.chunk.blocks_per_chunk(Some(layout.tokens_per_block))?;
        let params = NamespaceParams::new(layout, tp, blocks_per_chunk, cfg.canonical_layout)
            .map_err(|e| Error::config("--tp", e.message().to_string()))?;
        let copies = if params.replicated_layout { 1 } else { tp };
        let geometry = ChunkGeometry::derive(
            layout.worker_kv_bytes_per_block(tp)?,
            copies,
            blocks_per_chunk,
            cfg.cpu_bytes_to_use,
        )?;
        geometry.region_dims()?;
        check_tiers(cfg, &TierFactory::with_builtins(), geometry.row_stride)?;
        Ok(ServePlan {
            blocks_per_chunk,
            params,
            geometry,
        })
    }
}

/// A plan error names the configuration file unless it is about a flag (`--tp`).
pub fn in_file(config: &std::path::Path, e: Error) -> Error {
    if e.context_value("key").is_some_and(|k| k.starts_with("--")) {
        e
    } else {
        crate::config::error_in_file(config, e)
    }
}

/// Every secondary tier of `cfg` against `factory`'s rules for rows of `row_stride` bytes.
pub fn check_tiers(cfg: &KvtierConfig, factory: &TierFactory, row_stride: u64) -> Result<()> {
    cfg.secondary_tiers
        .iter()
        .try_for_each(|tier| factory.check(tier, row_stride))
}

/// Allocates the region of `plan` and builds the manager with `nvme` tiers that carry the
/// layout's namespace and `fs` tiers named by its vLLM FileMapper fields.
pub fn build_manager(
    cfg: &KvtierConfig,
    layout: &LayoutDescriptor,
    plan: &ServePlan,
    metrics_prefix: &str,
) -> Result<TieringManager> {
    let geometry = &plan.geometry;
    let (rows, stride) = geometry.region_dims()?;
    check_region_memory(geometry.region_bytes, crate::cli::memory::mem_available())?;
    log::info!(
        "primary region: {rows} rows of {} ({})",
        format_size(geometry.row_stride),
        format_size(geometry.region_bytes)
    );
    let region = Arc::new(PrimaryRegion::create(rows, stride)?);
    let namespace = namespace_digest(layout, &plan.params);
    let factory = TierFactory::with_builtins();
    let opts = ManagerOptions {
        metrics_prefix: metrics_prefix.to_string(),
        namespace: Some(namespace),
        file_mapper_fields: Some(VllmDigestFields::from_descriptor(layout, &plan.params).to_json()),
        ..ManagerOptions::default()
    };
    TieringManager::from_config(cfg, region, &factory, opts)
}

/// The primary region is pre-faulted when it is created, so a `cpu_bytes_to_use` larger than
/// the memory available would push the machine into swap or the OOM killer instead of failing:
/// refuse it up front (a user mistake, exit 2).
fn check_region_memory(region_bytes: u64, available: Option<u64>) -> Result<()> {
    match available {
        Some(avail) if region_bytes > avail => Err(Error::config(
            "cpu_bytes_to_use",
            format!(
                "the primary region needs {} (pre-faulted at start), but only {} of memory is \
                 available; lower cpu_bytes_to_use",
                format_size(region_bytes),
                format_size(avail)
            ),
        )),
        _ => Ok(()),
    }
}

/// The manager as a [`Service`]: a scrape collects finished jobs, then renders.
struct ManagerService {
    manager: TieringManager,
}

impl Service for ManagerService {
    fn metrics_text(&mut self) -> Result<String> {
        if let Err(e) = self.manager.poll() {
            log::error!("tiering manager: {e}");
        }
        Ok(self.manager.metrics_text())
    }

    fn health(&mut self) -> std::result::Result<String, String> {
        health_body(&self.manager.health())
    }

    fn shutdown(&mut self) -> Result<()> {
        self.manager.poll()?;
        self.manager.shutdown()?;
        // A tier that served nothing, or whose final checkpoint failed, did not stop cleanly.
        let failed: Vec<String> = self
            .manager
            .health()
            .into_iter()
            .filter(|(_, h)| h.state == HealthState::Failed)
            .flat_map(|(label, h)| {
                h.problems
                    .into_iter()
                    .map(move |p| format!("tier {label}: {p}"))
            })
            .collect();
        if failed.is_empty() {
            Ok(())
        } else {
            Err(Error::new(
                ErrorKind::Io,
                format!("the tiers did not stop cleanly: {}", failed.join("; ")),
            ))
        }
    }
}

/// The `/healthz` answer for the tiers' health: `ok`; `degraded` and one line per problem
/// (still 200: the tiers serve); or, when a tier cannot serve, `failed` and the problems (503).
pub fn health_body(tiers: &[(String, TierHealth)]) -> std::result::Result<String, String> {
    let worst = tiers.iter().map(|(_, h)| h.state).max().unwrap_or_default();
    let mut body = match worst {
        HealthState::Ok => return Ok("ok\n".to_string()),
        HealthState::Degraded => "degraded\n".to_string(),
        HealthState::Failed => "failed\n".to_string(),
    };
    for (label, h) in tiers {
        for p in &h.problems {
            body.push_str(&format!("tier {label}: {p}\n"));
        }
    }
    if worst == HealthState::Failed {
        Err(body)
    } else {
        Ok(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_body_is_200_while_tiers_serve_and_503_when_one_cannot() {
        let ok = TierHealth::default();
        let mut degraded = TierHealth::default();
        degraded.add(HealthState::Degraded, "path 1 (/b) takes no writes: EIO");
        let mut failed = TierHealth::default();
        failed.add(HealthState::Failed, "index recovery failed");
        let t = |h: &TierHealth| {
            vec![
                ("1:nvme".to_string(), ok.clone()),
                ("2:nvme".to_string(), h.clone()),
            ]
        };
        assert_eq!(health_body(&t(&ok)), Ok("ok\n".to_string()));
        assert_eq!(
            health_body(&t(&degraded)),
            Ok("degraded\ntier 2:nvme: path 1 (/b) takes no writes: EIO\n".to_string())
        );
        assert_eq!(
            health_body(&t(&failed)),
            Err("failed\ntier 2:nvme: index recovery failed\n".to_string())
        );
        assert_eq!(health_body(&[]), Ok("ok\n".to_string()));
    }

    #[test]
    fn a_region_larger_than_available_memory_is_a_config_error() {
        let e = check_region_memory(64 << 30, Some(22 << 30)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        let s = e.to_string();
        assert!(
            s.contains("cpu_bytes_to_use") && s.contains("64 GiB"),
            "{s}"
        );
        assert!(check_region_memory(1 << 30, Some(22 << 30)).is_ok());
        assert!(check_region_memory(1 << 40, None).is_ok());
    }
}
