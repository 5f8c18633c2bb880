//! Regions that map another process's shared file ([`PrimaryRegion::map_shared_file`]): the
//! node service's view of an engine's rows.

use std::os::fd::AsFd;
use std::ptr::NonNull;

use super::{
    Backing, HOST_FIX_HINT, PrefaultMethod, PrimaryRegion, check_geometry, huge_pages, rows,
    shared_alias,
};
use crate::error::{Error, ErrorKind, Result};

impl PrimaryRegion {
    /// Maps `num_rows * row_stride` bytes of another process's shared file (vLLM's
    /// `/dev/shm/vllm_offload_<engine_id>.mmap`, or a memfd passed over a Unix socket)
    /// `MAP_SHARED`, read and write, from file offset 0, so that rows written here are the
    /// owner's rows. The file must already be that large (a shorter file is refused: touching
    /// a page beyond its end would be `SIGBUS`). The mapping is removed when the region is
    /// dropped (after every I/O engine holding it has stopped).
    ///
    /// Like [`PrimaryRegion::adopt_shared`], the mapping starts at a 2 MiB boundary and, when
    /// the file is on tmpfs (vLLM's `/dev/shm` region, a memfd), is collapsed into 2 MiB pages
    /// (`MADV_COLLAPSE`: the data stays, the owner's mapping sees the same bytes, now
    /// physically contiguous), so that a large row is one DMA segment per 2 MiB. Where that
    /// fails, the outcome is logged once and readable from [`PrimaryRegion::huge_page_share`]
    /// and [`PrimaryRegion::small_pages_reason`].
    ///
    /// The owner must not shrink the file while it is mapped here (a tmpfs file cannot be
    /// sealed); the node service only maps files of peers on its uid allow list.
    pub fn map_shared_file(fd: &impl AsFd, num_rows: usize, row_stride: u64) -> Result<Self> {
        let (row_stride, len) = check_geometry(row_stride, num_rows)?;
        let st = rustix::fs::fstat(fd).map_err(|e| {
            Error::new(ErrorKind::Io, "fstat of the region file failed")
                .with_source(std::io::Error::from(e))
        })?;
        let file_type = rustix::fs::FileType::from_raw_mode(st.st_mode);
        if file_type != rustix::fs::FileType::RegularFile {
            return Err(Error::new(
                ErrorKind::InvalidPath,
                format!("the region file is a {file_type:?}, not a regular file"),
            ));
        }
        let size = u64::try_from(st.st_size).unwrap_or(0);
        if size < len as u64 {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "the region file holds {size} bytes, fewer than the {num_rows} rows of \
                     {row_stride} bytes ({len} bytes) registered"
                ),
            ));
        }
        // As `adopt_shared` does for the in-process tier: a mapping at a 2 MiB boundary,
        // collapsed into huge pages where the file is on tmpfs (vLLM's `/dev/shm` region, a
        // memfd), so that a large row is one DMA segment per 2 MiB.
        match shared_alias::map_collapsed(fd.as_fd(), 0, len, "the region file") {
            Ok(m) => {
                let mut region = PrimaryRegion {
                    base: NonNull::new(m.alias.base).ok_or_else(|| {
                        Error::new(ErrorKind::Internal, "the region mapping is null")
                    })?,
                    row_stride,
                    num_rows,
                    backing: Backing::AdoptedAlias { _alias: m.alias },
                    prefault: PrefaultMethod::None,
                    huge_pages: m.shortfall.is_none(),
                    small_pages_reason: None,
                    huge_page_share: m.share,
                    measured: m.measured,
                    // Only a region that may be staged needs it (`shared_file`).
                    copy_fd: m
                        .shortfall
                        .is_some()
                        .then(|| fd.as_fd().try_clone_to_owned().ok())
                        .flatten(),
                    collapser: m.collapser,
                    leases: rows::Leases::new(num_rows),
                };
                let how = if m.already_huge {
                    "already 2 MiB pages: the file's tmpfs gives them"
                } else {
                    "collapsed with MADV_COLLAPSE"
                };
                match &m.shortfall {
                    None => log::info!(
                        "mapped an engine's region ({len} bytes) in 2 MiB pages (measured in \
                         /proc/self/smaps; {how}; the owner's mapping is unchanged)"
                    ),
                    Some(why) => log::warn!(
                        "mapped an engine's region ({len} bytes) with {:.0} % of it in 2 MiB \
                         pages (measured in /proc/self/smaps): {why}; large rows there are \
                         staged through kvtier's own 2 MiB pages (a copy); {HOST_FIX_HINT}",
                        m.share * 100.0
                    ),
                }
                region.small_pages_reason = m.shortfall;
                return Ok(region);
            }
            Err(why) if len >= huge_pages::HUGE_PAGE => {
                log::warn!(
                    "mapped an engine's region ({len} bytes) in 4 KiB pages: {why}; {HOST_FIX_HINT}"
                )
            }
            Err(_) => {}
        }
        Self::map_shared_small(fd, num_rows, row_stride, len)
    }

    /// [`PrimaryRegion::map_shared_file`] where no 2 MiB mapping can be made: a mapping at
    /// an address of the kernel's choosing.
    fn map_shared_small(
        fd: &impl AsFd,
        num_rows: usize,
        row_stride: usize,
        len: usize,
    ) -> Result<Self> {
        // SAFETY: a fresh mapping at an address of the kernel's choosing of `len` bytes of a
        // file at least that long; nothing else refers to the new range.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::SHARED,
                fd,
                0,
            )
        }
        .map_err(|e| {
            Error::new(
                ErrorKind::NoSpace,
                format!("cannot map the region file ({len} bytes)"),
            )
            .with_source(std::io::Error::from(e))
        })?;
        let base = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| Error::new(ErrorKind::Internal, "mmap returned a null address"))?;
        Ok(PrimaryRegion {
            base,
            row_stride,
            num_rows,
            backing: Backing::SharedFile,
            prefault: PrefaultMethod::None,
            huge_pages: false,
            small_pages_reason: Some(if len < huge_pages::HUGE_PAGE {
                "the region is smaller than one 2 MiB page".to_string()
            } else {
                "no 2 MiB-aligned mapping could be made (see the log)".to_string()
            }),
            huge_page_share: 0.0,
            measured: None,
            // Only a region that may be staged needs it (`shared_file`).
            copy_fd: (len >= huge_pages::HUGE_PAGE)
                .then(|| fd.as_fd().try_clone_to_owned().ok())
                .flatten(),
            collapser: None,
            leases: rows::Leases::new(num_rows),
        })
    }
}
