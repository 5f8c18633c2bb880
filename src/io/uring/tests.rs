//! Registered-buffer pieces: a small piece limit stands in for the 1 GiB kernel limit.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::Arc;
use std::time::Duration;

use super::UringEngine;
use crate::error::ErrorKind;
use crate::io::{IoDir, IoEngine, IoRequest};
use crate::region::PrimaryRegion;

const PAGE: usize = 4096;

fn pattern(row: usize) -> u8 {
    (row as u8).wrapping_mul(37).wrapping_add(11)
}

fn req(dir: IoDir, row: usize, rows: usize, tag: u64) -> IoRequest {
    IoRequest {
        dir,
        file: 0,
        file_offset: (row * PAGE) as u64,
        region_offset: row * PAGE,
        len: rows * PAGE,
        tag,
    }
}

fn wait(engine: &UringEngine, tag: u64) -> crate::error::Result<usize> {
    let c = engine
        .completions()
        .recv_timeout(Duration::from_secs(30))
        .expect("completion within 30 s");
    assert_eq!(c.tag, tag);
    c.result
}

#[test]
fn requests_use_their_piece_and_never_straddle_two() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(dir.path().join("slab"))
        .unwrap();
    let region = Arc::new(PrimaryRegion::create(8, PAGE as u64).unwrap());
    let engine = match UringEngine::with_piece_limit(region.clone(), vec![file], 8, true, 3 * PAGE)
    {
        Ok(e) => e,
        Err((e, _)) => {
            crate::skip_test!("io_uring unavailable here: {e}");
            return;
        }
    };
    if !engine.fixed_buffers() {
        eprintln!(
            "SKIP: buffers could not be registered: {:?}",
            engine.fallback_reason()
        );
        return;
    }
    // Pieces: rows 0-2, 3-5, 6-7.
    assert_eq!(engine.piece_bytes(), Some(3 * PAGE));
    for row in 0..8 {
        // No transfer is in flight; this test owns the region.
        region.write_row(row).unwrap().fill(pattern(row));
    }
    // Whole pieces and single rows in every piece, including the short last one.
    for (i, (row, rows)) in [(0, 3), (3, 3), (6, 2)].into_iter().enumerate() {
        engine
            .submit(&[req(IoDir::Write, row, rows, i as u64)])
            .unwrap();
        assert_eq!(wait(&engine, i as u64).unwrap(), rows * PAGE);
    }
    for row in 0..8 {
        // As above.
        region.write_row(row).unwrap().fill(0);
        engine
            .submit(&[req(IoDir::Read, row, 1, 100 + row as u64)])
            .unwrap();
        assert_eq!(wait(&engine, 100 + row as u64).unwrap(), PAGE);
        // The read into this row has completed.
        let bytes = region.read_row(row).unwrap();
        assert!(bytes.iter().all(|&b| b == pattern(row)), "row {row}");
    }
    // Rows 2-3 lie in two pieces: refused, clearly.
    engine.submit(&[req(IoDir::Read, 2, 2, 7)]).unwrap();
    let e = wait(&engine, 7).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Contract);
    assert!(e.to_string().contains("straddles"), "{e}");
    engine.shutdown();
}

#[test]
fn opcode_probe_names_what_the_kernel_lacks() {
    use super::{FIXED_BUFFER_OPCODES, OpcodeSupport, REQUIRED_OPCODES};
    let all = OpcodeSupport::from_support(|_| true);
    assert_eq!(all.missing_required(), None);
    assert_eq!(all.missing_fixed(), None);
    // A kernel without the fixed-buffer opcodes: usable, with plain READ / WRITE.
    let fixed: Vec<u8> = FIXED_BUFFER_OPCODES.iter().map(|(_, c)| *c).collect();
    let no_fixed = OpcodeSupport::from_support(|c| !fixed.contains(&c));
    assert_eq!(no_fixed.missing_required(), None);
    let why = no_fixed.missing_fixed().expect("fixed opcodes are missing");
    assert!(why.contains("READ_FIXED, WRITE_FIXED"), "{why}");
    // A kernel without the eventfd poll: not usable, and the reason names the opcode.
    let poll = REQUIRED_OPCODES
        .iter()
        .find(|(n, _)| *n == "POLL_ADD")
        .unwrap()
        .1;
    let no_poll = OpcodeSupport::from_support(|c| c != poll);
    let why = no_poll.missing_required().expect("POLL_ADD is missing");
    assert!(why.contains("POLL_ADD") && !why.contains("READ,"), "{why}");
    assert_eq!(no_poll.missing_fixed(), None);
}

#[test]
fn this_kernel_has_every_opcode_kvtier_uses() {
    let ring = match io_uring::IoUring::new(2) {
        Ok(r) => r,
        Err(e) => {
            crate::skip_test!("io_uring unavailable: {e}");
            return;
        }
    };
    let support = match super::OpcodeSupport::of(&ring, |_| true) {
        Ok(s) => s,
        Err(why) => {
            crate::skip_test!("{why}");
            return;
        }
    };
    // io_uring has had all of them since Linux 5.6, which the probe itself needs.
    assert_eq!(support.missing_required(), None);
    assert_eq!(support.missing_fixed(), None);
}

#[test]
fn an_engine_without_fixed_opcodes_moves_rows_with_plain_ones_and_says_why() {
    use io_uring::opcode;
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let open = || {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(libc::O_DIRECT)
            .open(dir.path().join("slab"))
            .unwrap()
    };
    let region = Arc::new(PrimaryRegion::create(2, PAGE as u64).unwrap());
    // An older kernel: no POLL_ADD. The engine refuses, naming the opcode.
    let poll = opcode::PollAdd::CODE;
    let refused = UringEngine::start(
        region.clone(),
        vec![open()],
        4,
        true,
        PAGE,
        |c| c != poll,
        None,
    );
    let e = match refused {
        Ok(e) => {
            e.shutdown();
            panic!("an engine without POLL_ADD must not start");
        }
        Err((e, files)) => {
            assert_eq!(files.len(), 1, "the files come back for the psync fallback");
            e
        }
    };
    if e.to_string().contains("cannot set up an io_uring")
        || e.to_string().contains("cannot list its io_uring opcodes")
    {
        crate::skip_test!("io_uring unavailable here: {e}");
        return;
    }
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    assert!(e.to_string().contains("POLL_ADD"), "{e}");
    // No READ_FIXED: plain READ / WRITE, with the reason naming it.
    let no_fixed = opcode::ReadFixed::CODE;
    let engine = UringEngine::start(
        region.clone(),
        vec![open()],
        4,
        true,
        PAGE,
        |c| c != no_fixed,
        None,
    )
    .map_err(|(e, _)| e)
    .unwrap();
    assert!(!engine.fixed_buffers());
    let why = engine.fallback_reason().unwrap_or_default().to_string();
    assert!(why.contains("READ_FIXED"), "{why}");
    // No transfer is in flight; this test owns the region.
    region.write_row(0).unwrap().fill(pattern(0));
    engine.submit(&[req(IoDir::Write, 0, 1, 1)]).unwrap();
    assert_eq!(wait(&engine, 1).unwrap(), PAGE);
    engine.submit(&[req(IoDir::Read, 0, 1, 2)]).unwrap();
    // One request at a time: two requests in flight may complete in either order.
    assert_eq!(wait(&engine, 2).unwrap(), PAGE);
    // The read lands in row 1 of the region: same file offset, other row.
    let mut back = req(IoDir::Read, 0, 1, 3);
    back.region_offset = PAGE;
    engine.submit(&[back]).unwrap();
    assert_eq!(wait(&engine, 3).unwrap(), PAGE);
    // The read into row 1 has completed.
    let bytes = region.read_row(1).unwrap();
    assert!(bytes.iter().all(|&b| b == pattern(0)));
    engine.shutdown();
}

/// Issue 20 item 5: a CQE of EINTR or EAGAIN was resubmitted forever (the request never
/// completed and the ring thread spun). Now it is resubmitted at most
/// `MAX_TRANSIENT_RETRIES` times, then that request alone fails; a request the kernel
/// interrupts a few times still succeeds. The filter stands in for the kernel's answers.
#[test]
fn eintr_and_eagain_are_resubmitted_a_bounded_number_of_times() {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use crate::io::files::MAX_TRANSIENT_RETRIES;

    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(dir.path().join("slab"))
        .unwrap();
    let region = Arc::new(PrimaryRegion::create(4, PAGE as u64).unwrap());
    let seen: Arc<Mutex<HashMap<u64, u32>>> = Arc::default();
    let counts = seen.clone();
    // Tag 1: always EAGAIN. Tag 2: EINTR three times, then the real result. Tag 3: always
    // EINTR. Other tags: the kernel's answer.
    let filter = Box::new(move |tag: u64, res: i32| {
        let mut c = counts.lock().unwrap();
        let n = c.entry(tag).or_insert(0);
        *n += 1;
        match tag {
            1 => -libc::EAGAIN,
            2 if *n <= 3 => -libc::EINTR,
            3 => -libc::EINTR,
            _ => res,
        }
    });
    // Not dropped on a failure: the drop would wait for a request that never completes.
    let engine = match UringEngine::with_cqe_filter(region.clone(), vec![file], filter) {
        Ok(e) => std::mem::ManuallyDrop::new(e),
        Err((e, _)) => {
            crate::skip_test!("io_uring unavailable here: {e}");
            return;
        }
    };
    // No transfer is in flight; this test owns the region.
    region.write_row(0).unwrap().fill(pattern(0));
    engine.submit(&[req(IoDir::Write, 0, 1, 0)]).unwrap();
    assert_eq!(wait(&engine, 0).unwrap(), PAGE);
    let expect_failure = |tag: u64, errno: i32| {
        engine.submit(&[req(IoDir::Read, 0, 1, tag)]).unwrap();
        let Ok(c) = engine.completions().recv_timeout(Duration::from_secs(10)) else {
            panic!("a request answered errno {errno} forever never completed");
        };
        assert_eq!(c.tag, tag);
        let e = c.result.unwrap_err();
        assert_eq!(
            e.context_value("errno"),
            Some(errno.to_string().as_str()),
            "{e}"
        );
        let n = MAX_TRANSIENT_RETRIES.to_string();
        assert_eq!(e.context_value("resubmissions"), Some(n.as_str()), "{e}");
        assert!(crate::io::is_transient(&e), "{e}");
    };
    expect_failure(1, libc::EAGAIN);
    expect_failure(3, libc::EINTR);
    let mut into_row_1 = req(IoDir::Read, 0, 1, 2);
    into_row_1.region_offset = PAGE;
    engine.submit(&[into_row_1]).unwrap();
    assert_eq!(wait(&engine, 2).unwrap(), PAGE);
    // The read into row 1 has completed.
    let bytes = region.read_row(1).unwrap();
    assert!(bytes.iter().all(|&b| b == pattern(0)));
    let c = seen.lock().unwrap().clone();
    assert_eq!(c[&1], MAX_TRANSIENT_RETRIES + 1);
    assert_eq!(c[&2], 4);
    engine.shutdown();
}
