//! Slab files: one preallocated, exclusively locked file per path, holding a superblock and
//! `slots_in_file` slots of `row_stride` bytes.
//!
//! A stripe set is created only when none of its files exist; if all exist they are opened and
//! checked against the expected geometry; a partial set is refused (a file is never recreated
//! under an index that may still name its slots). Reformatting is [`remove_set`] followed by a
//! fresh open, and only the admin commands do that.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::ErrorKind as IoErrorKind;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, ErrorKind, Result};
use crate::g3::aligned::AlignedBuf;
use crate::g3::config::DirectIoMode;
pub use crate::g3::dirs::sync_dir;
use crate::g3::dirs::{check_writable_dir, unwritable_reason};
use crate::g3::format::{
    MISMATCH_CAPACITY, MISMATCH_ROW_STRIDE, MISMATCH_STRIPE, SLAB_FORMAT_VERSION, SUPERBLOCK_SIZE,
    Superblock, namespace_mismatch, random_uuid, read_at_most, slab_file_len,
};
use crate::g3::fs_record::FsGuard;
use crate::geometry::{ChunkGeometry, ROW_ALIGNMENT};
use crate::size::{count, format_size_human};

/// Name of the slab file created in each path.
pub const SLAB_FILE_NAME: &str = "kvtier-g3.slab";

/// The geometry a tier expects of its stripe set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlabSpec {
    /// Bytes per slot (the primary's row stride).
    pub row_stride: u64,
    /// Total capacity over all paths.
    pub capacity_bytes: u64,
    /// Namespace digest.
    pub namespace: [u8; 32],
    /// O_DIRECT policy.
    pub direct_io: DirectIoMode,
}

/// One open, locked slab file.
#[derive(Debug)]
pub struct SlabFile {
    /// The slab file's path.
    pub path: PathBuf,
    /// The locked descriptor (buffered): superblock, preallocation, fsync.
    pub meta: File,
    /// The data descriptor handed to the I/O engine: O_DIRECT when `direct`.
    pub data: File,
    /// Whether `data` is O_DIRECT.
    pub direct: bool,
    /// Filesystem type, e.g. `ext4 (0xef53)`.
    pub fs_type: String,
    /// The file's superblock.
    pub superblock: Superblock,
}

impl SlabFile {
    /// Checks that the slab is still what its path names: not deleted (a link count of 0),
    /// and the path leads to this very file (not renamed, replaced, or hidden by an unmount of
    /// its filesystem). Slots written to a slab that fails this would not be found by a
    /// restart.
    pub fn check_identity(&self) -> Result<()> {
        let md = self
            .meta
            .metadata()
            .map_err(|e| Error::io("stat", &self.path, e))?;
        let gone = |why: String| {
            Err(Error::new(
                ErrorKind::InvalidPath,
                format!(
                    "G3 slab {} {why} while the tier ran: what is written to it now would not \
                     be found by a restart",
                    self.path.display()
                ),
            )
            .with("path", self.path.display().to_string()))
        };
        if md.nlink() == 0 {
            return gone("was deleted".into());
        }
        match std::fs::metadata(&self.path) {
            Ok(now) if now.dev() == md.dev() && now.ino() == md.ino() => Ok(()),
            Ok(_) => gone("was replaced by another file (or its directory by another one)".into()),
            Err(e) => gone(format!(
                "can no longer be reached through its path ({e}): renamed, or its filesystem \
                 unmounted"
            )),
        }
    }
}

/// The open files of a stripe set, in stripe order.
#[derive(Debug)]
pub struct SlabSet {
    /// Files, `files[i].superblock.path_index == i`.
    pub files: Vec<SlabFile>,
    /// True when this open created the set.
    pub created: bool,
    /// Paths whose filesystem could not be recorded ([`FsGuard::record`]; logged).
    pub unrecorded_paths: usize,
}

impl SlabSet {
    /// Directory holding the set's journal and checkpoint (the first path's directory).
    pub fn meta_dir(&self) -> &Path {
        self.files[0].path.parent().unwrap_or(Path::new("."))
    }

    /// Bytes per slot.
    pub fn row_stride(&self) -> u64 {
        self.files[0].superblock.row_stride
    }

    /// Slots over the whole set.
    pub fn total_slots(&self) -> u64 {
        self.files[0].superblock.total_slots
    }

    /// The set's uuid.
    pub fn set_uuid(&self) -> [u8; 16] {
        self.files[0].superblock.set_uuid
    }
}

/// Checks that every entry is an existing directory and that no two entries name the same
/// directory. Returns the canonical paths.
pub fn check_dirs(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    if paths.is_empty() {
        return Err(Error::new(
            ErrorKind::Config,
            "a G3 tier needs at least one path",
        ));
    }
    let mut seen: Vec<(u64, u64, PathBuf)> = Vec::new();
    let mut out = Vec::with_capacity(paths.len());
    for p in paths {
        let md = std::fs::metadata(p).map_err(|e| {
            let why = if e.kind() == IoErrorKind::NotFound {
                "does not exist"
            } else {
                "is not usable"
            };
            Error::new(
                ErrorKind::InvalidPath,
                format!("G3 path {} {why}: {e}", p.display()),
            )
            .with("path", p.display().to_string())
            .with_source(e)
        })?;
        if !md.is_dir() {
            return Err(Error::new(
                ErrorKind::InvalidPath,
                format!("G3 path {} is not a directory", p.display()),
            )
            .with("path", p.display().to_string()));
        }
        if let Some((_, _, first)) = seen
            .iter()
            .find(|(d, i, _)| *d == md.dev() && *i == md.ino())
        {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "G3 paths {} and {} name the same directory (each path needs its own slab)",
                    first.display(),
                    p.display()
                ),
            )
            .with("path", p.display().to_string()));
        }
        seen.push((md.dev(), md.ino(), p.clone()));
        out.push(std::fs::canonicalize(p).unwrap_or_else(|_| p.clone()));
    }
    Ok(out)
}

/// [`check_dirs`], then checks that every directory takes new files
/// ([`check_writable_dir`]): for the commands that create or change a stripe set.
pub fn check_writable_dirs(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let dirs = check_dirs(paths)?;
    dirs.iter().try_for_each(|d| check_writable_dir(d))?;
    Ok(dirs)
}

/// A directory's own lock: `flock(LOCK_EX | LOCK_NB)` on the directory itself (no file is
/// added to it). Whatever removes or creates a stripe set's files holds it from its first
/// removal to its last write (`tier format`, `tier repair`, a tier creating its set), so that
/// two of them never interleave. Released on drop.
#[derive(Debug)]
pub struct DirLock {
    _dir: File,
}

/// Takes the [`DirLock`] of every directory in `dirs` (in order), retrying a held one for up
/// to a second; a directory another process keeps locked is a `Locked` error naming it and
/// the holder's pid.
pub fn lock_dirs(dirs: &[PathBuf]) -> Result<Vec<DirLock>> {
    let mut held = Vec::with_capacity(dirs.len());
    for d in dirs {
        let f = File::open(d).map_err(|e| Error::io("open directory", d, e))?;
        match lock_retrying(&f) {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let holder =
                    lock_holder_of(&f).map_or_else(|| "unknown".to_string(), |p| p.to_string());
                return Err(Error::new(
                    ErrorKind::Locked,
                    format!(
                        "{} is being changed by another kvtier process (pid {holder}: a \
                         `kvtier tier format` or `repair`, or a tier creating its slabs); \
                         try again once it has finished",
                        d.display()
                    ),
                )
                .with("path", d.display().to_string()));
            }
            Err(TryLockError::Error(e)) => return Err(Error::io("flock", d, e)),
        }
        held.push(DirLock { _dir: f });
    }
    Ok(held)
}

/// Whether each directory of `dirs` holds a slab file. A directory whose entries cannot be
/// looked up (no read or search permission, e.g. mode 000) is an [`ErrorKind::InvalidPath`]
/// error saying so: kvtier cannot tell whether it holds a tier, and never guesses "none".
pub fn slabs_present(dirs: &[PathBuf]) -> Result<Vec<bool>> {
    dirs.iter()
        .map(|d| {
            let p = d.join(SLAB_FILE_NAME);
            match std::fs::symlink_metadata(&p) {
                Ok(_) => Ok(true),
                Err(e) if e.kind() == IoErrorKind::NotFound => Ok(false),
                Err(e) => Err(unreadable_dir(d, &p, e)),
            }
        })
        .collect()
}

/// The error for a directory `d` in which `p` cannot be looked up (`e`).
fn unreadable_dir(d: &Path, p: &Path, e: std::io::Error) -> Error {
    let mode = std::fs::metadata(d)
        .map(|m| format!(" (mode {:03o})", m.mode() & 0o7777))
        .unwrap_or_default();
    Error::new(
        ErrorKind::InvalidPath,
        format!(
            "{} cannot be read{mode}: looking up {} failed: {e}; kvtier cannot tell whether it \
             holds a G3 tier. Give this process read and search permission on it",
            d.display(),
            p.display()
        ),
    )
    .with("path", d.display().to_string())
    .with_source(e)
}

/// Opens the stripe set in `dirs` (creating it when no slab file exists yet) and checks it
/// against `spec`. Holds the directories' [`DirLock`]s while it does.
pub fn open_set(dirs: &[PathBuf], spec: &SlabSpec) -> Result<SlabSet> {
    let dirs = check_writable_dirs(dirs)?;
    let _locks = lock_dirs(&dirs)?;
    open_set_locked(&dirs, spec)
}

/// [`open_set`] for a caller that holds the [`DirLock`]s of `dirs` (checked directories).
///
/// Before anything is created or opened, every path must be on the filesystem its record
/// names ([`FsGuard::check`]: a path found on another one, its disk not mounted, is refused
/// and no slab is created there); after, the paths' filesystems are recorded.
pub fn open_set_locked(dirs: &[PathBuf], spec: &SlabSpec) -> Result<SlabSet> {
    let guard = FsGuard::load(dirs)?;
    check_filesystems(dirs, &guard)?;
    open_set_recorded(dirs, spec, &guard)
}

/// Refuses, with [`FsGuard::check`], a path of `dirs` that is on another filesystem than
/// recorded, unless the slab found there belongs to the recorded set (the tier moved with its
/// files).
pub fn check_filesystems(dirs: &[PathBuf], guard: &FsGuard) -> Result<()> {
    let present = slabs_present(dirs)?;
    guard.check(|i| {
        present
            .get(i)
            .copied()
            .unwrap_or(false)
            .then(|| peek_set_uuid(&dirs[i].join(SLAB_FILE_NAME)))
            .flatten()
    })
}

/// The set uuid in the superblock of the slab `p`, read without a lock (and without
/// blocking on anything but a regular file); `None` when it cannot be read.
fn peek_set_uuid(p: &Path) -> Option<[u8; 16]> {
    let f = crate::g3::index_dir::open_regular(p, rustix::fs::OFlags::RDONLY).ok()??;
    read_superblock(&f, p).ok().map(|sb| sb.set_uuid)
}

/// [`open_set_locked`] for a caller that checked `guard` itself (or replaces what it records:
/// a format onto a new filesystem); records the paths' filesystems once the set is open.
pub fn open_set_recorded(dirs: &[PathBuf], spec: &SlabSpec, guard: &FsGuard) -> Result<SlabSet> {
    let mut set = open_set_unrecorded(dirs, spec)?;
    set.unrecorded_paths = guard.record(set.set_uuid());
    Ok(set)
}

fn open_set_unrecorded(dirs: &[PathBuf], spec: &SlabSpec) -> Result<SlabSet> {
    let dirs = dirs.to_vec();
    let slab_paths: Vec<PathBuf> = dirs.iter().map(|d| d.join(SLAB_FILE_NAME)).collect();
    let present = slabs_present(&dirs)?;
    if present.iter().all(|&x| !x) {
        return create_set(&slab_paths, spec);
    }
    if present.iter().any(|&x| !x) {
        return Err(incomplete_set(&dirs, &present));
    }
    let mut opened = Vec::with_capacity(slab_paths.len());
    for p in &slab_paths {
        let meta = open_locked(p, false)?;
        let superblock = read_superblock(&meta, p)?;
        let len = meta.metadata().map_err(|e| Error::io("stat", p, e))?.len();
        check_geometry(&superblock, len, p)?;
        opened.push((meta, superblock));
    }
    let sbs: Vec<Superblock> = opened.iter().map(|(_, sb)| sb.clone()).collect();
    check_members(&dirs, &sbs)?;
    let mut files = Vec::with_capacity(slab_paths.len());
    for (i, (p, (meta, superblock))) in slab_paths.iter().zip(opened).enumerate() {
        check_superblock(&superblock, p, i, slab_paths.len(), spec)?;
        files.push(slab_file(p, meta, superblock, spec.direct_io)?);
    }
    Ok(SlabSet {
        files,
        created: false,
        unrecorded_paths: 0,
    })
}

/// Checks a superblock against itself and its file: `total_slots` is `path_count` files of
/// `slots_in_file` slots (at most 2^32 - 2), the row stride a positive multiple of 4096, and the
/// file is exactly as long as its slots need (slabs are preallocated to that size and never
/// resized). Run wherever a stripe set is opened (the tier and the admin
/// commands), before anything is sized from these numbers.
pub fn check_geometry(sb: &Superblock, file_len: u64, p: &Path) -> Result<()> {
    let corrupt = |why: String| {
        Err(Error::new(
            ErrorKind::Corrupt,
            format!("{}: superblock is inconsistent: {why}", p.display()),
        )
        .with("path", p.display().to_string()))
    };
    let align = crate::geometry::ROW_ALIGNMENT as u64;
    if sb.row_stride == 0 || !sb.row_stride.is_multiple_of(align) {
        return corrupt(format!(
            "row_stride {} is not a positive multiple of {align}",
            sb.row_stride
        ));
    }
    if sb.path_count == 0 || sb.path_index >= sb.path_count {
        return corrupt(format!(
            "member {} of {} files",
            sb.path_index, sb.path_count
        ));
    }
    let total = sb.slots_in_file.checked_mul(u64::from(sb.path_count));
    if total != Some(sb.total_slots) {
        return corrupt(format!(
            "total_slots is {}, but {} file(s) of {} slots hold {}",
            sb.total_slots,
            sb.path_count,
            sb.slots_in_file,
            total.map_or_else(|| "more than 2^64".into(), |t| t.to_string())
        ));
    }
    if sb.total_slots >= u64::from(u32::MAX) {
        return corrupt(format!(
            "total_slots {} exceeds the 2^32 - 2 slot limit",
            sb.total_slots
        ));
    }
    let want = sb
        .slots_in_file
        .checked_mul(sb.row_stride)
        .and_then(|b| b.checked_add(SUPERBLOCK_SIZE as u64));
    match want {
        Some(want) if file_len == want => Ok(()),
        Some(want) if file_len > want => corrupt(format!(
            "the file is {file_len} bytes, longer than the {want} its {} slots of {} bytes \
             need: the superblock names fewer slots than the file was made for (its entries \
             beyond would be hidden)",
            sb.slots_in_file, sb.row_stride
        )),
        Some(want) => Err(Error::new(
            ErrorKind::Corrupt,
            format!(
                "{} is truncated: {file_len} bytes, its superblock needs {want}",
                p.display()
            ),
        )
        .with("path", p.display().to_string())
        .with("expected", want.to_string())
        .with("found", file_len.to_string())),
        None => corrupt(format!(
            "{} slots of {} bytes overflow a file size",
            sb.slots_in_file, sb.row_stride
        )),
    }
}

/// Checks that the slabs found form one stripe set listed in its order; when they are one set
/// listed in another order, says which order.
pub fn check_members(dirs: &[PathBuf], sbs: &[Superblock]) -> Result<()> {
    let n = sbs.len();
    let Some(first) = sbs.first() else {
        return Ok(());
    };
    if let Some(i) = sbs.iter().position(|sb| sb.set_uuid != first.set_uuid) {
        let short = |u: &[u8; 16]| hex::encode(&u[..4]);
        return Err(Error::new(
            ErrorKind::IncompatibleLayout,
            format!(
                "{} is member {} of stripe set {}…, but {} is member {} of stripe set {}…: the \
                 paths of one tier must be the directories of one set, listed in the order it \
                 was formatted with. Nothing is wrong with the files: list the directories of \
                 one set (`kvtier tier inspect DIR` shows the set and position of each \
                 directory's slab)",
                dirs[i].join(SLAB_FILE_NAME).display(),
                sbs[i].path_index,
                short(&sbs[i].set_uuid),
                dirs[0].join(SLAB_FILE_NAME).display(),
                first.path_index,
                short(&first.set_uuid),
            ),
        )
        .with("path", dirs[i].join(SLAB_FILE_NAME).display().to_string())
        .with("mismatch", MISMATCH_STRIPE)
        .with("expected", hex::encode(first.set_uuid))
        .with("found", hex::encode(sbs[i].set_uuid)));
    }
    if sbs
        .iter()
        .enumerate()
        .all(|(i, sb)| sb.path_index as usize == i && sb.path_count as usize == n)
    {
        return Ok(());
    }
    let mut order: Vec<Option<&PathBuf>> = vec![None; n];
    let permutation = sbs.iter().zip(dirs).all(|(sb, d)| {
        sb.path_count as usize == n
            && order
                .get_mut(sb.path_index as usize)
                .is_some_and(|o| o.replace(d).is_none())
    });
    if permutation {
        let right: Vec<String> = order
            .iter()
            .flatten()
            .map(|d| d.display().to_string())
            .collect();
        return Err(Error::new(
            ErrorKind::IncompatibleLayout,
            format!(
                "the paths of this G3 stripe set are listed in another order than it was \
                 formatted with: list them as [{}] (nothing is wrong with the files)",
                right.join(", ")
            ),
        )
        .with("mismatch", MISMATCH_STRIPE)
        .with("expected", right.join(", ")));
    }
    let (i, sb) = sbs
        .iter()
        .enumerate()
        .find(|(i, sb)| sb.path_index as usize != *i || sb.path_count as usize != n)
        .unwrap_or((0, first));
    Err(Error::new(
        ErrorKind::IncompatibleLayout,
        format!(
            "{} is member {} of a stripe set of {} files, but {n} path(s) are listed: list \
             every directory of the set, in the order it was formatted with",
            dirs[i].join(SLAB_FILE_NAME).display(),
            sb.path_index,
            sb.path_count
        ),
    )
    .with("mismatch", MISMATCH_STRIPE)
    .with("expected", format!("{n} path(s)"))
    .with(
        "found",
        format!("member {} of {}", sb.path_index, sb.path_count),
    ))
}

/// The error for a stripe set some of whose slabs are missing: what to do without losing the
/// chunks the others hold.
pub fn incomplete_set(dirs: &[PathBuf], present: &[bool]) -> Error {
    let names = |want: bool| -> Vec<String> {
        dirs.iter()
            .zip(present)
            .filter(|(_, p)| **p == want)
            .map(|(d, _)| d.join(SLAB_FILE_NAME).display().to_string())
            .collect()
    };
    let (missing, found) = (names(false), names(true));
    let all: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
    Error::new(
        ErrorKind::Corrupt,
        format!(
            "incomplete G3 stripe set: {} missing while {} {} there. If a filesystem is not \
             mounted, mount it and start again (nothing is lost). If the file is gone for \
             good, `kvtier tier repair {}` recreates it empty and keeps every chunk stored on \
             the other paths (`kvtier tier format` would discard them all)",
            missing.join(", "),
            found.join(", "),
            if found.len() == 1 { "is" } else { "are" },
            all.join(" ")
        ),
    )
    .with("path", missing.first().cloned().unwrap_or_default())
}

fn check_superblock(
    sb: &Superblock,
    p: &Path,
    idx: usize,
    n: usize,
    spec: &SlabSpec,
) -> Result<()> {
    let incompatible = |what: &str, mismatch: &str, expected: String, found: String, fix: &str| {
        Err(Error::new(
            ErrorKind::IncompatibleLayout,
            format!(
                "{}: {what} differs: the tier expects {expected}, the slab holds {found}: \
                 {fix}",
                p.display()
            ),
        )
        .with("path", p.display().to_string())
        .with("mismatch", mismatch)
        .with("expected", expected)
        .with("found", found))
    };
    if sb.row_stride != spec.row_stride {
        return incompatible(
            "row_stride",
            MISMATCH_ROW_STRIDE,
            spec.row_stride.to_string(),
            sb.row_stride.to_string(),
            "the row size comes from the model layout, TP size and blocks per chunk; restore \
             the settings the tier was formatted with to keep its chunks, or reformat it \
             explicitly with `kvtier tier format` (which discards them)",
        );
    }
    if sb.namespace != spec.namespace {
        return Err(namespace_mismatch(p, &spec.namespace, &sb.namespace));
    }
    // (The position in the set was checked for the whole set by `check_members`, and
    // `total_slots` against the files by `check_geometry`.)
    debug_assert!(sb.path_count as usize == n && sb.path_index as usize == idx);
    let slots = ChunkGeometry::slots_per_file(spec.capacity_bytes, n, spec.row_stride);
    if sb.slots_in_file != slots {
        let formatted = sb
            .slots_in_file
            .saturating_mul(n as u64)
            .saturating_mul(sb.row_stride);
        return incompatible(
            "capacity (slots per file)",
            MISMATCH_CAPACITY,
            format!("{slots} (capacity_bytes {})", spec.capacity_bytes),
            sb.slots_in_file.to_string(),
            &format!(
                "set capacity_bytes back to {formatted} ({}), the capacity it was formatted \
                 with, to keep its chunks; to resize it, `kvtier tier format` with the new \
                 capacity (which discards them)",
                format_size_human(formatted)
            ),
        );
    }
    Ok(())
}

/// Slots in each of `n` slab files that share `capacity_bytes` in slots of `row_stride` bytes
/// ([`ChunkGeometry::slots_per_file`]); none is a `Config` error.
pub fn slots_in_file(capacity_bytes: u64, n: usize, row_stride: u64) -> Result<u64> {
    let slots = ChunkGeometry::slots_per_file(capacity_bytes, n, row_stride);
    if slots == 0 {
        return Err(Error::new(
            ErrorKind::Config,
            format!(
                "capacity_bytes {} holds no slot of {} on each of {}",
                format_size_human(capacity_bytes),
                format_size_human(row_stride),
                count(n as u64, "path")
            ),
        ));
    }
    Ok(slots)
}

fn create_set(slab_paths: &[PathBuf], spec: &SlabSpec) -> Result<SlabSet> {
    let n = slab_paths.len();
    let slots = slots_in_file(spec.capacity_bytes, n, spec.row_stride)?;
    let total_slots = ChunkGeometry::total_slots(spec.capacity_bytes, n, spec.row_stride);
    let set_uuid = random_uuid()?;
    let created_unix_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut files = Vec::with_capacity(n);
    let mut made: Vec<PathBuf> = Vec::new();
    let result = (|| -> Result<()> {
        for (i, p) in slab_paths.iter().enumerate() {
            let superblock = Superblock {
                version: SLAB_FORMAT_VERSION,
                row_stride: spec.row_stride,
                slots_in_file: slots,
                total_slots,
                path_index: i as u32,
                path_count: n as u32,
                namespace: spec.namespace,
                set_uuid,
                created_unix_s,
            };
            let meta = create_member(p, &superblock, &mut made)?;
            files.push(slab_file(p, meta, superblock, spec.direct_io)?);
        }
        Ok(())
    })();
    if let Err(e) = result {
        drop(files);
        for p in &made {
            let _ = std::fs::remove_file(p);
        }
        return Err(e);
    }
    log::info!(
        "created G3 stripe set {} ({n} file(s), {slots} slots of {} bytes each)",
        hex::encode(set_uuid),
        spec.row_stride
    );
    Ok(SlabSet {
        files,
        created: true,
        unrecorded_paths: 0,
    })
}

/// Creates the slab `p` of `superblock` (locked, preallocated, superblock written and synced,
/// its directory synced); `made` records it once it exists, so a caller can remove it again.
pub fn create_member(p: &Path, superblock: &Superblock, made: &mut Vec<PathBuf>) -> Result<File> {
    let meta = open_locked(p, true)?;
    made.push(p.to_path_buf());
    preallocate(
        &meta,
        p,
        slab_file_len(superblock.slots_in_file, superblock.row_stride),
    )?;
    meta.write_all_at(&superblock.encode(), 0)
        .map_err(|e| Error::io("write superblock of", p, e))?;
    meta.sync_all().map_err(|e| Error::io("fsync", p, e))?;
    sync_dir(p.parent().unwrap_or(Path::new(".")))?;
    Ok(meta)
}

/// Opens (or creates, with `create`) `p` read-write and takes `flock(LOCK_EX | LOCK_NB)`. An
/// existing file must be a regular file (a FIFO is refused without blocking).
pub fn open_locked(p: &Path, create: bool) -> Result<File> {
    open_and_lock(p, create, true)
}

/// Opens the existing slab `p` read-only (it may be on a read-only filesystem) and takes the
/// same exclusive lock as [`open_locked`]: for commands that only read but must not run beside
/// a live tier.
pub fn open_locked_read_only(p: &Path) -> Result<File> {
    open_and_lock(p, false, false)
}

fn open_and_lock(p: &Path, create: bool, write: bool) -> Result<File> {
    let mut o = OpenOptions::new();
    o.read(true)
        .write(write)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC);
    if create {
        o.create_new(true);
    } else {
        // A FIFO in place of a slab must not block the open; it is refused below.
        o.custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK);
    }
    let f = o.open(p).map_err(|e| {
        let dir = p.parent().unwrap_or(Path::new("."));
        if !create && matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM)) {
            // The file is there: its own permissions refuse this process.
            return Error::new(
                ErrorKind::InvalidPath,
                format!(
                    "cannot open {}: {e} (this process may not {} it: check its owner and \
                     mode)",
                    p.display(),
                    if write { "read and write" } else { "read" }
                ),
            )
            .with("path", p.display().to_string())
            .with_source(e);
        }
        match unwritable_reason(&e) {
            Some(reason) => Error::new(
                ErrorKind::InvalidPath,
                format!(
                    "cannot {} {} ({} is not writable: {reason}): {e}",
                    if create { "create" } else { "open" },
                    p.display(),
                    dir.display()
                ),
            )
            .with("path", p.display().to_string())
            .with_source(e),
            None => Error::io(if create { "create" } else { "open" }, p, e),
        }
    })?;
    if !create {
        let md = f.metadata().map_err(|e| Error::io("stat", p, e))?;
        crate::g3::index_dir::require_regular(md.mode(), p)?;
        let fl = rustix::fs::fcntl_getfl(&f).map_err(|e| Error::io("fcntl", p, e.into()))?;
        rustix::fs::fcntl_setfl(&f, fl - rustix::fs::OFlags::NONBLOCK)
            .map_err(|e| Error::io("fcntl", p, e.into()))?;
    }
    match lock_retrying(&f) {
        Ok(()) => Ok(f),
        Err(TryLockError::WouldBlock) => Err(lock_error(
            p,
            &f,
            std::io::Error::from_raw_os_error(libc::EWOULDBLOCK),
            true,
        )),
        Err(TryLockError::Error(e)) => Err(lock_error(p, &f, e, false)),
    }
}

/// `flock(LOCK_EX | LOCK_NB)` on `f` (`File::try_lock` on Linux), retrying a held lock for up
/// to [`LOCK_RETRY`]. A process forked by any thread of this one holds a copy of every
/// descriptor until its exec closes it, so the lock of a tier closed a moment ago can outlive
/// the close by that long (measured: 275 of 300 immediate reopens failed while another thread
/// ran a command). Retry briefly before calling the path locked.
fn lock_retrying(f: &File) -> std::result::Result<(), TryLockError> {
    let started = std::time::Instant::now();
    loop {
        match f.try_lock() {
            Err(TryLockError::WouldBlock) if started.elapsed() < LOCK_RETRY => {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            done => return done,
        }
    }
}

/// How long [`lock_retrying`] retries a lock that is held (see there).
const LOCK_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// The error for a failed `flock` (`busy`: EWOULDBLOCK, naming the holder when known).
fn lock_error(p: &Path, f: &File, err: std::io::Error, busy: bool) -> Error {
    if !busy {
        return Error::io("flock", p, err);
    }
    let pid = lock_holder_of(f);
    let holder = pid.map_or_else(|| "unknown".to_string(), |p| p.to_string());
    let msg = if pid == Some(std::process::id()) {
        format!(
            "{} is already open in this process (pid {holder}): a G3 tier may be \
             opened only once; check for two tier entries naming the same path",
            p.display()
        )
    } else {
        format!(
            "{} is locked by another process (pid {holder})",
            p.display()
        )
    };
    Error::new(ErrorKind::Locked, msg)
        .with("path", p.display().to_string())
        .with("pid", holder)
        .with_source(err)
}

/// The pid holding a `flock` on the file `f` refers to, from `/proc/locks`.
pub fn lock_holder_of(f: &File) -> Option<u32> {
    let md = f.metadata().ok()?;
    let dev = md.dev();
    let want = format!(
        "{:02x}:{:02x}:{}",
        rustix::fs::major(dev),
        rustix::fs::minor(dev),
        md.ino()
    );
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    locks.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF"; blocked waiters carry "->".
        if fields.len() >= 6 && fields[1] == "FLOCK" && fields[5] == want {
            fields[4].parse().ok()
        } else {
            None
        }
    })
}

/// The [`SlabFile`] for slab `p`, whose locked descriptor `meta` holds `superblock`: opens its
/// data descriptor with [`open_data`].
fn slab_file(p: &Path, meta: File, superblock: Superblock, mode: DirectIoMode) -> Result<SlabFile> {
    let (data, direct, fs_type) = open_data(p, mode)?;
    Ok(SlabFile {
        path: p.to_path_buf(),
        meta,
        data,
        direct,
        fs_type,
        superblock,
    })
}

/// Opens the data descriptor of `p`: O_DIRECT, probed with a real aligned read and write of
/// the superblock page; on failure an error (`required`) or a buffered descriptor with one warning
/// (`auto`).
fn open_data(p: &Path, mode: DirectIoMode) -> Result<(File, bool, String)> {
    let fs_type = fs_type_of(p);
    let opened = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_DIRECT)
        .open(p);
    // The probe is one aligned O_DIRECT read of the superblock page and one O_DIRECT write
    // of the same bytes back (identical content, so even a torn write changes nothing).
    let probe = opened.and_then(|f| {
        let mut buf = AlignedBuf::new(SUPERBLOCK_SIZE).map_err(std::io::Error::other)?;
        f.read_exact_at(buf.as_mut_slice(), 0)?;
        f.write_all_at(buf.as_slice(), 0)?;
        Ok(f)
    });
    // statx(STATX_DIOALIGN), where the kernel reports it, must allow kvtier's row alignment.
    let probe = probe.and_then(|f| match dio_alignment(p) {
        Some((mem, off)) if mem as usize > ROW_ALIGNMENT || off as usize > ROW_ALIGNMENT => {
            Err(std::io::Error::other(format!(
                "the filesystem requires O_DIRECT alignment of {mem} bytes (memory) and {off} \
                 bytes (offset), kvtier uses {ROW_ALIGNMENT}"
            )))
        }
        _ => Ok(f),
    });
    match probe {
        Ok(f) => Ok((f, true, fs_type)),
        Err(e) => match mode {
            DirectIoMode::Required => Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{} does not support O_DIRECT (filesystem {fs_type}): {e}; set direct_io = \
                     \"auto\" to allow buffered I/O",
                    p.display()
                ),
            )
            .with("path", p.display().to_string())
            .with("filesystem", fs_type)
            .with_source(e)),
            DirectIoMode::Auto => {
                log::warn!(
                    "{} does not support O_DIRECT (filesystem {fs_type}: {e}); using buffered \
                     I/O for this slab (direct_io = auto)",
                    p.display()
                );
                let f = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .custom_flags(libc::O_CLOEXEC)
                    .open(p)
                    .map_err(|e| Error::io("open", p, e))?;
                Ok((f, false, fs_type))
            }
        },
    }
}

/// `posix_fallocate` of `len` bytes, after checking free space; ENOSPC names the path, the
/// bytes needed and the bytes available.
fn preallocate(f: &File, p: &Path, len: u64) -> Result<()> {
    let available = available_bytes(p.parent().unwrap_or(Path::new(".")));
    let no_space = |available: Option<u64>| {
        let avail = available.map_or_else(|| "unknown".to_string(), |a| a.to_string());
        Error::new(
            ErrorKind::NoSpace,
            format!(
                "not enough space to preallocate {}: needs {len} bytes, {avail} available",
                p.display()
            ),
        )
        .with("path", p.display().to_string())
        .with("needed", len.to_string())
        .with("available", avail)
    };
    if let Some(a) = available
        && a < len
    {
        return Err(no_space(available));
    }
    let len_off = libc::off_t::try_from(len).map_err(|_| no_space(available))?;
    // Raw libc: glibc's posix_fallocate writes zeros where the filesystem has no fallocate(2)
    // (rustix's `fallocate` and std have only the system call, which then fails).
    // SAFETY: posix_fallocate on a descriptor we own; no memory is involved.
    let rc = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, len_off) };
    match rc {
        0 => Ok(()),
        libc::ENOSPC | libc::EDQUOT => Err(no_space(available_bytes(
            p.parent().unwrap_or(Path::new(".")),
        ))),
        e => Err(Error::io(
            "posix_fallocate",
            p,
            std::io::Error::from_raw_os_error(e),
        )),
    }
}

/// Bytes available to an unprivileged writer in the filesystem of `dir` (`statvfs`); `None`
/// when unknown.
pub fn available_bytes(dir: &Path) -> Option<u64> {
    let st = rustix::fs::statvfs(dir).ok()?;
    if st.f_blocks == 0 {
        // ramfs and some virtual filesystems report no size at all: unknown, not full.
        return None;
    }
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

/// The filesystem type of `p` as `name (0xmagic)`.
pub fn fs_type_of(p: &Path) -> String {
    let Ok(magic) = crate::io::probe::statfs_magic(p) else {
        return "unknown".into();
    };
    let name = crate::io::probe::fs_type_name(magic);
    format!("{name} (0x{magic:x})")
}

/// `(memory, offset)` O_DIRECT alignment of the filesystem holding `dir`'s slabs, from the
/// I/O layer's probe (`statx(STATX_DIOALIGN)`), when the kernel reports it.
fn dio_alignment(slab: &Path) -> Option<(u32, u32)> {
    let dir = slab.parent()?;
    match crate::io::probe_direct_io(dir) {
        Ok(p) => Some((p.dio_mem_align?, p.dio_offset_align?)),
        Err(e) => {
            log::debug!("direct-I/O probe of {} failed: {e}", dir.display());
            None
        }
    }
}

/// Reads and decodes the superblock of an open slab.
pub fn read_superblock(f: &File, p: &Path) -> Result<Superblock> {
    let mut b = vec![0u8; SUPERBLOCK_SIZE];
    let got = read_at_most(f, &mut b, 0).map_err(|e| Error::io("read superblock of", p, e))?;
    Superblock::decode(&b[..got], &p.display().to_string())
}

/// Removes the slab files of `dirs` after taking their locks (so a live tier is never
/// reformatted under its feet). Missing files are ignored.
#[cfg(any(test, feature = "test-support"))]
pub fn remove_set(dirs: &[PathBuf]) -> Result<()> {
    let dirs = check_dirs(dirs)?;
    remove_locked(lock_slabs(&dirs)?)
}

/// The slabs present in `dirs`, each opened and locked (a live tier's slab is refused):
/// what [`remove_locked`] removes.
pub fn lock_slabs(dirs: &[PathBuf]) -> Result<Vec<(File, PathBuf)>> {
    let mut held = Vec::new();
    for d in dirs {
        let p = d.join(SLAB_FILE_NAME);
        if p.exists() {
            held.push((open_locked(&p, false)?, p));
        }
    }
    Ok(held)
}

/// Removes slabs locked by [`lock_slabs`], syncing their directories.
pub fn remove_locked(held: Vec<(File, PathBuf)>) -> Result<()> {
    // Only the directories that held a slab are synced: nothing removed, nothing to sync.
    for (_f, p) in &held {
        std::fs::remove_file(p).map_err(|e| Error::io("remove", p, e))?;
        sync_dir(p.parent().unwrap_or(Path::new(".")))?;
    }
    Ok(())
}

/// Checks, before anything is removed, that the slabs a format creates in `dirs` (each
/// `slots_in_file` slots of `row_stride` bytes) fit: per filesystem, what is available plus
/// what the old slabs `held` free must cover what the new ones need.
pub fn check_format_space(
    dirs: &[PathBuf],
    held: &[(File, PathBuf)],
    slots_in_file: u64,
    row_stride: u64,
) -> Result<()> {
    use std::collections::BTreeMap;
    let each = slab_file_len(slots_in_file, row_stride);
    // dev -> (needed, freed, available, first directory)
    let mut by_dev: BTreeMap<u64, (u64, u64, Option<u64>, &PathBuf)> = BTreeMap::new();
    for d in dirs {
        let dev = std::fs::metadata(d)
            .map_err(|e| Error::io("stat", d, e))?
            .dev();
        let e = by_dev
            .entry(dev)
            .or_insert_with(|| (0, 0, available_bytes(d), d));
        e.0 = e.0.saturating_add(each);
    }
    for (f, p) in held {
        let md = f.metadata().map_err(|e| Error::io("stat", p, e))?;
        if let Some(e) = by_dev.get_mut(&md.dev()) {
            e.1 = e.1.saturating_add(md.blocks().saturating_mul(512));
        }
    }
    for (needed, freed, available, dir) in by_dev.into_values() {
        let Some(available) = available else {
            continue;
        };
        let usable = available.saturating_add(freed);
        if usable < needed {
            return Err(Error::new(
                ErrorKind::NoSpace,
                format!(
                    "not enough space to format {}: the new slabs on its filesystem need {}, \
                     {} is available (counting the {} the old slabs would free); nothing was \
                     removed",
                    dir.display(),
                    format_size_human(needed),
                    format_size_human(usable),
                    format_size_human(freed)
                ),
            )
            .with("path", dir.display().to_string())
            .with("needed", needed.to_string())
            .with("available", usable.to_string()));
        }
    }
    Ok(())
}
