//! The node service's wire protocol: little-endian frames on a Unix stream socket, byte for
//! byte in `docs/node-service.md`.
//!
//! Every frame is a 16-byte header and a body:
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 4 | `body_len`, u32: bytes of the body (at most [`MAX_BODY`]) |
//! | 4 | 2 | `kind`, u16 (the `KIND_*` constants) |
//! | 6 | 2 | `flags`, u16: 0 (reserved) |
//! | 8 | 8 | `seq`, u64: the client's request number, echoed by the reply |
//!
//! Strings (`str16`) are a u16 byte count and UTF-8 bytes; keys (`key16`) a u16 byte count and
//! the key's bytes. Integers are little-endian.

use crate::contract::job::{JobResult, LookupResult};
use crate::error::{Error, ErrorKind, Result};
use crate::key::ChunkKey;

/// The first four bytes of a `HELLO` and a `WELCOME` body.
pub const MAGIC: [u8; 4] = *b"KVTN";
/// The protocol version this build speaks.
pub const VERSION: u16 = 1;
/// Bytes of a frame header.
pub const HEADER_LEN: usize = 16;
/// The largest body a peer may send (16 MiB).
pub const MAX_BODY: u32 = 16 << 20;

/// Client: opens the session (magic, version, row stride, compatibility digest, engine name).
pub const KIND_HELLO: u16 = 0x0001;
/// Client: registers the primary region by the path of its shared file.
pub const KIND_REGISTER_PATH: u16 = 0x0002;
/// Client: registers the primary region by a descriptor sent with the frame (`SCM_RIGHTS`).
pub const KIND_REGISTER_FD: u16 = 0x0003;
/// Client: looks keys up.
pub const KIND_LOOKUP: u16 = 0x0004;
/// Client: stores rows of its region under keys (primary -> G3).
pub const KIND_STORE: u16 = 0x0005;
/// Client: loads keys into rows of its region (G3 -> primary).
pub const KIND_LOAD: u16 = 0x0006;
/// Client: asks for the service's status (JSON).
pub const KIND_STATUS: u16 = 0x0007;
/// Client: a request's prefetch hint (keys to stage from G3 into the DRAM staging pool).
pub const KIND_HINT: u16 = 0x0008;
/// Client: the hinted request finished; what it did not use is discarded (no reply).
pub const KIND_HINT_DONE: u16 = 0x0009;
/// Client: asks for the inventory events since its last ask (subscribes at the first).
pub const KIND_TAKE_EVENTS: u16 = 0x000A;
/// Client: keys recently used (vLLM's `touch`), for G3's LRU (no reply).
pub const KIND_TOUCH: u16 = 0x000B;
/// Service: the session is open.
pub const KIND_WELCOME: u16 = 0x8001;
/// Service: the region is mapped.
pub const KIND_REGISTERED: u16 = 0x8002;
/// Service: one result per key of a `LOOKUP`.
pub const KIND_LOOKUP_RESULT: u16 = 0x8004;
/// Service: a `STORE` or `LOAD` job finished (its `seq` is the job's request).
pub const KIND_JOB_DONE: u16 = 0x8005;
/// Service: the status, as JSON.
pub const KIND_STATUS_REPLY: u16 = 0x8007;
/// Service: one verdict per key of a `HINT` (as `LOOKUP_RESULT`).
pub const KIND_HINTED: u16 = 0x8008;
/// Service: inventory events (which medium holds which keys).
pub const KIND_EVENTS: u16 = 0x800A;
/// Service: the request failed (after a refused `HELLO` the service closes the socket).
pub const KIND_ERROR: u16 = 0x80FF;

/// One frame: its kind, sequence number and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The `KIND_*` value.
    pub kind: u16,
    /// The request number (replies echo it).
    pub seq: u64,
    /// The body.
    pub body: Vec<u8>,
}

/// The fields of a frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Bytes of the body.
    pub body_len: u32,
    /// The `KIND_*` value.
    pub kind: u16,
    /// The request number.
    pub seq: u64,
}

impl Header {
    /// Reads a header; a body longer than [`MAX_BODY`] or nonzero flags are refused.
    pub fn parse(b: &[u8; HEADER_LEN]) -> Result<Header> {
        let body_len = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let kind = u16::from_le_bytes([b[4], b[5]]);
        let flags = u16::from_le_bytes([b[6], b[7]]);
        let mut seq = [0u8; 8];
        seq.copy_from_slice(&b[8..16]);
        if body_len > MAX_BODY {
            return Err(malformed(format!(
                "a frame of kind {kind:#06x} announces {body_len} body bytes (at most {MAX_BODY})"
            )));
        }
        if flags != 0 {
            return Err(malformed(format!(
                "frame flags {flags:#06x} (this version knows none)"
            )));
        }
        Ok(Header {
            body_len,
            kind,
            seq: u64::from_le_bytes(seq),
        })
    }
}

impl Frame {
    /// The frame's bytes: header then body.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + self.body.len());
        out.extend_from_slice(&(self.body.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.kind.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&self.seq.to_le_bytes());
        out.extend_from_slice(&self.body);
        out
    }
}

fn malformed(msg: impl Into<String>) -> Error {
    Error::new(
        ErrorKind::Contract,
        format!("malformed node-service frame: {}", msg.into()),
    )
}

/// A store or load job: rows of the client's region and their keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobRequest {
    /// The client's job id (echoed in `JOB_DONE`).
    pub job_id: u64,
    /// Row of the client's region per key.
    pub rows: Vec<u32>,
    /// The keys.
    pub keys: Vec<ChunkKey>,
}

/// What a client sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Opens the session.
    Hello {
        /// Bytes per row of the engine's region.
        row_stride: u64,
        /// The engine's compatibility (namespace) digest.
        digest: [u8; 32],
        /// A name for status and logs (vLLM's engine id).
        engine: String,
    },
    /// Registers the region by path.
    RegisterPath {
        /// Rows of the region.
        num_rows: u64,
        /// The shared file (`/dev/shm/vllm_offload_<engine_id>.mmap`).
        path: String,
    },
    /// Registers the region by the descriptor sent with the frame.
    RegisterFd {
        /// Rows of the region.
        num_rows: u64,
    },
    /// Looks keys up.
    Lookup {
        /// The keys.
        keys: Vec<ChunkKey>,
    },
    /// Primary -> G3.
    Store(JobRequest),
    /// G3 -> primary.
    Load(JobRequest),
    /// The service's status.
    Status,
    /// Stage `keys` for request `req_id` (answered with one verdict per key).
    Hint {
        /// The engine's request id.
        req_id: String,
        /// The keys the request will look up.
        keys: Vec<ChunkKey>,
    },
    /// Request `req_id` finished: its staged keys it did not load are discarded.
    HintDone {
        /// The engine's request id.
        req_id: String,
    },
    /// The inventory events since the last ask.
    TakeEvents,
    /// The keys were used (vLLM's `touch`): most recently used in G3's LRU.
    Touch {
        /// The keys.
        keys: Vec<ChunkKey>,
    },
}

/// Which medium of the service holds the keys of an [`InventoryEvent`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventMedium {
    /// The DRAM staging pool (vLLM `Medium.CPU`), wire value 0.
    Cpu,
    /// The G3 slots (vLLM `Medium.STORAGE`), wire value 1.
    Storage,
}

/// Keys stored in or removed from one medium of the service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InventoryEvent {
    /// Where.
    pub medium: EventMedium,
    /// True: the keys left that medium; false: they arrived.
    pub removed: bool,
    /// The keys.
    pub keys: Vec<ChunkKey>,
}

/// The outcome of a job as it crosses the socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobDone {
    /// The job id.
    pub job_id: u64,
    /// Every key moved (or was skipped as held).
    pub success: bool,
    /// Bytes moved.
    pub transfer_bytes: u64,
    /// Nanoseconds spent moving them.
    pub transfer_ns: u64,
    /// A failed load: indices (into the job's keys) of the keys that did load.
    pub loaded: Option<Vec<u32>>,
    /// The first error.
    pub error: Option<(ErrorKind, String)>,
}

impl JobDone {
    /// The wire form of `r`, a job of `keys`.
    pub fn from_result(r: &JobResult, keys: &[ChunkKey]) -> JobDone {
        let loaded = r.successful_keys.as_ref().map(|ok| {
            keys.iter()
                .enumerate()
                .filter(|(_, k)| ok.contains(k))
                .map(|(i, _)| i as u32)
                .collect()
        });
        JobDone {
            job_id: r.job_id,
            success: r.success,
            transfer_bytes: r.transfer_bytes.unwrap_or(0),
            transfer_ns: r
                .transfer_time
                .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
            loaded,
            error: r
                .error
                .as_ref()
                .map(|e| (e.kind(), e.message().to_string())),
        }
    }

    /// The job's [`JobResult`] (`keys` are the job's keys).
    pub fn to_result(&self, keys: &[ChunkKey]) -> JobResult {
        let error = self.error.as_ref().map(|(k, m)| Error::new(*k, m.clone()));
        JobResult {
            job_id: self.job_id,
            success: self.success,
            successful_keys: self.loaded.as_ref().map(|ix| {
                ix.iter()
                    .filter_map(|&i| keys.get(i as usize).cloned())
                    .collect()
            }),
            transfer_time: (self.success || self.transfer_ns > 0)
                .then(|| std::time::Duration::from_nanos(self.transfer_ns)),
            transfer_bytes: (self.success || self.transfer_bytes > 0)
                .then_some(self.transfer_bytes),
            error: if self.success { None } else { error },
        }
    }
}

/// What the service sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// The session is open.
    Welcome {
        /// The service's row stride.
        row_stride: u64,
        /// The service's compatibility digest.
        digest: [u8; 32],
        /// The service's kvtier version.
        version: String,
    },
    /// The region is mapped.
    Registered {
        /// Rows mapped.
        num_rows: u64,
    },
    /// One result per key.
    Lookup(Vec<LookupResult>),
    /// A job finished.
    JobDone(JobDone),
    /// The status as JSON.
    Status(String),
    /// One verdict per key of a `HINT`.
    Hinted(Vec<LookupResult>),
    /// Inventory events, oldest first.
    Events(Vec<InventoryEvent>),
    /// The request failed.
    Error {
        /// The error's kind.
        kind: ErrorKind,
        /// What went wrong.
        message: String,
    },
}

/// Appends to a body.
#[derive(Debug, Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    /// A u16 count and the bytes, cut at 65535 bytes (on a character boundary for text).
    fn str16(&mut self, s: &str) -> &mut Self {
        let mut end = s.len().min(u16::MAX as usize);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.u16(end as u16).bytes(&s.as_bytes()[..end])
    }
    fn key16(&mut self, k: &ChunkKey) -> Result<&mut Self> {
        let len = u16::try_from(k.len()).map_err(|_| {
            Error::new(
                ErrorKind::Contract,
                format!(
                    "a key of {} bytes (at most 65535 cross the socket)",
                    k.len()
                ),
            )
        })?;
        Ok(self.u16(len).bytes(k.as_bytes()))
    }
    /// A u32 count and that many `key16`s.
    fn keys16(&mut self, keys: &[ChunkKey]) -> Result<&mut Self> {
        self.u32(keys.len() as u32);
        for k in keys {
            self.key16(k)?;
        }
        Ok(self)
    }
    /// The body of `HELLO` and `WELCOME`: magic, version, reserved, row stride, digest, text.
    fn greeting(&mut self, row_stride: u64, digest: &[u8; 32], text: &str) {
        self.bytes(&MAGIC)
            .u16(VERSION)
            .u16(0)
            .u64(row_stride)
            .bytes(digest)
            .str16(text);
    }
    fn frame(self, kind: u16, seq: u64) -> Frame {
        Frame {
            kind,
            seq,
            body: self.0,
        }
    }
}

/// Reads a body.
struct Reader<'a> {
    b: &'a [u8],
    /// The frame's kind, for errors.
    what: &'static str,
}

/// The name of frame kind `kind` (as in the `KIND_*` constants), for errors.
fn kind_name(kind: u16) -> &'static str {
    match kind {
        KIND_HELLO => "HELLO",
        KIND_REGISTER_PATH => "REGISTER_PATH",
        KIND_REGISTER_FD => "REGISTER_FD",
        KIND_LOOKUP => "LOOKUP",
        KIND_STORE => "STORE",
        KIND_LOAD => "LOAD",
        KIND_STATUS => "STATUS",
        KIND_WELCOME => "WELCOME",
        KIND_REGISTERED => "REGISTERED",
        KIND_LOOKUP_RESULT => "LOOKUP_RESULT",
        KIND_JOB_DONE => "JOB_DONE",
        KIND_STATUS_REPLY => "STATUS",
        KIND_HINT => "HINT",
        KIND_HINT_DONE => "HINT_DONE",
        KIND_TAKE_EVENTS => "TAKE_EVENTS",
        KIND_TOUCH => "TOUCH",
        KIND_HINTED => "HINTED",
        KIND_EVENTS => "EVENTS",
        KIND_ERROR => "ERROR",
        _ => "unknown",
    }
}

impl<'a> Reader<'a> {
    /// A reader of `f`'s body.
    fn of(f: &'a Frame) -> Self {
        Reader {
            b: &f.body,
            what: kind_name(f.kind),
        }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.b.len() < n {
            return Err(malformed(format!(
                "the {} body ends {} bytes early",
                self.what,
                n - self.b.len()
            )));
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn str16(&mut self) -> Result<String> {
        let n = self.u16()? as usize;
        let what = self.what;
        String::from_utf8(self.take(n)?.to_vec())
            .map_err(|_| malformed(format!("a string of the {what} body is not UTF-8")))
    }
    /// A [`Writer::greeting`] from the `peer` (`client` or `service`): its row stride,
    /// digest and text, after the magic and version are checked.
    fn greeting(&mut self, peer: &str) -> Result<(u64, [u8; 32], String)> {
        let magic: [u8; 4] = self.array()?;
        if magic != MAGIC {
            return Err(malformed(format!(
                "{} magic {} (expected {})",
                self.what,
                hex::encode(magic),
                hex::encode(MAGIC)
            )));
        }
        let version = self.u16()?;
        if version != VERSION {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "the {peer} speaks node-service protocol version {version}, this kvtier \
                     {VERSION}"
                ),
            ));
        }
        self.u16()?;
        Ok((self.u64()?, self.array()?, self.str16()?))
    }
    fn key16(&mut self) -> Result<ChunkKey> {
        let n = self.u16()? as usize;
        Ok(ChunkKey::new(self.take(n)?))
    }
    /// A u32 count and that many `key16`s (each at least its 2-byte length).
    fn keys16(&mut self) -> Result<Vec<ChunkKey>> {
        let n = self.count(2)?;
        (0..n).map(|_| self.key16()).collect()
    }
    /// A count of items each at least `min_item` bytes long, checked against what is left.
    fn count(&mut self, min_item: usize) -> Result<usize> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min_item) > self.b.len() {
            return Err(malformed(format!(
                "the {} body announces {n} items but holds {} bytes",
                self.what,
                self.b.len()
            )));
        }
        Ok(n)
    }
    fn end(self) -> Result<()> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(malformed(format!(
                "{} bytes after the end of the {} body",
                self.b.len(),
                self.what
            )))
        }
    }
}

fn lookup_byte(r: LookupResult) -> u8 {
    match r {
        LookupResult::Miss => 0,
        LookupResult::Hit => 1,
        LookupResult::Retry | LookupResult::HitPending => 2,
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip_request(req: Request) {
        let bytes = req.to_frame(7).unwrap().to_bytes();
        let mut h = [0u8; HEADER_LEN];
        h.copy_from_slice(&bytes[..HEADER_LEN]);
        let head = Header::parse(&h).unwrap();
        assert_eq!(head.seq, 7);
        assert_eq!(head.body_len as usize, bytes.len() - HEADER_LEN);
        let f = Frame {
            kind: head.kind,
            seq: head.seq,
            body: bytes[HEADER_LEN..].to_vec(),
        };
        assert_eq!(Request::from_frame(&f).unwrap(), req);
    }

    #[test]
    fn a_hello_is_the_documented_bytes() {
        let f = Request::Hello {
            row_stride: 0x2000,
            digest: [0xAB; 32],
            engine: "dp0".into(),
        }
        .to_frame(1)
        .unwrap()
        .to_bytes();
        let mut want = vec![];
        want.extend_from_slice(&[53, 0, 0, 0, 0x01, 0x00, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]);
        want.extend_from_slice(b"KVTN");
        want.extend_from_slice(&[1, 0, 0, 0]);
        want.extend_from_slice(&[0x00, 0x20, 0, 0, 0, 0, 0, 0]);
        want.extend_from_slice(&[0xAB; 32]);
        want.extend_from_slice(&[3, 0]);
        want.extend_from_slice(b"dp0");
        assert_eq!(f, want);
    }

    #[test]
    fn requests_round_trip() {
        round_trip_request(Request::RegisterPath {
            num_rows: 12,
            path: "/dev/shm/vllm_offload_e.mmap".into(),
        });
        round_trip_request(Request::RegisterFd { num_rows: 3 });
        round_trip_request(Request::Lookup {
            keys: vec![ChunkKey::new(b"a"), ChunkKey::new([0u8; 36])],
        });
        round_trip_request(Request::Store(JobRequest {
            job_id: u64::MAX,
            rows: vec![0, 9],
            keys: vec![ChunkKey::new(b"k0"), ChunkKey::new(b"k1")],
        }));
        round_trip_request(Request::Load(JobRequest {
            job_id: 5,
            rows: vec![],
            keys: vec![],
        }));
        round_trip_request(Request::Status);
        round_trip_request(Request::Hint {
            req_id: "req-1".into(),
            keys: vec![ChunkKey::new([7u8; 36])],
        });
        round_trip_request(Request::HintDone {
            req_id: "req-1".into(),
        });
        round_trip_request(Request::TakeEvents);
        round_trip_request(Request::Touch {
            keys: vec![ChunkKey::new([3u8; 36]), ChunkKey::new(b"t")],
        });
    }

    #[test]
    fn replies_round_trip() {
        for reply in [
            Reply::Welcome {
                row_stride: 4096,
                digest: [1; 32],
                version: "0.1.0".into(),
            },
            Reply::Registered { num_rows: 4 },
            Reply::Lookup(vec![
                LookupResult::Hit,
                LookupResult::Miss,
                LookupResult::Retry,
            ]),
            Reply::JobDone(JobDone {
                job_id: 3,
                success: false,
                transfer_bytes: 4096,
                transfer_ns: 1000,
                loaded: Some(vec![0, 2]),
                error: Some((ErrorKind::Checksum, "key 01: CRC".into())),
            }),
            Reply::JobDone(JobDone {
                job_id: 4,
                success: true,
                transfer_bytes: 0,
                transfer_ns: 0,
                loaded: None,
                error: None,
            }),
            Reply::Status("{\"engines\":[]}".into()),
            Reply::Hinted(vec![LookupResult::Hit, LookupResult::Miss]),
            Reply::Events(vec![
                InventoryEvent {
                    medium: EventMedium::Cpu,
                    removed: false,
                    keys: vec![ChunkKey::new(b"a"), ChunkKey::new(b"b")],
                },
                InventoryEvent {
                    medium: EventMedium::Storage,
                    removed: true,
                    keys: vec![],
                },
            ]),
            Reply::Error {
                kind: ErrorKind::PermissionDenied,
                message: "uid 65534".into(),
            },
        ] {
            let f = reply.to_frame(9);
            assert_eq!(Reply::from_frame(&f).unwrap(), reply);
        }
    }

    #[test]
    fn truncated_oversized_and_trailing_bodies_are_refused_without_panicking() {
        let f = Request::Lookup {
            keys: vec![ChunkKey::new(b"abc")],
        }
        .to_frame(1)
        .unwrap();
        for cut in 0..f.body.len() {
            let g = Frame {
                body: f.body[..cut].to_vec(),
                ..f.clone()
            };
            assert_eq!(
                Request::from_frame(&g).unwrap_err().kind(),
                ErrorKind::Contract
            );
        }
        let mut g = f.clone();
        g.body.push(0);
        assert!(
            Request::from_frame(&g)
                .unwrap_err()
                .message()
                .contains("after the end")
        );
        let mut h = [0u8; HEADER_LEN];
        h[..4].copy_from_slice(&(MAX_BODY + 1).to_le_bytes());
        assert!(Header::parse(&h).is_err());
        // A count far beyond the body is refused before anything is allocated for it.
        let huge = Frame {
            kind: KIND_LOOKUP,
            seq: 1,
            body: u32::MAX.to_le_bytes().to_vec(),
        };
        assert!(Request::from_frame(&huge).is_err());
    }
}
