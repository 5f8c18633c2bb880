//! The CLI reports GPUDirect Storage: `kvtier version` (built in or not, and what it would do
//! here) and `kvtier tier inspect` (what it would do for those slabs).

mod cli_common;

use cli_common::{assert_success, json, kvtier};

#[test]
fn version_says_whether_gds_is_built_in_and_what_it_would_do_here() {
    let out = kvtier(&["version"]);
    assert_success(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    let built = if cfg!(feature = "gds") {
        "gds: built in"
    } else {
        "gds: not built in"
    };
    assert!(text.contains(built), "{text}");
    let here = text
        .lines()
        .find(|l| l.starts_with("gds here: "))
        .expect(&text);
    let expected = kvtier::g3::gds::probe_status(&[std::env::temp_dir()]);
    assert_eq!(here, format!("gds here: {expected}"));
}

#[test]
fn inspect_reports_gds_for_the_slabs() {
    let d = tempfile::tempdir_in("/tmp").unwrap();
    let dir = d.path().to_str().unwrap();
    assert_success(&kvtier(&["tier", "format", dir, "--capacity", "8MiB"]));
    let report = json(&kvtier(&["tier", "inspect", dir, "--json"]));
    let expected = kvtier::g3::gds::probe_status(&[d.path().to_path_buf()]);
    assert_eq!(report["gds"]["state"], expected.state.as_str());
    assert_eq!(report["gds"]["reason"], expected.reason);
    let text = kvtier(&["tier", "inspect", dir]);
    assert!(String::from_utf8_lossy(&text.stdout).contains(&format!("gds:        {expected}")));
}

/// Without a GPU (or without the feature), `bench --gds` is a one-line user error saying why.
#[test]
fn bench_gds_without_gpu_says_why() {
    if kvtier::g3::gds::availability(&[std::env::temp_dir()]).is_ok() {
        kvtier::skip_test!("GPUDirect Storage libraries are present here");
        return;
    }
    let out = kvtier(&["bench", "--gds", "--bytes", "8MiB"]);
    let needle = if cfg!(feature = "gds") {
        "cannot start"
    } else {
        "--features gds"
    };
    cli_common::assert_exit_2_one_line(&out, needle);
}
