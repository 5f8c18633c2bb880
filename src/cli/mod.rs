//! The `kvtier` command line.

use std::process::ExitCode;

/// Runs the CLI with the process arguments and returns the exit code
/// (0 success, 1 internal failure, 2 user mistake).
pub fn main() -> ExitCode {
    eprintln!("kvtier: no commands yet");
    ExitCode::from(2)
}
