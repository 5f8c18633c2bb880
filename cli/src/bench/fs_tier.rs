//! `kvtier bench --tier fs --path DIR`: the fs tier measured in rounds beside vLLM's fs tier
//! approach (and, with `--fio`, fio's one-file-per-chunk profiles), on the same directory,
//! rows and jobs.
//!
//! Each round runs every side once on fresh sub-directories of `DIR` (so stores create new
//! files, as a cache fill does), the side that goes first alternating between rounds:
//!
//! * **kvtier**: the bench's phases through the tiering manager and an fs tier (fill, store,
//!   empty the primary, look up and load, verify every byte);
//! * **vLLM's approach** ([`super::vllm_fs`]): 16 threads, one task per job, `write` / `readv`
//!   per file, every byte verified too;
//! * **fio** (`fio-profiles/fs-store.fio`, `fs-load.fio`): 16 threads, one file per chunk,
//!   O_DIRECT, no rename or checksum: the raw ceiling.
//!
//! The report gives each side's median store and load GB/s and files/s; `--json` adds every
//! round. Throughput on a shared machine is noisy: compare sides within one run only.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use serde::Serialize;

use crate::bench::args::BenchArgs;
use crate::bench::data::chunk_key;
use crate::bench::phases::{fill, load_phase, store_phase, verify};
use crate::bench::plan::Plan;
use crate::bench::tier::{BenchTier, TierOptions};
use crate::bench::vllm_fs::{VLLM_THREADS, VllmFsMirror};
use crate::fio::runner::{fio_version, run_job_file};
use crate::output::{Table, errln, out, print_json};
use crate::size::format_size;
use crate::stats::median;
use kvtier::canonical::VllmDigestFields;
use kvtier::embed::PoolOpener;
use kvtier::error::{Error, Result};
use kvtier::fs::FileMapper;
use kvtier::key::ChunkKey;
use kvtier::region::PrimaryRegion;

/// Rounds when `--rounds` is not given.
pub const DEFAULT_ROUNDS: u32 = 3;

/// One side's figures in one round.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct SideRound {
    /// Store throughput, bytes/s.
    pub store_bytes_per_sec: f64,
    /// Store files per second.
    pub store_files_per_sec: f64,
    /// Load throughput, bytes/s.
    pub load_bytes_per_sec: f64,
    /// Load files per second.
    pub load_files_per_sec: f64,
    /// Process CPU seconds per GB stored (0 for fio, which runs in its own process).
    pub store_cpu_seconds_per_gb: f64,
    /// Process CPU seconds per GB loaded.
    pub load_cpu_seconds_per_gb: f64,
    /// Chunks whose loaded bytes matched (0 for fio, which checks nothing).
    pub chunks_verified: u64,
}

/// One side over all rounds.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SideReport {
    /// `kvtier`, `vllm`, `fio`.
    pub side: &'static str,
    /// What runs on this side.
    pub description: String,
    /// Medians over the rounds.
    pub median: SideRound,
    /// Every round, in order.
    pub rounds: Vec<SideRound>,
}

/// `kvtier bench --tier fs --json`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FsBenchReport {
    /// The directory the sides ran in.
    pub path: std::path::PathBuf,
    /// Filesystem type there.
    pub fs_type: String,
    /// Model name.
    pub model: String,
    /// Bytes per chunk file.
    pub row_stride: u64,
    /// Chunks per round and side.
    pub chunks: u64,
    /// Chunks per job (one request's batch; vLLM runs one job per task).
    pub chunks_per_job: usize,
    /// kvtier's `max_bytes_in_flight`.
    pub max_bytes_in_flight: u64,
    /// kvtier's I/O engine and whether the files use O_DIRECT.
    pub kvtier_engine: String,
    /// `direct (O_DIRECT)` or `buffered`.
    pub direct_io: String,
    /// The sides.
    pub sides: Vec<SideReport>,
    /// True iff every chunk of every round of kvtier and vLLM's approach came back intact.
    pub ok: bool,
}

/// Runs the fs bench (see the module docs).
pub fn run(args: &BenchArgs) -> Result<ExitCode> {
    let plan = Plan::from_args(args)?;
    let dirs = args.path.dirs()?;
    if dirs.len() != 1 {
        return Err(Error::config(
            "--path",
            "--tier fs takes one directory (the shared one the chunk files go to)",
        ));
    }
    let parent = &dirs[0];
    let rounds = args.rounds.unwrap_or(DEFAULT_ROUNDS);
    if rounds == 0 {
        return Err(Error::config("--rounds", "must be at least 1"));
    }
    if args.fio {
        fio_version()?;
    }
    let fields = VllmDigestFields::from_descriptor(&plan.layout, &plan.params).to_json();
    let namespace = PoolOpener::InProcess.namespace(&plan.layout, &plan.params)?;
    let probe = kvtier::io::probe_direct_io(parent)?;
    let progress = !args.json;
    let mut sides: Vec<SideReport> = vec![
        side(
            "kvtier",
            "kvtier fs tier (CRC xattr, publish without replace, byte cap)",
        ),
        side(
            "vllm",
            &format!("vLLM fs approach ({VLLM_THREADS} threads, write/readv per file)"),
        ),
    ];
    if args.fio {
        sides.push(side(
            "fio",
            &format!("fio one file per chunk ({VLLM_THREADS} jobs, psync)"),
        ));
    }
    let mut engine = String::new();
    let mut direct_io = String::new();
    for round in 0..rounds {
        let seed = crate::bench::data::run_seed() ^ u64::from(round);
        let keys: Vec<ChunkKey> = (0..plan.chunks).map(|i| chunk_key(seed, i)).collect();
        let mut order: Vec<usize> = (0..sides.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for s in order {
            crate::interrupt::check("the fs bench")?;
            let r = match sides[s].side {
                "kvtier" => {
                    let (r, e, d) = kvtier_round(args, &plan, &fields, namespace, &keys, seed)?;
                    (engine, direct_io) = (e, d);
                    r
                }
                "vllm" => vllm_round(parent, &plan, &fields, &keys, seed, probe.o_direct)?,
                _ => fio_round(parent, &plan)?,
            };
            if progress {
                errln!(
                    "round {}/{rounds} {}: store {:.2} GB/s, load {:.2} GB/s",
                    round + 1,
                    sides[s].side,
                    r.store_bytes_per_sec / 1e9,
                    r.load_bytes_per_sec / 1e9
                );
            }
            sides[s].rounds.push(r);
        }
    }
    for s in &mut sides {
        s.median = medians(&s.rounds);
    }
    let expected = plan.chunks * u64::from(rounds);
    let ok = sides
        .iter()
        .filter(|s| s.side != "fio")
        .all(|s| s.rounds.iter().map(|r| r.chunks_verified).sum::<u64>() == expected);
    let report = FsBenchReport {
        path: parent.clone(),
        fs_type: probe.fs_type.to_string(),
        model: plan.layout.model_name.clone(),
        row_stride: plan.row_stride,
        chunks: plan.chunks,
        chunks_per_job: plan.chunks_per_job,
        max_bytes_in_flight: plan.max_bytes_in_flight,
        kvtier_engine: engine,
        direct_io,
        sides,
        ok,
    };
    if args.json {
        print_json(&report)?;
    } else {
        out!("{}", render(&report, rounds))?;
    }
    if ok {
        Ok(ExitCode::SUCCESS)
    } else {
        errln!("kvtier: error: chunks did not load back intact (see chunks_verified)");
        Ok(ExitCode::from(1))
    }
}

fn side(name: &'static str, description: &str) -> SideReport {
    SideReport {
        side: name,
        description: description.to_string(),
        median: SideRound::default(),
        rounds: Vec::new(),
    }
}

fn medians(rounds: &[SideRound]) -> SideRound {
    let m =
        |f: fn(&SideRound) -> f64| median(&rounds.iter().map(f).collect::<Vec<_>>()).unwrap_or(0.0);
    SideRound {
        store_bytes_per_sec: m(|r| r.store_bytes_per_sec),
        store_files_per_sec: m(|r| r.store_files_per_sec),
        load_bytes_per_sec: m(|r| r.load_bytes_per_sec),
        load_files_per_sec: m(|r| r.load_files_per_sec),
        store_cpu_seconds_per_gb: m(|r| r.store_cpu_seconds_per_gb),
        load_cpu_seconds_per_gb: m(|r| r.load_cpu_seconds_per_gb),
        chunks_verified: rounds.iter().map(|r| r.chunks_verified).min().unwrap_or(0),
    }
}

/// Throughput figures of `chunks` rows of `stride` bytes in `seconds`.
fn rates(chunks: u64, stride: u64, seconds: f64) -> (f64, f64) {
    let s = seconds.max(1e-9);
    ((chunks * stride) as f64 / s, chunks as f64 / s)
}

/// kvtier's side, and its engine and direct-I/O mode.
fn kvtier_round(
    args: &BenchArgs,
    plan: &Plan,
    fields: &serde_json::Value,
    namespace: [u8; 32],
    keys: &[ChunkKey],
    seed: u64,
) -> Result<(SideRound, String, String)> {
    let mut tier = BenchTier::open(&TierOptions {
        fs_fields: Some(fields.clone()),
        ..TierOptions::of(args, plan, namespace)
    })?;
    let batches = plan.batches();
    let progress = !args.json;
    fill(&mut tier.manager, keys, &batches, seed, progress)?;
    let store = store_phase(&mut tier.manager, plan, keys, &batches, progress)?;
    tier.manager.reset_cache()?;
    tier.manager.on_reset_flushed();
    let load = load_phase(&mut tier.manager, plan, keys, &batches, progress)?;
    let (verified, _, _) = verify(&mut tier.manager, keys, seed, None, progress)?;
    let facts = tier.facts();
    tier.close()?;
    let (sb, sf) = rates(plan.chunks, plan.row_stride, store.seconds);
    let (lb, lf) = rates(plan.chunks, plan.row_stride, load.seconds);
    let round = SideRound {
        store_bytes_per_sec: sb,
        store_files_per_sec: sf,
        load_bytes_per_sec: lb,
        load_files_per_sec: lf,
        store_cpu_seconds_per_gb: store.cpu_seconds_per_gb,
        load_cpu_seconds_per_gb: load.cpu_seconds_per_gb,
        chunks_verified: verified,
    };
    Ok((round, facts.io_engine, facts.direct_io))
}

fn fresh_dir(parent: &Path, prefix: &str) -> Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(parent)
        .map_err(|e| Error::io("create a bench directory in", parent, e))
}

fn vllm_round(
    parent: &Path,
    plan: &Plan,
    fields: &serde_json::Value,
    keys: &[ChunkKey],
    seed: u64,
    direct: bool,
) -> Result<SideRound> {
    let dir = fresh_dir(parent, "kvtier-bench-vllm-")?;
    let rows = usize::try_from(plan.chunks)
        .map_err(|_| Error::config("--bytes", "too many rows for this platform"))?;
    let region = Arc::new(PrimaryRegion::create(rows, plan.row_stride)?);
    let mirror = VllmFsMirror {
        mapper: FileMapper::new(dir.path(), fields.clone())?,
        region: &region,
        direct,
    };
    let batches = plan.batches();
    mirror.fill(rows, seed)?;
    let store = mirror.store(keys, &batches)?;
    mirror.clear(rows)?;
    let load = mirror.load(keys, &batches)?;
    let verified = mirror.verified(rows, seed)?;
    let gb = (plan.chunks * plan.row_stride) as f64 / 1e9;
    let (sb, sf) = rates(plan.chunks, plan.row_stride, store.seconds);
    let (lb, lf) = rates(plan.chunks, plan.row_stride, load.seconds);
    Ok(SideRound {
        store_bytes_per_sec: sb,
        store_files_per_sec: sf,
        load_bytes_per_sec: lb,
        load_files_per_sec: lf,
        store_cpu_seconds_per_gb: store.cpu_seconds / gb,
        load_cpu_seconds_per_gb: load.cpu_seconds / gb,
        chunks_verified: verified,
    })
}

fn fio_round(parent: &Path, plan: &Plan) -> Result<SideRound> {
    let dir = fresh_dir(parent, "kvtier-bench-fio-")?;
    let scratch = tempfile::tempdir().map_err(|e| Error::io("create", Path::new("/tmp"), e))?;
    let per_job = plan.chunks.div_ceil(VLLM_THREADS as u64).max(1);
    let env = [
        ("KVTIER_FIO_DIR", dir.path().display().to_string()),
        ("KVTIER_FIO_BS", plan.row_stride.to_string()),
        ("KVTIER_FIO_FILES_PER_JOB", per_job.to_string()),
        ("KVTIER_FIO_JOBS", VLLM_THREADS.to_string()),
    ];
    let store = run_job_file(
        "fs-store",
        include_str!("../../../fio-profiles/fs-store.fio"),
        &env,
        scratch.path(),
    )?;
    let load = run_job_file(
        "fs-load",
        include_str!("../../../fio-profiles/fs-load.fio"),
        &env,
        scratch.path(),
    )?;
    // fio's group bandwidth and IOPS (one I/O per file: every file is one row).
    let (sb, sf) = (store.write.bytes_per_sec, store.write.iops);
    let (lb, lf) = (load.read.bytes_per_sec, load.read.iops);
    Ok(SideRound {
        store_bytes_per_sec: sb,
        store_files_per_sec: sf,
        load_bytes_per_sec: lb,
        load_files_per_sec: lf,
        store_cpu_seconds_per_gb: 0.0,
        load_cpu_seconds_per_gb: 0.0,
        chunks_verified: 0,
    })
}

/// The human report.
pub fn render(r: &FsBenchReport, rounds: u32) -> String {
    let mut out = format!(
        "kvtier bench --tier fs: {} chunk files of {} ({}) per side and round, {} rounds\n\
         path: {} ({}), {}, kvtier engine {}, {} in flight, {} chunks per job\n\n",
        r.chunks,
        format_size(r.row_stride),
        r.model,
        rounds,
        r.path.display(),
        r.fs_type,
        r.direct_io,
        r.kvtier_engine,
        format_size(r.max_bytes_in_flight),
        r.chunks_per_job
    );
    let mut t = Table::new([
        "side (medians)",
        "store GB/s",
        "store files/s",
        "load GB/s",
        "load files/s",
        "CPU s/GB st/ld",
        "verified",
    ]);
    for s in &r.sides {
        let m = &s.median;
        let cpu = if s.side == "fio" {
            "-".to_string()
        } else {
            format!(
                "{:.3} / {:.3}",
                m.store_cpu_seconds_per_gb, m.load_cpu_seconds_per_gb
            )
        };
        let verified = if s.side == "fio" {
            "-".to_string()
        } else {
            format!(
                "{} / {}",
                s.rounds.iter().map(|x| x.chunks_verified).sum::<u64>(),
                r.chunks * s.rounds.len() as u64
            )
        };
        t.row([
            s.description.clone(),
            format!("{:.3}", m.store_bytes_per_sec / 1e9),
            format!("{:.0}", m.store_files_per_sec),
            format!("{:.3}", m.load_bytes_per_sec / 1e9),
            format!("{:.0}", m.load_files_per_sec),
            cpu,
            verified,
        ]);
    }
    out.push_str(&t.render());
    out.push_str(
        "\nEach round runs every side once on fresh directories (the first side alternates); \
         throughput on a shared machine is noisy, compare within one run.\n",
    );
    out
}
