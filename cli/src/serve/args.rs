//! The arguments of `kvtier serve` (what the command and both of its services read).

use std::path::PathBuf;

use crate::args::ModelArgs;
use crate::serve::http::DEFAULT_METRICS_ADDR;

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
