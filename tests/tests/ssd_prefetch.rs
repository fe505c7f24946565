//! Touch hints prefetch SSD objects (issue #16, docs/ssd.md "Prefetch on touch hints"): a
//! scheduler's hint for objects that are on SSD only promotes them into DRAM before any
//! load asks (the `umbp-pool` daemon, a real scheduler client, real segment files); the
//! load that follows finds them in DRAM, byte-exact, without reading the SSD again.

mod common;
use common::*;

use std::time::Duration;

const OBJECT: u64 = 16 << 10;
const DRAM: u64 = 8 << 20;

#[test]
fn touch_hints_promote_ssd_objects_before_the_load() {
    let dir = tempfile::Builder::new().prefix("umbp-ssd-it-prefetch-").tempdir_in("/var/tmp").expect("tempdir in /var/tmp");
    let d = dir.path().to_str().unwrap();
    let pool = PoolProcess::start(
        &unique_socket("ssd-prefetch"),
        &[
            "--capacity", "8MiB", "--min-object-size", "16KiB", "--ssd-dir", d, "--ssd-capacity", "256MiB", "--ssd-segment-size", "4MiB",
            "--ssd-admission", "all",
        ],
    );
    // 2x DRAM: the first keys stored end up on SSD only.
    let count = 2 * DRAM / OBJECT;
    store_all(&pool.socket, 1, count, &[]);
    std::thread::sleep(Duration::from_millis(300));
    let before = pool.report();
    assert!(before.tiers.ssd >= count / 4, "{:?}", before.tiers);
    assert_eq!(before.ssd.as_ref().unwrap().promotions, 0, "nothing loaded yet");

    // A scheduler looks up the first 32 keys (on SSD: listed in the index) and touches them.
    let hinted = 32u64;
    let keys: Vec<umbp_protocol::ObjectKey> =
        (0..hinted as u128).map(|i| umbp_protocol::ObjectKey::derive(1, 0, 0, &i.to_le_bytes())).collect();
    let mut idx = umbp_scheduler::IndexClient::connect(&pool.socket, 1, Duration::from_secs(5)).unwrap();
    assert_eq!(idx.match_prefix(&keys), hinted as usize, "SSD objects are hits for a lookup");
    idx.touch(&keys);
    let prefetched = eventually(Duration::from_secs(5), || pool.report().ssd.unwrap().promotions >= hinted / 2);
    let after = pool.report();
    assert!(prefetched, "the hint promoted SSD objects without a load: {:?} {:?}", after.ssd, after.tiers);
    let promoted = after.ssd.as_ref().unwrap().promotions;
    assert!(after.tiers.dram > before.tiers.dram, "{:?} -> {:?}", before.tiers, after.tiers);

    // The load that follows finds them in DRAM: byte-exact, no second read of those.
    let l = run_worker(&pool.socket, 1, "per-layer", &["load", "--first-key", "0", "--count", &hinted.to_string()]);
    assert_eq!((n(&l, "loaded"), n(&l, "corrupt")), (hinted, 0), "{l}");
    let ssd = pool.report().ssd.unwrap();
    assert!(ssd.promotions <= hinted, "each object read from SSD once: {promoted} prefetched, {ssd:?}");
    assert_eq!((ssd.crc_misses, ssd.promotion_failures), (0, 0), "{ssd:?}");
}
