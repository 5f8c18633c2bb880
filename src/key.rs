//! Chunk keys: opaque byte strings chosen by the inference server.
//!
//! vLLM's keys are `block_hash || u32 big-endian KV-cache-group id` (36 bytes with sha256,
//! 20 with xxhash). kvtier treats them as opaque and variable-length; it only parses them to
//! print them.

use std::fmt;
use std::sync::Arc;

/// An opaque chunk key. Cheap to clone (shared bytes).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkKey(Arc<[u8]>);

impl ChunkKey {
    /// Wraps `bytes` as a key.
    pub fn new(bytes: impl AsRef<[u8]>) -> Self {
        ChunkKey(Arc::from(bytes.as_ref()))
    }

    /// The key's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True for the empty key.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Lower-case hex of the whole key.
    pub fn to_hex(&self) -> String {
        hex::encode(&self.0)
    }

    /// Parses a key from hex (as printed by [`ChunkKey::to_hex`]).
    pub fn from_hex(s: &str) -> Option<Self> {
        hex::decode(s).ok().map(ChunkKey::new)
    }

    /// vLLM's offload key for a block (`make_offload_key`): the block hash followed by the
    /// KV-cache-group id, 4 bytes big-endian.
    ///
    /// ```
    /// let k = kvtier::ChunkKey::vllm_offload_key(&[0xab; 32], 2);
    /// assert_eq!(k.len(), 36);
    /// assert_eq!(k.vllm_group_id(), Some(2));
    /// ```
    pub fn vllm_offload_key(block_hash: &[u8], group: u32) -> Self {
        let mut bytes = Vec::with_capacity(block_hash.len() + 4);
        bytes.extend_from_slice(block_hash);
        // vLLM's key layout fixes big-endian for the group id suffix.
        #[allow(clippy::big_endian_bytes)]
        bytes.extend_from_slice(&group.to_be_bytes());
        ChunkKey::from(bytes)
    }

    /// vLLM's KV-cache-group id (the last 4 bytes, big-endian), when the key is long enough.
    pub fn vllm_group_id(&self) -> Option<u32> {
        let n = self.0.len();
        if n < 4 {
            return None;
        }
        let mut b = [0u8; 4];
        b.copy_from_slice(&self.0[n - 4..]);
        // vLLM's key layout fixes big-endian for the group id suffix.
        #[allow(clippy::big_endian_bytes)]
        Some(u32::from_be_bytes(b))
    }
}

impl fmt::Debug for ChunkKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkKey({})", self.to_hex())
    }
}

impl fmt::Display for ChunkKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl From<&[u8]> for ChunkKey {
    fn from(b: &[u8]) -> Self {
        ChunkKey::new(b)
    }
}

impl From<Vec<u8>> for ChunkKey {
    fn from(b: Vec<u8>) -> Self {
        ChunkKey(Arc::from(b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip_and_group_id() {
        let mut raw = vec![0xABu8; 32];
        raw.extend_from_slice(&[0, 0, 1, 2]);
        let k = ChunkKey::new(&raw);
        assert_eq!(k.len(), 36);
        assert_eq!(k.vllm_group_id(), Some(258));
        assert_eq!(ChunkKey::from_hex(&k.to_hex()), Some(k.clone()));
        assert_eq!(ChunkKey::new([1u8, 2]).vllm_group_id(), None);
        assert!(ChunkKey::from_hex("zz").is_none());
    }
}
