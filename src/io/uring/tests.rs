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
    let region = Arc::new(PrimaryRegion::create(8, PAGE).unwrap());
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
        // SAFETY: no transfer is in flight; this test owns the region.
        unsafe { region.row_mut(row).unwrap().fill(pattern(row)) };
    }
    // Whole pieces and single rows in every piece, including the short last one.
    for (i, (row, rows)) in [(0, 3), (3, 3), (6, 2)].into_iter().enumerate() {
        engine
            .submit(&[req(IoDir::Write, row, rows, i as u64)])
            .unwrap();
        assert_eq!(wait(&engine, i as u64).unwrap(), rows * PAGE);
    }
    for row in 0..8 {
        // SAFETY: as above.
        unsafe { region.row_mut(row).unwrap().fill(0) };
        engine
            .submit(&[req(IoDir::Read, row, 1, 100 + row as u64)])
            .unwrap();
        assert_eq!(wait(&engine, 100 + row as u64).unwrap(), PAGE);
        // SAFETY: the read into this row has completed.
        let bytes = unsafe { region.row(row).unwrap() };
        assert!(bytes.iter().all(|&b| b == pattern(row)), "row {row}");
    }
    // Rows 2-3 lie in two pieces: refused, clearly.
    engine.submit(&[req(IoDir::Read, 2, 2, 7)]).unwrap();
    let e = wait(&engine, 7).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Contract);
    assert!(e.to_string().contains("straddles"), "{e}");
    engine.shutdown();
}
