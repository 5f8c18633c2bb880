//! The one error type of the crate: a kind, a message, key/value context and an optional source.
//!
//! Every error a user can see says what went wrong and where (config key path, file path, chunk
//! key, expected vs found), so that it can be acted on without reading the code.

use std::fmt;
use std::io;
use std::path::Path;

/// What class of failure an [`Error`] is. Callers match on this, never on the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The configuration is invalid (unknown key, wrong type, value out of range).
    Config,
    /// An operating-system I/O call failed.
    Io,
    /// A transfer moved fewer bytes than requested.
    ShortIo,
    /// A buffer, offset or length violates the O_DIRECT / row alignment rules.
    Misaligned,
    /// Not enough space (disk, region, slots) for what was asked.
    NoSpace,
    /// Stored bytes failed their CRC check.
    Checksum,
    /// On-disk data is not in the expected format (magic, version, CRC of metadata).
    Corrupt,
    /// A file is locked by another process.
    Locked,
    /// Stored data was written under another layout / geometry / namespace.
    IncompatibleLayout,
    /// The platform, filesystem or build lacks a needed capability.
    Unsupported,
    /// An earlier write or fsync failed on this object; it refuses further writes.
    Poisoned,
    /// The object was shut down or closed.
    Closed,
    /// The request was cancelled before it started.
    Cancelled,
    /// A path is missing, not a directory, or not usable.
    InvalidPath,
    /// A caller broke an API contract (e.g. a job reported twice); a bug, surfaced as an error.
    Contract,
    /// Something that should be impossible happened inside kvtier.
    Internal,
    /// A peer is not allowed (its uid is not on the node service's allow list).
    PermissionDenied,
    /// The memory a transfer moves rows to or from is gone: an engine's region file was shrunk
    /// while the node service had it mapped. The stored chunks are not at fault.
    RegionLost,
}

impl ErrorKind {
    /// A short lower-case name, stable for metrics labels and JSON output.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Config => "config",
            ErrorKind::Io => "io",
            ErrorKind::ShortIo => "short_io",
            ErrorKind::Misaligned => "misaligned",
            ErrorKind::NoSpace => "no_space",
            ErrorKind::Checksum => "checksum",
            ErrorKind::Corrupt => "corrupt",
            ErrorKind::Locked => "locked",
            ErrorKind::IncompatibleLayout => "incompatible_layout",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Poisoned => "poisoned",
            ErrorKind::Closed => "closed",
            ErrorKind::Cancelled => "cancelled",
            ErrorKind::InvalidPath => "invalid_path",
            ErrorKind::Contract => "contract",
            ErrorKind::Internal => "internal",
            ErrorKind::PermissionDenied => "permission_denied",
            ErrorKind::RegionLost => "region_lost",
        }
    }

    /// Every kind, in declaration order.
    pub const ALL: [ErrorKind; 18] = [
        ErrorKind::Config,
        ErrorKind::Io,
        ErrorKind::ShortIo,
        ErrorKind::Misaligned,
        ErrorKind::NoSpace,
        ErrorKind::Checksum,
        ErrorKind::Corrupt,
        ErrorKind::Locked,
        ErrorKind::IncompatibleLayout,
        ErrorKind::Unsupported,
        ErrorKind::Poisoned,
        ErrorKind::Closed,
        ErrorKind::Cancelled,
        ErrorKind::InvalidPath,
        ErrorKind::Contract,
        ErrorKind::Internal,
        ErrorKind::PermissionDenied,
        ErrorKind::RegionLost,
    ];

    /// The kind named `name` ([`ErrorKind::as_str`]), if any.
    pub fn from_name(name: &str) -> Option<ErrorKind> {
        ErrorKind::ALL.into_iter().find(|k| k.as_str() == name)
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The crate's error: kind, human message, context pairs and the underlying cause.
pub struct Error {
    kind: ErrorKind,
    message: String,
    context: Vec<(&'static str, String)>,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

/// Result alias used throughout kvtier.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A new error of `kind` with a message a user can act on.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
            context: Vec::new(),
            source: None,
        }
    }

    /// Shorthand for a [`ErrorKind::Config`] error that names the key path.
    pub fn config(key_path: impl Into<String>, message: impl Into<String>) -> Self {
        let key_path = key_path.into();
        Error::new(ErrorKind::Config, format!("{key_path}: {}", message.into()))
            .with("key", key_path)
    }

    /// An [`ErrorKind::Io`] error for `op` on `path`, keeping the OS error (and its errno).
    pub fn io(op: &str, path: &Path, err: io::Error) -> Self {
        let kind = match err.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => ErrorKind::NoSpace,
            Some(libc::EWOULDBLOCK) => ErrorKind::Locked,
            Some(libc::ENOENT) | Some(libc::ENOTDIR) => ErrorKind::InvalidPath,
            _ => ErrorKind::Io,
        };
        let mut e = Error::new(kind, format!("{op} {}: {err}", path.display()))
            .with("path", path.display().to_string());
        if let Some(errno) = err.raw_os_error() {
            e = e.with("errno", errno.to_string());
        }
        e.with_source(err)
    }

    /// Adds a context pair (`path`, `offset`, `expected`, `found`, `key`, ...).
    pub fn with(mut self, key: &'static str, value: impl Into<String>) -> Self {
        self.context.push((key, value.into()));
        self
    }

    /// Attaches the underlying cause.
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// The kind of failure.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The message without context.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The context pairs, in the order they were added.
    pub fn context(&self) -> &[(&'static str, String)] {
        &self.context
    }

    /// The value of a context key, if present.
    pub fn context_value(&self, key: &str) -> Option<&str> {
        self.context
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The OS errno carried by the source, if the source is an `io::Error`.
    pub fn raw_os_error(&self) -> Option<i32> {
        self.source
            .as_ref()
            .and_then(|s| s.downcast_ref::<io::Error>())
            .and_then(|e| e.raw_os_error())
    }

    /// A copy that keeps kind, message and context; the source becomes its text.
    /// Used when one failure must be reported for several keys or jobs.
    pub fn duplicate(&self) -> Self {
        Error {
            kind: self.kind,
            message: self.message.clone(),
            context: self.context.clone(),
            source: self
                .source
                .as_ref()
                .map(|s| Box::new(SourceText(s.to_string())) as _),
        }
    }
}

impl Clone for Error {
    fn clone(&self) -> Self {
        self.duplicate()
    }
}

#[derive(Debug)]
struct SourceText(String);
impl fmt::Display for SourceText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for SourceText {}

impl Error {
    /// Whether the message already says what the context pair `k: v` would add.
    fn spells_out(&self, k: &str, v: &str) -> bool {
        match k {
            "key" | "path" => self.message.contains(v),
            "errno" => self.message.contains(&format!("os error {v})")),
            "pid" => self.message.contains(&format!("pid {v}")),
            // A tag for programs (which refusal this is), never news to a reader.
            "mismatch" => true,
            _ => false,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)?;
        // Context already spelled out in the message is not repeated.
        let extra: Vec<_> = self
            .context
            .iter()
            .filter(|(k, v)| !self.spells_out(k, v))
            .collect();
        if !extra.is_empty() {
            f.write_str(" (")?;
            for (i, (k, v)) in extra.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{k}: {v}")?;
            }
            f.write_str(")")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Error")
            .field("kind", &self.kind)
            .field("message", &self.message)
            .field("context", &self.context)
            .field("source", &self.source.as_ref().map(|s| s.to_string()))
            .finish()
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_ref()
            .map(|s| s.as_ref() as &(dyn std::error::Error + 'static))
    }
}

impl From<io::Error> for Error {
    fn from(err: io::Error) -> Self {
        let kind = match err.raw_os_error() {
            Some(libc::ENOSPC) => ErrorKind::NoSpace,
            _ => ErrorKind::Io,
        };
        Error::new(kind, err.to_string()).with_source(err)
    }
}

/// Returns early with an error of the given kind and formatted message.
#[macro_export]
macro_rules! bail {
    ($kind:expr, $($arg:tt)*) => {
        return Err($crate::error::Error::new($kind, format!($($arg)*)))
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_includes_context_but_not_repeated_path() {
        let e = Error::io(
            "open",
            Path::new("/nope/slab"),
            io::Error::from_raw_os_error(libc::ENOENT),
        );
        assert_eq!(e.kind(), ErrorKind::InvalidPath);
        let s = e.to_string();
        assert!(s.starts_with("open /nope/slab: "), "{s}");
        // The errno is spelled once, by the OS error text, not again as context.
        assert!(s.contains("(os error 2)"), "{s}");
        assert!(!s.contains("errno: 2"), "{s}");
        assert_eq!(e.context_value("errno"), Some("2"));
        assert_eq!(s.matches("/nope/slab").count(), 1, "{s}");
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
    }

    #[test]
    fn config_error_names_key() {
        let e = Error::config("secondary_tiers[1].backpresure", "unknown key")
            .with("did_you_mean", "backpressure");
        assert_eq!(e.kind(), ErrorKind::Config);
        assert_eq!(
            e.context_value("key"),
            Some("secondary_tiers[1].backpresure")
        );
        let s = e.to_string();
        assert!(
            s.contains("secondary_tiers[1].backpresure: unknown key"),
            "{s}"
        );
        assert!(s.contains("did_you_mean: backpressure"), "{s}");
    }

    #[test]
    fn enospc_maps_to_no_space_and_duplicate_keeps_kind() {
        let e = Error::io(
            "fallocate",
            Path::new("/tmp/x"),
            io::Error::from_raw_os_error(libc::ENOSPC),
        );
        assert_eq!(e.kind(), ErrorKind::NoSpace);
        let d = e.duplicate();
        assert_eq!(d.kind(), ErrorKind::NoSpace);
        assert_eq!(d.to_string(), e.to_string());
    }
}
