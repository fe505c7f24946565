//! The pool's side of the cluster tier seam (docs/cluster.md). The pool knows no NIXL and
//! no peers: a cluster implementation (`umbp-cluster`) gets a [`ClusterAccess`] from
//! [`crate::Pool::cluster_access`] to register the DRAM, pin objects for peers' reads,
//! list and follow this pool's keys, mirror peers' keys as `Lower { Remote }` objects, and
//! install the [`TierSource`] that loads of those promote through (tier.rs: the same seam
//! as the SSD tier; `Tiers::remote` is a [`RemoteSlot`] filled once the cluster starts).
//! With `--namespace-acl`, peers' keys are routed by namespace: each is listed in the
//! tenant group of its namespace, and a peer's pin names the namespace.

use std::sync::{Arc, OnceLock};

use umbp_ipc::SharedMemory;
use umbp_protocol::ObjectKey;

use crate::objects::{GroupKey, LoadReservation};
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

    /// This pool's tenant groups (from `--namespace-acl`; one group without it).
    pub fn tenant_groups(&self) -> &crate::groups::TenantGroups {
        &self.inner.tenant_groups
    }

    /// Pins a published DRAM object of `size` bytes for a peer's read, found by its
    /// NAMESPACE: only in the tenant group of `namespace` here, and only if it was stored
    /// under `namespace` (anything else is a miss). Returns its DRAM offset and namespace.
    /// Objects on a lower tier are not served (a peer would have to wait for a promotion).
    pub fn pin(&self, namespace: u128, key: ObjectKey, size: u64) -> Result<(u64, u128), String> {
        let gk = GroupKey::new(self.inner.tenant_groups.group_of(namespace), key);
        let mut store = self.inner.store.lock().expect("store lock");
        match store.namespace_of(gk) {
            Some(ns) if ns == namespace => {}
            Some(_) => return Err(format!("key {:032x} is not held under namespace {namespace:032x} here", key.0)),
            None => return Err(format!("key {:032x} not held here", key.0)),
        }
        match store.reserve_load(gk, size) {
            LoadReservation::Pinned { offset } => Ok((offset, namespace)),
            LoadReservation::SizeMismatch { stored } => Err(format!("key {:032x} is {stored} bytes, not {size}", key.0)),
            other => Err(format!("key {:032x} not in DRAM here ({other:?})", key.0)),
        }
    }

    /// Releases a pin taken by [`Self::pin`] (same namespace and key).
    pub fn unpin(&self, namespace: u128, key: ObjectKey) {
        let gk = GroupKey::new(self.inner.tenant_groups.group_of(namespace), key);
        self.inner.store.lock().expect("store lock").finish_load(gk);
    }

    /// Every group's objects published in DRAM, with their group.
    pub fn dram_objects(&self) -> Vec<(u32, HeldObject)> {
        let store = self.inner.store.lock().expect("store lock");
        (0..self.inner.tenant_groups.len() as u32).flat_map(|g| store.dram_objects(g).into_iter().map(move |o| (g, o))).collect()
    }

    /// Size and namespace of `key` of `group` if it is published in DRAM here.
    pub fn dram_object(&self, group: u32, key: ObjectKey) -> Option<HeldObject> {
        self.inner.store.lock().expect("store lock").dram_object(group, key)
    }

    /// `group`'s KV event log (the change streams the cluster follows, one per group).
    pub fn events_memory(&self, group: u32) -> Arc<SharedMemory> {
        self.inner.group_mem[group as usize].events_mem.clone()
    }

    /// Mirrors a peer's key as a `Lower { Remote }` object (index entry marked remote, KV
    /// event `Stored(remote)`) in the tenant group of its NAMESPACE here (so only engines
    /// whose ACL allows that namespace see it); false if held there in any form, no index
    /// room, or `max_entries` remote objects are listed already (checked under the store
    /// lock). Returns the group too.
    pub fn insert_remote(&self, o: HeldObject, max_entries: u64) -> (u32, bool) {
        let g = self.inner.tenant_groups.group_of(o.namespace);
        (g, self.inner.store.lock().expect("store lock").insert_remote(g, o, max_entries))
    }

    /// Remote objects listed now (all groups).
    pub fn remote_entries(&self) -> u64 {
        self.inner.store.lock().expect("store lock").remote_entries()
    }

    /// Most live entries the indexes take (local and remote together, all groups).
    pub fn index_capacity(&self) -> u64 {
        self.inner.store.lock().expect("store lock").index_capacity()
    }

    /// Drops `key` of tenant group `group` if it is (still) a remote-only object.
    pub fn remove_remote(&self, group: u32, key: ObjectKey) -> bool {
        self.inner.store.lock().expect("store lock").remove_remote(group, key)
    }

    /// A promotion from the remote tier whose destination a transfer may still write
    /// (timeout): the object leaves the pool and its DRAM is never handed out again.
    pub fn abandon_promotion(&self, namespace: u128, key: ObjectKey) -> u64 {
        let g = self.inner.tenant_groups.group_of(namespace);
        self.inner.store.lock().expect("store lock").abandon_promotion(GroupKey::new(g, key))
    }

    /// Installs the source loads of remote objects promote through (once).
    pub fn set_remote_source(&self, source: Arc<dyn TierSource>) -> bool {
        self.inner.remote_source.0.set(source).is_ok()
    }
}
