//! Tiling verification (vLLM's `_verify_tiling`), run at start-up before any byte moves:
//! each rank's runs partition its local page exactly, and for every writer-election residue the
//! elected writers tile the canonical page exactly once.

use crate::canonical::mapping::{CanonicalPageMapping, LayerMapping};
use crate::error::{Error, ErrorKind, Result};

/// One covered byte range and the rank that covers it.
#[derive(Debug, Clone, Copy)]
struct Span {
    start: u64,
    end: u64,
    rank: u32,
}

fn tiling_error(layer: &LayerMapping, rank: u32, start: u64, end: u64, what: String) -> Error {
    Error::new(
        ErrorKind::Internal,
        format!(
            "canonical tiling check failed: layer {} ({}), rank {rank}, bytes [{start}, {end}): {what}",
            layer.layer, layer.layer_name
        ),
    )
    .with("layer", layer.layer_name.clone())
    .with("rank", rank.to_string())
    .with("range", format!("[{start}, {end})"))
}

/// Checks every layer of every rank: `per_rank[rank][layer]`, as from
/// [`crate::canonical::derive_all_ranks`]. Layers without a mapping on every rank are skipped
/// (validation refuses them separately); a layer mapped on some ranks only is an error.
pub fn verify_tiling(per_rank: &[Vec<LayerMapping>]) -> Result<()> {
    let Some(first) = per_rank.first() else {
        return Ok(());
    };
    for (r, layers) in per_rank.iter().enumerate() {
        if layers.len() != first.len() {
            return Err(Error::new(
                ErrorKind::Internal,
                format!(
                    "canonical tiling check failed: rank {r} has {} layers, rank 0 has {}",
                    layers.len(),
                    first.len()
                ),
            ));
        }
    }
    for l in 0..first.len() {
        let layer: Vec<&LayerMapping> = per_rank.iter().map(|ranks| &ranks[l]).collect();
        verify_layer(&layer)?;
    }
    Ok(())
}

/// Checks one layer across all ranks (`ranks[i]` is rank `i`'s mapping of that layer).
pub fn verify_layer(ranks: &[&LayerMapping]) -> Result<()> {
    let Some(first) = ranks.first() else {
        return Ok(());
    };
    let mapped: Vec<(&LayerMapping, &CanonicalPageMapping)> = ranks
        .iter()
        .filter_map(|lm| lm.mapping.as_ref().map(|m| (*lm, m)))
        .collect();
    if mapped.is_empty() {
        return Ok(());
    }
    if mapped.len() != ranks.len() {
        let missing = ranks
            .iter()
            .find(|lm| lm.mapping.is_none())
            .map_or(0, |lm| lm.rank);
        return Err(tiling_error(
            first,
            missing,
            0,
            0,
            "layer has no mapping on this rank but has one on others".into(),
        ));
    }
    let canonical_size = mapped[0].1.canonical_page_size_bytes;
    for (lm, m) in &mapped {
        if m.canonical_page_size_bytes != canonical_size {
            return Err(tiling_error(
                lm,
                lm.rank,
                0,
                m.canonical_page_size_bytes,
                format!(
                    "canonical page size {} differs from rank {}'s {canonical_size}",
                    m.canonical_page_size_bytes, mapped[0].0.rank
                ),
            ));
        }
        verify_local_partition(lm, m)?;
    }
    // Residues repeat with the least common multiple of the writer counts.
    let period = mapped
        .iter()
        .map(|(_, m)| u64::from(m.num_writers.max(1)))
        .fold(1u64, lcm);
    for residue in 0..period {
        let mut spans = Vec::new();
        for (lm, m) in &mapped {
            if !m.is_writer(residue) {
                continue;
            }
            for run in &m.runs {
                for (_, c) in run.fragments() {
                    spans.push(Span {
                        start: c,
                        end: c + run.fragment_size,
                        rank: lm.rank,
                    });
                }
            }
        }
        check_partition(
            first,
            &mut spans,
            canonical_size,
            &format!("canonical page, writer residue {residue}"),
        )?;
    }
    Ok(())
}

fn verify_local_partition(lm: &LayerMapping, m: &CanonicalPageMapping) -> Result<()> {
    let mut spans = Vec::new();
    for (i, run) in m.runs.iter().enumerate() {
        let bad_shape = run.fragment_size == 0 || run.num_fragments == 0;
        let (Some(local_end), Some(canonical_end)) = (run.local_end(), run.canonical_end()) else {
            return Err(tiling_error(
                lm,
                lm.rank,
                run.local_offset,
                u64::MAX,
                format!("run {i} overflows"),
            ));
        };
        if bad_shape {
            return Err(tiling_error(
                lm,
                lm.rank,
                run.local_offset,
                local_end,
                format!("run {i} is empty"),
            ));
        }
        if local_end > m.local_page_size_bytes {
            return Err(tiling_error(
                lm,
                lm.rank,
                run.local_offset,
                local_end,
                format!(
                    "run {i} reaches past the local page ({} bytes)",
                    m.local_page_size_bytes
                ),
            ));
        }
        if canonical_end > m.canonical_page_size_bytes {
            return Err(tiling_error(
                lm,
                lm.rank,
                run.canonical_offset,
                canonical_end,
                format!(
                    "run {i} reaches past the canonical page ({} bytes)",
                    m.canonical_page_size_bytes
                ),
            ));
        }
        for (l, _) in run.fragments() {
            spans.push(Span {
                start: l,
                end: l + run.fragment_size,
                rank: lm.rank,
            });
        }
    }
    check_partition(lm, &mut spans, m.local_page_size_bytes, "local page")
}

/// Checks that `spans` cover `[0, total)` exactly once.
fn check_partition(layer: &LayerMapping, spans: &mut [Span], total: u64, what: &str) -> Result<()> {
    spans.sort_by_key(|s| (s.start, s.end));
    let mut cursor = 0u64;
    let mut last_rank = layer.rank;
    for s in spans.iter() {
        if s.start > cursor {
            return Err(tiling_error(
                layer,
                last_rank.min(s.rank),
                cursor,
                s.start,
                format!("{what}: not covered"),
            ));
        }
        if s.start < cursor {
            return Err(tiling_error(
                layer,
                s.rank,
                s.start,
                cursor.min(s.end),
                format!("{what}: covered twice (ranks {last_rank} and {})", s.rank),
            ));
        }
        cursor = s.end;
        last_rank = s.rank;
    }
    if cursor < total {
        return Err(tiling_error(
            layer,
            last_rank,
            cursor,
            total,
            format!("{what}: not covered"),
        ));
    }
    if cursor > total {
        return Err(tiling_error(
            layer,
            last_rank,
            total,
            cursor,
            format!("{what}: covered past its end"),
        ));
    }
    Ok(())
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

fn lcm(a: u64, b: u64) -> u64 {
    a / gcd(a, b) * b
}
