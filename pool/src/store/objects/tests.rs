use std::time::Duration;

use super::*;
use umbp_protocol::index;

fn store(capacity: u64) -> ObjectStore {
    ObjectStore::new(capacity, index_mem(capacity, 4096))
}

/// A formatted index for a store of `capacity` bytes of objects of at least `min_object`.
fn index_mem(capacity: u64, min_object: u64) -> Arc<SharedMemory> {
    let slots = index::slots_for(capacity, min_object);
    let mem = SharedMemory::create("idx", index::region_bytes(slots), false).unwrap();
    // SAFETY: fresh zeroed mapping we own.
    unsafe { IndexView::init(mem.as_ptr(), mem.len(), slots) }.unwrap();
    Arc::new(mem)
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
    let mems: Vec<_> = (0..3).map(|_| index_mem(cap, 64 << 10)).collect();
    let mut s = ObjectStore::with_groups(cap, mems);
    let logs: Vec<_> = (0..3).map(|g| crate::store::event_log::SharedEventLog::create(&format!("ev{g}"), 64).unwrap()).collect();
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
    s.set_ssd_admission(umbp_ssd::SsdAdmission::All);
    let log = crate::store::event_log::SharedEventLog::create("ev-tiers", 256).unwrap();
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
    assert_eq!((t.objects[0], t.objects[1], t.moves.demotions, t.moves.demotion_failures), (2, 7, 8, 1));
    // The count a load's look-ahead reads without the store lock follows every move.
    let lower = s.lower_objects_counter();
    let lower_now = |s: &ObjectStore| (lower.load(std::sync::atomic::Ordering::Acquire), s.lower_objects());
    assert_eq!(lower_now(&s), (7, 7));
    // A lower object: not stored again, loads must promote it.
    assert_eq!(s.reserve_store(1, ObjectKey(2), size, 1), StoreReservation::AlreadyPresent);
    assert_eq!(s.reserve_load(ObjectKey(2), size), LoadReservation::Lower { tier: Tier::Ssd });
    assert_eq!(s.reserve_load(ObjectKey(2), 2 * size), LoadReservation::SizeMismatch { stored: size });
    let (offset, tier, ns) = s.begin_promotion(ObjectKey(2)).unwrap();
    assert_eq!((tier, ns), (Tier::Ssd, 1));
    assert_eq!(s.reserve_load(ObjectKey(2), size), LoadReservation::Promoting, "a second load waits");
    assert!(s.begin_promotion(ObjectKey(2)).is_none(), "never fetched twice");
    assert_eq!(lower_now(&s), (7, 7), "a promoting object is still below DRAM");
    assert_eq!(s.evict_to(0, now), 0, "a promoting object is pinned");
    let head = s.group_events_written(0);
    assert!(s.finish_promotion(ObjectKey(2), offset, true));
    assert_eq!(lower_now(&s), (6, 6));
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
    let (offset3, _, _) = s.begin_promotion(ObjectKey(3)).unwrap();
    assert!(!s.finish_promotion(ObjectKey(3), offset3, false));
    assert_eq!(lower.load(std::sync::atomic::Ordering::Acquire), s.lower_objects(), "a failed promotion drops the object");
    assert_eq!(reader(&s).lookup(ObjectKey(3)), None);
    assert_eq!(s.reserve_load(ObjectKey(3), size), LoadReservation::Missing);
    assert_eq!(s.take_ssd_drops(), vec![(ObjectKey(3), 1)]);
    // Records the SSD store dropped for room take their SSD-only objects along.
    let groups = crate::store::groups::TenantGroups::single();
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

/// The evictor's passes go in bounded steps (it hands the store lock to copy threads
/// between them): steps of 7 evict exactly what one pass at once does (bytes, index
/// entries and namespaces' quotas, around pinned and leased objects), each step at most
/// 7, and the pass goes on to the low watermarks after the first step took the store
/// below the high ones.
#[test]
fn eviction_in_steps_evicts_what_one_pass_does() {
    const SIZE: u64 = 4096;
    let build = || {
        // Slabs of three sizes (2 MiB pages each), and room for every object below.
        let cap = 16 << 20;
        let mut s = ObjectStore::with_groups(cap, vec![index_mem(4 << 20, 4096), index_mem(4 << 20, 4096)]);
        s.set_policy(Policy {
            high_bytes: 1 << 20,
            low_bytes: 512 << 10,
            index_high_wm: 0.9,
            index_low_wm: 0.5,
            namespace_max_bytes: 1 << 20,
            namespace_high: 0.9,
            namespace_low: 0.5,
            ..Policy::default()
        });
        let now = Instant::now();
        // Group 0: two namespaces over their quota's high mark, and together over the
        // bytes one.
        for i in 0..120u128 {
            assert!(publish_in(&mut s, 0, 1, i, 2 * SIZE), "store {i}");
        }
        for i in 1000..1235u128 {
            assert!(publish_in(&mut s, 0, 2, i, SIZE), "store {i}");
        }
        // Group 1: small objects over its index mark.
        let cap1 = s.groups[1].index.capacity();
        for i in 0..(cap1 - 4) as u128 {
            assert!(publish_in(&mut s, 1, 3, i, 64), "group 1 store {i}");
        }
        // Protected: pinned, leased, scattered through the LRU.
        for i in (0..120u128).step_by(13) {
            s.reserve_load(ObjectKey(i), 2 * SIZE);
        }
        for i in (5..1235u128).step_by(17) {
            s.touch(ObjectKey(i), Duration::from_secs(600), now);
        }
        s.take_events();
        (s, now)
    };
    let (mut whole, now) = build();
    assert!(whole.needs_eviction());
    let evicted = whole.evict(now);

    let (mut stepped, now) = build();
    let mut pass = stepped.eviction_pass();
    let (mut total, mut steps) = (0, 0);
    while !pass.is_done() {
        let k = stepped.evict_step(&mut pass, now, 7);
        assert!(k <= 7, "a step evicts at most its budget: {k}");
        total += k;
        steps += 1;
        assert!(steps < 10_000, "the pass ends");
    }
    assert_eq!(total, evicted);
    assert!(steps > evicted / 7, "{steps} steps for {evicted} objects");
    assert_eq!(stepped.object_count(), whole.object_count());
    assert_eq!(stepped.allocated_bytes(), whole.allocated_bytes());
    assert!(stepped.allocated_bytes() <= stepped.policy.low_bytes, "down to the low watermark, not just under the high one");
    for g in 0..2 {
        assert_eq!(stepped.groups[g].index.len(), whole.groups[g].index.len(), "group {g}");
    }
    for (key, o) in &whole.objects {
        assert!(stepped.objects.get(key).is_some_and(|s| s.size == o.size), "{key:?} kept in both");
    }
    for ns in [1, 2, 3] {
        assert_eq!(stepped.namespaces().get(&ns).map(|h| h.objects), whole.namespaces().get(&ns).map(|h| h.objects), "namespace {ns}");
    }
    assert_eq!(stepped.needs_eviction(), whole.needs_eviction(), "what is left is protected in both");
    assert!(evicted > 1000, "a pass of {evicted} objects");
}
