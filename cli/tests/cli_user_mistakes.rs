//! Mistakes a first user makes, each answered by one `kvtier: error:` line naming the flag,
//! key or path, with exit 2, and never a panic; and output cut short by a closed pipe ends
//! quietly instead of panicking.

mod cli_common;

use std::path::Path;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use cli_common::{assert_user_error, command, fio_installed, kvtier, send_signal};
use kvtier::g3::slab::available_bytes;

/// Starts `kvtier ARGS --path DIR`, sends `signal` once the command has made something in `dir`
/// (`what`, if it never does), and returns its output; `None`, skipped with a note, when the
/// command finished before the signal arrived.
fn interrupt_once_started(
    args: &[&str],
    dir: &Path,
    signal: libc::c_int,
    what: &str,
) -> Option<Output> {
    let child = command(args)
        .arg("--path")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvtier");
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::fs::read_dir(dir).unwrap().count() == 0 {
        assert!(Instant::now() < deadline, "no {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
    send_signal(&child, signal);
    let out = child.wait_with_output().unwrap();
    if out.status.code() == Some(0) {
        kvtier::skip_test!("{} finished before the signal arrived", args[0]);
        return None;
    }
    Some(out)
}

/// Whether `dir`'s filesystem has `needed` bytes free (with 64 MiB to spare for the index and
/// other writers); skips the test with a printed reason when it has not.
fn has_room(dir: &Path, needed: u64) -> bool {
    let spare = 64 << 20;
    match available_bytes(dir) {
        Some(free) if free >= needed + spare => true,
        Some(free) => {
            kvtier::skip_test!(
                "{} needs {} MiB free, {} MiB available",
                dir.display(),
                (needed + spare) >> 20,
                free >> 20
            );
            false
        }
        None => true,
    }
}

#[test]
fn bench_bytes_zero_is_refused() {
    assert_user_error(&kvtier(&["bench", "--bytes", "0"]), "--bytes");
}

/// `kvtier service bench` sizes its slabs from `--row-size` x `--chunks` x
/// `--concurrent-requests`: a product past `u64` is refused (it panicked with an overflow).
#[test]
fn service_bench_sizes_past_u64_are_refused() {
    let out = kvtier(&[
        "service",
        "bench",
        "--row-size",
        "4611686018427387904", // 2^62 bytes, a multiple of 4096; times 4 chunks is 2^64
        "--chunks",
        "4",
    ]);
    assert_user_error(&out, "--row-size");
}

#[test]
fn serve_refuses_a_primary_larger_than_memory_before_allocating_it() {
    if std::fs::read_to_string("/proc/meminfo").is_err() {
        kvtier::skip_test!("no /proc/meminfo, so kvtier cannot know the memory available");
        return;
    }
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let cfg = dir.path().join("big.json");
    std::fs::write(&cfg, r#"{"cpu_bytes_to_use": "64TiB"}"#).unwrap();
    let out = kvtier(&[
        "serve",
        "--config",
        cfg.to_str().unwrap(),
        "--metrics-addr",
        "127.0.0.1:0",
    ]);
    assert_user_error(&out, "cpu_bytes_to_use");
}

#[test]
fn a_closed_stdout_ends_the_command_without_a_panic() {
    use std::os::unix::process::ExitStatusExt;
    let (reader, writer) = std::io::pipe().expect("pipe");
    // Nobody reads: every write to stdout fails with EPIPE, like `kvtier ... | head -1` after
    // head has exited.
    drop(reader);
    let layout = concat!(env!("CARGO_MANIFEST_DIR"), "/../layouts/llama-3.1-8b.toml");
    let out = command(&["layout", "show", layout, "--tp", "1"])
        .stdout(Stdio::from(writer))
        .stderr(Stdio::piped())
        .output()
        .expect("spawn kvtier");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{stderr}");
}

#[test]
fn fio_compare_refuses_a_plot_in_a_missing_folder_before_running() {
    // (The arguments are checked before fio is looked for: this runs without fio.)
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let out = kvtier(&[
        "fio-compare",
        "--path",
        dir.path().to_str().unwrap(),
        "--size",
        "4MiB",
        "--plot",
        "/nonexistent/kvtier/depth.svg",
    ]);
    assert_user_error(&out, "--plot");
    // Refused up front: no test file was made.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn tier_commands_on_a_folder_without_a_tier_say_how_to_make_one() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let d = dir.path().to_str().unwrap();
    for cmd in ["inspect", "verify", "ls"] {
        let out = kvtier(&["tier", cmd, d]);
        assert_user_error(&out, "holds no G3 tier");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("kvtier tier format"),
            "{cmd}"
        );
    }
    assert_user_error(&kvtier(&["tier", "clear", d, "--yes"]), "holds no G3 tier");
}

#[test]
fn bench_in_a_folder_it_cannot_write_is_a_user_error() {
    // /proc refuses new directories even to root, like a read-only mount.
    if !std::path::Path::new("/proc/self").exists() {
        kvtier::skip_test!("no /proc here");
        return;
    }
    assert_user_error(
        &kvtier(&["bench", "--path", "/proc", "--bytes", "2MiB"]),
        "cannot create a directory in /proc",
    );
}

#[test]
fn two_nvme_tiers_on_one_directory_are_refused_by_config_check_and_serve() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let tier = dir.path().join("tier");
    std::fs::create_dir(&tier).unwrap();
    let cfg = dir.path().join("dup.json");
    std::fs::write(
        &cfg,
        format!(
            r#"{{"cpu_bytes_to_use": "8MiB", "secondary_tiers": [
                {{"type": "nvme", "paths": ["{t}"], "capacity_bytes": "16MiB"}},
                {{"type": "nvme", "paths": ["{t}/."], "capacity_bytes": "16MiB"}}]}}"#,
            t = tier.display()
        ),
    )
    .unwrap();
    let cfg = cfg.to_str().unwrap();
    assert_user_error(
        &kvtier(&["config", "check", cfg]),
        "secondary_tiers[1].paths[0]",
    );
    let out = kvtier(&["serve", "--config", cfg, "--metrics-addr", "127.0.0.1:0"]);
    assert_user_error(&out, "also a path of secondary_tiers[0]");
}

#[test]
fn a_typo_in_an_option_is_one_line_with_the_suggestion() {
    let out = kvtier(&["bench", "--byts", "2MiB"]);
    assert_user_error(&out, "'--byts'");
    assert!(String::from_utf8_lossy(&out.stderr).contains("'--bytes'"));
    assert_user_error(
        &kvtier(&["layout", "show", "x.toml"]),
        "required arguments were not provided: --tp",
    );
    assert_user_error(&kvtier(&["bench", "--bytes", "lots"]), "\"lots\"");
    assert_user_error(&kvtier(&["frobnicate"]), "'frobnicate'");
    // Help still prints in full, on stdout, with success.
    let help = kvtier(&["bench", "--help"]);
    assert_eq!(help.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&help.stdout).contains("--bytes"));
}

#[test]
fn ctrl_c_stops_the_bench_and_removes_its_tier() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    // 512 MiB of slab keeps the bench busy long enough for the signal to find it running.
    if !has_room(dir.path(), 512 << 20) {
        return;
    }
    // The handler is installed before the tier's directory is made: wait for the directory.
    let Some(out) = interrupt_once_started(
        &["bench", "--bytes", "512MiB", "--keep"],
        dir.path(),
        libc::SIGINT,
        "bench directory",
    ) else {
        return;
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "the interrupted bench left its tier behind"
    );
}

#[test]
fn sigterm_stops_fio_compare_and_removes_its_files() {
    if !fio_installed() {
        kvtier::skip_test!("fio is not installed");
        return;
    }
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    // fio-compare writes one file of --size per side.
    if !has_room(dir.path(), 2 * (256 << 20)) {
        return;
    }
    let Some(out) = interrupt_once_started(
        &["fio-compare", "--size", "256MiB", "--pairs", "3"],
        dir.path(),
        libc::SIGTERM,
        "fio-compare file",
    ) else {
        return;
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "the interrupted fio-compare left files behind"
    );
}

#[test]
fn tier_format_in_a_folder_that_takes_no_files_is_a_user_error() {
    // /proc is a pseudo filesystem: no slab can live there (fsync of it even fails EINVAL).
    if !std::path::Path::new("/proc/self").exists() {
        kvtier::skip_test!("no /proc here");
        return;
    }
    let out = kvtier(&["tier", "format", "/proc", "--capacity", "16MiB", "--yes"]);
    assert_user_error(&out, "not a writable local filesystem");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("/proc"),
        "{out:?}"
    );
}
