//! The object store: which keys the pool holds, where, in what state; LRU order, pins,
//! leases; and the index writers that make published objects visible to schedulers.
//! One instance behind one mutex; every method is short (no copies under the lock).
//!
//! Objects are keyed by (tenant group, key) (groups.rs): each group has its own index and
//! KV event log, so the same key stored in two groups is two objects and neither group's
//! index, log or store statuses show the other's. DRAM, the LRU and the byte watermarks
//! are one for the whole pool; index watermarks are per group.
//!
//! This file holds the store's state and its store/load paths; by concern: `policy`
//! (limits), `leases` (touch hints), `tiering` (eviction, demotion, promotion), `events`
//! (KV events), `remote` (the cluster tier's keys).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;

use umbp_ipc::SharedMemory;
use umbp_protocol::index::{IndexView, IndexWriter, Insert, InsertError};
use umbp_protocol::location::{self, Tier};
use umbp_protocol::ObjectKey;

use crate::store::alloc::SlabAllocator;

mod events;
mod eviction;
mod leases;
mod policy;
mod quarantine;
mod remote;
#[cfg(test)]
mod tests;
mod tiering;

pub use crate::store::event_log::ObjectEvent;
use leases::{Lease, LeaseBook};
pub use policy::Policy;
pub use quarantine::{QuarantineStats, Writer};
pub use remote::HeldObject;
pub use tiering::{Demotion, TierStats};

/// An object's identity in the store: the tenant group whose index holds it and its key.
/// A bare `ObjectKey` converts to group 0 (pools without `--namespace-acl` have no other).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GroupKey {
    pub group: u32,
    pub key: ObjectKey,
}

impl GroupKey {
    pub fn new(group: u32, key: ObjectKey) -> Self {
        Self { group, key }
    }
}

impl From<ObjectKey> for GroupKey {
    fn from(key: ObjectKey) -> Self {
        Self { group: 0, key }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ObjectState {
    /// Bytes being copied in by this attachment; invisible to loads and the index.
    Writing { owner: u32 },
    /// In DRAM at `offset`, listed in the index as DRAM.
    Published,
    /// Only on a lower tier (no DRAM); listed in the index with that tier. A load
    /// promotes it (tier/mod.rs).
    Lower { tier: Tier },
    /// A load is fetching it from `from` into its DRAM at `offset` (pinned by that load);
    /// still listed as `from` until the bytes are in.
    Promoting { from: Tier },
}

#[derive(Debug)]
struct Object {
    offset: u64,
    size: u64,
    namespace: u128,
    state: ObjectState,
    /// Loads in flight; a pinned object is never evicted or freed.
    pins: u32,
    /// Protected from eviction until then by a touch hint of this uid (scheduler hints).
    lease: Option<Lease>,
    /// Position in `lru`.
    tick: u64,
    /// Chosen by the evictor for demotion: its bytes are being written to SSD, outside
    /// the store lock. Still loadable from DRAM; never freed or evicted meanwhile.
    demoting: bool,
    /// An SSD record of this object exists, with this location payload (the shard): a
    /// later eviction moves it to SSD without writing it again.
    ssd_at: Option<u64>,
    /// Loads pinned it (admission policy).
    hits: u32,
    /// When it was stored (admission policy).
    stored_at: Instant,
}

/// Outcome of reserving room for one block of a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreReservation {
    Reserved { offset: u64 },
    AlreadyPresent,
    NoRoom,
}

/// Outcome of pinning one block for a load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadReservation {
    Pinned {
        offset: u64,
    },
    Missing,
    /// On a lower tier only: the loader promotes it first ([`ObjectStore::begin_promotion`]).
    Lower {
        tier: Tier,
    },
    /// Another load is promoting it right now: try again shortly.
    Promoting,
    /// The object exists with another size than the loader's layout: a layout mismatch
    /// inside one namespace, reported as a failed block.
    SizeMismatch {
        stored: u64,
    },
}

#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct NamespaceUsage {
    pub objects: u64,
    pub bytes: u64,
}

/// Objects and bytes (slab footprint) a namespace holds, published or being written.
#[derive(Debug, Default, Clone, Copy)]
struct Held {
    objects: u64,
    bytes: u64,
}

/// A fresh random key for the index's home-slot hash (`/dev/urandom`, else the std
/// hasher's random keys).
pub fn index_seed() -> [u64; 2] {
    use std::io::Read;
    let mut b = [0u8; 16];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).is_ok() {
        return [u64::from_le_bytes(b[..8].try_into().expect("8")), u64::from_le_bytes(b[8..].try_into().expect("8"))];
    }

    use std::hash::{BuildHasher, Hasher};
    let r = std::collections::hash_map::RandomState::new();
    let word = |salt: u64| {
        let mut h = r.build_hasher();
        h.write_u64(salt);
        h.finish()
    };
    [word(1), word(2)]
}

/// One tenant group's index writer and event log.
struct GroupIndex {
    index: IndexWriter<'static>,
    /// The group's events in shared memory, for its schedulers (absent in unit tests).
    event_log: Option<crate::store::event_log::SharedEventLog>,
    // Declared last: the index writer borrows this mapping.
    _index_mem: Arc<SharedMemory>,
}

impl GroupIndex {
    fn new(index_mem: Arc<SharedMemory>) -> Self {
        // SAFETY: the pool formatted this mapping (`Pool::start`) and keeps it alive in
        // `_index_mem` for as long as the writer exists; the store is its only writer.
        let view = unsafe { IndexView::attach(index_mem.as_ptr(), index_mem.len()) }.expect("the pool formats its own index region");
        // SAFETY: extends the borrow to 'static; `_index_mem` outlives `index` (field
        // order) and the mapping never moves.
        let view: IndexView<'static> = unsafe { std::mem::transmute::<IndexView<'_>, IndexView<'static>>(view) };
        Self { index: IndexWriter::new(view), event_log: None, _index_mem: index_mem }
    }

    /// Used slots (live entries and tombstones).
    fn used(&self) -> u64 {
        self.index.len() + self.index.tombstones()
    }
}

pub struct ObjectStore {
    alloc: SlabAllocator,
    objects: HashMap<GroupKey, Object>,
    lru: BTreeMap<u64, GroupKey>,
    next_tick: u64,
    /// One per tenant group, by group number.
    groups: Vec<GroupIndex>,
    namespaces: HashMap<u128, NamespaceUsage>,
    held: HashMap<u128, Held>,
    leases: HashMap<u32, LeaseBook>,
    policy: Policy,
    evictions: u64,
    /// Objects with `pins > 0`, kept as pins change so reports and scrapes never walk
    /// the objects under the store lock.
    pinned_objects: usize,
    /// Evictions made for index pressure and for namespace quotas (also in `evictions`).
    index_evictions: u64,
    quota_evictions: u64,
    /// Stores refused because their namespace was at its quota.
    quota_refusals: u64,
    /// Touch hints ignored: the key is of another namespace than the hinting peer's.
    foreign_hints: u64,
    /// Leases ended early because their uid was over its lease cap.
    leases_dropped: u64,
    quarantine: quarantine::Quarantine,
    events: Vec<ObjectEvent>,
    /// The SSD tier's admission policy; None: no SSD tier (evicted objects just go).
    ssd_admission: Option<umbp_ssd::SsdAdmission>,
    /// Chosen for demotion, not yet taken by the demoter.
    demotions: Vec<Demotion>,
    /// Slab footprint of objects being demoted (counted as gone by the evictor).
    demoting_bytes: u64,
    /// SSD records of objects dropped from the index, to remove from the SSD store
    /// outside the lock ((key, namespace)).
    ssd_drops: Vec<(ObjectKey, u128)>,
    /// Lower-tier objects a scheduler's touch hint asked for (prefetched by the evictor
    /// thread, tier::prefetch); at most PREFETCH_QUEUE.
    prefetch: Vec<GroupKey>,
    /// Objects on a lower tier only (Lower or Promoting), by tier; change it only through
    /// `count_lower`.
    lower: [u64; 3],
    /// Their sum, readable without the store lock ([`ObjectStore::lower_objects_counter`]).
    lower_total: Arc<AtomicU64>,
    tier_stats: TierStats,
}

impl ObjectStore {
    /// A store with one group (no `--namespace-acl`).
    #[cfg(test)]
    pub fn new(capacity_bytes: u64, index_mem: Arc<SharedMemory>) -> Self {
        Self::with_groups(capacity_bytes, vec![index_mem])
    }

    /// A store with one index per tenant group (`index_mems[g]` is group g's, formatted).
    pub fn with_groups(capacity_bytes: u64, index_mems: Vec<Arc<SharedMemory>>) -> Self {
        assert!(!index_mems.is_empty(), "a store has at least group 0");
        Self {
            alloc: SlabAllocator::new(capacity_bytes),
            objects: HashMap::new(),
            lru: BTreeMap::new(),
            next_tick: 0,
            groups: index_mems.into_iter().map(GroupIndex::new).collect(),
            namespaces: HashMap::new(),
            held: HashMap::new(),
            leases: HashMap::new(),
            policy: Policy::default(),
            evictions: 0,
            pinned_objects: 0,
            index_evictions: 0,
            quota_evictions: 0,
            quota_refusals: 0,
            foreign_hints: 0,
            leases_dropped: 0,
            quarantine: quarantine::Quarantine::default(),
            events: Vec::new(),
            ssd_admission: None,
            demotions: Vec::new(),
            demoting_bytes: 0,
            ssd_drops: Vec::new(),
            prefetch: Vec::new(),
            lower: [0; 3],
            lower_total: Arc::new(AtomicU64::new(0)),
            tier_stats: TierStats::default(),
        }
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.alloc.capacity_bytes()
    }

    pub fn allocated_bytes(&self) -> u64 {
        self.alloc.allocated_bytes()
    }

    pub fn object_count(&self) -> usize {
        self.objects.len()
    }

    /// Published objects, all groups.
    pub fn published_count(&self) -> u64 {
        self.groups.iter().map(|g| g.index.len()).sum()
    }

    pub fn group_count(&self) -> usize {
        self.groups.len()
    }

    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    pub fn set_policy(&mut self, policy: Policy) {
        self.policy = policy;
    }

    /// Live entries the indexes take at most, all groups.
    pub fn index_capacity(&self) -> u64 {
        self.groups.iter().map(|g| g.index.capacity()).sum()
    }

    /// Counters of the defences in this file, for reports.
    pub fn defence_counters(&self) -> crate::pool_report::Defences {
        crate::pool_report::Defences {
            index_evictions: self.index_evictions,
            quota_evictions: self.quota_evictions,
            quota_refusals: self.quota_refusals,
            foreign_hints_ignored: self.foreign_hints,
            leases_dropped: self.leases_dropped,
        }
    }

    pub fn namespaces(&self) -> &HashMap<u128, NamespaceUsage> {
        &self.namespaces
    }

    pub fn set_page_limit(&mut self, pages: u32) {
        self.alloc.set_page_limit(pages);
    }

    fn touch_lru(&mut self, key: GroupKey) {
        let tick = self.next_tick;
        self.next_tick += 1;
        if let Some(o) = self.objects.get_mut(&key) {
            self.lru.remove(&o.tick);
            o.tick = tick;
            self.lru.insert(tick, key);
        }
    }

    /// First writer wins: a key that exists (published or being written) is not stored
    /// again. Never evicts: no room, or a namespace at its quota, is `NoRoom` (the caller
    /// wakes the evictor).
    pub fn reserve_store(&mut self, namespace: u128, key: impl Into<GroupKey>, size: u64, owner: u32) -> StoreReservation {
        let key = key.into();
        if self.objects.contains_key(&key) {
            return StoreReservation::AlreadyPresent;
        }
        let held = self.held.get(&namespace).copied().unwrap_or_default();
        let footprint = SlabAllocator::footprint(size);
        if held.objects >= self.policy.namespace_max_objects || held.bytes.saturating_add(footprint) > self.policy.namespace_max_bytes {
            if self.quota_refusals.is_multiple_of(1024) {
                tracing::warn!(
                    namespace = format!("{namespace:032x}"),
                    objects = held.objects,
                    bytes = held.bytes,
                    "namespace at its quota (--namespace-share): store refused until its own LRU is evicted"
                );
            }
            self.quota_refusals += 1;
            return StoreReservation::NoRoom;
        }
        let Some(offset) = self.alloc.alloc(size) else {
            return StoreReservation::NoRoom;
        };
        let h = self.held.entry(namespace).or_default();
        h.objects += 1;
        h.bytes += footprint;
        let tick = self.next_tick;
        self.next_tick += 1;
        self.objects.insert(
            key,
            Object {
                offset,
                size,
                namespace,
                state: ObjectState::Writing { owner },
                pins: 0,
                lease: None,
                tick,
                demoting: false,
                ssd_at: None,
                hits: 0,
                stored_at: Instant::now(),
            },
        );
        self.lru.insert(tick, key);
        StoreReservation::Reserved { offset }
    }

    /// Ends a store: on success the object becomes visible in the index (only now that
    /// its bytes are complete); otherwise its allocation is freed. Returns whether the
    /// object is now published.
    pub fn finish_store(&mut self, key: impl Into<GroupKey>, copied: bool) -> bool {
        let key = key.into();
        let Some(o) = self.objects.get(&key) else { return false };
        debug_assert!(matches!(o.state, ObjectState::Writing { .. }));
        if copied {
            match self.groups[key.group as usize].index.insert(key.key, location::encode(Tier::Dram, o.offset)) {
                Ok(Insert::Inserted) => {
                    let o = self.objects.get_mut(&key).expect("present");
                    o.state = ObjectState::Published;
                    let ns = self.namespaces.entry(o.namespace).or_default();
                    ns.objects += 1;
                    ns.bytes += o.size;
                    self.push_event(key.group, ObjectEvent::Stored(key.key), Tier::Dram);
                    return true;
                }
                Ok(Insert::Exists(_)) => unreachable!("the store reserves keys before copying"),
                Err(e @ InsertError::Full(_)) => tracing::warn!("{e}: object not stored (the evictor frees index entries)"),
                Err(e @ InsertError::ProbeLimit { .. }) => tracing::debug!(key = format!("{:032x}", key.key.0), "{e}: object not stored"),
            }
        }
        self.drop_object(key);
        false
    }

    /// Gives up on an object being written whose copy may still be in flight (a copy
    /// thread panicked inside the device layer): the key is forgotten, so it can be stored
    /// again, but its DRAM is quarantined (objects/quarantine.rs) — a DMA still writing
    /// there must not land in someone else's object. Returns the bytes quarantined.
    pub fn quarantine(&mut self, key: impl Into<GroupKey>) -> u64 {
        let key = key.into();
        match self.objects.get(&key) {
            Some(o) if matches!(o.state, ObjectState::Writing { .. }) => {
                let o = self.objects.remove(&key).expect("present");
                self.lru.remove(&o.tick);
                self.release_held(o.namespace, o.size);
                self.quarantine.add(o.offset, o.size, Writer::Unknown, true);
                o.size
            }
            _ => 0,
        }
    }

    /// DRAM quarantined now (still counted as allocated), by [`Self::quarantine`] and
    /// [`Self::abandon_promotion`].
    #[cfg(test)]
    pub fn quarantined_bytes(&self) -> u64 {
        self.quarantine.stats().bytes
    }

    pub fn quarantine_stats(&self) -> QuarantineStats {
        self.quarantine.stats()
    }

    /// Bounds the quarantine: at `max` bytes remote-tier promotions are refused (misses).
    pub fn set_quarantine_max_bytes(&mut self, max: u64) {
        self.quarantine.set_max_bytes(max);
    }

    /// The timed-out read(s) filed under `agent` (the cluster tier's tag of one read) can
    /// no longer write this pool's DRAM (NIXL reported the kept request final): the ranges
    /// they left whose promotions have ended are freed. Returns the bytes reclaimed.
    pub fn reclaim_quarantine_of(&mut self, agent: &str) -> u64 {
        let safe = self.quarantine.writer_gone(agent);
        self.free_reclaimed(safe)
    }

    fn free_reclaimed(&mut self, ranges: Vec<(u64, u64)>) -> u64 {
        let mut bytes = 0;
        for (offset, size) in ranges {
            self.alloc.free(offset, size);
            bytes += size;
        }
        if bytes > 0 {
            tracing::info!(bytes, "quarantined DRAM reclaimed: no transfer can write it any more");
        }
        bytes
    }

    fn release_held(&mut self, namespace: u128, size: u64) {
        if let Some(h) = self.held.get_mut(&namespace) {
            h.objects -= 1;
            h.bytes -= SlabAllocator::footprint(size);
            if h.objects == 0 {
                self.held.remove(&namespace);
            }
        }
    }

    /// Removes an object from the pool (index, events, DRAM, its SSD record). Never
    /// called for one being demoted or promoted (its bytes are in use outside the lock).
    fn drop_object(&mut self, key: GroupKey) {
        if let Some(o) = self.objects.get(&key) {
            debug_assert!(!o.demoting && !matches!(o.state, ObjectState::Promoting { .. }), "dropping an object in a tier move");
            if o.demoting || matches!(o.state, ObjectState::Promoting { .. }) {
                return;
            }
        }
        if let Some(o) = self.objects.remove(&key) {
            if o.pins > 0 {
                self.pinned_objects -= 1;
            }
            self.lru.remove(&o.tick);
            if let Some(l) = o.lease {
                self.leases.get_mut(&l.uid).expect("a lease has its book").bytes -= o.size;
            }
            if o.ssd_at.is_some() {
                self.ssd_drops.push((key.key, o.namespace));
            }
            let tier = match o.state {
                ObjectState::Lower { tier } => {
                    self.count_lower(tier, -1);
                    tier
                }
                _ => {
                    self.release_held(o.namespace, o.size);
                    self.alloc.free(o.offset, o.size);
                    Tier::Dram
                }
            };
            if matches!(o.state, ObjectState::Published | ObjectState::Lower { .. }) {
                self.groups[key.group as usize].index.remove(key.key);
                if let Some(ns) = self.namespaces.get_mut(&o.namespace) {
                    ns.objects -= 1;
                    ns.bytes -= o.size;
                    if ns.objects == 0 {
                        self.namespaces.remove(&o.namespace);
                    }
                }
                self.push_event(key.group, ObjectEvent::Removed(key.key), tier);
            }
        }
    }

    /// Namespace of the peer that stored `key` (None: not held).
    pub fn namespace_of(&self, key: impl Into<GroupKey>) -> Option<u128> {
        self.objects.get(&key.into()).map(|o| o.namespace)
    }

    /// Pins a published object for a load of `size` bytes.
    pub fn reserve_load(&mut self, key: impl Into<GroupKey>, size: u64) -> LoadReservation {
        let key = key.into();
        let Some(o) = self.objects.get_mut(&key) else { return LoadReservation::Missing };
        let lower = match o.state {
            ObjectState::Writing { .. } => return LoadReservation::Missing,
            ObjectState::Published => None,
            ObjectState::Lower { tier } => Some(tier),
            ObjectState::Promoting { .. } => return LoadReservation::Promoting,
        };
        if o.size != size {
            return LoadReservation::SizeMismatch { stored: o.size };
        }
        if let Some(tier) = lower {
            return LoadReservation::Lower { tier };
        }
        o.pins += 1;
        o.hits = o.hits.saturating_add(1);
        if o.pins == 1 {
            self.pinned_objects += 1;
        }
        let offset = o.offset;
        self.touch_lru(key);
        LoadReservation::Pinned { offset }
    }

    pub fn finish_load(&mut self, key: impl Into<GroupKey>) {
        let key = key.into();
        if let Some(o) = self.objects.get_mut(&key) {
            if o.pins == 1 {
                self.pinned_objects -= 1;
            }
            o.pins = o.pins.saturating_sub(1);
        }
    }

    /// Drops every unpinned published object of `namespace` (vLLM reset_cache).
    pub fn reset_namespace(&mut self, namespace: u128) -> u64 {
        let keys: Vec<_> = self
            .objects
            .iter()
            .filter(|(_, o)| {
                o.namespace == namespace
                    && ((o.state == ObjectState::Published && o.pins == 0 && !o.demoting) || matches!(o.state, ObjectState::Lower { .. }))
            })
            .map(|(k, _)| *k)
            .collect();
        for k in &keys {
            self.drop_object(*k);
        }
        keys.len() as u64
    }

    /// Objects reserved by `owner` and not finished (leak checks).
    #[cfg(test)]
    pub fn writing_count(&self, owner: u32) -> usize {
        self.objects.values().filter(|o| o.state == ObjectState::Writing { owner }).count()
    }

    /// Objects pinned by loads in flight (a running count: O(1)).
    pub fn pinned_count(&self) -> usize {
        self.pinned_objects
    }
}
