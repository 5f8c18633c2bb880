//! Idle engines do not burn CPU: their threads block (on the request channel, or in the
//! kernel) instead of polling. Measured as CPU ticks used by the engine threads while idle;
//! a spinning thread would use most of a core even on a busy machine.

mod io_common;

use std::time::Duration;

use io_common::{Engine, Fixture, collect};
use kvtier::io::{IoDir, IoRequest};

/// CPU ticks (utime + stime) used so far by this process's threads whose name starts with
/// `prefix`.
fn thread_ticks(prefix: &str) -> u64 {
    let mut total = 0;
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if !comm.trim_end().starts_with(prefix) {
            continue;
        }
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        // Fields after the parenthesised name: state is field 3, utime 14, stime 15.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.len() > 12 {
            total += f[11].parse::<u64>().unwrap_or(0) + f[12].parse::<u64>().unwrap_or(0);
        }
    }
    total
}

#[test]
fn idle_engine_threads_block() {
    let fixtures: Vec<_> = [Engine::Psync, Engine::Uring, Engine::faulty(Engine::Uring)]
        .into_iter()
        .filter_map(|e| Fixture::new(e, 2, 4096, 0, 8))
        .collect();
    for fx in &fixtures {
        // One request each, so that every thread has run and gone idle.
        let req = IoRequest {
            dir: IoDir::Write,
            file: 0,
            file_offset: 0,
            region_offset: 0,
            len: 4096,
            tag: 1,
        };
        fx.engine.submit(&[req]).unwrap();
        assert!(collect(&*fx.engine, 1)[&1].is_ok());
    }
    let before = thread_ticks("kvtier-");
    std::thread::sleep(Duration::from_secs(1));
    let used = thread_ticks("kvtier-") - before;
    // 5 ticks is 50 ms at the usual 100 Hz: far below what one spinning thread uses in 1 s.
    assert!(
        used <= 5,
        "idle engine threads used {used} CPU ticks in 1 s"
    );
    for fx in &fixtures {
        fx.engine.shutdown();
    }
}
