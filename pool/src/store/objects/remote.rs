//! Remote objects (the cluster tier, docs/cluster.md): keys a peer pool holds, listed in
//! the tenant group of their namespace as `Lower { Remote }` objects (h-ssd's lower-tier state: an index entry marked
//! remote, no DRAM, in the LRU, dropped under index pressure like any object) so
//! schedulers find cross-node hits with a local lookup, and a load promotes them through
//! `Tiers::remote` like an SSD object.

use umbp_protocol::location::Tier;
use umbp_protocol::ObjectKey;

use super::{GroupKey, ObjectEvent, ObjectState, ObjectStore, Writer};

/// One published object of this pool, as the cluster advertises it (re-exported as
/// `remote::HeldObject`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldObject {
    pub key: ObjectKey,
    pub size: u64,
    pub namespace: u128,
}

impl ObjectStore {
    /// Lists a peer's object in `group` (the tenant group of its namespace here) unless
    /// this pool holds the key in that group in any form or `max_entries` remote objects
    /// are listed already (the cap that keeps peers' keys from crowding local objects out
    /// of the index).
    pub fn insert_remote(&mut self, group: u32, o: HeldObject, max_entries: u64) -> bool {
        if self.remote_entries() >= max_entries || group as usize >= self.groups.len() {
            return false;
        }
        let listed = self.insert_lower(group, o.namespace, o.key, o.size, Tier::Remote, 0);
        if listed {
            // `insert_lower` counts warm-restart listings; a peer's key is not one.
            self.tier_stats.restored -= 1;
        }
        listed
    }

    /// Remote objects listed now (including those being promoted).
    pub fn remote_entries(&self) -> u64 {
        self.lower[Tier::Remote as usize]
    }

    /// Drops `key` of `group` if it is a remote-only object (not being promoted).
    pub fn remove_remote(&mut self, group: u32, key: ObjectKey) -> bool {
        let gk = GroupKey::new(group, key);
        if self.objects.get(&gk).is_some_and(|o| o.state == (ObjectState::Lower { tier: Tier::Remote })) {
            self.drop_object(gk);
            return true;
        }
        false
    }

    /// `group`'s objects published in DRAM.
    pub fn dram_objects(&self, group: u32) -> Vec<HeldObject> {
        self.objects
            .iter()
            .filter(|(k, o)| k.group == group && o.state == ObjectState::Published)
            .map(|(k, o)| HeldObject { key: k.key, size: o.size, namespace: o.namespace })
            .collect()
    }

    pub fn dram_object(&self, group: u32, key: ObjectKey) -> Option<HeldObject> {
        let o = self.objects.get(&GroupKey::new(group, key))?;
        (o.state == ObjectState::Published).then_some(HeldObject { key, size: o.size, namespace: o.namespace })
    }

    /// Gives up on a promotion whose destination a transfer may still write (a remote read
    /// that timed out, `writer`): the object leaves the pool (index, event) and its DRAM
    /// stays allocated, quarantined until the promotion's owner has finished it (then
    /// `finish_promotion` finds nothing to free) and `writer` can no longer land
    /// (objects/quarantine.rs). Returns the bytes quarantined.
    pub fn abandon_promotion(&mut self, key: impl Into<GroupKey>, writer: Writer) -> u64 {
        let gk = key.into();
        let (group, key) = (gk.group, gk.key);
        let Some(o) = self.objects.get(&gk) else { return 0 };
        let ObjectState::Promoting { from } = o.state else { return 0 };
        let o = self.objects.remove(&gk).expect("present");
        self.lru.remove(&o.tick);
        if o.pins > 0 {
            self.pinned_objects -= 1;
        }
        self.count_lower(from, -1);
        self.release_held(o.namespace, o.size);
        self.quarantine.add(o.offset, o.size, writer, false);
        self.groups[group as usize].index.remove(key);
        if let Some(ns) = self.namespaces.get_mut(&o.namespace) {
            ns.objects -= 1;
            ns.bytes -= o.size;
            if ns.objects == 0 {
                self.namespaces.remove(&o.namespace);
            }
        }
        self.push_event(group, ObjectEvent::Removed(key), from);
        o.size
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use umbp_ipc::SharedMemory;
    use umbp_protocol::{index, location};

    use super::*;
    use crate::store::objects::{LoadReservation, StoreReservation};

    fn store() -> ObjectStore {
        let slots = index::slots_for(1 << 24, 4096);
        let mem = SharedMemory::create("idx", index::region_bytes(slots), false).unwrap();
        // SAFETY: fresh zeroed mapping we own.
        unsafe { index::IndexView::init(mem.as_ptr(), mem.len(), slots) }.unwrap();
        ObjectStore::new(1 << 24, Arc::new(mem))
    }

    fn held(k: u128) -> HeldObject {
        HeldObject { key: ObjectKey(k), size: 4096, namespace: 5 }
    }

    #[test]
    fn a_remote_object_is_listed_remote_loads_as_lower_and_is_removable() {
        let mut s = store();
        let k = ObjectKey(7);
        assert!(s.insert_remote(0, held(7), u64::MAX));
        assert!(!s.insert_remote(0, held(7), u64::MAX), "present already");
        assert_eq!(s.tier_stats.restored, 0, "not a warm-restart listing");
        assert_eq!(s.groups[0].index.get(k).and_then(location::decode), Some((Tier::Remote, 0)));
        assert_eq!(s.reserve_load(k, 4096), LoadReservation::Lower { tier: Tier::Remote });
        assert_eq!(s.reserve_store(5, k, 4096, 1), StoreReservation::AlreadyPresent);
        assert!(s.dram_objects(0).is_empty(), "not advertised as ours");
        assert!(s.remove_remote(0, k) && !s.remove_remote(0, k));
        assert_eq!(s.groups[0].index.get(k), None);
    }

    #[test]
    fn promotion_publishes_in_dram_and_then_it_is_no_longer_remote() {
        let mut s = store();
        let k = ObjectKey(9);
        assert!(s.insert_remote(0, held(9), u64::MAX));
        let (offset, tier, ns) = s.begin_promotion(k).unwrap();
        assert_eq!((tier, ns), (Tier::Remote, 5));
        assert!(s.finish_promotion(k, offset, true));
        assert_eq!(s.groups[0].index.get(k), Some(location::encode(Tier::Dram, offset)));
        assert!(!s.remove_remote(0, k), "the local copy stays");
        assert_eq!(s.dram_objects(0), vec![held(9)]);
        assert!(!s.insert_remote(0, held(9), u64::MAX));
    }

    #[test]
    fn an_abandoned_promotion_leaks_its_dram_instead_of_freeing_it() {
        let mut s = store();
        let k = ObjectKey(11);
        assert!(s.insert_remote(0, held(11), u64::MAX));
        let before = s.allocated_bytes();
        let (offset, _, _) = s.begin_promotion(k).unwrap();
        let allocated = s.allocated_bytes();
        assert!(allocated > before);
        assert_eq!(s.abandon_promotion(k, Writer::RemoteRead("holder".into())), 4096);
        assert!(!s.finish_promotion(k, offset, false), "nothing left to free");
        assert_eq!(s.allocated_bytes(), allocated, "the DRAM is never reused");
        assert_eq!(s.quarantined_bytes(), 4096);
        assert_eq!(s.groups[0].index.get(k), None);
        assert_eq!(s.pinned_count(), 0);
    }

    /// Issue #31 item 5: load A's remote read times out (its promotion is abandoned, its
    /// DRAM quarantined), the peer's key is listed again and load B begins its own
    /// promotion of it; A's late `finish_promotion` must not end B's (free B's DRAM while
    /// B's fetch still writes it, and drop B's object).
    #[test]
    fn a_late_finish_never_ends_another_loads_promotion_of_the_key() {
        let mut s = store();
        let k = ObjectKey(13);
        assert!(s.insert_remote(0, held(13), u64::MAX));
        let a = s.begin_promotion(k).unwrap();
        assert_eq!(s.abandon_promotion(k, Writer::RemoteRead("holder".into())), 4096);
        assert!(s.insert_remote(0, held(13), u64::MAX), "the follower lists the peer's key again");
        let b = s.begin_promotion(k).unwrap();
        assert_ne!(a.0, b.0, "A's DRAM is quarantined, B got its own");
        let allocated = s.allocated_bytes();
        assert!(!s.finish_promotion(k, a.0, false), "A's finish ends nothing");
        assert_eq!(s.allocated_bytes(), allocated, "B's DRAM is still allocated (its fetch writes it)");
        assert_eq!(s.reserve_load(k, 4096), LoadReservation::Promoting, "B's promotion still runs");
        assert!(s.finish_promotion(k, b.0, true), "B's own finish publishes");
        assert_eq!(s.groups[0].index.get(k), Some(location::encode(Tier::Dram, b.0)));
    }

    /// Issue #31 item 6g: the DRAM of timed-out reads is reclaimed once both the load
    /// that began each promotion has finished it and the cluster node has forgotten the
    /// holder (its endpoint closed: no byte of the read lands any more), in either order;
    /// another holder's ranges stay. Before, it stayed allocated until the pool restarted.
    #[test]
    fn quarantined_reads_are_reclaimed_once_finished_and_their_holder_forgotten() {
        let mut s = store();
        let holder = |k: u128| Writer::RemoteRead(if k.is_multiple_of(4) { "h2".into() } else { "h1".into() });
        let before = s.allocated_bytes();
        let mut begun = Vec::new();
        for k in 0..8u128 {
            assert!(s.insert_remote(0, held(300 + k), u64::MAX));
            let (offset, _, _) = s.begin_promotion(ObjectKey(300 + k)).unwrap();
            assert_eq!(s.abandon_promotion(ObjectKey(300 + k), holder(k)), 4096);
            begun.push((k, offset));
        }
        assert_eq!(s.quarantine_stats().ranges, 8);
        // h1 forgotten before its loads finished: nothing may be reused yet (a late finish
        // would match another promotion given the same offset).
        assert_eq!(s.reclaim_quarantine_of("h1"), 0);
        for &(k, offset) in &begun[..4] {
            assert!(!s.finish_promotion(ObjectKey(300 + k), offset, false));
        }
        // Finished after the forget: k = 1, 2, 3 (h1) are free at their finish.
        assert_eq!(s.quarantine_stats().reclaimed_bytes, 3 * 4096);
        for &(k, offset) in &begun[4..] {
            assert!(!s.finish_promotion(ObjectKey(300 + k), offset, false));
        }
        assert_eq!(s.quarantine_stats().reclaimed_bytes, 6 * 4096, "h1's six ranges");
        assert_eq!(s.quarantined_bytes(), 2 * 4096, "h2 (k = 0, 4) was not forgotten");
        assert_eq!(s.reclaim_quarantine_of("h2"), 2 * 4096);
        let stats = s.quarantine_stats();
        assert_eq!((stats.bytes, stats.ranges, stats.reclaimed_bytes), (0, 0, 8 * 4096), "{stats:?}");
        assert_eq!(s.allocated_bytes(), before, "every range is back in the allocator");
    }

    /// Issue #31 item 6g: the quarantine is bounded. At the bound a promotion from the
    /// remote tier is refused (the remote copy is forgotten here: the load misses, never
    /// reads a wrong byte) and counted; once ranges are reclaimed, promotions resume.
    /// Before, every timed-out read added DRAM for good.
    #[test]
    fn at_its_bound_the_quarantine_refuses_remote_promotions() {
        let mut s = store();
        s.set_quarantine_max_bytes(2 * 4096);
        let mut begun = Vec::new();
        for k in 0..2u128 {
            assert!(s.insert_remote(0, held(400 + k), u64::MAX));
            let (offset, _, _) = s.begin_promotion(ObjectKey(400 + k)).unwrap();
            s.abandon_promotion(ObjectKey(400 + k), Writer::RemoteRead("slow".into()));
            assert!(!s.finish_promotion(ObjectKey(400 + k), offset, false));
            begun.push(offset);
        }
        assert!(s.insert_remote(0, held(410), u64::MAX));
        let allocated = s.allocated_bytes();
        assert_eq!(s.begin_promotion(ObjectKey(410)), None, "at the bound no remote read begins");
        assert_eq!(s.reserve_load(ObjectKey(410), 4096), LoadReservation::Missing, "the load misses");
        assert_eq!(s.groups[0].index.get(ObjectKey(410)), None, "lookups miss too");
        assert_eq!(s.allocated_bytes(), allocated);
        assert_eq!(s.quarantine_stats().refusals, 1);
        assert_eq!(s.reclaim_quarantine_of("slow"), 2 * 4096);
        assert!(s.insert_remote(0, held(410), u64::MAX));
        assert!(s.begin_promotion(ObjectKey(410)).is_some(), "under the bound again: promotions resume");
    }

    #[test]
    fn remote_entries_stop_at_the_cap_and_never_take_room_from_local_stores() {
        let mut s = store();
        for k in 0..10u128 {
            assert_eq!(s.insert_remote(0, held(100 + k), 4), k < 4, "entry {k}");
        }
        assert_eq!(s.remote_entries(), 4);
        // Local stores go on (the index has room the cap kept free).
        for k in 0..8u128 {
            assert!(matches!(s.reserve_store(5, ObjectKey(k), 4096, 1), StoreReservation::Reserved { .. }), "local store {k}");
        }
        // A promoted remote object is local: it no longer counts, so one more may be listed.
        let (offset, _, _) = s.begin_promotion(ObjectKey(100)).unwrap();
        assert!(s.finish_promotion(ObjectKey(100), offset, true));
        assert_eq!(s.remote_entries(), 3);
        assert!(s.insert_remote(0, held(200), 4) && !s.insert_remote(0, held(201), 4));
        // A removed one frees its place too.
        assert!(s.remove_remote(0, ObjectKey(101)));
        assert!(s.insert_remote(0, held(202), 4));
    }
}
