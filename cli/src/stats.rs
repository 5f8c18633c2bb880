//! Small statistics for benchmark reports: medians, nearest-rank percentiles and the process's
//! CPU time.

/// The median of `values` (mean of the two middle values for an even count); `None` if empty
/// or if any value is NaN.
pub fn median(values: &[f64]) -> Option<f64> {
    if values.is_empty() || values.iter().any(|v| v.is_nan()) {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    Some(if sorted.len() % 2 == 1 {
        sorted[mid]
    } else {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    })
}

/// The nearest-rank `p`-th percentile (0 < p <= 100) of `sorted` (ascending); `None` if empty.
pub fn percentile_sorted<T: Copy>(sorted: &[T], p: f64) -> Option<T> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// User plus system CPU seconds this process has used so far.
///
/// `clock_gettime(CLOCK_PROCESS_CPUTIME_ID)`: the CPU time of every thread of the process, the
/// same sum as `getrusage`'s user and system times.
pub fn process_cpu_seconds() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 / 1e9
}

/// (max - min) / median of `v`; NaN when empty or the median is not positive.
pub fn spread_of(v: &[f64]) -> f64 {
    let Some(m) = median(v) else {
        return f64::NAN;
    };
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if m > 0.0 { (hi - lo) / m } else { f64::NAN }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_odd_even_empty() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[1.0, f64::NAN]), None);
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<u32> = (1..=100).collect();
        assert_eq!(percentile_sorted(&v, 50.0), Some(50));
        assert_eq!(percentile_sorted(&v, 99.0), Some(99));
        assert_eq!(percentile_sorted(&v, 100.0), Some(100));
        assert_eq!(percentile_sorted(&[7u32], 99.0), Some(7));
        assert_eq!(percentile_sorted::<u32>(&[], 50.0), None);
        assert_eq!(percentile_sorted(&[1u32, 2], 0.1), Some(1));
    }
}
