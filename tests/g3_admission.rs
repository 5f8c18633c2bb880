//! The G3 tier's `admission` key: with `tinylfu`, a store of a key the tier has seen no more
//! often than the entry it would evict is skipped, the job still succeeds with only the
//! written bytes, and the counters say what was admitted and rejected. Expectations are
//! worked out by hand from the TinyLFU rule (a key's estimate = the accesses the tier saw:
//! its lookups and the stores that offered it; admitted when the tier has a free slot or the
//! estimate beats the least recently used entry's).

mod g3_common;

use g3_common::*;
use kvtier::contract::admission::AdmissionKind;
use kvtier::contract::job::LookupResult;
use kvtier::contract::secondary::SecondaryTier;
use kvtier::g3::G3Tier;

/// A G3 tier of `slots` slots in a fresh directory over an 8-row region (the tier holds it)
/// whose row `i` holds pattern `i`, with `admission` and whatever else `adjust` sets in its
/// configuration.
fn tier_of(
    slots: u64,
    admission: AdmissionKind,
    adjust: impl FnOnce(&mut kvtier::g3::G3TierConfig),
) -> (tempfile::TempDir, G3Tier) {
    let d = tmpdir();
    let r = region(8);
    let mut cfg = config(&[d.path()], slots);
    cfg.admission = admission;
    adjust(&mut cfg);
    let t = open(cfg, &r);
    for i in 0..8u32 {
        fill_row(&r, i, u64::from(i));
    }
    (d, t)
}

fn outcome(t: &G3Tier, name: &str, outcome: &str) -> f64 {
    t.metrics()
        .iter()
        .find(|m| {
            m.name == name
                && m.labels
                    .iter()
                    .any(|(k, v)| *k == "outcome" && v == outcome)
        })
        .map_or(-1.0, |m| m.value)
}

#[test]
fn tinylfu_skips_cold_keys_and_admits_them_once_they_are_asked_for() {
    let (_d, mut t) = tier_of(4, AdmissionKind::TinyLfu, |_| {});
    // Four free slots: keys 0..4 are admitted whatever their counts (each estimate 1 now).
    let res = run(&mut t, job(1, &[0, 1, 2, 3], &[0, 1, 2, 3], false));
    assert!(res.success, "{res:?}");
    assert_eq!(res.transfer_bytes, Some(4 * STRIDE as u64));
    // Key 4, never asked for: estimate 1 (this store), the LRU entry (key 0) 1 too: a tie
    // keeps the resident entry. The job still succeeds and moved nothing.
    let res = run(&mut t, job(2, &[4], &[4], false));
    assert!(res.success, "a rejected key is not a failure: {res:?}");
    assert_eq!(res.transfer_bytes, Some(0));
    assert_eq!(lookup(&mut t, 4), LookupResult::Miss); // key 4: estimate 2
    for i in 0..4 {
        assert_eq!(lookup(&mut t, i), LookupResult::Hit, "key {i} still held");
    }
    // Keys 0..4 now estimate 2 each (store + lookup); the LRU order is 0, 1, 2, 3.
    // Key 4 asked for once more: estimate 3, beats key 0 (2): admitted, key 0 evicted.
    assert_eq!(lookup(&mut t, 4), LookupResult::Miss);
    let res = run(&mut t, job(3, &[4], &[4], false));
    assert!(res.success, "{res:?}");
    assert_eq!(res.transfer_bytes, Some(STRIDE as u64));
    assert_eq!(lookup(&mut t, 4), LookupResult::Hit);
    assert_eq!(
        lookup(&mut t, 0),
        LookupResult::Miss,
        "key 0 was the LRU victim"
    );
    // The counters: 5 admitted (0..4, then 4), 1 rejected, at one slot each.
    assert_eq!(outcome(&t, "g3_admission_blocks", "admitted"), 5.0);
    assert_eq!(outcome(&t, "g3_admission_blocks", "rejected"), 1.0);
    assert_eq!(
        outcome(&t, "g3_admission_bytes", "admitted"),
        5.0 * STRIDE as f64
    );
    assert_eq!(outcome(&t, "g3_admission_bytes", "rejected"), STRIDE as f64);
    assert_eq!(outcome(&t, "g3_admission_blocks", "unchecked"), 0.0);
    assert_eq!(metric(&t, "g3_keys_stored"), 5.0);
    t.shutdown().unwrap();
}

#[test]
fn a_job_whose_keys_are_all_rejected_is_reported_once_and_keys_held_pass() {
    let (_d, mut t) = tier_of(2, AdmissionKind::TinyLfu, |_| {});
    assert!(run(&mut t, job(1, &[0, 1], &[0, 1], false)).success);
    // Key 1 is held (passes untouched, counted as neither); keys 5 and 6 tie with the
    // victims and are rejected.
    let res = run(&mut t, job(2, &[1, 5, 6], &[1, 5, 6], false));
    assert!(res.success, "{res:?}");
    assert_eq!(res.transfer_bytes, Some(0));
    assert_eq!(outcome(&t, "g3_admission_blocks", "admitted"), 2.0);
    assert_eq!(outcome(&t, "g3_admission_blocks", "rejected"), 2.0);
    assert_eq!(metric(&t, "g3_stores_skipped"), 1.0);
    assert!(!t.has_pending_work());
    assert!(
        t.get_finished_jobs().is_empty(),
        "each job is reported exactly once"
    );
    t.shutdown().unwrap();
}

#[test]
fn admission_all_writes_everything_and_counts_zero() {
    let (_d, mut t) = tier_of(2, AdmissionKind::All, |_| {});
    assert!(run(&mut t, job(1, &[0, 1], &[0, 1], false)).success);
    // Never asked for, the tier full: `all` writes it anyway, evicting key 0.
    assert!(run(&mut t, job(2, &[2], &[2], false)).success);
    assert_eq!(metric(&t, "g3_keys_stored"), 3.0);
    assert_eq!(lookup(&mut t, 0), LookupResult::Miss);
    assert_eq!(outcome(&t, "g3_admission_blocks", "admitted"), 0.0);
    assert_eq!(outcome(&t, "g3_admission_blocks", "rejected"), 0.0);
    t.shutdown().unwrap();
}

fn parse_nvme(params: serde_json::Value) -> kvtier::Result<kvtier::g3::G3TierConfig> {
    let mut tc = kvtier::config::TierConfig::new(0, "nvme");
    let mut p = serde_json::json!({"paths": ["/tmp"], "capacity_bytes": "1MiB"});
    for (k, v) in params.as_object().unwrap() {
        p[k] = v.clone();
    }
    tc.params = p.as_object().cloned().unwrap();
    kvtier::g3::G3TierConfig::from_tier(&tc)
}

#[test]
fn the_admission_key_takes_all_or_tinylfu_and_names_itself_otherwise() {
    let c = parse_nvme(serde_json::json!({})).unwrap();
    assert_eq!(c.admission, AdmissionKind::All, "the default");
    let c = parse_nvme(serde_json::json!({"admission": "tinylfu"})).unwrap();
    assert_eq!(c.admission, AdmissionKind::TinyLfu);
    let c = parse_nvme(serde_json::json!({"admission": "all"})).unwrap();
    assert_eq!(c.admission, AdmissionKind::All);
    let e = parse_nvme(serde_json::json!({"admission": "lfu"})).unwrap_err();
    assert_eq!(e.context_value("key"), Some("secondary_tiers[0].admission"));
    assert!(e.to_string().contains("tinylfu"), "{e}");
    let e = parse_nvme(serde_json::json!({"admision": "tinylfu"})).unwrap_err();
    assert_eq!(e.context_value("did_you_mean"), Some("admission"));
    let e = parse_nvme(serde_json::json!({"admission": 1})).unwrap_err();
    assert_eq!(e.context_value("key"), Some("secondary_tiers[0].admission"));
}

#[test]
fn the_eviction_policy_key_takes_lru_or_arc_and_names_itself_otherwise() {
    use kvtier::config::EvictionPolicyKind;
    let c = parse_nvme(serde_json::json!({})).unwrap();
    assert_eq!(c.eviction_policy, EvictionPolicyKind::Lru, "the default");
    let c = parse_nvme(serde_json::json!({"eviction_policy": "arc"})).unwrap();
    assert_eq!(c.eviction_policy, EvictionPolicyKind::Arc);
    let c = parse_nvme(serde_json::json!({"eviction_policy": "ARC"})).unwrap();
    assert_eq!(
        c.eviction_policy,
        EvictionPolicyKind::Arc,
        "case-insensitive"
    );
    let c = parse_nvme(serde_json::json!({"eviction_policy": "lru"})).unwrap();
    assert_eq!(c.eviction_policy, EvictionPolicyKind::Lru);
    let e = parse_nvme(serde_json::json!({"eviction_policy": "lfu"})).unwrap_err();
    assert_eq!(
        e.context_value("key"),
        Some("secondary_tiers[0].eviction_policy")
    );
    assert!(e.to_string().contains("arc"), "{e}");
    let e = parse_nvme(serde_json::json!({"eviction_polcy": "arc"})).unwrap_err();
    assert_eq!(e.context_value("did_you_mean"), Some("eviction_policy"));
    let e = parse_nvme(serde_json::json!({"eviction_policy": 1})).unwrap_err();
    assert_eq!(
        e.context_value("key"),
        Some("secondary_tiers[0].eviction_policy")
    );
}

/// TinyLFU weighs a candidate against the entry the configured eviction policy would evict.
/// Four slots: keys 0 and 1 stored and looked up (estimate 2 each; ARC's T2), keys 2 and 3
/// stored (estimate 1; ARC's T1). Key 4 asked for once, then offered (estimate 2). LRU would
/// evict key 0 (the least recently used; estimate 2, a tie: rejected). ARC evicts T1's least
/// recent entry, key 2 (estimate 1): admitted, key 2 gone, key 0 kept.
#[test]
fn tinylfu_decides_against_the_victim_of_the_eviction_policy() {
    use kvtier::config::EvictionPolicyKind;
    for policy in [EvictionPolicyKind::Lru, EvictionPolicyKind::Arc] {
        let (_d, mut t) = tier_of(4, AdmissionKind::TinyLfu, |c| c.eviction_policy = policy);
        assert!(run(&mut t, job(1, &[0, 1], &[0, 1], false)).success);
        assert_eq!(lookup(&mut t, 0), LookupResult::Hit);
        assert_eq!(lookup(&mut t, 1), LookupResult::Hit);
        assert!(run(&mut t, job(2, &[2, 3], &[2, 3], false)).success);
        assert_eq!(lookup(&mut t, 4), LookupResult::Miss);
        let res = run(&mut t, job(3, &[4], &[4], false));
        assert!(res.success, "{policy:?}: {res:?}");
        if policy == EvictionPolicyKind::Arc {
            assert_eq!(res.transfer_bytes, Some(STRIDE as u64), "ARC: admitted");
            assert_eq!(lookup(&mut t, 4), LookupResult::Hit);
            assert_eq!(lookup(&mut t, 2), LookupResult::Miss, "ARC's victim");
            assert_eq!(lookup(&mut t, 0), LookupResult::Hit);
        } else {
            assert_eq!(res.transfer_bytes, Some(0), "LRU: a tie with key 0");
            assert_eq!(lookup(&mut t, 0), LookupResult::Hit);
            assert_eq!(lookup(&mut t, 2), LookupResult::Hit);
        }
        t.shutdown().unwrap();
    }
}

/// A job's keys are a prefix: a key rejected before an admitted one would end the reusable
/// prefix there, so it is admitted too. Two slots hold keys 0 and 1 (estimate 2 each: a store
/// and a lookup; LRU order 0, 1). Key 5 asked for twice (estimate 2). Job [4, 5]: key 4
/// (estimate 1) loses to key 0 (2); key 5 (3) beats key 0: admitted, and so key 4 before it.
/// Both written, keys 0 and 1 evicted; nothing counted rejected.
#[test]
fn a_key_rejected_before_an_admitted_one_is_admitted_too() {
    let (_d, mut t) = tier_of(2, AdmissionKind::TinyLfu, |_| {});
    assert!(run(&mut t, job(1, &[0, 1], &[0, 1], false)).success);
    assert_eq!(lookup(&mut t, 0), LookupResult::Hit);
    assert_eq!(lookup(&mut t, 1), LookupResult::Hit);
    assert_eq!(lookup(&mut t, 5), LookupResult::Miss);
    assert_eq!(lookup(&mut t, 5), LookupResult::Miss);
    let res = run(&mut t, job(2, &[4, 5], &[4, 5], false));
    assert!(res.success, "{res:?}");
    assert_eq!(res.transfer_bytes, Some(2 * STRIDE as u64));
    for (k, want) in [
        (4, LookupResult::Hit),
        (5, LookupResult::Hit),
        (0, LookupResult::Miss),
        (1, LookupResult::Miss),
    ] {
        assert_eq!(lookup(&mut t, k), want, "key {k}");
    }
    assert_eq!(outcome(&t, "g3_admission_blocks", "admitted"), 4.0);
    assert_eq!(outcome(&t, "g3_admission_blocks", "rejected"), 0.0);
    // Job [6, 7], both never asked for (estimate 1) against keys 4 and 5: both rejected,
    // nothing after them admitted, nothing to close.
    let res = run(&mut t, job(3, &[6, 7], &[6, 7], false));
    assert_eq!(res.transfer_bytes, Some(0));
    assert_eq!(outcome(&t, "g3_admission_blocks", "rejected"), 2.0);
    t.shutdown().unwrap();
}
