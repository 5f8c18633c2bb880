//! The request side of a thread-backed engine (`psync`, `uring`): requests are validated, then
//! travel over a channel to the engine's thread(s); completions come back on another channel.
//! Closing the queue at shutdown lets the threads drain what was queued and exit.

use crossbeam_channel::{Receiver, Sender};
use parking_lot::RwLock;

use crate::error::{Error, ErrorKind, Result};
use crate::io::files::FileTable;
use crate::io::{IoCompletion, IoRequest};
use crate::region::PrimaryRegion;

/// Requests to an engine's threads and the completions they send back.
pub(crate) struct RequestQueue {
    /// `None` once closed; submitters hold the read lock while sending.
    requests: RwLock<Option<Sender<IoRequest>>>,
    done_tx: Sender<IoCompletion>,
    done_rx: Receiver<IoCompletion>,
    /// The engine's name, for the error after shutdown.
    engine: &'static str,
    /// The error message when the engine's threads are gone.
    threads_gone: &'static str,
}

impl RequestQueue {
    /// An open queue for engine `engine`, and the receiver its threads take requests from.
    /// `threads_gone` is the error message for a send that finds no thread left.
    pub(crate) fn new(
        engine: &'static str,
        threads_gone: &'static str,
    ) -> (Self, Receiver<IoRequest>) {
        let (req_tx, req_rx) = crossbeam_channel::unbounded();
        let (done_tx, done_rx) = crossbeam_channel::unbounded();
        let queue = RequestQueue {
            requests: RwLock::new(Some(req_tx)),
            done_tx,
            done_rx,
            engine,
            threads_gone,
        };
        (queue, req_rx)
    }

    /// Where the engine's threads send completions.
    pub(crate) fn completion_sender(&self) -> Sender<IoCompletion> {
        self.done_tx.clone()
    }

    /// Where completions arrive.
    pub(crate) fn completions(&self) -> &Receiver<IoCompletion> {
        &self.done_rx
    }

    /// Validates each request against `files` and `region` and queues it; an invalid request
    /// completes at once with its error. Returns whether any request was queued; an error only
    /// once the queue is closed (or the engine's threads are gone).
    pub(crate) fn submit(
        &self,
        reqs: &[IoRequest],
        files: &FileTable,
        region: &PrimaryRegion,
    ) -> Result<bool> {
        let guard = self.requests.read();
        let Some(tx) = guard.as_ref() else {
            return Err(Error::new(
                ErrorKind::Closed,
                format!("the {} engine is shut down", self.engine),
            ));
        };
        let mut queued = false;
        for req in reqs {
            if let Err(e) = files.validate(req, region) {
                let _ = self.done_tx.send(IoCompletion {
                    tag: req.tag,
                    result: Err(e),
                    row_crc: None,
                });
                continue;
            }
            if tx.send(*req).is_err() {
                files.release(req.file);
                return Err(Error::new(ErrorKind::Internal, self.threads_gone));
            }
            queued = true;
        }
        Ok(queued)
    }

    /// Stops accepting requests; the threads drain what is queued, then see the channel close.
    pub(crate) fn close(&self) {
        drop(self.requests.write().take());
    }
}

/// The [`IoEngine`](crate::io::IoEngine) methods that a thread-backed engine answers from its
/// fields alone: `queue` (a [`RequestQueue`]) for its completions, `region` for its region, and
/// `files` (its [`FileTable`]) for `sync_data`, `attach_file` and `detach_file`. Expanded inside
/// the engine's `impl IoEngine`.
macro_rules! engine_methods_from_fields {
    () => {
        fn completions(&self) -> &crossbeam_channel::Receiver<crate::io::IoCompletion> {
            self.queue.completions()
        }

        fn region(&self) -> &std::sync::Arc<crate::region::PrimaryRegion> {
            &self.region
        }

        fn sync_data(&self, file: usize) -> crate::error::Result<()> {
            self.files.sync_data(file)
        }

        fn attach_file(
            &self,
            file: std::fs::File,
            label: String,
            o_direct: bool,
        ) -> crate::error::Result<usize> {
            self.files.attach(file, label, o_direct)
        }

        fn detach_file(&self, file: usize) -> crate::error::Result<std::fs::File> {
            self.files.detach(file)
        }
    };
}
pub(crate) use engine_methods_from_fields;
