//! The cluster tier on a real pool (`umbp_pool::remote::ClusterAccess`): the node serves
//! pins from the pool's store, advertises the pool's group-0 keys (a snapshot on join,
//! then the pool's KV event log, followed by its own reader), mirrors peers' keys as
//! `Tier::Remote` index entries, and is installed as the pool's `RemoteTier` so a load of
//! a remote entry pulls the object over NIXL.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use umbp_pool::remote::{ClusterAccess, HeldObject};
use umbp_pool::remote::{FetchItem, TierSource};
use umbp_protocol::events::{EventKind, EventLog, EventLogReader};
use umbp_protocol::{ObjectKey, Tier};


use crate::catalog::{IndexChange, KeyChange};
use crate::membership::Discovery;
use crate::node::{Cluster, ClusterConfig, ClusterError, FetchRequest, LocalPool};

/// The default cap on remote entries: this share of group 0's index capacity, so peers'
/// keys never take more than half of the index (local objects keep the rest).
pub const DEFAULT_REMOTE_SHARE: f64 = 0.5;

/// How the tier runs on the pool.
#[derive(Debug, Clone, Copy, Default)]
pub struct TierOptions {
    /// Most remote entries listed in the local index at once (`--cluster-max-remote-entries`);
    /// None: [`DEFAULT_REMOTE_SHARE`] of the index capacity. Remote keys past it are not
    /// listed until room frees (counted in `remote_refused`); local objects never lose
    /// index room to them.
    pub max_remote_entries: Option<u64>,
}

struct PoolSide {
    access: ClusterAccess,
    max_remote: u64,
    /// Remote keys not listed because of the cap (a count, for reports and the one warning).
    refused: AtomicU64,
    /// Those keys, listed when room frees (a remote entry promoted or removed) while a peer
    /// still advertises them; forgotten when the catalog drops them.
    waiting: Mutex<HashSet<ObjectKey>>,
    /// Keys whose pull failed: their promotion's `Removed(remote)` re-lists them while a
    /// live peer advertises them (other removals, a reset or index pressure, do not).
    failed: Mutex<HashSet<ObjectKey>>,
}

impl PoolSide {
    fn list(&self, key: ObjectKey, size: u64, namespace: u128) -> bool {
        let listed = self.access.insert_remote(HeldObject { key, size, namespace }, self.max_remote);
        if !listed && self.access.remote_entries() >= self.max_remote {
            self.waiting.lock().expect("waiting").insert(key);
            if self.refused.fetch_add(1, Ordering::Relaxed) == 0 {
                tracing::warn!(
                    cap = self.max_remote,
                    "cluster: remote entries reached --cluster-max-remote-entries; further remote keys are listed only as room frees"
                );
            }
        }
        listed
    }

    /// Lists keys the cap held back while there is room and a peer still advertises them.
    fn refill(&self, cluster: &Cluster) {
        loop {
            if self.access.remote_entries() >= self.max_remote {
                return;
            }
            let Some(k) = self.waiting.lock().expect("waiting").iter().next().copied() else { return };
            self.waiting.lock().expect("waiting").remove(&k);
            if let Some(o) = cluster.remote_object(0, k) {
                if !self.list(o.key, o.size, o.namespace) && self.access.remote_entries() >= self.max_remote {
                    return; // raced with another listing: back in `waiting`
                }
            }
        }
    }
}

impl LocalPool for PoolSide {
    fn snapshot(&self) -> Vec<KeyChange> {
        self.access.dram_objects().into_iter().map(|o| KeyChange::stored(o.key.0, o.size, o.namespace)).collect()
    }

    fn pin(&self, group: u32, key: ObjectKey, size: u64) -> Result<(u64, u128), String> {
        if group != 0 {
            return Err(format!("group {group}: the cluster tier serves group 0 only"));
        }
        self.access.pin(key, size)
    }

    fn unpin(&self, _group: u32, key: ObjectKey) {
        self.access.unpin(key);
    }

    fn apply_index(&self, changes: &[IndexChange]) {
        for c in changes {
            match *c {
                IndexChange::Insert(o) if o.group == 0 => {
                    self.list(o.key, o.size, o.namespace);
                }
                IndexChange::Remove((0, k)) => {
                    self.waiting.lock().expect("waiting").remove(&k);
                    self.access.remove_remote(k);
                }
                _ => {}
            }
        }
    }
}

struct FetchSide(Arc<Cluster>, ClusterAccess, Arc<PoolSide>);

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
                    // Before the pool drops the promotion (its event comes after this).
                    self.2.failed.lock().expect("failed").insert(r.key);
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
    side: Arc<PoolSide>,
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
    pub fn start(access: ClusterAccess, cfg: ClusterConfig, discovery: Box<dyn Discovery>, opts: TierOptions) -> Result<Self, TierError> {
        if access.has_tenant_groups() {
            return Err(TierError::TenantGroups);
        }
        let (base, len) = access.dram();
        let events = access.events_memory();
        let max_remote = opts.max_remote_entries.unwrap_or((access.index_capacity() as f64 * DEFAULT_REMOTE_SHARE) as u64);
        let side = Arc::new(PoolSide {
            access: access.clone(),
            max_remote,
            refused: AtomicU64::new(0),
            waiting: Mutex::new(HashSet::new()),
            failed: Mutex::new(HashSet::new()),
        });
        // SAFETY: the pool's DRAM mapping lives as long as the pool, and the pool outlives
        // this tier (the daemon drops the tier first); peers read only objects they pinned.
        let cluster = Arc::new(unsafe { Cluster::start(cfg, discovery, side.clone(), base, len) }?);
        access.set_remote_source(Arc::new(FetchSide(cluster.clone(), access.clone(), side.clone())));
        let stop = Arc::new(AtomicBool::new(false));
        let (c, s, p) = (cluster.clone(), stop.clone(), side.clone());
        let follower = std::thread::Builder::new()
            .name("cluster-events".into())
            .spawn(move || follow(&c, &p, &events, &s))
            .expect("spawn");
        tracing::info!(max_remote_entries = max_remote, "cluster tier on the pool");
        Ok(Self { cluster, side, stop, follower: Some(follower) })
    }

    pub fn cluster(&self) -> &Arc<Cluster> {
        &self.cluster
    }

    /// The cap on remote entries in effect.
    pub fn max_remote_entries(&self) -> u64 {
        self.side.max_remote
    }

    /// Remote keys not listed because of the cap.
    pub fn remote_refused(&self) -> u64 {
        self.side.refused.load(Ordering::Relaxed)
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
///
/// It also lists again a remote entry whose pull failed (a stopped or slow holder: the
/// pool drops the promoting object like any failed promotion) while a live peer still
/// advertises the key, so the next load pulls it from the holder placement picks then.
/// Without this a key held by two peers would vanish here for good when one of them failed
/// a fetch: the catalog only re-inserts a key when its first holder appears. Entries
/// removed otherwise (a reset, index pressure) are not re-listed. Any removal of a remote
/// entry frees room under the cap: held-back keys are listed then.
fn follow(cluster: &Cluster, side: &PoolSide, events: &umbp_ipc::SharedMemory, stop: &AtomicBool) {
    let access = &side.access;
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
        let mut room_freed = false;
        for e in &buf {
            if e.kind != EventKind::Stored && e.tier == Tier::Remote {
                room_freed = true;
                if side.failed.lock().expect("failed").remove(&e.key) {
                    if let Some(o) = cluster.remote_object(0, e.key) {
                        side.list(o.key, o.size, o.namespace);
                    }
                }
            }
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
        if room_freed {
            side.refill(cluster);
        }
        if r.read == 0 {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}
