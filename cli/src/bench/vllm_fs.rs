//! vLLM 0.33.0's `fs` tier approach, mirrored for `kvtier bench --tier fs`, so that both are
//! measured in the same run on the same directory, rows and jobs.
//!
//! What vLLM does (`tiering/fs/io.py` and its C extension `vllm.fs_io_C`, which releases the
//! GIL and follows the same steps): a pool of 16 threads; each job is one task run on one
//! thread, its keys in order. Store, per key: skip if the final file exists; create the parent
//! directories; open `<final>_<random>.tmp` with `O_CREAT | O_EXCL | O_WRONLY | O_TRUNC |
//! O_DIRECT`; one `write` of the row; close; `rename` onto the final name. Load, per key: open
//! with `O_RDONLY | O_DIRECT`; one `readv` into the row; close. No CRC, no xattr, no fsync, no
//! byte cap, no I/O engine. File names are the same FileMapper names kvtier uses.

use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use crate::bench::data::{fill_row, first_mismatch};
use crate::stats::process_cpu_seconds;
use kvtier::error::{Error, ErrorKind, Result};
use kvtier::fs::FileMapper;
use kvtier::key::ChunkKey;
use kvtier::region::PrimaryRegion;

/// vLLM's default `n_read_threads` = `n_write_threads`.
pub const VLLM_THREADS: usize = 16;

/// One direction of the mirror.
#[derive(Debug, Clone, Copy, Default)]
pub struct MirrorPhase {
    /// Wall seconds from the first job to the last.
    pub seconds: f64,
    /// Process CPU seconds during the phase.
    pub cpu_seconds: f64,
}

/// The mirror over one set of chunks: rows `0..keys.len()` of `region` hold chunk `i`.
pub struct VllmFsMirror<'a> {
    /// The naming (vLLM's FileMapper over the mirror's own directory).
    pub mapper: FileMapper,
    /// Rows: one per chunk.
    pub region: &'a PrimaryRegion,
    /// Whether to open with O_DIRECT (vLLM's probe decides; the caller passes its outcome).
    pub direct: bool,
}

impl VllmFsMirror<'_> {
    /// Stores every chunk, one job per batch, on [`VLLM_THREADS`] threads.
    pub fn store(
        &self,
        keys: &[ChunkKey],
        batches: &[std::ops::Range<u64>],
    ) -> Result<MirrorPhase> {
        self.run(batches, |i| self.store_one(&keys[i], i))
    }

    /// Loads every chunk back into its row.
    pub fn load(&self, keys: &[ChunkKey], batches: &[std::ops::Range<u64>]) -> Result<MirrorPhase> {
        self.run(batches, |i| self.load_one(&keys[i], i))
    }

    /// Fills row `i` with chunk `i`'s bytes for every chunk (untimed).
    pub fn fill(&self, n: usize, seed: u64) -> Result<()> {
        for i in 0..n {
            // The mirror's region is private to the bench and no thread runs now.
            fill_row(&mut self.region.write_row(i)?, seed, i as u64);
        }
        Ok(())
    }

    /// Zeroes every row, so that a load that moved nothing cannot pass the check.
    pub fn clear(&self, n: usize) -> Result<()> {
        for i in 0..n {
            // As in `fill`.
            self.region.write_row(i)?.fill(0);
        }
        Ok(())
    }

    /// Chunks whose row holds exactly their bytes.
    pub fn verified(&self, n: usize, seed: u64) -> Result<u64> {
        let mut ok = 0;
        for i in 0..n {
            // As in `fill`.
            let row = self.region.read_row(i)?;
            ok += u64::from(first_mismatch(&row, seed, i as u64).is_none());
        }
        Ok(ok)
    }

    /// Runs one task per batch on the pool; the first failure ends the phase with its error.
    fn run(
        &self,
        batches: &[std::ops::Range<u64>],
        per_key: impl Fn(usize) -> std::io::Result<()> + Sync,
    ) -> Result<MirrorPhase> {
        let next = AtomicUsize::new(0);
        let cpu0 = process_cpu_seconds();
        let start = Instant::now();
        let failures: Vec<std::io::Error> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..VLLM_THREADS)
                .map(|_| {
                    s.spawn(|| {
                        let mut errors = Vec::new();
                        loop {
                            let b = next.fetch_add(1, Ordering::Relaxed);
                            let Some(range) = batches.get(b) else { break };
                            // A job stops at its first failing key, as vLLM's does.
                            if let Err(e) = range.clone().try_for_each(|i| per_key(i as usize)) {
                                errors.push(e);
                            }
                        }
                        errors
                    })
                })
                .collect();
            workers
                .into_iter()
                .flat_map(|w| w.join().unwrap_or_default())
                .collect()
        });
        let phase = MirrorPhase {
            seconds: start.elapsed().as_secs_f64(),
            cpu_seconds: process_cpu_seconds() - cpu0,
        };
        match failures.into_iter().next() {
            None => Ok(phase),
            Some(e) => Err(Error::new(
                ErrorKind::Io,
                format!(
                    "vLLM's fs approach failed on {}: {e}",
                    self.mapper.data_dir().display()
                ),
            )),
        }
    }

    fn store_one(&self, key: &ChunkKey, row: usize) -> std::io::Result<()> {
        let dest = self.mapper.file_path(key).map_err(std::io::Error::other)?;
        if dest.exists() {
            return Ok(());
        }
        let parent = dest.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(parent)?;
        static SUFFIX: AtomicUsize = AtomicUsize::new(0);
        let n = SUFFIX.fetch_add(1, Ordering::Relaxed);
        let tmp = format!("{}_{}{n}.tmp", dest.display(), std::process::id());
        let mut o = OpenOptions::new();
        o.write(true).create_new(true).mode(0o644);
        if self.direct {
            o.custom_flags(libc::O_DIRECT);
        }
        let mut f = o.open(&tmp)?;
        // Rows are only read during a store phase; no thread writes them.
        let bytes = self.region.read_row(row).map_err(std::io::Error::other)?;
        let written = f.write(&bytes)?;
        drop(f);
        if written < bytes.len() {
            let _ = std::fs::remove_file(&tmp);
            return Err(std::io::Error::other(format!(
                "short write: {written} of {} bytes",
                bytes.len()
            )));
        }
        std::fs::rename(&tmp, &dest)
    }

    fn load_one(&self, key: &ChunkKey, row: usize) -> std::io::Result<()> {
        let path = self.mapper.file_path(key).map_err(std::io::Error::other)?;
        let mut o = OpenOptions::new();
        o.read(true);
        if self.direct {
            o.custom_flags(libc::O_DIRECT);
        }
        let mut f = o.open(&path)?;
        // Each row is written by exactly one thread (its chunk's task) during a load
        // phase, and nothing reads it until the phase is over.
        let mut buf = self.region.write_row(row).map_err(std::io::Error::other)?;
        let n = f.read(&mut buf)?;
        if n < buf.len() {
            return Err(std::io::Error::other(format!(
                "short read: {n} of {} bytes from {}",
                buf.len(),
                path.display()
            )));
        }
        Ok(())
    }
}
