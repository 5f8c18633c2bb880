//! A tiny HTTP/1.1 server for the metrics endpoint: `GET /metrics` (Prometheus text) and
//! `GET /healthz`, one connection at a time on one thread, `Connection: close`.
//!
//! It is deliberately minimal: the only clients are a Prometheus scraper and health probes.
//! The accept loop blocks in `accept` (no polling); [`MetricsServer::stop`] wakes it with a
//! connection to itself. Every connection has read and write timeouts, so a stuck client cannot
//! hold the server for more than a few seconds.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::error::{Error, ErrorKind, Result};

/// Default metrics address: loopback only (never all interfaces unless asked).
pub const DEFAULT_METRICS_ADDR: &str = "127.0.0.1:9464";

/// Prometheus text exposition content type.
const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// How long a client may take to send its request or read the answer.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);

/// Produces the `/metrics` body; an error becomes a 500 answer.
pub type RenderMetrics = Arc<dyn Fn() -> Result<String> + Send + Sync>;
/// Answers `/healthz`: `Ok(body)` = serving (200: `ok`, or `degraded` with the problems),
/// `Err(body)` = cannot serve (503, with the reasons).
pub type CheckHealth = Arc<dyn Fn() -> std::result::Result<String, String> + Send + Sync>;

/// A running metrics server.
pub struct MetricsServer {
    addr: SocketAddr,
    stopping: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Binds `addr` (`host:port`; port 0 picks a free port) and starts serving.
    /// A bad or busy address is a user error ([`ErrorKind::Config`]) naming the address.
    pub fn start(addr: &str, render: RenderMetrics, health: CheckHealth) -> Result<Self> {
        let resolved: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|e| {
                Error::config(
                    "--metrics-addr",
                    format!("{addr:?} is not a host:port address ({e})"),
                )
            })?
            .collect();
        let listener = TcpListener::bind(&resolved[..]).map_err(|e| {
            Error::config("--metrics-addr", format!("cannot listen on {addr}: {e}")).with_source(e)
        })?;
        let bound = listener.local_addr().map_err(|e| {
            Error::new(ErrorKind::Io, format!("cannot read the bound address: {e}")).with_source(e)
        })?;
        let stopping = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stopping);
        let thread = std::thread::Builder::new()
            .name("kvtier-metrics".into())
            .spawn(move || accept_loop(listener, flag, render, health))
            .map_err(|e| {
                Error::new(
                    ErrorKind::Internal,
                    format!("cannot start the metrics thread: {e}"),
                )
            })?;
        Ok(MetricsServer {
            addr: bound,
            stopping,
            thread: Some(thread),
        })
    }

    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, finishes the connection in progress and joins the thread.
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
        if let Err(e) = TcpStream::connect_timeout(&wake, CLIENT_TIMEOUT) {
            log::warn!("metrics server: cannot wake the accept loop at {wake}: {e}");
        }
        if thread.join().is_err() {
            log::error!("metrics server thread panicked");
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(
    listener: TcpListener,
    stopping: Arc<AtomicBool>,
    render: RenderMetrics,
    health: CheckHealth,
) {
    for conn in listener.incoming() {
        if stopping.load(Ordering::SeqCst) {
            break;
        }
        match conn {
            Ok(stream) => {
                if let Err(e) = serve_one(stream, &render, &health) {
                    log::debug!("metrics server: connection failed: {e}");
                }
            }
            Err(e) => log::warn!("metrics server: accept failed: {e}"),
        }
    }
}

/// One answer: status line, content type, body.
struct Answer {
    status: &'static str,
    content_type: &'static str,
    body: String,
}

impl Answer {
    fn text(status: &'static str, body: impl Into<String>) -> Self {
        Answer {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
        }
    }
}

fn serve_one(
    stream: TcpStream,
    render: &RenderMetrics,
    health: &CheckHealth,
) -> std::io::Result<()> {
    stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
    stream.set_write_timeout(Some(CLIENT_TIMEOUT))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut request_line = String::new();
    if reader.read_line(&mut request_line)? == 0 {
        return Ok(()); // the wake-up connection, or a client that said nothing
    }
    // Skip the headers; nothing in them matters here.
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header)? == 0 || header == "\r\n" || header == "\n" {
            break;
        }
    }
    let mut parts = request_line.split_whitespace();
    let method = parts.next().unwrap_or("");
    let target = parts.next().unwrap_or("");
    let path = target.split('?').next().unwrap_or("");
    let head_only = method == "HEAD";
    let answer = if method != "GET" && !head_only {
        Answer::text(
            "405 Method Not Allowed",
            "only GET and HEAD are supported\n",
        )
    } else {
        route(path, render, health)
    };
    write_answer(stream, &answer, head_only)
}

/// The answer for a path (pure routing, unit-tested).
fn route(path: &str, render: &RenderMetrics, health: &CheckHealth) -> Answer {
    match path {
        "/metrics" => match render() {
            Ok(body) => Answer {
                status: "200 OK",
                content_type: METRICS_CONTENT_TYPE,
                body,
            },
            Err(e) => Answer::text("500 Internal Server Error", format!("{e}\n")),
        },
        "/healthz" => match health() {
            Ok(body) => Answer::text("200 OK", with_newline(body)),
            Err(reason) => Answer::text("503 Service Unavailable", with_newline(reason)),
        },
        "/" => Answer::text("200 OK", "kvtier: see /metrics and /healthz\n"),
        _ => Answer::text("404 Not Found", "not found: try /metrics or /healthz\n"),
    }
}

fn with_newline(mut s: String) -> String {
    if !s.ends_with('\n') {
        s.push('\n');
    }
    s
}

fn write_answer(mut stream: TcpStream, answer: &Answer, head_only: bool) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        answer.status,
        answer.content_type,
        answer.body.len()
    );
    stream.write_all(head.as_bytes())?;
    if !head_only {
        stream.write_all(answer.body.as_bytes())?;
    }
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
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
}
