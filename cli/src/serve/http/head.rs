//! Reading and checking a request head for the endpoint in [`super`]: the head must arrive
//! whole before a deadline and fit a size cap, and be an HTTP/1.x request line with well-formed
//! header lines (RFC 9112); anything else becomes the error answer to send.

use std::io::Read;
use std::net::TcpStream;
use std::time::Instant;

use super::answer::Answer;

/// How reading a request head ended.
#[derive(Debug, PartialEq)]
pub(super) enum Head {
    /// The whole head (request line and headers, without the blank line).
    Complete(Vec<u8>),
    /// The client closed before sending anything.
    Closed,
    /// The client closed in the middle of its head.
    Incomplete,
    /// The deadline passed first.
    TimedOut,
    /// The head exceeds the cap (`in_request_line`: before the first line ended).
    TooLarge { in_request_line: bool },
}

/// Reads a request head until its blank line, the deadline or the size cap.
pub(super) fn read_head(
    stream: &mut TcpStream,
    deadline: Instant,
    max: usize,
) -> std::io::Result<Head> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 2048];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(Head::TimedOut);
        }
        stream.set_read_timeout(Some(left))?;
        let n = match stream.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Ok(Head::TimedOut);
            }
            Err(e) => return Err(e),
        };
        if n == 0 {
            return Ok(if head.is_empty() {
                Head::Closed
            } else {
                Head::Incomplete
            });
        }
        let searched = head.len().saturating_sub(3);
        head.extend_from_slice(&buf[..n]);
        if let Some(end) = head_end(&head, searched) {
            if end > max {
                return Ok(Head::TooLarge {
                    in_request_line: !head[..max].contains(&b'\n'),
                });
            }
            head.truncate(end);
            return Ok(Head::Complete(head));
        }
        if head.len() > max {
            return Ok(Head::TooLarge {
                in_request_line: !head[..max].contains(&b'\n'),
            });
        }
    }
}

/// Where the head ends (the index of its blank line), searching from `from`: `\r\n\r\n`, or
/// bare `\n\n` (which RFC 9112 lets a server accept).
fn head_end(bytes: &[u8], from: usize) -> Option<usize> {
    (from..bytes.len())
        .find(|&i| bytes[i..].starts_with(b"\r\n\r\n") || bytes[i..].starts_with(b"\n\n"))
}

/// A parsed request line (headers are checked, not kept: nothing in them matters here).
#[derive(Debug, PartialEq)]
pub(super) struct Request {
    pub(super) method: String,
    pub(super) target: String,
}

/// RFC 9110 `tchar`: the characters of a method or header name.
fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn bad_request(why: &str) -> Answer {
    Answer::text("400 Bad Request", format!("{why}\n"))
}

/// Parses a request head: `METHOD SP target SP HTTP/1.x`, then `name: value` lines. Anything
/// else is refused with the answer to send.
pub(super) fn parse_request(head: &[u8]) -> std::result::Result<Request, Answer> {
    let text = std::str::from_utf8(head).map_err(|_| bad_request("the request is not text"))?;
    let mut lines = text.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l));
    let request_line = lines.next().unwrap_or("");
    let parts: Vec<&str> = request_line.split(' ').collect();
    let [method, target, version] = parts[..] else {
        return Err(bad_request(
            "expected a request line `METHOD /path HTTP/1.1`",
        ));
    };
    if !is_token(method) {
        return Err(bad_request("the method is not a token"));
    }
    let target = if target.starts_with('/') {
        target
    } else if let Some(rest) = target
        .strip_prefix("http://")
        .or_else(|| target.strip_prefix("https://"))
    {
        // absolute-form: keep the path
        rest.find('/').map_or("/", |i| &rest[i..])
    } else {
        return Err(bad_request("the target is not a path"));
    };
    if target.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return Err(bad_request("the target holds a control character"));
    }
    match version.strip_prefix("HTTP/") {
        Some("1.1" | "1.0") => {}
        Some(v)
            if v.len() == 3
                && v.as_bytes()[0].is_ascii_digit()
                && v.as_bytes()[1] == b'.'
                && v.as_bytes()[2].is_ascii_digit() =>
        {
            return Err(Answer::text(
                "505 HTTP Version Not Supported",
                "only HTTP/1.0 and HTTP/1.1\n",
            ));
        }
        Some(v) if v.len() == 1 && v.as_bytes()[0].is_ascii_digit() => {
            return Err(Answer::text(
                "505 HTTP Version Not Supported",
                "only HTTP/1.0 and HTTP/1.1\n",
            ));
        }
        _ => return Err(bad_request("expected HTTP/1.1 or HTTP/1.0")),
    }
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            return Err(bad_request("a header line without a colon"));
        };
        if !is_token(name) {
            // Also a folded line (RFC 9112 obs-fold) and whitespace before the colon.
            return Err(bad_request("a header name that is not a token"));
        }
        if value.bytes().any(|b| (b < b' ' && b != b'\t') || b == 0x7f) {
            return Err(bad_request("a header value with a control character"));
        }
    }
    Ok(Request {
        method: method.to_string(),
        target: target.to_string(),
    })
}
