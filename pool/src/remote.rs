//! The pool's side of the cluster tier seam (docs/cluster.md). The pool knows no NIXL and
//! no peers: a cluster implementation (`umbp-cluster`) gets a [`ClusterAccess`] from
//! [`crate::Pool::cluster_access`] to register the DRAM, pin objects for peers' reads,
//! list and follow this pool's keys, mirror peers' keys as `Lower { Remote }` objects, and
//! install the [`TierSource`] that loads of those promote through (tier.rs: the same seam
//! as the SSD tier; `Tiers::remote` is a [`RemoteSlot`] filled once the cluster starts).
//! The cluster tier serves tenant group 0 (pools without `--namespace-acl`).

use std::sync::{Arc, OnceLock};

use umbp_ipc::SharedMemory;
use umbp_protocol::ObjectKey;

use crate::objects::LoadReservation;
pub use crate::tier::{FetchItem, TierSource};
use crate::PoolInner;

/// `Tiers::remote` of every pool: empty (every fetch misses) until a cluster installs its
/// source.
#[derive(Clone, Default)]
pub struct RemoteSlot(Arc<OnceLock<Arc<dyn TierSource>>>);

impl TierSource for RemoteSlot {
    fn fetch(&self, items: &mut [FetchItem<'_>]) -> Vec<bool> {
        match self.0.get() {
            Some(s) => s.fetch(items),
            None => vec![false; items.len()],
        }
    }
}

/// One published object of this pool, as the cluster advertises it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldObject {
    pub key: ObjectKey,
    pub size: u64,
    pub namespace: u128,
}

/// What the cluster tier may do to a running pool.
#[derive(Clone)]
pub struct ClusterAccess {
    pub(crate) inner: Arc<PoolInner>,
}

impl ClusterAccess {
    /// The DRAM tier's mapping (registered with NIXL for peers' reads).
    pub fn dram(&self) -> (*mut u8, usize) {
        (self.inner.dram.base(), self.inner.dram.len())
    }

    /// Whether the pool has tenant groups (`--namespace-acl`): the cluster tier refuses them.
    pub fn has_tenant_groups(&self) -> bool {
        self.inner.tenant_groups.len() > 1
    }

    /// Pins a published group-0 DRAM object of `size` bytes for a peer's read; returns its
    /// DRAM offset and namespace. Objects on a lower tier are not served (a peer would
    /// have to wait for a promotion here).
    pub fn pin(&self, key: ObjectKey, size: u64) -> Result<(u64, u128), String> {
        let mut store = self.inner.store.lock().expect("store lock");
        let ns = store.namespace_of(key).unwrap_or_default();
        match store.reserve_load(key, size) {
            LoadReservation::Pinned { offset } => Ok((offset, ns)),
            LoadReservation::SizeMismatch { stored } => Err(format!("key {:032x} is {stored} bytes, not {size}", key.0)),
            other => Err(format!("key {:032x} not in DRAM here ({other:?})", key.0)),
        }
    }

    pub fn unpin(&self, key: ObjectKey) {
        self.inner.store.lock().expect("store lock").finish_load(key);
    }

    /// Group 0's objects published in DRAM.
    pub fn dram_objects(&self) -> Vec<HeldObject> {
        self.inner.store.lock().expect("store lock").dram_objects(0)
    }

    /// Size and namespace of group-0 `key` if it is published in DRAM here.
    pub fn dram_object(&self, key: ObjectKey) -> Option<HeldObject> {
        self.inner.store.lock().expect("store lock").dram_object(0, key)
    }

    /// Group 0's KV event log (the change stream the cluster follows).
    pub fn events_memory(&self) -> Arc<SharedMemory> {
        self.inner.group_mem[0].events_mem.clone()
    }

    /// Mirrors a peer's key in group 0 as a `Lower { Remote }` object (index entry marked
    /// remote, KV event `Stored(remote)`); false if held here in any form, no index room,
    /// or `max_entries` remote objects are listed already (checked under the store lock).
    pub fn insert_remote(&self, o: HeldObject, max_entries: u64) -> bool {
        self.inner.store.lock().expect("store lock").insert_remote(o, max_entries)
    }

    /// Remote objects listed in group 0 now.
    pub fn remote_entries(&self) -> u64 {
        self.inner.store.lock().expect("store lock").remote_entries()
    }

    /// Most live entries the index takes (local and remote together; the cluster tier runs
    /// only on pools with the one group 0).
    pub fn index_capacity(&self) -> u64 {
        self.inner.store.lock().expect("store lock").index_capacity()
    }

    /// Drops group-0 `key` if it is (still) a remote-only object.
    pub fn remove_remote(&self, key: ObjectKey) -> bool {
        self.inner.store.lock().expect("store lock").remove_remote(key)
    }

    /// A promotion from the remote tier whose destination a transfer may still write
    /// (timeout): the object leaves the pool and its DRAM is never handed out again.
    pub fn abandon_promotion(&self, key: ObjectKey) -> u64 {
        self.inner.store.lock().expect("store lock").abandon_promotion(key)
    }

    /// Installs the source loads of remote objects promote through (once).
    pub fn set_remote_source(&self, source: Arc<dyn TierSource>) -> bool {
        self.inner.remote_source.0.set(source).is_ok()
    }
}
