//! The `psync` engine: `pread`/`pwrite` on a small pool of threads.
//!
//! Requests travel over an unbounded channel to the workers, which block on it when idle. Each
//! request completes exactly once. A short transfer is continued for the remainder (buffer,
//! offset and length all advanced); a 0-byte result or an OS error fails the request.
//! This is what `auto` uses when io_uring cannot be set up or its buffers cannot be registered.

use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Mutex, RwLock};

use crate::error::{Error, ErrorKind, Result};
use crate::io::files::{FileTable, check_partial, os_error, short_error};
use crate::io::{IoCompletion, IoDir, IoEngine, IoRequest};
use crate::region::PrimaryRegion;

/// Default number of worker threads.
pub const DEFAULT_PSYNC_THREADS: usize = 4;

/// pread/pwrite on a thread pool.
pub struct PsyncEngine {
    region: Arc<PrimaryRegion>,
    files: Arc<FileTable>,
    /// `None` once shut down; submitters hold the read lock while sending.
    requests: RwLock<Option<Sender<IoRequest>>>,
    done_tx: Sender<IoCompletion>,
    done_rx: Receiver<IoCompletion>,
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
        let (req_tx, req_rx) = crossbeam_channel::unbounded::<IoRequest>();
        let (done_tx, done_rx) = crossbeam_channel::unbounded();
        let mut workers = Vec::new();
        for i in 0..threads.max(1) {
            let rx = req_rx.clone();
            let tx = done_tx.clone();
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
            requests: RwLock::new(Some(req_tx)),
            done_tx,
            done_rx,
            workers: Mutex::new(workers),
        })
    }

    /// Number of worker threads.
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
        // The receiver lives in the engine, which outlives its workers.
        let _ = tx.send(IoCompletion {
            tag: req.tag,
            result,
        });
    }
}

/// Moves all of `req` or fails. The request has been validated against the region and files.
fn transfer(req: &IoRequest, files: &FileTable, region: &PrimaryRegion) -> Result<usize> {
    let fd = files.raw_fd(req.file);
    let label = files.label(req.file);
    // SAFETY: `validate` checked region_offset + len <= region.len().
    let buf = unsafe { region.base_ptr().add(req.region_offset) };
    let mut done = 0usize;
    while done < req.len {
        let remaining = req.len - done;
        let offset = req.file_offset + done as u64;
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
            if err.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(os_error(req, label, done, err));
        }
        if rc == 0 {
            let why = match req.dir {
                IoDir::Read => "end of file",
                IoDir::Write => "the write made no progress",
            };
            return Err(short_error(req, label, done, why));
        }
        done += rc as usize;
        if done < req.len
            && let Some(e) = check_partial(req, label, done, files.o_direct())
        {
            return Err(e);
        }
    }
    Ok(req.len)
}

impl IoEngine for PsyncEngine {
    fn name(&self) -> String {
        "psync".to_string()
    }

    fn submit(&self, reqs: &[IoRequest]) -> Result<()> {
        let guard = self.requests.read();
        let Some(tx) = guard.as_ref() else {
            return Err(Error::new(
                ErrorKind::Closed,
                "the psync engine is shut down",
            ));
        };
        for req in reqs {
            if let Err(e) = self.files.validate(req, &self.region) {
                let _ = self.done_tx.send(IoCompletion {
                    tag: req.tag,
                    result: Err(e),
                });
                continue;
            }
            tx.send(*req).map_err(|_| {
                Error::new(ErrorKind::Internal, "psync workers exited unexpectedly")
            })?;
        }
        Ok(())
    }

    fn completions(&self) -> &Receiver<IoCompletion> {
        &self.done_rx
    }

    fn region(&self) -> &Arc<PrimaryRegion> {
        &self.region
    }

    fn sync_data(&self, file: usize) -> Result<()> {
        self.files.sync_data(file)
    }

    fn shutdown(&self) {
        // Dropping the sender lets the workers drain the queue and exit.
        drop(self.requests.write().take());
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
