//! The life of `kvtier serve`: start the metrics endpoint, wait for SIGTERM or Ctrl-C, then
//! drain and shut the service down (checkpoint included) and stop the endpoint.
//!
//! The service sits behind a mutex shared with the HTTP thread: a scrape locks it, lets it
//! collect finished work and renders the metrics; the signal wait blocks (no polling loop).

use std::io::Write;
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use crate::output::{errln, outln};
use crate::serve::http::{CheckHealth, Limits, MetricsServer, RenderMetrics};
use kvtier::error::{Error, ErrorKind, Result};

/// What `serve` runs: something that renders metrics and shuts down cleanly.
pub trait Service: Send {
    /// Collects finished work and renders every metric as Prometheus text.
    fn metrics_text(&mut self) -> Result<String>;

    /// `Ok(body)` while serving (`ok`, or `degraded` with the problems); `Err(reasons)` when
    /// it cannot serve.
    fn health(&mut self) -> std::result::Result<String, String> {
        Ok("ok".to_string())
    }

    /// Drains in-flight work, persists what must survive (checkpoints) and stops.
    fn shutdown(&mut self) -> Result<()>;
}

/// Serves `service` on `listener` (bound by [`crate::serve::http::bind`]) until SIGTERM
/// or SIGINT, then shuts it down. Prints `kvtier serve: listening on http://ADDR/metrics` on
/// stdout once the endpoint is up (tests and scripts read the address from it).
pub fn serve_until_signal(listener: TcpListener, service: Box<dyn Service>) -> Result<()> {
    // Register the handlers before announcing the address, so a signal sent right after the
    // announcement is never lost.
    let mut signals = Signals::new([SIGTERM, SIGINT]).map_err(|e| {
        Error::new(
            ErrorKind::Internal,
            format!("cannot install the SIGTERM/SIGINT handlers: {e}"),
        )
    })?;
    let service = Arc::new(Mutex::new(service));
    let draining = Arc::new(AtomicBool::new(false));
    let render: RenderMetrics = {
        let service = Arc::clone(&service);
        Arc::new(move || service.lock().metrics_text())
    };
    let health: CheckHealth = {
        let service = Arc::clone(&service);
        let draining = Arc::clone(&draining);
        Arc::new(move || {
            if draining.load(Ordering::SeqCst) {
                return Err("shutting down".to_string());
            }
            service.lock().health()
        })
    };
    let server = MetricsServer::start_with(listener, render, health, Limits::default())?;
    outln!(
        "kvtier serve: listening on http://{}/metrics",
        server.local_addr()
    )?;
    let _ = std::io::stdout().flush();

    let signal = signals.forever().next();
    draining.store(true, Ordering::SeqCst);
    let name = match signal {
        Some(SIGTERM) => "SIGTERM",
        Some(SIGINT) => "SIGINT",
        _ => "a signal",
    };
    errln!("kvtier serve: {name} received: draining jobs and writing checkpoints");
    let result = service.lock().shutdown();
    server.stop();
    if result.is_ok() {
        errln!("kvtier serve: stopped cleanly");
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fake {
        scrapes: u32,
    }

    impl Service for Fake {
        fn metrics_text(&mut self) -> Result<String> {
            self.scrapes += 1;
            Ok(format!("fake_scrapes {}\n", self.scrapes))
        }
        fn shutdown(&mut self) -> Result<()> {
            Ok(())
        }
    }

    #[test]
    fn fake_service_renders() {
        let mut f = Fake { scrapes: 0 };
        assert_eq!(f.metrics_text().unwrap(), "fake_scrapes 1\n");
        assert!(f.health().is_ok());
        f.shutdown().unwrap();
    }
}
