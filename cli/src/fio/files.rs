//! Test files for `kvtier fio-compare`, prepared identically for both sides: truncated,
//! preallocated with `fallocate`, then written in full once with O_DIRECT and synced, so every
//! measured pass overwrites or reads written extents (never fresh, unwritten ones).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustix::fs::FallocateFlags;

use crate::region_arg::BenchRegion;
use kvtier::error::{Error, Result};
use kvtier::geometry::ROW_ALIGNMENT;
use kvtier::region::PrimaryRegion;

/// Bytes per write while filling (a multiple of [`ROW_ALIGNMENT`]).
const FILL_CHUNK: usize = 8 << 20;

/// Prepares every file: `len` bytes (a multiple of `row_size`), preallocated and written.
pub fn prepare(files: &[PathBuf], len: u64, row_size: u64) -> Result<()> {
    let chunk = FILL_CHUNK.min(len as usize).max(ROW_ALIGNMENT) / ROW_ALIGNMENT * ROW_ALIGNMENT;
    let buffer = PrimaryRegion::create(1, chunk as u64)?;
    // `buffer` is a private region owned by this function; nothing else reads or writes
    // it while this view lives.
    let mut bytes = buffer.write_row(0)?;
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes()[7];
    }
    for path in files {
        fill(path, len, &bytes)?;
    }
    debug_assert!(len.is_multiple_of(row_size));
    Ok(())
}

/// The buffer rows of kvtier's side: two rows of `row_size` bytes per request in flight at
/// `max_depth` (a mixed pass runs a writer and a reader, each at the full depth; both sides
/// pass their largest depth times their buffer sets), in the region `kind` (kvtier's own, or
/// one made and adopted as vLLM's).
pub fn buffer_region(
    row_size: u64,
    max_depth: u32,
    kind: BenchRegion,
) -> Result<Arc<PrimaryRegion>> {
    let rows = 2 * max_depth.max(1) as usize;
    Ok(Arc::new(kind.create(rows, row_size)?))
}

/// How the buffer rows are backed, in the words the report uses: an O_DIRECT transfer is one
/// DMA segment per physically contiguous run, so 4 KiB pages split a large row into many.
pub fn page_note(region: &PrimaryRegion) -> String {
    format!("buffers in {}", crate::region_arg::pages_note(region))
}

/// Opens a prepared file for O_DIRECT reads and writes.
pub fn open_direct(path: &Path) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| Error::io("open (O_DIRECT)", path, e))
}

fn fill(path: &Path, len: u64, bytes: &[u8]) -> Result<()> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| Error::io("create (O_DIRECT)", path, e))?;
    if let Err(e) = rustix::fs::fallocate(&file, FallocateFlags::empty(), 0, len) {
        return Err(Error::io("fallocate", path, e.into()).with("needed", len.to_string()));
    }
    let mut offset = 0u64;
    while offset < len {
        let n = (len - offset).min(bytes.len() as u64) as usize;
        file.write_all_at(&bytes[..n], offset)
            .map_err(|e| Error::io("write", path, e).with("offset", offset.to_string()))?;
        offset += n as u64;
    }
    file.sync_all().map_err(|e| Error::io("fsync", path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prepared_files_are_fully_written_and_allocated() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let files = vec![dir.path().join("a.dat"), dir.path().join("b.dat")];
        std::fs::write(&files[1], vec![0u8; 3 << 20]).unwrap(); // a larger stale file
        prepare(&files, 1 << 20, 256 << 10).unwrap();
        for f in &files {
            let meta = std::fs::metadata(f).unwrap();
            assert_eq!(meta.len(), 1 << 20);
            let data = std::fs::read(f).unwrap();
            assert!(data.iter().any(|&b| b != 0), "file was not written");
            let f = open_direct(f).unwrap();
            drop(f);
        }
        let e = prepare(&[dir.path().join("missing/x.dat")], 4096, 4096).unwrap_err();
        assert!(e.to_string().contains("missing/x.dat"), "{e}");
    }
}
