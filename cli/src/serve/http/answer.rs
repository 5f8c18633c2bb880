//! One HTTP answer of the endpoint: its status line, headers and body, as bytes on the wire.

/// Prometheus text exposition content type.
const METRICS_CONTENT_TYPE: &str = kvtier::metrics::CONTENT_TYPE;

/// The methods every path answers.
pub(super) const ALLOWED_METHODS: &str = "GET, HEAD";

/// One answer: status line, content type, body, and the headers some answers add.
#[derive(Debug)]
pub(super) struct Answer {
    pub(super) status: &'static str,
    pub(super) content_type: &'static str,
    pub(super) body: String,
    /// `Allow: GET, HEAD` (a 405).
    pub(super) allow: bool,
    /// `Retry-After: 1` (a 503 for too many connections).
    pub(super) retry_after: bool,
    /// A HEAD request: the headers of the GET answer, no body.
    pub(super) head_only: bool,
}

impl Answer {
    pub(super) fn text(status: &'static str, body: impl Into<String>) -> Self {
        Answer {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
            allow: false,
            retry_after: false,
            head_only: false,
        }
    }

    pub(super) fn metrics(body: String) -> Self {
        Answer {
            content_type: METRICS_CONTENT_TYPE,
            ..Answer::text("200 OK", body)
        }
    }

    /// The status line, headers and (unless `head_only`) the body.
    pub(super) fn to_bytes(&self) -> Vec<u8> {
        let mut head = format!(
            "HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
            self.status,
            self.content_type,
            self.body.len()
        );
        if self.allow {
            head.push_str(&format!("Allow: {ALLOWED_METHODS}\r\n"));
        }
        if self.retry_after {
            head.push_str("Retry-After: 1\r\n");
        }
        head.push_str("\r\n");
        let mut bytes = head.into_bytes();
        if !self.head_only {
            bytes.extend_from_slice(self.body.as_bytes());
        }
        bytes
    }
}
