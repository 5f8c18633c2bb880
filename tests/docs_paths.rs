//! Every file or directory the documentation names exists: each path-like name in a code
//! span or link of `README.md` and `docs/**/*.md` (`src/g3/slab.rs`, `layouts/`,
//! `policy/lru.rs`, `tier.rs`) must be a file or directory of the repository, matched as a
//! whole path or as the tail of one (docs often name a file inside the folder of their table
//! row). Names of files kvtier creates at run time, absolute paths and placeholders
//! (`<path>`) are not repository paths and are skipped.

use std::path::{Path, PathBuf};

/// Extensions that mark a name as a repository file.
const EXTENSIONS: [&str; 8] = [".rs", ".md", ".toml", ".fio", ".json", ".py", ".sh", ".svg"];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every file and directory of the repository, relative, with `/` separators (build output
/// and version control excluded).
fn repo_paths() -> Vec<String> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if matches!(name.as_str(), "target" | ".git") {
                continue;
            }
            let rel = p
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            out.push(rel);
            if p.is_dir() {
                walk(&p, root, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(&root(), &root(), &mut out);
    out
}

fn docs() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "md") {
                out.push(p);
            }
        }
    }
    let mut out = vec![root().join("README.md")];
    walk(&root().join("docs"), &mut out);
    out.sort();
    out
}

/// The code spans and link targets of a markdown text.
fn spans(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, part) in text.split('`').enumerate() {
        if i % 2 == 1 {
            out.push(part.to_string());
        }
    }
    for piece in text.split("](").skip(1) {
        if let Some(end) = piece.find(')') {
            out.push(piece[..end].to_string());
        }
    }
    out
}

/// The repository path a span names, if it names one.
fn path_like(span: &str) -> Option<String> {
    let s = span
        .trim()
        .split('#')
        .next()?
        .trim_end_matches([':', ',', '.']);
    let skip = s.is_empty()
        || s.contains(char::is_whitespace)
        || s.contains(['<', '>', '*', '$', '~', '{', '}', '|', '=', '(', '"'])
        || s.starts_with(['/', '.', '-'])
        || s.contains("://")
        || s.contains("::");
    if skip {
        return None;
    }
    let has_ext = EXTENSIONS
        .iter()
        .any(|e| s.ends_with(e) && s.len() > e.len());
    let is_dir = s.ends_with('/') && s.len() > 1;
    (has_ext || is_dir).then(|| s.trim_end_matches('/').to_string())
}

fn exists(name: &str, doc_dir: &Path, repo: &[String]) -> bool {
    root().join(name).exists()
        || doc_dir.join(name).exists()
        || repo
            .iter()
            .any(|p| p == name || p.ends_with(&format!("/{name}")))
}

#[test]
fn every_path_the_docs_name_exists() {
    let repo = repo_paths();
    let mut missing = Vec::new();
    let mut checked = 0;
    for doc in docs() {
        let text = std::fs::read_to_string(&doc).unwrap();
        let dir = doc.parent().unwrap();
        for name in spans(&text).iter().filter_map(|s| path_like(s)) {
            checked += 1;
            if !exists(&name, dir, &repo) {
                missing.push(format!(
                    "{}: {name}",
                    doc.strip_prefix(root()).unwrap().display()
                ));
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} paths found: is the scan broken?"
    );
    assert!(
        missing.is_empty(),
        "the docs name files that do not exist:\n  {}",
        missing.join("\n  ")
    );
}

#[test]
fn the_scan_sees_paths_and_skips_other_code() {
    let text = "see `src/g3/slab.rs`, [fmt](docs/format.md#superblock), `layouts/`, \
                `kvtier bench --json`, `/dev/shm/x.json`, `<path>/a.rs`, `crate::g3`, `64GiB`";
    let names: Vec<String> = spans(text).iter().filter_map(|s| path_like(s)).collect();
    assert_eq!(names, ["src/g3/slab.rs", "layouts", "docs/format.md"]);
    let repo = repo_paths();
    assert!(exists("policy/lru.rs", &root(), &repo));
    assert!(!exists("cli/src/bench_phases.rs", &root(), &repo));
    assert!(!exists("no_such_module.rs", &root(), &repo));
}
