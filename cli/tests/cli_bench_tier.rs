//! `kvtier bench` and `kvtier tier ...` end to end: the bench JSON schema on a small run, the
//! kept tier inspected, listed and verified, a flipped byte in a slab found by `tier verify`,
//! and the user-error exits.

mod cli_common;

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};

use serde_json::Value;

use cli_common::{assert_exit_2_one_line, command, json, kvtier, stderr};

/// A 64 MiB bench (32 rows of 2 MiB, 16 MiB in flight) on a tier made in `parent`, as JSON.
fn small_bench(parent: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "bench",
        "--bytes",
        "64MiB",
        "--max-bytes-in-flight",
        "16MiB",
        "--path",
        parent.to_str().unwrap(),
        "--json",
    ];
    args.extend_from_slice(extra);
    kvtier(&args)
}

fn run_bench_kept(parent: &Path) -> (Value, PathBuf) {
    let v = json(&small_bench(parent, &["--keep"]));
    let dir = PathBuf::from(v["tier"]["paths"][0].as_str().unwrap());
    (v, dir)
}

#[test]
fn bench_json_schema_and_every_chunk_verified() {
    let parent = tempfile::tempdir_in("/tmp").unwrap();
    let v = json(&small_bench(parent.path(), &["--idle-linger-ms", "0"]));
    assert_eq!(v["ok"], true);
    assert_eq!(v["chunks"], 32);
    assert_eq!(v["chunks_verified"], 32);
    assert_eq!(v["chunks_mismatched"], 0);
    assert_eq!(v["chunks_missing"], 0);
    let layout = &v["layout"];
    assert_eq!(layout["model"], "meta-llama/Llama-3.1-8B-Instruct");
    assert_eq!(layout["tp"], 1);
    assert_eq!(layout["blocks_per_chunk"], 1);
    assert_eq!(layout["tokens_per_chunk"], 16);
    assert_eq!(layout["row_stride"], 2 << 20);
    assert_eq!(layout["namespace"].as_str().unwrap().len(), 64);
    let tier = &v["tier"];
    assert_eq!(tier["capacity_bytes"], 64 << 20);
    assert_eq!(tier["max_bytes_in_flight"], 16 << 20);
    assert_eq!(tier["kept"], false);
    assert!(!tier["io_engine"].as_str().unwrap().is_empty());
    assert!(
        tier["direct_io"].as_str().unwrap().contains("direct"),
        "{tier}"
    );
    for phase in ["store", "load"] {
        let p = &v[phase];
        assert_eq!(p["bytes"], 64 << 20, "{phase}");
        let secs = p["seconds"].as_f64().unwrap();
        assert!(secs > 0.0);
        let gbps = p["gb_per_s"].as_f64().unwrap();
        assert!((gbps - (64u64 << 20) as f64 / secs / 1e9).abs() < 1e-9 * gbps.max(1.0));
        let chunks_per_job = p["chunks_per_job"].as_u64().unwrap();
        assert_eq!(p["jobs"].as_u64().unwrap(), 32u64.div_ceil(chunks_per_job));
        let p50 = p["job_latency_p50_ms"].as_f64().unwrap();
        let p99 = p["job_latency_p99_ms"].as_f64().unwrap();
        assert!(p50 > 0.0 && p99 >= p50, "{p}");
        assert!(p["cpu_seconds"].as_f64().unwrap() >= 0.0);
        assert!(p["cpu_seconds_per_gb"].is_number());
    }
    // Not kept: the tier directory is gone.
    assert_eq!(std::fs::read_dir(parent.path()).unwrap().count(), 0);
}

/// Qwen2.5-3B at TP 4: vLLM's row (1152 KiB) is twice the canonical area the G3 slots hold;
/// every chunk still verifies (the bench compares what the tier keeps: the row's prefix).
#[test]
fn replicated_gqa_rows_store_their_canonical_prefix_and_verify() {
    let parent = tempfile::tempdir_in("/tmp").unwrap();
    let layout = concat!(env!("CARGO_MANIFEST_DIR"), "/../layouts/qwen2.5-3b.toml");
    let v = json(&kvtier(&[
        "bench",
        "--bytes",
        "8MiB",
        "--layout",
        layout,
        "--tp",
        "4",
        "--path",
        parent.path().to_str().unwrap(),
        "--json",
    ]));
    assert_eq!(v["ok"], true);
    assert_eq!(v["layout"]["row_stride"], 2 * 589_824);
    assert_eq!(v["chunks_verified"], v["chunks"]);
    assert_eq!(v["chunks_mismatched"], 0);
}

#[test]
fn a_wrong_byte_fails_the_bench_with_exit_1() {
    let parent = tempfile::tempdir_in("/tmp").unwrap();
    let out = command(&[
        "bench",
        "--bytes",
        "16MiB",
        "--max-bytes-in-flight",
        "8MiB",
        "--path",
        parent.path().to_str().unwrap(),
        "--json",
    ])
    .env("KVTIER_BENCH_CORRUPT_CHUNK", "5")
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["ok"], false);
    assert_eq!(v["chunks_verified"], 7);
    assert_eq!(v["chunks_mismatched"], 1);
    assert_eq!(v["chunks_missing"], 0);
    assert!(
        stderr(&out).contains("1 of 8 chunks did not load back intact"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn kept_tier_is_inspected_listed_verified_and_a_flipped_byte_is_found() {
    let parent = tempfile::tempdir_in("/tmp").unwrap();
    let (bench, dir) = run_bench_kept(parent.path());
    assert_eq!(bench["tier"]["kept"], true);
    let d = dir.to_str().unwrap();

    let inspect = json(&kvtier(&["tier", "inspect", d, "--json"]));
    assert_eq!(inspect["entries"], 32);
    assert_eq!(inspect["used_slots"], 32);
    assert_eq!(inspect["total_slots"], 32);
    assert_eq!(inspect["files"][0]["superblock"]["row_stride"], 2 << 20);
    assert_eq!(
        inspect["files"][0]["superblock"]["namespace"],
        bench["layout"]["namespace"]
    );
    assert!(inspect["journal_bytes"].as_u64().unwrap() > 0);
    assert!(inspect["checkpoint_bytes"].is_u64());
    let text = kvtier(&["tier", "inspect", d]);
    assert!(text.status.success());
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("32 used") && text.contains("namespace:"),
        "{text}"
    );

    let ls = kvtier(&["tier", "ls", d]);
    assert!(ls.status.success());
    let keys: Vec<String> = String::from_utf8_lossy(&ls.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(keys.len(), 32);
    assert!(keys.iter().all(|k| k.len() == 72 && hex::decode(k).is_ok()));

    let ok = json(&kvtier(&["tier", "verify", d, "--json"]));
    assert_eq!(ok["checked"], 32);
    assert_eq!(ok["ok"], 32);

    // Flip one byte inside the first data slot (after the 4096-byte superblock).
    let listed = json(&kvtier(&["tier", "ls", d, "--json"]));
    let slab = dir.join("kvtier-g3.slab");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&slab)
        .unwrap();
    let at = 4096 + 12345;
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= 0x01;
    f.write_all_at(&b, at).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let slot0 = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["slot"] == 0)
        .expect("a key in slot 0")["key"]
        .as_str()
        .unwrap()
        .to_string();

    let bad = kvtier(&["tier", "verify", d]);
    assert_eq!(bad.status.code(), Some(1), "{}", stderr(&bad));
    let out = String::from_utf8_lossy(&bad.stdout);
    assert!(out.contains("31 ok, 1 bad"), "{out}");
    assert!(out.contains(&slot0), "the bad key is listed: {out}");
    assert!(stderr(&bad).contains("1 of 32"), "{}", stderr(&bad));

    let clear = kvtier(&["tier", "clear", d, "--yes"]);
    assert!(clear.status.success(), "{}", stderr(&clear));
    let after = json(&kvtier(&["tier", "inspect", d, "--json"]));
    assert_eq!(after["entries"], 0);
    assert_eq!(after["free_slots"], 32);
}

#[test]
fn tier_format_then_inspect_and_refusals() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir(&a).unwrap();
    std::fs::create_dir(&b).unwrap();
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    let f = json(&kvtier(&[
        "tier",
        "format",
        a,
        b,
        "--capacity",
        "16MiB",
        "--blocks-per-chunk",
        "2",
        "--json",
    ]));
    assert_eq!(f["total_slots"], 4);
    assert_eq!(f["files"][1]["superblock"]["row_stride"], 4 << 20);
    assert_eq!(f["files"][1]["superblock"]["path_index"], 1);

    // Reformatting without --yes on a non-interactive stdin is refused; nothing changes.
    let again = command(&["tier", "format", a, b, "--capacity", "16MiB"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_exit_2_one_line(&again, "--yes");
    let clear = command(&["tier", "clear", a, b])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_exit_2_one_line(&clear, "--yes");

    // Paths in the wrong order: the message names the right order (a user error).
    assert_exit_2_one_line(&kvtier(&["tier", "inspect", b, a]), "another order");
    assert_exit_2_one_line(
        &kvtier(&["tier", "verify", "/nonexistent/kvtier"]),
        "/nonexistent/kvtier",
    );
    assert_exit_2_one_line(
        &kvtier(&["tier", "ls", dir.path().to_str().unwrap()]),
        "kvtier-g3.slab",
    );
    let out = kvtier(&["tier", "inspect"]);
    assert_eq!(out.status.code(), Some(2));
    let out = kvtier(&["tier", "format", a, "--capacity", "lots"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn bench_user_mistakes_exit_2_with_one_line() {
    assert_exit_2_one_line(
        &kvtier(&["bench", "--path", "/nonexistent/kvtier"]),
        "/nonexistent/kvtier",
    );
    assert_exit_2_one_line(
        &kvtier(&["bench", "--bytes", "64MiB", "--capacity", "8MiB"]),
        "--capacity",
    );
    assert_exit_2_one_line(&kvtier(&["bench", "--tp", "3"]), "TP size 3");
    assert_exit_2_one_line(
        &kvtier(&["bench", "--layout", "/nonexistent/model.toml"]),
        "/nonexistent/model.toml",
    );
    let out = kvtier(&["bench", "--io-engine", "spdk"]);
    assert_eq!(out.status.code(), Some(2));
    let out = kvtier(&["bench", "--bogus"]);
    assert_eq!(out.status.code(), Some(2));
    let out = kvtier(&["frobnicate"]);
    assert_eq!(out.status.code(), Some(2));
}

/// `kvtier bench --tier fs`: kvtier's fs tier and vLLM's approach (and fio where installed) in
/// one run on one directory, every chunk of both verified, the sides' fresh directories
/// removed afterwards; one-line exit-2 errors for options that do not fit.
#[test]
fn bench_fs_tier_beside_vllms_approach() {
    let parent = tempfile::tempdir_in("/tmp").unwrap();
    let p = parent.path().to_str().unwrap();
    let fio = std::process::Command::new("fio")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    let mut args = vec![
        "bench", "--tier", "fs", "--path", p, "--bytes", "16MiB", "--rounds", "2", "--json",
    ];
    if fio {
        args.push("--fio");
    } else {
        kvtier::skip_test!("fio is not installed: the fio side of the fs bench is not run");
    }
    let out = kvtier(&args);
    let v = json(&out);
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["chunks"], 8);
    let sides = v["sides"].as_array().unwrap();
    assert_eq!(sides.len(), if fio { 3 } else { 2 });
    for s in sides {
        let rounds = s["rounds"].as_array().unwrap();
        assert_eq!(rounds.len(), 2, "{s}");
        for r in rounds {
            assert!(r["store_bytes_per_sec"].as_f64().unwrap() > 0.0, "{s}");
            assert!(r["load_files_per_sec"].as_f64().unwrap() > 0.0, "{s}");
            let want = if s["side"] == "fio" { 0 } else { 8 };
            assert_eq!(r["chunks_verified"], want, "{s}: fio checks nothing");
        }
    }
    assert_eq!(sides[0]["side"], "kvtier");
    assert_eq!(sides[1]["side"], "vllm");
    assert_eq!(
        std::fs::read_dir(parent.path()).unwrap().count(),
        0,
        "every side's directory is removed"
    );
    assert_exit_2_one_line(
        &kvtier(&["bench", "--tier", "fs", "--path", p, "--path", "/tmp"]),
        "--tier fs takes one directory",
    );
    assert_exit_2_one_line(&kvtier(&["bench", "--fio"]), "--tier fs only");
    assert_exit_2_one_line(
        &kvtier(&["bench", "--tier", "fs", "--path", p, "--rounds", "0"]),
        "--rounds",
    );
}

/// Issue 20 item 6: two `kvtier tier format` of one directory at once. Each round, at least one
/// succeeds, any other is refused as locked (never an O_DIRECT or missing-file diagnosis), and
/// a whole tier is left behind.
#[test]
fn two_formats_of_one_directory_do_not_race() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let d = dir.path().to_str().unwrap();
    let bin = env!("CARGO_BIN_EXE_kvtier");
    for round in 0..6 {
        let spawn = || {
            std::process::Command::new(bin)
                .args(["tier", "format", d, "--capacity", "16MiB", "--yes"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        };
        let (a, b) = (spawn(), spawn());
        let outs = [a.wait_with_output().unwrap(), b.wait_with_output().unwrap()];
        let ok = outs.iter().filter(|o| o.status.success()).count();
        assert!(
            ok >= 1,
            "round {round}: both formats failed: {:?}",
            outs.iter().map(stderr).collect::<Vec<_>>()
        );
        for o in outs.iter().filter(|o| !o.status.success()) {
            let e = stderr(o);
            assert!(
                e.contains("being changed by another kvtier process")
                    || e.contains("locked by another process"),
                "round {round}: {e}"
            );
        }
        let inspect = kvtier(&["tier", "inspect", d, "--json"]);
        assert!(
            inspect.status.success(),
            "round {round}: {}",
            stderr(&inspect)
        );
        let v: serde_json::Value = serde_json::from_slice(&inspect.stdout).unwrap();
        assert!(
            v["total_slots"].as_u64().is_some_and(|n| n > 0),
            "round {round}: {v}"
        );
    }
}
