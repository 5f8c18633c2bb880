//! `gds = "auto"` falls back to the CPU path on a machine where GPUDirect Storage cannot run
//! (no CUDA driver, no cuFile, or a build without the `gds` feature) and says why in
//! `g3_gds_info`; `gds = "required"` is a start-up error naming the key and the reason, and
//! touches nothing.

mod g3_common;

use g3_common::*;
use kvtier::ErrorKind;
use kvtier::contract::secondary::SecondaryTier;
use kvtier::g3::gds::{GdsState, availability};
use kvtier::g3::{G3Tier, GdsMode, geometry_namespace};

/// Runs `f` only where GDS cannot run (this machine: no GPU, no CUDA); prints why it skips
/// elsewhere.
fn where_gds_cannot_run(dir: &std::path::Path, f: impl FnOnce(String)) {
    match availability(&[dir.to_path_buf()]) {
        Err(why) => f(why),
        Ok(found) => {
            kvtier::skip_test!("GPUDirect Storage can run here ({found}): no fallback to test")
        }
    }
}

fn gds_info(t: &G3Tier) -> (String, String) {
    let m = t.metrics();
    let info = m
        .iter()
        .find(|m| m.name == "g3_gds_info")
        .expect("g3_gds_info is exported");
    assert_eq!(info.value, 1.0);
    let label = |k: &str| {
        info.labels
            .iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    (label("mode"), label("reason"))
}

#[test]
fn auto_falls_back_to_the_cpu_path_and_says_why() {
    let d = tmpdir();
    where_gds_cannot_run(d.path(), |why| {
        let r = region(4);
        let mut cfg = config(&[d.path()], 8);
        cfg.gds = GdsMode::Auto;
        let mut t = open(cfg, &r);
        let status = t.gds_status();
        assert_eq!(status.state, GdsState::CpuFallback);
        assert_eq!(status.reason, why);
        assert_eq!(t.info().gds, status);
        let (mode, reason) = gds_info(&t);
        assert_eq!(mode, "cpu_fallback");
        assert_eq!(reason, why);
        // The reason names what is missing.
        assert!(
            why.contains("not installed")
                || why.contains("built without")
                || why.contains("cannot back"),
            "{why}"
        );
        // The CPU path serves: store and load round trip.
        fill_row(&r, 0, 7);
        assert!(run(&mut t, job(1, &[7], &[0], false)).success);
        clear_row(&r, 0);
        assert!(run(&mut t, job(2, &[7], &[1], true)).success);
        assert!(row_is(&r, 1, 7));
        t.shutdown().unwrap();
    });
}

#[test]
fn required_is_a_clear_start_up_error() {
    let d = tmpdir();
    where_gds_cannot_run(d.path(), |why| {
        let mut cfg = config(&[d.path()], 8);
        cfg.gds = GdsMode::Required;
        let e = G3Tier::open(
            cfg,
            region(4),
            geometry_namespace(STRIDE as u64),
            "g3-test".into(),
            None,
        )
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        let msg = e.to_string();
        assert!(msg.contains("gds = \"required\""), "{msg}");
        assert!(msg.contains(&why), "{msg}");
        assert!(
            msg.contains("gds = \"auto\""),
            "the message says how to fall back: {msg}"
        );
        assert_eq!(e.context_value("key"), Some("gds"));
        // Nothing was created.
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
    });
}

#[test]
fn off_reports_off() {
    let d = tmpdir();
    let r = region(2);
    let t = open(config(&[d.path()], 4), &r);
    assert_eq!(gds_info(&t).0, "off");
    assert_eq!(t.gds_status().state, GdsState::Off);
}
