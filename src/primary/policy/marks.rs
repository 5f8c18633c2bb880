//! The per-slot marks LRU and ARC keep alike: a resident slot may be marked evictable (counted),
//! and the slots a store protects are marked for the length of one victim selection, which
//! either finds all the victims asked for or changes nothing.

/// A policy with one state byte per slot and a count of evictable slots.
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

/// Selects exactly `n` victims, passing over `protected`, and appends them to `victims`;
/// false (and `victims` as it was) when there are fewer.
pub(super) fn select_victims<P: Marked>(
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
