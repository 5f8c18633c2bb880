//! CRC-32 (IEEE, the one `crc32fast` computes and the G3 journal stores) composed from the CRCs
//! of consecutive pieces, so a row's CRC can be computed piecewise on the GPU and combined on
//! the host without touching the bytes again.
//!
//! `crc(A ‖ B) = x^(8·|B|) · crc(A) ⊕ crc(B)` in GF(2)\[x\] modulo the CRC polynomial (zlib's
//! `crc32_combine`): one carry-less multiplication per piece with an operator that depends only
//! on the piece length, so combining the 512 pieces of a 2 MiB row costs about 16k bit steps.

/// The CRC-32 polynomial, bit-reflected.
const POLY: u32 = 0xedb8_8320;

/// Bytes per piece whose CRC the GPU kernel computes (one thread each); the row CRC is
/// composed from them. 4 KiB divides every row stride (rows are 4 KiB multiples).
pub const PIECE_BYTES: u64 = 4096;

/// `a · b mod P` (both bit-reflected polynomials).
fn multmodp(a: u32, mut b: u32) -> u32 {
    let mut m = 1u32 << 31;
    let mut p = 0u32;
    loop {
        if a & m != 0 {
            p ^= b;
            if a & (m - 1) == 0 {
                break;
            }
        }
        m >>= 1;
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
    }
    p
}

/// `x^(2^k) mod P` for k in 0..32.
const fn x2n_table() -> [u32; 32] {
    let mut t = [0u32; 32];
    let mut p = 1u32 << 30; // x^1
    let mut n = 0;
    while n < 32 {
        t[n] = p;
        // p = p * p mod P, written out because const fn cannot call `multmodp` in a loop
        // that mutates its argument (same algorithm).
        let (a, mut b) = (p, p);
        let mut m = 1u32 << 31;
        let mut q = 0u32;
        loop {
            if a & m != 0 {
                q ^= b;
                if a & (m - 1) == 0 {
                    break;
                }
            }
            m >>= 1;
            b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
        }
        p = q;
        n += 1;
    }
    t
}

static X2N: [u32; 32] = x2n_table();

/// `x^(n · 2^k) mod P`.
fn x2nmodp(mut n: u64, mut k: usize) -> u32 {
    let mut p = 1u32 << 31; // x^0
    while n != 0 {
        if n & 1 != 0 {
            p = multmodp(X2N[k & 31], p);
        }
        n >>= 1;
        k += 1;
    }
    p
}

/// The operator that appends `len` bytes: `combine(a, b, len) = op(len) ∘ a ⊕ b`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShiftOperator(u32);

impl ShiftOperator {
    /// The operator for pieces of `len` bytes.
    pub fn for_len(len: u64) -> Self {
        ShiftOperator(x2nmodp(len, 3))
    }

    /// `crc(A ‖ B)` from `crc(A)` and `crc(B)`, `B` being this operator's length.
    pub fn combine(self, crc_a: u32, crc_b: u32) -> u32 {
        multmodp(self.0, crc_a) ^ crc_b
    }
}

/// `crc(A ‖ B)` from `crc(A)`, `crc(B)` and `|B|` (zlib's `crc32_combine`).
pub fn combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    ShiftOperator::for_len(len_b).combine(crc_a, crc_b)
}

/// The CRC of a sequence of consecutive pieces, given each piece's CRC and length, in order.
pub fn compose(pieces: impl IntoIterator<Item = (u32, u64)>) -> u32 {
    let mut cached: Option<(u64, ShiftOperator)> = None;
    let mut crc = 0u32; // the CRC of no bytes
    for (piece_crc, len) in pieces {
        let op = match cached {
            Some((l, op)) if l == len => op,
            _ => {
                let op = ShiftOperator::for_len(len);
                cached = Some((len, op));
                op
            }
        };
        crc = op.combine(crc, piece_crc);
    }
    crc
}

/// The pieces of `len` bytes cut at [`PIECE_BYTES`]: `(offset, length)` of each, in order;
/// the last one may be shorter. This is how the GPU kernel splits a range (one thread per
/// piece), so [`compose_pieces`] knows each piece's length.
pub fn pieces(len: u64) -> impl Iterator<Item = (u64, u64)> {
    (0..len.div_ceil(PIECE_BYTES)).map(move |i| {
        let off = i * PIECE_BYTES;
        (off, PIECE_BYTES.min(len - off))
    })
}

/// The CRC of a range of `len` bytes from the CRCs of its [`pieces`] (in order).
pub fn compose_pieces(piece_crcs: &[u32], len: u64) -> u32 {
    compose(
        piece_crcs
            .iter()
            .zip(pieces(len))
            .map(|(c, (_, l))| (*c, l)),
    )
}

/// The CRC of each [`PIECE_BYTES`] piece of `data`: what the GPU kernel computes, on the host
/// (the host stand-in device and the tests use it).
pub fn piece_crcs_host(data: &[u8]) -> Vec<u32> {
    pieces(data.len() as u64)
        .map(|(off, len)| crc32fast::hash(&data[off as usize..(off + len) as usize]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s as u8
            })
            .collect()
    }

    #[test]
    fn combine_equals_crc32fast_of_the_concatenation() {
        for (a, b) in [
            (0, 0),
            (0, 5),
            (7, 0),
            (1, 1),
            (100, 4096),
            (4096, 3),
            (5000, 70000),
        ] {
            let x = bytes(a, 3);
            let y = bytes(b, 9);
            let whole: Vec<u8> = x.iter().chain(&y).copied().collect();
            assert_eq!(
                combine(crc32fast::hash(&x), crc32fast::hash(&y), b as u64),
                crc32fast::hash(&whole),
                "{a} + {b}"
            );
        }
    }

    #[test]
    fn pieces_compose_to_the_row_crc() {
        // Whole rows of 4 KiB multiples and odd lengths (a last, shorter piece).
        for len in [
            0usize,
            1,
            4095,
            4096,
            4097,
            3 * 4096,
            2 << 20,
            (2 << 20) + 17,
        ] {
            let data = bytes(len, len as u64 + 1);
            let crcs = piece_crcs_host(&data);
            assert_eq!(crcs.len(), len.div_ceil(4096));
            assert_eq!(
                compose_pieces(&crcs, len as u64),
                crc32fast::hash(&data),
                "{len}"
            );
        }
    }

    #[test]
    fn uneven_segments_compose_in_order() {
        // Segments of different lengths (runs of a row plus its padding), in row order.
        let data = bytes(70_000, 5);
        let cuts = [0usize, 256, 2304, 2305, 40_000, 65_536, 70_000];
        let parts: Vec<(u32, u64)> = cuts
            .windows(2)
            .map(|w| (crc32fast::hash(&data[w[0]..w[1]]), (w[1] - w[0]) as u64))
            .collect();
        assert_eq!(compose(parts.iter().copied()), crc32fast::hash(&data));
        // Out of order composes something else: the order is part of the CRC.
        let mut swapped = parts.clone();
        swapped.swap(1, 3);
        assert_ne!(compose(swapped), crc32fast::hash(&data));
    }
}
