//! Ctrl-C / SIGTERM for long-running commands: the first one sets a flag that the work loops
//! check, so the command stops with an error and its temporary files are removed on the way
//! out (a killed `kvtier bench` would leave gigabytes of slab behind in the temp dir).

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use signal_hook::consts::{SIGINT, SIGTERM};

use crate::output::errln;
use kvtier::error::{Error, ErrorKind, Result};

static INTERRUPTED: OnceLock<Arc<AtomicBool>> = OnceLock::new();

/// Exit code of a command stopped by Ctrl-C or SIGTERM (128 + SIGINT, as shells report it).
pub const EXIT_INTERRUPTED: u8 = 130;

/// From now on SIGINT and SIGTERM set the flag instead of killing the process.
pub fn catch() {
    let flag = INTERRUPTED.get_or_init(|| Arc::new(AtomicBool::new(false)));
    for sig in [SIGINT, SIGTERM] {
        if let Err(e) = signal_hook::flag::register(sig, flag.clone()) {
            log::warn!("cannot catch signal {sig} ({e}); interrupting will not clean up");
        }
    }
}

/// `Err(Cancelled)` naming `what` once SIGINT or SIGTERM has arrived.
pub fn check(what: &str) -> Result<()> {
    if INTERRUPTED.get().is_some_and(|f| f.load(Ordering::Relaxed)) {
        return Err(Error::new(
            ErrorKind::Cancelled,
            format!("interrupted during {what}"),
        ));
    }
    Ok(())
}

/// Runs a long command with [`catch`] in force: an interrupt ([`check`] returned `Cancelled`)
/// prints one error line and exits [`EXIT_INTERRUPTED`]; every other result passes through.
pub fn run_interruptible(command: impl FnOnce() -> Result<ExitCode>) -> Result<ExitCode> {
    catch();
    match command() {
        Err(e) if e.kind() == ErrorKind::Cancelled => {
            errln!("kvtier: error: {e}");
            Ok(ExitCode::from(EXIT_INTERRUPTED))
        }
        other => other,
    }
}
