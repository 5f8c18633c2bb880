//! What a block device itself saw, from its own counters (`/sys/dev/block/MAJ:MIN/stat`,
//! described in the kernel's `Documentation/admin-guide/iostats.rst`), read before and after
//! some work: `kvtier fio-compare`'s passes ([`DeviceSampler`]) and `kvtier replay`'s busy time
//! ([`counters_of`]).
//!
//! Throughput is requests in flight divided by the time each takes. Two passes can keep the
//! same number of requests in the device and still differ because each request took longer
//! there, or keep fewer requests in the device because the software between two requests was
//! slow. The first points at the device (or at what the pass does to it), the second at the
//! software. [`DeviceView`] tells them apart:
//! * `queue_while_busy`: requests in the device on average while it had any
//!   (`time_in_queue` / `io_ticks`, both in ms: fields 11 and 10);
//! * `request_latency_us`: the time from a request's start to its completion, on average
//!   (read + write ticks / reads + writes completed: fields 4 + 8 over fields 1 + 5);
//! * `request_bytes`: a request's size after the block layer merged neighbouring ones
//!   (sectors of 512 bytes, fields 3 + 7, over requests).
//!
//! The counters hold every request this machine makes to the device, not only the pass's: a
//! quiet machine is assumed, as for the throughput. Files on a filesystem without a block
//! device (tmpfs, overlayfs, btrfs: their device numbers name no block device) give no view.

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::Serialize;

/// The counters of one or more block devices (summed), as read at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceCounters {
    /// Reads and writes completed.
    pub requests: u64,
    /// 512-byte sectors read and written.
    pub sectors: u64,
    /// Milliseconds spent by reads and writes, summed over requests.
    pub request_ms: u64,
    /// Milliseconds during which the device had at least one request (`io_ticks`).
    pub busy_ms: u64,
    /// Requests in the device integrated over time, in ms (`time_in_queue`).
    pub queued_ms: u64,
}

impl DeviceCounters {
    /// Parses one `stat` file's text; `None` when it has fewer than 11 numeric fields.
    pub fn parse(text: &str) -> Option<Self> {
        let f: Vec<u64> = text
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()
            .ok()?;
        if f.len() < 11 {
            return None;
        }
        Some(DeviceCounters {
            requests: f[0] + f[4],
            sectors: f[2] + f[6],
            request_ms: f[3] + f[7],
            busy_ms: f[9],
            queued_ms: f[10],
        })
    }

    fn add(self, o: Self) -> Self {
        DeviceCounters {
            requests: self.requests + o.requests,
            sectors: self.sectors + o.sectors,
            request_ms: self.request_ms + o.request_ms,
            busy_ms: self.busy_ms + o.busy_ms,
            queued_ms: self.queued_ms + o.queued_ms,
        }
    }
}

/// What the device saw between two readings of its counters (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DeviceView {
    /// Requests in the device on average while it had any.
    pub queue_while_busy: f64,
    /// Start-to-completion time of a request on average, microseconds.
    pub request_latency_us: f64,
    /// Bytes per request on average, after merging.
    pub request_bytes: f64,
    /// Requests completed.
    pub requests: u64,
}

impl DeviceView {
    /// The view between `before` and `after`; `None` when no request completed in between or
    /// the counters went backwards (the device was reset).
    pub fn between(before: DeviceCounters, after: DeviceCounters) -> Option<Self> {
        let requests = after.requests.checked_sub(before.requests)?;
        if requests == 0 {
            return None;
        }
        let sectors = after.sectors.checked_sub(before.sectors)?;
        let request_ms = after.request_ms.checked_sub(before.request_ms)?;
        let busy_ms = after.busy_ms.checked_sub(before.busy_ms)?;
        let queued_ms = after.queued_ms.checked_sub(before.queued_ms)?;
        Some(DeviceView {
            queue_while_busy: if busy_ms == 0 {
                f64::NAN
            } else {
                queued_ms as f64 / busy_ms as f64
            },
            request_latency_us: request_ms as f64 * 1000.0 / requests as f64,
            request_bytes: sectors as f64 * 512.0 / requests as f64,
            requests,
        })
    }

    /// The median of each figure over `views` (`None` when empty).
    pub fn median_of(views: &[DeviceView]) -> Option<DeviceView> {
        let m = |f: fn(&DeviceView) -> f64| {
            crate::stats::median(&views.iter().map(f).collect::<Vec<_>>()).unwrap_or(f64::NAN)
        };
        let mut requests: Vec<u64> = views.iter().map(|v| v.requests).collect();
        requests.sort_unstable();
        Some(DeviceView {
            queue_while_busy: m(|v| v.queue_while_busy),
            request_latency_us: m(|v| v.request_latency_us),
            request_bytes: m(|v| v.request_bytes),
            requests: *requests.get(requests.len() / 2)?,
        })
    }
}

/// The block devices holding a set of paths, read together.
#[derive(Debug, Clone)]
pub struct DeviceSampler {
    stat_files: Vec<PathBuf>,
    /// Their names (`vda`, `nvme0n1p1`), for the report.
    pub names: Vec<String>,
}

impl DeviceSampler {
    /// The distinct block devices that hold `paths` (a partition counts as itself: its `stat`
    /// counts its own requests). Paths on filesystems without a block device are left out.
    pub fn of(paths: &[PathBuf]) -> Self {
        let mut devs = BTreeSet::new();
        for p in paths {
            if let Ok(m) = std::fs::metadata(p) {
                devs.insert(m.dev());
            }
        }
        let mut stat_files = Vec::new();
        let mut names = Vec::new();
        for dev in devs {
            let base = sysfs_dir(dev);
            let stat = base.join("stat");
            if read_counters(&stat).is_none() {
                continue;
            }
            let name = std::fs::read_link(&base)
                .ok()
                .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| {
                    format!("{}:{}", rustix::fs::major(dev), rustix::fs::minor(dev))
                });
            stat_files.push(stat);
            names.push(name);
        }
        DeviceSampler { stat_files, names }
    }

    /// The summed counters now; `None` when there is no device or one could not be read.
    pub fn read(&self) -> Option<DeviceCounters> {
        if self.stat_files.is_empty() {
            return None;
        }
        self.stat_files
            .iter()
            .try_fold(DeviceCounters::default(), |sum, f| {
                Some(sum.add(read_counters(f)?))
            })
    }

    /// Runs `pass` and returns its result with what the devices saw meanwhile.
    pub fn around<T>(&self, pass: impl FnOnce() -> T) -> (T, Option<DeviceView>) {
        let before = self.read();
        let out = pass();
        let view = before
            .zip(self.read())
            .and_then(|(b, a)| DeviceView::between(b, a));
        (out, view)
    }
}

fn read_counters(path: &Path) -> Option<DeviceCounters> {
    DeviceCounters::parse(&std::fs::read_to_string(path).ok()?)
}

/// The sysfs directory of block device `dev` (`/sys/dev/block/MAJ:MIN`).
fn sysfs_dir(dev: u64) -> PathBuf {
    let (major, minor) = (rustix::fs::major(dev), rustix::fs::minor(dev));
    PathBuf::from(format!("/sys/dev/block/{major}:{minor}"))
}

/// The counters of the block device holding `path` now, or why there are none (the path
/// cannot be read, or its device has no `stat` file: tmpfs, overlayfs, btrfs).
pub fn counters_of(path: &Path) -> std::result::Result<DeviceCounters, String> {
    let dev = std::fs::metadata(path)
        .map_err(|e| format!("cannot stat {}: {e}", path.display()))?
        .dev();
    let stat = sysfs_dir(dev).join("stat");
    let text = std::fs::read_to_string(&stat).map_err(|_| {
        format!(
            "{} is on device {}:{}, which has no {}",
            path.display(),
            rustix::fs::major(dev),
            rustix::fs::minor(dev),
            stat.display()
        )
    })?;
    DeviceCounters::parse(&text).ok_or_else(|| format!("{} has no io_ticks field", stat.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_come_from_the_fields_iostats_names() {
        // Fields 1..17 of iostats.rst: reads 100 (merges 1, 800 sectors, 50 ms), writes 20
        // (merges 2, 4000 sectors, 30 ms), 3 in flight, io_ticks 60, time_in_queue 80, then
        // discards and flushes, which are not counted.
        let c = DeviceCounters::parse("100 1 800 50 20 2 4000 30 3 60 80 7 7 7 7 9 9\n").unwrap();
        assert_eq!(
            c,
            DeviceCounters {
                requests: 120,
                sectors: 4800,
                request_ms: 80,
                busy_ms: 60,
                queued_ms: 80,
            }
        );
        assert_eq!(DeviceCounters::parse("1 2 3"), None);
        assert_eq!(DeviceCounters::parse("1 2 x 4 5 6 7 8 9 10 11"), None);
    }

    #[test]
    fn the_view_divides_the_differences() {
        let before = DeviceCounters {
            requests: 1_000,
            sectors: 10_000,
            request_ms: 500,
            busy_ms: 400,
            queued_ms: 600,
        };
        // 400 requests of 64 KiB (128 sectors), 2 ms each, 800 ms in all over 100 ms busy:
        // 8 requests in the device on average.
        let after = DeviceCounters {
            requests: 1_400,
            sectors: 10_000 + 400 * 128,
            request_ms: 1_300,
            busy_ms: 500,
            queued_ms: 1_400,
        };
        let v = DeviceView::between(before, after).unwrap();
        assert_eq!(v.requests, 400);
        assert_eq!(v.request_bytes, 65_536.0);
        assert_eq!(v.request_latency_us, 2_000.0);
        assert_eq!(v.queue_while_busy, 8.0);
        // Nothing completed, or the counters went backwards: no view.
        assert_eq!(DeviceView::between(before, before), None);
        assert_eq!(DeviceView::between(after, before), None);
    }

    #[test]
    fn the_median_is_taken_per_figure() {
        let v = |q: f64, l: f64, b: f64, n: u64| DeviceView {
            queue_while_busy: q,
            request_latency_us: l,
            request_bytes: b,
            requests: n,
        };
        let m = DeviceView::median_of(&[
            v(1.0, 900.0, 10.0, 5),
            v(3.0, 100.0, 30.0, 1),
            v(2.0, 500.0, 20.0, 9),
        ])
        .unwrap();
        assert_eq!(m, v(2.0, 500.0, 20.0, 5));
        assert_eq!(DeviceView::median_of(&[]), None);
    }

    #[test]
    fn counters_of_a_path_say_why_there_are_none() {
        let e = counters_of(Path::new("/nonexistent/kvtier")).unwrap_err();
        assert!(e.starts_with("cannot stat /nonexistent/kvtier"), "{e}");
        // tmpfs numbers its files' device with no block device behind it.
        if Path::new("/dev/shm").is_dir() {
            let e = counters_of(Path::new("/dev/shm")).unwrap_err();
            assert!(e.contains("which has no /sys/dev/block/"), "{e}");
        }
    }

    #[test]
    fn a_pass_on_the_temp_dir_is_seen_by_its_device() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let sampler = DeviceSampler::of(&[dir.path().to_path_buf()]);
        if sampler.names.is_empty() {
            kvtier::skip_test!("/tmp is not on a block device with a stat file");
            return;
        }
        // 64 O_DIRECT writes of 64 KiB reach the device as requests of their own (at most
        // merged with each other).
        let path = dir.path().join("f");
        let (written, view) = sampler.around(|| {
            use std::os::unix::fs::{FileExt, OpenOptionsExt};
            let f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .custom_flags(libc::O_DIRECT)
                .open(&path)
                .unwrap();
            let buf = kvtier::region::PrimaryRegion::create(1, 64 << 10).unwrap();
            let row = buf.read_row(0).unwrap();
            for i in 0..64u64 {
                f.write_all_at(&row, i * (64 << 10)).unwrap();
            }
            f.sync_all().unwrap();
            64u64 << 16
        });
        let v = view.expect("the device completed requests during the pass");
        let bytes = v.request_bytes * v.requests as f64;
        assert!(bytes >= written as f64, "{v:?}");
    }
}
