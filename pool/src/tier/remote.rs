//! The pool's side of the cluster tier seam (docs/cluster.md). The pool knows no NIXL and
//! no peers: a cluster implementation (`umbp-cluster`) gets a [`ClusterAccess`] from
//! [`crate::Pool::cluster_access`] to register the DRAM (as the destination of this
//! pool's remote reads), pin objects while it copies them out for peers' reads,
//! list and follow this pool's keys, mirror peers' keys as `Lower { Remote }` objects, and
//! install the [`TierSource`] that loads of those promote through (tier/mod.rs: the same seam
//! as the SSD tier; `Tiers::remote` is a [`RemoteSlot`] filled once the cluster starts).
//! With `--namespace-acl`, peers' keys are routed by namespace: each is listed in the
//! tenant group of its namespace, and a peer's pin names the namespace.

use std::sync::{Arc, OnceLock};

use umbp_ipc::SharedMemory;
use umbp_protocol::ObjectKey;

pub use crate::store::objects::HeldObject;
use crate::store::objects::{GroupKey, LoadReservation, Writer};
use crate::store::Store;
pub use crate::tier::{FetchItem, TierSource};

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

    fn cluster_report(&self) -> Option<crate::pool_report::ClusterReport> {
        self.0.get().and_then(|s| s.cluster_report())
    }
}

/// What the cluster tier may do to a running pool.
#[derive(Clone)]
pub struct ClusterAccess {
    pub(crate) store: Arc<Store>,
    pub(crate) remote_source: RemoteSlot,
}

impl ClusterAccess {
    /// The DRAM tier's mapping (registered with NIXL as the destination of this pool's
    /// remote reads; peers read copies from the cluster's export area, never this).
    pub fn dram(&self) -> (*mut u8, usize) {
        (self.store.dram.base(), self.store.dram.len())
    }

    /// This pool's tenant groups (from `--namespace-acl`; one group without it).
    pub fn tenant_groups(&self) -> &crate::store::groups::TenantGroups {
        &self.store.tenant_groups
    }

    /// Pins a published DRAM object of `size` bytes for a peer's read, found by its
    /// NAMESPACE: only in the tenant group of `namespace` here, and only if it was stored
    /// under `namespace` (anything else is a miss). Returns its DRAM offset and namespace.
    /// Objects on a lower tier are not served (a peer would have to wait for a promotion).
    pub fn pin(&self, namespace: u128, key: ObjectKey, size: u64) -> Result<(u64, u128), String> {
        let gk = GroupKey::new(self.store.tenant_groups.group_of(namespace), key);
        let mut store = self.store.objects.lock().expect("store lock");
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
        let gk = GroupKey::new(self.store.tenant_groups.group_of(namespace), key);
        self.store.objects.lock().expect("store lock").finish_load(gk);
    }

    /// Every group's objects published in DRAM, with their group.
    pub fn dram_objects(&self) -> Vec<(u32, HeldObject)> {
        let store = self.store.objects.lock().expect("store lock");
        (0..self.store.tenant_groups.len() as u32).flat_map(|g| store.dram_objects(g).into_iter().map(move |o| (g, o))).collect()
    }

    /// Size and namespace of `key` of `group` if it is published in DRAM here.
    pub fn dram_object(&self, group: u32, key: ObjectKey) -> Option<HeldObject> {
        self.store.objects.lock().expect("store lock").dram_object(group, key)
    }

    /// `group`'s KV event log (the change streams the cluster follows, one per group).
    pub fn events_memory(&self, group: u32) -> Arc<SharedMemory> {
        self.store.group_mem[group as usize].events_mem.clone()
    }

    /// Mirrors a peer's key as a `Lower { Remote }` object (index entry marked remote, KV
    /// event `Stored(remote)`) in the tenant group of its NAMESPACE here (so only engines
    /// whose ACL allows that namespace see it); false if held there in any form, no index
    /// room, or `max_entries` remote objects are listed already (checked under the store
    /// lock). Returns the group too.
    pub fn insert_remote(&self, o: HeldObject, max_entries: u64) -> (u32, bool) {
        let g = self.store.tenant_groups.group_of(o.namespace);
        (g, self.store.objects.lock().expect("store lock").insert_remote(g, o, max_entries))
    }

    /// Remote objects listed now (all groups).
    pub fn remote_entries(&self) -> u64 {
        self.store.objects.lock().expect("store lock").remote_entries()
    }

    /// Most live entries the indexes take (local and remote together, all groups).
    pub fn index_capacity(&self) -> u64 {
        self.store.objects.lock().expect("store lock").index_capacity()
    }

    /// Drops `key` of tenant group `group` if it is (still) a remote-only object.
    pub fn remove_remote(&self, group: u32, key: ObjectKey) -> bool {
        self.store.objects.lock().expect("store lock").remove_remote(group, key)
    }

    /// A promotion from the remote tier whose destination a timed-out read may still write
    /// (`holder`: the tag the cluster tier gave that read): the object leaves the pool and
    /// its DRAM is quarantined until [`Self::holder_forgotten`] for that tag says the read
    /// is final (see `objects/quarantine.rs`).
    pub fn abandon_promotion(&self, namespace: u128, key: ObjectKey, holder: &str) -> u64 {
        let g = self.store.tenant_groups.group_of(namespace);
        self.store.objects.lock().expect("store lock").abandon_promotion(GroupKey::new(g, key), Writer::RemoteRead(holder.to_string()))
    }

    /// Reclaims the DRAM the timed-out reads filed under `holder` left (once their loads
    /// finished them), for a caller that KNOWS no byte of those reads can land any more:
    /// the cluster tier calls it with a read's tag once NIXL reports that read final.
    /// Returns the bytes reclaimed.
    pub fn holder_forgotten(&self, holder: &str) -> u64 {
        self.store.objects.lock().expect("store lock").reclaim_quarantine_of(holder)
    }

    /// Installs the source loads of remote objects promote through (once).
    pub fn set_remote_source(&self, source: Arc<dyn TierSource>) -> bool {
        self.remote_source.0.set(source).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use umbp_protocol::ObjectKey;

    use crate::store::objects::{GroupKey, StoreReservation};
    use crate::{Pool, PoolConfig};

    /// A peer's pin names the namespace: the holder serves only an object stored under it
    /// (in that namespace's tenant group); the same key under another namespace, or asked
    /// for under another namespace, is a miss. Remote entries are listed in the group of
    /// their namespace.
    #[test]
    fn pins_and_remote_entries_go_by_namespace() {
        let dir = tempfile::tempdir().unwrap();
        let mut acl = std::collections::BTreeMap::new();
        acl.insert(65533u32, vec![0xa11ceu128]);
        acl.insert(65534u32, vec![0xb0bu128]);
        // Two namespaces of one reader: one tenant group.
        acl.insert(65535u32, vec![0xd1u128, 0xd2]);
        let cfg = PoolConfig { socket_path: dir.path().join("s"), capacity_bytes: 64 << 20, namespace_acl: acl, ..PoolConfig::default() };
        let pool = Pool::start(cfg).expect("pool starts");
        let access = pool.cluster_access();
        let groups = access.tenant_groups().clone();
        let (ga, gb) = (groups.group_of(0xa11ce), groups.group_of(0xb0b));
        assert!(ga != gb && ga != 0 && gb != 0);
        let k = ObjectKey(42);
        {
            let mut store = access.store.objects.lock().unwrap();
            let r = store.reserve_store(0xa11ce, GroupKey::new(ga, k), 4096, 1);
            assert!(matches!(r, StoreReservation::Reserved { .. }), "{r:?}");
            assert!(store.finish_store(GroupKey::new(ga, k), true));
        }
        assert_eq!(access.dram_objects().iter().map(|(g, o)| (*g, o.key)).collect::<Vec<_>>(), vec![(ga, k)]);
        let e = access.pin(0xb0b, k, 4096).unwrap_err();
        assert!(e.contains("not held"), "{e}");
        let e = access.pin(0xc0c, k, 4096).unwrap_err();
        assert!(e.contains("not held"), "an unlisted namespace (group 0): {e}");
        let (_, ns) = access.pin(0xa11ce, k, 4096).expect("pinned under its own namespace");
        assert_eq!(ns, 0xa11ce);
        access.unpin(0xa11ce, k);
        // Same group, another namespace: still a miss (the namespace is checked, not only
        // the group).
        let gd = groups.group_of(0xd1);
        assert_eq!(gd, groups.group_of(0xd2));
        {
            let mut store = access.store.objects.lock().unwrap();
            assert!(matches!(store.reserve_store(0xd1, GroupKey::new(gd, k), 4096, 1), StoreReservation::Reserved { .. }));
            assert!(store.finish_store(GroupKey::new(gd, k), true));
        }
        let e = access.pin(0xd2, k, 4096).unwrap_err();
        assert!(e.contains("not held under namespace"), "{e}");
        assert_eq!(access.pin(0xd1, k, 4096).map(|p| p.1), Ok(0xd1));
        access.unpin(0xd1, k);
        // A peer's key in namespace B is listed in B's group only.
        let held = super::HeldObject { key: ObjectKey(43), size: 4096, namespace: 0xb0b };
        assert_eq!(access.insert_remote(held, u64::MAX), (gb, true));
        let store = access.store.objects.lock().unwrap();
        assert_eq!(store.namespace_of(GroupKey::new(gb, ObjectKey(43))), Some(0xb0b));
        assert_eq!(store.namespace_of(GroupKey::new(ga, ObjectKey(43))), None);
        assert_eq!(store.namespace_of(GroupKey::new(0, ObjectKey(43))), None);
    }
}
