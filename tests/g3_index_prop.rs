//! Property test: random store / load / failure sequences on the index, journaled the way the
//! worker journals them, always recover to the same committed entries, and the index always
//! agrees with a simple model.

use std::collections::HashMap;

use kvtier::g3::index::{Index, Slot, SlotState};
use kvtier::g3::index_dir::IndexDir;
use kvtier::g3::journal::{FILE_HEADER_SIZE, JournalWriter};
use kvtier::g3::record::{Record, RecordCodec, decode_records};
use kvtier::key::ChunkKey;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Store(u8),
    StoreFails(u8),
    Load(u8),
    LoadFails(u8),
    PinThenStore(u8, u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..24).prop_map(Op::Store),
        1 => (0u8..24).prop_map(Op::StoreFails),
        3 => (0u8..24).prop_map(Op::Load),
        1 => (0u8..24).prop_map(Op::LoadFails),
        1 => (0u8..24, 0u8..24).prop_map(|(a, b)| Op::PinThenStore(a, b)),
    ]
}

fn k(i: u8) -> ChunkKey {
    ChunkKey::new([i, 0xAB])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn journal_replay_matches_live_index(ops in proptest::collection::vec(op(), 1..120), slots in 1u32..10) {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let mut ix = Index::new(slots, 2);
        let index_dir = IndexDir::open(dir.path()).unwrap();
        let mut j = JournalWriter::create(&index_dir, [1; 16], 0).unwrap();
        let mut model: HashMap<ChunkKey, (Slot, u32)> = HashMap::new();
        let mut generation = 1u64;
        let mut store = |ix: &mut Index, j: &mut JournalWriter, model: &mut HashMap<_, _>, key: ChunkKey, ok: bool| {
            if ix.is_held(&key) {
                return;
            }
            let Some(r) = ix.reserve(&key) else { return };
            if let Some((old, s)) = r.evicted {
                j.remove(s);
                model.remove(&old);
            }
            if ok {
                let crc = u32::from(key.as_bytes()[0]) * 7;
                j.insert(&key, r.slot, crc, generation);
                ix.commit(r.slot, crc, generation);
                generation += 1;
                model.insert(key, (r.slot, crc));
            } else {
                ix.abort(r.slot);
            }
        };
        for o in ops {
            match o {
                Op::Store(i) => store(&mut ix, &mut j, &mut model, k(i), true),
                Op::StoreFails(i) => store(&mut ix, &mut j, &mut model, k(i), false),
                Op::Load(i) => {
                    if let Some((s, crc)) = ix.pin(&k(i)) {
                        prop_assert_eq!(model.get(&k(i)), Some(&(s, crc)));
                        ix.unpin(s);
                    } else {
                        prop_assert!(!model.contains_key(&k(i)));
                    }
                }
                Op::LoadFails(i) => {
                    if let Some((s, _)) = ix.pin(&k(i)) {
                        prop_assert_eq!(ix.drop_slot(s), Some(k(i)));
                        j.remove(s);
                        ix.unpin(s);
                        model.remove(&k(i));
                        prop_assert_eq!(ix.state(s), Some(SlotState::Free));
                    }
                }
                Op::PinThenStore(a, b) => {
                    // A slot being read is never chosen for eviction.
                    let pinned = ix.pin(&k(a));
                    store(&mut ix, &mut j, &mut model, k(b), true);
                    if let Some((s, _)) = pinned {
                        if a != b {
                            prop_assert!(ix.is_valid(&k(a)), "pinned key evicted");
                        }
                        ix.unpin(s);
                    }
                }
            }
            prop_assert_eq!(ix.len(), model.len());
            prop_assert_eq!(ix.len() + ix.free_slots(), slots as usize);
            for key in model.keys() {
                prop_assert!(ix.is_valid(key));
            }
        }
        j.flush(false).unwrap();
        let bytes = std::fs::read(j.path()).unwrap();
        let mut replay = Index::new(slots, 2);
        let decoded = decode_records(&RecordCodec::new([1; 16]), &bytes[FILE_HEADER_SIZE..], FILE_HEADER_SIZE as u64);
        prop_assert!(decoded.skipped.is_empty() && decoded.tail.is_none());
        for r in decoded.records {
            match r {
                Record::Insert { key, slot, crc, generation } => { replay.apply_insert(key, slot, crc, generation); }
                Record::Remove { slot } => { replay.apply_remove(slot); }
            }
        }
        replay.finish_recovery();
        let mut live = ix.entries_lru_first();
        let mut rec = replay.entries_lru_first();
        live.sort_by_key(|e| e.slot);
        rec.sort_by_key(|e| e.slot);
        prop_assert_eq!(live, rec);
        prop_assert_eq!(replay.free_slots(), ix.free_slots());
    }
}
