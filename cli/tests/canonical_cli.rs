//! `kvtier layout show` / `kvtier layout check` through the real binary.

use std::process::Command;

use kvtier::canonical::digest::vllm_digest_of_value;

fn kvtier(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("run kvtier")
}

#[test]
fn show_json_carries_both_digests_and_the_hashed_fields() {
    let out = kvtier(&[
        "layout",
        "show",
        "layouts/llama-3.1-8b.toml",
        "--tp",
        "2",
        "--rank",
        "1",
        "--canonical",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // Known answer from tests/canonical_digest.rs (computed with Python's json.dumps).
    assert_eq!(r["vllm_digest"], "81b5c61c1522");
    assert_eq!(
        vllm_digest_of_value(&r["vllm_digest_fields"]),
        "81b5c61c1522"
    );
    assert_eq!(r["vllm_digest_fields"]["canonical_format"], "v1-nhd");
    assert_eq!(r["namespace"].as_str().unwrap().len(), 64);
    assert_eq!(r["all_layers_portable"], true);
    assert_eq!(r["row_stride"], 2 * 1024 * 1024);
    let layers = r["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 32);
    assert_eq!(layers[0]["kind"], "certified");
    // TP 2, packed NHD: the rank's 4 heads (K|V) per token, one strided run.
    assert_eq!(layers[0]["runs"].as_array().unwrap().len(), 1);
}

#[test]
fn show_text_and_direct_mode() {
    let out = kvtier(&[
        "layout",
        "show",
        "layouts/qwen2.5-3b.toml",
        "--tp",
        "8",
        "--rank",
        "5",
        "--blocks-per-chunk",
        "4",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("TP 8 rank 5 (direct layout)"), "{text}");
    assert!(text.contains("portable    false"), "{text}");
    assert!(text.contains("vllm_digest "), "{text}");
    assert!(text.contains("namespace   "), "{text}");
}

#[test]
fn show_refuses_a_tp_the_model_does_not_allow() {
    let out = kvtier(&["layout", "show", "layouts/qwen2.5-7b.toml", "--tp", "8"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("does not divide its 28 attention heads"),
        "{err}"
    );
}

#[test]
fn check_accepts_the_shipped_layouts_and_names_a_broken_one() {
    let out = kvtier(&["layout", "check", "layouts"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let dir = tempfile::tempdir().unwrap();
    let good = std::fs::read_to_string(concat!(
        concat!(env!("CARGO_MANIFEST_DIR"), "/.."),
        "/layouts/mistral-7b.toml"
    ))
    .unwrap();
    std::fs::write(dir.path().join("good.toml"), &good).unwrap();
    std::fs::write(
        dir.path().join("bad.toml"),
        good.replace("head_dim = 128", "head_dim = 0"),
    )
    .unwrap();
    let out = kvtier(&["layout", "check", dir.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("FAIL") && text.contains("bad.toml") && text.contains("head_dim"),
        "{text}"
    );
    assert!(
        text.contains("ok    ") && text.contains("good.toml"),
        "{text}"
    );
}
