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
        namespace: geometry_namespace(STRIDE),
        direct_io: DirectIoMode::Required,
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
