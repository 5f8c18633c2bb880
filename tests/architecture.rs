//! The import graphs of the engine (`src/`) and of the command line (`cli/src/`), checked:
//! in the engine every arrow between top-level modules points down the layer order below; in
//! both no two modules of one folder import each other (directly or round a longer circle).
//!
//! An arrow is a path a module names in code (a `use` item or an inline `crate::` / `super::` /
//! `self::` path; comments and string literals are ignored), resolved to the file module that
//! defines it. Re-exports (`pub use`) are followed to the module that defines the item, so an
//! import through a parent's re-export counts as an arrow to the defining sibling. In the
//! engine, arrows from a module to its own descendants or ancestors (a folder's `mod.rs` and
//! its files) are not circles: a folder may re-export its files, and its files may use the
//! folder's own items. In the command line they are ([`CrateSpec::parent_child`]): a folder's
//! `mod.rs` that uses its files while they use its items is a circle (`fio: mod <-> plan`), and
//! the types both need live in a file of the folder (`fio/args.rs`).
//!
//! `cargo test --test architecture -- --nocapture` prints the measurement (layers, arrows,
//! backward arrows, circles). On failure the offending arrows are printed with the file and
//! the path that makes them.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The layer order, lowest first. A top-level module may import modules of its own layer or
/// of a layer below it, never above (and modules of one layer never in a circle). Every
/// top-level module of `src/` must be listed here: a new module is placed deliberately.
///
/// * `error`, `key`, `hash`: the vocabulary every layer speaks (errors, chunk keys, hashing).
/// * `geometry`: row stride, row alignment, rows for a byte budget, slots per file.
/// * `metrics`: the Prometheus registry.
/// * `region`: the primary memory region (rows of the geometry's stride).
/// * `io`: I/O engines moving rows between the region and files.
/// * `contract`: the tier contract (jobs, lookups, events, the `SecondaryTier` trait).
/// * `config`: the configuration model, parsing and validation.
/// * `canonical`: the canonical layout (descriptors, copy runs, digests).
/// * `primary`: the CPU primary tier.
/// * `g3`, `fs`: the G3 NVMe tier; the file-per-chunk tier (it reuses G3's direct-I/O mode,
///   engine factory type and directory sync, so it imports `g3`, never the reverse).
/// * `tiering`: the manager tying the tiers together.
/// * `embed`: the `Builder`, configuration in, running manager or tier out.
/// * `node`: the node-local service (one G3 pool for every engine of a host) and its client.
const LAYERS: &[&[&str]] = &[
    &["error", "key", "hash", "size"],
    &["geometry"],
    &["metrics"],
    &["region"],
    &["io"],
    &["contract"],
    &["config"],
    &["canonical"],
    &["primary"],
    &["g3", "fs"],
    &["tiering"],
    &["embed"],
    &["node"],
];

/// Circles between files of one folder that are tolerated for now, each with the issue that
/// removes it. Empty is the goal.
const ALLOWED_CIRCLES: &[(&str, &str, &str)] = &[];

/// One source file: its module path (`g3::worker::store`) and its text without comments and
/// literals.
struct SourceFile {
    module: String,
    path: PathBuf,
    code: String,
}

/// One reference from a module to a path.
#[derive(Debug, Clone)]
struct Reference {
    /// The module (file module, plus inline modules such as `tests`) that names the path.
    from: String,
    /// The absolute path named, `crate::` removed (`config::model::TierConfig`).
    target: Vec<String>,
    /// The file that names it.
    file: PathBuf,
    /// True for a `pub use` (a re-export).
    reexport: bool,
    /// For a path that starts with a bare name (`plan::Plan`, `use runner::Profile`): the
    /// module that name would be, a child of `from` (`fio::plan`). The reference counts only
    /// if that module exists; otherwise the name is something else (a crate such as `std`, a
    /// type such as `Vec`, an imported item).
    child: Option<String>,
}

/// An arrow between two file modules, with one example of what makes it.
#[derive(Debug, Clone)]
struct Arrow {
    from: String,
    to: String,
    file: PathBuf,
    path: String,
}

/// A crate of the workspace whose import graph is checked.
struct CrateSpec {
    /// Its source folder, relative to the workspace root (`src`, `cli/src`).
    dir: &'static str,
    /// Folders under `dir` that belong to other crates (`cli/src/bin`: the `kvtier-replay`
    /// driver).
    skip: &'static [&'static str],
    /// The layer order of its top-level modules (`None`: not layered, circles only).
    layers: Option<&'static [&'static [&'static str]]>,
    /// Whether a folder's own file (`mod.rs`, or the crate root) and the files inside it
    /// importing each other is a circle too (named `mod` in the folder's circles).
    parent_child: bool,
    /// Circles tolerated for now: (folder, a, b).
    allowed: &'static [(&'static str, &'static str, &'static str)],
}

/// The engine library, `src/` (package `kvtier`).
const ENGINE: CrateSpec = CrateSpec {
    dir: "src",
    skip: &[],
    layers: Some(LAYERS),
    parent_child: false,
    allowed: ALLOWED_CIRCLES,
};

/// The command line, `cli/src/` (package `kvtier-cli`, the `kvtier` binary's crate; its
/// `bin/` folder is the `kvtier-replay` driver, a crate of its own). Not layered: its
/// commands sit side by side on the engine. No circle at all, not even between a folder's
/// `mod.rs` and its files: what both need lives in a file of the folder that both import.
const CLI: CrateSpec = CrateSpec {
    dir: "cli/src",
    skip: &["bin"],
    layers: None,
    parent_child: true,
    allowed: &[],
};

impl CrateSpec {
    fn src(&self) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join(self.dir)
    }
}

fn rust_files(dir: &Path, skip: &[PathBuf], out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if skip.contains(&p) {
            continue;
        }
        if p.is_dir() {
            rust_files(&p, skip, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// `src/g3/worker/mod.rs` -> `g3::worker`; `src/lib.rs` (`cli/src/main.rs`) -> ``.
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("file under src");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|c| c.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().expect("file name");
    let stem = last.strip_suffix(".rs").expect(".rs file").to_string();
    let crate_root = parts.is_empty() && (stem == "lib" || stem == "main");
    if stem != "mod" && !crate_root {
        parts.push(stem);
    }
    parts.join("::")
}

/// Replaces comments, string literals and char literals with spaces (newlines kept).
fn strip_comments_and_literals(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let blank = |out: &mut String, s: &[u8]| {
        for &c in s {
            out.push(if c == b'\n' { '\n' } else { ' ' });
        }
    };
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            let end = text[i..].find('\n').map_or(b.len(), |n| i + n);
            blank(&mut out, &b[i..end]);
            i = end;
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            let mut j = i;
            while j < b.len() {
                if b[j] == b'/' && b.get(j + 1) == Some(&b'*') {
                    depth += 1;
                    j += 2;
                } else if b[j] == b'*' && b.get(j + 1) == Some(&b'/') {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            blank(&mut out, &b[i..j]);
            i = j;
        } else if c == b'r'
            && (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#'))
            && (i == 0 || !is_ident_byte(b[i - 1]))
        {
            // Raw string r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push(c as char);
                i += 1;
                continue;
            }
            let close: String = std::iter::once('"')
                .chain(std::iter::repeat_n('#', hashes))
                .collect();
            let end = text[j + 1..]
                .find(&close)
                .map_or(b.len(), |n| j + 1 + n + close.len());
            blank(&mut out, &b[i..end]);
            i = end;
        } else if c == b'"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            let end = (j + 1).min(b.len());
            blank(&mut out, &b[i..end]);
            i = end;
        } else if c == b'\'' {
            // A char literal ('x', '\n', '\u{..}') or a lifetime ('a).
            let end = if b.get(i + 1) == Some(&b'\\') {
                text[i + 2..].find('\'').map(|n| i + 2 + n + 1)
            } else {
                let ch_len = text[i + 1..].chars().next().map_or(1, char::len_utf8);
                (b.get(i + 1 + ch_len) == Some(&b'\'')).then_some(i + 2 + ch_len)
            };
            match end {
                Some(end) => {
                    blank(&mut out, &b[i..end]);
                    i = end;
                }
                None => {
                    out.push('\'');
                    i += 1;
                }
            }
        } else {
            let ch = text[i..].chars().next().expect("char");
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

fn is_ident_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// A token of the stripped source: identifiers, `::`, and single punctuation characters.
#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    PathSep,
    Punct(char),
}

fn tokenize(code: &str) -> Vec<Tok> {
    let b = code.as_bytes();
    let mut toks = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() {
            i += 1;
        } else if is_ident_byte(c) || c == b'$' {
            let start = i;
            i += 1;
            while i < b.len() && is_ident_byte(b[i]) {
                i += 1;
            }
            toks.push(Tok::Ident(code[start..i].to_string()));
        } else if c == b':' && b.get(i + 1) == Some(&b':') {
            toks.push(Tok::PathSep);
            i += 2;
        } else {
            let ch = code[i..].chars().next().expect("char");
            toks.push(Tok::Punct(ch));
            i += ch.len_utf8();
        }
    }
    toks
}

/// Expands a `use` tree starting at `toks[*i]` (after `use`) into full paths, stopping at `;`.
/// `prefix` is the path so far. Each result is (segments, is_glob).
fn parse_use_tree(toks: &[Tok], i: &mut usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
    let mut path = prefix;
    loop {
        match toks.get(*i) {
            Some(Tok::Ident(s)) if s == "as" => {
                *i += 2; // `as name`
                out.push(path);
                return;
            }
            Some(Tok::Ident(s)) => {
                path.push(s.clone());
                *i += 1;
            }
            Some(Tok::PathSep) => *i += 1,
            Some(Tok::Punct('*')) => {
                *i += 1;
                out.push(path);
                return;
            }
            Some(Tok::Punct('{')) => {
                *i += 1;
                loop {
                    match toks.get(*i) {
                        Some(Tok::Punct('}')) => {
                            *i += 1;
                            return;
                        }
                        Some(Tok::Punct(',')) => *i += 1,
                        None => return,
                        _ => parse_use_tree(toks, i, path.clone(), out),
                    }
                }
            }
            _ => {
                // `,`, `}` or `;`: this branch ends here.
                if !path.is_empty() {
                    // `self` inside braces names the prefix itself.
                    if path.last().is_some_and(|s| s == "self") {
                        path.pop();
                    }
                    out.push(path);
                }
                return;
            }
        }
    }
}

/// Every reference a file makes, with the (inline) module that makes it.
fn references(file: &SourceFile) -> Vec<Reference> {
    let toks = tokenize(&file.code);
    let mut refs = Vec::new();
    // Inline modules (`mod tests { .. }`): (name, brace depth inside it).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    let current = |inline: &[(String, usize)]| -> Vec<String> {
        let mut m: Vec<String> = split(&file.module);
        m.extend(inline.iter().map(|(n, _)| n.clone()));
        m
    };
    while i < toks.len() {
        match &toks[i] {
            Tok::Punct('{') => {
                depth += 1;
                i += 1;
            }
            Tok::Punct('}') => {
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
                i += 1;
            }
            Tok::Ident(k) if k == "mod" => {
                if let (Some(Tok::Ident(name)), Some(Tok::Punct('{'))) =
                    (toks.get(i + 1), toks.get(i + 2))
                {
                    depth += 1;
                    inline.push((name.clone(), depth));
                    i += 3;
                } else {
                    i += 1;
                }
            }
            Tok::Ident(k) if k == "use" => {
                let reexport = is_pub_before(&toks, i);
                i += 1;
                let mut paths = Vec::new();
                parse_use_tree(&toks, &mut i, Vec::new(), &mut paths);
                let here = current(&inline);
                for p in paths {
                    if let Some((target, child)) = resolve_start(&here, &p) {
                        refs.push(Reference {
                            from: here.join("::"),
                            target,
                            file: file.path.clone(),
                            reexport,
                            child,
                        });
                    }
                }
            }
            Tok::Ident(k)
                if toks.get(i + 1) == Some(&Tok::PathSep)
                    && !(i > 0 && toks[i - 1] == Tok::PathSep) =>
            {
                let mut p = vec![k.clone()];
                let mut j = i + 1;
                while toks.get(j) == Some(&Tok::PathSep) {
                    match toks.get(j + 1) {
                        Some(Tok::Ident(s)) => {
                            p.push(s.clone());
                            j += 2;
                        }
                        _ => break,
                    }
                }
                let here = current(&inline);
                if let Some((target, child)) = resolve_start(&here, &p) {
                    refs.push(Reference {
                        from: here.join("::"),
                        target,
                        file: file.path.clone(),
                        reexport: false,
                        child,
                    });
                }
                i = j;
            }
            _ => i += 1,
        }
    }
    refs
}

/// Whether the `use` at `toks[i]` is `pub use` or `pub(..) use`.
fn is_pub_before(toks: &[Tok], i: usize) -> bool {
    match i.checked_sub(1).map(|j| &toks[j]) {
        Some(Tok::Ident(s)) if s == "pub" => true,
        Some(Tok::Punct(')')) => {
            // pub(crate) / pub(super) / pub(in path)
            let mut j = i - 1;
            while j > 0 && toks[j] != Tok::Punct('(') {
                j -= 1;
            }
            j > 0 && toks[j - 1] == Tok::Ident("pub".into())
        }
        _ => false,
    }
}

fn split(module: &str) -> Vec<String> {
    if module.is_empty() {
        Vec::new()
    } else {
        module.split("::").map(str::to_string).collect()
    }
}

/// The crate-absolute form of `path` named in module `here`: a path that starts with
/// `crate`, `super` or `self` ([`absolute`]), or one that starts with a bare name, read as a
/// child module of `here` (with that child, checked against the crate's modules later).
/// `None` for `$crate` paths and a lone name.
fn resolve_start(here: &[String], path: &[String]) -> Option<(Vec<String>, Option<String>)> {
    let first = path.first()?;
    if matches!(first.as_str(), "crate" | "super" | "self") {
        return absolute(here, path).map(|t| (t, None));
    }
    if path.len() < 2 || !first.starts_with(|c: char| c.is_ascii_lowercase()) {
        return None;
    }
    let mut target = here.to_vec();
    target.extend(path.iter().cloned());
    let child = target[..=here.len()].join("::");
    Some((target, Some(child)))
}

/// The crate-absolute form of `path` named in module `here`, or `None` for paths outside the
/// crate (`std::..`, `serde::..`) and `$crate` paths. Only `crate`, `super` and `self` starts
/// are resolved here; a path that starts with a child module's name is [`resolve_start`]'s.
fn absolute(here: &[String], path: &[String]) -> Option<Vec<String>> {
    let mut it = path.iter();
    let mut base: Vec<String> = match it.next()?.as_str() {
        "crate" => Vec::new(),
        "self" => here.to_vec(),
        "super" => {
            let mut b = here.to_vec();
            b.pop()?;
            b
        }
        _ => return None,
    };
    for seg in it {
        if seg == "super" {
            base.pop()?;
        } else if seg != "self" {
            base.push(seg.clone());
        }
    }
    Some(base)
}

/// The graph of the crate: file modules, their references, re-exports.
struct Crate {
    modules: BTreeSet<String>,
    refs: Vec<Reference>,
    /// module -> name -> the absolute path it re-exports.
    reexports: BTreeMap<String, BTreeMap<String, Vec<String>>>,
}

impl Crate {
    fn load(spec: &CrateSpec) -> Crate {
        let src = spec.src();
        let skip: Vec<PathBuf> = spec.skip.iter().map(|d| src.join(d)).collect();
        let mut files = Vec::new();
        rust_files(&src, &skip, &mut files);
        let mut sources = Vec::new();
        // Files included with `#[path = "x.rs"] mod name;` belong to the including module.
        let mut path_attr: BTreeMap<PathBuf, String> = BTreeMap::new();
        for f in &files {
            let text = fs::read_to_string(f).expect("read source");
            let module = module_of(&src, f);
            // `#[path = "x.rs"] mod name;`: the file is module `<this>::name`.
            for (n, line) in text.lines().enumerate() {
                let t = line.trim();
                if let Some(rest) = t.strip_prefix("#[path = \"") {
                    let file = rest.trim_end_matches("\"]");
                    let next = text.lines().nth(n + 1).unwrap_or("").trim();
                    let name = next
                        .trim_start_matches("pub ")
                        .trim_start_matches("mod ")
                        .trim_end_matches(';');
                    let dir = f.parent().expect("parent");
                    let m = if module.is_empty() {
                        name.to_string()
                    } else {
                        format!("{module}::{name}")
                    };
                    path_attr.insert(dir.join(file), m);
                }
            }
            sources.push((f.clone(), module, text));
        }
        let mut out = Crate {
            modules: BTreeSet::new(),
            refs: Vec::new(),
            reexports: BTreeMap::new(),
        };
        let files: Vec<SourceFile> = sources
            .into_iter()
            .map(|(path, module, text)| SourceFile {
                module: path_attr.get(&path).cloned().unwrap_or(module),
                code: strip_comments_and_literals(&text),
                path,
            })
            .collect();
        for f in &files {
            out.modules.insert(f.module.clone());
        }
        for f in &files {
            for r in references(f) {
                if r.child.as_ref().is_some_and(|c| !out.modules.contains(c)) {
                    continue;
                }
                if r.reexport && r.from == f.module {
                    let name = r.target.last().cloned().unwrap_or_default();
                    out.reexports
                        .entry(f.module.clone())
                        .or_default()
                        .insert(name, r.target.clone());
                }
                out.refs.push(r);
            }
        }
        out
    }

    /// The file module that defines the item at `path` (following re-exports), if any.
    fn resolve(&self, path: &[String], hops: usize) -> Option<String> {
        let mut n = path.len();
        while n > 0 {
            let m = path[..n].join("::");
            if self.modules.contains(&m) {
                break;
            }
            n -= 1;
        }
        let module = path[..n].join("::");
        if n == 0 && path.is_empty() {
            return Some(String::new());
        }
        if n < path.len()
            && hops < 8
            && let Some(target) = self.reexports.get(&module).and_then(|r| r.get(&path[n]))
        {
            let mut full = target.clone();
            full.extend(path[n + 1..].iter().cloned());
            if full != path {
                return self.resolve(&full, hops + 1);
            }
        }
        Some(module)
    }

    /// The file module a (possibly inline) module belongs to.
    fn file_module(&self, module: &str) -> String {
        let mut parts = split(module);
        while !parts.is_empty() && !self.modules.contains(&parts.join("::")) {
            parts.pop();
        }
        parts.join("::")
    }

    /// Every arrow between two different file modules, one example each.
    fn arrows(&self) -> Vec<Arrow> {
        let mut seen: BTreeMap<(String, String), Arrow> = BTreeMap::new();
        for r in &self.refs {
            let from = self.file_module(&r.from);
            let Some(to) = self.resolve(&r.target, 0) else {
                continue;
            };
            if from == to {
                continue;
            }
            seen.entry((from.clone(), to.clone()))
                .or_insert_with(|| Arrow {
                    from,
                    to,
                    file: r.file.clone(),
                    path: format!("crate::{}", r.target.join("::")),
                });
        }
        seen.into_values().collect()
    }
}

fn top(module: &str) -> &str {
    module.split("::").next().unwrap_or(module)
}

fn layer_of(layers: &[&[&str]], top_module: &str) -> Option<usize> {
    layers.iter().position(|l| l.contains(&top_module))
}

/// The folder an arrow runs inside and the child of that folder on each side: two files of one
/// folder (or of its subfolders), or, with `parent_child`, also the folder's own file (named
/// `mod`: its `mod.rs`, or the crate root) and one of its files. Without `parent_child` an arrow
/// between an ancestor and a descendant is no folder's arrow.
fn folder_arrow(a: &Arrow, parent_child: bool) -> Option<(String, String, String)> {
    let f = split(&a.from);
    let t = split(&a.to);
    let common = f.iter().zip(&t).take_while(|(x, y)| x == y).count();
    if !parent_child && (common == f.len() || common == t.len()) {
        return None; // ancestor / descendant
    }
    // `mod` is a keyword: no module has that name.
    let side = |m: &[String]| m.get(common).cloned().unwrap_or_else(|| "mod".to_string());
    Some((f[..common].join("::"), side(&f), side(&t)))
}

/// The circles among the arrows, per folder: (folder, members, the arrows inside the circle).
fn folder_circles(arrows: &[Arrow], parent_child: bool) -> Vec<(String, Vec<String>, Vec<Arrow>)> {
    let mut per_folder: BTreeMap<String, FolderGraph> = BTreeMap::new();
    let mut examples: BTreeMap<(String, String, String), Vec<Arrow>> = BTreeMap::new();
    for a in arrows {
        if let Some((folder, f, t)) = folder_arrow(a, parent_child) {
            let e = per_folder.entry(folder.clone()).or_default();
            e.0.insert(f.clone());
            e.0.insert(t.clone());
            e.1.insert((f.clone(), t.clone()));
            examples.entry((folder, f, t)).or_default().push(a.clone());
        }
    }
    let mut found = Vec::new();
    for (folder, (nodes, edges)) in &per_folder {
        for comp in circles(nodes, edges) {
            let inside: Vec<Arrow> = edges
                .iter()
                .filter(|(f, t)| comp.contains(f) && comp.contains(t))
                .flat_map(|(f, t)| examples[&(folder.clone(), f.clone(), t.clone())].clone())
                .collect();
            found.push((folder.clone(), comp, inside));
        }
    }
    found
}

/// Strongly connected components with more than one node (Tarjan).
fn circles(nodes: &BTreeSet<String>, edges: &BTreeSet<(String, String)>) -> Vec<Vec<String>> {
    struct State<'a> {
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(v: &'a str, edges: &'a BTreeSet<(String, String)>, s: &mut State<'a>) {
        s.index.insert(v, s.next);
        s.low.insert(v, s.next);
        s.next += 1;
        s.stack.push(v);
        s.on_stack.insert(v);
        for (_, w) in edges.iter().filter(|(f, _)| f == v) {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(w, edges, s);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).expect("low");
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).expect("low");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            loop {
                let w = s.stack.pop().expect("stack");
                s.on_stack.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.out.push(comp);
            }
        }
    }
    let mut s = State {
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in nodes {
        if !s.index.contains_key(v.as_str()) {
            visit(v, edges, &mut s);
        }
    }
    s.out
}

/// The files of one folder and the arrows between them.
type FolderGraph = (BTreeSet<String>, BTreeSet<(String, String)>);

/// The measurement: layer arrows, backward arrows, circles per folder.
struct Report {
    top_arrows: BTreeMap<(String, String), Arrow>,
    backward: Vec<Arrow>,
    unplaced: BTreeSet<String>,
    /// (folder, members, arrows inside the circle)
    circles: Vec<(String, Vec<String>, Vec<Arrow>)>,
    file_arrows: usize,
    depth: BTreeMap<String, usize>,
}

fn measure(spec: &CrateSpec) -> Report {
    let krate = Crate::load(spec);
    let arrows = krate.arrows();
    let layer_of = |m: &str| spec.layers.and_then(|layers| layer_of(layers, m));
    let mut top_arrows = BTreeMap::new();
    let mut backward = Vec::new();
    let mut unplaced = BTreeSet::new();
    for m in &krate.modules {
        if spec.layers.is_some() && !m.is_empty() && layer_of(top(m)).is_none() {
            unplaced.insert(top(m).to_string());
        }
    }
    for a in &arrows {
        let (f, t) = (top(&a.from), top(&a.to));
        if f == t || f.is_empty() || t.is_empty() {
            continue;
        }
        top_arrows
            .entry((f.to_string(), t.to_string()))
            .or_insert_with(|| a.clone());
        if let (Some(lf), Some(lt)) = (layer_of(f), layer_of(t))
            && lt > lf
        {
            backward.push(a.clone());
        }
    }
    // Circles: per folder (the crate root included), between its children.
    let found = folder_circles(&arrows, spec.parent_child);
    // Dependency level of each top-level module: the longest chain of arrows below it, with
    // the modules of a circle counted as one.
    let tops: BTreeSet<String> = krate
        .modules
        .iter()
        .filter(|m| !m.is_empty())
        .map(|m| top(m).to_string())
        .collect();
    let top_edges: BTreeSet<(String, String)> = top_arrows.keys().cloned().collect();
    let mut component: BTreeMap<String, String> =
        tops.iter().map(|t| (t.clone(), t.clone())).collect();
    for comp in circles(&tops, &top_edges) {
        let name = comp.join("+");
        for m in &comp {
            component.insert(m.clone(), name.clone());
        }
    }
    let mut depth: BTreeMap<String, usize> = BTreeMap::new();
    for _ in 0..=tops.len() {
        for t in &tops {
            let d = top_edges
                .iter()
                .filter(|(f, to)| f == t && component[f] != component[to])
                .map(|(_, to)| depth.get(&component[to]).copied().unwrap_or(0) + 1)
                .max()
                .unwrap_or(0);
            let c = depth.entry(component[t].clone()).or_insert(0);
            *c = (*c).max(d);
        }
    }
    let depth = tops
        .iter()
        .map(|t| (t.clone(), depth[&component[t]]))
        .collect();
    Report {
        top_arrows,
        backward,
        unplaced,
        circles: found,
        file_arrows: arrows.len(),
        depth,
    }
}

fn describe(a: &Arrow) -> String {
    // The crate root (`lib.rs`, `main.rs`) is the module without a name.
    let name = |m: &str| if m.is_empty() { "crate" } else { m }.to_string();
    format!(
        "{} -> {}  ({} names {})",
        name(&a.from),
        name(&a.to),
        a.file
            .strip_prefix(env!("CARGO_MANIFEST_DIR"))
            .unwrap_or(&a.file)
            .display(),
        a.path
    )
}

fn allowed(spec: &CrateSpec, folder: &str, members: &[String]) -> bool {
    spec.allowed.iter().any(|(f, a, b)| {
        *f == folder
            && members.len() == 2
            && members.contains(&a.to_string())
            && members.contains(&b.to_string())
    })
}

/// Prints the measurement of `spec`'s import graph and fails on a backward arrow, a
/// top-level module missing from its layers, or a circle it does not allow.
fn check(spec: &CrateSpec) {
    let r = measure(spec);
    let dir = spec.dir;
    let max_depth = r.depth.values().copied().max().unwrap_or(0);
    println!(
        "import graph of {dir}/: {} top-level modules in {} dependency levels, {} arrows \
         between top-level modules, {} arrows between file modules",
        r.depth.len(),
        max_depth + 1,
        r.top_arrows.len(),
        r.file_arrows
    );
    for (m, d) in &r.depth {
        let to: Vec<&str> = r
            .top_arrows
            .keys()
            .filter(|(f, _)| f == m)
            .map(|(_, t)| t.as_str())
            .collect();
        println!("  level {d:>2}  {m:<10} -> {}", to.join(" "));
    }
    let backward_tops: BTreeSet<(&str, &str)> = r
        .backward
        .iter()
        .map(|a| (top(&a.from), top(&a.to)))
        .collect();
    println!(
        "backward arrows: {} between top-level modules ({} between file modules)",
        backward_tops.len(),
        r.backward.len()
    );
    for a in &r.backward {
        println!("  {}", describe(a));
    }
    println!("circles inside a folder: {}", r.circles.len());
    for (folder, members, arrows) in &r.circles {
        let folder_name = if folder.is_empty() { dir } else { folder };
        let note = if allowed(spec, folder, members) {
            " (allowed)"
        } else {
            ""
        };
        println!("  {folder_name}: {}{note}", members.join(" <-> "));
        for a in arrows {
            println!("    {}", describe(a));
        }
    }

    let mut problems = Vec::new();
    if !r.unplaced.is_empty() {
        problems.push(format!(
            "top-level modules missing from LAYERS in tests/architecture.rs: {:?}",
            r.unplaced
        ));
    }
    for a in &r.backward {
        problems.push(format!(
            "backward arrow (a lower layer imports a higher one): {}",
            describe(a)
        ));
    }
    for (folder, members, arrows) in &r.circles {
        if allowed(spec, folder, members) {
            continue;
        }
        let folder_name = if folder.is_empty() { dir } else { folder };
        let list: Vec<String> = arrows.iter().map(describe).collect();
        problems.push(format!(
            "circle in {folder_name}: {}\n      {}",
            members.join(" <-> "),
            list.join("\n      ")
        ));
    }
    assert!(
        problems.is_empty(),
        "import graph of {dir}/ breaks the architecture:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn import_graph_has_no_backward_arrows_and_no_circles() {
    check(&ENGINE);
}

#[test]
fn cli_import_graph_has_no_circles() {
    check(&CLI);
}

#[test]
fn allowed_circles_still_exist() {
    // An exception that no longer matches a circle must be removed, so it cannot hide a
    // future one.
    for spec in [&ENGINE, &CLI] {
        let r = measure(spec);
        for (folder, a, b) in spec.allowed {
            assert!(
                r.circles.iter().any(|(f, m, _)| f == folder
                    && m.contains(&a.to_string())
                    && m.contains(&b.to_string())),
                "{}: the allowed circles list {folder}: {a} <-> {b}, which is no longer a \
                 circle: remove the entry",
                spec.dir
            );
        }
    }
}

#[test]
fn a_folder_and_its_file_importing_each_other_is_a_circle_where_checked() {
    let arrow = |from: &str, to: &str| Arrow {
        from: from.to_string(),
        to: to.to_string(),
        file: PathBuf::from("x.rs"),
        path: format!("crate::{to}"),
    };
    // fio/mod.rs uses fio::plan, and fio/plan.rs uses a type fio/mod.rs defines; fio/report.rs
    // uses fio::plan only.
    let arrows = [
        arrow("fio", "fio::plan"),
        arrow("fio::plan", "fio"),
        arrow("fio::report", "fio::plan"),
        arrow("fio::plan::inner", "fio::runner"),
        arrow("fio::runner", "fio::plan"),
    ];
    let found = folder_circles(&arrows, true);
    let members: Vec<(String, Vec<String>)> = found
        .iter()
        .map(|(f, m, _)| (f.clone(), m.clone()))
        .collect();
    assert_eq!(
        members,
        vec![(
            "fio".to_string(),
            vec!["mod".to_string(), "plan".to_string(), "runner".to_string()]
        )]
    );
    // Without the parent/child rule only the two files' circle is one.
    let found = folder_circles(&arrows, false);
    let members: Vec<(String, Vec<String>)> = found
        .iter()
        .map(|(f, m, _)| (f.clone(), m.clone()))
        .collect();
    assert_eq!(
        members,
        vec![(
            "fio".to_string(),
            vec!["plan".to_string(), "runner".to_string()]
        )]
    );
    // A crate root and a top-level module.
    let root = [arrow("", "bench"), arrow("bench::plan", "")];
    assert_eq!(folder_circles(&root, true)[0].1, vec!["bench", "mod"]);
    assert!(folder_circles(&root, false).is_empty());
}

#[test]
fn the_parser_finds_use_trees_inline_paths_and_skips_comments() {
    let code = strip_comments_and_literals(
        "use crate::a::{b::{C, D as E}, self, f::*};\n\
         // use crate::commented::Out;\n\
         /* crate::block::Out */\n\
         pub(crate) use super::g::H;\n\
         fn x() { let s = \"crate::string::Out\"; let c = '\\''; crate::i::j::k(); }\n\
         use plan::Plan;\n\
         fn y() { runner::go(); Vec::new(); std::mem::take(z); }\n\
         mod tests { use super::*; fn t<'a>(_: &'a str) { super::super::m::N; } }\n",
    );
    let file = SourceFile {
        module: "p::q".into(),
        path: PathBuf::from("src/p/q.rs"),
        code,
    };
    let got: Vec<(String, String, bool, Option<String>)> = references(&file)
        .into_iter()
        .map(|r| (r.from, r.target.join("::"), r.reexport, r.child))
        .collect();
    let want = [
        ("p::q", "a::b::C", false, None),
        ("p::q", "a::b::D", false, None),
        ("p::q", "a", false, None),
        ("p::q", "a::f", false, None),
        ("p::q", "p::g::H", true, None),
        ("p::q", "i::j::k", false, None),
        // Bare starts: children of `p::q` if such modules exist (checked when loading).
        ("p::q", "p::q::plan::Plan", false, Some("p::q::plan")),
        ("p::q", "p::q::runner::go", false, Some("p::q::runner")),
        ("p::q", "p::q::std::mem::take", false, Some("p::q::std")),
        ("p::q::tests", "p::q", false, None),
        ("p::q::tests", "p::m::N", false, None),
    ];
    let want: Vec<(String, String, bool, Option<String>)> = want
        .iter()
        .map(|(a, b, c, d)| (a.to_string(), b.to_string(), *c, d.map(str::to_string)))
        .collect();
    assert_eq!(got, want);
}

#[test]
fn tarjan_finds_a_three_module_circle_and_ignores_a_chain() {
    let nodes: BTreeSet<String> = ["a", "b", "c", "d"].iter().map(|s| s.to_string()).collect();
    let edge = |f: &str, t: &str| (f.to_string(), t.to_string());
    let chain: BTreeSet<_> = [edge("a", "b"), edge("b", "c"), edge("c", "d")].into();
    assert!(circles(&nodes, &chain).is_empty());
    let ring: BTreeSet<_> = [
        edge("a", "b"),
        edge("b", "c"),
        edge("c", "a"),
        edge("c", "d"),
    ]
    .into();
    assert_eq!(circles(&nodes, &ring), vec![vec!["a", "b", "c"]]);
}
