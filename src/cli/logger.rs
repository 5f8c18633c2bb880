//! A minimal stderr logger for the `kvtier` binary, so the library's one-time warnings
//! (fallbacks, recovered journals, config notes) reach the user: `kvtier: warning: ...`.
//! The level comes from `KVTIER_LOG` (`error`, `warn` (default), `info`, `debug`, `trace`,
//! `off`).

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
        eprintln!("kvtier: {level}: {}", record.args());
    }

    fn flush(&self) {}
}

static LOGGER: StderrLogger = StderrLogger;

/// The level named by `KVTIER_LOG`, or `warn`.
pub fn level_from_env(value: Option<&str>) -> LevelFilter {
    match value.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        Some("off") => LevelFilter::Off,
        Some("error") => LevelFilter::Error,
        Some("info") => LevelFilter::Info,
        Some("debug") => LevelFilter::Debug,
        Some("trace") => LevelFilter::Trace,
        _ => LevelFilter::Warn,
    }
}

/// Installs the logger (once; later calls do nothing).
pub fn init() {
    let level = level_from_env(std::env::var("KVTIER_LOG").ok().as_deref());
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(level);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels() {
        assert_eq!(level_from_env(None), LevelFilter::Warn);
        assert_eq!(level_from_env(Some("DEBUG")), LevelFilter::Debug);
        assert_eq!(level_from_env(Some("off")), LevelFilter::Off);
        assert_eq!(level_from_env(Some("nonsense")), LevelFilter::Warn);
    }
}
