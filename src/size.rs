//! Human byte sizes: parse `"2MiB"`, `"64G"`, `"1.5 GiB"`, `"4096"` and print sizes back.
//!
//! Units (case-insensitive, optional space between number and unit, optional `B`):
//! * binary: `K`, `M`, `G`, `T`, `P` and `KiB`, `MiB`, `GiB`, `TiB`, `PiB` (powers of 1024,
//!   as in fio, `dd` and `numfmt --from=iec`);
//! * decimal (SI): `kB`, `MB`, `GB`, `TB`, `PB` (powers of 1000);
//! * `B` or no unit: bytes.
//!
//! A fraction is allowed when the result is a whole number of bytes (`"1.5GiB"` yes,
//! `"0.1KiB"` no). Parsing never rounds: a size either converts exactly or is an error.

use std::fmt;
use std::str::FromStr;

/// A byte count that parses from and prints as a human size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

/// Why a size string did not parse. The message says what was expected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SizeParseError {
    message: String,
}

impl fmt::Display for SizeParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for SizeParseError {}

fn size_err(text: &str, why: &str) -> SizeParseError {
    SizeParseError {
        message: format!(
            "{text:?} is not a byte size: {why} (expected e.g. \"4096\", \"2MiB\", \"64G\", \"1.5 GiB\")"
        ),
    }
}

const KIB: u64 = 1 << 10;

/// Binary units used for printing, largest first.
const BINARY_UNITS: [(&str, u64); 5] = [
    ("PiB", KIB.pow(5)),
    ("TiB", KIB.pow(4)),
    ("GiB", KIB.pow(3)),
    ("MiB", KIB.pow(2)),
    ("KiB", KIB),
];

/// The multiplier of a unit suffix (already lower-cased), or `None` if unknown.
fn unit_multiplier(unit: &str) -> Option<u64> {
    let m = match unit {
        "" | "b" => 1,
        "k" | "kib" => KIB,
        "m" | "mib" => KIB.pow(2),
        "g" | "gib" => KIB.pow(3),
        "t" | "tib" => KIB.pow(4),
        "p" | "pib" => KIB.pow(5),
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "pb" => 1_000_000_000_000_000,
        _ => return None,
    };
    Some(m)
}

/// Parses a human byte size. See the module docs for the accepted units.
pub fn parse_size(text: &str) -> Result<u64, SizeParseError> {
    let s = text.trim();
    if s.is_empty() {
        return Err(size_err(text, "empty"));
    }
    let num_end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(num_end);
    let number: String = number.chars().filter(|&c| c != '_').collect();
    let unit = unit.trim().to_ascii_lowercase();
    let multiplier =
        unit_multiplier(&unit).ok_or_else(|| size_err(text, &format!("unknown unit {unit:?}")))?;
    let (int_part, frac_part) = match number.split_once('.') {
        Some((i, f)) => (i, f),
        None => (number.as_str(), ""),
    };
    if int_part.is_empty() && frac_part.is_empty() {
        return Err(size_err(text, "no number"));
    }
    if frac_part.contains('.') {
        return Err(size_err(text, "more than one decimal point"));
    }
    if frac_part.len() > 18 {
        return Err(size_err(text, "too many decimal places"));
    }
    let overflow = || size_err(text, "larger than 2^64 - 1 bytes");
    let digits = |d: &str| -> Result<u128, SizeParseError> {
        if d.is_empty() {
            Ok(0)
        } else {
            d.parse::<u128>().map_err(|_| overflow())
        }
    };
    // value = (int + frac / 10^n) * multiplier, computed exactly in u128.
    let scale = 10u128.pow(frac_part.len() as u32);
    let scaled = digits(int_part)?
        .checked_mul(scale)
        .and_then(|v| v.checked_add(digits(frac_part).ok()?))
        .and_then(|v| v.checked_mul(u128::from(multiplier)))
        .ok_or_else(overflow)?;
    if scaled % scale != 0 {
        return Err(size_err(text, "not a whole number of bytes"));
    }
    u64::try_from(scaled / scale).map_err(|_| overflow())
}

/// Prints `bytes` exactly, in the largest binary unit that divides it (`"64GiB"`, `"1536B"`).
/// The result parses back to the same number.
pub fn format_size_exact(bytes: u64) -> String {
    for (name, unit) in BINARY_UNITS {
        if bytes >= unit && bytes.is_multiple_of(unit) {
            return format!("{}{name}", bytes / unit);
        }
    }
    format!("{bytes}B")
}

/// Prints `bytes` for people, rounded to two decimals in the largest binary unit that fits
/// (`"1.50 GiB"`, `"512 B"`). Not exact; use [`format_size_exact`] for round trips.
pub fn format_size_human(bytes: u64) -> String {
    for (name, unit) in BINARY_UNITS {
        if bytes >= unit {
            if bytes.is_multiple_of(unit) {
                return format!("{} {name}", bytes / unit);
            }
            return format!("{:.2} {name}", bytes as f64 / unit as f64);
        }
    }
    format!("{bytes} B")
}

/// A count and its noun for people: `1 chunk`, `0 chunks`, `2 paths` (the noun's plural is
/// the noun and an `s`).
pub fn count(n: u64, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

impl FromStr for ByteSize {
    type Err = SizeParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_size(s).map(ByteSize)
    }
}

impl fmt::Display for ByteSize {
    /// Exact form, see [`format_size_exact`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_size_exact(self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_units() {
        let cases: &[(&str, u64)] = &[
            ("4096", 4096),
            ("4096B", 4096),
            ("2MiB", 2 << 20),
            ("2mib", 2 << 20),
            ("64G", 64 << 30),
            ("64 GiB", 64 << 30),
            ("1.5GiB", 3 << 29),
            ("1K", 1024),
            ("1kB", 1000),
            ("10GB", 10_000_000_000),
            ("1TiB", 1 << 40),
            ("1_048_576", 1 << 20),
            (" 8 KiB ", 8192),
            (".5KiB", 512),
        ];
        for &(text, want) in cases {
            assert_eq!(parse_size(text), Ok(want), "{text}");
        }
    }

    #[test]
    fn rejects_bad_sizes_with_reason() {
        for (text, why) in [
            ("", "empty"),
            ("GiB", "no number"),
            ("12 parsecs", "unknown unit"),
            ("0.1KiB", "whole number of bytes"),
            ("1.2.3", "decimal point"),
            ("-5", "unknown unit"),
            ("16PiB0", "unknown unit"),
            ("99999999999999999999", "2^64"),
            ("16384PiB", "2^64"),
        ] {
            let e = parse_size(text).expect_err(text).to_string();
            assert!(e.contains(why), "{text}: {e}");
            assert!(e.contains("expected e.g."), "{e}");
        }
    }

    #[test]
    fn formats() {
        assert_eq!(format_size_exact(64 << 30), "64GiB");
        assert_eq!(format_size_exact(1536), "1536B");
        assert_eq!(format_size_exact(3 << 29), "1536MiB");
        assert_eq!(format_size_exact(0), "0B");
        assert_eq!(format_size_human(3 << 29), "1.50 GiB");
        assert_eq!(format_size_human(100 << 20), "100 MiB");
        assert_eq!(format_size_human(512), "512 B");
        assert_eq!(count(1, "chunk"), "1 chunk");
        assert_eq!(count(0, "chunk"), "0 chunks");
        assert_eq!(count(2, "path"), "2 paths");
        assert_eq!(ByteSize(2 << 20).to_string(), "2MiB");
        assert_eq!("2MiB".parse::<ByteSize>(), Ok(ByteSize(2 << 20)));
    }

    proptest! {
        #[test]
        fn exact_format_round_trips(bytes in any::<u64>()) {
            prop_assert_eq!(parse_size(&format_size_exact(bytes)), Ok(bytes));
        }

        #[test]
        fn unit_suffix_scales(n in 0u64..16_384, unit in 0usize..5) {
            let (name, mult) = BINARY_UNITS[unit];
            prop_assert_eq!(parse_size(&format!("{n}{name}")), Ok(n * mult));
        }
    }
}
