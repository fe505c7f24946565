//! The object store: which keys the pool holds, where, in what state; LRU order, pins,
//! leases; and the index writers that make published objects visible to schedulers.
//! One instance behind one mutex; every method is short (no copies under the lock).
//!
//! Objects are keyed by (tenant group, key) (groups.rs): each group has its own index and
//! KV event log, so the same key stored in two groups is two objects and neither group's
//! index, log or store statuses show the other's. DRAM, the LRU and the byte watermarks
//! are one for the whole pool; index watermarks are per group.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_ipc::SharedMemory;
use umbp_protocol::index::{IndexView, IndexWriter, Insert, InsertError};
use umbp_protocol::location::{self, Tier};
use umbp_protocol::ObjectKey;

use crate::alloc::SlabAllocator;

mod remote;

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
    /// promotes it (tier.rs).
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
    Pinned { offset: u64 },
    Missing,
    /// On a lower tier only: the loader promotes it first ([`ObjectStore::begin_promotion`]).
    Lower { tier: Tier },
    /// Another load is promoting it right now: try again shortly.
    Promoting,
    /// The object exists with another size than the loader's layout: a layout mismatch
    /// inside one namespace, reported as a failed block.
    SizeMismatch { stored: u64 },
}

/// A key that left the pool or entered it, for KV events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ObjectEvent {
    Stored(ObjectKey),
    Removed(ObjectKey),
}

#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct NamespaceUsage {
    pub objects: u64,
    pub bytes: u64,
}

/// An object the evictor chose for demotion: its DRAM bytes (stable until
/// [`ObjectStore::finish_demotion`]) to write to SSD.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Demotion {
    pub key: GroupKey,
    pub namespace: u128,
    pub offset: u64,
    pub size: u64,
}

/// Tier counters of the store (reports).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Objects listed in the indexes by tier (DRAM: published in DRAM, incl. promoting).
    pub objects: [u64; 3],
    pub demotions: u64,
    pub demoted_bytes: u64,
    pub not_admitted: u64,
    pub demotion_failures: u64,
    pub promotions: u64,
    pub promoted_bytes: u64,
    pub promotion_failures: u64,
    /// Objects moved to SSD without a write (their record was still there).
    pub clean_demotions: u64,
    /// Objects listed at start from the SSD segments.
    pub restored: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Lease {
    uid: u32,
    until: Instant,
}

/// The leases one uid's touch hints hold, oldest first, and the bytes of those still in
/// force (an entry is in force while its object's lease is exactly that uid and time).
#[derive(Debug, Default)]
struct LeaseBook {
    queue: VecDeque<(GroupKey, Instant)>,
    bytes: u64,
}

/// What the evictor and the store path hold the store to (docs/security.md): byte and
/// index watermarks, per-namespace quotas, per-uid lease caps. `Default` is "no limits"
/// (unit tests); the pool builds it from its config with [`Policy::from_config`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    /// The evictor runs above `high` allocated bytes, down to `low`.
    pub high_bytes: u64,
    pub low_bytes: u64,
    /// ... and, for each group's index, above this fraction of its capacity in used slots
    /// (live entries and tombstones), down to `index_low_wm` of it in live entries.
    pub index_high_wm: f64,
    pub index_low_wm: f64,
    /// Most objects / bytes (slab footprint) one namespace may hold, written or being
    /// written; its own least recently used objects are evicted above `namespace_high`.
    pub namespace_max_objects: u64,
    pub namespace_max_bytes: u64,
    pub namespace_high: f64,
    pub namespace_low: f64,
    /// Bytes of objects one uid's touch hints may keep leased at once.
    pub lease_max_bytes: u64,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            high_bytes: u64::MAX,
            low_bytes: u64::MAX,
            index_high_wm: f64::INFINITY,
            index_low_wm: f64::INFINITY,
            namespace_max_objects: u64::MAX,
            namespace_max_bytes: u64::MAX,
            namespace_high: 1.0,
            namespace_low: 1.0,
            lease_max_bytes: u64::MAX,
        }
    }
}

impl Policy {
    /// `capacity` bytes of DRAM; `index_capacity`: the live entries an index sized for the
    /// whole pool takes (namespace quotas are shares of it, whatever group they are in).
    pub fn from_config(c: &crate::PoolConfig, capacity: u64, index_capacity: u64) -> Self {
        let frac = |n: u64, f: f64| (n as f64 * f) as u64;
        let share = c.namespace_share;
        Self {
            high_bytes: frac(capacity, c.high_watermark),
            low_bytes: frac(capacity, c.low_watermark),
            index_high_wm: c.high_watermark,
            index_low_wm: c.low_watermark,
            // Share 1: no quota (a full pool is the byte and index watermarks' business).
            namespace_max_objects: if share >= 1.0 { u64::MAX } else { frac(index_capacity, share).max(1) },
            namespace_max_bytes: if share >= 1.0 { u64::MAX } else { frac(capacity, share).max(1) },
            namespace_high: c.high_watermark,
            namespace_low: c.low_watermark,
            lease_max_bytes: frac(capacity, c.lease_share),
        }
    }
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
    event_log: Option<crate::event_log::SharedEventLog>,
    // Declared last: the index writer borrows this mapping.
    _index_mem: Arc<SharedMemory>,
}

impl GroupIndex {
    fn new(index_mem: Arc<SharedMemory>) -> Self {
        // SAFETY: the pool formatted this mapping (`Pool::start`) and keeps it alive in
        // `_index_mem` for as long as the writer exists; the store is its only writer.
        let view = unsafe { IndexView::attach(index_mem.as_ptr(), index_mem.len()) }
            .expect("the pool formats its own index region");
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
    quarantined_bytes: u64,
    events: Vec<ObjectEvent>,
    /// The SSD tier's admission policy; None: no SSD tier (evicted objects just go).
    ssd_admission: Option<crate::ssd::SsdAdmission>,
    /// Chosen for demotion, not yet taken by the demoter.
    demotions: Vec<Demotion>,
    /// Slab footprint of objects being demoted (counted as gone by the evictor).
    demoting_bytes: u64,
    /// SSD records of objects dropped from the index, to remove from the SSD store
    /// outside the lock ((key, namespace)).
    ssd_drops: Vec<(ObjectKey, u128)>,
    /// Objects on a lower tier only (Lower or Promoting), by tier.
    lower: [u64; 3],
    tier_stats: TierStats,
}

/// Lease entries one uid may have queued (re-touches of one key add entries); past it
/// its oldest leases end early, like past its byte cap.
const MAX_LEASE_QUEUE: usize = 1 << 18;

/// Events kept for observers before the oldest are dropped.
const MAX_EVENTS: usize = 1 << 16;

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
            quarantined_bytes: 0,
            events: Vec::new(),
            ssd_admission: None,
            demotions: Vec::new(),
            demoting_bytes: 0,
            ssd_drops: Vec::new(),
            lower: [0; 3],
            tier_stats: TierStats::default(),
        }
    }

    /// Turns on demotion to SSD with this admission policy.
    pub fn set_ssd_admission(&mut self, admission: crate::ssd::SsdAdmission) {
        self.ssd_admission = Some(admission);
    }

    /// Tier counters; `objects` by tier.
    pub fn tier_stats(&self) -> TierStats {
        let mut t = self.tier_stats;
        let listed = self.published_count();
        let lower: u64 = self.lower.iter().sum();
        t.objects = self.lower;
        t.objects[Tier::Dram as usize] = listed.saturating_sub(lower);
        t
    }

    /// Objects chosen for demotion since the last call.
    pub fn take_demotions(&mut self) -> Vec<Demotion> {
        std::mem::take(&mut self.demotions)
    }

    /// SSD records to remove (their objects left the index) since the last call.
    pub fn take_ssd_drops(&mut self) -> Vec<(ObjectKey, u128)> {
        std::mem::take(&mut self.ssd_drops)
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

    /// A group's index watermark in entries (`wm` of its capacity).
    fn index_mark(g: &GroupIndex, wm: f64) -> u64 {
        (g.index.capacity() as f64 * wm) as u64
    }

    fn namespace_over(&self, h: &Held, f: f64) -> bool {
        let p = &self.policy;
        h.objects as f64 > p.namespace_max_objects as f64 * f || h.bytes as f64 > p.namespace_max_bytes as f64 * f
    }

    /// Whether the evictor has work: bytes or index slots above their high watermark, or
    /// a namespace above its quota's.
    pub fn needs_eviction(&self) -> bool {
        let p = &self.policy;
        self.alloc.allocated_bytes().saturating_sub(self.demoting_bytes) > p.high_bytes
            || self.groups.iter().any(|g| g.used() > Self::index_mark(g, p.index_high_wm))
            || self.held.values().any(|h| self.namespace_over(h, p.namespace_high))
    }

    /// One evictor pass (evictor.rs): LRU eviction down to the low watermarks of bytes and
    /// of index entries, and of each namespace over its quota's high mark down to its low
    /// mark. Skips objects being written, pinned or leased. Returns how many went.
    pub fn evict(&mut self, now: Instant) -> usize {
        let p = self.policy;
        let mut n = 0;
        if self.alloc.allocated_bytes().saturating_sub(self.demoting_bytes) > p.high_bytes {
            n += self.evict_to(p.low_bytes, now);
        }
        for group in 0..self.groups.len() {
            let g = &mut self.groups[group];
            let (high, low) = (Self::index_mark(g, p.index_high_wm), Self::index_mark(g, p.index_low_wm));
            if g.used() <= high {
                continue;
            }
            // Tombstones go by rebuilding; only live entries need evicting.
            if g.index.tombstones() > 0 {
                g.index.rebuild();
            }
            if g.index.len() > high {
                let excess = g.index.len() - low.min(g.index.len());
                let victims = self.pick_lru(Victims::Group(group as u32), now, |_, evicted| evicted as u64 >= excess);
                let k = victims.len();
                for v in victims {
                    self.drop_object(v);
                }
                self.evictions += k as u64;
                self.index_evictions += k as u64;
                n += k;
            }
        }
        let over: Vec<(u128, Held)> =
            self.held.iter().filter(|(_, h)| self.namespace_over(h, p.namespace_high)).map(|(ns, h)| (*ns, *h)).collect();
        for (ns, h) in over {
            let (max_o, max_b) = (p.namespace_max_objects as f64 * p.namespace_low, p.namespace_max_bytes as f64 * p.namespace_low);
            let (mut objects, mut bytes) = (h.objects, h.bytes);
            let victims = self.pick_lru(Victims::Namespace(ns), now, |size, _| {
                objects -= 1;
                bytes = bytes.saturating_sub(SlabAllocator::footprint(size));
                objects as f64 <= max_o && bytes as f64 <= max_b
            });
            let k = victims.len();
            for v in victims {
                self.drop_object(v);
            }
            self.evictions += k as u64;
            self.quota_evictions += k as u64;
            n += k;
        }
        n
    }

    /// Least recently used evictable objects (of `which`) until
    /// `enough(size of the one just chosen, count chosen so far)` says so. DRAM objects
    /// for `Any` and `Namespace` (they free DRAM); for `Group` (index pressure) objects on
    /// lower tiers too (they free index entries).
    fn pick_lru(&self, which: Victims, now: Instant, mut enough: impl FnMut(u64, usize) -> bool) -> Vec<GroupKey> {
        let mut victims = Vec::new();
        for (_, key) in self.lru.iter() {
            let o = &self.objects[key];
            let mine = match which {
                Victims::Any => Self::evictable(o, now),
                Victims::Namespace(ns) => o.namespace == ns && Self::evictable(o, now),
                Victims::Group(g) => key.group == g && (Self::evictable(o, now) || matches!(o.state, ObjectState::Lower { .. })),
            };
            if !mine {
                continue;
            }
            victims.push(*key);
            if enough(o.size, victims.len()) {
                break;
            }
        }
        victims
    }

    fn evictable(o: &Object, now: Instant) -> bool {
        let leased = o.lease.is_some_and(|l| l.until > now);
        o.state == ObjectState::Published && o.pins == 0 && !leased && !o.demoting
    }

    /// Takes a DRAM object out of DRAM for byte pressure: to SSD at once if its record is
    /// still there, chosen for demotion if the admission policy admits it, else dropped.
    fn evict_dram(&mut self, key: GroupKey, now: Instant) {
        let o = &self.objects[&key];
        let Some(admission) = self.ssd_admission else {
            self.drop_object(key);
            return;
        };
        if let Some(payload) = o.ssd_at {
            self.tier_stats.clean_demotions += 1;
            self.move_to_lower(key, Tier::Ssd, payload);
        } else if admission.admits(now.saturating_duration_since(o.stored_at), o.hits) {
            let d = Demotion { key, namespace: o.namespace, offset: o.offset, size: o.size };
            self.demoting_bytes += SlabAllocator::footprint(o.size);
            self.objects.get_mut(&key).expect("present").demoting = true;
            self.demotions.push(d);
        } else {
            self.tier_stats.not_admitted += 1;
            self.drop_object(key);
        }
    }

    /// Frees a DRAM object's bytes and lists it as on `tier` (no I/O: its bytes are
    /// there already). The caller checked it is published, unpinned and not demoting.
    fn move_to_lower(&mut self, key: GroupKey, tier: Tier, payload: u64) {
        let o = self.objects.get_mut(&key).expect("present");
        debug_assert!(o.state == ObjectState::Published && o.pins == 0 && !o.demoting);
        o.state = ObjectState::Lower { tier };
        let (offset, size, namespace, lease) = (o.offset, o.size, o.namespace, o.lease.take());
        if let Some(l) = lease {
            self.leases.get_mut(&l.uid).expect("a lease has its book").bytes -= size;
        }
        self.alloc.free(offset, size);
        self.release_held(namespace, size);
        self.lower[tier as usize] += 1;
        self.groups[key.group as usize].index.set_location(key.key, location::encode(tier, payload));
        self.push_event(key.group, ObjectEvent::Removed(key.key), Tier::Dram);
        self.push_event(key.group, ObjectEvent::Stored(key.key), tier);
    }

    /// The demoter wrote (Ok: at location payload) or failed to write a demoted object.
    /// Written: it leaves DRAM now (unless a load pinned it or a hint leased it
    /// meanwhile: then the next eviction moves it without a write). Failed: it just goes,
    /// like an eviction without an SSD tier (a pinned one stays in DRAM).
    pub fn finish_demotion(&mut self, key: GroupKey, written: Result<u64, ()>, now: Instant) {
        let Some(o) = self.objects.get_mut(&key) else { return };
        if !o.demoting {
            return;
        }
        o.demoting = false;
        let size = o.size;
        self.demoting_bytes -= SlabAllocator::footprint(size);
        let free_now = o.pins == 0 && o.lease.is_none_or(|l| l.until <= now);
        match written {
            Ok(payload) => {
                o.ssd_at = Some(payload);
                self.tier_stats.demotions += 1;
                self.tier_stats.demoted_bytes += size;
                if free_now {
                    self.move_to_lower(key, Tier::Ssd, payload);
                }
            }
            Err(()) => {
                self.tier_stats.demotion_failures += 1;
                if free_now {
                    self.drop_object(key);
                }
            }
        }
    }

    /// The SSD store dropped these records for room (or found them unreadable): objects
    /// only there leave the index; DRAM copies just forget them.
    pub fn ssd_records_gone(&mut self, gone: &[(ObjectKey, u128)], groups: &crate::groups::TenantGroups) {
        for &(key, ns) in gone {
            let gk = GroupKey::new(groups.group_of(ns), key);
            let Some(o) = self.objects.get_mut(&gk) else { continue };
            if o.namespace != ns {
                continue;
            }
            o.ssd_at = None;
            if o.state == (ObjectState::Lower { tier: Tier::Ssd }) {
                self.drop_object(gk);
            }
        }
    }

    /// Lists an object found on a lower tier at start (warm restart): in its group's
    /// index as that tier. False if the key is already held in that group (the first
    /// listed wins) or the index is full.
    pub fn insert_lower(&mut self, group: u32, namespace: u128, key: ObjectKey, size: u64, tier: Tier, payload: u64) -> bool {
        let gk = GroupKey::new(group, key);
        if self.objects.contains_key(&gk) {
            return false;
        }
        if self.groups[group as usize].index.insert(key, location::encode(tier, payload)) != Ok(Insert::Inserted) {
            return false;
        }
        let tick = self.next_tick;
        self.next_tick += 1;
        self.objects.insert(
            gk,
            Object {
                offset: 0,
                size,
                namespace,
                state: ObjectState::Lower { tier },
                pins: 0,
                lease: None,
                tick,
                demoting: false,
                ssd_at: (tier == Tier::Ssd).then_some(payload),
                hits: 0,
                stored_at: Instant::now(),
            },
        );
        self.lru.insert(tick, gk);
        self.lower[tier as usize] += 1;
        let ns = self.namespaces.entry(namespace).or_default();
        ns.objects += 1;
        ns.bytes += size;
        self.tier_stats.restored += 1;
        self.push_event(group, ObjectEvent::Stored(key), tier);
        true
    }

    /// A load found `key` on a lower tier: allocates its DRAM and pins it for this load,
    /// which fetches the bytes outside the lock and then calls [`Self::finish_promotion`].
    /// Returns the DRAM offset, the tier to fetch from and the object's namespace; None: not on a lower tier any
    /// more, or no DRAM free (the caller wakes the evictor).
    pub fn begin_promotion(&mut self, key: impl Into<GroupKey>) -> Option<(u64, Tier, u128)> {
        let key = key.into();
        let o = self.objects.get(&key)?;
        let ObjectState::Lower { tier } = o.state else { return None };
        let (size, namespace) = (o.size, o.namespace);
        let offset = self.alloc.alloc(size)?;
        let h = self.held.entry(namespace).or_default();
        h.objects += 1;
        h.bytes += SlabAllocator::footprint(size);
        let o = self.objects.get_mut(&key).expect("present");
        o.state = ObjectState::Promoting { from: tier };
        o.offset = offset;
        o.pins = 1;
        o.hits += 1;
        self.pinned_objects += 1;
        self.touch_lru(key);
        Some((offset, tier, namespace))
    }

    /// Ends a promotion: with the bytes in, the object is in DRAM (index and events say
    /// so) and stays pinned for the load that promoted it; without (I/O error, bad CRC,
    /// record gone) it leaves the pool: a miss, never wrong bytes. Returns `fetched`.
    pub fn finish_promotion(&mut self, key: impl Into<GroupKey>, fetched: bool) -> bool {
        let key = key.into();
        let Some(o) = self.objects.get_mut(&key) else { return false };
        let ObjectState::Promoting { from } = o.state else { return false };
        let (offset, size, namespace) = (o.offset, o.size, o.namespace);
        if fetched {
            o.state = ObjectState::Published;
            self.lower[from as usize] -= 1;
            self.tier_stats.promotions += 1;
            self.tier_stats.promoted_bytes += size;
            self.groups[key.group as usize].index.set_location(key.key, location::encode(Tier::Dram, offset));
            self.push_event(key.group, ObjectEvent::Removed(key.key), from);
            self.push_event(key.group, ObjectEvent::Stored(key.key), Tier::Dram);
            return true;
        }
        // Back to "lower only", then dropped like any object there.
        o.state = ObjectState::Lower { tier: from };
        o.pins = 0;
        self.pinned_objects -= 1;
        self.alloc.free(offset, size);
        self.release_held(namespace, size);
        self.tier_stats.promotion_failures += 1;
        self.drop_object(key);
        false
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
        if held.objects >= self.policy.namespace_max_objects
            || held.bytes.saturating_add(footprint) > self.policy.namespace_max_bytes
        {
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
    /// thread panicked mid-transfer): the key is forgotten, so it can be stored again, but
    /// its DRAM is never handed out again — a DMA still writing there must not land in
    /// someone else's object. Returns the bytes leaked.
    pub fn quarantine(&mut self, key: impl Into<GroupKey>) -> u64 {
        let key = key.into();
        match self.objects.get(&key) {
            Some(o) if matches!(o.state, ObjectState::Writing { .. }) => {
                let o = self.objects.remove(&key).expect("present");
                self.lru.remove(&o.tick);
                self.release_held(o.namespace, o.size);
                self.quarantined_bytes += o.size;
                o.size
            }
            _ => 0,
        }
    }

    /// DRAM given up by [`Self::quarantine`] (still counted as allocated).
    pub fn quarantined_bytes(&self) -> u64 {
        self.quarantined_bytes
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
                    self.lower[tier as usize] -= 1;
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

    /// From now on every event of `group` also goes to this shared-memory log.
    pub fn set_event_log(&mut self, group: u32, log: crate::event_log::SharedEventLog) {
        self.groups[group as usize].event_log = Some(log);
    }

    /// Events written to the shared logs so far, all groups.
    pub fn events_written(&self) -> u64 {
        (0..self.groups.len() as u32).map(|g| self.group_events_written(g)).sum()
    }

    /// Events written to one group's shared log so far.
    pub fn group_events_written(&self, group: u32) -> u64 {
        self.groups[group as usize].event_log.as_ref().map_or(0, |l| l.written())
    }

    fn push_event(&mut self, group: u32, e: ObjectEvent, tier: Tier) {
        if let Some(log) = self.groups[group as usize].event_log.as_mut() {
            log.push(e, tier);
        }
        if self.events.len() >= MAX_EVENTS {
            self.events.drain(..MAX_EVENTS / 2);
        }
        self.events.push(e);
    }

    /// Events since the last call, all groups (the embedded pool's own engine).
    pub fn take_events(&mut self) -> Vec<ObjectEvent> {
        std::mem::take(&mut self.events)
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

    /// A scheduler hit from a peer of `uid` attached with namespace `namespace`: counts as
    /// use and protects the object for `lease`, if the object is of `namespace` or of one
    /// `also_allowed` (the uid's ACL). A hint for another namespace's key is ignored
    /// (counted), so a peer cannot pin what it may not load. The uid's leases are a FIFO of
    /// at most `Policy::lease_max_bytes`: past it, its oldest leases end early. Returns
    /// whether the hint was applied.
    pub fn touch_hint(
        &mut self,
        uid: u32,
        namespace: u128,
        also_allowed: &[u128],
        key: impl Into<GroupKey>,
        lease: Duration,
        now: Instant,
    ) -> bool {
        let key = key.into();
        let Some(o) = self.objects.get_mut(&key) else { return false };
        if o.namespace != namespace && !also_allowed.contains(&o.namespace) {
            self.foreign_hints += 1;
            return false;
        }
        if o.state != ObjectState::Published {
            return false;
        }
        // A scheduler's prefix hit is use: the SSD admission policy counts it.
        o.hits = o.hits.saturating_add(1);
        let until = now + lease;
        let size = o.size;
        if let Some(old) = o.lease.replace(Lease { uid, until }) {
            // The old entry (this uid's or another's) is no longer in force.
            self.leases.get_mut(&old.uid).expect("a lease has its book").bytes -= size;
        }
        let book = self.leases.entry(uid).or_default();
        book.queue.push_back((key, until));
        book.bytes += size;
        self.touch_lru(key);
        self.trim_leases(uid, now);
        true
    }

    /// Ends `uid`'s expired leases and, while it is over its cap, its oldest ones.
    fn trim_leases(&mut self, uid: u32, now: Instant) {
        let cap = self.policy.lease_max_bytes;
        let Some(book) = self.leases.get_mut(&uid) else { return };
        while let Some(&(key, until)) = book.queue.front() {
            if until > now && book.bytes <= cap && book.queue.len() <= MAX_LEASE_QUEUE {
                break;
            }
            book.queue.pop_front();
            let Some(o) = self.objects.get_mut(&key) else { continue };
            if o.lease == Some(Lease { uid, until }) {
                o.lease = None;
                book.bytes -= o.size;
                if until > now {
                    self.leases_dropped += 1;
                }
            }
        }
        if book.queue.is_empty() {
            self.leases.remove(&uid);
        }
    }

    /// Bytes of objects `uid`'s hints keep leased now (expired leases still count until
    /// that uid's next hint trims them; they protect nothing).
    #[cfg(test)]
    pub fn leased_bytes(&self, uid: u32) -> u64 {
        self.leases.get(&uid).map_or(0, |b| b.bytes)
    }

    /// A hint from a scheduler of the object's own namespace, uid 0 (tests).
    #[cfg(test)]
    pub fn touch(&mut self, key: impl Into<GroupKey>, lease: Duration, now: Instant) {
        let key = key.into();
        let ns = self.objects.get(&key).map(|o| o.namespace).unwrap_or_default();
        self.touch_hint(0, ns, &[], key, lease, now);
    }

    /// Evicts least recently used DRAM objects until allocated bytes (less those being
    /// demoted) are at most `target`: to SSD (demoted, or moved if their record is still
    /// there) where the admission policy says so, else dropped. Skips objects being
    /// written, pinned by loads, leased or being demoted. Returns how many were chosen.
    pub fn evict_to(&mut self, target: u64, now: Instant) -> usize {
        let mut projected = self.alloc.allocated_bytes().saturating_sub(self.demoting_bytes);
        if projected <= target {
            return 0;
        }
        let victims = self.pick_lru(Victims::Any, now, |size, _| {
            projected = projected.saturating_sub(SlabAllocator::footprint(size));
            projected <= target
        });
        for v in &victims {
            self.evict_dram(*v, now);
        }
        self.evictions += victims.len() as u64;
        victims.len()
    }

    /// Drops every unpinned published object of `namespace` (vLLM reset_cache).
    pub fn reset_namespace(&mut self, namespace: u128) -> u64 {
        let keys: Vec<_> = self
            .objects
            .iter()
            .filter(|(_, o)| {
                o.namespace == namespace
                    && ((o.state == ObjectState::Published && o.pins == 0 && !o.demoting)
                        || matches!(o.state, ObjectState::Lower { .. }))
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

/// Which objects an eviction pass may take.
#[derive(Debug, Clone, Copy)]
enum Victims {
    Any,
    Namespace(u128),
    Group(u32),
}

#[cfg(test)]
mod tests {
    use super::*;
    use umbp_protocol::index;

    fn store(capacity: u64) -> ObjectStore {
        let slots = index::slots_for(capacity, 4096);
        let mem = SharedMemory::create("idx", index::region_bytes(slots), false).unwrap();
        // SAFETY: fresh zeroed mapping we own.
        unsafe { IndexView::init(mem.as_ptr(), mem.len(), slots) }.unwrap();
        ObjectStore::new(capacity, Arc::new(mem))
    }

    fn reader(s: &ObjectStore) -> IndexView<'_> {
        group_reader(s, 0)
    }

    fn group_reader(s: &ObjectStore, group: u32) -> IndexView<'_> {
        let m = &s.groups[group as usize]._index_mem;
        // SAFETY: the mapping lives as long as the store.
        unsafe { IndexView::attach(m.as_ptr(), m.len()) }.unwrap()
    }

    #[test]
    fn first_writer_wins_and_publish_after_copy() {
        let mut s = store(4 << 20);
        let k = ObjectKey(1);
        let StoreReservation::Reserved { offset } = s.reserve_store(7, k, 4096, 1) else { panic!() };
        assert_eq!(s.reserve_store(7, k, 4096, 2), StoreReservation::AlreadyPresent);
        assert_eq!(reader(&s).lookup(k), None, "invisible until the bytes are complete");
        assert_eq!(s.reserve_load(k, 4096), LoadReservation::Missing);
        assert!(s.finish_store(k, true));
        assert_eq!(reader(&s).lookup(k), Some(offset));
        assert_eq!(s.reserve_load(k, 4096), LoadReservation::Pinned { offset });
        assert_eq!(s.reserve_load(k, 8192), LoadReservation::SizeMismatch { stored: 4096 });
        assert_eq!(s.namespaces()[&7].objects, 1);
        assert_eq!(s.take_events(), vec![ObjectEvent::Stored(k)]);
    }

    #[test]
    fn failed_copy_frees_everything() {
        let mut s = store(4 << 20);
        s.reserve_store(0, ObjectKey(5), 100_000, 3);
        assert_eq!(s.writing_count(3), 1);
        assert!(!s.finish_store(ObjectKey(5), false));
        assert_eq!(s.allocated_bytes(), 0);
        assert_eq!(s.object_count(), 0);
    }

    #[test]
    fn eviction_respects_pins_leases_and_lru() {
        let mut s = store(4 << 20);
        let now = Instant::now();
        for i in 0..10u128 {
            s.reserve_store(0, ObjectKey(i), 64 << 10, 1);
            s.finish_store(ObjectKey(i), true);
        }
        s.reserve_load(ObjectKey(0), 64 << 10); // pinned
        s.touch(ObjectKey(1), Duration::from_secs(60), now); // leased
        s.reserve_load(ObjectKey(2), 64 << 10);
        s.finish_load(ObjectKey(2)); // recently used, unpinned
        let n = s.evict_to(5 * (64 << 10), now);
        assert_eq!(n, 5);
        let r = reader(&s);
        for i in [0u128, 1, 2] {
            assert!(r.lookup(ObjectKey(i)).is_some(), "{i} must survive");
        }
        for i in 3..8u128 {
            assert!(r.lookup(ObjectKey(i)).is_none(), "{i} is the oldest unprotected");
        }
        assert_eq!(s.evictions(), 5);
        assert_eq!(s.pinned_count(), 1, "running count: key 0 pinned, key 2 pinned and released");
        assert_eq!(s.reset_namespace(0), 4, "the pinned one stays");
        s.reserve_load(ObjectKey(0), 64 << 10);
        assert_eq!(s.pinned_count(), 1, "a second pin of one object counts once");
        s.finish_load(ObjectKey(0));
        s.finish_load(ObjectKey(0));
        assert_eq!(s.pinned_count(), 0);
    }

    fn publish(s: &mut ObjectStore, ns: u128, key: u128, size: u64) -> bool {
        matches!(s.reserve_store(ns, ObjectKey(key), size, 1), StoreReservation::Reserved { .. }) && s.finish_store(ObjectKey(key), true)
    }

    /// Objects smaller than the index was sized for fill the index before DRAM: 4 KiB
    /// objects in an index sized for 64 KiB ones (2048 slots, 1536 entries) in 64 MiB. Without
    /// index-pressure eviction every store past 1536 objects failed, with DRAM at 9 %.
    #[test]
    fn index_pressure_evicts_so_stores_keep_succeeding() {
        let cap = 64u64 << 20;
        let slots = index::slots_for(cap, 64 << 10);
        let mem = SharedMemory::create("idx", index::region_bytes(slots), false).unwrap();
        // SAFETY: fresh zeroed mapping we own.
        unsafe { IndexView::init(mem.as_ptr(), mem.len(), slots) }.unwrap();
        let mut s = ObjectStore::new(cap, Arc::new(mem));
        let cfg = crate::PoolConfig { capacity_bytes: cap, ..Default::default() };
        s.set_policy(Policy::from_config(&cfg, cap, s.index_capacity()));
        assert_eq!(s.index_capacity(), 1536);
        let now = Instant::now();
        for i in 0..5000u128 {
            assert!(publish(&mut s, 1, i, 4096), "store {i} failed");
            if s.needs_eviction() {
                s.evict(now);
            }
        }
        assert!(s.published_count() <= 1536 && s.published_count() > 1000, "{}", s.published_count());
        assert!(s.index_evictions > 0 && s.allocated_bytes() < cap / 10);
        // The newest survive.
        assert!(reader(&s).lookup(ObjectKey(4999)).is_some());
    }

    /// --namespace-share 0.5: a namespace is refused at its share, and its own LRU goes
    /// first; another namespace's objects are not touched.
    #[test]
    fn namespace_quota_evicts_its_own_lru() {
        let cap = 64u64 << 20;
        let mut s = store(cap);
        let cfg = crate::PoolConfig { capacity_bytes: cap, namespace_share: 0.5, ..Default::default() };
        s.set_policy(Policy::from_config(&cfg, cap, s.index_capacity()));
        for i in 0..64u128 {
            assert!(publish(&mut s, 2, 1_000_000 + i, 64 << 10));
        }
        let now = Instant::now();
        let mut refused = 0;
        for i in 0..2000u128 {
            if !publish(&mut s, 1, i, 64 << 10) {
                refused += 1;
            }
            if i % 256 == 255 && s.needs_eviction() {
                s.evict(now);
            }
        }
        assert!(refused > 0 && refused < 1000, "{refused}");
        assert!(s.quota_evictions > 0);
        let r = reader(&s);
        assert!((0..64u128).all(|i| r.lookup(ObjectKey(1_000_000 + i)).is_some()), "namespace 2 kept everything");
        assert!(s.namespaces()[&1].bytes <= cap / 2);
        assert!(r.lookup(ObjectKey(1800)).is_some() && r.lookup(ObjectKey(0)).is_none(), "namespace 1 kept its newest");
    }

    /// Tenant groups (`--namespace-acl`): the same key stored in two groups is two objects,
    /// each in its own group's index and event log only; a load or hint of one group never
    /// finds the other's. DRAM and byte eviction stay pool-wide (LRU across groups), index
    /// watermarks are per group.
    #[test]
    fn tenant_groups_have_their_own_objects_indexes_and_logs() {
        let cap = 4u64 << 20;
        let mems: Vec<_> = (0..3)
            .map(|_| {
                let slots = index::slots_for(cap, 64 << 10);
                let mem = SharedMemory::create("idx", index::region_bytes(slots), false).unwrap();
                // SAFETY: fresh zeroed mapping we own.
                unsafe { IndexView::init(mem.as_ptr(), mem.len(), slots) }.unwrap();
                Arc::new(mem)
            })
            .collect();
        let mut s = ObjectStore::with_groups(cap, mems);
        let logs: Vec<_> = (0..3).map(|g| crate::event_log::SharedEventLog::create(&format!("ev{g}"), 64).unwrap()).collect();
        let log_mems: Vec<_> = logs.iter().map(|l| l.memory().clone()).collect();
        for (g, l) in logs.into_iter().enumerate() {
            s.set_event_log(g as u32, l);
        }
        let (a, b) = (GroupKey::new(1, ObjectKey(42)), GroupKey::new(2, ObjectKey(42)));
        let StoreReservation::Reserved { offset } = s.reserve_store(0xa, a, 64 << 10, 1) else { panic!() };
        // Group 2 does not see group 1's object, even while it is being written.
        assert!(matches!(s.reserve_store(0xb, b, 64 << 10, 2), StoreReservation::Reserved { .. }), "not AlreadyPresent");
        assert!(s.finish_store(a, true));
        assert_eq!(group_reader(&s, 1).lookup(ObjectKey(42)), Some(offset));
        assert_eq!(group_reader(&s, 2).lookup(ObjectKey(42)), None, "group 2's index: not yet published");
        assert_eq!(group_reader(&s, 0).lookup(ObjectKey(42)), None);
        assert!(s.finish_store(b, true));
        assert_eq!(s.published_count(), 2);
        assert_eq!(s.events_written(), 2);
        assert_eq!((s.group_events_written(0), s.group_events_written(1), s.group_events_written(2)), (0, 1, 1));
        // Each log holds its own group's event only.
        for (g, m) in log_mems.iter().enumerate() {
            // SAFETY: the log's mapping lives as long as `log_mems`.
            let log = unsafe { umbp_protocol::events::EventLog::attach(m.as_ptr(), m.len()) }.unwrap();
            assert_eq!(log.snapshot().head, if g == 0 { 0 } else { 1 }, "group {g}");
        }
        // Loads and hints are per group: a key of group 1 is Missing for group 0.
        assert_eq!(s.reserve_load(ObjectKey(42), 64 << 10), LoadReservation::Missing);
        assert!(matches!(s.reserve_load(a, 64 << 10), LoadReservation::Pinned { .. }));
        s.finish_load(a);
        assert!(!s.touch_hint(5, 0xc, &[], GroupKey::new(0, ObjectKey(42)), Duration::from_secs(60), Instant::now()));
        // Bytes are pool-wide: eviction to 0 takes both groups' objects (LRU order).
        assert_eq!(s.allocated_bytes(), 2 * (64 << 10));
        assert_eq!(s.evict_to(0, Instant::now()), 2);
        assert_eq!(group_reader(&s, 1).lookup(ObjectKey(42)), None);
        assert_eq!((s.group_events_written(1), s.group_events_written(2)), (2, 2), "Removed events in each group's log");
        // Index pressure is per group: group 1 full of small objects, group 2 untouched.
        s.set_policy(Policy { index_high_wm: 0.9, index_low_wm: 0.5, ..Policy::default() });
        let cap1 = s.groups[1].index.capacity();
        for i in 0..(cap1 - 8) as u128 {
            assert!(publish_in(&mut s, 1, 0xa, i, 4096), "store {i}");
        }
        assert!(publish_in(&mut s, 2, 0xb, 7, 4096));
        assert!(s.needs_eviction());
        s.evict(Instant::now());
        assert!(s.groups[1].index.len() <= cap1 / 2, "{}", s.groups[1].index.len());
        assert!(group_reader(&s, 2).lookup(ObjectKey(7)).is_some(), "group 2 keeps its object");
    }

    /// Tier moves (issue #16): a demoting object stays loadable and is never chosen
    /// twice or freed; a written one leaves DRAM unless a load pinned it meanwhile; a
    /// promotion is exclusive (a second load waits) and a failed one is a miss that drops
    /// the object and its SSD record; a promoted object goes back to SSD without a write.
    #[test]
    fn demotion_and_promotion_move_tiers_safely() {
        use umbp_protocol::location::{encode, Tier};
        let size = 64u64 << 10;
        let mut s = store(4 << 20);
        s.set_ssd_admission(crate::ssd::SsdAdmission::All);
        let log = crate::event_log::SharedEventLog::create("ev-tiers", 256).unwrap();
        let log_mem = log.memory().clone();
        s.set_event_log(0, log);
        // SAFETY: the log's mapping lives as long as `log_mem`.
        let events = unsafe { umbp_protocol::events::EventLog::attach(log_mem.as_ptr(), log_mem.len()) }.unwrap();
        let event = |n: u64| match events.read_event(n) {
            umbp_protocol::events::EntryRead::Event(e) => (e.kind, e.key, e.tier),
            other => panic!("event {n}: {other:?}"),
        };
        use umbp_protocol::events::EventKind;
        for i in 0..10u128 {
            assert!(publish(&mut s, 1, i, size));
        }
        let now = Instant::now();
        assert!(matches!(s.reserve_load(ObjectKey(0), size), LoadReservation::Pinned { .. }));
        assert_eq!(s.evict_to(0, now), 9, "all but the pinned one");
        let d = s.take_demotions();
        assert_eq!(d.len(), 9);
        assert_eq!(s.evict_to(0, now), 0, "demoting objects count as gone and are not chosen again");
        assert_eq!(s.allocated_bytes(), 10 * size, "nothing freed while being written");
        assert_eq!(s.reset_namespace(1), 0, "a reset skips objects in a tier move");
        // Loadable while demoting; key 1 stays pinned through its demotion.
        assert!(matches!(s.reserve_load(ObjectKey(1), size), LoadReservation::Pinned { .. }));
        for x in &d {
            let w = if x.key.key == ObjectKey(9) { Err(()) } else { Ok(3) };
            s.finish_demotion(x.key, w, now);
        }
        // Events: key 2's demotion is Removed(dram) then Stored(ssd) in its group's log.
        let head = s.group_events_written(0);
        let tail: Vec<_> = (10..head).map(event).collect();
        let at = tail.iter().position(|e| *e == (EventKind::Removed, ObjectKey(2), Tier::Dram)).expect("Removed(dram)");
        assert_eq!(tail[at + 1], (EventKind::Stored, ObjectKey(2), Tier::Ssd));
        assert!(tail.contains(&(EventKind::Removed, ObjectKey(9), Tier::Dram)), "the failed demotion's removal");
        let r = reader(&s);
        assert_eq!(r.lookup(ObjectKey(2)), Some(encode(Tier::Ssd, 3)));
        assert!(r.lookup(ObjectKey(1)).is_some_and(|l| l < encode(Tier::Ssd, 0)), "pinned: still DRAM");
        assert_eq!(r.lookup(ObjectKey(9)), None, "failed demotion: dropped");
        assert_eq!(s.allocated_bytes(), 2 * size);
        let t = s.tier_stats();
        assert_eq!((t.objects[0], t.objects[1], t.demotions, t.demotion_failures), (2, 7, 8, 1));
        // A lower object: not stored again, loads must promote it.
        assert_eq!(s.reserve_store(1, ObjectKey(2), size, 1), StoreReservation::AlreadyPresent);
        assert_eq!(s.reserve_load(ObjectKey(2), size), LoadReservation::Lower { tier: Tier::Ssd });
        assert_eq!(s.reserve_load(ObjectKey(2), 2 * size), LoadReservation::SizeMismatch { stored: size });
        let (offset, tier, ns) = s.begin_promotion(ObjectKey(2)).unwrap();
        assert_eq!((tier, ns), (Tier::Ssd, 1));
        assert_eq!(s.reserve_load(ObjectKey(2), size), LoadReservation::Promoting, "a second load waits");
        assert!(s.begin_promotion(ObjectKey(2)).is_none(), "never fetched twice");
        assert_eq!(s.evict_to(0, now), 0, "a promoting object is pinned");
        let head = s.group_events_written(0);
        assert!(s.finish_promotion(ObjectKey(2), true));
        assert_eq!(reader(&s).lookup(ObjectKey(2)), Some(offset));
        assert_eq!(
            (event(head), event(head + 1)),
            ((EventKind::Removed, ObjectKey(2), Tier::Ssd), (EventKind::Stored, ObjectKey(2), Tier::Dram)),
            "a promotion is Removed(ssd) then Stored(dram)"
        );
        s.finish_load(ObjectKey(2));
        // Back to SSD without a write: its record is still there.
        s.finish_load(ObjectKey(0));
        s.finish_load(ObjectKey(1));
        assert_eq!(s.evict_to(0, now), 3);
        assert_eq!(s.take_demotions().len(), 1, "key 0 is written; keys 1 (written while pinned) and 2 are not");
        assert_eq!(reader(&s).lookup(ObjectKey(2)), Some(encode(Tier::Ssd, 3)));
        assert_eq!(reader(&s).lookup(ObjectKey(1)), Some(encode(Tier::Ssd, 3)));
        assert_eq!(s.tier_stats().clean_demotions, 2);
        // A failed promotion is a miss: the object and its record go.
        s.take_ssd_drops();
        s.begin_promotion(ObjectKey(3)).unwrap();
        assert!(!s.finish_promotion(ObjectKey(3), false));
        assert_eq!(reader(&s).lookup(ObjectKey(3)), None);
        assert_eq!(s.reserve_load(ObjectKey(3), size), LoadReservation::Missing);
        assert_eq!(s.take_ssd_drops(), vec![(ObjectKey(3), 1)]);
        // Records the SSD store dropped for room take their SSD-only objects along.
        let groups = crate::groups::TenantGroups::single();
        s.ssd_records_gone(&[(ObjectKey(4), 1), (ObjectKey(5), 2)], &groups);
        assert_eq!(reader(&s).lookup(ObjectKey(4)), None);
        assert!(reader(&s).lookup(ObjectKey(5)).is_some(), "another namespace's record: not this object");
        // A reset drops lower objects too, and queues their records' removal.
        let before = s.published_count();
        assert_eq!(s.reset_namespace(1), before - 1, "all but the demoting one");
        assert_eq!(s.take_ssd_drops().len() as u64, before - 1);
    }

    fn publish_in(s: &mut ObjectStore, group: u32, ns: u128, key: u128, size: u64) -> bool {
        let k = GroupKey::new(group, ObjectKey(key));
        matches!(s.reserve_store(ns, k, size, 1), StoreReservation::Reserved { .. }) && s.finish_store(k, true)
    }

    #[test]
    fn hints_only_for_own_namespace_and_leases_capped_per_uid() {
        let cap = 4u64 << 20;
        let mut s = store(cap);
        s.set_policy(Policy { lease_max_bytes: 4 * 4096, ..Policy::default() });
        for i in 0..10u128 {
            assert!(publish(&mut s, if i < 8 { 1 } else { 2 }, i, 4096));
        }
        let now = Instant::now();
        let lease = Duration::from_secs(60);
        // A scheduler of namespace 2 cannot lease namespace 1's objects (unless its ACL
        // lists namespace 1).
        assert!(!s.touch_hint(50, 2, &[], ObjectKey(0), lease, now));
        assert_eq!(s.foreign_hints, 1);
        assert!(s.touch_hint(50, 2, &[1], ObjectKey(0), lease, now));
        assert!(s.touch_hint(50, 2, &[], ObjectKey(8), lease, now));
        // uid 60 leases all 8 of namespace 1: only its last 4 stay leased (16 KiB cap).
        for i in 0..8u128 {
            assert!(s.touch_hint(60, 1, &[], ObjectKey(i), lease, now));
        }
        assert_eq!(s.leased_bytes(60), 4 * 4096);
        assert_eq!(s.leased_bytes(50), 4096, "key 0 moved to uid 60, key 8 stays uid 50's");
        // Re-touching does not grow the count.
        for _ in 0..3 {
            for i in 4..8u128 {
                s.touch_hint(60, 1, &[], ObjectKey(i), lease, now);
            }
        }
        assert_eq!(s.leased_bytes(60), 4 * 4096);
        assert_eq!(s.evict_to(0, now), 5, "0..4 (uid 60's leases ended early) and 9 are evictable");
        let r = reader(&s);
        assert!((4..9u128).all(|i| r.lookup(ObjectKey(i)).is_some()));
        // A reset drops leased objects too and their bytes leave the books.
        assert_eq!(s.reset_namespace(1), 4);
        assert_eq!(s.leased_bytes(60), 0);
        // Expired leases protect nothing.
        let later = now + Duration::from_secs(61);
        assert_eq!(s.evict_to(0, later), 1);
        assert_eq!(s.allocated_bytes(), 0);
    }
}
