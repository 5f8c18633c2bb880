//! Request-scoped accesses, as vLLM 0.33.0's `CPUOffloadingManager` records them
//! (`_RequestCacheAccess`): the keys a request met (each once, grouped by KV cache group in
//! first-seen order), which it inserted, which it reused, and which store misses the policy
//! has already seen for it. Committed to the policy when the request finishes.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::key::ChunkKey;

use super::policy::Commit;

/// One request's record.
#[derive(Debug, Default)]
pub(crate) struct RequestAccess {
    /// `(group index, keys in first-seen order)`, groups in first-seen order.
    groups: Vec<(u32, Vec<ChunkKey>)>,
    seen: HashSet<ChunkKey>,
    inserted: HashSet<ChunkKey>,
    reused: HashSet<ChunkKey>,
    store_misses: HashSet<ChunkKey>,
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
    /// Records `keys` (in the order met; keys met before are skipped) and, of `reused`, the
    /// keys the request did not insert itself.
    pub(crate) fn record<'a>(
        &mut self,
        keys: impl IntoIterator<Item = &'a ChunkKey>,
        reused: impl IntoIterator<Item = &'a ChunkKey>,
    ) {
        for key in keys {
            if self.seen.contains(key) {
                continue;
            }
            self.seen.insert(key.clone());
            let g = group_of(key);
            match self.groups.iter_mut().find(|(idx, _)| *idx == g) {
                Some((_, list)) => list.push(key.clone()),
                None => self.groups.push((g, vec![key.clone()])),
            }
        }
        for key in reused {
            if !self.inserted.contains(key) {
                self.reused.insert(key.clone());
            }
        }
    }

    /// Marks `keys` as inserted by the request.
    pub(crate) fn inserted<'a>(&mut self, keys: impl IntoIterator<Item = &'a ChunkKey>) {
        self.inserted.extend(keys.into_iter().cloned());
    }

    /// Whether the policy has seen `key` as a store miss of this request; records it.
    pub(crate) fn first_store_miss(&mut self, key: &ChunkKey) -> bool {
        if self.store_misses.contains(key) {
            return false;
        }
        self.store_misses.insert(key.clone());
        true
    }

    /// The commit plan: keys in head-to-tail order (groups by index, each in first-seen
    /// order) reversed, so the head ends up most recent; reused keys count as reuse, keys only
    /// inserted as insertions, the rest as seen.
    fn commit_plan(mut self) -> Vec<(ChunkKey, Commit)> {
        self.groups.sort_by_key(|(g, _)| *g);
        let mut plan = Vec::with_capacity(self.seen.len());
        for (_, keys) in self.groups.iter().rev() {
            for key in keys.iter().rev() {
                let how = if self.reused.contains(key) {
                    Commit::Reused
                } else if self.inserted.contains(key) {
                    Commit::InsertedOnly
                } else {
                    Commit::Seen
                };
                plan.push((key.clone(), how));
            }
        }
        plan
    }
}

/// Per-request access records.
#[derive(Debug, Default)]
pub(crate) struct RequestLog {
    by_req: HashMap<Arc<str>, RequestAccess>,
}

impl RequestLog {
    /// `req`'s record, created on first use.
    pub(crate) fn get(&mut self, req: &Arc<str>) -> &mut RequestAccess {
        if !self.by_req.contains_key(req.as_ref()) {
            self.by_req
                .insert(Arc::clone(req), RequestAccess::default());
        }
        self.by_req.get_mut(req.as_ref()).expect("inserted above")
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
