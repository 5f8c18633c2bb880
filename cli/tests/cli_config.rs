//! `kvtier config check`: exit 0 with the resolved JSON for a valid file, exit 2 with one
//! line on stderr for an invalid or unreadable one.

mod cli_common;

use std::path::Path;
use std::process::Output;

use serde_json::Value;

use cli_common::{assert_user_error, json, kvtier};

fn check(path: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["config", "check", path.to_str().unwrap()];
    args.extend_from_slice(extra);
    kvtier(&args)
}

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

const VALID: &str = r#"{
  "cpu_bytes_to_use": "100MiB", "blocks_per_chunk": 2,
  "backpressure": {"backpressure_cls": "EMABackpressureDetector", "alpha": 0.2},
  "secondary_tiers": [
    {"type": "nvme", "paths": ["/mnt/a"], "capacity_bytes": "4GiB",
     "backpressure": {"high_water_s": 0.02}},
    {"type": "memory", "locality": "REMOTE"},
    {"type": "memory"}
  ]
}"#;

#[test]
fn valid_json_prints_resolved_config_with_merged_backpressure() {
    let dir = tempfile::tempdir().unwrap();
    let out = check(&write(dir.path(), "c.json", VALID), &[]);
    let v = json(&out);
    assert_eq!(v["valid"], true);
    assert_eq!(v["format"], "json");
    assert_eq!(v["config"]["cpu_bytes_to_use"], 100u64 << 20);
    assert_eq!(v["cpu_bytes_to_use_human"], "100 MiB");
    // Rows sized as serve sizes them: Llama-3.1-8B at TP 1, 2 MiB per block, 2 blocks.
    assert_eq!(v["rows_from"], "meta-llama/Llama-3.1-8B-Instruct at --tp 1");
    assert_eq!(v["geometry"]["row_stride"], 4u64 << 20);
    assert_eq!(v["geometry"]["num_chunks"], 25);
    let tiers = &v["config"]["secondary_tiers"];
    // Tier 0: tier value wins, top-level alpha inherited, LOCAL low mark, nvme failure threshold.
    assert_eq!(tiers[0]["backpressure"]["high_water_s"], 0.02);
    assert_eq!(tiers[0]["backpressure"]["low_water_s"], 0.002);
    assert_eq!(tiers[0]["backpressure"]["alpha"], 0.2);
    assert_eq!(tiers[0]["backpressure"]["failure_threshold"], 3);
    assert_eq!(tiers[0]["params"]["paths"][0], "/mnt/a");
    // Tier 1: top level only, NETWORK preset.
    assert_eq!(tiers[1]["backpressure"]["high_water_s"], 0.05);
    assert_eq!(tiers[1]["backpressure"]["low_water_s"], 0.01);
    assert_eq!(tiers[1]["locality"], "REMOTE");
    // Tier 2: top level only, LOCAL preset, no failure threshold.
    assert_eq!(tiers[2]["backpressure"]["high_water_s"], 0.01);
    assert_eq!(tiers[2]["backpressure"]["failure_threshold"], Value::Null);
}

#[test]
fn geometry_is_printed_when_layout_inputs_are_given() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "c.json", VALID);
    let out = check(&p, &["--bytes-per-block", "512", "--copies", "2"]);
    let v = json(&out);
    let g = &v["geometry"];
    // vllm-contract.md §4.1 worked example.
    assert_eq!(g["row_stride"], 4096);
    assert_eq!(g["page_size_per_worker"], 1024);
    assert_eq!(g["num_chunks"], 25_600);
    assert_eq!(g["padding"], 2048);

    // A pool too small for one row is a user error.
    let out = check(&p, &["--bytes-per-block", "64MiB"]);
    assert_user_error(&out, "holds no chunk");
}

#[test]
fn toml_is_accepted_and_block_size_needs_gpu_block_size() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(
        dir.path(),
        "c.toml",
        "cpu_bytes_to_use = \"1GiB\"\nblock_size = 64\n[[secondary_tiers]]\ntype = \"nvme\"\n\
         paths = [\"/mnt/a\"]\ncapacity_bytes = \"4GiB\"\n",
    );
    let out = check(&p, &[]);
    let v = json(&out);
    assert_eq!(v["format"], "toml");
    assert_eq!(v["config"]["chunk"]["block_size_tokens"], 64);
    assert_eq!(
        v["config"]["secondary_tiers"][0]["backpressure"],
        Value::Null
    );

    assert_user_error(&check(&p, &["--bytes-per-block", "2MiB"]), "GPU block size");
    let v = json(&check(
        &p,
        &["--bytes-per-block", "2MiB", "--gpu-block-size", "16"],
    ));
    assert_eq!(v["geometry"]["blocks_per_chunk"], 4);
    assert_eq!(v["geometry"]["row_stride"], 8u64 << 20);
}

#[test]
fn invalid_configs_exit_2_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    for (name, text, needle) in [
        (
            "typo.json",
            r#"{"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "nvme"}, {"type": "nvme", "backpresure": {}}]}"#,
            "secondary_tiers[1].backpresure: unknown key",
        ),
        (
            "store.json",
            r#"{"cpu_bytes_to_use": 1, "store_threshold": 3}"#,
            "not supported with tiering",
        ),
        ("syntax.json", r#"{"cpu_bytes_to_use": 1,"#, "invalid JSON"),
        ("syntax.toml", "cpu_bytes_to_use = = 1\n", "invalid TOML"),
        (
            "marks.toml",
            "cpu_bytes_to_use = 4096\n[[secondary_tiers]]\ntype = \"memory\"\nlocality = \"REMOTE\"\nbackpressure = { backpressure_cls = \"EMABackpressureDetector\", low_water_s = 0.2 }\n",
            "low_water_s must be <= high_water_s",
        ),
    ] {
        let p = write(dir.path(), name, text);
        let out = check(&p, &[]);
        assert_user_error(&out, needle);
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(name),
            "names the file"
        );
    }
}

#[test]
fn unreadable_or_unnamed_files_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    assert_user_error(
        &check(&dir.path().join("missing.json"), &[]),
        "missing.json",
    );
    let as_dir = dir.path().join("dir.json");
    std::fs::create_dir(&as_dir).unwrap();
    assert_user_error(&check(&as_dir, &[]), "cannot read configuration file");
    let p = write(dir.path(), "c.yaml", "cpu_bytes_to_use: 1\n");
    assert_user_error(&check(&p, &[]), ".json or .toml");
}

#[test]
fn bad_arguments_exit_2() {
    let out = kvtier(&["config", "check"]);
    assert_eq!(out.status.code(), Some(2));
    let out = kvtier(&["config", "check", "x.json", "--bytes-per-block", "lots"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a byte size"));
}

#[test]
fn documented_examples_are_valid_and_equivalent() {
    let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let mut configs = Vec::new();
    for name in ["kvtier.json", "kvtier.toml"] {
        let out = check(
            &root.join("docs/examples").join(name),
            &["--bytes-per-block", "2MiB"],
        );
        let v = json(&out);
        assert_eq!(v["geometry"]["num_chunks"], 8192);
        configs.push(v["config"].clone());
    }
    assert_eq!(configs[0], configs[1]);
    let bp = &configs[0]["secondary_tiers"][0]["backpressure"];
    assert_eq!(bp["low_water_s"], 0.002);
    assert_eq!(bp["failure_threshold"], 3);

    // The JSON shown in docs/configuration.md is the example file.
    let doc = std::fs::read_to_string(root.join("docs/configuration.md")).unwrap();
    let example = doc.split("## Example").nth(1).expect("an Example section");
    let block = example
        .split("```json")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("a json block");
    let file = std::fs::read_to_string(root.join("docs/examples/kvtier.json")).unwrap();
    let doc_value: Value = serde_json::from_str(block).unwrap();
    let file_value: Value = serde_json::from_str(&file).unwrap();
    assert_eq!(doc_value, file_value);
}

#[test]
fn nvme_tier_keys_are_validated_by_the_g3_parser_and_unknown_types_refused() {
    let dir = tempfile::tempdir().unwrap();
    let good = r#"{"cpu_bytes_to_use": "1GiB", "secondary_tiers": [
        {"type": "nvme", "paths": ["/mnt/a"], "capacity_bytes": "8GiB"}, {"type": "memory"}]}"#;
    let out = check(&write(dir.path(), "good.json", good), &[]);
    let v = json(&out);
    assert_eq!(v["tier_params"][0]["validated"], true);
    assert_eq!(v["tier_params"][1]["validated"], true);
    // A type kvtier cannot build is refused, as serve refuses it.
    let custom = good.replace(r#"{"type": "memory"}"#, r#"{"type": "custom", "x": 1}"#);
    let out = check(&write(dir.path(), "custom.json", &custom), &[]);
    assert_user_error(
        &out,
        "secondary_tiers[1].type: unknown secondary tier type \"custom\"",
    );

    let typo = good.replace("capacity_bytes", "capacity_byte");
    let out = check(&write(dir.path(), "typo.json", &typo), &[]);
    assert_user_error(&out, "secondary_tiers[0].capacity_byte");
    assert!(String::from_utf8_lossy(&out.stderr).contains("typo.json"));
}

#[test]
fn one_config_holds_an_nvme_and_an_fs_tier_each_checked_by_its_parser() {
    let dir = tempfile::tempdir().unwrap();
    let good = r#"{"cpu_bytes_to_use": "1GiB", "secondary_tiers": [
        {"type": "nvme", "paths": ["/mnt/a"], "capacity_bytes": "8GiB"},
        {"type": "fs", "locality": "REMOTE", "root_dir": "/shared/kv", "capacity_bytes": "1TiB"}]}"#;
    let out = check(&write(dir.path(), "good.json", good), &[]);
    let v = json(&out);
    assert_eq!(v["tier_params"][1]["validated"], true);
    assert_eq!(
        v["tier_params"][1]["by"],
        "kvtier's fs tier rules, for rows of 2 MiB"
    );
    let bad = good.replace("\"root_dir\"", "\"rootdir\"");
    let out = check(&write(dir.path(), "bad.json", &bad), &[]);
    assert_user_error(&out, "secondary_tiers[1].rootdir");
}

/// Issue 20 item 4: a huge `checkpoint_interval_s` panicked `config check` (1e300) or was
/// accepted (1e19, which then overflowed the worker's deadline arithmetic). Out of range is a
/// user error naming the key path; the largest accepted value still checks.
#[test]
fn checkpoint_interval_out_of_range_is_a_key_path_error() {
    let dir = tempfile::tempdir().unwrap();
    let with = |v: &str| {
        format!(
            r#"{{"cpu_bytes_to_use": "1GiB", "secondary_tiers": [{{"type": "nvme",
            "paths": ["/mnt/a"], "capacity_bytes": "8GiB", "checkpoint_interval_s": {v}}}]}}"#
        )
    };
    for (i, v) in ["1e300", "1e19", "31536001", "-1"].iter().enumerate() {
        let out = check(&write(dir.path(), &format!("iv{i}.json"), &with(v)), &[]);
        assert_user_error(&out, "secondary_tiers[0].checkpoint_interval_s: expected");
    }
    for (i, v) in ["31536000", "0", "0.5"].iter().enumerate() {
        let out = check(&write(dir.path(), &format!("ok{i}.json"), &with(v)), &[]);
        assert_eq!(json(&out)["valid"], true, "{v}");
    }
}
