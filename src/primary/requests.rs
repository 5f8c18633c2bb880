//! Request-scoped recency: accesses are recorded per request and committed to the policy when
//! the request finishes (contract section 5.3).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::key::ChunkKey;

/// How a request met a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// The request stored the key (it was not present before).
    Inserted,
    /// The request found the key ready (loaded it, or offered it again to a store).
    Reused,
}

/// What to do with one key when its request finishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Commit {
    /// Real reuse: counts as frequency (ARC) and recency.
    Touch,
    /// Only the request's own insertion: recency without frequency.
    Refresh,
}

/// Per-request access records.
#[derive(Debug, Default)]
pub(crate) struct RequestLog {
    by_req: HashMap<Arc<str>, Vec<(ChunkKey, Access)>>,
}

impl RequestLog {
    /// Appends `keys` (in prefix order) to `req`'s record.
    pub(crate) fn record<'a>(
        &mut self,
        req: &Arc<str>,
        keys: impl IntoIterator<Item = &'a ChunkKey>,
        access: Access,
    ) {
        let mut keys = keys.into_iter().peekable();
        if keys.peek().is_none() {
            return;
        }
        let entry = match self.by_req.get_mut(req.as_ref()) {
            Some(e) => e,
            None => self.by_req.entry(Arc::clone(req)).or_default(),
        };
        entry.extend(keys.map(|k| (k.clone(), access)));
    }

    /// Removes `req`'s record and returns it in commit order: tail before head (the reverse
    /// of the recorded prefix order, so the head ends up most recent), each key classified.
    /// A key the request inserted itself never counts as reuse.
    pub(crate) fn take_commit_plan(&mut self, req: &str) -> Vec<(ChunkKey, Commit)> {
        let Some(entries) = self.by_req.remove(req) else {
            return Vec::new();
        };
        let inserted: HashSet<&ChunkKey> = entries
            .iter()
            .filter(|(_, a)| *a == Access::Inserted)
            .map(|(k, _)| k)
            .collect();
        entries
            .iter()
            .rev()
            .map(|(k, a)| {
                let commit = if *a == Access::Reused && !inserted.contains(k) {
                    Commit::Touch
                } else {
                    Commit::Refresh
                };
                (k.clone(), commit)
            })
            .collect()
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
    fn commit_plan_reverses_and_does_not_count_own_insertions() {
        let mut log = RequestLog::default();
        let req: Arc<str> = Arc::from("r1");
        let k = |b: u8| ChunkKey::new([b]);
        log.record(&req, &[k(1), k(2)], Access::Reused);
        log.record(&req, &[k(3)], Access::Inserted);
        log.record(&req, &[k(3)], Access::Reused);
        log.record(&req, &[], Access::Reused);
        assert_eq!(log.open_requests(), 1);
        let plan = log.take_commit_plan("r1");
        assert_eq!(
            plan,
            vec![
                (k(3), Commit::Refresh),
                (k(3), Commit::Refresh),
                (k(2), Commit::Touch),
                (k(1), Commit::Touch),
            ]
        );
        assert!(log.take_commit_plan("r1").is_empty());
        assert_eq!(log.open_requests(), 0);
    }
}
