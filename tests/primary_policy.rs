//! Eviction behaviour through the tier's public API: LRU order (including request-scoped
//! recency and pins that leave recency alone) and ARC (scan resistance, adaptation of the
//! target `p`, frequency counted only for real reuse), with LRU on the same traces.

use std::sync::Arc;

use kvtier::ChunkKey;
use kvtier::config::model::EvictionPolicyKind;
use kvtier::contract::job::{LookupResult, RequestContext};
use kvtier::primary::PrimaryTier;
use kvtier::region::PrimaryRegion;

fn key(i: u32) -> ChunkKey {
    let mut b = [0xc3u8; 36];
    b[..4].copy_from_slice(&i.to_le_bytes());
    ChunkKey::new(b)
}

fn keys(r: std::ops::Range<u32>) -> Vec<ChunkKey> {
    r.map(key).collect()
}

fn tier(n: usize, policy: EvictionPolicyKind) -> PrimaryTier {
    let region = Arc::new(PrimaryRegion::create(n, 4096).expect("region"));
    PrimaryTier::new(region, policy, false)
}

fn req(name: &str) -> RequestContext {
    RequestContext::new(name)
}

/// Stores and publishes `ks`; returns the evicted keys' ids.
fn store(t: &mut PrimaryTier, ks: &[ChunkKey], r: &RequestContext) -> Vec<u32> {
    let out = t.prepare_store(ks, r).expect("store refused");
    t.complete_store(&out.keys_to_store, true);
    out.evicted_keys.iter().map(id_of).collect()
}

fn id_of(k: &ChunkKey) -> u32 {
    let b = k.as_bytes();
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// One access as the tiering manager makes it for a request: a hit is loaded (pin, unpin),
/// a miss is stored; the request then finishes. Returns whether it hit.
fn access(t: &mut PrimaryTier, k: u32) -> bool {
    let r = req(&format!("access-{k}"));
    let ks = [key(k)];
    let hit = t.lookup(&ks[0]) == LookupResult::Hit;
    if hit {
        t.prepare_load(&ks, &r).expect("load");
        t.complete_load(&ks).expect("unload");
    } else {
        store(t, &ks, &r);
    }
    t.on_request_finished(&r);
    hit
}

fn resident(t: &PrimaryTier, r: std::ops::Range<u32>) -> usize {
    r.filter(|&i| t.lookup(&key(i)) != LookupResult::Miss)
        .count()
}

#[test]
fn lru_evicts_in_insertion_order_then_touch_order() {
    let mut t = tier(4, EvictionPolicyKind::Lru);
    store(&mut t, &keys(0..4), &req("a"));
    assert_eq!(store(&mut t, &keys(4..5), &req("b")), vec![0]);
    // touch applies tail before head: key 1 ends most recent, then 3.
    t.touch(&[key(1), key(3)]);
    assert_eq!(store(&mut t, &keys(5..7), &req("c")), vec![2, 4]);
    assert_eq!(store(&mut t, &keys(7..9), &req("d")), vec![3, 1]);
    t.check_consistency().unwrap();
}

#[test]
fn lru_recency_is_committed_when_the_request_finishes() {
    let mut t = tier(3, EvictionPolicyKind::Lru);
    store(&mut t, &keys(0..3), &req("fill"));
    let r = req("reader");
    t.prepare_load(&[key(0)], &r).unwrap();
    t.complete_load(&[key(0)]).unwrap();
    // Not finished yet: key 0 is still the least recent.
    assert_eq!(store(&mut t, &keys(3..4), &req("x")), vec![0]);
    t.prepare_load(&[key(1)], &r).unwrap();
    t.complete_load(&[key(1)]).unwrap();
    t.on_request_finished(&r);
    // Key 1 was committed as most recent: 2 goes first, then 3.
    assert_eq!(store(&mut t, &keys(4..6), &req("y")), vec![2, 3]);
    // "fill", "x" and "y" never finished; "reader" was committed and forgotten.
    assert_eq!(t.open_requests(), 3);
}

#[test]
fn lru_prefix_order_keeps_the_head_longest() {
    let mut t = tier(4, EvictionPolicyKind::Lru);
    let r = req("prefix");
    store(&mut t, &keys(0..4), &r);
    t.on_request_finished(&r);
    // Committed tail before head: eviction takes the tail (3) first, the head (0) last.
    assert_eq!(store(&mut t, &keys(10..14), &req("z")), vec![3, 2, 1, 0]);
}

#[test]
fn cascade_pin_does_not_change_recency_and_pinned_keys_survive() {
    // A pinned key that eviction does not reach keeps its exact place.
    for policy in [EvictionPolicyKind::Lru, EvictionPolicyKind::Arc] {
        let mut t = tier(4, policy);
        store(&mut t, &keys(0..4), &req("fill"));
        t.prepare_read(&[key(1)]).unwrap();
        assert_eq!(store(&mut t, &keys(4..5), &req("a")), vec![0], "{policy:?}");
        t.complete_read(&[key(1)]).unwrap();
        assert_eq!(
            store(&mut t, &keys(5..7), &req("b")),
            vec![1, 2],
            "{policy:?}"
        );
    }
    for policy in [EvictionPolicyKind::Lru, EvictionPolicyKind::Arc] {
        let mut t = tier(4, policy);
        store(&mut t, &keys(0..4), &req("fill"));
        // Pin 0 (the least recent) and 2 for a cascade while two stores evict.
        t.prepare_read(&[key(0), key(2)]).unwrap();
        assert_eq!(
            store(&mut t, &keys(4..6), &req("a")),
            vec![1, 3],
            "{policy:?}"
        );
        t.complete_read(&[key(0), key(2)]).unwrap();
        // Passed over while pinned, they kept their places (vLLM: LRU rank, ARC position),
        // so the least recent of them goes first.
        assert_eq!(
            store(&mut t, &keys(6..8), &req("b")),
            vec![0, 2],
            "{policy:?}"
        );
        t.check_consistency().unwrap();
    }
}

#[test]
fn store_never_evicts_its_own_ready_keys_and_keeps_their_places() {
    let mut t = tier(4, EvictionPolicyKind::Lru);
    store(&mut t, &keys(0..4), &req("fill"));
    // Key 0 (least recent) is offered again with two new keys: 1 and 2 go, 0 stays.
    let mut ks = vec![key(0)];
    ks.extend(keys(4..6));
    let out = t.prepare_store(&ks, &req("s")).unwrap();
    assert_eq!(out.keys_to_store, keys(4..6));
    assert_eq!(out.evicted_keys, keys(1..3));
    t.complete_store(&out.keys_to_store, true);
    // Key 0 kept its place as least recent (its reuse is committed only at request end).
    assert_eq!(store(&mut t, &keys(6..7), &req("t")), vec![0]);
}

#[test]
fn arc_resists_a_scan_that_flushes_lru() {
    let (cap, hot, scan) = (100u32, 50u32, 500u32);
    let mut kept = Vec::new();
    for policy in [EvictionPolicyKind::Lru, EvictionPolicyKind::Arc] {
        let mut t = tier(cap as usize, policy);
        for _ in 0..3 {
            for k in 0..hot {
                access(&mut t, k);
            }
        }
        assert_eq!(resident(&t, 0..hot), hot as usize);
        for k in 1000..1000 + scan {
            access(&mut t, k);
        }
        kept.push(resident(&t, 0..hot));
        t.check_consistency().unwrap();
    }
    assert_eq!(kept[0], 0, "LRU: a scan of {scan} keys flushes the hot set");
    assert_eq!(kept[1], hot as usize, "ARC keeps the whole reused hot set");
}

#[test]
fn arc_beats_lru_on_a_hot_set_with_repeated_scans() {
    // Each round reads a hot set of 40 keys twice, then scans 100 fresh keys: 140 distinct
    // keys between two rounds' reads of a hot key, more than the 100 slots.
    let mut hits = Vec::new();
    for policy in [EvictionPolicyKind::Lru, EvictionPolicyKind::Arc] {
        let mut t = tier(100, policy);
        let mut h = 0;
        let mut fresh = 10_000u32;
        for _round in 0..20 {
            for _pass in 0..2 {
                for k in 0..40 {
                    h += usize::from(access(&mut t, k));
                }
            }
            for _ in 0..100 {
                h += usize::from(access(&mut t, fresh));
                fresh += 1;
            }
        }
        t.check_consistency().unwrap();
        hits.push(h);
    }
    // LRU hits only the second pass of each round; ARC keeps the hot set in T2 across scans.
    assert_eq!(hits[0], 20 * 40, "LRU");
    assert_eq!(hits[1], 40 + 19 * 80, "ARC");
}

#[test]
fn arc_target_grows_on_b1_ghost_hits() {
    let mut t = tier(8, EvictionPolicyKind::Arc);
    let p = |t: &PrimaryTier| t.policy_stats().arc.unwrap().target_t1;
    for _ in 0..2 {
        for k in 0..4 {
            access(&mut t, k); // reused: T2 = {0..3}
        }
    }
    for k in 10..20 {
        access(&mut t, k); // T1 holds 4; 10..15 evicted from T1 into B1 (up to 8 ghosts)
    }
    let s = t.policy_stats().arc.unwrap();
    assert_eq!((s.t1, s.t2, s.b1, s.b2, s.target_t1), (4, 4, 6, 0, 0.0));
    let mut last = p(&t);
    for k in [15, 14, 13] {
        assert_eq!(t.lookup(&key(k)), LookupResult::Miss);
        access(&mut t, k); // B1 ghost hit: T1 was too small
        assert!(p(&t) > last, "p did not grow on the B1 hit of {k}");
        last = p(&t);
    }
    // As in vLLM, a key stored again while its ghost is in B1 enters T1 (a later reuse
    // promotes it), and each of the three adaptations added max(1, |B2| / |B1|) = 1.
    let s = t.policy_stats().arc.unwrap();
    assert_eq!((s.t1, s.t2, s.target_t1), (4, 4, 3.0), "{s:?}");
    // B2 adaptation (and every other ARC rule) is checked against vLLM's own ARC by
    // tests/python/test_manager_vs_vllm.py.
    t.check_consistency().unwrap();
}

#[test]
fn arc_counts_only_real_reuse_as_frequency() {
    let mut t = tier(8, EvictionPolicyKind::Arc);
    let own = req("own");
    store(&mut t, &keys(0..2), &own);
    // The same request loads what it stored (e.g. after a preemption): not reuse.
    t.prepare_load(&keys(0..2), &own).unwrap();
    t.complete_load(&keys(0..2)).unwrap();
    t.on_request_finished(&own);
    assert_eq!(t.policy_stats().arc.unwrap().t2, 0);
    // Another request loads key 0 and offers key 1 to a store: both are reuse.
    let other = req("other");
    t.prepare_load(&keys(0..1), &other).unwrap();
    t.complete_load(&keys(0..1)).unwrap();
    let out = t.prepare_store(&keys(1..2), &other).unwrap();
    assert!(out.keys_to_store.is_empty());
    t.on_request_finished(&other);
    let s = t.policy_stats().arc.unwrap();
    assert_eq!((s.t1, s.t2), (0, 2));
    // An explicit touch is reuse too.
    store(&mut t, &keys(2..3), &req("x"));
    t.touch(&keys(2..3));
    assert_eq!(t.policy_stats().arc.unwrap().t2, 3);
}
