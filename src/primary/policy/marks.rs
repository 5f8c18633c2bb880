//! What LRU and ARC do alike over their per-slot state bytes: a resident slot may be marked
//! evictable (counted); removing a slot takes it out of its list and its mark away; an
//! eviction protects the slots a store is preparing, selects every victim it was asked for or
//! changes nothing, then takes each out of its list. [`marked_methods!`] writes the
//! `EvictionPolicy` methods that are these operations, once for both policies.

/// A policy with one state byte per slot, a count of evictable slots and recency lists.
pub(super) trait Marked {
    /// The state bits that say a slot is resident (in one of the policy's lists).
    const RESIDENT: u8;
    /// The bit of an evictable slot.
    const EVICTABLE: u8;
    /// The bit of a slot protected during a selection.
    const PROTECTED: u8;

    /// The state bytes and the evictable count.
    fn marks(&mut self) -> (&mut [u8], &mut usize);

    /// Appends up to `n` evictable, unprotected slots to `victims` in eviction order, changing
    /// nothing; returns how many it found.
    fn select(&self, n: usize, victims: &mut Vec<u32>) -> usize;

    /// Takes resident `slot` out of its list (its state byte is cleared after).
    fn unlink(&mut self, slot: u32);

    /// Victim `slot` is about to leave (still in its list); `fingerprint(slot)` gives its
    /// key's fingerprint (ARC remembers it as a ghost).
    fn on_evicted(&mut self, _slot: u32, _fingerprint: &mut dyn FnMut(u32) -> u64) {}
}

/// Marks resident `slot` evictable (once).
pub(super) fn mark_evictable<P: Marked>(p: &mut P, slot: u32) {
    let (state, evictable) = p.marks();
    let st = state[slot as usize];
    if st & P::EVICTABLE != 0 || st & P::RESIDENT == 0 {
        return;
    }
    state[slot as usize] = st | P::EVICTABLE;
    *evictable += 1;
}

/// Takes `slot`'s evictable mark (if any) away.
pub(super) fn mark_non_evictable<P: Marked>(p: &mut P, slot: u32) {
    let (state, evictable) = p.marks();
    let st = state[slot as usize];
    if st & P::EVICTABLE != 0 {
        state[slot as usize] = st & !P::EVICTABLE;
        *evictable -= 1;
    }
}

/// Forgets `slot` (not resident: nothing).
pub(super) fn remove<P: Marked>(p: &mut P, slot: u32) {
    let (state, _) = p.marks();
    let st = state[slot as usize];
    if st & P::RESIDENT == 0 {
        return;
    }
    p.unlink(slot);
    let (state, evictable) = p.marks();
    if st & P::EVICTABLE != 0 {
        *evictable -= 1;
    }
    state[slot as usize] = 0;
}

/// `EvictionPolicy::evict`: selects all `n` victims first (passing over `protected`; nothing
/// changes when there are fewer), then takes each out of its list.
pub(super) fn evict<P: Marked>(
    p: &mut P,
    n: usize,
    protected: &[u32],
    fingerprint: &mut dyn FnMut(u32) -> u64,
    victims: &mut Vec<u32>,
) -> bool {
    if n == 0 {
        return true;
    }
    let start = victims.len();
    if !select_victims(p, n, protected, victims) {
        return false;
    }
    for &slot in &victims[start..] {
        p.on_evicted(slot, fingerprint);
        p.unlink(slot);
        let (state, _) = p.marks();
        state[slot as usize] = 0;
    }
    let (_, evictable) = p.marks();
    *evictable -= n;
    true
}

/// Selects exactly `n` victims, passing over `protected`, and appends them to `victims`;
/// false (and `victims` as it was) when there are fewer.
fn select_victims<P: Marked>(
    p: &mut P,
    n: usize,
    protected: &[u32],
    victims: &mut Vec<u32>,
) -> bool {
    let (state, evictable) = p.marks();
    if n > *evictable {
        return false;
    }
    for &s in protected {
        state[s as usize] |= P::PROTECTED;
    }
    let start = victims.len();
    let ok = p.select(n, victims) == n;
    let (state, _) = p.marks();
    for &s in protected {
        state[s as usize] &= !P::PROTECTED;
    }
    if !ok {
        victims.truncate(start);
    }
    ok
}

/// The `EvictionPolicy` methods of a [`Marked`] policy with `links`, `state` and `evictable`
/// fields: `remove`, `mark_evictable`, `mark_non_evictable`, `num_evictable`, `prefetch` and
/// `evict` (the functions above).
macro_rules! marked_methods {
    () => {
        fn remove(&mut self, slot: u32) {
            $crate::primary::policy::marks::remove(self, slot);
        }

        fn mark_evictable(&mut self, slot: u32) {
            $crate::primary::policy::marks::mark_evictable(self, slot);
        }

        fn mark_non_evictable(&mut self, slot: u32) {
            $crate::primary::policy::marks::mark_non_evictable(self, slot);
        }

        fn num_evictable(&self) -> usize {
            self.evictable
        }

        fn prefetch(&self, slot: u32) {
            $crate::primary::policy::list::prefetch_node(&self.links, &self.state, slot);
        }

        fn evict(
            &mut self,
            n: usize,
            protected: &[u32],
            fingerprint: &mut dyn FnMut(u32) -> u64,
            victims: &mut Vec<u32>,
        ) -> bool {
            $crate::primary::policy::marks::evict(self, n, protected, fingerprint, victims)
        }
    };
}
pub(super) use marked_methods;
