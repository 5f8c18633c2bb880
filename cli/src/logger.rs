//! A minimal stderr logger for the `kvtier` binary, so the library's one-time warnings
//! (fallbacks, recovered journals, config notes) reach the user: `kvtier: warning: ...`.
//! The level comes from `KVTIER_LOG` (`error`, `warn` (default), `info`, `debug`, `trace`,
//! `off`).

use crate::output::errln;
use log::{Level, LevelFilter, Log, Metadata, Record};

struct StderrLogger;

impl Log for StderrLogger {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let level = match record.level() {
            Level::Error => "error",
            Level::Warn => "warning",
            Level::Info => "info",
            Level::Debug => "debug",
            Level::Trace => "trace",
        };
        errln!("kvtier: {level}: {}", record.args());
    }

    fn flush(&self) {}
}

static LOGGER: StderrLogger = StderrLogger;

/// The level named by `KVTIER_LOG` (`warn` when unset or empty), or `None` for a value that
/// names no level.
pub fn level_from_env(value: Option<&str>) -> Option<LevelFilter> {
    match value.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        None | Some("") | Some("warn") | Some("warning") => Some(LevelFilter::Warn),
        Some("off") => Some(LevelFilter::Off),
        Some("error") => Some(LevelFilter::Error),
        Some("info") => Some(LevelFilter::Info),
        Some("debug") => Some(LevelFilter::Debug),
        Some("trace") => Some(LevelFilter::Trace),
        Some(_) => None,
    }
}

/// Installs the logger (once; later calls do nothing). A `KVTIER_LOG` that names no level is
/// said in a warning, and the level stays `warn`.
pub fn init() {
    let value = std::env::var_os("KVTIER_LOG").map(|v| v.to_string_lossy().into_owned());
    let level = level_from_env(value.as_deref());
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(level.unwrap_or(LevelFilter::Warn));
        if level.is_none() {
            log::warn!(
                "KVTIER_LOG={:?} is not a level (off, error, warn, info, debug, trace); using warn",
                value.unwrap_or_default()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels() {
        assert_eq!(level_from_env(None), Some(LevelFilter::Warn));
        assert_eq!(level_from_env(Some("DEBUG")), Some(LevelFilter::Debug));
        assert_eq!(level_from_env(Some("off")), Some(LevelFilter::Off));
        assert_eq!(level_from_env(Some("nonsense")), None);
    }
}
