//! Fault injection through the `faulty` engine, around psync and uring: every injected fault
//! reaches the caller as a failure of exactly the request it hit (or, for a bit flip, as
//! changed bytes), never as silent success.

mod io_common;

use std::time::{Duration, Instant};

use io_common::{Engine, Fixture, collect, fill_row, row_bytes};
use kvtier::ErrorKind;
use kvtier::io::{FaultPlan, IoDir, IoRequest};

const STRIDE: usize = 16384;

fn req(dir: IoDir, slot: u64, row: usize, tag: u64) -> IoRequest {
    IoRequest {
        dir,
        file: 0,
        file_offset: slot * STRIDE as u64,
        region_offset: row * STRIDE,
        len: STRIDE,
        tag,
    }
}

fn fixture(inner: Engine, plan: FaultPlan) -> Option<Fixture> {
    Fixture::new(Engine::faulty(inner).with_plan(plan), 8, STRIDE, 0, 16)
}

fn eio_surfaces_per_request(inner: Engine) {
    let Some(fx) = fixture(inner, FaultPlan::new().eio_on(2)) else {
        return;
    };
    for row in 0..4 {
        fill_row(&fx.region, row, row as u64 + 1);
    }
    let writes: Vec<_> = (0..4)
        .map(|i| req(IoDir::Write, i, i as usize, i))
        .collect();
    fx.engine.submit(&writes).unwrap();
    let done = collect(&*fx.engine, 4);
    let e = done[&1].as_ref().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io, "{e}");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e:?}");
    assert_eq!(e.context_value("offset"), Some(&*STRIDE.to_string()));
    for tag in [0, 2, 3] {
        assert_eq!(*done[&tag].as_ref().unwrap(), STRIDE, "tag {tag}");
    }
    // The failed write never reached the file: slot 1 reads back as zeros.
    fx.engine.submit(&[req(IoDir::Read, 1, 5, 10)]).unwrap();
    assert!(collect(&*fx.engine, 1)[&10].is_ok());
    assert!(row_bytes(&fx.region, 5).iter().all(|&b| b == 0));
    assert_eq!(fx.faults.as_ref().unwrap().counts().eio, 1);
    fx.engine.shutdown();
}

fn injected_short_transfer_fails(inner: Engine) {
    let plan = FaultPlan::new().short_on(1, 4096).short_on(3, 8192);
    let Some(fx) = fixture(inner, plan) else {
        return;
    };
    fill_row(&fx.region, 0, 9);
    fx.engine.submit(&[req(IoDir::Write, 0, 0, 1)]).unwrap();
    let e = collect(&*fx.engine, 1).remove(&1).unwrap().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ShortIo, "{e}");
    assert_eq!(e.context_value("found"), Some("4096"));
    // Only the first 4096 bytes really moved.
    assert_eq!(std::fs::metadata(&fx.path).unwrap().len(), 4096);
    // A full write, then a short read of it: the read fails even though bytes arrived.
    fx.engine.submit(&[req(IoDir::Write, 0, 0, 2)]).unwrap();
    assert!(collect(&*fx.engine, 1)[&2].is_ok());
    fx.engine.submit(&[req(IoDir::Read, 0, 1, 3)]).unwrap();
    let e = collect(&*fx.engine, 1).remove(&3).unwrap().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ShortIo, "{e}");
    assert_eq!(e.context_value("found"), Some("8192"));
    fx.engine.shutdown();
}

fn bit_flip_visible(inner: Engine) {
    let Some(fx) = fixture(inner, FaultPlan::new().flip_bit(2, 100, 3)) else {
        return;
    };
    fill_row(&fx.region, 0, 77);
    fx.engine.submit(&[req(IoDir::Write, 2, 0, 1)]).unwrap();
    assert!(collect(&*fx.engine, 1)[&1].is_ok());
    fx.engine.submit(&[req(IoDir::Read, 2, 1, 2)]).unwrap();
    assert!(collect(&*fx.engine, 1)[&2].is_ok());
    let (a, b) = (row_bytes(&fx.region, 0), row_bytes(&fx.region, 1));
    let diffs: Vec<_> = (0..STRIDE).filter(|&i| a[i] != b[i]).collect();
    assert_eq!(diffs, vec![100]);
    assert_eq!(a[100] ^ b[100], 1 << 3);
    assert_eq!(fx.faults.as_ref().unwrap().counts().flips, 1);
    fx.engine.shutdown();
}

fn writes_fail_after_limit(inner: Engine) {
    let Some(fx) = fixture(inner, FaultPlan::new().fail_writes_after(2)) else {
        return;
    };
    let writes: Vec<_> = (0..4)
        .map(|i| req(IoDir::Write, i, i as usize, i))
        .collect();
    fx.engine.submit(&writes).unwrap();
    let done = collect(&*fx.engine, 4);
    assert!(done[&0].is_ok() && done[&1].is_ok());
    for tag in [2, 3] {
        let e = done[&tag].as_ref().unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e:?}");
    }
    // Reads still work.
    fx.engine.submit(&[req(IoDir::Read, 1, 6, 9)]).unwrap();
    assert!(collect(&*fx.engine, 1)[&9].is_ok());
    fx.engine.shutdown();
}

fn latency_delays_and_shutdown_waits(inner: Engine) {
    let delay = Duration::from_millis(40);
    let Some(fx) = fixture(inner, FaultPlan::new().latency(delay).eio_on(3)) else {
        return;
    };
    let start = Instant::now();
    let writes: Vec<_> = (0..6)
        .map(|i| req(IoDir::Write, i, i as usize, i))
        .collect();
    fx.engine.submit(&writes).unwrap();
    // Shutdown must wait for the delayed completions, injected failures included.
    fx.engine.shutdown();
    assert!(start.elapsed() >= delay, "completions were not delayed");
    let mut n = 0;
    while let Ok(c) = fx.engine.completions().try_recv() {
        assert_eq!(c.result.is_err(), c.tag == 2, "tag {}", c.tag);
        n += 1;
    }
    assert_eq!(n, 6);
    assert_eq!(
        fx.engine.submit(&writes[..1]).unwrap_err().kind(),
        ErrorKind::Closed
    );
}

macro_rules! fault_suite {
    ($module:ident, $inner:expr) => {
        mod $module {
            use super::*;

            #[test]
            fn eio_surfaces_per_request() {
                super::eio_surfaces_per_request($inner);
            }
            #[test]
            fn injected_short_transfer_fails() {
                super::injected_short_transfer_fails($inner);
            }
            #[test]
            fn bit_flip_visible() {
                super::bit_flip_visible($inner);
            }
            #[test]
            fn writes_fail_after_limit() {
                super::writes_fail_after_limit($inner);
            }
            #[test]
            fn latency_delays_and_shutdown_waits() {
                super::latency_delays_and_shutdown_waits($inner);
            }
        }
    };
}

fault_suite!(over_psync, Engine::Psync);
fault_suite!(over_uring, Engine::Uring);
