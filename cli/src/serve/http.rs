//! The HTTP/1.1 endpoint of `kvtier serve`: `GET /metrics` (Prometheus text) and
//! `GET /healthz`, `Connection: close`.
//!
//! Its clients are a Prometheus scraper and health probes, but it must stay answerable whatever
//! else connects, so:
//! * every connection is served on its own thread: an idle, slow or hostile client never
//!   delays another; at most [`Limits::max_connections`] are served at once, and a connection
//!   beyond that gets `503` at once (without reading it) instead of waiting;
//! * a request's head must arrive whole within [`Limits::request_deadline`], one deadline for
//!   the whole head however it trickles in (`408` after it), and may not exceed
//!   [`Limits::max_head_bytes`] (`431`, or `414` when the request line alone is longer);
//! * the answer must be taken within [`Limits::response_deadline`];
//! * a head that is not HTTP/1.x is a `400` (`505` for another HTTP version), a method other
//!   than GET or HEAD on a known path a `405` with `Allow: GET, HEAD`.
//!
//! The accept loop blocks in `accept` (no polling); [`MetricsServer::stop`] wakes it with a
//! connection to itself, then shuts the open connections down and waits for their threads.
//! Reading and checking the request head lives in `head`.
//!
//! The server is written here, on `std` alone: the small server crates cannot do the above
//! (`tiny_http` 0.12 owns the accepted sockets and has no deadline, head cap or connection
//! limit, and keeps connections open after the answer and at stop; served by it, the 12 tests
//! of `serve` that read an answer fail). The comparison and the measurement: docs/metrics.md,
//! "Why the endpoint has its own server".

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use kvtier::error::{Error, ErrorKind, Result};

mod answer;
mod head;

use answer::{ALLOWED_METHODS, Answer};

use head::{Head, Request, parse_request, read_head};

/// Default metrics address: loopback only (never all interfaces unless asked).
pub const DEFAULT_METRICS_ADDR: &str = "127.0.0.1:9464";

/// Produces the `/metrics` body; an error becomes a 500 answer.
pub type RenderMetrics = Arc<dyn Fn() -> Result<String> + Send + Sync>;
/// Answers `/healthz`: `Ok(body)` = serving (200: `ok`, or `degraded` with the problems),
/// `Err(body)` = cannot serve (503, with the reasons).
pub type CheckHealth = Arc<dyn Fn() -> std::result::Result<String, String> + Send + Sync>;

/// What one client may take of the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once; one more is answered `503` without being read.
    pub max_connections: usize,
    /// Time from accepting a connection to the end of its request head.
    pub request_deadline: Duration,
    /// Largest request head (request line and headers).
    pub max_head_bytes: usize,
    /// Time to hand the whole answer to a client that reads slowly.
    pub response_deadline: Duration,
}

impl Default for Limits {
    /// 64 connections, 5 s for the head, 8 KiB of head, 10 s for the answer.
    fn default() -> Self {
        Limits {
            max_connections: 64,
            request_deadline: Duration::from_secs(5),
            max_head_bytes: 8 << 10,
            response_deadline: Duration::from_secs(10),
        }
    }
}

/// After an error answer, how long (and how many bytes) the server keeps reading what the
/// client still sends before closing, so that closing with unread bytes (a TCP reset) does
/// not destroy the answer before the client has read it.
const LINGER: Duration = Duration::from_millis(500);
const LINGER_BYTES: usize = 64 << 10;

/// A running metrics server.
pub struct MetricsServer {
    addr: SocketAddr,
    stopping: Arc<AtomicBool>,
    connections: Arc<Connections>,
    thread: Option<JoinHandle<()>>,
}

/// The connections being served: a clone of each stream (so that [`MetricsServer::stop`] can
/// shut them down) and a signal when the last one ends.
#[derive(Default)]
struct Connections {
    open: Mutex<HashMap<u64, TcpStream>>,
    ended: Condvar,
}

/// Removes its connection from [`Connections`] when the serving thread ends (also on panic).
struct Registered {
    connections: Arc<Connections>,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        let mut open = self.connections.open.lock();
        open.remove(&self.id);
        if open.is_empty() {
            self.connections.ended.notify_all();
        }
    }
}

impl MetricsServer {
    /// Binds `addr` (`host:port`; port 0 picks a free port) and starts serving with the
    /// default [`Limits`]. A bad or busy address is a user error ([`ErrorKind::Config`])
    /// naming the address.
    #[cfg(test)]
    pub fn start(addr: &str, render: RenderMetrics, health: CheckHealth) -> Result<Self> {
        Self::start_with(bind(addr)?, render, health, Limits::default())
    }

    /// Starts serving on a listener bound by [`bind`], within `limits`.
    pub fn start_with(
        listener: TcpListener,
        render: RenderMetrics,
        health: CheckHealth,
        limits: Limits,
    ) -> Result<Self> {
        let bound = listener.local_addr().map_err(|e| {
            Error::new(ErrorKind::Io, format!("cannot read the bound address: {e}")).with_source(e)
        })?;
        let stopping = Arc::new(AtomicBool::new(false));
        let connections = Arc::new(Connections::default());
        let server = Server {
            stopping: Arc::clone(&stopping),
            connections: Arc::clone(&connections),
            render,
            health,
            limits,
        };
        let thread = std::thread::Builder::new()
            .name("kvtier-metrics".into())
            .spawn(move || server.accept_loop(listener))
            .map_err(|e| {
                Error::new(
                    ErrorKind::Internal,
                    format!("cannot start the metrics thread: {e}"),
                )
            })?;
        Ok(MetricsServer {
            addr: bound,
            stopping,
            connections,
            thread: Some(thread),
        })
    }

    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, cuts the open connections and waits for their threads.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        self.stopping.store(true, Ordering::SeqCst);
        // Wake the blocking accept with a connection to ourselves (to loopback when bound to
        // the unspecified address).
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(match wake {
                SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        if let Err(e) = TcpStream::connect_timeout(&wake, Duration::from_secs(5)) {
            log::warn!("metrics server: cannot wake the accept loop at {wake}: {e}");
        }
        if thread.join().is_err() {
            log::error!("metrics server thread panicked");
        }
        // No new connection can be registered now; end the open ones (a blocked read or
        // write returns at once) and wait for their threads to let go.
        let mut open = self.connections.open.lock();
        for stream in open.values() {
            let _ = stream.shutdown(Shutdown::Both);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while !open.is_empty() {
            if self
                .connections
                .ended
                .wait_until(&mut open, deadline)
                .timed_out()
            {
                log::warn!(
                    "metrics server: {} connection(s) still busy at stop",
                    open.len()
                );
                break;
            }
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Binds the metrics address: a bad or busy address is a user error ([`ErrorKind::Config`])
/// naming it. `serve` binds before it builds anything else, so a busy port costs nothing.
pub fn bind(addr: &str) -> Result<TcpListener> {
    let resolved: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| {
            Error::config(
                "--metrics-addr",
                format!("{addr:?} is not a host:port address ({e})"),
            )
        })?
        .collect();
    TcpListener::bind(&resolved[..]).map_err(|e| {
        Error::config("--metrics-addr", format!("cannot listen on {addr}: {e}")).with_source(e)
    })
}

/// What the accept loop hands every connection thread.
#[derive(Clone)]
struct Server {
    stopping: Arc<AtomicBool>,
    connections: Arc<Connections>,
    render: RenderMetrics,
    health: CheckHealth,
    limits: Limits,
}

impl Server {
    fn accept_loop(self, listener: TcpListener) {
        let mut next_id = 0u64;
        for conn in listener.incoming() {
            if self.stopping.load(Ordering::SeqCst) {
                break;
            }
            let stream = match conn {
                Ok(stream) => stream,
                Err(e) => {
                    log::warn!("metrics server: accept failed: {e}");
                    continue;
                }
            };
            next_id += 1;
            self.admit(stream, next_id);
        }
    }

    /// Serves `stream` on its own thread, or answers 503 at once when the server is full.
    fn admit(&self, stream: TcpStream, id: u64) {
        let registered = {
            let mut open = self.connections.open.lock();
            if open.len() >= self.limits.max_connections {
                None
            } else {
                match stream.try_clone() {
                    Ok(clone) => {
                        open.insert(id, clone);
                        Some(Registered {
                            connections: Arc::clone(&self.connections),
                            id,
                        })
                    }
                    Err(e) => {
                        log::debug!("metrics server: cannot track a connection: {e}");
                        return;
                    }
                }
            }
        };
        let Some(registered) = registered else {
            refuse_busy(stream, self.limits.max_connections);
            return;
        };
        let server = self.clone();
        let spawned = std::thread::Builder::new()
            .name("kvtier-http".into())
            .spawn(move || {
                let _registered = registered;
                if let Err(e) = server.serve(stream) {
                    log::debug!("metrics server: connection failed: {e}");
                }
            });
        if let Err(e) = spawned {
            // The closure (and with it the registration) is dropped: the slot is free again.
            log::warn!("metrics server: cannot start a connection thread: {e}");
        }
    }

    /// Reads one request within the deadline and answers it.
    fn serve(&self, mut stream: TcpStream) -> std::io::Result<()> {
        let deadline = Instant::now() + self.limits.request_deadline;
        let answer = match read_head(&mut stream, deadline, self.limits.max_head_bytes)? {
            Head::Closed => return Ok(()), // the wake-up connection, or a client that said nothing
            Head::Complete(head) => match parse_request(&head) {
                Ok(request) => self.answer(&request),
                Err(refusal) => refusal,
            },
            Head::TimedOut => Answer::text(
                "408 Request Timeout",
                format!(
                    "the request did not arrive within {} s\n",
                    self.limits.request_deadline.as_secs_f64()
                ),
            ),
            Head::TooLarge { in_request_line } => {
                let (status, what) = if in_request_line {
                    ("414 URI Too Long", "request line")
                } else {
                    ("431 Request Header Fields Too Large", "request head")
                };
                Answer::text(
                    status,
                    format!("the {what} exceeds {} bytes\n", self.limits.max_head_bytes),
                )
            }
            Head::Incomplete => Answer::text("400 Bad Request", "incomplete request head\n"),
        };
        let complete = answer.status.starts_with('2') || answer.status.starts_with("404");
        write_answer(
            &mut stream,
            &answer,
            Instant::now() + self.limits.response_deadline,
        )?;
        if !complete {
            linger(&mut stream);
        }
        Ok(())
    }

    fn answer(&self, request: &Request) -> Answer {
        let path = request.target.split('?').next().unwrap_or("");
        let known = route_known(path);
        let mut answer = if request.method != "GET" && request.method != "HEAD" {
            if known {
                let mut a = Answer::text(
                    "405 Method Not Allowed",
                    format!("{path} answers {ALLOWED_METHODS} only\n"),
                );
                a.allow = true;
                a
            } else {
                not_found()
            }
        } else if self.stopping.load(Ordering::SeqCst) {
            Answer::text("503 Service Unavailable", "shutting down\n")
        } else {
            route(path, &self.render, &self.health)
        };
        answer.head_only = request.method == "HEAD";
        answer
    }
}

/// Answers `503` to a connection over the limit without reading it (the write fits in an
/// empty socket buffer, so it does not block) and closes it.
fn refuse_busy(mut stream: TcpStream, limit: usize) {
    let mut answer = Answer::text(
        "503 Service Unavailable",
        format!("{limit} connections are open; try again\n"),
    );
    answer.retry_after = true;
    let _ = stream.set_nonblocking(true);
    let _ = stream.write_all(&answer.to_bytes());
    let _ = stream.shutdown(Shutdown::Write);
}

/// Reads and drops what the client still sends, briefly, before the connection closes.
fn linger(stream: &mut TcpStream) {
    let _ = stream.shutdown(Shutdown::Write);
    let deadline = Instant::now() + LINGER;
    let mut left = LINGER_BYTES;
    let mut buf = [0u8; 4096];
    while left > 0 {
        let wait = deadline.saturating_duration_since(Instant::now());
        if wait.is_zero() || stream.set_read_timeout(Some(wait)).is_err() {
            return;
        }
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => left = left.saturating_sub(n),
        }
    }
}

fn not_found() -> Answer {
    Answer::text("404 Not Found", "not found: try /metrics or /healthz\n")
}

/// The paths [`route`] answers.
fn route_known(path: &str) -> bool {
    matches!(path, "/metrics" | "/healthz" | "/")
}

/// The answer for a path (pure routing, unit-tested).
fn route(path: &str, render: &RenderMetrics, health: &CheckHealth) -> Answer {
    match path {
        "/metrics" => match render() {
            Ok(body) => Answer::metrics(body),
            Err(e) => Answer::text("500 Internal Server Error", format!("{e}\n")),
        },
        "/healthz" => match health() {
            Ok(body) => Answer::text("200 OK", with_newline(body)),
            Err(reason) => Answer::text("503 Service Unavailable", with_newline(reason)),
        },
        "/" => Answer::text("200 OK", "kvtier: see /metrics and /healthz\n"),
        _ => not_found(),
    }
}

fn with_newline(mut s: String) -> String {
    if !s.ends_with('\n') {
        s.push('\n');
    }
    s
}

/// Writes the answer, all of it before `deadline` (a client that reads too slowly is cut off).
fn write_answer(stream: &mut TcpStream, answer: &Answer, deadline: Instant) -> std::io::Result<()> {
    let bytes = answer.to_bytes();
    let mut sent = 0;
    while sent < bytes.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the client did not take the answer in time",
            ));
        }
        stream.set_write_timeout(Some(left))?;
        match stream.write(&bytes[sent..]) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    fn get(addr: SocketAddr, path: &str) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn serves_metrics_health_and_404_then_stops() {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = Arc::clone(&calls);
        let render: RenderMetrics = Arc::new(move || {
            let n = c.fetch_add(1, Ordering::SeqCst) + 1;
            Ok(format!("demo_scrapes_total {n}\n"))
        });
        let health: CheckHealth = Arc::new(|| Err("draining".to_string()));
        let server = MetricsServer::start("127.0.0.1:0", render, health).unwrap();
        let addr = server.local_addr();
        assert_ne!(addr.port(), 0);

        let m = get(addr, "/metrics");
        assert!(m.starts_with("HTTP/1.1 200 OK\r\n"), "{m}");
        assert!(m.contains("text/plain; version=0.0.4"), "{m}");
        assert!(m.ends_with("demo_scrapes_total 1\n"), "{m}");
        assert!(get(addr, "/metrics?x=1").ends_with("demo_scrapes_total 2\n"));
        let h = get(addr, "/healthz");
        assert!(h.starts_with("HTTP/1.1 503"), "{h}");
        assert!(h.ends_with("draining\n"), "{h}");
        assert!(get(addr, "/nope").starts_with("HTTP/1.1 404"));

        let mut s = TcpStream::connect(addr).unwrap();
        write!(s, "POST /metrics HTTP/1.1\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        assert!(out.starts_with("HTTP/1.1 405"), "{out}");

        server.stop();
        assert!(
            TcpStream::connect(addr).is_err(),
            "still listening after stop"
        );
    }

    #[test]
    fn render_error_is_500_and_bad_address_is_a_config_error() {
        let render: RenderMetrics = Arc::new(|| Err(Error::new(ErrorKind::Closed, "manager gone")));
        let health: CheckHealth = Arc::new(|| Ok("ok".to_string()));
        let a = route("/metrics", &render, &health);
        assert_eq!(a.status, "500 Internal Server Error");
        assert!(a.body.contains("manager gone"));
        assert_eq!(route("/healthz", &render, &health).status, "200 OK");

        let err = MetricsServer::start("not-an-address", render, health)
            .err()
            .unwrap();
        assert_eq!(err.kind(), ErrorKind::Config);
        assert!(err.to_string().contains("--metrics-addr"), "{err}");
    }

    /// A server with test limits whose metrics and health always answer.
    fn test_server(limits: Limits) -> MetricsServer {
        let render: RenderMetrics = Arc::new(|| Ok("up 1\n".to_string()));
        let health: CheckHealth = Arc::new(|| Ok("ok".to_string()));
        MetricsServer::start_with(bind("127.0.0.1:0").unwrap(), render, health, limits).unwrap()
    }

    /// Sends raw bytes, reads the whole answer (or what came before the server closed).
    fn exchange(addr: SocketAddr, request: &[u8]) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = s.write_all(request);
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    }

    #[test]
    fn malformed_requests_are_400_and_other_versions_505() {
        let server = test_server(Limits::default());
        let addr = server.local_addr();
        for bad in [
            &b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n"[..],
            b"hello\r\n\r\n",
            b"GET\r\n\r\n",
            b"GET /metrics\r\n\r\n",
            b"GET  /metrics HTTP/1.1\r\n\r\n",
            b"GET /metrics HTTP/1.1 extra\r\n\r\n",
            b"G(T /metrics HTTP/1.1\r\n\r\n",
            b"GET metrics HTTP/1.1\r\n\r\n",
            b"GET /metrics FTP/1.1\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\nHost : x\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\nX-A: \x01\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\nHost: \xff\r\n\r\n",
        ] {
            let a = exchange(addr, bad);
            assert!(
                a.starts_with("HTTP/1.1 400 Bad Request\r\n"),
                "{:?}: {a}",
                String::from_utf8_lossy(bad)
            );
        }
        // A client that closes in the middle of its head.
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            .unwrap();
        s.shutdown(Shutdown::Write).unwrap();
        let mut a = String::new();
        s.read_to_string(&mut a).unwrap();
        assert!(a.starts_with("HTTP/1.1 400 "), "{a}");

        let a = exchange(addr, b"GET /metrics HTTP/2.0\r\n\r\n");
        assert!(a.starts_with("HTTP/1.1 505 "), "{a}");
        // Bare LF line ends and absolute-form targets are accepted (RFC 9112).
        let a = exchange(
            addr,
            b"GET http://127.0.0.1/metrics?x HTTP/1.0\nHost: x\n\n",
        );
        assert!(
            a.starts_with("HTTP/1.1 200 OK\r\n") && a.ends_with("up 1\n"),
            "{a}"
        );
    }

    #[test]
    fn wrong_methods_are_405_with_allow_and_head_has_no_body() {
        let server = test_server(Limits::default());
        let addr = server.local_addr();
        for method in ["POST", "PUT", "DELETE", "OPTIONS", "get"] {
            let a = exchange(
                addr,
                format!("{method} /healthz HTTP/1.1\r\n\r\n").as_bytes(),
            );
            assert!(a.starts_with("HTTP/1.1 405 Method Not Allowed\r\n"), "{a}");
            assert!(a.contains("\r\nAllow: GET, HEAD\r\n"), "{a}");
        }
        let a = exchange(addr, b"POST /nope HTTP/1.1\r\n\r\n");
        assert!(a.starts_with("HTTP/1.1 404 "), "{a}");
        let a = exchange(addr, b"HEAD /metrics HTTP/1.1\r\n\r\n");
        assert!(a.starts_with("HTTP/1.1 200 OK\r\n"), "{a}");
        assert!(
            a.contains("Content-Length: 5\r\n") && a.ends_with("\r\n\r\n"),
            "{a}"
        );
    }

    #[test]
    fn a_trickled_head_gets_408_at_the_deadline_and_a_long_one_431() {
        let limits = Limits {
            request_deadline: Duration::from_millis(300),
            max_head_bytes: 256,
            ..Limits::default()
        };
        let server = test_server(limits);
        let addr = server.local_addr();
        // One byte every 20 ms never finishes the head: cut at the deadline, not per read.
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(5))).unwrap();
        let start = Instant::now();
        s.write_all(b"GET /metrics HTTP/1.1\r\nX-Slow: ").unwrap();
        let mut answer = Vec::new();
        let mut buf = [0u8; 512];
        while start.elapsed() < Duration::from_secs(5) {
            if s.write_all(b"a").is_err() {
                break;
            }
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
                Err(_) => {}
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
        // Said nothing at all: closed at the deadline with 408 as well.
        let a = exchange(addr, b"");
        assert!(a.starts_with("HTTP/1.1 408 "), "{a}");

        let long_header = format!("GET / HTTP/1.1\r\nX-Big: {}\r\n\r\n", "b".repeat(300));
        let a = exchange(addr, long_header.as_bytes());
        assert!(a.starts_with("HTTP/1.1 431 "), "{a}");
        let long_line = format!("GET /{} HTTP/1.1\r\n\r\n", "p".repeat(300));
        let a = exchange(addr, long_line.as_bytes());
        assert!(a.starts_with("HTTP/1.1 414 "), "{a}");
        // A head of exactly the cap is fine.
        let fits = format!("GET /metrics HTTP/1.1\r\nX-Pad: {}", "c".repeat(256));
        let fits = format!("{}\r\n\r\n", &fits[..256]);
        let a = exchange(addr, fits.as_bytes());
        assert!(a.starts_with("HTTP/1.1 200 "), "{a}");
    }

    #[test]
    fn beyond_the_connection_limit_the_answer_is_503_at_once_and_stop_cuts_idle_clients() {
        let limits = Limits {
            max_connections: 3,
            ..Limits::default()
        };
        let server = test_server(limits);
        let addr = server.local_addr();
        let idle: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(addr).unwrap()).collect();
        // Let the accept loop register them.
        let start = Instant::now();
        let mut a = String::new();
        while start.elapsed() < Duration::from_secs(5) {
            a = exchange(addr, b"GET /healthz HTTP/1.1\r\n\r\n");
            if a.starts_with("HTTP/1.1 503 ") {
                break;
            }
        }
        assert!(
            a.starts_with("HTTP/1.1 503 ") && a.contains("Retry-After: 1\r\n"),
            "{a}"
        );
        let start = Instant::now();
        server.stop();
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
        for mut s in idle {
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut rest = Vec::new();
            // Cut by stop: end of stream (or a reset), not a timeout.
            if let Err(e) = s.read_to_end(&mut rest) {
                assert_ne!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}");
            }
        }
    }
}
