//! The system calls the `fs` tier needs beyond `std`, through rustix: extended attributes on
//! an open file and `renameat2(RENAME_NOREPLACE)`, with `std::io::Error`s; and the random
//! suffix of the names it creates in a shared directory.

use std::ffi::CStr;
use std::fs::File;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::fs::{CWD, RenameFlags, XattrFlags};

/// `fsetxattr(file, name, value, 0)`.
pub(crate) fn set_xattr(file: &File, name: &CStr, value: &[u8]) -> io::Result<()> {
    rustix::fs::fsetxattr(file, name, value, XattrFlags::empty()).map_err(io::Error::from)
}

/// `fgetxattr(file, name)` into `buf`: `Ok(None)` when the file has no such attribute,
/// `Ok(Some(len))` with its length otherwise (`ERANGE` if `buf` is too small).
pub(crate) fn get_xattr(file: &File, name: &CStr, buf: &mut [u8]) -> io::Result<Option<usize>> {
    match rustix::fs::fgetxattr(file, name, buf) {
        Ok(n) => Ok(Some(n)),
        Err(e) if e == rustix::io::Errno::NODATA => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// `renameat2(from, to, RENAME_NOREPLACE)`: `EEXIST` when `to` exists; `EINVAL` (or
/// `ENOSYS`) where the filesystem or kernel does not support the flag.
pub(crate) fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    rustix::fs::renameat_with(CWD, from, CWD, to, RenameFlags::NOREPLACE).map_err(io::Error::from)
}

/// Whether an errno says the filesystem lacks a feature (rather than that the call failed).
pub(crate) fn is_unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOTSUP) | Some(libc::ENOSYS) | Some(libc::EINVAL) | Some(libc::EPERM)
    )
}

/// A random 64-bit suffix, unique within the process and unlikely to repeat across hosts.
pub(crate) fn unique_suffix() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let seed = *SEED.get_or_init(|| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.finish()
    });
    // splitmix64 of seed + counter: distinct per call, spread over all 64 bits.
    let mut z = seed.wrapping_add(
        COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15),
    );
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
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
