//! The tier contract: the vocabulary the manager and every tier speak, after vLLM 0.33.0's
//! `kv_offload/base.py` and `tiering/base.py` (contract doc section 3).
//!
//! It sits below everything that uses it (`config`, `primary`, `g3`, `tiering`), so a tier is
//! written against this module alone and never imports the manager.
//!
//! * [`job`]: transfer jobs and their results, lookup answers, media, localities, request
//!   contexts and offloading events.
//! * [`hints`]: the orchestrator's hints attached to a request (vLLM's `KvHintsEnvelope`).
//! * [`secondary`]: the [`SecondaryTier`](secondary::SecondaryTier) trait every secondary tier
//!   implements, and the tier-owned metric samples it reports.
//! * [`admission`]: which offered chunks a secondary tier writes (`admission` key; TinyLFU).
//! * `ledger`: the bookkeeping of tiers with a worker thread (jobs reported without the
//!   worker, jobs not yet reported, the shutdown handshake).
//! * `front` and `worker` (crate-internal): the two ends of a tier's worker thread that G3
//!   and the fs tier share (enqueue, results, drain and stop; the byte-capped job queue, a
//!   job's progress, the thread loop, the events).

pub mod admission;
pub(crate) mod front;
pub mod hints;
pub mod job;
test_visible! {
    mod ledger;
}
pub mod secondary;
pub(crate) mod worker;
