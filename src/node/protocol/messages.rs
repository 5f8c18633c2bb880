//! The messages: what a client sends ([`Request`]) and what the service answers ([`Reply`]).

use crate::contract::job::{JobResult, LookupResult};
use crate::error::{Error, ErrorKind};
use crate::key::ChunkKey;

/// A store or load job: rows of the client's region and their keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobRequest {
    /// The client's job id (echoed in `JOB_DONE`).
    pub job_id: u64,
    /// Row of the client's region per key.
    pub rows: Vec<u32>,
    /// The keys.
    pub keys: Vec<ChunkKey>,
}

/// What a client sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Opens the session.
    Hello {
        /// Bytes per row of the engine's region.
        row_stride: u64,
        /// The engine's compatibility (namespace) digest.
        digest: [u8; 32],
        /// A name for status and logs (vLLM's engine id).
        engine: String,
    },
    /// Registers the region by path.
    RegisterPath {
        /// Rows of the region.
        num_rows: u64,
        /// The shared file (`/dev/shm/vllm_offload_<engine_id>.mmap`).
        path: String,
    },
    /// Registers the region by the descriptor sent with the frame.
    RegisterFd {
        /// Rows of the region.
        num_rows: u64,
    },
    /// Looks keys up.
    Lookup {
        /// The keys.
        keys: Vec<ChunkKey>,
    },
    /// Primary -> G3.
    Store(JobRequest),
    /// G3 -> primary.
    Load(JobRequest),
    /// The service's status.
    Status,
    /// Stage `keys` for request `req_id` (answered with one verdict per key).
    Hint {
        /// The engine's request id.
        req_id: String,
        /// The keys the request will look up.
        keys: Vec<ChunkKey>,
    },
    /// Request `req_id` finished: its staged keys it did not load are discarded.
    HintDone {
        /// The engine's request id.
        req_id: String,
    },
    /// The inventory events since the last ask.
    TakeEvents,
    /// The keys were used (vLLM's `touch`): most recently used in G3's LRU.
    Touch {
        /// The keys.
        keys: Vec<ChunkKey>,
    },
}

/// Which medium of the service holds the keys of an [`InventoryEvent`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventMedium {
    /// The DRAM staging pool (vLLM `Medium.CPU`), wire value 0.
    Cpu,
    /// The G3 slots (vLLM `Medium.STORAGE`), wire value 1.
    Storage,
}

/// Keys stored in or removed from one medium of the service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InventoryEvent {
    /// Where.
    pub medium: EventMedium,
    /// True: the keys left that medium; false: they arrived.
    pub removed: bool,
    /// The keys.
    pub keys: Vec<ChunkKey>,
}

/// The outcome of a job as it crosses the socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobDone {
    /// The job id.
    pub job_id: u64,
    /// Every key moved (or was skipped as held).
    pub success: bool,
    /// Bytes moved.
    pub transfer_bytes: u64,
    /// Nanoseconds spent moving them.
    pub transfer_ns: u64,
    /// A failed load: indices (into the job's keys) of the keys that did load.
    pub loaded: Option<Vec<u32>>,
    /// The first error.
    pub error: Option<(ErrorKind, String)>,
}

impl JobDone {
    /// The wire form of `r`, a job of `keys`.
    pub fn from_result(r: &JobResult, keys: &[ChunkKey]) -> JobDone {
        let loaded = r.successful_keys.as_ref().map(|ok| {
            keys.iter()
                .enumerate()
                .filter(|(_, k)| ok.contains(k))
                .map(|(i, _)| i as u32)
                .collect()
        });
        JobDone {
            job_id: r.job_id,
            success: r.success,
            transfer_bytes: r.transfer_bytes.unwrap_or(0),
            transfer_ns: r
                .transfer_time
                .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
            loaded,
            error: r
                .error
                .as_ref()
                .map(|e| (e.kind(), e.message().to_string())),
        }
    }

    /// The job's [`JobResult`] (`keys` are the job's keys).
    pub fn to_result(&self, keys: &[ChunkKey]) -> JobResult {
        let error = self.error.as_ref().map(|(k, m)| Error::new(*k, m.clone()));
        JobResult {
            job_id: self.job_id,
            success: self.success,
            successful_keys: self.loaded.as_ref().map(|ix| {
                ix.iter()
                    .filter_map(|&i| keys.get(i as usize).cloned())
                    .collect()
            }),
            transfer_time: (self.success || self.transfer_ns > 0)
                .then(|| std::time::Duration::from_nanos(self.transfer_ns)),
            transfer_bytes: (self.success || self.transfer_bytes > 0)
                .then_some(self.transfer_bytes),
            error: if self.success { None } else { error },
        }
    }
}

/// What the service sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// The session is open.
    Welcome {
        /// The service's row stride.
        row_stride: u64,
        /// The service's compatibility digest.
        digest: [u8; 32],
        /// The service's kvtier version.
        version: String,
    },
    /// The region is mapped.
    Registered {
        /// Rows mapped.
        num_rows: u64,
    },
    /// One result per key.
    Lookup(Vec<LookupResult>),
    /// A job finished.
    JobDone(JobDone),
    /// The status as JSON.
    Status(String),
    /// One verdict per key of a `HINT`.
    Hinted(Vec<LookupResult>),
    /// Inventory events, oldest first.
    Events(Vec<InventoryEvent>),
    /// The request failed.
    Error {
        /// The error's kind.
        kind: ErrorKind,
        /// What went wrong.
        message: String,
    },
}
