//! `kvtier serve`: runs the tiering manager with the configured tiers behind a metrics
//! endpoint until SIGTERM or Ctrl-C, then drains, checkpoints and exits 0.
//!
//! The manager comes from the library's [`Builder`]: the region is sized like vLLM sizes it
//! (the layout, default Llama-3.1-8B, and TP give the bytes per GPU block, the config gives
//! `blocks_per_chunk` or `block_size` and `cpu_bytes_to_use`), `nvme` tiers get the layout's
//! namespace digest for their superblocks and `fs` tiers its vLLM FileMapper fields.

pub mod http;
pub mod node;
pub mod service;

use std::path::PathBuf;
use std::process::ExitCode;

use crate::args::ModelArgs;
use crate::serve::http::DEFAULT_METRICS_ADDR;
use crate::serve::service::{Service, serve_until_signal};
use kvtier::config::KvtierConfig;
use kvtier::contract::secondary::{HealthState, TierHealth};
use kvtier::embed::Builder;
use kvtier::error::{Error, ErrorKind, Result};
use kvtier::tiering::TierFactory;
use kvtier::tiering::TieringManager;

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
    /// Node service only: the namespace digest (64 hex digits) the engines present, instead of
    /// the one vLLM engines of --layout and --tp present. SGLang ranks present their own
    /// (`kvtier.sglang`, docs/sglang.md, which names it and --slot-bytes).
    #[arg(
        long,
        value_name = "HEX",
        requires = "slot_bytes",
        conflicts_with = "layout"
    )]
    pub namespace: Option<String>,
    /// With --namespace: bytes of one G3 slot (SGLang: one piece of a host page).
    #[arg(long, value_name = "SIZE", requires = "namespace", value_parser = crate::size::parse_size)]
    pub slot_bytes: Option<u64>,
    /// Metric name prefix (`vllm:` makes vLLM dashboards work unchanged).
    #[arg(long, default_value = kvtier::metrics::DEFAULT_PREFIX, value_name = "PREFIX")]
    pub metrics_prefix: String,
}

/// Runs `kvtier serve`.
pub fn run(args: ServeArgs) -> Result<ExitCode> {
    let cfg = kvtier::config::load(&args.config)?;
    if let (Some(namespace), Some(slot_bytes)) = (&args.namespace, args.slot_bytes) {
        return node::run_for_namespace(&args, &cfg, namespace, slot_bytes);
    }
    let layout = args.model.load()?;
    // Every rule first (the ones `config check` runs too), then the address: a mistake in
    // either is found before the region is allocated and the slabs created.
    let builder = Builder::new(cfg.clone())
        .layout(layout.clone(), args.model.tp)
        .metrics_prefix(&args.metrics_prefix);
    let plan = builder.plan().map_err(|e| in_file(&args.config, e))?;
    kvtier::metrics::Registry::new(args.metrics_prefix.as_str())
        .map_err(|e| Error::config("--metrics-prefix", e.message().to_string()))?;
    let listener = http::bind(&args.metrics_addr)?;
    if cfg.service.is_some() {
        node::run(&args, &cfg, &layout, &plan, listener)?;
        return Ok(ExitCode::SUCCESS);
    }
    let manager = builder.build().map_err(|e| {
        if e.kind() != ErrorKind::IncompatibleLayout {
            return e;
        }
        // Say which inputs make the namespace and how to format a tier that matches.
        namespace_hint(
            e,
            &args,
            &cfg,
            &layout,
            &plan.params,
            crate::tier::FormatFor::InProcess,
        )
    })?;
    serve_until_signal(listener, Box::new(ManagerService { manager }))?;
    Ok(ExitCode::SUCCESS)
}

/// A namespace or row-size refusal `e` (a tier formatted for another model, TP size, row
/// layout or opener) with the inputs serve derives its namespace from (`layout`: the `--layout` model)
/// and the exact `kvtier tier format` command that makes a tier it opens (`for_`: the
/// in-process tiers' namespace, or the node service's, which vLLM engines present). Any
/// other refusal is returned as it is.
fn namespace_hint(
    e: Error,
    args: &ServeArgs,
    cfg: &KvtierConfig,
    layout: &kvtier::canonical::LayoutDescriptor,
    params: &kvtier::canonical::NamespaceParams,
    for_: crate::tier::FormatFor,
) -> Error {
    use crate::tier::FormatFor;
    use kvtier::g3::{MISMATCH_NAMESPACE, MISMATCH_ROW_STRIDE};
    // Only a tier formatted under other settings is fixed by a format that matches them;
    // every other refusal (paths in another order, a member of another set, a slab of another
    // format version or capacity) already says what fixes it, and a format would discard
    // chunks for nothing.
    if !matches!(
        e.context_value("mismatch"),
        Some(MISMATCH_NAMESPACE | MISMATCH_ROW_STRIDE)
    ) {
        return e;
    }
    let blocks_per_chunk = params.blocks_per_chunk;
    // A tier formatted for this model but for the other opener says so.
    let other_for = match for_ {
        FormatFor::InProcess => FormatFor::Vllm,
        FormatFor::Vllm => FormatFor::InProcess,
    };
    let other = other_for
        .namespace(layout, params)
        .ok()
        .map(|d| (d, other_for.openers()));
    let formatted_for = match (other, e.context_value("found")) {
        (Some((digest, who)), Some(found)) if hex::encode(digest) == found => {
            format!(" (the tier was formatted for {who})")
        }
        _ => String::new(),
    };
    let (who, flag) = match for_ {
        FormatFor::InProcess => (
            "kvtier serve without a service section opens tiers with the in-process namespace",
            "--for in-process",
        ),
        FormatFor::Vllm => (
            "the node service opens tiers with the namespace vLLM engines present (with the \
             tier entry's layout key)",
            "--for vllm, the default",
        ),
    };
    let command = crate::tier::format_command(
        cfg,
        args.model.layout.as_deref(),
        args.model.tp,
        blocks_per_chunk,
        for_,
    );
    let mut out = Error::new(
        ErrorKind::IncompatibleLayout,
        format!(
            "{}{formatted_for}; {who} ({flag}), derived from {} at --tp {}, \
             blocks_per_chunk {} and canonical_layout = {} in {}: serve with the settings \
             the tier was formatted with to keep its chunks, or, to change them, format the \
             tier to match, which discards the chunks it holds (`{command}`)",
            e.message(),
            layout.model_name,
            args.model.tp,
            blocks_per_chunk,
            cfg.canonical_layout,
            args.config.display(),
        ),
    );
    for key in ["expected", "found"] {
        if let Some(v) = e.context_value(key) {
            out = out.with(key, v.to_string());
        }
    }
    out
}

/// A plan error names the configuration file unless it is about a flag (`--tp`).
pub fn in_file(config: &std::path::Path, e: Error) -> Error {
    if e.context_value("key").is_some_and(|k| k.starts_with("--")) {
        e
    } else {
        kvtier::config::error_in_file(config, e)
    }
}

/// Every secondary tier of `cfg` against `factory`'s rules for rows of `row_stride` bytes.
pub fn check_tiers(cfg: &KvtierConfig, factory: &TierFactory, row_stride: u64) -> Result<()> {
    cfg.secondary_tiers
        .iter()
        .try_for_each(|tier| factory.check(tier, row_stride))
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
}
