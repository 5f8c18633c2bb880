//! Mooncake-format KV-cache traces (kvcache-ai/Mooncake `FAST25-release/traces/`): one JSON
//! object per line, `timestamp` (ms from the trace's start), `input_length` and
//! `output_length` (tokens) and `hash_ids` (prefix block ids, [`TOKENS_PER_BLOCK`] tokens per
//! block; requests sharing a leading run of ids share that prefix's KV cache).

use std::collections::HashSet;
use std::io::BufRead;
use std::path::Path;

use kvtier::error::{Error, ErrorKind, Result};

/// Tokens per trace block (Mooncake's traces hash 512-token blocks).
pub const TOKENS_PER_BLOCK: u64 = 512;

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceRequest {
    /// Arrival, milliseconds from the trace's start.
    pub timestamp_ms: u64,
    /// Prompt tokens.
    pub input_length: u64,
    /// The prompt's block ids, in order.
    pub hash_ids: Vec<u64>,
}

impl TraceRequest {
    /// Blocks whose KV can be stored and reused: the full ones. vLLM hashes (and so offloads
    /// and looks up) only full blocks; a partial last block is always computed.
    pub fn full_blocks(&self) -> &[u64] {
        let full = usize::try_from(self.input_length / TOKENS_PER_BLOCK).unwrap_or(usize::MAX);
        &self.hash_ids[..full.min(self.hash_ids.len())]
    }
}

#[derive(serde::Deserialize)]
struct Line {
    timestamp: u64,
    input_length: u64,
    #[allow(dead_code)]
    output_length: Option<u64>,
    hash_ids: Vec<u64>,
}

/// A trace and its figures.
#[derive(Debug, Clone)]
pub struct Trace {
    /// Requests in file order.
    pub requests: Vec<TraceRequest>,
}

impl Trace {
    /// Reads `path`; errors name the file and line. `limit`: at most that many requests.
    pub fn read(path: &Path, limit: Option<usize>) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| {
            let kind = if e.kind() == std::io::ErrorKind::NotFound {
                ErrorKind::InvalidPath
            } else {
                ErrorKind::Io
            };
            Error::new(
                kind,
                format!("--trace: cannot open {}: {e}", path.display()),
            )
            .with_source(e)
        })?;
        let mut requests = Vec::new();
        for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
            if limit.is_some_and(|n| requests.len() >= n) {
                break;
            }
            let line = line.map_err(|e| Error::io("read the trace", path, e))?;
            if line.trim().is_empty() {
                continue;
            }
            let l: Line = serde_json::from_str(&line).map_err(|e| {
                Error::config(
                    "--trace",
                    format!(
                        "{} line {}: not a trace request ({e}); expected {{\"timestamp\": ms, \
                         \"input_length\": n, \"hash_ids\": [...]}}",
                        path.display(),
                        i + 1
                    ),
                )
            })?;
            let blocks = l.input_length.div_ceil(TOKENS_PER_BLOCK);
            if l.hash_ids.len() as u64 > blocks {
                return Err(Error::config(
                    "--trace",
                    format!(
                        "{} line {}: {} hash_ids for {} input tokens (at most {blocks} blocks \
                         of {TOKENS_PER_BLOCK})",
                        path.display(),
                        i + 1,
                        l.hash_ids.len(),
                        l.input_length
                    ),
                ));
            }
            requests.push(TraceRequest {
                timestamp_ms: l.timestamp,
                input_length: l.input_length,
                hash_ids: l.hash_ids,
            });
        }
        if requests.is_empty() {
            return Err(Error::config(
                "--trace",
                format!("{} holds no requests", path.display()),
            ));
        }
        Ok(Trace { requests })
    }

    /// Distinct full blocks (what capacities given as a share count).
    pub fn unique_full_blocks(&self) -> u64 {
        let mut seen = HashSet::new();
        for r in &self.requests {
            seen.extend(r.full_blocks().iter().copied());
        }
        seen.len() as u64
    }

    /// References to full blocks.
    #[cfg(test)]
    pub fn full_block_references(&self) -> u64 {
        self.requests
            .iter()
            .map(|r| r.full_blocks().len() as u64)
            .sum()
    }

    /// Prompt tokens over all requests.
    #[cfg(test)]
    pub fn input_tokens(&self) -> u64 {
        self.requests.iter().map(|r| r.input_length).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut f, text.as_bytes()).unwrap();
        f
    }

    #[test]
    fn reads_requests_and_counts_full_blocks() {
        let f = write(
            "{\"timestamp\": 0, \"input_length\": 1100, \"output_length\": 5, \"hash_ids\": [1, 2, 3]}\n\
             \n{\"timestamp\": 7, \"input_length\": 1024, \"output_length\": 5, \"hash_ids\": [1, 2]}\n",
        );
        let t = Trace::read(f.path(), None).unwrap();
        assert_eq!(t.requests.len(), 2);
        assert_eq!(t.requests[0].full_blocks(), &[1, 2]);
        assert_eq!(t.requests[1].full_blocks(), &[1, 2]);
        assert_eq!(t.unique_full_blocks(), 2);
        assert_eq!(t.full_block_references(), 4);
        assert_eq!(t.input_tokens(), 2124);
    }

    #[test]
    fn errors_name_the_line() {
        let f = write("{\"timestamp\": 0, \"input_length\": 10, \"hash_ids\": [1]}\nnot json\n");
        let e = Trace::read(f.path(), None).unwrap_err().to_string();
        assert!(e.contains("line 2"), "{e}");
        let f = write("{\"timestamp\": 0, \"input_length\": 10, \"hash_ids\": [1, 2]}\n");
        let e = Trace::read(f.path(), None).unwrap_err().to_string();
        assert!(e.contains("line 1") && e.contains("2 hash_ids"), "{e}");
    }
}
