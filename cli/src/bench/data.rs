//! Deterministic chunk contents for `kvtier bench`, and the seed that makes each run differ.
//!
//! Every chunk's bytes are a function of its index alone, so the bench can fill a row, forget
//! it, and later check a loaded row without keeping a copy: any wrong byte, wrong row or wrong
//! key shows up as a mismatch.

use kvtier::key::ChunkKey;

/// The key of chunk `index` in a bench run: 32 bytes of a per-run seed and the index, plus a
/// 4-byte group id, the shape of vLLM's sha256 keys.
pub fn chunk_key(run_seed: u64, index: u64) -> ChunkKey {
    let mut k = [0u8; 36];
    k[..8].copy_from_slice(&run_seed.to_le_bytes());
    k[8..16].copy_from_slice(&index.to_le_bytes());
    k[16..24].copy_from_slice(&mix(run_seed ^ index).to_le_bytes());
    k[24..32].copy_from_slice(&mix(index.wrapping_add(1)).to_le_bytes());
    ChunkKey::new(k)
}

/// SplitMix64's finaliser: a cheap, well-spread 64-bit hash.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The 8-byte word at word position `w` of chunk `index`.
#[inline]
fn word(base: u64, w: u64) -> u64 {
    base ^ w.wrapping_mul(0xD6E8_FEB8_6659_FD93)
}

/// Fills `row` with chunk `index`'s bytes (`row.len()` a multiple of 8).
pub fn fill_row(row: &mut [u8], run_seed: u64, index: u64) {
    let base = mix(run_seed ^ mix(index));
    for (w, chunk) in row.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&word(base, w as u64).to_le_bytes());
    }
}

/// The first byte offset where `row` differs from chunk `index`'s bytes, if any.
pub fn first_mismatch(row: &[u8], run_seed: u64, index: u64) -> Option<usize> {
    let base = mix(run_seed ^ mix(index));
    for (w, chunk) in row.chunks_exact(8).enumerate() {
        let expected = word(base, w as u64).to_le_bytes();
        if chunk != expected {
            let i = chunk
                .iter()
                .zip(expected)
                .position(|(a, b)| *a != b)
                .unwrap_or(0);
            return Some(w * 8 + i);
        }
    }
    None
}

/// A seed that differs between runs (so a kept tier never makes a later run look good).
pub(crate) fn run_seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ (u64::from(std::process::id()) << 32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::process_cpu_seconds;

    #[test]
    fn rows_round_trip_and_differ_between_chunks() {
        let mut a = vec![0u8; 4096];
        let mut b = vec![0u8; 4096];
        fill_row(&mut a, 7, 1);
        fill_row(&mut b, 7, 2);
        assert_ne!(a, b);
        assert_eq!(first_mismatch(&a, 7, 1), None);
        assert_eq!(first_mismatch(&a, 7, 2), Some(0));
        assert_eq!(first_mismatch(&a, 8, 1), Some(0));
        a[1234] ^= 0x10;
        assert_eq!(first_mismatch(&a, 7, 1), Some(1234));
    }

    #[test]
    fn keys_are_distinct_and_vllm_shaped() {
        let k1 = chunk_key(1, 0);
        assert_eq!(k1.len(), 36);
        assert_ne!(k1, chunk_key(1, 1));
        assert_ne!(k1, chunk_key(2, 0));
    }

    #[test]
    fn cpu_time_advances() {
        let t0 = process_cpu_seconds();
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = x.wrapping_add(mix(i));
        }
        std::hint::black_box(x);
        assert!(process_cpu_seconds() >= t0);
        assert!(t0.is_finite());
    }
}
