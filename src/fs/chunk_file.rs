//! The blocking steps around one chunk file's transfer, run on the tier's I/O threads:
//!
//! * **Store**: a temporary file `<name>.bin_<16 hex>.tmp` next to the final name, created
//!   with `O_CREAT | O_EXCL` (and `O_DIRECT` when the tier uses it), its CRC record set, then
//!   (after the engine wrote the row) published: `renameat2(RENAME_NOREPLACE)`, or where the
//!   filesystem lacks it `link` + `unlink`, or as a last resort `rename`. A final name that
//!   exists already means the chunk is there (names are content addresses): the temporary
//!   file is removed and the store is done. A partial file is never visible under a final
//!   name, and a failed store removes its temporary file.
//! * **Load**: open, check that the file is exactly one row long, read its CRC record.
//!
//! [`probe_publish`] picks the publish method once per tier at start.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use parking_lot::Mutex;

use crate::error::{Error, ErrorKind, Result};
use crate::fs::integrity::CrcRecord;
use crate::fs::sys;

/// How a temporary file is published under its final name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishMode {
    /// `renameat2(RENAME_NOREPLACE)`: atomic, never replaces.
    NoReplace,
    /// `link(tmp, final)` then `unlink(tmp)`: atomic, never replaces.
    Link,
    /// `rename(tmp, final)`: atomic, replaces a file that appeared meanwhile (same bytes).
    Rename,
}

impl PublishMode {
    /// A short name for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            PublishMode::NoReplace => "noreplace",
            PublishMode::Link => "link",
            PublishMode::Rename => "rename",
        }
    }
}

/// Whether a publish made the file or found it there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Published {
    /// This store's file is now the chunk's file.
    New,
    /// Another writer's file was there first (same content address); this one was dropped.
    AlreadyThere,
}

/// Picks the publish method that works in `dir` (trying them on scratch files there).
pub fn probe_publish(dir: &Path) -> Result<PublishMode> {
    let tag = sys::unique_suffix();
    let a = dir.join(format!(".kvtier-publish-probe-{tag:016x}-a"));
    let b = dir.join(format!(".kvtier-publish-probe-{tag:016x}-b"));
    let c = dir.join(format!(".kvtier-publish-probe-{tag:016x}-c"));
    let create = |p: &Path| {
        File::create(p).map_err(|e| {
            Error::new(
                ErrorKind::InvalidPath,
                format!("cannot create files in {}: {e}", dir.display()),
            )
            .with("path", dir.display().to_string())
            .with_source(e)
        })
    };
    create(&a)?;
    create(&b)?;
    let mode = match sys::rename_noreplace(&a, &b) {
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
            // It refused to replace: now check that it really renames.
            match sys::rename_noreplace(&a, &c) {
                Ok(()) => PublishMode::NoReplace,
                Err(_) => link_or_rename(&a, &b),
            }
        }
        // It replaced `b` (the flag was ignored) or is not supported.
        _ => link_or_rename(&a, &b),
    };
    for p in [&a, &b, &c] {
        let _ = std::fs::remove_file(p);
    }
    Ok(mode)
}

fn link_or_rename(a: &Path, b: &Path) -> PublishMode {
    let _ = File::create(a);
    let _ = File::create(b);
    match std::fs::hard_link(a, b) {
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => PublishMode::Link,
        _ => PublishMode::Rename,
    }
}

/// Whether a file name is a temporary file of a store in progress (kvtier's or vLLM's, both
/// `<hex>.bin_<suffix>.tmp`).
pub fn is_temp_name(name: &str) -> bool {
    name.ends_with(".tmp") && name.contains(".bin_")
}

/// Directories this process has made sure exist, so that each store does not ask again.
#[derive(Debug, Default)]
pub struct DirCache {
    known: Mutex<HashSet<PathBuf>>,
}

/// Directories remembered before the cache starts over (about 100 bytes each).
const DIR_CACHE_LIMIT: usize = 1 << 16;

impl DirCache {
    fn ensure(&self, dir: &Path, again: bool) -> io::Result<()> {
        if !again && self.known.lock().contains(dir) {
            return Ok(());
        }
        std::fs::create_dir_all(dir)?;
        let mut known = self.known.lock();
        if known.len() >= DIR_CACHE_LIMIT {
            known.clear();
        }
        known.insert(dir.to_path_buf());
        Ok(())
    }
}

fn io_err(op: &str, path: &Path, e: io::Error) -> Error {
    let kind = match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => ErrorKind::NoSpace,
        _ => ErrorKind::Io,
    };
    let mut err = Error::new(kind, format!("{op} {}: {e}", path.display()))
        .with("path", path.display().to_string())
        .with("op", op.to_string());
    if let Some(errno) = e.raw_os_error() {
        err = err.with("errno", errno.to_string());
    }
    err.with_source(e)
}

/// Creates the temporary file for `dest` (`O_CREAT | O_EXCL`, mode 0644), making the parent
/// directories as needed, and sets `record` on it (when given).
pub fn create_temp(
    dest: &Path,
    direct: bool,
    dirs: &DirCache,
    record: Option<CrcRecord>,
) -> Result<(File, PathBuf)> {
    let parent = dest.parent().unwrap_or(Path::new("."));
    let open = |tmp: &Path| {
        let mut o = OpenOptions::new();
        o.write(true).create_new(true).mode(0o644);
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        o.open(tmp)
    };
    let mut made_dirs = false;
    let mut attempts = 0;
    loop {
        attempts += 1;
        let tmp = PathBuf::from(format!(
            "{}_{:016x}.tmp",
            dest.display(),
            sys::unique_suffix()
        ));
        dirs.ensure(parent, made_dirs)
            .map_err(|e| io_err("create directory", parent, e))?;
        match open(&tmp) {
            Ok(file) => {
                if let Some(r) = record
                    && let Err(e) = r.write_to(&file)
                {
                    drop(file);
                    let _ = std::fs::remove_file(&tmp);
                    return Err(io_err("set the CRC record of", &tmp, e));
                }
                return Ok((file, tmp));
            }
            // The directory went away (removed by another host) or was never made: once more.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) && !made_dirs => made_dirs = true,
            // Another writer drew the same name: draw again.
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) && attempts < 4 => {}
            Err(e) => return Err(io_err("create", &tmp, e)),
        }
    }
}

/// Publishes the written temporary file `tmp` as `dest`; removes `tmp` in every case but a
/// plain rename that succeeded.
pub fn publish(tmp: &Path, dest: &Path, mode: PublishMode) -> Result<Published> {
    let outcome = match mode {
        PublishMode::NoReplace => match sys::rename_noreplace(tmp, dest) {
            Ok(()) => return Ok(Published::New),
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(Published::AlreadyThere),
            Err(e) => Err(io_err("rename (no replace)", dest, e)),
        },
        PublishMode::Link => match std::fs::hard_link(tmp, dest) {
            Ok(()) => Ok(Published::New),
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(Published::AlreadyThere),
            Err(e) => Err(io_err("link", dest, e)),
        },
        PublishMode::Rename => match std::fs::rename(tmp, dest) {
            Ok(()) => return Ok(Published::New),
            // Some shared filesystems refuse to replace; the file there has the same bytes.
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(Published::AlreadyThere),
            Err(e) => Err(io_err("rename", dest, e)),
        },
    };
    discard_temp(tmp);
    outcome
}

/// Removes a temporary file (a failed or superseded store).
pub fn discard_temp(tmp: &Path) {
    if let Err(e) = std::fs::remove_file(tmp)
        && e.kind() != io::ErrorKind::NotFound
    {
        log::warn!("cannot remove temporary file {}: {e}", tmp.display());
    }
}

/// Whether a complete chunk file is at `path` already (a regular file of `len` bytes).
pub fn exists_complete(path: &Path, len: u64) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() == len)
}

/// Before a store: `true` if a complete chunk file is at `path` (nothing to write). A file of
/// another size there is broken (final names are only given to complete files) and is
/// removed, so that this store can publish in its place.
pub fn check_existing(path: &Path, len: u64) -> bool {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_file() && m.len() == len => true,
        Ok(m) if m.is_file() => {
            if remove_if_same(path, (m.dev(), m.ino())) {
                log::warn!(
                    "removed {} ({} bytes, not one row of {len}) before storing it again",
                    path.display(),
                    m.len()
                );
            }
            false
        }
        _ => false,
    }
}

/// A chunk file opened for a load.
#[derive(Debug)]
pub struct LoadFile {
    /// The open file.
    pub file: File,
    /// Its CRC record, if it has one.
    pub record: Option<CrcRecord>,
    /// `(st_dev, st_ino)`, to remove exactly this file if it turns out corrupt.
    pub identity: (u64, u64),
}

/// Opens `path` for a load and checks that it is a regular file of exactly `len` bytes whose
/// record (if any) says `len` too. A missing file is an [`ErrorKind::InvalidPath`] error
/// (`errno` ENOENT in its context); the wrong size or record is [`ErrorKind::Corrupt`].
pub fn open_for_load(path: &Path, len: u64, direct: bool) -> Result<LoadFile> {
    let mut o = OpenOptions::new();
    o.read(true);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    let file = o.open(path).map_err(|e| {
        if e.raw_os_error() == Some(libc::ENOENT) {
            Error::new(
                ErrorKind::InvalidPath,
                format!("chunk file {} is gone", path.display()),
            )
            .with("path", path.display().to_string())
            .with("errno", libc::ENOENT.to_string())
        } else {
            io_err("open", path, e)
        }
    })?;
    let meta = file.metadata().map_err(|e| io_err("fstat", path, e))?;
    if !meta.is_file() || meta.len() != len {
        // Final names are only ever given to complete files: this one is broken. Remove it
        // (unless another host replaced it meanwhile), so that a new store can take its place.
        let removed = meta.is_file() && remove_if_same(path, (meta.dev(), meta.ino()));
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!(
                "chunk file {} has {} bytes, not one row of {len}",
                path.display(),
                meta.len()
            ),
        )
        .with("path", path.display().to_string())
        .with("expected", len.to_string())
        .with("found", meta.len().to_string())
        .with("removed", removed.to_string()));
    }
    let record = CrcRecord::read_from(&file, path)?;
    if let Some(r) = record
        && r.len != len
    {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!(
                "the CRC record of {} covers {} bytes, not the file's {len}",
                path.display(),
                r.len
            ),
        )
        .with("path", path.display().to_string()));
    }
    Ok(LoadFile {
        file,
        record,
        identity: (meta.dev(), meta.ino()),
    })
}

/// Removes `path` if it is still the file with `identity` (a corrupt file this load read, not
/// a good one another host published since). Returns whether it removed it.
pub fn remove_if_same(path: &Path, identity: (u64, u64)) -> bool {
    match std::fs::symlink_metadata(path) {
        Ok(m) if (m.dev(), m.ino()) == identity => std::fs::remove_file(path).is_ok(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_steps_publish_once_and_leave_no_temp() {
        let d = tempfile::tempdir_in("/tmp").unwrap();
        let mode = probe_publish(d.path()).unwrap();
        assert_eq!(
            mode,
            PublishMode::NoReplace,
            "ext4 supports RENAME_NOREPLACE"
        );
        let dest = d.path().join("abc/de_g0/abcdef.bin");
        let dirs = DirCache::default();
        let (f1, t1) = create_temp(&dest, false, &dirs, None).unwrap();
        let (f2, t2) = create_temp(&dest, false, &dirs, None).unwrap();
        assert_ne!(t1, t2);
        assert!(is_temp_name(t1.file_name().unwrap().to_str().unwrap()));
        use std::io::Write;
        (&f1).write_all(b"one").unwrap();
        (&f2).write_all(b"one").unwrap();
        assert_eq!(publish(&t1, &dest, mode).unwrap(), Published::New);
        assert_eq!(publish(&t2, &dest, mode).unwrap(), Published::AlreadyThere);
        assert!(!t1.exists() && !t2.exists());
        assert!(exists_complete(&dest, 3));
        assert!(!exists_complete(&dest, 4));
        for m in [PublishMode::Link, PublishMode::Rename] {
            let (_, t) = create_temp(&dest, false, &dirs, None).unwrap();
            publish(&t, &dest, m).unwrap();
            assert!(!t.exists(), "{m:?} left {}", t.display());
        }
        let names: Vec<_> = std::fs::read_dir(dest.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("abcdef.bin")]);
    }

    #[test]
    fn loads_check_size_and_identity() {
        let d = tempfile::tempdir_in("/tmp").unwrap();
        let p = d.path().join("x.bin");
        let e = open_for_load(&p, 4096, false).unwrap_err();
        assert_eq!(e.context_value("errno"), Some("2"), "{e}");
        std::fs::write(&p, vec![1u8; 100]).unwrap();
        let e = open_for_load(&p, 4096, false).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
        assert_eq!(e.context_value("removed"), Some("true"));
        assert!(!p.exists(), "a broken file is removed");
        std::fs::write(&p, vec![1u8; 100]).unwrap();
        assert!(!check_existing(&p, 4096));
        assert!(!p.exists());
        std::fs::write(&p, vec![1u8; 4096]).unwrap();
        assert!(check_existing(&p, 4096));
        let lf = open_for_load(&p, 4096, true).unwrap();
        assert_eq!(lf.record, None);
        // A file published since (another inode) is not removed.
        std::fs::remove_file(&p).unwrap();
        std::fs::write(&p, vec![2u8; 4096]).unwrap();
        assert!(!remove_if_same(&p, lf.identity));
        let lf = open_for_load(&p, 4096, false).unwrap();
        assert!(remove_if_same(&p, lf.identity));
        assert!(!p.exists());
    }
}
