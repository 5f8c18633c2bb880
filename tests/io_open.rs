//! `open_engine`: what `auto` picks, what the info says, and the unregistered-buffer fallback
//! when the region is file-backed memory (io_uring refuses to register it with EFAULT).

mod io_common;

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use io_common::open_direct;
use kvtier::ErrorKind;
use kvtier::io::{
    EngineOptions, FaultPlan, FaultyEngine, IoDir, IoEngineKind, IoRequest, open_engine,
    probe_io_uring,
};
use kvtier::region::PrimaryRegion;

#[test]
fn auto_picks_uring_with_fixed_buffers_or_says_why_not() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let file = open_direct(&dir.path().join("slab"));
    let region = Arc::new(PrimaryRegion::create(4, 8192).unwrap());
    let h = open_engine(
        IoEngineKind::Auto,
        region,
        vec![file],
        &EngineOptions::default(),
    )
    .unwrap();
    match probe_io_uring() {
        Ok(()) if h.info.kind == IoEngineKind::Uring => {
            assert_eq!(h.info.name, "uring");
            assert_eq!(h.engine.name(), "uring");
            assert!(h.info.fixed_buffers, "auto never runs uring unregistered");
            assert_eq!(h.info.fallback_reason, None);
        }
        Ok(()) => {
            // A 32 KiB region only fails to register under an unusually small memlock limit.
            let reason = h.info.fallback_reason.clone().unwrap();
            eprintln!("note: io_uring works but registration failed: {reason}");
            assert!(reason.contains("fixed buffers failed"), "{reason}");
        }
        Err(why) => {
            eprintln!("note: io_uring unavailable here ({why}); checking the psync fallback");
            assert_eq!(h.info.kind, IoEngineKind::Psync);
            assert!(h.info.fallback_reason.unwrap().contains("psync"));
        }
    }
    h.engine.shutdown();
}

#[test]
fn psync_when_asked_and_zero_queue_depth_refused() {
    let region = Arc::new(PrimaryRegion::create(1, 4096).unwrap());
    let h = open_engine(
        IoEngineKind::Psync,
        region.clone(),
        vec![],
        &EngineOptions::default(),
    )
    .unwrap();
    assert_eq!(
        (h.info.kind, h.info.fixed_buffers, h.info.fallback_reason),
        (IoEngineKind::Psync, false, None)
    );
    let opts = EngineOptions {
        queue_depth: 0,
        ..EngineOptions::default()
    };
    let e = open_engine(IoEngineKind::Uring, region, vec![], &opts).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
}

#[test]
fn faulty_wrapper_keeps_info_and_prefixes_name() {
    let region = Arc::new(PrimaryRegion::create(1, 4096).unwrap());
    let h = open_engine(
        IoEngineKind::Psync,
        region,
        vec![],
        &EngineOptions::default(),
    )
    .unwrap();
    let w = FaultyEngine::wrap_handle(h, FaultPlan::new()).unwrap();
    assert_eq!(w.info.name, "faulty(psync)");
    assert_eq!(w.engine.name(), "faulty(psync)");
    assert_eq!(w.info.kind, IoEngineKind::Psync);
}

/// An ext4-file-backed MAP_SHARED mapping cannot be registered (EFAULT): the uring engine says
/// so, runs unregistered READ/WRITE, and still moves the bytes.
#[test]
fn file_backed_region_falls_back_to_unregistered_buffers() {
    if let Err(why) = probe_io_uring() {
        kvtier::skip_test!("io_uring unavailable here: {why}");
        return;
    }
    const LEN: usize = 4 * 4096;
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let backing = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(dir.path().join("backing"))
        .unwrap();
    backing.set_len(LEN as u64).unwrap();
    // SAFETY: maps LEN bytes of a file we just sized; checked for MAP_FAILED below.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            LEN,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            backing.as_raw_fd(),
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    struct Unmap(*mut libc::c_void);
    impl Drop for Unmap {
        fn drop(&mut self) {
            // SAFETY: unmaps exactly the mapping made above, after every user let go.
            unsafe { libc::munmap(self.0, LEN) };
        }
    }
    let unmap = Unmap(base);
    // SAFETY: the mapping outlives the region and the engine (both dropped before `unmap`).
    let region = Arc::new(unsafe { PrimaryRegion::adopt(base.cast(), 4096, 4) }.unwrap());
    let file = open_direct(&dir.path().join("slab"));
    let h = open_engine(
        IoEngineKind::Uring,
        region.clone(),
        vec![file],
        &EngineOptions::default(),
    )
    .unwrap();
    assert!(!h.info.fixed_buffers, "file-backed memory registered?");
    let reason = h.info.fallback_reason.clone().unwrap();
    assert!(reason.contains("fixed buffers failed"), "{reason}");
    // No transfer in flight; the test owns the region.
    region.write_row(0).unwrap().fill(0xC3);
    let w = IoRequest {
        dir: IoDir::Write,
        file: 0,
        file_offset: 8192,
        region_offset: 0,
        len: 4096,
        tag: 1,
    };
    let r = IoRequest {
        dir: IoDir::Read,
        region_offset: 4096 * 3,
        tag: 2,
        ..w
    };
    for req in [w, r] {
        h.engine.submit(&[req]).unwrap();
        let c = h
            .engine
            .completions()
            .recv_timeout(Duration::from_secs(30))
            .unwrap();
        assert_eq!(c.tag, req.tag);
        assert_eq!(c.result.unwrap(), 4096);
    }
    // The read has completed.
    assert!(region.read_row(3).unwrap().iter().all(|&b| b == 0xC3));
    h.engine.shutdown();
    drop(h);
    // `auto` does not settle for unregistered buffers: it runs psync and says why.
    let file = open_direct(&dir.path().join("slab"));
    let auto = open_engine(
        IoEngineKind::Auto,
        region.clone(),
        vec![file],
        &EngineOptions::default(),
    )
    .unwrap();
    assert_eq!(auto.info.kind, IoEngineKind::Psync);
    let reason = auto.info.fallback_reason.clone().unwrap();
    assert!(
        reason.contains("fixed buffers failed") && reason.contains("psync"),
        "{reason}"
    );
    auto.engine.submit(&[IoRequest { tag: 3, ..r }]).unwrap();
    let c = auto
        .engine
        .completions()
        .recv_timeout(Duration::from_secs(30))
        .unwrap();
    assert_eq!((c.tag, c.result.unwrap()), (3, 4096));
    auto.engine.shutdown();
    drop(auto);
    drop(region);
    drop(unmap);
}

/// Under a locked-memory limit (a non-root user without CAP_IPC_LOCK: 8 MiB here), registering
/// a larger region fails with ENOMEM: explicit `uring` runs unregistered and says so, `auto`
/// picks psync. As root the limit does not apply, so the test re-runs itself as `nobody`.
#[test]
fn memlock_limit_enomem_falls_back() {
    const CHILD: &str = "KVTIER_IO_ENOMEM_CHILD";
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if std::env::var_os(CHILD).is_some() || !root {
        enomem_body();
        return;
    }
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args(["--exact", "memlock_limit_enomem_falls_back", "--nocapture"])
        .env(CHILD, "1")
        .current_dir("/tmp")
        .uid(65534)
        .gid(65534)
        .output();
    let out = match out {
        Ok(o) => o,
        Err(e) => {
            kvtier::skip_test!("cannot re-run the test as nobody: {e}");
            return;
        }
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprint!("{stderr}");
    assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("1 passed") || stderr.contains("1 passed"),
        "the child did not run the test:\n{stdout}"
    );
}

fn enomem_body() {
    if let Err(why) = probe_io_uring() {
        kvtier::skip_test!("io_uring unavailable here: {why}");
        return;
    }
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid out-pointer.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) };
    assert_eq!(rc, 0);
    if lim.rlim_cur == libc::RLIM_INFINITY || lim.rlim_cur > (64 << 20) {
        eprintln!(
            "SKIP: RLIMIT_MEMLOCK is {} here; too large to exceed cheaply",
            lim.rlim_cur
        );
        return;
    }
    let stride = 1 << 20;
    let rows = (lim.rlim_cur as usize).div_ceil(stride) + 4;
    let region = Arc::new(PrimaryRegion::create(rows, stride as u64).unwrap());
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let file = open_direct(&dir.path().join("slab"));
    let h = open_engine(
        IoEngineKind::Uring,
        region.clone(),
        vec![file],
        &EngineOptions::default(),
    )
    .unwrap();
    if h.info.fixed_buffers {
        kvtier::skip_test!(
            "a {rows} MiB region registered despite the memlock limit (CAP_IPC_LOCK?)"
        );
        return;
    }
    let reason = h.info.fallback_reason.clone().unwrap();
    eprintln!("uring fallback as uid {}: {reason}", effective_uid());
    assert!(reason.contains("RLIMIT_MEMLOCK"), "{reason}");
    let w = IoRequest {
        dir: IoDir::Write,
        file: 0,
        file_offset: 0,
        region_offset: stride,
        len: stride,
        tag: 1,
    };
    h.engine.submit(&[w]).unwrap();
    let c = h
        .engine
        .completions()
        .recv_timeout(Duration::from_secs(30))
        .unwrap();
    assert_eq!((c.tag, c.result.unwrap()), (1, stride));
    h.engine.shutdown();
    drop(h);
    let file = open_direct(&dir.path().join("slab"));
    let auto = open_engine(
        IoEngineKind::Auto,
        region,
        vec![file],
        &EngineOptions::default(),
    )
    .unwrap();
    assert_eq!(auto.info.kind, IoEngineKind::Psync);
    assert!(
        auto.info
            .fallback_reason
            .unwrap()
            .contains("RLIMIT_MEMLOCK")
    );
}

fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}
