//! Peer-to-peer or compatibility mode: what cuFile will do for a slab on a given filesystem,
//! from its driver properties and whether nvidia-fs is loaded.
//!
//! Without nvidia-fs, or on a filesystem cuFile does not drive directly, libcufile silently
//! runs in compatibility mode (POSIX I/O through its own host bounce buffers) when
//! `/etc/cufile.json` allows it, and fails otherwise. kvtier reports which one applies instead
//! of calling both "GDS".

/// How cuFile moves a slab's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferMode {
    /// DMA between the GPU and the NVMe device (nvidia-fs, supported filesystem).
    PeerToPeer,
    /// cuFile's compatibility mode: POSIX I/O through host bounce buffers.
    Compat,
}

impl TransferMode {
    /// The metric and report label: `p2p` or `compat`.
    pub fn as_str(self) -> &'static str {
        match self {
            TransferMode::PeerToPeer => "p2p",
            TransferMode::Compat => "compat",
        }
    }
}

/// How cuFile treats a filesystem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FsClass {
    /// A local block filesystem cuFile drives peer-to-peer on NVMe (ext4, xfs).
    LocalBlock(&'static str),
    /// A distributed filesystem with a cuFile status flag (NFS, Lustre, GPFS, BeeGFS).
    Distributed(&'static str, u32),
    /// Cannot back GDS at all (tmpfs, ramfs, overlayfs, pseudo filesystems).
    Unsupported(&'static str),
    /// Anything else: compatibility mode at best.
    Other(String),
}

/// Bits of `CUfileDrvProps.nvfs.dstatusflags` (`1 << CUfileDriverStatusFlags`).
pub mod status_bit {
    /// `CU_FILE_LUSTRE_SUPPORTED`.
    pub const LUSTRE: u32 = 0;
    /// `CU_FILE_NFS_SUPPORTED`.
    pub const NFS: u32 = 2;
    /// `CU_FILE_GPFS_SUPPORTED`.
    pub const GPFS: u32 = 3;
    /// `CU_FILE_NVME_SUPPORTED`.
    pub const NVME: u32 = 4;
    /// `CU_FILE_BEEGFS_SUPPORTED`.
    pub const BEEGFS: u32 = 9;
}

/// Bit of `CUfileDrvProps.nvfs.dcontrolflags`: `CU_FILE_ALLOW_COMPAT_MODE`.
pub const CONTROL_ALLOW_COMPAT: u32 = 1;

/// Classifies a filesystem by its `statfs` magic.
pub fn classify_fs(magic: u64) -> FsClass {
    match magic {
        0xef53 => FsClass::LocalBlock("ext4"),
        0x5846_5342 => FsClass::LocalBlock("xfs"),
        0x6969 => FsClass::Distributed("nfs", status_bit::NFS),
        0x0bd0_0bd0 => FsClass::Distributed("lustre", status_bit::LUSTRE),
        0x4750_4653 => FsClass::Distributed("gpfs", status_bit::GPFS),
        0x1983_0326 => FsClass::Distributed("beegfs", status_bit::BEEGFS),
        0x0102_1994 => FsClass::Unsupported("tmpfs"),
        0x8584_58f6 => FsClass::Unsupported("ramfs"),
        0x794c_7630 => FsClass::Unsupported("overlayfs"),
        0x9fa0 => FsClass::Unsupported("proc"),
        0x6265_6572 => FsClass::Unsupported("sysfs"),
        other => FsClass::Other(format!("filesystem 0x{other:x}")),
    }
}

/// What the cuFile driver reported (`cuFileDriverGetProperties`) plus nvidia-fs' presence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DriverFacts {
    /// nvidia-fs is loaded (`/proc/driver/nvidia-fs` exists, driver version non-zero).
    pub nvidia_fs: bool,
    /// `nvfs.dstatusflags`.
    pub status_flags: u32,
    /// `nvfs.dcontrolflags`.
    pub control_flags: u32,
}

impl DriverFacts {
    fn supports(&self, bit: u32) -> bool {
        self.status_flags & (1 << bit) != 0
    }

    fn compat_allowed(&self) -> bool {
        self.control_flags & (1 << CONTROL_ALLOW_COMPAT) != 0
    }
}

/// The mode cuFile will use for a slab on `fs`, with the reason when it is not peer-to-peer,
/// or why GDS cannot run there at all (`Err`).
pub fn decide(facts: &DriverFacts, fs: &FsClass) -> Result<(TransferMode, String), String> {
    let compat = |why: String| {
        if facts.compat_allowed() {
            Ok((TransferMode::Compat, why))
        } else {
            Err(format!(
                "{why}, and cuFile's compatibility mode is disabled (allow_compat_mode in \
                 cufile.json)"
            ))
        }
    };
    match fs {
        FsClass::Unsupported(name) => Err(format!("{name} cannot back GPUDirect Storage")),
        _ if !facts.nvidia_fs => compat("the nvidia-fs kernel module is not loaded".into()),
        FsClass::LocalBlock(name) if facts.supports(status_bit::NVME) => Ok((
            TransferMode::PeerToPeer,
            format!("{name} on NVMe, nvidia-fs loaded"),
        )),
        FsClass::LocalBlock(name) => compat(format!(
            "cuFile reports no NVMe support for {name} (dstatusflags)"
        )),
        FsClass::Distributed(name, bit) if facts.supports(*bit) => Ok((
            TransferMode::PeerToPeer,
            format!("{name}, supported by cuFile"),
        )),
        FsClass::Distributed(name, _) => compat(format!("cuFile reports no support for {name}")),
        FsClass::Other(name) => {
            compat(format!("{name} is not a filesystem cuFile drives directly"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NVME: u32 = 1 << status_bit::NVME;
    const COMPAT: u32 = 1 << CONTROL_ALLOW_COMPAT;

    fn facts(nvidia_fs: bool, status_flags: u32, control_flags: u32) -> DriverFacts {
        DriverFacts {
            nvidia_fs,
            status_flags,
            control_flags,
        }
    }

    #[test]
    fn ext4_on_nvme_with_nvidia_fs_is_peer_to_peer() {
        let (m, _) = decide(&facts(true, NVME, COMPAT), &classify_fs(0xef53)).unwrap();
        assert_eq!(m, TransferMode::PeerToPeer);
        let (m, _) = decide(&facts(true, NVME, 0), &classify_fs(0x5846_5342)).unwrap();
        assert_eq!(m, TransferMode::PeerToPeer);
    }

    #[test]
    fn without_nvidia_fs_it_is_compat_or_nothing() {
        let (m, why) = decide(&facts(false, NVME, COMPAT), &classify_fs(0xef53)).unwrap();
        assert_eq!((m, why.contains("nvidia-fs")), (TransferMode::Compat, true));
        let e = decide(&facts(false, NVME, 0), &classify_fs(0xef53)).unwrap_err();
        assert!(e.contains("allow_compat_mode"), "{e}");
        // No NVMe support reported, or an unknown filesystem: compat.
        assert_eq!(
            decide(&facts(true, 0, COMPAT), &classify_fs(0xef53))
                .unwrap()
                .0,
            TransferMode::Compat
        );
        assert_eq!(
            decide(&facts(true, NVME, COMPAT), &classify_fs(0x9123_683e))
                .unwrap()
                .0,
            TransferMode::Compat
        );
        // Distributed filesystems follow their own status bit.
        let nfs = 1 << status_bit::NFS;
        assert_eq!(
            decide(&facts(true, nfs, 0), &classify_fs(0x6969))
                .unwrap()
                .0,
            TransferMode::PeerToPeer
        );
        assert!(decide(&facts(true, NVME, 0), &classify_fs(0x6969)).is_err());
    }

    #[test]
    fn memory_and_overlay_filesystems_cannot_back_gds() {
        for magic in [0x0102_1994u64, 0x8584_58f6, 0x794c_7630] {
            let e = decide(&facts(true, NVME, COMPAT), &classify_fs(magic)).unwrap_err();
            assert!(e.contains("cannot back"), "{e}");
        }
    }
}
