//! A key as the index's slot table holds it: keys of up to [`INLINE_KEY_LEN`] bytes (vLLM's
//! 36-byte sha256 and 20-byte xxhash keys) are stored inline in the slot entry, so rebuilding
//! an index of millions of entries allocates nothing per entry and touches one slot entry per
//! key instead of an entry plus a separate heap block. Longer keys share the caller's bytes.

use crate::key::ChunkKey;

/// Longest key stored inline.
pub const INLINE_KEY_LEN: usize = 38;

/// A slot's key, or nothing.
#[derive(Debug, Clone, Default)]
pub enum SlotKey {
    /// The slot holds no key.
    #[default]
    Empty,
    /// A short key, stored in place.
    Inline {
        /// Bytes used in `bytes`.
        len: u8,
        /// The key's bytes, then zeros.
        bytes: [u8; INLINE_KEY_LEN],
    },
    /// A longer key, shared with the caller.
    Shared(ChunkKey),
}

impl SlotKey {
    /// A key holding a copy of `b`.
    pub fn from_bytes(b: &[u8]) -> Self {
        if b.len() <= INLINE_KEY_LEN {
            let mut bytes = [0u8; INLINE_KEY_LEN];
            bytes[..b.len()].copy_from_slice(b);
            SlotKey::Inline {
                len: b.len() as u8,
                bytes,
            }
        } else {
            SlotKey::Shared(ChunkKey::new(b))
        }
    }

    /// A key holding `k` (shared when too long to store inline).
    pub fn from_key(k: &ChunkKey) -> Self {
        if k.len() <= INLINE_KEY_LEN {
            Self::from_bytes(k.as_bytes())
        } else {
            SlotKey::Shared(k.clone())
        }
    }

    /// The key's bytes; `None` when empty.
    pub fn bytes(&self) -> Option<&[u8]> {
        match self {
            SlotKey::Empty => None,
            SlotKey::Inline { len, bytes } => bytes.get(..usize::from(*len)),
            SlotKey::Shared(k) => Some(k.as_bytes()),
        }
    }

    /// True when this holds exactly the key `b`.
    pub fn holds(&self, b: &[u8]) -> bool {
        self.bytes() == Some(b)
    }

    /// True when this holds a key.
    #[cfg(any(test, feature = "test-support"))]
    pub fn is_some(&self) -> bool {
        !matches!(self, SlotKey::Empty)
    }

    /// The key as a [`ChunkKey`] (allocates for inline keys); `None` when empty.
    pub fn to_chunk_key(&self) -> Option<ChunkKey> {
        match self {
            SlotKey::Shared(k) => Some(k.clone()),
            other => other.bytes().map(ChunkKey::new),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_keys_inline_long_keys_shared_both_round_trip() {
        for n in [0, 1, 20, 36, INLINE_KEY_LEN, INLINE_KEY_LEN + 1, 300] {
            let raw: Vec<u8> = (0..n).map(|i| i as u8 ^ 0x5A).collect();
            let k = ChunkKey::new(&raw);
            for s in [SlotKey::from_bytes(&raw), SlotKey::from_key(&k)] {
                assert_eq!(
                    matches!(s, SlotKey::Inline { .. }),
                    n <= INLINE_KEY_LEN,
                    "{n}"
                );
                assert!(s.is_some() && s.holds(&raw));
                assert!(!s.holds(&raw[..n.saturating_sub(1)]) || n == 0);
                assert_eq!(s.to_chunk_key(), Some(k.clone()));
            }
        }
        assert!(!SlotKey::Empty.is_some() && SlotKey::Empty.bytes().is_none());
    }
}
