//! `kvtier tier ...`: offline administration of a G3 tier (a stripe set of slab files, one per
//! path, in the order the tier lists them): format, inspect, verify, ls, clear, repair.

use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde::Serialize;

use crate::args::RowArgs;
use crate::args::name_flag;
use crate::output::{
    Table, display_paths, errln, out, outln, print_json, progress_bar, stdout_error,
};
use crate::size::{format_size, parse_size};
use kvtier::canonical::NamespaceParams;
use kvtier::embed::PoolOpener;
use kvtier::error::{Error, ErrorKind, Result};
use kvtier::g3::CHECKPOINT_FILE_NAME;
use kvtier::g3::SLAB_FILE_NAME;
use kvtier::g3::admin::{self, BadKind, FormatOptions, SlabReport};
use kvtier::g3::{DirectIoMode, G3TierConfig};
use kvtier::size::count;

/// `kvtier tier`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Paths are the tier's directories in the tier's order. Examples:
  kvtier tier format /mnt/nvme0 /mnt/nvme1 --capacity 1TiB
  kvtier tier inspect /mnt/nvme0 /mnt/nvme1
  kvtier tier verify /mnt/nvme0 /mnt/nvme1
  kvtier tier ls /mnt/nvme0 /mnt/nvme1 | wc -l
  kvtier tier clear /mnt/nvme0 /mnt/nvme1 --yes
  kvtier tier repair /mnt/nvme0 /mnt/nvme1"
)]
pub struct TierArgs {
    /// What to do.
    #[command(subcommand)]
    pub command: TierCommand,
}

/// The tier subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum TierCommand {
    /// Create an empty tier (discarding what the paths held).
    #[command(after_help = "Examples:
  kvtier tier format /mnt/nvme0 --capacity 512GiB
  kvtier tier format /mnt/nvme0 /mnt/nvme1 --layout layouts/qwen3-32b.toml --tp 2 --capacity 2T --yes
  kvtier tier format /mnt/nvme0 --layout qwen2.5-3b --tp 4 --canonical --capacity 1T   # vLLM engines, node service
  kvtier tier format /mnt/nvme0 --capacity 64GiB --for in-process                     # kvtier serve without a service section")]
    Format(FormatArgs),
    /// Show superblocks, geometry, namespace, used/free slots, journal and checkpoint.
    #[command(after_help = "Example:\n  kvtier tier inspect /mnt/nvme0 /mnt/nvme1 --json")]
    Inspect(PathsArgs),
    /// Read every stored slot and check its CRC; list bad keys; exit 1 if any.
    #[command(after_help = "Example:\n  kvtier tier verify /mnt/nvme0")]
    Verify(PathsArgs),
    /// List stored keys (hex), least recently used first.
    #[command(after_help = "Example:\n  kvtier tier ls /mnt/nvme0 | head")]
    Ls(PathsArgs),
    /// Forget every stored chunk (slabs stay allocated); asks unless --yes.
    #[command(after_help = "Example:\n  kvtier tier clear /mnt/nvme0 --yes")]
    Clear(ClearArgs),
    /// Recreate a slab that is gone for good (empty), keeping the chunks on the other paths.
    #[command(
        after_help = "Recreates the missing slab files of a stripe set with the set's \
geometry, after dropping from the index the entries that lived in them; the other paths keep \
their chunks. If a filesystem is only not mounted, mount it instead.

Example:\n  kvtier tier repair /mnt/nvme0 /mnt/nvme1"
    )]
    Repair(PathsArgs),
}

/// Paths of a tier, plus `--json`.
#[derive(Debug, clap::Args)]
pub struct PathsArgs {
    /// The tier's directories, in the tier's order.
    #[arg(required = true, value_name = "PATH")]
    pub paths: Vec<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// `kvtier tier clear`.
#[derive(Debug, clap::Args)]
pub struct ClearArgs {
    /// The tier's directories, in the tier's order.
    #[arg(required = true, value_name = "PATH")]
    pub paths: Vec<PathBuf>,
    /// Do not ask.
    #[arg(long, short = 'y')]
    pub yes: bool,
}

/// `kvtier tier format`.
#[derive(Debug, clap::Args)]
pub struct FormatArgs {
    /// Directories, one slab file each (rows are striped across them in this order).
    #[arg(required = true, value_name = "PATH")]
    pub paths: Vec<PathBuf>,
    /// Capacity over all paths (split evenly, rounded down to whole slots).
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub capacity: u64,
    /// The rows the tier is sized for: model layout, TP size, blocks per chunk.
    #[command(flatten)]
    pub row: RowArgs,
    /// Rows hold the canonical layout (`canonical_layout = true` in the config that will use
    /// the tier; `kvtier bench` tiers are canonical). Default: the direct layout, the config
    /// default. The two have different namespace digests, so this must match the config.
    #[arg(long)]
    pub canonical: bool,
    /// Who opens the tier, which decides its namespace digest: `vllm` (vLLM engines through
    /// `kvtier.vllm.KvtierTier` with the tier entry's `layout` key, in process or in client
    /// mode, and the node service, `kvtier serve` with a `service` section) or `in-process`
    /// (kvtier's own in-process tiers: `kvtier serve` without a `service` section and the
    /// Rust `Builder::layout`).
    #[arg(long = "for", value_enum, default_value_t = FormatFor::Vllm, value_name = "WHO")]
    pub for_: FormatFor,
    /// O_DIRECT policy: required (a path without it is an error) or auto.
    #[arg(long, default_value = "required", value_parser = parse_direct_io, value_name = "MODE")]
    pub direct_io: DirectIoMode,
    /// Do not ask before discarding an existing tier.
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// Format even where a path is on another filesystem than the tier kvtier recorded there
    /// (a replaced disk). Without it such a path is refused: its filesystem may only be
    /// unmounted, and a format would put the tier on the disk below.
    #[arg(long)]
    pub new_filesystem: bool,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// `kvtier tier format --for`: who opens the tier (its namespace digest), as the flag spells
/// the library's [`PoolOpener`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FormatFor {
    /// vLLM engines (with the entry's `layout` key) and the node service:
    /// [`PoolOpener::VllmEngines`].
    Vllm,
    /// kvtier's in-process tiers: [`PoolOpener::InProcess`].
    InProcess,
}

impl FormatFor {
    /// The `--for` value as typed.
    pub fn as_str(self) -> &'static str {
        match self {
            FormatFor::Vllm => "vllm",
            FormatFor::InProcess => "in-process",
        }
    }

    /// The opener this `--for` value names.
    pub fn opener(self) -> PoolOpener {
        match self {
            FormatFor::Vllm => PoolOpener::VllmEngines,
            FormatFor::InProcess => PoolOpener::InProcess,
        }
    }

    /// The `--for` value that names `opener`.
    pub fn of(opener: PoolOpener) -> Self {
        match opener {
            PoolOpener::VllmEngines => FormatFor::Vllm,
            PoolOpener::InProcess => FormatFor::InProcess,
        }
    }

    /// Who opens a tier formatted for this opener, with its `--for` flag, as messages say.
    pub fn openers(self) -> &'static str {
        match self {
            FormatFor::Vllm => "vLLM engines and the node service (--for vllm)",
            FormatFor::InProcess => "kvtier's in-process tiers (--for in-process)",
        }
    }
}

/// The `kvtier tier format` command line that formats the `nvme` tiers of `cfg` so that a
/// tier opener for (`for_`) the model of `layout` (`--layout` as the user gave it; `None`: the
/// default layout) at TP `tp` with `blocks_per_chunk` finds its namespace: one command per
/// tier, joined by `; `, each with the tier's paths, capacity and O_DIRECT policy.
pub fn format_command(
    cfg: &kvtier::config::KvtierConfig,
    layout: Option<&Path>,
    tp: u32,
    blocks_per_chunk: u32,
    for_: FormatFor,
) -> String {
    let commands: Vec<String> = cfg
        .secondary_tiers
        .iter()
        .filter(|t| kvtier::embed::is_nvme(&t.tier_type))
        .filter_map(|t| G3TierConfig::from_tier(t).ok())
        .map(|g3| {
            let mut words = vec!["kvtier".to_string(), "tier".into(), "format".into()];
            words.extend(
                g3.paths
                    .iter()
                    .map(|p| shell_word(&p.display().to_string())),
            );
            words.push(format!("--capacity {}", g3.capacity_bytes));
            if let Some(l) = layout {
                words.push(format!("--layout {}", shell_word(&l.display().to_string())));
            }
            words.push(format!("--tp {tp} --blocks-per-chunk {blocks_per_chunk}"));
            if cfg.canonical_layout {
                words.push("--canonical".into());
            }
            if g3.direct_io == DirectIoMode::Auto {
                words.push("--direct-io auto".into());
            }
            words.push(format!("--for {}", for_.as_str()));
            words.join(" ")
        })
        .collect();
    commands.join("; ")
}

/// `s` as one shell word (single-quoted unless it is plain).
fn shell_word(s: &str) -> String {
    let plain = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-+:=@%,".contains(&b));
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

fn parse_direct_io(s: &str) -> std::result::Result<DirectIoMode, String> {
    match s {
        "required" => Ok(DirectIoMode::Required),
        "auto" => Ok(DirectIoMode::Auto),
        _ => Err(format!(
            "unknown direct-I/O mode {s:?} (use required or auto)"
        )),
    }
}

/// Runs `kvtier tier ...`.
pub fn run(args: TierArgs) -> Result<ExitCode> {
    match args.command {
        TierCommand::Format(a) => format(a),
        TierCommand::Inspect(a) => inspect(a),
        TierCommand::Verify(a) => verify(a),
        TierCommand::Ls(a) => ls(a),
        TierCommand::Clear(a) => clear(a),
        TierCommand::Repair(a) => repair(a),
    }
}

fn format(a: FormatArgs) -> Result<ExitCode> {
    let layout = a.row.model.load()?;
    let params = NamespaceParams::new(&layout, a.row.model.tp, a.row.blocks_per_chunk, a.canonical)
        .map_err(|e| name_flag(e, "blocks_per_chunk", "--blocks-per-chunk"))?;
    // The nvme tier's own capacity rule, for the row this format is for.
    G3TierConfig::new(a.paths.clone(), a.capacity)
        .validate("", Some(params.slot_bytes))
        .map_err(|e| name_flag(e, "capacity_bytes", "--capacity"))?;
    let existing: Vec<PathBuf> = a
        .paths
        .iter()
        .map(|p| p.join(SLAB_FILE_NAME))
        .filter(|p| p.exists())
        .collect();
    if !existing.is_empty() && !a.yes {
        let list: Vec<String> = existing.iter().map(|p| p.display().to_string()).collect();
        confirm(&format!(
            "{} already {} a tier; formatting discards every stored chunk",
            list.join(", "),
            if list.len() == 1 { "holds" } else { "hold" }
        ))?;
    }
    let report = admin::format(
        &a.paths,
        &FormatOptions {
            // Slots of what the tier will store: the canonical area or the whole row.
            row_stride: params.slot_bytes,
            capacity_bytes: a.capacity,
            namespace: a.for_.opener().namespace(&layout, &params)?,
            direct_io: a.direct_io,
            new_filesystem: a.new_filesystem,
        },
    )?;
    if !a.json {
        outln!(
            "formatted {} for {} (TP {}, {} per chunk, {} layout), namespace for {}",
            count(a.paths.len() as u64, "path"),
            layout.model_name,
            a.row.model.tp,
            count(u64::from(a.row.blocks_per_chunk), "block"),
            if a.canonical { "canonical" } else { "direct" },
            a.for_.openers()
        )?;
        return print_inspect(&InspectOutput::new(&report, &a.paths), false);
    }
    print_json(&FormatOutput {
        inspect: InspectOutput::new(&report, &a.paths),
        namespace_for: a.for_,
    })?;
    Ok(ExitCode::SUCCESS)
}

/// `format --json`: the tier as `inspect --json` shows it, and who its namespace is for.
#[derive(Debug, Serialize)]
pub struct FormatOutput<'a> {
    /// What `inspect --json` prints.
    #[serde(flatten)]
    pub inspect: InspectOutput<'a>,
    /// The `--for` value (`vllm` or `in-process`).
    pub namespace_for: FormatFor,
}

/// `inspect --json` (and `format --json`): the admin report plus the checkpoint size.
#[derive(Debug, Serialize)]
pub struct InspectOutput<'a> {
    /// Superblocks, slots, index.
    #[serde(flatten)]
    pub report: &'a SlabReport,
    /// Checkpoint file size in bytes (0 when absent).
    pub checkpoint_bytes: u64,
    /// Slots holding a chunk.
    pub used_slots: u64,
    /// What GPUDirect Storage would do for these slabs on this machine.
    pub gds: kvtier::g3::gds::GdsStatus,
}

impl<'a> InspectOutput<'a> {
    fn new(report: &'a SlabReport, paths: &[PathBuf]) -> Self {
        let checkpoint_bytes = paths
            .first()
            .and_then(|p| std::fs::metadata(p.join(CHECKPOINT_FILE_NAME)).ok())
            .map_or(0, |m| m.len());
        InspectOutput {
            report,
            checkpoint_bytes,
            used_slots: report.total_slots.saturating_sub(report.free_slots as u64),
            gds: kvtier::g3::gds::probe_status(paths),
        }
    }
}

fn inspect(a: PathsArgs) -> Result<ExitCode> {
    let report = admin::inspect(&a.paths)?;
    print_inspect(&InspectOutput::new(&report, &a.paths), a.json)
}

/// What `inspect` prints (and `format` after its first line).
fn print_inspect(out: &InspectOutput<'_>, json: bool) -> Result<ExitCode> {
    if json {
        print_json(out)?;
    } else {
        out!("{}", render_inspect(out))?;
    }
    Ok(ExitCode::SUCCESS)
}

fn render_inspect(o: &InspectOutput<'_>) -> String {
    let r = o.report;
    let mut s = String::new();
    if let Some(first) = r.files.first() {
        let sb = &first.superblock;
        s.push_str(&format!(
            "stripe set {} ({}), format v{}, created {}\n",
            hex::encode(sb.set_uuid),
            count(u64::from(sb.path_count), "path"),
            sb.version,
            utc_time(sb.created_unix_s)
        ));
        s.push_str(&format!(
            "row stride: {} ({} bytes)\nnamespace:  {}\n",
            format_size(sb.row_stride),
            sb.row_stride,
            hex::encode(sb.namespace)
        ));
    }
    s.push_str(&format!(
        "slots:      {} total, {} used ({} entries), {} free\n",
        r.total_slots, o.used_slots, r.entries, r.free_slots
    ));
    s.push_str(&format!("gds:        {}\n", o.gds));
    s.push_str(&format!(
        "index:      checkpoint #{} ({}), journal {}, {} records read in {:.3} s\n\n",
        r.checkpoint_seq,
        format_size(o.checkpoint_bytes),
        format_size(r.journal_bytes),
        r.index_records,
        r.recovery_seconds
    ));
    let mut t = Table::new(["slab", "index", "slots", "size", "fs", "locked by", "state"]);
    for f in &r.files {
        t.row([
            f.path.display().to_string(),
            format!("{}/{}", f.superblock.path_index, f.superblock.path_count),
            f.superblock.slots_in_file.to_string(),
            format_size(f.file_bytes),
            f.fs_type.clone(),
            f.locked_by
                .map_or_else(|| "-".to_string(), |pid| format!("pid {pid}")),
            match &f.problem {
                None => "ok".to_string(),
                Some(p) if p.starts_with("truncated") => "TRUNCATED".to_string(),
                Some(_) => "DAMAGED".to_string(),
            },
        ]);
    }
    s.push_str(&t.render());
    for w in &r.warnings {
        s.push_str(&format!("warning: {w}\n"));
    }
    s
}

fn verify(a: PathsArgs) -> Result<ExitCode> {
    // Reading every stored chunk back takes a while on a large tier: a bar on a terminal.
    let bar = progress_bar(0, "verify", !a.json);
    let report = admin::verify_with_progress(&a.paths, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    });
    bar.finish_and_clear();
    let report = report?;
    if a.json {
        print_json(&report)?;
    } else {
        outln!(
            "checked {}: {} ok, {} bad ({} failed the CRC check, {} could not be read)",
            count(report.checked, "stored chunk"),
            report.ok,
            report.bad.len(),
            report.crc_failures,
            report.read_errors
        )?;
        if !report.bad.is_empty() {
            let mut t = Table::new(["key", "slot", "problem", "expected crc", "found"]);
            for b in &report.bad {
                t.row([
                    b.key.clone(),
                    b.slot.to_string(),
                    match b.kind {
                        BadKind::CrcMismatch => "crc mismatch".to_string(),
                        BadKind::ReadError => "read error".to_string(),
                    },
                    format!("{:08x}", b.expected_crc),
                    match (&b.found_crc, &b.error) {
                        (Some(c), _) => format!("{c:08x}"),
                        (None, Some(e)) => e.clone(),
                        (None, None) => "?".to_string(),
                    },
                ]);
            }
            out!("{}", t.render())?;
        }
    }
    if report.bad.is_empty() {
        return Ok(ExitCode::SUCCESS);
    }
    let checked = count(report.checked, "stored chunk");
    let mut parts = Vec::new();
    if report.crc_failures > 0 {
        parts.push(format!(
            "{} of {checked} failed {} CRC check",
            report.crc_failures,
            if report.crc_failures == 1 {
                "its"
            } else {
                "their"
            }
        ));
    }
    if report.read_errors > 0 {
        parts.push(format!(
            "{} of {checked} could not be read (I/O error or a truncated slab; see `kvtier \
             tier inspect`)",
            report.read_errors
        ));
    }
    errln!("kvtier: error: {}", parts.join("; "));
    Ok(ExitCode::from(1))
}

fn ls(a: PathsArgs) -> Result<ExitCode> {
    let keys = admin::list_keys(&a.paths)?;
    if a.json {
        print_json(&keys)?;
    } else {
        // Buffered: a tier lists millions of keys. A closed pipe (`| head`) ends the process
        // through SIGPIPE; any other failure to write is an error.
        let mut out = std::io::BufWriter::new(std::io::stdout().lock());
        for k in &keys {
            writeln!(out, "{}", k.key).map_err(stdout_error)?;
        }
        out.flush().map_err(stdout_error)?;
    }
    Ok(ExitCode::SUCCESS)
}

fn clear(a: ClearArgs) -> Result<ExitCode> {
    if !a.yes {
        let report = admin::inspect(&a.paths)?;
        confirm(&format!(
            "clearing forgets all {} in {}",
            count(report.entries as u64, "stored chunk"),
            display_paths(&a.paths)
        ))?;
    }
    admin::clear(&a.paths)?;
    outln!("cleared {}", display_paths(&a.paths))?;
    Ok(ExitCode::SUCCESS)
}

fn repair(a: PathsArgs) -> Result<ExitCode> {
    let report = admin::repair(&a.paths)?;
    if a.json {
        print_json(&report)?;
    } else if report.recreated.is_empty() {
        outln!(
            "the stripe set in {} is complete; nothing to repair",
            display_paths(&a.paths)
        )?;
    } else {
        let list: Vec<String> = report
            .recreated
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        outln!(
            "recreated {} (empty); dropped {} that lived there; kept {} on the other paths",
            list.join(", "),
            count(report.dropped as u64, "chunk"),
            count(report.kept as u64, "chunk")
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Asks on the terminal; refuses (a user error) when stdin is not a terminal.
fn confirm(what: &str) -> Result<()> {
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        return Err(Error::new(
            ErrorKind::Config,
            format!("{what}; not asking on a non-interactive input: pass --yes to go ahead"),
        ));
    }
    eprint!("{what}. Continue? [y/N] ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    stdin
        .lock()
        .read_line(&mut answer)
        .map_err(|e| Error::io("read the answer from", Path::new("stdin"), e))?;
    if matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes") {
        Ok(())
    } else {
        Err(Error::new(
            ErrorKind::Cancelled,
            "cancelled: nothing was changed",
        ))
    }
}

/// `YYYY-MM-DD HH:MM:SS UTC` for seconds since the Unix epoch.
fn utc_time(unix_s: u64) -> String {
    let days = (unix_s / 86_400) as i64;
    let rem = unix_s % 86_400;
    // Days to civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_dates() {
        assert_eq!(utc_time(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc_time(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc_time(1_795_942_749), "2026-11-29 08:59:09 UTC");
    }

    #[test]
    fn direct_io_modes() {
        assert_eq!(parse_direct_io("auto"), Ok(DirectIoMode::Auto));
        assert!(parse_direct_io("sometimes").is_err());
    }
}
