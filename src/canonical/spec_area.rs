//! The canonical area of vLLM's rows, from a layout descriptor checked against vLLM's
//! configuration.
//!
//! vLLM 0.33 gives a secondary tier its `OffloadingConfig` and the primary region's row, but no
//! KV head count, so the tier cannot tell how many of the row's bytes are the canonical pages
//! vLLM's workers write (`SharedOffloadRegion.create_next_canonical_view` carves them from the
//! start of each row, layer after layer). For GQA with replicated KV heads (Qwen2.5-3B at TP 4
//! and 8) vLLM sizes the row for one copy per worker, twice or four times the canonical area.
//! A layout descriptor says how large the area is; [`VllmSpecFields::canonical_area`] checks
//! that the descriptor is the model vLLM runs (every value vLLM reports that the descriptor
//! predicts) and returns the area, so a tier stores only it, under one namespace at every TP
//! size.

use crate::canonical::descriptor::{KvLayout, LayoutDescriptor};
use crate::canonical::digest::VllmSpecFields;
use crate::error::{Error, Result};

impl VllmSpecFields {
    /// Bytes of each row that hold the canonical pages of `desc`'s model, after checking that
    /// `desc` describes the model and deployment these fields come from: vLLM's canonical
    /// layout on, the same model name and dtype, block size, layer count and KV cache layout, a TP-only
    /// topology the model allows, and exactly the bytes per worker block and row that the
    /// descriptor predicts for this TP size. `key` names the setting in errors, which give
    /// both values (`expected`: the descriptor's, `found`: vLLM's).
    pub fn canonical_area(&self, desc: &LayoutDescriptor, key: &str) -> Result<u64> {
        let model = &desc.model_name;
        let mismatch = |what: &str, expected: String, found: String| {
            Error::config(
                key,
                format!(
                    "the layout ({model}) does not describe the model vLLM runs: {what} differs"
                ),
            )
            .with("expected", expected)
            .with("found", found)
        };
        if !self.canonical_layout {
            return Err(Error::config(
                key,
                "names the canonical area of vLLM's canonical layout, but \
                 kv_connector_extra_config.canonical_layout is off (turn it on, or remove the key)",
            )
            .with("found", "canonical_layout: false"));
        }
        // vLLM reports no KV head count: a descriptor with fewer heads than the model, at a
        // TP size that replicates them, predicts the same worker blocks and rows but a smaller
        // area (half the pages would be lost). The model's name is what tells them apart; a
        // model served under another name needs a descriptor that says so.
        if self.model_name != desc.model_name {
            return Err(mismatch(
                "the model name",
                desc.model_name.clone(),
                self.model_name.clone(),
            ));
        }
        if self.dtype != desc.dtype {
            return Err(mismatch(
                "the KV cache dtype",
                desc.dtype.clone(),
                self.dtype.clone(),
            ));
        }
        let [group] = self.kv_cache_groups.as_slice() else {
            return Err(mismatch(
                "the number of KV cache groups",
                "1".into(),
                self.kv_cache_groups.len().to_string(),
            ));
        };
        if group.tokens_per_block != desc.tokens_per_block {
            return Err(mismatch(
                "tokens per block",
                desc.tokens_per_block.to_string(),
                group.tokens_per_block.to_string(),
            ));
        }
        if group.layer_names.len() != desc.num_layers as usize {
            return Err(mismatch(
                "the number of layers",
                desc.num_layers.to_string(),
                group.layer_names.len().to_string(),
            ));
        }
        let vllm_layout = self
            .kv_cache_layout
            .as_deref()
            .and_then(KvLayout::from_vllm_name);
        if vllm_layout != Some(desc.kv_layout) {
            return Err(mismatch(
                "the KV cache layout",
                desc.kv_layout.as_str().to_string(),
                format!("{:?}", self.kv_cache_layout),
            ));
        }
        let tp = self.tp_size;
        if (self.pp_size, self.pcp_size, self.dcp_size, self.world_size) != (1, 1, 1, tp) {
            return Err(Error::config(
                key,
                "a layout descriptor describes TP-only deployments (PP, PCP and DCP 1, world \
                 size = TP size)",
            )
            .with(
                "found",
                format!(
                    "tp {tp}, pp {}, pcp {}, dcp {}, world size {}",
                    self.pp_size, self.pcp_size, self.dcp_size, self.world_size
                ),
            ));
        }
        desc.check_tp(tp).map_err(|e| {
            Error::config(key, format!("{model} cannot run at TP {tp}: {e}"))
                .with("found", format!("tp_size {tp}"))
        })?;
        let worker = desc.worker_kv_bytes_per_block(tp)?;
        if worker != self.worker_kv_bytes_per_block {
            return Err(mismatch(
                &format!("KV bytes per worker block at TP {tp} (worker_kv_bytes_per_block)"),
                worker.to_string(),
                self.worker_kv_bytes_per_block.to_string(),
            ));
        }
        let row = desc.vllm_row_stride(tp, self.blocks_per_chunk, self.replicated_layout)?;
        if row != self.row_stride {
            return Err(mismatch(
                &format!(
                    "the primary row at TP {tp} with {} blocks per chunk",
                    self.blocks_per_chunk
                ),
                row.to_string(),
                self.row_stride.to_string(),
            ));
        }
        let area = desc.canonical_row_stride(self.blocks_per_chunk)?;
        if area > row {
            return Err(mismatch(
                "the canonical area fitting in the row",
                format!("at most {row}"),
                area.to_string(),
            ));
        }
        Ok(area)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canonical::digest::KvCacheGroupFields;
    use crate::canonical::shipped::shipped_layout;

    /// The fields vLLM reports for `desc` at `tp` (as `build_offloading_config` computes
    /// them; the Python suite checks the real ones).
    fn reported(desc: &LayoutDescriptor, tp: u32, bpc: u32) -> VllmSpecFields {
        let replicated = desc.is_mla() && tp > 1;
        VllmSpecFields {
            model_name: desc.model_name.clone(),
            dtype: desc.dtype.clone(),
            tokens_per_hash: desc.tokens_per_block,
            blocks_per_chunk: bpc,
            tp_size: tp,
            pp_size: 1,
            pcp_size: 1,
            dcp_size: 1,
            world_size: tp,
            is_parallelism_agnostic: true,
            kv_cache_groups: vec![KvCacheGroupFields {
                tokens_per_block: desc.tokens_per_block,
                layer_names: desc.layer_names(),
            }],
            replicated_layout: replicated,
            canonical_layout: true,
            kv_cache_layout: Some("LBNHC".into()),
            worker_kv_bytes_per_block: desc.worker_kv_bytes_per_block(tp).unwrap(),
            row_stride: desc.vllm_row_stride(tp, bpc, replicated).unwrap(),
            slot_bytes: None,
        }
    }

    #[test]
    fn replicated_gqa_gets_one_area_and_one_namespace_at_every_tp() {
        let desc = shipped_layout("qwen2.5-3b").unwrap().unwrap();
        let mut namespaces = Vec::new();
        for tp in [1, 2, 4, 8] {
            let mut f = reported(&desc, tp, 2);
            let area = f.canonical_area(&desc, "k").unwrap();
            assert_eq!(area, desc.canonical_row_stride(2).unwrap());
            assert_eq!(f.row_stride, area * u64::from((tp / 2).max(1)));
            f.slot_bytes = Some(area);
            namespaces.push(f.namespace_digest().unwrap());
        }
        assert!(namespaces.windows(2).all(|w| w[0] == w[1]));
        // Where the area is the row, naming it leaves the namespace as it was.
        let mut f = reported(&desc, 2, 2);
        let before = f.namespace_digest().unwrap();
        f.slot_bytes = Some(f.canonical_area(&desc, "k").unwrap());
        assert_eq!(before, f.namespace_digest().unwrap());
    }

    #[test]
    fn a_descriptor_of_another_model_is_refused_naming_the_key_and_both_values() {
        let qwen = shipped_layout("qwen2.5-3b").unwrap().unwrap();
        let llama = shipped_layout("llama-3.1-8b").unwrap().unwrap();
        let f = reported(&qwen, 4, 1);
        let e = f
            .canonical_area(&llama, "secondary_tiers[0].layout")
            .unwrap_err();
        assert_eq!(e.context_value("key"), Some("secondary_tiers[0].layout"));
        assert!(e.context_value("expected").is_some() && e.context_value("found").is_some());
        let mut renamed = f.clone();
        renamed.model_name = "/models/qwen".into();
        let e = renamed.canonical_area(&qwen, "k").unwrap_err();
        assert_eq!(e.context_value("found"), Some("/models/qwen"));
        let mut off = f.clone();
        off.canonical_layout = false;
        let e = off.canonical_area(&qwen, "k").unwrap_err();
        assert!(e.to_string().contains("canonical_layout"), "{e}");
        let mut row = f.clone();
        row.row_stride *= 2;
        let e = row.canonical_area(&qwen, "k").unwrap_err();
        assert_eq!(
            e.context_value("found"),
            Some(row.row_stride.to_string().as_str())
        );
    }
}
