//! One validation for `kvtier config check` and `kvtier serve` (issue 20 item 11), one rule for
//! `max_bytes_in_flight` everywhere, and `serve` finding a busy port before it allocates the
//! region or creates slabs.

mod cli_common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use cli_common::{assert_exit_2_one_line, command, kvtier, stderr};

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// Runs `kvtier serve` on `config`; a serve still running after 20 s accepted the config
/// (it is stopped and `None` returned).
fn serve(config: &Path, extra: &[&str]) -> Option<Output> {
    let mut child = command(&["serve", "--config", config.to_str().unwrap()])
        .args(["--metrics-addr", "127.0.0.1:0"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if child.try_wait().unwrap().is_some() {
            return Some(child.wait_with_output().unwrap());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// Configs that `serve` cannot run (rows of the default model, Llama-3.1-8B at TP 1: 2 MiB),
/// and the key each error must name.
fn refused(dir: &Path) -> Vec<(&'static str, String, &'static str)> {
    let nvme = dir.join("nvme");
    let fs = dir.join("fs");
    std::fs::create_dir_all(&nvme).unwrap();
    std::fs::create_dir_all(&fs).unwrap();
    let (nvme, fs) = (nvme.display(), fs.display());
    vec![
        (
            "a tier type kvtier does not have",
            r#"{"cpu_bytes_to_use": "8MiB", "secondary_tiers": [{"type": "s3", "bucket": "b"}]}"#
                .to_string(),
            "secondary_tiers[0].type",
        ),
        (
            "an nvme tier of capacity 0",
            format!(
                r#"{{"cpu_bytes_to_use": "8MiB", "secondary_tiers": [
                    {{"type": "nvme", "paths": ["{nvme}"], "capacity_bytes": 0}}]}}"#
            ),
            "secondary_tiers[0].capacity_bytes",
        ),
        (
            "an nvme tier with less than one row in flight",
            format!(
                r#"{{"cpu_bytes_to_use": "8MiB", "secondary_tiers": [
                    {{"type": "nvme", "paths": ["{nvme}"], "capacity_bytes": "16MiB",
                      "max_bytes_in_flight": "1MiB"}}]}}"#
            ),
            "secondary_tiers[0].max_bytes_in_flight",
        ),
        (
            "an fs tier with less than one row in flight",
            format!(
                r#"{{"cpu_bytes_to_use": "8MiB", "secondary_tiers": [
                    {{"type": "fs", "root_dir": "{fs}", "capacity_bytes": "16MiB",
                      "max_bytes_in_flight": "1MiB"}}]}}"#
            ),
            "secondary_tiers[0].max_bytes_in_flight",
        ),
        (
            "an fs tier smaller than one row",
            format!(
                r#"{{"cpu_bytes_to_use": "8MiB", "secondary_tiers": [
                    {{"type": "fs", "root_dir": "{fs}", "capacity_bytes": "1MiB"}}]}}"#
            ),
            "secondary_tiers[0].capacity_bytes",
        ),
        (
            "a memory tier of no chunks",
            r#"{"cpu_bytes_to_use": "8MiB", "secondary_tiers": [
                {"type": "memory", "capacity_chunks": 0}]}"#
                .to_string(),
            "secondary_tiers[0].capacity_chunks",
        ),
        (
            "a primary smaller than one row",
            r#"{"cpu_bytes_to_use": "1MiB", "secondary_tiers": []}"#.to_string(),
            "cpu_bytes_to_use",
        ),
    ]
}

#[test]
fn config_check_refuses_what_serve_refuses_naming_the_same_key() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let mut wrong = Vec::new();
    for (i, (what, text, key)) in refused(dir.path()).into_iter().enumerate() {
        let cfg = write(dir.path(), &format!("c{i}.json"), &text);
        let check = kvtier(&["config", "check", cfg.to_str().unwrap()]);
        if check.status.code() != Some(2) || !stderr(&check).contains(key) {
            wrong.push(format!(
                "{what}: config check exit {:?}, {}",
                check.status.code(),
                stderr(&check).trim()
            ));
            continue;
        }
        assert_exit_2_one_line(&check, key);
        match serve(&cfg, &[]) {
            None => wrong.push(format!("{what}: serve ran it")),
            Some(out) => {
                assert_exit_2_one_line(&out, key);
                // The same words: one rule, one message.
                assert_eq!(stderr(&out), stderr(&check), "{what}");
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn max_bytes_in_flight_has_one_rule_for_every_way_in() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let nvme = dir.path().join("nvme");
    std::fs::create_dir_all(&nvme).unwrap();
    // Below one row (2 MiB): the key, the value and the row size in human units.
    let cfg = write(
        dir.path(),
        "low.json",
        &format!(
            r#"{{"cpu_bytes_to_use": "8MiB", "secondary_tiers": [
                {{"type": "nvme", "paths": ["{}"], "capacity_bytes": "16MiB",
                  "max_bytes_in_flight": 1048576}}]}}"#,
            nvme.display()
        ),
    );
    let out = kvtier(&["config", "check", cfg.to_str().unwrap()]);
    assert_exit_2_one_line(&out, "secondary_tiers[0].max_bytes_in_flight: 1 MiB");
    assert!(stderr(&out).contains("one row (2 MiB)"), "{}", stderr(&out));

    // The bench flag: the same rule, naming the flag and the key it sets.
    let out = kvtier(&["bench", "--max-bytes-in-flight", "1MiB", "--bytes", "4MiB"]);
    assert_exit_2_one_line(&out, "--max-bytes-in-flight");
    let err = stderr(&out);
    assert!(
        err.contains("max_bytes_in_flight") && err.contains("1 MiB") && err.contains("(2 MiB)"),
        "{err}"
    );
    // fio-compare sizes its depth by the same rule.
    let out = kvtier(&[
        "fio-compare",
        "--path",
        dir.path().to_str().unwrap(),
        "--row-size",
        "2MiB",
        "--max-bytes-in-flight",
        "1MiB",
    ]);
    assert_exit_2_one_line(&out, "--max-bytes-in-flight");

    // Rows above 64 MiB (64 blocks of Llama-3.1-8B: 128 MiB) and the key not set: the default
    // is one row, valid for config check; the bench plans with it as well.
    let cfg = write(
        dir.path(),
        "big.json",
        &format!(
            r#"{{"cpu_bytes_to_use": "256MiB", "blocks_per_chunk": 64, "secondary_tiers": [
                {{"type": "nvme", "paths": ["{}"], "capacity_bytes": "1GiB"}}]}}"#,
            nvme.display()
        ),
    );
    let out = kvtier(&["config", "check", cfg.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[test]
fn serve_finds_a_busy_port_before_it_allocates_or_creates_slabs() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let nvme = dir.path().join("nvme");
    std::fs::create_dir_all(&nvme).unwrap();
    let cfg = write(
        dir.path(),
        "kvtier.json",
        &format!(
            r#"{{"cpu_bytes_to_use": "64MiB", "secondary_tiers": [
                {{"type": "nvme", "paths": ["{}"], "capacity_bytes": "64MiB"}}]}}"#,
            nvme.display()
        ),
    );
    let busy = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let out = kvtier(&[
        "serve",
        "--config",
        cfg.to_str().unwrap(),
        "--metrics-addr",
        &addr,
    ]);
    assert_exit_2_one_line(&out, "--metrics-addr");
    assert!(stderr(&out).contains(&addr), "{}", stderr(&out));
    let created: Vec<_> = std::fs::read_dir(&nvme)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(
        created.is_empty(),
        "serve created {created:?} before it found the port busy"
    );
}
