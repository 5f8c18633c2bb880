//! The layout descriptors shipped in `layouts/`, embedded in the library, and how a `layout`
//! setting names one: a shipped name (`qwen2.5-3b`, the file's stem) or a path to a TOML
//! descriptor. The Python package has no `layouts/` folder beside it, so a vLLM tier entry can
//! still say `"layout": "qwen2.5-3b"`.

use std::path::Path;

use crate::canonical::descriptor::LayoutDescriptor;
use crate::error::{Error, Result};

/// `(name, TOML text)` of every descriptor in `layouts/` (a unit test keeps the list equal to
/// the folder).
pub const SHIPPED_LAYOUTS: &[(&str, &str)] = &[
    (
        "deepseek-v3",
        include_str!("../../layouts/deepseek-v3.toml"),
    ),
    ("llama-2-7b", include_str!("../../layouts/llama-2-7b.toml")),
    (
        "llama-3.1-70b",
        include_str!("../../layouts/llama-3.1-70b.toml"),
    ),
    (
        "llama-3.1-8b",
        include_str!("../../layouts/llama-3.1-8b.toml"),
    ),
    ("mistral-7b", include_str!("../../layouts/mistral-7b.toml")),
    ("qwen2.5-3b", include_str!("../../layouts/qwen2.5-3b.toml")),
    ("qwen2.5-7b", include_str!("../../layouts/qwen2.5-7b.toml")),
    ("qwen3-32b", include_str!("../../layouts/qwen3-32b.toml")),
];

/// The shipped descriptor called `name` (`qwen2.5-3b`), parsed.
pub fn shipped_layout(name: &str) -> Option<Result<LayoutDescriptor>> {
    SHIPPED_LAYOUTS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, text)| LayoutDescriptor::from_toml_str(text))
}

/// Resolves a `layout` setting at `key` (named in errors): a shipped name, else a path to a
/// TOML descriptor. Returns the descriptor and where it came from (`shipped qwen2.5-3b` or
/// the path).
pub fn resolve_layout(key: &str, value: &str) -> Result<(LayoutDescriptor, String)> {
    if let Some(desc) = shipped_layout(value) {
        return Ok((desc?, format!("shipped {value}")));
    }
    let path = Path::new(value);
    if !path.exists() {
        let names: Vec<&str> = SHIPPED_LAYOUTS.iter().map(|(n, _)| *n).collect();
        return Err(Error::config(
            key,
            "neither a shipped layout name nor an existing descriptor file",
        )
        .with("found", value.to_string())
        .with(
            "expected",
            format!("one of {} or a path to a .toml", names.join(", ")),
        ));
    }
    let desc = LayoutDescriptor::load(path).map_err(|e| e.with("key", key.to_string()))?;
    Ok((desc, path.display().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_list_is_the_layouts_folder() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("layouts");
        let mut on_disk: Vec<(String, String)> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "toml"))
            .map(|p| {
                let stem = p.file_stem().unwrap().to_string_lossy().into_owned();
                (stem, std::fs::read_to_string(&p).unwrap())
            })
            .collect();
        on_disk.sort();
        let embedded: Vec<(String, String)> = SHIPPED_LAYOUTS
            .iter()
            .map(|(n, t)| (n.to_string(), t.to_string()))
            .collect();
        assert_eq!(embedded, on_disk);
        for (name, _) in SHIPPED_LAYOUTS {
            shipped_layout(name).unwrap().unwrap();
        }
    }

    #[test]
    fn a_name_or_a_path_resolves_and_anything_else_is_refused_naming_the_key() {
        let (desc, source) = resolve_layout("k", "qwen2.5-3b").unwrap();
        assert_eq!(desc.model_name, "Qwen/Qwen2.5-3B-Instruct");
        assert_eq!(source, "shipped qwen2.5-3b");
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("layouts/mistral-7b.toml");
        let (desc, source) = resolve_layout("k", path.to_str().unwrap()).unwrap();
        assert!(desc.model_name.contains("Mistral"), "{}", desc.model_name);
        assert_eq!(source, path.display().to_string());
        let e = resolve_layout("secondary_tiers[0].layout", "qwen9").unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("secondary_tiers[0].layout") && text.contains("qwen9"),
            "{text}"
        );
        assert!(text.contains("qwen2.5-3b"), "{text}");
    }
}
