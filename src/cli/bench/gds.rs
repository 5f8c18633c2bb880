//! `kvtier bench --gds`: chunks in GPU memory stored into a fresh G3 tier and loaded back by
//! GPUDirect Storage and, from the same GPU buffers, by the CPU path (GPU -> pinned primary row
//! -> O_DIRECT), in one run; every byte verified both ways across the paths (a GDS-stored chunk
//! loaded by the CPU path and compared with the canonical row `gather` builds, and so on).
//! Prints one table; exits 1 on any mismatch. `gds/device-check.sh` runs it on a GPU machine.

use std::process::ExitCode;

use crate::cli::bench::BenchArgs;
use crate::error::{Error, ErrorKind, Result};

/// Runs the GPU benchmark (needs the `gds` feature and a GPU).
pub fn run(args: &BenchArgs) -> Result<ExitCode> {
    #[cfg(not(feature = "gds"))]
    {
        let _ = args;
        Err(Error::new(
            ErrorKind::Unsupported,
            "`kvtier bench --gds` needs a build with GPUDirect Storage: cargo build --release \
             --features gds",
        ))
    }
    #[cfg(feature = "gds")]
    {
        gpu::run(args)
    }
}

#[cfg(feature = "gds")]
mod gpu {
    use std::process::ExitCode;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use kvtier_gds::cuda::CudaDevice;
    use kvtier_gds::device::{Device, Flow};
    use kvtier_gds::plan::{GpuLayout, LayerPages, plan_chunk};

    use super::{BenchArgs, Error, ErrorKind, Result};
    use crate::canonical::{
        Direction, EncodingSource, LayerView, ParallelConfig, RowPlan, allocator_views,
        namespace_digest, prepare_canonical_from_views,
    };
    use crate::cli::bench::plan::Plan;
    use crate::cli::output::{errln, outln};
    use crate::cli::size::format_size;
    use crate::contract::job::TransferJob;
    use crate::contract::secondary::SecondaryTier;
    use crate::g3::gpu_path::{GpuChunk, GpuPath, chunk_runs, gds_error};
    use crate::g3::{FsyncPolicy, G3Tier, G3TierConfig, GdsMode};
    use crate::key::ChunkKey;
    use crate::region::PrimaryRegion;

    /// The chunks' "KV cache": one tensor per layer, shaped and strided as vLLM's allocator
    /// creates it (`allocator_views`), block `b` at `b * stride[0]`.
    struct Kv {
        bases: Vec<u64>,
    }

    /// Bytes between blocks and bytes of one page of a layer's view.
    fn block_and_page_bytes(view: &LayerView) -> (u64, u64) {
        let page: u64 = view.shape[1..].iter().product();
        (view.stride[0] * view.element_size, page * view.element_size)
    }

    fn pattern(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    fn alloc_kv(dev: &CudaDevice, views: &[LayerView], blocks: u64, fill: bool) -> Result<Kv> {
        let mut bases = Vec::new();
        for (l, view) in views.iter().enumerate() {
            let len = block_and_page_bytes(view).0 * blocks;
            let base = dev.alloc(len).map_err(gds_error)?;
            if fill {
                dev.upload(base, &pattern(len as usize, l as u64 + 1))
                    .map_err(gds_error)?;
            }
            bases.push(base);
        }
        Ok(Kv { bases })
    }

    fn table(plan: &RowPlan, views: &[LayerView], kv: &Kv) -> Result<GpuLayout> {
        GpuLayout::new(
            views
                .iter()
                .zip(&kv.bases)
                .map(|(view, &b)| {
                    let (block_stride, page) = block_and_page_bytes(view);
                    LayerPages::contiguous(page, b, block_stride)
                })
                .collect(),
            u64::from(plan.blocks_per_chunk),
        )
        .map_err(gds_error)
    }

    fn gbps(bytes: u64, d: Duration) -> f64 {
        bytes as f64 / d.as_secs_f64().max(1e-9) / 1e9
    }

    fn wait(tier: &mut G3Tier, n: usize) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(600);
        let mut got = 0;
        while got < n {
            for r in tier.get_finished_jobs() {
                if !r.success {
                    return Err(r
                        .error
                        .unwrap_or_else(|| Error::new(ErrorKind::Io, "job failed")));
                }
                got += 1;
            }
            if Instant::now() > deadline {
                return Err(Error::new(
                    ErrorKind::Io,
                    "tier jobs did not finish in 600 s",
                ));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    }

    fn job(id: u64, keys: Vec<ChunkKey>, rows: Vec<u32>, load: bool) -> TransferJob {
        TransferJob {
            job_id: id,
            keys,
            chunk_ids: rows,
            is_promotion: load,
            req_id: Arc::from("bench-gds"),
            submit_time: Instant::now(),
        }
    }

    pub(super) fn run(args: &BenchArgs) -> Result<ExitCode> {
        let plan = Plan::from_args(args)?;
        if args.row.model.tp != 1 {
            return Err(Error::config(
                "--tp",
                "kvtier bench --gds stores whole rows from one GPU: use --tp 1",
            ));
        }
        let stride = plan.row_stride;
        let chunks = plan.chunks;
        let bpc = args.row.blocks_per_chunk;
        // The GPU tensors are allocated as vLLM's allocator creates them, and the page
        // encoding the gather assumes is derived from their views (the descriptor checked).
        let blocks = chunks * u64::from(bpc);
        let views = allocator_views(&plan.layout, 1, blocks)?.ok_or_else(|| {
            Error::new(
                ErrorKind::Unsupported,
                format!(
                    "kvtier bench --gds allocates its KV tensors as vLLM's allocator does, which \
                     covers NHD and HND layouts, not {}",
                    plan.layout.kv_layout.as_str()
                ),
            )
        })?;
        let prepared = prepare_canonical_from_views(
            &plan.layout,
            &ParallelConfig::tp(1, 0),
            bpc,
            true,
            &views,
        )?;
        debug_assert_eq!(prepared.encoding_source, EncodingSource::Views);
        let prepared_encoding = prepared.encoding.describe();
        let rplan: RowPlan = prepared.plan;
        let dev = CudaDevice::open(0).map_err(|e| {
            Error::new(
                ErrorKind::Unsupported,
                format!("GPUDirect Storage cannot start: {}", e.message),
            )
        })?;
        let parent = args
            .path
            .paths
            .first()
            .cloned()
            .unwrap_or_else(std::env::temp_dir);
        let dir = tempfile::tempdir_in(&parent)
            .map_err(|e| Error::io("create a directory in", &parent, e))?;
        let magic = crate::io::probe::statfs_magic(dir.path())?;
        let mode = match dev.mode_for(magic) {
            Ok((m, why)) => format!("{} ({why})", m.as_str()),
            Err(why) => return Err(Error::new(ErrorKind::Unsupported, why)),
        };
        let rows =
            usize::try_from(chunks).map_err(|_| Error::config("--bytes", "too many rows"))?;
        let region = Arc::new(PrimaryRegion::create(rows, stride)?);
        let mut cfg = G3TierConfig::new(vec![dir.path().to_path_buf()], 2 * chunks * stride);
        cfg.max_bytes_in_flight = Some(plan.max_bytes_in_flight);
        cfg.io_engine = args.io_engine;
        cfg.fsync = FsyncPolicy::Never;
        cfg.gds = GdsMode::Required;
        cfg.slot_bytes = plan.params.slot_prefix();
        let ns = namespace_digest(&plan.layout, &plan.params);
        let mut tier = G3Tier::open(cfg, region.clone(), ns, "bench-gds".into(), None)?;
        tier.wait_recovered(Duration::from_secs(60));
        // SAFETY: the region stays mapped (held by `region`) until unpinned below.
        unsafe { dev.pin_host(region.base_ptr(), rows * stride as usize) }.map_err(gds_error)?;
        let src = alloc_kv(&dev, &views, blocks, true)?;
        let dst = alloc_kv(&dev, &views, blocks, false)?;
        let (src_t, dst_t) = (table(&rplan, &views, &src)?, table(&rplan, &views, &dst)?);
        let block_ids = |c: u64| {
            (0..u64::from(bpc))
                .map(|j| c * u64::from(bpc) + j)
                .collect::<Vec<_>>()
        };
        let gkey = |c: u64| ChunkKey::new(format!("bench-gds-{c}").into_bytes());
        let ckey = |c: u64| ChunkKey::new(format!("bench-cpu-{c}").into_bytes());
        let gchunks = |k: &dyn Fn(u64) -> ChunkKey| -> Vec<GpuChunk> {
            (0..chunks)
                .map(|c| GpuChunk {
                    key: k(c),
                    chunk_id: c,
                    blocks: block_ids(c),
                })
                .collect()
        };
        let total = chunks * stride;
        let mismatches = std::cell::Cell::new(0u64);
        let verify = |what: &str, kv: &Kv, c: u64| -> Result<()> {
            for (l, lp) in rplan.layers.iter().enumerate() {
                let page = lp.mapping.local_page_size_bytes;
                let len = page * u64::from(bpc);
                let at = c * len;
                let got = dev.download(kv.bases[l] + at, len).map_err(gds_error)?;
                let want = &pattern((blocks * page) as usize, l as u64 + 1)
                    [at as usize..(at + len) as usize];
                if got != want {
                    mismatches.set(mismatches.get() + 1);
                    errln!("kvtier: MISMATCH {what}: chunk {c} layer {l}");
                }
            }
            Ok(())
        };
        // 1. GDS store, then the CPU path loads those slots into the primary rows.
        let src_path = GpuPath::new(
            &dev,
            tier.direct_slots()?,
            rplan.clone(),
            src_t.clone(),
            plan.max_bytes_in_flight,
        )?;
        let t = Instant::now();
        let r = src_path.store(1, &gchunks(&gkey));
        let gds_store = t.elapsed();
        if !r.success {
            return Err(r
                .error
                .unwrap_or_else(|| Error::new(ErrorKind::Io, "GDS store failed")));
        }
        let t = Instant::now();
        tier.submit_load(job(
            2,
            (0..chunks).map(gkey).collect(),
            (0..chunks as u32).collect(),
            true,
        ));
        wait(&mut tier, 1)?;
        let cpu_load_of_gds = t.elapsed();
        for c in 0..chunks {
            // No transfer targets the region now.
            let row = region.read_row(c as usize)?;
            let mut local = vec![0u8; rplan.local_chunk_bytes as usize];
            rplan.scatter(&row, &mut local)?;
            let mut at = 0usize;
            for (l, lp) in rplan.layers.iter().enumerate() {
                let len = (lp.mapping.local_page_size_bytes * u64::from(bpc)) as usize;
                let off = c as usize * len;
                let want = &pattern(
                    (blocks * lp.mapping.local_page_size_bytes) as usize,
                    l as u64 + 1,
                )[off..off + len];
                if &local[at..at + len] != want {
                    mismatches.set(mismatches.get() + 1);
                    errln!("kvtier: MISMATCH GDS store -> CPU load: chunk {c} layer {l}");
                }
                at += len;
            }
        }
        // 2. GDS load of the same slots into other GPU buffers.
        let dst_path = GpuPath::new(
            &dev,
            tier.direct_slots()?,
            rplan.clone(),
            dst_t.clone(),
            plan.max_bytes_in_flight,
        )?;
        let t = Instant::now();
        let r = dst_path.load(3, &gchunks(&gkey));
        let gds_load = t.elapsed();
        if !r.success {
            return Err(r
                .error
                .unwrap_or_else(|| Error::new(ErrorKind::Io, "GDS load failed")));
        }
        for c in 0..chunks {
            verify("GDS store -> GDS load", &dst, c)?;
        }
        // 3. The CPU path from the same GPU buffers: GPU -> pinned row -> O_DIRECT, and back.
        let t = Instant::now();
        for c in 0..chunks {
            let copies = plan_chunk(
                &chunk_runs(&rplan, c, Direction::Store),
                &src_t,
                &block_ids(c),
            )
            .map_err(gds_error)?;
            // Row `c` is this benchmark's, pinned, and no transfer targets it now.
            let mut row = region.write_row(c as usize)?;
            dev.copy_row(&mut row, &copies, Flow::ToRow)
                .map_err(gds_error)?;
        }
        tier.submit_store(job(
            4,
            (0..chunks).map(ckey).collect(),
            (0..chunks as u32).collect(),
            false,
        ));
        wait(&mut tier, 1)?;
        let cpu_store = t.elapsed();
        let t = Instant::now();
        tier.submit_load(job(
            5,
            (0..chunks).map(ckey).collect(),
            (0..chunks as u32).collect(),
            true,
        ));
        wait(&mut tier, 1)?;
        for c in 0..chunks {
            let copies = plan_chunk(
                &chunk_runs(&rplan, c, Direction::Load),
                &dst_t,
                &block_ids(c),
            )
            .map_err(gds_error)?;
            // As above.
            let mut row = region.write_row(c as usize)?;
            dev.copy_row(&mut row, &copies, Flow::FromRow)
                .map_err(gds_error)?;
        }
        let cpu_load = t.elapsed();
        for c in 0..chunks {
            verify("CPU store -> CPU load", &dst, c)?;
        }
        // 4. A CPU-stored chunk loads by GDS.
        let r = dst_path.load(6, &gchunks(&ckey));
        if !r.success {
            mismatches.set(mismatches.get() + 1);
            errln!("kvtier: CPU store -> GDS load failed: {:?}", r.error);
        }
        for c in 0..chunks {
            verify("CPU store -> GDS load", &dst, c)?;
        }
        drop((src_path, dst_path));
        tier.shutdown()?;
        // SAFETY: pinned above; every copy has finished.
        unsafe { dev.unpin_host(region.base_ptr()) }.map_err(gds_error)?;
        outln!(
            "kvtier bench --gds: {} ({}, {} pages derived from its tensors, allocated as vLLM \
             allocates them), {} chunks of {} ({}), {} in flight, cuFile mode {mode}",
            dev.describe(),
            plan.layout.model_name,
            prepared_encoding,
            chunks,
            format_size(stride),
            format_size(total),
            format_size(plan.max_bytes_in_flight)
        )?;
        outln!("| path | store GB/s | load GB/s |")?;
        outln!("|---|---:|---:|")?;
        outln!(
            "| GDS (GPU <-> slot, cuFile) | {:.2} | {:.2} |",
            gbps(total, gds_store),
            gbps(total, gds_load)
        )?;
        outln!(
            "| CPU path (GPU <-> pinned row <-> O_DIRECT) | {:.2} | {:.2} |",
            gbps(total, cpu_store),
            gbps(total, cpu_load)
        )?;
        outln!(
            "| CPU load of GDS-stored slots (slot -> row) | | {:.2} |",
            gbps(total, cpu_load_of_gds)
        )?;
        outln!("byte mismatches: {}", mismatches.get())?;
        Ok(if mismatches.get() == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        })
    }
}
