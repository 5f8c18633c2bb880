//! The `kvtier` binary: see `kvtier --help`.

fn main() -> std::process::ExitCode {
    kvtier::run_cli()
}
