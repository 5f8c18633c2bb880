//! `kvtier layout check`'s comparison with vLLM 0.33.0's own canonical-mapping code.
//!
//! The binary embeds the Python side of the differential test (`tests/python/layout_check.py`,
//! `vllm_canonical.py` and the metadata-only stand-ins of `tests/python/stubs/`), writes it to
//! a temporary folder and runs it with `$KVTIER_PYTHON` (default `python3`) over the vLLM
//! 0.33.0 sources the test harness caches (`$KVTIER_VLLM_SRC`, else the newest complete
//! `vllm-0.33.0-py-*` folder under `$KVTIER_CACHE_DIR` or `~/.cache/kvtier`). kvtier's answers
//! (every rank's canonical mappings at every allowed TP size) go in on stdin; vLLM's
//! `derive_canonical_mappings` over the views `create_kv_cache_views` creates, and a byte
//! oracle from those views, decide. Without the sources or a Python that can import vLLM's
//! modules the comparison is skipped and the reason printed.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{Value, json};

use kvtier::error::{Error, ErrorKind, Result};

/// The embedded Python files, by path relative to the folder they run from.
const FILES: &[(&str, &str)] = &[
    (
        "layout_check.py",
        include_str!("../../tests/python/layout_check.py"),
    ),
    (
        "vllm_canonical.py",
        include_str!("../../tests/python/vllm_canonical.py"),
    ),
    (
        "stubs/kvtier_placeholders.py",
        include_str!("../../tests/python/stubs/kvtier_placeholders.py"),
    ),
    (
        "stubs/torch/__init__.py",
        include_str!("../../tests/python/stubs/torch/__init__.py"),
    ),
    (
        "stubs/torch/cuda/__init__.py",
        include_str!("../../tests/python/stubs/torch/cuda/__init__.py"),
    ),
    (
        "stubs/torch/version.py",
        include_str!("../../tests/python/stubs/torch/version.py"),
    ),
];

/// The version whose code decides.
pub const VLLM_VERSION: &str = "0.33.0";

/// What the comparison found.
#[derive(Debug)]
pub enum Outcome {
    /// It ran: layer mappings compared and every difference found.
    Ran {
        /// Layer mappings (descriptor x TP x rank x layer) compared.
        compared: u64,
        /// One line per difference.
        differences: Vec<String>,
    },
    /// It could not run here; why.
    Skipped(String),
}

/// One descriptor to compare: its file, its text and kvtier's answer per TP size
/// (`{"ranks": [{"rank", "layers": [...]}]}`).
#[derive(Debug)]
pub struct Subject {
    /// The descriptor file.
    pub file: PathBuf,
    /// Its text.
    pub text: String,
    /// TP size to kvtier's answer.
    pub answers: Vec<(u32, Value)>,
}

/// The cached vLLM sources, or why there are none.
fn vllm_sources() -> std::result::Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("KVTIER_VLLM_SRC") {
        let dir = PathBuf::from(dir);
        return if dir.join("vllm").is_dir() {
            Ok(dir)
        } else {
            Err(format!(
                "KVTIER_VLLM_SRC={} holds no vllm/ package",
                dir.display()
            ))
        };
    }
    let cache = match std::env::var_os("KVTIER_CACHE_DIR") {
        Some(d) => PathBuf::from(d),
        None => match std::env::var_os("HOME") {
            Some(h) => Path::new(&h).join(".cache/kvtier"),
            None => return Err("neither KVTIER_CACHE_DIR nor HOME is set".into()),
        },
    };
    let prefix = format!("vllm-{VLLM_VERSION}-py-");
    let mut found: Vec<PathBuf> = std::fs::read_dir(&cache)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix))
                && p.join(".kvtier-complete").is_file()
        })
        .collect();
    found.sort();
    found.pop().ok_or_else(|| {
        format!(
            "the vLLM {VLLM_VERSION} sources are not cached in {} (fetch them once with \
             `python3 tests/python/fetch_vllm.py`, about 340 MB, or set KVTIER_VLLM_SRC)",
            cache.display()
        )
    })
}

/// Runs the comparison for `subjects`.
pub fn compare(subjects: &[Subject]) -> Result<Outcome> {
    let src = match vllm_sources() {
        Ok(s) => s,
        Err(why) => return Ok(Outcome::Skipped(why)),
    };
    let python = std::env::var("KVTIER_PYTHON").unwrap_or_else(|_| "python3".into());
    let dir = tempfile::tempdir()
        .map_err(|e| Error::io("create a temp dir in", &std::env::temp_dir(), e))?;
    for (rel, text) in FILES {
        let path = dir.path().join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| Error::io("create", parent, e))?;
        }
        std::fs::write(&path, text).map_err(|e| Error::io("write", &path, e))?;
    }
    let request = json!({
        "vllm_src": src.display().to_string(),
        "layouts": subjects.iter().map(|s| json!({
            "file": s.file.display().to_string(),
            "text": s.text,
            "answers": s.answers.iter().map(|(tp, a)| (tp.to_string(), a.clone()))
                .collect::<serde_json::Map<_, _>>(),
        })).collect::<Vec<_>>(),
    });
    let child = Command::new(&python)
        .arg(dir.path().join("layout_check.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            return Ok(Outcome::Skipped(format!(
                "cannot run {python} ({e}); set KVTIER_PYTHON to a Python 3.11+ with \
                 tests/python/requirements.txt installed"
            )));
        }
    };
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(request.to_string().as_bytes())
            .map_err(|e| Error::io("write to", Path::new(&python), e))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| Error::io("wait for", Path::new(&python), e))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr.lines().last().unwrap_or("").trim().to_string();
    match out.status.code() {
        Some(0) => {}
        Some(3) => {
            return Ok(Outcome::Skipped(format!(
                "{python} cannot import vLLM's modules from {} ({last}); set KVTIER_PYTHON to a \
                 Python 3.11+ with tests/python/requirements.txt installed",
                src.display()
            )));
        }
        _ => {
            return Err(Error::new(
                ErrorKind::Internal,
                format!(
                    "the vLLM comparison failed ({}): {}",
                    out.status,
                    stderr.trim()
                ),
            ));
        }
    }
    let report: Value = serde_json::from_slice(&out.stdout).map_err(|e| {
        Error::new(
            ErrorKind::Internal,
            format!("the vLLM comparison printed no JSON report: {e}"),
        )
    })?;
    Ok(Outcome::Ran {
        compared: report["compared"].as_u64().unwrap_or(0),
        differences: report["differences"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|d| d.as_str().unwrap_or("?").to_string())
            .collect(),
    })
}
