//! The start-up scan: walks the tier's data folder in the background, hands every chunk file
//! it finds to the catalog in least-recently-used order (file times: the later of access and
//! modification), and removes temporary files older than `stale_temp_s` (stores that died
//! mid-way, kvtier's or vLLM's; start-up probe files of a killed start). Until it has finished, the catalog knows only what this
//! process did since it started, so the capacity is enforced over that.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use crossbeam_channel::Sender;

use crate::error::{Error, ErrorKind, Result};
use crate::fs::chunk_file::is_temp_name;
use crate::fs::mapper::FileMapper;
use crate::fs::worker::{Cmd, Shared};
use crate::key::ChunkKey;

/// Starts the scan thread; `stop` ends it early (at shutdown).
pub(crate) fn spawn(
    sh: Arc<Shared>,
    stale_age: Duration,
    stop: Arc<AtomicBool>,
    cmd_tx: Sender<Cmd>,
) -> Result<JoinHandle<()>> {
    crate::io::spawn_io_thread("kvtier-fs-scan".to_string(), move || {
        let started = std::time::Instant::now();
        let mut files = Vec::new();
        let dir = sh.mapper.data_dir().to_path_buf();
        let complete = walk(&sh, &dir, stale_age, &stop, &mut files);
        if !complete {
            return;
        }
        // Newest first: the catalog puts each one behind the previous.
        files.sort_unstable_by_key(|f| std::cmp::Reverse(f.2));
        let n = files.len();
        let _ = cmd_tx.send(Cmd::Scanned(
            files.into_iter().map(|(k, b, _)| (k, b)).collect(),
        ));
        sh.metrics.scan_done.store(true, Ordering::Release);
        log::info!(
            "fs tier: found {n} chunk files under {} in {:.1} s",
            dir.display(),
            started.elapsed().as_secs_f64()
        );
    })
    .map_err(|e| {
        Error::new(
            ErrorKind::Io,
            format!("cannot start the fs scan thread: {e}"),
        )
        .with_source(e)
    })
}

/// Walks `<data>/<hhh>/<hh>_g<n>/`; false if stopped before the end.
fn walk(
    sh: &Shared,
    data: &Path,
    stale_age: Duration,
    stop: &AtomicBool,
    out: &mut Vec<(ChunkKey, u64, SystemTime)>,
) -> bool {
    let now = SystemTime::now();
    for d1 in read_dir(data) {
        // Beside the `<hhh>` folders only the start-up probes' files live here; one that a
        // killed start left is removed once stale.
        if !d1.is_dir() {
            let probe = d1
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(".kvtier-") && n.contains("-probe-"));
            if probe && is_stale(&d1, now, stale_age) && std::fs::remove_file(&d1).is_ok() {
                sh.metrics
                    .stale_temps_removed
                    .fetch_add(1, Ordering::Relaxed);
            }
            continue;
        }
        for d2 in read_dir(&d1) {
            if stop.load(Ordering::Relaxed) {
                return false;
            }
            for file in read_dir(&d2) {
                let Some(name) = file.file_name().and_then(|n| n.to_str()) else {
                    continue;
                };
                let Ok(meta) = std::fs::symlink_metadata(&file) else {
                    continue;
                };
                if !meta.is_file() {
                    continue;
                }
                let mtime = meta.modified().unwrap_or(now);
                if is_temp_name(name) {
                    let age = now.duration_since(mtime).unwrap_or_default();
                    if age > stale_age && std::fs::remove_file(&file).is_ok() {
                        sh.metrics
                            .stale_temps_removed
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    continue;
                }
                let Some(key) = file.strip_prefix(data).ok().and_then(FileMapper::key_of) else {
                    continue;
                };
                let used = meta.accessed().map_or(mtime, |a| a.max(mtime));
                sh.metrics.scanned_files.fetch_add(1, Ordering::Relaxed);
                out.push((key, meta.len(), used));
            }
        }
    }
    true
}

/// Whether `path` was last modified more than `age` before `now`.
fn is_stale(path: &Path, now: SystemTime, age: Duration) -> bool {
    std::fs::symlink_metadata(path)
        .and_then(|m| m.modified())
        .is_ok_and(|t| now.duration_since(t).unwrap_or_default() > age)
}

/// The entries of `dir`, or none if it cannot be read (another host may remove folders).
fn read_dir(dir: &Path) -> Vec<std::path::PathBuf> {
    match std::fs::read_dir(dir) {
        Ok(rd) => rd.filter_map(|e| e.ok().map(|e| e.path())).collect(),
        Err(e) => {
            if e.kind() != std::io::ErrorKind::NotFound {
                log::warn!("fs tier scan: cannot read {}: {e}", dir.display());
            }
            Vec::new()
        }
    }
}
