//! `max_bytes_in_flight`: the one rule for a tier's cap on bytes of I/O in flight, whatever
//! the tier type (`nvme`, `fs`) and whatever the way in (a config file through `kvtier config
//! check` or `kvtier serve`, `kvtier bench --max-bytes-in-flight`, `kvtier fio-compare`, or
//! code that builds a tier configuration itself):
//!
//! * a tier moves whole rows, so the cap is at least one row;
//! * not set, it is [`DEFAULT_MAX_BYTES_IN_FLIGHT`] (64 MiB), or one row when a row is larger;
//! * a value below one row is refused, naming the key, the value and the row size.
//!
//! The tier configurations' `validate` functions call [`check_max_bytes_in_flight`]; the
//! tiers and the commands size their queues with [`max_bytes_in_flight`].

use crate::error::{Error, Result};
use crate::size::format_size_human;

/// The cap when `max_bytes_in_flight` is not set, unless one row is larger.
pub const DEFAULT_MAX_BYTES_IN_FLIGHT: u64 = 64 << 20;

/// The cap in effect for rows of `row_stride` bytes: the value set, or the default
/// (`max(64 MiB, one row)`) when none is. A value set is assumed checked by
/// [`check_max_bytes_in_flight`].
///
/// ```
/// use kvtier::config::in_flight::max_bytes_in_flight;
/// assert_eq!(max_bytes_in_flight(None, 2 << 20), 64 << 20);
/// assert_eq!(max_bytes_in_flight(None, 128 << 20), 128 << 20);
/// assert_eq!(max_bytes_in_flight(Some(8 << 20), 2 << 20), 8 << 20);
/// ```
pub fn max_bytes_in_flight(set: Option<u64>, row_stride: u64) -> u64 {
    set.unwrap_or(DEFAULT_MAX_BYTES_IN_FLIGHT.max(row_stride))
}

/// Refuses a `max_bytes_in_flight` below one row ([`crate::error::ErrorKind::Config`], naming
/// `key` (a key path, or a flag and the key it sets), the value and the row size). Without
/// the row stride only 0 can be known to be too small.
///
/// ```
/// use kvtier::config::in_flight::check_max_bytes_in_flight;
/// assert!(check_max_bytes_in_flight("max_bytes_in_flight", None, Some(2 << 20)).is_ok());
/// assert!(check_max_bytes_in_flight("max_bytes_in_flight", Some(2 << 20), Some(2 << 20)).is_ok());
/// let e = check_max_bytes_in_flight("max_bytes_in_flight", Some(1 << 20), Some(2 << 20));
/// assert!(e.unwrap_err().to_string().contains("1 MiB is less than one row (2 MiB)"));
/// assert!(check_max_bytes_in_flight("max_bytes_in_flight", Some(0), None).is_err());
/// ```
pub fn check_max_bytes_in_flight(
    key: &str,
    set: Option<u64>,
    row_stride: Option<u64>,
) -> Result<()> {
    let Some(value) = set else {
        return Ok(());
    };
    let row = match row_stride {
        Some(row) if value < row => format!("one row ({})", format_size_human(row)),
        None if value == 0 => "one row".to_string(),
        _ => return Ok(()),
    };
    Err(Error::config(
        key,
        format!(
            "{} is less than {row}: a tier moves whole rows, so it needs at least one in \
             flight (without it: max(64 MiB, one row))",
            format_size_human(value)
        ),
    )
    .with("found", value.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn at_least_one_row_and_a_default_that_holds_one() {
        let mib = 1u64 << 20;
        // Not set: 64 MiB, or one row when a row is larger.
        assert_eq!(max_bytes_in_flight(None, 2 * mib), 64 * mib);
        assert_eq!(max_bytes_in_flight(None, 64 * mib), 64 * mib);
        assert_eq!(max_bytes_in_flight(None, 96 * mib), 96 * mib);
        assert!(check_max_bytes_in_flight("k", None, Some(96 * mib)).is_ok());
        // Set: at least one row.
        assert!(check_max_bytes_in_flight("k", Some(2 * mib), Some(2 * mib)).is_ok());
        assert_eq!(max_bytes_in_flight(Some(3 * mib), 2 * mib), 3 * mib);
        let e = check_max_bytes_in_flight(
            "secondary_tiers[1].max_bytes_in_flight",
            Some(mib + 1),
            Some(2 * mib),
        )
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert_eq!(
            e.context_value("key"),
            Some("secondary_tiers[1].max_bytes_in_flight")
        );
        let s = e.to_string();
        assert!(
            s.contains("1.00 MiB") && s.contains("one row (2 MiB)"),
            "{s}"
        );
        assert_eq!(e.context_value("found"), Some("1048577"));
        // Without the row size only 0 is known to be too small.
        assert!(check_max_bytes_in_flight("k", Some(1), None).is_ok());
        let s = check_max_bytes_in_flight("k", Some(0), None)
            .unwrap_err()
            .to_string();
        assert!(s.contains("0 B is less than one row"), "{s}");
    }
}
