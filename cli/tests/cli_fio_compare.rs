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
    // 2 x 64 sets x 32 rows of 2 MiB.
    let out = no_fio(&[
        "fio-compare",
        "--path",
        d,
        "--iodepth",
        "32",
        "--buffer-sets",
        "64",
    ]);
    assert_exit_2_one_line(&out, "8 GiB");
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
        // fio gets the same kind of memory as kvtier's rows, or the report says it did not.
        assert_eq!(o["kvtier_region"], "own");
        let pages = o["kvtier_pages"].as_str().unwrap();
        let like = o["fio_like_for_like"].as_bool().unwrap();
        let memory = &o["fio_setup"]["memory"];
        if pages.starts_with("2 MiB pages") && like {
            assert_eq!(memory, "shm_huge", "{o}");
            assert_eq!(o["fio_best_setup"]["memory"], "shm_huge", "{o}");
            assert_eq!(o["fio_best_bytes_per_sec"], o["fio_bytes_per_sec"], "{o}");
        }
        if !like {
            assert_eq!(memory, "malloc", "{o}");
            assert!(
                o["fio_note"]
                    .as_str()
                    .unwrap()
                    .contains("NOT like for like"),
                "{o}"
            );
        }
        assert_eq!(
            o["fio_setup"]["batch"], 0,
            "batches of up to the depth: {o}"
        );
        for key in ["kvtier_cpu_seconds_per_gb", "fio_cpu_seconds_per_gb"] {
            assert!(o[key].as_f64().is_some_and(|v| v >= 0.0), "{key}: {o}");
        }
        assert!(o["sweep"][0]["row_size"] == 1 << 20);
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

/// `--fio-verify`: fio checks a CRC-32C of every block it loads, in rounds of its own. It
/// fails on a block without its verify header, so this also checks that its file was written
/// with them at this row size.
#[test]
fn fio_checking_what_it_loads_runs_beside_the_others() {
    if !fio_installed() {
        kvtier::skip_test!("fio is not installed (apt-get install fio)");
        return;
    }
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let cwd = tempfile::tempdir_in("/tmp").unwrap();
    let d = dir.path().to_str().unwrap();
    let mut cmd = command(&[
        "fio-compare",
        "--path",
        d,
        "--size",
        "8MiB",
        "--row-size",
        "256KiB",
        "--iodepth",
        "4",
        "--pairs",
        "2",
        "--fio-verify",
        "--json",
    ]);
    let out = cmd.current_dir(cwd.path()).output().unwrap();
    assert_success(&out);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let arr = v.as_array().unwrap();
    assert_eq!(arr.len(), 2);
    assert_eq!(arr[0]["profile"], "store");
    assert!(arr[0].get("fio_verify").is_none(), "stores: {}", arr[0]);
    let load = &arr[1];
    assert_eq!(load["profile"], "load");
    let verify = &load["fio_verify"];
    let speed = verify["bytes_per_sec"].as_f64().unwrap();
    assert!(speed > 0.0, "{load}");
    assert_eq!(
        verify["samples"].as_array().unwrap().len(),
        load["kvtier_samples"].as_array().unwrap().len(),
        "one verifying pass per round: {load}"
    );
    let k = load["kvtier_bytes_per_sec"].as_f64().unwrap();
    assert!((verify["ratio"].as_f64().unwrap() - k / speed).abs() < 1e-9 * k / speed);
    assert!(
        verify["cpu_seconds_per_gb"]
            .as_f64()
            .is_some_and(|c| c >= 0.0)
    );
    // No fio verify state files in the working directory, and the test files are gone.
    let left = |p: &Path| std::fs::read_dir(p).unwrap().count();
    assert_eq!(left(cwd.path()), 0);
    assert_eq!(left(dir.path()), 0);
    // The table says it too.
    let table = small_compare(d, &["--profile", "load", "--fio-verify"]);
    assert_success(&table);
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains("fio checking what it loads"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("  load   fio verifying ") && l.contains("kvtier/that")),
        "{text}"
    );
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
        &[
            "--profile",
            "mixed",
            "--kvtier-side",
            "engine",
            "--buffer-sets",
            "2",
            "--keep",
        ],
    );
    assert_success(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("file state: preallocated"), "{text}");
    assert!(
        text.contains("2 sets of rows per direction used in turn"),
        "{text}"
    );
    assert!(
        text.contains("kvtier/fio") && text.contains("mixed"),
        "{text}"
    );
    assert!(dir.path().join("kvtier-fio-compare.fio.dat").exists());
    assert!(dir.path().join("kvtier-fio-compare.kvtier.dat").exists());

    // The G3 side keeps its tier directory with --keep; mixed needs the engine side.
    let out = small_compare(
        d,
        &[
            "--profile",
            "store",
            "--keep",
            "--json",
            "--buffer-sets",
            "2",
        ],
    );
    assert_success(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("2 sets of rows taken in turn"), "{text}");
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

/// kvtier's rows in a vLLM-shaped region with 4 KiB pages: fio's buffers are 4 KiB shared
/// tmpfs pages too, and fio's best (hugetlb) runs beside it as the device reference, or the
/// report says why it cannot.
#[test]
fn a_4k_page_region_gets_shared_tmpfs_buffers_and_a_huge_page_reference() {
    if !fio_installed() {
        kvtier::skip_test!("fio is not installed (apt-get install fio)");
        return;
    }
    if !Path::new("/dev/shm").is_dir() {
        kvtier::skip_test!("no /dev/shm");
        return;
    }
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let out = small_compare(
        dir.path().to_str().unwrap(),
        &["--profile", "store", "--region", "vllm-4k", "--json"],
    );
    assert_success(&out);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let o = &v[0];
    assert_eq!(o["kvtier_region"], "vllm-4k");
    assert!(
        o["kvtier_pages"]
            .as_str()
            .unwrap()
            .starts_with("4 KiB pages"),
        "{o}"
    );
    assert_eq!(o["fio_like_for_like"], true);
    let shm = o["fio_setup"]["memory"]["shm_file"].as_str().unwrap();
    assert!(shm.starts_with("/dev/shm/"), "{o}");
    assert!(!Path::new(shm).exists(), "fio's buffer file is removed");
    match o["fio_best_setup"]["memory"].as_str() {
        Some(m) => {
            assert_eq!(m, "shm_huge");
            let best = o["fio_best_bytes_per_sec"].as_f64().unwrap();
            let k = o["kvtier_bytes_per_sec"].as_f64().unwrap();
            assert!(best > 0.0);
            assert!(
                (o["ratio_to_best"].as_f64().unwrap() - k / best).abs() < 1e-9,
                "{o}"
            );
        }
        None => assert!(
            o["fio_note"]
                .as_str()
                .unwrap()
                .contains("best configuration cannot run"),
            "{o}"
        ),
    }
}

/// What a vLLM deployment hands kvtier (its region pinned in 4 KiB pages before kvtier adopts
/// it): the report says the pages were measured as 4 KiB, and gives each round's
/// kvtier/reference ratio with their spread ((max - min) / median, recomputed here from the
/// ratios), at least `--pairs` rounds of them.
#[test]
fn a_pinned_region_is_measured_and_the_spread_of_the_rounds_is_reported() {
    if !fio_installed() {
        kvtier::skip_test!("fio is not installed (apt-get install fio)");
        return;
    }
    if !Path::new("/dev/shm").is_dir() {
        kvtier::skip_test!("no /dev/shm");
        return;
    }
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let d = dir.path().to_str().unwrap();
    let out = kvtier(&[
        "fio-compare",
        "--path",
        d,
        "--size",
        "8MiB",
        "--row-size",
        "2MiB",
        "--iodepth",
        "2",
        "--pairs",
        "2",
        "--profile",
        "load",
        "--region",
        "vllm-pinned",
        "--json",
    ]);
    if !out.status.success() && stderr(&out).contains("cannot pin") {
        kvtier::skip_test!("cannot pin here: {}", stderr(&out));
        return;
    }
    assert_success(&out);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let o = &v[0];
    assert_eq!(o["kvtier_region"], "vllm-pinned");
    let pages = o["kvtier_pages"].as_str().unwrap();
    let shm_huge = std::fs::read_to_string("/proc/mounts")
        .unwrap()
        .lines()
        .any(|l| {
            l.split_whitespace().nth(1) == Some("/dev/shm")
                && l.contains("huge=")
                && !l.contains("huge=never")
        });
    if !shm_huge {
        assert!(pages.starts_with("4 KiB pages (measured)"), "{pages}");
    }
    let ratios: Vec<f64> = o["pair_ratios"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_f64().unwrap())
        .collect();
    assert!(ratios.len() >= 2 && ratios.len() <= 6, "{o}");
    assert_eq!(ratios.len(), o["kvtier_samples"].as_array().unwrap().len());
    let mut sorted = ratios.clone();
    sorted.sort_by(f64::total_cmp);
    let median = if sorted.len() % 2 == 1 {
        sorted[sorted.len() / 2]
    } else {
        (sorted[sorted.len() / 2 - 1] + sorted[sorted.len() / 2]) / 2.0
    };
    let spread = (sorted[sorted.len() - 1] - sorted[0]) / median;
    let reported = o["ratio_spread"].as_f64().unwrap();
    assert!(
        (reported - spread).abs() < 1e-9,
        "{reported} vs {spread}: {o}"
    );
    // Fewer rounds than the most are taken only once the spread is narrow.
    if ratios.len() < 6 {
        assert!(spread <= 0.10 + 1e-9, "{o}");
    }
}
