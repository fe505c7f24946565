//! SSD store tests on real files (the root file system here is ext4, which supports
//! O_DIRECT; each test says "skipped" for a part it cannot observe). Crash and disk-full
//! tests run in a child process (this test binary re-run on an ignored helper test).

use std::path::Path;

use umbp_protocol::ObjectKey;

use super::format::{self, HEADER_BYTES};
use super::{segment, SsdConfig, SsdError, SsdStore};

mod durability;
mod faults;
mod forgery;
mod salt;

fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("umbp-ssd-test").tempdir_in("/var/tmp").expect("tempdir in /var/tmp")
}

/// Opens a store on `c`; a directory still locked is tried again for a while. Tests open
/// a directory again right after dropping its store, and another test thread may fork a
/// child (the crash and disk-full tests do) that holds a copy of every fd of this process,
/// the directory's lock included, from its fork until its exec: the lock can outlive the
/// drop by that moment. Any other error fails at once.
fn open_store(c: &SsdConfig) -> SsdStore {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match SsdStore::open(c) {
            Ok(s) => return s,
            Err(SsdError::Locked { .. }) if std::time::Instant::now() < deadline => std::thread::sleep(std::time::Duration::from_millis(5)),
            Err(e) => panic!("open the SSD store: {e}"),
        }
    }
}

fn cfg(dirs: &[&Path], capacity: u64, segment: u64) -> SsdConfig {
    SsdConfig {
        dirs: dirs.iter().map(|d| d.to_path_buf()).collect(),
        capacity_bytes: capacity,
        segment_bytes: segment,
        queue_depth: 32,
        chunk_bytes: 64 << 10,
        ..SsdConfig::default()
    }
}

/// The secret salt of an SSD directory a store has opened (tests forge with it).
fn dir_salt(dir: &Path) -> format::Salt {
    format::Salt::from_file_bytes(&std::fs::read(dir.join(crate::salt::SALT_NAME)).unwrap()).expect("a salt file")
}

fn key(i: u64) -> ObjectKey {
    ObjectKey(((i as u128).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835)) ^ 0xABCD)
}

fn payload(i: u64, len: usize) -> Vec<u8> {
    let mut x = i.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Sizes from 0 to ~70 KiB, some exactly at block boundaries.
fn size_of(i: u64) -> usize {
    match i % 7 {
        0 => 0,
        1 => 4096 - HEADER_BYTES,
        2 => 4096 - HEADER_BYTES + 1,
        _ => ((i * 7919) % 70_000) as usize,
    }
}

fn put_all(store: &SsdStore, range: std::ops::Range<u64>) {
    for i in range {
        store.put(key(i), 7, 65536, &payload(i, size_of(i))).unwrap_or_else(|e| panic!("put {i}: {e}"));
    }
}

fn check_all(store: &SsdStore, range: std::ops::Range<u64>) {
    for i in range {
        let (info, data) = store.get(key(i), 7).unwrap_or_else(|| panic!("object {i} missing"));
        assert_eq!(data.len(), size_of(i), "object {i} size");
        assert!(data == payload(i, size_of(i)), "object {i} bytes differ");
        assert_eq!((info.namespace, info.layout_object_size), (7, 65536));
    }
}

#[test]
fn put_get_byte_exact_across_segments_and_two_directories() {
    let (a, b) = (tempdir(), tempdir());
    let store = open_store(&cfg(&[a.path(), b.path()], 64 << 20, 256 << 10));
    put_all(&store, 0..400);
    check_all(&store, 0..400);
    let st = store.stats();
    assert_eq!(st.objects, 400);
    assert!(st.direct_io, "ext4 under /var/tmp should take O_DIRECT");
    assert!(st.io_uring, "io_uring is allowed on this machine");
    assert!(segment::segment_files(a.path()).unwrap().len() >= 3 && segment::segment_files(b.path()).unwrap().len() >= 3, "{st:?}");
    assert!(store.get(key(10_000), 7).is_none());
    // A batch too: results in order.
    let items: Vec<(ObjectKey, u128, u64, Vec<u8>)> = (400..500).map(|i| (key(i), 7, 65536, payload(i, size_of(i)))).collect();
    let refs: Vec<(ObjectKey, u128, u64, &[u8])> = items.iter().map(|(k, n, l, d)| (*k, *n, *l, &d[..])).collect();
    assert!(store.put_batch(&refs).iter().all(|r| r.is_ok()));
    let keys: Vec<(ObjectKey, u128)> = (0..500).map(|i| (key(i), 7)).collect();
    let mut outs: Vec<Vec<u8>> = vec![Vec::new(); 500];
    let mut o: Vec<&mut Vec<u8>> = outs.iter_mut().collect();
    let got = store.get_batch(&keys, &mut o);
    for i in 0..500u64 {
        assert!(got[i as usize].is_some(), "batch get {i}");
        assert!(outs[i as usize] == payload(i, size_of(i)), "batch get {i} bytes");
    }
}

#[test]
fn restart_finds_everything_and_keeps_removals() {
    let (a, b) = (tempdir(), tempdir());
    let c = cfg(&[a.path(), b.path()], 64 << 20, 256 << 10);
    {
        let store = open_store(&c);
        put_all(&store, 0..300);
        for i in (0..300).step_by(10) {
            assert!(store.remove(key(i), 7));
        }
        // Overwrite: the newest copy wins after restart.
        store.put(key(1), 7, 65536, b"newest").unwrap();
    }
    let store = open_store(&c);
    let st = store.stats();
    assert_eq!(st.segments_scanned, 0, "a clean close seals every segment: {st:?}");
    assert!(st.segments_from_footer >= 4);
    assert_eq!(st.objects, 270);
    for i in 2..300 {
        if i % 10 == 0 {
            assert!(store.get(key(i), 7).is_none(), "removed {i} came back");
        } else {
            check_all(&store, i..i + 1);
        }
    }
    assert_eq!(store.get(key(1), 7).unwrap().1, b"newest");
}

#[test]
fn torn_tail_is_skipped_and_the_rest_found() {
    let d = tempdir();
    let c = cfg(&[d.path()], 64 << 20, 8 << 20);
    let size = 20_000usize;
    let rl = format::record_len(size as u64);
    {
        let store = open_store(&c);
        for i in 0..50 {
            store.put(key(i), 7, 65536, &payload(i, size)).unwrap();
        }
    }
    let segs = segment::segment_files(d.path()).unwrap();
    assert_eq!(segs.len(), 1);
    // Cut the footer and the last record's payload (its header stays), as a crash would;
    // and zero part of record 20's payload (a write that landed partly).
    let f = std::fs::OpenOptions::new().write(true).open(&segs[0]).unwrap();
    f.set_len(49 * rl + 4096).unwrap();
    use std::os::unix::fs::FileExt;
    f.write_all_at(&[0u8; 4096], 20 * rl + 8192).unwrap();
    drop(f);
    let store = open_store(&c);
    let st = store.stats();
    assert_eq!(st.segments_scanned, 1);
    assert_eq!(st.torn_records_skipped, 2, "{st:?}");
    for i in 0..50 {
        let got = store.get(key(i), 7);
        if i == 20 || i == 49 {
            assert!(got.is_none(), "torn record {i} returned");
        } else {
            assert!(got.unwrap().1 == payload(i, size), "record {i}");
        }
    }
    // The scanned segment was sealed: the next start reads its footer.
    drop(store);
    let store = open_store(&c);
    assert_eq!(store.stats().segments_scanned, 0);
    assert_eq!(store.stats().objects, 48);
}

#[test]
fn a_flipped_byte_on_disk_is_a_miss_not_wrong_data() {
    let d = tempdir();
    let c = cfg(&[d.path()], 64 << 20, 8 << 20);
    let size = 10_000usize;
    let rl = format::record_len(size as u64);
    let store = open_store(&c);
    for i in 0..4 {
        store.put(key(i), 7, 65536, &payload(i, size)).unwrap();
    }
    let seg = &segment::segment_files(d.path()).unwrap()[0];
    let f = std::fs::OpenOptions::new().read(true).write(true).open(seg).unwrap();
    use std::os::unix::fs::FileExt;
    let flip = |at: u64| {
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, at).unwrap();
        b[0] ^= 0x20;
        f.write_all_at(&b, at).unwrap();
        f.sync_all().unwrap();
    };
    flip(HEADER_BYTES as u64 + 5000); // payload of record 0
    flip(rl + 30); // header (namespace) of record 1
    assert!(store.get(key(0), 7).is_none(), "payload flip returned data");
    assert!(store.get(key(1), 7).is_none(), "header flip returned data");
    assert!(store.get(key(2), 7).unwrap().1 == payload(2, size));
    assert_eq!(store.stats().crc_failures, 2);
    // Once failed, it stays a miss (dropped from the index).
    assert!(store.get(key(0), 7).is_none());
    assert_eq!(store.stats().crc_failures, 2);
    drop(store);
    // After a restart (footer rebuild trusts the footer) the flipped records are still misses.
    flip(2 * rl + HEADER_BYTES as u64 + 1); // and one more, in record 2
    let store = open_store(&c);
    assert!(store.get(key(0), 7).is_none() && store.get(key(1), 7).is_none() && store.get(key(2), 7).is_none());
    assert!(store.get(key(3), 7).unwrap().1 == payload(3, size));
}

#[test]
fn compaction_reclaims_dead_records_and_keeps_live_ones() {
    let d = tempdir();
    let c = cfg(&[d.path()], 64 << 20, 256 << 10);
    {
        let store = open_store(&c);
        put_all(&store, 0..400);
        // Remove 3 of every 4 (tombstones), overwrite some.
        for i in 0..400 {
            if i % 4 != 0 {
                store.remove(key(i), 7);
            }
        }
        let before = store.stats();
        let n = store.compact();
        let after = store.stats();
        assert!(n >= 3, "compacted {n} segments");
        assert!(after.used_bytes < before.used_bytes / 2, "before {before:?}\nafter {after:?}");
        assert!(after.compacted_bytes > 0);
        for i in 0..400 {
            if i % 4 == 0 {
                check_all(&store, i..i + 1);
            } else {
                assert!(store.get(key(i), 7).is_none());
            }
        }
    }
    // Removed keys stay removed across a restart (tombstones were carried where needed).
    let store = open_store(&c);
    assert_eq!(store.stats().objects, 100);
    for i in 0..400 {
        if i % 4 == 0 {
            check_all(&store, i..i + 1);
        } else {
            assert!(store.get(key(i), 7).is_none(), "removed {i} came back after compaction + restart");
        }
    }
}

/// Issue #34, S7: sealed segments' footer entries are not kept in memory; compaction reads
/// them back from the footer. Where that footer is no longer readable (here zeroed while
/// the store runs), the segment's live records are found through the index instead:
/// compaction still moves every one (a record left behind would be lost with the file).
#[test]
fn compaction_of_a_segment_whose_footer_went_bad_keeps_its_live_records() {
    let d = tempdir();
    let c = cfg(&[d.path()], 64 << 20, 256 << 10);
    let store = open_store(&c);
    put_all(&store, 0..200);
    store.flush().unwrap();
    let segs = segment::segment_files(d.path()).unwrap();
    assert!(segs.len() >= 4, "{segs:?}");
    // Every sealed segment's trailer zeroed.
    for seg in &segs {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(seg).unwrap();
        let len = f.metadata().unwrap().len();
        f.write_all_at(&[0u8; 4096], len - 4096).unwrap();
    }
    for i in (0..200).filter(|i| i % 4 != 0) {
        store.remove(key(i), 7);
    }
    assert!(store.compact() >= 3);
    assert!(store.take_evicted().is_empty(), "compaction lost records");
    for i in 0..200 {
        if i % 4 == 0 {
            check_all(&store, i..i + 1);
        } else {
            assert!(store.get(key(i), 7).is_none());
        }
    }
    drop(store);
    let store = open_store(&c);
    assert_eq!(store.stats().objects, 50);
    for i in (0..200).filter(|i| i % 4 == 0) {
        check_all(&store, i..i + 1);
    }
}

#[test]
fn capacity_watermarks_evict_oldest_and_refuse_what_cannot_fit() {
    let d = tempdir();
    let seg = 256u64 << 10;
    let c = cfg(&[d.path()], 8 * seg, seg);
    let store = open_store(&c);
    let size = 30_000usize;
    let mut evicted = Vec::new();
    for i in 0..200 {
        store.put(key(i), 7, 65536, &payload(i, size)).unwrap();
        evicted.extend(store.take_evicted());
    }
    let st = store.stats();
    assert!(st.used_bytes <= 8 * seg, "{st:?}");
    assert!(!evicted.is_empty());
    assert_eq!(st.evicted_objects, evicted.len() as u64);
    assert!(evicted.contains(&(key(0), 7)), "oldest first");
    for k in &evicted {
        assert!(store.get(k.0, k.1).is_none());
    }
    assert_eq!(st.objects + evicted.len() as u64, 200);
    assert!(store.get(key(199), 7).unwrap().1 == payload(199, size));
    // An object larger than a segment is refused with a clear error.
    let e = store.put(key(1000), 7, 65536, &vec![1u8; seg as usize]).unwrap_err();
    assert!(matches!(e, SsdError::TooLarge { .. }), "{e}");
}

#[test]
fn bad_directories_give_errors_naming_them() {
    let d = tempdir();
    let missing = d.path().join("nope");
    let e = SsdStore::open(&cfg(&[&missing], 64 << 20, 1 << 20)).err().expect("missing dir refused").to_string();
    assert!(e.contains(missing.to_str().unwrap()), "{e}");
    let file = d.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let e = SsdStore::open(&cfg(&[&file], 64 << 20, 1 << 20)).err().expect("file refused").to_string();
    assert!(e.contains(file.to_str().unwrap()) && e.contains("not a directory"), "{e}");
    // Two stores on one directory: the second is refused.
    let s = open_store(&cfg(&[d.path()], 64 << 20, 1 << 20));
    let e = SsdStore::open(&cfg(&[d.path()], 64 << 20, 1 << 20)).err().expect("second store refused").to_string();
    assert!(e.contains("in use"), "{e}");
    drop(s);
}

#[test]
fn tmpfs_directory_works_with_or_without_o_direct() {
    let Ok(d) = tempfile::Builder::new().prefix("umbp-ssd-test").tempdir_in("/dev/shm") else {
        println!("skipped: no /dev/shm");
        return;
    };
    let store = open_store(&cfg(&[d.path()], 64 << 20, 1 << 20));
    put_all(&store, 0..50);
    check_all(&store, 0..50);
    if store.stats().direct_io {
        println!("skipped (fallback part): this kernel's tmpfs accepts O_DIRECT, so the buffered fallback was not exercised");
    }
    drop(store);
    let store = open_store(&cfg(&[d.path()], 64 << 20, 1 << 20));
    check_all(&store, 0..50);
}

#[test]
fn buffered_mode_works_and_survives_a_restart() {
    let d = tempdir();
    let c = SsdConfig { direct_io: false, ..cfg(&[d.path()], 64 << 20, 256 << 10) };
    {
        let store = open_store(&c);
        assert!(!store.stats().direct_io);
        put_all(&store, 0..200);
        check_all(&store, 0..200);
    }
    let store = open_store(&c);
    assert_eq!(store.stats().segments_scanned, 0);
    check_all(&store, 0..200);
}

#[test]
fn without_io_uring_the_synchronous_path_is_byte_exact() {
    let d = tempdir();
    let c = SsdConfig { io_uring: false, ..cfg(&[d.path()], 64 << 20, 256 << 10) };
    {
        let store = open_store(&c);
        assert!(!store.stats().io_uring && store.stats().direct_io);
        put_all(&store, 0..150);
        check_all(&store, 0..150);
    }
    let store = open_store(&SsdConfig { io_uring: true, ..c });
    assert!(store.stats().io_uring);
    check_all(&store, 0..150);
}

#[test]
fn an_unreadable_segment_is_skipped_not_fatal() {
    let d = tempdir();
    let c = cfg(&[d.path()], 64 << 20, 256 << 10);
    {
        let store = open_store(&c);
        put_all(&store, 0..100);
    }
    // A segment name that cannot be opened as a file (EISDIR).
    std::fs::create_dir(d.path().join(super::segment::segment_name(0xff))).unwrap();
    let store = open_store(&c);
    assert_eq!(store.stats().segments_unreadable, 1);
    check_all(&store, 0..100);
    // New segments are numbered past it.
    put_all(&store, 100..150);
    check_all(&store, 0..150);
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// `cargo test -p umbp-ssd --lib tests::bench_ssd -- --ignored --nocapture`; sizes
/// from UMBP_SSD_BENCH_BYTES, UMBP_SSD_BENCH_OBJECT, UMBP_SSD_BENCH_REBUILD_OBJECTS and
/// the directory from UMBP_SSD_BENCH_DIR (default /var/tmp). Prints JSON lines.
#[test]
#[ignore = "measurement, run by hand"]
fn bench_ssd() {
    let base = std::env::var("UMBP_SSD_BENCH_DIR").unwrap_or_else(|_| "/var/tmp".into());
    let d = tempfile::Builder::new().prefix("umbp-ssd-bench").tempdir_in(base).unwrap();
    let c = SsdConfig::default();
    let total = env_u64("UMBP_SSD_BENCH_BYTES", 1 << 30);
    let object = env_u64("UMBP_SSD_BENCH_OBJECT", 256 << 10);
    let r = super::bench::run(d.path(), total, object, 64, &c).unwrap();
    println!("{}", serde_json::to_string(&r).unwrap());
    // Rebuild of many small objects (one block each).
    let n = env_u64("UMBP_SSD_BENCH_REBUILD_OBJECTS", 100_000);
    let small = 4096 - HEADER_BYTES as u64;
    let r = super::bench::run(d.path(), n * small, small, 256, &c).unwrap();
    println!("{}", serde_json::to_string(&r).unwrap());
}

fn rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    s.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0) * 4096
}

/// Warm restart of many one-block objects (UMBP_SSD_BENCH_REBUILD_OBJECTS, default 1M):
/// rebuild time and the index's memory per object.
#[test]
#[ignore = "measurement, run by hand"]
fn bench_rebuild() {
    let base = std::env::var("UMBP_SSD_BENCH_DIR").unwrap_or_else(|_| "/var/tmp".into());
    let d = tempfile::Builder::new().prefix("umbp-ssd-bench").tempdir_in(base).unwrap();
    let n = env_u64("UMBP_SSD_BENCH_REBUILD_OBJECTS", 1_000_000);
    let c = SsdConfig { dirs: vec![d.path().to_path_buf()], capacity_bytes: n * 8192 + (4 << 30), ..SsdConfig::default() };
    let small = vec![0x5au8; 4096 - HEADER_BYTES];
    let t = std::time::Instant::now();
    {
        let store = open_store(&c);
        let mut i = 0;
        while i < n {
            let m = (n - i).min(1024);
            let items: Vec<(ObjectKey, u128, u64, &[u8])> = (i..i + m).map(|j| (key(j), 7, 65536, &small[..])).collect();
            assert!(store.put_batch(&items).iter().all(|r| r.is_ok()));
            i += m;
        }
    }
    let write_s = t.elapsed().as_secs_f64();
    let before = rss_bytes();
    let t = std::time::Instant::now();
    let store = open_store(&c);
    let open_ms = t.elapsed().as_secs_f64() * 1000.0;
    let st = store.stats();
    let after = rss_bytes();
    assert_eq!(st.objects, n);
    assert!(store.get(key(n / 2), 7).unwrap().1 == small);
    println!(
        "{{\"objects\":{n},\"write_s\":{write_s:.1},\"open_ms\":{open_ms:.1},\"rebuild_ms\":{:.1},\"rebuild_ms_per_million\":{:.1},\"index_bytes_per_object\":{}}}",
        st.rebuild_ms,
        st.rebuild_ms * 1e6 / n as f64,
        after.saturating_sub(before) / n.max(1)
    );
}

/// Issue #34, S4: a tenant's payload may carry, at a block boundary, a record header that
/// passes its CRC32C (CRC is no MAC): here one for another namespace's key with a winning
/// sequence number. Once that tenant's record is torn (its payload CRC fails after a
/// crash), the scan skips it by its header's length; the forged header inside is never
/// read (old code resynced block by block inside the payload and served the forged bytes
/// for the victim's key).
#[test]
fn a_forged_header_inside_a_torn_payload_is_not_listed_after_restart() {
    let d = tempdir();
    let c = cfg(&[d.path()], 64 << 20, 8 << 20);
    let size = 20_000usize;
    let rl = format::record_len(size as u64);
    let victim = (key(1), 7u128);
    let forged_data = vec![0xEEu8; 1000];
    let store = open_store(&c);
    // The strongest forger: one who knows the directory's salt, so the forged header passes
    // every check a header has; only never looking inside the torn payload keeps it out.
    let salt = dir_salt(d.path());
    let forged = format::RecordHeader {
        flags: 0,
        key: victim.0 .0,
        namespace: victim.1,
        size: forged_data.len() as u64,
        layout_object_size: 65536,
        seq: format::MAX_SEQ / 2,
        payload_crc: crc32c::crc32c(&forged_data),
    };
    // The attacker's payload: the forged record starts at the record's second block.
    let mut evil = payload(100, size);
    let at = format::BLOCK as usize - HEADER_BYTES;
    evil[at..at + HEADER_BYTES].copy_from_slice(&forged.encode(&salt));
    evil[at + HEADER_BYTES..at + HEADER_BYTES + forged_data.len()].copy_from_slice(&forged_data);
    {
        for i in 0..5 {
            store.put(key(i), 7, 65536, &payload(i, size)).unwrap();
        }
        store.put(key(100), 9, 65536, &evil).unwrap();
        for i in 5..10 {
            store.put(key(i), 7, 65536, &payload(i, size)).unwrap();
        }
        drop(store);
    }
    let segs = segment::segment_files(d.path()).unwrap();
    assert_eq!(segs.len(), 1);
    // A crash: no footer, and the attacker's record torn (a payload byte past the forged
    // record differs, so its CRC fails).
    let f = std::fs::OpenOptions::new().write(true).open(&segs[0]).unwrap();
    f.set_len(11 * rl).unwrap();
    use std::os::unix::fs::FileExt;
    f.write_all_at(&[!evil[size - 1]], 5 * rl + HEADER_BYTES as u64 + size as u64 - 1).unwrap();
    drop(f);
    let store = open_store(&c);
    let got = store.get(victim.0, victim.1).expect("the victim's own record");
    assert!(got.1 == payload(1, size), "the forged header's bytes were served for another namespace's key");
    let st = store.stats();
    assert_eq!(st.segments_scanned, 1, "{st:?}");
    assert_eq!(st.torn_records_skipped, 1, "{st:?}");
    assert!(store.get(key(100), 9).is_none(), "the torn record is a miss");
    for i in (0..10).filter(|&i| i != 1) {
        assert!(store.get(key(i), 7).unwrap().1 == payload(i, size), "record {i} after the torn one");
    }
    assert_eq!(store.stats().objects, 10);
}

/// Issue #34, S6: a segment skipped as unreadable at start may hold the highest sequence
/// numbers; the records written meanwhile must still beat its old ones once it is readable
/// again (old code numbered on from the highest number read, so the old copy won).
#[test]
fn sequence_numbers_do_not_go_back_when_a_segment_is_skipped() {
    let d = tempdir();
    let c = cfg(&[d.path()], 64 << 20, 256 << 10);
    let size = 30_000usize;
    {
        let store = open_store(&c);
        put_all(&store, 0..20);
        // The last records, key(1)'s old copy among them, in the newest segment.
        store.put(key(1), 7, 65536, &payload(1000, size)).unwrap();
    }
    let segs = segment::segment_files(d.path()).unwrap();
    assert!(segs.len() >= 2, "{segs:?}");
    let newest = segs.iter().max().unwrap().clone();
    let aside = d.path().join("aside");
    std::fs::rename(&newest, &aside).unwrap();
    // Unreadable in its place (EISDIR), as a drive error would make it.
    std::fs::create_dir(&newest).unwrap();
    {
        let store = open_store(&c);
        assert_eq!(store.stats().segments_unreadable, 1);
        store.put(key(1), 7, 65536, &payload(2000, size)).unwrap();
    }
    std::fs::remove_dir(&newest).unwrap();
    std::fs::rename(&aside, &newest).unwrap();
    let store = open_store(&c);
    assert_eq!(store.stats().segments_unreadable, 0);
    assert!(store.get(key(1), 7).unwrap().1 == payload(2000, size), "the older copy won over the one written later");
}
