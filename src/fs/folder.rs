//! The tier's folder under `root_dir`: vLLM's `config.json` (the digest's fields, written as
//! vLLM writes it when absent) and kvtier's own `kvtier.json` (kvtier's namespace digest,
//! which also covers the KV memory layout that vLLM 0.33.0 leaves out of its digest). Both
//! are checked when present: a folder whose files name another model or layout is refused
//! with both digests. Both are created atomically (temporary file, then a publish that never
//! replaces), so a host reading them never sees half a file written by kvtier.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

use crate::canonical::digest::vllm_digest_of_value;
use crate::error::{Error, ErrorKind, Result};
use crate::fs::chunk_file::{self, DirCache, PublishMode};
use crate::fs::mapper::FileMapper;

/// kvtier's marker file in the base folder.
pub const KVTIER_FILE_NAME: &str = "kvtier.json";

/// The `format` value of `kvtier.json`.
pub const FOLDER_FORMAT: &str = "kvtier-fs-1";

/// How often a `config.json` that does not parse is read again (a vLLM instance may be
/// writing it right now: vLLM writes it in place, not atomically), and how long apart.
const PARSE_ATTEMPTS: u32 = 10;
const PARSE_PAUSE: Duration = Duration::from_millis(100);

/// Creates `mapper`'s folders, then checks or writes `config.json` and `kvtier.json`.
pub fn prepare(mapper: &FileMapper, namespace: &[u8; 32], mode: PublishMode) -> Result<()> {
    for dir in [mapper.base_path(), mapper.data_dir()] {
        std::fs::create_dir_all(dir).map_err(|e| {
            Error::new(
                ErrorKind::InvalidPath,
                format!("cannot create the fs tier folder {}: {e}", dir.display()),
            )
            .with("path", dir.display().to_string())
            .with_source(e)
        })?;
    }
    let config = mapper.config_file_path();
    let text = mapper.config_json();
    if !write_new(&config, text.as_bytes(), mode)? {
        let found = read_json(&config)?;
        if &found != mapper.fields() {
            let theirs = vllm_digest_of_value(&found);
            return Err(Error::new(
                ErrorKind::IncompatibleLayout,
                format!(
                    "{} holds the fields of another model or layout (vLLM digest {theirs}, this \
                     tier's is {}); point root_dir elsewhere or remove {}",
                    config.display(),
                    mapper.digest(),
                    mapper.base_path().display()
                ),
            )
            .with("path", config.display().to_string())
            .with("expected", mapper.digest().to_string())
            .with("found", theirs));
        }
    }
    let ours = hex::encode(namespace);
    let marker = mapper.base_path().join(KVTIER_FILE_NAME);
    let body = json!({"format": FOLDER_FORMAT, "kvtier_namespace": ours});
    if !write_new(&marker, body.to_string().as_bytes(), mode)? {
        let found = read_json(&marker)?;
        let theirs = found
            .get("kvtier_namespace")
            .and_then(Value::as_str)
            .unwrap_or("<missing>")
            .to_string();
        if theirs != ours {
            return Err(Error::new(
                ErrorKind::IncompatibleLayout,
                format!(
                    "{} was written by kvtier under another namespace (model, dtype, KV layout, \
                     row size or topology differ: {theirs} there, {ours} here); chunk files \
                     there would be wrong bytes for this model; point root_dir elsewhere",
                    marker.display()
                ),
            )
            .with("path", marker.display().to_string())
            .with("expected", ours)
            .with("found", theirs));
        }
    }
    Ok(())
}

/// Writes `bytes` to `path` unless a file is there: true if this call created it.
fn write_new(path: &Path, bytes: &[u8], mode: PublishMode) -> Result<bool> {
    if path.exists() {
        return Ok(false);
    }
    let (file, tmp) = chunk_file::create_temp(path, false, &DirCache::default(), None)?;
    use std::io::Write;
    let written = (&file).write_all(bytes).and_then(|()| file.sync_all());
    drop(file);
    if let Err(e) = written {
        chunk_file::discard_temp(&tmp);
        return Err(Error::io("write", &tmp, e));
    }
    Ok(chunk_file::publish(&tmp, path, mode)? == chunk_file::Published::New)
}

fn read_json(path: &Path) -> Result<Value> {
    let mut last = String::new();
    for attempt in 0..PARSE_ATTEMPTS {
        if attempt > 0 {
            std::thread::sleep(PARSE_PAUSE);
        }
        let text = std::fs::read_to_string(path).map_err(|e| Error::io("read", path, e))?;
        match serde_json::from_str(&text) {
            Ok(v) => return Ok(v),
            Err(e) => last = e.to_string(),
        }
    }
    Err(Error::new(
        ErrorKind::Corrupt,
        format!("{} is not valid JSON: {last}", path.display()),
    )
    .with("path", path.display().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folders_are_made_checked_and_refused_with_both_digests() {
        let d = tempfile::tempdir_in("/tmp").unwrap();
        let m = FileMapper::new(d.path(), json!({"model_name": "a/b", "n": 1})).unwrap();
        prepare(&m, &[1; 32], PublishMode::NoReplace).unwrap();
        assert_eq!(
            std::fs::read_to_string(m.config_file_path()).unwrap(),
            m.config_json()
        );
        assert!(m.data_dir().is_dir());
        // Again: everything matches.
        prepare(&m, &[1; 32], PublishMode::NoReplace).unwrap();
        // Another kvtier namespace (e.g. another KV layout) in the same vLLM folder.
        let e = prepare(&m, &[2; 32], PublishMode::NoReplace).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::IncompatibleLayout);
        assert_eq!(
            e.context_value("found"),
            Some(hex::encode([1u8; 32]).as_str())
        );
        assert_eq!(
            e.context_value("expected"),
            Some(hex::encode([2u8; 32]).as_str())
        );
        // A config.json of another model in the folder.
        let other = json!({"model_name": "x/y", "n": 1});
        std::fs::write(m.config_file_path(), other.to_string()).unwrap();
        let e = prepare(&m, &[1; 32], PublishMode::NoReplace).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::IncompatibleLayout);
        assert_eq!(e.context_value("expected"), Some(m.digest()));
        let theirs = vllm_digest_of_value(&other);
        assert_eq!(e.context_value("found"), Some(theirs.as_str()));
        assert!(e.to_string().contains(&theirs) && e.to_string().contains(m.digest()));
        // One that never parses.
        std::fs::write(m.config_file_path(), "{").unwrap();
        let e = prepare(&m, &[1; 32], PublishMode::NoReplace).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt);
    }
}
