//! A clean stop keeps the cache warm (issue #16, docs/ssd.md "Clean stop"): on SIGTERM the
//! `umbp-pool` daemon writes the DRAM objects its admission policy admits to SSD before it
//! exits (`--ssd-flush-on-stop`), so a restart on the same directory lists and loads them
//! byte-exact; with `--ssd-flush-on-stop 0` the DRAM-only objects are gone after the
//! restart (the control: what the flush adds). Real processes, real segment files.

mod common;
use common::*;

use std::time::Duration;

/// 16 KiB objects: 4 layers x 4 KiB pages (the test worker's per-layer default).
const OBJECT: u64 = 16 << 10;
const DRAM: u64 = 8 << 20;

/// Stores 2x DRAM (part goes to SSD by eviction, the newest part is in DRAM only), stops
/// the pool with SIGTERM, restarts it on the same directory; returns (objects in DRAM only
/// before the stop, report after the restart, the restarted pool).
fn store_stop_restart(tag: &str, flush: &str) -> (u64, umbp_pool::PoolReport, PoolProcess, tempfile::TempDir) {
    let dir = tempfile::Builder::new().prefix(&format!("umbp-ssd-it-{tag}-")).tempdir_in("/var/tmp").expect("tempdir in /var/tmp");
    let d = dir.path().to_str().unwrap().to_string();
    // The default admission (hit-or-young): every object here is young, so admitted.
    let args = [
        "--capacity", "8MiB", "--min-object-size", "16KiB", "--ssd-dir", &d, "--ssd-capacity", "256MiB", "--ssd-segment-size", "4MiB",
        "--ssd-flush-on-stop", flush,
    ];
    let mut pool = PoolProcess::start(&unique_socket(tag), &args);
    let count = 2 * DRAM / OBJECT;
    store_all(&pool.socket, 1, count, &[]);
    // Let the evictor settle, then count what is in DRAM only.
    std::thread::sleep(Duration::from_millis(300));
    let r = pool.report();
    assert_eq!(r.tiers.dram + r.tiers.ssd, count, "{:?}", r.tiers);
    let dram_only = r.tiers.dram;
    assert!(dram_only > 0 && r.tiers.ssd > 0, "some objects in DRAM only, some on SSD: {:?}", r.tiers);
    pool.signal(libc::SIGTERM);
    let status = pool.child.wait().expect("pool exits");
    assert!(status.success(), "a clean stop exits 0: {status:?}");
    pool.restart();
    let r = pool.report();
    (dram_only, r, pool, dir)
}

#[test]
fn sigterm_writes_dram_objects_to_ssd_and_a_restart_loads_them() {
    let count = 2 * DRAM / OBJECT;
    let (dram_only, r, pool, _dir) = store_stop_restart("ssd-stop", "20");
    let ssd = r.ssd.clone().unwrap();
    assert_eq!(ssd.restored_objects, count, "every object, DRAM-only ones included ({dram_only}), is on SSD after the stop: {ssd:?}");
    assert_eq!(r.tiers.ssd, count, "{:?}", r.tiers);
    // No record scan needed: the stop sealed the segments (footers).
    assert_eq!(ssd.torn_records_skipped, 0, "{ssd:?}");
    let l = run_worker(&pool.socket, 1, "per-layer", &["load", "--first-key", "0", "--count", &count.to_string()]);
    assert_eq!((n(&l, "loaded"), n(&l, "corrupt"), n(&l, "missing")), (count, 0, 0), "all byte-exact from SSD: {l}");
    let ssd = pool.report().ssd.unwrap();
    assert!(ssd.promotions >= dram_only, "{ssd:?}");
    assert_eq!((ssd.crc_misses, ssd.promotion_failures), (0, 0), "{ssd:?}");
}

#[test]
fn without_the_flush_dram_only_objects_are_lost() {
    let count = 2 * DRAM / OBJECT;
    let (dram_only, r, pool, _dir) = store_stop_restart("ssd-stop0", "0");
    let ssd = r.ssd.clone().unwrap();
    assert_eq!(ssd.restored_objects, count - dram_only, "only what eviction wrote: {ssd:?}");
    let l = run_worker(&pool.socket, 1, "per-layer", &["load", "--first-key", "0", "--count", &count.to_string()]);
    assert_eq!((n(&l, "missing"), n(&l, "corrupt")), (dram_only, 0), "{l}");
}

/// A limit too short for the flush: the pool still exits cleanly at once, what was written
/// is served, the rest is missing (never wrong bytes).
#[test]
fn a_limit_too_short_cuts_the_flush_and_the_pool_still_exits_cleanly() {
    let count = 2 * DRAM / OBJECT;
    let (dram_only, r, pool, _dir) = store_stop_restart("ssd-stop-short", "0.000001");
    let ssd = r.ssd.clone().unwrap();
    assert!(ssd.restored_objects >= count - dram_only && ssd.restored_objects < count, "{dram_only} DRAM-only, {ssd:?}");
    let l = run_worker(&pool.socket, 1, "per-layer", &["load", "--first-key", "0", "--count", &count.to_string()]);
    assert_eq!(n(&l, "corrupt"), 0, "{l}");
    assert_eq!(n(&l, "loaded"), ssd.restored_objects, "{l}");
}
