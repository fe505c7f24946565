//! Loom models of the KV event log (protocol/src/events.rs): one writer, a reader that
//! follows it concurrently with its own cursor.
//!
//! Run with
//! `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p umbp-protocol --release --test loom_events`.
//!
//! Invariants: every event a reader returns is exactly what the writer wrote under that
//! number (kind and key are functions of the number, so a torn or stale copy breaks it);
//! numbers come out strictly increasing; returned + lost == how far the cursor moved, so
//! nothing vanishes silently; with room for every event nothing is lost.
//!
//! As in `loom_index.rs`, the writer runs on the model's main thread and the reader is
//! spawned (loom's DPOR otherwise hides the races), and every model asserts that it
//! explored more than a handful of executions.
#![cfg(loom)]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering as StdOrdering};

use common::loom_model::check;
use loom::sync::atomic::{fence, Ordering};
use loom::sync::Arc;
use loom::thread;
use umbp_protocol::events::{EntryRead, Event, EventKind, EventLogReader, EventLogWriter, LoomEventStorage};
use umbp_protocol::ObjectKey;

fn key(n: u64) -> ObjectKey {
    ObjectKey::from_words([n.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1, !n])
}

fn kind(n: u64) -> EventKind {
    if n.is_multiple_of(2) {
        EventKind::Stored
    } else {
        EventKind::Removed
    }
}

/// Executions in which a reader lost events (shows the overrun path was explored).
static OVERRUNS: AtomicUsize = AtomicUsize::new(0);

fn assert_exact(events: &[Event]) {
    for w in events.windows(2) {
        assert!(w[0].seq < w[1].seq, "out of order: {events:?}");
    }
    for e in events {
        assert_eq!(e.key, key(e.seq), "torn or stale event {e:?}");
        assert_eq!(e.kind, kind(e.seq), "torn or stale event {e:?}");
    }
}

/// Writes `total` events into a log of `capacity` while a reader polls twice; then the
/// main thread finishes reading from the reader's cursor.
fn follow_model(capacity: u32, total: u64, bound: usize) -> usize {
    check(bound, move || {
        let st = Arc::new(LoomEventStorage::new(capacity));
        let st2 = st.clone();
        let reader = thread::spawn(move || {
            let mut r = EventLogReader::from_oldest(st2.log());
            let start = r.cursor();
            let mut out = Vec::new();
            let mut lost = 0;
            for _ in 0..2 {
                lost += r.poll(&mut out, 8).lost;
            }
            assert_exact(&out);
            assert_eq!(out.len() as u64 + lost, r.cursor() - start, "events vanished");
            (out.len() as u64, lost, start, r.cursor())
        });
        let mut w = EventLogWriter::new(st.log());
        for n in 0..total {
            w.push(kind(n), key(n));
        }
        let (read, lost, start, cursor) = reader.join().unwrap();
        // Everything after the reader's cursor is still there or reported lost.
        let mut r = EventLogReader::at(st.log(), cursor);
        let mut out = Vec::new();
        let res = r.poll(&mut out, 64);
        assert_exact(&out);
        assert_eq!(start + read + lost + res.read as u64 + res.lost, total, "events unaccounted for");
        if lost + res.lost > 0 {
            OVERRUNS.fetch_add(1, StdOrdering::Relaxed);
        }
        if total <= capacity as u64 {
            assert_eq!(lost + res.lost, 0, "nothing may be lost while the log has room");
        }
    })
}

#[test]
fn reader_follows_without_overrun() {
    let runs = follow_model(4, 3, 2);
    assert!(runs > 50, "loom explored only {runs} executions");
}

#[test]
fn reader_detects_overrun() {
    let runs = follow_model(2, 3, 2);
    assert!(runs > 50, "loom explored only {runs} executions");
    assert!(OVERRUNS.load(StdOrdering::Relaxed) > 0, "no execution overran the reader");
}

/// Event 0 sits in entry 0 of a 2-entry log; the writer overwrites that entry with event 2
/// while a reader reads event 0. With `release_fence = false` the writer skips the fence
/// after its odd stamp (the broken seqlock).
fn overwrite_model(release_fence: bool) -> usize {
    check(3, move || {
        let st = Arc::new(LoomEventStorage::new(2));
        let mut w = EventLogWriter::new(st.log());
        w.push(kind(0), key(0));
        w.push(kind(1), key(1));
        let st2 = st.clone();
        let reader = thread::spawn(move || {
            if let EntryRead::Event(e) = st2.log().read_event(0) {
                assert_eq!(e.key, key(e.seq), "torn copy accepted");
            }
        });
        if release_fence {
            w.push(kind(2), key(2));
        } else {
            let e = &st.log().entries()[0];
            e.stamp.store(2 * 2 + 1, Ordering::Relaxed);
            let [lo, hi] = key(2).to_words();
            e.kind.store(kind(2) as u32, Ordering::Relaxed);
            e.key[0].store(lo, Ordering::Relaxed);
            e.key[1].store(hi, Ordering::Relaxed);
            e.stamp.store(2 * 2 + 2, Ordering::Release);
            fence(Ordering::SeqCst);
        }
        reader.join().unwrap();
    })
}

#[test]
fn overwrite_is_never_a_torn_event() {
    let runs = overwrite_model(true);
    assert!(runs > 20, "loom explored only {runs} executions");
}

/// Without the Release fence a reader can copy the new key, still see the old stamp and
/// accept a torn event; loom must find it (this is why `EventLogWriter::push` has it).
#[test]
#[should_panic(expected = "torn")]
fn harness_detects_torn_event_without_release_fence() {
    overwrite_model(false);
}
