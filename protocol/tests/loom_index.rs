//! Loom models of the seqlocked shared index (docs/protocol.md §2 "Shared index").
//!
//! Run with
//! `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p umbp-protocol --release --test loom_ring --test loom_index`.
//!
//! Invariant checked everywhere: a reader's answer for key `k` is either a miss or
//! `checksum(k)`, the only location the writer ever stores with `k`. A torn copy of a slot
//! (state of one write with key or location of another, e.g. a tombstone's location 0 under
//! a FULL state) breaks it.
//!
//! The writer runs on the model's main thread and the reader is spawned. The other way
//! round, loom explores a single interleaving: its DPOR only compares an access with the
//! *last* access to the same object, and the writer loads each `seq` right before storing
//! it, which hides the reader's earlier load of it. Every model therefore also asserts
//! that it explored more than a handful of executions.
#![cfg(loom)]

mod common;

use common::checksum;
use common::loom_model::check;
use loom::sync::atomic::Ordering;
use loom::sync::Arc;
use loom::thread;
use umbp_protocol::index::{home_slot, IndexSlot, IndexView, IndexWriter, Insert, LoomIndexStorage, SLOT_FULL};
use umbp_protocol::ObjectKey;

/// Two keys with the same home slot (slot 1 of a 4-slot table, hence also of a 2-slot
/// one), found by searching with the index's own home function: inserting the second one
/// reuses the first one's tombstone, so the same slot is rewritten with a different key and
/// location. The home function hashes the key words (a mix keyed with the region's seed,
/// 0 in the loom storage), so fixed keys
/// would silently stop sharing a slot when it changes; searching keeps the models honest,
/// and `same_home_keys` asserts what it found.
fn same_home_keys() -> (ObjectKey, ObjectKey) {
    let wanted = 1;
    let mut found = (1u128..).map(|i| ObjectKey(i | (i << 64))).filter(|k| home_slot(*k, 3, [0, 0]) == wanted);
    let (k1, k2) = (found.next().unwrap(), found.next().unwrap());
    assert_ne!(k1, k2);
    assert_eq!((home_slot(k1, 3, [0, 0]), home_slot(k2, 3, [0, 0])), (wanted, wanted));
    assert_eq!((home_slot(k1, 1, [0, 0]), home_slot(k2, 1, [0, 0])), (wanted & 1, wanted & 1));
    (k1, k2)
}

fn k1() -> ObjectKey {
    same_home_keys().0
}

fn k2() -> ObjectKey {
    same_home_keys().1
}

fn consistent(k: ObjectKey, found: Option<u64>) {
    if let Some(loc) = found {
        assert_eq!(loc, checksum(k), "torn or stale slot copy for {k:?}");
    }
}

/// What the index holds when the race starts.
#[derive(Clone, Copy)]
enum Start {
    /// K1 is stored.
    K1Live,
    /// K1 was stored and removed: its slot is a tombstone.
    K1Removed,
}

/// One model of the index: `slot_count` slots prepared as `start`, then `read` runs on a
/// spawned reader while `write` changes the index on the model's main thread (see the
/// module comment for why that way round); `after` checks the index once both are done.
fn reader_races_writer(
    slot_count: u64,
    start: Start,
    read: fn(&IndexView<'_>),
    write: fn(&mut IndexWriter<'_>),
    after: fn(&IndexView<'_>),
) -> usize {
    check(2, move || {
        let st = Arc::new(LoomIndexStorage::new(slot_count));
        let mut w = IndexWriter::new(st.view());
        w.insert(k1(), checksum(k1())).unwrap();
        if let Start::K1Removed = start {
            w.remove(k1());
        }
        let st2 = st.clone();
        let reader = thread::spawn(move || read(&st2.view()));
        write(&mut w);
        reader.join().unwrap();
        after(&st.view());
    })
}

/// K1's home slot holds its tombstone; the writer inserts k2() into it (one seqlocked rewrite of
/// state, key and location) while a reader looks up both keys.
#[test]
fn seqlock_reader_never_sees_torn_slot() {
    let runs = reader_races_writer(
        4,
        Start::K1Removed,
        |view| {
            consistent(k1(), view.lookup(k1()));
            consistent(k2(), view.lookup(k2()));
        },
        |w| {
            assert_eq!(w.view().snapshot().tombstones, 1);
            assert_eq!(w.insert(k2(), checksum(k2())), Ok(Insert::Inserted));
        },
        |view| {
            // K2 went into K1's tombstone (a reuse of that slot), not into a free slot.
            assert_eq!(view.snapshot().tombstones, 0, "K2 did not reuse K1's slot");
            assert_eq!(view.lookup(k1()), None);
            assert_eq!(view.lookup(k2()), Some(checksum(k2())));
        },
    );
    assert!(runs > 100, "loom explored only {runs} executions");
}

/// FULL -> TOMBSTONE: the writer removes K1 while a reader runs `match_prefix`. The reader
/// may count it or not, but never count a slot it did not copy consistently.
#[test]
fn seqlock_match_prefix_during_remove() {
    let runs = reader_races_writer(
        4,
        Start::K1Live,
        |view| {
            let n = view.match_prefix(&[k1()]);
            assert!(n <= 1);
        },
        |w| assert_eq!(w.remove(k1()), Some(checksum(k1()))),
        |view| assert_eq!(view.match_prefix(&[k1()]), 0),
    );
    assert!(runs > 20, "loom explored only {runs} executions");
}

/// Epoch flip: the writer rebuilds twice (into table 1, then back into table 0, which it
/// first clears) while a reader looks up a key that stays live throughout. The reader
/// must never see a wrong location and, as two flips are fewer than its epoch retries,
/// must find the key.
#[test]
fn rebuild_epoch_flip_keeps_live_key_visible() {
    let runs = reader_races_writer(
        2,
        Start::K1Live,
        |view| assert_eq!(view.lookup(k1()), Some(checksum(k1()))),
        |w| {
            w.rebuild();
            w.rebuild();
        },
        |view| {
            assert_eq!(view.snapshot().epoch, 2);
            assert_eq!(view.lookup(k1()), Some(checksum(k1())));
        },
    );
    assert!(runs > 100, "loom explored only {runs} executions");
}

/// Epoch flip racing with a removal and an insert into the new table: remove K1 (the
/// slot becomes a tombstone), rebuild (the tombstone is not copied), insert k2() (into the
/// new table, at the slot K1 had in the old one).
#[test]
fn rebuild_with_remove_and_insert_no_wrong_hit() {
    let runs = reader_races_writer(
        2,
        Start::K1Removed,
        |view| consistent(k2(), view.lookup(k2())),
        |w| {
            w.rebuild();
            w.insert(k2(), checksum(k2())).unwrap();
        },
        |view| assert_eq!(view.lookup(k2()), Some(checksum(k2()))),
    );
    assert!(runs > 100, "loom explored only {runs} executions");
}

fn new_slot() -> IndexSlot {
    use loom::sync::atomic::{AtomicU32, AtomicU64};
    IndexSlot {
        seq: AtomicU32::new(0),
        state: AtomicU32::new(SLOT_FULL),
        key: [AtomicU64::new(1), AtomicU64::new(1)],
        location: AtomicU64::new(checksum(ObjectKey::from_words([1, 1]))),
    }
}

/// A reader copies a bare slot with the crate's `IndexView::read_slot` while `write`
/// rewrites it on the model's main thread; a torn copy panics ("torn").
fn bare_slot_model(bound: usize, write: fn(&IndexSlot)) -> usize {
    check(bound, move || {
        let slot = std::sync::Arc::new(new_slot());
        let s2 = slot.clone();
        let reader = thread::spawn(move || {
            if let Some(c) = IndexView::read_slot(&s2) {
                assert_eq!(c.location, checksum(c.key), "torn copy");
            }
        });
        write(&slot);
        reader.join().unwrap();
    })
}

/// Sanity check of the harness: a writer that rewrites a slot without the odd `seq` (no
/// seqlock at all) must be caught tearing `IndexView::read_slot`'s copy. Without this,
/// a model that explores too little would pass silently.
#[test]
#[should_panic(expected = "torn")]
fn harness_detects_torn_read_without_seqlock() {
    bare_slot_model(2, |slot| {
        // Broken writer: data words rewritten in place, seq never made odd.
        slot.key[0].store(2, Ordering::Relaxed);
        slot.key[1].store(2, Ordering::Relaxed);
        slot.location.store(checksum(ObjectKey::from_words([2, 2])), Ordering::Relaxed);
        slot.seq.store(2, Ordering::Release);
    });
}

/// The writer protocol of `IndexWriter` (seq odd, Release fence, data, seq even with
/// Release), spelled out over a bare slot so it can be broken on purpose below.
fn seqlock_write(slot: &IndexSlot, key: [u64; 2], release_fence: bool) {
    let s = slot.seq.load(Ordering::Relaxed);
    slot.seq.store(s.wrapping_add(1), Ordering::Relaxed);
    if release_fence {
        loom::sync::atomic::fence(Ordering::Release);
    }
    slot.key[0].store(key[0], Ordering::Relaxed);
    slot.key[1].store(key[1], Ordering::Relaxed);
    slot.location.store(checksum(ObjectKey::from_words(key)), Ordering::Relaxed);
    slot.seq.store(s.wrapping_add(2), Ordering::Release);
}

/// Positive control for the next test: the real protocol over a bare slot, against the
/// crate's `read_slot`, with a higher preemption bound than the models above.
#[test]
fn bare_slot_seqlock_is_consistent() {
    let runs = bare_slot_model(3, |slot| seqlock_write(slot, [2, 2], true));
    assert!(runs > 100, "loom explored only {runs} executions");
}

/// Without the Release fence after the odd `seq` store, a reader can copy new data words,
/// still see the old even `seq` and accept a torn copy. Loom must find it: this is why
/// `IndexWriter::write_slot` has that fence.
#[test]
#[should_panic(expected = "torn")]
fn harness_detects_torn_read_without_release_fence() {
    bare_slot_model(3, |slot| seqlock_write(slot, [2, 2], false));
}
