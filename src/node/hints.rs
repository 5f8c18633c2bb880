//! kvtier's prefetch hint action: what an orchestrator puts in a request's `kv_hints` (vLLM
//! 0.33's `KvHintsEnvelope`) so that the node service reads the request's chunks from G3 into
//! its DRAM staging pool before the request is scheduled (`docs/node-service.md`).
//!
//! The action (one `KvHintAction` of the envelope):
//!
//! | field | value |
//! | --- | --- |
//! | `action_type` | `"kvtier.prefetch"` ([`PREFETCH_ACTION`]) |
//! | `action_version` | `"1"` ([`PREFETCH_VERSION`]) |
//! | `payload` | `{"keys": [hex, ...]}`: vLLM offload keys (block hash and group index, `make_offload_key`), hex; or `{"block_hashes": [hex, ...], "group_idx": 0}`: the chunks' block hashes, hex, made into offload keys with `group_idx` (default 0), 4 bytes big-endian, as vLLM's `make_offload_key` does |
//!
//! Both lists may be given; at most [`MAX_KEYS_PER_ENVELOPE`] keys are taken. Actions of
//! another type, or of this type with another version, are ignored and counted; an action of
//! this type whose payload does not parse is counted as invalid (and logged), and the other
//! actions still apply.

use crate::contract::hints::KvHintsEnvelope;
use crate::key::ChunkKey;

/// kvtier's prefetch action type.
pub const PREFETCH_ACTION: &str = "kvtier.prefetch";
/// The payload version this build reads.
pub const PREFETCH_VERSION: &str = "1";
/// Keys one envelope may name (the rest are ignored and the action counted invalid).
pub const MAX_KEYS_PER_ENVELOPE: usize = 65536;

/// What an envelope asks of kvtier.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HintPlan {
    /// The keys to prefetch, in order, each once.
    pub keys: Vec<ChunkKey>,
    /// Prefetch actions applied.
    pub applied: u64,
    /// Actions ignored: their `(action_type, action_version)`.
    pub ignored: Vec<(String, String)>,
    /// Prefetch actions whose payload was refused: `(action_id, why)`.
    pub invalid: Vec<(String, String)>,
}

/// Reads `envelope`'s kvtier prefetch actions (see the module docs).
pub fn plan(envelope: &KvHintsEnvelope) -> HintPlan {
    let mut p = HintPlan::default();
    let mut seen = std::collections::HashSet::new();
    for a in &envelope.actions {
        if a.action_type != PREFETCH_ACTION || a.action_version != PREFETCH_VERSION {
            p.ignored
                .push((a.action_type.clone(), a.action_version.clone()));
            continue;
        }
        match payload_keys(&a.payload) {
            Ok(keys) => {
                let room = MAX_KEYS_PER_ENVELOPE - p.keys.len();
                if keys.len() > room {
                    p.invalid.push((
                        a.action_id.clone(),
                        format!(
                            "more than {MAX_KEYS_PER_ENVELOPE} keys in one envelope; the first \
                             {room} are prefetched"
                        ),
                    ));
                }
                for k in keys.into_iter().take(room) {
                    if seen.insert(k.clone()) {
                        p.keys.push(k);
                    }
                }
                p.applied += 1;
            }
            Err(why) => p.invalid.push((a.action_id.clone(), why)),
        }
    }
    p
}

fn hex_list(
    payload: &serde_json::Map<String, serde_json::Value>,
    field: &str,
) -> Result<Vec<Vec<u8>>, String> {
    let Some(v) = payload.get(field) else {
        return Ok(Vec::new());
    };
    let list = v
        .as_array()
        .ok_or_else(|| format!("payload.{field}: expected a list of hex strings"))?;
    list.iter()
        .enumerate()
        .map(|(i, x)| {
            let s = x
                .as_str()
                .ok_or_else(|| format!("payload.{field}[{i}]: expected a hex string"))?;
            let b = hex::decode(s).map_err(|e| format!("payload.{field}[{i}]: not hex ({e})"))?;
            if b.is_empty() || b.len() > u16::MAX as usize {
                return Err(format!(
                    "payload.{field}[{i}]: {} bytes (expected 1 to 65535)",
                    b.len()
                ));
            }
            Ok(b)
        })
        .collect()
}

fn payload_keys(
    payload: &serde_json::Map<String, serde_json::Value>,
) -> Result<Vec<ChunkKey>, String> {
    if let Some(unknown) = payload
        .keys()
        .find(|k| !["keys", "block_hashes", "group_idx"].contains(&k.as_str()))
    {
        return Err(format!(
            "payload.{unknown}: unknown field (expected keys, block_hashes, group_idx)"
        ));
    }
    let group = match payload.get("group_idx") {
        None => 0u32,
        Some(v) => v
            .as_u64()
            .and_then(|g| u32::try_from(g).ok())
            .ok_or_else(|| "payload.group_idx: expected an integer 0..=4294967295".to_string())?,
    };
    let mut keys: Vec<ChunkKey> = hex_list(payload, "keys")?
        .into_iter()
        .map(ChunkKey::new)
        .collect();
    for h in hex_list(payload, "block_hashes")? {
        keys.push(ChunkKey::vllm_offload_key(&h, group));
    }
    if keys.is_empty() {
        return Err("payload: no keys (give keys or block_hashes)".into());
    }
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn envelope(actions: serde_json::Value) -> KvHintsEnvelope {
        KvHintsEnvelope::from_json(
            &serde_json::json!({"protocol_version": "1", "message_id": "m", "actions": actions})
                .to_string(),
        )
        .unwrap()
    }

    #[test]
    fn prefetch_keys_and_block_hashes_are_read_the_rest_counted() {
        let e = envelope(serde_json::json!([
            {"action_id": "a", "action_type": "kvtier.prefetch", "action_version": "1",
             "payload": {"keys": ["0a0b", "0a0b"], "block_hashes": ["ff"], "group_idx": 2}},
            {"action_id": "b", "action_type": "router.pin", "action_version": "1", "payload": {}},
            {"action_id": "c", "action_type": "kvtier.prefetch", "action_version": "2",
             "payload": {"keys": ["01"]}},
            {"action_id": "d", "action_type": "kvtier.prefetch", "action_version": "1",
             "payload": {"keys": ["zz"]}},
        ]));
        let p = plan(&e);
        assert_eq!(
            p.keys,
            vec![
                ChunkKey::new([0x0a, 0x0b]),
                ChunkKey::new([0xff, 0, 0, 0, 2])
            ]
        );
        assert_eq!(p.applied, 1);
        assert_eq!(p.ignored.len(), 2);
        assert_eq!(p.invalid.len(), 1);
        assert!(
            p.invalid[0].1.contains("payload.keys[0]"),
            "{:?}",
            p.invalid
        );
    }
}
