//! The `psync` engine: `pread`/`pwrite` on a small pool of threads.
//!
//! Requests travel over an unbounded channel to the workers, which block on it when idle. Each
//! request completes exactly once. A short transfer is continued for the remainder (buffer,
//! offset and length all advanced); a 0-byte result or an OS error fails the request.
//! This is what `auto` uses when io_uring cannot be set up or its buffers cannot be registered.

use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;

use crate::error::{Error, ErrorKind, Result};
use crate::io::files::{FileTable, advance, os_error, resubmit_transient};
use crate::io::queue::{RequestQueue, engine_methods_from_fields};
use crate::io::{IoCompletion, IoDir, IoEngine, IoRequest};
use crate::region::PrimaryRegion;

/// Default number of worker threads.
pub const DEFAULT_PSYNC_THREADS: usize = 4;

/// pread/pwrite on a thread pool.
pub struct PsyncEngine {
    region: Arc<PrimaryRegion>,
    files: Arc<FileTable>,
    queue: RequestQueue,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl PsyncEngine {
    /// Starts `threads` workers (at least one) over `files`, transferring to and from `region`.
    /// `o_direct` says the files were opened with O_DIRECT: requests are then checked for
    /// 4096-byte alignment before they run.
    pub fn new(
        region: Arc<PrimaryRegion>,
        files: Vec<std::fs::File>,
        threads: usize,
        o_direct: bool,
    ) -> Result<Self> {
        let files = Arc::new(FileTable::new(files, o_direct));
        let (queue, req_rx) = RequestQueue::new("psync", "psync workers exited unexpectedly");
        let mut workers = Vec::new();
        for i in 0..threads.max(1) {
            let rx = req_rx.clone();
            let tx = queue.completion_sender();
            let files = files.clone();
            let region = region.clone();
            let handle = super::spawn_io_thread(format!("kvtier-psync-{i}"), move || {
                worker(&rx, &tx, &files, &region)
            })
            .map_err(|e| {
                Error::new(
                    ErrorKind::Io,
                    format!("cannot start psync worker thread: {e}"),
                )
                .with_source(e)
            })?;
            workers.push(handle);
        }
        Ok(PsyncEngine {
            region,
            files,
            queue,
            workers: Mutex::new(workers),
        })
    }

    /// Number of worker threads.
    #[cfg(any(test, feature = "test-support"))]
    pub fn threads(&self) -> usize {
        self.workers.lock().len()
    }
}

fn worker(
    rx: &Receiver<IoRequest>,
    tx: &Sender<IoCompletion>,
    files: &FileTable,
    region: &PrimaryRegion,
) {
    // `recv` blocks while idle and fails once the engine dropped its sender and the queue is
    // empty, so every queued request runs before the worker exits.
    while let Ok(req) = rx.recv() {
        let result = transfer(&req, files, region);
        // Released before the completion is sent, so that its receiver may detach the file.
        files.release(req.file);
        // The receiver lives in the engine, which outlives its workers.
        let _ = tx.send(IoCompletion {
            tag: req.tag,
            result,
            row_crc: None,
        });
    }
}

/// Moves all of `req` or fails. The request has been validated against the region and files.
fn transfer(req: &IoRequest, files: &FileTable, region: &PrimaryRegion) -> Result<usize> {
    let fd = files.raw_fd(req.file);
    // SAFETY: `validate` checked region_offset + len <= region.len().
    let buf = unsafe { region.base_ptr().add(req.region_offset) };
    let mut done = 0usize;
    let mut retries = 0u32;
    while done < req.len {
        let remaining = req.len - done;
        let offset = req.file_offset + done as u64;
        // Raw libc pread/pwrite: the buffer is region memory addressed by pointer (the region
        // never hands out a Rust slice over rows the kernel or another agent may touch), and
        // std's `read_at`/`write_at` and rustix's `pread`/`pwrite` take slices.
        // SAFETY: `buf + done .. buf + len` lies inside the region, which the caller keeps
        // alive (this worker holds an `Arc`); the caller owns the row for the duration of the
        // request (reserved for a read into it, pinned for a write from it).
        let rc = unsafe {
            match req.dir {
                IoDir::Read => {
                    libc::pread(fd, buf.add(done).cast(), remaining, offset as libc::off_t)
                }
                IoDir::Write => libc::pwrite(
                    fd,
                    buf.add(done).cast_const().cast(),
                    remaining,
                    offset as libc::off_t,
                ),
            }
        };
        if rc < 0 {
            let err = std::io::Error::last_os_error();
            if resubmit_transient(err.raw_os_error().unwrap_or(0), &mut retries) {
                continue;
            }
            return Err(os_error(req, &files.label(req.file), done, retries, err));
        }
        done = advance(req, files, done, rc as usize)?;
    }
    Ok(req.len)
}

impl IoEngine for PsyncEngine {
    fn name(&self) -> String {
        "psync".to_string()
    }

    engine_methods_from_fields!();

    fn submit(&self, reqs: &[IoRequest]) -> Result<()> {
        self.queue.submit(reqs, &self.files, &self.region)?;
        Ok(())
    }

    fn shutdown(&self) {
        // Closing the queue lets the workers drain it and exit.
        self.queue.close();
        let workers = std::mem::take(&mut *self.workers.lock());
        for w in workers {
            if w.join().is_err() {
                log::error!("a psync worker thread panicked");
            }
        }
    }
}

impl Drop for PsyncEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}
