//! Configuration: the serde model of vLLM's `kv_connector_extra_config`, merge and validation.
