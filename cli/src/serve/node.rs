//! `kvtier serve` as the node-local service (a configuration with a `service` section): the
//! one `nvme` tier is shared by every engine process that connects to the service's Unix
//! socket (`docs/node-service.md`), with `/metrics` and `/healthz` on the HTTP endpoint.

use std::net::TcpListener;
use std::process::ExitCode;

use crate::serve::args::ServeArgs;
use crate::serve::health::health_body;
use crate::serve::refusal::{in_file, namespace_hint};
use crate::serve::service::{Service, serve_until_signal};
use kvtier::canonical::LayoutDescriptor;
use kvtier::config::KvtierConfig;
use kvtier::embed::{Plan, PoolOpener};
use kvtier::error::{Error, ErrorKind, Result};
use kvtier::node::NodeService;
use kvtier::node::start_from_config;

/// Starts the node service for `cfg` (planned as `plan` for `layout`) and serves until a
/// signal.
pub fn run(
    args: &ServeArgs,
    cfg: &KvtierConfig,
    layout: &LayoutDescriptor,
    plan: &Plan,
    listener: TcpListener,
) -> Result<()> {
    let config_path = args.config.as_path();
    // The namespace vLLM engines of this model and configuration present with the tier
    // entry's `layout` key (its canonical area where that is shorter than the row), not the
    // descriptor namespace of an in-process tier; `kvtier tier format` writes it by default.
    let opener = PoolOpener::serving(cfg);
    let digest = opener
        .namespace(layout, &plan.params)
        .map_err(|e| in_file(config_path, e))?;
    let service = start_from_config(
        cfg,
        plan.geometry.row_stride,
        plan.params.slot_prefix(),
        digest,
    )
    .map_err(|e| {
        if e.kind() == ErrorKind::IncompatibleLayout {
            namespace_hint(e, args, cfg, layout, &plan.params, opener)
        } else {
            in_file(config_path, e)
        }
    })?;
    serve(args, cfg, service, listener, digest, plan.params.slot_bytes)
}

/// Starts the node service for `cfg` with the namespace digest `namespace` (64 hex digits)
/// and slots of `slot_bytes` given on the command line (`--namespace`, `--slot-bytes`: what
/// SGLang ranks present, `docs/sglang.md`), and serves until a signal.
pub fn run_for_namespace(
    args: &ServeArgs,
    cfg: &KvtierConfig,
    namespace: &str,
    slot_bytes: u64,
) -> Result<ExitCode> {
    let config_path = args.config.as_path();
    if cfg.service.is_none() {
        return Err(Error::config(
            "--namespace",
            "only for the node service: the configuration needs a service section",
        ));
    }
    let digest = kvtier::canonical::digest_from_hex(namespace).ok_or_else(|| {
        Error::config(
            "--namespace",
            format!("{namespace:?} is not 64 hex digits (a namespace digest)"),
        )
    })?;
    kvtier::metrics::Registry::new(args.metrics_prefix.as_str())
        .map_err(|e| Error::config("--metrics-prefix", e.message().to_string()))?;
    let listener = crate::serve::http::bind(&args.metrics_addr)?;
    // Every engine's row is one slot: the whole row is stored.
    let service = start_from_config(cfg, slot_bytes, None, digest).map_err(|e| {
        if e.kind() != ErrorKind::IncompatibleLayout {
            return in_file(config_path, e);
        }
        // `kvtier tier format` makes vLLM's and kvtier's namespaces, not this one.
        let mut out = Error::new(
            ErrorKind::IncompatibleLayout,
            format!(
                "{}; with --namespace and --slot-bytes the service opens only slabs written \
                 under that namespace and slot size: use other directories, or delete this \
                 tier's files to start it empty",
                e.message()
            ),
        );
        for key in ["expected", "found"] {
            if let Some(v) = e.context_value(key) {
                out = out.with(key, v.to_string());
            }
        }
        in_file(config_path, out)
    })?;
    serve(args, cfg, service, listener, digest, slot_bytes)?;
    Ok(ExitCode::SUCCESS)
}

/// Says where the started `service` listens and what it stores, then serves its metrics and
/// health on `listener` until a signal.
fn serve(
    args: &ServeArgs,
    cfg: &KvtierConfig,
    service: NodeService,
    listener: TcpListener,
    digest: [u8; 32],
    slot_bytes: u64,
) -> Result<()> {
    if let Some(s) = &cfg.service {
        // stderr: the first stdout line stays the endpoint's address (scripts read it).
        crate::output::errln!(
            "kvtier serve: node service on {} (digest {}, slots of {} bytes: engines' rows \
             of at least that many bytes, their first ones stored)",
            s.socket_path.display(),
            hex::encode(digest),
            slot_bytes
        );
    }
    serve_until_signal(
        listener,
        Box::new(NodeHttp {
            service: Some(service),
            prefix: args.metrics_prefix.clone(),
        }),
    )
}

/// The node service behind the HTTP endpoint.
struct NodeHttp {
    service: Option<NodeService>,
    prefix: String,
}

impl Service for NodeHttp {
    fn metrics_text(&mut self) -> Result<String> {
        match &self.service {
            Some(s) => s.metrics_text(&self.prefix),
            None => Err(Error::new(
                ErrorKind::Closed,
                "the node service has stopped",
            )),
        }
    }

    fn health(&mut self) -> std::result::Result<String, String> {
        match &self.service {
            Some(s) => health_body(&[(s.tier_label().to_string(), s.health())]),
            None => Err("stopped\n".to_string()),
        }
    }

    fn shutdown(&mut self) -> Result<()> {
        self.service.take().map_or(Ok(()), NodeService::shutdown)
    }
}
