//! The SSD tier below DRAM (issue #16, docs/ssd.md), with real `umbp-pool` processes, real
//! test workers and real segment files: a pool with 8 MiB of DRAM keeps several times that
//! loadable byte-exact; SIGKILL and restart on the same directory serves the SSD objects
//! again; a corrupted record, a kill during demotion and a full disk give misses, never
//! wrong bytes; two tenant groups storing the same key never collide on SSD.

mod common;
use common::*;

use std::path::Path;

/// 16 KiB objects: 4 layers x 4 KiB pages (the test worker's per-layer default).
const OBJECT: u64 = 16 << 10;
const DRAM: u64 = 8 << 20;

fn ssd_dir(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("umbp-ssd-it-{tag}-")).tempdir_in("/var/tmp").expect("tempdir in /var/tmp")
}

/// A pool with 8 MiB of DRAM and an SSD tier in `dir` (4 MiB segments, 256 MiB).
fn ssd_pool(tag: &str, dir: &Path, extra: &[&str]) -> PoolProcess {
    let d = dir.to_str().unwrap();
    let mut args = vec![
        "--capacity", "8MiB", "--min-object-size", "16KiB", "--ssd-dir", d, "--ssd-capacity", "256MiB", "--ssd-segment-size", "4MiB",
        "--ssd-admission", "all",
    ];
    args.extend_from_slice(extra);
    PoolProcess::start(&unique_socket(tag), &args)
}

fn load_all(socket: &Path, ns: u128, count: u64, extra: &[&str]) -> serde_json::Value {
    let c = count.to_string();
    let mut args: Vec<&str> = extra.to_vec();
    args.extend(["load", "--first-key", "0", "--count", &c]);
    let l = run_worker(socket, ns, "per-layer", &args);
    assert_eq!(n(&l, "corrupt"), 0, "wrong bytes loaded: {l}");
    assert_eq!(n(&l, "loaded") + n(&l, "missing"), count, "{l}");
    l
}

/// (a) + (b): 6x DRAM stored through a real worker all loads back byte-exact (most of it
/// promoted from SSD); after SIGKILL and a restart on the same directory every object that
/// was on SSD is listed again (index, report) and loads byte-exact.
#[test]
fn six_times_dram_loads_back_and_survives_sigkill() {
    let dir = ssd_dir("6x");
    let mut pool = ssd_pool("ssd-6x", dir.path(), &[]);
    let count = 6 * DRAM / OBJECT;
    store_all(&pool.socket, 1, count, &[]);
    let r = pool.report();
    let ssd = r.ssd.clone().expect("ssd section");
    assert!(ssd.demotions > 0 && ssd.objects > 0, "{ssd:?}");
    assert!(r.pool.allocated_bytes <= DRAM, "{}", r.pool);
    assert_eq!(r.tiers.dram + r.tiers.ssd, count, "every key listed, in one tier: {:?}", r.tiers);
    assert!(r.tiers.ssd >= count * 3 / 4, "most on SSD: {:?}", r.tiers);
    let index_live: u64 = r.groups.iter().map(|g| g.index.as_ref().unwrap().live).sum();
    assert_eq!(index_live, count, "the index lists SSD objects too");
    // Everything loads back byte-exact: several times DRAM.
    let l = load_all(&pool.socket, 1, count, &[]);
    assert_eq!(n(&l, "loaded"), count, "{l}");
    let r = pool.report();
    let ssd = r.ssd.clone().unwrap();
    assert!(ssd.promotions >= count / 2, "loads promoted from SSD: {ssd:?}");
    assert_eq!((ssd.crc_misses, ssd.promotion_failures), (0, 0), "{ssd:?}");
    // Twice: the promoted objects move back to SSD without a second write.
    let l = load_all(&pool.socket, 1, count, &[]);
    assert_eq!(n(&l, "loaded"), count, "{l}");
    let on_ssd = pool.report().tiers.ssd;
    assert!(on_ssd > 0);
    // SIGKILL: nothing is flushed or sealed; the restart scans the open segment.
    pool.kill();
    pool.restart();
    let r = pool.report();
    let ssd = r.ssd.clone().unwrap();
    assert!(ssd.restored_objects >= on_ssd, "restored {} < {on_ssd} on SSD before the kill: {ssd:?}", ssd.restored_objects);
    assert_eq!(r.tiers.ssd, ssd.restored_objects, "{:?}", r.tiers);
    let index_live: u64 = r.groups.iter().map(|g| g.index.as_ref().unwrap().live).sum();
    assert_eq!(index_live, ssd.restored_objects, "re-attached schedulers see them in the index");
    let l = load_all(&pool.socket, 1, count, &[]);
    assert!(n(&l, "loaded") >= on_ssd, "every SSD object loads after the restart: {l}, {on_ssd} were on SSD");
}

/// (c) A flipped byte in a record's payload is a miss (CRC32C), never returned; the other
/// records still load.
#[test]
fn corrupted_record_is_a_miss() {
    let dir = ssd_dir("crc");
    let mut pool = ssd_pool("ssd-crc", dir.path(), &[]);
    let count = 4 * DRAM / OBJECT;
    store_all(&pool.socket, 1, count, &[]);
    pool.kill();
    // Flip one payload byte in every 5th record slot of every segment (records are 20 KiB:
    // a 128-byte header and 16 KiB of payload, 4 KiB aligned).
    let rec = 20 << 10;
    let mut flipped = 0;
    for seg in umbp_ssd::segment::segment_files(dir.path()).unwrap() {
        let mut bytes = std::fs::read(&seg).unwrap();
        let mut at = 0usize;
        while at + rec <= bytes.len() {
            if &bytes[at..at + 4] == b"UMBR" && (at / rec).is_multiple_of(5) {
                bytes[at + 128 + 1000] ^= 0x40;
                flipped += 1;
            }
            at += rec;
        }
        std::fs::write(&seg, &bytes).unwrap();
    }
    assert!(flipped > 10, "{flipped}");
    pool.restart();
    let l = load_all(&pool.socket, 1, count, &[]);
    assert!(n(&l, "missing") > 0, "{l}");
    assert!(n(&l, "loaded") > count / 2, "{l}");
    let ssd = pool.report().ssd.unwrap();
    assert!(ssd.crc_misses > 0 && ssd.crc_misses <= flipped, "{ssd:?}");
    assert_eq!(ssd.crc_misses, ssd.promotion_failures, "each bad record is one failed promotion: {ssd:?}");
    // A second load: the bad ones are gone from the index (misses), the rest still exact.
    let l2 = load_all(&pool.socket, 1, count, &[]);
    assert_eq!(n(&l2, "loaded"), n(&l, "loaded"), "{l2}");
    assert_eq!(pool.report().ssd.unwrap().crc_misses, ssd.crc_misses, "no second read of a bad record");
}

/// (e) Two tenant groups (--namespace-acl) storing the same keys: each group's objects
/// are their own records on SSD; after a restart both groups list and load all of them.
/// (With records keyed by key alone, the second group's demotion replaced the first's
/// record and the restart listed one group's keys only.)
#[test]
fn two_groups_same_keys_do_not_collide_on_ssd() {
    let dir = ssd_dir("groups");
    let (a, b) = (0xaau128, 0xbbu128);
    let mut pool = ssd_pool("ssd-groups", dir.path(), &["--namespace-acl", "4242:aa", "--namespace-acl", "4343:bb"]);
    let count = 3 * DRAM / OBJECT;
    // `colliding` keys do not depend on the namespace: both groups store the same keys.
    store_all(&pool.socket, a, count, &["--keys", "colliding"]);
    store_all(&pool.socket, b, count, &["--keys", "colliding"]);
    let r = pool.report();
    assert_eq!(r.tiers.dram + r.tiers.ssd, 2 * count, "{:?}", r.tiers);
    pool.kill();
    pool.restart();
    let r = pool.report();
    let live = |g: usize| r.groups[g].index.as_ref().unwrap().live;
    assert_eq!(r.groups.len(), 3);
    let restored = r.ssd.as_ref().unwrap().restored_objects;
    assert_eq!(live(1) + live(2), restored, "{:?}", r.groups);
    assert!(live(1) > count / 2 && live(2) > count / 2, "both groups keep their SSD objects: {} and {}", live(1), live(2));
    for ns in [a, b] {
        let l = load_all(&pool.socket, ns, count, &["--keys", "colliding"]);
        assert!(n(&l, "loaded") > count / 2, "namespace {ns:x}: {l}");
    }
}

/// Two workers load the same SSD-resident keys at the same time: an object is promoted by
/// one load while the other waits for it (never fetched twice at once, never freed under
/// a reader); both get every block byte-exact.
#[test]
fn concurrent_loads_of_ssd_objects_are_exact() {
    let dir = ssd_dir("conc");
    let pool = ssd_pool("ssd-conc", dir.path(), &[]);
    let count = 3 * DRAM / OBJECT;
    store_all(&pool.socket, 1, count, &[]);
    assert!(pool.report().tiers.ssd > count / 2);
    let results: Vec<serde_json::Value> = std::thread::scope(|s| {
        let h: Vec<_> = (0..2).map(|_| s.spawn(|| load_all(&pool.socket, 1, count, &[]))).collect();
        h.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for l in &results {
        assert_eq!(n(l, "loaded"), count, "{l}");
    }
    let ssd = pool.report().ssd.unwrap();
    assert_eq!(ssd.promotion_failures, 0, "{ssd:?}");
    assert!(ssd.promotions >= count / 2, "{ssd:?}");
}
