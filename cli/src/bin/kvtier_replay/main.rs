//! `kvtier-replay`: the driver the Python differential tests (`tests/python/`) use to observe
//! kvtier. It reads one JSON document on stdin, feeds it through kvtier's library code and
//! prints one JSON document of observations on stdout; the tests feed the same inputs to
//! vLLM 0.33.0's own code and compare.
//!
//! ```text
//! kvtier-replay canonical     < {"queries": [...]}     runs, writers and digests
//! kvtier-replay backpressure  < {"scenarios": [...]}   detector, manager and config replays
//! kvtier-replay fs            < {"scenarios": [...]}   the fs tier on a directory: paths, stores, loads
//! kvtier-replay node-serve    < {"config", ...}        the node service until SIGTERM
//! kvtier-replay roundtrip     < {"dir", "steps": [...]} canonical chunks through a G3 tier by TP size
//! kvtier-replay manager       < {"scenarios": [...]}   primary tier and tiering manager call sequences
//! ```
//!
//! Every subcommand answers `{"results": [...]}`, one entry per query or scenario; an entry
//! that kvtier refuses is `{"error": "...", "kind": "..."}` (the refusal is an observation).
//! A malformed document is exit status 2 with the reason on stderr. The input formats are
//! documented in `tests/python/README.md` and at the top of each module.

mod backpressure;
mod canonical;
mod fs;
mod json;
mod manager;
mod node;
mod roundtrip;

use std::io::Read as _;
use std::process::ExitCode;

use serde_json::Value;

const USAGE: &str =
    "usage: kvtier-replay <canonical|backpressure|fs|roundtrip|manager> < input.json > output.json
  canonical     canonical-layout runs, writers and digests for descriptors or layer views
  backpressure  back-pressure replays: detector events, manager feeds, config merges
  fs            the fs tier on a directory: file paths, stores, lookups, loads
  roundtrip     canonical chunks from rank files through a G3 tier, loaded at any TP size
  manager       call sequences through the primary tier and the tiering manager";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let command: fn(&Value) -> Result<Value, String> = match args.first().map(String::as_str) {
        Some("canonical") => canonical::run,
        Some("backpressure") => backpressure::run,
        Some("fs") => fs::run,
        Some("node-serve") => node::run,
        Some("roundtrip") => roundtrip::run,
        Some("manager") => manager::run,
        Some("-h" | "--help") => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Some(other) => return usage_error(&format!("unknown command {other:?}")),
        None => return usage_error("missing command"),
    };
    if args.len() > 1 {
        return usage_error(&format!("unexpected argument {:?}", args[1]));
    }
    let mut text = String::new();
    if let Err(e) = std::io::stdin().read_to_string(&mut text) {
        return usage_error(&format!("reading stdin: {e}"));
    }
    let input: Value = match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(e) => return usage_error(&format!("stdin is not JSON: {e}")),
    };
    match command(&input) {
        Ok(out) => {
            println!("{out}");
            ExitCode::SUCCESS
        }
        Err(msg) => usage_error(&msg),
    }
}

fn usage_error(msg: &str) -> ExitCode {
    eprintln!("kvtier-replay: {msg}\n{USAGE}");
    ExitCode::from(2)
}
