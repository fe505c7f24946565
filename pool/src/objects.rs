//! The object store: which keys the pool holds, where, in what state; LRU order, pins,
//! leases; and the index writer that makes published objects visible to schedulers.
//! One instance behind one mutex; every method is short (no copies under the lock).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_ipc::SharedMemory;
use umbp_protocol::index::{IndexView, IndexWriter, Insert};
use umbp_protocol::ObjectKey;

use crate::alloc::SlabAllocator;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ObjectState {
    /// Bytes being copied in by this attachment; invisible to loads and the index.
    Writing { owner: u32 },
    Published,
}

#[derive(Debug)]
struct Object {
    offset: u64,
    size: u64,
    namespace: u128,
    state: ObjectState,
    /// Loads in flight; a pinned object is never evicted or freed.
    pins: u32,
    /// Protected from eviction until then (scheduler touch hints).
    lease_until: Option<Instant>,
    /// Position in `lru`.
    tick: u64,
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

pub struct ObjectStore {
    alloc: SlabAllocator,
    objects: HashMap<ObjectKey, Object>,
    lru: BTreeMap<u64, ObjectKey>,
    next_tick: u64,
    index: IndexWriter<'static>,
    namespaces: HashMap<u128, NamespaceUsage>,
    evictions: u64,
    /// Objects with `pins > 0`, kept as pins change so reports and scrapes never walk
    /// the objects under the store lock.
    pinned_objects: usize,
    quarantined_bytes: u64,
    events: Vec<ObjectEvent>,
    /// The same events in shared memory, for schedulers (absent in unit tests).
    event_log: Option<crate::event_log::SharedEventLog>,
    // Declared last: the index writer borrows this mapping.
    _index_mem: Arc<SharedMemory>,
}

/// Events kept for observers before the oldest are dropped.
const MAX_EVENTS: usize = 1 << 16;

impl ObjectStore {
    pub fn new(capacity_bytes: u64, index_mem: Arc<SharedMemory>) -> Self {
        // SAFETY: the pool formatted this mapping (`Pool::start`) and keeps it alive in
        // `_index_mem` for as long as the writer exists; the store is its only writer.
        let view = unsafe { IndexView::attach(index_mem.as_ptr(), index_mem.len()) }
            .expect("the pool formats its own index region");
        // SAFETY: extends the borrow to 'static; `_index_mem` outlives `index` (field
        // order) and the mapping never moves.
        let view: IndexView<'static> = unsafe { std::mem::transmute::<IndexView<'_>, IndexView<'static>>(view) };
        Self {
            alloc: SlabAllocator::new(capacity_bytes),
            objects: HashMap::new(),
            lru: BTreeMap::new(),
            next_tick: 0,
            index: IndexWriter::new(view),
            namespaces: HashMap::new(),
            evictions: 0,
            pinned_objects: 0,
            quarantined_bytes: 0,
            events: Vec::new(),
            event_log: None,
            _index_mem: index_mem,
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

    pub fn published_count(&self) -> u64 {
        self.index.len()
    }

    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    pub fn namespaces(&self) -> &HashMap<u128, NamespaceUsage> {
        &self.namespaces
    }

    pub fn set_page_limit(&mut self, pages: u32) {
        self.alloc.set_page_limit(pages);
    }

    fn touch_lru(&mut self, key: ObjectKey) {
        let tick = self.next_tick;
        self.next_tick += 1;
        if let Some(o) = self.objects.get_mut(&key) {
            self.lru.remove(&o.tick);
            o.tick = tick;
            self.lru.insert(tick, key);
        }
    }

    /// First writer wins: a key that exists (published or being written) is not stored
    /// again. Never evicts: no room is `NoRoom`.
    pub fn reserve_store(&mut self, namespace: u128, key: ObjectKey, size: u64, owner: u32) -> StoreReservation {
        if self.objects.contains_key(&key) {
            return StoreReservation::AlreadyPresent;
        }
        let Some(offset) = self.alloc.alloc(size) else {
            return StoreReservation::NoRoom;
        };
        let tick = self.next_tick;
        self.next_tick += 1;
        self.objects.insert(
            key,
            Object { offset, size, namespace, state: ObjectState::Writing { owner }, pins: 0, lease_until: None, tick },
        );
        self.lru.insert(tick, key);
        StoreReservation::Reserved { offset }
    }

    /// Ends a store: on success the object becomes visible in the index (only now that
    /// its bytes are complete); otherwise its allocation is freed. Returns whether the
    /// object is now published.
    pub fn finish_store(&mut self, key: ObjectKey, copied: bool) -> bool {
        let Some(o) = self.objects.get(&key) else { return false };
        debug_assert!(matches!(o.state, ObjectState::Writing { .. }));
        if copied {
            match self.index.insert(key, o.offset) {
                Ok(Insert::Inserted) => {
                    let o = self.objects.get_mut(&key).expect("present");
                    o.state = ObjectState::Published;
                    let ns = self.namespaces.entry(o.namespace).or_default();
                    ns.objects += 1;
                    ns.bytes += o.size;
                    self.push_event(ObjectEvent::Stored(key));
                    return true;
                }
                Ok(Insert::Exists(_)) => unreachable!("the store reserves keys before copying"),
                Err(full) => tracing::warn!("{full}: object not stored"),
            }
        }
        self.drop_object(key);
        false
    }

    /// Gives up on an object being written whose copy may still be in flight (a copy
    /// thread panicked mid-transfer): the key is forgotten, so it can be stored again, but
    /// its DRAM is never handed out again — a DMA still writing there must not land in
    /// someone else's object. Returns the bytes leaked.
    pub fn quarantine(&mut self, key: ObjectKey) -> u64 {
        match self.objects.get(&key) {
            Some(o) if matches!(o.state, ObjectState::Writing { .. }) => {
                let o = self.objects.remove(&key).expect("present");
                self.lru.remove(&o.tick);
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

    fn drop_object(&mut self, key: ObjectKey) {
        if let Some(o) = self.objects.remove(&key) {
            if o.pins > 0 {
                self.pinned_objects -= 1;
            }
            self.lru.remove(&o.tick);
            self.alloc.free(o.offset, o.size);
            if o.state == ObjectState::Published {
                self.index.remove(key);
                if let Some(ns) = self.namespaces.get_mut(&o.namespace) {
                    ns.objects -= 1;
                    ns.bytes -= o.size;
                    if ns.objects == 0 {
                        self.namespaces.remove(&o.namespace);
                    }
                }
                self.push_event(ObjectEvent::Removed(key));
            }
        }
    }

    /// From now on every event also goes to this shared-memory log.
    pub fn set_event_log(&mut self, log: crate::event_log::SharedEventLog) {
        self.event_log = Some(log);
    }

    /// Events written to the shared log so far.
    pub fn events_written(&self) -> u64 {
        self.event_log.as_ref().map_or(0, |l| l.written())
    }

    fn push_event(&mut self, e: ObjectEvent) {
        if let Some(log) = self.event_log.as_mut() {
            log.push(e);
        }
        if self.events.len() >= MAX_EVENTS {
            self.events.drain(..MAX_EVENTS / 2);
        }
        self.events.push(e);
    }

    /// Events since the last call.
    pub fn take_events(&mut self) -> Vec<ObjectEvent> {
        std::mem::take(&mut self.events)
    }

    /// Namespace of the peer that stored `key` (None: not held).
    pub fn namespace_of(&self, key: ObjectKey) -> Option<u128> {
        self.objects.get(&key).map(|o| o.namespace)
    }

    /// Pins a published object for a load of `size` bytes.
    pub fn reserve_load(&mut self, key: ObjectKey, size: u64) -> LoadReservation {
        let Some(o) = self.objects.get_mut(&key) else { return LoadReservation::Missing };
        if o.state != ObjectState::Published {
            return LoadReservation::Missing;
        }
        if o.size != size {
            return LoadReservation::SizeMismatch { stored: o.size };
        }
        o.pins += 1;
        if o.pins == 1 {
            self.pinned_objects += 1;
        }
        let offset = o.offset;
        self.touch_lru(key);
        LoadReservation::Pinned { offset }
    }

    pub fn finish_load(&mut self, key: ObjectKey) {
        if let Some(o) = self.objects.get_mut(&key) {
            if o.pins == 1 {
                self.pinned_objects -= 1;
            }
            o.pins = o.pins.saturating_sub(1);
        }
    }

    /// A scheduler hit: counts as use, and protects the object for `lease`.
    pub fn touch(&mut self, key: ObjectKey, lease: Duration, now: Instant) {
        if let Some(o) = self.objects.get_mut(&key) {
            o.lease_until = Some(now + lease);
            self.touch_lru(key);
        }
    }

    /// Evicts least recently used objects until allocated bytes are at most `target`.
    /// Skips objects being written, pinned by loads, or leased. Returns how many went.
    pub fn evict_to(&mut self, target: u64, now: Instant) -> usize {
        let mut victims = Vec::new();
        let mut projected = self.alloc.allocated_bytes();
        for (_, key) in self.lru.iter() {
            if projected <= target {
                break;
            }
            let o = &self.objects[key];
            let leased = o.lease_until.is_some_and(|t| t > now);
            if o.state != ObjectState::Published || o.pins > 0 || leased {
                continue;
            }
            projected = projected.saturating_sub(SlabAllocator::footprint(o.size));
            victims.push(*key);
        }
        for k in &victims {
            self.drop_object(*k);
        }
        self.evictions += victims.len() as u64;
        victims.len()
    }

    /// Drops every unpinned published object of `namespace` (vLLM reset_cache).
    pub fn reset_namespace(&mut self, namespace: u128) -> u64 {
        let keys: Vec<_> = self
            .objects
            .iter()
            .filter(|(_, o)| o.namespace == namespace && o.state == ObjectState::Published && o.pins == 0)
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
        // SAFETY: the mapping lives as long as the store.
        unsafe { IndexView::attach(s._index_mem.as_ptr(), s._index_mem.len()) }.unwrap()
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
}
