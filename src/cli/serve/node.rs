//! `kvtier serve` as the node-local service (a configuration with a `service` section): the
//! one `nvme` tier is shared by every engine process that connects to the service's Unix
//! socket (`docs/node-service.md`), with `/metrics` and `/healthz` on the HTTP endpoint.

use std::net::TcpListener;
use std::path::Path;

use crate::canonical::LayoutDescriptor;
use crate::canonical::digest::VllmSpecFields;
use crate::cli::serve::health_body;
use crate::cli::serve::service::{Service, serve_until_signal};
use crate::config::KvtierConfig;
use crate::embed::Plan;
use crate::error::{Error, ErrorKind, Result};
use crate::node::NodeService;
use crate::node::server::start_from_config;

/// Starts the node service for `cfg` (planned as `plan` for `layout`) and serves until a
/// signal.
pub fn run(
    config_path: &Path,
    cfg: &KvtierConfig,
    layout: &LayoutDescriptor,
    plan: &Plan,
    listener: TcpListener,
    metrics_prefix: &str,
) -> Result<()> {
    // The namespace vLLM engines of this model and configuration present (their spec's, as
    // the Python tier computes it), not the descriptor namespace of an in-process tier.
    let digest = VllmSpecFields::of_engine(layout, &plan.params)
        .and_then(|f| f.namespace_digest())
        .map_err(|e| super::in_file(config_path, e))?;
    let service = start_from_config(
        cfg,
        plan.geometry.row_stride,
        plan.params.slot_prefix(),
        digest,
    )
    .map_err(|e| super::in_file(config_path, e))?;
    if let Some(s) = &cfg.service {
        // stderr: the first stdout line stays the endpoint's address (scripts read it).
        crate::cli::output::errln!(
            "kvtier serve: node service on {} (digest {}, rows of {} bytes)",
            s.socket_path.display(),
            hex::encode(digest),
            plan.geometry.row_stride
        );
    }
    serve_until_signal(
        listener,
        Box::new(NodeHttp {
            service: Some(service),
            prefix: metrics_prefix.to_string(),
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
