//! G3 tier throughput and recovery benchmark (plain harness).
//!
//! ```text
//! cargo bench --bench g3                    # full: 256 KiB / 2 MiB / 8 MiB rows, 3 repetitions
//! cargo bench --bench g3 -- --quick         # small sizes, to check that it runs
//! cargo bench --bench g3 -- --recovery-only # only the index recovery figures
//! cargo bench --bench g3 -- --row-kib 2048  # only 2 MiB rows (then recovery)
//! KVTIER_G3_BENCH_DIR=/mnt/nvme0/bench cargo bench --bench g3
//! ```
//!
//! For each row size and `max_bytes_in_flight` it first fills the slab once (unmeasured, so
//! that neither side pays the filesystem's first-write extent conversion), then stores a
//! working set (primary -> G3) and loads it back (G3 -> primary) through the public
//! `SecondaryTier` API, and reports GB/s and CPU seconds per GB (getrusage, whole process: worker, engine threads, CRC). When `fio` is
//! installed it runs fio on the same slab file with the same block size and queue depth in
//! fio's best configuration on the path (`--ioengine=io_uring --direct=1`, registered buffers
//! and files, batched submit and complete, buffers in hugetlb 2 MiB pages like kvtier's region
//! when enough are free: reserve them first, e.g. `echo 300 > /proc/sys/vm/nr_hugepages`;
//! otherwise `malloc`, and the table says the comparison is not like for like), alternating
//! with the engine; medians are reported. fio's figures are what `kvtier fio-compare` calls
//! fio's best (see `docs/performance.md`).
//! Finally it measures index recovery (checkpoint and journal replay) in entries per second.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier::contract::job::TransferJob;
use kvtier::contract::secondary::SecondaryTier;
use kvtier::g3::checkpoint::rotate;
use kvtier::g3::index_dir::IndexDir;
use kvtier::g3::journal::JournalWriter;
use kvtier::g3::{FsyncPolicy, G3Tier, G3TierConfig, geometry_namespace};
use kvtier::key::ChunkKey;
use kvtier::region::PrimaryRegion;

const KEYS_PER_JOB: usize = 8;

fn cpu_seconds() -> f64 {
    // SAFETY: an all-zero rusage is a valid value of this plain C struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid out-pointer for getrusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn key(round: u64, i: usize) -> ChunkKey {
    let mut b = round.to_le_bytes().to_vec();
    b.extend_from_slice(&(i as u64).to_le_bytes());
    b.extend_from_slice(&[0xB5; 16]);
    ChunkKey::new(b)
}

/// Moves every row once (store or load) in jobs of `KEYS_PER_JOB`; returns (seconds, cpu s).
fn pass(t: &mut G3Tier, rows: usize, round: u64, load: bool, next_id: &mut u64) -> (f64, f64) {
    let cpu0 = cpu_seconds();
    let start = Instant::now();
    let mut jobs = 0;
    for first in (0..rows).step_by(KEYS_PER_JOB) {
        let idx: Vec<usize> = (first..(first + KEYS_PER_JOB).min(rows)).collect();
        *next_id += 1;
        let job = TransferJob {
            job_id: *next_id,
            keys: idx.iter().map(|&i| key(round, i)).collect(),
            chunk_ids: idx.iter().map(|&i| i as u32).collect(),
            is_promotion: load,
            req_id: Arc::from("bench"),
            submit_time: Instant::now(),
        };
        if load {
            t.submit_load(job);
        } else {
            t.submit_store(job);
        }
        jobs += 1;
    }
    let mut done = 0;
    while done < jobs {
        for r in t.get_finished_jobs() {
            assert!(r.success, "bench job failed: {:?}", r.error);
            done += 1;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    (start.elapsed().as_secs_f64(), cpu_seconds() - cpu0)
}

/// fio's buffer memory for a run of `depth` I/Os of `bs` bytes: hugetlb 2 MiB pages
/// (`shmhuge`, as kvtier's region) when enough are free, else `malloc` with the reason (the
/// comparison is then not like for like). fio needs each job's `bs * depth` plus one page of
/// alignment, rounded up to 2 MiB pages, and one page more (fio 3.33, as `kvtier fio-compare`).
fn fio_memory(bs: usize, depth: usize) -> (&'static str, Option<String>) {
    let needed = ((bs * depth + 4096) as u64).div_ceil(2 << 20) + 1;
    let free = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("HugePages_Free:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .unwrap_or(0);
    if free >= needed {
        ("shmhuge", None)
    } else {
        (
            "malloc",
            Some(format!(
                "fio on 4 KiB malloc pages, NOT like for like: {free} hugetlb pages free,                  {needed} needed (as root: echo {needed} > /proc/sys/vm/nr_hugepages)"
            )),
        )
    }
}

/// fio on the slab file, same block size and queue depth, in fio's best configuration on the
/// path (as `fio-profiles/store.fio` and `kvtier fio-compare`'s device reference): io_uring
/// with registered buffers and files, submit and complete in batches of up to the depth,
/// buffers in `iomem`; returns GB/s.
fn fio(slab: &Path, write: bool, bs: usize, depth: usize, bytes: u64, iomem: &str) -> Option<f64> {
    let out = Command::new("fio")
        .args([
            "--name=g3",
            "--ioengine=io_uring",
            "--direct=1",
            "--fixedbufs=1",
            "--registerfiles=1",
            "--thread=1",
            "--output-format=json",
            "--offset=4096",
            &format!("--iomem={iomem}"),
            &format!("--iodepth_batch_submit={depth}"),
            "--iodepth_batch_complete_min=1",
            &format!("--iodepth_batch_complete_max={depth}"),
            &format!("--filename={}", slab.display()),
            &format!("--rw={}", if write { "write" } else { "read" }),
            &format!("--bs={bs}"),
            &format!("--iodepth={depth}"),
            &format!("--size={bytes}"),
        ])
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!(
            "fio failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    let job = &v["jobs"][0][if write { "write" } else { "read" }];
    Some(job["bw_bytes"].as_f64()? / 1e9)
}

struct Measured {
    stride: usize,
    in_flight: u64,
    store_gbs: f64,
    store_cpu: f64,
    load_gbs: f64,
    load_cpu: f64,
    fio_write: Option<f64>,
    fio_read: Option<f64>,
    /// fio's `iomem` and, when it is not hugetlb pages, why.
    fio_memory: (&'static str, Option<String>),
}

struct Case {
    stride: usize,
    in_flight: u64,
    working_set: u64,
    reps: usize,
    use_fio: bool,
}

fn throughput(dir: &Path, c: &Case) -> Measured {
    let stride = c.stride;
    let rows = (c.working_set / stride as u64).max(KEYS_PER_JOB as u64) as usize;
    let region = Arc::new(PrimaryRegion::create(rows, stride as u64).expect("region"));
    let slab_dir = tempfile::tempdir_in(dir).expect("tempdir");
    let mut cfg = G3TierConfig::new(vec![slab_dir.path().to_path_buf()], (rows * stride) as u64);
    cfg.max_bytes_in_flight = Some(c.in_flight);
    cfg.fsync = FsyncPolicy::Never;
    let bytes = (rows * stride) as f64;
    let (mut sg, mut sc, mut lg, mut lc) = (vec![], vec![], vec![], vec![]);
    let (mut fw, mut fr) = (vec![], vec![]);
    let slab = slab_dir.path().join(kvtier::g3::slab::SLAB_FILE_NAME);
    let depth = (c.in_flight as usize / stride).max(1);
    let fio_memory = fio_memory(stride, depth);
    let ns = geometry_namespace(stride as u64);
    {
        // Warm-up, not measured: the first write into a preallocated (unwritten) extent costs
        // the filesystem an extent conversion that fio, writing the same file afterwards,
        // would never pay. Fill every slot once so that both sides write written extents
        // (every measured store then also evicts, as in steady state).
        let mut t =
            G3Tier::open(cfg.clone(), region.clone(), ns, "bench".into(), None).expect("open");
        assert!(t.wait_recovered(Duration::from_secs(600)));
        pass(&mut t, rows, u64::MAX, false, &mut 0);
        t.shutdown().expect("shutdown");
    }
    for rep in 0..c.reps {
        {
            let mut t =
                G3Tier::open(cfg.clone(), region.clone(), ns, "bench".into(), None).expect("open");
            assert!(t.wait_recovered(Duration::from_secs(600)));
            let mut id = 0;
            let (s, cpu) = pass(&mut t, rows, rep as u64, false, &mut id);
            sg.push(bytes / s / 1e9);
            sc.push(cpu / (bytes / 1e9));
            let (s, cpu) = pass(&mut t, rows, rep as u64, true, &mut id);
            lg.push(bytes / s / 1e9);
            lc.push(cpu / (bytes / 1e9));
            t.shutdown().expect("shutdown");
        }
        if c.use_fio {
            // The tier is closed (its lock released); fio uses the same file.
            fw.extend(fio(&slab, true, stride, depth, bytes as u64, fio_memory.0));
            fr.extend(fio(&slab, false, stride, depth, bytes as u64, fio_memory.0));
        }
    }
    Measured {
        stride,
        in_flight: c.in_flight,
        store_gbs: median(&mut sg),
        store_cpu: median(&mut sc),
        load_gbs: median(&mut lg),
        load_cpu: median(&mut lc),
        fio_write: (!fw.is_empty()).then(|| median(&mut fw)),
        fio_read: (!fr.is_empty()).then(|| median(&mut fr)),
        fio_memory,
    }
}

fn recovery_bench(dir: &Path, entries: u64) {
    let d = tempfile::tempdir_in(dir).expect("tempdir");
    let uuid = [7u8; 16];
    let total = u32::try_from(entries).expect("entries fit u32");
    let ix: Vec<_> = (0..entries)
        .map(|i| kvtier::g3::index::IndexEntry {
            key: key(1, i as usize),
            slot: i as u32,
            crc: i as u32,
            generation: i + 1,
        })
        .collect();
    let dir = IndexDir::open(d.path()).expect("index directory");
    rotate(&dir, uuid, 1, entries + 1, &ix)
        .map_err(|e| e.error)
        .expect("checkpoint");
    let _ = kvtier::g3::recovery::recover(&dir, uuid, total, 1); // warm the page cache
    let r = kvtier::g3::recovery::recover(&dir, uuid, total, 1).expect("recover");
    assert_eq!(r.index.len() as u64, entries);
    let ck = r.records as f64 / r.duration.as_secs_f64();
    // Journal-only replay of the same entries.
    let ckpt = d.path().join(kvtier::g3::journal::CHECKPOINT_FILE_NAME);
    std::fs::remove_file(ckpt).expect("remove checkpoint");
    let mut w = JournalWriter::create(&dir, uuid, 0).expect("journal");
    for e in &ix {
        w.insert(&e.key, e.slot, e.crc, e.generation);
    }
    w.flush(false).expect("flush");
    drop(w);
    let _ = kvtier::g3::recovery::recover(&dir, uuid, total, 1);
    let r = kvtier::g3::recovery::recover(&dir, uuid, total, 1).expect("recover");
    assert_eq!(r.index.len() as u64, entries);
    let jn = r.records as f64 / r.duration.as_secs_f64();
    println!("\n| recovery source | entries | entries/s |\n|---|---:|---:|");
    println!("| checkpoint | {entries} | {:.2}M |", ck / 1e6);
    println!("| journal | {entries} | {:.2}M |", jn / 1e6);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick =
        args.iter().any(|a| a == "--quick") || std::env::var_os("KVTIER_G3_BENCH_QUICK").is_some();
    let dir = std::env::var_os("KVTIER_G3_BENCH_DIR")
        .map_or_else(|| PathBuf::from("/tmp"), PathBuf::from);
    let use_fio = Command::new("fio").arg("--version").output().is_ok();
    let recovery_only = args.iter().any(|a| a == "--recovery-only");
    let only_row: Option<usize> = args
        .iter()
        .position(|a| a == "--row-kib")
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse::<usize>().expect("--row-kib takes a number of KiB") << 10);
    let (sizes, flights, working_set, reps, entries): (Vec<usize>, Vec<u64>, u64, usize, u64) =
        if quick {
            (
                vec![256 << 10, 2 << 20],
                vec![4 << 20, 16 << 20],
                32 << 20,
                1,
                200_000,
            )
        } else {
            let sizes = vec![256 << 10, 2 << 20, 8 << 20];
            (
                sizes,
                vec![16 << 20, 64 << 20, 256 << 20],
                1 << 30,
                3,
                5_000_000,
            )
        };
    println!(
        "G3 benchmark in {} ({} mode, fsync = never, {KEYS_PER_JOB} keys per job, fio: {use_fio})",
        dir.display(),
        if quick { "quick" } else { "full" }
    );
    println!(
        "\n| row | max in flight | store GB/s | store CPU s/GB | load GB/s | load CPU s/GB \
         | fio write GB/s | fio read GB/s | store/fio | load/fio | fio memory |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    let mut notes = Vec::new();
    for &stride in sizes
        .iter()
        .filter(|&&s| !recovery_only && only_row.is_none_or(|r| r == s))
    {
        for &in_flight in &flights {
            if in_flight < stride as u64 {
                continue;
            }
            let case = Case {
                stride,
                in_flight,
                working_set,
                reps,
                use_fio,
            };
            let r = throughput(&dir, &case);
            let f = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}"));
            let ratio =
                |a: f64, b: Option<f64>| b.map_or("-".to_string(), |b| format!("{:.2}", a / b));
            if let Some(why) = &r.fio_memory.1 {
                notes.push(format!(
                    "{} KiB x {} MiB: {why}",
                    r.stride >> 10,
                    r.in_flight >> 20
                ));
            }
            println!(
                "| {} KiB | {} MiB | {:.2} | {:.3} | {:.2} | {:.3} | {} | {} | {} | {} | {} |",
                r.stride >> 10,
                r.in_flight >> 20,
                r.store_gbs,
                r.store_cpu,
                r.load_gbs,
                r.load_cpu,
                f(r.fio_write),
                f(r.fio_read),
                ratio(r.store_gbs, r.fio_write),
                ratio(r.load_gbs, r.fio_read),
                r.fio_memory.0,
            );
        }
    }
    for n in notes {
        println!("* {n}");
    }
    recovery_bench(&dir, entries);
}
