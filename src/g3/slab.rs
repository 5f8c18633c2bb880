//! Slab files: one preallocated, exclusively locked file per path, holding a superblock and
//! `slots_in_file` slots of `row_stride` bytes.
//!
//! A stripe set is created only when none of its files exist; if all exist they are opened and
//! checked against the expected geometry; a partial set is refused (a file is never recreated
//! under an index that may still name its slots). Reformatting is [`remove_set`] followed by a
//! fresh open, and only the admin commands do that.

use std::fs::File;
use std::io::ErrorKind as IoErrorKind;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, ErrorKind, Result};
use crate::g3::config::DirectIoMode;
use crate::g3::dirs::check_writable_dir;
pub use crate::g3::dirs::sync_dir;
use crate::g3::format::{
    MISMATCH_CAPACITY, MISMATCH_ROW_STRIDE, MISMATCH_STRIPE, SLAB_FORMAT_VERSION, SUPERBLOCK_SIZE,
    Superblock, namespace_mismatch, random_uuid, read_at_most, slab_file_len,
};
use crate::g3::fs_record::FsGuard;
use crate::geometry::ChunkGeometry;
use crate::size::{count, format_size_human};

mod data;
mod lock;
mod space;

pub use data::fs_type_of;
use data::open_data;
#[cfg(any(test, feature = "test-support"))]
pub use lock::DirLock;
pub use lock::{lock_dirs, lock_holder_of, open_locked, open_locked_read_only};
use space::preallocate;
pub use space::{available_bytes, check_format_space};

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
