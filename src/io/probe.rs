//! Capability probes run before a tier trusts a path or an engine.
//!
//! [`probe_direct_io`] checks a directory the way the tier will use it: it must exist, be a
//! directory and be writable (those are errors), and it reports whether O_DIRECT works there
//! (one real aligned 4096-byte write and read through a temporary file, removed afterwards),
//! which alignment the kernel reports through `statx(STATX_DIOALIGN)`, whether misaligned direct
//! I/O is refused (tmpfs, for example, accepts it, so alignment bugs hide there), and the
//! filesystem type. [`probe_io_uring`] checks that a ring can be set up and runs a NOP.

use std::fs::{File, OpenOptions};
use std::hash::BuildHasher;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::fs::{AtFlags, CWD, StatxFlags};

use crate::error::{Error, ErrorKind, Result};
use crate::geometry::ROW_ALIGNMENT;
use crate::region::PrimaryRegion;

/// Size of the probe's test write: one aligned block.
const PROBE_BYTES: usize = ROW_ALIGNMENT;

/// What [`probe_direct_io`] found out about a directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirectIoProbe {
    /// The directory probed.
    pub dir: PathBuf,
    /// Filesystem name from `statfs` (`"ext4"`, `"xfs"`, `"tmpfs"`, ...; `"unknown"` otherwise).
    pub fs_type: &'static str,
    /// The raw `statfs` `f_type` magic.
    pub fs_magic: u64,
    /// Whether an aligned 4096-byte O_DIRECT write and read-back worked.
    pub o_direct: bool,
    /// Why O_DIRECT does not work, when it does not.
    pub o_direct_error: Option<String>,
    /// `stx_dio_mem_align` when statx reports DIO alignment (nonzero), else `None`.
    pub dio_mem_align: Option<u32>,
    /// `stx_dio_offset_align` when statx reports DIO alignment (nonzero), else `None`.
    pub dio_offset_align: Option<u32>,
    /// Whether the filesystem refused a misaligned O_DIRECT write (false on tmpfs, where
    /// O_DIRECT accepts anything, and whenever O_DIRECT does not work at all).
    pub enforces_alignment: bool,
}

impl DirectIoProbe {
    /// `Ok` when O_DIRECT works here; otherwise an [`ErrorKind::Unsupported`] error naming the
    /// directory, the filesystem and the reason (for `direct_io = "required"`).
    pub fn require_direct_io(&self) -> Result<()> {
        if self.o_direct {
            return Ok(());
        }
        let why = self.o_direct_error.as_deref().unwrap_or("unknown reason");
        Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "O_DIRECT does not work in {} (filesystem {}): {why}",
                self.dir.display(),
                self.fs_type
            ),
        )
        .with("path", self.dir.display().to_string())
        .with("filesystem", self.fs_type))
    }
}

/// Name of a `statfs` `f_type` magic.
pub fn fs_type_name(magic: u64) -> &'static str {
    match magic & 0xFFFF_FFFF {
        0xEF53 => "ext4",
        0x5846_5342 => "xfs",
        0x9123_683E => "btrfs",
        0x0102_1994 => "tmpfs",
        0x8584_58F6 => "ramfs",
        0x794C_7630 => "overlayfs",
        0x6969 => "nfs",
        0x2FC1_2FC1 => "zfs",
        0xF2F5_2010 => "f2fs",
        0x6573_5546 => "fuse",
        0xFF53_4D42 => "cifs",
        0xFE53_4D42 => "smb2",
        0x00C3_6400 => "ceph",
        0x0102_1997 => "9p",
        0x7371_7368 => "squashfs",
        0x4D44 => "vfat",
        0x2011_BAB0 => "exfat",
        0x6264_6576 => "bdev",
        0x5346_544E => "ntfs",
        0x0BD0_0BD0 => "lustre",
        0x4750_4653 => "gpfs",
        _ => "unknown",
    }
}

/// A path the kernel can take: no NUL byte inside.
fn check_no_nul(path: &Path) -> Result<()> {
    if path.as_os_str().as_bytes().contains(&0) {
        return Err(Error::new(
            ErrorKind::InvalidPath,
            format!("{} contains a NUL byte", path.display()),
        )
        .with("path", path.display().to_string()));
    }
    Ok(())
}

/// The `statfs` `f_type` magic of the filesystem holding `path` (a 32-bit value; the C field
/// is a signed word, so it is masked to 32 bits).
pub fn statfs_magic(path: &Path) -> Result<u64> {
    check_no_nul(path)?;
    let st = rustix::fs::statfs(path).map_err(|e| Error::io("statfs", path, e.into()))?;
    Ok(st.f_type as u64 & 0xffff_ffff)
}

/// What identifies the filesystem holding a directory: the raw facts
/// [`filesystem_facts`] reads (the G3 tier's filesystem record compares them; see
/// `docs/g3.md`, "The wrong disk").
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FilesystemFacts {
    /// `statfs` `f_type` (masked to 32 bits).
    pub fs_type: u64,
    /// `statvfs` `f_fsid` (ext4 and btrfs derive it from the filesystem's UUID; XFS from the
    /// device number; 0 where the filesystem reports none).
    pub fsid: u64,
    /// The filesystem's UUID (`FS_IOC_GETFSUUID`, Linux 6.5+, from the filesystem's own
    /// superblock); `None` where the kernel or the filesystem gives none, or gives all zeros.
    pub uuid: Option<[u8; 16]>,
    /// `st_dev` of the directory (changes when devices are numbered differently).
    pub dev: u64,
    /// The mount's source (`/dev/nvme0n1`) from `/proc/self/mountinfo`; empty when unknown.
    pub source: String,
    /// The mount point of the filesystem holding the directory; empty when unknown.
    pub mount_point: String,
}

/// Reads [`FilesystemFacts`] of the directory `dir`.
pub fn filesystem_facts(dir: &Path) -> Result<FilesystemFacts> {
    check_no_nul(dir)?;
    let fs_type = statfs_magic(dir)?;
    let vfs = rustix::fs::statvfs(dir).map_err(|e| Error::io("statvfs", dir, e.into()))?;
    let st = rustix::fs::stat(dir).map_err(|e| Error::io("stat", dir, e.into()))?;
    let dev = st.st_dev;
    let (source, mount_point) = mount_of(dir, dev).unwrap_or_default();
    Ok(FilesystemFacts {
        fs_type,
        fsid: vfs.f_fsid,
        uuid: filesystem_uuid(dir),
        dev,
        source,
        mount_point,
    })
}

/// `FS_IOC_GETFSUUID` = `_IOR(0x15, 0, struct fsuuid2)`, `struct fsuuid2 { __u8 len; __u8
/// uuid[16]; }` (17 bytes): `include/uapi/linux/fs.h`.
const FS_IOC_GETFSUUID: u32 = (2 << 30) | (17 << 16) | (0x15 << 8);

/// `struct fsuuid2` of `FS_IOC_GETFSUUID`.
#[repr(C)]
struct FsUuid2 {
    len: u8,
    uuid: [u8; 16],
}

/// The UUID of the filesystem holding `dir` (`FS_IOC_GETFSUUID`), when the kernel and the
/// filesystem report a nonzero one of 16 bytes.
fn filesystem_uuid(dir: &Path) -> Option<[u8; 16]> {
    use std::os::fd::AsRawFd;
    let f = File::open(dir).ok()?;
    let mut out = FsUuid2 {
        len: 0,
        uuid: [0; 16],
    };
    // SAFETY: FS_IOC_GETFSUUID writes at most size_of::<FsUuid2>() (17) bytes into `out`,
    // which has exactly the layout of the kernel's `struct fsuuid2` and outlives the call;
    // `f` is an open descriptor.
    let rc = unsafe {
        libc::ioctl(
            f.as_raw_fd(),
            FS_IOC_GETFSUUID as _,
            &mut out as *mut FsUuid2,
        )
    };
    (rc == 0 && out.len == 16 && out.uuid != [0; 16]).then_some(out.uuid)
}

/// `(source, mount point)` of the mount holding `dir` (device `dev`) from
/// `/proc/self/mountinfo`: the longest mount point above `dir` with that device.
fn mount_of(dir: &Path, dev: u64) -> Option<(String, String)> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let want = format!("{}:{}", rustix::fs::major(dev), rustix::fs::minor(dev));
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let mut best: Option<(String, String)> = None;
    for line in text.lines() {
        // "36 35 98:0 /mnt1 /mnt/parent rw,noatime master:1 - ext3 /dev/root rw,errors=..."
        let Some((head, tail)) = line.split_once(" - ") else {
            continue;
        };
        let fields: Vec<&str> = head.split(' ').collect();
        if fields.len() < 5 || fields[2] != want {
            continue;
        }
        let mount_point = unescape_mountinfo(fields[4]);
        if !dir.starts_with(&mount_point) {
            continue;
        }
        let source = tail
            .split(' ')
            .nth(1)
            .map(unescape_mountinfo)
            .unwrap_or_default();
        if best
            .as_ref()
            .is_none_or(|(_, m)| mount_point.len() >= m.len())
        {
            best = Some((source, mount_point));
        }
    }
    best
}

/// Undoes mountinfo's octal escapes (`\040` for a space).
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = (b[i] == b'\\' && i + 3 < b.len())
            .then(|| &b[i + 1..i + 4])
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .and_then(|d| {
                let v = d.iter().fold(0u16, |v, c| v * 8 + u16::from(c - b'0'));
                u8::try_from(v).ok()
            });
        if let Some(v) = octal {
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `(mem_align, offset_align)` from statx, when the kernel reports nonzero DIO alignment.
fn statx_dio_align(path: &Path) -> Option<(u32, u32)> {
    let st = rustix::fs::statx(CWD, path, AtFlags::empty(), StatxFlags::DIOALIGN).ok()?;
    if st.stx_mask & StatxFlags::DIOALIGN.bits() == 0 {
        return None;
    }
    (st.stx_dio_offset_align != 0).then_some((st.stx_dio_mem_align, st.stx_dio_offset_align))
}

/// Removes the probe file when dropped.
struct TempProbeFile(PathBuf);

impl Drop for TempProbeFile {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.0) {
            log::warn!("cannot remove probe file {}: {e}", self.0.display());
        }
    }
}

fn check_dir(dir: &Path) -> Result<()> {
    let meta = std::fs::metadata(dir).map_err(|e| {
        let reason = match e.raw_os_error() {
            Some(libc::ENOENT) => "does not exist",
            Some(libc::EACCES) => "is not accessible (permission denied)",
            Some(libc::ENOTDIR) => "has a non-directory component",
            _ => "cannot be inspected",
        };
        Error::new(
            ErrorKind::InvalidPath,
            format!("{} {reason}: {e}", dir.display()),
        )
        .with("path", dir.display().to_string())
        .with_source(e)
    })?;
    if !meta.is_dir() {
        return Err(Error::new(
            ErrorKind::InvalidPath,
            format!("{} is not a directory", dir.display()),
        )
        .with("path", dir.display().to_string()));
    }
    Ok(())
}

/// A new probe file in `dir`. Its name is unique across hosts: a directory shared through a
/// distributed file system (the fs tier's `root_dir`) is probed by every host at start, and
/// their engines often have the same pid (one per container), so the name adds a random part.
fn create_probe_file(dir: &Path) -> Result<TempProbeFile> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let pid = std::process::id();
    let random = std::collections::hash_map::RandomState::new().hash_one((pid, n));
    let name = format!(".kvtier-probe-{pid}-{n}-{random:016x}");
    let path = dir.join(name);
    match OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
    {
        Ok(_) => Ok(TempProbeFile(path)),
        Err(e) => {
            let reason = match e.raw_os_error() {
                Some(libc::EACCES) | Some(libc::EPERM) => "is not writable (permission denied)",
                Some(libc::EROFS) => "is on a read-only filesystem",
                Some(libc::ENOSPC) | Some(libc::EDQUOT) => "has no space left",
                _ => "does not accept new files",
            };
            let kind = match e.raw_os_error() {
                Some(libc::ENOSPC) | Some(libc::EDQUOT) => ErrorKind::NoSpace,
                _ => ErrorKind::InvalidPath,
            };
            Err(Error::new(kind, format!("{} {reason}: {e}", dir.display()))
                .with("path", dir.display().to_string())
                .with_source(e))
        }
    }
}

/// Outcome of the real O_DIRECT round trip: `Ok(enforces_alignment)` or why it failed.
fn direct_round_trip(path: &Path) -> std::result::Result<bool, String> {
    let file: File = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::EINVAL) => format!("the filesystem refuses O_DIRECT opens (EINVAL): {e}"),
            _ => format!("opening with O_DIRECT failed: {e}"),
        })?;
    // Two page-aligned rows: one to write from, one to read into.
    let buf = PrimaryRegion::create(2, PROBE_BYTES as u64)
        .map_err(|e| format!("cannot allocate an aligned probe buffer: {e}"))?;
    let (src, dst) = (buf.write_row(0), buf.write_row(1));
    let (mut src, mut dst) = match (src, dst) {
        (Ok(s), Ok(d)) => (s, d),
        _ => return Err("probe buffer rows are unavailable".to_string()),
    };
    for (i, b) in src.iter_mut().enumerate() {
        *b = (i % 251) as u8 ^ 0x5A;
    }
    match file.write_at(&src, 0) {
        Ok(n) if n == PROBE_BYTES => {}
        Ok(n) => {
            return Err(format!(
                "aligned O_DIRECT write moved {n} of {PROBE_BYTES} bytes"
            ));
        }
        Err(e) => return Err(format!("aligned O_DIRECT write failed: {e}")),
    }
    match file.read_at(&mut dst, 0) {
        Ok(n) if n == PROBE_BYTES => {}
        Ok(n) => {
            return Err(format!(
                "aligned O_DIRECT read moved {n} of {PROBE_BYTES} bytes"
            ));
        }
        Err(e) => return Err(format!("aligned O_DIRECT read failed: {e}")),
    }
    if src[..] != dst[..] {
        return Err("O_DIRECT read back different bytes than were written".to_string());
    }
    // A misaligned write: 100 bytes from an odd address at an odd offset.
    let accepted = file.write_at(&src[1..101], 7).is_ok();
    Ok(!accepted)
}

/// Probes `dir` for use as a tier path: see the module docs.
///
/// Errors (naming the path and the reason): the directory is missing, not a directory, or not
/// writable. That O_DIRECT does not work is a finding, not an error: see
/// [`DirectIoProbe::require_direct_io`].
pub fn probe_direct_io(dir: &Path) -> Result<DirectIoProbe> {
    check_dir(dir)?;
    let fs_magic = statfs_magic(dir)?;
    let fs_type = fs_type_name(fs_magic);
    let probe_file = create_probe_file(dir)?;
    let align = statx_dio_align(&probe_file.0);
    let outcome = direct_round_trip(&probe_file.0);
    drop(probe_file);
    let (o_direct, o_direct_error, enforces_alignment) = match outcome {
        Ok(enforces) => (true, None, enforces),
        Err(why) => (false, Some(why), false),
    };
    Ok(DirectIoProbe {
        dir: dir.to_path_buf(),
        fs_type,
        fs_magic,
        o_direct,
        o_direct_error,
        dio_mem_align: align.map(|a| a.0),
        dio_offset_align: align.map(|a| a.1),
        enforces_alignment,
    })
}

/// Whether an io_uring can be set up here, has the opcodes kvtier needs
/// (`crate::io::uring::REQUIRED_OPCODES`) and completes a NOP; `Err` says why not, naming
/// any missing opcode.
pub fn probe_io_uring() -> std::result::Result<(), String> {
    let mut ring = io_uring::IoUring::new(4).map_err(|e| {
        let hint = match e.raw_os_error() {
            Some(libc::ENOSYS) => " (kernel without io_uring)",
            Some(libc::EPERM) => " (disabled by kernel.io_uring_disabled or a seccomp filter)",
            _ => "",
        };
        format!("io_uring_setup failed: {e}{hint}")
    })?;
    let opcodes = crate::io::uring::OpcodeSupport::of(&ring, |_| true)?;
    if let Some(why) = opcodes.missing_required() {
        return Err(why);
    }
    let nop = io_uring::opcode::Nop::new().build().user_data(7);
    // SAFETY: a NOP references no memory.
    unsafe { ring.submission().push(&nop) }
        .map_err(|_| "the submission queue of a fresh ring is full".to_string())?;
    ring.submit_and_wait(1)
        .map_err(|e| format!("io_uring_enter failed: {e}"))?;
    match ring.completion().next() {
        Some(c) if c.user_data() == 7 && c.result() >= 0 => Ok(()),
        Some(c) => Err(format!("io_uring NOP completed with {}", c.result())),
        None => Err("io_uring NOP produced no completion".to_string()),
    }
}
