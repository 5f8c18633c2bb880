//! What a new user reads (issue 20 item 13): sizes in human units, the flag and the config key
//! both named where they differ, counts with their singular ("1 chunk"), the temp directory
//! named when `bench` writes there, and a progress bar for `tier verify` on a terminal.

mod cli_common;

use std::path::{Path, PathBuf};
use std::process::Command;

use cli_common::{assert_exit_2_one_line, assert_success, command, json, kvtier, stderr};

/// Runs `kvtier bench` (8 chunks of 2 MiB) in `dir` with `--keep`; the tier it leaves.
fn kept_bench_tier(dir: &Path) -> String {
    let v = json(&kvtier(&[
        "bench",
        "--bytes",
        "16MiB",
        "--keep",
        "--json",
        "--path",
        dir.to_str().unwrap(),
    ]));
    v["tier"]["paths"][0].as_str().unwrap().to_string()
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn sizes_are_human_and_flags_name_the_keys_they_set() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let d = dir.path().to_str().unwrap();
    // Rows of the default model are 2 MiB.
    let small = write(dir.path(), "small.json", r#"{"cpu_bytes_to_use": "1MiB"}"#);
    let out = kvtier(&["config", "check", small.to_str().unwrap()]);
    assert_exit_2_one_line(&out, "cpu_bytes_to_use (1 MiB) holds no chunk of 2 MiB");
    let tier = write(
        dir.path(),
        "tier.json",
        &format!(
            r#"{{"cpu_bytes_to_use": "8MiB", "secondary_tiers": [{{"type": "nvme",
                "paths": ["{d}"], "capacity_bytes": "1MiB"}}]}}"#
        ),
    );
    let out = kvtier(&["config", "check", tier.to_str().unwrap()]);
    assert_exit_2_one_line(
        &out,
        "secondary_tiers[0].capacity_bytes: 1 MiB holds no slot of 2 MiB on each of 1 path",
    );
    let journal = write(
        dir.path(),
        "journal.json",
        &format!(
            r#"{{"cpu_bytes_to_use": "8MiB", "secondary_tiers": [{{"type": "nvme",
                "paths": ["{d}"], "capacity_bytes": "16MiB", "checkpoint_journal_bytes": "1GiB",
                "max_journal_bytes": "512MiB"}}]}}"#
        ),
    );
    let out = kvtier(&["config", "check", journal.to_str().unwrap()]);
    assert_exit_2_one_line(&out, "64 KiB (1 GiB), found 512 MiB");

    // The flag, and the key whose rule it broke.
    let out = kvtier(&["tier", "format", d, "--capacity", "1MiB", "--yes"]);
    assert_exit_2_one_line(
        &out,
        "--capacity (capacity_bytes): 1 MiB holds no slot of 2 MiB on each of 1 path",
    );
    let layout = concat!(env!("CARGO_MANIFEST_DIR"), "/../layouts/llama-3.1-8b.toml");
    let out = kvtier(&[
        "layout",
        "show",
        layout,
        "--tp",
        "1",
        "--blocks-per-chunk",
        "0",
    ]);
    assert_exit_2_one_line(&out, "--blocks-per-chunk (blocks_per_chunk): must be > 0");
    // Counts agree with their nouns.
    let out = kvtier(&[
        "bench",
        "--capacity",
        "3MiB",
        "--bytes",
        "8MiB",
        "--path",
        d,
    ]);
    assert_exit_2_one_line(
        &out,
        "3 MiB holds 1 row of 2 MiB over 1 path, but --bytes needs 4",
    );
}

#[test]
fn bench_says_one_chunk_and_names_the_temp_dir_it_writes_in() {
    let tmp = tempfile::tempdir_in("/tmp").unwrap();
    let out = command(&["bench", "--bytes", "2MiB"])
        .env("TMPDIR", tmp.path())
        .output()
        .unwrap();
    assert_success(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("kvtier bench: 1 chunk of 2 MiB"), "{text}");
    let err = stderr(&out);
    assert!(
        err.contains(&format!(
            "kvtier bench: writing 2 MiB of slabs in {}/kvtier-bench-",
            tmp.path().display()
        )) && err.contains("the system temp dir")
            && err.contains("removed at the end"),
        "{err}"
    );
    // Not when the user chose the directory.
    let out = kvtier(&[
        "bench",
        "--bytes",
        "2MiB",
        "--path",
        tmp.path().to_str().unwrap(),
    ]);
    assert_success(&out);
    assert!(!stderr(&out).contains("temp dir"), "{}", stderr(&out));
}

#[test]
fn tier_verify_shows_a_progress_bar_on_a_terminal_only() {
    let script = Command::new("script").arg("--version").output();
    if !script.is_ok_and(|o| o.status.success()) {
        kvtier::skip_test!("no `script` (util-linux) to give kvtier a terminal");
        return;
    }
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let tier = kept_bench_tier(dir.path());
    // On a terminal (`script` runs it on a pseudo-terminal): the bar, then the summary.
    let bin = env!("CARGO_BIN_EXE_kvtier");
    let tty = Command::new("script")
        .args(["-qec", &format!("{bin} tier verify {tier}"), "/dev/null"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&tty.stdout);
    assert!(tty.status.success(), "{text}");
    assert!(text.contains("verify [") && text.contains("/8"), "{text}");
    assert!(
        text.contains("checked 8 stored chunks: 8 ok, 0 bad"),
        "{text}"
    );
    // Piped: no bar.
    let piped = kvtier(&["tier", "verify", &tier]);
    assert_success(&piped);
    assert_eq!(stderr(&piped), "");
}

/// Issue 20 item 7: `tier verify` said "failed their CRC check" for slots it could not read,
/// and `tier inspect` refused a truncated slab. Now inspect lists it as TRUNCATED (exit 0),
/// and verify labels each bad slot and says how many could not be read.
#[test]
fn tier_verify_tells_read_errors_apart_and_inspect_flags_a_truncated_slab() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let tier = kept_bench_tier(dir.path());
    let info: serde_json::Value =
        serde_json::from_slice(&kvtier(&["tier", "inspect", &tier, "--json"]).stdout).unwrap();
    let stride = info["files"][0]["superblock"]["row_stride"]
        .as_u64()
        .unwrap();
    let slab = Path::new(&tier).join(kvtier::g3::slab::SLAB_FILE_NAME);
    let f = std::fs::OpenOptions::new().write(true).open(&slab).unwrap();
    f.set_len(f.metadata().unwrap().len() - stride).unwrap();
    drop(f);

    let inspect = kvtier(&["tier", "inspect", &tier]);
    assert_success(&inspect);
    let text = String::from_utf8_lossy(&inspect.stdout);
    assert!(text.contains("TRUNCATED"), "{text}");
    assert!(
        text.contains("warning:") && text.contains("truncated"),
        "{text}"
    );

    let verify = kvtier(&["tier", "verify", &tier]);
    assert_eq!(verify.status.code(), Some(1), "{}", stderr(&verify));
    let text = String::from_utf8_lossy(&verify.stdout);
    assert!(
        text.contains("7 ok, 1 bad (0 failed the CRC check, 1 could not be read)"),
        "{text}"
    );
    assert!(
        text.contains("read error") && text.contains("past the end"),
        "{text}"
    );
    let err = stderr(&verify);
    assert!(
        err.contains("1 of 8 stored chunks could not be read"),
        "{err}"
    );
    assert!(
        !err.contains("CRC"),
        "a read error is not a CRC failure: {err}"
    );
}
