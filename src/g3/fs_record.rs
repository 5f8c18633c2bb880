//! Which filesystem each path of a stripe set lives on, remembered outside the tier, so that a
//! restart that finds a path on another filesystem (its disk not mounted: the mount point is
//! now a bare directory on the root disk) refuses instead of creating a fresh tier on the wrong
//! disk (`docs/g3.md`, "The wrong disk"; the record's bytes are in `docs/format.md`).
//!
//! The record cannot live in the tier's own files: when the tier's filesystem is not mounted,
//! they are not there to read. It lives in kvtier's state directory ([`state_dir`]), one
//! small file per path, written when a set is created or formatted and when an existing set
//! opens without one (it gains it).
//!
//! **What identifies a filesystem** ([`FsIdentity::same_filesystem`]): its UUID
//! (`FS_IOC_GETFSUUID`, from the filesystem's own superblock: it survives reboots, remounts and
//! devices numbered differently), else `statfs`'s `f_fsid` (derived from the UUID on ext4 and
//! btrfs, from the device number on XFS), else the device number `st_dev`; the filesystem
//! type must match in every case. A mount id is new at every mount and says nothing across
//! restarts. A bare directory on the root disk gives the root filesystem's type, UUID and
//! `f_fsid`, never the tier's. Memory filesystems (tmpfs, ramfs) keep nothing across a mount,
//! so any mount of the same type is the same to them (a tmpfs remounted empty is where such a
//! tier belongs).

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{Error, ErrorKind, Result};
use crate::g3::format::{le_u32, le_u64};
use crate::io::{FilesystemFacts, filesystem_facts, probe::fs_type_name};

/// The environment variable naming kvtier's state directory (see [`state_dir`]).
pub const STATE_DIR_ENV: &str = "KVTIER_STATE_DIR";
/// The folder of the filesystem records inside the state directory.
pub const RECORDS_DIR_NAME: &str = "g3-filesystems";
/// Magic at offset 0 of a filesystem record.
pub const RECORD_MAGIC: [u8; 8] = *b"KVTG3FSR";
/// The record format version this build writes and reads.
pub const RECORD_VERSION: u32 = 1;
/// Bytes before the variable-length strings.
const FIXED_LEN: usize = 92;
/// The `mismatch` context value of the refusal of a path found on another filesystem.
pub const MISMATCH_FILESYSTEM: &str = "filesystem";

/// `statfs` magics of filesystems that keep nothing across a mount.
const VOLATILE: [u64; 2] = [0x0102_1994, 0x8584_58F6];

/// The filesystem holding a directory, as a record keeps it: the facts the I/O layer reads
/// ([`FilesystemFacts`]), compared by [`FsIdentity::same_filesystem`].
pub type FsIdentity = FilesystemFacts;

impl FsIdentity {
    /// The filesystem holding the directory `dir` now.
    pub fn of(dir: &Path) -> Result<Self> {
        filesystem_facts(dir)
    }

    /// Whether `self` and `other` are the same filesystem (see the module docs).
    pub fn same_filesystem(&self, other: &FsIdentity) -> bool {
        if self.fs_type != other.fs_type {
            return false;
        }
        if VOLATILE.contains(&self.fs_type) {
            return true;
        }
        // Where only one side has a UUID, fall through to the weaker identities.
        if let (Some(a), Some(b)) = (self.uuid, other.uuid) {
            return a == b;
        }
        if self.fsid != 0 && other.fsid != 0 {
            return self.fsid == other.fsid;
        }
        self.dev == other.dev
    }

    /// For messages: `ext4 (uuid 0123abcd-…, /dev/nvme0n1 mounted at /mnt/nvme0)`.
    pub fn describe(&self) -> String {
        let name = fs_type_name(self.fs_type);
        let id = match self.uuid {
            Some(u) => format!("uuid {}", uuid_text(&u)),
            None if self.fsid != 0 => format!("fsid {:016x}", self.fsid),
            None => format!(
                "device {}:{}",
                rustix::fs::major(self.dev),
                rustix::fs::minor(self.dev)
            ),
        };
        let place = match (self.source.is_empty(), self.mount_point.is_empty()) {
            (false, false) => format!(", {} mounted at {}", self.source, self.mount_point),
            (true, false) => format!(", mounted at {}", self.mount_point),
            _ => String::new(),
        };
        format!("{name} ({id}{place})")
    }
}

/// At most `u16::MAX` bytes of `b` (a record's string lengths are 16-bit).
fn clip(b: &[u8]) -> &[u8] {
    &b[..b.len().min(u16::MAX as usize)]
}

/// A UUID in its usual 8-4-4-4-12 spelling.
fn uuid_text(u: &[u8; 16]) -> String {
    let h = hex::encode(u);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// What is remembered about one path of a stripe set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsRecord {
    /// The stripe set the path held when recorded.
    pub set_uuid: [u8; 16],
    /// The path (canonical).
    pub path: PathBuf,
    /// Its filesystem.
    pub fs: FsIdentity,
    /// When recorded, seconds since the Unix epoch.
    pub recorded_unix_s: u64,
}

impl FsRecord {
    /// The record's bytes (`docs/format.md`, "Filesystem record"; little-endian).
    pub fn encode(&self) -> Vec<u8> {
        let path = self.path.as_os_str().as_bytes();
        let source = self.fs.source.as_bytes();
        let mount = self.fs.mount_point.as_bytes();
        let (path, source, mount) = (clip(path), clip(source), clip(mount));
        let len = FIXED_LEN + path.len() + source.len() + mount.len() + 4;
        let mut b = Vec::with_capacity(len);
        b.extend_from_slice(&RECORD_MAGIC);
        b.extend_from_slice(&RECORD_VERSION.to_le_bytes());
        b.extend_from_slice(&(len as u32).to_le_bytes());
        b.extend_from_slice(&self.set_uuid);
        b.extend_from_slice(&self.fs.fs_type.to_le_bytes());
        b.extend_from_slice(&self.fs.fsid.to_le_bytes());
        b.push(if self.fs.uuid.is_some() { 16 } else { 0 });
        b.extend_from_slice(&self.fs.uuid.unwrap_or([0; 16]));
        b.extend_from_slice(&[0; 3]);
        b.extend_from_slice(&self.fs.dev.to_le_bytes());
        b.extend_from_slice(&self.recorded_unix_s.to_le_bytes());
        for s in [path, source, mount] {
            b.extend_from_slice(&(s.len() as u16).to_le_bytes());
        }
        b.extend_from_slice(&[0; 2]);
        debug_assert_eq!(b.len(), FIXED_LEN);
        b.extend_from_slice(path);
        b.extend_from_slice(source);
        b.extend_from_slice(mount);
        let crc = crc32fast::hash(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes a record; `Err` says what is wrong (a record that does not decode is ignored,
    /// with a warning, and written again).
    pub fn decode(b: &[u8]) -> std::result::Result<Self, String> {
        if b.len() < FIXED_LEN + 4 {
            return Err(format!("{} bytes, shorter than a record", b.len()));
        }
        if b[0..8] != RECORD_MAGIC {
            return Err("bad magic".into());
        }
        let version = le_u32(b, 8);
        if version != RECORD_VERSION {
            return Err(format!("record version {version} is not {RECORD_VERSION}"));
        }
        let len = le_u32(b, 12) as usize;
        if len != b.len() {
            return Err(format!("length field {len}, file {} bytes", b.len()));
        }
        let crc = le_u32(b, len - 4);
        if crc != crc32fast::hash(&b[..len - 4]) {
            return Err("CRC mismatch".into());
        }
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]) as usize;
        let (pl, sl, ml) = (u16_at(84), u16_at(86), u16_at(88));
        if FIXED_LEN + pl + sl + ml + 4 != len {
            return Err("string lengths do not add up to the record length".into());
        }
        let mut set_uuid = [0u8; 16];
        set_uuid.copy_from_slice(&b[16..32]);
        let uuid = match b[48] {
            0 => None,
            16 => {
                let mut u = [0u8; 16];
                u.copy_from_slice(&b[49..65]);
                Some(u)
            }
            n => return Err(format!("uuid length {n}")),
        };
        let text = |from: usize, n: usize| String::from_utf8_lossy(&b[from..from + n]).into_owned();
        let path = PathBuf::from(std::ffi::OsStr::from_bytes(&b[FIXED_LEN..FIXED_LEN + pl]));
        Ok(FsRecord {
            set_uuid,
            path,
            fs: FsIdentity {
                fs_type: le_u64(b, 32),
                fsid: le_u64(b, 40),
                uuid,
                dev: le_u64(b, 68),
                source: text(FIXED_LEN + pl, sl),
                mount_point: text(FIXED_LEN + pl + sl, ml),
            },
            recorded_unix_s: le_u64(b, 76),
        })
    }
}

/// kvtier's state directory: `$KVTIER_STATE_DIR` when set; else `/var/lib/kvtier` for root;
/// else `$XDG_STATE_HOME/kvtier`, else `$HOME/.local/state/kvtier`. `None` when none of these
/// can be named.
pub fn state_dir() -> Option<PathBuf> {
    let set = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(d) = set(STATE_DIR_ENV) {
        return Some(PathBuf::from(d));
    }
    if rustix::process::geteuid().is_root() {
        return Some(PathBuf::from("/var/lib/kvtier"));
    }
    if let Some(x) = set("XDG_STATE_HOME") {
        return Some(PathBuf::from(x).join("kvtier"));
    }
    set("HOME").map(|h| PathBuf::from(h).join(".local/state/kvtier"))
}

/// The filesystem records of a state directory.
#[derive(Debug, Clone)]
pub struct Records {
    /// `<state dir>/g3-filesystems`.
    pub dir: PathBuf,
    /// The filesystem holding the state directory (its nearest existing ancestor): a path on
    /// that filesystem needs no record (an unmount cannot leave it behind while the record
    /// survives), so none is written for it.
    home: Option<FsIdentity>,
}

impl Records {
    /// The records of `state_dir`; `None` when there is no state directory.
    pub fn default_location() -> Option<Self> {
        state_dir().map(|d| Self::in_state_dir(&d))
    }

    /// The records of the state directory `state`.
    pub fn in_state_dir(state: &Path) -> Self {
        let home = state
            .ancestors()
            .find(|a| a.is_dir())
            .and_then(|a| FsIdentity::of(a).ok());
        Records {
            dir: state.join(RECORDS_DIR_NAME),
            home,
        }
    }

    /// The record file of `path` (canonical): named by a hash of the path.
    pub fn file_of(&self, path: &Path) -> PathBuf {
        let h = Sha256::digest(path.as_os_str().as_bytes());
        self.dir.join(format!("{}.fsrec", hex::encode(&h[..16])))
    }

    /// The record of `path`, if one was written. A record that cannot be read or decoded is
    /// ignored with a warning (it is written again when the set opens).
    pub fn read(&self, path: &Path) -> Option<FsRecord> {
        let file = self.file_of(path);
        let bytes = match std::fs::read(&file) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => {
                log::warn!(
                    "cannot read the filesystem record {} of G3 path {}: {e}; the path is \
                     opened without it",
                    file.display(),
                    path.display()
                );
                return None;
            }
        };
        match FsRecord::decode(&bytes) {
            Ok(r) if r.path == path => Some(r),
            Ok(r) => {
                log::warn!(
                    "filesystem record {} names {}, not {}; ignored",
                    file.display(),
                    r.path.display(),
                    path.display()
                );
                None
            }
            Err(why) => {
                log::warn!(
                    "filesystem record {} of G3 path {} is damaged ({why}); ignored and \
                     written again",
                    file.display(),
                    path.display()
                );
                None
            }
        }
    }

    /// Whether a path on `fs` needs a record (it is not on the state directory's own
    /// filesystem).
    pub fn needs_record(&self, fs: &FsIdentity) -> bool {
        self.home.as_ref().is_none_or(|h| !h.same_filesystem(fs))
    }

    /// Removes the record of `path` (canonical), for a tool that removes the tier it made
    /// (`kvtier bench`); none is fine.
    pub fn forget(&self, path: &Path) {
        let file = self.file_of(path);
        if let Err(e) = std::fs::remove_file(&file)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            log::warn!(
                "cannot remove the filesystem record {}: {e}",
                file.display()
            );
        }
    }

    /// Writes `rec` (temporary file, fsync, rename, directory fsync).
    pub fn write(&self, rec: &FsRecord) -> Result<()> {
        use std::io::Write;
        std::fs::create_dir_all(&self.dir).map_err(|e| Error::io("create", &self.dir, e))?;
        let file = self.file_of(&rec.path);
        let tmp = file.with_extension("fsrec.tmp");
        let mut f = std::fs::File::create(&tmp).map_err(|e| Error::io("create", &tmp, e))?;
        f.write_all(&rec.encode())
            .and_then(|()| f.sync_all())
            .map_err(|e| Error::io("write", &tmp, e))?;
        std::fs::rename(&tmp, &file).map_err(|e| Error::io("rename into", &file, e))?;
        std::fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| Error::io("fsync directory", &self.dir, e))
    }
}

/// The paths of a stripe set with their filesystems now and as recorded: what an open checks
/// before it creates or opens anything, and records after.
#[derive(Debug)]
pub struct FsGuard {
    records: Option<Records>,
    /// `(canonical path, filesystem now, record)` per path, in stripe order.
    paths: Vec<(PathBuf, FsIdentity, Option<FsRecord>)>,
}

impl FsGuard {
    /// Reads the filesystem of every directory of `dirs` (canonical paths) and its record in
    /// the default state directory.
    pub fn load(dirs: &[PathBuf]) -> Result<Self> {
        Self::load_with(dirs, Records::default_location())
    }

    /// [`FsGuard::load`] with the records of `records`.
    pub fn load_with(dirs: &[PathBuf], records: Option<Records>) -> Result<Self> {
        let paths = dirs
            .iter()
            .map(|d| {
                let now = FsIdentity::of(d)?;
                let rec = records.as_ref().and_then(|r| r.read(d));
                Ok((d.clone(), now, rec))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(FsGuard { records, paths })
    }

    /// Refuses when a path is on another filesystem than recorded, unless the slabs found
    /// there are the recorded set (`set_in(i)`: the set uuid of the slab in path `i`, if any):
    /// the tier moved with its files. The error names the path and both filesystems.
    pub fn check(&self, set_in: impl Fn(usize) -> Option<[u8; 16]>) -> Result<()> {
        for (i, (dir, now, rec)) in self.paths.iter().enumerate() {
            let Some(rec) = rec else { continue };
            if rec.fs.same_filesystem(now) || set_in(i) == Some(rec.set_uuid) {
                continue;
            }
            return Err(self.wrong_filesystem(dir, now, rec));
        }
        Ok(())
    }

    fn wrong_filesystem(&self, dir: &Path, now: &FsIdentity, rec: &FsRecord) -> Error {
        let all: Vec<String> = self
            .paths
            .iter()
            .map(|(d, _, _)| d.display().to_string())
            .collect();
        let file = self
            .records
            .as_ref()
            .map(|r| r.file_of(dir).display().to_string())
            .unwrap_or_default();
        Error::new(
            ErrorKind::InvalidPath,
            format!(
                "G3 path {} is on {}, but its tier (stripe set {}…) was created on {}: that \
                 filesystem is not mounted there (the path is now a directory of the one \
                 below), so kvtier creates nothing in it. Mount it and start again (nothing is \
                 lost). If the tier is to live on the new filesystem from now on (a replaced \
                 disk), `kvtier tier format {} --capacity SIZE --new-filesystem` creates an \
                 empty one there (record: {file})",
                dir.display(),
                now.describe(),
                hex::encode(&rec.set_uuid[..4]),
                rec.fs.describe(),
                all.join(" "),
            ),
        )
        .with("path", dir.display().to_string())
        .with("mismatch", MISMATCH_FILESYSTEM)
    }

    /// The paths whose filesystem is not the recorded one, with both: `(path, recorded, now)`.
    pub fn mismatches(&self) -> Vec<(PathBuf, FsIdentity, FsIdentity)> {
        self.paths
            .iter()
            .filter_map(|(d, now, rec)| {
                let rec = rec.as_ref()?;
                (!rec.fs.same_filesystem(now)).then(|| (d.clone(), rec.fs.clone(), now.clone()))
            })
            .collect()
    }

    /// Records that the paths hold the stripe set `set_uuid` on their filesystems now (paths
    /// on the state directory's own filesystem need none; an unchanged record is not
    /// rewritten). A failure is a warning: the tier runs, but a restart cannot then tell its
    /// filesystem from an empty directory there. Returns how many paths could not be recorded.
    pub fn record(&self, set_uuid: [u8; 16]) -> usize {
        let Some(records) = &self.records else {
            if let Some((d, _, _)) = self.paths.first() {
                log::warn!(
                    "no state directory (set {STATE_DIR_ENV}, or HOME) to record which \
                     filesystem G3 path {} is on: a restart cannot tell that filesystem, \
                     unmounted, from an empty directory there",
                    d.display()
                );
            }
            return self.paths.len();
        };
        let now_s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut failed = 0;
        for (dir, now, rec) in &self.paths {
            let unchanged = rec
                .as_ref()
                .is_some_and(|r| r.set_uuid == set_uuid && r.fs.same_filesystem(now));
            if unchanged || (rec.is_none() && !records.needs_record(now)) {
                continue;
            }
            let new = FsRecord {
                set_uuid,
                path: dir.clone(),
                fs: now.clone(),
                recorded_unix_s: now_s,
            };
            match records.write(&new) {
                Ok(()) => log::info!(
                    "recorded G3 path {} on {} in {}",
                    dir.display(),
                    now.describe(),
                    records.file_of(dir).display()
                ),
                Err(e) => {
                    failed += 1;
                    log::warn!(
                        "cannot record which filesystem G3 path {} is on ({e}): a restart \
                         cannot tell that filesystem, unmounted, from an empty directory there",
                        dir.display()
                    );
                }
            }
        }
        failed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ident(fs_type: u64, fsid: u64, uuid: Option<[u8; 16]>, dev: u64) -> FsIdentity {
        FsIdentity {
            fs_type,
            fsid,
            uuid,
            dev,
            source: "/dev/x".into(),
            mount_point: "/mnt/x".into(),
        }
    }

    #[test]
    fn record_golden_bytes_and_round_trip() {
        let rec = FsRecord {
            set_uuid: [0x11; 16],
            path: PathBuf::from("/mnt/a"),
            fs: FsIdentity {
                fs_type: 0xEF53,
                fsid: 0x0102_0304_0506_0708,
                uuid: Some([0xAB; 16]),
                dev: 0x0700_0003,
                source: "/dev/sdb".into(),
                mount_point: "/mnt".into(),
            },
            recorded_unix_s: 1_800_000_000,
        };
        let b = rec.encode();
        assert_eq!(b.len(), 114);
        assert_eq!(&b[0..8], b"KVTG3FSR");
        assert_eq!(hex::encode(&b[8..16]), "0100000072000000");
        assert_eq!(b[16..32], [0x11; 16]);
        assert_eq!(hex::encode(&b[32..48]), "53ef0000000000000807060504030201");
        assert_eq!(b[48], 16);
        assert_eq!(b[49..65], [0xAB; 16]);
        assert_eq!(b[65..68], [0; 3]);
        assert_eq!(hex::encode(&b[68..84]), "030000070000000000d2496b00000000");
        assert_eq!(hex::encode(&b[84..92]), "0600080004000000");
        assert_eq!(&b[92..110], b"/mnt/a/dev/sdb/mnt");
        assert_eq!(le_u32(&b, 110), crc32fast::hash(&b[..110]));
        assert_eq!(FsRecord::decode(&b).unwrap(), rec);
        let mut bad = b.clone();
        bad[40] ^= 1;
        assert!(FsRecord::decode(&bad).unwrap_err().contains("CRC"));
        assert!(FsRecord::decode(&b[..50]).is_err());
    }

    #[test]
    fn what_counts_as_the_same_filesystem() {
        let u1 = Some([1; 16]);
        let u2 = Some([2; 16]);
        // The UUID decides where both have one (a renumbered device keeps it).
        assert!(ident(0xEF53, 5, u1, 1).same_filesystem(&ident(0xEF53, 6, u1, 2)));
        assert!(!ident(0xEF53, 5, u1, 1).same_filesystem(&ident(0xEF53, 5, u2, 1)));
        // Else f_fsid, else st_dev.
        assert!(ident(0xEF53, 5, None, 1).same_filesystem(&ident(0xEF53, 5, u1, 2)));
        assert!(!ident(0xEF53, 5, None, 1).same_filesystem(&ident(0xEF53, 6, None, 1)));
        assert!(ident(0xEF53, 0, None, 1).same_filesystem(&ident(0xEF53, 0, None, 1)));
        assert!(!ident(0xEF53, 0, None, 1).same_filesystem(&ident(0xEF53, 0, None, 2)));
        // Another type is never the same; a memory filesystem is any mount of its type.
        assert!(!ident(0xEF53, 5, u1, 1).same_filesystem(&ident(0x5846_5342, 5, u1, 1)));
        assert!(ident(0x0102_1994, 5, u1, 1).same_filesystem(&ident(0x0102_1994, 6, u2, 2)));
    }

    #[test]
    fn a_fresh_directory_elsewhere_is_another_filesystem_than_dev_shm() {
        let shm = Path::new("/dev/shm");
        let (Ok(a), Ok(b)) = (FsIdentity::of(shm), FsIdentity::of(Path::new("/tmp"))) else {
            crate::skip_test!("no /dev/shm or /tmp here");
            return;
        };
        if a.fs_type == b.fs_type {
            crate::skip_test!("/tmp is on the same kind of filesystem as /dev/shm here");
            return;
        }
        assert!(!a.same_filesystem(&b));
        assert!(a.same_filesystem(&FsIdentity::of(shm).unwrap()));
        assert!(a.describe().starts_with("tmpfs ("), "{}", a.describe());
    }
}
