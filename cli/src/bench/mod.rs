//! `kvtier bench`: the whole stack end to end on a temporary (or given) G3 tier.
//!
//! 1. Fill: reserve primary rows through the manager (`prepare_store`) and write each chunk's
//!    deterministic bytes into its row (what the GPU -> primary copy does in vLLM).
//! 2. Store: `complete_store` per job-sized batch; the manager cascades every batch to the G3
//!    tier as one store job. A window of outstanding jobs keeps the tier's byte budget busy.
//! 3. Evict: `reset_cache` drains the tier and empties the primary (G3 keeps its data).
//! 4. Load: `lookup` finds each chunk in G3 and starts a promotion; `on_schedule_end` submits
//!    one load job per request (batch).
//! 5. Verify: pin every row (`prepare_load`) and compare it byte for byte with what was stored.
//!
//! * [`args`]: the arguments. [`plan`]: what they mean (rows, jobs, capacity), checked before anything runs.
//! * [`tier`]: the stack the bench runs on (primary, one G3 tier, the manager).
//! * [`phases`]: fill, store, load, verify. [`data`]: each chunk's deterministic bytes.
//! * [`report`]: the `--json` schema and the human table.
//! * [`fs_tier`]: `--tier fs`: the same phases on an fs tier, in rounds beside
//!   [`vllm_fs`] (vLLM's fs tier approach, mirrored) and optionally fio.

pub mod args;
pub mod data;
pub mod fs_tier;
pub mod gds;
pub mod phases;
pub mod plan;
pub mod report;
pub mod tier;
pub mod vllm_fs;

use std::process::ExitCode;

pub use crate::bench::args::{BenchArgs, BenchTierKind};
use crate::bench::data::{chunk_key, run_seed};
use crate::bench::phases::{
    corrupt_chunk_for_test, corrupt_loaded_chunk, fill, load_phase, store_phase, verify,
};
use crate::bench::plan::Plan;
use crate::bench::report::{
    BenchReport, LayoutReport, PhaseReport, RegionRound, RegionSummary, TierReport, render,
};
use crate::bench::tier::{BenchTier, TierFacts, TierOptions};
use crate::output::{display_paths, errln, out, print_json};
use crate::region_arg::BenchRegion;
use crate::size::format_size;
use kvtier::embed::PoolOpener;
use kvtier::error::Result;
use kvtier::key::ChunkKey;

/// Runs `kvtier bench`. Ctrl-C or SIGTERM stops it between batches, removes the tier's
/// directories (even with `--keep`) and exits 130.
pub fn run(args: BenchArgs) -> Result<ExitCode> {
    crate::interrupt::run_interruptible(|| run_caught(args))
}

fn run_caught(args: BenchArgs) -> Result<ExitCode> {
    if args.gds {
        return gds::run(&args);
    }
    if args.tier == BenchTierKind::Fs {
        return fs_tier::run(&args);
    }
    if args.fio {
        return Err(kvtier::error::Error::config(
            "--fio",
            "applies to --tier fs only (the nvme tier is compared with fio by `kvtier fio-compare`)",
        ));
    }
    let (regions, rounds) = regions_and_rounds(&args)?;
    let plan = Plan::from_args(&args)?;
    let namespace = PoolOpener::InProcess.namespace(&plan.layout, &plan.params)?;
    let rounds_run = run_rounds(&args, &plan, namespace, &regions, rounds)?;
    let (report, expected, totals) =
        bench_report(&args, &plan, namespace, &regions, rounds, rounds_run);
    if args.json {
        print_json(&report)?;
    } else {
        out!("{}", render(&report))?;
    }
    if report.ok {
        Ok(ExitCode::SUCCESS)
    } else {
        errln!(
            "kvtier: error: {} of {} chunks did not load back intact ({} mismatched, {} missing)",
            expected - totals.0,
            expected,
            totals.1,
            totals.2
        );
        Ok(ExitCode::from(1))
    }
}

/// The regions to run (`--region`, default own, in the order given) and the rounds; `--keep`
/// keeps the tier of a single run only.
fn regions_and_rounds(args: &BenchArgs) -> Result<(Vec<BenchRegion>, u32)> {
    let mut regions = args.regions.clone();
    if regions.is_empty() {
        regions.push(BenchRegion::Own);
    }
    regions.dedup();
    let rounds = args.rounds.unwrap_or(1);
    if rounds == 0 {
        return Err(kvtier::error::Error::config(
            "--rounds",
            "must be at least 1",
        ));
    }
    if args.keep && (rounds > 1 || regions.len() > 1) {
        return Err(kvtier::error::Error::config(
            "--keep",
            "keeps the tier of a single run: give one --region and one round",
        ));
    }
    Ok((regions, rounds))
}

/// What the rounds measured: each region's rounds, the first region's first run (with its
/// tier's facts) and the chunks verified, mismatched and missing over every run.
struct Rounds {
    summaries: Vec<RegionSummary>,
    first: (Run, TierFacts),
    totals: (u64, u64, u64),
}

/// Runs every region `rounds` times on a fresh stack each, the order alternating by round.
fn run_rounds(
    args: &BenchArgs,
    plan: &Plan,
    namespace: [u8; 32],
    regions: &[BenchRegion],
    rounds: u32,
) -> Result<Rounds> {
    let progress = !args.json;
    let mut summaries: Vec<RegionSummary> = regions
        .iter()
        .map(|r| RegionSummary::new(r.name()))
        .collect();
    let mut first: Option<(Run, TierFacts)> = None;
    let mut totals = (0u64, 0u64, 0u64);
    for round in 0..rounds {
        let mut order: Vec<usize> = (0..regions.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            let (run, facts) = run_once(args, plan, namespace, regions[i], progress)?;
            if progress && (rounds > 1 || regions.len() > 1) {
                errln!(
                    "round {}/{rounds} region {}: store {:.2} GB/s, load {:.2} GB/s",
                    round + 1,
                    regions[i].name(),
                    run.store.gb_per_s,
                    run.load.gb_per_s
                );
            }
            totals.0 += run.verified;
            totals.1 += run.mismatched;
            totals.2 += run.missing;
            summaries[i].pages = facts.pages.clone();
            summaries[i].rounds.push(RegionRound {
                store: run.store.clone(),
                load: run.load.clone(),
            });
            if i == 0 && first.is_none() {
                first = Some((run, facts));
            }
        }
    }
    for s in &mut summaries {
        s.compute_medians();
    }
    let Some(first) = first else {
        return Err(kvtier::error::Error::new(
            kvtier::error::ErrorKind::Internal,
            "the bench ran nothing",
        ));
    };
    Ok(Rounds {
        summaries,
        first,
        totals,
    })
}

/// The report of the rounds, with the chunks expected to load back intact and the totals.
fn bench_report(
    args: &BenchArgs,
    plan: &Plan,
    namespace: [u8; 32],
    regions: &[BenchRegion],
    rounds: u32,
    r: Rounds,
) -> (BenchReport, u64, (u64, u64, u64)) {
    let Rounds {
        summaries,
        first: (run, facts),
        totals,
    } = r;
    let expected = plan.chunks * u64::from(rounds) * regions.len() as u64;
    let report = BenchReport {
        layout: LayoutReport {
            model: plan.layout.model_name.clone(),
            tp: args.row.model.tp,
            blocks_per_chunk: args.row.blocks_per_chunk,
            tokens_per_chunk: plan.layout.tokens_per_block * args.row.blocks_per_chunk,
            row_stride: plan.row_stride,
            page_encoding: plan.encoding.0.describe(),
            page_encoding_source: plan.encoding.1.as_str(),
            namespace: hex::encode(namespace),
        },
        tier: TierReport {
            paths: facts.dirs,
            capacity_bytes: plan.capacity,
            max_bytes_in_flight: plan.max_bytes_in_flight,
            io_engine: facts.io_engine,
            direct_io: facts.direct_io,
            kept: run.kept,
        },
        region: regions[0].name(),
        region_pages: facts.pages,
        chunks: plan.chunks,
        store: run.store,
        load: run.load,
        chunks_verified: run.verified,
        chunks_mismatched: run.mismatched,
        chunks_missing: run.missing,
        ok: totals.0 == expected,
        regions: if regions.len() > 1 || rounds > 1 {
            summaries
        } else {
            Vec::new()
        },
    };
    (report, expected, totals)
}

/// What one run on one region measured.
struct Run {
    store: PhaseReport,
    load: PhaseReport,
    verified: u64,
    mismatched: u64,
    missing: u64,
    kept: bool,
}

/// Builds a fresh stack on `region` and runs fill, store, evict, load and verify once.
fn run_once(
    args: &BenchArgs,
    plan: &Plan,
    namespace: [u8; 32],
    region: BenchRegion,
    progress: bool,
) -> Result<(Run, TierFacts)> {
    let mut tier = BenchTier::open(&TierOptions {
        slot_bytes: plan.params.slot_prefix(),
        region,
        ..TierOptions::of(args, plan, namespace)
    })?;
    if args.path.paths.is_empty() && progress {
        // The user named no directory: say where the slabs go, before the long part starts.
        errln!(
            "kvtier bench: writing {} of slabs in {} (the system temp dir; --path DIR to choose \
             another; {})",
            format_size(plan.capacity),
            display_paths(&tier.facts().dirs),
            if args.keep {
                "kept at the end (--keep)"
            } else {
                "removed at the end"
            }
        );
    }
    let seed = run_seed();
    let keys: Vec<ChunkKey> = (0..plan.chunks).map(|i| chunk_key(seed, i)).collect();
    let batches = plan.batches();

    fill(&mut tier.manager, &keys, &batches, seed, progress)?;
    let store = store_phase(&mut tier.manager, plan, &keys, &batches, progress)?;
    tier.manager.reset_cache()?;
    tier.manager.on_reset_flushed();
    let load = load_phase(&mut tier.manager, plan, &keys, &batches, progress)?;
    if let Some(index) = corrupt_chunk_for_test()? {
        corrupt_loaded_chunk(&mut tier.manager, &keys, index)?;
    }
    let (verified, mismatched, missing) = verify(
        &mut tier.manager,
        &keys,
        seed,
        plan.params.slot_prefix(),
        progress,
    )?;

    let facts = tier.facts();
    let kept = tier.close()?;
    Ok((
        Run {
            store,
            load,
            verified,
            mismatched,
            missing,
            kept,
        },
        facts,
    ))
}
