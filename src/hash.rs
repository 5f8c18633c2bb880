//! Fast seeded hashing of keys and ids: `KeyHasher` (one call per byte string, used by the
//! primary tier's index) and [`FastState`], a `BuildHasher` with the same mixing for the
//! tiering manager's maps, whose keys (chunk keys, request ids, job ids) are looked up several
//! times per scheduler call. The standard SipHash costs tens of nanoseconds per 40-byte key
//! and was a measurable part of a lookup that starts a promotion.
//!
//! Not cryptographic. Each process (each `FastState`, each `KeyHasher::random`) gets a random
//! seed, so an outsider cannot choose keys that collide; the keys are chunk hashes computed
//! by the inference server in any case.

use std::hash::{BuildHasher, Hasher};

/// A seeded 64-bit hash of a byte string (folded multiply, 16 bytes per step).
///
/// Fast (a few ns for a 36-byte key) and well mixed; the per-instance random seed keeps an
/// outsider from choosing keys that collide. Not cryptographic.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeyHasher {
    seed: u64,
}

const K1: u64 = 0x243F_6A88_85A3_08D3;
const K2: u64 = 0x1319_8A2E_0370_7344;
const K3: u64 = 0xA409_3822_299F_31D0;

#[inline]
fn fold_mul(a: u64, b: u64) -> u64 {
    let r = u128::from(a) * u128::from(b);
    (r as u64) ^ ((r >> 64) as u64)
}

/// `b` (at most 8 bytes) as a little-endian number; the usual lengths without a copy call.
#[inline]
fn read_u64(b: &[u8]) -> u64 {
    if let Ok(w) = <[u8; 8]>::try_from(b) {
        return u64::from_le_bytes(w);
    }
    if let Ok(w) = <[u8; 4]>::try_from(b) {
        return u64::from(u32::from_le_bytes(w));
    }
    let mut w = [0u8; 8];
    w[..b.len()].copy_from_slice(b);
    u64::from_le_bytes(w)
}

impl KeyHasher {
    /// A hasher with a fresh random seed.
    pub(crate) fn random() -> Self {
        let seed = std::collections::hash_map::RandomState::new().hash_one(0x6b76_7469_6572_u64);
        KeyHasher { seed }
    }

    /// A hasher with a fixed seed (tests, and admission sketches whose estimates must be the
    /// same on every run).
    pub(crate) fn with_seed(seed: u64) -> Self {
        KeyHasher { seed }
    }

    /// The 64-bit hash of `bytes`.
    #[inline]
    pub(crate) fn hash(&self, bytes: &[u8]) -> u64 {
        let mut h = FastHasher {
            h: self.seed ^ (bytes.len() as u64).wrapping_mul(K1),
        };
        h.write(bytes);
        fold_mul(h.h ^ K3, K1 ^ self.seed.rotate_left(32))
    }
}

/// `BuildHasher` for the manager's maps: randomly seeded once per map.
#[derive(Debug, Clone, Copy)]
pub struct FastState {
    seed: u64,
}

impl Default for FastState {
    fn default() -> Self {
        FastState {
            seed: KeyHasher::random().seed,
        }
    }
}

impl BuildHasher for FastState {
    type Hasher = FastHasher;

    fn build_hasher(&self) -> FastHasher {
        FastHasher { h: self.seed }
    }
}

/// The streaming hasher of [`FastState`]: folds each written word into its state.
#[derive(Debug, Clone, Copy)]
pub struct FastHasher {
    h: u64,
}

impl FastHasher {
    #[inline]
    fn mix(&mut self, a: u64, b: u64) {
        self.h = fold_mul(a ^ self.h ^ K2, b ^ K3).rotate_left(23) ^ self.h.wrapping_mul(K1);
    }
}

impl Hasher for FastHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut pairs = bytes.chunks_exact(16);
        for p in &mut pairs {
            self.mix(read_u64(&p[..8]), read_u64(&p[8..]));
        }
        // A slice's length is hashed separately (`Hash` for slices writes it first; the
        // key hash seeds with it), so a short tail is just zero-padded.
        let rest = pairs.remainder();
        if rest.len() > 8 {
            self.mix(read_u64(&rest[..8]), read_u64(&rest[8..]));
        } else if !rest.is_empty() {
            self.mix(read_u64(rest), 0);
        }
    }

    #[inline]
    fn write_u64(&mut self, x: u64) {
        self.mix(x, 0);
    }

    #[inline]
    fn write_usize(&mut self, x: usize) {
        self.mix(x as u64, 0);
    }

    #[inline]
    fn write_u32(&mut self, x: u32) {
        self.mix(u64::from(x), 0);
    }

    #[inline]
    fn finish(&self) -> u64 {
        fold_mul(self.h ^ K3, K1)
    }
}

/// A `HashMap` hashed with [`FastState`].
pub type FastMap<K, V> = std::collections::HashMap<K, V, FastState>;
/// A `HashSet` hashed with [`FastState`].
pub type FastSet<K> = std::collections::HashSet<K, FastState>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_depends_on_every_byte_and_length() {
        let h = KeyHasher::with_seed(7);
        let base = [0u8; 36];
        let h0 = h.hash(&base);
        for i in 0..36 {
            let mut k = base;
            k[i] = 1;
            assert_ne!(h.hash(&k), h0, "byte {i} ignored");
        }
        assert_ne!(h.hash(&base[..35]), h0);
        assert_ne!(h.hash(&[]), h.hash(&[0]));
        assert_ne!(KeyHasher::with_seed(8).hash(&base), h0);
    }

    #[test]
    fn fast_hasher_depends_on_every_byte_length_and_seed() {
        let s = FastState { seed: 7 };
        let base = [0u8; 44];
        let h0 = s.hash_one(&base[..]);
        for i in 0..44 {
            let mut k = base;
            k[i] = 1;
            assert_ne!(s.hash_one(&k[..]), h0, "byte {i} ignored");
        }
        assert_ne!(s.hash_one(&base[..43]), h0);
        assert_ne!(
            s.hash_one((1usize, &base[..])),
            s.hash_one((2usize, &base[..]))
        );
        assert_ne!(FastState { seed: 8 }.hash_one(&base[..]), h0);
        assert_ne!(s.hash_one(1u64), s.hash_one(2u64));
    }

    #[test]
    fn fast_map_behaves_like_a_map() {
        let mut m: FastMap<Vec<u8>, usize> = FastMap::default();
        for i in 0..10_000usize {
            m.insert(i.to_le_bytes().repeat(5), i);
        }
        for i in 0..10_000usize {
            assert_eq!(m.get(&i.to_le_bytes().repeat(5)), Some(&i));
        }
        assert_eq!(m.len(), 10_000);
    }
}
