//! The resolved configuration: what the rest of kvtier consumes after parsing, merging and
//! validation. Every value here has already been checked.

use serde::Serialize;

use crate::contract::job::Locality;
use crate::error::{Error, ErrorKind, Result};
use crate::geometry::ChunkGeometry;

/// How big a chunk is, in GPU blocks or in tokens (mutually exclusive in the config).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ChunkSizing {
    /// `blocks_per_chunk` (default 1, > 0).
    BlocksPerChunk(u32),
    /// `block_size` in tokens (a multiple of the GPU block size; resolved against it later).
    BlockSizeTokens(u32),
}

/// The primary tier's eviction policy (`eviction_policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EvictionPolicyKind {
    /// Least recently used (default).
    #[default]
    Lru,
    /// Adaptive replacement cache (Megiddo and Modha).
    Arc,
}

/// Back-pressure settings for one tier after the field-by-field merge (top level, then the
/// tier's own dict) and after the tier-type-aware presets filled what was still missing.
/// Field names and meanings are vLLM 0.33.0's `EMABackpressureDetector` kwargs.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct BackpressureConfig {
    /// Detector class name (`EMABackpressureDetector`).
    pub backpressure_cls: Option<String>,
    /// Drop policy class name (`ThrottledDropPolicy` default, or `DropStorePolicy`).
    pub policy_cls: Option<String>,
    /// EMA above this (s/MiB) means pressure.
    pub high_water_s: Option<f64>,
    /// EMA below this (s/MiB) clears pressure.
    pub low_water_s: Option<f64>,
    /// EMA smoothing factor, 0 < alpha <= 1 (default 0.15).
    pub alpha: Option<f64>,
    /// Completions collected before the EMA starts (default 10).
    pub warmup_completions: Option<u32>,
    /// Idle decay half-life in seconds (default 2.0; `<= 0`: no idle decay).
    pub decay_half_life_s: Option<f64>,
    /// Cooldown after pressure clears, in seconds (default 1.0).
    pub cooldown_s: Option<f64>,
    /// Consecutive failed stores that trip pressure; `None`: failures never trip. The merge
    /// has already applied the tier type's default (3 for `fs`, `obj` and kvtier's `nvme`),
    /// so `None` here is either a non-storage tier or an explicit `null`.
    pub failure_threshold: Option<u32>,
}

/// One entry of `secondary_tiers`, resolved.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TierConfig {
    /// Position in `secondary_tiers` (0-based); the metric label is `<index+1>:<type>`.
    pub index: usize,
    /// The tier type (`nvme`, `memory`, ...).
    #[serde(rename = "type")]
    pub tier_type: String,
    /// `LOCAL` or `REMOTE`, if configured.
    #[serde(serialize_with = "ser_locality")]
    pub locality: Option<Locality>,
    /// Merged back-pressure config; `None` = no detector, the tier never drops stores.
    pub backpressure: Option<BackpressureConfig>,
    /// Type-specific keys, validated by the tier's own config parser. `module_path` (checked
    /// to be a string) stays here too: vLLM imports it, kvtier's tiers ignore it.
    pub params: serde_json::Map<String, serde_json::Value>,
}

impl TierConfig {
    /// A tier of `tier_type` at position `index` with no locality, no back-pressure and no
    /// type-specific keys (for tests and programmatic construction).
    pub fn new(index: usize, tier_type: impl Into<String>) -> Self {
        TierConfig {
            index,
            tier_type: tier_type.into(),
            locality: None,
            backpressure: None,
            params: serde_json::Map::new(),
        }
    }

    /// The key path prefix of this entry for error messages: `secondary_tiers[3]`.
    pub fn key_path(&self) -> String {
        format!("secondary_tiers[{}]", self.index)
    }
}

fn ser_locality<S: serde::Serializer>(l: &Option<Locality>, s: S) -> Result<S::Ok, S::Error> {
    match l {
        Some(l) => s.serialize_str(l.as_str()),
        None => s.serialize_none(),
    }
}

/// The whole resolved configuration.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KvtierConfig {
    /// Total bytes of the primary region (`cpu_bytes_to_use`).
    pub cpu_bytes_to_use: u64,
    /// Chunk sizing.
    pub chunk: ChunkSizing,
    /// Primary eviction policy.
    pub eviction_policy: EvictionPolicyKind,
    /// `store_threshold` (0 or 1; >= 2 is rejected for tiering).
    pub store_threshold: u32,
    /// Store chunks in the canonical (parallelism-agnostic) layout.
    pub canonical_layout: bool,
    /// Engine id (names the region; unique per DP replica).
    pub engine_id: Option<String>,
    /// Secondary tiers in lookup order.
    pub secondary_tiers: Vec<TierConfig>,
    /// The node-local service (`service`): when set, `kvtier serve` owns the `nvme` tier for
    /// every engine process of the host and listens on a Unix socket (`docs/node-service.md`).
    pub service: Option<ServiceConfig>,
}

/// The node-local service's socket (`service` key; `docs/node-service.md`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ServiceConfig {
    /// Path of the Unix socket (`service.socket_path`).
    pub socket_path: std::path::PathBuf,
    /// Permission bits of the socket file (`service.socket_mode`, default `0o600`).
    pub socket_mode: u32,
    /// Peer uids allowed to connect, checked with `SO_PEERCRED` (`service.allowed_uids`;
    /// empty: only the uid the service runs as).
    pub allowed_uids: Vec<u32>,
    /// Bytes of the service's DRAM staging pool (`service.dram_bytes`; 0: none): chunks
    /// loaded from G3 and prefetched for hints stay there for every engine.
    pub dram_bytes: u64,
}

impl ServiceConfig {
    /// The default socket mode: owner read and write only.
    pub const DEFAULT_SOCKET_MODE: u32 = 0o600;

    /// A service on `socket_path` with the default mode and only the service's own uid.
    pub fn new(socket_path: impl Into<std::path::PathBuf>) -> Self {
        ServiceConfig {
            socket_path: socket_path.into(),
            socket_mode: Self::DEFAULT_SOCKET_MODE,
            allowed_uids: Vec::new(),
            dram_bytes: 0,
        }
    }
}

impl KvtierConfig {
    /// A configuration with `cpu_bytes_to_use` and every other key at its default
    /// (`blocks_per_chunk` 1, LRU, no secondary tiers), for tests and programmatic use.
    pub fn new(cpu_bytes_to_use: u64) -> Self {
        KvtierConfig {
            cpu_bytes_to_use,
            chunk: ChunkSizing::BlocksPerChunk(1),
            eviction_policy: EvictionPolicyKind::Lru,
            store_threshold: 0,
            canonical_layout: false,
            engine_id: None,
            secondary_tiers: Vec::new(),
            service: None,
        }
    }
}

impl ChunkSizing {
    /// GPU blocks per chunk. `block_size` (tokens) must be a positive multiple of
    /// `gpu_block_size_tokens`, which is needed only in that case.
    pub fn blocks_per_chunk(self, gpu_block_size_tokens: Option<u32>) -> Result<u32> {
        match self {
            ChunkSizing::BlocksPerChunk(n) => Ok(n),
            ChunkSizing::BlockSizeTokens(tokens) => {
                let Some(gpu) = gpu_block_size_tokens.filter(|g| *g > 0) else {
                    return Err(Error::new(
                        ErrorKind::Config,
                        format!(
                            "block_size ({tokens} tokens) needs the GPU block size (tokens per GPU \
                         block) to give blocks per chunk"
                        ),
                    ));
                };
                if tokens == 0 || !tokens.is_multiple_of(gpu) {
                    return Err(Error::config(
                        "block_size",
                        "must be a positive multiple of the GPU block size",
                    )
                    .with("found", tokens.to_string())
                    .with("gpu_block_size", gpu.to_string()));
                }
                Ok(tokens / gpu)
            }
        }
    }
}

impl KvtierConfig {
    /// The chunk geometry of this configuration for one worker's KV bytes per GPU block and
    /// the number of copies; `gpu_block_size_tokens` is needed only when `block_size` is set.
    pub fn geometry(
        &self,
        worker_kv_bytes_per_block: u64,
        copies: u32,
        gpu_block_size_tokens: Option<u32>,
    ) -> Result<ChunkGeometry> {
        let blocks_per_chunk = self.chunk.blocks_per_chunk(gpu_block_size_tokens)?;
        ChunkGeometry::derive(
            worker_kv_bytes_per_block,
            copies,
            blocks_per_chunk,
            self.cpu_bytes_to_use,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_geometry_uses_its_sizing_and_pool() {
        let mut c = KvtierConfig::new(100 << 20);
        c.chunk = ChunkSizing::BlockSizeTokens(32);
        let g = c.geometry(512, 2, Some(16)).unwrap();
        assert_eq!((g.blocks_per_chunk, g.num_chunks), (2, 25_600));
        assert!(c.geometry(512, 2, None).is_err());
    }

    #[test]
    fn block_size_resolves_against_gpu_block_size() {
        assert_eq!(
            ChunkSizing::BlocksPerChunk(4)
                .blocks_per_chunk(None)
                .unwrap(),
            4
        );
        assert_eq!(
            ChunkSizing::BlockSizeTokens(64)
                .blocks_per_chunk(Some(16))
                .unwrap(),
            4
        );
        let e = ChunkSizing::BlockSizeTokens(40)
            .blocks_per_chunk(Some(16))
            .unwrap_err();
        assert!(
            e.to_string().contains("multiple of the GPU block size"),
            "{e}"
        );
        assert!(
            ChunkSizing::BlockSizeTokens(64)
                .blocks_per_chunk(None)
                .is_err()
        );
    }
}
