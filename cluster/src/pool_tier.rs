//! The cluster tier on a real pool (`umbp_pool::remote::ClusterAccess`): the node serves
//! pins from the pool's store, advertises the pool's group-0 keys (a snapshot on join,
//! then the pool's KV event log, followed by its own reader), mirrors peers' keys as
//! `Tier::Remote` index entries, and is installed as the pool's `RemoteTier` so a load of
//! a remote entry pulls the object over NIXL.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use umbp_pool::remote::{ClusterAccess, HeldObject};
use umbp_pool::remote::{FetchItem, TierSource};
use umbp_protocol::events::{EventKind, EventLog, EventLogReader};
use umbp_protocol::{ObjectKey, Tier};


use crate::catalog::{IndexChange, KeyChange};
use crate::membership::Discovery;
use crate::node::{Cluster, ClusterConfig, ClusterError, FetchRequest, LocalPool};

struct PoolSide(ClusterAccess);

impl LocalPool for PoolSide {
    fn snapshot(&self) -> Vec<KeyChange> {
        self.0.dram_objects().into_iter().map(|o| KeyChange::stored(o.key.0, o.size, o.namespace)).collect()
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
                IndexChange::Insert(o) if o.group == 0 => {
                    self.0.insert_remote(HeldObject { key: o.key, size: o.size, namespace: o.namespace });
                }
                IndexChange::Remove((0, k)) => {
                    self.0.remove_remote(k);
                }
                _ => {}
            }
        }
    }
}

struct FetchSide(Arc<Cluster>, ClusterAccess);

impl TierSource for FetchSide {
    fn fetch(&self, items: &mut [FetchItem<'_>]) -> Vec<bool> {
        let reqs: Vec<FetchRequest> =
            items.iter_mut().map(|it| FetchRequest { key: it.key, size: it.dst.len() as u64, dest: it.dst.as_mut_ptr() }).collect();
        // SAFETY: each `dst` is the object's new DRAM allocation (in the mapping this node
        // registered), written only by this fetch until the promotion ends; on a tainted
        // failure the promotion is abandoned below, so that DRAM is never reused.
        let results = unsafe { self.0.fetch_batch(0, &reqs) };
        reqs.iter()
            .zip(results)
            .map(|(r, res)| match res {
                Ok(_) => true,
                Err(e) => {
                    if e.destination_tainted() {
                        let leaked = self.1.abandon_promotion(r.key);
                        tracing::warn!(key = format!("{:032x}", r.key.0), leaked, "remote read timed out: its DRAM is quarantined");
                    }
                    false
                }
            })
            .collect()
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
        access.set_remote_source(Arc::new(FetchSide(cluster.clone(), access.clone())));
        let stop = Arc::new(AtomicBool::new(false));
        let (c, s, a) = (cluster.clone(), stop.clone(), access.clone());
        let follower = std::thread::Builder::new()
            .name("cluster-events".into())
            .spawn(move || follow(&c, &a, &events, &s))
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
fn follow(cluster: &Cluster, access: &ClusterAccess, events: &umbp_ipc::SharedMemory, stop: &AtomicBool) {
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
        for e in &buf {
            let mut c = KeyChange { tier: e.tier as u8, ..KeyChange::removed(e.key.0) };
            if e.kind == EventKind::Stored {
                c.stored = true;
                if e.tier == Tier::Dram {
                    // Size and namespace from the store; gone already: its Removed follows.
                    let Some(o) = access.dram_object(e.key) else { continue };
                    (c.size, c.namespace) = (o.size, o.namespace);
                }
            }
            changes.push(c);
        }
        cluster.publish(&changes);
        if r.read == 0 {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}
