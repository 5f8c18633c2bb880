//! Property test: random operation sequences on the primary tier, checked after every step
//! against a simple reference model (a map of key -> (slot, ref_cnt) with the same slot
//! allocator). The model cannot know which ready key a policy evicts, so it validates the
//! tier's choice (only `ref_cnt == 0` keys outside the store, exactly as many as needed) and
//! then follows it; everything else (refusals, chunk ids, ref counts, errors, usage, events)
//! it predicts exactly.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use kvtier::ChunkKey;
use kvtier::config::model::EvictionPolicyKind;
use kvtier::contract::job::{LookupResult, Medium, OffloadingEvent, RequestContext};
use kvtier::primary::{PrimaryTier, PrimaryUsage};
use kvtier::region::PrimaryRegion;
use proptest::prelude::*;
use proptest::sample::Index;

const CAPACITY: usize = 6;
const UNIVERSE: u8 = 16;

fn key(i: u8) -> ChunkKey {
    // 36 bytes like a sha256 block hash plus a group id; only the index varies.
    let mut b = [0x5au8; 36];
    b[3] = i;
    ChunkKey::new(b)
}

#[derive(Debug, Clone)]
enum Op {
    Store {
        keys: Vec<u8>,
        req: u8,
    },
    CompleteStore {
        picks: Vec<Index>,
        stray: Option<u8>,
        success: bool,
    },
    Load {
        picks: Vec<Index>,
        stray: Option<u8>,
        req: u8,
    },
    CompleteLoad {
        picks: Vec<Index>,
        stray: Option<u8>,
    },
    Read {
        picks: Vec<Index>,
        stray: Option<u8>,
    },
    CompleteRead {
        picks: Vec<Index>,
        stray: Option<u8>,
    },
    Touch {
        keys: Vec<u8>,
    },
    Finish {
        req: u8,
    },
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    let k = || 0..UNIVERSE;
    let picks = || prop::collection::vec(any::<Index>(), 0..4);
    let stray = || prop::option::weighted(0.2, 0..UNIVERSE);
    prop_oneof![
        6 => (prop::collection::vec(k(), 0..5), 0..3u8)
            .prop_map(|(keys, req)| Op::Store { keys, req }),
        5 => (picks(), stray(), prop::bool::weighted(0.85))
            .prop_map(|(picks, stray, success)| Op::CompleteStore { picks, stray, success }),
        3 => (picks(), stray(), 0..3u8).prop_map(|(picks, stray, req)| Op::Load { picks, stray, req }),
        3 => (picks(), stray()).prop_map(|(picks, stray)| Op::CompleteLoad { picks, stray }),
        2 => (picks(), stray()).prop_map(|(picks, stray)| Op::Read { picks, stray }),
        2 => (picks(), stray()).prop_map(|(picks, stray)| Op::CompleteRead { picks, stray }),
        1 => prop::collection::vec(k(), 0..4).prop_map(|keys| Op::Touch { keys }),
        1 => (0..3u8).prop_map(|req| Op::Finish { req }),
        1 => Just(Op::Reset),
    ]
}

/// The reference model: resident keys with their slot and ref count, and the allocator.
#[derive(Debug, Clone, PartialEq)]
struct Model {
    entries: BTreeMap<u8, (u32, i32)>,
    next_fresh: u32,
    free: Vec<u32>,
}

impl Model {
    fn alloc(&mut self) -> u32 {
        if (self.next_fresh as usize) < CAPACITY {
            self.next_fresh += 1;
            self.next_fresh - 1
        } else {
            self.free.pop().expect("model: no free slot")
        }
    }

    fn release(&mut self, k: u8) {
        let (slot, _) = self
            .entries
            .remove(&k)
            .expect("model: release of absent key");
        self.free.push(slot);
    }

    fn usage(&self) -> PrimaryUsage {
        PrimaryUsage {
            total: CAPACITY,
            used: self.entries.len(),
            pinned_for_read: self.entries.values().filter(|e| e.1 > 0).count(),
            reserved_for_write: self.entries.values().filter(|e| e.1 == -1).count(),
            evictable: self.entries.values().filter(|e| e.1 == 0).count(),
        }
    }

    fn keys_where(&self, f: impl Fn(i32) -> bool) -> Vec<u8> {
        self.entries
            .iter()
            .filter(|(_, e)| f(e.1))
            .map(|(k, _)| *k)
            .collect()
    }
}

fn event(keys: Vec<u8>, removed: bool, metadata_only: bool) -> OffloadingEvent {
    OffloadingEvent {
        keys: keys.into_iter().map(key).collect(),
        medium: Medium::Cpu,
        removed,
        locality: None,
        ownership: None,
        removal_expected: false,
        metadata_only,
    }
}

fn index_of(k: &ChunkKey) -> u8 {
    k.as_bytes()[3]
}

fn pick(from: &[u8], picks: &[Index], stray: Option<u8>) -> Vec<u8> {
    let mut v: Vec<u8> = if from.is_empty() {
        Vec::new()
    } else {
        picks.iter().map(|p| *p.get(from)).collect()
    };
    v.extend(stray);
    v
}

fn check_state(tier: &PrimaryTier, model: &Model) -> Result<(), TestCaseError> {
    if let Err(e) = tier.check_consistency() {
        return Err(TestCaseError::fail(format!("inconsistent tier: {e}")));
    }
    prop_assert_eq!(tier.usage(), model.usage());
    for i in 0..UNIVERSE {
        let k = key(i);
        match model.entries.get(&i) {
            None => {
                prop_assert_eq!(tier.lookup(&k), LookupResult::Miss);
                prop_assert_eq!(tier.chunk_id(&k), None);
            }
            Some(&(slot, r)) => {
                let want = if r == -1 {
                    LookupResult::HitPending
                } else {
                    LookupResult::Hit
                };
                prop_assert_eq!(tier.lookup(&k), want);
                prop_assert_eq!(tier.chunk_id(&k), Some(slot));
                prop_assert_eq!(tier.ref_count(&k), Some(r));
            }
        }
    }
    Ok(())
}

fn run(policy: EvictionPolicyKind, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let region = Arc::new(PrimaryRegion::create(CAPACITY, 4096).expect("region"));
    let mut tier = PrimaryTier::new(region, policy, true);
    let mut model = Model {
        entries: BTreeMap::new(),
        next_fresh: 0,
        free: Vec::new(),
    };
    let reqs: Vec<RequestContext> = (0..3)
        .map(|r| RequestContext::new(format!("req-{r}")))
        .collect();
    for op in ops {
        let mut expected_events = Vec::new();
        match op {
            Op::Store { keys, req } => {
                let ks: Vec<ChunkKey> = keys.iter().map(|&i| key(i)).collect();
                let mut new = Vec::new();
                let mut protected = Vec::new();
                for &i in &keys {
                    match model.entries.get(&i) {
                        None if !new.contains(&i) => new.push(i),
                        Some(&(_, 0)) if !protected.contains(&i) => protected.push(i),
                        _ => {}
                    }
                }
                let free = CAPACITY - model.entries.len();
                let evictable = model.keys_where(|r| r == 0).len() - protected.len();
                let to_evict = new.len().saturating_sub(free);
                let before = model.clone();
                match tier.prepare_store(&ks, &reqs[req as usize]) {
                    None => {
                        prop_assert!(to_evict > evictable, "refused with room: {keys:?}");
                        prop_assert_eq!(&model, &before);
                    }
                    Some(out) => {
                        prop_assert!(to_evict <= evictable, "accepted without room");
                        let evicted: Vec<u8> = out.evicted_keys.iter().map(index_of).collect();
                        prop_assert_eq!(evicted.len(), to_evict);
                        for &e in &evicted {
                            let r = model.entries.get(&e).map(|x| x.1);
                            prop_assert_eq!(r, Some(0), "evicted key {} was not ready", e);
                            prop_assert!(!keys.contains(&e), "evicted a protected key {}", e);
                            model.release(e);
                        }
                        let stored: Vec<u8> = out.keys_to_store.iter().map(index_of).collect();
                        prop_assert_eq!(&stored, &new);
                        for (&i, &id) in new.iter().zip(&out.chunk_ids) {
                            let slot = model.alloc();
                            prop_assert_eq!(id, slot, "slot for key {}", i);
                            model.entries.insert(i, (slot, -1));
                        }
                        if !evicted.is_empty() {
                            expected_events.push(event(evicted, true, false));
                        }
                    }
                }
            }
            Op::CompleteStore {
                picks,
                stray,
                success,
            } => {
                let ks = pick(&model.keys_where(|r| r == -1), &picks, stray);
                let mut done = Vec::new();
                for &i in &ks {
                    if model.entries.get(&i).map(|e| e.1) == Some(-1) {
                        done.push(i);
                        if success {
                            model.entries.get_mut(&i).expect("present").1 = 0;
                        } else {
                            model.release(i);
                        }
                    }
                }
                let keys: Vec<ChunkKey> = ks.iter().map(|&i| key(i)).collect();
                tier.complete_store(&keys, success);
                if !done.is_empty() {
                    expected_events.push(event(done, !success, !success));
                }
            }
            Op::Load { picks, stray, req } => {
                let ks = pick(&model.keys_where(|r| r >= 0), &picks, stray);
                let keys: Vec<ChunkKey> = ks.iter().map(|&i| key(i)).collect();
                let got = tier.prepare_load(&keys, &reqs[req as usize]);
                check_pin(&mut model, &ks, got)?;
            }
            Op::Read { picks, stray } => {
                let ks = pick(&model.keys_where(|r| r >= 0), &picks, stray);
                let keys: Vec<ChunkKey> = ks.iter().map(|&i| key(i)).collect();
                let got = tier.prepare_read(&keys);
                check_pin(&mut model, &ks, got)?;
            }
            Op::CompleteLoad { picks, stray } => {
                let ks = pick(&model.keys_where(|r| r > 0), &picks, stray);
                let keys: Vec<ChunkKey> = ks.iter().map(|&i| key(i)).collect();
                let got = tier.complete_load(&keys);
                check_unpin(&mut model, &ks, got)?;
            }
            Op::CompleteRead { picks, stray } => {
                let ks = pick(&model.keys_where(|r| r > 0), &picks, stray);
                let keys: Vec<ChunkKey> = ks.iter().map(|&i| key(i)).collect();
                let got = tier.complete_read(&keys);
                check_unpin(&mut model, &ks, got)?;
            }
            Op::Touch { keys } => {
                let ks: Vec<ChunkKey> = keys.iter().map(|&i| key(i)).collect();
                tier.touch(&ks);
            }
            Op::Finish { req } => tier.on_request_finished(&reqs[req as usize]),
            Op::Reset => {
                let mut ready: Vec<(u32, u8)> = model
                    .entries
                    .iter()
                    .filter(|(_, e)| e.1 == 0)
                    .map(|(k, e)| (e.0, *k))
                    .collect();
                ready.sort_unstable();
                let n = tier.reset_cache();
                prop_assert_eq!(n, ready.len());
                for &(_, k) in &ready {
                    model.release(k);
                }
                if !ready.is_empty() {
                    expected_events.push(event(ready.iter().map(|x| x.1).collect(), true, false));
                }
            }
        }
        prop_assert_eq!(tier.take_events(), expected_events);
        check_state(&tier, &model)?;
    }
    Ok(())
}

/// Pinning succeeds iff every key is resident and ready; then each listed key gains a pin.
fn check_pin(
    model: &mut Model,
    ks: &[u8],
    got: kvtier::Result<Vec<u32>>,
) -> Result<(), TestCaseError> {
    let ok = ks
        .iter()
        .all(|i| model.entries.get(i).is_some_and(|e| e.1 >= 0));
    match got {
        Ok(ids) => {
            prop_assert!(ok, "pinned {:?} but the model refuses", ks);
            for (i, id) in ks.iter().zip(ids) {
                let e = model.entries.get_mut(i).expect("present");
                prop_assert_eq!(id, e.0);
                e.1 += 1;
            }
        }
        Err(e) => {
            prop_assert!(!ok, "refused to pin {:?}: {}", ks, e);
            prop_assert_eq!(e.kind(), kvtier::ErrorKind::Contract);
        }
    }
    Ok(())
}

/// Unpinning succeeds iff every key is pinned at least as many times as it is listed.
fn check_unpin(model: &mut Model, ks: &[u8], got: kvtier::Result<()>) -> Result<(), TestCaseError> {
    let mut need: HashMap<u8, i32> = HashMap::new();
    for &i in ks {
        *need.entry(i).or_default() += 1;
    }
    let ok = need
        .iter()
        .all(|(i, n)| model.entries.get(i).is_some_and(|e| e.1 >= *n));
    match got {
        Ok(()) => {
            prop_assert!(ok, "unpinned {:?} but the model refuses", ks);
            for (i, n) in need {
                model.entries.get_mut(&i).expect("present").1 -= n;
            }
        }
        Err(e) => {
            prop_assert!(!ok, "refused to unpin {:?}: {}", ks, e);
            prop_assert_eq!(e.kind(), kvtier::ErrorKind::Contract);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn lru_matches_model(ops in prop::collection::vec(op(), 1..60)) {
        run(EvictionPolicyKind::Lru, ops)?;
    }

    #[test]
    fn arc_matches_model(ops in prop::collection::vec(op(), 1..60)) {
        run(EvictionPolicyKind::Arc, ops)?;
    }
}
