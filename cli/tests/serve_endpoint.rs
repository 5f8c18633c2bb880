//! `kvtier serve`'s HTTP endpoint under the clients a real network brings (issue 20 item 8):
//! idle connections, a client trickling its request a byte at a time, an oversized head,
//! garbage and wrong methods. None of them may delay `/healthz` or `/metrics` for anyone else
//! (all on loopback).

mod cli_common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cli_common::{send_signal, start_serve, write_config};

/// How long `/healthz` and `/metrics` may take while the bad clients hold their connections.
const PROMPT: Duration = Duration::from_secs(1);

/// Sends `request` and reads the whole answer (the server closes after it), within 5 s.
fn exchange(addr: &str, request: &[u8]) -> Result<String, String> {
    let mut s = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(request).map_err(|e| format!("write: {e}"))?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)
        .map_err(|e| format!("no whole answer within 5 s: {e}"))?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// A GET of `path`: its answer and how long it took.
fn timed_get(addr: &str, path: &str) -> (Duration, Result<String, String>) {
    let start = Instant::now();
    let answer = exchange(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes(),
    );
    (start.elapsed(), answer)
}

fn status_line(answer: &str) -> &str {
    answer.lines().next().unwrap_or("")
}

/// A client on its own thread: sends `first`, then `each` every `pause` until `stop`, the
/// server closing on it, or 20 s; returns what the server answered meanwhile (read after every
/// write, before a reset can drop it). `sent` counts the bytes it got out.
fn writer_thread(
    addr: &str,
    first: &'static [u8],
    each: &'static [u8],
    pause: Duration,
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicUsize>,
) -> std::thread::JoinHandle<Option<String>> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(5))).unwrap();
    std::thread::spawn(move || {
        let start = Instant::now();
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        if s.write_all(first).is_ok() {
            sent.fetch_add(first.len(), Ordering::SeqCst);
        }
        while !stop.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(20) {
            let wrote = s.write_all(each).is_ok();
            if wrote {
                sent.fetch_add(each.len(), Ordering::SeqCst);
            }
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
                Err(_) => break,
            }
            if !wrote {
                break;
            }
            std::thread::sleep(pause);
        }
        (!answer.is_empty()).then(|| String::from_utf8_lossy(&answer).into_owned())
    })
}

/// Waits (up to 20 s) until `sent` has reached `bytes`.
fn wait_sent(sent: &AtomicUsize, bytes: usize) {
    let start = Instant::now();
    while sent.load(Ordering::SeqCst) < bytes && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn idle_trickling_and_oversized_clients_do_not_delay_health_or_metrics() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let cfg = write_config(dir.path());
    let (mut child, addr) = start_serve(&[
        "--config",
        cfg.to_str().unwrap(),
        "--metrics-addr",
        "127.0.0.1:0",
    ]);
    let (_, first) = timed_get(&addr, "/metrics");
    assert!(
        first
            .as_deref()
            .is_ok_and(|a| a.starts_with("HTTP/1.1 200")),
        "{first:?}"
    );

    // Ten clients that connect and say nothing, one that stops in the middle of its head.
    let idle: Vec<TcpStream> = (0..10)
        .map(|_| TcpStream::connect(&addr).unwrap())
        .collect();
    let mut half = TcpStream::connect(&addr).unwrap();
    half.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    // One that trickles a header a byte every 50 ms, forever; one that sends an endless head.
    // (The flooder stops by itself once answered; the trickler when told.)
    let stop = Arc::new(AtomicBool::new(false));
    let (trickled, flooded) = (Arc::default(), Arc::default());
    let trickler = writer_thread(
        &addr,
        b"GET /metrics HTTP/1.1\r\nX-Slow: ",
        b"a",
        Duration::from_millis(50),
        Arc::clone(&stop),
        Arc::clone(&trickled),
    );
    let flooder = writer_thread(
        &addr,
        b"GET /metrics HTTP/1.1\r\nX-Big: ",
        &[b'b'; 4096],
        Duration::from_millis(1),
        Arc::new(AtomicBool::new(false)),
        Arc::clone(&flooded),
    );
    // Both are under way (on a busy machine a new thread may wait to run).
    wait_sent(&trickled, 40);
    wait_sent(&flooded, 12 << 10);

    for round in 0..3 {
        for path in ["/healthz", "/metrics"] {
            let (took, answer) = timed_get(&addr, path);
            assert!(
                took < PROMPT,
                "round {round}: {path} took {took:?} with idle and slow clients connected: \
                 {answer:?}"
            );
            let answer = answer.unwrap();
            assert!(
                answer.starts_with("HTTP/1.1 200 OK\r\n"),
                "round {round}: {path}: {answer}"
            );
        }
    }

    // Garbage is a 400, a wrong method a 405 naming the allowed ones, both at once.
    let start = Instant::now();
    let garbage = exchange(
        &addr,
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
    )
    .unwrap();
    assert!(
        status_line(&garbage).starts_with("HTTP/1.1 400 "),
        "{garbage}"
    );
    let post = exchange(&addr, b"POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    assert!(status_line(&post).starts_with("HTTP/1.1 405 "), "{post}");
    assert!(post.contains("\r\nAllow: GET, HEAD\r\n"), "{post}");
    assert!(start.elapsed() < 2 * PROMPT, "{:?}", start.elapsed());

    let flooded = flooder.join().unwrap();
    assert!(
        flooded
            .as_deref()
            .is_some_and(|a| status_line(a).starts_with("HTTP/1.1 431 ")),
        "an endless head must be refused with 431: {flooded:?}"
    );
    stop.store(true, Ordering::SeqCst);
    let _ = trickler.join().unwrap();

    // SIGTERM with the idle clients still connected: serve stops promptly.
    send_signal(&child, libc::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("kvtier serve did not stop within 30 s with idle clients connected");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(0));
    drop(idle);
    drop(half);
}
