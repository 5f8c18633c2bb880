//! A [`Reply`] to and from its frame.

use super::codec::{Reader, Writer, lookup_byte};
use super::frame::{
    Frame, KIND_ERROR, KIND_EVENTS, KIND_HINTED, KIND_JOB_DONE, KIND_LOOKUP_RESULT,
    KIND_REGISTERED, KIND_STATUS_REPLY, KIND_WELCOME, malformed,
};
use super::messages::{EventMedium, InventoryEvent, JobDone, Reply};
use crate::contract::job::LookupResult;
use crate::error::{ErrorKind, Result};

impl Reply {
    /// The reply as a frame answering request `seq`.
    pub fn to_frame(&self, seq: u64) -> Frame {
        let mut w = Writer::default();
        let kind = match self {
            Reply::Welcome {
                row_stride,
                digest,
                version,
            } => {
                w.greeting(*row_stride, digest, version);
                KIND_WELCOME
            }
            Reply::Registered { num_rows } => {
                w.u64(*num_rows);
                KIND_REGISTERED
            }
            Reply::Lookup(results) | Reply::Hinted(results) => {
                w.u32(results.len() as u32);
                for r in results {
                    w.u8(lookup_byte(*r));
                }
                if matches!(self, Reply::Lookup(_)) {
                    KIND_LOOKUP_RESULT
                } else {
                    KIND_HINTED
                }
            }
            Reply::Events(events) => {
                w.u32(events.len() as u32);
                for e in events {
                    let medium = match e.medium {
                        EventMedium::Cpu => 0,
                        EventMedium::Storage => 1,
                    };
                    w.u8(medium)
                        .u8(u8::from(e.removed))
                        .u32(e.keys.len() as u32);
                    for k in &e.keys {
                        // Keys reached the service through a key16: they fit.
                        let _ = w.key16(k);
                    }
                }
                KIND_EVENTS
            }
            Reply::JobDone(d) => {
                w.u64(d.job_id)
                    .u8(u8::from(d.success))
                    .bytes(&[0; 3])
                    .u64(d.transfer_bytes)
                    .u64(d.transfer_ns);
                match &d.loaded {
                    None => {
                        w.u32(u32::MAX);
                    }
                    Some(ix) => {
                        w.u32(ix.len() as u32);
                        for i in ix {
                            w.u32(*i);
                        }
                    }
                }
                let (k, m) = d
                    .error
                    .as_ref()
                    .map_or(("", ""), |(k, m)| (k.as_str(), m.as_str()));
                w.str16(k).str16(m);
                KIND_JOB_DONE
            }
            Reply::Status(json) => {
                w.u32(json.len() as u32).bytes(json.as_bytes());
                KIND_STATUS_REPLY
            }
            Reply::Error { kind, message } => {
                w.str16(kind.as_str()).str16(message);
                KIND_ERROR
            }
        };
        w.frame(kind, seq)
    }

    /// Reads a reply frame.
    pub fn from_frame(f: &Frame) -> Result<Reply> {
        let mut r = Reader::of(f);
        let reply = match f.kind {
            KIND_WELCOME => {
                let (row_stride, digest, version) = r.greeting("service")?;
                Reply::Welcome {
                    row_stride,
                    digest,
                    version,
                }
            }
            KIND_REGISTERED => Reply::Registered { num_rows: r.u64()? },
            KIND_LOOKUP_RESULT | KIND_HINTED => {
                let n = r.count(1)?;
                let results = (0..n)
                    .map(|_| match r.u8()? {
                        0 => Ok(LookupResult::Miss),
                        1 => Ok(LookupResult::Hit),
                        2 => Ok(LookupResult::Retry),
                        b => Err(malformed(format!("lookup result byte {b}"))),
                    })
                    .collect::<Result<_>>()?;
                if f.kind == KIND_HINTED {
                    Reply::Hinted(results)
                } else {
                    Reply::Lookup(results)
                }
            }
            KIND_EVENTS => {
                let n = r.count(6)?;
                let mut events = Vec::with_capacity(n);
                for _ in 0..n {
                    let medium = match r.u8()? {
                        0 => EventMedium::Cpu,
                        1 => EventMedium::Storage,
                        b => return Err(malformed(format!("event medium byte {b}"))),
                    };
                    let removed = r.u8()? != 0;
                    events.push(InventoryEvent {
                        medium,
                        removed,
                        keys: r.keys16()?,
                    });
                }
                Reply::Events(events)
            }
            KIND_JOB_DONE => {
                let job_id = r.u64()?;
                let success = r.u8()? != 0;
                r.take(3)?;
                let transfer_bytes = r.u64()?;
                let transfer_ns = r.u64()?;
                let n = r.u32()?;
                let loaded = if n == u32::MAX {
                    None
                } else {
                    if (n as usize).saturating_mul(4) > r.b.len() {
                        return Err(malformed(
                            "JOB_DONE announces more loaded keys than it holds",
                        ));
                    }
                    Some((0..n).map(|_| r.u32()).collect::<Result<_>>()?)
                };
                let kind = r.str16()?;
                let message = r.str16()?;
                let error = if kind.is_empty() {
                    None
                } else {
                    Some((
                        ErrorKind::from_name(&kind).unwrap_or(ErrorKind::Internal),
                        message,
                    ))
                };
                Reply::JobDone(JobDone {
                    job_id,
                    success,
                    transfer_bytes,
                    transfer_ns,
                    loaded,
                    error,
                })
            }
            KIND_STATUS_REPLY => {
                let n = r.u32()? as usize;
                let json = String::from_utf8(r.take(n)?.to_vec())
                    .map_err(|_| malformed("the status is not UTF-8"))?;
                Reply::Status(json)
            }
            KIND_ERROR => {
                let kind = r.str16()?;
                let message = r.str16()?;
                Reply::Error {
                    kind: ErrorKind::from_name(&kind).unwrap_or(ErrorKind::Internal),
                    message,
                }
            }
            k => {
                return Err(malformed(format!("unknown reply kind {k:#06x}")));
            }
        };
        r.end()?;
        Ok(reply)
    }
}
