//! kvtier's side of `fio-compare` through the G3 tier's whole data path: jobs submitted to a
//! [`G3Tier`], which writes each row into a slot of its slab files with the tier's I/O engine
//! (O_DIRECT, io_uring with the region registered as fixed buffers), CRC32 on every row, index
//! records in its journal, and `max_bytes_in_flight = depth * row` as its byte budget.
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
        let region = buffer_region(shape.row_size, shape.max_depth, shape.region)?;
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
        format!(
            "G3 tier ({}, O_DIRECT, {}, CRC32, journal, fsync never)",
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
        let rows = 2 * depth as usize;
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
        let mut free_rows: Vec<u32> = (0..rows as u32).rev().collect();
        let mut row_of_job = std::collections::HashMap::new();
        let mut next = 0usize;
        let mut done = 0usize;
        let mut failed: Option<Error> = None;
        let start = Instant::now();
        let mut last_progress = start;
        while done < keys.len() {
            // Keep twice the budget queued so the tier never waits for this driver.
            while next < keys.len() && failed.is_none() {
                let Some(r) = free_rows.pop() else { break };
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
                    free_rows.push(row);
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
}
