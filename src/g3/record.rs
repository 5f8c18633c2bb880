//! The record codec of the G3 index files (journal and checkpoint), shared by the journal
//! writer, the checkpoint writer, the streaming reader and recovery: the 64-byte file header,
//! the record encoding, the check of one record, and the data CRC that binds a key to its
//! bytes. Byte layouts are in `docs/format.md`; every integer is little-endian.
//!
//! A record's CRC covers the stripe set's uuid and the record's own offset in its file besides
//! its bytes, so a record can be recognised without the file header (a damaged header costs
//! nothing but the header) and a copy of a record at another offset, or from another set, is
//! never valid. Each record also starts with a magic byte, so that a reader can skip a damaged
//! record and find the next valid one ([`RecordCodec::check`] at each candidate offset).

use crate::error::{Error, ErrorKind, Result};
use crate::g3::format::{le_u32, le_u64};
use crate::g3::index::Slot;
#[cfg(any(test, feature = "test-support"))]
use crate::key::ChunkKey;

/// Magic of a journal file.
pub const JOURNAL_MAGIC: [u8; 8] = *b"KVTG3JNL";
/// Magic of a checkpoint file.
pub const CHECKPOINT_MAGIC: [u8; 8] = *b"KVTG3CKP";
/// Version of the journal and checkpoint formats this build writes and reads.
pub const INDEX_FORMAT_VERSION: u32 = 2;
/// Size of the journal / checkpoint file header.
pub const FILE_HEADER_SIZE: usize = 64;
/// Fixed part of a record, before the key bytes.
pub const RECORD_HEADER_SIZE: usize = 24;
/// Longest key a record can hold.
pub const MAX_KEY_LEN: usize = u16::MAX as usize;
/// Longest record.
pub const MAX_RECORD_LEN: usize = RECORD_HEADER_SIZE + MAX_KEY_LEN;
/// Byte 4 of every record.
pub const RECORD_MAGIC: u8 = 0xC5;
/// Largest sequence number or generation accepted from a file: anything above is treated as
/// damage (a real tier never gets near it, and arithmetic on it must not overflow).
pub const MAX_SEQUENCE: u64 = 1 << 62;

/// Record kind: `slot` now holds `key`.
pub const KIND_INSERT: u8 = 1;
/// Record kind: `slot` holds nothing.
pub const KIND_REMOVE: u8 = 2;

/// CRC-32 binding a chunk's bytes to its key: the CRC-32 of the key's bytes followed by the
/// row's bytes (one pass over the row; the key is hashed first). A slot loaded under another
/// key fails this check even when the index names the right CRC of its bytes.
///
/// ```
/// let row = vec![7u8; 4096];
/// let a = kvtier::g3::record::chunk_crc(b"key-a", &row);
/// assert_ne!(a, kvtier::g3::record::chunk_crc(b"key-b", &row));
/// let mut both = b"key-a".to_vec();
/// both.extend_from_slice(&row);
/// assert_eq!(a, crc32fast::hash(&both));
/// ```
pub fn chunk_crc(key: &[u8], row: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(key);
    h.update(row);
    h.finalize()
}

/// [`chunk_crc`] of `key` and a row of `row_len` bytes whose CRC-32 is `row_crc`, without the
/// row's bytes (CRC-32 combination: for another data path that checksums the rows itself).
pub fn chunk_crc_from_row_crc(key: &[u8], row_crc: u32, row_len: u64) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(key);
    h.combine(&crc32fast::Hasher::new_with_initial_len(row_crc, row_len));
    h.finalize()
}

/// The CRC-32 that the `row_len` bytes of `key`'s row must have, given its [`chunk_crc`]
/// (`chunk_crc` is linear in the row's CRC: this undoes [`chunk_crc_from_row_crc`]).
pub fn row_crc_from_chunk_crc(key: &[u8], chunk_crc: u32, row_len: u64) -> u32 {
    chunk_crc ^ chunk_crc_from_row_crc(key, 0, row_len)
}

/// The header of a journal or checkpoint file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileHeader {
    /// `JOURNAL_MAGIC` or `CHECKPOINT_MAGIC`.
    pub magic: [u8; 8],
    /// Uuid of the stripe set the file belongs to.
    pub set_uuid: [u8; 16],
    /// Checkpoint: its sequence number. Journal: the checkpoint it continues.
    pub seq: u64,
    /// Checkpoint: number of entries. Journal: 0.
    pub count: u64,
    /// Checkpoint: next generation to hand out. Journal: 0.
    pub next_generation: u64,
}

impl FileHeader {
    /// Encodes the 64-byte header.
    pub fn encode(&self) -> [u8; FILE_HEADER_SIZE] {
        let mut b = [0u8; FILE_HEADER_SIZE];
        b[0..8].copy_from_slice(&self.magic);
        b[8..12].copy_from_slice(&INDEX_FORMAT_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&(FILE_HEADER_SIZE as u32).to_le_bytes());
        b[16..32].copy_from_slice(&self.set_uuid);
        b[32..40].copy_from_slice(&self.seq.to_le_bytes());
        b[40..48].copy_from_slice(&self.count.to_le_bytes());
        b[48..56].copy_from_slice(&self.next_generation.to_le_bytes());
        let crc = crc32fast::hash(&b[..60]);
        b[60..64].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes and checks a header with the expected magic. `what` names the file. A header
    /// of another format version is [`ErrorKind::IncompatibleLayout`] naming the version;
    /// any other damage (short, magic, CRC, header size, an implausible sequence number or
    /// generation) is [`ErrorKind::Corrupt`].
    pub fn decode(b: &[u8], magic: [u8; 8], what: &str) -> Result<Self> {
        let corrupt = |why: String| {
            Error::new(ErrorKind::Corrupt, format!("{what}: {why}")).with("path", what)
        };
        if b.len() < FILE_HEADER_SIZE {
            return Err(corrupt(format!(
                "{} bytes, shorter than its {FILE_HEADER_SIZE}-byte header",
                b.len()
            )));
        }
        if b[0..8] != magic {
            return Err(corrupt("bad magic".into()));
        }
        let crc = crc32fast::hash(&b[..60]);
        if le_u32(b, 60) != crc {
            return Err(corrupt("header CRC mismatch".into()));
        }
        let version = le_u32(b, 8);
        if version != INDEX_FORMAT_VERSION {
            return Err(Error::new(
                ErrorKind::IncompatibleLayout,
                format!(
                    "{what}: index format version {version} is not supported (this build \
                     reads version {INDEX_FORMAT_VERSION})"
                ),
            )
            .with("path", what)
            .with("expected", INDEX_FORMAT_VERSION.to_string())
            .with("found", version.to_string()));
        }
        if le_u32(b, 12) as usize != FILE_HEADER_SIZE {
            return Err(corrupt(format!("header size is not {FILE_HEADER_SIZE}")));
        }
        let mut set_uuid = [0u8; 16];
        set_uuid.copy_from_slice(&b[16..32]);
        let h = FileHeader {
            magic,
            set_uuid,
            seq: le_u64(b, 32),
            count: le_u64(b, 40),
            next_generation: le_u64(b, 48),
        };
        if h.seq > MAX_SEQUENCE || h.next_generation > MAX_SEQUENCE {
            return Err(corrupt(format!(
                "implausible sequence number {} or generation {}",
                h.seq, h.next_generation
            )));
        }
        Ok(h)
    }
}

/// One index record.
#[cfg(any(test, feature = "test-support"))]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// `slot` now holds `key`, whose bytes have [`chunk_crc`] `crc`.
    Insert {
        /// The key.
        key: ChunkKey,
        /// Its slot.
        slot: Slot,
        /// [`chunk_crc`] of the key and the slot's bytes.
        crc: u32,
        /// Generation (monotonic per stripe set).
        generation: u64,
    },
    /// `slot` holds nothing any more.
    Remove {
        /// The slot.
        slot: Slot,
    },
}

/// One record, borrowing its key bytes from a read buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordRef<'a> {
    /// `slot` now holds `key`, whose bytes have [`chunk_crc`] `crc`.
    Insert {
        /// The key's bytes.
        key: &'a [u8],
        /// Its slot.
        slot: Slot,
        /// [`chunk_crc`] of the key and the slot's bytes.
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
    #[cfg(any(test, feature = "test-support"))]
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

/// Why the bytes at an offset are not a valid record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Invalid {
    /// Fewer bytes than the record needs before the end of the file.
    Torn,
    /// Byte 4 is not [`RECORD_MAGIC`].
    Magic,
    /// Unknown kind, or fields a record of its kind cannot have.
    Kind(u8),
    /// The record CRC does not match.
    Crc,
}

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Invalid::Torn => f.write_str("torn record"),
            Invalid::Magic => f.write_str("no record magic"),
            Invalid::Kind(k) => write!(f, "invalid record (kind {k})"),
            Invalid::Crc => f.write_str("record CRC mismatch"),
        }
    }
}

/// The outcome of checking the bytes at one offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checked {
    /// A valid record of this many bytes.
    Valid(usize),
    /// More bytes are needed to decide (only when the buffer is not the end of the file).
    NeedMore,
    /// Not a valid record.
    Invalid(Invalid),
}

/// Encodes and checks the records of one stripe set's index files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordCodec {
    /// CRC-32 of the set uuid: the state every record CRC starts from.
    seed: u32,
}

impl RecordCodec {
    /// The codec of the stripe set `set_uuid`.
    pub fn new(set_uuid: [u8; 16]) -> Self {
        RecordCodec {
            seed: crc32fast::hash(&set_uuid),
        }
    }

    /// The record CRC of `body` (bytes 4.. of a record) at file offset `offset`:
    /// CRC-32 of `set_uuid || offset (u64 LE) || body`.
    pub fn record_crc(&self, offset: u64, body: &[u8]) -> u32 {
        let mut h = crc32fast::Hasher::new_with_initial(self.seed);
        h.update(&offset.to_le_bytes());
        h.update(body);
        h.finalize()
    }

    /// Appends an insert record to `out` (whose byte 0 lies at file offset `base`). Keys
    /// longer than [`MAX_KEY_LEN`] are refused by the caller before reaching here.
    pub fn encode_insert(
        &self,
        out: &mut Vec<u8>,
        base: u64,
        key: &[u8],
        slot: Slot,
        crc: u32,
        generation: u64,
    ) {
        self.encode(out, base, KIND_INSERT, key, slot, crc, generation);
    }

    /// Appends a remove record to `out` (whose byte 0 lies at file offset `base`).
    pub fn encode_remove(&self, out: &mut Vec<u8>, base: u64, slot: Slot) {
        self.encode(out, base, KIND_REMOVE, &[], slot, 0, 0);
    }

    #[allow(clippy::too_many_arguments)]
    fn encode(
        &self,
        out: &mut Vec<u8>,
        base: u64,
        kind: u8,
        key: &[u8],
        slot: Slot,
        crc: u32,
        generation: u64,
    ) {
        let key = &key[..key.len().min(MAX_KEY_LEN)];
        let start = out.len();
        out.extend_from_slice(&[0u8; 4]);
        out.push(RECORD_MAGIC);
        out.push(kind);
        out.extend_from_slice(&(key.len() as u16).to_le_bytes());
        out.extend_from_slice(&slot.to_le_bytes());
        out.extend_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(&generation.to_le_bytes());
        out.extend_from_slice(key);
        let c = self.record_crc(base + start as u64, &out[start + 4..]);
        out[start..start + 4].copy_from_slice(&c.to_le_bytes());
    }

    /// Checks the record at the start of `b`, which lies at file offset `offset`. `at_end`:
    /// `b` runs to the end of the file (a record cut off by it is torn, not incomplete).
    pub fn check(&self, b: &[u8], offset: u64, at_end: bool) -> Checked {
        let short = if at_end {
            Checked::Invalid(Invalid::Torn)
        } else {
            Checked::NeedMore
        };
        if b.len() < RECORD_HEADER_SIZE {
            // The magic and kind are checked as soon as they are there, so that a resync
            // scan does not wait for bytes at offsets that cannot start a record.
            if b.len() > 4 && b[4] != RECORD_MAGIC {
                return Checked::Invalid(Invalid::Magic);
            }
            return short;
        }
        if b[4] != RECORD_MAGIC {
            return Checked::Invalid(Invalid::Magic);
        }
        let kind = b[5];
        let key_len = usize::from(u16::from_le_bytes([b[6], b[7]]));
        let plausible = match kind {
            KIND_INSERT => true,
            KIND_REMOVE => key_len == 0 && b[12..24].iter().all(|&x| x == 0),
            _ => false,
        };
        if !plausible {
            return Checked::Invalid(Invalid::Kind(kind));
        }
        let len = RECORD_HEADER_SIZE + key_len;
        if b.len() < len {
            return short;
        }
        if self.record_crc(offset, &b[4..len]) != le_u32(b, 0) {
            return Checked::Invalid(Invalid::Crc);
        }
        Checked::Valid(len)
    }
}

/// The records of `valid`, a run of records each accepted by [`RecordCodec::check`].
/// Iteration ends early (it never panics) if `valid` holds anything else.
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
        let rec = match r[5] {
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

/// A stretch of bytes that held no valid record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Damage {
    /// File offset of its first byte.
    pub start: u64,
    /// File offset just past it.
    pub end: u64,
    /// Why its first record was invalid.
    pub why: Invalid,
}

impl Damage {
    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.end - self.start
    }

    /// True when empty (never, for a reported stretch).
    #[cfg(any(test, feature = "test-support"))]
    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
}

/// What [`decode_records`] found: the records, in order, and the damage skipped.
#[cfg(any(test, feature = "test-support"))]
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Decoded {
    /// Every valid record.
    pub records: Vec<Record>,
    /// Stretches skipped between valid records (damage in the middle of the file).
    pub skipped: Vec<Damage>,
    /// A stretch at the end with no valid record after it (a torn or damaged tail).
    pub tail: Option<Damage>,
}

/// Decodes every valid record of `body`, which lies at file offset `base` and runs to the end
/// of the file, skipping damaged records and resynchronising on the next valid one (the same
/// checks as the streaming reader, `crate::g3::record_reader::stream_records`).
#[cfg(any(test, feature = "test-support"))]
pub fn decode_records(codec: &RecordCodec, body: &[u8], base: u64) -> Decoded {
    let mut out = Decoded::default();
    let mut pos = 0;
    let mut damage: Option<(usize, Invalid)> = None;
    while pos < body.len() {
        match codec.check(&body[pos..], base + pos as u64, true) {
            Checked::Valid(len) => {
                if let Some((start, why)) = damage.take() {
                    out.skipped.push(Damage {
                        start: base + start as u64,
                        end: base + pos as u64,
                        why,
                    });
                }
                out.records
                    .extend(records(&body[pos..pos + len]).map(|r| r.to_record()));
                pos += len;
            }
            Checked::Invalid(why) => {
                damage.get_or_insert((pos, why));
                pos += 1;
            }
            // Unreachable with `at_end`; treated as the end.
            Checked::NeedMore => break,
        }
    }
    if let Some((start, why)) = damage {
        out.tail = Some(Damage {
            start: base + start as u64,
            end: base + body.len() as u64,
            why,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const U: [u8; 16] = [0x11; 16];

    #[test]
    fn record_golden_bytes_and_round_trip() {
        let c = RecordCodec::new(U);
        let mut b = Vec::new();
        c.encode_insert(&mut b, 64, &[0xAA, 0xBB], 7, 0x1122_3344, 9);
        assert_eq!(b.len(), RECORD_HEADER_SIZE + 2);
        assert_eq!(
            hex::encode(&b[4..]),
            concat!(
                "c5010200",
                "07000000",
                "44332211",
                "0900000000000000",
                "aabb"
            )
        );
        // The record CRC covers the set uuid, the record's offset and its bytes 4..
        let mut covered = U.to_vec();
        covered.extend_from_slice(&64u64.to_le_bytes());
        covered.extend_from_slice(&b[4..]);
        assert_eq!(le_u32(&b, 0), crc32fast::hash(&covered));
        c.encode_remove(&mut b, 64, 7);
        let d = decode_records(&c, &b, 64);
        assert!(d.skipped.is_empty() && d.tail.is_none(), "{d:?}");
        assert_eq!(
            d.records,
            vec![
                Record::Insert {
                    key: ChunkKey::new([0xAA, 0xBB]),
                    slot: 7,
                    crc: 0x1122_3344,
                    generation: 9
                },
                Record::Remove { slot: 7 },
            ]
        );
    }

    fn three(c: &RecordCodec) -> (Vec<u8>, [usize; 3]) {
        let mut b = Vec::new();
        let mut starts = [0; 3];
        for (i, s) in starts.iter_mut().enumerate() {
            *s = b.len();
            c.encode_insert(&mut b, 64, format!("key{i}").as_bytes(), i as u32, 1, 1);
        }
        (b, starts)
    }

    #[test]
    fn a_bad_record_is_skipped_and_the_next_one_found() {
        let c = RecordCodec::new(U);
        let (b, starts) = three(&c);
        // Every single-byte damage of the middle record loses that record only.
        for at in starts[1]..starts[2] {
            let mut bad = b.clone();
            bad[at] ^= 0x20;
            let d = decode_records(&c, &bad, 64);
            let slots: Vec<u32> = d
                .records
                .iter()
                .map(|r| match r {
                    Record::Insert { slot, .. } | Record::Remove { slot } => *slot,
                })
                .collect();
            assert_eq!(slots, vec![0, 2], "damage at {at}: {d:?}");
            assert_eq!(d.skipped.len(), 1, "damage at {at}");
            assert_eq!(d.skipped[0].start, 64 + starts[1] as u64);
            assert_eq!(d.skipped[0].end, 64 + starts[2] as u64);
            assert!(d.tail.is_none());
        }
    }

    #[test]
    fn a_torn_tail_is_a_tail_not_a_skip() {
        let c = RecordCodec::new(U);
        let (b, starts) = three(&c);
        for cut in starts[2] + 1..b.len() {
            let d = decode_records(&c, &b[..cut], 64);
            assert_eq!(d.records.len(), 2);
            assert!(d.skipped.is_empty());
            let t = d.tail.unwrap();
            assert_eq!((t.start, t.end), (64 + starts[2] as u64, 64 + cut as u64));
        }
    }

    #[test]
    fn records_of_another_set_or_offset_are_invalid() {
        let c = RecordCodec::new(U);
        let (b, _) = three(&c);
        let other = RecordCodec::new([0x22; 16]);
        let d = decode_records(&other, &b, 64);
        assert!(d.records.is_empty());
        // The same bytes one record later in a file are not valid either.
        let d = decode_records(&c, &b, 64 + 8);
        assert!(d.records.is_empty());
    }

    #[test]
    fn header_round_trip_and_checks() {
        let h = FileHeader {
            magic: JOURNAL_MAGIC,
            set_uuid: [3; 16],
            seq: 5,
            count: 6,
            next_generation: 7,
        };
        let b = h.encode();
        assert_eq!(FileHeader::decode(&b, JOURNAL_MAGIC, "j").unwrap(), h);
        assert_eq!(
            FileHeader::decode(&b, CHECKPOINT_MAGIC, "j")
                .unwrap_err()
                .kind(),
            ErrorKind::Corrupt
        );
        let mut bad = b;
        bad[33] ^= 1;
        assert_eq!(
            FileHeader::decode(&bad, JOURNAL_MAGIC, "j")
                .unwrap_err()
                .kind(),
            ErrorKind::Corrupt
        );
        // Version 1 (before the record CRC bound the set and offset) is named, not misread.
        let mut v1 = b;
        v1[8..12].copy_from_slice(&1u32.to_le_bytes());
        let crc = crc32fast::hash(&v1[..60]);
        v1[60..64].copy_from_slice(&crc.to_le_bytes());
        let e = FileHeader::decode(&v1, JOURNAL_MAGIC, "j").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::IncompatibleLayout);
        assert!(e.to_string().contains("version 1"), "{e}");
        // A sequence number that would overflow is damage.
        let huge = FileHeader { seq: u64::MAX, ..h };
        assert_eq!(
            FileHeader::decode(&huge.encode(), JOURNAL_MAGIC, "j")
                .unwrap_err()
                .kind(),
            ErrorKind::Corrupt
        );
    }

    #[test]
    fn chunk_crc_from_and_to_the_row_crc() {
        for (key, len) in [
            (&b"k"[..], 4096usize),
            (&[0xAB; 40][..], 8192),
            (&b""[..], 17),
        ] {
            let row: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let whole = chunk_crc(key, &row);
            let row_crc = crc32fast::hash(&row);
            assert_eq!(chunk_crc_from_row_crc(key, row_crc, len as u64), whole);
            assert_eq!(row_crc_from_chunk_crc(key, whole, len as u64), row_crc);
        }
    }

    #[test]
    fn seeded_crc_equals_crc_of_the_concatenation() {
        let c = RecordCodec::new(U);
        let mut all = U.to_vec();
        all.extend_from_slice(&99u64.to_le_bytes());
        all.extend_from_slice(b"body");
        assert_eq!(c.record_crc(99, b"body"), crc32fast::hash(&all));
    }
}
