//! The `kvtier` command line (the `kvtier` binary; see `kvtier --help`), built on the `kvtier`
//! engine library.
//!
//! Each command lives in its own module with a `clap::Args` struct and a
//! `run(args) -> Result<ExitCode>` function; this module only parses and dispatches.
//!
//! * [`bench`](mod@bench): `kvtier bench` (plan, phases, report, the stack it runs on).
//! * [`fio`]: `kvtier fio-compare` (fio runner, test files, the kvtier and G3 workloads,
//!   report, plot).
//! * [`serve`]: `kvtier serve` (manager service or node service, metrics endpoint);
//!   [`service_cmd`]: `kvtier service status`; [`service_bench`]: `kvtier service bench`.
//! * [`replay`]: `kvtier replay` (a KV-cache trace through the manager and a G3 tier).
//! * [`tier`]: `kvtier tier format|inspect|verify|ls|clear`.
//! * [`config_cmd`], [`layout_cmd`], [`version`]: `kvtier config check`,
//!   `kvtier layout show|check`, `kvtier version`.
//! * [`args`]: the argument groups and flag parsers several commands share; [`exit`]: the
//!   exit code of an error; [`output`],
//!   [`size`], [`stats`], [`interrupt`], [`logger`], [`sigpipe`]: what every
//!   command uses.
//!
//! Exit codes: 0 success, 1 internal failure, 2 user mistake (bad path, unknown option,
//! unreadable or invalid config, tier locked by another process, layout mismatch), decided
//! for every command by [`exit::is_user_error`].

pub mod args;
pub mod bench;
pub mod block_device;
pub mod config_cmd;
pub mod exit;
pub mod fio;
pub mod interrupt;
pub mod layout_cmd;
pub mod layout_vllm;
pub mod logger;
pub mod output;
pub mod region_arg;
pub mod replay;
pub mod serve;
pub mod service_bench;
pub mod service_cmd;
pub mod sigpipe;
pub mod size;
pub mod stats;
pub mod tier;
pub mod version;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::exit::report;
use crate::output::errln;

/// kvtier: a fast, trustworthy storage tier for LLM KV cache.
#[derive(Debug, Parser)]
#[command(
    name = "kvtier",
    version,
    about,
    long_about = None,
    after_help = "Examples:
  kvtier bench                                  # the whole stack on a temporary tier, verified
  kvtier fio-compare --path /mnt/nvme0          # kvtier vs fio, same file state, row size, depth
  kvtier tier inspect /mnt/nvme0 /mnt/nvme1     # what a tier holds
  kvtier serve --config kvtier.json             # /metrics on 127.0.0.1:9464

Exit codes: 0 success, 1 kvtier failed (I/O error, bytes that did not verify, stdout not
writable), 2 your input (bad option; a path missing, not readable or writable, or holding a
file that is not kvtier's; invalid config; tier locked by another process; layout mismatch)."
)]
pub struct Cli {
    /// The command to run.
    #[command(subcommand)]
    pub command: Command,
}

/// kvtier's commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the version, the build (profile, rust-version, features) and the I/O engines
    /// available on this machine.
    Version,
    /// Store chunks through the whole stack into a G3 tier, load them back, verify every byte.
    Bench(bench::BenchArgs),
    /// Compare kvtier's store/load throughput with fio on the same path, file state, row size
    /// and depth.
    FioCompare(fio::FioCompareArgs),
    /// Replay a Mooncake-format KV-cache trace through the primary and a G3 tier, every
    /// loaded byte verified; counts served / recomputed blocks and NVMe bytes.
    Replay(replay::ReplayArgs),
    /// Run the manager with the configured tiers and serve /metrics and /healthz (with a
    /// `service` section: the node service every engine of the host connects to).
    Serve(serve::ServeArgs),
    /// Ask a running node service: `kvtier service status --socket PATH`.
    Service(service_cmd::ServiceArgs),
    /// Administer a G3 tier: format, inspect, verify, ls, clear.
    Tier(tier::TierArgs),
    /// Configuration tools: `kvtier config check FILE`.
    Config(config_cmd::ConfigArgs),
    /// Inspect and validate KV layout descriptors (canonical mappings and digests).
    Layout(layout_cmd::LayoutArgs),
}

/// A command-line mistake as one line, `kvtier: error: ...` with clap's hint (exit 2). Help and
/// version requests print as clap prints them.
fn parse_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind as Clap;
    if matches!(
        e.kind(),
        Clap::DisplayHelp | Clap::DisplayVersion | Clap::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        e.exit();
    }
    errln!("kvtier: error: {}", one_line(&e.render().to_string()));
    ExitCode::from(2)
}

/// clap's message (its first paragraph) and its tips, on one line.
fn one_line(rendered: &str) -> String {
    let mut paragraphs = rendered.split("\n\n");
    let join = |p: &str| p.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut line = join(paragraphs.next().unwrap_or_default());
    if let Some(rest) = line.strip_prefix("error: ") {
        line = rest.to_string();
    }
    for tip in paragraphs.filter(|p| p.trim_start().starts_with("tip:")) {
        line.push_str("; ");
        line.push_str(&join(tip));
    }
    line.push_str(" (see --help)");
    line
}

/// Runs the CLI with the process arguments and returns the exit code.
fn main() -> ExitCode {
    logger::init();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return parse_error(e),
    };
    if !matches!(cli.command, Command::Serve(_)) {
        sigpipe::restore_default();
    }
    let result = match cli.command {
        Command::Version => version::run(),
        Command::Bench(args) => bench::run(args),
        Command::FioCompare(args) => fio::run(args),
        Command::Replay(args) => replay::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Service(args) => service_cmd::run(args),
        Command::Tier(args) => tier::run(args),
        Command::Config(args) => config_cmd::run(args),
        Command::Layout(args) => layout_cmd::run(args),
    };
    match result {
        Ok(code) => code,
        Err(e) => report(&e),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn clap_errors_become_one_line_with_their_tip() {
        let text = "error: unexpected argument '--byts' found\n\n  tip: a similar argument \
                    exists: '--bytes'\n\nUsage: kvtier bench --bytes <SIZE>\n\nFor more \
                    information, try '--help'.\n";
        assert_eq!(
            super::one_line(text),
            "unexpected argument '--byts' found; tip: a similar argument exists: '--bytes' \
             (see --help)"
        );
        let text = "error: the following required arguments were not provided:\n  --tp <TP>\n\n\
                    Usage: kvtier layout show --tp <TP> <FILE>\n";
        assert_eq!(
            super::one_line(text),
            "the following required arguments were not provided: --tp <TP> (see --help)"
        );
    }
}
