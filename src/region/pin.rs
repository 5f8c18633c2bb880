//! A long-term pin of a mapping's pages, as `cudaHostRegister` takes one on vLLM's region.
//!
//! vLLM 0.33's GPU workers pin their shared offload region with `cudaHostRegister`
//! (`vllm/v1/kv_offload/cpu/host_register.py`, called from `create_worker` in
//! `kv_offload/cpu/gpu_worker.py`) when they register their KV caches, before the scheduler
//! builds its secondary tiers, so kvtier always adopts pages that are already pinned. The NVIDIA
//! driver pins with `pin_user_pages(FOLL_WRITE | FOLL_LONGTERM)`; an io_uring fixed-buffer
//! registration of the same range takes exactly that pin (`io_pin_pages`), so a ring that holds
//! the range registered is a faithful stand-in without a GPU. While it is held the pages cannot
//! be migrated or collapsed (`MADV_COLLAPSE` answers EAGAIN), which is the case kvtier must run
//! well in.

use io_uring::IoUring;

/// The largest single registered buffer the kernel accepts.
pub(crate) const MAX_REGISTERED_BUFFER: usize = 1 << 30;

/// The pin; released (buffers unregistered with the ring) on drop.
pub(super) struct LongTermPin {
    _ring: IoUring,
}

impl std::fmt::Debug for LongTermPin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LongTermPin")
    }
}

impl LongTermPin {
    /// Pins `[base, base + len)` (FOLL_LONGTERM) for as long as the value lives.
    ///
    /// # Safety
    /// The range is a mapping of this process that stays mapped until the value is dropped.
    pub(super) unsafe fn new(base: *mut u8, len: usize) -> std::io::Result<Self> {
        let ring = IoUring::new(2)?;
        let iovecs: Vec<libc::iovec> = (0..len)
            .step_by(MAX_REGISTERED_BUFFER)
            .map(|off| libc::iovec {
                // SAFETY: `off < len`, inside the caller's mapping.
                iov_base: unsafe { base.add(off) }.cast(),
                iov_len: MAX_REGISTERED_BUFFER.min(len - off),
            })
            .collect();
        // SAFETY: every iovec lies inside the caller's mapping, which outlives the ring (the
        // caller's promise); the ring never transfers into them, it only holds the pin.
        unsafe { ring.submitter().register_buffers(&iovecs) }?;
        Ok(LongTermPin { _ring: ring })
    }
}
