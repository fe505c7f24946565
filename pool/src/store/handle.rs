//! The store room's handle: what every thread that touches objects shares (DRAM, the
//! object store over it, the tenant groups and their shared regions, the evictor's wake
//! flag). Threads get an `Arc<Store>`, not the whole pool.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Condvar, Mutex};

use umbp_ipc::SharedMemory;

use super::dram::Dram;
use super::groups::TenantGroups;
use super::objects::ObjectStore;
use super::priority_lock::PriorityMutex;

pub(crate) struct Store {
    pub dram: Dram,
    /// Copy threads take it with `lock_urgent`: their stage work is on a transfer's critical path.
    pub objects: PriorityMutex<ObjectStore>,
    /// The tenant groups of `config.namespace_acl` (one without an ACL).
    pub tenant_groups: TenantGroups,
    /// By group number: the index and event log a peer of that group is handed.
    pub group_mem: Vec<GroupMemory>,
    /// Objects of the store below DRAM (promoting included), readable without its lock.
    pub lower_objects: Arc<AtomicU64>,
    /// The evictor's wake flag (tier/evictor.rs).
    pub evict_wake: (Mutex<bool>, Condvar),
}

impl Store {
    pub fn wake_evictor(&self) {
        let (lock, cv) = &self.evict_wake;
        *lock.lock().expect("evictor lock") = true;
        cv.notify_one();
    }
}

/// One tenant group's shared regions (groups.rs): its index and its KV event log, both
/// read-only for peers, written through the object store.
pub(crate) struct GroupMemory {
    pub index_mem: Arc<SharedMemory>,
    pub events_mem: Arc<SharedMemory>,
}
