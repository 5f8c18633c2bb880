//! Sizes and rates for the command line. Parsing and printing byte sizes is
//! [`kvtier::config::size`]'s (one parser for config files and flags); this adds the clap value
//! parser and throughput formatting.

/// clap value parser for human sizes (`2MiB`, `64G`, `4096`).
pub fn parse_size(text: &str) -> Result<u64, String> {
    kvtier::config::parse_size(text).map_err(|e| e.to_string())
}

/// Formats bytes for people: `2 MiB`, `1.50 GiB`, `512 B`.
pub fn format_size(bytes: u64) -> String {
    kvtier::config::format_size_human(bytes)
}

/// Formats a throughput in decimal GB/s (10^9 bytes per second), as fio and disk vendors do.
pub fn format_gbps(bytes_per_sec: f64) -> String {
    format!("{:.2} GB/s", bytes_per_sec / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_sizes_and_rates() {
        assert_eq!(parse_size("2MiB"), Ok(2 << 20));
        assert_eq!(parse_size("64G"), Ok(64 << 30));
        assert!(parse_size("2XB").is_err());
        assert_eq!(format_size(2 << 20), "2 MiB");
        assert_eq!(format_gbps(2.5e9), "2.50 GB/s");
    }
}
