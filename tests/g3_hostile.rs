//! Hostile or odd files where a tier's files belong (issue 21 item 6): a FIFO in place of the
//! checkpoint, journal or slab never blocks anything; a CRC-valid superblock whose
//! `total_slots` disagrees with the files is refused before anything is sized from it; a
//! checkpoint sequence number of `u64::MAX` does not wrap.

mod g3_common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use g3_common::*;
use kvtier::contract::job::LookupResult;
use kvtier::contract::secondary::SecondaryTier;
use kvtier::g3::G3Tier;
use kvtier::g3::journal::{CHECKPOINT_FILE_NAME, JOURNAL_FILE_NAME};
use kvtier::g3::slab::SLAB_FILE_NAME;

/// Runs `f` on another thread; fails the test if it has not returned within 20 s.
fn within<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(20))
        .unwrap_or_else(|_| panic!("{what} hung (still blocked after 20 s)"))
}

fn mkfifo(p: &Path) {
    let out = std::process::Command::new("mkfifo")
        .arg(p)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

/// A tier with keys 0..4 stored and shut down (checkpoint written).
fn stored_tier(d: &Path) {
    let r = region(1);
    let mut t = open(config(&[d], 8), &r);
    for k in 0..4u64 {
        fill_row(&r, 0, k);
        assert!(run(&mut t, job(k + 1, &[k], &[0], false)).success);
    }
    t.shutdown().unwrap();
}

fn admin_commands_return(dir: &Path, what: &str) {
    let paths = vec![dir.to_path_buf()];
    for cmd in ["inspect", "ls", "verify"] {
        let p = paths.clone();
        let res = within(
            &format!("tier {cmd} with a FIFO as the {what}"),
            move || match cmd {
                "inspect" => kvtier::g3::admin::inspect(&p).map(|_| ()),
                "ls" => kvtier::g3::admin::list_keys(&p).map(|_| ()),
                _ => kvtier::g3::admin::verify(&p).map(|_| ()),
            },
        );
        let e = res.expect_err("a FIFO was read as an index file");
        assert!(e.to_string().contains("FIFO"), "tier {cmd}: {e}");
    }
}

#[test]
fn a_fifo_in_place_of_an_index_file_blocks_nothing() {
    for name in [CHECKPOINT_FILE_NAME, JOURNAL_FILE_NAME] {
        let d = tmpdir();
        stored_tier(d.path());
        std::fs::remove_file(d.path().join(name)).unwrap();
        mkfifo(&d.path().join(name));
        admin_commands_return(d.path(), name);
        // A tier opened on it does not hang either: it reports the problem and shuts down.
        let dir = d.path().to_path_buf();
        let (recovered, failed) = within(&format!("a tier with a FIFO as {name}"), move || {
            let r = region(1);
            let mut t = G3Tier::open(
                config(&[&dir], 8),
                r,
                kvtier::g3::geometry_namespace(STRIDE as u64),
                "t".into(),
                None,
            )
            .unwrap();
            assert!(t.wait_recovered(Duration::from_secs(10)));
            let recovered = metric(&t, "g3_recovered");
            let failed = lookup(&mut t, 0) != LookupResult::Hit;
            t.shutdown().unwrap();
            (recovered, failed)
        });
        assert_eq!(
            recovered, 0.0,
            "{name}: a failed recovery reported as recovered"
        );
        assert!(failed);
    }
}

#[test]
fn a_fifo_in_place_of_a_slab_blocks_nothing() {
    let d = tmpdir();
    stored_tier(d.path());
    let slab = d.path().join(SLAB_FILE_NAME);
    std::fs::remove_file(&slab).unwrap();
    mkfifo(&slab);
    admin_commands_return(d.path(), "slab");
    let dir: PathBuf = d.path().to_path_buf();
    let e = within("opening a tier whose slab is a FIFO", move || {
        G3Tier::open(
            config(&[&dir], 8),
            region(1),
            kvtier::g3::geometry_namespace(STRIDE as u64),
            "t".into(),
            None,
        )
        .map(|_| ())
    })
    .expect_err("a FIFO opened as a slab");
    assert!(e.to_string().contains("FIFO"), "{e}");
}

/// Rewrites `total_slots` and `slots_in_file` of the slab's superblock, with a valid CRC.
fn forge_superblock(dir: &Path, slots_in_file: u64, total_slots: u64) {
    rewrite_superblock(&dir.join(SLAB_FILE_NAME), |sb| {
        sb[24..32].copy_from_slice(&slots_in_file.to_le_bytes());
        sb[32..40].copy_from_slice(&total_slots.to_le_bytes());
    });
}

#[test]
fn a_superblock_that_disagrees_with_its_file_is_refused_before_sizing_anything() {
    // (slots_in_file, total_slots): a huge total (the admin commands used to ask for 256 GiB
    // and abort), a huge consistent geometry the file does not hold, and a smaller one that
    // would hide the keys in the slots beyond it.
    for (slots, total) in [(8, 0xFFFF_FFF0), (1 << 31, 1 << 31), (4, 4)] {
        let d = tmpdir();
        stored_tier(d.path());
        forge_superblock(d.path(), slots, total);
        let paths = vec![d.path().to_path_buf()];
        let e = within("tier inspect", move || {
            kvtier::g3::admin::inspect(&paths).map(|r| r.entries)
        })
        .expect_err("a superblock that disagrees with its file was used");
        assert_eq!(e.kind(), kvtier::error::ErrorKind::Corrupt, "{e}");
        let s = e.to_string();
        assert!(s.contains(&total.to_string()) || s.contains("bytes"), "{s}");
    }
}

#[test]
fn a_checkpoint_sequence_of_u64_max_does_not_wrap() {
    let d = tmpdir();
    stored_tier(d.path());
    for name in ["kvtier-g3.checkpoint.prev", "kvtier-g3.journal.prev"] {
        let _ = std::fs::remove_file(d.path().join(name));
    }
    let ckpt = d.path().join(CHECKPOINT_FILE_NAME);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&ckpt)
        .unwrap();
    let mut h = [0u8; 64];
    f.read_exact_at(&mut h, 0).unwrap();
    h[32..40].copy_from_slice(&u64::MAX.to_le_bytes());
    let crc = crc32fast::hash(&h[..60]);
    h[60..64].copy_from_slice(&crc.to_le_bytes());
    f.write_all_at(&h, 0).unwrap();
    drop(f);
    let r = region(1);
    let mut t = open(config(&[d.path()], 8), &r);
    for k in 0..4 {
        assert_eq!(lookup(&mut t, k), LookupResult::Hit, "key {k}");
    }
    fill_row(&r, 0, 9);
    assert!(run(&mut t, job(9, &[9], &[0], false)).success);
    t.shutdown().unwrap();
    drop(t);
    let mut t = open(config(&[d.path()], 8), &r);
    assert_eq!(lookup(&mut t, 9), LookupResult::Hit);
}
