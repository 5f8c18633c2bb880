//! Reading journal and checkpoint records fast: the file is streamed through one reusable
//! buffer (no allocation proportional to the file, no page faults on a fresh multi-hundred-MB
//! buffer), every record is checked over the buffered chunk ([`RecordCodec::check`]), and
//! records are handed out in runs whose keys borrow from the buffer (no allocation per
//! record).
//!
//! A record that fails its check does not end the file: the reader skips it and
//! resynchronises on the next offset that holds a valid record, reporting the bytes skipped
//! ([`StreamEnd::skipped`]). Bytes at the end with no valid record after them are a tail
//! ([`StreamEnd::tail`]): a torn append, cut off by the journal writer. The checks are
//! exactly those of [`crate::g3::record::decode_records`].

use std::fs::File;
use std::path::Path;

use crate::error::{Error, Result};
use crate::g3::format::read_at_most;
use crate::g3::record::{Checked, Damage, Invalid, MAX_RECORD_LEN, RECORD_MAGIC, RecordCodec};

/// Bytes read per chunk (plus room for one longest record carried over).
const CHUNK_BYTES: usize = 1 << 20;

/// What [`stream_records`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamEnd {
    /// Valid records read.
    pub records: u64,
    /// File offset just past the last valid record (`start` when there is none).
    pub valid_end: u64,
    /// File length.
    pub total: u64,
    /// Stretches skipped between valid records (damage in the middle).
    pub skipped: Vec<Damage>,
    /// A stretch at the end with no valid record after it.
    pub tail: Option<Damage>,
}

impl StreamEnd {
    /// Bytes skipped in the middle.
    pub fn skipped_bytes(&self) -> u64 {
        self.skipped.iter().map(Damage::len).sum()
    }

    /// A one-line description of the damage found, if any.
    pub fn problem(&self) -> Option<String> {
        let first = self.skipped.first().or(self.tail.as_ref())?;
        let mut s = format!("{} at offset {}", first.why, first.start);
        if !self.skipped.is_empty() {
            s.push_str(&format!(
                "; {} damaged stretch(es), {} bytes skipped, later records read",
                self.skipped.len(),
                self.skipped_bytes()
            ));
        }
        if let Some(t) = &self.tail {
            s.push_str(&format!(
                "; {} bytes at the end hold no valid record",
                t.len()
            ));
        }
        Some(s)
    }
}

/// Reads the records of `file` (at `path`, for messages) from byte `start` to its end, in
/// chunks through one buffer, calling `f` with each run of checked, whole records (pass it to
/// [`crate::g3::record::records`]). Damaged records are skipped (see the module docs).
pub fn stream_records(
    codec: &RecordCodec,
    file: &File,
    path: &Path,
    start: u64,
    mut f: impl FnMut(&[u8]),
) -> Result<StreamEnd> {
    let mut buf = vec![0u8; CHUNK_BYTES + MAX_RECORD_LEN];
    let mut end = StreamEnd {
        valid_end: start,
        ..StreamEnd::default()
    };
    // buf[..filled] holds the file bytes at offsets base..base + filled.
    let mut filled = 0usize;
    let mut base = start;
    let mut at_end = false;
    // Where the current stretch of damage began, and why.
    let mut damage: Option<(u64, Invalid)> = None;
    loop {
        if !at_end && filled < buf.len() {
            let want = buf.len() - filled;
            let n = read_at_most(file, &mut buf[filled..], base + filled as u64)
                .map_err(|e| Error::io("read", path, e))?;
            filled += n;
            at_end = n < want;
        }
        let mut pos = 0;
        let mut run = 0;
        while pos < filled {
            match codec.check(&buf[pos..filled], base + pos as u64, at_end) {
                Checked::Valid(len) => {
                    if let Some((s, why)) = damage.take() {
                        end.skipped.push(Damage {
                            start: s,
                            end: base + pos as u64,
                            why,
                        });
                        run = pos;
                    }
                    pos += len;
                    end.records += 1;
                    end.valid_end = base + pos as u64;
                }
                Checked::NeedMore => break,
                Checked::Invalid(why) => {
                    if run < pos {
                        f(&buf[run..pos]);
                    }
                    damage.get_or_insert((base + pos as u64, why));
                    // Resynchronise: the next offset whose byte 4 is the record magic.
                    pos = next_candidate(&buf[..filled], pos + 1);
                    run = pos;
                }
            }
        }
        if damage.is_none() && run < pos {
            f(&buf[run..pos]);
        }
        if at_end && pos >= filled {
            end.total = base + filled as u64;
            if let Some((s, why)) = damage {
                end.tail = Some(Damage {
                    start: s,
                    end: end.total,
                    why,
                });
            }
            return Ok(end);
        }
        let keep = pos.min(filled);
        buf.copy_within(keep..filled, 0);
        filled -= keep;
        base += keep as u64;
    }
}

/// The first offset `>= from` in `b` that could start a record (its byte 4 is the record
/// magic), or where the bytes run out to decide.
fn next_candidate(b: &[u8], from: usize) -> usize {
    match b.get(from + 4..) {
        Some(rest) => rest
            .iter()
            .position(|&x| x == RECORD_MAGIC)
            .map_or(b.len().saturating_sub(4).max(from), |i| from + i),
        None => from.min(b.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::g3::record::{Record, decode_records, records};

    const U: [u8; 16] = [0x5A; 16];
    const START: u64 = 64;

    fn sample(c: &RecordCodec, n: u32) -> Vec<u8> {
        let mut b = Vec::new();
        for i in 0..n {
            let key = vec![i as u8; (i as usize * 7) % 300];
            c.encode_insert(&mut b, START, &key, i, i ^ 0xABCD, u64::from(i) + 1);
            if i % 5 == 0 {
                c.encode_remove(&mut b, START, i / 2);
            }
        }
        b
    }

    fn streamed(c: &RecordCodec, bytes: &[u8]) -> (Vec<Record>, StreamEnd) {
        let d = tempfile::tempdir_in("/tmp").unwrap();
        let p = d.path().join("records");
        let mut with_prefix = vec![0xEE; START as usize];
        with_prefix.extend_from_slice(bytes);
        std::fs::write(&p, &with_prefix).unwrap();
        let f = File::open(&p).unwrap();
        let mut got = Vec::new();
        let end = stream_records(c, &f, &p, START, |chunk| {
            got.extend(records(chunk).map(|r| r.to_record()));
        })
        .unwrap();
        (got, end)
    }

    fn same_as_decoding(c: &RecordCodec, bytes: &[u8]) -> StreamEnd {
        let want = decode_records(c, bytes, START);
        let (got, end) = streamed(c, bytes);
        assert_eq!(got, want.records);
        assert_eq!(end.records, want.records.len() as u64);
        assert_eq!(end.skipped, want.skipped);
        assert_eq!(end.tail, want.tail);
        assert_eq!(end.total, START + bytes.len() as u64);
        end
    }

    #[test]
    fn streaming_across_chunks_matches_whole_buffer_decoding() {
        // Enough records to span several chunks, so records straddle chunk boundaries.
        let c = RecordCodec::new(U);
        let b = sample(&c, 30_000);
        assert!(b.len() > 3 * CHUNK_BYTES);
        let end = same_as_decoding(&c, &b);
        assert_eq!(end.valid_end, START + b.len() as u64);
        assert!(end.skipped.is_empty() && end.tail.is_none());
    }

    #[test]
    fn damage_anywhere_is_skipped_like_decoding_skips_it() {
        let c = RecordCodec::new(U);
        let b = sample(&c, 30_000);
        // A torn tail, a flipped bit in the middle, a stretch of garbage across a chunk
        // boundary, and damage in the very first record.
        let torn = &b[..b.len() - 5];
        let end = same_as_decoding(&c, torn);
        assert!(end.tail.is_some() && end.skipped.is_empty());
        let mut flipped = b.clone();
        flipped[b.len() / 2 + 3] ^= 0x10;
        let end = same_as_decoding(&c, &flipped);
        assert_eq!(end.skipped.len(), 1);
        assert!(end.tail.is_none());
        assert_eq!(end.valid_end, START + b.len() as u64);
        let mut garbage = b.clone();
        for x in &mut garbage[CHUNK_BYTES - 1000..CHUNK_BYTES + 70_000] {
            *x = 0xC5;
        }
        let end = same_as_decoding(&c, &garbage);
        assert_eq!(end.skipped.len(), 1);
        let mut first = b.clone();
        first[9] ^= 1;
        let end = same_as_decoding(&c, &first);
        assert_eq!(end.skipped.len(), 1);
        assert_eq!(end.skipped[0].start, START);
        assert!(end.problem().unwrap().contains("CRC"));
    }
}
