//! `kvtier service bench` is [`crate::service_bench`].
//!
//! `kvtier service status --socket PATH [--json]`: asks a running node service
//! (`kvtier serve` with a `service` section) which engines are connected, their regions and
//! counters, and how full its tier is.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};

use crate::output::outln;
use kvtier::error::{Error, ErrorKind, Result};
use kvtier::node::NodeClient;

/// `kvtier service ...`.
#[derive(Debug, Args)]
pub struct ServiceArgs {
    /// The service command.
    #[command(subcommand)]
    pub command: ServiceCommand,
}

/// Node-service commands.
#[derive(Debug, Subcommand)]
pub enum ServiceCommand {
    /// List the connected engines, their regions and counters, and the tier's fill.
    Status(StatusArgs),
    /// Measure what the DRAM staging pool and prefetch hints save on the service path
    /// (a service of its own, in this process).
    Bench(crate::service_bench::BenchArgs),
}

/// Arguments of `kvtier service status`.
#[derive(Debug, Args)]
#[command(after_help = "Example:
  kvtier service status --socket /run/kvtier/kvtier.sock")]
pub struct StatusArgs {
    /// The service's socket (`service.socket_path` of its configuration).
    #[arg(long, value_name = "PATH")]
    pub socket: PathBuf,
    /// Print the status document as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Runs `kvtier service ...`.
pub fn run(args: ServiceArgs) -> Result<ExitCode> {
    match args.command {
        ServiceCommand::Status(a) => status(a),
        ServiceCommand::Bench(a) => crate::service_bench::run(a),
    }
}

fn status(args: StatusArgs) -> Result<ExitCode> {
    // A missing socket is the user's (exit 2: the path names no service); the error names it.
    let client = NodeClient::observe(&args.socket)?;
    let text = client.status()?;
    if args.json {
        outln!("{text}")?;
        return Ok(ExitCode::SUCCESS);
    }
    let doc: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::new(ErrorKind::Contract, format!("bad status document: {e}")))?;
    let tier = &doc["tier"];
    outln!(
        "kvtier node service {} on {}: digest {}, slots of {} bytes (each engine's rows hold \
         at least that many)",
        doc["version"].as_str().unwrap_or("?"),
        args.socket.display(),
        doc["digest"].as_str().unwrap_or("?"),
        doc["slot_bytes"]
    )?;
    outln!(
        "tier: {} of {} slots used, engine {}, {}",
        tier["used_slots"],
        tier["total_slots"],
        tier["engine"].as_str().unwrap_or("?"),
        if tier["ready"].as_bool() == Some(true) {
            "ready"
        } else {
            "recovering its index"
        }
    )?;
    let engines = doc["engines"].as_array().cloned().unwrap_or_default();
    let n = engines.len();
    outln!(
        "{n} engine{} connected{}",
        if n == 1 { "" } else { "s" },
        if n == 0 { "" } else { ":" }
    )?;
    for e in engines {
        let region = match e["region"].as_object() {
            Some(r) => format!(
                "region {} ({} rows of {} bytes, {} I/O, {:.0} % in 2 MiB pages)",
                r.get("path").and_then(|p| p.as_str()).unwrap_or("?"),
                r.get("num_rows").map_or("?".into(), |v| v.to_string()),
                r.get("row_stride").map_or("?".into(), |v| v.to_string()),
                r.get("io_engine").and_then(|p| p.as_str()).unwrap_or("?"),
                r.get("huge_page_share")
                    .and_then(serde_json::Value::as_f64)
                    .unwrap_or(0.0)
                    * 100.0
            ),
            None => "no region registered".to_string(),
        };
        outln!(
            "  {} (pid {}, uid {}): {region}; {} stores, {} loads, {} failed, {} in flight, \
             {} B stored, {} B loaded, {} lookups, {} errors",
            e["name"].as_str().unwrap_or("?"),
            e["pid"],
            e["uid"],
            e["stores"],
            e["loads"],
            e["failed_jobs"],
            e["jobs_in_flight"],
            e["bytes_stored"],
            e["bytes_loaded"],
            e["lookups"],
            e["errors"]
        )?;
    }
    if let Some(n) = doc["regions_lost"].as_u64().filter(|n| *n > 0) {
        let last = &doc["last_region_lost"];
        outln!(
            "{n} region{} lost (shrunk by its engine while registered); the last: \
             engine {} (pid {}), region {}, {} bytes registered, {} bytes found",
            if n == 1 { "" } else { "s" },
            last["engine"].as_str().unwrap_or("?"),
            last["pid"],
            last["path"].as_str().unwrap_or("?"),
            last["expected_bytes"],
            last["found_bytes"]
                .as_u64()
                .map_or_else(|| "an unknown number of".to_string(), |b| b.to_string())
        )?;
    }
    Ok(ExitCode::SUCCESS)
}
