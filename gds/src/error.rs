//! The crate's error: a kind (what the caller does about it) and a message that names what
//! failed and why.

use std::fmt;

/// What went wrong, as far as the caller's decision goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GdsErrorKind {
    /// GDS cannot start here (no driver, no cuFile, no nvidia-fs, unsupported filesystem, no
    /// GPU): the caller falls back to the CPU path or, when GDS is required, reports it.
    Unavailable,
    /// A CUDA driver call failed.
    Cuda,
    /// A cuFile call failed.
    CuFile,
    /// A transfer moved fewer bytes than asked.
    ShortIo,
    /// A loaded row failed its CRC check.
    Checksum,
    /// A copy plan or an address is outside what it describes (a bug or a bad layout).
    Plan,
    /// An operating-system I/O error (host stand-in device).
    Io,
}

/// An error of the GDS data path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GdsError {
    /// What kind of failure.
    pub kind: GdsErrorKind,
    /// One line naming what failed and why.
    pub message: String,
}

impl GdsError {
    /// An error of `kind` with `message`.
    pub fn new(kind: GdsErrorKind, message: impl Into<String>) -> Self {
        GdsError {
            kind,
            message: message.into(),
        }
    }
}

impl fmt::Display for GdsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for GdsError {}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, GdsError>;

pub(crate) fn plan_error(message: impl Into<String>) -> GdsError {
    GdsError::new(GdsErrorKind::Plan, message)
}
