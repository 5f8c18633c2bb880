//! Configuration rules: keys, types, ranges, tiers, vLLM-owned keys, the `kv_transfer_config`
//! wrapper, JSON / TOML equivalence and file loading. Back-pressure: `config_backpressure.rs`.

mod common;

use common::{err, notes_of, ok, with_tiers};
use kvtier::ErrorKind;
use kvtier::config::{
    self, ChunkSizing, EvictionPolicyKind, Format, KvtierConfig, TierConfig,
    backpressure::LOCAL_PRESET,
};
use kvtier::contract::job::Locality;
use serde_json::json;

// ---- defaults and simple keys -------------------------------------------------------------

#[test]
fn minimal_config_takes_defaults() {
    let c = ok(json!({"cpu_bytes_to_use": 4096}));
    assert_eq!(c, KvtierConfig::new(4096));
    assert_eq!(c.chunk, ChunkSizing::BlocksPerChunk(1));
    assert_eq!(c.eviction_policy, EvictionPolicyKind::Lru);
    assert!(c.secondary_tiers.is_empty());
}

#[test]
fn every_kvtier_key_is_read() {
    let c = ok(json!({
        "cpu_bytes_to_use": "64GiB", "block_size": 64, "eviction_policy": "ARC",
        "store_threshold": 1, "canonical_layout": true, "engine_id": "e0_dp1",
    }));
    assert_eq!(c.cpu_bytes_to_use, 64 << 30);
    assert_eq!(c.chunk, ChunkSizing::BlockSizeTokens(64));
    assert_eq!(c.eviction_policy, EvictionPolicyKind::Arc);
    assert_eq!(c.store_threshold, 1);
    assert!(c.canonical_layout);
    assert_eq!(c.engine_id.as_deref(), Some("e0_dp1"));
}

#[test]
fn cpu_bytes_to_use_is_required_positive_and_sized() {
    let e = err(json!({"blocks_per_chunk": 2}));
    assert_eq!(e.context_value("key"), Some("cpu_bytes_to_use"));
    assert!(e.to_string().contains("required key is missing"), "{e}");
    let e = err(json!({"cpu_bytes_to_use": 0}));
    assert!(e.to_string().contains("out of range"), "{e}");
    let e = err(json!({"cpu_bytes_to_use": "0GiB"}));
    assert!(e.to_string().contains("out of range"), "{e}");
    let e = err(json!({"cpu_bytes_to_use": true}));
    assert_eq!(e.context_value("found"), Some("boolean true"));
    let e = err(json!({"cpu_bytes_to_use": "64 parsecs"}));
    assert_eq!(e.context_value("found"), Some("string \"64 parsecs\""));
    assert!(e.to_string().contains("64GiB"), "says what is allowed: {e}");
    assert_eq!(
        ok(json!({"cpu_bytes_to_use": 6.8e10})).cpu_bytes_to_use,
        68_000_000_000
    );
    err(json!({"cpu_bytes_to_use": 1.5}));
}

#[test]
fn block_size_and_blocks_per_chunk_are_exclusive() {
    let e = err(json!({"cpu_bytes_to_use": 4096, "block_size": 16, "blocks_per_chunk": 1}));
    assert!(e.to_string().contains("mutually exclusive"), "{e}");
    for bad in [json!(0), json!(-1), json!(1.5), json!("4")] {
        let e = err(json!({"cpu_bytes_to_use": 4096, "blocks_per_chunk": bad}));
        assert_eq!(e.context_value("key"), Some("blocks_per_chunk"), "{e}");
        assert!(e.context_value("found").is_some(), "{e}");
    }
    err(json!({"cpu_bytes_to_use": 4096, "block_size": 0}));
}

#[test]
fn store_threshold_two_or_more_is_rejected_for_tiering() {
    assert_eq!(
        ok(json!({"cpu_bytes_to_use": 4096, "store_threshold": 0})).store_threshold,
        0
    );
    let e = err(json!({"cpu_bytes_to_use": 4096, "store_threshold": 2}));
    let s = e.to_string();
    assert!(
        s.contains("store_threshold") && s.contains("not supported with tiering"),
        "{s}"
    );
    assert_eq!(e.context_value("found"), Some("2"));
    err(json!({"cpu_bytes_to_use": 4096, "store_threshold": -1}));
}

#[test]
fn wrong_types_name_key_value_and_allowed() {
    for (key, bad, expected) in [
        ("canonical_layout", json!("yes"), "a boolean"),
        ("eviction_policy", json!(3), "a string"),
        ("engine_id", json!(7), "a string"),
    ] {
        let mut v = json!({"cpu_bytes_to_use": 4096});
        v[key] = bad;
        let e = err(v);
        assert_eq!(e.context_value("key"), Some(key), "{e}");
        assert!(
            e.context_value("expected").unwrap().contains(expected),
            "{e}"
        );
        assert!(e.context_value("found").is_some(), "{e}");
    }
    let e = err(json!({"cpu_bytes_to_use": 4096, "eviction_policy": "lur"}));
    assert_eq!(e.context_value("did_you_mean"), Some("lru"));
    assert_eq!(e.context_value("allowed"), Some("lru, arc"));
    let e = err(json!({"cpu_bytes_to_use": 4096, "engine_id": "a/b"}));
    assert!(e.to_string().contains("without '/'"), "{e}");
    let e = err(json!([1, 2]));
    assert!(e.to_string().contains("<root>: wrong type"), "{e}");
}

// ---- unknown keys -------------------------------------------------------------------------

#[test]
fn unknown_top_level_key_suggests_the_closest() {
    let e = err(json!({"cpu_bytes_to_use": 4096, "blocks_per_chunck": 2}));
    assert_eq!(e.context_value("key"), Some("blocks_per_chunck"));
    assert_eq!(e.context_value("did_you_mean"), Some("blocks_per_chunk"));
    assert!(
        e.to_string().starts_with("blocks_per_chunck: unknown key"),
        "{e}"
    );
    let e = err(json!({"cpu_bytes_to_use": 4096, "zzz": 1}));
    assert_eq!(e.context_value("did_you_mean"), None);
    assert!(
        e.context_value("valid_keys")
            .unwrap()
            .contains("secondary_tiers")
    );
}

#[test]
fn misspelt_tier_key_names_full_path() {
    let v = with_tiers(
        None,
        json!([{"type": "nvme"}, {"type": "nvme", "backpresure": {}}]),
    );
    let e = err(v);
    assert_eq!(
        e.context_value("key"),
        Some("secondary_tiers[1].backpresure")
    );
    assert_eq!(e.context_value("did_you_mean"), Some("backpressure"));
    for typo in ["tpye", "Locality", "module_pth"] {
        let mut tier = json!({"type": "nvme"});
        tier[typo] = json!("x");
        let e = err(with_tiers(None, json!([tier])));
        assert_eq!(
            e.context_value("key"),
            Some(format!("secondary_tiers[0].{typo}").as_str())
        );
    }
}

#[test]
fn unknown_backpressure_key_names_full_path() {
    let v = with_tiers(
        None,
        json!([{"type": "nvme", "backpressure": {"alpa": 0.2}}]),
    );
    let e = err(v);
    assert_eq!(
        e.context_value("key"),
        Some("secondary_tiers[0].backpressure.alpa")
    );
    assert_eq!(e.context_value("did_you_mean"), Some("alpha"));
    let e = err(with_tiers(Some(json!({"ramp_factor": 2.0})), json!([])));
    assert_eq!(e.context_value("key"), Some("backpressure.ramp_factor"));
}

// ---- tiers --------------------------------------------------------------------------------

#[test]
fn secondary_tiers_must_be_a_list_of_objects_with_type() {
    let e = err(with_tiers(None, json!({"type": "nvme"})));
    assert_eq!(e.context_value("key"), Some("secondary_tiers"));
    assert_eq!(e.context_value("found"), Some("object"));
    let e = err(with_tiers(None, json!([{"type": "nvme"}, {"paths": []}])));
    assert_eq!(e.context_value("key"), Some("secondary_tiers[1].type"));
    assert!(e.to_string().contains("required key is missing"), "{e}");
    let e = err(with_tiers(None, json!(["nvme"])));
    assert_eq!(e.context_value("key"), Some("secondary_tiers[0]"));
    err(with_tiers(None, json!([{"type": 3}])));
    err(with_tiers(None, json!([{"type": ""}])));
}

#[test]
fn tier_keys_split_into_common_and_params() {
    let c = ok(with_tiers(
        None,
        json!([{"type": "nvme", "locality": "remote", "module_path": "kvtier.vllm",
                "paths": ["/a", "/b"], "capacity_bytes": "1TiB", "fsync": true}]),
    ));
    let t = &c.secondary_tiers[0];
    assert_eq!(t.tier_type, "nvme");
    assert_eq!(t.key_path(), "secondary_tiers[0]");
    assert_eq!(t.locality, Some(Locality::Remote));
    let keys: Vec<&str> = t.params.keys().map(String::as_str).collect();
    assert_eq!(keys, ["capacity_bytes", "fsync", "module_path", "paths"]);
    assert_eq!(t.params["paths"], json!(["/a", "/b"]));
    let e = err(with_tiers(
        None,
        json!([{"type": "nvme", "locality": "EDGE"}]),
    ));
    assert_eq!(e.context_value("key"), Some("secondary_tiers[0].locality"));
    assert_eq!(e.context_value("found"), Some("\"EDGE\""));
}

// ---- vLLM-owned keys, wrapper, formats ----------------------------------------------------

#[test]
fn vllm_owned_keys_are_type_checked_and_noted() {
    let v = json!({"cpu_bytes_to_use": 4096, "spec_name": "TieringOffloadingSpec",
                   "tier_poll_interval_s": 0.001, "offload_prompt_only": true,
                   "self_describing_kv_events": false, "sync_load_budget_bytes": 0,
                   "max_tracker_size": 64000, "cache_policy_module_path": "m",
                   "spec_module_path": "m"});
    ok(v.clone());
    assert!(
        notes_of(v)
            .iter()
            .any(|n| n.contains("tier_poll_interval_s"))
    );
    let e = err(json!({"cpu_bytes_to_use": 4096, "offload_prompt_only": "yes"}));
    assert_eq!(e.context_value("key"), Some("offload_prompt_only"));
    let mut v = with_tiers(None, json!([{"type": "nvme"}]));
    v["spec_name"] = json!("CPUOffloadingSpec");
    let e = err(v);
    assert!(e.to_string().contains("TieringOffloadingSpec"), "{e}");
}

#[test]
fn kv_transfer_config_wrapper_is_accepted() {
    let v = json!({"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "engine_id": "e1",
                   "kv_buffer_device": "cuda", "kv_rank": 0,
                   "kv_connector_extra_config": {"cpu_bytes_to_use": 8192}});
    let c = ok(v);
    assert_eq!(c.cpu_bytes_to_use, 8192);
    assert_eq!(c.engine_id.as_deref(), Some("e1"));
    let e = err(json!({"kv_connector_extra_config": {"cpu_bytes_to_use": 8192, "blok_size": 1}}));
    assert_eq!(
        e.context_value("key"),
        Some("kv_connector_extra_config.blok_size")
    );
    let e = err(json!({"kv_connector": "NixlConnector", "kv_connector_extra_config": {}}));
    assert_eq!(e.context_value("key"), Some("kv_connector"));
    let e = err(json!({"kv_conector": "x", "kv_connector_extra_config": {}}));
    assert_eq!(e.context_value("did_you_mean"), Some("kv_connector"));
    let e = err(
        json!({"engine_id": "a", "kv_connector_extra_config": {"cpu_bytes_to_use": 1, "engine_id": "b"}}),
    );
    assert!(e.to_string().contains("differs"), "{e}");
}

#[test]
fn contract_example_parses() {
    // vllm-contract.md §10.6, verbatim.
    let text = r#"{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
 "kv_connector_extra_config": {
   "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 68719476736, "blocks_per_chunk": 4,
   "canonical_layout": true, "backpressure": {"backpressure_cls": "EMABackpressureDetector"},
   "secondary_tiers": [{"type": "KvtierSecondaryTier", "module_path": "kvtier.vllm", "locality": "LOCAL",
                        "backpressure": {"high_water_s": 0.010, "failure_threshold": 3},
                        "g3_paths": ["/mnt/nvme0/kvtier", "/mnt/nvme1/kvtier"], "o_direct": "require"}]}}"#;
    let c = config::from_json_str(text).unwrap();
    let t = &c.secondary_tiers[0];
    let bp = t.backpressure.as_ref().unwrap();
    assert_eq!(bp.failure_threshold, Some(3));
    assert_eq!(bp.low_water_s, Some(LOCAL_PRESET.low_water_s));
    assert_eq!(t.params.len(), 3, "g3_paths, o_direct, module_path");
}

const EQUIV_JSON: &str = r#"{
  "cpu_bytes_to_use": "2GiB", "blocks_per_chunk": 2, "eviction_policy": "arc",
  "engine_id": "e", "backpressure": {"backpressure_cls": "EMABackpressureDetector", "alpha": 0.25},
  "secondary_tiers": [
    {"type": "nvme", "paths": ["/mnt/a"], "capacity_bytes": "1TiB", "direct_io": "required",
     "backpressure": {"high_water_s": 0.02}},
    {"type": "custom", "locality": "REMOTE", "nested": {"x": [1, 2]}}
  ]
}"#;

const EQUIV_TOML: &str = r#"
cpu_bytes_to_use = "2GiB"
blocks_per_chunk = 2
eviction_policy = "arc"
engine_id = "e"

[backpressure]
backpressure_cls = "EMABackpressureDetector"
alpha = 0.25

[[secondary_tiers]]
type = "nvme"
paths = ["/mnt/a"]
capacity_bytes = "1TiB"
direct_io = "required"
backpressure = { high_water_s = 0.02 }

[[secondary_tiers]]
type = "custom"
locality = "REMOTE"
nested = { x = [1, 2] }
"#;

#[test]
fn toml_and_json_are_equivalent() {
    let j = config::from_json_str(EQUIV_JSON).unwrap();
    let t = config::from_toml_str(EQUIV_TOML).unwrap();
    assert_eq!(j, t);
    assert_eq!(config::parse_str(EQUIV_TOML, Format::Toml).unwrap(), j);
    let e = config::from_toml_str(&EQUIV_TOML.replace("alpha", "alhpa")).unwrap_err();
    assert_eq!(e.context_value("key"), Some("backpressure.alhpa"));
}

#[test]
fn load_reads_by_extension_and_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let json_path = dir.path().join("c.json");
    let toml_path = dir.path().join("c.toml");
    std::fs::write(&json_path, EQUIV_JSON).unwrap();
    std::fs::write(&toml_path, EQUIV_TOML).unwrap();
    assert_eq!(
        config::load(&json_path).unwrap(),
        config::load(&toml_path).unwrap()
    );

    std::fs::write(
        &json_path,
        r#"{"cpu_bytes_to_use": 1, "secondary_tiers": 3}"#,
    )
    .unwrap();
    let e = config::load(&json_path).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(
        e.to_string()
            .starts_with(&format!("{}: secondary_tiers", json_path.display())),
        "{e}"
    );

    let as_dir = dir.path().join("dir.json");
    std::fs::create_dir(&as_dir).unwrap();
    let e = config::load(&as_dir).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidPath, "{e}");
    assert!(e.to_string().contains("dir.json"), "{e}");
    let e = config::load(&dir.path().join("missing.toml")).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidPath, "{e}");
}

#[test]
fn tier_config_constructor_matches_parsed_defaults() {
    let c = ok(with_tiers(None, json!([{"type": "nvme"}])));
    assert_eq!(c.secondary_tiers[0], TierConfig::new(0, "nvme"));
}

// ---- the node service ---------------------------------------------------------------------

#[test]
fn the_service_section_is_read_with_its_defaults() {
    let c = ok(json!({"cpu_bytes_to_use": 4096,
                      "service": {"socket_path": "/run/kvtier/kvtier.sock"}}));
    let s = c.service.unwrap();
    assert_eq!(
        s.socket_path,
        std::path::PathBuf::from("/run/kvtier/kvtier.sock")
    );
    assert_eq!(s.socket_mode, 0o600);
    assert!(s.allowed_uids.is_empty());
    let c = ok(json!({"cpu_bytes_to_use": 4096,
                      "service": {"socket_path": "/s.sock", "socket_mode": "0660",
                                  "allowed_uids": [1000, 0]}}));
    let s = c.service.unwrap();
    assert_eq!((s.socket_mode, s.allowed_uids), (0o660, vec![1000, 0]));
    let example = config::load(std::path::Path::new("docs/examples/node-service.json")).unwrap();
    assert_eq!(example.service.unwrap().allowed_uids, vec![1000, 1001]);
}

#[test]
fn service_mistakes_name_the_key() {
    let cases = [
        (json!({"socket_mode": "0600"}), "service.socket_path"),
        (
            json!({"socket_path": "relative.sock"}),
            "service.socket_path",
        ),
        (
            json!({"socket_path": format!("/{}", "x".repeat(120))}),
            "service.socket_path",
        ),
        (
            json!({"socket_path": "/s.sock", "socket_mode": "0400"}),
            "service.socket_mode",
        ),
        (
            json!({"socket_path": "/s.sock", "socket_mode": "rw"}),
            "service.socket_mode",
        ),
        (
            json!({"socket_path": "/s.sock", "allowed_uids": [-1]}),
            "service.allowed_uids[0]",
        ),
        (
            json!({"socket_path": "/s.sock", "allowed_uid": [1]}),
            "service.allowed_uid",
        ),
        (json!("/s.sock"), "service"),
    ];
    for (service, key) in cases {
        let e = err(json!({"cpu_bytes_to_use": 4096, "service": service}));
        assert!(e.to_string().contains(key), "{key}: {e}");
    }
    let e =
        err(json!({"cpu_bytes_to_use": 4096, "service": {"socket_path": "/s", "allowed_uid": []}}));
    assert!(
        e.to_string().contains("allowed_uids"),
        "closest key suggested: {e}"
    );
}
