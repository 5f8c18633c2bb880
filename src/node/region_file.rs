//! An engine's region as the node service's own threads touch it: through the region file's
//! descriptor and kernel copies, never through CPU loads and stores on the mapping.
//!
//! The service maps each engine's region file `MAP_SHARED` (for io_uring). The engine owns
//! the file and may, by a bug, shrink it while it is mapped. A CPU access to a page of the
//! mapping beyond the file's new end raises `SIGBUS`, which would kill the service and stop
//! every other engine. A kernel copy of the same bytes fails instead (checked on Linux 6.18,
//! tmpfs in `/dev/shm`, truncation to 0 and to half, see `docs/node-service.md`):
//!
//! * `pread` of the region file past its end returns short (0 bytes);
//! * a copy *into* the mapping by the kernel (here: `pread` from the staging pool's memfd
//!   with the engine's row as the destination) fails with `EFAULT`, without extending the
//!   file (a `pwrite` to the region file would extend it again);
//! * an io_uring or `pread`/`pwrite` O_DIRECT transfer with the mapping as its buffer fails
//!   with `EFAULT`, except with registered buffers: their pages were pinned at registration,
//!   so the transfer "succeeds" into or out of pages the file no longer holds.
//!
//! So every CPU access goes through this module: the CRC of a store's row and of a loaded row
//! ([`RegionFile::crc`], `pread` in chunks through a small buffer that stays in cache),
//! the copy of a loaded row into the staging pool ([`RegionFile::read_into`]) and the copy of
//! a staged chunk into an engine's row ([`RegionFile::copy_into_row`]). A failed copy is an
//! error for that job ([`ErrorKind::RegionLost`]). For the registered-buffer case, and to
//! name what happened, [`RegionFile::check`] compares the file's size with the registered
//! bytes before and after every job (and before a job's G3 part commits anything): a job
//! that overlaps a shrink fails.
//!
//! Not seen: a shrink *and* a regrow back to the size between two checks (the file's change
//! time cannot tell: every first write to a page through any shared mapping updates it). The
//! registered pages are then no longer the file's: a load's CRC, read through the file,
//! fails (the chunk is dropped from G3 as a damaged one would be) and a store's bytes fail
//! their CRC at their first load. No wrong byte is returned either way.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use crate::error::{Error, ErrorKind, Result};
use crate::region::{PrimaryRegion, RowCopyError};

/// Bytes of a row read per `pread` for its CRC: small enough to stay in the L2 cache between
/// the kernel's copy and the CRC.
pub const CRC_CHUNK: usize = 64 * 1024;

/// The size of the file behind `fd`.
fn size(fd: BorrowedFd<'_>) -> std::io::Result<u64> {
    let st = rustix::fs::fstat(fd)?;
    Ok(u64::try_from(st.st_size).unwrap_or(0))
}

/// An engine's registered region file: its descriptor, what it held at registration, and the
/// names an error about it gives.
#[derive(Debug)]
pub struct RegionFile {
    fd: OwnedFd,
    engine: String,
    path: String,
    /// Bytes registered (rows times row stride).
    len: u64,
}

impl RegionFile {
    /// Takes the region file of `engine` (`path`: its path, or `fd` for a descriptor) whose
    /// first `len` bytes are registered; fails if the file is already shorter.
    pub fn new(fd: OwnedFd, engine: &str, path: &str, len: u64) -> Result<RegionFile> {
        let found = size(fd.as_fd()).map_err(|e| {
            Error::new(
                ErrorKind::Io,
                format!("fstat of engine {engine:?}'s region {path} failed"),
            )
            .with_source(e)
        })?;
        if found < len {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "engine {engine:?}'s region {path} holds {found} bytes, fewer than the \
                     {len} registered (it shrank while it was being mapped)"
                ),
            ));
        }
        Ok(RegionFile {
            fd,
            engine: engine.to_string(),
            path: path.to_string(),
            len,
        })
    }

    /// Whether the file still holds the registered bytes (one `fstat`). The error
    /// ([`ErrorKind::RegionLost`]) names the engine, the path, the bytes registered, what the
    /// file holds now, and `when` the loss was seen (`before the job`, ...).
    pub fn check(&self, when: &str) -> Result<()> {
        match size(self.fd.as_fd()) {
            Ok(now) if now >= self.len => Ok(()),
            Ok(now) => Err(self.lost(Some(now), None, when)),
            Err(e) => Err(self.lost(None, Some(e), when)),
        }
    }

    /// The error for a lost region: `now` is the file's size if known, `cause` what failed,
    /// `when` where it was seen.
    fn lost(&self, now: Option<u64>, cause: Option<std::io::Error>, when: &str) -> Error {
        let now = now.or_else(|| size(self.fd.as_fd()).ok());
        let found = now.map_or_else(|| "an unknown number of".to_string(), |s| s.to_string());
        let what = match now {
            Some(s) if s < self.len => "was shrunk",
            _ => "could not be copied",
        };
        let mut e = Error::new(
            ErrorKind::RegionLost,
            format!(
                "engine {:?}'s region {} {what} while the service had it registered: {} bytes \
                 registered, the file holds {found} bytes now (seen {when}{}); the service \
                 ends the engine's session, the chunks in G3 are unaffected",
                self.engine,
                self.path,
                self.len,
                cause
                    .as_ref()
                    .map_or_else(String::new, |c| format!(": {c}")),
            ),
        )
        .with("engine", self.engine.clone())
        .with("path", self.path.clone())
        .with("expected_bytes", self.len.to_string())
        .with("found_bytes", found);
        if let Some(c) = cause {
            e = e.with_source(c);
        }
        e
    }

    /// The error for a copy of `[offset, offset + len)` that failed (`cause`) or came short.
    fn copy_failed(&self, offset: u64, len: usize, cause: Option<std::io::Error>) -> Error {
        let why = cause.map_or_else(
            || format!("a copy of bytes [{offset}, +{len}) came short"),
            |c| format!("a copy of bytes [{offset}, +{len}) failed: {c}"),
        );
        // The file's size says what happened to it; the failed copy is the cause.
        self.lost(None, Some(std::io::Error::other(why)), "in a copy")
    }

    fn range(&self, offset: u64, len: usize) -> Result<()> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::new(
                ErrorKind::Contract,
                format!(
                    "bytes [{offset}, +{len}) are outside the {}-byte region of engine {:?}",
                    self.len, self.engine
                ),
            )),
        }
    }

    /// Reads `dst.len()` bytes of the region from `offset` into `dst` (the service's own
    /// memory) with `pread`. A shrunk file reads short: an error, never a signal.
    pub fn read_into(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.range(offset, dst.len())?;
        let mut done = 0;
        while done < dst.len() {
            match rustix::io::pread(&self.fd, &mut dst[done..], offset + done as u64) {
                Ok(0) => return Err(self.copy_failed(offset, dst.len(), None)),
                Ok(n) => done += n,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => {
                    return Err(self.copy_failed(offset, dst.len(), Some(e.into())));
                }
            }
        }
        Ok(())
    }

    /// The CRC-32 (IEEE, what `crc32fast` computes) of the region's `len` bytes from
    /// `offset`, read through `chunk` (the caller's buffer, [`CRC_CHUNK`] bytes is right).
    pub fn crc(&self, offset: u64, len: usize, chunk: &mut [u8]) -> Result<u32> {
        self.range(offset, len)?;
        if chunk.is_empty() {
            return Err(Error::new(ErrorKind::Internal, "a CRC needs a buffer"));
        }
        let mut h = crc32fast::Hasher::new();
        let mut done = 0;
        while done < len {
            let n = chunk.len().min(len - done);
            let part = &mut chunk[..n];
            self.read_into(offset + done as u64, part)?;
            h.update(part);
            done += n;
        }
        Ok(h.finalize())
    }

    /// Copies `len` bytes of the file `src` from `src_offset` into row `row` of `mapped`,
    /// the service's mapping of this region file: the kernel writes them (`pread` of `src`
    /// with the row as the buffer, [`PrimaryRegion::copy_file_into_row`]), so a page the
    /// region file lost fails the copy with `EFAULT` instead of raising `SIGBUS`, and the
    /// region file is not extended. The engine gave the row to a load job; the copy holds a
    /// write lease on it.
    pub fn copy_into_row(
        &self,
        mapped: &PrimaryRegion,
        row: usize,
        len: usize,
        src: BorrowedFd<'_>,
        src_offset: u64,
    ) -> Result<()> {
        let offset = row as u64 * mapped.row_stride();
        self.range(offset, len)?;
        match mapped.copy_file_into_row(row, len, src, src_offset)? {
            Ok(()) => Ok(()),
            Err(RowCopyError::Short) => Err(self.copy_failed(offset, len, None)),
            Err(RowCopyError::SourceOffset) => {
                Err(Error::new(ErrorKind::Internal, "source offset overflow"))
            }
            Err(RowCopyError::Os(e)) => Err(self.copy_failed(offset, len, Some(e))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STRIDE: usize = 64 * 1024;
    const ROWS: usize = 4;

    fn memfd(len: usize) -> OwnedFd {
        let fd =
            rustix::fs::memfd_create(c"kvtier-region-file-test", rustix::fs::MemfdFlags::CLOEXEC)
                .unwrap();
        rustix::fs::ftruncate(&fd, len as u64).unwrap();
        fd
    }

    fn pattern(i: usize) -> u8 {
        (i * 31 + i / 4096) as u8
    }

    /// A region file mapped by the service, its bytes a pattern, and the same file as a
    /// [`RegionFile`].
    fn region() -> (PrimaryRegion, RegionFile, OwnedFd) {
        let fd = memfd(STRIDE * ROWS);
        let bytes: Vec<u8> = (0..STRIDE * ROWS).map(pattern).collect();
        rustix::io::pwrite(&fd, &bytes, 0).unwrap();
        let mapped = PrimaryRegion::map_shared_file(&fd, ROWS, STRIDE as u64).unwrap();
        let engine_side = fd.try_clone().unwrap();
        let file = RegionFile::new(fd, "engine-a", "fd", (STRIDE * ROWS) as u64).unwrap();
        (mapped, file, engine_side)
    }

    #[test]
    fn crc_and_copies_go_through_the_kernel_and_match_the_bytes() {
        let (mapped, file, _engine) = region();
        let mut chunk = vec![0u8; 1000]; // not a divisor of the row: the last piece is short
        let expected: Vec<u8> = (STRIDE..2 * STRIDE).map(pattern).collect();
        assert_eq!(
            file.crc(STRIDE as u64, STRIDE, &mut chunk).unwrap(),
            crc32fast::hash(&expected)
        );
        let mut row = vec![0u8; STRIDE];
        file.read_into(STRIDE as u64, &mut row).unwrap();
        assert!(row == expected);
        // A copy from another file into row 2 of the mapping.
        let src = memfd(STRIDE);
        rustix::io::pwrite(&src, &[7u8; STRIDE], 0).unwrap();
        file.copy_into_row(&mapped, 2, STRIDE, src.as_fd(), 0)
            .unwrap();
        file.read_into(2 * STRIDE as u64, &mut row).unwrap();
        assert!(row.iter().all(|b| *b == 7));
        file.check("now").unwrap();
        // Outside the region: a contract error, nothing read.
        let e = file
            .read_into((ROWS * STRIDE) as u64 - 1, &mut row)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Contract);
    }

    #[test]
    fn a_shrunk_file_fails_each_copy_and_the_check_names_the_sizes() {
        let (mapped, file, engine) = region();
        // The owner shrinks its file to half: rows 2 and 3 are gone.
        rustix::fs::ftruncate(&engine, (2 * STRIDE) as u64).unwrap();
        let mut chunk = vec![0u8; CRC_CHUNK];
        let e = file.crc(3 * STRIDE as u64, STRIDE, &mut chunk).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::RegionLost, "{e}");
        let mut row = vec![0u8; STRIDE];
        let e = file.read_into(2 * STRIDE as u64, &mut row).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::RegionLost, "{e}");
        let src = memfd(STRIDE);
        // Row 3 of the mapping of this file: its pages are gone (the kernel says so).
        let e = file
            .copy_into_row(&mapped, 3, STRIDE, src.as_fd(), 0)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::RegionLost, "{e}");
        assert!(e.to_string().contains("Bad address"), "{e}");
        // The copy neither extended the file nor wrote past its end.
        assert_eq!(
            rustix::fs::fstat(&engine).unwrap().st_size,
            (2 * STRIDE) as i64
        );
        let e = file.check("after the copies").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::RegionLost);
        let msg = e.to_string();
        for part in [
            "engine \"engine-a\"",
            "region fd was shrunk",
            &format!("{} bytes registered", ROWS * STRIDE),
            &format!("holds {} bytes now (seen after the copies)", 2 * STRIDE),
        ] {
            assert!(msg.contains(part), "{part:?} not in {msg}");
        }
        assert_eq!(e.context_value("found_bytes"), Some("131072"));
        // Rows the file still holds still copy.
        file.read_into(STRIDE as u64, &mut row).unwrap();
    }
}
