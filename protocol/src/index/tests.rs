use super::*;

pub(crate) struct Region(Vec<u128>);

impl Region {
    fn new(slots: u64) -> Self {
        Self(vec![0u128; region_bytes(slots) / 16 + 8])
    }
    fn ptr(&mut self) -> *mut u8 {
        // Align to 128 inside the buffer.
        let p = self.0.as_mut_ptr() as usize;
        ((p + 127) & !127) as *mut u8
    }
}

#[test]
fn insert_lookup_remove_rebuild() {
    let mut r = Region::new(MIN_SLOTS);
    let p = r.ptr();
    // SAFETY: region outlives the view.
    let view = unsafe { IndexView::init(p, region_bytes(MIN_SLOTS), MIN_SLOTS) }.unwrap();
    let mut w = IndexWriter::new(view);
    for i in 0..500u128 {
        assert_eq!(w.insert(ObjectKey(i * 7919), i as u64), Ok(Insert::Inserted));
    }
    assert_eq!(w.insert(ObjectKey(7919), 99), Ok(Insert::Exists(1)));
    // SAFETY: as above; a second (reader) view of the same region.
    let reader = unsafe { IndexView::attach(p, region_bytes(MIN_SLOTS)) }.unwrap();
    assert_eq!(reader.lookup(ObjectKey(7919 * 3)), Some(3));
    let keys: Vec<_> = (0..10u128).map(|i| ObjectKey(i * 7919)).collect();
    assert_eq!(reader.match_prefix(&keys), 10);
    // A tier move rewrites the location in place: same entry count, no tombstone.
    let (live, tombs) = (w.len(), w.tombstones());
    assert!(w.set_location(ObjectKey(7919 * 2), crate::location::encode(crate::location::Tier::Ssd, 4)));
    assert_eq!(reader.lookup(ObjectKey(7919 * 2)), Some(crate::location::encode(crate::location::Tier::Ssd, 4)));
    assert!(w.set_location(ObjectKey(7919 * 2), 2));
    assert!(!w.set_location(ObjectKey(1), 7), "absent keys are not inserted");
    assert_eq!((w.len(), w.tombstones(), reader.lookup(ObjectKey(1))), (live, tombs, None));
    assert_eq!(w.remove(ObjectKey(7919 * 5)), Some(5));
    assert_eq!(reader.match_prefix(&keys), 5);
    assert_eq!(reader.lookup(ObjectKey(7919 * 5)), None);
    // Churn until a rebuild happens; everything live stays visible.
    for round in 0..2000u128 {
        let k = ObjectKey(1_000_000 + round);
        w.insert(k, 1).unwrap();
        w.remove(k).unwrap();
    }
    let snap = reader.snapshot();
    assert!(snap.rebuilds > 0, "{snap:?}");
    assert_eq!(snap.live, 499);
    assert_eq!(reader.lookup(ObjectKey(7919 * 499)), Some(499));
    w.clear();
    assert_eq!(reader.lookup(ObjectKey(7919 * 499)), None);
    assert_eq!(reader.snapshot().live, 0);
}

/// Keys a client picks itself, all a multiple of the table size apart (so the raw low
/// words agree modulo the table), and sequential runs of them: the home slots still
/// spread, so no entry sits far from its home (raw words: one run of 300 slots).
#[test]
fn strided_and_sequential_keys_spread_over_the_table() {
    let slots = 4 * MIN_SLOTS;
    let mut r = Region::new(slots);
    let p = r.ptr();
    // SAFETY: region outlives the view.
    let view = unsafe { IndexView::init(p, region_bytes(slots), slots) }.unwrap();
    let mut w = IndexWriter::new(view);
    for round in 0..10u128 {
        for i in 0..300u128 {
            let key = (round << 80) | (round * slots as u128 * 1024) | i;
            w.insert(ObjectKey(key), 1).unwrap();
        }
    }
    // SAFETY: as above.
    let reader = unsafe { IndexView::attach(p, region_bytes(slots)) }.unwrap();
    let hist = reader.probe_histogram(32);
    assert_eq!(hist.iter().sum::<u64>(), 3000);
    // 3000 of 4096 slots filled (73 %): linear probing keeps nearly all within a few
    // slots of home; a clustering home function puts thousands at distance >= 31.
    assert!(hist[31] < 30, "far-from-home entries: {hist:?}");
}

#[test]
fn full_table_refuses() {
    let mut r = Region::new(MIN_SLOTS);
    // SAFETY: region outlives the view.
    let view = unsafe { IndexView::init(r.ptr(), region_bytes(MIN_SLOTS), MIN_SLOTS) }.unwrap();
    let mut w = IndexWriter::new(view);
    let mut n = 0;
    while w.insert(ObjectKey(n as u128 + 1), 0).is_ok() {
        n += 1;
    }
    assert_eq!(n, 768);
    assert!(matches!(w.insert(ObjectKey(u128::MAX), 0), Err(InsertError::Full(IndexFull { live: 768, .. }))));
}

/// Keys chosen so that protocol v2's unkeyed mix gave them all one home slot (equal
/// `lo ^ rotl(hi, 32)`): v2 put 600 of them in one run of 600 slots, so every probe
/// near there walked it. Keyed, they spread like random keys.
#[test]
fn keys_colliding_under_the_unkeyed_mix_spread() {
    let slots = 4 * MIN_SLOTS;
    let mut r = Region::new(slots);
    // SAFETY: region outlives the view.
    let view = unsafe { IndexView::init_seeded(r.ptr(), region_bytes(slots), slots, [0x1234, 0x5678]) }.unwrap();
    let mut w = IndexWriter::new(view);
    for i in 0..600u64 {
        let key = ((i as u128) << 64) | (i.rotate_left(32) ^ 0xdead_beef) as u128;
        w.insert(ObjectKey(key), 1).unwrap();
    }
    let hist = view.probe_histogram(32);
    assert_eq!(hist.iter().sum::<u64>(), 600);
    assert!(hist[31] == 0 && hist[0] > 400, "far-from-home entries: {hist:?}");
}

/// Keys found (knowing the seed) to share one home slot: the writer takes
/// MAX_PROBE of them and refuses the rest with ProbeLimit; a key homed elsewhere is
/// unaffected, and a lookup never probes more than MAX_PROBE slots.
#[test]
fn probe_runs_are_bounded_even_for_keys_chosen_with_the_seed() {
    let slots = 4 * MIN_SLOTS;
    let seed = [7, 9];
    let mut r = Region::new(slots);
    // SAFETY: region outlives the view.
    let view = unsafe { IndexView::init_seeded(r.ptr(), region_bytes(slots), slots, seed) }.unwrap();
    let mut w = IndexWriter::new(view);
    let colliding: Vec<ObjectKey> = (1u128..).map(ObjectKey).filter(|k| view.home(*k) == 100).take(800).collect();
    let mut refused = 0;
    for k in &colliding {
        match w.insert(*k, 1) {
            Ok(Insert::Inserted) => {}
            Err(InsertError::ProbeLimit { home: 100, limit: MAX_PROBE }) => refused += 1,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(refused, 800 - MAX_PROBE as usize);
    assert_eq!(view.lookup(colliding[0]), Some(1));
    assert_eq!(view.lookup(colliding[799]), None);
    let elsewhere = (1u128..).map(ObjectKey).find(|k| view.home(*k) == 2000).unwrap();
    assert_eq!(w.insert(elsewhere, 5), Ok(Insert::Inserted));
    assert_eq!(view.lookup(elsewhere), Some(5));
    // Removing half and churning forces rebuilds; every live one stays within reach.
    for k in colliding.iter().take(MAX_PROBE as usize).step_by(2) {
        w.remove(*k).unwrap();
    }
    for round in 0..3000u128 {
        let k = ObjectKey(1 << 100 | round);
        w.insert(k, 1).unwrap();
        w.remove(k).unwrap();
    }
    assert!(view.snapshot().rebuilds > 0);
    for k in colliding.iter().take(MAX_PROBE as usize).skip(1).step_by(2) {
        assert_eq!(view.lookup(*k), Some(1));
    }
    assert_eq!(view.lookup(elsewhere), Some(5));
    // Room again near slot 100: colliding keys go in up to the bound once more.
    let mut more = 0;
    for k in &colliding[MAX_PROBE as usize..] {
        if w.insert(*k, 1).is_ok() {
            more += 1;
        }
    }
    assert_eq!(more, MAX_PROBE as usize / 2);
}

/// Random keys at the pool's loads stay far inside MAX_PROBE (2^20 slots, filled to
/// one half and then to the 3/4 limit).
#[test]
fn random_keys_stay_far_inside_the_probe_limit() {
    let slots = 1u64 << 20;
    let mut r = Region::new(slots);
    // SAFETY: region outlives the view.
    let view = unsafe { IndexView::init_seeded(r.ptr(), region_bytes(slots), slots, [11, 13]) }.unwrap();
    let mut w = IndexWriter::new(view);
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let max_dist = |v: &IndexView<'_>| {
        let hist = v.probe_histogram(MAX_PROBE as usize + 1);
        hist.iter().rposition(|&n| n > 0).unwrap_or(0)
    };
    for (load, bound) in [(slots / 2, 128), (slots / 4 * 3, MAX_PROBE as usize)] {
        while w.len() < load {
            w.insert(ObjectKey(((next() as u128) << 64) | next() as u128), 1).unwrap();
        }
        let d = max_dist(&view);
        eprintln!("load {load}/{slots}: longest displacement {d}");
        assert!(d < bound, "{d}");
    }
}

#[test]
fn the_seed_is_in_the_header_and_changes_homes() {
    let mut a = Region::new(MIN_SLOTS);
    let mut b = Region::new(MIN_SLOTS);
    let len = region_bytes(MIN_SLOTS);
    // SAFETY: regions outlive the views.
    let va = unsafe { IndexView::init_seeded(a.ptr(), len, MIN_SLOTS, [1, 2]) }.unwrap();
    // SAFETY: as above.
    let vb = unsafe { IndexView::init_seeded(b.ptr(), len, MIN_SLOTS, [3, 4]) }.unwrap();
    // SAFETY: as above; a reader attaching later reads the seed from the header.
    let ra = unsafe { IndexView::attach(a.ptr(), len) }.unwrap();
    let same = (0..1000u128).filter(|i| va.home(ObjectKey(*i)) == vb.home(ObjectKey(*i))).count();
    assert!(same < 10, "{same} of 1000 keys kept their home under another seed");
    assert!((0..1000u128).all(|i| ra.home(ObjectKey(i)) == va.home(ObjectKey(i))));
}

/// The home mix spreads keys a fixed stride apart and keys that collided under v2's
/// unkeyed mix (equal `lo ^ rotl(hi, 32)`) like random ones.
#[test]
fn home_mix_spreads_structured_keys() {
    let mask = (1u64 << 12) - 1;
    for seed in [[0, 0], [0x1234, 0x5678]] {
        let families: [Box<dyn Fn(u128) -> ObjectKey>; 3] = [
            Box::new(ObjectKey),
            Box::new(|i| ObjectKey(i << 64)),
            // v2 colliders: lo ^ rotl(hi, 32) constant.
            Box::new(|i| {
                let hi = i as u64;
                ObjectKey(((hi.rotate_left(32) ^ 0xabc) as u128) | ((hi as u128) << 64))
            }),
        ];
        for f in &families {
            let mut used = std::collections::HashSet::new();
            for i in 0..4096u128 {
                used.insert(home_slot(f(i), mask, seed));
            }
            // 4096 random keys into 4096 slots occupy ~63% of them (1 - 1/e).
            assert!(used.len() > 2300, "{} of 4096 home slots used", used.len());
        }
    }
}

#[test]
fn malformed_index_regions() {
    let mut r = Region::new(MIN_SLOTS);
    let p = r.ptr();
    let len = region_bytes(MIN_SLOTS);
    // SAFETY: the region outlives every view.
    assert!(matches!(unsafe { IndexView::attach(p, len) }, Err(ProtocolError::BadMagic { .. })));
    // SAFETY: the region outlives every view.
    assert!(matches!(unsafe { IndexView::init(p, len, 1000) }, Err(ProtocolError::InvalidField { .. })));
    // SAFETY: the region outlives every view.
    assert!(matches!(unsafe { IndexView::init(p, 100, MIN_SLOTS) }, Err(ProtocolError::RegionTooSmall { .. })));
    // SAFETY: the region outlives every view.
    let view = unsafe { IndexView::init(p, len, MIN_SLOTS) }.unwrap();
    view.header.info.table_offset[1].store(len as u64, Ordering::Relaxed);
    // SAFETY: the region outlives every view.
    assert!(matches!(unsafe { IndexView::attach(p, len) }, Err(ProtocolError::InvalidField { what: "index table offset", .. })));
    view.header.info.slot_count.store(MIN_SLOTS * 4, Ordering::Relaxed);
    // SAFETY: the region outlives every view.
    assert!(matches!(unsafe { IndexView::attach(p, len) }, Err(ProtocolError::RegionTooSmall { .. })));
}

#[test]
fn stuck_writer_is_a_miss_not_a_hang() {
    let mut r = Region::new(MIN_SLOTS);
    // SAFETY: region outlives the view.
    let view = unsafe { IndexView::init(r.ptr(), region_bytes(MIN_SLOTS), MIN_SLOTS) }.unwrap();
    let mut w = IndexWriter::new(view);
    let k = ObjectKey(42);
    w.insert(k, 7).unwrap();
    let i = w.find(k).0.unwrap();
    // A writer stopped between its two seq stores leaves the slot odd forever.
    w.active()[i].seq.fetch_add(1, Ordering::Relaxed);
    assert_eq!(view.lookup(k), None);
    w.active()[i].seq.fetch_add(1, Ordering::Relaxed);
    assert_eq!(view.lookup(k), Some(7));
}

#[test]
fn sizing() {
    assert_eq!(slots_for(64 << 30, 64 << 10), 1 << 21);
    assert_eq!(slots_for(1 << 20, 64 << 10), MIN_SLOTS);
}

#[test]
fn heartbeat_staleness() {
    let mut r = Region::new(MIN_SLOTS);
    // SAFETY: region outlives the view; the test owns it (writable).
    let view = unsafe { IndexView::init(r.ptr(), region_bytes(MIN_SLOTS), MIN_SLOTS) }.unwrap();
    // A writer that never beat (predates the word) is never judged stalled.
    assert!(!view.stalled(u64::MAX, 1));
    // SAFETY: writable test region.
    unsafe { view.beat(1_000_000_000) };
    assert!(!view.stalled(1_000_000_000 + 5_000_000, 10_000_000));
    assert!(!view.stalled(1_000_000_000 + 10_000_000, 10_000_000));
    assert!(view.stalled(1_000_000_000 + 10_000_001, 10_000_000));
    // A clock read before the beat (reader's clock behind) is not a stall.
    assert!(!view.stalled(999_000_000, 10_000_000));
    // The word sits in IndexInfo's cache line, right after the death word.
    assert_eq!(core::mem::offset_of!(IndexInfo, heartbeat_ns), 72);
}
