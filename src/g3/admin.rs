//! Offline administration of a G3 stripe set, for the `kvtier` CLI: format, inspect, verify,
//! list keys, clear. `inspect` and `list_keys` only read (and work while a tier runs);
//! `format`, `verify` and `clear` take the slab locks and refuse to run beside a live tier.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use rustix::fs::OFlags;
use serde::Serialize;

use crate::error::{Error, ErrorKind, Result};
use crate::g3::aligned::AlignedBuf;
use crate::g3::checkpoint::remove_index_files;
use crate::g3::config::DirectIoMode;
use crate::g3::format::{Superblock, slot_location};
use crate::g3::fs_record::FsGuard;
use crate::g3::index_dir::{IndexDir, JOURNAL_FILE_NAME, open_regular};
use crate::g3::record::chunk_crc;
use crate::g3::recovery::{self, Recovered};
use crate::g3::slab::{
    self, SLAB_FILE_NAME, SlabSpec, check_dirs, fs_type_of, lock_holder_of, open_locked,
    read_superblock,
};

/// What `format` creates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FormatOptions {
    /// Bytes per slot (the primary's row stride, a multiple of 4096).
    pub row_stride: u64,
    /// Total capacity over all paths.
    pub capacity_bytes: u64,
    /// Namespace digest (see [`crate::g3::geometry_namespace`]).
    pub namespace: [u8; 32],
    /// O_DIRECT policy used for the probe.
    pub direct_io: DirectIoMode,
    /// Format even where a path is on another filesystem than the tier recorded there (a
    /// replaced disk). Without it such a path is refused before anything is removed, as a
    /// tier's open refuses it (its filesystem may only be unmounted).
    pub new_filesystem: bool,
}

/// One slab file, as reported by [`inspect`].
#[derive(Debug, Clone, Serialize)]
pub struct SlabFileReport {
    /// Slab file path.
    pub path: PathBuf,
    /// Its superblock.
    pub superblock: Superblock,
    /// File size in bytes.
    pub file_bytes: u64,
    /// Filesystem type.
    pub fs_type: String,
    /// Pid of the process holding the slab's lock, if any.
    pub locked_by: Option<u32>,
    /// What is wrong with the file, if anything (a truncated slab: the slots past its end
    /// cannot be read).
    pub problem: Option<String>,
}

/// A stripe set and its index, as reported by [`inspect`] and [`format`](fn@format).
#[derive(Debug, Clone, Serialize)]
pub struct SlabReport {
    /// Files in stripe order.
    pub files: Vec<SlabFileReport>,
    /// Committed index entries.
    pub entries: usize,
    /// Slots over all files.
    pub total_slots: u64,
    /// Slots holding nothing.
    pub free_slots: usize,
    /// Checkpoint sequence number.
    pub checkpoint_seq: u64,
    /// Journal size in bytes (0 when absent).
    pub journal_bytes: u64,
    /// Index records applied when reading the index.
    pub index_records: u64,
    /// Damage found while reading the index.
    pub warnings: Vec<String>,
    /// Seconds it took to read the index.
    pub recovery_seconds: f64,
}

/// One index entry, as listed by [`list_keys`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeyEntry {
    /// Key, lower-case hex.
    pub key: String,
    /// Slot.
    pub slot: u32,
    /// CRC32 of the slot's bytes.
    pub crc: u32,
    /// Generation of the insert.
    pub generation: u64,
}

/// Why a slot failed verification.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BadKind {
    /// The bytes were read and do not match their CRC.
    CrcMismatch,
    /// The bytes could not be read (an I/O error, or the slot lies past the end of a
    /// truncated slab): nothing is known about them.
    ReadError,
}

/// A key whose slot failed verification.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BadKey {
    /// Key, lower-case hex.
    pub key: String,
    /// Slot.
    pub slot: u32,
    /// CRC mismatch or read error.
    pub kind: BadKind,
    /// CRC recorded in the index.
    pub expected_crc: u32,
    /// CRC of the bytes read, when the read worked.
    pub found_crc: Option<u32>,
    /// Read error, when it failed.
    pub error: Option<String>,
}

/// The outcome of [`verify`].
#[derive(Debug, Clone, Default, Serialize)]
pub struct VerifyReport {
    /// Entries checked.
    pub checked: u64,
    /// Entries whose bytes match their CRC.
    pub ok: u64,
    /// Entries that failed (both kinds).
    pub bad: Vec<BadKey>,
    /// Entries whose bytes did not match their CRC.
    pub crc_failures: u64,
    /// Entries whose bytes could not be read.
    pub read_errors: u64,
}

struct OpenSet {
    files: Vec<(PathBuf, File, Superblock)>,
    /// Per file: what is wrong with it (reported, not refused; see [`open_existing`]).
    problems: Vec<Option<String>>,
}

impl OpenSet {
    fn meta_dir(&self) -> &Path {
        self.files[0].0.parent().unwrap_or(Path::new("."))
    }
    fn sb(&self) -> &Superblock {
        &self.files[0].2
    }
    fn index_dir(&self) -> Result<IndexDir> {
        IndexDir::open(self.meta_dir())
    }
    fn recover(&self) -> Result<Recovered> {
        let sb = self.sb();
        let total = u32::try_from(sb.total_slots)
            .map_err(|_| Error::new(ErrorKind::Corrupt, "superblock names more than 2^32 slots"))?;
        recovery::recover(&self.index_dir()?, sb.set_uuid, total, self.files.len())
    }
}

/// How [`open_existing`] opens the slabs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    /// Read-only, no lock (works beside a live tier).
    Read,
    /// Read-only under the tier's exclusive lock (refused beside a live tier; works on a
    /// read-only filesystem).
    ReadLocked,
    /// Read-write under the exclusive lock.
    WriteLocked,
}

/// Opens every slab of `paths` and checks that they form one set, listed in its order, with a
/// consistent geometry (before anything is sized from the superblock).
fn open_existing(paths: &[PathBuf], access: Access) -> Result<OpenSet> {
    let dirs = check_dirs(paths)?;
    let present = slab::slabs_present(&dirs)?;
    if present.iter().all(|&p| !p) {
        return Err(no_tier_in(&paths[0]));
    }
    if present.iter().any(|&p| !p) {
        return Err(slab::incomplete_set(&dirs, &present));
    }
    let mut files = Vec::with_capacity(dirs.len());
    let mut problems = Vec::with_capacity(dirs.len());
    let mut truncated: Option<Error> = None;
    let mut held_bytes = 0u64;
    for d in &dirs {
        let p = d.join(SLAB_FILE_NAME);
        let f = match access {
            Access::WriteLocked => open_locked(&p, false)?,
            Access::ReadLocked => slab::open_locked_read_only(&p)?,
            Access::Read => open_regular(&p, OFlags::RDONLY)?.ok_or_else(|| no_tier_in(d))?,
        };
        let sb = read_superblock(&f, &p)?;
        let len = f.metadata().map_err(|e| Error::io("stat", &p, e))?.len();
        let problem = match slab::check_geometry(&sb, len, &p) {
            Ok(()) => None,
            // A truncated slab is what the read-only commands are for: `inspect` reports it,
            // `verify` reports the slots past its end as read errors.
            Err(e) if access != Access::WriteLocked && is_truncation(&e, len) => {
                let problem = format!(
                    "truncated: {len} bytes, its superblock needs {}; the slots past its end \
                     cannot be read",
                    e.context_value("expected").unwrap_or("more")
                );
                truncated.get_or_insert(e);
                Some(problem)
            }
            Err(e) => return Err(e),
        };
        held_bytes = held_bytes.saturating_add(len);
        files.push((p, f, sb));
        problems.push(problem);
    }
    // Nothing is sized from a superblock its files cannot back: a truncated set is reported
    // only while its files hold at least the index's 64 bytes per slot the superblock names
    // (a forged or garbled superblock naming billions of slots stays an error).
    if let Some(e) = truncated
        && files
            .first()
            .is_none_or(|(_, _, sb)| sb.total_slots.saturating_mul(64) > held_bytes)
    {
        return Err(e);
    }
    let sbs: Vec<Superblock> = files.iter().map(|(_, _, sb)| sb.clone()).collect();
    slab::check_members(&dirs, &sbs)?;
    Ok(OpenSet { files, problems })
}

/// Whether `e` (from [`slab::check_geometry`]) says the file of `len` bytes is shorter than
/// its superblock needs.
fn is_truncation(e: &Error, len: u64) -> bool {
    e.context_value("expected")
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|want| len < want)
}

/// A folder without a slab is not a tier: say so, and how to make one, rather than a bare
/// "open .../kvtier-g3.slab: No such file or directory".
fn no_tier_in(dir: &Path) -> Error {
    Error::new(
        ErrorKind::InvalidPath,
        format!(
            "{} holds no G3 tier (no {SLAB_FILE_NAME}); create one with `kvtier tier format {} \
             --capacity SIZE`",
            dir.display(),
            dir.display()
        ),
    )
    .with("path", dir.display().to_string())
}

/// Discards whatever `paths` hold and creates a fresh, empty stripe set.
///
/// Everything that can be known before anything is removed is checked first: every directory
/// takes files, no live tier holds a slab, and the new slabs fit in the space available plus
/// what the old ones free. The directories' locks (`slab::lock_dirs`) are held from the first
/// removal to the last write, so two formats of one directory never interleave: the second
/// is refused, naming the first one's pid.
pub fn format(paths: &[PathBuf], opts: &FormatOptions) -> Result<SlabReport> {
    // Refuse a directory that takes no files before anything is removed or created.
    let dirs = slab::check_writable_dirs(paths)?;
    let _locks = slab::lock_dirs(&dirs)?;
    let guard = FsGuard::load(&dirs)?;
    if !opts.new_filesystem {
        slab::check_filesystems(&dirs, &guard)?;
    }
    let slots = slab::slots_in_file(opts.capacity_bytes, dirs.len(), opts.row_stride)?;
    let old = slab::lock_slabs(&dirs)?;
    slab::check_format_space(&dirs, &old, slots, opts.row_stride)?;
    slab::remove_locked(old)?;
    let index_dir = IndexDir::open(&dirs[0])?;
    remove_index_files(&index_dir)?;
    let spec = SlabSpec {
        row_stride: opts.row_stride,
        capacity_bytes: opts.capacity_bytes,
        namespace: opts.namespace,
        direct_io: opts.direct_io,
    };
    let set = slab::open_set_recorded(&dirs, &spec, &guard)?;
    let total = u32::try_from(set.total_slots())
        .map_err(|_| Error::new(ErrorKind::Config, "more than 2^32 - 1 slots"))?;
    let rec = recovery::recover(&index_dir, set.set_uuid(), total, set.files.len())?;
    recovery::open_journal(&index_dir, set.set_uuid(), &rec)?;
    drop(set);
    inspect(&dirs)
}

/// Reports the superblocks, lock holders and index summary. Read-only.
pub fn inspect(paths: &[PathBuf]) -> Result<SlabReport> {
    let set = open_existing(paths, Access::Read)?;
    let mut rec = set.recover()?;
    let index_dir = set.index_dir()?;
    let journal_bytes = index_dir
        .open_read(JOURNAL_FILE_NAME)?
        .and_then(|f| f.metadata().ok())
        .map_or(0, |m| m.len());
    for (name, len) in index_dir.damaged_copies()? {
        rec.warnings.push(format!(
            "{} ({len} bytes) is a damaged index file kept for inspection; the entries it \
             still held were recovered where readable. Remove it once inspected",
            index_dir.file_path(&name).display()
        ));
    }
    for ((p, _, _), problem) in set.files.iter().zip(&set.problems) {
        if let Some(problem) = problem {
            rec.warnings.push(format!("{} is {problem}", p.display()));
        }
    }
    let files = set
        .files
        .iter()
        .zip(&set.problems)
        .map(|((p, f, sb), problem)| SlabFileReport {
            path: p.clone(),
            superblock: sb.clone(),
            file_bytes: f.metadata().map(|m| m.len()).unwrap_or(0),
            fs_type: fs_type_of(p),
            locked_by: lock_holder_of(f),
            problem: problem.clone(),
        })
        .collect();
    Ok(SlabReport {
        files,
        entries: rec.index.len(),
        total_slots: set.sb().total_slots,
        free_slots: rec.index.free_slots(),
        checkpoint_seq: rec.checkpoint_seq,
        journal_bytes,
        index_records: rec.records,
        warnings: rec.warnings,
        recovery_seconds: rec.duration.as_secs_f64(),
    })
}

/// Every index entry, least recently used first. Read-only.
pub fn list_keys(paths: &[PathBuf]) -> Result<Vec<KeyEntry>> {
    let set = open_existing(paths, Access::Read)?;
    Ok(set
        .recover()?
        .index
        .entries_lru_first()
        .into_iter()
        .map(|e| KeyEntry {
            key: e.key.to_hex(),
            slot: e.slot,
            crc: e.crc,
            generation: e.generation,
        })
        .collect())
}

/// Reads every indexed slot and checks its CRC. Takes the slab locks.
pub fn verify(paths: &[PathBuf]) -> Result<VerifyReport> {
    verify_with_progress(paths, &mut |_, _| {})
}

/// [`verify`], calling `progress(checked, total)` after each stored chunk (for a progress bar;
/// `total` is known once the index is recovered).
pub fn verify_with_progress(
    paths: &[PathBuf],
    progress: &mut dyn FnMut(u64, u64),
) -> Result<VerifyReport> {
    let set = open_existing(paths, Access::ReadLocked)?;
    let rec = set.recover()?;
    let stride = set.sb().row_stride;
    let n = set.files.len();
    let readers = set
        .files
        .iter()
        .map(|(p, _, _)| {
            open_regular(p, OFlags::RDONLY | OFlags::DIRECT)
                .or_else(|_| open_regular(p, OFlags::RDONLY))?
                .ok_or_else(|| Error::io("open", p, std::io::ErrorKind::NotFound.into()))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut buf = AlignedBuf::new(stride as usize)?;
    let mut report = VerifyReport::default();
    let entries = rec.index.entries_lru_first();
    let total = entries.len() as u64;
    for e in entries {
        progress(report.checked, total);
        report.checked += 1;
        let (file, off) = slot_location(u64::from(e.slot), n, stride);
        match readers[file].read_exact_at(buf.as_mut_slice(), off) {
            Ok(()) => {
                let found = chunk_crc(e.key.as_bytes(), buf.as_slice());
                if found == e.crc {
                    report.ok += 1;
                } else {
                    report.crc_failures += 1;
                    report.bad.push(BadKey {
                        key: e.key.to_hex(),
                        slot: e.slot,
                        kind: BadKind::CrcMismatch,
                        expected_crc: e.crc,
                        found_crc: Some(found),
                        error: None,
                    });
                }
            }
            Err(err) => {
                report.read_errors += 1;
                let what = if err.kind() == std::io::ErrorKind::UnexpectedEof {
                    "past the end of the file".to_string()
                } else {
                    err.to_string()
                };
                report.bad.push(BadKey {
                    key: e.key.to_hex(),
                    slot: e.slot,
                    kind: BadKind::ReadError,
                    expected_crc: e.crc,
                    found_crc: None,
                    error: Some(format!(
                        "read {} at {off}: {what}",
                        set.files[file].0.display()
                    )),
                });
            }
        }
    }
    progress(report.checked, total);
    Ok(report)
}

/// What [`repair`] did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RepairReport {
    /// Slab files recreated (empty), in stripe order.
    pub recreated: Vec<PathBuf>,
    /// Index entries dropped because their slots were on a recreated member.
    pub dropped: usize,
    /// Index entries kept (on the members that were there).
    pub kept: usize,
}

/// Recreates the missing members of a stripe set, empty, with the set's geometry and uuid,
/// keeping every chunk stored on the members that are there. First the entries whose slots
/// were on a missing member are dropped from the index (a fresh checkpoint generation without
/// them is written), so that nothing names the recreated slots. Takes the slab locks.
///
/// Use it when a slab is gone for good; when its filesystem is only not mounted, mount it
/// instead (a recreated member would hide the old one).
pub fn repair(paths: &[PathBuf]) -> Result<RepairReport> {
    let dirs = slab::check_writable_dirs(paths)?;
    let _locks = slab::lock_dirs(&dirs)?;
    // A member missing because its filesystem is not mounted is never recreated on the
    // filesystem below.
    let guard = FsGuard::load(&dirs)?;
    slab::check_filesystems(&dirs, &guard)?;
    let slabs: Vec<PathBuf> = dirs.iter().map(|d| d.join(SLAB_FILE_NAME)).collect();
    let present = slab::slabs_present(&dirs)?;
    if present.iter().all(|&p| !p) {
        return Err(no_tier_in(&paths[0]));
    }
    let n = dirs.len();
    let mut held = Vec::new();
    let mut template: Option<Superblock> = None;
    for (i, p) in slabs.iter().enumerate().filter(|(i, _)| present[*i]) {
        let f = open_locked(p, false)?;
        let sb = read_superblock(&f, p)?;
        let len = f.metadata().map_err(|e| Error::io("stat", p, e))?.len();
        slab::check_geometry(&sb, len, p)?;
        if sb.path_count as usize != n || sb.path_index as usize != i {
            return Err(Error::new(
                ErrorKind::IncompatibleLayout,
                format!(
                    "{} is member {} of a stripe set of {} files, but is listed at position {i} \
                     of {n}: list the set's directories in the order it was formatted with \
                     before repairing it",
                    p.display(),
                    sb.path_index,
                    sb.path_count
                ),
            ));
        }
        if let Some(t) = &template
            && t.set_uuid != sb.set_uuid
        {
            return Err(Error::new(
                ErrorKind::IncompatibleLayout,
                format!("{} belongs to another stripe set", p.display()),
            )
            .with("expected", hex::encode(t.set_uuid))
            .with("found", hex::encode(sb.set_uuid)));
        }
        template.get_or_insert(sb);
        held.push(f);
    }
    let Some(template) = template else {
        return Err(no_tier_in(&paths[0]));
    };
    let missing: Vec<usize> = (0..n).filter(|&i| !present[i]).collect();
    let mut report = RepairReport::default();
    if missing.is_empty() {
        return Ok(report);
    }
    let total = u32::try_from(template.total_slots)
        .map_err(|_| Error::new(ErrorKind::Corrupt, "superblock names more than 2^32 slots"))?;
    let index_dir = IndexDir::open(&dirs[0])?;
    let mut rec = recovery::recover(&index_dir, template.set_uuid, total, n)?;
    for e in rec.index.entries_lru_first() {
        if missing.contains(&(e.slot as usize % n)) {
            rec.index.apply_remove(e.slot);
            report.dropped += 1;
        }
    }
    report.kept = rec.index.len();
    // The index no longer names the missing members' slots before they exist again.
    rec.append_at = None;
    recovery::open_journal(&index_dir, template.set_uuid, &rec)?;
    let mut made = Vec::new();
    for &i in &missing {
        let sb = Superblock {
            path_index: i as u32,
            created_unix_s: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            ..template.clone()
        };
        held.push(slab::create_member(&slabs[i], &sb, &mut made)?);
        report.recreated.push(slabs[i].clone());
    }
    guard.record(template.set_uuid);
    log::warn!(
        "repaired G3 stripe set {}: recreated {} empty; dropped {} entries that lived there, \
         kept {}",
        hex::encode(template.set_uuid),
        display_list(&report.recreated),
        report.dropped,
        report.kept
    );
    Ok(report)
}

fn display_list(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Forgets every entry (the slabs stay, their slots become free). Takes the slab locks.
pub fn clear(paths: &[PathBuf]) -> Result<()> {
    let set = open_existing(paths, Access::WriteLocked)?;
    let index_dir = set.index_dir()?;
    remove_index_files(&index_dir)?;
    let rec = set.recover()?;
    recovery::open_journal(&index_dir, set.sb().set_uuid, &rec)?;
    Ok(())
}
