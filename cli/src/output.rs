//! Output helpers shared by the commands: aligned text tables, `--json` printing, and progress
//! bars that only appear when stderr is a terminal.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use kvtier::error::{Error, ErrorKind, Result};

/// A plain text table: a header row and data rows, columns padded to their widest cell.
/// The first column is left-aligned, the others right-aligned (they hold numbers).
#[derive(Debug, Default)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column titles.
    pub fn new<S: Into<String>>(header: impl IntoIterator<Item = S>) -> Self {
        Table {
            header: header.into_iter().map(Into::into).collect(),
            rows: Vec::new(),
        }
    }

    /// Appends a row (missing cells print empty, extra cells are kept).
    pub fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) {
        self.rows.push(cells.into_iter().map(Into::into).collect());
    }

    /// The table as text, one line per row, each line ending in a newline.
    pub fn render(&self) -> String {
        let columns = self
            .rows
            .iter()
            .map(Vec::len)
            .chain([self.header.len()])
            .max()
            .unwrap_or(0);
        let mut widths = vec![0usize; columns];
        for line in std::iter::once(&self.header).chain(&self.rows) {
            for (i, cell) in line.iter().enumerate() {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
        let mut out = String::new();
        let mut push_line = |cells: &[String]| {
            let mut line = String::new();
            for (i, width) in widths.iter().enumerate() {
                let cell = cells.get(i).map(String::as_str).unwrap_or("");
                if i > 0 {
                    line.push_str("  ");
                }
                if i == 0 {
                    line.push_str(&format!("{cell:<width$}"));
                } else {
                    line.push_str(&format!("{cell:>width$}"));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        };
        push_line(&self.header);
        let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
        push_line(&rule);
        for row in &self.rows {
            push_line(row);
        }
        out
    }
}

/// `print!` for the commands: writes to stdout and returns an error instead of panicking when
/// stdout cannot take it (`kvtier version > /dev/full`: an I/O error, exit 1). A pipe closed
/// by its reader still ends a command through `SIGPIPE` ([`crate::sigpipe`]).
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::output::write_stdout(format_args!($($arg)*))
    };
}

/// `println!` for the commands, returning an error like [`out!`].
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::output::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `eprintln!` for the commands: a stderr that cannot be written (closed, full) loses the
/// line instead of panicking (there is nowhere else to say it).
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::output::write_stderr(format_args!("{}\n", format_args!($($arg)*)))
    };
}

pub(crate) use {errln, out, outln};

/// Writes to stderr, ignoring a failure (see [`errln!`]).
pub fn write_stderr(text: std::fmt::Arguments<'_>) {
    let _ = std::io::stderr().lock().write_fmt(text);
}

/// Writes to stdout and flushes; a failure (a full disk, a closed descriptor) is an
/// [`ErrorKind::Io`] error that says so.
pub fn write_stdout(text: std::fmt::Arguments<'_>) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_fmt(text)
        .and_then(|()| stdout.flush())
        .map_err(stdout_error)
}

/// The error for a failed write to stdout.
pub fn stdout_error(e: std::io::Error) -> Error {
    Error::new(ErrorKind::Io, format!("cannot write to stdout: {e}")).with_source(e)
}

/// Prints `value` as pretty JSON on stdout.
pub fn print_json<T: Serialize + ?Sized>(value: &T) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| {
        Error::new(
            ErrorKind::Internal,
            format!("cannot encode JSON output: {e}"),
        )
    })?;
    outln!("{text}")?;
    Ok(())
}

/// Paths for people: `a, b, c`.
pub fn display_paths(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A progress bar of `len` steps on stderr when stderr is a terminal and `enabled`; otherwise a
/// hidden bar that costs nothing (so piped output and `--json` stay clean).
pub fn progress_bar(len: u64, message: &str, enabled: bool) -> ProgressBar {
    if !enabled || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    if let Ok(style) =
        ProgressStyle::with_template("{msg:>12} [{bar:40}] {pos}/{len} ({elapsed}, eta {eta})")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(message.to_string());
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_aligns_columns() {
        let mut t = Table::new(["profile", "kvtier", "fio"]);
        t.row(["store", "1.00 GB/s", "1.10 GB/s"]);
        t.row(["load-long-name", "12.00 GB/s", "9 GB/s"]);
        let text = t.render();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4);
        assert_eq!(lines[0], "profile             kvtier        fio");
        assert!(lines[1].starts_with("--------------  ----------"));
        assert_eq!(lines[2], "store            1.00 GB/s  1.10 GB/s");
        assert_eq!(lines[3], "load-long-name  12.00 GB/s     9 GB/s");
    }

    #[test]
    fn hidden_bar_when_disabled() {
        assert!(progress_bar(10, "x", false).is_hidden());
    }
}
