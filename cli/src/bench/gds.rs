//! `kvtier bench --gds`: chunks in GPU memory stored into a fresh G3 tier and loaded back by
//! GPUDirect Storage and, from the same GPU buffers, by the CPU path (GPU -> pinned primary row
//! -> O_DIRECT), in one run; every byte verified both ways across the paths (a GDS-stored chunk
//! loaded by the CPU path and compared with the canonical row `gather` builds, and so on).
//! Prints one table; exits 1 on any mismatch. `gds/device-check.sh` runs it on a GPU machine.

use std::process::ExitCode;

use crate::bench::args::BenchArgs;
use kvtier::error::{Error, ErrorKind, Result};

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
    use crate::bench::plan::Plan;
    use crate::output::{errln, outln};
    use crate::size::format_size;
    use kvtier::canonical::{
        Direction, EncodingSource, LayerView, ParallelConfig, PreparedCanonical, RowPlan,
        allocator_views, prepare_canonical_from_views,
    };
    use kvtier::contract::job::TransferJob;
    use kvtier::contract::secondary::SecondaryTier;
    use kvtier::embed::PoolOpener;
    use kvtier::g3::gpu_path::{GpuChunk, GpuPath, chunk_runs, gds_error};
    use kvtier::g3::{FsyncPolicy, G3Tier, G3TierConfig, GdsMode};
    use kvtier::key::ChunkKey;
    use kvtier::region::PrimaryRegion;

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
        let (plan, views, prepared) = row_plan(args)?;
        let dev = CudaDevice::open(0).map_err(|e| {
            Error::new(
                ErrorKind::Unsupported,
                format!("GPUDirect Storage cannot start: {}", e.message),
            )
        })?;
        let mut rig = Rig::open(args, &dev, plan, &views, prepared)?;
        let mismatches = std::cell::Cell::new(0u64);
        // 1. GDS store, then the CPU path loads those slots into the primary rows.
        let src_path = rig.gpu_path(&dev, &rig.src_t)?;
        let (gds_store, cpu_load_of_gds) = gds_store_cpu_load(&mut rig, &src_path, &mismatches)?;
        // 2. GDS load of the same slots into other GPU buffers.
        let dst_path = rig.gpu_path(&dev, &rig.dst_t)?;
        let t = Instant::now();
        let r = dst_path.load(3, &rig.gchunks(&gkey));
        let gds_load = t.elapsed();
        if !r.success {
            return Err(r
                .error
                .unwrap_or_else(|| Error::new(ErrorKind::Io, "GDS load failed")));
        }
        for c in 0..rig.chunks {
            rig.verify(&dev, "GDS store -> GDS load", &rig.dst, c, &mismatches)?;
        }
        // 3. The CPU path from the same GPU buffers: GPU -> pinned row -> O_DIRECT, and back.
        let (cpu_store, cpu_load) = cpu_path(&dev, &mut rig, &mismatches)?;
        // 4. A CPU-stored chunk loads by GDS.
        let r = dst_path.load(6, &rig.gchunks(&ckey));
        if !r.success {
            mismatches.set(mismatches.get() + 1);
            errln!("kvtier: CPU store -> GDS load failed: {:?}", r.error);
        }
        for c in 0..rig.chunks {
            rig.verify(&dev, "CPU store -> GDS load", &rig.dst, c, &mismatches)?;
        }
        drop((src_path, dst_path));
        rig.tier.shutdown()?;
        // SAFETY: pinned above; every copy has finished.
        unsafe { dev.unpin_host(rig.region.base_ptr()) }.map_err(gds_error)?;
        print_table(
            &dev,
            &rig,
            &Timings {
                gds_store,
                gds_load,
                cpu_store,
                cpu_load,
                cpu_load_of_gds,
            },
            mismatches.get(),
        )?;
        Ok(if mismatches.get() == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        })
    }

    /// The bench's plan for a GPU of TP 1, the layers' views of KV tensors allocated as vLLM's
    /// allocator creates them, and the canonical row plan derived from those views (the
    /// page encoding the gather assumes, the descriptor checked).
    fn row_plan(args: &BenchArgs) -> Result<(Plan, Vec<LayerView>, PreparedCanonical)> {
        let plan = Plan::from_args(args)?;
        if args.row.model.tp != 1 {
            return Err(Error::config(
                "--tp",
                "kvtier bench --gds stores whole rows from one GPU: use --tp 1",
            ));
        }
        let bpc = args.row.blocks_per_chunk;
        let blocks = plan.chunks * u64::from(bpc);
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
        Ok((plan, views, prepared))
    }

    /// What the run measures on: the row plan, a fresh G3 tier (GDS required) in a temporary
    /// directory over primary rows pinned for the GPU, and the source (filled) and
    /// destination KV tensors with their page tables. Dropped in this order: the tier before
    /// its directory.
    struct Rig {
        plan: Plan,
        bpc: u32,
        chunks: u64,
        stride: u64,
        blocks: u64,
        rplan: RowPlan,
        prepared_encoding: String,
        /// The cuFile mode for the tier's filesystem, and why.
        mode: String,
        tier: G3Tier,
        region: Arc<PrimaryRegion>,
        _dir: tempfile::TempDir,
        dst: Kv,
        src_t: GpuLayout,
        dst_t: GpuLayout,
    }

    impl Rig {
        fn open(
            args: &BenchArgs,
            dev: &CudaDevice,
            plan: Plan,
            views: &[LayerView],
            prepared: PreparedCanonical,
        ) -> Result<Rig> {
            let stride = plan.row_stride;
            let chunks = plan.chunks;
            let bpc = args.row.blocks_per_chunk;
            let blocks = chunks * u64::from(bpc);
            let prepared_encoding = prepared.encoding.describe();
            let rplan: RowPlan = prepared.plan;
            let parent = args
                .path
                .paths
                .first()
                .cloned()
                .unwrap_or_else(std::env::temp_dir);
            let dir = tempfile::tempdir_in(&parent)
                .map_err(|e| Error::io("create a directory in", &parent, e))?;
            let magic = kvtier::io::statfs_magic(dir.path())?;
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
            let ns = PoolOpener::InProcess.namespace(&plan.layout, &plan.params)?;
            let tier = G3Tier::open(cfg, region.clone(), ns, "bench-gds".into(), None)?;
            tier.wait_recovered(Duration::from_secs(60));
            // SAFETY: the region stays mapped (held by `region`) until unpinned below.
            unsafe { dev.pin_host(region.base_ptr(), rows * stride as usize) }
                .map_err(gds_error)?;
            let src = alloc_kv(dev, views, blocks, true)?;
            let dst = alloc_kv(dev, views, blocks, false)?;
            let (src_t, dst_t) = (table(&rplan, views, &src)?, table(&rplan, views, &dst)?);
            Ok(Rig {
                plan,
                bpc,
                chunks,
                stride,
                blocks,
                rplan,
                prepared_encoding,
                mode,
                tier,
                region,
                _dir: dir,
                dst,
                src_t,
                dst_t,
            })
        }

        /// The GPU path between the tier's slots and the tensors of `layout`.
        fn gpu_path<'d>(
            &self,
            dev: &'d CudaDevice,
            layout: &GpuLayout,
        ) -> Result<GpuPath<'d, CudaDevice>> {
            GpuPath::new(
                dev,
                self.tier.slot_grants()?,
                self.rplan.clone(),
                layout.clone(),
                self.plan.max_bytes_in_flight,
            )
        }

        /// The GPU blocks of chunk `c`.
        fn block_ids(&self, c: u64) -> Vec<u64> {
            (0..u64::from(self.bpc))
                .map(|j| c * u64::from(self.bpc) + j)
                .collect::<Vec<_>>()
        }

        /// Every chunk, keyed by `key`.
        fn gchunks(&self, key: &dyn Fn(u64) -> ChunkKey) -> Vec<GpuChunk> {
            (0..self.chunks)
                .map(|c| GpuChunk {
                    key: key(c),
                    chunk_id: c,
                    blocks: self.block_ids(c),
                })
                .collect()
        }

        /// Compares chunk `c` of the tensors `kv` with the source pattern, layer by layer,
        /// counting and naming (`what`) each layer that differs.
        fn verify(
            &self,
            dev: &CudaDevice,
            what: &str,
            kv: &Kv,
            c: u64,
            mismatches: &std::cell::Cell<u64>,
        ) -> Result<()> {
            for (l, lp) in self.rplan.layers.iter().enumerate() {
                let page = lp.mapping.local_page_size_bytes;
                let len = page * u64::from(self.bpc);
                let at = c * len;
                let got = dev.download(kv.bases[l] + at, len).map_err(gds_error)?;
                let want = &pattern((self.blocks * page) as usize, l as u64 + 1)
                    [at as usize..(at + len) as usize];
                if got != want {
                    mismatches.set(mismatches.get() + 1);
                    errln!("kvtier: MISMATCH {what}: chunk {c} layer {l}");
                }
            }
            Ok(())
        }
    }

    /// The key of chunk `c` stored by GDS.
    fn gkey(c: u64) -> ChunkKey {
        ChunkKey::new(format!("bench-gds-{c}").into_bytes())
    }

    /// The key of chunk `c` stored by the CPU path.
    fn ckey(c: u64) -> ChunkKey {
        ChunkKey::new(format!("bench-cpu-{c}").into_bytes())
    }

    /// Phase 1: every chunk stored by GDS from the source tensors, then loaded by the CPU path
    /// into the primary rows and checked against the pattern. Returns both times.
    fn gds_store_cpu_load(
        rig: &mut Rig,
        src_path: &GpuPath<'_, CudaDevice>,
        mismatches: &std::cell::Cell<u64>,
    ) -> Result<(Duration, Duration)> {
        let (chunks, bpc, blocks) = (rig.chunks, rig.bpc, rig.blocks);
        let (region, rplan) = (&rig.region, &rig.rplan);
        let t = Instant::now();
        let r = src_path.store(1, &rig.gchunks(&gkey));
        let gds_store = t.elapsed();
        if !r.success {
            return Err(r
                .error
                .unwrap_or_else(|| Error::new(ErrorKind::Io, "GDS store failed")));
        }
        let t = Instant::now();
        rig.tier.submit_load(job(
            2,
            (0..chunks).map(gkey).collect(),
            (0..chunks as u32).collect(),
            true,
        ));
        wait(&mut rig.tier, 1)?;
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
        Ok((gds_store, cpu_load_of_gds))
    }

    /// Phase 3: the CPU path from the source tensors (GPU -> pinned row -> O_DIRECT store)
    /// and back into the destination tensors (load -> row -> GPU), then checked. Returns the
    /// store and load times.
    fn cpu_path(
        dev: &CudaDevice,
        rig: &mut Rig,
        mismatches: &std::cell::Cell<u64>,
    ) -> Result<(Duration, Duration)> {
        let chunks = rig.chunks;
        let (region, rplan) = (&rig.region, &rig.rplan);
        let (src_t, dst_t) = (&rig.src_t, &rig.dst_t);
        let t = Instant::now();
        for c in 0..chunks {
            let copies = plan_chunk(
                &chunk_runs(rplan, c, Direction::Store),
                src_t,
                &rig.block_ids(c),
            )
            .map_err(gds_error)?;
            // Row `c` is this benchmark's, pinned, and no transfer targets it now.
            let mut row = region.write_row(c as usize)?;
            dev.copy_row(&mut row, &copies, Flow::ToRow)
                .map_err(gds_error)?;
        }
        rig.tier.submit_store(job(
            4,
            (0..chunks).map(ckey).collect(),
            (0..chunks as u32).collect(),
            false,
        ));
        wait(&mut rig.tier, 1)?;
        let cpu_store = t.elapsed();
        let t = Instant::now();
        rig.tier.submit_load(job(
            5,
            (0..chunks).map(ckey).collect(),
            (0..chunks as u32).collect(),
            true,
        ));
        wait(&mut rig.tier, 1)?;
        for c in 0..chunks {
            let copies = plan_chunk(
                &chunk_runs(rplan, c, Direction::Load),
                dst_t,
                &rig.block_ids(c),
            )
            .map_err(gds_error)?;
            // As above.
            let mut row = region.write_row(c as usize)?;
            dev.copy_row(&mut row, &copies, Flow::FromRow)
                .map_err(gds_error)?;
        }
        let cpu_load = t.elapsed();
        for c in 0..chunks {
            rig.verify(dev, "CPU store -> CPU load", &rig.dst, c, mismatches)?;
        }
        Ok((cpu_store, cpu_load))
    }

    /// The times the table reports.
    struct Timings {
        gds_store: Duration,
        gds_load: Duration,
        cpu_store: Duration,
        cpu_load: Duration,
        cpu_load_of_gds: Duration,
    }

    /// The run's one table: what ran, GB/s of each path, and the mismatches.
    fn print_table(dev: &CudaDevice, rig: &Rig, t: &Timings, mismatches: u64) -> Result<()> {
        let total = rig.chunks * rig.stride;
        outln!(
            "kvtier bench --gds: {} ({}, {} pages derived from its tensors, allocated as vLLM \
             allocates them), {} chunks of {} ({}), {} in flight, cuFile mode {}",
            dev.describe(),
            rig.plan.layout.model_name,
            rig.prepared_encoding,
            rig.chunks,
            format_size(rig.stride),
            format_size(total),
            format_size(rig.plan.max_bytes_in_flight),
            rig.mode
        )?;
        outln!("| path | store GB/s | load GB/s |")?;
        outln!("|---|---:|---:|")?;
        outln!(
            "| GDS (GPU <-> slot, cuFile) | {:.2} | {:.2} |",
            gbps(total, t.gds_store),
            gbps(total, t.gds_load)
        )?;
        outln!(
            "| CPU path (GPU <-> pinned row <-> O_DIRECT) | {:.2} | {:.2} |",
            gbps(total, t.cpu_store),
            gbps(total, t.cpu_load)
        )?;
        outln!(
            "| CPU load of GDS-stored slots (slot -> row) | | {:.2} |",
            gbps(total, t.cpu_load_of_gds)
        )?;
        outln!("byte mismatches: {mismatches}")?;
        Ok(())
    }
}
