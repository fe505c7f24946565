//! What an engine worker links to use a UMBP pool (docs/architecture.md, docs/connection.md): attach,
//! register memory and KV layouts, submit stores and loads, reap completions, and survive
//! the pool dying, stalling or restarting without an engine restart.
//!
//! ```no_run
//! # use umbp_worker::*;
//! # fn main() -> Result<(), WorkerError> {
//! let mut kv = vec![0u8; 64 << 10]; // declared first: dropped after the worker
//! let endpoint = default_endpoint().map_err(|e| WorkerError::Invalid(e.to_string()))?;
//! let mut w = Worker::connect(WorkerConfig::new(endpoint, 0x1234))?;
//! // SAFETY: `kv` outlives `w` and is only read or written through references between
//! // transfers (after their completion was reaped).
//! let alloc = unsafe { w.register_memory(MemorySpec::HostProcess { ptr: kv.as_mut_ptr() as usize, len: kv.len() }) }?;
//! w.register_layout(0, vec![Segment::new(alloc, 0, 4096, 4096, 16)])?;
//! let id = w.store(0, &[(ObjectKey(7), 3)])?;
//! let done = w.wait(id, std::time::Duration::from_secs(5));
//! # Ok(()) }
//! ```
//!
//! One [`Worker`] per submitting thread: it owns one attachment's SPSC rings, so it is
//! `Send` but not `Sync`.

mod arena_alloc;
mod connection;
mod error;
mod fence;
mod worker;

pub use error::WorkerError;
pub use worker::{default_endpoint, CancelOutcome, Completion, MemorySpec, TransferId, Worker, WorkerConfig};

pub use umbp_protocol::entries::{BlockStatus, CqeError};
pub use umbp_protocol::layout::Segment;
pub use umbp_protocol::ObjectKey;

/// Reconnect backoff bounds (first retry, longest wait between retries).
pub use umbp_ipc::backoff::{BACKOFF_MAX, BACKOFF_MIN};
