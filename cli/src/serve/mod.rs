//! `kvtier serve`: runs the tiering manager with the configured tiers behind a metrics
//! endpoint until SIGTERM or Ctrl-C, then drains, checkpoints and exits 0.
//!
//! The manager comes from the library's [`Builder`]: the region is sized like vLLM sizes it
//! (the layout, default Llama-3.1-8B, and TP give the bytes per GPU block, the config gives
//! `blocks_per_chunk` or `block_size` and `cpu_bytes_to_use`), `nvme` tiers get the layout's
//! namespace digest for their superblocks and `fs` tiers its vLLM FileMapper fields.

pub mod args;
pub mod health;
pub mod http;
pub mod node;
pub mod refusal;
pub mod service;

use std::process::ExitCode;

pub use crate::serve::args::ServeArgs;
use crate::serve::health::health_body;
pub use crate::serve::refusal::in_file;
use crate::serve::refusal::namespace_hint;
use crate::serve::service::{Service, serve_until_signal};
use kvtier::config::KvtierConfig;
use kvtier::contract::secondary::HealthState;
use kvtier::embed::{Builder, PoolOpener};
use kvtier::error::{Error, ErrorKind, Result};
use kvtier::tiering::TierFactory;
use kvtier::tiering::TieringManager;

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
            PoolOpener::serving(&cfg),
        )
    })?;
    serve_until_signal(listener, Box::new(ManagerService { manager }))?;
    Ok(ExitCode::SUCCESS)
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
