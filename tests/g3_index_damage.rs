//! Damage to the index files (checkpoint, journal) costs only what it covers (issue 21 item 4),
//! and a load returns only bytes stored under its own key (item 5).

mod g3_common;

use std::os::unix::fs::FileExt;
use std::path::Path;

use g3_common::*;
use kvtier::contract::job::LookupResult;
use kvtier::contract::secondary::SecondaryTier;
use kvtier::g3::G3Tier;
use kvtier::g3::journal::{CHECKPOINT_FILE_NAME, JOURNAL_FILE_NAME};

/// Bytes of one index record of a `g3_common::key` (40-byte key).
const RECORD: u64 = 24 + 40;
const HEADER: u64 = 64;

fn flip(path: &Path, offset: u64, mask: u8) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset).unwrap();
    f.write_all_at(&[b[0] ^ mask], offset).unwrap();
    f.sync_all().unwrap();
}

/// Stores keys 0..8 (one job per key, so the journal holds them in order).
fn store_eight(t: &mut G3Tier, r: &kvtier::region::PrimaryRegion) {
    for i in 0..8u64 {
        fill_row(r, 0, i);
        let res = run(t, job(i + 1, &[i], &[0], false));
        assert!(res.success, "{res:?}");
    }
}

fn hits(t: &mut G3Tier) -> Vec<u64> {
    (0..8)
        .filter(|&i| lookup(t, i) == LookupResult::Hit)
        .collect()
}

/// Every hit loads its own bytes.
fn loads_own_bytes(t: &mut G3Tier, r: &kvtier::region::PrimaryRegion, keys: &[u64]) {
    for (n, &i) in (0u64..).zip(keys) {
        clear_row(r, 1);
        let res = run(t, job(1000 + n, &[i], &[1], true));
        assert!(res.success, "key {i}: {res:?}");
        assert!(row_is(r, 1, i), "key {i} loaded other bytes");
    }
}

fn remove_previous_generation(dir: &Path) {
    for name in [
        format!("{CHECKPOINT_FILE_NAME}.prev"),
        format!("{JOURNAL_FILE_NAME}.prev"),
    ] {
        match std::fs::remove_file(dir.join(name)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => panic!("{e}"),
        }
    }
}

fn damaged_copies(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".damaged"))
        .collect()
}

#[test]
fn one_bad_checkpoint_record_costs_only_that_record() {
    let d = tmpdir();
    let r = region(2);
    let mut t = open(config(&[d.path()], 16), &r);
    store_eight(&mut t, &r);
    t.shutdown().unwrap();
    drop(t);
    // Without the previous generation, only the damaged record's entry may be lost.
    remove_previous_generation(d.path());
    flip(&d.path().join(CHECKPOINT_FILE_NAME), HEADER + 9, 0x04);
    let mut t = open(config(&[d.path()], 16), &r);
    let h = hits(&mut t);
    assert_eq!(
        h.len(),
        7,
        "7 of 8 intact records must be recovered, got {h:?}"
    );
    loads_own_bytes(&mut t, &r, &h);
    // A restart (with its shutdown checkpoint) must not make the loss larger, and the
    // damaged file is kept for inspection.
    t.shutdown().unwrap();
    drop(t);
    assert!(
        !damaged_copies(d.path()).is_empty(),
        "the damaged checkpoint was not kept aside"
    );
    let report = kvtier::g3::admin::inspect(&[d.path().to_path_buf()]).unwrap();
    assert!(
        report.warnings.iter().any(|w| w.contains("damaged")),
        "inspect does not mention the damage: {:?}",
        report.warnings
    );
    let mut t = open(config(&[d.path()], 16), &r);
    assert_eq!(hits(&mut t), h);
}

#[test]
fn a_damaged_checkpoint_falls_back_to_the_previous_generation() {
    let d = tmpdir();
    let r = region(2);
    let mut t = open(config(&[d.path()], 16), &r);
    store_eight(&mut t, &r);
    t.shutdown().unwrap();
    drop(t);
    flip(&d.path().join(CHECKPOINT_FILE_NAME), HEADER + 9, 0x04);
    let mut t = open(config(&[d.path()], 16), &r);
    let h = hits(&mut t);
    assert_eq!(
        h,
        (0..8).collect::<Vec<_>>(),
        "previous generation not used"
    );
    loads_own_bytes(&mut t, &r, &h);
}

#[test]
fn a_damaged_checkpoint_header_does_not_drop_its_records() {
    let d = tmpdir();
    let r = region(2);
    let mut t = open(config(&[d.path()], 16), &r);
    store_eight(&mut t, &r);
    t.shutdown().unwrap();
    drop(t);
    remove_previous_generation(d.path());
    // The count field of the header.
    flip(&d.path().join(CHECKPOINT_FILE_NAME), 41, 0x01);
    let mut t = open(config(&[d.path()], 16), &r);
    let h = hits(&mut t);
    assert_eq!(
        h,
        (0..8).collect::<Vec<_>>(),
        "records lost with the header"
    );
    loads_own_bytes(&mut t, &r, &h);
}

#[test]
fn one_bad_journal_record_costs_only_that_record() {
    let d = tmpdir();
    let r = region(2);
    let mut t = open(config(&[d.path()], 16), &r);
    store_eight(&mut t, &r);
    t.close_without_checkpoint().unwrap();
    // Record 0 of the journal is key 0's insert.
    flip(&d.path().join(JOURNAL_FILE_NAME), HEADER + 9, 0x04);
    let mut t = open(config(&[d.path()], 16), &r);
    let h = hits(&mut t);
    assert_eq!(h, (1..8).collect::<Vec<_>>());
    loads_own_bytes(&mut t, &r, &h);
    t.shutdown().unwrap();
    drop(t);
    let mut t = open(config(&[d.path()], 16), &r);
    assert_eq!(hits(&mut t), (1..8).collect::<Vec<_>>());
}

#[test]
fn a_record_pointing_a_key_at_another_keys_slot_loads_nothing() {
    let d = tmpdir();
    let r = region(2);
    let mut t = open(config(&[d.path()], 16), &r);
    store_eight(&mut t, &r);
    t.close_without_checkpoint().unwrap();
    // Rewrite key 7's record (the last one) to name key 3's slot and data CRC, with a valid
    // record CRC: an index bug or a rewritten record.
    let listed = kvtier::g3::admin::list_keys(&[d.path().to_path_buf()]).unwrap();
    let k3 = key(3).to_hex();
    let e3 = listed.iter().find(|e| e.key == k3).unwrap();
    let jpath = d.path().join(JOURNAL_FILE_NAME);
    let len = std::fs::metadata(&jpath).unwrap().len();
    let last = len - RECORD;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&jpath)
        .unwrap();
    let mut rec = vec![0u8; RECORD as usize];
    f.read_exact_at(&mut rec, last).unwrap();
    let slot_at = 8;
    let crc_at = 12;
    rec[slot_at..slot_at + 4].copy_from_slice(&e3.slot.to_le_bytes());
    rec[crc_at..crc_at + 4].copy_from_slice(&e3.crc.to_le_bytes());
    let set_uuid = kvtier::g3::admin::inspect(&[d.path().to_path_buf()])
        .unwrap()
        .files[0]
        .superblock
        .set_uuid;
    reseal_record(&mut rec, set_uuid, last);
    f.write_all_at(&rec, last).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let mut t = open(config(&[d.path()], 16), &r);
    if lookup(&mut t, 7) == LookupResult::Hit {
        clear_row(&r, 1);
        let res = run(&mut t, job(99, &[7], &[1], true));
        assert!(
            !(res.success && row_is(&r, 1, 3)),
            "key 7 loaded key 3's bytes"
        );
        assert!(!res.success, "key 7 has no bytes of its own: {res:?}");
    }
}

/// Recomputes the record CRC of `rec`, which sits at `offset` of an index file of the set
/// `set_uuid`, as `docs/format.md` defines it: CRC-32 of the set uuid, the offset (u64 LE)
/// and the record's bytes from offset 4.
fn reseal_record(rec: &mut [u8], set_uuid: [u8; 16], offset: u64) {
    let mut covered = set_uuid.to_vec();
    covered.extend_from_slice(&offset.to_le_bytes());
    covered.extend_from_slice(&rec[4..]);
    let crc = crc32fast::hash(&covered);
    rec[0..4].copy_from_slice(&crc.to_le_bytes());
}

/// How the previous journal's header is damaged in [`previous_journal_header_damage`].
#[derive(Debug, Clone, Copy)]
enum PrevHeader {
    /// One flipped bit in its `seq` field (the header CRC no longer matches).
    FlippedBit,
    /// A CRC-valid header whose `seq` is above 2^62.
    SeqAboveLimit,
    /// A CRC-valid header whose `seq` equals the current journal's.
    SeqOfCurrent,
}

/// Overwrites the `seq` of the index-file header at `path` and reseals its CRC (bytes 0..60),
/// as `docs/format.md` defines the header.
fn reseal_header_seq(path: &Path, seq: u64) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut h = [0u8; HEADER as usize];
    f.read_exact_at(&mut h, 0).unwrap();
    h[32..40].copy_from_slice(&seq.to_le_bytes());
    let crc = crc32fast::hash(&h[..60]);
    h[60..64].copy_from_slice(&crc.to_le_bytes());
    f.write_all_at(&h, 0).unwrap();
    f.sync_all().unwrap();
}

fn header_seq(path: &Path) -> u64 {
    let b = std::fs::read(path).unwrap();
    u64::from_le_bytes(b[32..40].try_into().unwrap())
}

/// Issue 28 item 9: a tier whose four slots were reused between two generations (keys 0..4 in
/// the previous journal, keys 10..14 in the same slots in the current one); the previous
/// journal's header is damaged. The current keys must all load, the stale ones must miss,
/// and the damaged file must be kept aside before the rotations of the next starts.
fn previous_journal_header_damage(how: PrevHeader) {
    let d = tmpdir();
    let r = region(2);
    let mut t = open(config(&[d.path()], 4), &r);
    for i in 0..4u64 {
        fill_row(&r, 0, i);
        assert!(run(&mut t, job(i + 1, &[i], &[0], false)).success);
    }
    t.shutdown().unwrap();
    drop(t);
    let mut t = open(config(&[d.path()], 4), &r);
    for i in 10..14u64 {
        fill_row(&r, 0, i);
        assert!(run(&mut t, job(i + 1, &[i], &[0], false)).success);
    }
    t.close_without_checkpoint().unwrap();
    let prev = d.path().join(format!("{JOURNAL_FILE_NAME}.prev"));
    let current_seq = header_seq(&d.path().join(JOURNAL_FILE_NAME));
    match how {
        PrevHeader::FlippedBit => flip(&prev, 33, 0x01),
        PrevHeader::SeqAboveLimit => reseal_header_seq(&prev, (1 << 62) + 5),
        PrevHeader::SeqOfCurrent => reseal_header_seq(&prev, current_seq),
    }
    let current: Vec<u64> = (10..14).collect();
    let present = |t: &mut G3Tier| -> Vec<u64> {
        (0..4)
            .chain(10..14)
            .filter(|&i| lookup(t, i) == LookupResult::Hit)
            .collect()
    };
    // Two starts: each writes a fresh generation (the first because of the damage, the
    // second at its shutdown), which is where an intact current journal could be renamed
    // over.
    for start in 0..2 {
        let mut t = open(config(&[d.path()], 4), &r);
        assert_eq!(
            present(&mut t),
            current,
            "{how:?}, start {start}: the current keys must be exactly what is found"
        );
        loads_own_bytes(&mut t, &r, &current);
        t.shutdown().unwrap();
        drop(t);
        assert!(
            damaged_copies(d.path())
                .iter()
                .any(|n| n.starts_with(&format!("{JOURNAL_FILE_NAME}.prev.damaged"))),
            "{how:?}, start {start}: the damaged previous journal was not kept aside: {:?}",
            damaged_copies(d.path())
        );
    }
}

#[test]
fn a_flipped_bit_in_the_previous_journals_header_keeps_the_current_keys() {
    previous_journal_header_damage(PrevHeader::FlippedBit);
}

#[test]
fn a_previous_journal_seq_above_2_62_keeps_the_current_keys() {
    previous_journal_header_damage(PrevHeader::SeqAboveLimit);
}

#[test]
fn a_previous_journal_seq_equal_to_the_current_keeps_the_current_keys() {
    previous_journal_header_damage(PrevHeader::SeqOfCurrent);
}

/// The other side of item 9: when the current checkpoint is damaged, the previous journal
/// continues the generation recovery falls back to, and its records are needed even with a
/// damaged header (its inserts are newer than that checkpoint).
#[test]
fn a_previous_journal_with_a_damaged_header_is_replayed_when_it_continues_the_base() {
    let d = tmpdir();
    let r = region(2);
    let mut t = open(config(&[d.path()], 4), &r);
    for i in 0..2u64 {
        fill_row(&r, 0, i);
        assert!(run(&mut t, job(i + 1, &[i], &[0], false)).success);
    }
    t.shutdown().unwrap();
    drop(t);
    let mut t = open(config(&[d.path()], 4), &r);
    for i in 10..12u64 {
        fill_row(&r, 0, i);
        assert!(run(&mut t, job(i + 1, &[i], &[0], false)).success);
    }
    t.close_without_checkpoint().unwrap();
    // Key 0's record in the current checkpoint, and the previous journal's header.
    flip(&d.path().join(CHECKPOINT_FILE_NAME), HEADER + 9, 0x04);
    flip(
        &d.path().join(format!("{JOURNAL_FILE_NAME}.prev")),
        33,
        0x01,
    );
    let mut t = open(config(&[d.path()], 4), &r);
    let found: Vec<u64> = [0, 1, 10, 11]
        .into_iter()
        .filter(|&i| lookup(&mut t, i) == LookupResult::Hit)
        .collect();
    assert_eq!(
        found,
        [0, 1, 10, 11],
        "the previous journal's records were lost"
    );
    loads_own_bytes(&mut t, &r, &found);
}

/// Issue 28 item 10: a current journal cut to 0 bytes (kvtier writes index files whole before
/// they take their name, so only a filesystem that lost data or a hand does that) loses what
/// it held: recovery says so instead of ignoring it quietly.
#[test]
fn an_empty_current_journal_is_warned_about() {
    let d = tmpdir();
    let r = region(2);
    let mut t = open(config(&[d.path()], 16), &r);
    store_eight(&mut t, &r);
    t.close_without_checkpoint().unwrap();
    let journal = d.path().join(JOURNAL_FILE_NAME);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&journal)
        .unwrap()
        .set_len(0)
        .unwrap();
    let report = kvtier::g3::admin::inspect(&[d.path().to_path_buf()]).unwrap();
    let shown = journal.display().to_string();
    assert!(
        report
            .warnings
            .iter()
            .any(|w| w.contains(&shown) && w.contains("is empty (0 bytes") && w.contains("lost")),
        "no warning about the empty journal: {:?}",
        report.warnings
    );
    // The tier still opens (with what the checkpoint holds: nothing, here).
    let mut t = open(config(&[d.path()], 16), &r);
    assert!(hits(&mut t).is_empty());
}
