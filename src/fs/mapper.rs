//! vLLM 0.33.0's `FileMapper` naming (contract §8.4 and §11.1), so that a vLLM `fs` tier and
//! kvtier on one `root_dir` find each other's chunk files:
//!
//! ```text
//! <root_dir>/<model_name with '/' -> '_'>_<digest12>/config.json       the digest's fields
//! <root_dir>/<model_name with '/' -> '_'>_<digest12>_r0/<hex[0:3]>/<hex[3:5]>_g<group>/<hex>.bin
//! ```
//!
//! `digest12` is the first 12 hex digits of the sha256 of the fields serialised as Python's
//! `json.dumps(fields, sort_keys=True, separators=(",", ":"))`; `hex` is the lower-case hex of
//! the key without its last 4 bytes and `group` the big-endian `u32` in those 4 bytes. The
//! rank is always 0: vLLM's tiers run in the scheduler process, whose rank is 0.
//!
//! ```
//! use kvtier::fs::FileMapper;
//! let fields = serde_json::json!({"model_name": "org/m", "tokens_per_hash": 16});
//! let m = FileMapper::new("/shared/kv", fields).unwrap();
//! let mut key = vec![0xab; 32];
//! key.extend_from_slice(&2u32.to_be_bytes());
//! let path = m.file_path(&kvtier::ChunkKey::new(key)).unwrap();
//! let name = format!("{}_r0/aba/ba_g2/{}.bin", m.base_path().display(), "ab".repeat(32));
//! assert_eq!(path.to_str().unwrap(), name);
//! ```

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::canonical::digest::{python_json_dumps, vllm_digest_of_value};
use crate::error::{Error, ErrorKind, Result};
use crate::key::ChunkKey;

/// The name of the field file in the base folder.
pub const CONFIG_FILE_NAME: &str = "config.json";

/// The rank suffix of the data folder (`_r0`): vLLM's tiers always run at rank 0.
pub const RANK: u32 = 0;

/// Bytes of the group id at the end of a vLLM key.
const GROUP_BYTES: usize = 4;

/// Shortest block-hash part that names a file (`hex[0:3]` and `hex[3:5]` need 5 digits).
const MIN_HASH_BYTES: usize = 3;

/// Maps chunk keys to file names exactly as vLLM 0.33.0's `FileMapper` does.
#[derive(Debug, Clone, PartialEq)]
pub struct FileMapper {
    fields: Value,
    digest: String,
    base_path: PathBuf,
    data_dir: PathBuf,
}

impl FileMapper {
    /// The mapper for `root_dir` and the digest's field object (what vLLM's
    /// `FileMapper.get_run_config()` returns; it must have a string `model_name`).
    pub fn new(root_dir: impl AsRef<Path>, fields: Value) -> Result<Self> {
        let model = match fields.get("model_name") {
            Some(Value::String(s)) => s.clone(),
            _ => {
                return Err(Error::new(
                    ErrorKind::Config,
                    "the FileMapper fields need a string \"model_name\"",
                )
                .with("found", python_json_dumps(&fields)));
            }
        };
        if model.contains('\0') {
            return Err(Error::new(
                ErrorKind::Config,
                "the model name contains a NUL byte and cannot name a folder",
            ));
        }
        let digest = vllm_digest_of_value(&fields);
        let folder = format!("{}_{digest}", model.replace('/', "_"));
        let base_path = root_dir.as_ref().join(&folder);
        let data_dir = root_dir.as_ref().join(format!("{folder}_r{RANK}"));
        Ok(FileMapper {
            fields,
            digest,
            base_path,
            data_dir,
        })
    }

    /// The digest's field object.
    pub fn fields(&self) -> &Value {
        &self.fields
    }

    /// The 12 hex digits of the digest.
    pub fn digest(&self) -> &str {
        &self.digest
    }

    /// `<root_dir>/<model>_<digest12>`: the folder of `config.json`.
    pub fn base_path(&self) -> &Path {
        &self.base_path
    }

    /// `<base_path>_r0`: the folder of the chunk files.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// `<base_path>/config.json`.
    pub fn config_file_path(&self) -> PathBuf {
        self.base_path.join(CONFIG_FILE_NAME)
    }

    /// The file of `key`. A key too short to be `block_hash ‖ u32 group` with a block hash of
    /// at least 3 bytes cannot be named and is an error (vLLM's hashes are 16 or 32 bytes).
    pub fn file_path(&self, key: &ChunkKey) -> Result<PathBuf> {
        let (hex, group) = split_key(key)?;
        let mut rel = String::with_capacity(hex.len() * 2 + 24);
        let _ = write!(rel, "{}/{}_g{group}/{hex}.bin", &hex[..3], &hex[3..5]);
        Ok(self.data_dir.join(rel))
    }

    /// The key a chunk file's name stands for, given its path relative to [`Self::data_dir`]
    /// (`<hhh>/<hh>_g<n>/<hex>.bin`); `None` for any other name (temporary files included).
    pub fn key_of(rel: &Path) -> Option<ChunkKey> {
        let mut parts = rel.iter().map(|p| p.to_str());
        let (Some(Some(d1)), Some(Some(d2)), Some(Some(name)), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return None;
        };
        let hex = name.strip_suffix(".bin")?;
        let (prefix, group) = d2.split_once("_g")?;
        if hex.len() < MIN_HASH_BYTES * 2
            || !hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
            || d1 != &hex[..3]
            || prefix != &hex[3..5]
            || group.is_empty()
            || !group.bytes().all(|b| b.is_ascii_digit())
            || (group.len() > 1 && group.starts_with('0'))
        {
            return None;
        }
        let group: u32 = group.parse().ok()?;
        let hash = hex::decode(hex).ok()?;
        Some(ChunkKey::vllm_offload_key(&hash, group))
    }

    /// The text vLLM writes to `config.json`: `json.dump(fields, f, indent=2, sort_keys=True)`
    /// (no trailing newline).
    pub fn config_json(&self) -> String {
        let mut out = String::new();
        write_indented(&mut out, &self.fields, 0);
        out
    }
}

/// The hex of a key's block-hash part and its group id.
fn split_key(key: &ChunkKey) -> Result<(String, u32)> {
    let b = key.as_bytes();
    match key.vllm_group_id() {
        Some(group) if b.len() >= GROUP_BYTES + MIN_HASH_BYTES => {
            Ok((hex::encode(&b[..b.len() - GROUP_BYTES]), group))
        }
        _ => Err(Error::new(
            ErrorKind::Contract,
            format!(
                "key of {} bytes cannot name an fs chunk file (a vLLM key is a block hash of \
                 at least {MIN_HASH_BYTES} bytes followed by a 4-byte group id)",
                b.len()
            ),
        )
        .with("key", key.to_hex())),
    }
}

/// Python's `json.dumps(value, indent=2, sort_keys=True)`: separators `", "` / `": "` become
/// `","` + newline and `": "`; empty containers stay `[]` / `{}`; scalars as in the compact
/// form ([`python_json_dumps`]).
fn write_indented(out: &mut String, value: &Value, depth: usize) {
    let pad = |out: &mut String, d: usize| {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', 2 * d));
    };
    match value {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                pad(out, depth + 1);
                write_indented(out, v, depth + 1);
            }
            pad(out, depth);
            out.push(']');
        }
        Value::Object(map) if !map.is_empty() => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                pad(out, depth + 1);
                out.push_str(&python_json_dumps(&Value::String((*k).clone())));
                out.push_str(": ");
                write_indented(out, &map[k.as_str()], depth + 1);
            }
            pad(out, depth);
            out.push('}');
        }
        leaf => out.push_str(&python_json_dumps(leaf)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn key(hash: &[u8], group: u32) -> ChunkKey {
        let mut b = hash.to_vec();
        #[allow(clippy::big_endian_bytes)]
        b.extend_from_slice(&group.to_be_bytes());
        ChunkKey::new(b)
    }

    #[test]
    fn names_follow_vllm_and_parse_back() {
        let m = FileMapper::new(
            "/r",
            json!({"model_name": "meta-llama/Llama-3.1-8B", "tokens_per_hash": 16}),
        )
        .unwrap();
        let folder = format!("meta-llama_Llama-3.1-8B_{}", m.digest());
        assert_eq!(m.base_path(), Path::new("/r").join(&folder));
        assert_eq!(m.data_dir(), Path::new("/r").join(format!("{folder}_r0")));
        let k = key(&[0x01, 0x23, 0x45, 0x67], 7);
        let p = m.file_path(&k).unwrap();
        assert_eq!(
            p,
            Path::new("/r").join(format!("{folder}_r0/012/34_g7/01234567.bin"))
        );
        let rel = p.strip_prefix(m.data_dir()).unwrap();
        assert_eq!(FileMapper::key_of(rel), Some(k));
        for bad in [
            "012/34_g7/01234567.bin_123.tmp",
            "012/35_g7/01234567.bin",
            "013/34_g7/01234567.bin",
            "012/34_g07/01234567.bin",
            "012/34_gx/01234567.bin",
            "012/34_g7/0123456G.bin",
            "012/34_g7/0123.bin",
            "012/34_g7/extra/01234567.bin",
            "012/34_g4294967296/01234567.bin",
        ] {
            assert_eq!(FileMapper::key_of(Path::new(bad)), None, "{bad}");
        }
    }

    #[test]
    fn short_keys_cannot_name_a_file() {
        let m = FileMapper::new("/r", json!({"model_name": "m"})).unwrap();
        for k in [vec![], vec![1, 2, 3, 4], vec![1, 2, 0, 0, 0, 1]] {
            let e = m.file_path(&ChunkKey::new(k)).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Contract);
        }
        assert!(m.file_path(&key(&[1, 2, 3], 0)).is_ok());
        assert!(FileMapper::new("/r", json!({"tokens_per_hash": 16})).is_err());
    }

    #[test]
    fn config_json_is_pythons_indent_2() {
        let m = FileMapper::new(
            "/r",
            json!({
                "model_name": "m\u{e9}", "tokens_per_hash": 16, "kv_cache_groups": [
                    {"tokens_per_block": 16, "layer_names": ["a", "b"]}
                ], "empty": [], "nothing": {}, "flag": false
            }),
        )
        .unwrap();
        let want = "{\n  \"empty\": [],\n  \"flag\": false,\n  \"kv_cache_groups\": [\n    {\n      \
                    \"layer_names\": [\n        \"a\",\n        \"b\"\n      ],\n      \
                    \"tokens_per_block\": 16\n    }\n  ],\n  \"model_name\": \"m\\u00e9\",\n  \
                    \"nothing\": {},\n  \"tokens_per_hash\": 16\n}";
        assert_eq!(m.config_json(), want);
        let back: Value = serde_json::from_str(&m.config_json()).unwrap();
        assert_eq!(&back, m.fields());
    }
}
