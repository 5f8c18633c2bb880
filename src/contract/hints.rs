//! Orchestrator hints attached to a request, after vLLM 0.33.0's `vllm/v1/kv_hints/protocol.py`
//! (`KvHintsEnvelope` and `KvHintAction`, which a `ReqContext` carries as `kv_hints`).
//!
//! vLLM does not interpret the actions: each has a type and a version, and the component that
//! implements that action validates its payload. kvtier's own action is documented where it is
//! implemented (`crate::node::hints`, `docs/node-service.md`).

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};

/// One versioned hint action (vLLM `KvHintAction`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvHintAction {
    /// The orchestrator's id of this action.
    pub action_id: String,
    /// What the action asks for (`kvtier.prefetch` is kvtier's).
    pub action_type: String,
    /// The version of the action's payload schema.
    pub action_version: String,
    /// The action's payload (JSON values).
    pub payload: serde_json::Map<String, serde_json::Value>,
}

/// The hints of one request (vLLM `KvHintsEnvelope`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvHintsEnvelope {
    /// The envelope's protocol version.
    pub protocol_version: String,
    /// The orchestrator's message id.
    pub message_id: String,
    /// The actions.
    pub actions: Vec<KvHintAction>,
}

impl KvHintsEnvelope {
    /// Reads the JSON form of an envelope (what `msgspec.to_builtins` makes of vLLM's).
    pub fn from_json(text: &str) -> Result<KvHintsEnvelope> {
        serde_json::from_str(text).map_err(|e| {
            Error::new(
                ErrorKind::Contract,
                format!("kv_hints is not a KvHintsEnvelope: {e}"),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_an_envelope_and_names_what_is_missing() {
        let e = KvHintsEnvelope::from_json(
            r#"{"protocol_version":"1","message_id":"m","actions":[
                {"action_id":"a","action_type":"t","action_version":"1","payload":{"x":[1]}}]}"#,
        )
        .unwrap();
        assert_eq!(e.actions[0].action_type, "t");
        assert_eq!(e.actions[0].payload["x"][0], 1);
        let err =
            KvHintsEnvelope::from_json(r#"{"protocol_version":"1","actions":[]}"#).unwrap_err();
        assert!(err.to_string().contains("message_id"), "{err}");
    }
}
