//! `kvtier fio-compare` end to end: JSON schema, plot, cleanup, and the error exits.

mod cli_common;

use std::path::Path;
use std::process::Output;

use cli_common::{assert_exit_2_one_line, assert_success, command, fio_installed, kvtier, stderr};

/// fio-compare on `dir` with 4 MiB per side in 1 MiB rows, depth 1, one pair.
fn small_compare(dir: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "fio-compare",
        "--path",
        dir,
        "--size",
        "4MiB",
        "--row-size",
        "1MiB",
        "--iodepth",
        "1",
        "--pairs",
        "1",
    ];
    args.extend_from_slice(extra);
    kvtier(&args)
}

#[test]
fn missing_fio_says_how_to_install_and_fails() {
    let out = command(&["fio-compare", "--size", "4MiB"])
        .env("KVTIER_FIO_BIN", "/nonexistent/fio")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("apt-get install fio"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}

/// A mistake in the arguments is reported as such on a machine without fio (issue 20 item 10):
/// the arguments are checked first.
#[test]
fn argument_mistakes_are_reported_before_fio_is_looked_for() {
    let no_fio = |args: &[&str]| {
        command(args)
            .env("KVTIER_FIO_BIN", "/nonexistent/fio")
            .output()
            .unwrap()
    };
    let out = no_fio(&["fio-compare", "--path", "/nonexistent/kvtier-dir"]);
    assert_exit_2_one_line(&out, "/nonexistent/kvtier-dir");
    let out = no_fio(&["fio-compare", "--row-size", "1000"]);
    assert_exit_2_one_line(&out, "--row-size");
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let d = dir.path().to_str().unwrap();
    let out = no_fio(&["fio-compare", "--path", d, "--iodepth", "0"]);
    assert_exit_2_one_line(&out, "--iodepth");
    // Correct arguments: then the missing fio is the error.
    let out = no_fio(&["fio-compare", "--path", d, "--size", "4MiB"]);
    assert!(
        stderr(&out).contains("apt-get install fio"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn bad_path_and_bad_options_exit_2_with_one_line() {
    let out = kvtier(&["fio-compare", "--path", "/nonexistent/kvtier-dir"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("/nonexistent/kvtier-dir"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");

    let out = kvtier(&["fio-compare", "--row-size", "1000"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--row-size"));

    let out = kvtier(&["fio-compare", "--row-size", "2 parsecs"]);
    assert_eq!(out.status.code(), Some(2));

    let out = kvtier(&["fio-compare", "--no-such-flag"]);
    assert_eq!(out.status.code(), Some(2));

    let out = kvtier(&["fio-compare", "--profile", "sideways"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn compares_store_and_load_as_json_and_plots() {
    if !fio_installed() {
        kvtier::skip_test!("fio is not installed (apt-get install fio)");
        return;
    }
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let svg = dir.path().join("depth.svg");
    let d = dir.path().to_str().unwrap();
    let out = kvtier(&[
        "fio-compare",
        "--path",
        d,
        "--size",
        "8MiB",
        "--row-size",
        "1MiB",
        "--iodepth",
        "2",
        "--pairs",
        "1",
        "--depths",
        "1",
        "--plot",
        svg.to_str().unwrap(),
        "--json",
    ]);
    assert_success(&out);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let arr = v.as_array().expect("an array, one object per profile");
    let names: Vec<&str> = arr.iter().map(|o| o["profile"].as_str().unwrap()).collect();
    assert_eq!(names, ["store", "load"]);
    for o in arr {
        let k = o["kvtier_bytes_per_sec"].as_f64().unwrap();
        let f = o["fio_bytes_per_sec"].as_f64().unwrap();
        let r = o["ratio"].as_f64().unwrap();
        assert!(k > 0.0 && f > 0.0, "{o}");
        assert!((r - k / f).abs() < 1e-9 * r.max(1.0), "{o}");
        assert_eq!(o["row_size"], 1 << 20);
        assert_eq!(o["iodepth"], 2);
        assert_eq!(o["pairs"], 1);
        assert_eq!(o["kvtier_samples"].as_array().unwrap().len(), 1);
        assert_eq!(o["fio_samples"].as_array().unwrap().len(), 1);
        assert!(
            o["file_state"]
                .as_str()
                .unwrap()
                .contains("written in full")
        );
        let depths: Vec<u64> = o["sweep"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["iodepth"].as_u64().unwrap())
            .collect();
        assert_eq!(depths, [1, 2]);
    }
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg") && text.contains("store") && text.contains("load"));
    // The test files are gone (no --keep); only the plot remains.
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, [Path::new("depth.svg").as_os_str()]);
}

#[test]
fn table_output_names_the_file_state_and_keep_keeps_files() {
    if !fio_installed() {
        kvtier::skip_test!("fio is not installed (apt-get install fio)");
        return;
    }
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let d = dir.path().to_str().unwrap();
    let out = small_compare(
        d,
        &["--profile", "mixed", "--kvtier-side", "engine", "--keep"],
    );
    assert_success(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("file state: preallocated"), "{text}");
    assert!(
        text.contains("kvtier/fio") && text.contains("mixed"),
        "{text}"
    );
    assert!(dir.path().join("kvtier-fio-compare.fio.dat").exists());
    assert!(dir.path().join("kvtier-fio-compare.kvtier.dat").exists());

    // The G3 side keeps its tier directory with --keep; mixed needs the engine side.
    let out = small_compare(d, &["--profile", "store", "--keep", "--json"]);
    assert_success(&out);
    assert!(
        dir.path()
            .join("kvtier-fio-compare.g3/kvtier-g3.slab")
            .exists()
    );
    let out = kvtier(&["fio-compare", "--path", d, "--profile", "mixed"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("--kvtier-side engine"),
        "{}",
        stderr(&out)
    );
}
