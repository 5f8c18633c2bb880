//! What every engine shares: the table of open files (with names for error messages), request
//! validation before anything is submitted, and the errors a transfer can end with.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};

use crate::error::{Error, ErrorKind};
use crate::geometry::ROW_ALIGNMENT;
use crate::io::{IoDir, IoRequest};
use crate::region::PrimaryRegion;

/// The files an engine transfers to and from, with a printable name for each.
#[derive(Debug)]
pub(crate) struct FileTable {
    files: Vec<File>,
    labels: Vec<String>,
    o_direct: bool,
}

impl FileTable {
    /// Takes ownership of `files`; names come from `/proc/self/fd` when available.
    pub(crate) fn new(files: Vec<File>, o_direct: bool) -> Self {
        let labels = files
            .iter()
            .enumerate()
            .map(|(i, f)| {
                std::fs::read_link(format!("/proc/self/fd/{}", f.as_raw_fd()))
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|_| format!("file #{i}"))
            })
            .collect();
        FileTable {
            files,
            labels,
            o_direct,
        }
    }

    /// Gives the files back.
    pub(crate) fn into_files(self) -> Vec<File> {
        self.files
    }

    /// Number of files.
    pub(crate) fn len(&self) -> usize {
        self.files.len()
    }

    /// Raw fds in table order (for io_uring file registration).
    pub(crate) fn raw_fds(&self) -> Vec<RawFd> {
        self.files.iter().map(|f| f.as_raw_fd()).collect()
    }

    /// The raw fd of file `i` (already validated).
    pub(crate) fn raw_fd(&self, i: usize) -> RawFd {
        self.files[i].as_raw_fd()
    }

    /// `fdatasync` of file `i`; an unknown index is a contract error.
    pub(crate) fn sync_data(&self, i: usize) -> Result<(), Error> {
        let Some(f) = self.files.get(i) else {
            return Err(Error::new(
                ErrorKind::Contract,
                format!(
                    "sync of file #{i}: the engine has {} files",
                    self.files.len()
                ),
            ));
        };
        f.sync_data()
            .map_err(|e| Error::io("fdatasync", std::path::Path::new(self.label(i)), e))
    }

    /// The printable name of file `i`.
    pub(crate) fn label(&self, i: usize) -> &str {
        self.labels
            .get(i)
            .map(String::as_str)
            .unwrap_or("<unknown file>")
    }

    /// Whether the files were opened with O_DIRECT (alignment is then enforced).
    pub(crate) fn o_direct(&self) -> bool {
        self.o_direct
    }

    /// Checks a request against the file table, the region bounds and (for O_DIRECT files)
    /// 4096-byte alignment of file offset, region offset (hence buffer address) and length.
    pub(crate) fn validate(&self, req: &IoRequest, region: &PrimaryRegion) -> Result<(), Error> {
        if req.file >= self.files.len() {
            return Err(request_error(
                ErrorKind::Contract,
                format!(
                    "file index {} is out of range (the engine has {} files)",
                    req.file,
                    self.files.len()
                ),
                req,
                "<none>",
            ));
        }
        let label = self.label(req.file);
        if req.len == 0 {
            return Err(request_error(
                ErrorKind::Contract,
                "a transfer of 0 bytes was requested".to_string(),
                req,
                label,
            ));
        }
        let end = req.region_offset.checked_add(req.len);
        if end.is_none_or(|end| end > region.len()) {
            return Err(request_error(
                ErrorKind::Contract,
                format!(
                    "region range [{}, +{}) is outside the region ({} bytes)",
                    req.region_offset,
                    req.len,
                    region.len()
                ),
                req,
                label,
            ));
        }
        if req.file_offset.checked_add(req.len as u64).is_none() {
            return Err(request_error(
                ErrorKind::Contract,
                "file offset + length overflows".to_string(),
                req,
                label,
            ));
        }
        if self.o_direct {
            // O_DIRECT: offsets, lengths and buffer addresses aligned to the row alignment.
            let a = ROW_ALIGNMENT;
            let addr = region.base_ptr() as usize + req.region_offset;
            let bad = [
                ("file offset", !req.file_offset.is_multiple_of(a as u64)),
                ("buffer address", !addr.is_multiple_of(a)),
                ("length", !req.len.is_multiple_of(a)),
            ];
            let what: Vec<&str> = bad.iter().filter(|(_, b)| *b).map(|(w, _)| *w).collect();
            if !what.is_empty() {
                return Err(request_error(
                    ErrorKind::Misaligned,
                    format!(
                        "O_DIRECT {} of {label} is misaligned ({} not a multiple of {a})",
                        dir_name(req.dir),
                        what.join(", ")
                    ),
                    req,
                    label,
                )
                .with("expected", format!("multiple of {a}"))
                .with(
                    "found",
                    format!(
                        "file_offset {}, buffer {addr:#x}, len {}",
                        req.file_offset, req.len
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// `"read"` or `"write"`.
pub(crate) fn dir_name(dir: IoDir) -> &'static str {
    match dir {
        IoDir::Read => "read",
        IoDir::Write => "write",
    }
}

/// An error about `req` with the standard context (path, file index, offset, len, direction).
pub(crate) fn request_error(
    kind: ErrorKind,
    message: String,
    req: &IoRequest,
    label: &str,
) -> Error {
    Error::new(kind, message)
        .with("path", label.to_string())
        .with("file", req.file.to_string())
        .with("offset", req.file_offset.to_string())
        .with("len", req.len.to_string())
        .with("op", dir_name(req.dir))
}

/// The error for a transfer that the OS failed with `err` after `done` of `req.len` bytes.
pub(crate) fn os_error(req: &IoRequest, label: &str, done: usize, err: io::Error) -> Error {
    let kind = match err.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => ErrorKind::NoSpace,
        _ => ErrorKind::Io,
    };
    let mut e = request_error(
        kind,
        format!(
            "{} of {} bytes at offset {} of {label} failed after {done} bytes: {err}",
            dir_name(req.dir),
            req.len,
            req.file_offset
        ),
        req,
        label,
    );
    if let Some(errno) = err.raw_os_error() {
        e = e.with("errno", errno.to_string());
    }
    e.with_source(err)
}

/// The error for a transfer that stopped after `done` of `req.len` bytes (end of file, or an
/// O_DIRECT remainder that cannot be resubmitted).
fn short_error(req: &IoRequest, label: &str, done: usize, why: &str) -> Error {
    request_error(
        ErrorKind::ShortIo,
        format!(
            "short {}: {done} of {} bytes at offset {} of {label} moved ({why})",
            dir_name(req.dir),
            req.len,
            req.file_offset
        ),
        req,
        label,
    )
    .with("expected", req.len.to_string())
    .with("found", done.to_string())
}

/// Accounts for one step of a transfer that moved `moved` more bytes after `done`: the bytes
/// moved so far (`req.len` once complete, else continue with the remainder), or the error that
/// ends the request: a step that moved nothing (end of file, for a read), or a partial O_DIRECT
/// transfer whose remainder would be misaligned (the kernel would refuse it with EINVAL).
pub(crate) fn advance(
    req: &IoRequest,
    label: &str,
    done: usize,
    moved: usize,
    o_direct: bool,
) -> Result<usize, Error> {
    if moved == 0 {
        let why = match req.dir {
            IoDir::Read => "end of file",
            IoDir::Write => "the write made no progress",
        };
        return Err(short_error(req, label, done, why));
    }
    let done = done + moved;
    if done < req.len && o_direct && !done.is_multiple_of(ROW_ALIGNMENT) {
        return Err(short_error(
            req,
            label,
            done,
            "O_DIRECT transfer ended inside an aligned block, probably at end of file",
        ));
    }
    Ok(done)
}
