//! `kvtier replay` on small generated traces whose outcome is worked out by hand (in the
//! comments) from the rules the replay follows: prefix lookups (primary first, then the tier;
//! the first miss ends the reusable prefix), promotions into the primary, computed blocks
//! stored in the primary (LRU) and cascaded to the G3 tier (LRU), and the TinyLFU rule for
//! `--admission tinylfu` (a key's estimate counts the tier's lookups of it and the stores that
//! offered it; admitted into a free slot, or when its estimate beats the LRU entry's), and
//! ARC's rules for `--tier-eviction arc`.

mod cli_common;

use cli_common::{assert_success, json, kvtier};

/// A trace of single-or-more-block requests, every block full (512 tokens each).
fn trace(requests: &[&[u64]]) -> tempfile::NamedTempFile {
    let mut text = String::new();
    for (i, ids) in requests.iter().enumerate() {
        let ids: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
        text.push_str(&format!(
            "{{\"timestamp\": {}, \"input_length\": {}, \"output_length\": 1, \"hash_ids\": [{}]}}\n",
            i * 10,
            ids.len() * 512,
            ids.join(", ")
        ));
    }
    let mut f = tempfile::NamedTempFile::new().unwrap();
    std::io::Write::write_all(&mut f, text.as_bytes()).unwrap();
    f
}

fn replay(
    t: &tempfile::NamedTempFile,
    primary: &str,
    tier: &str,
    admission: &str,
) -> serde_json::Value {
    replay_evicting(t, primary, tier, admission, "lru")
}

fn replay_evicting(
    t: &tempfile::NamedTempFile,
    primary: &str,
    tier: &str,
    admission: &str,
    eviction: &str,
) -> serde_json::Value {
    let path = t.path().to_str().unwrap();
    let out = kvtier(&[
        "replay",
        "--trace",
        path,
        "--bytes-per-block",
        "4KiB",
        "--primary",
        primary,
        "--tier-capacity",
        tier,
        "--admission",
        admission,
        "--tier-eviction",
        eviction,
        "--path",
        "/tmp",
        "--json",
    ]);
    assert_success(&out);
    json(&out)
}

fn n(v: &serde_json::Value, k: &str) -> u64 {
    v[k].as_u64()
        .unwrap_or_else(|| panic!("{k} missing in {v}"))
}

#[test]
fn admit_all_replay_counts_what_the_rules_say() {
    // Primary 2 blocks, tier 4 slots.
    // R1 [1,2]: both miss; computed; P {1,2}; tier {1,2}.                 written 2
    // R2 [3,4]: both miss; computed; P {3,4}; tier {1,2,3,4}.             written 4
    // R3 [1,2,5]: 1 and 2 miss in P, hit in the tier (promoted, verified);
    //             5 misses everywhere: computed; tier full, evicts its LRU entry 3
    //             (1 and 2 were just looked up): tier {4,1,2,5}.          written 5, read 2
    // R4 [3]: misses in P and tier: computed; tier evicts 4.              written 6
    let t = trace(&[&[1, 2], &[3, 4], &[1, 2, 5], &[3]]);
    let v = replay(&t, "8KiB", "16KiB", "all");
    assert_eq!(n(&v, "requests"), 4);
    assert_eq!(n(&v, "block_references"), 8);
    assert_eq!(n(&v, "unique_blocks"), 5);
    assert_eq!(n(&v, "primary_blocks"), 2);
    assert_eq!(n(&v, "tier_blocks"), 4);
    assert_eq!(n(&v, "served_primary"), 0);
    assert_eq!(n(&v, "served_tier"), 2);
    assert_eq!(n(&v, "recomputed"), 6);
    assert_eq!(n(&v, "prefill_tokens_saved"), 2 * 512);
    assert_eq!(n(&v, "nvme_bytes_written"), 6 * 4096);
    assert_eq!(n(&v, "nvme_bytes_read"), 2 * 4096);
    assert_eq!(n(&v, "bytes_verified"), 2 * 4096);
    assert_eq!(v["write_amplification"].as_f64(), Some(3.0));
    assert_eq!(n(&v, "load_failures"), 0);
}

/// The trace both admission tests replay: primary 1 block, tier 2 slots.
const SEQUENCE: &[&[u64]] = &[&[1], &[2], &[3], &[3], &[4], &[3], &[3], &[1], &[3]];

#[test]
fn tinylfu_replay_counts_what_the_rules_say() {
    // e(k) = the tier's accesses of k so far (lookups that reached it, stores offering it).
    // R1 [1]: lookup (e1=1), miss; store offers 1 (e1=2), free slot: admitted. tier {1}
    // R2 [2]: lookup (e2=1); offered (e2=2), free slot: admitted.     tier {1,2} (LRU 1)
    // R3 [3]: lookup (e3=1); offered (e3=2) vs LRU 1 (e1=2): rejected.
    // R4 [3]: primary hit (3 is the primary's one block).
    // R5 [4]: lookup (e4=1); offered (e4=2) vs 1 (2): rejected.       primary {4}
    // R6 [3]: primary miss; lookup (e3=3) misses; offered (e3=4) vs 1 (2): admitted,
    //         1 evicted.                                               tier {2,3}
    // R7 [3]: primary hit.
    // R8 [1]: lookup (e1=3) misses; offered (e1=4) vs LRU 2 (e2=2): admitted. tier {3,1}
    // R9 [3]: primary miss (it holds 1); tier hit: promoted and verified.
    // Served: primary 2 (R4, R7), tier 1 (R9); computed 6; 4 admitted, 2 rejected.
    let t = trace(SEQUENCE);
    let v = replay(&t, "4KiB", "8KiB", "tinylfu");
    assert_eq!(n(&v, "block_references"), 9);
    assert_eq!(n(&v, "served_primary"), 2);
    assert_eq!(n(&v, "served_tier"), 1);
    assert_eq!(n(&v, "recomputed"), 6);
    assert_eq!(n(&v, "admitted_blocks"), 4);
    assert_eq!(n(&v, "rejected_blocks"), 2);
    assert_eq!(n(&v, "unchecked_blocks"), 0);
    assert_eq!(n(&v, "nvme_bytes_written"), 4 * 4096);
    assert_eq!(n(&v, "nvme_bytes_read"), 4096);
    assert_eq!(v["admission"], "tinylfu");
}

#[test]
fn admit_all_on_the_same_sequence_serves_more_and_writes_more() {
    // R1, R2: tier {1,2}. R3 [3]: written, evicts 1: {2,3}. R4: primary hit.
    // R5 [4]: written, evicts 2: {3,4}. R6 [3]: tier hit (3 becomes most recent).
    // R7: primary hit. R8 [1]: written, evicts 4: {3,1}. R9 [3]: tier hit.
    // Served: primary 2, tier 2; computed 5; written 1,2,3,4,1 = 5 blocks; read 2.
    let t = trace(SEQUENCE);
    let v = replay(&t, "4KiB", "8KiB", "all");
    assert_eq!(n(&v, "served_primary"), 2);
    assert_eq!(n(&v, "served_tier"), 2);
    assert_eq!(n(&v, "recomputed"), 5);
    assert_eq!(n(&v, "nvme_bytes_written"), 5 * 4096);
    assert_eq!(n(&v, "nvme_bytes_read"), 2 * 4096);
    assert_eq!(n(&v, "admitted_blocks"), 0);
}

/// Primary 1 block, tier 3 slots, admit-all. ARC (T1: stored, not served yet; T2: served by
/// the tier; p = 0 throughout, as no ghost is hit) against LRU:
/// R1 [1], R2 [2]: computed, stored: T1 [2 1].                           P {2}
/// R3 [1]: primary miss, tier hit: T2 [1], T1 [2].                          P {1}
/// R4 [3]: computed, free slot: T1 [3 2].                                  P {3}
/// R5 [2]: primary miss, tier hit: T2 [2 1], T1 [3]. LRU order: 1 3 2.      P {2}
/// R6 [4]: computed; full. ARC: |T1| = 1 > p: evicts T1's 3; LRU evicts 1.  P {4}
/// R7 [1]: primary miss. ARC: tier hit. LRU: miss, computed, stored (evicts 3).
/// ARC: tier 3 served, 4 computed, 4 written. LRU: tier 2, 5 computed, 5 written.
#[test]
fn arc_keeps_the_blocks_the_tier_served() {
    let t = trace(&[&[1], &[2], &[1], &[3], &[2], &[4], &[1]]);
    let v = replay_evicting(&t, "4KiB", "12KiB", "all", "arc");
    assert_eq!(v["tier_eviction"], "arc");
    assert_eq!(n(&v, "served_primary"), 0);
    assert_eq!(n(&v, "served_tier"), 3);
    assert_eq!(n(&v, "recomputed"), 4);
    assert_eq!(n(&v, "nvme_bytes_written"), 4 * 4096);
    assert_eq!(n(&v, "nvme_bytes_read"), 3 * 4096);
    let v = replay_evicting(&t, "4KiB", "12KiB", "all", "lru");
    assert_eq!(v["tier_eviction"], "lru");
    assert_eq!(n(&v, "served_primary"), 0);
    assert_eq!(n(&v, "served_tier"), 2);
    assert_eq!(n(&v, "recomputed"), 5);
    assert_eq!(n(&v, "nvme_bytes_written"), 5 * 4096);
    assert_eq!(n(&v, "nvme_bytes_read"), 2 * 4096);
}

#[test]
fn capacities_as_shares_and_bad_flags() {
    let t = trace(&[&[1, 2], &[3, 4]]);
    // 4 unique blocks: 50 % is 2 blocks, 25 % one.
    let v = replay(&t, "25%", "50%", "all");
    assert_eq!(n(&v, "primary_blocks"), 1);
    assert_eq!(n(&v, "tier_blocks"), 2);
    let path = t.path().to_str().unwrap();
    for (flag, value, needle) in [
        ("--admission", "lfu", "--admission"),
        ("--tier-eviction", "lfu", "--tier-eviction"),
        ("--bytes-per-block", "1000", "--bytes-per-block"),
        ("--tier-capacity", "0%", "--tier-capacity"),
        ("--fsync", "sometimes", "--fsync"),
        ("--time-scale=-1", "", "--time-scale"),
    ] {
        let mut argv = vec!["replay", "--trace", path, flag];
        if !value.is_empty() {
            argv.push(value);
        }
        let out = kvtier(&argv);
        cli_common::assert_user_error(&out, needle);
    }
    let out = kvtier(&["replay", "--trace", "/nonexistent/trace.jsonl"]);
    cli_common::assert_user_error(&out, "/nonexistent/trace.jsonl");
}
