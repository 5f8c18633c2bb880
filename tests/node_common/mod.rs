//! Helpers shared by the node service tests.
#![allow(dead_code)]

use kvtier::ChunkKey;

/// The key of chunk `i` of `tag`: `tag-000i`.
pub fn key(tag: &str, i: u32) -> ChunkKey {
    ChunkKey::new(format!("{tag}-{i:04}").as_bytes())
}

/// The bytes of `k`'s row of `stride` bytes: a function of the key alone, so any loaded row
/// can be checked.
pub fn payload_of(k: &ChunkKey, stride: u64) -> Vec<u8> {
    let mut seed = k.as_bytes().iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    }) | 1;
    let mut row = vec![0u8; stride as usize];
    for chunk in row.chunks_mut(8) {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        chunk.copy_from_slice(&seed.to_le_bytes()[..chunk.len()]);
    }
    row
}
