//! Walks a parsed `kv_connector_extra_config` value into a [`KvtierConfig`], checking every key.

use serde_json::{Map, Value};

use super::backpressure::{self, Overlay};
use super::fields::{self, index, join};
use super::model::{ChunkSizing, EvictionPolicyKind, KvtierConfig, ServiceConfig, TierConfig};
use super::size::parse_size;
use super::validate::{check_engine_id, store_threshold_error};
use crate::contract::job::Locality;
use crate::error::{Error, Result};

/// Keys of `kv_connector_extra_config` that kvtier reads.
pub const KVTIER_KEYS: [&str; 10] = [
    "cpu_bytes_to_use",
    "block_size",
    "blocks_per_chunk",
    "eviction_policy",
    "store_threshold",
    "canonical_layout",
    "engine_id",
    "secondary_tiers",
    "backpressure",
    "service",
];

/// Keys of the `service` object (the node-local service, `docs/node-service.md`).
pub const SERVICE_KEYS: [&str; 4] = ["socket_path", "socket_mode", "allowed_uids", "dram_bytes"];

/// Keys of `kv_connector_extra_config` that belong to vLLM: accepted (type-checked) and
/// otherwise ignored by kvtier.
pub const VLLM_OWNED_KEYS: [&str; 8] = [
    "spec_name",
    "spec_module_path",
    "tier_poll_interval_s",
    "offload_prompt_only",
    "self_describing_kv_events",
    "sync_load_budget_bytes",
    "max_tracker_size",
    "cache_policy_module_path",
];

/// Keys of vLLM's `--kv-transfer-config` object (`KVTransferConfig`) accepted around
/// `kv_connector_extra_config`. kvtier reads `kv_connector` (must be `OffloadingConnector`),
/// `engine_id` and `kv_connector_extra_config`; the others are vLLM's and ignored.
pub const WRAPPER_KEYS: [&str; 13] = [
    "kv_connector",
    "engine_id",
    "kv_connector_extra_config",
    "kv_role",
    "kv_connector_module_path",
    "kv_buffer_device",
    "kv_buffer_size",
    "kv_rank",
    "kv_parallel_size",
    "kv_ip",
    "kv_port",
    "kv_load_failure_policy",
    "enable_permute_local_kv",
];

/// Keys common to every `secondary_tiers[i]`; every other key belongs to the tier's parser.
/// `module_path` is type-checked and left in [`TierConfig::params`] for the tier to ignore.
pub const TIER_COMMON_KEYS: [&str; 4] = ["type", "module_path", "locality", "backpressure"];

/// Common keys taken out of the entry (not passed on in `params`).
const EXTRACTED_TIER_KEYS: [&str; 3] = ["type", "locality", "backpressure"];

/// The connector whose extra config this is.
const CONNECTOR: &str = "OffloadingConnector";
const SPEC_TIERING: &str = "TieringOffloadingSpec";
const CPU_BYTES_EXPECTED: &str =
    "a positive integer number of bytes or a size string such as \"64GiB\"";

/// A validated configuration together with notes about defaults kvtier filled in where vLLM
/// would have behaved differently, or keys kvtier ignored.
#[derive(Debug, Clone)]
pub struct ResolvedConfig {
    /// The configuration.
    pub config: KvtierConfig,
    /// Human-readable notes (also logged at `warn` level by [`super::from_value`]).
    pub notes: Vec<String>,
}

/// Resolves a parsed value: either `kv_connector_extra_config` itself or the whole
/// `--kv-transfer-config` object containing it.
pub fn resolve(value: &Value) -> Result<ResolvedConfig> {
    let root = value.as_object().ok_or_else(|| {
        fields::type_error(
            "<root>",
            "an object (vLLM's kv_connector_extra_config or kv_transfer_config)",
            value,
        )
    })?;
    let mut notes = Vec::new();
    let Some(extra) = root.get("kv_connector_extra_config") else {
        return resolve_extra(root, "", None, &mut notes)
            .map(|config| ResolvedConfig { config, notes });
    };
    let mut outer_engine_id = None;
    for (k, v) in root {
        let p = k.as_str();
        match p {
            "kv_connector" => {
                let name = fields::string(p, v)?;
                if name != CONNECTOR {
                    return Err(Error::config(
                        p,
                        "kvtier reads OffloadingConnector's configuration",
                    )
                    .with("expected", CONNECTOR)
                    .with("found", name));
                }
            }
            "engine_id" => outer_engine_id = Some(engine_id(p, v)?),
            "kv_connector_extra_config" => {}
            _ if WRAPPER_KEYS.contains(&p) => {}
            _ => return Err(fields::unknown_key("", k, &WRAPPER_KEYS)),
        }
    }
    let extra = fields::object("kv_connector_extra_config", extra)?;
    let config = resolve_extra(
        extra,
        "kv_connector_extra_config",
        outer_engine_id,
        &mut notes,
    )?;
    Ok(ResolvedConfig { config, notes })
}

/// Resolves one `secondary_tiers` entry on its own, with the key paths of position `index`
/// (`secondary_tiers[index].paths`): for an embedder that is handed one tier's keys at a
/// time, as vLLM's factory hands them to an out-of-tree tier. No top-level back-pressure is
/// merged in (vLLM has already turned the merged dict into its own detector).
pub fn resolve_tier_entry(index: usize, entry: &Value) -> Result<TierConfig> {
    let tier = resolve_tier(index, entry, "secondary_tiers", None)?;
    tier.validate()?;
    Ok(tier)
}

fn engine_id(path: &str, v: &Value) -> Result<String> {
    let s = fields::string(path, v)?;
    check_engine_id(path, s)?;
    Ok(s.to_string())
}

fn resolve_extra(
    obj: &Map<String, Value>,
    prefix: &str,
    outer_engine_id: Option<String>,
    notes: &mut Vec<String>,
) -> Result<KvtierConfig> {
    check_extra_keys(obj, prefix)?;
    let path = |k: &str| join(prefix, k);
    let cpu_bytes_to_use = match obj.get("cpu_bytes_to_use") {
        None => {
            return Err(fields::missing(
                &path("cpu_bytes_to_use"),
                CPU_BYTES_EXPECTED,
            ));
        }
        Some(v) => byte_count(&path("cpu_bytes_to_use"), v)?,
    };
    let chunk = chunk_sizing(obj, prefix)?;
    let eviction_policy = match obj.get("eviction_policy") {
        None => EvictionPolicyKind::Lru,
        Some(v) => eviction_policy(&path("eviction_policy"), v)?,
    };
    let store_threshold = match obj.get("store_threshold") {
        None => 0,
        Some(v) => {
            let p = path("store_threshold");
            let n = fields::integer(&p, v, "0 or 1")?;
            // The range is KvtierConfig::validate's; a value beyond u32 breaks the same rule.
            u32::try_from(n).map_err(|_| store_threshold_error(&p, n))?
        }
    };
    let canonical_layout = match obj.get("canonical_layout") {
        None => false,
        Some(v) => fields::boolean(&path("canonical_layout"), v)?,
    };
    let engine_id = merged_engine_id(obj, prefix, outer_engine_id)?;
    let secondary_tiers = secondary_tiers(obj, prefix, notes)?;
    check_spec(obj, prefix, &secondary_tiers)?;
    let ignored: Vec<&str> = VLLM_OWNED_KEYS
        .iter()
        .copied()
        .filter(|k| obj.contains_key(*k))
        .collect();
    if !ignored.is_empty() {
        notes.push(format!(
            "keys read by vLLM, not by kvtier (type-checked, otherwise ignored): {}",
            ignored.join(", ")
        ));
    }
    let service = match obj.get("service") {
        None | Some(Value::Null) => None,
        Some(v) => Some(service(&path("service"), v)?),
    };
    let config = KvtierConfig {
        cpu_bytes_to_use,
        chunk,
        eviction_policy,
        store_threshold,
        canonical_layout,
        engine_id,
        secondary_tiers,
        service,
    };
    config.validate_at(prefix)?;
    Ok(config)
}

/// Refuses a key that neither kvtier nor vLLM reads, and type-checks vLLM's own keys.
fn check_extra_keys(obj: &Map<String, Value>, prefix: &str) -> Result<()> {
    let valid: Vec<&str> = KVTIER_KEYS
        .iter()
        .chain(&VLLM_OWNED_KEYS)
        .copied()
        .collect();
    for (k, v) in obj {
        if !valid.contains(&k.as_str()) {
            return Err(fields::unknown_key(prefix, k, &valid));
        }
        if VLLM_OWNED_KEYS.contains(&k.as_str()) {
            check_vllm_key(&join(prefix, k), k, v)?;
        }
    }
    Ok(())
}

/// `block_size` (tokens) or `blocks_per_chunk` (GPU blocks), never both; one GPU block per
/// chunk when neither is set.
fn chunk_sizing(obj: &Map<String, Value>, prefix: &str) -> Result<ChunkSizing> {
    let path = |k: &str| join(prefix, k);
    Ok(match (obj.get("block_size"), obj.get("blocks_per_chunk")) {
        (Some(_), Some(_)) => {
            return Err(Error::config(
                path("block_size"),
                "cannot be combined with blocks_per_chunk (they are mutually exclusive); set only one",
            ));
        }
        (Some(v), None) => ChunkSizing::BlockSizeTokens(fields::integer_u32(
            &path("block_size"),
            v,
            0,
            "a positive integer number of tokens (a multiple of the GPU block size)",
        )?),
        (None, Some(v)) => ChunkSizing::BlocksPerChunk(fields::integer_u32(
            &path("blocks_per_chunk"),
            v,
            0,
            "a positive integer (GPU blocks per chunk)",
        )?),
        (None, None) => ChunkSizing::BlocksPerChunk(1),
    })
}

/// The `engine_id`: this object's, or the enclosing `kv_transfer_config`'s; both set must
/// agree.
fn merged_engine_id(
    obj: &Map<String, Value>,
    prefix: &str,
    outer_engine_id: Option<String>,
) -> Result<Option<String>> {
    let path = join(prefix, "engine_id");
    let inner_engine_id = match obj.get("engine_id") {
        None => None,
        Some(v) => Some(engine_id(&path, v)?),
    };
    match (inner_engine_id, outer_engine_id) {
        (Some(a), Some(b)) if a != b => Err(Error::config(
            path,
            "differs from the engine_id of the enclosing kv_transfer_config",
        )
        .with("found", a)
        .with("expected", b)),
        (a, b) => Ok(a.or(b)),
    }
}

/// The `secondary_tiers`, each merged with the top-level `backpressure` dict; notes when
/// that dict is empty and so configures nothing.
fn secondary_tiers(
    obj: &Map<String, Value>,
    prefix: &str,
    notes: &mut Vec<String>,
) -> Result<Vec<TierConfig>> {
    // vLLM merges only a truthy top-level dict: `null` contributes nothing.
    let top_bp = match obj.get("backpressure") {
        None | Some(Value::Null) => None,
        Some(v) => Some(Overlay::parse(&join(prefix, "backpressure"), v)?),
    };
    let tiers_path = join(prefix, "secondary_tiers");
    let tier_values: &[Value] = match obj.get("secondary_tiers") {
        None => &[],
        Some(Value::Array(a)) => a,
        Some(v) => {
            return Err(fields::type_error(
                &tiers_path,
                "a list of tier objects, each with a \"type\"",
                v,
            ));
        }
    };
    let mut secondary_tiers = Vec::with_capacity(tier_values.len());
    for (i, v) in tier_values.iter().enumerate() {
        secondary_tiers.push(resolve_tier(i, v, &tiers_path, top_bp.as_ref())?);
    }
    if let Some(top) = &top_bp
        && top.is_empty()
        && secondary_tiers.iter().any(|t| t.backpressure.is_none())
    {
        notes.push(format!(
            "{}: an empty top-level dict configures no tier (vLLM merges only non-empty dicts); \
             tiers without their own backpressure key have no detector",
            join(prefix, "backpressure")
        ));
    }
    Ok(secondary_tiers)
}

/// Refuses `secondary_tiers` under a vLLM spec other than the tiering one (it ignores them).
fn check_spec(
    obj: &Map<String, Value>,
    prefix: &str,
    secondary_tiers: &[TierConfig],
) -> Result<()> {
    if let Some(Value::String(spec)) = obj.get("spec_name")
        && spec != SPEC_TIERING
        && obj.get("spec_module_path").is_none()
        && !secondary_tiers.is_empty()
    {
        return Err(Error::config(
            join(prefix, "spec_name"),
            "secondary_tiers need vLLM's TieringOffloadingSpec; this spec ignores them",
        )
        .with("expected", SPEC_TIERING)
        .with("found", spec.as_str()));
    }
    Ok(())
}

/// The `service` object: a socket path, an octal mode string or integer, a list of uids.
fn service(path: &str, v: &Value) -> Result<ServiceConfig> {
    let obj = fields::object(path, v)?;
    for k in obj.keys() {
        if !SERVICE_KEYS.contains(&k.as_str()) {
            return Err(fields::unknown_key(path, k, &SERVICE_KEYS));
        }
    }
    let key = |k: &str| join(path, k);
    let socket_path = match obj.get("socket_path") {
        None => {
            return Err(fields::missing(
                &key("socket_path"),
                "the path of the service's Unix socket, e.g. \"/run/kvtier/kvtier.sock\"",
            ));
        }
        Some(v) => std::path::PathBuf::from(fields::string(&key("socket_path"), v)?),
    };
    const MODE_EXPECTED: &str = "permission bits as an octal string such as \"0600\" or \"0660\"";
    let socket_mode = match obj.get("socket_mode") {
        None => ServiceConfig::DEFAULT_SOCKET_MODE,
        Some(Value::String(s)) => {
            let digits = s.strip_prefix("0o").unwrap_or(s);
            u32::from_str_radix(digits, 8)
                .map_err(|_| fields::range_error(&key("socket_mode"), MODE_EXPECTED, s))?
        }
        Some(v) => fields::integer_u32(&key("socket_mode"), v, 0, MODE_EXPECTED)?,
    };
    let uids_path = key("allowed_uids");
    let allowed_uids = match obj.get("allowed_uids") {
        None => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, v)| fields::integer_u32(&index(&uids_path, i), v, 0, "a uid (integer)"))
            .collect::<Result<Vec<_>>>()?,
        Some(v) => return Err(fields::type_error(&uids_path, "a list of uids", v)),
    };
    let dram_bytes = match obj.get("dram_bytes") {
        None => 0,
        Some(v) => byte_count(&key("dram_bytes"), v)?,
    };
    Ok(ServiceConfig {
        socket_path,
        socket_mode,
        allowed_uids,
        dram_bytes,
    })
}

/// A byte count: an integer or a human size string (its range is
/// [`KvtierConfig::validate`]'s).
fn byte_count(path: &str, v: &Value) -> Result<u64> {
    let n = match v {
        Value::String(s) => parse_size(s).map_err(|e| {
            Error::config(path, "not a byte size")
                .with("expected", CPU_BYTES_EXPECTED)
                .with("found", fields::describe(v))
                .with_source(e)
        })?,
        _ => fields::integer(path, v, CPU_BYTES_EXPECTED)?,
    };
    Ok(n)
}

fn eviction_policy(path: &str, v: &Value) -> Result<EvictionPolicyKind> {
    let s = fields::string(path, v)?;
    match s.to_ascii_lowercase().as_str() {
        "lru" => Ok(EvictionPolicyKind::Lru),
        "arc" => Ok(EvictionPolicyKind::Arc),
        _ => {
            let mut e = Error::config(
                path,
                "unsupported eviction policy; kvtier implements lru and arc",
            )
            .with("allowed", "lru, arc")
            .with("found", s);
            if let Some(c) = fields::closest(s, &["lru", "arc"]) {
                e = e.with("did_you_mean", c);
            }
            Err(e)
        }
    }
}

/// Type checks for keys vLLM owns, so that a typo in their value is caught here too.
fn check_vllm_key(path: &str, key: &str, v: &Value) -> Result<()> {
    match key {
        "spec_name" | "spec_module_path" | "cache_policy_module_path" => {
            fields::string(path, v)?;
        }
        "offload_prompt_only" | "self_describing_kv_events" => {
            fields::boolean(path, v)?;
        }
        "tier_poll_interval_s" => {
            fields::number(
                path,
                v,
                "a number of seconds (<= 0 disables the tier-poll thread)",
            )?;
        }
        "sync_load_budget_bytes" | "max_tracker_size" => {
            fields::integer(path, v, "a non-negative integer")?;
        }
        _ => {}
    }
    Ok(())
}

fn resolve_tier(
    i: usize,
    v: &Value,
    tiers_path: &str,
    top_bp: Option<&Overlay>,
) -> Result<TierConfig> {
    let tier_path = index(tiers_path, i);
    let entry = fields::object(&tier_path, v)?;
    let tier_type = match entry.get("type") {
        None => {
            return Err(fields::missing(
                &join(&tier_path, "type"),
                "the tier type, e.g. \"nvme\", or an out-of-tree class name",
            ));
        }
        Some(t) => fields::string(&join(&tier_path, "type"), t)?.to_string(),
    };
    if let Some(m) = entry.get("module_path") {
        fields::string(&join(&tier_path, "module_path"), m)?;
    }
    let locality = match entry.get("locality") {
        None => None,
        Some(l) => {
            let p = join(&tier_path, "locality");
            let s = fields::string(&p, l)?;
            Some(Locality::parse(s).ok_or_else(|| {
                fields::range_error(&p, "\"LOCAL\" or \"REMOTE\"", format!("{s:?}"))
            })?)
        }
    };
    let mut params = Map::new();
    for (k, v) in entry {
        if EXTRACTED_TIER_KEYS.contains(&k.as_str()) {
            continue;
        }
        if let Some(common) = TIER_COMMON_KEYS.iter().find(|c| fields::is_near_miss(k, c)) {
            return Err(Error::config(
                join(&tier_path, k),
                "unknown key: looks like a misspelt common tier key",
            )
            .with("did_you_mean", *common));
        }
        params.insert(k.clone(), v.clone());
    }
    let backpressure =
        backpressure::resolve_for_tier(top_bp, entry, &tier_path, &tier_type, locality)?;

    Ok(TierConfig {
        index: i,
        tier_type,
        locality,
        backpressure,
        params,
    })
}
