//! The cluster tier on a real pool (`umbp_pool::remote::ClusterAccess`): the node serves
//! pins from the pool's store, advertises the pool's group-0 keys (a snapshot on join,
//! then the pool's KV event log, followed by its own reader), mirrors peers' keys as
//! `Tier::Remote` index entries, and is installed as the pool's `RemoteTier` so a load of
//! a remote entry pulls the object over NIXL.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use umbp_pool::remote::{ClusterAccess, RemoteFetchError, RemoteTier};
use umbp_protocol::events::{EventKind, EventLog, EventLogReader};
use umbp_protocol::{ObjectKey, Tier};

use crate::catalog::{IndexChange, KeyChange};
use crate::membership::Discovery;
use crate::node::{Cluster, ClusterConfig, ClusterError, LocalPool};

struct PoolSide(ClusterAccess);

impl LocalPool for PoolSide {
    fn snapshot(&self) -> Vec<KeyChange> {
        self.0.published_keys().into_iter().map(|k| KeyChange { group: 0, key: k.0, stored: true, tier: Tier::Dram as u8 }).collect()
    }

    fn pin(&self, group: u32, key: ObjectKey, size: u64) -> Result<(u64, u128), String> {
        if group != 0 {
            return Err(format!("group {group}: the cluster tier serves group 0 only"));
        }
        self.0.pin(key, size)
    }

    fn unpin(&self, _group: u32, key: ObjectKey) {
        self.0.unpin(key);
    }

    fn apply_index(&self, changes: &[IndexChange]) {
        for c in changes {
            match *c {
                IndexChange::Insert((0, k)) => {
                    self.0.insert_remote(k, 0);
                }
                IndexChange::Remove((0, k)) => {
                    self.0.remove_remote(k);
                }
                _ => {}
            }
        }
    }
}

struct FetchSide(Arc<Cluster>);

impl RemoteTier for FetchSide {
    fn fetch(&self, key: ObjectKey, size: u64, dest: *mut u8) -> Result<u128, RemoteFetchError> {
        // SAFETY: the pool hands a reserved, unpublished range of its DRAM (registered with
        // this node at start) and quarantines it when the error says it is tainted.
        unsafe { self.0.fetch(0, key, size, dest) }
            .map_err(|e| RemoteFetchError { tainted: e.destination_tainted(), message: e.to_string() })
    }
}

/// A running cluster tier; stops on drop.
pub struct ClusterTier {
    cluster: Arc<Cluster>,
    stop: Arc<AtomicBool>,
    follower: Option<std::thread::JoinHandle<()>>,
}

#[derive(Debug, thiserror::Error)]
pub enum TierError {
    #[error("--cluster-* cannot be combined with --namespace-acl: the cluster tier serves tenant group 0 only (docs/cluster.md)")]
    TenantGroups,
    #[error(transparent)]
    Cluster(#[from] ClusterError),
}

impl ClusterTier {
    /// Starts the node over `access`'s pool and installs it as the pool's remote tier.
    pub fn start(access: ClusterAccess, cfg: ClusterConfig, discovery: Box<dyn Discovery>) -> Result<Self, TierError> {
        if access.has_tenant_groups() {
            return Err(TierError::TenantGroups);
        }
        let (base, len) = access.dram();
        let events = access.events_memory();
        // SAFETY: the pool's DRAM mapping lives as long as the pool, and the pool outlives
        // this tier (the daemon drops the tier first); peers read only objects they pinned.
        let cluster = Arc::new(unsafe { Cluster::start(cfg, discovery, Arc::new(PoolSide(access.clone())), base, len) }?);
        access.set_remote_tier(Arc::new(FetchSide(cluster.clone())));
        let stop = Arc::new(AtomicBool::new(false));
        let (c, s) = (cluster.clone(), stop.clone());
        let follower = std::thread::Builder::new()
            .name("cluster-events".into())
            .spawn(move || follow(&c, &events, &s))
            .expect("spawn");
        Ok(Self { cluster, stop, follower: Some(follower) })
    }

    pub fn cluster(&self) -> &Arc<Cluster> {
        &self.cluster
    }
}

impl Drop for ClusterTier {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.follower.take() {
            let _ = t.join();
        }
    }
}

/// Follows group 0's KV event log and publishes its changes to the subscribers. An
/// overrun (the log lapped this reader) makes every subscriber re-join for a snapshot.
fn follow(cluster: &Cluster, events: &umbp_ipc::SharedMemory, stop: &AtomicBool) {
    // SAFETY: the pool's event log region, formatted at its start and mapped as long as
    // `events` lives (held by the caller's closure).
    let log = match unsafe { EventLog::attach(events.as_ptr(), events.len()) } {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("cluster: cannot follow the KV event log: {e}");
            return;
        }
    };
    let mut reader = EventLogReader::from_now(log);
    let mut buf = Vec::new();
    let mut changes = Vec::new();
    while !stop.load(Ordering::Acquire) {
        buf.clear();
        let r = reader.poll(&mut buf, 4096);
        if r.lost > 0 {
            tracing::warn!(lost = r.lost, "cluster: KV event log overrun; subscribers re-join for a snapshot");
            cluster.resync_subscribers();
        }
        changes.clear();
        changes.extend(buf.iter().map(|e| KeyChange {
            group: 0,
            key: e.key.0,
            stored: e.kind == EventKind::Stored,
            tier: e.tier as u8,
        }));
        cluster.publish(&changes);
        if r.read == 0 {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}
