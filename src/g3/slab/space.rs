//! Disk space for slabs: free space checked before a slab is preallocated, and before a
//! format removes anything.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, ErrorKind, Result};
use crate::g3::format::slab_file_len;
use crate::size::format_size_human;

/// `posix_fallocate` of `len` bytes, after checking free space; ENOSPC names the path, the
/// bytes needed and the bytes available.
pub(super) fn preallocate(f: &File, p: &Path, len: u64) -> Result<()> {
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
    libc::off_t::try_from(len).map_err(|_| no_space(available))?;
    match crate::io::posix_fallocate(f, len) {
        Ok(()) => Ok(()),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) => Err(no_space(
            available_bytes(p.parent().unwrap_or(Path::new("."))),
        )),
        Err(e) => Err(Error::io("posix_fallocate", p, e)),
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
