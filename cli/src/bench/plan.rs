//! The plan of `kvtier bench`: everything derived from the arguments before anything runs
//! (layout, row stride, chunk count, job size and window, tier capacity), with the argument
//! checks that need those figures.

use crate::bench::args::BenchArgs;
use crate::size::format_size;
use kvtier::canonical::{
    EncodingSource, LayoutDescriptor, NamespaceParams, PageEncoding, allocated_encoding,
};
use kvtier::embed::mem_available;
use kvtier::error::{Error, ErrorKind, Result};
use kvtier::geometry::ChunkGeometry;
use kvtier::size::count;

/// Everything derived from the arguments before anything runs.
#[derive(Debug)]
pub(crate) struct Plan {
    pub(crate) layout: LayoutDescriptor,
    pub(crate) params: NamespaceParams,
    /// The page encoding of the layer tensors kvtier allocates as vLLM's allocator does
    /// (`--gds` gathers from them), checked against the descriptor, and its source.
    pub(crate) encoding: (PageEncoding, EncodingSource),
    pub(crate) row_stride: u64,
    pub(crate) chunks: u64,
    pub(crate) chunks_per_job: usize,
    pub(crate) window_jobs: usize,
    pub(crate) capacity: u64,
    /// The tier's cap on bytes in flight ([`kvtier::config::in_flight`]).
    pub(crate) max_bytes_in_flight: u64,
}

impl Plan {
    pub(crate) fn from_args(args: &BenchArgs) -> Result<Self> {
        let layout = args.row.model.load()?;
        if args.row.blocks_per_chunk == 0 {
            return Err(Error::config("--blocks-per-chunk", "must be at least 1"));
        }
        let params =
            NamespaceParams::new(&layout, args.row.model.tp, args.row.blocks_per_chunk, true)
                .map_err(|e| flag_error("--tp", e))?;
        // A descriptor is a claim: the tensors vLLM allocates for this geometry say which
        // page encoding the bytes have, and a descriptor that says otherwise is refused.
        let encoding = allocated_encoding(&layout, args.row.model.tp)?;
        let row_stride = params.row_stride;
        if args.bytes == 0 {
            return Err(Error::config(
                "--bytes",
                format!(
                    "0 stores nothing; give at least one row ({})",
                    format_size(row_stride)
                ),
            ));
        }
        let chunks = ChunkGeometry::rows_in(args.bytes, row_stride).max(1);
        let n_paths = args.path.paths.len().max(1) as u64;
        let capacity = match args.capacity {
            Some(c) => {
                let slots = ChunkGeometry::total_slots(c, n_paths as usize, row_stride);
                if slots < chunks {
                    return Err(Error::config(
                        "--capacity",
                        format!(
                            "{} holds {} of {} over {}, but --bytes needs {chunks}; raise \
                             --capacity or lower --bytes",
                            format_size(c),
                            count(slots, "row"),
                            format_size(row_stride),
                            count(n_paths, "path")
                        ),
                    ));
                }
                c
            }
            None => chunks.div_ceil(n_paths) * n_paths * row_stride,
        };
        // The tier's rule (at least one row; max(64 MiB, one row) without the flag).
        let max_bytes_in_flight = args.in_flight.for_row(row_stride)?;
        check_memory(chunks * row_stride, mem_available())?;
        let rows_in_flight = ChunkGeometry::rows_in_flight(max_bytes_in_flight, row_stride);
        let rows_in_flight = usize::try_from(rows_in_flight).unwrap_or(usize::MAX);
        // A job is a batch of chunks (one request's chunks in one step); keep about twice the
        // tier's byte budget outstanding so the device never idles between polls.
        let chunks_per_job = (rows_in_flight / 4).clamp(1, 16);
        let window_jobs = (2 * rows_in_flight).div_ceil(chunks_per_job).max(2);
        Ok(Plan {
            layout,
            params,
            encoding,
            row_stride,
            chunks,
            chunks_per_job,
            window_jobs,
            capacity,
            max_bytes_in_flight,
        })
    }

    pub(crate) fn batches(&self) -> Vec<std::ops::Range<u64>> {
        let per = self.chunks_per_job as u64;
        (0..self.chunks.div_ceil(per))
            .map(|b| b * per..((b + 1) * per).min(self.chunks))
            .collect()
    }
}

/// The primary region holds every chunk of the run (like a primary sized to the working set):
/// refuse a `--bytes` that would take more than 3/4 of the available memory.
fn check_memory(region_bytes: u64, available: Option<u64>) -> Result<()> {
    match available {
        Some(avail) if region_bytes > avail / 4 * 3 => Err(Error::config(
            "--bytes",
            format!(
                "the bench keeps all {} of chunks in the primary region, but only {} of memory \
                 is available; lower --bytes",
                format_size(region_bytes),
                format_size(avail)
            ),
        )),
        _ => Ok(()),
    }
}

/// An error in a flag's value is the user's: it keeps its message and becomes a config error
/// naming the flag.
fn flag_error(flag: &str, e: Error) -> Error {
    if e.kind() == ErrorKind::Config {
        Error::config(flag, e.message().to_string())
    } else {
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::parse_for_test;

    fn plan(argv: &[&str]) -> Result<Plan> {
        Plan::from_args(&parse_for_test(argv))
    }

    #[test]
    fn default_is_llama_8b_with_2_mib_rows_and_2_gib() {
        let p = plan(&[]).unwrap();
        assert_eq!(p.row_stride, 2 << 20);
        assert_eq!(p.chunks, 1024);
        assert_eq!(p.capacity, 2 << 30);
        assert_eq!(p.chunks_per_job, 8);
        assert_eq!(p.window_jobs, 8);
        let b = p.batches();
        assert_eq!(b.len(), 128);
        assert_eq!(b[127], 1016..1024);
    }

    #[test]
    fn batches_cover_every_chunk_once() {
        let p = plan(&["--bytes", "21MiB", "--max-bytes-in-flight", "8MiB"]).unwrap();
        assert_eq!(p.chunks, 10);
        assert_eq!(p.chunks_per_job, 1);
        let covered: Vec<u64> = p.batches().into_iter().flatten().collect();
        assert_eq!(covered, (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn max_bytes_in_flight_follows_the_tier_rule() {
        // Not set: 64 MiB, or one row when a row is larger (64 blocks: 128 MiB rows).
        assert_eq!(plan(&[]).unwrap().max_bytes_in_flight, 64 << 20);
        let p = plan(&["--blocks-per-chunk", "64", "--bytes", "128MiB"]).unwrap();
        assert_eq!(p.max_bytes_in_flight, 128 << 20);
        assert_eq!(p.chunks_per_job, 1);
        // Below one row: the flag and the key it sets, the value, the row size.
        let e = plan(&["--max-bytes-in-flight", "1MiB"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        let s = e.to_string();
        assert!(
            s.contains("--max-bytes-in-flight (the nvme tier's max_bytes_in_flight)")
                && s.contains("1 MiB is less than one row (2 MiB)"),
            "{s}"
        );
    }

    #[test]
    fn user_mistakes_are_config_errors() {
        let e = plan(&["--capacity", "10MiB", "--bytes", "64MiB"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.to_string().contains("--capacity"), "{e}");
        assert_eq!(
            plan(&["--max-bytes-in-flight", "1MiB"]).unwrap_err().kind(),
            ErrorKind::Config
        );
        let e = plan(&["--bytes", "0"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.to_string().contains("--bytes"), "{e}");
        assert_eq!(
            plan(&["--blocks-per-chunk", "0"]).unwrap_err().kind(),
            ErrorKind::Config
        );
        let e = plan(&["--tp", "3"]).unwrap_err();
        assert!(crate::exit::is_user_error(&e), "{e:?}");
        assert!(e.to_string().contains("TP size 3"), "{e}");
        let e = check_memory(8 << 30, Some(8 << 30)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.to_string().contains("--bytes"), "{e}");
        assert!(check_memory(2 << 30, Some(8 << 30)).is_ok());
        assert!(check_memory(2 << 30, None).is_ok());
        let e = plan(&["--layout", "/nonexistent/layout.toml"]).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/layout.toml"), "{e}");
    }
}
