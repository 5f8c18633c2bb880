//! The locks of a stripe set: each slab opened under its exclusive lock, and each directory's
//! own lock while a set's files are removed or created (`flock(LOCK_EX | LOCK_NB)`, retried
//! briefly), with errors that name the process holding one.

use std::fs::{File, OpenOptions, TryLockError};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, ErrorKind, Result};
use crate::g3::dirs::unwritable_reason;

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
