//! `kvtier serve` as the node service, end to end through the binary: an engine connects to
//! the configured socket (mode 0600), stores and loads through it, `kvtier service status`
//! lists it, `/metrics` counts its jobs, and SIGTERM stops the service and removes the socket.

mod cli_common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use cli_common::{assert_success, get, kvtier, send_signal, start_serve};
use kvtier::node::{ClientHello, NodeClient};
use kvtier::{ChunkKey, LookupResult, PrimaryRegion};

fn wait_for(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn serve_with_a_service_section_shares_its_tier_over_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let tier = dir.path().join("tier");
    std::fs::create_dir(&tier).unwrap();
    let socket = dir.path().join("kvtier.sock");
    let cfg = dir.path().join("kvtier.json");
    std::fs::write(
        &cfg,
        format!(
            r#"{{"cpu_bytes_to_use": "8MiB",
                "service": {{"socket_path": "{}"}},
                "secondary_tiers": [{{"type": "nvme", "paths": ["{}"],
                                      "capacity_bytes": "16MiB", "direct_io": "auto"}}]}}"#,
            socket.display(),
            tier.display()
        ),
    )
    .unwrap();
    let cfg_s = cfg.display().to_string();
    let (mut child, addr) = start_serve(&["--config", &cfg_s, "--metrics-addr", "127.0.0.1:0"]);
    wait_for(&socket);
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);

    // An observer learns the service's digest and row stride; an engine presents them.
    let service = NodeClient::observe(&socket).unwrap().service().clone();
    let stride = service.row_stride as usize;
    let client = NodeClient::connect(
        &socket,
        &ClientHello {
            engine: "cli-test".into(),
            row_stride: service.row_stride,
            digest: service.digest,
        },
    )
    .unwrap();
    let region = PrimaryRegion::create(4, stride as u64).unwrap();
    client.register_fd(region.fd().unwrap(), 4).unwrap();
    for row in 0..2 {
        // No job is running; this test is the region's only user.
        let mut r = region.write_row(row).unwrap();
        for (i, b) in r.iter_mut().enumerate() {
            *b = (i * 7 + row * 13) as u8;
        }
    }
    let keys = vec![ChunkKey::new(b"cli-0"), ChunkKey::new(b"cli-1")];
    client.submit_store(1, keys.clone(), vec![0, 1]);
    let r = client.wait_finished(Duration::from_secs(60)).unwrap();
    assert!(r.success, "{:?}", r.error);
    assert_eq!(
        client.lookup(&keys).unwrap(),
        vec![LookupResult::Hit, LookupResult::Hit]
    );
    client.submit_load(2, keys.clone(), vec![2, 3]);
    let r = client.wait_finished(Duration::from_secs(60)).unwrap();
    assert!(r.success, "{:?}", r.error);
    // The load is done; this test is the region's only user.
    assert!(region.read_row(2).unwrap()[..] == region.read_row(0).unwrap()[..]);
    assert!(region.read_row(3).unwrap()[..] == region.read_row(1).unwrap()[..]);

    let socket_s = socket.display().to_string();
    let out = kvtier(&["service", "status", "--socket", &socket_s]);
    assert_success(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("1 engine connected:"), "{text}");
    assert!(text.contains("cli-test"), "{text}");
    assert!(text.contains("1 stores, 1 loads, 0 failed"), "{text}");
    assert!(text.contains("% in 2 MiB pages"), "{text}");

    // A job naming a row outside the region is refused: a failed job and an error.
    client.submit_load(3, vec![keys[0].clone()], vec![99]);
    let r = client.wait_finished(Duration::from_secs(60)).unwrap();
    assert!(!r.success);
    let (_, metrics) = get(&addr, "/metrics");
    let value = |series: &str| -> f64 {
        let line = metrics
            .lines()
            .find(|l| l.rsplit_once(' ').is_some_and(|(name, _)| name == series))
            .unwrap_or_else(|| panic!("{series} in\n{metrics}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let e = "engine=\"cli-test\"";
    let stored = (2 * stride) as f64;
    for (series, want) in [
        (
            format!("kvtier:node_engine_jobs_total{{{e},op=\"store\"}}"),
            1.0,
        ),
        (
            format!("kvtier:node_engine_jobs_total{{{e},op=\"load\"}}"),
            1.0,
        ),
        (
            format!("kvtier:node_engine_bytes_total{{{e},op=\"store\"}}"),
            stored,
        ),
        (
            format!("kvtier:node_engine_bytes_total{{{e},op=\"load\"}}"),
            stored,
        ),
        (format!("kvtier:node_engine_failed_jobs_total{{{e}}}"), 1.0),
        (format!("kvtier:node_engine_errors_total{{{e}}}"), 1.0),
        (format!("kvtier:node_engine_connections{{{e}}}"), 1.0),
        ("kvtier:node_engines_connected".to_string(), 1.0),
    ] {
        assert_eq!(value(&series), want, "{series}");
    }
    // The engine's region as the service maps it; the tier's gauge is that share.
    let engine_share = value("kvtier:node_engine_region_huge_pages{engine=\"cli-test\"}");
    assert!((0.0..=1.0).contains(&engine_share));
    assert_eq!(
        value("kvtier:g3_region_huge_pages{tier=\"1:nvme\"}"),
        engine_share
    );
    assert!(metrics.contains("# TYPE kvtier:node_engine_errors_total counter"));
    let (head, health) = get(&addr, "/healthz");
    assert!(head.contains(" 200 "), "{head}\n{health}");
    assert_eq!(health, "ok\n");

    drop(client);
    send_signal(&child, libc::SIGTERM);
    let status = child.wait().unwrap();
    assert!(status.success(), "serve exited {status:?}");
    assert!(!socket.exists(), "the socket file is removed at shutdown");
}

#[test]
fn service_status_without_a_service_is_a_user_error() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("none.sock").display().to_string();
    let out = kvtier(&["service", "status", "--socket", &socket]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("connect to the kvtier node service at") && err.contains("none.sock"),
        "{err}"
    );
}

/// `kvtier serve --namespace HEX --slot-bytes SIZE` (SGLang ranks, `docs/sglang.md`): the
/// service presents exactly the given digest and slot size; an engine presenting another
/// digest is refused; slabs written under another namespace are refused at the next start,
/// and a malformed digest or a configuration without a service section are user errors.
#[test]
fn serve_with_a_given_namespace_and_slot_size() {
    let dir = tempfile::tempdir().unwrap();
    let tier = dir.path().join("tier");
    std::fs::create_dir(&tier).unwrap();
    let socket = dir.path().join("kvtier.sock");
    let cfg = dir.path().join("kvtier.json");
    let body = |service: bool| {
        format!(
            r#"{{"cpu_bytes_to_use": "8MiB", {}
                "secondary_tiers": [{{"type": "nvme", "paths": ["{}"],
                                      "capacity_bytes": "4MiB", "direct_io": "auto"}}]}}"#,
            if service {
                format!(r#""service": {{"socket_path": "{}"}},"#, socket.display())
            } else {
                String::new()
            },
            tier.display()
        )
    };
    std::fs::write(&cfg, body(true)).unwrap();
    let cfg_s = cfg.display().to_string();
    let ns_a = "a1".repeat(32);
    let (mut child, _addr) = start_serve(&[
        "--config",
        &cfg_s,
        "--metrics-addr",
        "127.0.0.1:0",
        "--namespace",
        &ns_a,
        "--slot-bytes",
        "16KiB",
    ]);
    wait_for(&socket);
    let service = NodeClient::observe(&socket).unwrap().service().clone();
    assert_eq!(hex::encode(service.digest), ns_a);
    assert_eq!(service.row_stride, 16384);
    let other = NodeClient::connect(
        &socket,
        &ClientHello {
            engine: "other".into(),
            row_stride: 16384,
            digest: [0xb2; 32],
        },
    );
    let err = other.expect_err("another digest is refused").to_string();
    assert!(err.contains(&ns_a), "{err}");
    send_signal(&child, libc::SIGTERM);
    assert!(child.wait().unwrap().success());

    // The slabs now carry namespace A: B is refused, naming both.
    let ns_b = "b2".repeat(32);
    let args = |ns: &str| {
        vec![
            "serve".to_string(),
            "--config".into(),
            cfg_s.clone(),
            "--metrics-addr".into(),
            "127.0.0.1:0".into(),
            "--namespace".into(),
            ns.to_string(),
            "--slot-bytes".into(),
            "16384".into(),
        ]
    };
    let run = |a: Vec<String>| {
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        kvtier(&a)
    };
    let out = run(args(&ns_b));
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&ns_a) && err.contains(&ns_b) && err.contains("--namespace"),
        "{err}"
    );
    let out = run(args("xyz"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code() == Some(2) && err.contains("--namespace") && err.contains("64 hex"),
        "{err}"
    );
    std::fs::write(&cfg, body(false)).unwrap();
    let out = run(args(&ns_a));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code() == Some(2) && err.contains("service section"),
        "{err}"
    );
}
