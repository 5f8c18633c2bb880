//! A frame body's writer and reader: little-endian integers, `str16` (a u16 byte count and
//! UTF-8 bytes), `key16` (a u16 byte count and the key's bytes) and the greeting of `HELLO`
//! and `WELCOME`.

use super::frame::{Frame, MAGIC, VERSION, kind_name, malformed};
use crate::contract::job::LookupResult;
use crate::error::{Error, ErrorKind, Result};
use crate::key::ChunkKey;

/// Appends to a body.
#[derive(Debug, Default)]
pub(super) struct Writer(Vec<u8>);

impl Writer {
    pub(super) fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub(super) fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    /// A u16 count and the bytes, cut at 65535 bytes (on a character boundary for text).
    pub(super) fn str16(&mut self, s: &str) -> &mut Self {
        let mut end = s.len().min(u16::MAX as usize);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.u16(end as u16).bytes(&s.as_bytes()[..end])
    }
    pub(super) fn key16(&mut self, k: &ChunkKey) -> Result<&mut Self> {
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
    pub(super) fn keys16(&mut self, keys: &[ChunkKey]) -> Result<&mut Self> {
        self.u32(keys.len() as u32);
        for k in keys {
            self.key16(k)?;
        }
        Ok(self)
    }
    /// The body of `HELLO` and `WELCOME`: magic, version, reserved, row stride, digest, text.
    pub(super) fn greeting(&mut self, row_stride: u64, digest: &[u8; 32], text: &str) {
        self.bytes(&MAGIC)
            .u16(VERSION)
            .u16(0)
            .u64(row_stride)
            .bytes(digest)
            .str16(text);
    }
    pub(super) fn frame(self, kind: u16, seq: u64) -> Frame {
        Frame {
            kind,
            seq,
            body: self.0,
        }
    }
}

/// Reads a body.
pub(super) struct Reader<'a> {
    pub(super) b: &'a [u8],
    /// The frame's kind, for errors.
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// A reader of `f`'s body.
    pub(super) fn of(f: &'a Frame) -> Self {
        Reader {
            b: &f.body,
            what: kind_name(f.kind),
        }
    }
    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8]> {
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
    pub(super) fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub(super) fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    pub(super) fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub(super) fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    pub(super) fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    pub(super) fn str16(&mut self) -> Result<String> {
        let n = self.u16()? as usize;
        let what = self.what;
        String::from_utf8(self.take(n)?.to_vec())
            .map_err(|_| malformed(format!("a string of the {what} body is not UTF-8")))
    }
    /// A [`Writer::greeting`] from the `peer` (`client` or `service`): its row stride,
    /// digest and text, after the magic and version are checked.
    pub(super) fn greeting(&mut self, peer: &str) -> Result<(u64, [u8; 32], String)> {
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
    pub(super) fn key16(&mut self) -> Result<ChunkKey> {
        let n = self.u16()? as usize;
        Ok(ChunkKey::new(self.take(n)?))
    }
    /// A u32 count and that many `key16`s (each at least its 2-byte length).
    pub(super) fn keys16(&mut self) -> Result<Vec<ChunkKey>> {
        let n = self.count(2)?;
        (0..n).map(|_| self.key16()).collect()
    }
    /// A count of items each at least `min_item` bytes long, checked against what is left.
    pub(super) fn count(&mut self, min_item: usize) -> Result<usize> {
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
    pub(super) fn end(self) -> Result<()> {
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

pub(super) fn lookup_byte(r: LookupResult) -> u8 {
    match r {
        LookupResult::Miss => 0,
        LookupResult::Hit => 1,
        LookupResult::Retry | LookupResult::HitPending => 2,
    }
}
