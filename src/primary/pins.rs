//! Pinning rows for readers: `prepare_load` / `complete_load` (GPU loads, with a request
//! access) and `prepare_read` / `complete_read` (cascades and peer pins, recency untouched).
//!
//! Every call is all-or-nothing: it validates every key first and returns
//! [`ErrorKind::Contract`](crate::error::ErrorKind::Contract) naming the first bad key
//! without changing anything.

use crate::contract::job::RequestContext;
use crate::error::Result;
use crate::key::ChunkKey;

use super::table::{Found, IN_FLIGHT};
use super::{PrimaryTier, contract_error};

impl PrimaryTier {
    /// Pins `keys` for a GPU load (`ref_cnt += 1` each; a key listed twice is pinned twice)
    /// and records the access for `req` (committed by `on_request_finished`). Every key must
    /// be resident and ready. Returns the rows, parallel to `keys`.
    pub fn prepare_load(&mut self, keys: &[ChunkKey], req: &RequestContext) -> Result<Vec<u32>> {
        let ids = self.pin(keys, "prepare_load")?;
        self.requests.get(&req.req_id).record(keys, keys);
        Ok(ids)
    }

    /// Unpins `keys` after a GPU load (`ref_cnt -= 1` each). Every key must be pinned (as
    /// many times as it is listed).
    pub fn complete_load(&mut self, keys: &[ChunkKey]) -> Result<()> {
        self.unpin(keys, "complete_load")
    }

    /// Pins `keys` for a secondary tier to read (a cascade store or a peer pin) without
    /// touching recency. Every key must be resident and ready. Returns the rows.
    pub fn prepare_read(&mut self, keys: &[ChunkKey]) -> Result<Vec<u32>> {
        self.pin(keys, "prepare_read")
    }

    /// Unpins `keys` after a secondary tier read them.
    pub fn complete_read(&mut self, keys: &[ChunkKey]) -> Result<()> {
        self.unpin(keys, "complete_read")
    }

    fn pin(&mut self, keys: &[ChunkKey], op: &str) -> Result<Vec<u32>> {
        let mut found = Vec::with_capacity(keys.len());
        let hashes = self.hash_batch(keys);
        for (key, &hash) in keys.iter().zip(&hashes) {
            let Some(f) = self.slots.find_hashed(hash, key.as_bytes()) else {
                self.counters.contract_violations += 1;
                return Err(contract_error(op, key, "is not in the primary tier"));
            };
            let r = self.slots.ref_at(f.pos);
            if r == IN_FLIGHT {
                self.counters.contract_violations += 1;
                return Err(contract_error(
                    op,
                    key,
                    "is not ready (its write is in flight)",
                ));
            }
            // Conservative: even if every listed key were this one, no overflow.
            if i64::from(r) + keys.len() as i64 > i64::from(i32::MAX) {
                self.counters.contract_violations += 1;
                return Err(contract_error(op, key, format!("has too many pins ({r})")));
            }
            found.push(f);
        }
        // Nothing is removed in between, so the entry positions are still valid.
        for f in &found {
            let r = self.slots.ref_at(f.pos) + 1;
            self.slots.set_ref_at(f.pos, r);
            if r == 1 {
                self.pinned += 1;
                self.policy.mark_non_evictable(f.slot);
            }
        }
        Ok(found.into_iter().map(|f| f.slot).collect())
    }

    fn unpin(&mut self, keys: &[ChunkKey], op: &str) -> Result<()> {
        // Phase 1: decrement the counts only, undoing them if a key is not pinned.
        let mut found: Vec<Found> = Vec::with_capacity(keys.len());
        let mut failure = None;
        let hashes = self.hash_batch(keys);
        for (key, &hash) in keys.iter().zip(&hashes) {
            match self.slots.find_hashed(hash, key.as_bytes()) {
                Some(f) if self.slots.ref_at(f.pos) > 0 => {
                    self.slots.set_ref_at(f.pos, self.slots.ref_at(f.pos) - 1);
                    found.push(f);
                }
                Some(f) => {
                    let r = self.slots.ref_at(f.pos);
                    let state = if r == IN_FLIGHT {
                        "is not pinned (its write is in flight)".to_string()
                    } else {
                        format!("is not pinned (ref_cnt {r} after the earlier keys of this call)")
                    };
                    failure = Some(contract_error(op, key, state));
                    break;
                }
                None => {
                    failure = Some(contract_error(op, key, "is not in the primary tier"));
                    break;
                }
            }
        }
        if let Some(err) = failure {
            for f in &found {
                self.slots.set_ref_at(f.pos, self.slots.ref_at(f.pos) + 1);
            }
            self.counters.contract_violations += 1;
            return Err(err);
        }
        // Phase 2: the slots that reached 0 become evictable (each counted once: a slot
        // listed twice reaches 0 only at its last decrement, and marking is idempotent).
        for f in &found {
            if self.slots.ref_at(f.pos) == 0 {
                let before = self.policy.num_evictable();
                self.policy.mark_evictable(f.slot);
                if self.policy.num_evictable() != before {
                    self.pinned -= 1;
                }
            }
        }
        Ok(())
    }
}
