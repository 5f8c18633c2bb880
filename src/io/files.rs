//! What every engine shares: the table of open files (with names for error messages), request
//! validation before anything is submitted, and the errors a transfer can end with.
//!
//! The table has two parts: the **fixed** files an engine is opened with (G3 slabs, indices
//! `0..n`), and **attached** files that a file-per-chunk tier opens for a few transfers and
//! hands over with [`FileTable::attach`] (indices with [`ATTACHED_FLAG`] set, carrying a
//! generation so that a stale index never reaches a newer file). An attached file cannot be
//! detached while a transfer on it is in flight, so the descriptor a transfer uses stays open
//! until its completion.

use std::borrow::Cow;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};

use parking_lot::Mutex;

use crate::error::{Error, ErrorKind};
use crate::geometry::ROW_ALIGNMENT;
use crate::io::{IoDir, IoRequest};
use crate::region::PrimaryRegion;

/// Set in the index of an attached file: `ATTACHED_FLAG | generation << 32 | slot`.
pub const ATTACHED_FLAG: usize = 1 << 62;

const _: () = assert!(
    usize::BITS == 64,
    "file indices pack a generation into 64 bits"
);

/// A file attached for a few transfers.
#[derive(Debug)]
struct AttachedFile {
    file: File,
    label: String,
    o_direct: bool,
    /// Transfers validated and not yet completed.
    in_flight: u32,
}

#[derive(Debug, Default)]
struct AttachedSlot {
    generation: u32,
    file: Option<AttachedFile>,
}

/// The attached part of the table: slots reused through a free list.
#[derive(Debug, Default)]
struct Attached {
    slots: Vec<AttachedSlot>,
    free: Vec<u32>,
}

impl Attached {
    fn get_mut(&mut self, index: usize) -> Option<&mut AttachedFile> {
        let (generation, slot) = split_attached(index);
        let s = self.slots.get_mut(slot as usize)?;
        if s.generation != generation {
            return None;
        }
        s.file.as_mut()
    }
}

fn split_attached(index: usize) -> (u32, u32) {
    let raw = index & !ATTACHED_FLAG;
    ((raw >> 32) as u32, (raw & 0xffff_ffff) as u32)
}

fn is_attached(index: usize) -> bool {
    index & ATTACHED_FLAG != 0
}

/// The files an engine transfers to and from, with a printable name for each.
#[derive(Debug)]
pub(crate) struct FileTable {
    files: Vec<File>,
    labels: Vec<String>,
    o_direct: bool,
    attached: Mutex<Attached>,
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
            attached: Mutex::new(Attached::default()),
        }
    }

    /// Adds `file` for transfers of its own; the returned index goes in [`IoRequest::file`].
    pub(crate) fn attach(&self, file: File, label: String, o_direct: bool) -> Result<usize, Error> {
        let mut a = self.attached.lock();
        let entry = AttachedFile {
            file,
            label,
            o_direct,
            in_flight: 0,
        };
        let slot = match a.free.pop() {
            Some(slot) => slot,
            None => {
                let slot = u32::try_from(a.slots.len()).map_err(|_| {
                    Error::new(ErrorKind::NoSpace, "too many files attached to the engine")
                })?;
                a.slots.push(AttachedSlot::default());
                slot
            }
        };
        let s = &mut a.slots[slot as usize];
        s.file = Some(entry);
        Ok(ATTACHED_FLAG | (s.generation as usize) << 32 | slot as usize)
    }

    /// Removes an attached file and gives it back. Fails (and keeps the file) while a transfer
    /// on it is in flight, and for an index that names no attached file.
    pub(crate) fn detach(&self, index: usize) -> Result<File, Error> {
        let mut a = self.attached.lock();
        let in_flight = match a.get_mut(index) {
            None => return Err(unknown_attached(index)),
            Some(f) => f.in_flight,
        };
        if in_flight > 0 {
            return Err(Error::new(
                ErrorKind::Contract,
                format!("cannot detach a file with {in_flight} transfer(s) in flight"),
            ));
        }
        let (_, slot) = split_attached(index);
        let s = &mut a.slots[slot as usize];
        let file = s.file.take().ok_or_else(|| unknown_attached(index))?;
        s.generation = s.generation.wrapping_add(1);
        a.free.push(slot);
        Ok(file.file)
    }

    /// Marks the end of a transfer on `index` (validated earlier): an attached file may be
    /// detached once none is left.
    pub(crate) fn release(&self, index: usize) {
        if is_attached(index)
            && let Some(f) = self.attached.lock().get_mut(index)
        {
            f.in_flight = f.in_flight.saturating_sub(1);
        }
    }

    /// Whether `index` is one of the fixed files (registered with io_uring where possible).
    pub(crate) fn is_fixed(&self, index: usize) -> bool {
        index < self.files.len()
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

    /// The raw fd of file `i` (validated, so an attached file stays open until its release);
    /// -1 for an index that names no file (the transfer then fails with EBADF).
    pub(crate) fn raw_fd(&self, i: usize) -> RawFd {
        if is_attached(i) {
            return self
                .attached
                .lock()
                .get_mut(i)
                .map_or(-1, |f| f.file.as_raw_fd());
        }
        self.files.get(i).map_or(-1, |f| f.as_raw_fd())
    }

    /// `fdatasync` of file `i`; an unknown index is a contract error.
    pub(crate) fn sync_data(&self, i: usize) -> Result<(), Error> {
        if is_attached(i) {
            // A duplicate descriptor of the same file, so that the sync runs without the lock
            // (and the file may be detached meanwhile: the duplicate keeps it open).
            let dup = {
                let mut a = self.attached.lock();
                let f = a.get_mut(i).ok_or_else(|| unknown_attached(i))?;
                f.file.try_clone()
            };
            return dup
                .and_then(|f| f.sync_data())
                .map_err(|e| Error::io("fdatasync", std::path::Path::new(&*self.label(i)), e));
        }
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
            .map_err(|e| Error::io("fdatasync", std::path::Path::new(&*self.label(i)), e))
    }

    /// The printable name of file `i`.
    pub(crate) fn label(&self, i: usize) -> Cow<'_, str> {
        if is_attached(i) {
            return Cow::Owned(
                self.attached
                    .lock()
                    .get_mut(i)
                    .map_or_else(|| "<detached file>".to_string(), |f| f.label.clone()),
            );
        }
        Cow::Borrowed(
            self.labels
                .get(i)
                .map(String::as_str)
                .unwrap_or("<unknown file>"),
        )
    }

    /// Whether file `i` was opened with O_DIRECT (alignment is then enforced).
    pub(crate) fn o_direct_of(&self, i: usize) -> bool {
        if is_attached(i) {
            return self.attached.lock().get_mut(i).is_some_and(|f| f.o_direct);
        }
        self.o_direct
    }

    /// Checks a request against the file table, the region bounds and (for O_DIRECT files)
    /// 4096-byte alignment of file offset, region offset (hence buffer address) and length.
    /// A valid request on an attached file holds that file until [`FileTable::release`].
    pub(crate) fn validate(&self, req: &IoRequest, region: &PrimaryRegion) -> Result<(), Error> {
        if is_attached(req.file) {
            let mut a = self.attached.lock();
            let Some(f) = a.get_mut(req.file) else {
                return Err(request_error(
                    ErrorKind::Contract,
                    format!("file index {:#x} names no attached file", req.file),
                    req,
                    "<none>",
                ));
            };
            check_request(req, region, f.o_direct, &f.label)?;
            f.in_flight += 1;
            return Ok(());
        }
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
        check_request(req, region, self.o_direct, &self.label(req.file))
    }
}

fn unknown_attached(index: usize) -> Error {
    Error::new(
        ErrorKind::Contract,
        format!("file index {index:#x} names no attached file"),
    )
}

/// Region bounds, overflow and (for O_DIRECT) alignment of one request on file `label`.
fn check_request(
    req: &IoRequest,
    region: &PrimaryRegion,
    o_direct: bool,
    label: &str,
) -> Result<(), Error> {
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
    if o_direct {
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

/// Most times one request is resubmitted after the kernel answered EINTR or EAGAIN; the next
/// such answer fails the request (one key), so that a file that keeps answering them cannot
/// hold a transfer, or the thread that resubmits it, forever.
pub const MAX_TRANSIENT_RETRIES: u32 = 16;

/// Whether a request the kernel answered with `errno` after `retries` resubmissions is
/// resubmitted again (EINTR and EAGAIN, at most [`MAX_TRANSIENT_RETRIES`] times); counts the
/// resubmission.
pub(crate) fn resubmit_transient(errno: i32, retries: &mut u32) -> bool {
    if (errno == libc::EINTR || errno == libc::EAGAIN) && *retries < MAX_TRANSIENT_RETRIES {
        *retries += 1;
        true
    } else {
        false
    }
}

/// True when a transfer failed with an error that says nothing about the medium: interrupted
/// (EINTR) or unavailable (EAGAIN) after its bounded resubmissions, or cancelled (ECANCELED).
/// That key fails; its file is not taken out of service for it.
pub fn is_transient(e: &Error) -> bool {
    e.context_value("errno")
        .and_then(|v| v.parse::<i32>().ok())
        .is_some_and(|n| matches!(n, libc::EINTR | libc::EAGAIN | libc::ECANCELED))
}

/// The error for a transfer that the OS failed with `err` after `done` of `req.len` bytes and
/// `resubmissions` resubmissions after EINTR or EAGAIN (named in the context when any).
pub(crate) fn os_error(
    req: &IoRequest,
    label: &str,
    done: usize,
    resubmissions: u32,
    err: io::Error,
) -> Error {
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
    if resubmissions > 0 {
        e = e.with("resubmissions", resubmissions.to_string());
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
    files: &FileTable,
    done: usize,
    moved: usize,
) -> Result<usize, Error> {
    if moved == 0 {
        let why = match req.dir {
            IoDir::Read => "end of file",
            IoDir::Write => "the write made no progress",
        };
        return Err(short_error(req, &files.label(req.file), done, why));
    }
    let done = done + moved;
    if done < req.len && !done.is_multiple_of(ROW_ALIGNMENT) && files.o_direct_of(req.file) {
        return Err(short_error(
            req,
            &files.label(req.file),
            done,
            "O_DIRECT transfer ended inside an aligned block, probably at end of file",
        ));
    }
    Ok(done)
}

/// `posix_fallocate(file, 0, len)`: glibc's, which writes zeros where the filesystem has no
/// `fallocate(2)` (rustix's `fallocate` and std have only the system call, which then fails).
/// The error is the call's `errno` (`ENOSPC`, `EDQUOT`, ...), or `EFBIG` for a length beyond
/// `off_t`.
pub(crate) fn posix_fallocate(file: &File, len: u64) -> io::Result<()> {
    let len = libc::off_t::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    // SAFETY: posix_fallocate on a descriptor `file` owns and keeps open for the call; no
    // memory is involved.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) } {
        0 => Ok(()),
        e => Err(io::Error::from_raw_os_error(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(file: usize) -> IoRequest {
        IoRequest {
            dir: IoDir::Write,
            file,
            file_offset: 0,
            region_offset: 0,
            len: 4096,
            tag: 0,
        }
    }

    #[test]
    fn an_attached_file_is_held_from_validation_to_release() {
        let region = PrimaryRegion::create(1, 4096).unwrap();
        let table = FileTable::new(Vec::new(), true);
        let f = tempfile::tempfile().unwrap();
        let id = table.attach(f, "chunk".into(), false).unwrap();
        assert!(!table.is_fixed(id));
        assert!(!table.o_direct_of(id));
        assert_eq!(table.label(id), "chunk");
        table.validate(&req(id), &region).unwrap();
        table.validate(&req(id), &region).unwrap();
        let e = table.detach(id).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Contract, "{e}");
        assert!(e.to_string().contains("2 transfer(s) in flight"), "{e}");
        table.release(id);
        assert!(table.detach(id).is_err());
        table.release(id);
        table.detach(id).unwrap();
        // The index is dead now, also for validation and release.
        assert_eq!(
            table.validate(&req(id), &region).unwrap_err().kind(),
            ErrorKind::Contract
        );
        table.release(id);
        assert_eq!(table.raw_fd(id), -1);
        assert_eq!(table.label(id), "<detached file>");
    }
}
