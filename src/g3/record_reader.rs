//! Reading journal and checkpoint records fast: the file is streamed through one reusable
//! buffer (no allocation proportional to the file, no page faults on a fresh multi-hundred-MB
//! buffer), every record's CRC is checked over the buffered chunk, and records are handed out
//! as [`RecordRef`]s borrowing their keys from the buffer (no allocation per record).
//!
//! Byte layouts are in `docs/format.md`; the checks are exactly those of
//! [`crate::g3::journal::decode_records`]: decoding stops at the first record that is torn,
//! fails its CRC or has an unknown kind.

use std::fs::File;
use std::path::Path;

use crate::error::{Error, Result};
use crate::g3::format::{le_u32, le_u64, read_at_most};
use crate::g3::index::Slot;
use crate::g3::journal::{KIND_INSERT, KIND_REMOVE, MAX_KEY_LEN, RECORD_HEADER_SIZE, Record};
use crate::key::ChunkKey;

/// Bytes read per chunk (plus room for one longest record carried over).
const CHUNK_BYTES: usize = 1 << 20;

/// One record, borrowing its key bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordRef<'a> {
    /// `slot` now holds `key`, whose bytes have CRC32 `crc`.
    Insert {
        /// The key's bytes.
        key: &'a [u8],
        /// Its slot.
        slot: Slot,
        /// CRC32 of the slot's bytes.
        crc: u32,
        /// Generation.
        generation: u64,
    },
    /// `slot` holds nothing any more.
    Remove {
        /// The slot.
        slot: Slot,
    },
}

impl RecordRef<'_> {
    /// The owned [`Record`].
    pub fn to_record(&self) -> Record {
        match *self {
            RecordRef::Insert {
                key,
                slot,
                crc,
                generation,
            } => Record::Insert {
                key: ChunkKey::new(key),
                slot,
                crc,
                generation,
            },
            RecordRef::Remove { slot } => Record::Remove { slot },
        }
    }
}

/// Checks the records at the start of `body`, whose first byte is at offset `base` of the
/// record area (for messages). Returns `(valid_bytes, problem)`: `valid_bytes` covers whole
/// records with a matching CRC and a known kind. A record cut off by the end of `body` is a
/// problem (torn) only when `at_end`; otherwise checking just stops before it, as more bytes
/// may follow.
pub fn check_records(body: &[u8], base: u64, at_end: bool) -> (usize, Option<String>) {
    let mut off = 0;
    while off < body.len() {
        let rest = &body[off..];
        let at = base + off as u64;
        if rest.len() < RECORD_HEADER_SIZE {
            return (
                off,
                at_end.then(|| format!("torn record header at offset {at}")),
            );
        }
        let len = RECORD_HEADER_SIZE + usize::from(u16::from_le_bytes([rest[6], rest[7]]));
        if rest.len() < len {
            return (off, at_end.then(|| format!("torn record at offset {at}")));
        }
        if crc32fast::hash(&rest[4..len]) != le_u32(rest, 0) {
            return (off, Some(format!("record CRC mismatch at offset {at}")));
        }
        if rest[4] != KIND_INSERT && rest[4] != KIND_REMOVE {
            return (
                off,
                Some(format!("unknown record kind {} at offset {at}", rest[4])),
            );
        }
        off += len;
    }
    (off, None)
}

/// The records of `valid`, a prefix accepted by [`check_records`]. Iteration ends early (it
/// never panics) if `valid` holds anything else.
pub fn records(valid: &[u8]) -> Records<'_> {
    Records { rest: valid }
}

/// Iterator returned by [`records`].
#[derive(Debug, Clone)]
pub struct Records<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for Records<'a> {
    type Item = RecordRef<'a>;

    fn next(&mut self) -> Option<RecordRef<'a>> {
        let r = self.rest;
        if r.len() < RECORD_HEADER_SIZE {
            return None;
        }
        let len = RECORD_HEADER_SIZE + usize::from(u16::from_le_bytes([r[6], r[7]]));
        let key = r.get(RECORD_HEADER_SIZE..len)?;
        let slot = le_u32(r, 8);
        let rec = match r[4] {
            KIND_INSERT => RecordRef::Insert {
                key,
                slot,
                crc: le_u32(r, 12),
                generation: le_u64(r, 16),
            },
            KIND_REMOVE => RecordRef::Remove { slot },
            _ => return None,
        };
        self.rest = &r[len..];
        Some(rec)
    }
}

/// What [`stream_records`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamEnd {
    /// Bytes of whole, valid records from `start`.
    pub valid: u64,
    /// Bytes from `start` to the end of the file.
    pub total: u64,
    /// Why reading stopped before the end, if it did.
    pub problem: Option<String>,
}

/// Reads the records of `file` (at `path`, for messages) from byte `start` to its end, in
/// chunks through one buffer, calling `f` with each run of checked, whole records (pass it
/// to [`records`]). Stops at the first torn or corrupt record.
pub fn stream_records(
    file: &File,
    path: &Path,
    start: u64,
    mut f: impl FnMut(&[u8]),
) -> Result<StreamEnd> {
    let mut buf = vec![0u8; CHUNK_BYTES + RECORD_HEADER_SIZE + MAX_KEY_LEN];
    // buf[..filled] holds the bytes at record offsets base..base + filled.
    let mut filled = 0usize;
    let mut base = 0u64;
    let mut at_end = false;
    loop {
        if !at_end && filled < buf.len() {
            let want = buf.len() - filled;
            let n = read_at_most(file, &mut buf[filled..], start + base + filled as u64)
                .map_err(|e| Error::io("read", path, e))?;
            filled += n;
            at_end = n < want;
        }
        // A full buffer always holds at least one whole record, so every round progresses.
        let (valid, problem) = check_records(&buf[..filled], base, at_end);
        if valid > 0 {
            f(&buf[..valid]);
        }
        if problem.is_some() || (at_end && valid == filled) {
            let mut total = base + filled as u64;
            if !at_end {
                // Stopped early: the rest of the file (to be cut off) was not read.
                let len = file
                    .metadata()
                    .map_err(|e| Error::io("stat", path, e))?
                    .len();
                total = total.max(len.saturating_sub(start));
            }
            return Ok(StreamEnd {
                valid: base + valid as u64,
                total,
                problem,
            });
        }
        buf.copy_within(valid..filled, 0);
        filled -= valid;
        base += valid as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::g3::journal::{decode_records, encode_insert, encode_remove};

    fn sample(n: u32) -> Vec<u8> {
        let mut b = Vec::new();
        for i in 0..n {
            let key = vec![i as u8; (i as usize * 7) % 300];
            encode_insert(&mut b, &key, i, i ^ 0xABCD, u64::from(i) + 1);
            if i % 5 == 0 {
                encode_remove(&mut b, i / 2);
            }
        }
        b
    }

    fn streamed(bytes: &[u8]) -> (Vec<Record>, StreamEnd) {
        let d = tempfile::tempdir_in("/tmp").unwrap();
        let p = d.path().join("records");
        let mut with_prefix = vec![0xEE; 64];
        with_prefix.extend_from_slice(bytes);
        std::fs::write(&p, &with_prefix).unwrap();
        let f = File::open(&p).unwrap();
        let mut got = Vec::new();
        let end = stream_records(&f, &p, 64, |chunk| {
            got.extend(records(chunk).map(|r| r.to_record()));
        })
        .unwrap();
        (got, end)
    }

    #[test]
    fn streaming_across_chunks_matches_whole_buffer_decoding() {
        // Enough records to span several chunks, so records straddle chunk boundaries.
        let b = sample(30_000);
        assert!(b.len() > 3 * CHUNK_BYTES);
        let mut want = Vec::new();
        let (n, p) = decode_records(&b, |r| want.push(r));
        assert_eq!((n, p), (b.len(), None));
        let (got, end) = streamed(&b);
        assert_eq!(got, want);
        let len = b.len() as u64;
        assert_eq!(
            end,
            StreamEnd {
                valid: len,
                total: len,
                problem: None
            }
        );
    }

    #[test]
    fn torn_and_corrupt_records_stop_the_stream_where_decoding_stops() {
        let b = sample(30_000);
        let mut bad = b.clone();
        let at = b.len() / 2 + 3;
        bad[at] ^= 0x10;
        for (bytes, what) in [(&b[..b.len() - 5], "torn"), (&bad[..], "CRC")] {
            let mut want = Vec::new();
            let (n, p) = decode_records(bytes, |r| want.push(r));
            let (got, end) = streamed(bytes);
            assert_eq!(got, want);
            assert_eq!(end.valid, n as u64);
            assert_eq!(end.total, bytes.len() as u64);
            assert_eq!(end.problem, p);
            assert!(end.problem.unwrap().contains(what));
        }
    }
}
