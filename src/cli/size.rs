//! Human byte sizes for the command line: `2MiB`, `64G`, `512k`, `4096`.
//!
//! Binary and decimal suffixes are both accepted and mean what they say: `KiB`/`MiB`/`GiB`/`TiB`
//! are powers of 1024; `KB`/`MB`/`GB`/`TB` are powers of 1000; the short forms `K`/`M`/`G`/`T`
//! (as in `dd` and fio) are powers of 1024. A bare number is bytes. Case and a space before the
//! suffix are ignored; a `B` alone means bytes. Printing uses binary units.

/// Parses a human size into bytes. Errors say what was wrong and give an example.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let s = text.trim();
    let digits_end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(digits_end);
    let number: String = number.chars().filter(|&c| c != '_').collect();
    if number.is_empty() {
        return Err(format!(
            "invalid size {text:?}: expected a number with an optional unit, e.g. 2MiB or 64G"
        ));
    }
    let multiplier: u64 = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        other => {
            return Err(format!(
                "invalid size {text:?}: unknown unit {other:?} (use B, KiB, MiB, GiB, TiB, \
                 K, M, G, T, KB, MB, GB or TB)"
            ));
        }
    };
    if let Ok(whole) = number.parse::<u64>() {
        return whole
            .checked_mul(multiplier)
            .ok_or_else(|| format!("invalid size {text:?}: too large"));
    }
    let value: f64 = number
        .parse()
        .map_err(|_| format!("invalid size {text:?}: {number:?} is not a number"))?;
    let bytes = value * multiplier as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("invalid size {text:?}: too large"));
    }
    if bytes.fract() != 0.0 {
        return Err(format!(
            "invalid size {text:?}: {bytes} is not a whole number of bytes"
        ));
    }
    Ok(bytes as u64)
}

/// Formats bytes with a binary unit and up to two decimals: `2 MiB`, `1.50 GiB`, `512 B`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 || value.fract() == 0.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

/// Formats a throughput in decimal GB/s (10^9 bytes per second), as fio and disk vendors do.
pub fn format_gbps(bytes_per_sec: f64) -> String {
    format!("{:.2} GB/s", bytes_per_sec / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_binary_decimal_and_short_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("2MiB"), Ok(2 << 20));
        assert_eq!(parse_size("2 mib"), Ok(2 << 20));
        assert_eq!(parse_size("64G"), Ok(64 << 30));
        assert_eq!(parse_size("512k"), Ok(512 << 10));
        assert_eq!(parse_size("1GB"), Ok(1_000_000_000));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("1_000"), Ok(1000));
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("10B"), Ok(10));
    }

    #[test]
    fn rejects_garbage_with_a_reason() {
        assert!(parse_size("").unwrap_err().contains("expected a number"));
        assert!(parse_size("MiB").unwrap_err().contains("expected a number"));
        assert!(parse_size("2XB").unwrap_err().contains("unknown unit"));
        assert!(parse_size("1.1.1M").unwrap_err().contains("not a number"));
        assert!(parse_size("0.3B").unwrap_err().contains("whole number"));
        assert!(
            parse_size("99999999999T")
                .unwrap_err()
                .contains("too large")
        );
    }

    #[test]
    fn formats_round_trip() {
        for n in [0u64, 1, 4096, 2 << 20, 3 << 29, 64 << 30] {
            let text = format_size(n).replace(' ', "");
            assert_eq!(parse_size(&text), Ok(n), "{text}");
        }
        assert_eq!(format_size(1536), "1.50 KiB");
        assert_eq!(format_gbps(2.5e9), "2.50 GB/s");
    }
}
