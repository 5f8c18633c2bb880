//! Checks and syncs of the directories that hold a stripe set.
//!
//! A directory kvtier cannot create or sync files in (a pseudo filesystem such as `/proc`, a
//! read-only mount, a folder without write permission) is the user's mistake, not an I/O
//! failure: it is reported as [`ErrorKind::InvalidPath`] naming the directory and the reason,
//! before anything is created where possible ([`check_writable_dir`]).

use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::Access;

use crate::error::{Error, ErrorKind, Result};

/// Why a directory does not take slab files, when an OS error on a directory operation says
/// it is the directory's fault (`EINVAL`, `EROFS`, `EACCES`, `EPERM`).
pub fn unwritable_reason(e: &std::io::Error) -> Option<&'static str> {
    match e.raw_os_error()? {
        libc::EINVAL => Some("not a writable local filesystem"),
        libc::EROFS => Some("on a read-only filesystem"),
        libc::EACCES | libc::EPERM => Some("not writable (permission denied)"),
        _ => None,
    }
}

/// The [`ErrorKind::InvalidPath`] error for `dir`, which refused `op` with `e`.
fn unwritable(dir: &Path, op: &str, reason: &str, e: std::io::Error) -> Error {
    Error::new(
        ErrorKind::InvalidPath,
        format!(
            "G3 path {} is {reason}: {op} failed: {e} (choose a directory on a local, \
             writable filesystem)",
            dir.display()
        ),
    )
    .with("path", dir.display().to_string())
    .with_source(e)
}

/// fsyncs a directory (after creating, renaming or removing entries in it). A directory that
/// cannot be synced because of what it is (see [`unwritable_reason`]) is an
/// [`ErrorKind::InvalidPath`] error; any other failure is an I/O error.
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| match unwritable_reason(&e) {
            Some(reason) => unwritable(dir, "fsync directory", reason, e),
            None => Error::io("fsync directory", dir, e),
        })
}

/// `statfs` magics of kernel pseudo filesystems, which never hold slab files.
const PSEUDO_FILESYSTEMS: [(u64, &str); 12] = [
    (0x9fa0, "proc"),
    (0x6265_6572, "sysfs"),
    (0x0027_e0eb, "cgroup"),
    (0x6367_7270, "cgroup2"),
    (0x6462_6720, "debugfs"),
    (0x7472_6163, "tracefs"),
    (0x7363_6673, "securityfs"),
    (0x1cd1, "devpts"),
    (0xcafe_4a11, "bpf"),
    (0x6165_676c, "pstore"),
    (0xde5e_81e4, "efivarfs"),
    (0x6265_6570, "configfs"),
];

/// Checks, before anything is created, that slab, journal and checkpoint files can be made in
/// `dir`: not a kernel pseudo filesystem, not a read-only mount, writable by this process.
/// Every refusal is an [`ErrorKind::InvalidPath`] error naming `dir` and the reason.
pub fn check_writable_dir(dir: &Path) -> Result<()> {
    if dir.as_os_str().as_bytes().contains(&0) {
        return Err(Error::new(
            ErrorKind::InvalidPath,
            format!("G3 path {} contains a NUL byte", dir.display()),
        )
        .with("path", dir.display().to_string()));
    }
    if let Ok(magic) = crate::io::probe::statfs_magic(dir)
        && let Some((_, name)) = PSEUDO_FILESYSTEMS.iter().find(|(m, _)| *m == magic)
    {
        return Err(Error::new(
            ErrorKind::InvalidPath,
            format!(
                "G3 path {} is not a writable local filesystem (it is on the kernel's \
                     {name} pseudo filesystem; choose a directory on a local disk)",
                dir.display()
            ),
        )
        .with("path", dir.display().to_string())
        .with("filesystem", *name));
    }
    if let Err(e) = rustix::fs::access(dir, Access::WRITE_OK | Access::EXEC_OK) {
        let e = std::io::Error::from(e);
        let reason = unwritable_reason(&e).unwrap_or("not usable");
        return Err(unwritable(dir, "access check", reason, e));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_is_refused_as_a_user_mistake() {
        let proc = Path::new("/proc");
        if !proc.join("self").exists() {
            crate::skip_test!("no /proc here");
            return;
        }
        let e = check_writable_dir(proc).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidPath, "{e}");
        assert!(e.to_string().contains("/proc"), "{e}");
        assert!(
            e.to_string().contains("not a writable local filesystem"),
            "{e}"
        );
        // fsync of /proc fails with EINVAL: the user's mistake, not an I/O error.
        let e = sync_dir(proc).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidPath, "{e}");
        assert!(e.to_string().contains("/proc"), "{e}");
    }

    #[test]
    fn an_ordinary_directory_passes() {
        let d = tempfile::tempdir_in("/tmp").unwrap();
        check_writable_dir(d.path()).unwrap();
        sync_dir(d.path()).unwrap();
    }

    #[test]
    fn only_directory_mistakes_are_user_errors() {
        for errno in [libc::EINVAL, libc::EROFS, libc::EACCES, libc::EPERM] {
            assert!(unwritable_reason(&std::io::Error::from_raw_os_error(errno)).is_some());
        }
        for errno in [libc::EIO, libc::ENOSPC] {
            assert!(unwritable_reason(&std::io::Error::from_raw_os_error(errno)).is_none());
        }
    }
}
