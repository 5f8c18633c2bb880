//! Bad paths and bad media at open: each error names the path and says what is wrong.
//!
//! Some cases need root to build the bad medium honestly (we run as root here): a read-only
//! directory uses `chattr +i` (root ignores permission bits, not the immutable flag), a
//! filesystem without O_DIRECT is a `ramfs` mount (tmpfs accepts O_DIRECT), and a full disk is
//! a 1 MiB `tmpfs` mount. When the capability is missing the test prints why and skips.

mod g3_common;

use std::path::Path;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use g3_common::*;
use kvtier::contract::job::LookupResult;
use kvtier::contract::secondary::SecondaryTier;
use kvtier::error::{Error, ErrorKind};
use kvtier::g3::slab::SLAB_FILE_NAME;
use kvtier::g3::{DirectIoMode, G3Tier, G3TierConfig, geometry_namespace};
use kvtier::region::PrimaryRegion;

fn open_err(cfg: G3TierConfig, r: &Arc<PrimaryRegion>) -> Error {
    open_ns_err(cfg, r, geometry_namespace(r.row_stride()))
}

fn open_ns_err(cfg: G3TierConfig, r: &Arc<PrimaryRegion>, ns: [u8; 32]) -> Error {
    match G3Tier::open(cfg, r.clone(), ns, "t".into(), None) {
        Ok(_) => panic!("open succeeded"),
        Err(e) => e,
    }
}

#[test]
fn missing_path_is_refused() {
    let d = tmpdir();
    let r = region(1);
    let missing = d.path().join("nope");
    let e = open_err(config(&[&missing], 4), &r);
    assert_eq!(e.kind(), ErrorKind::InvalidPath);
    assert!(e.to_string().contains("does not exist"), "{e}");
    assert!(
        e.to_string().contains(&missing.display().to_string()),
        "{e}"
    );
}

#[test]
fn file_instead_of_directory_is_refused() {
    let d = tmpdir();
    let r = region(1);
    let file = d.path().join("plain");
    std::fs::write(&file, b"x").unwrap();
    let e = open_err(config(&[&file], 4), &r);
    assert_eq!(e.kind(), ErrorKind::InvalidPath);
    assert!(e.to_string().contains("is not a directory"), "{e}");
    // A path below a regular file cannot even be looked up.
    let below = file.join("sub");
    let e = open_err(config(&[&below], 4), &r);
    assert_eq!(e.kind(), ErrorKind::InvalidPath);
    assert!(e.to_string().contains(&below.display().to_string()), "{e}");
}

#[test]
fn unwritable_directory_is_refused() {
    let d = tmpdir();
    let r = region(1);
    let ro = d.path().join("ro");
    std::fs::create_dir(&ro).unwrap();
    let ok = Command::new("chattr")
        .arg("+i")
        .arg(&ro)
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        kvtier::skip_test!("chattr +i is not available here");
        return;
    }
    let e = open_err(config(&[&ro], 4), &r);
    let _ = Command::new("chattr").arg("-i").arg(&ro).status();
    assert_eq!(e.kind(), ErrorKind::InvalidPath, "{e}");
    assert!(e.to_string().contains("is not writable"), "{e}");
    assert!(e.to_string().contains(&ro.display().to_string()), "{e}");
}

#[test]
fn filesystem_without_o_direct_is_refused_or_falls_back() {
    let d = tmpdir();
    let Some(_m) = Mount::new("ramfs", "rw", d.path()) else {
        return;
    };
    let r = region(2);
    let e = open_err(config(&[d.path()], 4), &r);
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    assert!(e.to_string().contains("ramfs"), "{e}");
    assert!(e.to_string().contains(SLAB_FILE_NAME), "{e}");
    assert_eq!(
        e.context_value("filesystem")
            .map(|f| f.starts_with("ramfs")),
        Some(true)
    );
    // `auto` falls back to buffered I/O, visibly.
    let mut cfg = config(&[d.path()], 4);
    cfg.direct_io = DirectIoMode::Auto;
    let mut t = open(cfg, &r);
    assert_eq!(t.info().direct_io, vec![false]);
    assert_eq!(metric(&t, "g3_direct_io"), 0.0);
    fill_row(&r, 0, 5);
    assert!(run(&mut t, job(1, &[5], &[0], false)).success);
    clear_row(&r, 1);
    assert!(run(&mut t, job(2, &[5], &[1], true)).success);
    assert!(row_is(&r, 1, 5));
    t.shutdown().unwrap();
}

#[test]
fn no_space_at_preallocation_names_path_needed_and_available() {
    let d = tmpdir();
    let Some(_m) = Mount::new("tmpfs", "size=1m", d.path()) else {
        return;
    };
    let r = region(1);
    let e = open_err(config(&[d.path()], 1024), &r); // 8 MiB of slots on a 1 MiB filesystem
    assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
    let needed: u64 = e.context_value("needed").unwrap().parse().unwrap();
    let available: u64 = e.context_value("available").unwrap().parse().unwrap();
    assert_eq!(needed, 4096 + 1024 * STRIDE as u64);
    assert!(available < needed && available <= 1 << 20, "{e}");
    assert!(e.to_string().contains(SLAB_FILE_NAME), "{e}");
    assert!(
        !d.path().join(SLAB_FILE_NAME).exists(),
        "a failed create leaves nothing behind"
    );
}

fn wait_locked_by(child: &mut Child, slab: &Path) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
        if locks
            .lines()
            .any(|l| l.contains(&format!(" {} ", child.id())))
        {
            return true;
        }
        assert!(child.try_wait().unwrap().is_none(), "flock exited early");
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = slab;
    false
}

#[test]
fn slab_locked_by_another_process_names_its_pid() {
    let d = tmpdir();
    let r = region(1);
    open(config(&[d.path()], 4), &r).shutdown().unwrap();
    let slab = d.path().join(SLAB_FILE_NAME);
    let Ok(mut child) = Command::new("flock")
        .args(["-x", "-o"])
        .arg(&slab)
        .args(["sleep", "30"])
        .spawn()
    else {
        kvtier::skip_test!("the flock command is not available");
        return;
    };
    assert!(
        wait_locked_by(&mut child, &slab),
        "flock never took the lock"
    );
    let e = open_err(config(&[d.path()], 4), &r);
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(e.kind(), ErrorKind::Locked, "{e}");
    assert_eq!(
        e.context_value("pid"),
        Some(child.id().to_string().as_str()),
        "{e}"
    );
    assert!(e.to_string().contains(&slab.display().to_string()), "{e}");
    assert!(e.to_string().contains("locked by another process"), "{e}");
    // Once the holder is gone the slab opens again.
    open(config(&[d.path()], 4), &r).shutdown().unwrap();
}

#[test]
fn a_second_tier_on_the_same_slab_is_locked_out() {
    let d = tmpdir();
    let r = region(1);
    let t = open(config(&[d.path()], 4), &r);
    let e = open_err(config(&[d.path()], 4), &r);
    assert_eq!(e.kind(), ErrorKind::Locked, "{e}");
    assert_eq!(
        e.context_value("pid"),
        Some(std::process::id().to_string().as_str())
    );
    // The holder is this process: say so, not "another process".
    assert!(
        e.to_string().contains("already open in this process"),
        "{e}"
    );
    assert!(!e.to_string().contains("another process"), "{e}");
    drop(t);
}

#[test]
fn two_entries_naming_one_directory_are_rejected() {
    let d = tmpdir();
    let r = region(1);
    let link = d.path().join("alias");
    std::os::unix::fs::symlink(d.path(), &link).unwrap();
    let e = open_err(config(&[d.path(), &link], 4), &r);
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.to_string().contains("same directory"), "{e}");
}

#[test]
fn superblock_of_another_geometry_is_refused_with_both_values() {
    let d = tmpdir();
    let r = region(2);
    open(config(&[d.path()], 8), &r).shutdown().unwrap();
    // Another row stride.
    let small = Arc::new(PrimaryRegion::create(2, 4096).unwrap());
    let e = open_err(config(&[d.path()], 16), &small);
    assert_eq!(e.kind(), ErrorKind::IncompatibleLayout, "{e}");
    assert_eq!(e.context_value("expected"), Some("4096"));
    assert_eq!(e.context_value("found"), Some("8192"));
    assert!(e.to_string().contains("row_stride"), "{e}");
    // Another namespace digest.
    let e = open_ns_err(config(&[d.path()], 8), &r, [7; 32]);
    assert_eq!(e.kind(), ErrorKind::IncompatibleLayout);
    assert_eq!(
        e.context_value("expected"),
        Some(hex::encode([7u8; 32]).as_str())
    );
    // The message shows both digests (short) and what the namespace is made of.
    let msg = e.to_string();
    assert!(msg.contains(&hex::encode([7u8; 6])), "{msg}");
    let stored = e.context_value("found").unwrap();
    assert!(msg.contains(&stored[..12]), "{msg}");
    for what in [
        "model layout",
        "TP size",
        "blocks per chunk",
        "canonical layout",
    ] {
        assert!(msg.contains(what), "{msg}");
    }
    // Another capacity.
    let e = open_err(config(&[d.path()], 9), &r);
    assert_eq!(e.kind(), ErrorKind::IncompatibleLayout);
    assert!(e.to_string().contains("capacity"), "{e}");
    // Nothing was changed by the refusals.
    let mut t = open(config(&[d.path()], 8), &r);
    assert_eq!(lookup(&mut t, 1), LookupResult::Miss);
}

#[test]
fn stripe_set_order_and_completeness_are_checked() {
    let (a, b) = (tmpdir(), tmpdir());
    let r = region(1);
    open(config(&[a.path(), b.path()], 4), &r)
        .shutdown()
        .unwrap();
    let e = open_err(config(&[b.path(), a.path()], 4), &r);
    assert_eq!(e.kind(), ErrorKind::IncompatibleLayout, "{e}");
    // The error names the order the set was formatted in.
    let order = format!("{}, {}", a.path().display(), b.path().display());
    assert_eq!(e.context_value("expected"), Some(order.as_str()));
    // A stripe set with a missing file is never silently recreated.
    std::fs::remove_file(b.path().join(SLAB_FILE_NAME)).unwrap();
    let e = open_err(config(&[a.path(), b.path()], 4), &r);
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(e.to_string().contains("incomplete"), "{e}");
    assert!(!b.path().join(SLAB_FILE_NAME).exists());
}

#[test]
fn corrupt_superblock_is_refused() {
    let d = tmpdir();
    let r = region(1);
    open(config(&[d.path()], 4), &r).shutdown().unwrap();
    let slab = d.path().join(SLAB_FILE_NAME);
    let f = std::fs::OpenOptions::new().write(true).open(&slab).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[0xFF; 4], 16).unwrap();
    drop(f);
    let e = open_err(config(&[d.path()], 4), &r);
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(e.to_string().contains("CRC"), "{e}");
}

#[test]
fn a_pseudo_filesystem_is_refused_as_a_bad_path() {
    if !Path::new("/proc/self").exists() {
        kvtier::skip_test!("no /proc here");
        return;
    }
    let r = region(1);
    let e = open_err(config(&[Path::new("/proc")], 4), &r);
    assert_eq!(e.kind(), ErrorKind::InvalidPath, "{e}");
    assert!(e.to_string().contains("/proc"), "{e}");
    assert!(
        e.to_string().contains("not a writable local filesystem"),
        "{e}"
    );
}

/// Issue 20 item 4: a programmatic caller's huge checkpoint interval (one that would overflow
/// the worker's deadline arithmetic) is refused at open with the config key, before any file
/// is created.
#[test]
fn huge_checkpoint_interval_is_refused_at_open() {
    let d = tmpdir();
    let r = region(1);
    for secs in [u64::MAX, 10_000_000_000_000_000_000, 31_536_001] {
        let mut cfg = config(&[d.path()], 4);
        cfg.checkpoint_interval = Some(Duration::from_secs(secs));
        let e = open_err(cfg, &r);
        assert_eq!(e.kind(), ErrorKind::Config, "{e}");
        assert!(e.to_string().contains("checkpoint_interval_s"), "{e}");
    }
    assert!(!d.path().join(SLAB_FILE_NAME).exists());
}
