//! Exit codes and output edges of every command (issue 20 item 12): a path the user may not
//! read or write and a file with a bad magic under kvtier's name are the user's input (exit 2,
//! one line) the same way in every command; a stdout that cannot be written (`/dev/full`) is an
//! error with exit 1, not a panic or a silent 0; a `KVTIER_LOG` that names no level is said.

mod cli_common;

use std::fs::File;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use cli_common::{assert_exit_2_one_line, command, fio_installed, kvtier, stderr};

const LAYOUT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../layouts/llama-3.1-8b.toml");
const EXAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/examples/kvtier.json");

fn mode(p: &Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// A G3 tier formatted in `dir` (16 MiB).
fn format_tier(dir: &Path) {
    let out = kvtier(&[
        "tier",
        "format",
        dir.to_str().unwrap(),
        "--capacity",
        "16MiB",
        "--yes",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
}

fn nvme_config(dir: &Path, name: &str, tier: &Path) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(
        &p,
        format!(
            r#"{{"cpu_bytes_to_use": "8MiB", "secondary_tiers": [
                {{"type": "nvme", "paths": ["{}"], "capacity_bytes": "16MiB"}}]}}"#,
            tier.display()
        ),
    )
    .unwrap();
    mode(&p, 0o644);
    p
}

/// How to run kvtier without the right to a path: as `nobody` when this test runs as root
/// (root passes every permission check), else as this user (a mode of 0 stops it).
fn unprivileged(args: &[&str]) -> Command {
    let mut c = command(args);
    // SAFETY: geteuid has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } == 0 {
        c.uid(65534).gid(65534);
    }
    c
}

#[test]
fn permission_denied_is_the_users_input_in_every_command() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    mode(dir.path(), 0o755);
    let probe = unprivileged(&["version"]).output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        kvtier::skip_test!("cannot run kvtier as an unprivileged user here: {probe:?}");
        return;
    }
    // `closed`: nobody may enter; `readonly`: nobody may write; each holds a tier.
    let (closed, readonly) = (dir.path().join("closed"), dir.path().join("readonly"));
    for d in [&closed, &readonly] {
        std::fs::create_dir(d).unwrap();
        format_tier(d);
    }
    let layout = closed.join("layout.toml");
    std::fs::copy(LAYOUT, &layout).unwrap();
    let config = nvme_config(&closed, "kvtier.json", &readonly);
    let readonly_config = nvme_config(dir.path(), "readonly.json", &readonly);
    let empty = dir.path().join("empty-readonly");
    std::fs::create_dir(&empty).unwrap();
    for (d, m) in [(&closed, 0o000), (&readonly, 0o555), (&empty, 0o555)] {
        mode(d, m);
    }
    for f in std::fs::read_dir(&readonly).unwrap() {
        mode(&f.unwrap().path(), 0o444);
    }
    let (c, r, e) = (
        closed.to_str().unwrap(),
        readonly.to_str().unwrap(),
        empty.to_str().unwrap(),
    );
    let mut cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["tier", "inspect", c], c),
        (vec!["tier", "verify", c], c),
        (vec!["tier", "ls", c], c),
        (vec!["tier", "clear", r, "--yes"], r),
        (vec!["tier", "format", e, "--capacity", "16MiB", "--yes"], e),
        (
            vec!["layout", "show", layout.to_str().unwrap(), "--tp", "1"],
            "layout.toml",
        ),
        (
            vec!["config", "check", config.to_str().unwrap()],
            "kvtier.json",
        ),
        (vec!["bench", "--path", e, "--bytes", "4MiB"], e),
        (
            vec![
                "serve",
                "--config",
                readonly_config.to_str().unwrap(),
                "--metrics-addr",
                "127.0.0.1:0",
            ],
            r,
        ),
    ];
    if fio_installed() {
        cases.push((vec!["fio-compare", "--path", e, "--size", "4MiB"], e));
    }
    let mut wrong = Vec::new();
    for (args, needle) in &cases {
        let out = unprivileged(args).output().unwrap();
        let err = stderr(&out);
        let last = err.trim_end().lines().last().unwrap_or("");
        if out.status.code() != Some(2) || !last.contains(needle) || err.contains("panicked") {
            wrong.push(format!("{args:?}: exit {:?}: {err}", out.status.code()));
        }
    }
    for d in [&closed, &readonly, &empty] {
        mode(d, 0o755);
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn a_bad_magic_is_the_users_input_in_every_command() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let tier = dir.path().join("tier");
    std::fs::create_dir(&tier).unwrap();
    // Another file under the slab's name.
    std::fs::write(tier.join("kvtier-g3.slab"), vec![0x5a; 1 << 20]).unwrap();
    let t = tier.to_str().unwrap();
    for args in [
        vec!["tier", "inspect", t],
        vec!["tier", "verify", t],
        vec!["tier", "ls", t],
        vec!["tier", "clear", t, "--yes"],
    ] {
        let out = kvtier(&args);
        assert_exit_2_one_line(&out, "not a kvtier G3 slab (bad magic)");
    }
    let config = nvme_config(dir.path(), "kvtier.json", &tier);
    let out = kvtier(&[
        "serve",
        "--config",
        config.to_str().unwrap(),
        "--metrics-addr",
        "127.0.0.1:0",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("bad magic"), "{}", stderr(&out));
}

#[test]
fn a_full_stdout_is_an_error_with_exit_1_in_every_command() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    format_tier(dir.path());
    let d = dir.path().to_str().unwrap();
    for args in [
        vec!["version"],
        vec!["config", "check", EXAMPLE],
        vec!["layout", "show", LAYOUT, "--tp", "1"],
        vec!["layout", "show", LAYOUT, "--tp", "1", "--json"],
        vec!["tier", "inspect", d],
        vec!["tier", "ls", d, "--json"],
        vec!["tier", "verify", d],
    ] {
        let out: Output = command(&args)
            .stdout(File::create("/dev/full").unwrap())
            .output()
            .unwrap();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(
            err.trim_end(),
            "kvtier: error: cannot write to stdout: No space left on device (os error 28)",
            "{args:?}"
        );
    }
}

#[test]
fn a_kvtier_log_that_names_no_level_is_said() {
    let out = command(&["version"])
        .env("KVTIER_LOG", "bogus")
        .output()
        .unwrap();
    assert!(out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("kvtier: warning: KVTIER_LOG=\"bogus\" is not a level"),
        "{err}"
    );
    // Known levels, in any case, say nothing.
    let out = command(&["version"])
        .env("KVTIER_LOG", "WARN")
        .output()
        .unwrap();
    assert_eq!(stderr(&out), "");
}
