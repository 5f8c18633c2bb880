//! Back-pressure configuration: merge precedence (top level, then tier, field by field),
//! configured vs unconfigured tiers, tier-type-aware presets, defaults and validation.
//! (`tests/python/test_backpressure_vs_vllm.py` checks the same merge against vLLM's own code.)

mod common;

use common::{bp_of, err, notes_of, ok, with_tiers};
use kvtier::config::backpressure::{LOCAL_PRESET, NETWORK_PRESET};
use serde_json::json;

/// The detector class a configured tier must name.
const CLS: &str = "EMABackpressureDetector";

#[test]
fn neither_source_leaves_tier_unconfigured() {
    assert_eq!(bp_of(with_tiers(None, json!([{"type": "nvme"}])), 0), None);
}

#[test]
fn top_level_only_applies_to_every_tier() {
    let v = with_tiers(
        Some(json!({"backpressure_cls": "EMABackpressureDetector", "alpha": 0.3})),
        json!([{"type": "nvme"}, {"type": "custom"}]),
    );
    let c = ok(v);
    for t in &c.secondary_tiers {
        let bp = t.backpressure.as_ref().unwrap();
        assert_eq!(bp.alpha, Some(0.3));
        assert_eq!(bp.high_water_s, Some(LOCAL_PRESET.high_water_s));
    }
}

#[test]
fn tier_only_configures_only_that_tier() {
    let v = with_tiers(
        None,
        json!([{"type": "custom", "backpressure": {"backpressure_cls": CLS, "cooldown_s": 0.5}},
               {"type": "custom"}]),
    );
    let c = ok(v);
    assert_eq!(
        c.secondary_tiers[0]
            .backpressure
            .as_ref()
            .unwrap()
            .cooldown_s,
        Some(0.5)
    );
    assert_eq!(c.secondary_tiers[1].backpressure, None);
}

#[test]
fn tier_fields_override_top_level_field_by_field() {
    let v = with_tiers(
        Some(
            json!({"backpressure_cls": "EMABackpressureDetector", "policy_cls": "DropStorePolicy",
                    "alpha": 0.3, "high_water_s": 0.2}),
        ),
        json!([{"type": "custom", "backpressure": {"alpha": 0.5, "low_water_s": 0.1}}]),
    );
    let bp = bp_of(v, 0).unwrap();
    assert_eq!(bp.alpha, Some(0.5), "tier wins");
    assert_eq!(bp.low_water_s, Some(0.1), "tier-only field");
    assert_eq!(bp.high_water_s, Some(0.2), "inherited from the top level");
    assert_eq!(
        bp.policy_cls.as_deref(),
        Some("DropStorePolicy"),
        "inherited"
    );
}

#[test]
fn a_configured_tier_needs_a_detector_class() {
    // vLLM's factory raises ValueError without backpressure_cls; so does kvtier.
    for bp in [json!({}), json!(null), json!({"alpha": 0.2})] {
        let e = err(with_tiers(
            None,
            json!([{"type": "custom", "backpressure": bp}]),
        ));
        assert_eq!(
            e.context_value("key"),
            Some("secondary_tiers[0].backpressure.backpressure_cls"),
            "{e}"
        );
    }
    // From the top level is enough, also for a tier whose own key is null.
    let v = with_tiers(
        Some(json!({"backpressure_cls": CLS})),
        json!([{"type": "custom", "backpressure": null}]),
    );
    assert!(bp_of(v, 0).is_some());
}

#[test]
fn detector_class_alone_configures_tier_with_presets() {
    let v = with_tiers(
        None,
        json!([{"type": "custom", "backpressure": {"backpressure_cls": CLS}}]),
    );
    let bp = bp_of(v, 0).unwrap();
    assert_eq!(
        bp.backpressure_cls.as_deref(),
        Some("EMABackpressureDetector")
    );
    assert_eq!(bp.policy_cls.as_deref(), Some("ThrottledDropPolicy"));
    assert_eq!(bp.high_water_s, Some(LOCAL_PRESET.high_water_s));
    assert_eq!(bp.low_water_s, Some(LOCAL_PRESET.low_water_s));
    assert_eq!(bp.alpha, Some(0.15));
    assert_eq!(bp.warmup_completions, Some(10));
    assert_eq!(bp.decay_half_life_s, Some(2.0));
    assert_eq!(bp.cooldown_s, Some(1.0));
    assert_eq!(bp.failure_threshold, None, "not a storage tier type");
}

#[test]
fn empty_top_level_dict_configures_nothing() {
    let v = with_tiers(
        Some(json!({})),
        json!([{"type": "nvme"}, {"type": "nvme", "backpressure": {"backpressure_cls": CLS}}]),
    );
    let c = ok(v.clone());
    assert_eq!(c.secondary_tiers[0].backpressure, None);
    assert!(c.secondary_tiers[1].backpressure.is_some());
    let notes = notes_of(v);
    assert!(
        notes.iter().any(|n| n.contains("empty top-level dict")),
        "{notes:?}"
    );
}

#[test]
fn remote_locality_and_obj_type_get_network_preset() {
    let v = with_tiers(
        None,
        json!([{"type": "custom", "locality": "REMOTE", "backpressure": {"backpressure_cls": CLS}},
               {"type": "obj", "backpressure": {"backpressure_cls": CLS}},
               {"type": "custom", "locality": "LOCAL", "backpressure": {"backpressure_cls": CLS}}]),
    );
    let c = ok(v);
    let marks = |i: usize| {
        let bp = c.secondary_tiers[i].backpressure.as_ref().unwrap();
        (bp.high_water_s.unwrap(), bp.low_water_s.unwrap())
    };
    let network = (NETWORK_PRESET.high_water_s, NETWORK_PRESET.low_water_s);
    assert_eq!(marks(0), network);
    assert_eq!(marks(1), network);
    assert_eq!(
        marks(2),
        (LOCAL_PRESET.high_water_s, LOCAL_PRESET.low_water_s)
    );
    assert_eq!(
        c.secondary_tiers[1]
            .backpressure
            .as_ref()
            .unwrap()
            .failure_threshold,
        Some(3)
    );
}

#[test]
fn storage_tier_types_get_failure_threshold() {
    for (ty, want) in [
        ("nvme", Some(3)),
        ("fs", Some(3)),
        ("obj", Some(3)),
        ("custom", None),
    ] {
        let v = with_tiers(
            None,
            json!([{"type": ty, "backpressure": {"backpressure_cls": CLS}}]),
        );
        assert_eq!(bp_of(v, 0).unwrap().failure_threshold, want, "{ty}");
        // An explicit null means "no failure trip" and is not replaced by the default.
        let v = with_tiers(
            None,
            json!([{"type": ty, "backpressure": {"backpressure_cls": CLS, "failure_threshold": null}}]),
        );
        assert_eq!(bp_of(v, 0).unwrap().failure_threshold, None, "{ty}");
    }
}

#[test]
fn explicit_values_are_never_overwritten_by_presets() {
    let v = with_tiers(
        Some(json!({"backpressure_cls": CLS, "failure_threshold": 7, "low_water_s": 0.3})),
        json!([{"type": "nvme", "locality": "REMOTE",
                "backpressure": {"high_water_s": 0.4, "alpha": 1.0, "warmup_completions": 0,
                                 "cooldown_s": 0, "decay_half_life_s": 9}}]),
    );
    let bp = bp_of(v, 0).unwrap();
    assert_eq!(bp.high_water_s, Some(0.4));
    assert_eq!(bp.low_water_s, Some(0.3));
    assert_eq!(bp.failure_threshold, Some(7));
    assert_eq!(bp.alpha, Some(1.0));
    assert_eq!(bp.warmup_completions, Some(0));
    assert_eq!(bp.cooldown_s, Some(0.0));
    assert_eq!(bp.decay_half_life_s, Some(9.0));
}

#[test]
fn water_mark_conflict_names_both_origins() {
    let v = with_tiers(
        None,
        json!([{"type": "nvme", "backpressure": {"backpressure_cls": CLS, "high_water_s": 0.001}}]),
    );
    let e = err(v);
    assert_eq!(
        e.context_value("key"),
        Some("secondary_tiers[0].backpressure")
    );
    assert_eq!(
        e.context_value("low_water_s"),
        Some("0.002 from LOCAL preset")
    );
    assert_eq!(
        e.context_value("high_water_s"),
        Some("0.001 from secondary_tiers[0].backpressure.high_water_s")
    );
}

#[test]
fn backpressure_ranges_and_types() {
    for (key, bad) in [
        ("alpha", json!(0)),
        ("alpha", json!(1.01)),
        ("failure_threshold", json!(0)),
        ("high_water_s", json!(0)),
        ("low_water_s", json!(-0.1)),
        ("decay_half_life_s", json!("2")),
        ("cooldown_s", json!(-1)),
        ("warmup_completions", json!(2.5)),
        ("alpha", json!("0.2")),
    ] {
        let e = err(with_tiers(Some(json!({key: bad})), json!([])));
        assert_eq!(
            e.context_value("key"),
            Some(format!("backpressure.{key}").as_str()),
            "{e}"
        );
        assert!(e.context_value("found").is_some(), "{e}");
    }
    let e = err(with_tiers(None, json!([{"type": "x", "backpressure": []}])));
    assert!(e.to_string().contains("or null"), "{e}");
    err(with_tiers(Some(json!([])), json!([])));
}

#[test]
fn values_vllm_gives_a_meaning() {
    // A top-level null contributes nothing (the tier has no detector).
    assert_eq!(
        bp_of(with_tiers(Some(json!(null)), json!([{"type": "x"}])), 0),
        None
    );
    // decay_half_life_s <= 0: no idle decay; policy_cls "" or null: the default policy.
    for (decay, policy) in [(json!(0), json!("")), (json!(-3.5), json!(null))] {
        let v = with_tiers(
            Some(
                json!({"backpressure_cls": CLS, "decay_half_life_s": decay, "policy_cls": policy}),
            ),
            json!([{"type": "x"}]),
        );
        let bp = bp_of(v.clone(), 0).unwrap();
        assert_eq!(bp.decay_half_life_s, decay.as_f64());
        let cfg = ok(v);
        let params =
            kvtier::tiering::backpressure::DetectorParams::for_tier(&cfg.secondary_tiers[0])
                .unwrap()
                .unwrap();
        assert_eq!(
            params.policy,
            kvtier::tiering::backpressure::PolicyKind::Throttled
        );
    }
}

#[test]
fn class_names_are_checked() {
    let e = err(with_tiers(
        Some(json!({"policy_cls": "DropStorePolicyy"})),
        json!([]),
    ));
    assert_eq!(e.context_value("did_you_mean"), Some("DropStorePolicy"));
    let e = err(with_tiers(
        Some(json!({"backpressure_cls": "my.Detector"})),
        json!([]),
    ));
    assert_eq!(e.context_value("allowed"), Some("EMABackpressureDetector"));
    let v = with_tiers(
        Some(
            json!({"backpressure_cls": "vllm.v1.kv_offload.tiering.backpressure.EMABackpressureDetector"}),
        ),
        json!([{"type": "x"}]),
    );
    assert_eq!(
        bp_of(v, 0).unwrap().backpressure_cls.as_deref(),
        Some("EMABackpressureDetector")
    );
}

#[test]
fn p2p_tier_refuses_backpressure() {
    ok(with_tiers(None, json!([{"type": "p2p"}])));
    let e = err(with_tiers(
        Some(json!({"backpressure_cls": CLS, "alpha": 0.2})),
        json!([{"type": "p2p"}]),
    ));
    assert!(e.to_string().contains("p2p"), "{e}");
}

mod model {
    //! A reference model of vLLM's merge (`TieringOffloadingSpec.__init__`) and of
    //! `default_config` + detector defaults, checked against kvtier on random inputs.

    use super::common::with_tiers;
    use kvtier::config::{self, BackpressureConfig};
    use proptest::prelude::*;
    use serde_json::{Map, Value, json};

    /// Per key: a few valid values.
    fn key_values() -> Vec<(&'static str, Vec<Value>)> {
        vec![
            ("backpressure_cls", vec![json!("EMABackpressureDetector")]),
            (
                "policy_cls",
                vec![json!("ThrottledDropPolicy"), json!("DropStorePolicy")],
            ),
            ("high_water_s", vec![json!(0.004), json!(0.03), json!(0.5)]),
            ("low_water_s", vec![json!(0.0), json!(0.005), json!(0.04)]),
            ("alpha", vec![json!(0.1), json!(1.0)]),
            ("warmup_completions", vec![json!(0), json!(5)]),
            ("decay_half_life_s", vec![json!(0.5), json!(4)]),
            ("cooldown_s", vec![json!(0), json!(2.5)]),
            ("failure_threshold", vec![json!(1), json!(9)]),
        ]
    }

    /// A random partial back-pressure dict.
    fn dict() -> impl Strategy<Value = Map<String, Value>> {
        let per_key: Vec<_> = key_values()
            .into_iter()
            .map(|(k, vals)| {
                proptest::option::of(proptest::sample::select(vals)).prop_map(move |v| (k, v))
            })
            .collect();
        per_key.prop_map(|kvs| {
            kvs.into_iter()
                .filter_map(|(k, v)| v.map(|v| (k.to_string(), v)))
                .collect()
        })
    }

    /// Expected resolution, or `None` for "unconfigured", or `Err(part of the message)` for
    /// "rejected".
    fn expected(
        top: &Option<Map<String, Value>>,
        tier: &Option<Map<String, Value>>,
        ty: &str,
        remote: bool,
    ) -> Result<Option<BackpressureConfig>, &'static str> {
        let mut merged = Map::new();
        for src in [top, tier].into_iter().flatten() {
            for (k, v) in src {
                merged.insert(k.clone(), v.clone());
            }
        }
        if merged.is_empty() && tier.is_none() {
            return Ok(None);
        }
        if !merged.contains_key("backpressure_cls") {
            return Err("backpressure_cls");
        }
        let (high, low) = if remote || ty == "obj" {
            (0.05, 0.01)
        } else {
            (0.01, 0.002)
        };
        let f = |k: &str, d: f64| merged.get(k).and_then(Value::as_f64).unwrap_or(d);
        let n = |k: &str| merged.get(k).and_then(Value::as_u64).map(|x| x as u32);
        let s = |k: &str, d: &str| {
            merged
                .get(k)
                .and_then(Value::as_str)
                .unwrap_or(d)
                .to_string()
        };
        let storage = ["nvme", "fs", "obj"].contains(&ty);
        let bp = BackpressureConfig {
            backpressure_cls: Some(s("backpressure_cls", "EMABackpressureDetector")),
            policy_cls: Some(s("policy_cls", "ThrottledDropPolicy")),
            high_water_s: Some(f("high_water_s", high)),
            low_water_s: Some(f("low_water_s", low)),
            alpha: Some(f("alpha", 0.15)),
            warmup_completions: Some(n("warmup_completions").unwrap_or(10)),
            decay_half_life_s: Some(f("decay_half_life_s", 2.0)),
            cooldown_s: Some(f("cooldown_s", 1.0)),
            failure_threshold: n("failure_threshold").or(if storage { Some(3) } else { None }),
        };
        if bp.low_water_s > bp.high_water_s {
            return Err("low_water_s must be <= high_water_s");
        }
        Ok(Some(bp))
    }

    proptest! {
        #[test]
        fn merge_matches_reference_model(
            top in proptest::option::of(dict()),
            tier in proptest::option::of(dict()),
            ty in proptest::sample::select(vec!["nvme", "fs", "obj", "custom"]),
            remote in any::<bool>(),
        ) {
            let mut entry = json!({"type": ty, "locality": if remote { "REMOTE" } else { "LOCAL" }});
            if let Some(t) = &tier {
                entry["backpressure"] = Value::Object(t.clone());
            }
            let v = with_tiers(top.clone().map(Value::Object), json!([entry]));
            let got = config::from_value(v).map(|c| c.secondary_tiers[0].backpressure.clone());
            match expected(&top, &tier, ty, remote) {
                Ok(want) => prop_assert_eq!(got.map_err(|e| e.to_string()), Ok(want)),
                Err(part) => {
                    let e = got.expect_err("must be rejected");
                    prop_assert!(e.to_string().contains(part), "{}", e);
                }
            }
        }
    }
}
