//! Restores the default `SIGPIPE` action for commands that only write to stdout, so that
//! `kvtier tier ls DIR | head` ends quietly, as other Unix tools do, instead of panicking in
//! `println!` with "Broken pipe" and a backtrace. `kvtier serve` keeps Rust's default (the
//! signal ignored): a scraper that hangs up must not kill the server.

/// Sets `SIGPIPE` back to `SIG_DFL` for this process. Raw libc: neither std nor rustix sets
/// a signal's action (signal-hook installs handlers, not `SIG_DFL`).
pub fn restore_default() {
    // SAFETY: `signal` with `SIG_DFL` installs no handler code; it only changes the action of
    // one signal, and is called once at start-up before any other thread exists.
    let previous = unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    if previous == libc::SIG_ERR {
        log::debug!("could not restore the default SIGPIPE action");
    }
}
