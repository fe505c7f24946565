//! The pool's side of the cluster tier seam (docs/cluster.md). The pool knows no NIXL and
//! no peers: a cluster implementation (`umbp-cluster`) gets a [`ClusterAccess`] from
//! [`crate::Pool::cluster_access`] to register the DRAM, pin objects for peers' reads,
//! list and follow this pool's keys and mirror peers' keys as remote index entries; and
//! installs a [`RemoteTier`] through which a load of a remote entry pulls the object.
//! The cluster tier serves tenant group 0 (pools without `--namespace-acl`).

use std::sync::Arc;

use umbp_ipc::SharedMemory;
use umbp_protocol::ObjectKey;

use crate::objects::{GroupKey, LoadReservation, StoreReservation};
use crate::PoolInner;

/// A failed remote fetch; the block's load fails and the engine recomputes.
#[derive(Debug, Clone)]
pub struct RemoteFetchError {
    pub message: String,
    /// The transfer may still write the destination (timeout): never reuse it.
    pub tainted: bool,
}

/// Pulls peers' objects into this pool's DRAM (implemented by the cluster tier).
pub trait RemoteTier: Send + Sync {
    /// Fetches group-0 `key` (`size` bytes) into `dest`, a reserved, unpublished range of
    /// this pool's DRAM; returns the object's namespace at its holder. Bounded in time.
    fn fetch(&self, key: ObjectKey, size: u64, dest: *mut u8) -> Result<u128, RemoteFetchError>;
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
    /// DRAM offset and namespace.
    pub fn pin(&self, key: ObjectKey, size: u64) -> Result<(u64, u128), String> {
        let mut store = self.inner.store.lock().expect("store lock");
        let ns = store.namespace_of(key).unwrap_or_default();
        match store.reserve_load(key, size) {
            LoadReservation::Pinned { offset } => Ok((offset, ns)),
            LoadReservation::Missing => Err(format!("key {:032x} not held in DRAM", key.0)),
            LoadReservation::SizeMismatch { stored } => Err(format!("key {:032x} is {stored} bytes, not {size}", key.0)),
        }
    }

    pub fn unpin(&self, key: ObjectKey) {
        self.inner.store.lock().expect("store lock").finish_load(key);
    }

    /// Keys of group 0's published objects.
    pub fn published_keys(&self) -> Vec<ObjectKey> {
        self.inner.store.lock().expect("store lock").published_keys(0)
    }

    /// Group 0's KV event log (the change stream the cluster follows).
    pub fn events_memory(&self) -> Arc<SharedMemory> {
        self.inner.group_mem[0].events_mem.clone()
    }

    /// Mirrors a peer's key (`peer`: the location payload) in group 0's index.
    pub fn insert_remote(&self, key: ObjectKey, peer: u64) -> bool {
        self.inner.store.lock().expect("store lock").insert_remote(key, peer)
    }

    pub fn remove_remote(&self, key: ObjectKey) -> bool {
        self.inner.store.lock().expect("store lock").remove_remote(key)
    }

    pub fn is_remote(&self, key: ObjectKey) -> bool {
        self.inner.store.lock().expect("store lock").is_remote(key)
    }

    /// Installs the tier loads of remote entries go through (once).
    pub fn set_remote_tier(&self, tier: Arc<dyn RemoteTier>) -> bool {
        self.inner.remote_tier.set(tier).is_ok()
    }

    /// Pulls remote `key` into a fresh local object (reserved under `namespace`, the
    /// loader's), publishes it (the copy replaces the remote entry) and returns whether it
    /// is now held here. No lock is held during the fetch.
    pub fn promote(&self, namespace: u128, key: ObjectKey, size: u64, owner: u32) -> Result<bool, RemoteFetchError> {
        promote(&self.inner, namespace, key, size, owner)
    }
}

/// See [`ClusterAccess::promote`]; the load path calls this for a remote entry.
pub(crate) fn promote(inner: &PoolInner, namespace: u128, key: ObjectKey, size: u64, owner: u32) -> Result<bool, RemoteFetchError> {
    let Some(tier) = inner.remote_tier.get() else {
        return Err(RemoteFetchError { message: "no cluster tier in this pool".into(), tainted: false });
    };
    let gk = GroupKey::from(key);
    let offset = {
        let mut store = inner.store.lock().expect("store lock");
        if !store.is_remote(key) {
            return Ok(store.namespace_of(gk).is_some()); // raced: held here now, or gone
        }
        match store.reserve_store(namespace, gk, size, owner) {
            StoreReservation::Reserved { offset } => offset,
            StoreReservation::AlreadyPresent => return Ok(true),
            StoreReservation::NoRoom => {
                inner.wake_evictor();
                return Err(RemoteFetchError { message: "no DRAM room for a remote object".into(), tainted: false });
            }
        }
    };
    // SAFETY: [offset, offset+size) was just reserved for this object; nothing else reads
    // or writes it until finish_store/quarantine below.
    let dest = unsafe { inner.dram.base().add(offset as usize) };
    let r = tier.fetch(key, size, dest);
    let mut store = inner.store.lock().expect("store lock");
    match r {
        Ok(_) => Ok(store.finish_store(gk, true)),
        Err(e) => {
            if e.tainted {
                store.quarantine(gk);
            } else {
                store.finish_store(gk, false);
            }
            Err(e)
        }
    }
}
