//! The primary tier's API contract: error cases (contract violations refuse and change
//! nothing), store edge cases, events, usage, reset and the memory bound.

use std::sync::Arc;

use kvtier::config::model::EvictionPolicyKind;
use kvtier::contract::job::{LookupResult, Medium, RequestContext};
use kvtier::primary::{PrimaryTier, PrimaryUsage};
use kvtier::region::PrimaryRegion;
use kvtier::{ChunkKey, ErrorKind};

fn key(i: u32) -> ChunkKey {
    let mut b = [0x11u8; 36];
    b[..4].copy_from_slice(&i.to_le_bytes());
    ChunkKey::new(b)
}

fn keys(r: std::ops::Range<u32>) -> Vec<ChunkKey> {
    r.map(key).collect()
}

fn tier(n: usize, events: bool) -> PrimaryTier {
    let region = Arc::new(PrimaryRegion::create(n, 4096).expect("region"));
    PrimaryTier::new(region, EvictionPolicyKind::Lru, events)
}

fn req() -> RequestContext {
    RequestContext::new("r")
}

fn usage(total: usize, used: usize, pinned: usize, reserved: usize) -> PrimaryUsage {
    PrimaryUsage {
        total,
        used,
        pinned_for_read: pinned,
        reserved_for_write: reserved,
        evictable: used - pinned - reserved,
    }
}

#[test]
fn pin_errors_name_the_key_and_change_nothing() {
    let mut t = tier(4, false);
    let out = t.prepare_store(&keys(0..2), &req()).unwrap();
    t.complete_store(&keys(0..1), true); // key 1 stays in flight
    let absent = key(9);

    let e = t
        .prepare_load(&[key(0), absent.clone()], &req())
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Contract);
    assert!(e.to_string().contains(&absent.to_hex()), "{e}");
    assert_eq!(t.ref_count(&key(0)), Some(0), "the good key was not pinned");

    let e = t.prepare_read(&[key(1)]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Contract);
    assert!(e.to_string().contains("in flight"), "{e}");

    let e = t.complete_load(&[key(0)]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Contract);
    assert!(e.to_string().contains("not pinned"), "{e}");

    // Pinned once, released twice in one call: refused as a whole.
    t.prepare_read(&[key(0)]).unwrap();
    let e = t.complete_read(&[key(0), key(0)]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Contract);
    assert_eq!(t.ref_count(&key(0)), Some(1));
    assert_eq!(
        t.complete_read(&[absent]).unwrap_err().kind(),
        ErrorKind::Contract
    );
    assert_eq!(
        t.complete_load(&[key(1)]).unwrap_err().kind(),
        ErrorKind::Contract
    );
    t.complete_read(&[key(0)]).unwrap();

    assert_eq!(t.usage(), usage(4, 2, 0, 1));
    assert_eq!(out.chunk_ids, vec![0, 1]);
    assert_eq!(t.counters().contract_violations, 6);
    t.check_consistency().unwrap();
}

#[test]
fn double_pins_count_and_release_separately() {
    let mut t = tier(2, false);
    t.prepare_store(&keys(0..1), &req()).unwrap();
    t.complete_store(&keys(0..1), true);
    t.prepare_load(&[key(0), key(0)], &req()).unwrap();
    t.prepare_read(&[key(0)]).unwrap();
    assert_eq!(t.ref_count(&key(0)), Some(3));
    assert_eq!(t.usage().pinned_for_read, 1);
    t.complete_load(&[key(0), key(0)]).unwrap();
    assert_eq!(t.usage().pinned_for_read, 1);
    t.complete_read(&[key(0)]).unwrap();
    assert_eq!(t.usage(), usage(2, 1, 0, 0));
    t.check_consistency().unwrap();
}

#[test]
fn stray_and_duplicate_completions_are_ignored() {
    let mut t = tier(2, true);
    t.prepare_store(&keys(0..1), &req()).unwrap();
    t.complete_store(&[key(0), key(0), key(5)], true);
    assert_eq!(t.counters().contract_violations, 2);
    assert_eq!(t.counters().stored, 1);
    let ev = t.take_events();
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].keys, vec![key(0)]);
    // A failure report for a published key does not remove it.
    t.complete_write(&[key(0)], false);
    assert_eq!(t.lookup(&key(0)), LookupResult::Hit);
    assert!(t.take_events().is_empty());
    t.check_consistency().unwrap();
}

#[test]
fn store_skips_present_keys_and_duplicates() {
    let mut t = tier(64, false);
    t.prepare_store(&keys(0..2), &req()).unwrap();
    t.complete_store(&keys(0..1), true);
    // 0 ready (reuse), 1 in flight (ignored), 2 new twice.
    let out = t
        .prepare_store(&[key(0), key(1), key(2), key(2)], &req())
        .unwrap();
    assert_eq!(out.keys_to_store, vec![key(2)]);
    assert_eq!(out.chunk_ids, vec![2]);
    // A large batch (the hash-set path) with every key twice.
    let mut big = keys(100..130);
    big.extend(keys(100..130));
    let out = t.prepare_store(&big, &req()).unwrap();
    assert_eq!(out.keys_to_store, keys(100..130));
    // Nothing to store: an empty output, not a refusal.
    let out = t.prepare_store(&[], &req()).unwrap();
    assert!(out.keys_to_store.is_empty() && out.evicted_keys.is_empty());
    assert_eq!(t.lookup(&key(1)), LookupResult::HitPending);
    t.check_consistency().unwrap();
}

#[test]
fn keys_of_any_length_are_distinct() {
    let mut t = tier(8, false);
    let ks: Vec<ChunkKey> = [&b""[..], b"\0", b"\0\0", &[7u8; 100], &[7u8; 99]]
        .iter()
        .map(ChunkKey::new)
        .collect();
    let out = t.prepare_store(&ks, &req()).unwrap();
    assert_eq!(out.keys_to_store.len(), 5);
    t.complete_store(&ks, true);
    for (i, k) in ks.iter().enumerate() {
        assert_eq!(t.chunk_id(k), Some(i as u32));
    }
    t.check_consistency().unwrap();
}

#[test]
fn refused_store_changes_nothing() {
    let mut t = tier(3, true);
    t.prepare_store(&keys(0..3), &req()).unwrap();
    t.complete_store(&keys(0..2), true);
    t.prepare_read(&keys(0..1)).unwrap();
    t.take_events();
    // One evictable slot (key 1); two new keys need two.
    let before = (t.usage(), t.policy_stats());
    assert!(t.prepare_store(&keys(5..7), &req()).is_none());
    // Key 1 is the only evictable entry, and it is protected by being in the store.
    assert!(t.prepare_store(&[key(1), key(5)], &req()).is_none());
    assert_eq!((t.usage(), t.policy_stats()), before);
    assert!(t.take_events().is_empty());
    assert_eq!(t.counters().stores_refused, 2);
    assert_eq!(t.counters().evicted, 0);
    for i in 0..3 {
        assert_ne!(t.lookup(&key(i)), LookupResult::Miss);
    }
    // One new key fits by evicting key 1.
    let out = t.prepare_write(&keys(5..6), &req()).unwrap();
    assert_eq!(out.evicted_keys, vec![key(1)]);
    assert_eq!(out.chunk_ids, vec![1], "the evicted row is reused");
    t.check_consistency().unwrap();
}

#[test]
fn events_follow_state_changes() {
    let mut t = tier(2, true);
    t.prepare_store(&keys(0..2), &req()).unwrap();
    assert!(t.take_events().is_empty(), "reservation is not an event");
    t.complete_store(&keys(0..1), true);
    t.complete_store(&keys(1..2), false);
    let ev = t.take_events();
    assert_eq!(ev.len(), 2);
    assert_eq!((ev[0].removed, ev[0].metadata_only), (false, false));
    assert_eq!(ev[0].keys, vec![key(0)]);
    assert_eq!((ev[1].removed, ev[1].metadata_only), (true, true));
    assert_eq!(ev[1].keys, vec![key(1)]);
    for e in &ev {
        assert_eq!(e.medium, Medium::Cpu);
        assert_eq!(e.ownership, None);
        assert!(!e.removal_expected);
    }
    // Failed slot 1 is free again; filling and overflowing evicts key 0 with an event.
    t.prepare_store(&keys(2..3), &req()).unwrap();
    t.complete_store(&keys(2..3), true);
    t.take_events();
    t.prepare_store(&keys(3..4), &req()).unwrap();
    let ev = t.take_events();
    assert_eq!(ev.len(), 1);
    assert_eq!((ev[0].removed, ev[0].metadata_only), (true, false));
    assert_eq!(ev[0].keys, vec![key(0)]);

    let mut quiet = tier(1, false);
    quiet.prepare_store(&keys(0..1), &req()).unwrap();
    quiet.complete_store(&keys(0..1), true);
    quiet.prepare_store(&keys(1..2), &req()).unwrap();
    assert!(quiet.take_events().is_empty());
}

#[test]
fn reset_drops_only_ready_unpinned_entries() {
    for policy in [EvictionPolicyKind::Lru, EvictionPolicyKind::Arc] {
        let region = Arc::new(PrimaryRegion::create(4, 4096).unwrap());
        let mut t = PrimaryTier::new(region, policy, true);
        t.prepare_store(&keys(0..4), &req()).unwrap();
        t.complete_store(&keys(0..3), true);
        t.prepare_load(&keys(0..1), &req()).unwrap();
        t.take_events();
        assert_eq!(t.reset_cache(), 2);
        let ev = t.take_events();
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].keys, keys(1..3));
        assert!(ev[0].removed && !ev[0].metadata_only);
        assert_eq!(t.usage(), usage(4, 2, 1, 1));
        // Outstanding calls still balance.
        t.complete_load(&keys(0..1)).unwrap();
        t.complete_store(&keys(3..4), true);
        assert_eq!(t.lookup(&key(1)), LookupResult::Miss);
        assert_eq!(t.lookup(&key(3)), LookupResult::Hit);
        let s = t.policy_stats();
        if let Some(a) = s.arc {
            assert_eq!((a.b1, a.b2, a.target_t1), (0, 0, 0.0));
        }
        assert_eq!(t.counters().reset_dropped, 2);
        t.check_consistency().unwrap();
    }
}

#[test]
fn memory_per_chunk_is_bounded_plus_the_key() {
    // Keys of up to 36 bytes live inside the 48-byte slot: the footprint includes them.
    for policy in [EvictionPolicyKind::Lru, EvictionPolicyKind::Arc] {
        let region = Arc::new(PrimaryRegion::create(1000, 4096).unwrap());
        let t = PrimaryTier::new(region, policy, false);
        let m = t.memory_footprint();
        assert_eq!(m.slots, 1000);
        assert_eq!(m.slot_table_bytes, 48 * 1251 + 4 * 1000);
        // ARC keeps up to `capacity` ghosts in each of B1 and B2, as vLLM 0.33.0 does: two
        // ghost nodes (17 bytes each) and their index buckets per slot come on top.
        let bound = match policy {
            EvictionPolicyKind::Lru => 64.0,
            EvictionPolicyKind::Arc => 64.0 + 48.0,
        };
        assert!(m.bytes_per_chunk() - 36.0 <= bound, "{policy:?}: {m:?}");
    }
}

#[test]
fn with_policy_rejects_a_mismatched_capacity() {
    let region = Arc::new(PrimaryRegion::create(4, 4096).unwrap());
    let policy = kvtier::primary::policy::build_policy(EvictionPolicyKind::Arc, 5);
    let e = PrimaryTier::with_policy(Arc::clone(&region), policy, false).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    let policy = kvtier::primary::policy::build_policy(EvictionPolicyKind::Arc, 4);
    let t = PrimaryTier::with_policy(region, policy, false).unwrap();
    assert_eq!((t.num_chunks(), t.policy_name()), (4, "arc"));
    assert_eq!(t.region().num_rows(), 4);
}

#[test]
fn lookup_many_agrees_with_lookup() {
    let mut t = tier(64, false);
    t.prepare_store(&keys(0..40), &req()).unwrap();
    t.complete_store(&keys(0..20), true);
    let probe: Vec<ChunkKey> = (0..50).rev().map(key).collect();
    let mut out = vec![LookupResult::Retry];
    t.lookup_many(&probe, &mut out);
    assert_eq!(out.len(), 51);
    let single: Vec<LookupResult> = probe.iter().map(|k| t.lookup(k)).collect();
    assert_eq!(&out[1..], &single[..]);
    assert_eq!(out[50], LookupResult::Hit);
    assert_eq!(out[20], LookupResult::HitPending);
    assert_eq!(out[1], LookupResult::Miss);
}

#[test]
fn tier_is_send() {
    fn assert_send<T: Send>(_: &T) {}
    let t = tier(1, false);
    assert_send(&t);
    // Moving it to another thread and back keeps it usable.
    let t = std::thread::spawn(move || t).join().unwrap();
    assert_eq!(t.num_chunks(), 1);
}
