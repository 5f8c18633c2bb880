//! fio's buffer memory and submission batching in `kvtier fio-compare`, chosen to match
//! kvtier's side.
//!
//! An O_DIRECT transfer is one DMA segment per physically contiguous run of buffer pages, so
//! the kind of memory decides how a large row reaches the device. fio's side therefore uses
//! the same kind kvtier's rows are in:
//! * kvtier's rows in 2 MiB pages: fio's buffers in hugetlb pages (`iomem=shmhuge`), reserved
//!   for the run when there are not enough free ones (`/proc/sys/vm/nr_hugepages`, root) and
//!   given back afterwards; when they cannot be had, `malloc` with the comparison marked as not
//!   like for like;
//! * kvtier's rows in 4 KiB pages (the vLLM-shaped region): a shared `/dev/shm` file mapping
//!   (`iomem=mmap:/dev/shm/...`), 4 KiB shmem pages as vLLM's region has.
//!
//! Submission: kvtier's io_uring engine submits every ready request in one `io_uring_enter` and
//! reaps every completion there is, so fio submits and completes in batches of up to the depth
//! (`iodepth_batch_submit` = `iodepth_batch_complete_max` = depth, `iodepth_batch_complete_min=1`).
//!
//! fio's best configuration on the path (hugetlb pages, batched submit and complete) is also
//! run as the device reference.

use std::path::PathBuf;

use serde::Serialize;

/// The hugetlb page size fio's `shmhuge` gets (the default, 2 MiB on x86-64).
const HUGE_PAGE: u64 = 2 << 20;

/// How fio's buffers are backed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FioMemory {
    /// `iomem=shmhuge`: SysV shared memory in hugetlb 2 MiB pages.
    ShmHuge,
    /// `iomem=malloc`: heap memory, 4 KiB pages.
    Malloc,
    /// `iomem=mmap:<file>`: a shared mapping of a tmpfs file, 4 KiB pages.
    ShmFile(PathBuf),
}

impl FioMemory {
    /// The `iomem=` value.
    pub fn iomem(&self) -> String {
        match self {
            FioMemory::ShmHuge => "shmhuge".to_string(),
            FioMemory::Malloc => "malloc".to_string(),
            FioMemory::ShmFile(p) => format!("mmap:{}", p.display()),
        }
    }

    /// In the report's words.
    pub fn describe(&self) -> String {
        match self {
            FioMemory::ShmHuge => "hugetlb 2 MiB pages (iomem=shmhuge)".to_string(),
            FioMemory::Malloc => "4 KiB heap pages (iomem=malloc)".to_string(),
            FioMemory::ShmFile(p) => {
                format!("4 KiB shared tmpfs pages (iomem=mmap:{})", p.display())
            }
        }
    }

    /// A table cell's worth: `hugetlb`, `malloc` or `tmpfs file`.
    pub fn short(&self) -> &'static str {
        match self {
            FioMemory::ShmHuge => "hugetlb",
            FioMemory::Malloc => "malloc",
            FioMemory::ShmFile(_) => "tmpfs file",
        }
    }

    /// Whether the buffers are 2 MiB pages.
    pub fn huge(&self) -> bool {
        matches!(self, FioMemory::ShmHuge)
    }
}

/// One fio configuration: memory and batching.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FioSetup {
    /// Buffer memory.
    pub memory: FioMemory,
    /// `iodepth_batch_submit` and `iodepth_batch_complete_max` (0 = the depth of each run).
    pub batch: u32,
}

impl FioSetup {
    /// The batch for a run at `depth`.
    pub fn batch_at(&self, depth: u32) -> u32 {
        if self.batch == 0 { depth } else { self.batch }
    }

    /// In the report's words.
    pub fn describe(&self) -> String {
        let batch = if self.batch == 0 {
            "batches of up to the depth".to_string()
        } else {
            format!("batches of {}", self.batch)
        };
        format!("{}, submit and complete in {batch}", self.memory.describe())
    }
}

/// What fio runs beside kvtier, decided once kvtier's region exists.
#[derive(Debug, Clone, Serialize)]
pub struct FioChoice {
    /// The same kind of memory as kvtier's rows, batching no worse than kvtier's.
    pub like: FioSetup,
    /// Whether `like` really is like for like (false when hugetlb pages could not be had).
    pub like_for_like: bool,
    /// Why not, or what was done to make it so (hugetlb pages reserved).
    pub note: Option<String>,
    /// fio's best configuration on this path, when it differs from `like` and can run.
    pub best: Option<FioSetup>,
}

/// Hugetlb pages reserved for one fio-compare run: it adds its own pages to
/// `nr_hugepages` and takes exactly those away again on drop, each change made under an
/// exclusive lock on [`LOCK_FILE`], so concurrent runs never take each other's pages.
#[derive(Debug)]
pub struct HugetlbReservation {
    added: u64,
}

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

/// Serialises changes of `nr_hugepages` between runs (tmpfs: gone after a reboot).
const LOCK_FILE: &str = "/dev/shm/kvtier-fio-hugetlb.lock";

impl Drop for HugetlbReservation {
    fn drop(&mut self) {
        if self.added == 0 {
            return;
        }
        let _lock = lock();
        let total = hugetlb_pages().map_or(0, |(_, t)| t);
        if let Err(e) = std::fs::write(NR_HUGEPAGES, total.saturating_sub(self.added).to_string()) {
            log::warn!("cannot give back the hugetlb pages reserved for fio ({NR_HUGEPAGES}: {e})");
        }
    }
}

/// Takes [`LOCK_FILE`] exclusively (released when the file closes); `None` when it cannot.
fn lock() -> Option<std::fs::File> {
    use rustix::fs::{FlockOperation, flock};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(LOCK_FILE)
        .ok()?;
    flock(&file, FlockOperation::LockExclusive).ok()?;
    Some(file)
}

/// Free and total hugetlb pages of the default size, from `/proc/meminfo`.
fn hugetlb_pages() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| -> Option<u64> {
        text.lines()
            .find(|l| l.starts_with(name))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    Some((field("HugePages_Free:")?, field("HugePages_Total:")?))
}

/// Hugetlb pages fio needs: each job's buffers are `row * depth` bytes plus one page of
/// alignment, rounded up to whole 2 MiB pages, and one page more (fio 3.33 refuses to start
/// with exactly that many free: measured at 2 MiB x 32).
pub fn hugetlb_pages_needed(row: u64, depth: u32, jobs: u32) -> u64 {
    let per_job = row
        .saturating_mul(u64::from(depth))
        .saturating_add(4096)
        .div_ceil(HUGE_PAGE)
        .saturating_add(1);
    per_job.saturating_mul(u64::from(jobs))
}

/// Reserves `needed` hugetlb pages of this run's own (or, when not allowed to reserve, uses
/// free ones). `Err` says why they cannot be had.
pub fn reserve_hugetlb(needed: u64) -> Result<(HugetlbReservation, Option<String>), String> {
    let _lock = lock();
    let (free, total) = hugetlb_pages()
        .ok_or_else(|| "this kernel reports no hugetlb pages (/proc/meminfo)".to_string())?;
    // Never ask the kernel for more than half of the available memory in pinned pages.
    let available = kvtier::embed::mem_available().unwrap_or(0);
    if needed.saturating_mul(HUGE_PAGE) > available / 2 {
        return Err(format!(
            "fio needs {needed} hugetlb pages, over half of the available memory"
        ));
    }
    let want = total + needed;
    if let Err(e) = std::fs::write(NR_HUGEPAGES, want.to_string()) {
        // Not allowed to reserve: use free pages somebody else reserved, if there are enough.
        if free >= needed {
            let note = format!("using {needed} of {free} free hugetlb pages ({NR_HUGEPAGES}: {e})");
            return Ok((HugetlbReservation { added: 0 }, Some(note)));
        }
        return Err(format!(
            "{free} hugetlb pages free, fio needs {needed}, and reserving more failed \
             ({NR_HUGEPAGES}: {e}); as root: echo {want} > {NR_HUGEPAGES}"
        ));
    }
    let got = hugetlb_pages().map_or(0, |(_, t)| t).saturating_sub(total);
    if got < needed {
        // Give back what was had (under the lock still held: no reservation value whose drop
        // would take it again).
        let _ = std::fs::write(NR_HUGEPAGES, total.to_string());
        return Err(format!(
            "only {got} of the {needed} hugetlb pages fio needs could be reserved (memory too \
             fragmented for more 2 MiB pages)"
        ));
    }
    let note = format!("reserved {needed} hugetlb pages for fio's buffers (given back afterwards)");
    Ok((HugetlbReservation { added: got }, Some(note)))
}

/// Decides fio's side for kvtier rows in 2 MiB pages (`kvtier_huge`) or not; `shm_file` is
/// where a 4 KiB shared buffer file goes. The reservation must live as long as fio runs.
pub fn choose(
    kvtier_huge: bool,
    shm_file: PathBuf,
    pages_needed: u64,
) -> (FioChoice, Option<HugetlbReservation>) {
    let batched = |memory| FioSetup { memory, batch: 0 };
    let (reservation, huge_ok) = match reserve_hugetlb(pages_needed) {
        Ok((r, note)) => (Some(r), Ok(note)),
        Err(why) => (None, Err(why)),
    };
    let choice = match (kvtier_huge, huge_ok) {
        (true, Ok(note)) => FioChoice {
            like: batched(FioMemory::ShmHuge),
            like_for_like: true,
            note,
            best: None,
        },
        (true, Err(why)) => FioChoice {
            like: batched(FioMemory::Malloc),
            like_for_like: false,
            note: Some(format!(
                "NOT like for like: kvtier's rows are in 2 MiB pages, fio's in 4 KiB pages \
                 ({why}); fio's best configuration cannot run either"
            )),
            best: None,
        },
        (false, Ok(note)) => FioChoice {
            like: batched(FioMemory::ShmFile(shm_file)),
            like_for_like: true,
            note,
            best: Some(batched(FioMemory::ShmHuge)),
        },
        (false, Err(why)) => FioChoice {
            like: batched(FioMemory::ShmFile(shm_file)),
            like_for_like: true,
            note: Some(format!("fio's best configuration cannot run: {why}")),
            best: None,
        },
    };
    (choice, reservation)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_needed_cover_every_jobs_buffers() {
        assert_eq!(hugetlb_pages_needed(2 << 20, 32, 1), 34);
        assert_eq!(hugetlb_pages_needed(2 << 20, 32, 2), 68);
        assert_eq!(hugetlb_pages_needed(64 << 10, 1, 1), 2);
    }

    #[test]
    fn setups_name_their_memory_and_batching() {
        let s = FioSetup {
            memory: FioMemory::ShmFile("/dev/shm/x".into()),
            batch: 0,
        };
        assert_eq!(s.memory.iomem(), "mmap:/dev/shm/x");
        assert_eq!(s.batch_at(16), 16);
        assert!(s.describe().contains("4 KiB shared tmpfs pages"));
        assert_eq!(FioMemory::ShmHuge.iomem(), "shmhuge");
        assert!(FioMemory::ShmHuge.huge() && !FioMemory::Malloc.huge());
        let fixed = FioSetup {
            memory: FioMemory::Malloc,
            batch: 1,
        };
        assert_eq!(fixed.batch_at(16), 1);
    }

    /// The fallback selection: kvtier in 2 MiB pages and no hugetlb pages to be had makes the
    /// comparison "not like for like", never silently.
    #[test]
    fn choice_follows_kvtier_pages_and_hugetlb_availability() {
        let shm = PathBuf::from("/dev/shm/f");
        // More pages than any machine has: the reservation fails (as root too).
        let (c, r) = choose(true, shm.clone(), u64::MAX / 4);
        assert!(r.is_none());
        assert!(!c.like_for_like);
        assert_eq!(c.like.memory, FioMemory::Malloc);
        assert!(c.note.unwrap().contains("NOT like for like"));
        assert!(c.best.is_none());
        let (c, _) = choose(false, shm.clone(), u64::MAX / 4);
        assert!(c.like_for_like);
        assert_eq!(c.like.memory, FioMemory::ShmFile(shm.clone()));
        assert!(c.best.is_none() && c.note.unwrap().contains("best configuration cannot run"));
        // Zero pages are always there.
        let (c, _) = choose(true, shm.clone(), 0);
        assert!(c.like_for_like && c.like.memory.huge() && c.best.is_none());
        let (c, _) = choose(false, shm, 0);
        assert!(c.like_for_like && !c.like.memory.huge());
        assert_eq!(c.best.unwrap().memory, FioMemory::ShmHuge);
    }
}
