//! Which namespace digest a pool of slabs is formatted for, decided once: the pool's opener
//! ([`PoolOpener`]) names it. `kvtier serve` (both services), `kvtier tier format --for`,
//! `kvtier bench` and [`Builder::layout`](crate::embed::Builder::layout) all ask here, and so
//! can an embedder that formats a pool ([`crate::g3::admin::format`]) or starts the node
//! service for one.

use crate::canonical::{
    LayoutDescriptor, NamespaceParams, engine_pool_namespace, namespace_digest,
};
use crate::config::KvtierConfig;
use crate::error::Result;

/// Who opens a pool of slabs (an `nvme` tier's stripe set). The opener decides the namespace
/// digest the pool's superblocks carry; a pool formatted for one opener is refused by the
/// other (their digests differ: the error's `mismatch` context is `namespace`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolOpener {
    /// vLLM engines, in process or in client mode, which present the namespace of the tier
    /// entry's `layout` key ([`engine_pool_namespace`]), and the node service that serves
    /// them (`kvtier serve` with a `service` section).
    VllmEngines,
    /// kvtier's in-process tiers, which store under the descriptor namespace
    /// ([`namespace_digest`]): `kvtier serve` without a `service` section, `kvtier bench`,
    /// [`Builder::layout`](crate::embed::Builder::layout).
    InProcess,
}

impl PoolOpener {
    /// Who opens the `nvme` tier of `config` when it is served: the node service (for vLLM
    /// engines) where the configuration has a `service` section, kvtier's in-process tiers
    /// otherwise.
    pub fn serving(config: &KvtierConfig) -> Self {
        if config.service.is_some() {
            PoolOpener::VllmEngines
        } else {
            PoolOpener::InProcess
        }
    }

    /// The namespace digest of a pool this opener opens, for the model `desc` with `params`
    /// (TP size, blocks per chunk, canonical or direct rows). For vLLM engines it is an error
    /// where vLLM's spec cannot describe the model ([`engine_pool_namespace`]).
    pub fn namespace(self, desc: &LayoutDescriptor, params: &NamespaceParams) -> Result<[u8; 32]> {
        match self {
            PoolOpener::VllmEngines => engine_pool_namespace(desc, params),
            PoolOpener::InProcess => Ok(namespace_digest(desc, params)),
        }
    }

    /// The other opener: the one whose pools this one refuses.
    pub fn other(self) -> Self {
        match self {
            PoolOpener::VllmEngines => PoolOpener::InProcess,
            PoolOpener::InProcess => PoolOpener::VllmEngines,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canonical::VllmSpecFields;
    use crate::canonical::default_layout;
    use crate::config::ServiceConfig;

    #[test]
    fn a_served_pool_is_the_node_services_with_a_service_section_else_in_process() {
        let mut cfg =
            crate::config::from_json_str(r#"{"cpu_bytes_to_use": "8MiB", "secondary_tiers": []}"#)
                .unwrap();
        assert_eq!(PoolOpener::serving(&cfg), PoolOpener::InProcess);
        cfg.service = Some(ServiceConfig::new("/run/kvtier/node.sock"));
        assert_eq!(PoolOpener::serving(&cfg), PoolOpener::VllmEngines);
    }

    #[test]
    fn each_opener_has_its_own_namespace_for_every_row_layout() {
        let desc = default_layout();
        for canonical in [false, true] {
            for tp in [1, 2] {
                let params = NamespaceParams::new(&desc, tp, 16, canonical).unwrap();
                let vllm = PoolOpener::VllmEngines.namespace(&desc, &params).unwrap();
                let own = PoolOpener::InProcess.namespace(&desc, &params).unwrap();
                // What a vLLM engine of this model presents with the tier entry's `layout`
                // key, and what kvtier's descriptor namespace is.
                let engine = VllmSpecFields::of_layout_engine(&desc, &params)
                    .unwrap()
                    .namespace_digest()
                    .unwrap();
                assert_eq!(vllm, engine, "canonical {canonical}, TP {tp}");
                assert_eq!(own, namespace_digest(&desc, &params));
                assert_ne!(vllm, own, "canonical {canonical}, TP {tp}");
            }
        }
        assert_eq!(PoolOpener::VllmEngines.other(), PoolOpener::InProcess);
        assert_eq!(PoolOpener::InProcess.other(), PoolOpener::VllmEngines);
    }
}
