//! `kvtier service bench`: what the node service's DRAM staging pool and hints save, measured
//! through the service path an engine uses (`docs/node-service.md`).
//!
//! The command starts a node service in this process (slabs in `--dir`, a staging pool), and
//! three engine connections with regions of their own: A stores; B and C are client-mode
//! tiers ([`NodeTier`], what vLLM's `KvtierTier` runs) that play vLLM's scheduler: a request
//! arrives (`on_new_request`), its first lookup comes `--lead-ms` later (the time a request
//! waits in the queue), lookups are asked once per scheduler step (`--step-us`) until none
//! answers RETRY, then one load job is submitted and polled once per step until it is
//! reported. Each round stores fresh chunks and measures, in an order that alternates
//! between rounds:
//!
//! * `g3`: B's request without a hint, chunks only in G3 (RETRY round trip, G3 read);
//! * `hint`: B's request with kvtier's prefetch hint for its chunks (read into the pool while
//!   the request waits; its lookups HIT at once, the load is a copy from DRAM);
//! * `staged`: C's request without a hint for the chunks B's `g3` load staged (RETRY round
//!   trip, copy from DRAM).
//!
//! Reported per side: the median over rounds of the time from the first lookup to loaded,
//! of the load job alone (submit to reported) and its throughput, the steps that answered
//! RETRY, and the loads the pool served (the service's counters); and the stores' throughput.
//!
//! With `--concurrent-requests N` every side runs N requests at once, each on an engine (a
//! client-mode tier and region) of its own, in its own thread, started together: N hints
//! queue on the service's one prefetch thread, N unhinted loads on N sessions' job threads.
//! Medians are then over every request of every round, and the slowest request of each round
//! is reported as well (its median over rounds).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;

use crate::output::outln;
use crate::size::{format_gbps, format_size, parse_size};
use crate::stats::median;
use kvtier::config::ServiceConfig;
use kvtier::contract::hints::KvHintsEnvelope;
use kvtier::contract::job::{LookupResult, RequestContext, TransferJob};
use kvtier::contract::secondary::SecondaryTier;
use kvtier::error::{Error, ErrorKind, Result};
use kvtier::geometry::{ChunkGeometry, ROW_ALIGNMENT};
use kvtier::key::ChunkKey;
use kvtier::node::{ClientHello, NodeClient, NodeService, NodeTier, RegionSource};
use kvtier::region::PrimaryRegion;

/// Arguments of `kvtier service bench`.
#[derive(Debug, Args)]
#[command(after_help = "Example:
  kvtier service bench --dir /mnt/nvme0/kvtier-bench --row-size 2MiB --chunks 32 --rounds 7")]
pub struct BenchArgs {
    /// Folder for the slab files (on the drive to measure); a temporary folder under it is
    /// removed at the end.
    #[arg(long, value_name = "DIR", default_value = "/tmp")]
    pub dir: PathBuf,
    /// Bytes per chunk (row and slot; a multiple of 4096).
    #[arg(long, default_value = "2MiB", value_parser = parse_size, value_name = "SIZE")]
    pub row_size: u64,
    /// Chunks per request (each side loads this many per round).
    #[arg(long, default_value_t = 16, value_name = "N")]
    pub chunks: u32,
    /// Rounds (each stores fresh chunks and measures every side once; medians over rounds).
    #[arg(long, default_value_t = 7, value_name = "N")]
    pub rounds: u32,
    /// Time between a request's arrival (its hint) and its first lookup, in milliseconds.
    #[arg(long, default_value_t = 20, value_name = "MS")]
    pub lead_ms: u64,
    /// Scheduler step: how often lookups are asked again and jobs polled, in microseconds.
    #[arg(long, default_value_t = 1000, value_name = "US")]
    pub step_us: u64,
    /// Requests each side runs at once, each from an engine of its own (1 to 64).
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub concurrent_requests: u32,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

const DIGEST: [u8; 32] = [0xbe; 32];
const SIDES: [&str; 3] = ["g3", "hint", "staged"];

/// One side's measurement in one round.
#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    lookup_to_loaded_s: f64,
    load_job_s: f64,
    retry_steps: u32,
    pool_hits: u64,
}

/// Runs `kvtier service bench`.
pub fn run(args: BenchArgs) -> Result<ExitCode> {
    let b = Bench::start(&args)?;
    // Per side, per round: one sample per concurrent request.
    let mut samples: Vec<Vec<Vec<Sample>>> = vec![Vec::new(); SIDES.len()];
    let mut store_s = Vec::new();
    for round in 0..args.rounds {
        let (g3_keys, hint_keys, s) = b.store_round(round)?;
        store_s.push(s);
        // `staged` needs `g3` first (it loads what `g3` staged); `hint` goes first in odd
        // rounds and last in even ones.
        let order: &[usize] = if round % 2 == 1 {
            &[1, 0, 2]
        } else {
            &[0, 2, 1]
        };
        for &side in order {
            let keys = if side == 1 { &hint_keys } else { &g3_keys };
            let s = b.measure_concurrently(side, round, keys)?;
            samples[side].push(s);
        }
        let slowest = |side: usize| {
            samples[side].last().map_or(0.0, |r| {
                r.iter().map(|s| s.lookup_to_loaded_s).fold(0.0, f64::max) * 1e3
            })
        };
        eprintln!(
            "round {}/{}: g3 {:.2} ms, hint {:.2} ms, staged {:.2} ms (lookup to loaded{})",
            round + 1,
            args.rounds,
            slowest(0),
            slowest(1),
            slowest(2),
            if b.lanes > 1 { ", slowest request" } else { "" },
        );
    }
    b.report(&args, &samples, &store_s)?;
    b.shutdown()?;
    Ok(ExitCode::SUCCESS)
}

struct Bench {
    service: Option<NodeService>,
    _dir: tempfile::TempDir,
    a: NodeClient,
    a_region: PrimaryRegion,
    /// Per concurrent request: the engine of the `g3` and `hint` sides, and of `staged`.
    tiers: Vec<[parking_lot::Mutex<NodeTier>; 2]>,
    _regions: Vec<PrimaryRegion>,
    /// Requests per side at once (`--concurrent-requests`).
    lanes: usize,
    chunks: u32,
    row: u64,
    lead: Duration,
    step: Duration,
    next_job: std::sync::atomic::AtomicU64,
}

fn bench_error(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::Config, msg.into())
}

/// The arguments checked, and the bytes of one side's chunks of one round (the primary and
/// each DRAM set) and the tier's capacity (the sets of two rounds, twice), with room for them
/// in `--dir`.
fn sizes(args: &BenchArgs) -> Result<(u64, u64)> {
    if !ChunkGeometry::is_row_aligned(args.row_size) {
        return Err(bench_error(format!(
            "--row-size {}: expected a positive multiple of {ROW_ALIGNMENT}",
            args.row_size
        )));
    }
    if args.chunks == 0 || args.rounds == 0 {
        return Err(bench_error("--chunks and --rounds must be at least 1"));
    }
    if !(1..=64).contains(&args.concurrent_requests) {
        return Err(bench_error(format!(
            "--concurrent-requests {}: expected 1 to 64",
            args.concurrent_requests
        )));
    }
    let lanes = args.concurrent_requests as usize;
    let row = args.row_size;
    // The chunks of one side's requests of one round. G3 keeps two sets per round for
    // two rounds; the pool holds the sets of one round.
    let sizes = row
        .checked_mul(u64::from(args.chunks))
        .and_then(|b| b.checked_mul(lanes as u64))
        .and_then(|per_set| {
            let capacity = per_set.checked_mul(4)?;
            Some((per_set, capacity, capacity.checked_add(16 << 20)?))
        });
    let Some((per_set, capacity, need)) = sizes else {
        return Err(bench_error(format!(
            "--row-size {row} times --chunks {} times --concurrent-requests {lanes}: more \
             bytes than a machine holds",
            args.chunks
        )));
    };
    if let Some(free) = kvtier::g3::available_bytes(&args.dir)
        && free < need
    {
        return Err(Error::new(
            ErrorKind::NoSpace,
            format!(
                "{} has {} free; the benchmark's slabs need {} (lower --chunks or \
                 --row-size, or give another --dir)",
                args.dir.display(),
                format_size(free),
                format_size(need)
            ),
        ));
    }
    Ok((per_set, capacity))
}

/// Starts the node service in `dir` (its socket, and its slabs in `slabs/`) for rows of `row`
/// bytes, a primary of `per_set` bytes, twice that in DRAM and a tier of `capacity`, and
/// waits until its tier has opened.
fn start_service(dir: &Path, row: u64, per_set: u64, capacity: u64) -> Result<NodeService> {
    std::fs::create_dir(dir.join("slabs")).map_err(|e| Error::io("create", dir, e))?;
    let mut cfg = kvtier::config::from_value(serde_json::json!({
        "cpu_bytes_to_use": per_set,
        "secondary_tiers": [{
            "type": "nvme",
            "paths": [dir.join("slabs").display().to_string()],
            "capacity_bytes": capacity,
            "direct_io": "auto",
        }],
    }))?;
    let mut service = ServiceConfig::new(dir.join("kvtier.sock"));
    service.dram_bytes = 2 * per_set;
    cfg.service = Some(service);
    let svc = kvtier::node::start_from_config(&cfg, row, None, DIGEST)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !svc.is_ready() {
        if Instant::now() > deadline {
            return Err(Error::new(
                ErrorKind::Io,
                "the benchmark's G3 tier did not open within 60 s",
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(svc)
}

/// How an engine of rows of `row` bytes introduces itself.
fn hello(name: &str, row: u64) -> ClientHello {
    ClientHello {
        engine: name.into(),
        row_stride: row,
        digest: DIGEST,
    }
}

/// Engines B and C of every lane, each with its own region of `rows` rows of `row` bytes,
/// connected to the service on `socket` as node tiers; and their regions.
#[allow(clippy::type_complexity)]
fn connect_lanes(
    socket: &Path,
    lanes: usize,
    rows: usize,
    row: u64,
) -> Result<(Vec<[parking_lot::Mutex<NodeTier>; 2]>, Vec<PrimaryRegion>)> {
    let mut regions = Vec::new();
    let mut tiers = Vec::new();
    for lane in 0..lanes {
        let mut pair = Vec::new();
        for name in ["bench-b", "bench-c"] {
            let r = PrimaryRegion::create(rows, row)?;
            let fd = r
                .fd()
                .ok_or_else(|| Error::new(ErrorKind::Internal, "the region has no descriptor"))?;
            let name = if lanes == 1 {
                name.to_string()
            } else {
                format!("{name}-{lane}")
            };
            let t = NodeTier::connect(
                socket,
                &hello(&name, row),
                RegionSource::Fd(fd),
                rows as u64,
                None,
            )?;
            pair.push(parking_lot::Mutex::new(t));
            regions.push(r);
        }
        let [tb, tc]: [_; 2] = pair.try_into().map_err(|_| bench_error("two tiers"))?;
        tiers.push([tb, tc]);
    }
    Ok((tiers, regions))
}

impl Bench {
    fn start(args: &BenchArgs) -> Result<Bench> {
        let (per_set, capacity) = sizes(args)?;
        let lanes = args.concurrent_requests as usize;
        let row = args.row_size;
        let dir = tempfile::Builder::new()
            .prefix("kvtier-service-bench-")
            .tempdir_in(&args.dir)
            .map_err(|e| Error::io("create a folder in", &args.dir, e))?;
        let svc = start_service(dir.path(), row, per_set, capacity)?;
        let socket = dir.path().join("kvtier.sock");
        let rows = args.chunks as usize;
        let a_region = PrimaryRegion::create(rows, row)?;
        let a = NodeClient::connect(&socket, &hello("bench-a", row))?;
        let fd = a_region
            .fd()
            .ok_or_else(|| Error::new(ErrorKind::Internal, "the region has no descriptor"))?;
        a.register_fd(fd, rows as u64)?;
        let (tiers, regions) = connect_lanes(&socket, lanes, rows, row)?;
        Ok(Bench {
            service: Some(svc),
            _dir: dir,
            a,
            a_region,
            tiers,
            _regions: regions,
            lanes,
            chunks: args.chunks,
            row,
            lead: Duration::from_millis(args.lead_ms),
            step: Duration::from_micros(args.step_us.max(1)),
            next_job: std::sync::atomic::AtomicU64::new(1),
        })
    }

    fn job_id(&self) -> u64 {
        self.next_job
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// Stores fresh chunks for each request of the two sides that read G3; returns them
    /// (per request) and the seconds the stores took.
    #[allow(clippy::type_complexity)]
    fn store_round(&self, round: u32) -> Result<(Vec<Vec<ChunkKey>>, Vec<Vec<ChunkKey>>, f64)> {
        let keys = |tag: &str| -> Vec<Vec<ChunkKey>> {
            (0..self.lanes)
                .map(|lane| {
                    (0..self.chunks)
                        .map(|i| {
                            ChunkKey::new(format!("bench-{round}-{tag}-{lane}-{i}").as_bytes())
                        })
                        .collect()
                })
                .collect()
        };
        let (g3, hint) = (keys("g3"), keys("hint"));
        let rows: Vec<u32> = (0..self.chunks).collect();
        let started = Instant::now();
        for set in g3.iter().chain(&hint) {
            // The region is this command's own and no job uses it now. Rows are whole 4 KiB
            // pages, so the pages are filled in the region's order.
            let mut x = u64::from(round) * 7919 + set.len() as u64 + 1;
            for r in 0..self.a_region.num_rows() {
                let mut row = self.a_region.write_row(r)?;
                for b in row.chunks_mut(4096) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    b[..8].copy_from_slice(&x.to_le_bytes());
                }
            }
            let id = self.job_id();
            self.a.submit_store(id, set.clone(), rows.clone());
            let r = self
                .a
                .wait_finished(Duration::from_secs(600))
                .ok_or_else(|| Error::new(ErrorKind::Io, "a store was not reported"))?;
            if !r.success {
                return Err(r.error.unwrap_or_else(|| {
                    Error::new(ErrorKind::Io, "a store of the benchmark failed")
                }));
            }
        }
        Ok((g3, hint, started.elapsed().as_secs_f64()))
    }

    fn pool_hits(&self) -> u64 {
        let doc: serde_json::Value = self
            .service
            .as_ref()
            .map(|s| serde_json::from_str(&s.status_json()).unwrap_or_default())
            .unwrap_or_default();
        doc["staging"]["hits"].as_u64().unwrap_or(0)
    }

    /// The requests of `side` (one per lane, over `keys[lane]`) at once, each in a thread of
    /// its own, started together; their pool hits are the service's count over all of them,
    /// shared out evenly.
    fn measure_concurrently(
        &self,
        side: usize,
        round: u32,
        keys: &[Vec<ChunkKey>],
    ) -> Result<Vec<Sample>> {
        let hits_before = self.pool_hits();
        let start = std::sync::Barrier::new(self.lanes);
        let results: Vec<Result<Sample>> = std::thread::scope(|scope| {
            let threads: Vec<_> = keys
                .iter()
                .enumerate()
                .map(|(lane, keys)| {
                    let start = &start;
                    scope.spawn(move || {
                        let mut tier = self.tiers[lane][usize::from(side == 2)].lock();
                        start.wait();
                        self.measure(&mut tier, side, round, lane, keys)
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| {
                    t.join().unwrap_or_else(|_| {
                        Err(Error::new(ErrorKind::Internal, "a request thread panicked"))
                    })
                })
                .collect()
        });
        let mut samples = results.into_iter().collect::<Result<Vec<Sample>>>()?;
        let hits = self.pool_hits() - hits_before;
        for s in &mut samples {
            s.pool_hits = hits / self.lanes as u64;
        }
        Ok(samples)
    }

    /// One request of `side` over `keys`, as vLLM's scheduler would run it.
    fn measure(
        &self,
        tier: &mut NodeTier,
        side: usize,
        round: u32,
        lane: usize,
        keys: &[ChunkKey],
    ) -> Result<Sample> {
        let mut req = RequestContext::new(format!("bench-{round}-{}-{lane}", SIDES[side]));
        if side == 1 {
            let hex: Vec<String> = keys.iter().map(|k| hex::encode(k.as_bytes())).collect();
            let envelope = serde_json::json!({
                "protocol_version": "1", "message_id": req.req_id.as_ref(),
                "actions": [{"action_id": "bench", "action_type": kvtier::node::PREFETCH_ACTION,
                             "action_version": kvtier::node::PREFETCH_VERSION,
                             "payload": {"keys": hex}}],
            });
            req = req.with_kv_hints(KvHintsEnvelope::from_json(&envelope.to_string())?);
        }
        tier.on_new_request(&req);
        std::thread::sleep(self.lead);
        let started = Instant::now();
        let mut retry_steps = 0;
        let deadline = started + Duration::from_secs(120);
        loop {
            let verdicts: Vec<LookupResult> = keys.iter().map(|k| tier.lookup(k, &req)).collect();
            if verdicts.iter().all(|v| *v == LookupResult::Hit) {
                break;
            }
            if let Some(v) = verdicts
                .iter()
                .find(|v| !matches!(v, LookupResult::Retry | LookupResult::Hit))
            {
                return Err(Error::new(
                    ErrorKind::Internal,
                    format!("a stored chunk looked up as {v:?}"),
                ));
            }
            retry_steps += 1;
            if Instant::now() > deadline {
                return Err(Error::new(ErrorKind::Io, "lookups still RETRY after 120 s"));
            }
            std::thread::sleep(self.step);
        }
        let job_id = self.job_id();
        let submitted = Instant::now();
        tier.submit_load(TransferJob {
            job_id,
            keys: keys.to_vec(),
            chunk_ids: (0..self.chunks).collect(),
            is_promotion: true,
            req_id: req.req_id.clone(),
            submit_time: submitted,
        });
        let done = loop {
            if let Some(r) = tier.get_finished_jobs().into_iter().next() {
                break r;
            }
            if Instant::now() > deadline {
                return Err(Error::new(
                    ErrorKind::Io,
                    "a load was not reported in 120 s",
                ));
            }
            std::thread::sleep(self.step);
        };
        let loaded = Instant::now();
        tier.on_request_finished(&req);
        if !done.success {
            return Err(done
                .error
                .unwrap_or_else(|| Error::new(ErrorKind::Io, "a load of the benchmark failed")));
        }
        Ok(Sample {
            lookup_to_loaded_s: (loaded - started).as_secs_f64(),
            load_job_s: (loaded - submitted).as_secs_f64(),
            retry_steps,
            pool_hits: 0,
        })
    }

    fn report(
        &self,
        args: &BenchArgs,
        samples: &[Vec<Vec<Sample>>],
        store_s: &[f64],
    ) -> Result<()> {
        let bytes = self.row * u64::from(self.chunks);
        // Over every request of every round.
        let med = |side: usize, f: fn(&Sample) -> f64| {
            median(&samples[side].iter().flatten().map(f).collect::<Vec<_>>()).unwrap_or(f64::NAN)
        };
        // Over rounds, of each round's slowest request.
        let slowest = |side: usize| {
            let per_round: Vec<f64> = samples[side]
                .iter()
                .map(|r| r.iter().map(|s| s.lookup_to_loaded_s).fold(0.0, f64::max))
                .collect();
            median(&per_round).unwrap_or(f64::NAN)
        };
        let sides: Vec<serde_json::Value> = SIDES
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let job = med(i, |s| s.load_job_s);
                serde_json::json!({
                    "side": name,
                    "lookup_to_loaded_ms_median": med(i, |s| s.lookup_to_loaded_s) * 1e3,
                    "load_job_ms_median": job * 1e3,
                    "load_gbps_median": bytes as f64 / job / 1e9,
                    "retry_steps_median": med(i, |s| f64::from(s.retry_steps)),
                    "pool_hits_per_round_median": med(i, |s| s.pool_hits as f64),
                    "slowest_lookup_to_loaded_ms_median": slowest(i) * 1e3,
                    "lookup_to_loaded_ms": samples[i].iter().flatten().map(|s| s.lookup_to_loaded_s * 1e3).collect::<Vec<_>>(),
                })
            })
            .collect();
        let store = median(store_s).unwrap_or(f64::NAN);
        let doc = serde_json::json!({
            "row_bytes": self.row,
            "chunks": self.chunks,
            "rounds": args.rounds,
            "lead_ms": args.lead_ms,
            "step_us": args.step_us,
            "concurrent_requests": self.lanes,
            "dir": args.dir.display().to_string(),
            "store_gbps_median": (2 * bytes * self.lanes as u64) as f64 / store / 1e9,
            "sides": sides,
        });
        if args.json {
            outln!("{doc}")?;
            return Ok(());
        }
        outln!(
            "kvtier service bench: {} chunks of {} per request, {} request(s) at once, {} rounds \
             (medians), lead {} ms, step {} us, slabs in {}",
            self.chunks,
            format_size(self.row),
            self.lanes,
            args.rounds,
            args.lead_ms,
            args.step_us,
            args.dir.display()
        )?;
        outln!(
            "{:<8} {:>22} {:>14} {:>12} {:>12} {:>10} {:>14}",
            "side",
            "lookup->loaded (ms)",
            "load job (ms)",
            "load",
            "RETRY steps",
            "pool hits",
            "slowest (ms)"
        )?;
        for (i, name) in SIDES.iter().enumerate() {
            let job = med(i, |s| s.load_job_s);
            outln!(
                "{:<8} {:>22.2} {:>14.2} {:>12} {:>12} {:>10} {:>14.2}",
                name,
                med(i, |s| s.lookup_to_loaded_s) * 1e3,
                job * 1e3,
                format_gbps(bytes as f64 / job),
                med(i, |s| f64::from(s.retry_steps)),
                med(i, |s| s.pool_hits as f64),
                slowest(i) * 1e3
            )?;
        }
        outln!(
            "stores (service path, primary -> G3): {}",
            format_gbps((2 * bytes * self.lanes as u64) as f64 / store)
        )?;
        Ok(())
    }

    fn shutdown(mut self) -> Result<()> {
        for t in self.tiers.iter().flatten() {
            t.lock().shutdown()?;
        }
        match self.service.take() {
            Some(s) => s.shutdown(),
            None => Ok(()),
        }
    }
}
