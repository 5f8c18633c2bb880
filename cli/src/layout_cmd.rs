//! `kvtier layout show` and `kvtier layout check`: inspect and validate layout descriptors.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Subcommand};
use serde_json::{Value, json};

use crate::args::name_flag;
use crate::layout_vllm;
use crate::output::{outln, print_json};
use kvtier::canonical::rank_page_range;
use kvtier::canonical::static_portability_claim;
use kvtier::canonical::{self as digest, NamespaceParams, VllmDigestFields};
use kvtier::canonical::{
    LayerMapping, LayerView, LayoutDescriptor, ParallelConfig, RowPlan, allocated_encoding,
    allocator_views, derive_all_ranks, prepare_canonical, resolve_encoding, verify_tiling,
};
use kvtier::error::{Error, ErrorKind, Result};
use kvtier::size::count;

/// `kvtier layout ...`
#[derive(Debug, Args)]
pub struct LayoutArgs {
    /// What to do.
    #[command(subcommand)]
    pub command: LayoutCommand,
}

/// The layout subcommands.
#[derive(Debug, Subcommand)]
pub enum LayoutCommand {
    /// Print per-layer mappings, portability, row stride and both digests for one descriptor.
    Show(ShowArgs),
    /// Validate every descriptor (`*.toml`) in a folder at TP 1, 2, 4 and 8, and compare its
    /// mappings with vLLM 0.33.0's own code when the vLLM sources are cached.
    Check(CheckArgs),
}

/// `kvtier layout show FILE --tp N [--rank R] [--canonical] [--blocks-per-chunk N] [--json]`
#[derive(Debug, Args)]
pub struct ShowArgs {
    /// The layout descriptor (TOML).
    pub file: PathBuf,
    /// Tensor-parallel size.
    #[arg(long)]
    pub tp: u32,
    /// The rank whose mapping to print.
    #[arg(long, default_value_t = 0)]
    pub rank: u32,
    /// Use the canonical (parallelism-agnostic) layout instead of the direct per-rank layout.
    #[arg(long)]
    pub canonical: bool,
    /// GPU blocks per chunk (decides the row stride).
    #[arg(long, default_value_t = 1)]
    pub blocks_per_chunk: u32,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// The layers' KV-cache views at this TP size (JSON: a list of `{"shape", "stride",
    /// "element_size"}` in layer order, strides in elements): the page encoding is derived
    /// from them and checked against the descriptor instead of taken from it.
    #[arg(long, value_name = "FILE")]
    pub views: Option<PathBuf>,
    /// Derive the page encoding from the layer tensors kvtier allocates itself as vLLM 0.33's
    /// allocator does (what `kvtier bench` and `--gds` use) and check the descriptor against
    /// it; `--json` adds the views (`allocated_views`).
    #[arg(long, conflicts_with = "views")]
    pub allocate: bool,
}

/// `kvtier layout check DIR`
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// Folder holding `*.toml` layout descriptors.
    pub dir: PathBuf,
}

/// Runs a layout subcommand.
pub fn run(args: LayoutArgs) -> Result<ExitCode> {
    match args.command {
        LayoutCommand::Show(a) => show(&a),
        LayoutCommand::Check(a) => check(&a.dir),
    }
}

/// The `show` report as JSON (the `--json` output).
pub fn show_json(desc: &LayoutDescriptor, args: &ShowArgs) -> Result<Value> {
    let cfg = ParallelConfig::tp(args.tp, args.rank);
    let views: Option<Vec<LayerView>> = match &args.views {
        Some(file) => {
            let text =
                std::fs::read_to_string(file).map_err(|e| Error::io("read views", file, e))?;
            Some(serde_json::from_str(&text).map_err(|e| {
                Error::config(
                    "--views",
                    format!(
                        "{}: expected a JSON list of {{\"shape\", \"stride\", \"element_size\"}}, one per layer: {e}",
                        file.display()
                    ),
                )
            })?)
        }
        None => None,
    };
    let (encoding, source) = if args.allocate {
        allocated_encoding(desc, args.tp)?
    } else {
        resolve_encoding(desc, args.tp, views.as_deref())?
    };
    let allocated_views = if args.allocate {
        allocator_views(desc, args.tp, 1)?
    } else {
        None
    };
    let mut params = NamespaceParams::new(desc, args.tp, args.blocks_per_chunk, args.canonical)
        .map_err(|e| name_flag(e, "blocks_per_chunk", "--blocks-per-chunk"))?;
    let (layers, plan_bytes) = if args.canonical {
        let shared = static_portability_claim(desc, args.tp, args.tp, true);
        let prepared = prepare_canonical(desc, &cfg, args.blocks_per_chunk, shared)?;
        params.all_layers_portable = prepared.status.all_layers_portable;
        let mine = prepared.mappings[args.rank as usize].clone();
        (mine, prepared.plan.canonical_area_bytes)
    } else {
        let all = derive_all_ranks(desc, args.tp)?;
        verify_tiling(&all)?;
        let mine = all.into_iter().nth(args.rank as usize).ok_or_else(|| {
            Error::new(
                ErrorKind::Config,
                format!("--rank {} is out of range for --tp {}", args.rank, args.tp),
            )
        })?;
        let plan = RowPlan::new(&mine, args.blocks_per_chunk)?;
        (mine, plan.local_chunk_bytes)
    };
    let (vllm_hex, vllm_fields) =
        digest::vllm_digest(&VllmDigestFields::from_descriptor(desc, &params));
    let rank_bytes = desc.worker_kv_bytes_per_block(args.tp)? * u64::from(args.blocks_per_chunk);
    Ok(json!({
        "file": args.file.display().to_string(),
        "model_name": desc.model_name,
        "revision": desc.revision,
        "attention": desc.attention,
        "num_layers": desc.num_layers,
        "dtype": desc.dtype,
        "tokens_per_block": desc.tokens_per_block,
        "kv_layout": desc.kv_layout.as_str(),
        "kv_split": desc.split().as_str(),
        "tp": args.tp,
        "rank": args.rank,
        "canonical": args.canonical,
        "blocks_per_chunk": args.blocks_per_chunk,
        "worker_kv_bytes_per_block": desc.worker_kv_bytes_per_block(args.tp)?,
        "canonical_bytes_per_block": desc.canonical_bytes_per_block(),
        "rank_chunk_bytes": rank_bytes,
        "row_area_bytes": plan_bytes,
        // The JSON key keeps its name: `kvtier layout show --json` output is unchanged.
        "direct_row_range": (!args.canonical).then(|| {
            // A replicated layout keeps one copy at the row start, written alike by every rank.
            let slot = if params.replicated_layout { 0 } else { args.rank };
            let r = rank_page_range(rank_bytes, slot);
            [r.start, r.end]
        }),
        "page_encoding": {
            "kv_layout": encoding.kv_layout.as_str(),
            "kv_split": encoding.kv_split.as_str(),
            "source": source.as_str(),
            "views_file": args.views.as_ref().map(|f| f.display().to_string()),
        },
        "allocated_views": allocated_views,
        "row_stride": params.row_stride,
        "slot_bytes": params.slot_bytes,
        "canonical_row_stride": desc.canonical_row_stride(args.blocks_per_chunk)?,
        "replicated_layout": params.replicated_layout,
        "all_layers_portable": args.canonical && params.all_layers_portable,
        "layers": layers.iter().map(layer_json).collect::<Vec<_>>(),
        "vllm_digest": vllm_hex,
        "vllm_digest_fields": vllm_fields,
        "namespace": digest::namespace_hex(desc, &params),
        // What vLLM engines with the tier entry's `layout` key and the node service present
        // (`kvtier tier format --for vllm`, the default); `namespace` is kvtier's in-process one.
        "engine_namespace": hex::encode(digest::engine_pool_namespace(desc, &params)?),
    }))
}

fn layer_json(lm: &LayerMapping) -> Value {
    let m = lm.mapping.as_ref();
    json!({
        "layer": lm.layer,
        "layer_name": lm.layer_name,
        "kind": lm.kind,
        "reason": lm.reason,
        "canonical_page_size_bytes": m.map(|m| m.canonical_page_size_bytes),
        "local_page_size_bytes": m.map(|m| m.local_page_size_bytes),
        "num_writers": m.map(|m| m.num_writers),
        "writer_index": m.map(|m| m.writer_index),
        "parallelism_agnostic": m.map(|m| m.parallelism_agnostic),
        "runs": m.map(|m| m.runs.clone()),
    })
}

fn show(args: &ShowArgs) -> Result<ExitCode> {
    let desc = LayoutDescriptor::load(&args.file)?;
    let report = show_json(&desc, args)?;
    if args.json {
        print_json(&report)?;
    } else {
        print_text(&report)?;
    }
    Ok(ExitCode::SUCCESS)
}

fn print_text(r: &Value) -> Result<()> {
    let s = |k: &str| match &r[k] {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        v => v.to_string(),
    };
    outln!("layout      {} ({})", s("model_name"), s("file"))?;
    outln!(
        "geometry    {} layers, {} attention, {}, {} tokens/block, {} {}",
        s("num_layers"),
        s("attention"),
        s("dtype"),
        s("tokens_per_block"),
        s("kv_layout"),
        s("kv_split")
    )?;
    let mode = if r["canonical"] == json!(true) {
        "canonical"
    } else {
        "direct"
    };
    outln!(
        "parallel    TP {} rank {} ({mode} layout)",
        s("tp"),
        s("rank")
    )?;
    outln!(
        "bytes       {} per rank per block, {} canonical per block",
        s("worker_kv_bytes_per_block"),
        s("canonical_bytes_per_block")
    )?;
    outln!(
        "row         stride {} for {} blocks per chunk (canonical stride {}, replicated {})",
        s("row_stride"),
        s("blocks_per_chunk"),
        s("canonical_row_stride"),
        s("replicated_layout")
    )?;
    let page = &r["page_encoding"];
    let from = match (page["views_file"].as_str(), page["source"].as_str()) {
        (Some(f), _) => format!("derived from the views in {f}, which agree with the descriptor"),
        (None, Some("allocated")) => "derived from the layer tensors kvtier allocates as vLLM \
             0.33's allocator does (kvtier bench, --gds), which agree with the descriptor"
            .into(),
        _ => "from the descriptor's kv_split and kv_layout; no KV-cache views checked: \
              --views FILE or --allocate"
            .into(),
    };
    outln!(
        "page        {} {} ({from})",
        page["kv_split"].as_str().unwrap_or("?"),
        page["kv_layout"].as_str().unwrap_or("?")
    )?;
    outln!("slots       {} bytes stored per chunk", s("slot_bytes"))?;
    outln!("portable    {}", s("all_layers_portable"))?;
    if let Some([a, b]) = r["direct_row_range"]
        .as_array()
        .map(|v| [v[0].clone(), v[1].clone()])
    {
        outln!(
            "direct      rank {} stores its whole page at row bytes [{a}, {b}); the canonical mappings below apply only with --canonical",
            s("rank")
        )?;
    }
    // Consecutive layers with identical mappings are printed once.
    let layers = r["layers"].as_array().cloned().unwrap_or_default();
    let summary = |l: &Value| {
        let mut l = l.clone();
        if let Some(o) = l.as_object_mut() {
            o.remove("layer");
            o.remove("layer_name");
        }
        l
    };
    let mut i = 0;
    while i < layers.len() {
        let mut j = i;
        while j + 1 < layers.len() && summary(&layers[j + 1]) == summary(&layers[i]) {
            j += 1;
        }
        let l = &layers[i];
        let runs = l["runs"].as_array().map_or(0, |r| r.len());
        outln!(
            "layers {i}-{j}  {} page {} -> canonical {}, {runs} run(s), writers {} (index {}), agnostic {}{}",
            l["kind"].as_str().unwrap_or("?"),
            l["local_page_size_bytes"],
            l["canonical_page_size_bytes"],
            l["num_writers"],
            l["writer_index"],
            l["parallelism_agnostic"],
            l["reason"]
                .as_str()
                .map(|r| format!(" ({r})"))
                .unwrap_or_default()
        )?;
        for run in l["runs"].as_array().into_iter().flatten() {
            outln!(
                "    local {} -> canonical {}: {} x {} B (strides {} / {})",
                run["local_offset"],
                run["canonical_offset"],
                run["num_fragments"],
                run["fragment_size"],
                run["local_stride"],
                run["canonical_stride"]
            )?;
        }
        i = j + 1;
    }
    outln!("vllm_digest {}", s("vllm_digest"))?;
    outln!(
        "namespace   {} (kvtier's in-process tiers: tier format --for in-process)",
        s("namespace")
    )?;
    outln!(
        "engine ns   {} (vLLM engines with the layout key, the node service: tier format)",
        s("engine_namespace")
    )
}

/// Checks one descriptor at every TP in {1, 2, 4, 8} it allows; returns those TP sizes.
pub fn check_file(path: &Path) -> Result<Vec<u32>> {
    let desc = LayoutDescriptor::load(path)?;
    let tps = desc.allowed_tp(&[1, 2, 4, 8]);
    if tps.is_empty() {
        return Err(Error::new(
            ErrorKind::Config,
            format!("{}: the model allows none of TP 1, 2, 4, 8", path.display()),
        ));
    }
    for &tp in &tps {
        // The direct per-rank mappings must tile each row; then every rank's canonical plan
        // must prepare.
        verify_tiling(&derive_all_ranks(&desc, tp)?)?;
        let shared = static_portability_claim(&desc, tp, tp, true);
        for rank in 0..tp {
            prepare_canonical(&desc, &ParallelConfig::tp(tp, rank), 1, shared)?;
        }
    }
    Ok(tps)
}

/// kvtier's canonical answer for `path` at every TP size in `tps`, for the vLLM comparison.
fn subject(path: &Path, tps: &[u32]) -> Result<layout_vllm::Subject> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io("read layout", path, e))?;
    let desc = LayoutDescriptor::from_toml_str(&text)?;
    let mut answers = Vec::new();
    for &tp in tps {
        let shared = static_portability_claim(&desc, tp, tp, true);
        let prepared = prepare_canonical(&desc, &ParallelConfig::tp(tp, 0), 1, shared)?;
        let ranks: Vec<Value> = (0u32..)
            .zip(&prepared.mappings)
            .map(|(rank, layers)| {
                json!({"rank": rank, "layers": layers.iter().map(layer_json).collect::<Vec<_>>()})
            })
            .collect();
        answers.push((tp, json!({ "ranks": ranks })));
    }
    Ok(layout_vllm::Subject {
        file: path.to_path_buf(),
        text,
        answers,
    })
}

fn check(dir: &Path) -> Result<ExitCode> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io("read layout folder", dir, e))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::new(
            ErrorKind::InvalidPath,
            format!("{}: no *.toml layout descriptors found", dir.display()),
        ));
    }
    let mut failed = 0;
    let mut subjects = Vec::new();
    for f in &files {
        match check_file(f).and_then(|tps| subject(f, &tps).map(|s| (tps, s))) {
            Ok((tps, s)) => {
                let tps: Vec<String> = tps.iter().map(u32::to_string).collect();
                outln!("ok    {} (TP {})", f.display(), tps.join(", "))?;
                subjects.push(s);
            }
            Err(e) => {
                failed += 1;
                outln!("FAIL  {}: {e}", f.display())?;
            }
        }
    }
    if !subjects.is_empty() {
        let version = layout_vllm::VLLM_VERSION;
        match layout_vllm::compare(&subjects) {
            Ok(layout_vllm::Outcome::Ran {
                compared,
                differences,
            }) => {
                for d in &differences {
                    outln!("FAIL  vLLM {version}: {d}")?;
                }
                outln!(
                    "vLLM {version}: {compared} layer mappings of {} compared with vLLM's \
                     derive_canonical_mappings over create_kv_cache_views views (every rank, \
                     allowed TP of 1/2/4/8; byte oracle on the first and last layer): {} differ",
                    count(subjects.len() as u64, "descriptor"),
                    differences.len()
                )?;
                if !differences.is_empty() {
                    failed += 1;
                }
            }
            Ok(layout_vllm::Outcome::Skipped(why)) => {
                outln!("vLLM {version} comparison skipped: {why}")?;
            }
            Err(e) => {
                failed += 1;
                outln!("FAIL  vLLM {version} comparison: {e}")?;
            }
        }
    }
    outln!("{} descriptor(s), {failed} failed", files.len())?;
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    })
}
