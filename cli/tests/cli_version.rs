//! `kvtier version` reports the build and the engines this machine has, checked against
//! independent sources: `Cargo.toml` for the minimum Rust version and the cargo features, and
//! the library's own io_uring probe run in this process.

mod cli_common;

use cli_common::{assert_success, kvtier};

/// The `kvtier-cli` package's manifest (`cli/Cargo.toml`): its cargo features.
fn manifest() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")).unwrap()
}

/// The workspace's manifest: the minimum Rust version every crate shares.
fn workspace_manifest() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.toml")).unwrap()
}

/// Whether this build (the test is built with the package's features) has the cargo feature
/// `name`. A feature added to `cli/Cargo.toml` is added here too, or the test fails.
fn built_with(name: &str) -> bool {
    match name {
        "gds" => cfg!(feature = "gds"),
        "test-support" => cfg!(feature = "test-support"),
        other => panic!("cli/Cargo.toml declares feature {other:?}: add it to built_with"),
    }
}

/// The value of `key = "..."` on its own line in the manifest.
fn manifest_value(text: &str, key: &str) -> String {
    text.lines()
        .find_map(|l| l.trim().strip_prefix(key)?.trim().strip_prefix('='))
        .map(|v| v.trim().trim_matches('"').to_string())
        .unwrap_or_else(|| panic!("{key} not in Cargo.toml"))
}

/// The feature names of the `[features]` table, without `default`.
fn manifest_features(text: &str) -> Vec<String> {
    text.lines()
        .skip_while(|l| l.trim() != "[features]")
        .skip(1)
        .take_while(|l| !l.trim_start().starts_with('['))
        .filter_map(|l| l.split_once('=').map(|(k, _)| k.trim().to_string()))
        .filter(|k| !k.is_empty() && !k.starts_with('#') && k != "default")
        .collect()
}

#[test]
fn version_reports_build_features_and_engines() {
    let out = kvtier(&["version"]);
    assert_success(&out);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let line = |prefix: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no {prefix:?} line in:\n{text}"))
            .to_string()
    };
    let manifest = manifest();
    assert!(text.starts_with(&format!("kvtier {}\n", env!("CARGO_PKG_VERSION"))));
    let rust_version = manifest_value(&workspace_manifest(), "rust-version");
    assert!(
        line("build: ").contains(&format!("rust-version {rust_version} or newer")),
        "{text}"
    );

    // Every feature in Cargo.toml is reported, as built in exactly when this build has it.
    let declared = manifest_features(&manifest);
    assert!(!declared.is_empty(), "Cargo.toml declares features");
    let built: Vec<&str> = declared
        .iter()
        .filter(|f| built_with(f))
        .map(String::as_str)
        .collect();
    let expected = if built.is_empty() {
        "none".to_string()
    } else {
        built.join(", ")
    };
    assert_eq!(line("features: "), expected, "{text}");

    let uring = line("engine uring: ");
    match kvtier::io::probe_io_uring() {
        Ok(()) => assert_eq!(uring, "available"),
        Err(why) => assert!(
            uring.starts_with("unavailable") && uring.contains(&why),
            "{uring}"
        ),
    }
    assert_eq!(line("engine psync: "), "available");
}

/// `vllm region pages:` says 2 MiB pages exactly when `/proc/mounts` shows `/dev/shm` mounted
/// `huge=within_size` or `huge=always` (or shmem_enabled is `force`), and otherwise names the fix.
#[test]
fn version_says_whether_dev_shm_gives_vllm_2mib_pages() {
    let out = kvtier(&["version"]);
    assert_success(&out);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("vllm region pages: "))
        .unwrap_or_else(|| panic!("no vllm region pages line in:\n{text}"));
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    let Some(shm) = mounts
        .lines()
        .rev()
        .find(|l| l.split_whitespace().nth(1) == Some("/dev/shm"))
    else {
        assert!(line.contains("not a tmpfs mount"), "{line}");
        return;
    };
    let force = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
        .is_ok_and(|s| s.contains("[force]"));
    let huge = force || shm.contains("huge=within_size") || shm.contains("huge=always");
    if huge {
        assert!(line.starts_with("2 MiB pages"), "{shm}: {line}");
    } else {
        assert!(line.starts_with("4 KiB pages"), "{shm}: {line}");
        assert!(
            line.contains("mount -o remount,huge=within_size /dev/shm"),
            "{line}"
        );
    }
}
