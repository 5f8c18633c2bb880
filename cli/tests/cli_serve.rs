//! `kvtier serve` end to end: the endpoint answers /metrics with vLLM's metric names and
//! /healthz, holds the tier's lock while running, and SIGTERM drains, checkpoints and exits 0.
//! Also the user-error exits: unreadable config, bad address, layout mismatch.

mod cli_common;

use std::io::Read;
use std::net::TcpStream;
use std::process::Child;
use std::time::{Duration, Instant};

use cli_common::{
    assert_exit_2_one_line, assert_success, get, kvtier, send_signal, start_serve, write_config,
};

fn wait_with_timeout(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("kvtier serve did not exit within {limit:?} of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls `/healthz` for up to 20 s until `done(head, body)`; returns the last answer.
fn wait_for_health(addr: &str, done: impl Fn(&str, &str) -> bool) -> (String, String) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (head, body) = get(addr, "/healthz");
        if done(&head, &body) || Instant::now() > deadline {
            return (head, body);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `kvtier serve --config CFG` opens its tier (`/healthz` answers 200) and exits 0 on SIGTERM.
fn assert_serves_healthy(cfg: &str) {
    let (mut child, addr) = start_serve(&["--config", cfg, "--metrics-addr", "127.0.0.1:0"]);
    let (head, _) = get(&addr, "/healthz");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    send_signal(&child, libc::SIGTERM);
    assert!(wait_with_timeout(&mut child, Duration::from_secs(60)).success());
}

fn stop(child: &mut Child) -> (Option<i32>, String) {
    send_signal(child, libc::SIGTERM);
    let status = wait_with_timeout(child, Duration::from_secs(60));
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    (status.code(), err)
}

/// Issue 21 item 7: `/healthz` and the metrics come from the tier's state. A tier whose index
/// cannot be recovered (its checkpoint is a directory) makes `/healthz` answer 503 with the
/// reason, `g3_recovered` 0, and `serve` exit non-zero.
#[test]
fn a_tier_that_cannot_recover_is_unhealthy() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let cfg = write_config(dir.path());
    let tier = dir.path().join("tier");
    let (mut child, addr) = start_serve(&[
        "--config",
        cfg.to_str().unwrap(),
        "--metrics-addr",
        "127.0.0.1:0",
    ]);
    wait_for_health(&addr, |h, _| h.starts_with("HTTP/1.1 200"));
    assert_eq!(stop(&mut child).0, Some(0));
    let ckpt = tier.join("kvtier-g3.checkpoint");
    std::fs::remove_file(&ckpt).unwrap();
    std::fs::create_dir(&ckpt).unwrap();
    let (mut child, addr) = start_serve(&[
        "--config",
        cfg.to_str().unwrap(),
        "--metrics-addr",
        "127.0.0.1:0",
    ]);
    let (head, body) = wait_for_health(&addr, |h, _| !h.starts_with("HTTP/1.1 200"));
    let (_, metrics) = get(&addr, "/metrics");
    let (code, err) = stop(&mut child);
    assert!(
        head.starts_with("HTTP/1.1 503"),
        "a tier that serves nothing is healthy: {head} {body}"
    );
    assert!(
        body.contains("1:nvme") && body.contains("recovery failed"),
        "{body}"
    );
    assert!(
        metrics.contains("kvtier:g3_recovered{tier=\"1:nvme\"} 0"),
        "{}",
        metrics
            .lines()
            .filter(|l| l.contains("g3_recovered"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(code, Some(1), "{err}");
}

/// Issue 21 item 7: `serve` exits non-zero when its final checkpoint fails (the checkpoint's
/// temp file cannot be created).
#[test]
fn a_failed_final_checkpoint_fails_serve() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let cfg = write_config(dir.path());
    let tier = dir.path().join("tier");
    let (mut child, addr) = start_serve(&[
        "--config",
        cfg.to_str().unwrap(),
        "--metrics-addr",
        "127.0.0.1:0",
    ]);
    wait_for_health(&addr, |h, b| h.starts_with("HTTP/1.1 200") && b == "ok\n");
    // (`kvtier-g3.tmp` was the temp name before issue 21.)
    for name in ["kvtier-g3.checkpoint.tmp", "kvtier-g3.tmp"] {
        std::fs::create_dir(tier.join(name)).unwrap();
    }
    let (code, err) = stop(&mut child);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("checkpoint"), "{err}");
}

/// vLLM 0.33.0's tiering metric names (contract doc section 9.1).
const VLLM_TIERING_METRICS: [&str; 19] = [
    "kv_offload_tiering_lookup_sync_delay_seconds",
    "kv_offload_tiering_lookup_async_delay_seconds",
    "kv_offload_tiering_read_bytes",
    "kv_offload_tiering_read_time",
    "kv_offload_tiering_write_bytes",
    "kv_offload_tiering_write_time",
    "kv_offload_tiering_promotion_job_failures",
    "kv_offload_tiering_cascade_job_failures",
    "kv_offload_tiering_chunk_queries",
    "kv_offload_tiering_chunk_hits",
    "kv_offload_tiering_primary_write_usage_perc",
    "kv_offload_tiering_primary_read_usage_perc",
    "kv_offload_tiering_promotion_allocation_failures",
    "kv_offload_tiering_active_promotion_jobs",
    "kv_offload_tiering_active_cascade_jobs",
    "kv_offload_tiering_backpressure_store_latency_ema",
    "kv_offload_tiering_backpressure_stores_dropped",
    "kv_offload_tiering_backpressure_blocks_dropped",
    "kv_offload_tiering_promotion_latency_seconds",
];

#[test]
fn serves_vllm_metrics_and_stops_cleanly_on_sigterm() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let cfg = write_config(dir.path());
    let (mut child, addr) = start_serve(&[
        "--config",
        cfg.to_str().unwrap(),
        "--metrics-addr",
        "127.0.0.1:0",
        "--metrics-prefix",
        "vllm:",
    ]);
    assert!(addr.starts_with("127.0.0.1:"), "{addr}");

    let (head, body) = get(&addr, "/metrics");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    for name in VLLM_TIERING_METRICS {
        // (A counter's metadata lines carry its sample name, `_total` included.)
        assert!(
            body.contains(&format!("# TYPE vllm:{name} "))
                || body.contains(&format!("# TYPE vllm:{name}_total counter")),
            "missing vllm:{name} in\n{body}"
        );
    }
    assert!(body.contains("tier=\"0:primary\""), "{body}");
    assert!(body.contains("tier=\"1:nvme\""), "{body}");
    // (The tier recovers its index in the background: "ok" once that is done.)
    let (head, body) = wait_for_health(&addr, |h, b| h.starts_with("HTTP/1.1 200") && b == "ok\n");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(body, "ok\n");
    assert!(get(&addr, "/nope").0.starts_with("HTTP/1.1 404"));

    // While serve runs it holds the slab lock: offline verify is refused, naming the holder.
    let tier = dir.path().join("tier");
    let locked = kvtier(&["tier", "verify", tier.to_str().unwrap()]);
    assert_eq!(locked.status.code(), Some(2));
    let err = String::from_utf8_lossy(&locked.stderr);
    assert!(
        err.contains("locked") && err.contains(&child.id().to_string()),
        "{err}"
    );
    // The holder's pid is said once, not again as a context pair.
    assert!(!err.contains("(pid: "), "{err}");

    send_signal(&child, libc::SIGTERM);
    let status = wait_with_timeout(&mut child, Duration::from_secs(60));
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert_eq!(status.code(), Some(0), "{err}");
    assert!(
        err.contains("SIGTERM received") && err.contains("stopped cleanly"),
        "{err}"
    );
    assert!(
        TcpStream::connect(&addr).is_err(),
        "still listening after exit"
    );

    // The checkpoint was written and the lock released.
    assert!(tier.join("kvtier-g3.checkpoint").exists());
    let inspect = kvtier(&["tier", "inspect", tier.to_str().unwrap(), "--json"]);
    assert!(inspect.status.success());
    let v: serde_json::Value = serde_json::from_slice(&inspect.stdout).unwrap();
    assert!(v["files"][0]["locked_by"].is_null(), "{v}");
}

#[test]
fn user_mistakes_exit_2_with_one_line() {
    assert_exit_2_one_line(
        &kvtier(&["serve", "--config", "/nonexistent/kvtier.json"]),
        "/nonexistent/kvtier.json",
    );
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let bad = dir.path().join("bad.json");
    std::fs::write(
        &bad,
        r#"{"cpu_bytes_to_use": "8MiB", "secondary_tierz": []}"#,
    )
    .unwrap();
    assert_exit_2_one_line(
        &kvtier(&["serve", "--config", bad.to_str().unwrap()]),
        "secondary_tierz",
    );

    let cfg = write_config(dir.path());
    let cfg = cfg.to_str().unwrap();
    assert_exit_2_one_line(
        &kvtier(&["serve", "--config", cfg, "--metrics-addr", "not an address"]),
        "--metrics-addr",
    );
    // A tier formatted for one model refuses another model's layout.
    let layout = concat!(env!("CARGO_MANIFEST_DIR"), "/../layouts/mistral-7b.toml");
    let tier = dir.path().join("tier");
    let fmt = format_16mib(tier.to_str().unwrap(), &["--yes"]);
    assert_success(&fmt);
    assert_exit_2_one_line(
        &kvtier(&[
            "serve",
            "--config",
            cfg,
            "--layout",
            layout,
            "--metrics-addr",
            "127.0.0.1:0",
        ]),
        "namespace",
    );
}

/// `kvtier tier format PATH --capacity SIZE --for in-process` and then `kvtier serve` (in
/// process) with a config that leaves `canonical_layout` at its default must agree on the
/// namespace; a `--canonical` tier is refused by that config with one line saying what to
/// format instead.
#[test]
fn a_formatted_tier_is_served_by_the_default_config() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let cfg = write_config(dir.path());
    let cfg = cfg.to_str().unwrap();
    let tier = dir.path().join("tier");
    let tier = tier.to_str().unwrap();
    let fmt = format_16mib(tier, &["--yes", "--for", "in-process"]);
    assert_success(&fmt);

    assert_serves_healthy(cfg);

    let fmt = format_16mib(tier, &["--yes", "--canonical", "--for", "in-process"]);
    assert_success(&fmt);
    let out = kvtier(&["serve", "--config", cfg, "--metrics-addr", "127.0.0.1:0"]);
    assert_exit_2_one_line(&out, "canonical_layout = false");
    assert!(String::from_utf8_lossy(&out.stderr).contains("kvtier tier format"));
}

/// `kvtier tier format TIER --capacity 16MiB` with `extra` arguments after them.
fn format_16mib(tier: &str, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["tier", "format", tier, "--capacity", "16MiB"];
    args.extend_from_slice(extra);
    kvtier(&args)
}

/// The `kvtier tier format` command a refusal names (between backticks), without `kvtier`.
fn format_command_in(message: &str) -> Vec<String> {
    let start = message
        .find("`kvtier tier format ")
        .unwrap_or_else(|| panic!("no format command in: {message}"));
    let rest = &message[start + 1..];
    let command = &rest[..rest.find('`').expect("the command's closing backtick")];
    command
        .split_whitespace()
        .skip(1)
        .map(String::from)
        .collect()
}

/// `kvtier tier format` writes the namespace vLLM engines and the node service present by
/// default (`--for vllm`): the in-process `kvtier serve` refuses that tier, and its refusal
/// names the exact command that formats one it opens (paths, capacity, layout, TP, blocks
/// per chunk, `--for in-process`), which works.
#[test]
fn in_process_serve_refuses_a_tier_formatted_for_vllm_naming_the_command_that_works() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let cfg = write_config(dir.path());
    let cfg = cfg.to_str().unwrap();
    let tier = dir.path().join("tier");
    let tier = tier.to_str().unwrap();
    let out = format_16mib(tier, &["--yes", "--json"]);
    assert_success(&out);
    let formatted: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(formatted["namespace_for"], "vllm");
    let out = kvtier(&["serve", "--config", cfg, "--metrics-addr", "127.0.0.1:0"]);
    assert_exit_2_one_line(&out, "--for in-process");
    let message = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        message.contains("the tier was formatted for vLLM engines and the node service"),
        "{message}"
    );
    let mut command = format_command_in(&message);
    assert!(command.iter().any(|w| w == tier), "{message}");
    assert!(
        command.windows(2).any(|w| w == ["--capacity", "16777216"]),
        "{message}"
    );
    command.push("--yes".into());
    let command: Vec<&str> = command.iter().map(String::as_str).collect();
    assert_success(&kvtier(&command));
    assert_serves_healthy(cfg);
}

/// `--layout` takes a shipped layout's name as the vLLM tier entry's `layout` key does.
#[test]
fn layout_takes_a_shipped_name() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let tier = dir.path().join("tier");
    std::fs::create_dir(&tier).unwrap();
    let tier = tier.to_str().unwrap();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../layouts/qwen2.5-3b.toml");
    let namespace = |layout: &str| {
        let out = format_16mib(
            tier,
            &[
                "--yes",
                "--json",
                "--layout",
                layout,
                "--tp",
                "4",
                "--canonical",
            ],
        );
        assert_success(&out);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["files"][0]["superblock"]["namespace"].clone()
    };
    assert_eq!(namespace("qwen2.5-3b"), namespace(path));
    let out = format_16mib(tier, &["--layout", "qwen9"]);
    assert_ne!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stderr).contains("qwen9"));
}
