//! The data descriptor of a slab: O_DIRECT, probed with a real aligned read and write, or
//! buffered where `direct_io = "auto"` allows it; and the filesystem it lies on.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use crate::error::{Error, ErrorKind, Result};
use crate::g3::aligned::AlignedBuf;
use crate::g3::config::DirectIoMode;
use crate::g3::format::SUPERBLOCK_SIZE;
use crate::geometry::ROW_ALIGNMENT;

/// Opens the data descriptor of `p`: O_DIRECT, probed with a real aligned read and write of
/// the superblock page; on failure an error (`required`) or a buffered descriptor with one warning
/// (`auto`).
pub(super) fn open_data(p: &Path, mode: DirectIoMode) -> Result<(File, bool, String)> {
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
