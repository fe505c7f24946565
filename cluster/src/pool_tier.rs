//! The cluster tier on a real pool (`umbp_pool::remote::ClusterAccess`): the node serves
//! pins from the pool's store, advertises the pool's DRAM keys of every tenant group (a
//! snapshot on join, then each group's KV event log, followed by its own reader), mirrors
//! peers' keys as `Tier::Remote` index entries in the tenant group of their NAMESPACE
//! here, and is installed as the pool's `RemoteTier` so a load of a remote entry pulls
//! the object over NIXL (the pin names the namespace; docs/cluster.md).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use umbp_pool::remote::{ClusterAccess, HeldObject};
use umbp_pool::remote::{FetchItem, TierSource};
use umbp_protocol::events::{EventKind, EventLog, EventLogReader};
use umbp_protocol::{ObjectKey, Tier};

use crate::catalog::{IndexChange, KeyChange};
use crate::membership::Discovery;
use crate::node::{Cluster, ClusterConfig, ClusterError, FetchRequest, LocalPool, Pin};

/// The default cap on remote entries: this share of the pool's index capacity (all tenant
/// groups together), so peers' keys never take more than half of it (local objects keep
/// the rest). With tenant groups the cap is pool-wide: one group's remote entries are
/// bounded by it and by that group's own index room (index pressure drops them like any
/// object), not by half of that group's index.
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
    waiting: Mutex<HashSet<(u32, ObjectKey)>>,
    /// Keys whose pull failed: their promotion's `Removed(remote)` re-lists them while a
    /// live peer advertises them (other removals, a reset or index pressure, do not).
    failed: Mutex<HashSet<(u32, ObjectKey)>>,
    /// xxh3-128 of each DRAM object's bytes, taken by the event follower when the object
    /// was published (before it is advertised): a pin sends this digest, so bytes changed
    /// after the store (a remote NIXL write into the export slot holding the copy, a slot
    /// reused while a read was still going) fail the reader's check. Keyed by (group,
    /// key); the namespace and size guard against a re-store the follower has not seen yet.
    digests: Mutex<std::collections::HashMap<(u32, ObjectKey), StoredDigest>>,
    /// etcd membership's health for the report (`ClusterTier::report_etcd`); unset: the
    /// `--cluster-peer` list only.
    etcd: std::sync::OnceLock<crate::discovery::etcd::EtcdHandle>,
}

#[derive(Debug, Clone, Copy)]
struct StoredDigest {
    namespace: u128,
    size: u64,
    digest: u128,
}

/// xxh3-128 of `size` bytes at `offset` of the DRAM (a pinned object).
///
/// # Safety
/// `offset..offset+size` must lie in the mapping at `base` (len `len`, checked) and be
/// pinned (not rewritten) for the duration of the call.
unsafe fn dram_digest(base: *mut u8, len: usize, offset: u64, size: u64) -> Result<u128, String> {
    if offset.checked_add(size).is_none_or(|end| end > len as u64) {
        return Err(format!("offset {offset} + {size} bytes lies past the DRAM ({len} bytes)"));
    }
    // SAFETY: in the mapping (checked above); pinned per this function's contract.
    let bytes = unsafe { std::slice::from_raw_parts(base.add(offset as usize), size as usize) };
    Ok(xxhash_rust::xxh3::xxh3_128(bytes))
}

impl PoolSide {
    /// Lists a peer's key in the tenant group of its namespace here. `group`: the group
    /// the holder advertised it in, which is the same on every member (they run the same
    /// ACL: the handshake compares digests); a key whose namespace maps elsewhere is not
    /// listed (it could not be fetched by the catalog's group).
    fn list(&self, group: u32, key: ObjectKey, size: u64, namespace: u128) -> bool {
        let here = self.access.tenant_groups().group_of(namespace);
        if here != group {
            tracing::warn!(
                key = format!("{:032x}", key.0),
                group,
                here,
                "cluster: a peer advertised a key in another tenant group than its namespace's; not listed"
            );
            return false;
        }
        let (_, listed) = self.access.insert_remote(HeldObject { key, size, namespace }, self.max_remote);
        if !listed && self.access.remote_entries() >= self.max_remote {
            self.waiting.lock().expect("waiting").insert((group, key));
            if self.refused.fetch_add(1, Ordering::Relaxed) == 0 {
                tracing::warn!(
                    cap = self.max_remote,
                    "cluster: remote entries reached --cluster-max-remote-entries; further remote keys are listed only as room frees"
                );
            }
        }
        listed
    }

    /// Takes the digest of a just-published DRAM object (pinned meanwhile); nothing when
    /// it is gone already (its `Removed` follows).
    fn record_digest(&self, group: u32, o: umbp_pool::remote::HeldObject) {
        let Ok((offset, ns)) = self.access.pin(o.namespace, o.key, o.size) else { return };
        let (base, len) = self.access.dram();
        // SAFETY: pinned just above, released just below.
        let d = unsafe { dram_digest(base, len, offset, o.size) };
        self.access.unpin(ns, o.key);
        if let Ok(digest) = d {
            self.digests.lock().expect("digests").insert((group, o.key), StoredDigest { namespace: ns, size: o.size, digest });
        }
    }

    /// Lists keys the cap held back while there is room and a peer still advertises them.
    fn refill(&self, cluster: &Cluster) {
        loop {
            if self.access.remote_entries() >= self.max_remote {
                return;
            }
            let Some((g, k)) = self.waiting.lock().expect("waiting").iter().next().copied() else { return };
            self.waiting.lock().expect("waiting").remove(&(g, k));
            if let Some(o) = cluster.remote_object(g, k) {
                if !self.list(g, o.key, o.size, o.namespace) && self.access.remote_entries() >= self.max_remote {
                    return; // raced with another listing: back in `waiting`
                }
            }
        }
    }
}

impl LocalPool for PoolSide {
    fn snapshot(&self) -> Vec<KeyChange> {
        self.access
            .dram_objects()
            .into_iter()
            .map(|(g, o)| KeyChange { group: g, ..KeyChange::stored(o.key.0, o.size, o.namespace) })
            .collect()
    }

    fn pin(&self, _group: u32, namespace: u128, key: ObjectKey, size: u64) -> Result<Pin, String> {
        // By namespace: the group follows from it (and only an object stored under it).
        let (offset, namespace) = self.access.pin(namespace, key, size)?;
        let group = self.access.tenant_groups().group_of(namespace);
        let stored = self.digests.lock().expect("digests").get(&(group, key)).copied();
        if let Some(d) = stored.filter(|d| d.namespace == namespace && d.size == size) {
            return Ok(Pin { offset, namespace, digest: d.digest });
        }
        // Not seen by the follower yet (stored before the tier started, or just now):
        // the digest of the bytes as they are.
        let (base, len) = self.access.dram();
        // SAFETY: pinned by the reservation just taken (released by the peer's unpin or
        // below on an error).
        match unsafe { dram_digest(base, len, offset, size) } {
            Ok(digest) => Ok(Pin { offset, namespace, digest }),
            Err(e) => {
                self.access.unpin(namespace, key);
                Err(format!("key {:032x}: {e}", key.0))
            }
        }
    }

    fn unpin(&self, _group: u32, namespace: u128, key: ObjectKey) {
        self.access.unpin(namespace, key);
    }

    fn apply_index(&self, changes: &[IndexChange]) {
        for c in changes {
            match *c {
                IndexChange::Insert(o) => {
                    self.list(o.group, o.key, o.size, o.namespace);
                }
                IndexChange::Remove((g, k)) => {
                    self.waiting.lock().expect("waiting").remove(&(g, k));
                    self.access.remove_remote(g, k);
                }
            }
        }
    }

    /// Notice only: forgetting a holder's NIXL metadata does not stop a read already
    /// posted (the chaos soak, `umbp-bench soak --cluster`, 2026-12-05, saw a forgotten
    /// holder's read land on SIGCONT: 65,307 wrong bytes returned as `Loaded` when that
    /// DRAM was reclaimed here). The DRAM of given-up reads comes back through
    /// [`LocalPool::read_final`] instead.
    fn holder_forgotten(&self, agent: &str) {
        tracing::debug!(holder = agent, "holder forgotten");
    }

    /// The promotions the given-up read was filling leave the pool; their DRAM is
    /// quarantined under `tag` (this read alone) until [`Self::read_final`].
    fn read_given_up(&self, tag: &str, items: &[(u128, ObjectKey)]) {
        let leaked: u64 = items.iter().map(|&(ns, key)| self.access.abandon_promotion(ns, key, tag)).sum();
        tracing::warn!(read = tag, objects = items.len(), leaked, "remote read given up: its DRAM is quarantined until the read is final");
    }

    /// NIXL reports the given-up read `tag` final: its quarantined DRAM is reclaimed (at
    /// once for promotions their loads finished, else when they do).
    fn read_final(&self, tag: &str) {
        let reclaimed = self.access.holder_forgotten(tag);
        tracing::info!(read = tag, reclaimed, "given-up remote read is final: its quarantined DRAM is released");
    }
}

struct FetchSide(Arc<Cluster>, ClusterAccess, Arc<PoolSide>);

impl TierSource for FetchSide {
    fn fetch(&self, items: &mut [FetchItem<'_>]) -> Vec<bool> {
        let groups = self.1.tenant_groups();
        // The load's tenant group: that of the namespace the object was listed under.
        let mut by_group: std::collections::BTreeMap<u32, Vec<usize>> = Default::default();
        for (i, it) in items.iter().enumerate() {
            by_group.entry(groups.group_of(it.namespace)).or_default().push(i);
        }
        let mut ok = vec![false; items.len()];
        for (g, idx) in by_group {
            let reqs: Vec<FetchRequest> = idx
                .iter()
                .map(|&i| {
                    let it = &mut items[i];
                    FetchRequest { key: it.key, namespace: it.namespace, size: it.dst.len() as u64, dest: it.dst.as_mut_ptr() }
                })
                .collect();
            // SAFETY: each `dst` is the object's new DRAM allocation (in the mapping this
            // node registered), written only by this fetch until the promotion ends; on a
            // tainted failure the promotion is abandoned below, so that DRAM is never reused.
            let results = unsafe { self.0.fetch_batch(g, &reqs) };
            for ((r, res), &i) in reqs.iter().zip(results).zip(&idx) {
                ok[i] = self.settle(g, r, res);
            }
        }
        ok
    }

    fn cluster_report(&self) -> Option<umbp_pool::pool_report::ClusterReport> {
        let s = self.0.stats();
        Some(umbp_pool::pool_report::ClusterReport {
            peers: s.peers as u64,
            subscribers: s.subscribers as u64,
            remote_keys: s.remote_keys as u64,
            fetches: s.fetches,
            fetch_failures: s.fetch_failures,
            fetched_bytes: s.fetched_bytes,
            auth_failures: s.auth_failures,
            refused_connections: s.refused_connections,
            pins_over_cap: s.pins_over_cap,
            digest_mismatches: s.digest_mismatches,
            late_reads: s.late_reads,
            leased_pins: s.leased_pins,
            leases_over_cap: s.leases_over_cap,
            catalog_over_cap: s.catalog_over_cap,
            remote_refused: self.2.refused.load(Ordering::Relaxed),
            published_changes: s.published_changes,
            export_bytes_used: s.export_bytes_used,
            export_full: s.export_full,
            etcd: self.2.etcd.get().map(|h| {
                let e = h.health();
                umbp_pool::pool_report::EtcdReport {
                    reachable: e.reachable,
                    seconds_since_success: e.since_success.as_secs_f64(),
                    failed_requests: e.failed_requests,
                    outages: e.outages,
                    registrations: e.registrations,
                    members: e.members as u64,
                    registered: e.registered,
                }
            }),
        })
    }
}

impl FetchSide {
    fn settle(&self, g: u32, r: &FetchRequest, res: Result<u128, crate::node::FetchError>) -> bool {
        match res {
            // The holder pinned it under the namespace asked for (node.rs, `Pin`).
            Ok(ns) if ns == r.namespace => true,
            Ok(ns) => {
                tracing::warn!(key = format!("{:032x}", r.key.0), "remote holder served namespace {ns:x}, not {:x}: a miss", r.namespace);
                false
            }
            Err(e) => {
                // Before the pool drops the promotion (its event comes after this).
                self.2.failed.lock().expect("failed").insert((g, r.key));
                if let Some(read) = e.tainting_holder() {
                    // The node quarantined it already (`read_given_up`, before the fetch
                    // returned); it is released when the read is final (`read_final`).
                    tracing::debug!(
                        key = format!("{:032x}", r.key.0),
                        read,
                        "remote read timed out: its DRAM stays quarantined until the read is final"
                    );
                }
                false
            }
        }
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
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    #[error("cannot follow the KV event log of tenant group {group}: {reason}")]
    EventLog { group: u32, reason: String },
}

impl ClusterTier {
    /// Starts the node over `access`'s pool and installs it as the pool's remote tier.
    /// `cfg.acl` is set to this pool's ACL digest: peers must run the same `--namespace-acl`.
    pub fn start(
        access: ClusterAccess,
        mut cfg: ClusterConfig,
        discovery: Box<dyn Discovery>,
        opts: TierOptions,
    ) -> Result<Self, TierError> {
        cfg.acl = crate::control::acl_digest(access.tenant_groups());
        cfg.groups = access.tenant_groups().len() as u32;
        let (base, len) = access.dram();
        let events: Vec<_> = (0..access.tenant_groups().len() as u32).map(|g| access.events_memory(g)).collect();
        // Where the change stream starts, fixed before any peer can join: a subscriber's
        // snapshot is taken after this, so every change is in its snapshot or its stream,
        // however late the follower thread first runs (docs/cluster.md).
        let cursors = events
            .iter()
            .enumerate()
            .map(|(g, mem)| attach_log(g as u32, mem).map(|l| l.head()))
            .collect::<Result<Vec<u64>, TierError>>()?;
        let max_remote = opts.max_remote_entries.unwrap_or((access.index_capacity() as f64 * DEFAULT_REMOTE_SHARE) as u64);
        let side = Arc::new(PoolSide {
            access: access.clone(),
            max_remote,
            refused: AtomicU64::new(0),
            waiting: Mutex::new(HashSet::new()),
            failed: Mutex::new(HashSet::new()),
            digests: Mutex::new(Default::default()),
            etcd: std::sync::OnceLock::new(),
        });
        // SAFETY: the pool's DRAM mapping lives as long as the pool, and the pool outlives
        // this tier (the daemon drops the tier first); peers read only objects they pinned.
        let cluster = Arc::new(unsafe { Cluster::start(cfg, discovery, side.clone(), base, len) }?);
        access.set_remote_source(Arc::new(FetchSide(cluster.clone(), access.clone(), side.clone())));
        let stop = Arc::new(AtomicBool::new(false));
        let (c, s, p) = (cluster.clone(), stop.clone(), side.clone());
        let follower =
            std::thread::Builder::new().name("cluster-events".into()).spawn(move || follow(&c, &p, &events, &cursors, &s)).expect("spawn");
        tracing::info!(
            max_remote_entries = max_remote,
            tenant_groups = access.tenant_groups().len(),
            acl_digest = crate::control::short_hex(&crate::control::acl_digest(access.tenant_groups())),
            "cluster tier on the pool"
        );
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

    /// Shows this etcd membership's health in the pool report and metrics (`cluster.etcd`);
    /// the first call wins.
    pub fn report_etcd(&self, handle: crate::discovery::etcd::EtcdHandle) {
        let _ = self.side.etcd.set(handle);
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

/// Follows every tenant group's KV event log and publishes their changes (tagged with
/// the group) to the subscribers. An overrun (a log lapped this reader) makes every
/// subscriber re-join for a snapshot.
///
/// It also lists again a remote entry whose pull failed (a stopped or slow holder: the
/// pool drops the promoting object like any failed promotion) while a live peer still
/// advertises the key, so the next load pulls it from the holder placement picks then.
/// Without this a key held by two peers would vanish here for good when one of them failed
/// a fetch: the catalog only re-inserts a key when its first holder appears. Entries
/// removed otherwise (a reset, index pressure) are not re-listed. Any removal of a remote
/// entry frees room under the cap: held-back keys are listed then.
fn follow(cluster: &Cluster, side: &PoolSide, events: &[Arc<umbp_ipc::SharedMemory>], cursors: &[u64], stop: &AtomicBool) {
    umbp_pool::pass_hold_point(umbp_pool::HoldPoint::ClusterFollowerStart);
    let access = &side.access;
    let mut readers = Vec::with_capacity(events.len());
    for ((g, mem), &cursor) in events.iter().enumerate().zip(cursors) {
        match attach_log(g as u32, mem) {
            Ok(l) => readers.push((g as u32, EventLogReader::at(l, cursor))),
            Err(e) => {
                tracing::error!("cluster: {e}");
                return;
            }
        }
    }
    let mut buf = Vec::new();
    let mut changes = Vec::new();
    while !stop.load(Ordering::Acquire) {
        let mut read = 0;
        changes.clear();
        let mut room_freed = false;
        for (group, reader) in &mut readers {
            let group = *group;
            buf.clear();
            let r = reader.poll(&mut buf, 4096);
            read += r.read;
            if r.lost > 0 {
                tracing::warn!(lost = r.lost, group, "cluster: KV event log overrun; subscribers re-join for a snapshot");
                // Removals were lost too: drop the digests (pins take them afresh).
                side.digests.lock().expect("digests").clear();
                cluster.resync_subscribers();
            }
            for e in &buf {
                if e.kind != EventKind::Stored && e.tier == Tier::Remote {
                    room_freed = true;
                    if side.failed.lock().expect("failed").remove(&(group, e.key)) {
                        if let Some(o) = cluster.remote_object(group, e.key) {
                            side.list(group, o.key, o.size, o.namespace);
                        }
                    }
                }
                let mut c = KeyChange { group, tier: e.tier as u8, ..KeyChange::removed(e.key.0) };
                if e.kind == EventKind::Stored {
                    c.stored = true;
                    if e.tier == Tier::Dram {
                        // Size and namespace from the store; gone already: its Removed follows.
                        let Some(o) = access.dram_object(group, e.key) else { continue };
                        (c.size, c.namespace) = (o.size, o.namespace);
                        // Before it is advertised: every pin of it carries this digest.
                        side.record_digest(group, o);
                    }
                } else if e.tier == Tier::Dram {
                    side.digests.lock().expect("digests").remove(&(group, e.key));
                }
                changes.push(c);
            }
        }
        cluster.publish(&changes);
        if room_freed {
            side.refill(cluster);
        }
        if read == 0 {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// Group `group`'s KV event log in `mem`, for reading.
fn attach_log(group: u32, mem: &umbp_ipc::SharedMemory) -> Result<EventLog<'_>, TierError> {
    // SAFETY: the pool's event log region of `group`, formatted at its start and mapped
    // as long as `mem` lives (the borrow ties the log to it).
    unsafe { EventLog::attach(mem.as_ptr(), mem.len()) }.map_err(|e| TierError::EventLog { group, reason: e.to_string() })
}
