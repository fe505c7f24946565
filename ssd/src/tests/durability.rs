//! Issue #34, S5: `flush` (and a clean close) makes what was stored survive power loss:
//! every segment written since its last sync is fdatasynced (those sealed earlier by a
//! rollover too, not only the active one) and every directory fsynced (segment names
//! created or removed). A power loss cannot be made here; the syncs the store issues are
//! counted (`SsdStats::segment_syncs`, `dir_syncs`) and checked against the segments
//! written.

use super::*;

#[test]
fn flush_syncs_every_segment_written_since_its_last_sync_and_each_directory() {
    let (a, b) = (tempdir(), tempdir());
    let c = cfg(&[a.path(), b.path()], 64 << 20, 256 << 10);
    let store = open_store(&c);
    put_all(&store, 0..40);
    let st = store.stats();
    assert!(st.segments >= 4, "rollovers sealed segments before the flush: {st:?}");
    assert_eq!((st.segment_syncs, st.dir_syncs), (0, 0), "put does not sync: {st:?}");
    store.flush().unwrap();
    let st = store.stats();
    assert_eq!(st.segment_syncs, st.segments, "every segment written, those sealed by a rollover too: {st:?}");
    assert_eq!(st.dir_syncs, 2, "each directory once: {st:?}");
    // Nothing written since: no segment to sync; the directories again (cheap).
    store.flush().unwrap();
    let st2 = store.stats();
    assert_eq!((st2.segment_syncs, st2.dir_syncs), (st.segment_syncs, 4), "{st2:?}");
    // One more object: only the segment it went to.
    store.put(key(1000), 7, 65536, &payload(1000, 5000)).unwrap();
    store.flush().unwrap();
    let st3 = store.stats();
    assert_eq!(st3.segment_syncs, st.segment_syncs + 1, "{st3:?}");
    drop(store);
    // After a restart every segment found is synced once by the first flush (the process
    // before may have died without one), and everything stored is there.
    let store = open_store(&c);
    check_all(&store, 0..40);
    let n = store.stats().segments;
    store.flush().unwrap();
    let st = store.stats();
    assert_eq!((st.segment_syncs, st.dir_syncs), (n, 2), "{st:?}");
}
