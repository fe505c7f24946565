//! The object store and the memory under it: the objects and their states, the slab
//! allocator, the DRAM memfd and its GPU pinning, the KV event log, tenant groups and the
//! store's priority lock. The bottom room: it imports only the shared leaves (config/,
//! pool_report.rs), never the crate root; the DRAM registration thread gets a
//! `pinning::Registrar` (DRAM, store, stop flag), not the whole pool.

pub(crate) mod alloc;
pub(crate) mod dram;
pub(crate) mod event_log;
pub mod groups;
pub(crate) mod handle;
pub(crate) mod objects;
pub(crate) mod pinning;
pub(crate) mod priority_lock;

pub(crate) use handle::{GroupMemory, Store};
