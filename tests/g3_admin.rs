//! The admin functions behind `kvtier tier ...`: format, inspect, list, verify, clear.

mod g3_common;

use std::os::unix::fs::FileExt;

use g3_common::*;
use kvtier::contract::job::LookupResult;
use kvtier::contract::secondary::SecondaryTier;
use kvtier::error::ErrorKind;
use kvtier::g3::admin::{self, FormatOptions};
use kvtier::g3::slab::SLAB_FILE_NAME;
use kvtier::g3::{DirectIoMode, geometry_namespace};

fn fmt_opts(slots: u64) -> FormatOptions {
    FormatOptions {
        row_stride: STRIDE as u64,
        capacity_bytes: slots * STRIDE as u64,
        namespace: geometry_namespace(STRIDE as u64),
        direct_io: DirectIoMode::Required,
        new_filesystem: false,
    }
}

#[test]
fn format_inspect_list_verify_clear() {
    let (a, b) = (tmpdir(), tmpdir());
    let paths = vec![a.path().to_path_buf(), b.path().to_path_buf()];
    let rep = admin::format(&paths, &fmt_opts(8)).unwrap();
    assert_eq!(rep.files.len(), 2);
    assert_eq!(rep.total_slots, 8);
    assert_eq!(rep.entries, 0);
    assert_eq!(rep.files[1].superblock.path_index, 1);
    assert_eq!(
        rep.files[0].superblock.set_uuid,
        rep.files[1].superblock.set_uuid
    );

    let r = region(4);
    let mut t = open(config(&[a.path(), b.path()], 8), &r);
    assert!(!t.info().created, "the tier opens the formatted set");
    for i in 0..3u32 {
        fill_row(&r, i, u64::from(i));
    }
    assert!(run(&mut t, job(1, &[0, 1, 2], &[0, 1, 2], false)).success);
    // Read-only commands work beside a live tier and report its pid.
    let rep = admin::inspect(&paths).unwrap();
    assert_eq!(rep.entries, 3);
    assert_eq!(rep.free_slots, 5);
    assert_eq!(rep.files[0].locked_by, Some(std::process::id()));
    let keys = admin::list_keys(&paths).unwrap();
    assert_eq!(keys.len(), 3);
    assert_eq!(keys[0].key, key(0).to_hex());
    // Locking commands refuse to run beside it.
    assert_eq!(admin::verify(&paths).unwrap_err().kind(), ErrorKind::Locked);
    assert_eq!(admin::clear(&paths).unwrap_err().kind(), ErrorKind::Locked);
    assert_eq!(
        admin::format(&paths, &fmt_opts(8)).unwrap_err().kind(),
        ErrorKind::Locked
    );
    t.shutdown().unwrap();
    drop(t);

    let v = admin::verify(&paths).unwrap();
    assert_eq!((v.checked, v.ok), (3, 3));
    assert!(v.bad.is_empty());
    // Corrupt key 1 (slot 1: second file, first slot).
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(b.path().join(SLAB_FILE_NAME))
        .unwrap();
    f.write_all_at(&[0xEE; 16], 4096 + 100).unwrap();
    f.sync_all().unwrap();
    let v = admin::verify(&paths).unwrap();
    assert_eq!((v.checked, v.ok), (3, 2));
    assert_eq!(v.bad.len(), 1);
    assert_eq!(v.bad[0].key, key(1).to_hex());
    assert_eq!(v.bad[0].slot, 1);
    assert!(
        v.bad[0]
            .found_crc
            .is_some_and(|c| c != v.bad[0].expected_crc)
    );
    let json = serde_json::to_string(&v).unwrap();
    assert!(json.contains(&key(1).to_hex()));

    admin::clear(&paths).unwrap();
    assert_eq!(admin::inspect(&paths).unwrap().entries, 0);
    let mut t = open(config(&[a.path(), b.path()], 8), &r);
    assert_eq!(lookup(&mut t, 0), LookupResult::Miss);
    t.shutdown().unwrap();
    drop(t);

    // Reformatting changes the set's identity.
    let before = admin::inspect(&paths).unwrap().files[0].superblock.set_uuid;
    let after = admin::format(&paths, &fmt_opts(4)).unwrap();
    assert_ne!(after.files[0].superblock.set_uuid, before);
    assert_eq!(after.total_slots, 4);
}

#[test]
fn inspect_of_nothing_names_the_missing_slab() {
    let d = tmpdir();
    let e = admin::inspect(&[d.path().to_path_buf()]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidPath);
    assert!(e.to_string().contains(SLAB_FILE_NAME), "{e}");
}

#[test]
fn admin_commands_on_a_folder_without_a_tier_say_how_to_make_one() {
    let d = tmpdir();
    let paths = vec![d.path().to_path_buf()];
    let errs = [
        admin::inspect(&paths).unwrap_err(),
        admin::verify(&paths).unwrap_err(),
        admin::list_keys(&paths).unwrap_err(),
        admin::clear(&paths).unwrap_err(),
    ];
    for e in errs {
        assert_eq!(e.kind(), ErrorKind::InvalidPath, "{e}");
        let msg = e.to_string();
        assert!(msg.contains("holds no G3 tier"), "{msg}");
        assert!(msg.contains(&d.path().display().to_string()), "{msg}");
        assert!(msg.contains("kvtier tier format"), "{msg}");
    }
    // Nothing was created by the refusals.
    assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
}

#[test]
fn format_refuses_a_directory_that_takes_no_files() {
    if !std::path::Path::new("/proc/self").exists() {
        kvtier::skip_test!("no /proc here");
        return;
    }
    let e = admin::format(&[std::path::PathBuf::from("/proc")], &fmt_opts(8)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidPath, "{e}");
    assert!(e.to_string().contains("/proc"), "{e}");
    assert!(
        e.to_string().contains("not a writable local filesystem"),
        "{e}"
    );
}

/// Issue 20 item 7: `verify` labelled read errors as CRC failures, and `inspect` refused a
/// truncated slab outright instead of reporting it. A slab cut short (its last slot gone) and a
/// flipped byte in another slot: `inspect` flags the slab, `verify` counts one CRC mismatch and
/// one read error, each labelled.
#[test]
fn verify_tells_read_errors_from_crc_failures_and_inspect_flags_a_truncated_slab() {
    let (a, b) = (tmpdir(), tmpdir());
    let paths = vec![a.path().to_path_buf(), b.path().to_path_buf()];
    admin::format(&paths, &fmt_opts(8)).unwrap();
    let r = region(8);
    let mut t = open(config(&[a.path(), b.path()], 8), &r);
    for i in 0..8u32 {
        fill_row(&r, i, u64::from(i));
    }
    assert!(
        run(
            &mut t,
            job(
                1,
                &[0, 1, 2, 3, 4, 5, 6, 7],
                &[0, 1, 2, 3, 4, 5, 6, 7],
                false
            )
        )
        .success
    );
    t.shutdown().unwrap();
    drop(t);
    // Slot 7 is the last of file b (slots 1, 3, 5, 7): cut it off.
    let slab_b = b.path().join(SLAB_FILE_NAME);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&slab_b)
        .unwrap();
    let full = f.metadata().unwrap().len();
    f.set_len(full - STRIDE as u64).unwrap();
    // Slot 2 is the second of file a: flip a byte.
    let fa = std::fs::OpenOptions::new()
        .write(true)
        .open(a.path().join(SLAB_FILE_NAME))
        .unwrap();
    fa.write_all_at(&[0xEE; 16], 4096 + STRIDE as u64 + 100)
        .unwrap();
    fa.sync_all().unwrap();

    let rep = admin::inspect(&paths).unwrap();
    assert_eq!(rep.files[0].problem, None);
    let problem = rep.files[1]
        .problem
        .as_deref()
        .expect("the truncation is flagged");
    assert!(problem.starts_with("truncated"), "{problem}");
    assert!(problem.contains(&full.to_string()), "{problem}");
    assert!(
        rep.warnings.iter().any(|w| w.contains("truncated")),
        "{:?}",
        rep.warnings
    );
    assert_eq!(rep.entries, 8);

    let v = admin::verify(&paths).unwrap();
    assert_eq!((v.checked, v.ok), (8, 6));
    assert_eq!((v.crc_failures, v.read_errors), (1, 1));
    let by_slot = |s: u32| v.bad.iter().find(|b| b.slot == s).unwrap();
    assert_eq!(by_slot(2).kind, admin::BadKind::CrcMismatch);
    assert!(by_slot(2).found_crc.is_some());
    assert_eq!(by_slot(7).kind, admin::BadKind::ReadError);
    assert_eq!(by_slot(7).found_crc, None);
    assert!(
        by_slot(7)
            .error
            .as_deref()
            .unwrap()
            .contains("past the end"),
        "{:?}",
        by_slot(7)
    );
    let json = serde_json::to_value(&v).unwrap();
    assert_eq!(json["read_errors"], 1);
    assert!(json.to_string().contains("\"read_error\""), "{json}");
    // Commands that write still refuse the damaged set.
    assert_eq!(admin::clear(&paths).unwrap_err().kind(), ErrorKind::Corrupt);
}

/// Issue 20 item 6: a format that cannot fit the new slabs used to remove the old ones first,
/// leaving no tier. Now the space is checked before anything is removed: the old tier stays,
/// whole, and the error says why and that nothing was removed.
#[test]
fn a_format_that_cannot_fit_removes_nothing() {
    let d = tmpdir();
    let Some(_m) = Mount::new("tmpfs", "size=4m", d.path()) else {
        return;
    };
    let paths = vec![d.path().to_path_buf()];
    // 256 slots of 8 KiB: 2 MiB of a 4 MiB filesystem.
    let before = admin::format(&paths, &fmt_opts(256)).unwrap();
    let uuid = before.files[0].superblock.set_uuid;
    // 8 MiB cannot fit even with the old slab's 2 MiB freed.
    let e = admin::format(&paths, &fmt_opts(1024)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
    assert!(e.to_string().contains("nothing was removed"), "{e}");
    assert!(
        e.to_string().contains(&d.path().display().to_string()),
        "{e}"
    );
    let after = admin::inspect(&paths).expect("the old tier is still there");
    assert_eq!(after.files[0].superblock.set_uuid, uuid);
    assert_eq!(after.total_slots, 256);
    // What fits once the old slab is freed is accepted: 3 MiB with 2 MiB free + 2 MiB freed.
    let bigger = admin::format(&paths, &fmt_opts(384)).unwrap();
    assert_eq!(bigger.total_slots, 384);
}

/// Issue 20 item 6: two formats of one directory raced (both succeeded, or both failed and left
/// no tier, with a wrong O_DIRECT diagnosis). A format holds the directory's lock from its
/// first removal to its last write; one that finds it held is refused, naming the holder, and
/// touches nothing.
#[test]
fn a_format_is_refused_while_another_holds_the_directory() {
    let d = tmpdir();
    let paths = vec![d.path().to_path_buf()];
    let before = admin::format(&paths, &fmt_opts(8)).unwrap();
    // Another format (this test standing in for it) holds the directory's lock.
    let held = std::fs::File::open(d.path()).unwrap();
    // (A process another test thread forks holds a copy of the format's lock until it execs.)
    let start = std::time::Instant::now();
    while held.try_lock().is_err() {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(5),
            "cannot lock the directory"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let e = admin::format(&paths, &fmt_opts(16)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Locked, "{e}");
    assert!(
        e.to_string()
            .contains("being changed by another kvtier process"),
        "{e}"
    );
    assert!(
        e.to_string().contains(&std::process::id().to_string()),
        "{e}"
    );
    let e = admin::repair(&paths).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Locked, "{e}");
    let same = admin::inspect(&paths).unwrap();
    assert_eq!(
        same.files[0].superblock.set_uuid,
        before.files[0].superblock.set_uuid
    );
    assert_eq!(same.total_slots, 8);
    drop(held);
    assert_eq!(
        admin::format(&paths, &fmt_opts(16)).unwrap().total_slots,
        16
    );
}
