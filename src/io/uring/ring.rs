//! The ring thread: owns the io_uring, turns requests into SQEs, reaps CQEs, resubmits
//! remainders, and blocks (on the channel when idle, in `submit_and_wait(1)` otherwise).

use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{Ordering, fence};

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use io_uring::{IoUring, opcode, types};

use super::staging::{Staging, copies_out};
use super::{MAX_SQE_LEN, WAKE_TAG, Wake};
use crate::error::{Error, ErrorKind, Result};
use crate::io::files::{FileTable, advance, os_error, resubmit_transient};
use crate::io::{IoCompletion, IoDir, IoRequest};
use crate::region::PrimaryRegion;

/// One request in the ring's care.
pub(super) struct Op {
    req: IoRequest,
    /// Bytes moved so far.
    done: usize,
    /// Resubmissions after EINTR or EAGAIN (bounded, see [`resubmit_transient`]).
    retries: u32,
    /// The staging slot the transfer goes through, if it is staged (see `staging.rs`).
    stage: Option<usize>,
    /// The CRC-32 of a staged write's bytes, from its copy into the slot.
    crc: Option<u32>,
}

/// State owned by the ring thread.
pub(super) struct RingThread {
    pub(super) ring: IoUring,
    pub(super) files: Arc<FileTable>,
    pub(super) region: Arc<PrimaryRegion>,
    /// Registered piece size, `None` when buffers are not registered.
    pub(super) piece: Option<usize>,
    pub(super) fixed_files: bool,
    pub(super) rx: Receiver<IoRequest>,
    pub(super) done: Sender<IoCompletion>,
    pub(super) wake: Arc<Wake>,
    pub(super) depth: usize,
    /// Slot table; the slot index is the SQE's `user_data`.
    pub(super) ops: Vec<Option<Op>>,
    pub(super) free: Vec<usize>,
    /// Ops whose SQE is in the kernel.
    pub(super) in_flight: usize,
    /// Ops waiting for room in the ring (new, or a remainder to resubmit).
    pub(super) ready: VecDeque<usize>,
    pub(super) poll_armed: bool,
    /// `(user_data, result)` of the CQEs being reaped (kept to reuse its allocation).
    pub(super) reaped: Vec<(u64, i32)>,
    /// Rewrites CQE results before they are acted on (tests only; `None` in the engine).
    pub(super) cqe_filter: Option<CqeFilter>,
    /// Staging slots for large transfers of a region in 4 KiB pages, when used.
    pub(super) staging: Option<Staging>,
}

/// `filter(request tag, CQE result) -> result`, see [`RingThread::cqe_filter`].
pub(crate) type CqeFilter = Box<dyn FnMut(u64, i32) -> i32 + Send>;

macro_rules! rw_entry {
    ($fd:expr, $dir:expr, $buf:expr, $len:expr, $off:expr, $piece:expr) => {
        match ($dir, $piece) {
            (IoDir::Read, Some(idx)) => opcode::ReadFixed::new($fd, $buf, $len, idx)
                .offset($off)
                .build(),
            (IoDir::Write, Some(idx)) => opcode::WriteFixed::new($fd, $buf.cast_const(), $len, idx)
                .offset($off)
                .build(),
            (IoDir::Read, None) => opcode::Read::new($fd, $buf, $len).offset($off).build(),
            (IoDir::Write, None) => opcode::Write::new($fd, $buf.cast_const(), $len)
                .offset($off)
                .build(),
        }
    };
}

impl RingThread {
    pub(super) fn run(&mut self) {
        let mut closing = false;
        loop {
            let staging_idle = self.staging.as_ref().is_none_or(|s| s.waiting.is_empty());
            if self.in_flight == 0 && self.ready.is_empty() && staging_idle {
                if closing {
                    break;
                }
                // Idle: block on the channel.
                match self.rx.recv() {
                    Ok(req) => self.accept(req),
                    Err(_) => break,
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(req) => self.accept(req),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        closing = true;
                        break;
                    }
                }
            }
            self.push_ready();
            if self.in_flight > 0 {
                self.wait(closing);
            }
            self.reap();
        }
        self.finish();
    }

    fn accept(&mut self, req: IoRequest) {
        // A range a background collapse has made huge goes direct.
        let staged = self.staging.as_ref().is_some_and(|s| s.wants(&req))
            && !self.region.range_in_huge_pages(req.region_offset, req.len);
        let op = Op {
            req,
            done: 0,
            retries: 0,
            stage: None,
            crc: None,
        };
        let slot = match self.free.pop() {
            Some(s) => {
                self.ops[s] = Some(op);
                s
            }
            None => {
                self.ops.push(Some(op));
                self.ops.len() - 1
            }
        };
        if staged {
            if let Some(s) = self.staging.as_mut() {
                s.waiting.push_back(slot);
            }
            self.start_staged();
        } else {
            self.ready.push_back(slot);
        }
    }

    /// Gives waiting staged ops free staging slots, in order: a write's bytes are copied into
    /// its slot, then the op is ready.
    fn start_staged(&mut self) {
        loop {
            let Some(s) = self.staging.as_mut() else {
                return;
            };
            if s.waiting.is_empty() {
                return;
            }
            let Some(stage) = s.take() else { return };
            let Some(slot) = s.waiting.pop_front() else {
                s.release(stage);
                return;
            };
            let Some(op) = self.ops[slot].as_mut() else {
                s.release(stage);
                continue;
            };
            op.stage = Some(stage);
            let req = op.req;
            let copied = match req.dir {
                IoDir::Write => s.copy_in(&self.region, &req, stage).map(Some),
                IoDir::Read => Ok(None),
            };
            match copied {
                Ok(crc) => {
                    op.crc = crc;
                    self.ready.push_back(slot);
                }
                Err(e) => self.complete(slot, Err(e)),
            }
        }
    }

    fn complete(&mut self, slot: usize, mut result: Result<usize>) {
        if let Some(op) = self.ops[slot].take() {
            let mut row_crc = op.crc;
            if let (Some(stage), Some(s)) = (op.stage, self.staging.as_mut()) {
                // A read's bytes reach the region before its completion is sent.
                if result.is_ok() && copies_out(op.req.dir) {
                    match s.copy_out(&self.region, &op.req, stage) {
                        Ok(crc) => row_crc = Some(crc),
                        Err(e) => result = Err(e),
                    }
                }
                s.release(stage);
            }
            if result.is_err() {
                row_crc = None;
            }
            self.free.push(slot);
            // Released before the completion is sent, so that its receiver may detach the file.
            self.files.release(op.req.file);
            let _ = self.done.send(IoCompletion {
                tag: op.req.tag,
                result,
                row_crc,
            });
            if op.stage.is_some() {
                self.start_staged();
            }
        }
    }

    /// Moves ready ops into the submission queue while the ring has room.
    fn push_ready(&mut self) {
        while self.in_flight < self.depth {
            let Some(&slot) = self.ready.front() else {
                break;
            };
            let entry = match self.entry(slot) {
                Ok(e) => e,
                Err(e) => {
                    self.ready.pop_front();
                    self.complete(slot, Err(e));
                    continue;
                }
            };
            // SAFETY: the entry's buffer lies inside the region or the staging memory, which
            // this thread keeps alive (and registered) until every op has completed; the op's
            // slot stays occupied until its CQE is reaped, so `user_data` maps back to exactly
            // one op.
            if unsafe { self.ring.submission().push(&entry) }.is_err() {
                break;
            }
            self.ready.pop_front();
            self.in_flight += 1;
        }
    }

    /// Builds the SQE for the remainder of op `slot`.
    fn entry(&self, slot: usize) -> Result<io_uring::squeue::Entry> {
        let op = self.ops[slot].as_ref().ok_or_else(|| {
            Error::new(
                ErrorKind::Internal,
                format!("io_uring op slot {slot} is empty"),
            )
        })?;
        let req = &op.req;
        let start = req.region_offset + op.done;
        let len = (req.len - op.done).min(MAX_SQE_LEN);
        if let (Some(stage), Some(s)) = (op.stage, self.staging.as_ref()) {
            // The slot holds the whole request; the remainder starts `done` bytes in.
            let buf = s.ptr(stage, op.done);
            let off = req.file_offset + op.done as u64;
            let len = len as u32;
            let idx = s.buffer_index;
            let entry = if self.fixed_files && self.files.is_fixed(req.file) {
                rw_entry!(types::Fixed(req.file as u32), req.dir, buf, len, off, idx)
            } else {
                let fd = types::Fd(self.files.raw_fd(req.file));
                rw_entry!(fd, req.dir, buf, len, off, idx)
            };
            return Ok(entry.user_data(slot as u64));
        }
        let piece_index = match self.piece {
            Some(piece) => {
                let idx = req.region_offset / piece;
                if (req.region_offset + req.len).div_ceil(piece) != idx + 1 {
                    return Err(crate::io::files::request_error(
                        ErrorKind::Contract,
                        format!(
                            "region range [{}, +{}) straddles two registered buffer pieces of \
                             {piece} bytes; requests must stay within one piece (whole rows)",
                            req.region_offset, req.len
                        ),
                        req,
                        &self.files.label(req.file),
                    ));
                }
                Some(u16::try_from(idx).map_err(|_| {
                    Error::new(ErrorKind::Internal, "registered buffer index out of range")
                })?)
            }
            None => None,
        };
        // SAFETY: validated on submission: start + len <= region.len().
        let buf = unsafe { self.region.base_ptr().add(start) };
        let off = req.file_offset + op.done as u64;
        let len = len as u32;
        let entry = if self.fixed_files && self.files.is_fixed(req.file) {
            rw_entry!(
                types::Fixed(req.file as u32),
                req.dir,
                buf,
                len,
                off,
                piece_index
            )
        } else {
            let fd = types::Fd(self.files.raw_fd(req.file));
            rw_entry!(fd, req.dir, buf, len, off, piece_index)
        };
        Ok(entry.user_data(slot as u64))
    }

    /// Blocks until at least one completion (or a wake-up from a submitter).
    fn wait(&mut self, closing: bool) {
        if !self.poll_armed && !closing {
            let poll =
                opcode::PollAdd::new(types::Fd(self.wake.fd.as_raw_fd()), libc::POLLIN as u32)
                    .build()
                    .user_data(WAKE_TAG);
            // SAFETY: a poll on our eventfd uses no buffer; the fd outlives the ring.
            if unsafe { self.ring.submission().push(&poll) }.is_ok() {
                self.poll_armed = true;
            }
        }
        self.wake.waiting.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let want = if !closing && !self.rx.is_empty() {
            0
        } else {
            1
        };
        loop {
            match self.ring.submit_and_wait(want) {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                // EBUSY / EAGAIN: completions must be reaped first; the caller does that next.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY) | Some(libc::EAGAIN)) => {
                    break;
                }
                Err(e) => {
                    log::error!("io_uring submit_and_wait failed: {e}");
                    break;
                }
            }
        }
        self.wake.waiting.store(false, Ordering::SeqCst);
    }

    fn reap(&mut self) {
        let mut cqes = std::mem::take(&mut self.reaped);
        cqes.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
        for &(ud, res) in &cqes {
            if ud == WAKE_TAG {
                self.poll_armed = false;
                self.wake.drain();
                continue;
            }
            let slot = ud as usize;
            self.in_flight -= 1;
            self.on_cqe(slot, res);
        }
        cqes.clear();
        self.reaped = cqes;
    }

    fn on_cqe(&mut self, slot: usize, res: i32) {
        let Some(op) = self.ops.get_mut(slot).and_then(Option::as_mut) else {
            log::error!("io_uring completion for unknown slot {slot}");
            return;
        };
        let req = op.req;
        let res = match &mut self.cqe_filter {
            Some(filter) => filter(req.tag, res),
            None => res,
        };
        if res < 0 {
            let errno = -res;
            // Behind newer work, so that the file gets a moment; bounded, so that a file that
            // keeps answering EINTR or EAGAIN fails this key instead of spinning the ring.
            if resubmit_transient(errno, &mut op.retries) {
                self.ready.push_back(slot);
                return;
            }
            let err = os_error(
                &req,
                &self.files.label(req.file),
                op.done,
                op.retries,
                std::io::Error::from_raw_os_error(errno),
            );
            self.complete(slot, Err(err));
            return;
        }
        match advance(&req, &self.files, op.done, res as usize) {
            Ok(done) if done < req.len => {
                op.done = done;
                // Resubmit the remainder ahead of newer work.
                self.ready.push_front(slot);
            }
            Ok(_) => self.complete(slot, Ok(req.len)),
            Err(err) => self.complete(slot, Err(err)),
        }
    }

    fn finish(&mut self) {
        let submitter = self.ring.submitter();
        let staging_registered = self
            .staging
            .as_ref()
            .is_some_and(|s| s.buffer_index.is_some());
        if (self.piece.is_some() || staging_registered)
            && let Err(e) = submitter.unregister_buffers()
        {
            log::warn!("io_uring: unregistering buffers failed: {e}");
        }
        if self.fixed_files
            && let Err(e) = submitter.unregister_files()
        {
            log::warn!("io_uring: unregistering files failed: {e}");
        }
    }
}
