//! kvtier's side of `fio-compare` through the G3 tier's whole data path: jobs submitted to a
//! [`G3Tier`], which writes each row into a slot of its slab files with the tier's I/O engine
//! (O_DIRECT, io_uring with the region registered as fixed buffers), CRC32 on every row, index
//! records in its journal, and `max_bytes_in_flight = depth * row` as its byte budget.
//!
//! Rows: the driver keeps twice the budget queued, so it has `2 x depth` rows and gives a new
//! job the row freed last. With `buffer_sets` N above 1 it has `2 x N x depth` rows and gives a
//! new job the row freed longest ago, so a row comes back only after about `2 x (N - 1) x
//! depth` other jobs, as a scheduler's rows do (it names a free row of a large region).
//!
//! State: the tier preallocates its slabs (`posix_fallocate`) and a first, untimed store pass
//! writes every slot, so every timed store pass overwrites written slots (each new key evicts
//! the least recently used one) and every load pass reads written slots, as fio does on its
//! prepared file. Stores use `fsync = never` so both sides leave durability to the device
//! cache (fio runs without fsync); `kvtier bench` measures the durable default.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::fio::files::buffer_region;
use crate::fio::kvtier_workload::{PassStats, shuffle};
use crate::fio::runner::Profile;
use kvtier::contract::job::TransferJob;
use kvtier::contract::secondary::SecondaryTier;
use kvtier::error::{Error, ErrorKind, Result};
use kvtier::g3::{FsyncPolicy, G3Tier, G3TierConfig};
use kvtier::geometry::ChunkGeometry;
use kvtier::io::IoEngineKind;
use kvtier::key::ChunkKey;
use kvtier::region::PrimaryRegion;

/// How long the driver sleeps when no job has finished (it polls like a scheduler loop).
const POLL_INTERVAL: Duration = Duration::from_micros(100);

/// How long a pass waits without any job finishing before it gives up.
const STALL_LIMIT: Duration = Duration::from_secs(120);

/// What the G3 side runs on.
#[derive(Debug, Clone)]
pub struct G3Shape {
    /// One directory per path (created if missing; a previous run's tier there is replaced).
    pub dirs: Vec<PathBuf>,
    /// Bytes per path.
    pub bytes_per_path: u64,
    /// Bytes per row and slot.
    pub row_size: u64,
    /// The largest depth any pass will use.
    pub max_depth: u32,
    /// The tier's engine.
    pub engine: IoEngineKind,
    /// The kvtier region the buffer rows are in.
    pub region: crate::region_arg::BenchRegion,
    /// Sets of `2 x depth` rows the driver takes in turn (1: the row freed last is next).
    pub buffer_sets: u32,
}

/// A G3 tier over fresh directories, reopened whenever the depth (its byte budget) changes.
pub struct G3Workload {
    shape: G3Shape,
    region: Arc<PrimaryRegion>,
    tier: Option<(u32, G3Tier)>,
    slots: u64,
    held: Vec<ChunkKey>,
    generation: u64,
    next_job: u64,
    engine_name: String,
}

impl G3Workload {
    /// Creates the tier and fills every slot once (untimed).
    pub fn open(shape: &G3Shape) -> Result<Self> {
        for d in &shape.dirs {
            if d.exists() {
                std::fs::remove_dir_all(d).map_err(|e| Error::io("remove", d, e))?;
            }
            std::fs::create_dir_all(d).map_err(|e| Error::io("create", d, e))?;
        }
        let region = buffer_region(
            shape.row_size,
            shape.max_depth.saturating_mul(shape.buffer_sets.max(1)),
            shape.region,
        )?;
        let slots =
            ChunkGeometry::rows_in(shape.bytes_per_path, shape.row_size) * shape.dirs.len() as u64;
        let mut w = G3Workload {
            shape: shape.clone(),
            region,
            tier: None,
            slots,
            held: Vec::new(),
            generation: 0,
            next_job: 0,
            engine_name: String::new(),
        };
        w.run_pass(Profile::Store, shape.max_depth)?;
        Ok(w)
    }

    /// The buffer rows.
    pub fn region(&self) -> Arc<PrimaryRegion> {
        self.region.clone()
    }

    /// The data path as it runs.
    pub fn describe(&self) -> String {
        let sets = match self.shape.buffer_sets {
            0 | 1 => String::new(),
            n => format!(", {n} sets of rows taken in turn"),
        };
        format!(
            "G3 tier ({}, O_DIRECT, {}, CRC32, journal, fsync never{sets})",
            self.engine_name,
            crate::fio::files::page_note(&self.region)
        )
    }

    fn tier(&mut self, depth: u32) -> Result<&mut G3Tier> {
        if self.tier.as_ref().is_none_or(|(d, _)| *d != depth) {
            if let Some((_, mut old)) = self.tier.take() {
                old.shutdown()?;
            }
            let mut cfg = G3TierConfig::new(
                self.shape.dirs.clone(),
                self.shape.bytes_per_path * self.shape.dirs.len() as u64,
            );
            cfg.max_bytes_in_flight = Some(u64::from(depth) * self.shape.row_size);
            cfg.io_engine = self.shape.engine;
            cfg.fsync = FsyncPolicy::Never;
            let namespace = kvtier::g3::geometry_namespace(self.region.row_stride());
            let tier = G3Tier::open(cfg, self.region.clone(), namespace, "1:nvme".into(), None)?;
            if !tier.wait_recovered(Duration::from_secs(60)) {
                return Err(Error::new(
                    ErrorKind::Internal,
                    "the G3 tier did not recover its index within 60 s",
                ));
            }
            self.engine_name = tier.info().engine.clone();
            self.tier = Some((depth, tier));
        }
        match &mut self.tier {
            Some((_, t)) => Ok(t),
            None => Err(Error::new(ErrorKind::Internal, "G3 tier missing")),
        }
    }

    /// One pass of `profile` at `depth` rows in flight (the tier's byte budget). `mixed` is not
    /// supported here: concurrent stores would evict the keys being loaded.
    pub fn run_pass(&mut self, profile: Profile, depth: u32) -> Result<PassStats> {
        if depth == 0 || depth > self.shape.max_depth {
            return Err(Error::new(
                ErrorKind::Contract,
                format!("depth {depth} is outside 1..={}", self.shape.max_depth),
            ));
        }
        let sets = self.shape.buffer_sets.max(1) as usize;
        let rows = 2 * depth as usize * sets;
        let row = self.shape.row_size;
        let is_load = match profile {
            Profile::Store => false,
            Profile::Load => true,
            Profile::Mixed => {
                return Err(Error::config(
                    "--profile",
                    "mixed runs on the engine side only: add --kvtier-side engine",
                ));
            }
        };
        let keys: Vec<ChunkKey> = if is_load {
            let mut order: Vec<u64> = (0..self.held.len() as u64).collect();
            shuffle(&mut order, self.generation + 1);
            order
                .iter()
                .map(|&i| self.held[i as usize].clone())
                .collect()
        } else {
            self.generation += 1;
            let g = self.generation;
            (0..self.slots).map(|i| pass_key(g, i)).collect()
        };
        let mut next_job = self.next_job;
        let tier = self.tier(depth)?;
        let mut free_rows = RowPool::new(rows as u32, sets > 1);
        let mut row_of_job = std::collections::HashMap::new();
        let mut next = 0usize;
        let mut done = 0usize;
        let mut failed: Option<Error> = None;
        let start = Instant::now();
        let mut last_progress = start;
        while done < keys.len() {
            // Keep twice the budget queued so the tier never waits for this driver.
            while next < keys.len() && failed.is_none() {
                let Some(r) = free_rows.take() else { break };
                let job = TransferJob {
                    job_id: next_job,
                    keys: vec![keys[next].clone()],
                    chunk_ids: vec![r],
                    is_promotion: is_load,
                    req_id: Arc::from("fio-compare"),
                    submit_time: Instant::now(),
                };
                row_of_job.insert(next_job, r);
                next_job += 1;
                next += 1;
                if is_load {
                    tier.submit_load(job);
                } else {
                    tier.submit_store(job);
                }
            }
            let finished = tier.get_finished_jobs();
            if finished.is_empty() {
                if last_progress.elapsed() > STALL_LIMIT {
                    return Err(Error::new(
                        ErrorKind::Internal,
                        format!(
                            "no G3 job finished for {} s; the tier stopped reporting",
                            STALL_LIMIT.as_secs()
                        ),
                    ));
                }
                std::thread::sleep(POLL_INTERVAL);
                continue;
            }
            last_progress = Instant::now();
            for r in finished {
                done += 1;
                if let Some(row) = row_of_job.remove(&r.job_id) {
                    free_rows.give_back(row);
                }
                if !r.success && failed.is_none() {
                    failed = Some(r.error.unwrap_or_else(|| {
                        Error::new(ErrorKind::Io, format!("G3 job {} failed", r.job_id))
                    }));
                }
            }
            if failed.is_some() && row_of_job.is_empty() {
                break;
            }
        }
        let seconds = start.elapsed().as_secs_f64();
        self.next_job = next_job;
        if let Some(e) = failed {
            return Err(e);
        }
        if !is_load {
            self.held = keys;
        }
        Ok(PassStats {
            bytes: done as u64 * row,
            seconds,
        })
    }

    /// Shuts the tier down (checkpoint included).
    pub fn close(mut self) -> Result<()> {
        match self.tier.take() {
            Some((_, mut t)) => t.shutdown(),
            None => Ok(()),
        }
    }
}

/// The driver's free rows.
struct RowPool {
    free: std::collections::VecDeque<u32>,
    /// Take the row freed longest ago (else the one freed last).
    oldest_first: bool,
}

impl RowPool {
    /// Rows `0..rows`, all free; the first taken is row 0.
    fn new(rows: u32, oldest_first: bool) -> Self {
        let free = if oldest_first {
            (0..rows).collect()
        } else {
            (0..rows).rev().collect()
        };
        RowPool { free, oldest_first }
    }

    fn take(&mut self) -> Option<u32> {
        if self.oldest_first {
            self.free.pop_front()
        } else {
            self.free.pop_back()
        }
    }

    fn give_back(&mut self, row: u32) {
        self.free.push_back(row);
    }
}

/// A distinct 36-byte key per (pass generation, index).
fn pass_key(generation: u64, index: u64) -> ChunkKey {
    let mut k = [0u8; 36];
    k[..8].copy_from_slice(b"fio-cmp\0");
    k[8..16].copy_from_slice(&generation.to_le_bytes());
    k[16..24].copy_from_slice(&index.to_le_bytes());
    ChunkKey::new(k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_and_load_passes_move_every_slot_through_the_tier() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let row = 64u64 << 10;
        let mut w = G3Workload::open(&G3Shape {
            dirs: vec![dir.path().join("a"), dir.path().join("b")],
            bytes_per_path: 8 * row,
            row_size: row,
            max_depth: 4,
            engine: IoEngineKind::Auto,
            region: crate::region_arg::BenchRegion::Own,
            buffer_sets: 1,
        })
        .unwrap();
        assert!(w.describe().contains("G3 tier"));
        for depth in [1, 4] {
            let s = w.run_pass(Profile::Store, depth).unwrap();
            assert_eq!(s.bytes, 16 * row);
            let l = w.run_pass(Profile::Load, depth).unwrap();
            assert_eq!(l.bytes, 16 * row);
        }
        let e = w.run_pass(Profile::Mixed, 1).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert_eq!(
            w.run_pass(Profile::Load, 9).unwrap_err().kind(),
            ErrorKind::Contract
        );
        w.close().unwrap();
    }

    #[test]
    fn the_row_pool_hands_out_the_last_freed_or_the_oldest_freed_row() {
        let mut last = RowPool::new(4, false);
        let mut oldest = RowPool::new(4, true);
        for pool in [&mut last, &mut oldest] {
            assert_eq!(pool.take(), Some(0));
            assert_eq!(pool.take(), Some(1));
        }
        // Rows 2 and 3 are still free; 1 and then 0 come back.
        for pool in [&mut last, &mut oldest] {
            pool.give_back(1);
            pool.give_back(0);
        }
        let order = |pool: &mut RowPool| std::iter::from_fn(|| pool.take()).collect::<Vec<_>>();
        assert_eq!(order(&mut last), vec![0, 1, 2, 3]);
        assert_eq!(order(&mut oldest), vec![2, 3, 1, 0]);
    }

    #[test]
    fn with_buffer_sets_every_row_takes_its_turn() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let row = 64u64 << 10;
        let (depth, sets) = (2u32, 3u32);
        let mut w = G3Workload::open(&G3Shape {
            dirs: vec![dir.path().join("a")],
            bytes_per_path: 16 * row,
            row_size: row,
            max_depth: depth,
            engine: IoEngineKind::Auto,
            region: crate::region_arg::BenchRegion::Own,
            buffer_sets: sets,
        })
        .unwrap();
        assert!(w.describe().contains("3 sets of rows"), "{}", w.describe());
        let region = w.region();
        let rows = region.num_rows();
        assert_eq!(rows, (2 * depth * sets) as usize);
        // Each row a byte of its own, stored into the slots; then every row zeroed.
        let fill = |v: u8| {
            for i in 0..rows {
                region
                    .write_row(i)
                    .unwrap()
                    .fill(v.wrapping_mul(i as u8 + 1));
            }
        };
        fill(1);
        assert_eq!(w.run_pass(Profile::Store, depth).unwrap().bytes, 16 * row);
        fill(0);
        // 16 loads through the 12 rows (in the pool's order, tested above): every row holds
        // loaded bytes afterwards.
        assert_eq!(w.run_pass(Profile::Load, depth).unwrap().bytes, 16 * row);
        for i in 0..rows {
            let data = region.read_row(i).unwrap();
            assert!(
                data.iter().any(|&b| b != 0),
                "row {i} was never loaded into"
            );
        }
        w.close().unwrap();
    }
}
