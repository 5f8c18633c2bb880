use super::*;
use crate::canonical::default_layout;
use crate::contract::job::{LookupResult, RequestContext};
use crate::key::ChunkKey;

fn region(rows: usize) -> Arc<PrimaryRegion> {
    Arc::new(PrimaryRegion::create(rows, 4096).unwrap())
}

#[test]
fn a_region_larger_than_available_memory_is_a_config_error() {
    let e = check_region_memory(64 << 30, Some(22 << 30)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    let s = e.to_string();
    assert!(
        s.contains("cpu_bytes_to_use") && s.contains("64 GiB"),
        "{s}"
    );
    assert!(check_region_memory(1 << 30, Some(22 << 30)).is_ok());
    assert!(check_region_memory(1 << 40, None).is_ok());
}

#[test]
fn a_single_tier_is_built_over_the_given_region_with_its_label() {
    let json = r#"{"cpu_bytes_to_use": 8192,
                   "secondary_tiers": [{"type": "memory"}, {"type": "memory", "capacity_chunks": 2}]}"#;
    let mut tier = Builder::from_json(json)
        .unwrap()
        .region(region(2))
        .build_tier(1)
        .unwrap();
    assert_eq!(tier.tier_type(), "memory");
    assert!(tier.ready());
    let req = RequestContext::new("r");
    assert_eq!(tier.lookup(&ChunkKey::new(b"k"), &req), LookupResult::Miss);
    tier.shutdown().unwrap();

    let e = Builder::from_json(json)
        .unwrap()
        .region(region(2))
        .build_tier(3)
        .err()
        .expect("no tier 3");
    assert_eq!(e.context_value("key"), Some("secondary_tiers[3]"));
}

#[test]
fn a_builder_needs_a_region_or_a_layout() {
    let e = Builder::new(KvtierConfig::new(8192)).build().err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.to_string().contains("Builder::layout"), "{e}");
}

#[test]
fn the_layout_sizes_the_region_and_refuses_a_region_of_another_row_size() {
    // Llama-3.1-8B: 2 MiB per block at TP 1, so 4 MiB hold two rows of one block each.
    let m = Builder::from_json(
        r#"{"cpu_bytes_to_use": "4MiB", "secondary_tiers": [{"type": "memory"}]}"#,
    )
    .unwrap()
    .layout(default_layout(), 1)
    .build()
    .unwrap();
    assert_eq!(m.region().row_stride(), 2 << 20);
    assert_eq!(m.region().num_rows(), 2);
    assert_eq!(m.num_tiers(), 1);
    let e = Builder::new(KvtierConfig::new(4 << 20))
        .layout(default_layout(), 1)
        .region(region(2))
        .build()
        .err()
        .unwrap();
    assert_eq!(e.kind(), ErrorKind::IncompatibleLayout);
    assert!(e.to_string().contains("2097152"), "{e}");
}

#[test]
fn vllms_entry_for_the_python_tier_is_an_nvme_tier() {
    let dir = tempfile::tempdir().unwrap();
    let entry = serde_json::json!({
        "cpu_bytes_to_use": 16384,
        "secondary_tiers": [{
            "type": "KvtierTier", "module_path": "kvtier.vllm", "locality": "LOCAL",
            "paths": [dir.path()], "capacity_bytes": "64KiB", "direct_io": "auto",
        }]
    });
    let mut tier = Builder::from_json(&entry.to_string())
        .unwrap()
        .region(region(4))
        .namespace([7; 32])
        .build_tier(0)
        .unwrap();
    assert_eq!(tier.tier_type(), "nvme");
    let info: std::collections::BTreeMap<_, _> = tier.config_info().into_iter().collect();
    assert_eq!(info["kvtier_namespace"], hex::encode([7u8; 32]));
    assert_eq!(info["kvtier_slots"], "16");
    tier.shutdown().unwrap();

    let mut bad = entry.clone();
    bad["secondary_tiers"][0]["capacity"] = serde_json::json!(1);
    let e = Builder::from_json(&bad.to_string())
        .unwrap()
        .region(region(4))
        .build_tier(0)
        .err()
        .unwrap();
    assert_eq!(e.context_value("key"), Some("secondary_tiers[0].capacity"));
}

#[test]
fn clear_tier_forgets_a_g3_tiers_chunks_and_refuses_other_types() {
    let dir = tempfile::tempdir().unwrap();
    let entry = serde_json::json!({
        "type": "nvme", "paths": [dir.path()], "capacity_bytes": "64KiB", "direct_io": "auto",
    });
    let config = crate::config::resolve_tier_entry(0, &entry).unwrap();
    let open = || {
        let tier = Builder::for_tier(config.clone())
            .region(region(4))
            .namespace([3; 32])
            .build_tier(0)
            .unwrap();
        let started = std::time::Instant::now();
        while !tier.ready() && started.elapsed() < std::time::Duration::from_secs(10) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        tier
    };
    let key = ChunkKey::new(b"page");
    let req = RequestContext::new("r");
    let mut tier = open();
    tier.submit_store(crate::contract::job::TransferJob {
        job_id: 1,
        keys: vec![key.clone()],
        chunk_ids: vec![0],
        is_promotion: false,
        req_id: req.req_id.clone(),
        submit_time: std::time::Instant::now(),
    });
    tier.drain_jobs();
    assert!(tier.get_finished_jobs().iter().all(|r| r.success));
    tier.shutdown().unwrap();
    drop(tier);

    let mut tier = open();
    assert_eq!(tier.lookup(&key, &req), LookupResult::Hit);
    // Refused while the tier holds its slabs.
    assert_eq!(clear_tier(&config).unwrap_err().kind(), ErrorKind::Locked);
    tier.shutdown().unwrap();
    drop(tier);

    clear_tier(&config).unwrap();
    let mut tier = open();
    assert_eq!(tier.lookup(&key, &req), LookupResult::Miss);
    tier.shutdown().unwrap();

    let e = clear_tier(&TierConfig::new(2, "memory")).unwrap_err();
    assert_eq!(e.context_value("key"), Some("secondary_tiers[2].type"));
}

/// `enable_kv_events` of an nvme entry, with vLLM 0.33's fs tier's meaning: the tier records
/// events only when the entry asks for them and the host records events too
/// ([`Builder::events`]); a value that is not a boolean names the key.
#[test]
fn an_nvme_tier_records_events_only_with_its_flag_and_the_hosts() {
    use crate::contract::job::TransferJob;
    for (tier_flag, host_flag) in [(false, false), (true, false), (false, true), (true, true)] {
        let dir = tempfile::tempdir().unwrap();
        let entry = serde_json::json!({
            "cpu_bytes_to_use": 16384,
            "secondary_tiers": [{
                "type": "nvme", "paths": [dir.path()], "capacity_bytes": "64KiB",
                "direct_io": "auto", "enable_kv_events": tier_flag,
            }]
        });
        let r = region(4);
        let mut tier = Builder::from_json(&entry.to_string())
            .unwrap()
            .region(r.clone())
            .namespace([7; 32])
            .events(host_flag)
            .build_tier(0)
            .unwrap();
        let k = ChunkKey::new(b"k");
        tier.submit_store(TransferJob {
            job_id: 1,
            keys: vec![k.clone()],
            chunk_ids: vec![0],
            is_promotion: false,
            req_id: "r".into(),
            submit_time: std::time::Instant::now(),
        });
        tier.drain_jobs();
        let done = tier.get_finished_jobs();
        assert!(done.len() == 1 && done[0].success, "{done:?}");
        let stored: Vec<ChunkKey> = tier
            .take_events()
            .into_iter()
            .filter(|e| !e.removed)
            .flat_map(|e| e.keys)
            .collect();
        let want = if tier_flag && host_flag {
            vec![k]
        } else {
            vec![]
        };
        assert_eq!(stored, want, "tier flag {tier_flag}, host flag {host_flag}");
        tier.shutdown().unwrap();
    }
    let bad = serde_json::json!({
        "cpu_bytes_to_use": 16384,
        "secondary_tiers": [{"type": "nvme", "paths": ["/x"], "capacity_bytes": "64KiB",
                             "enable_kv_events": "yes"}]
    });
    let e = Builder::from_json(&bad.to_string())
        .unwrap()
        .region(region(4))
        .build_tier(0)
        .err()
        .unwrap();
    assert_eq!(
        e.context_value("key"),
        Some("secondary_tiers[0].enable_kv_events")
    );
}
