//! Messages that could cost data (issue 28 item 10): a refusal says what fixes it, and
//! advises a format (which discards the stored chunks) only where nothing else does; a
//! permission problem says which permission, not "not writable" or "holds no G3 tier".

mod cli_common;
#[path = "../../tests/g3_common/mod.rs"]
mod g3_common;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use cli_common::{assert_exit_2_one_line, assert_success, command, kvtier, stderr};

/// What serve appended to every layout refusal before: the advice to discard the tier.
const FORMAT_ADVICE: &str = "format the tier to match";

/// A serve config of one nvme tier on `paths` with `capacity`.
fn serve_config(dir: &Path, name: &str, paths: &[&Path], capacity: &str) -> PathBuf {
    let list: Vec<String> = paths
        .iter()
        .map(|p| format!("\"{}\"", p.display()))
        .collect();
    let cfg = dir.join(name);
    std::fs::write(
        &cfg,
        format!(
            r#"{{"cpu_bytes_to_use": "8MiB",
                "secondary_tiers": [{{"type": "nvme", "paths": [{}],
                                      "capacity_bytes": "{capacity}"}}]}}"#,
            list.join(", ")
        ),
    )
    .unwrap();
    cfg
}

/// `kvtier tier format PATHS --capacity 16MiB --for in-process --yes` (what the in-process
/// `kvtier serve` opens).
fn format(paths: &[&Path]) {
    let mut args = vec!["tier", "format"];
    args.extend(paths.iter().map(|p| p.to_str().unwrap()));
    args.extend(["--capacity", "16MiB", "--for", "in-process", "--yes"]);
    assert_success(&kvtier(&args));
}

fn dirs(root: &Path, names: &[&str]) -> Vec<PathBuf> {
    names
        .iter()
        .map(|n| {
            let d = root.join(n);
            std::fs::create_dir(&d).unwrap();
            d
        })
        .collect()
}

/// `kvtier serve --config CFG`, which must refuse at once (exit 2, one line); its message.
fn serve_refusal(cfg: &Path) -> String {
    let out = kvtier(&[
        "serve",
        "--config",
        cfg.to_str().unwrap(),
        "--metrics-addr",
        "127.0.0.1:0",
    ]);
    assert_exit_2_one_line(&out, "kvtier");
    stderr(&out)
}

#[test]
fn stripe_paths_in_another_order_are_not_advised_a_format() {
    let root = tempfile::tempdir_in("/tmp").unwrap();
    let d = dirs(root.path(), &["a", "b"]);
    format(&[&d[0], &d[1]]);
    let cfg = serve_config(root.path(), "swapped.json", &[&d[1], &d[0]], "16MiB");
    let m = serve_refusal(&cfg);
    assert!(m.contains("nothing is wrong with the files"), "{m}");
    assert!(
        m.contains(&format!(
            "list them as [{}, {}]",
            d[0].display(),
            d[1].display()
        )),
        "{m}"
    );
    assert!(!m.contains(FORMAT_ADVICE) && !m.contains("discard"), "{m}");
}

#[test]
fn a_member_of_another_set_is_not_advised_a_format() {
    let root = tempfile::tempdir_in("/tmp").unwrap();
    let d = dirs(root.path(), &["a", "b"]);
    format(&[&d[0]]);
    format(&[&d[1]]);
    let cfg = serve_config(root.path(), "mixed.json", &[&d[0], &d[1]], "16MiB");
    let m = serve_refusal(&cfg);
    assert!(m.contains("stripe set"), "{m}");
    assert!(m.contains("Nothing is wrong with the files"), "{m}");
    assert!(m.contains("kvtier tier inspect"), "{m}");
    assert!(!m.contains(FORMAT_ADVICE) && !m.contains("discard"), "{m}");
}

#[test]
fn a_slab_of_a_newer_kvtier_is_not_advised_a_format() {
    let root = tempfile::tempdir_in("/tmp").unwrap();
    let d = dirs(root.path(), &["a"]);
    format(&[&d[0]]);
    // Superblock version 3 (`docs/format.md`: u32 LE at offset 8, CRC-32 of bytes 0..4092 at
    // 4092), as a newer kvtier would write it.
    let slab = d[0].join("kvtier-g3.slab");
    g3_common::rewrite_superblock(&slab, |sb| sb[8..12].copy_from_slice(&3u32.to_le_bytes()));
    let cfg = serve_config(root.path(), "newer.json", &[&d[0]], "16MiB");
    let m = serve_refusal(&cfg);
    assert!(m.contains("written by a newer kvtier"), "{m}");
    assert!(m.contains("open it with that kvtier or a newer one"), "{m}");
    assert!(!m.contains(FORMAT_ADVICE) && !m.contains("discard"), "{m}");
}

#[test]
fn another_capacity_is_advised_the_capacity_it_was_formatted_with() {
    let root = tempfile::tempdir_in("/tmp").unwrap();
    let d = dirs(root.path(), &["a"]);
    format(&[&d[0]]);
    let cfg = serve_config(root.path(), "bigger.json", &[&d[0]], "32MiB");
    let m = serve_refusal(&cfg);
    assert!(m.contains("set capacity_bytes back to 16777216"), "{m}");
    assert!(!m.contains(FORMAT_ADVICE), "{m}");
}

/// `kvtier ARGS` as `nobody` when this test runs as root (root passes every permission check:
/// CAP_DAC_OVERRIDE), else as this user; `None` (with the reason printed) when that cannot run.
fn unprivileged(args: &[&str]) -> Option<Command> {
    let mut c = command(args);
    if rustix::process::geteuid().is_root() {
        c.uid(65534).gid(65534);
    }
    let mut probe = command(&["version"]);
    if rustix::process::geteuid().is_root() {
        probe.uid(65534).gid(65534);
    }
    match probe.output() {
        Ok(o) if o.status.success() => Some(c),
        other => {
            kvtier::skip_test!("cannot run kvtier as an unprivileged user here: {other:?}");
            None
        }
    }
}

fn chmod(p: &Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn a_directory_that_cannot_be_read_is_not_called_empty() {
    let root = tempfile::tempdir_in("/tmp").unwrap();
    chmod(root.path(), 0o755);
    let d = dirs(root.path(), &["closed"]);
    format(&[&d[0]]);
    chmod(&d[0], 0o000);
    let dir = d[0].to_str().unwrap();
    let Some(mut c) = unprivileged(&["tier", "inspect", dir]) else {
        chmod(&d[0], 0o755);
        return;
    };
    let out = c.output().unwrap();
    chmod(&d[0], 0o755);
    let m = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{m}");
    assert!(m.contains(dir) && m.contains("cannot be read"), "{m}");
    assert!(m.contains("mode 000"), "{m}");
    assert!(!m.contains("holds no G3 tier"), "{m}");
}

#[test]
fn an_index_file_that_cannot_be_read_is_not_called_an_unwritable_directory() {
    let root = tempfile::tempdir_in("/tmp").unwrap();
    chmod(root.path(), 0o755);
    let d = dirs(root.path(), &["tier"]);
    format(&[&d[0]]);
    // The directory and the slab are readable by anyone; the checkpoint by its owner only.
    chmod(&d[0], 0o755);
    chmod(&d[0].join("kvtier-g3.slab"), 0o644);
    let checkpoint = d[0].join("kvtier-g3.checkpoint");
    chmod(&checkpoint, 0o600);
    let Some(mut c) = unprivileged(&["tier", "inspect", d[0].to_str().unwrap()]) else {
        return;
    };
    let out = c.output().unwrap();
    let m = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{m}");
    assert!(m.contains(checkpoint.to_str().unwrap()), "{m}");
    assert!(m.contains("may not read it"), "{m}");
    assert!(!m.contains("not writable"), "{m}");
}
