//! One conformance suite run against every I/O engine: psync, uring, and the fault-injecting
//! wrapper around each. Alignment matters here, so files live under /tmp (ext4 on the dev
//! machine, which enforces O_DIRECT alignment), never /dev/shm (tmpfs accepts anything).

mod io_common;

use std::collections::HashMap;

use io_common::{Engine, Fixture, collect, fill_row, open_direct, row_bytes};
use kvtier::ErrorKind;
use kvtier::io::{IoDir, IoRequest};

const STRIDE: usize = 16384;

fn write_req(file_offset: u64, region_offset: usize, len: usize, tag: u64) -> IoRequest {
    IoRequest {
        dir: IoDir::Write,
        file: 0,
        file_offset,
        region_offset,
        len,
        tag,
    }
}

fn read_req(file_offset: u64, region_offset: usize, len: usize, tag: u64) -> IoRequest {
    IoRequest {
        dir: IoDir::Read,
        ..write_req(file_offset, region_offset, len, tag)
    }
}

/// Rows 0..4 written to scattered file offsets, read back into rows 4..8, compared byte for byte.
fn aligned_round_trip(engine: Engine) {
    let Some(fx) = Fixture::new(engine, 8, STRIDE, 0, 64) else {
        return;
    };
    let slots = [3u64, 0, 5, 1];
    for row in 0..4 {
        fill_row(&fx.region, row, row as u64 + 100);
    }
    let writes: Vec<_> = slots
        .iter()
        .enumerate()
        .map(|(row, &slot)| write_req(slot * STRIDE as u64, row * STRIDE, STRIDE, row as u64))
        .collect();
    fx.engine.submit(&writes).unwrap();
    for (tag, r) in collect(&*fx.engine, writes.len()) {
        assert_eq!(r.unwrap(), STRIDE, "write tag {tag}");
    }
    let reads: Vec<_> = slots
        .iter()
        .enumerate()
        .map(|(row, &slot)| {
            read_req(
                slot * STRIDE as u64,
                (row + 4) * STRIDE,
                STRIDE,
                row as u64 + 10,
            )
        })
        .collect();
    fx.engine.submit(&reads).unwrap();
    for (tag, r) in collect(&*fx.engine, reads.len()) {
        assert_eq!(r.unwrap(), STRIDE, "read tag {tag}");
    }
    for row in 0..4 {
        assert_eq!(
            row_bytes(&fx.region, row + 4),
            row_bytes(&fx.region, row),
            "row {row} came back different"
        );
    }
    fx.engine.shutdown();
}

/// Far more requests than the queue depth, all in flight at once; every one completes once.
fn many_concurrent_requests(engine: Engine) {
    let n = 64;
    let Some(fx) = Fixture::new(engine, n * 2, 4096, 0, 4) else {
        return;
    };
    for row in 0..n {
        fill_row(&fx.region, row, row as u64 * 7 + 1);
    }
    let writes: Vec<_> = (0..n)
        .map(|i| write_req(((n - 1 - i) * 4096) as u64, i * 4096, 4096, i as u64))
        .collect();
    fx.engine.submit(&writes).unwrap();
    let done = collect(&*fx.engine, n);
    assert_eq!(done.len(), n, "every write completes exactly once");
    assert!(done.values().all(|r| matches!(r, Ok(4096))));
    let reads: Vec<_> = (0..n)
        .map(|i| {
            read_req(
                ((n - 1 - i) * 4096) as u64,
                (n + i) * 4096,
                4096,
                1000 + i as u64,
            )
        })
        .collect();
    // Submit one at a time: the engine must pick up requests arriving while others are in flight.
    for r in &reads {
        fx.engine.submit(std::slice::from_ref(r)).unwrap();
    }
    let done = collect(&*fx.engine, n);
    assert_eq!(done.len(), n);
    assert!(done.values().all(|r| matches!(r, Ok(4096))));
    for i in 0..n {
        assert_eq!(
            row_bytes(&fx.region, n + i),
            row_bytes(&fx.region, i),
            "row {i}"
        );
    }
    fx.engine.shutdown();
}

/// Several threads submit one request at a time while others are in flight (the ring thread
/// must notice requests arriving while it waits for completions); every request completes
/// once and every byte lands.
fn concurrent_submitters(engine: Engine) {
    let (threads, per_thread) = (4, 32);
    let n = threads * per_thread;
    let Some(fx) = Fixture::new(engine, n, 4096, 0, 8) else {
        return;
    };
    for row in 0..n {
        fill_row(&fx.region, row, row as u64 + 3);
    }
    std::thread::scope(|s| {
        for t in 0..threads {
            let engine = &fx.engine;
            s.spawn(move || {
                for i in 0..per_thread {
                    let row = t * per_thread + i;
                    let r = write_req((row * 4096) as u64, row * 4096, 4096, row as u64);
                    engine.submit(&[r]).unwrap();
                }
            });
        }
    });
    let done = collect(&*fx.engine, n);
    assert!(done.values().all(|r| matches!(r, Ok(4096))));
    let on_disk = std::fs::read(&fx.path).unwrap();
    for row in 0..n {
        assert_eq!(
            &on_disk[row * 4096..(row + 1) * 4096],
            &row_bytes(&fx.region, row)[..],
            "row {row}"
        );
    }
    fx.engine.shutdown();
}

/// O_DIRECT alignment is enforced before submission, per request, and names what is wrong.
fn misaligned_request_rejected(engine: Engine) {
    let Some(fx) = Fixture::new(engine, 4, STRIDE, 0, 16) else {
        return;
    };
    let bad = [
        write_req(100, 0, 4096, 1),    // file offset
        write_req(0, 0, 1000, 2),      // length
        read_req(0, 512, 4096, 3),     // buffer address
        read_req(4096, 8192, 4096, 4), // fine
    ];
    fx.engine.submit(&bad[..3]).unwrap();
    let done = collect(&*fx.engine, 3);
    for tag in 1..=3 {
        let e = done[&tag].as_ref().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Misaligned, "tag {tag}: {e}");
        assert!(e.to_string().contains("4096"), "{e}");
        assert_eq!(e.context_value("path"), Some(fx.path.to_str().unwrap()));
    }
    // Out of range requests are contract errors, not crashes.
    let oob = [
        IoRequest { file: 7, ..bad[3] },
        read_req(0, 4 * STRIDE, 4096, 6),
    ];
    fx.engine.submit(&oob).unwrap();
    let done = collect(&*fx.engine, 2);
    assert!(
        done.values()
            .all(|r| r.as_ref().unwrap_err().kind() == ErrorKind::Contract)
    );
    fx.engine.shutdown();
}

/// Reading past the end of a file is a short read: it fails, it never succeeds.
fn short_transfer_surfaced(engine: Engine) {
    let Some(fx) = Fixture::new(engine, 4, STRIDE, 4096, 16) else {
        return;
    };
    fx.engine
        .submit(&[
            read_req(0, 0, STRIDE, 1),    // 4096 of 16384 bytes exist
            read_req(8192, 0, 4096, 2),   // wholly past EOF
            read_req(0, STRIDE, 4096, 3), // the one page that exists
        ])
        .unwrap();
    let done = collect(&*fx.engine, 3);
    for tag in [1, 2] {
        let e = done[&tag].as_ref().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ShortIo, "tag {tag}: {e}");
        assert!(e.context_value("expected").is_some(), "{e:?}");
    }
    assert_eq!(*done[&3].as_ref().unwrap(), 4096);
    fx.engine.shutdown();
}

/// A read that ends inside the file's last block: the engine continues at the advanced offset
/// (buffered file) or stops at the unaligned remainder (O_DIRECT), and fails either way with
/// exactly the bytes that exist counted as moved. Re-reading from the start instead of the
/// advanced offset would "succeed" here, so this also checks the offset is advanced.
fn partial_transfer_continues_at_advanced_offset(engine: Engine) {
    for o_direct in [false, true] {
        let Some(fx) = Fixture::build(engine.clone(), 2, 8192, 6000, 8, o_direct) else {
            return;
        };
        fill_row(&fx.region, 0, 1);
        fx.engine.submit(&[read_req(0, 0, 8192, 1)]).unwrap();
        let e = collect(&*fx.engine, 1).remove(&1).unwrap().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ShortIo, "o_direct={o_direct}: {e}");
        assert_eq!(e.context_value("found"), Some("6000"), "{e}");
        // The 6000 bytes that exist (zeros) did land in the buffer.
        assert!(row_bytes(&fx.region, 0)[..6000].iter().all(|&b| b == 0));
        fx.engine.shutdown();
    }
}

/// Shutdown waits for every request in flight; each completes exactly once; later submits fail.
fn shutdown_completes_in_flight_and_refuses_more(engine: Engine) {
    let n = 48;
    let Some(fx) = Fixture::new(engine, n, 8192, 0, 8) else {
        return;
    };
    for row in 0..n {
        fill_row(&fx.region, row, row as u64 + 5);
    }
    let writes: Vec<_> = (0..n)
        .map(|i| write_req((i * 8192) as u64, i * 8192, 8192, i as u64))
        .collect();
    fx.engine.submit(&writes).unwrap();
    fx.engine.shutdown();
    let mut seen = HashMap::new();
    while let Ok(c) = fx.engine.completions().try_recv() {
        assert!(
            seen.insert(c.tag, c.result).is_none(),
            "tag completed twice"
        );
    }
    assert_eq!(seen.len(), n, "shutdown returned before every completion");
    assert!(seen.values().all(|r| matches!(r, Ok(8192))));
    let e = fx.engine.submit(&[read_req(0, 0, 8192, 99)]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Closed);
    fx.engine.shutdown(); // idempotent
    // The bytes really reached the file.
    let on_disk = std::fs::read(&fx.path).unwrap();
    for i in 0..n {
        assert_eq!(
            &on_disk[i * 8192..(i + 1) * 8192],
            &row_bytes(&fx.region, i)[..]
        );
    }
}

/// `sync_data` of a written file succeeds; an unknown file index is a contract error.
fn sync_data_of_known_and_unknown_files(engine: Engine) {
    let Some(fx) = Fixture::new(engine, 2, 8192, 0, 8) else {
        return;
    };
    fill_row(&fx.region, 0, 7);
    fx.engine.submit(&[write_req(0, 0, 8192, 1)]).unwrap();
    assert!(collect(&*fx.engine, 1)[&1].is_ok());
    fx.engine.sync_data(0).unwrap();
    let e = fx.engine.sync_data(9).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Contract, "{e}");
}

/// Files attached for their own transfers (a file-per-chunk tier): each row goes to a file of
/// its own through the engine, comes back through freshly attached descriptors, and every
/// file holds exactly its row. Fixed file 0 keeps working beside them.
fn attached_files_round_trip(engine: Engine) {
    let Some(fx) = Fixture::new(engine, 8, STRIDE, 0, 4) else {
        return;
    };
    let path = |i: usize| fx.dir.path().join(format!("chunk{i}.bin"));
    for row in 0..4 {
        fill_row(&fx.region, row, row as u64 + 300);
    }
    let mut ids = Vec::new();
    for i in 0..4 {
        let f = open_direct(&path(i));
        ids.push(
            fx.engine
                .attach_file(f, path(i).display().to_string(), true)
                .unwrap(),
        );
    }
    let writes: Vec<_> = ids
        .iter()
        .enumerate()
        .map(|(i, &id)| IoRequest {
            file: id,
            ..write_req(0, i * STRIDE, STRIDE, i as u64)
        })
        .collect();
    fx.engine.submit(&writes).unwrap();
    for (tag, r) in collect(&*fx.engine, 4) {
        assert_eq!(r.unwrap(), STRIDE, "write tag {tag}");
    }
    fx.engine.sync_data(ids[0]).unwrap();
    for id in ids.drain(..) {
        drop(fx.engine.detach_file(id).unwrap());
    }
    for i in 0..4 {
        assert_eq!(std::fs::read(path(i)).unwrap(), row_bytes(&fx.region, i));
        let f = open_direct(&path(i));
        ids.push(
            fx.engine
                .attach_file(f, format!("chunk {i}"), true)
                .unwrap(),
        );
    }
    let reads: Vec<_> = ids
        .iter()
        .enumerate()
        .map(|(i, &id)| IoRequest {
            file: id,
            ..read_req(0, (i + 4) * STRIDE, STRIDE, i as u64 + 10)
        })
        .collect();
    fx.engine.submit(&reads).unwrap();
    for (tag, r) in collect(&*fx.engine, 4) {
        assert_eq!(r.unwrap(), STRIDE, "read tag {tag}");
    }
    for (i, id) in ids.into_iter().enumerate() {
        fx.engine.detach_file(id).unwrap();
        assert_eq!(row_bytes(&fx.region, i + 4), row_bytes(&fx.region, i));
    }
    // A misaligned request on an attached O_DIRECT file is refused like on a fixed one.
    let id = fx
        .engine
        .attach_file(open_direct(&path(0)), "chunk 0".into(), true)
        .unwrap();
    fx.engine
        .submit(&[IoRequest {
            file: id,
            ..read_req(100, 0, STRIDE, 77)
        }])
        .unwrap();
    let e = collect(&*fx.engine, 1).remove(&77).unwrap().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Misaligned, "{e}");
    assert!(e.to_string().contains("chunk 0"), "{e}");
    fx.engine.detach_file(id).unwrap();
    // The fixed file is unaffected.
    fx.engine.submit(&[write_req(0, 0, STRIDE, 5)]).unwrap();
    assert!(collect(&*fx.engine, 1)[&5].is_ok());
    fx.engine.shutdown();
}

/// A detached index is dead: a transfer naming it fails (even once its slot holds a newer
/// file), and detaching it again is a contract error.
fn stale_attached_index_is_refused(engine: Engine) {
    let Some(fx) = Fixture::new(engine, 2, STRIDE, 0, 4) else {
        return;
    };
    let a = fx.dir.path().join("a.bin");
    let b = fx.dir.path().join("b.bin");
    let old = fx
        .engine
        .attach_file(open_direct(&a), "a".into(), true)
        .unwrap();
    fx.engine.detach_file(old).unwrap();
    let new = fx
        .engine
        .attach_file(open_direct(&b), "b".into(), true)
        .unwrap();
    assert_ne!(old, new, "a reused slot gets a new generation");
    fill_row(&fx.region, 0, 9);
    fx.engine
        .submit(&[IoRequest {
            file: old,
            ..write_req(0, 0, STRIDE, 1)
        }])
        .unwrap();
    let e = collect(&*fx.engine, 1).remove(&1).unwrap().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Contract, "{e}");
    assert_eq!(
        std::fs::metadata(&b).unwrap().len(),
        0,
        "b must be untouched"
    );
    assert_eq!(
        fx.engine.detach_file(old).unwrap_err().kind(),
        ErrorKind::Contract
    );
    fx.engine.detach_file(new).unwrap();
    fx.engine.shutdown();
}

/// While a transfer on an attached file is in flight the file cannot be detached (its
/// descriptor must stay open until the completion); afterwards it can. A write into a full
/// pipe holds the transfer in flight until the test drains the pipe (io_uring only: pwrite on
/// a pipe fails at once with ESPIPE, so psync cannot be held this way; the unit tests of the
/// file table cover the same rule for every engine).
fn detach_waits_for_the_transfer_in_flight(engine: Engine) {
    let Some(fx) = Fixture::build(engine, 2, 1 << 20, 0, 4, false) else {
        return;
    };
    let mut fds = [0i32; 2];
    // SAFETY: `fds` is a valid out-array of two descriptors.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    use std::os::fd::FromRawFd;
    // SAFETY: both descriptors were just created and are owned here alone.
    let (reader, writer) = unsafe {
        (
            std::fs::File::from_raw_fd(fds[0]),
            std::fs::File::from_raw_fd(fds[1]),
        )
    };
    let id = fx.engine.attach_file(writer, "pipe".into(), false).unwrap();
    fill_row(&fx.region, 0, 3);
    fx.engine
        .submit(&[IoRequest {
            dir: IoDir::Write,
            file: id,
            file_offset: 0,
            region_offset: 0,
            len: 1 << 20,
            tag: 1,
        }])
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    let e = fx.engine.detach_file(id).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Contract, "{e}");
    let drained = std::thread::spawn(move || {
        use std::io::Read;
        let mut all = Vec::new();
        let mut r = reader;
        let mut buf = vec![0u8; 65536];
        while all.len() < 1 << 20 {
            let n = r.read(&mut buf).unwrap();
            assert!(n > 0);
            all.extend_from_slice(&buf[..n]);
        }
        all
    });
    assert_eq!(
        collect(&*fx.engine, 1).remove(&1).unwrap().unwrap(),
        1 << 20
    );
    assert_eq!(drained.join().unwrap(), row_bytes(&fx.region, 0));
    fx.engine.detach_file(id).unwrap();
    fx.engine.shutdown();
}

macro_rules! conformance {
    ($module:ident, $engine:expr) => {
        mod $module {
            use super::*;

            #[test]
            fn aligned_round_trip() {
                super::aligned_round_trip($engine);
            }
            #[test]
            fn many_concurrent_requests() {
                super::many_concurrent_requests($engine);
            }
            #[test]
            fn concurrent_submitters() {
                super::concurrent_submitters($engine);
            }
            #[test]
            fn misaligned_request_rejected() {
                super::misaligned_request_rejected($engine);
            }
            #[test]
            fn short_transfer_surfaced() {
                super::short_transfer_surfaced($engine);
            }
            #[test]
            fn partial_transfer_continues_at_advanced_offset() {
                super::partial_transfer_continues_at_advanced_offset($engine);
            }
            #[test]
            fn shutdown_completes_in_flight_and_refuses_more() {
                super::shutdown_completes_in_flight_and_refuses_more($engine);
            }
            #[test]
            fn sync_data_of_known_and_unknown_files() {
                super::sync_data_of_known_and_unknown_files($engine);
            }
            #[test]
            fn attached_files_round_trip() {
                super::attached_files_round_trip($engine);
            }
            #[test]
            fn stale_attached_index_is_refused() {
                super::stale_attached_index_is_refused($engine);
            }
        }
    };
}

conformance!(psync, Engine::Psync);
conformance!(uring, Engine::Uring);
conformance!(faulty_psync, Engine::faulty(Engine::Psync));
conformance!(faulty_uring, Engine::faulty(Engine::Uring));

#[test]
fn uring_detach_waits_for_the_transfer_in_flight() {
    detach_waits_for_the_transfer_in_flight(Engine::Uring);
}

#[test]
fn faulty_uring_detach_waits_for_the_transfer_in_flight() {
    detach_waits_for_the_transfer_in_flight(Engine::faulty(Engine::Uring));
}

/// Issue 2's region test: the primary region registers with io_uring as fixed buffers and serves
/// as the O_DIRECT buffer against a file under /tmp.
#[test]
fn region_registers_with_io_uring_and_serves_o_direct() {
    let Some(fx) = Fixture::new(Engine::Uring, 4, STRIDE, 0, 16) else {
        return;
    };
    assert!(
        fx.info.fixed_buffers,
        "the memfd region must register as fixed buffers (as root here): {:?}",
        fx.info.fallback_reason
    );
    fill_row(&fx.region, 0, 42);
    fx.engine.submit(&[write_req(0, 0, STRIDE, 1)]).unwrap();
    assert!(collect(&*fx.engine, 1)[&1].is_ok());
    fx.engine
        .submit(&[read_req(0, 2 * STRIDE, STRIDE, 2)])
        .unwrap();
    assert!(collect(&*fx.engine, 1)[&2].is_ok());
    assert_eq!(row_bytes(&fx.region, 2), row_bytes(&fx.region, 0));
    fx.engine.shutdown();
}
