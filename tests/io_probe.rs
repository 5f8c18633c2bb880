//! Path and io_uring probes: what they report on ext4 (/tmp), tmpfs (/dev/shm) and ramfs (no
//! O_DIRECT), and the errors for missing, non-directory and unwritable paths.

use std::path::Path;

use kvtier::ErrorKind;
use kvtier::io::probe::fs_type_name;
use kvtier::io::{probe_direct_io, probe_io_uring};

fn no_probe_files_left(dir: &Path) {
    let left: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(".kvtier-probe"))
        .collect();
    assert!(left.is_empty(), "probe files left behind: {left:?}");
}

#[test]
fn tmp_supports_direct_io_and_enforces_alignment() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let p = probe_direct_io(dir.path()).unwrap();
    no_probe_files_left(dir.path());
    eprintln!("/tmp probe: {p:?}");
    if p.fs_type == "tmpfs" {
        kvtier::skip_test!("/tmp is tmpfs here, which does not enforce O_DIRECT alignment");
        return;
    }
    assert!(p.o_direct, "{p:?}");
    assert!(p.o_direct_error.is_none());
    assert!(p.require_direct_io().is_ok());
    assert!(
        p.enforces_alignment,
        "{} accepted a misaligned O_DIRECT write",
        p.fs_type
    );
    if let (Some(mem), Some(off)) = (p.dio_mem_align, p.dio_offset_align) {
        for a in [mem, off] {
            assert!(a.is_power_of_two() && a <= 4096, "{p:?}");
        }
    } else {
        eprintln!(
            "note: statx reports no DIO alignment for {} here",
            p.fs_type
        );
    }
    assert_eq!(fs_type_name(p.fs_magic), p.fs_type);
}

#[test]
fn tmpfs_accepts_o_direct_without_enforcing_alignment() {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        kvtier::skip_test!("no /dev/shm here");
        return;
    }
    let dir = tempfile::tempdir_in(shm).unwrap();
    let p = probe_direct_io(dir.path()).unwrap();
    no_probe_files_left(dir.path());
    if p.fs_type != "tmpfs" {
        kvtier::skip_test!("/dev/shm is {} here, not tmpfs", p.fs_type);
        return;
    }
    if !p.o_direct {
        eprintln!(
            "SKIP: this kernel's tmpfs refuses O_DIRECT: {:?}",
            p.o_direct_error
        );
        return;
    }
    assert!(!p.enforces_alignment, "{p:?}");
    assert_eq!(p.dio_offset_align, None, "{p:?}");
}

/// A ramfs mount refuses O_DIRECT opens (EINVAL): the probe reports it and
/// `require_direct_io` names the path and filesystem. Needs permission to mount.
#[test]
fn ramfs_refuses_o_direct_and_require_names_path_and_fs() {
    struct Unmount(std::ffi::CString);
    impl Drop for Unmount {
        fn drop(&mut self) {
            // SAFETY: `self.0` is a NUL-terminated path we mounted on.
            unsafe { libc::umount2(self.0.as_ptr(), libc::MNT_DETACH) };
        }
    }
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let target = std::ffi::CString::new(dir.path().to_str().unwrap()).unwrap();
    // SAFETY: all pointers are NUL-terminated strings or null (no mount data).
    let rc = unsafe {
        libc::mount(
            c"ramfs".as_ptr(),
            target.as_ptr(),
            c"ramfs".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        eprintln!(
            "SKIP: cannot mount a ramfs to test a filesystem without O_DIRECT: {}",
            std::io::Error::last_os_error()
        );
        return;
    }
    let _unmount = Unmount(target);
    let p = probe_direct_io(dir.path()).unwrap();
    no_probe_files_left(dir.path());
    assert_eq!(p.fs_type, "ramfs");
    assert!(!p.o_direct, "{p:?}");
    assert!(!p.enforces_alignment);
    let why = p.o_direct_error.as_deref().unwrap();
    assert!(why.contains("EINVAL"), "{why}");
    let e = p.require_direct_io().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    let msg = e.to_string();
    assert!(
        msg.contains(dir.path().to_str().unwrap()) && msg.contains("ramfs"),
        "{msg}"
    );
}

#[test]
fn missing_path_is_an_error_naming_it() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let missing = dir.path().join("nope");
    let e = probe_direct_io(&missing).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidPath);
    let msg = e.to_string();
    assert!(
        msg.contains(missing.to_str().unwrap()) && msg.contains("does not exist"),
        "{msg}"
    );
}

#[test]
fn file_is_not_a_directory() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let file = dir.path().join("f");
    std::fs::write(&file, b"x").unwrap();
    let e = probe_direct_io(&file).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidPath);
    assert!(e.to_string().contains("is not a directory"), "{e}");
}

#[test]
fn unwritable_directory_is_an_error_naming_it() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o555)).unwrap();
    // Root ignores mode bits; sysfs refuses new files even to root.
    let target = if std::fs::write(dir.path().join("w"), b"").is_ok() {
        eprintln!("note: running with permission override; probing /sys instead");
        Path::new("/sys").to_path_buf()
    } else {
        dir.path().to_path_buf()
    };
    let result = probe_direct_io(&target);
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let e = match result {
        Err(e) => e,
        Ok(p) => {
            kvtier::skip_test!("{} is writable here ({p:?})", target.display());
            return;
        }
    };
    assert_eq!(e.kind(), ErrorKind::InvalidPath, "{e}");
    let msg = e.to_string();
    assert!(msg.contains(target.to_str().unwrap()), "{msg}");
    assert!(
        msg.contains("not writable") || msg.contains("read-only"),
        "{msg}"
    );
}

#[test]
fn io_uring_probe_agrees_with_engine_setup() {
    use kvtier::io::{EngineOptions, IoEngineKind, open_engine};
    use std::sync::Arc;
    let region = Arc::new(kvtier::region::PrimaryRegion::create(1, 4096).unwrap());
    let opts = EngineOptions::default();
    let uring = open_engine(IoEngineKind::Uring, region.clone(), vec![], &opts);
    match probe_io_uring() {
        Ok(()) => assert!(
            uring.is_ok(),
            "probe ok but engine failed: {:?}",
            uring.err()
        ),
        Err(why) => {
            eprintln!("note: io_uring unavailable here: {why}");
            assert_eq!(uring.unwrap_err().kind(), ErrorKind::Unsupported);
        }
    }
}
