//! A frame: its 16-byte header (see the [module docs](super)), the frame kinds and limits.

use crate::error::{Error, ErrorKind, Result};

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

pub(super) fn malformed(msg: impl Into<String>) -> Error {
    Error::new(
        ErrorKind::Contract,
        format!("malformed node-service frame: {}", msg.into()),
    )
}

/// The name of frame kind `kind` (as in the `KIND_*` constants), for errors.
pub(super) fn kind_name(kind: u16) -> &'static str {
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
