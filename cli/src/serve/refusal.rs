//! How `kvtier serve` words a refusal: errors of the plan name the configuration file, and a
//! tier formatted under other settings says which inputs make the namespace and the exact
//! `kvtier tier format` command that makes a tier serve opens.

use crate::serve::args::ServeArgs;
use crate::tier::FormatFor;
use kvtier::config::KvtierConfig;
use kvtier::embed::PoolOpener;
use kvtier::error::{Error, ErrorKind};

/// A namespace or row-size refusal `e` (a tier formatted for another model, TP size, row
/// layout or opener) with the inputs serve derives its namespace from (`layout`: the `--layout` model)
/// and the exact `kvtier tier format` command that makes a tier it opens (`opener`: the
/// in-process tiers, or the node service, whose namespace vLLM engines present). Any other
/// refusal is returned as it is.
pub fn namespace_hint(
    e: Error,
    args: &ServeArgs,
    cfg: &KvtierConfig,
    layout: &kvtier::canonical::LayoutDescriptor,
    params: &kvtier::canonical::NamespaceParams,
    opener: PoolOpener,
) -> Error {
    use kvtier::g3::{MISMATCH_NAMESPACE, MISMATCH_ROW_STRIDE};
    // Only a tier formatted under other settings is fixed by a format that matches them;
    // every other refusal (paths in another order, a member of another set, a slab of another
    // format version or capacity) already says what fixes it, and a format would discard
    // chunks for nothing.
    if !matches!(
        e.context_value("mismatch"),
        Some(MISMATCH_NAMESPACE | MISMATCH_ROW_STRIDE)
    ) {
        return e;
    }
    let blocks_per_chunk = params.blocks_per_chunk;
    let for_ = FormatFor::of(opener);
    // A tier formatted for this model but for the other opener says so.
    let other = opener
        .other()
        .namespace(layout, params)
        .ok()
        .map(|d| (d, FormatFor::of(opener.other()).openers()));
    let formatted_for = match (other, e.context_value("found")) {
        (Some((digest, who)), Some(found)) if hex::encode(digest) == found => {
            format!(" (the tier was formatted for {who})")
        }
        _ => String::new(),
    };
    let (who, flag) = match for_ {
        FormatFor::InProcess => (
            "kvtier serve without a service section opens tiers with the in-process namespace",
            "--for in-process",
        ),
        FormatFor::Vllm => (
            "the node service opens tiers with the namespace vLLM engines present (with the \
             tier entry's layout key)",
            "--for vllm, the default",
        ),
    };
    let command = crate::tier::format_command(
        cfg,
        args.model.layout.as_deref(),
        args.model.tp,
        blocks_per_chunk,
        for_,
    );
    let mut out = Error::new(
        ErrorKind::IncompatibleLayout,
        format!(
            "{}{formatted_for}; {who} ({flag}), derived from {} at --tp {}, \
             blocks_per_chunk {} and canonical_layout = {} in {}: serve with the settings \
             the tier was formatted with to keep its chunks, or, to change them, format the \
             tier to match, which discards the chunks it holds (`{command}`)",
            e.message(),
            layout.model_name,
            args.model.tp,
            blocks_per_chunk,
            cfg.canonical_layout,
            args.config.display(),
        ),
    );
    for key in ["expected", "found"] {
        if let Some(v) = e.context_value(key) {
            out = out.with(key, v.to_string());
        }
    }
    out
}

/// A plan error names the configuration file unless it is about a flag (`--tp`).
pub fn in_file(config: &std::path::Path, e: Error) -> Error {
    if e.context_value("key").is_some_and(|k| k.starts_with("--")) {
        e
    } else {
        kvtier::config::error_in_file(config, e)
    }
}
