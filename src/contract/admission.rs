//! Admission to a secondary tier: which offered chunks a tier actually writes.
//!
//! Every store to an NVMe tier is a write to flash that competes with the loads on the
//! time-to-first-token path, and on real traces most prefixes are never read again. A tier
//! configured with `admission = "tinylfu"` asks a [`TinyLfu`] policy, for each key a store
//! job offers, whether the key is worth the slot it would take: the policy estimates how often
//! the tier has been asked for the key (its own lookups and the stores offered to it) and
//! admits it only when that beats the estimate of the entry the tier would evict for it
//! (TinyLFU, Einziger, Friedman and Manes, ACM TOS 2017). With a free slot nothing is evicted
//! and the key is admitted.
//!
//! The interface follows vLLM's proposed `TieringAdmissionPolicy` (RFC vllm-project/vllm
//! #51240: `should_admit`, `on_admitted`, `on_completed`, `reset`) with one difference: vLLM's
//! predicate takes a whole job in the manager, this one a key inside the tier, because the
//! tier alone knows what it holds and what it would evict, and because under vLLM's manager
//! the tier sees only its own lookups and the stores cascaded to it.
//!
//! A rejected key is not an error: the store job still succeeds (like a key the tier already
//! holds, it is skipped), its bytes are not in the job's `transfer_bytes`, and lookups of the
//! key answer MISS.

use crate::hash::KeyHasher;
use crate::key::ChunkKey;

/// Which admission policy a tier runs (config key `admission`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AdmissionKind {
    /// Every offered key is written (the behaviour without a policy).
    #[default]
    All,
    /// [`TinyLfu`]: a key is written when it is estimated more frequent than the entry it
    /// would evict.
    TinyLfu,
}

impl AdmissionKind {
    /// The config value (`"all"`, `"tinylfu"`).
    pub fn as_str(self) -> &'static str {
        match self {
            AdmissionKind::All => "all",
            AdmissionKind::TinyLfu => "tinylfu",
        }
    }

    /// Parses a config value; `None` for anything but the names of [`AdmissionKind::CHOICES`].
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "all" => Some(AdmissionKind::All),
            "tinylfu" => Some(AdmissionKind::TinyLfu),
            _ => None,
        }
    }

    /// The accepted config values.
    pub const CHOICES: [&'static str; 2] = ["all", "tinylfu"];

    /// The policy for a tier of `capacity` slots; `None` for [`AdmissionKind::All`] (nothing
    /// to ask).
    pub fn build(self, capacity: usize) -> Option<Box<dyn AdmissionPolicy>> {
        match self {
            AdmissionKind::All => None,
            AdmissionKind::TinyLfu => Some(Box::new(TinyLfu::new(capacity))),
        }
    }
}

/// A tier's admission policy. The tier calls it on the scheduler's thread, so every method
/// must return in well under a microsecond per key.
pub trait AdmissionPolicy: Send + std::fmt::Debug {
    /// Short name (`"tinylfu"`).
    fn name(&self) -> &'static str;

    /// The tier was asked for `key`: a lookup (hit or miss) or a store that offered it.
    fn record_access(&mut self, key: &ChunkKey);

    /// Whether to write `candidate`, which would take the slot of `victim` (`None`: a free
    /// slot, nothing evicted). A pure predicate: it changes nothing.
    fn should_admit(&self, candidate: &ChunkKey, victim: Option<&ChunkKey>) -> bool;

    /// The tier committed to writing `keys` (they were admitted).
    fn on_admitted(&mut self, _keys: &[ChunkKey]) {}

    /// The store of admitted `keys` finished (`success`: every key was written).
    fn on_completed(&mut self, _keys: &[ChunkKey], _success: bool) {}

    /// Forgets everything learnt (vLLM's `reset_cache`).
    fn reset(&mut self);
}

/// Counters saturate here (4 bits, as in the TinyLFU paper and Caffeine).
const MAX_COUNT: u8 = 15;
/// Rows of the count-min sketch (independent hash functions).
const ROWS: usize = 4;
/// The sketch is aged (every counter halved, the doorkeeper cleared) after this many
/// accesses per slot of the tier (the paper's sample size W = 10 x the cache size).
const SAMPLE_PER_SLOT: u64 = 10;
/// Doorkeeper bits per access of the sample: it may hold every key seen in one sample period
/// (at most `sample_size` distinct keys), with two probes about 5 % false positives when full.
const DOOR_BITS_PER_SAMPLE: usize = 8;
/// Sketch counters per row per slot of the tier.
const WIDTH_PER_SLOT: usize = 4;
/// Fewest counters per sketch row.
const MIN_WIDTH: usize = 1024;
/// Fewest doorkeeper bits.
const MIN_DOOR_BITS: usize = 8192;
/// Fixed hash seed: estimates, and so the replay's counts, are the same on every run (the keys
/// are chunk hashes the inference server computes, not chosen by an outsider).
const SEED: u64 = 0x6b76_7469_6572_4c46;

/// TinyLFU admission: a count-min sketch of 4-bit counters behind a doorkeeper bloom filter,
/// aged by halving. A key's first access sets its doorkeeper bits only, so keys seen once
/// never reach the sketch; its estimate is the sketch's minimum over its 4 counters plus
/// one if the doorkeeper holds it. After `10 x capacity` accesses every counter is halved and
/// the doorkeeper cleared, so that old popularity fades.
#[derive(Debug, Clone)]
pub struct TinyLfu {
    hasher: KeyHasher,
    /// `ROWS` rows of `width` counters, one byte each.
    counters: Vec<u8>,
    width_mask: u64,
    door: Vec<u64>,
    door_mask: u64,
    accesses: u64,
    sample_size: u64,
}

impl TinyLfu {
    /// A policy for a tier of `capacity` slots (at least one).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        // Floors keep small tiers (tests, tiny replays) nearly free of collisions.
        let sample = capacity.saturating_mul(SAMPLE_PER_SLOT as usize);
        let width = capacity
            .saturating_mul(WIDTH_PER_SLOT)
            .next_power_of_two()
            .max(MIN_WIDTH);
        let door_bits = sample
            .saturating_mul(DOOR_BITS_PER_SAMPLE)
            .next_power_of_two()
            .max(MIN_DOOR_BITS);
        TinyLfu {
            hasher: KeyHasher::with_seed(SEED),
            counters: vec![0; ROWS * width],
            width_mask: width as u64 - 1,
            door: vec![0; door_bits / 64],
            door_mask: door_bits as u64 - 1,
            accesses: 0,
            sample_size: capacity as u64 * SAMPLE_PER_SLOT,
        }
    }

    /// Accesses after which the sketch is aged.
    pub fn sample_size(&self) -> u64 {
        self.sample_size
    }

    /// The estimated number of recent accesses to `key` (saturating at 16).
    pub fn estimate(&self, key: &ChunkKey) -> u32 {
        let h = self.hasher.hash(key.as_bytes());
        let door = u32::from(self.door_contains(h));
        if door == 0 {
            // Keys enter the sketch only through the doorkeeper; a key it does not hold may
            // still collide with others in the sketch, which is ignored.
            return 0;
        }
        u32::from(self.sketch_min(h)) + door
    }

    fn cell(&self, h: u64, row: usize) -> usize {
        // One 64-bit hash gives every row's index: row r uses bits rotated by 16 r, mixed
        // with an odd constant, so the rows are independent enough for a sketch.
        let x = h.rotate_left(16 * row as u32) ^ (row as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        row * (self.width_mask as usize + 1) + ((x >> 17) & self.width_mask) as usize
    }

    fn sketch_min(&self, h: u64) -> u8 {
        (0..ROWS)
            .map(|r| self.counters[self.cell(h, r)])
            .min()
            .unwrap_or(0)
    }

    fn door_probes(&self, h: u64) -> [u64; 2] {
        [
            h & self.door_mask,
            (h >> 32 ^ h.rotate_left(23)) & self.door_mask,
        ]
    }

    fn door_contains(&self, h: u64) -> bool {
        self.door_probes(h)
            .iter()
            .all(|&b| self.door[(b / 64) as usize] & (1 << (b % 64)) != 0)
    }

    fn door_insert(&mut self, h: u64) {
        for b in self.door_probes(h) {
            self.door[(b / 64) as usize] |= 1 << (b % 64);
        }
    }

    fn increment(&mut self, h: u64) {
        // Conservative update: only the counters at the minimum grow (fewer over-estimates).
        let min = self.sketch_min(h);
        if min >= MAX_COUNT {
            return;
        }
        for r in 0..ROWS {
            let c = self.cell(h, r);
            if self.counters[c] == min {
                self.counters[c] = min + 1;
            }
        }
    }

    fn age(&mut self) {
        for c in &mut self.counters {
            *c /= 2;
        }
        self.door.fill(0);
        self.accesses = 0;
    }
}

impl AdmissionPolicy for TinyLfu {
    fn name(&self) -> &'static str {
        "tinylfu"
    }

    fn record_access(&mut self, key: &ChunkKey) {
        let h = self.hasher.hash(key.as_bytes());
        if self.door_contains(h) {
            self.increment(h);
        } else {
            self.door_insert(h);
        }
        self.accesses += 1;
        if self.accesses >= self.sample_size {
            self.age();
        }
    }

    fn should_admit(&self, candidate: &ChunkKey, victim: Option<&ChunkKey>) -> bool {
        match victim {
            None => true,
            Some(v) => self.estimate(candidate) > self.estimate(v),
        }
    }

    fn reset(&mut self) {
        self.counters.fill(0);
        self.door.fill(0);
        self.accesses = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u64) -> ChunkKey {
        ChunkKey::from(i.to_le_bytes().to_vec())
    }

    #[test]
    fn parse_names_and_refuses_others() {
        assert_eq!(AdmissionKind::parse("all"), Some(AdmissionKind::All));
        assert_eq!(
            AdmissionKind::parse("tinylfu"),
            Some(AdmissionKind::TinyLfu)
        );
        assert_eq!(AdmissionKind::parse("TinyLFU"), None);
        assert_eq!(AdmissionKind::parse("lru"), None);
        assert!(AdmissionKind::All.build(10).is_none());
        assert_eq!(AdmissionKind::TinyLfu.build(10).unwrap().name(), "tinylfu");
    }

    #[test]
    fn first_access_reaches_only_the_doorkeeper() {
        let mut p = TinyLfu::new(1000);
        assert_eq!(p.estimate(&key(1)), 0);
        p.record_access(&key(1));
        assert_eq!(p.estimate(&key(1)), 1);
        p.record_access(&key(1));
        p.record_access(&key(1));
        assert_eq!(p.estimate(&key(1)), 3);
        // Nothing else was touched.
        assert_eq!(p.estimate(&key(2)), 0);
    }

    #[test]
    fn counts_saturate_at_sixteen() {
        let mut p = TinyLfu::new(1000);
        for _ in 0..100 {
            p.record_access(&key(7));
        }
        assert_eq!(p.estimate(&key(7)), 16);
    }

    #[test]
    fn free_slot_admits_anything() {
        let p = TinyLfu::new(100);
        assert!(p.should_admit(&key(1), None));
    }

    #[test]
    fn admits_only_keys_more_frequent_than_the_victim() {
        let mut p = TinyLfu::new(1000);
        for _ in 0..3 {
            p.record_access(&key(1)); // estimate 3
        }
        p.record_access(&key(2)); // estimate 1
        assert!(p.should_admit(&key(1), Some(&key(2))));
        assert!(!p.should_admit(&key(2), Some(&key(1))));
        // A tie keeps the resident entry (nothing gained by the write).
        p.record_access(&key(3));
        assert!(!p.should_admit(&key(3), Some(&key(2))));
        // A never-seen key never displaces a seen one.
        assert!(!p.should_admit(&key(4), Some(&key(2))));
    }

    #[test]
    fn aging_halves_counts_and_clears_the_doorkeeper() {
        let mut p = TinyLfu::new(10); // sample size 100
        assert_eq!(p.sample_size(), 100);
        for _ in 0..9 {
            p.record_access(&key(1)); // door + 8 in the sketch: estimate 9
        }
        assert_eq!(p.estimate(&key(1)), 9);
        // 91 accesses to distinct keys reach the sample size: halved, door cleared.
        for i in 0..91 {
            p.record_access(&key(1000 + i));
        }
        // Sketch 8 -> 4, doorkeeper cleared: the estimate reads 0 until the key is seen again,
        // and then 4 + 1.
        assert_eq!(p.estimate(&key(1)), 0);
        p.record_access(&key(1));
        assert_eq!(p.estimate(&key(1)), 5);
    }

    #[test]
    fn reset_forgets_everything() {
        let mut p = TinyLfu::new(100);
        for _ in 0..5 {
            p.record_access(&key(1));
        }
        p.reset();
        assert_eq!(p.estimate(&key(1)), 0);
    }

    #[test]
    fn the_doorkeeper_holds_a_whole_sample_period() {
        // Up to `sample_size` distinct keys pass the doorkeeper before it is cleared; sized
        // for the tier's slots instead (an earlier version), it filled up and most keys never
        // seen estimated 1, as often as the cold entries they were weighed against.
        let mut p = TinyLfu::new(10_000);
        for i in 0..p.sample_size() - 1 {
            p.record_access(&key(i));
        }
        let false_hits = (10_000_000..10_010_000)
            .filter(|&i| p.estimate(&key(i)) > 0)
            .count();
        assert!(
            false_hits < 1_000,
            "{false_hits} of 10,000 unseen keys estimated > 0"
        );
    }

    #[test]
    fn few_false_estimates_at_capacity() {
        // A tier of 10,000 slots; 10,000 keys seen once each (below the sample size): keys
        // never seen should mostly estimate 0 (doorkeeper false positives only).
        let mut p = TinyLfu::new(10_000);
        for i in 0..10_000 {
            p.record_access(&key(i));
        }
        let false_hits = (1_000_000..1_010_000)
            .filter(|&i| p.estimate(&key(i)) > 0)
            .count();
        assert!(
            false_hits < 1_000,
            "{false_hits} of 10,000 unseen keys estimated > 0"
        );
    }
}
