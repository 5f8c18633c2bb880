//! kvtier's side of `fio-compare`: the same passes fio runs, driven through kvtier's own I/O
//! engine exactly as the G3 tier drives it (io_uring with the primary region registered as
//! fixed buffers, O_DIRECT files, one row per request, a fixed number of rows in flight).
//!
//! A store pass writes every row of the file(s) in slot order, striped across files
//! (`slot % n_files`), as the G3 tier lays slots out; a load pass reads every row once in a
//! random order; a mixed pass runs both at once, each with the full depth.
//!
//! Buffer rows: by default each direction has `depth` rows and a completed request's row takes
//! the next request at once, as fio reuses its `iodepth` buffers. With `buffer_sets` N above 1
//! each direction has N sets of `depth` rows and a completed request's successor takes the
//! same place in the next set, so a row is used again only after N - 1 other sets: the reuse
//! of a tier, whose caller names a different row for each transfer.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::fio::files::{buffer_region, open_direct};
use crate::fio::runner::Profile;
use kvtier::error::{Error, ErrorKind, Result};
use kvtier::geometry::ChunkGeometry;
use kvtier::io::{
    EngineInfo, EngineOptions, IoDir, IoEngine, IoEngineKind, IoRequest, open_engine,
};
use kvtier::region::PrimaryRegion;
use kvtier::tiering::XorShift64;

/// What the workload runs on.
#[derive(Debug, Clone)]
pub struct WorkloadShape {
    /// Prepared files (see [`crate::fio::files::prepare`]), one per path.
    pub files: Vec<PathBuf>,
    /// Bytes per file (a multiple of `row_size`).
    pub file_size: u64,
    /// Bytes per request.
    pub row_size: u64,
    /// The largest depth any pass will use.
    pub max_depth: u32,
    /// Which engine to start.
    pub engine: IoEngineKind,
    /// The kvtier region the buffer rows are in.
    pub region: crate::region_arg::BenchRegion,
    /// Sets of `depth` buffer rows per direction, used in turn (1: a row is reused at once).
    pub buffer_sets: u32,
}

/// An engine over the prepared files with a region of `2 * max_depth * buffer_sets` rows as
/// buffers.
pub struct KvtierWorkload {
    engine: Arc<dyn IoEngine>,
    info: EngineInfo,
    n_files: u64,
    slots: u64,
    row: usize,
    max_depth: u32,
    buffer_sets: usize,
    passes: u64,
}

/// What one pass moved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PassStats {
    /// Bytes moved (both directions for `mixed`).
    pub bytes: u64,
    /// Wall time of the pass.
    pub seconds: f64,
}

impl PassStats {
    /// Bytes per second over the whole pass.
    pub fn bytes_per_sec(&self) -> f64 {
        self.bytes as f64 / self.seconds.max(1e-9)
    }
}

/// One sequence of requests sharing a set of buffer rows.
struct Stream {
    dir: IoDir,
    order: Vec<u64>,
    next: usize,
    first_row: usize,
}

impl KvtierWorkload {
    /// Opens the files with O_DIRECT and starts the engine.
    pub fn open(shape: &WorkloadShape) -> Result<Self> {
        let buffer_sets = shape.buffer_sets.max(1);
        let region = buffer_region(
            shape.row_size,
            shape.max_depth.saturating_mul(buffer_sets),
            shape.region,
        )?;
        let row = region.row_stride() as usize;
        let files = shape
            .files
            .iter()
            .map(|p| open_direct(p))
            .collect::<Result<Vec<_>>>()?;
        let opts = EngineOptions {
            // Both directions of a mixed pass in flight at the largest depth.
            queue_depth: 2 * shape.max_depth.max(1),
            o_direct: true,
            ..EngineOptions::default()
        };
        let handle = open_engine(shape.engine, region, files, &opts)?;
        let n_files = shape.files.len() as u64;
        Ok(KvtierWorkload {
            engine: handle.engine,
            info: handle.info,
            n_files,
            slots: ChunkGeometry::rows_in(shape.file_size, shape.row_size) * n_files,
            row,
            max_depth: shape.max_depth,
            buffer_sets: buffer_sets as usize,
            passes: 0,
        })
    }

    /// The buffer rows.
    pub fn region(&self) -> Arc<PrimaryRegion> {
        self.engine.region().clone()
    }

    /// The engine as it runs, e.g. `uring (fixed buffers), O_DIRECT`.
    pub fn describe(&self) -> String {
        let mut s = self.info.name.clone();
        s.push_str(if self.info.fixed_buffers {
            " (fixed buffers)"
        } else {
            " (unregistered buffers)"
        });
        s.push_str(", O_DIRECT, ");
        s.push_str(&crate::fio::files::page_note(self.engine.region()));
        if self.buffer_sets > 1 {
            s.push_str(&format!(
                ", {} sets of rows per direction used in turn",
                self.buffer_sets
            ));
        }
        if let Some(why) = &self.info.fallback_reason {
            s.push_str(&format!(", fell back: {why}"));
        }
        s
    }

    /// Runs one pass of `profile` at `depth` rows in flight per direction. Every request must
    /// move all its bytes, otherwise the pass fails.
    pub fn run_pass(&mut self, profile: Profile, depth: u32) -> Result<PassStats> {
        if depth == 0 || depth > self.max_depth {
            return Err(Error::new(
                ErrorKind::Contract,
                format!("depth {depth} is outside 1..={}", self.max_depth),
            ));
        }
        self.passes += 1;
        let seed = self.passes;
        let depth = depth as usize;
        let mut streams = match profile {
            Profile::Store => vec![self.stream(IoDir::Write, None, 0)],
            Profile::Load => vec![self.stream(IoDir::Read, Some(seed), 0)],
            Profile::Mixed => vec![
                self.stream(IoDir::Write, None, 0),
                self.stream(IoDir::Read, Some(seed), depth * self.buffer_sets),
            ],
        };
        let start = Instant::now();
        let moved = self.drive(&mut streams, depth)?;
        Ok(PassStats {
            bytes: moved,
            seconds: start.elapsed().as_secs_f64(),
        })
    }

    fn stream(&self, dir: IoDir, shuffle_seed: Option<u64>, first_row: usize) -> Stream {
        let mut order: Vec<u64> = (0..self.slots).collect();
        if let Some(seed) = shuffle_seed {
            shuffle(&mut order, seed);
        }
        Stream {
            dir,
            order,
            next: 0,
            first_row,
        }
    }

    fn request(&self, stream: &mut Stream, s: usize, buffer: usize) -> Option<IoRequest> {
        let slot = *stream.order.get(stream.next)?;
        stream.next += 1;
        let row = stream.first_row + buffer;
        Some(IoRequest {
            dir: stream.dir,
            file: (slot % self.n_files) as usize,
            file_offset: slot / self.n_files * self.row as u64,
            region_offset: row * self.row,
            len: self.row,
            tag: ((s as u64) << 32) | buffer as u64,
        })
    }

    /// Keeps `depth` requests of each stream in flight until every stream is done.
    fn drive(&self, streams: &mut [Stream], depth: usize) -> Result<u64> {
        let mut batch = Vec::new();
        for (s, stream) in streams.iter_mut().enumerate() {
            for buffer in 0..depth {
                if let Some(req) = self.request(stream, s, buffer) {
                    batch.push(req);
                }
            }
        }
        let mut in_flight = batch.len();
        let mut moved = 0u64;
        let mut first_error: Option<Error> = None;
        self.engine.submit(&batch)?;
        while in_flight > 0 {
            batch.clear();
            let first = self
                .engine
                .completions()
                .recv_timeout(Duration::from_secs(120))
                .map_err(|e| {
                    Error::new(
                        ErrorKind::Closed,
                        format!("the I/O engine stopped completing requests mid-pass ({e})"),
                    )
                })?;
            let mut done = vec![first];
            done.extend(self.engine.completions().try_iter());
            for c in done {
                in_flight -= 1;
                match c.result {
                    Ok(n) if n == self.row => moved += n as u64,
                    Ok(n) => {
                        first_error.get_or_insert(Error::new(
                            ErrorKind::ShortIo,
                            format!("a {}-byte request completed with {n} bytes", self.row),
                        ));
                    }
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
                if first_error.is_some() {
                    continue; // stop feeding; let what is in flight finish
                }
                let s = (c.tag >> 32) as usize;
                // The next request of this stream takes the same place in the next set.
                let buffer = ((c.tag & 0xFFFF_FFFF) as usize + depth) % (depth * self.buffer_sets);
                if let Some(stream) = streams.get_mut(s)
                    && let Some(req) = self.request(stream, s, buffer)
                {
                    batch.push(req);
                }
            }
            if !batch.is_empty() {
                self.engine.submit(&batch)?;
                in_flight += batch.len();
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(moved),
        }
    }

    /// Stops the engine.
    pub fn close(self) -> Result<()> {
        self.engine.shutdown();
        Ok(())
    }
}

/// Fisher-Yates with the crate's xorshift64*: deterministic per seed.
pub fn shuffle(v: &mut [u64], seed: u64) {
    let mut rng = XorShift64::new(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    for i in (1..v.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        v.swap(i, j);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fio::files::prepare;

    #[test]
    fn shuffle_is_a_permutation() {
        let mut v: Vec<u64> = (0..1000).collect();
        shuffle(&mut v, 7);
        assert_ne!(v, (0..1000).collect::<Vec<_>>());
        let mut sorted = v.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
    }

    #[test]
    fn passes_move_every_row_on_two_files() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let files = vec![dir.path().join("a"), dir.path().join("b")];
        let row = 64 << 10;
        prepare(&files, 8 * row, row).unwrap();
        let mut w = match KvtierWorkload::open(&WorkloadShape {
            files,
            file_size: 8 * row,
            row_size: row,
            max_depth: 4,
            engine: IoEngineKind::Auto,
            region: crate::region_arg::BenchRegion::Own,
            buffer_sets: 1,
        }) {
            Ok(w) => w,
            Err(e) => {
                kvtier::skip_test!("cannot start an engine with O_DIRECT on /tmp: {e}");
                return;
            }
        };
        assert!(w.describe().contains("O_DIRECT"));
        for profile in [Profile::Store, Profile::Load, Profile::Mixed] {
            for depth in [1, 4] {
                let pass = w.run_pass(profile, depth).unwrap();
                let directions = if profile == Profile::Mixed { 2 } else { 1 };
                assert_eq!(pass.bytes, directions * 16 * row, "{profile:?} {depth}");
                assert!(pass.bytes_per_sec() > 0.0);
            }
        }
        assert_eq!(
            w.run_pass(Profile::Load, 5).unwrap_err().kind(),
            ErrorKind::Contract
        );
        w.close().unwrap();
    }

    #[test]
    fn with_buffer_sets_each_set_takes_its_turn() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let files = vec![dir.path().join("a")];
        let row = 64 << 10;
        let rows_in_file = 12u64;
        prepare(&files, rows_in_file * row, row).unwrap();
        let (depth, sets) = (2u32, 3u32);
        let mut w = match KvtierWorkload::open(&WorkloadShape {
            files,
            file_size: rows_in_file * row,
            row_size: row,
            max_depth: depth,
            engine: IoEngineKind::Auto,
            region: crate::region_arg::BenchRegion::Own,
            buffer_sets: sets,
        }) {
            Ok(w) => w,
            Err(e) => {
                kvtier::skip_test!("cannot start an engine with O_DIRECT on /tmp: {e}");
                return;
            }
        };
        let region = w.region();
        // Two directions of `sets` sets of `depth` rows.
        assert_eq!(region.num_rows(), (2 * depth * sets) as usize);
        assert!(w.describe().contains("3 sets of rows"), "{}", w.describe());
        let zero_row = |i: usize| region.read_row(i).unwrap().iter().all(|&b| b == 0);
        assert!((0..region.num_rows()).all(zero_row));
        // A load pass of 12 rows at depth 2 goes through every row of all three sets of
        // its direction (each holds file bytes afterwards) and leaves the other
        // direction's rows alone.
        let pass = w.run_pass(Profile::Load, depth).unwrap();
        assert_eq!(pass.bytes, rows_in_file * row);
        let load_rows = (depth * sets) as usize;
        for i in 0..load_rows {
            assert!(!zero_row(i), "row {i} of the load sets was never used");
        }
        for i in load_rows..region.num_rows() {
            assert!(zero_row(i), "row {i} belongs to the store direction");
        }
        for depth in [1, 2] {
            let pass = w.run_pass(Profile::Mixed, depth).unwrap();
            assert_eq!(pass.bytes, 2 * rows_in_file * row, "mixed at depth {depth}");
        }
        w.close().unwrap();
    }
}
