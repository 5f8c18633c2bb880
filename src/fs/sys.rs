//! The system calls the `fs` tier needs beyond `std`: extended attributes on an open file and
//! `renameat2(RENAME_NOREPLACE)`. The only unsafe code of the tier's file handling.

use std::ffi::{CStr, CString};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

fn c_path(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

/// `fsetxattr(file, name, value, 0)`.
pub(crate) fn set_xattr(file: &File, name: &CStr, value: &[u8]) -> io::Result<()> {
    // SAFETY: `name` is NUL-terminated, `value` is valid for `value.len()` bytes, and the
    // descriptor is owned by `file`, which outlives the call.
    let rc = unsafe {
        libc::fsetxattr(
            file.as_raw_fd(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `fgetxattr(file, name)` into `buf`: `Ok(None)` when the file has no such attribute,
/// `Ok(Some(len))` with its length otherwise (`ERANGE` if `buf` is too small).
pub(crate) fn get_xattr(file: &File, name: &CStr, buf: &mut [u8]) -> io::Result<Option<usize>> {
    // SAFETY: `name` is NUL-terminated, `buf` is writable for `buf.len()` bytes, and the
    // descriptor is owned by `file`, which outlives the call.
    let rc = unsafe {
        libc::fgetxattr(
            file.as_raw_fd(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if rc >= 0 {
        return Ok(Some(rc as usize));
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::ENODATA) {
        Ok(None)
    } else {
        Err(e)
    }
}

/// `renameat2(from, to, RENAME_NOREPLACE)`: `EEXIST` when `to` exists; `EINVAL` (or
/// `ENOSYS`) where the filesystem or kernel does not support the flag.
pub(crate) fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    let (f, t) = (c_path(from)?, c_path(to)?);
    // SAFETY: both paths are NUL-terminated; AT_FDCWD makes them relative to the cwd (they
    // are absolute or relative as the caller gave them).
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            f.as_ptr(),
            libc::AT_FDCWD,
            t.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Whether an errno says the filesystem lacks a feature (rather than that the call failed).
pub(crate) fn is_unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOTSUP) | Some(libc::ENOSYS) | Some(libc::EINVAL) | Some(libc::EPERM)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xattr_round_trip_and_noreplace() {
        let d = tempfile::tempdir_in("/tmp").unwrap();
        let p = d.path().join("f");
        let f = File::create(&p).unwrap();
        let mut buf = [0u8; 8];
        assert_eq!(get_xattr(&f, c"user.kvtier.test", &mut buf).unwrap(), None);
        match set_xattr(&f, c"user.kvtier.test", b"abc") {
            Ok(()) => {
                assert_eq!(
                    get_xattr(&f, c"user.kvtier.test", &mut buf).unwrap(),
                    Some(3)
                );
                assert_eq!(&buf[..3], b"abc");
            }
            Err(e) if is_unsupported(&e) => {
                crate::skip_test!("/tmp has no user xattrs here: {e}");
            }
            Err(e) => panic!("fsetxattr: {e}"),
        }
        let q = d.path().join("g");
        std::fs::write(&q, b"x").unwrap();
        let e = rename_noreplace(&q, &p).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EEXIST));
        rename_noreplace(&q, &d.path().join("h")).unwrap();
        assert!(!q.exists());
    }
}
