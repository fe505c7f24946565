//! Property tests of the shared index against a `HashMap` model: random inserts, removes,
//! lookups, prefix matches, rebuilds and clears over the smallest table (1024 slots, 768
//! live entries at most) so that tombstones pile up and force rebuilds, with keys drawn
//! from a small universe that clusters on a few home slots (long probe chains through
//! tombstones) mixed with well-spread keys.
#![cfg(not(loom))]

mod common;

use std::collections::HashMap;

use common::{checksum, Region};
use proptest::prelude::*;
use umbp_protocol::index::{region_bytes, IndexFull, IndexView, IndexWriter, Insert, MIN_SLOTS};
use umbp_protocol::ObjectKey;

const UNIVERSE: u32 = 1200;
/// Most live entries a table of MIN_SLOTS accepts (load factor 3/4).
const MAX_LIVE: usize = (MIN_SLOTS as usize * 3) / 4;

/// Key number `i` of the universe. Even numbers cluster on 8 home slots (home = (lo ^ hi)
/// & mask); odd numbers are spread by xxh3.
fn key(i: u32) -> ObjectKey {
    if i.is_multiple_of(2) {
        let lo = (i as u64) << 20 | (i as u64 % 8);
        ObjectKey::from_words([lo, (i as u64) << 20])
    } else {
        ObjectKey(xxhash_rust_free_hash(i))
    }
}

/// A well-mixed 128-bit value (splitmix64 twice), so the test needs no hash crate.
fn xxhash_rust_free_hash(i: u32) -> u128 {
    let mix = |mut z: u64| {
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let a = mix(i as u64 + 0x9E37_79B9_7F4A_7C15);
    let b = mix(a);
    (a as u128) | (b as u128) << 64
}

#[derive(Debug, Clone)]
enum Op {
    /// Insert key `k` with location `checksum(k) ^ salt` (a later insert of the same key
    /// with another salt must report the first location: first writer wins).
    Insert(u32, u64),
    Remove(u32),
    Lookup(u32),
    /// `match_prefix` over these keys.
    Prefix(Vec<u32>),
    Rebuild,
    Clear,
    /// Insert many fresh keys, then remove them: churn that leaves tombstones.
    Churn(u32, u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        400 => (0..UNIVERSE, any::<u64>()).prop_map(|(k, s)| Op::Insert(k, s)),
        250 => (0..UNIVERSE).prop_map(Op::Remove),
        100 => (0..UNIVERSE).prop_map(Op::Lookup),
        50 => proptest::collection::vec(0..UNIVERSE, 0..12).prop_map(Op::Prefix),
        10 => Just(Op::Rebuild),
        20 => (0..UNIVERSE, 1u32..300).prop_map(|(k, n)| Op::Churn(k, n)),
        // Clear empties everything: rare, so that tables fill up between clears.
        1 => Just(Op::Clear),
    ]
}

struct Harness {
    _mem: Region,
    writer: IndexWriter<'static>,
    reader: IndexView<'static>,
    model: HashMap<ObjectKey, u64>,
}

impl Harness {
    fn new() -> Self {
        let len = region_bytes(MIN_SLOTS);
        let mem = Region::new(len);
        // SAFETY: `mem` lives in the harness, beside both views, and is never moved out
        // (the heap allocation does not move when the harness does). The 'static lifetime
        // is a lie confined to this struct: the views are dropped with it.
        let view: IndexView<'static> = unsafe { IndexView::init(mem.ptr(), len, MIN_SLOTS) }.unwrap();
        // SAFETY: as above; a second view of the same region, as a reader process has.
        let reader: IndexView<'static> = unsafe { IndexView::attach(mem.ptr(), len) }.unwrap();
        Self { _mem: mem, writer: IndexWriter::new(view), reader, model: HashMap::new() }
    }

    fn insert(&mut self, k: ObjectKey, loc: u64) -> Result<(), TestCaseError> {
        let got = self.writer.insert(k, loc);
        match self.model.get(&k) {
            Some(&old) => prop_assert_eq!(got, Ok(Insert::Exists(old))),
            None if self.model.len() >= MAX_LIVE => {
                prop_assert_eq!(got, Err(IndexFull { live: MAX_LIVE as u64, slots: MIN_SLOTS }.into()))
            }
            None => {
                prop_assert_eq!(got, Ok(Insert::Inserted));
                self.model.insert(k, loc);
            }
        }
        Ok(())
    }

    fn remove(&mut self, k: ObjectKey) -> Result<(), TestCaseError> {
        prop_assert_eq!(self.writer.remove(k), self.model.remove(&k));
        Ok(())
    }

    fn check_invariants(&self) -> Result<(), TestCaseError> {
        prop_assert_eq!(self.writer.len(), self.model.len() as u64);
        let snap = self.reader.snapshot();
        prop_assert_eq!(snap.live, self.model.len() as u64);
        prop_assert_eq!(snap.slot_count, MIN_SLOTS);
        // Tombstones never stay above the rebuild threshold after an insert decides.
        prop_assert!(snap.live + snap.tombstones <= MIN_SLOTS);
        Ok(())
    }

    fn check_all(&self) -> Result<(), TestCaseError> {
        for (k, &loc) in &self.model {
            prop_assert_eq!(self.reader.lookup(*k), Some(loc));
            prop_assert_eq!(self.writer.get(*k), Some(loc));
        }
        let mut entries: Vec<_> = self.writer.entries().collect();
        entries.sort();
        let mut want: Vec<_> = self.model.iter().map(|(k, v)| (*k, *v)).collect();
        want.sort();
        prop_assert_eq!(entries, want);
        let hist = self.reader.probe_histogram(16);
        prop_assert_eq!(hist.iter().sum::<u64>(), self.model.len() as u64);
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn index_matches_hashmap_model(ops in proptest::collection::vec(op(), 1..1500)) {
        let mut h = Harness::new();
        let mut explicit_rebuilds = 0;
        for op in ops {
            match op {
                Op::Insert(i, salt) => {
                    let k = key(i);
                    h.insert(k, checksum(k) ^ salt)?;
                }
                Op::Remove(i) => h.remove(key(i))?,
                Op::Lookup(i) => {
                    let k = key(i);
                    prop_assert_eq!(h.reader.lookup(k), h.model.get(&k).copied());
                }
                Op::Prefix(is) => {
                    let keys: Vec<_> = is.iter().map(|&i| key(i)).collect();
                    let want = keys.iter().take_while(|k| h.model.contains_key(k)).count();
                    prop_assert_eq!(h.reader.match_prefix(&keys), want);
                }
                Op::Rebuild => {
                    explicit_rebuilds += 1;
                    let epoch = h.reader.snapshot().epoch;
                    h.writer.rebuild();
                    let snap = h.reader.snapshot();
                    prop_assert_eq!(snap.epoch, epoch + 1);
                    prop_assert_eq!(snap.tombstones, 0);
                    h.check_all()?;
                }
                Op::Clear => {
                    explicit_rebuilds += 1;
                    h.writer.clear();
                    h.model.clear();
                    prop_assert_eq!(h.reader.snapshot().tombstones, 0);
                    h.check_all()?;
                }
                Op::Churn(base, n) => {
                    // Keys outside the universe, so they never collide with model keys.
                    for j in 0..n {
                        let k = key(UNIVERSE + base * 1000 + j);
                        if h.model.len() < MAX_LIVE {
                            h.insert(k, checksum(k))?;
                            h.remove(k)?;
                        }
                    }
                }
            }
            h.check_invariants()?;
        }
        h.check_all()?;
        if h.reader.snapshot().rebuilds > explicit_rebuilds {
            AUTO_REBUILT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        if std::env::var_os("UMBP_PROP_STATS").is_some() {
            eprintln!("cases with insert-triggered rebuilds so far: {}", AUTO_REBUILT.load(std::sync::atomic::Ordering::Relaxed));
        }
    }

    /// Churn (insert then remove fresh keys) keeps tombstones bounded by rebuilding, and
    /// every live key stays visible through the rebuilds.
    #[test]
    fn churn_forces_rebuilds(live in 0u32..700, churn in 300u32..3000) {
        let mut h = Harness::new();
        for i in 0..live {
            let k = key(i);
            h.insert(k, checksum(k))?;
        }
        for j in 0..churn {
            let k = key(UNIVERSE + j);
            h.insert(k, checksum(k))?;
            h.remove(k)?;
            h.check_invariants()?;
        }
        let snap = h.reader.snapshot();
        // Inserts reuse tombstones on their probe path, and rebuild first once tombstones
        // pass a quarter of the slots; a remove adds at most one after that check.
        prop_assert!(snap.tombstones <= MIN_SLOTS / 4 + 1, "{:?}", snap);
        h.check_all()?;
    }
}

/// Cases of `index_matches_hashmap_model` in which an insert (not an explicit Rebuild or
/// Clear op) triggered a rebuild; printed with UMBP_PROP_STATS=1 to check the generator.
static AUTO_REBUILT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Deterministic companion of `churn_forces_rebuilds`: enough churn always rebuilds, and
/// a rebuild drops every tombstone while keeping every live key.
#[test]
fn enough_churn_always_rebuilds() {
    let mut h = Harness::new();
    for i in 0..500 {
        let k = key(i);
        h.insert(k, checksum(k)).unwrap();
    }
    let mut j = 0;
    while h.reader.snapshot().rebuilds == 0 {
        let k = key(UNIVERSE + j);
        h.insert(k, checksum(k)).unwrap();
        h.remove(k).unwrap();
        j += 1;
        assert!(j < 20_000, "no rebuild after {j} insert/remove pairs: {:?}", h.reader.snapshot());
    }
    h.check_all().unwrap();
    assert!(h.reader.snapshot().tombstones <= 1);
}
