//! Helpers shared by the `kvtier` CLI integration tests: run the binary, read what it printed,
//! check the user-error contract (exit 2, one line) and signal a child.
#![allow(dead_code)]

use std::process::{Child, Command, Output};

use serde_json::Value;

/// The `kvtier` binary with `args`, for a test that adds an environment or stdio.
pub fn command(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvtier"));
    c.args(args);
    c
}

/// Runs `kvtier` with `args` to completion.
pub fn kvtier(args: &[&str]) -> Output {
    command(args).output().expect("spawn kvtier")
}

/// Stderr as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Exit 0, or a failure showing stderr.
pub fn assert_success(o: &Output) {
    assert!(o.status.success(), "exit {:?}: {}", o.status, stderr(o));
}

/// Stdout of a successful run, parsed as JSON.
pub fn json(o: &Output) -> Value {
    assert_success(o);
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&o.stdout)))
}

/// Exit 2 and exactly one line on stderr, containing `needle`.
pub fn assert_exit_2_one_line(o: &Output, needle: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains(needle), "expected {needle:?} in {err}");
}

/// A user mistake: exit 2, nothing on stdout, and exactly one `kvtier: error:` line on stderr
/// containing `needle`.
pub fn assert_user_error(out: &Output, needle: &str) {
    let stderr = stderr(out);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert!(
        out.stdout.is_empty(),
        "stdout: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    assert!(stderr.starts_with("kvtier: error: "), "{stderr}");
    assert!(stderr.contains(needle), "{needle:?} not in {stderr}");
}

/// Whether a working `fio` is on `PATH`.
pub fn fio_installed() -> bool {
    Command::new("fio")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Sends `signal` to a child this test started.
pub fn send_signal(child: &Child, signal: libc::c_int) {
    // SAFETY: sending a signal to our own child process; no memory is involved.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, signal) };
    assert_eq!(rc, 0);
}

/// `GET path` of the HTTP endpoint at `addr`: the response's head and body.
pub fn get(addr: &str, path: &str) -> (String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    (head.to_string(), body.to_string())
}

/// Writes `kvtier.json` in `dir`: an 8 MiB primary and one 16 MiB `nvme` tier in `dir/tier`
/// (created), the smallest configuration `kvtier serve` runs. Returns the file's path.
pub fn write_config(dir: &std::path::Path) -> std::path::PathBuf {
    let tier = dir.join("tier");
    std::fs::create_dir_all(&tier).unwrap();
    let cfg = dir.join("kvtier.json");
    std::fs::write(
        &cfg,
        format!(
            r#"{{"cpu_bytes_to_use": "8MiB",
                "secondary_tiers": [{{"type": "nvme", "paths": ["{}"],
                                      "capacity_bytes": "16MiB"}}]}}"#,
            tier.display()
        ),
    )
    .unwrap();
    cfg
}

/// Starts `kvtier serve` with `args` (stdout and stderr piped) and reads the bound address
/// (`host:port`) from its first stdout line.
pub fn start_serve(args: &[&str]) -> (Child, String) {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let mut child = command(&["serve"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvtier serve");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped stdout"))
        .read_line(&mut line)
        .expect("read the first line of kvtier serve");
    let addr = line
        .trim()
        .strip_prefix("kvtier serve: listening on http://")
        .and_then(|s| s.strip_suffix("/metrics"))
        .map(str::to_string);
    match addr {
        Some(addr) => (child, addr),
        None => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("unexpected first line of kvtier serve: {line:?}")
        }
    }
}
