//! The service's DRAM staging pool (`service.dram_bytes`, KVCR's "local G2"): copies of G3
//! chunks in the service's own memory, shared by every engine.
//!
//! * A chunk loaded from G3 for one engine is copied into the pool, so the next engine that
//!   loads it is served by a copy from DRAM into its row, with no G3 read.
//! * A hint (`HINT`) reads the request's chunks from G3 into the pool before the request's
//!   loads arrive ([`crate::node::prefetch`]); its chunks stay (are not evicted) while a hint
//!   holds them, and the ones the request did not load are discarded when it finishes.
//! * Otherwise the least recently used chunk that no load is copying and no hint holds is
//!   evicted when a slot is needed.
//!
//! Slots are rows of one memfd mapping ([`PrimaryRegion`]): page-aligned, each one row of
//! the service's row stride. Every staged copy carries the CRC-32 its bytes had when G3's
//! indexed CRC vouched for them (checked on the way in: a copy whose bytes do not match is
//! not kept). A load served from the pool checks the copy's CRC against it before copying
//! it out and falls back to G3 for a key that does not match, so a damaged copy can cost a
//! G3 read, never wrong bytes. The copy into an engine's row is the caller's
//! ([`StagingPool::copy_out_with`]); the node service makes it a kernel copy from the pool's
//! memfd (`crate::node::region_file`), so that a row the engine's file lost fails the copy
//! instead of raising `SIGBUS`.
//!
//! Concurrency: the pool's state is one mutex; bytes are copied outside it. A slot being
//! filled is owned by its filler; a slot being copied out has a reader count and is never
//! evicted, discarded or reused until the count is back at 0.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::Result;
use crate::key::ChunkKey;
use crate::node::events::EventBus;
use crate::node::protocol::EventMedium;
use crate::region::{PrimaryRegion, RowWrite};

/// How long a load waits for a chunk a prefetch is still reading before it reads G3 itself.
pub const FILL_WAIT: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    /// Its filler writes the bytes.
    Filling,
    /// Holds the key's bytes with `crc`.
    Ready,
}

#[derive(Debug)]
struct Slot {
    key: Option<ChunkKey>,
    state: SlotState,
    crc: u32,
    /// Loads copying out of it now.
    readers: u32,
    /// Hints holding it.
    holds: u32,
    /// A load copied it since it was staged.
    used: bool,
    /// Free it once its filler or last reader is done (discarded or failed its CRC).
    doomed: bool,
    /// Its place in the LRU order (Ready slots only).
    tick: u64,
}

impl Slot {
    fn empty() -> Slot {
        Slot {
            key: None,
            state: SlotState::Free,
            crc: 0,
            readers: 0,
            holds: 0,
            used: false,
            doomed: false,
            tick: 0,
        }
    }
}

#[derive(Debug)]
struct State {
    map: HashMap<ChunkKey, usize>,
    slots: Vec<Slot>,
    free: Vec<usize>,
    /// Ready slots by last use, oldest first.
    lru: BTreeMap<u64, usize>,
    tick: u64,
}

/// Counters of the pool (on the service's `/metrics`).
#[derive(Debug, Default)]
pub struct StagingCounters {
    /// Keys of loads served from the pool.
    pub hits: AtomicU64,
    /// Keys of loads read from G3 (the pool did not hold them).
    pub g3_loads: AtomicU64,
    /// Copies staged (after a G3 load or by a prefetch).
    pub inserts: AtomicU64,
    /// Copies evicted to make room.
    pub evictions: AtomicU64,
    /// Copies not staged because every slot was in use (copied out or held by hints).
    pub full: AtomicU64,
    /// Staged copies whose CRC did not match (not kept, or the load fell back to G3).
    pub crc_mismatches: AtomicU64,
    /// Prefetched copies discarded unused when their request finished.
    pub discarded: AtomicU64,
    /// Loads that waited for a prefetch still reading their chunk.
    pub fill_waits: AtomicU64,
}

/// What [`StagingPool::reserve`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reserve {
    /// The key is staged or being staged (held once more if a hold was asked).
    Present,
    /// A slot for the caller to fill, then [`StagingPool::commit`] or [`StagingPool::abort`].
    Reserved(usize),
    /// Every slot is copied out or held: nothing staged.
    Full,
}

/// The DRAM staging pool (see the module docs).
pub struct StagingPool {
    region: Arc<PrimaryRegion>,
    state: Mutex<State>,
    changed: Condvar,
    events: Arc<EventBus>,
    /// The pool's counters.
    pub counters: StagingCounters,
}

impl std::fmt::Debug for StagingPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingPool")
            .field("slots", &self.num_slots())
            .field("row_stride", &self.row_stride())
            .finish_non_exhaustive()
    }
}

impl StagingPool {
    /// A pool of `slots` slots of `row_stride` bytes; changes are published on `events`.
    pub fn new(slots: usize, row_stride: u64, events: Arc<EventBus>) -> Result<StagingPool> {
        let region = Arc::new(PrimaryRegion::create(slots, row_stride)?);
        Ok(StagingPool {
            region,
            state: Mutex::new(State {
                map: HashMap::with_capacity(slots),
                slots: (0..slots).map(|_| Slot::empty()).collect(),
                free: (0..slots).rev().collect(),
                lru: BTreeMap::new(),
                tick: 0,
            }),
            changed: Condvar::new(),
            events,
            counters: StagingCounters::default(),
        })
    }

    /// The pool's memory (for an I/O engine that reads G3 into it).
    pub fn region(&self) -> &Arc<PrimaryRegion> {
        &self.region
    }

    /// Slots in the pool.
    pub fn num_slots(&self) -> usize {
        self.region.num_rows()
    }

    /// Bytes per slot.
    pub fn row_stride(&self) -> u64 {
        self.region.row_stride()
    }

    /// Slots that hold a copy or are being filled.
    pub fn used_slots(&self) -> usize {
        let s = self.state.lock();
        s.slots.len() - s.free.len()
    }

    /// Slots held by hints now.
    pub fn held_slots(&self) -> usize {
        self.state
            .lock()
            .slots
            .iter()
            .filter(|s| s.holds > 0)
            .count()
    }

    /// True if `key` is staged or being staged.
    pub fn contains(&self, key: &ChunkKey) -> bool {
        self.state.lock().map.contains_key(key)
    }

    /// Holds `key` once more if it is staged or being staged; false if it is not.
    pub fn hold_if_present(&self, key: &ChunkKey) -> bool {
        let mut s = self.state.lock();
        let Some(&i) = s.map.get(key) else {
            return false;
        };
        let v = &mut s.slots[i];
        v.holds += 1;
        v.doomed = false;
        true
    }

    /// Finds `key` or a slot for it (evicting the least recently used copy nobody reads or
    /// holds); with `hold`, the key is held until [`StagingPool::release`].
    pub fn reserve(&self, key: &ChunkKey, hold: bool) -> Reserve {
        let mut guard = self.state.lock();
        let s = &mut *guard;
        if let Some(&i) = s.map.get(key) {
            if hold {
                s.slots[i].holds += 1;
                // A discard decided earlier is off: someone wants it again.
                s.slots[i].doomed = false;
            }
            return Reserve::Present;
        }
        let slot = match s.free.pop() {
            Some(i) => i,
            None => {
                let victim = s.lru.iter().map(|(&t, &i)| (t, i)).find(|&(_, i)| {
                    let v = &s.slots[i];
                    v.readers == 0 && v.holds == 0
                });
                let Some((tick, i)) = victim else {
                    self.counters.full.fetch_add(1, Ordering::Relaxed);
                    return Reserve::Full;
                };
                s.lru.remove(&tick);
                let old = s.slots[i].key.take();
                if let Some(old) = old {
                    s.map.remove(&old);
                    self.events.publish(EventMedium::Cpu, true, &[old]);
                }
                self.counters.evictions.fetch_add(1, Ordering::Relaxed);
                i
            }
        };
        let v = &mut s.slots[slot];
        *v = Slot::empty();
        v.key = Some(key.clone());
        v.state = SlotState::Filling;
        v.holds = u32::from(hold);
        s.map.insert(key.clone(), slot);
        Reserve::Reserved(slot)
    }

    /// The bytes of a slot reserved for filling: a write lease on its row (see
    /// [`crate::region::RowRead`]), to drop before [`StagingPool::commit`] reads them. Call
    /// only for a slot [`StagingPool::reserve`] gave this caller and not yet committed or
    /// aborted; a lease on a slot someone else reads or fills is refused.
    pub fn fill_bytes(&self, slot: usize) -> Result<RowWrite<'_>> {
        self.region.write_row(slot)
    }

    /// The filled slot holds its key's bytes, whose CRC-32 G3 vouched for: `crc`. The slot's
    /// bytes are checked against it first; a mismatch frees the slot (counted), and so does a
    /// slot whose bytes cannot be read (its filler still holds [`StagingPool::fill_bytes`]).
    pub fn commit(&self, slot: usize, crc: u32) -> bool {
        let actual = match self.region.read_row(slot) {
            Ok(bytes) => crc32fast::hash(&bytes),
            Err(e) => {
                log::error!("staging slot {slot} not committed: {e}");
                self.abort(slot);
                return false;
            }
        };
        self.commit_hashed(slot, crc, actual)
    }

    /// [`StagingPool::commit`] for a filler that computed `actual`, the CRC-32 of the slot's
    /// bytes, itself (a prefetch hashes them for G3's check): not hashed again.
    pub fn commit_hashed(&self, slot: usize, crc: u32, actual: u32) -> bool {
        if actual != crc {
            self.counters.crc_mismatches.fetch_add(1, Ordering::Relaxed);
            self.abort(slot);
            return false;
        }
        let mut guard = self.state.lock();
        let s = &mut *guard;
        let v = &mut s.slots[slot];
        if v.doomed {
            // Its request finished before the read did, and nobody else wants it.
            drop(guard);
            self.counters.discarded.fetch_add(1, Ordering::Relaxed);
            self.abort(slot);
            return false;
        }
        v.state = SlotState::Ready;
        v.crc = crc;
        s.tick += 1;
        v.tick = s.tick;
        s.lru.insert(s.tick, slot);
        let key = v.key.clone();
        drop(guard);
        self.counters.inserts.fetch_add(1, Ordering::Relaxed);
        if let Some(k) = key {
            self.events.publish(EventMedium::Cpu, false, &[k]);
        }
        self.changed.notify_all();
        true
    }

    /// Gives a reserved slot back unfilled (the G3 read failed, the CRC did not match).
    pub fn abort(&self, slot: usize) {
        let mut guard = self.state.lock();
        let s = &mut *guard;
        if let Some(k) = s.slots[slot].key.take() {
            s.map.remove(&k);
        }
        s.slots[slot] = Slot::empty();
        s.free.push(slot);
        drop(guard);
        self.changed.notify_all();
    }

    /// Serves `key` from the pool: checks its staged bytes against their CRC-32 and hands them
    /// to `copy` (with the slot's number, whose bytes lie at `slot * row_stride` in the pool's
    /// memfd) to put into the engine's row. Waits up to `wait` for a copy still being filled.
    /// `Ok(None)`: not staged, or the copy did not match (it is then dropped): read G3.
    /// `Ok(Some(crc))`: `copy` put the key's bytes, of CRC `crc`, in place. `Err`: `copy`
    /// failed; the staged copy stays.
    pub fn copy_out_with(
        &self,
        key: &ChunkKey,
        wait: Duration,
        copy: impl FnOnce(usize, &[u8]) -> Result<()>,
    ) -> Result<Option<u32>> {
        let deadline = Instant::now() + wait;
        let mut guard = self.state.lock();
        let (slot, crc) = loop {
            let Some(&i) = guard.map.get(key) else {
                return Ok(None);
            };
            match guard.slots[i].state {
                SlotState::Ready => break (i, guard.slots[i].crc),
                SlotState::Filling => {
                    self.counters.fill_waits.fetch_add(1, Ordering::Relaxed);
                    if self.changed.wait_until(&mut guard, deadline).timed_out() {
                        return Ok(None);
                    }
                }
                SlotState::Free => return Ok(None),
            }
        };
        {
            let s = &mut *guard;
            let v = &mut s.slots[slot];
            v.readers += 1;
            v.used = true;
            s.lru.remove(&v.tick);
            s.tick += 1;
            v.tick = s.tick;
            s.lru.insert(s.tick, slot);
        }
        drop(guard);
        // The slot is Ready and counted as read: nobody writes, evicts or reuses it until the
        // count drops (below), so the read lease is granted.
        let src = self
            .region
            .read_row(slot)
            .expect("a staged slot is a row of the pool");
        // A row may be longer than the slot (vLLM's row past its canonical area): the slot's
        // bytes are its first ones, and the CRC covers them.
        let ok = crc32fast::hash(&src) == crc;
        let copied = if ok { copy(slot, &src) } else { Ok(()) };
        drop(src);
        let mut guard = self.state.lock();
        let s = &mut *guard;
        s.slots[slot].readers -= 1;
        if !ok {
            self.counters.crc_mismatches.fetch_add(1, Ordering::Relaxed);
            // No new reader finds it; freed when the last one is done.
            if let Some(k) = s.slots[slot].key.clone() {
                s.map.remove(&k);
                self.events.publish(EventMedium::Cpu, true, &[k]);
            }
            s.slots[slot].doomed = true;
        }
        let v = &s.slots[slot];
        if v.doomed && v.readers == 0 && v.state == SlotState::Ready {
            let tick = v.tick;
            s.lru.remove(&tick);
            s.slots[slot] = Slot::empty();
            s.free.push(slot);
        }
        match (ok, copied) {
            (false, _) => Ok(None),
            (true, Ok(())) => {
                self.counters.hits.fetch_add(1, Ordering::Relaxed);
                Ok(Some(crc))
            }
            (true, Err(e)) => Err(e),
        }
    }

    /// One hint on `key` ends: with no hint left and no load having copied it, the copy is
    /// discarded (a copy still being read is discarded when its read completes).
    pub fn release(&self, key: &ChunkKey) {
        let mut guard = self.state.lock();
        let s = &mut *guard;
        let Some(&i) = s.map.get(key) else {
            return;
        };
        let v = &mut s.slots[i];
        if v.holds == 0 {
            // Not this hint's copy (its own failed and another load staged the key since).
            return;
        }
        v.holds -= 1;
        if v.holds > 0 || v.used {
            return;
        }
        match v.state {
            SlotState::Filling => v.doomed = true,
            SlotState::Ready if v.readers == 0 => {
                let tick = v.tick;
                s.lru.remove(&tick);
                s.map.remove(key);
                s.slots[i] = Slot::empty();
                s.free.push(i);
                self.counters.discarded.fetch_add(1, Ordering::Relaxed);
                drop(guard);
                self.events
                    .publish(EventMedium::Cpu, true, std::slice::from_ref(key));
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{Error, ErrorKind};

    /// Copies `key`'s staged bytes into the start of `dst` (at least one slot long) through
    /// [`StagingPool::copy_out_with`]. `None`: not staged, its CRC did not match (the copy is
    /// then dropped), or `dst` is shorter than a slot: read G3.
    fn copy_out(pool: &StagingPool, key: &ChunkKey, dst: &mut [u8], wait: Duration) -> Option<u32> {
        let copy = |_: usize, src: &[u8]| match dst.get_mut(..src.len()) {
            Some(d) => {
                d.copy_from_slice(src);
                Ok(())
            }
            None => Err(Error::new(
                ErrorKind::Contract,
                format!(
                    "a row of {} bytes cannot take a slot of {}",
                    dst.len(),
                    src.len()
                ),
            )),
        };
        pool.copy_out_with(key, wait, copy).ok().flatten()
    }

    fn k(i: u32) -> ChunkKey {
        ChunkKey::new(format!("key-{i}").as_bytes())
    }

    fn stage(pool: &StagingPool, key: &ChunkKey, fill: u8, hold: bool) -> bool {
        match pool.reserve(key, hold) {
            Reserve::Reserved(slot) => {
                let mut b = pool.fill_bytes(slot).unwrap();
                b.fill(fill);
                let crc = crc32fast::hash(&b);
                drop(b);
                pool.commit(slot, crc)
            }
            _ => false,
        }
    }

    #[test]
    fn lru_eviction_skips_held_copies_and_full_is_counted() {
        let bus = Arc::new(EventBus::default());
        bus.take(1);
        let pool = StagingPool::new(2, 4096, bus.clone()).unwrap();
        assert!(stage(&pool, &k(0), 1, false));
        assert!(stage(&pool, &k(1), 2, true));
        let mut row = vec![0u8; 4096];
        // k(0) is used more recently than k(1), but k(1) is held: k(0) goes.
        assert!(copy_out(&pool, &k(0), &mut row, FILL_WAIT).is_some());
        assert!(stage(&pool, &k(2), 3, false));
        assert!(!pool.contains(&k(0)));
        assert!(pool.contains(&k(1)));
        assert_eq!(pool.counters.evictions.load(Ordering::Relaxed), 1);
        // k(2) is not held, so k(3) evicts it; with both slots held nothing is staged.
        assert!(stage(&pool, &k(3), 4, true));
        assert_eq!(pool.reserve(&k(4), false), Reserve::Full);
        assert_eq!(pool.counters.full.load(Ordering::Relaxed), 1);
        assert!(copy_out(&pool, &k(1), &mut row, FILL_WAIT).is_some());
        assert!(row.iter().all(|b| *b == 2));
        let events = bus.take(1);
        let removed: Vec<_> = events.iter().filter(|e| e.removed).collect();
        assert_eq!(removed.len(), 2);
        assert!(events.iter().all(|e| e.medium == EventMedium::Cpu));
    }

    #[test]
    fn release_discards_unused_copies_only() {
        let pool = StagingPool::new(4, 4096, Arc::new(EventBus::default())).unwrap();
        assert!(stage(&pool, &k(0), 1, true));
        assert!(stage(&pool, &k(1), 2, true));
        let mut row = vec![0u8; 4096];
        assert!(copy_out(&pool, &k(1), &mut row, FILL_WAIT).is_some());
        pool.release(&k(0));
        pool.release(&k(1));
        assert!(!pool.contains(&k(0)), "unused: discarded");
        assert!(pool.contains(&k(1)), "used: stays for the others");
        assert_eq!(pool.counters.discarded.load(Ordering::Relaxed), 1);
        // A copy released while it is still being filled is discarded when the fill ends.
        let Reserve::Reserved(slot) = pool.reserve(&k(2), true) else {
            panic!("a free slot")
        };
        pool.release(&k(2));
        let crc = crc32fast::hash(&pool.fill_bytes(slot).unwrap());
        assert!(!pool.commit(slot, crc));
        assert!(!pool.contains(&k(2)));
        assert_eq!(pool.used_slots(), 1);
    }

    #[test]
    fn a_copy_whose_crc_does_not_match_is_never_served() {
        let pool = StagingPool::new(2, 4096, Arc::new(EventBus::default())).unwrap();
        let Reserve::Reserved(slot) = pool.reserve(&k(0), false) else {
            panic!()
        };
        pool.fill_bytes(slot).unwrap().fill(7);
        assert!(!pool.commit(slot, 12345), "bytes that G3 did not vouch for");
        assert!(!pool.contains(&k(0)));
        assert!(stage(&pool, &k(1), 9, false));
        // Damage the staged copy behind the pool's back: the load falls back to G3.
        let i = *pool.state.lock().map.get(&k(1)).unwrap();
        pool.region.write_row(i).unwrap()[100] ^= 1;
        let mut row = vec![0u8; 4096];
        assert_eq!(copy_out(&pool, &k(1), &mut row, FILL_WAIT), None);
        assert!(!pool.contains(&k(1)));
        assert_eq!(pool.used_slots(), 0);
        assert_eq!(pool.counters.crc_mismatches.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_load_waits_for_a_prefetch_still_filling() {
        let pool = Arc::new(StagingPool::new(1, 4096, Arc::new(EventBus::default())).unwrap());
        let Reserve::Reserved(slot) = pool.reserve(&k(0), true) else {
            panic!()
        };
        let reader = {
            let pool = pool.clone();
            std::thread::spawn(move || {
                let mut row = vec![0u8; 4096];
                let crc = copy_out(&pool, &k(0), &mut row, FILL_WAIT);
                (crc, row[0])
            })
        };
        std::thread::sleep(Duration::from_millis(20));
        // Reserved above; the reader waits for the commit.
        let mut b = pool.fill_bytes(slot).unwrap();
        b.fill(5);
        let crc = crc32fast::hash(&b);
        drop(b);
        assert!(pool.commit(slot, crc));
        assert_eq!(reader.join().unwrap(), (Some(crc), 5));
    }
}
