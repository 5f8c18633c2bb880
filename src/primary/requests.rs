//! Request-scoped accesses, as vLLM 0.33.0's `CPUOffloadingManager` records them
//! (`_RequestCacheAccess`): the keys a request met (each once, grouped by KV cache group in
//! first-seen order), which it inserted, which it reused, and which store misses the policy
//! has already seen for it. Committed to the policy when the request finishes.
//!
//! vLLM's four key sets (seen, inserted, reused, store misses) are flags of one map entry
//! per key here: one hash lookup and no key copy per set.

use std::sync::Arc;

use crate::hash::FastMap;
use crate::key::ChunkKey;

use super::policy::Commit;

/// The request met the key (it is in its group's list).
const SEEN: u8 = 1;
/// The request inserted the key.
const INSERTED: u8 = 2;
/// The request reused the key (re-reads of its own insertions aside).
const REUSED: u8 = 4;
/// The policy has seen the key as a store miss of this request.
const STORE_MISS: u8 = 8;

/// One request's record.
#[derive(Debug, Default)]
pub(crate) struct RequestAccess {
    /// `(group index, keys in first-seen order)`, groups in first-seen order.
    groups: Vec<(u32, Vec<ChunkKey>)>,
    /// What the request did with each key it met: [`SEEN`], [`INSERTED`], [`REUSED`],
    /// [`STORE_MISS`].
    flags: FastMap<ChunkKey, u8>,
}

/// vLLM's `get_offload_group_idx`: the last 4 bytes of the key, big-endian (all of a shorter
/// key).
fn group_of(key: &ChunkKey) -> u32 {
    let b = key.as_bytes();
    b[b.len().saturating_sub(4)..]
        .iter()
        .fold(0u32, |acc, &x| (acc << 8) | u32::from(x))
}

impl RequestAccess {
    /// `key`'s flags (none yet if the request has not met it).
    fn flags(&mut self, key: &ChunkKey) -> &mut u8 {
        self.flags.entry(key.clone()).or_insert(0)
    }

    /// Records `keys` (in the order met; keys met before are skipped) and, of `reused`, the
    /// keys the request did not insert itself.
    pub(crate) fn record<'a>(
        &mut self,
        keys: impl IntoIterator<Item = &'a ChunkKey>,
        reused: impl IntoIterator<Item = &'a ChunkKey>,
    ) {
        for key in keys {
            let flags = self.flags(key);
            if *flags & SEEN != 0 {
                continue;
            }
            *flags |= SEEN;
            let g = group_of(key);
            match self.groups.iter_mut().find(|(idx, _)| *idx == g) {
                Some((_, list)) => list.push(key.clone()),
                None => self.groups.push((g, vec![key.clone()])),
            }
        }
        for key in reused {
            let flags = self.flags(key);
            if *flags & INSERTED == 0 {
                *flags |= REUSED;
            }
        }
    }

    /// Marks `keys` as inserted by the request.
    pub(crate) fn inserted<'a>(&mut self, keys: impl IntoIterator<Item = &'a ChunkKey>) {
        for key in keys {
            *self.flags(key) |= INSERTED;
        }
    }

    /// Whether the policy has seen `key` as a store miss of this request; records it.
    pub(crate) fn first_store_miss(&mut self, key: &ChunkKey) -> bool {
        let flags = self.flags(key);
        let first = *flags & STORE_MISS == 0;
        *flags |= STORE_MISS;
        first
    }

    /// The commit plan: keys in head-to-tail order (groups by index, each in first-seen
    /// order) reversed, so the head ends up most recent; reused keys count as reuse, keys only
    /// inserted as insertions, the rest as seen.
    fn commit_plan(mut self) -> Vec<(ChunkKey, Commit)> {
        self.groups.sort_by_key(|(g, _)| *g);
        let mut plan = Vec::with_capacity(self.flags.len());
        for (_, keys) in self.groups.into_iter().rev() {
            for key in keys.into_iter().rev() {
                let flags = self.flags.get(&key).copied().unwrap_or(0);
                let how = if flags & REUSED != 0 {
                    Commit::Reused
                } else if flags & INSERTED != 0 {
                    Commit::InsertedOnly
                } else {
                    Commit::Seen
                };
                plan.push((key, how));
            }
        }
        plan
    }
}

/// Per-request access records.
#[derive(Debug, Default)]
pub(crate) struct RequestLog {
    by_req: FastMap<Arc<str>, RequestAccess>,
}

impl RequestLog {
    /// `req`'s record, created on first use.
    pub(crate) fn get(&mut self, req: &Arc<str>) -> &mut RequestAccess {
        self.by_req.entry(Arc::clone(req)).or_default()
    }

    /// Removes `req`'s record and returns its commit plan (empty if none).
    pub(crate) fn take_commit_plan(&mut self, req: &str) -> Vec<(ChunkKey, Commit)> {
        self.by_req
            .remove(req)
            .map_or_else(Vec::new, RequestAccess::commit_plan)
    }

    /// Requests with an open record.
    pub(crate) fn open_requests(&self) -> usize {
        self.by_req.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_plan_groups_reverses_and_classifies() {
        let mut log = RequestLog::default();
        let req: Arc<str> = Arc::from("r1");
        let k = |b: u8, g: u8| ChunkKey::new([b, 0, 0, 0, g]);
        let a = log.get(&req);
        a.record(&[k(1, 1), k(2, 0)], &[k(1, 1)]);
        a.inserted(&[k(3, 0)]);
        a.record(&[k(3, 0), k(2, 0)], &[k(3, 0)]); // own insertion: not reuse
        a.record(&[k(4, 0)], &[]);
        assert_eq!(log.open_requests(), 1);
        let plan = log.take_commit_plan("r1");
        assert_eq!(
            plan,
            vec![
                (k(1, 1), Commit::Reused),
                (k(4, 0), Commit::Seen),
                (k(3, 0), Commit::InsertedOnly),
                (k(2, 0), Commit::Seen),
            ]
        );
        assert!(log.take_commit_plan("r1").is_empty());
        assert_eq!(log.open_requests(), 0);
    }

    #[test]
    fn reuse_before_a_reinsertion_still_counts() {
        let mut log = RequestLog::default();
        let req: Arc<str> = Arc::from("r");
        let k = ChunkKey::new([9, 0, 0, 0, 0]);
        let a = log.get(&req);
        a.record([&k], [&k]);
        a.inserted([&k]);
        assert_eq!(log.take_commit_plan("r"), vec![(k, Commit::Reused)]);
    }
}
