//! The exit code of an error, one rule for every command: 2 for a mistake the user fixes, 1
//! for kvtier's own failure.

use crate::output::errln;
use kvtier::error::{Error, ErrorKind};
use std::process::ExitCode;

/// Whether an error is the user's to fix (exit 2) or kvtier's (exit 1), the same for every
/// command: a path the user named that kvtier may not read or write (`EACCES`, `EPERM`,
/// `EROFS`), that does not exist, or that holds something other than a kvtier file (a bad
/// magic) is the user's input; a kvtier file that fails its checks (CRC) or I/O that fails
/// is kvtier's.
pub fn is_user_error(e: &Error) -> bool {
    let denied = e
        .raw_os_error()
        .or_else(|| e.context_value("errno").and_then(|n| n.parse().ok()))
        .is_some_and(|n| [libc::EACCES, libc::EPERM, libc::EROFS].contains(&n));
    denied
        || matches!(
            e.kind(),
            ErrorKind::Config
                | ErrorKind::InvalidPath
                | ErrorKind::Locked
                | ErrorKind::IncompatibleLayout
                | ErrorKind::Misaligned
                | ErrorKind::NoSpace
                | ErrorKind::Unsupported
                | ErrorKind::PermissionDenied
        )
}

/// Prints an error as one line on stderr and maps it to the exit code.
pub fn report(e: &Error) -> ExitCode {
    errln!("kvtier: error: {e}");
    if is_user_error(e) {
        ExitCode::from(2)
    } else {
        ExitCode::from(1)
    }
}
