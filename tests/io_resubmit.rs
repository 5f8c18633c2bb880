//! A read that the kernel completes partially is resubmitted for the remainder with buffer,
//! offset and length advanced, and succeeds only when every byte has arrived.
//!
//! Regular files only return short reads at end of file (covered by the conformance suite), so
//! this uses a pipe: io_uring returns what the pipe holds (the first half), and the engine must
//! resubmit for the second half, which the writer sends after a pause. (pread cannot read a
//! pipe, so this runs against `uring` only.) If both halves happen to arrive before the first
//! read is issued, the test still checks the bytes, just without a partial completion.

use std::io::Write;
use std::os::fd::FromRawFd;
use std::sync::Arc;
use std::time::Duration;

use kvtier::io::{EngineOptions, IoDir, IoEngineKind, IoRequest, open_engine, probe_io_uring};
use kvtier::region::PrimaryRegion;

#[test]
fn uring_partial_read_continues_into_advanced_buffer() {
    if let Err(why) = probe_io_uring() {
        kvtier::skip_test!("io_uring unavailable here: {why}");
        return;
    }
    let mut fds = [0i32; 2];
    // SAFETY: `fds` is a valid array of two ints for pipe(2) to fill.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: both descriptors are fresh and owned by nothing else.
    let (reader, mut writer) = unsafe {
        (
            std::fs::File::from_raw_fd(fds[0]),
            std::fs::File::from_raw_fd(fds[1]),
        )
    };
    let region = Arc::new(PrimaryRegion::create(1, 8192).unwrap());
    let opts = EngineOptions {
        o_direct: false,
        ..EngineOptions::default()
    };
    let h = open_engine(IoEngineKind::Uring, region.clone(), vec![reader], &opts).unwrap();
    let req = IoRequest {
        dir: IoDir::Read,
        file: 0,
        file_offset: 0,
        region_offset: 0,
        len: 8192,
        tag: 1,
    };
    h.engine.submit(&[req]).unwrap();
    writer.write_all(&[0xA1; 4096]).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        h.engine.completions().try_recv().is_err(),
        "a 4096-byte partial read was reported as complete"
    );
    writer.write_all(&[0xB2; 4096]).unwrap();
    let c = h
        .engine
        .completions()
        .recv_timeout(Duration::from_secs(30))
        .unwrap();
    assert_eq!((c.tag, c.result.unwrap()), (1, 8192));
    // The read has completed; nothing else touches the region.
    let row = region.read_row(0).unwrap();
    assert!(row[..4096].iter().all(|&b| b == 0xA1));
    assert!(row[4096..].iter().all(|&b| b == 0xB2));
    // The writer closing mid-request: the remainder reads 0 bytes, a ShortIo failure.
    h.engine.submit(&[req]).unwrap();
    writer.write_all(&[0xC3; 4096]).unwrap();
    drop(writer);
    let c = h
        .engine
        .completions()
        .recv_timeout(Duration::from_secs(30))
        .unwrap();
    let e = c.result.unwrap_err();
    assert_eq!(e.kind(), kvtier::ErrorKind::ShortIo, "{e}");
    assert_eq!(e.context_value("found"), Some("4096"));
    h.engine.shutdown();
}
