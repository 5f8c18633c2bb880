//! A [`Request`] to and from its frame.

use super::codec::{Reader, Writer};
use super::frame::{
    Frame, KIND_HELLO, KIND_HINT, KIND_HINT_DONE, KIND_LOAD, KIND_LOOKUP, KIND_REGISTER_FD,
    KIND_REGISTER_PATH, KIND_STATUS, KIND_STORE, KIND_TAKE_EVENTS, KIND_TOUCH, MAX_BODY,
};
use super::messages::{JobRequest, Request};
use crate::error::{Error, ErrorKind, Result};

impl Request {
    /// The request as a frame numbered `seq`.
    pub fn to_frame(&self, seq: u64) -> Result<Frame> {
        let mut w = Writer::default();
        let kind = match self {
            Request::Hello {
                row_stride,
                digest,
                engine,
            } => {
                w.greeting(*row_stride, digest, engine);
                KIND_HELLO
            }
            Request::RegisterPath { num_rows, path } => {
                w.u64(*num_rows).str16(path);
                KIND_REGISTER_PATH
            }
            Request::RegisterFd { num_rows } => {
                w.u64(*num_rows);
                KIND_REGISTER_FD
            }
            Request::Lookup { keys } => {
                w.keys16(keys)?;
                KIND_LOOKUP
            }
            Request::Store(j) | Request::Load(j) => {
                if j.rows.len() != j.keys.len() {
                    return Err(Error::new(
                        ErrorKind::Contract,
                        format!(
                            "job {} has {} keys and {} rows",
                            j.job_id,
                            j.keys.len(),
                            j.rows.len()
                        ),
                    ));
                }
                w.u64(j.job_id).u32(j.keys.len() as u32);
                for (row, k) in j.rows.iter().zip(&j.keys) {
                    w.u32(*row).key16(k)?;
                }
                if matches!(self, Request::Store(_)) {
                    KIND_STORE
                } else {
                    KIND_LOAD
                }
            }
            Request::Status => KIND_STATUS,
            Request::Hint { req_id, keys } => {
                w.str16(req_id).keys16(keys)?;
                KIND_HINT
            }
            Request::HintDone { req_id } => {
                w.str16(req_id);
                KIND_HINT_DONE
            }
            Request::TakeEvents => KIND_TAKE_EVENTS,
            Request::Touch { keys } => {
                w.keys16(keys)?;
                KIND_TOUCH
            }
        };
        let frame = w.frame(kind, seq);
        if frame.body.len() > MAX_BODY as usize {
            return Err(Error::new(
                ErrorKind::Contract,
                format!(
                    "a request of {} bytes (at most {MAX_BODY}): split the job",
                    frame.body.len()
                ),
            ));
        }
        Ok(frame)
    }

    /// Reads a request frame.
    pub fn from_frame(f: &Frame) -> Result<Request> {
        let mut r = Reader::of(f);
        let req = match f.kind {
            KIND_HELLO => {
                let (row_stride, digest, engine) = r.greeting("client")?;
                Request::Hello {
                    row_stride,
                    digest,
                    engine,
                }
            }
            KIND_REGISTER_PATH => Request::RegisterPath {
                num_rows: r.u64()?,
                path: r.str16()?,
            },
            KIND_REGISTER_FD => Request::RegisterFd { num_rows: r.u64()? },
            KIND_LOOKUP => Request::Lookup { keys: r.keys16()? },
            KIND_STORE | KIND_LOAD => {
                let job_id = r.u64()?;
                let n = r.count(6)?;
                let mut rows = Vec::with_capacity(n);
                let mut keys = Vec::with_capacity(n);
                for _ in 0..n {
                    rows.push(r.u32()?);
                    keys.push(r.key16()?);
                }
                let j = JobRequest { job_id, rows, keys };
                if f.kind == KIND_STORE {
                    Request::Store(j)
                } else {
                    Request::Load(j)
                }
            }
            KIND_STATUS => Request::Status,
            KIND_HINT => Request::Hint {
                req_id: r.str16()?,
                keys: r.keys16()?,
            },
            KIND_HINT_DONE => Request::HintDone { req_id: r.str16()? },
            KIND_TAKE_EVENTS => Request::TakeEvents,
            KIND_TOUCH => Request::Touch { keys: r.keys16()? },
            k => {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!("unknown request kind {k:#06x}"),
                ));
            }
        };
        r.end()?;
        Ok(req)
    }
}
