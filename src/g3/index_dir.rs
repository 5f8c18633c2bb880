//! The directory that holds a stripe set's index files (the first path), held open: every
//! journal and checkpoint is opened, created, renamed and synced relative to the open
//! directory (`openat`, `renameat`, `linkat` through `rustix`), never through its path. After
//! a lazy unmount or a replaced directory the index files therefore stay with the slabs they
//! describe, and [`IndexDir::check_identity`] notices that the path now leads elsewhere.
//!
//! Every file is opened without blocking and must be a regular file: a FIFO or a device in
//! place of an index file is refused with an error naming it, never waited on. Operations go
//! through the engine's fault hook ([`crate::io::IoEngine::meta_fault`]) when one is given.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
#[cfg(any(test, feature = "test-support"))]
use std::sync::Arc;

use rustix::fs::{AtFlags, CWD, FileType, Mode, OFlags};

use crate::error::{Error, ErrorKind, Result};
use crate::g3::dirs::unwritable_reason;
#[cfg(any(test, feature = "test-support"))]
use crate::io::IoEngine;
use crate::io::{MetaFile, MetaOp};

/// The journal of the current generation.
pub const JOURNAL_FILE_NAME: &str = "kvtier-g3.journal";
/// The checkpoint of the current generation.
pub const CHECKPOINT_FILE_NAME: &str = "kvtier-g3.checkpoint";
/// The journal of the previous generation.
pub const JOURNAL_PREV_FILE_NAME: &str = "kvtier-g3.journal.prev";
/// The checkpoint of the previous generation.
pub const CHECKPOINT_PREV_FILE_NAME: &str = "kvtier-g3.checkpoint.prev";
/// A journal being written, before it is renamed into place.
pub const JOURNAL_TMP_FILE_NAME: &str = "kvtier-g3.journal.tmp";
/// A checkpoint being written, before it is renamed into place.
pub const CHECKPOINT_TMP_FILE_NAME: &str = "kvtier-g3.checkpoint.tmp";
/// Infix of the copies of damaged index files kept for inspection
/// (`kvtier-g3.checkpoint.damaged.<unix seconds>[.<n>]`).
pub const DAMAGED_INFIX: &str = ".damaged.";

/// Every index file name a stripe set uses (for `format` and `clear`).
pub const INDEX_FILE_NAMES: [&str; 6] = [
    JOURNAL_FILE_NAME,
    CHECKPOINT_FILE_NAME,
    JOURNAL_PREV_FILE_NAME,
    CHECKPOINT_PREV_FILE_NAME,
    JOURNAL_TMP_FILE_NAME,
    CHECKPOINT_TMP_FILE_NAME,
];

/// The open index directory.
pub struct IndexDir {
    path: PathBuf,
    fd: OwnedFd,
    dev: u64,
    ino: u64,
    #[cfg(any(test, feature = "test-support"))]
    faults: Option<Arc<dyn IoEngine>>,
}

impl std::fmt::Debug for IndexDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexDir")
            .field("path", &self.path)
            .field("dev", &self.dev)
            .field("ino", &self.ino)
            .finish_non_exhaustive()
    }
}

fn os(e: rustix::io::Errno) -> std::io::Error {
    std::io::Error::from(e)
}

/// The error for `op` on `name` in `dir` failing with `e`: a directory that refuses files
/// for what it is (read-only, permission) is [`ErrorKind::InvalidPath`], ENOSPC/EDQUOT is
/// [`ErrorKind::NoSpace`], anything else an I/O error.
fn file_error(op: &str, path: &Path, e: std::io::Error) -> Error {
    if let Some(reason) = unwritable_reason(&e) {
        return Error::new(
            ErrorKind::InvalidPath,
            format!("{op} {}: {e} (the directory is {reason})", path.display()),
        )
        .with("path", path.display().to_string())
        .with_source(e);
    }
    if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) {
        return Error::new(ErrorKind::NoSpace, format!("{op} {}: {e}", path.display()))
            .with("path", path.display().to_string())
            .with_source(e);
    }
    Error::io(op, path, e)
}

/// The error for opening `path` (a file to `use_` it, or the directory itself) refused with
/// `EACCES`/`EPERM`: permissions on that file or directory, not a directory that takes no
/// files. Anything else goes to [`file_error`].
fn open_error(op: &str, path: &Path, e: std::io::Error, use_: &str) -> Error {
    if !matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM)) {
        return file_error(op, path, e);
    }
    Error::new(
        ErrorKind::InvalidPath,
        format!(
            "{op} {}: {e} (this process may not {use_} it: check its owner and mode, and \
             search permission on the directories above it)",
            path.display()
        ),
    )
    .with("path", path.display().to_string())
    .with_source(e)
}

/// Refuses anything but a regular file at `path` (`st_mode` of the open descriptor).
pub(crate) fn require_regular(mode: u32, path: &Path) -> Result<()> {
    let kind = FileType::from_raw_mode(mode);
    if kind == FileType::RegularFile {
        return Ok(());
    }
    let what = match kind {
        FileType::Directory => "a directory",
        FileType::Fifo => "a FIFO",
        FileType::Socket => "a socket",
        FileType::CharacterDevice => "a character device",
        FileType::BlockDevice => "a block device",
        _ => "not a regular file",
    };
    Err(Error::new(
        ErrorKind::InvalidPath,
        format!(
            "{} is {what}, not a regular file: move it away (kvtier never opens it)",
            path.display()
        ),
    )
    .with("path", path.display().to_string()))
}

/// Opens `path` with `flags` without blocking (a FIFO would block an open for reading until
/// a writer comes) and refuses it unless it is a regular file. `Ok(None)` when it does not
/// exist. The descriptor is returned in blocking mode.
pub fn open_regular_at(
    dir: impl AsFd,
    name: &Path,
    shown: &Path,
    flags: OFlags,
) -> Result<Option<File>> {
    let fd = match rustix::fs::openat(
        dir,
        name,
        flags | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::from_raw_mode(0o600),
    ) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Ok(None),
        Err(e) => {
            let use_ = if flags.intersects(OFlags::WRONLY | OFlags::RDWR) {
                "read and write"
            } else {
                "read"
            };
            return Err(open_error("open", shown, os(e), use_));
        }
    };
    let st = rustix::fs::fstat(&fd).map_err(|e| Error::io("stat", shown, os(e)))?;
    require_regular(st.st_mode, shown)?;
    let fl = rustix::fs::fcntl_getfl(&fd).map_err(|e| Error::io("fcntl", shown, os(e)))?;
    rustix::fs::fcntl_setfl(&fd, fl - OFlags::NONBLOCK)
        .map_err(|e| Error::io("fcntl", shown, os(e)))?;
    Ok(Some(File::from(fd)))
}

/// [`open_regular_at`] of an absolute or relative path.
pub fn open_regular(path: &Path, flags: OFlags) -> Result<Option<File>> {
    open_regular_at(CWD, path, path, flags)
}

impl IndexDir {
    /// Opens the directory `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let fd = rustix::fs::open(
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| open_error("open directory", path, os(e), "read"))?;
        let st = rustix::fs::fstat(&fd).map_err(|e| Error::io("stat", path, os(e)))?;
        Ok(IndexDir {
            path: path.to_path_buf(),
            fd,
            dev: st.st_dev,
            ino: st.st_ino,
            #[cfg(any(test, feature = "test-support"))]
            faults: None,
        })
    }

    /// Sends every operation through `engine`'s fault hook (test support).
    #[cfg(any(test, feature = "test-support"))]
    pub fn with_faults(mut self, engine: Arc<dyn IoEngine>) -> Self {
        self.faults = Some(engine);
        self
    }

    /// The engine whose fault hook applies, if any (test support).
    #[cfg(any(test, feature = "test-support"))]
    pub fn faults(&self) -> Option<&Arc<dyn IoEngine>> {
        self.faults.as_ref()
    }

    /// The directory's path (as configured).
    #[cfg(any(test, feature = "test-support"))]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The path of `name` in the directory, for messages.
    pub fn file_path(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// The fault a test injects into `op` on `file`; none in a shipped build.
    #[cfg(any(test, feature = "test-support"))]
    fn fault(&self, file: MetaFile, op: MetaOp) -> std::io::Result<()> {
        match self.faults.as_ref().and_then(|e| e.meta_fault(file, op)) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The fault a test injects into `op` on `file`; none in a shipped build.
    #[cfg(not(any(test, feature = "test-support")))]
    #[inline(always)]
    fn fault(&self, _file: MetaFile, _op: MetaOp) -> std::io::Result<()> {
        Ok(())
    }

    /// Opens `name` for reading; `None` when it does not exist. Anything but a regular file is
    /// an error.
    pub fn open_read(&self, name: &str) -> Result<Option<File>> {
        open_regular_at(
            &self.fd,
            Path::new(name),
            &self.file_path(name),
            OFlags::RDONLY,
        )
    }

    /// Opens the existing `name` for reading and writing.
    pub fn open_rw(&self, name: &str) -> Result<File> {
        let p = self.file_path(name);
        open_regular_at(&self.fd, Path::new(name), &p, OFlags::RDWR)?
            .ok_or_else(|| Error::io("open", &p, std::io::Error::from_raw_os_error(libc::ENOENT)))
    }

    /// Creates (or truncates) `name` with `bytes`, fsynced. `file` names it for faults.
    pub fn write_file(&self, name: &str, bytes: &[u8], file: MetaFile) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let p = self.file_path(name);
        self.fault(file, MetaOp::Create)
            .map_err(|e| file_error("create", &p, e))?;
        // Never follow a link or open a FIFO here: a stale temp file of any kind is replaced.
        match rustix::fs::unlinkat(&self.fd, name, AtFlags::empty()) {
            Ok(()) | Err(rustix::io::Errno::NOENT) => {}
            Err(e) => return Err(file_error("remove stale", &p, os(e))),
        }
        let fd = rustix::fs::openat(
            &self.fd,
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| file_error("create", &p, os(e)))?;
        let f = File::from(fd);
        self.fault(file, MetaOp::Write)
            .and_then(|()| f.write_all_at(bytes, 0))
            .map_err(|e| file_error("write", &p, e))?;
        self.fault(file, MetaOp::Sync)
            .and_then(|()| f.sync_all())
            .map_err(|e| file_error("fsync", &p, e))
    }

    /// Renames `from` to `to` (replacing `to`). `Ok(false)` when `from` does not exist.
    pub fn rename(&self, from: &str, to: &str, file: MetaFile) -> Result<bool> {
        let p = self.file_path(to);
        self.fault(file, MetaOp::Rename)
            .map_err(|e| file_error("rename into", &p, e))?;
        match rustix::fs::renameat(&self.fd, from, &self.fd, to) {
            Ok(()) => Ok(true),
            Err(rustix::io::Errno::NOENT) => Ok(false),
            Err(e) => Err(file_error(
                &format!("rename {from} to"),
                &self.file_path(to),
                os(e),
            )),
        }
    }

    /// Gives `name` the new name `to` as well (a hard link), falling back to a copy where the
    /// filesystem has no hard links. `Ok(false)` when `name` does not exist.
    pub fn link(&self, name: &str, to: &str, file: MetaFile) -> Result<bool> {
        let p = self.file_path(to);
        self.fault(file, MetaOp::Rename)
            .map_err(|e| file_error("link", &p, e))?;
        match rustix::fs::linkat(&self.fd, name, &self.fd, to, AtFlags::empty()) {
            Ok(()) => Ok(true),
            Err(rustix::io::Errno::NOENT) => Ok(false),
            Err(rustix::io::Errno::PERM | rustix::io::Errno::OPNOTSUPP) => {
                let Some(src) = self.open_read(name)? else {
                    return Ok(false);
                };
                let mut bytes = Vec::new();
                std::io::Read::read_to_end(&mut &src, &mut bytes)
                    .map_err(|e| Error::io("read", &self.file_path(name), e))?;
                self.write_file(to, &bytes, file)?;
                Ok(true)
            }
            Err(e) => Err(file_error("link", &p, os(e))),
        }
    }

    /// Removes `name`; `Ok(false)` when it does not exist.
    pub fn remove(&self, name: &str) -> Result<bool> {
        match rustix::fs::unlinkat(&self.fd, name, AtFlags::empty()) {
            Ok(()) => Ok(true),
            Err(rustix::io::Errno::NOENT) => Ok(false),
            Err(e) => Err(file_error("remove", &self.file_path(name), os(e))),
        }
    }

    /// fsyncs the directory (its entries: creations, renames, removals).
    pub fn sync(&self) -> Result<()> {
        self.fault(MetaFile::Directory, MetaOp::Sync)
            .map_err(|e| file_error("fsync directory", &self.path, e))?;
        rustix::fs::fsync(&self.fd).map_err(|e| file_error("fsync directory", &self.path, os(e)))
    }

    /// The names in the directory (for damaged copies).
    pub fn names(&self) -> Result<Vec<String>> {
        let dup = self
            .fd
            .try_clone()
            .map_err(|e| Error::io("dup", &self.path, e))?;
        let dir =
            rustix::fs::Dir::read_from(&dup).map_err(|e| Error::io("read", &self.path, os(e)))?;
        let mut out = Vec::new();
        for entry in dir {
            let entry = entry.map_err(|e| Error::io("read", &self.path, os(e)))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name != "." && name != ".." {
                out.push(name);
            }
        }
        out.sort();
        Ok(out)
    }

    /// The copies of damaged index files kept in the directory, with their sizes.
    pub fn damaged_copies(&self) -> Result<Vec<(String, u64)>> {
        let mut out = Vec::new();
        for name in self.names()? {
            if name.starts_with("kvtier-g3.") && name.contains(DAMAGED_INFIX) {
                let len = rustix::fs::statat(&self.fd, name.as_str(), AtFlags::SYMLINK_NOFOLLOW)
                    .map(|st| st.st_size as u64)
                    .unwrap_or(0);
                out.push((name, len));
            }
        }
        Ok(out)
    }

    /// Keeps the damaged index file `name` for inspection under a new name: `rename` moves
    /// it (it is no longer used), otherwise a hard link keeps a copy while it stays in use
    /// (a journal whose readable records remain the previous generation's). Returns the new
    /// name.
    pub fn keep_damaged(&self, name: &str, rename: bool, file: MetaFile) -> Result<String> {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let existing = self.names()?;
        let mut to = format!("{name}{DAMAGED_INFIX}{stamp}");
        let mut n = 1;
        while existing.contains(&to) {
            to = format!("{name}{DAMAGED_INFIX}{stamp}.{n}");
            n += 1;
        }
        let done = if rename {
            self.rename(name, &to, file)?
        } else {
            self.link(name, &to, file)?
        };
        if done {
            log::warn!(
                "kept damaged G3 index file {} as {} for inspection",
                self.file_path(name).display(),
                self.file_path(&to).display()
            );
        }
        Ok(to)
    }

    /// Checks that the configured path still leads to this directory (same device and inode).
    /// After a lazy unmount, or when the directory was renamed or replaced, it does not: the
    /// index files written from now on would not be found at the path by a restart.
    pub fn check_identity(&self) -> Result<()> {
        let now = rustix::fs::statat(CWD, &self.path, AtFlags::empty());
        match now {
            Ok(st) if st.st_dev == self.dev && st.st_ino == self.ino => Ok(()),
            Ok(st) => Err(Error::new(
                ErrorKind::InvalidPath,
                format!(
                    "G3 path {} now leads to another directory (device {}:{}, inode {}; the \
                     tier's files are on device {}:{}, inode {}): it was unmounted, renamed or \
                     replaced while the tier ran, so a restart would not find what is stored \
                     now; writes to it stop",
                    self.path.display(),
                    libc::major(st.st_dev),
                    libc::minor(st.st_dev),
                    st.st_ino,
                    libc::major(self.dev),
                    libc::minor(self.dev),
                    self.ino
                ),
            )
            .with("path", self.path.display().to_string())),
            Err(e) => Err(Error::new(
                ErrorKind::InvalidPath,
                format!(
                    "G3 path {} no longer leads to the tier's directory ({}): it was \
                     unmounted, renamed or removed while the tier ran; writes to it stop",
                    self.path.display(),
                    os(e)
                ),
            )
            .with("path", self.path.display().to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_created_renamed_and_read_relative_to_the_open_directory() {
        let d = tempfile::tempdir_in("/tmp").unwrap();
        let dir = IndexDir::open(d.path()).unwrap();
        dir.write_file("a.tmp", b"hello", MetaFile::Journal)
            .unwrap();
        assert!(dir.rename("a.tmp", "a", MetaFile::Journal).unwrap());
        assert!(!dir.rename("a.tmp", "a", MetaFile::Journal).unwrap());
        dir.sync().unwrap();
        let f = dir.open_read("a").unwrap().unwrap();
        let mut s = String::new();
        std::io::Read::read_to_string(&mut &f, &mut s).unwrap();
        assert_eq!(s, "hello");
        assert!(dir.open_read("missing").unwrap().is_none());
        let kept = dir.keep_damaged("a", false, MetaFile::Journal).unwrap();
        assert!(kept.starts_with("a.damaged."));
        assert!(d.path().join("a").exists() && d.path().join(&kept).exists());
        dir.check_identity().unwrap();
        // The path now leads elsewhere: the directory was renamed and replaced.
        let moved = d.path().with_extension("moved");
        std::fs::rename(d.path(), &moved).unwrap();
        std::fs::create_dir(d.path()).unwrap();
        let e = dir.check_identity().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidPath, "{e}");
        assert!(e.to_string().contains("another directory"), "{e}");
        // Files still go to the directory the tier opened.
        dir.write_file("b", b"x", MetaFile::Checkpoint).unwrap();
        assert!(moved.join("b").exists() && !d.path().join("b").exists());
        std::fs::remove_dir_all(&moved).unwrap();
    }

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let d = tempfile::tempdir_in("/tmp").unwrap();
        let p = d.path().join("fifo");
        rustix::fs::mknodat(CWD, &p, FileType::Fifo, Mode::from_raw_mode(0o600), 0).unwrap();
        let dir = IndexDir::open(d.path()).unwrap();
        let e = dir.open_read("fifo").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidPath);
        assert!(e.to_string().contains("a FIFO"), "{e}");
        let e = open_regular(d.path(), OFlags::RDONLY).unwrap_err();
        assert!(e.to_string().contains("a directory"), "{e}");
    }
}
