//! SSD store tests on real files (the root file system here is ext4, which supports
//! O_DIRECT; each test says "skipped" for a part it cannot observe). Crash and disk-full
//! tests run in a child process (this test binary re-run on an ignored helper test).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use umbp_protocol::ObjectKey;

use super::format::{self, HEADER_BYTES};
use super::{segment, SsdConfig, SsdError, SsdStore};

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

/// Drops the capabilities that let root write anywhere, in this thread only (capset acts
/// on the calling thread).
fn drop_dac_override_in_this_thread() -> bool {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut h = Header { version: 0x2008_0522, pid: 0 };
    let mut d = [Data::default(); 2];
    // SAFETY: capget writes two Data entries for version 3, which `d` holds.
    if unsafe { libc::syscall(libc::SYS_capget, &mut h as *mut Header, d.as_mut_ptr()) } != 0 {
        return false;
    }
    d[0].effective &= !((1 << 1) | (1 << 2) | (1 << 3)); // DAC_OVERRIDE, DAC_READ_SEARCH, FOWNER
                                                         // SAFETY: capset reads the header and two Data entries.
    unsafe { libc::syscall(libc::SYS_capset, &mut h as *mut Header, d.as_ptr()) == 0 }
}

#[test]
fn a_read_only_directory_gives_an_error_naming_it() {
    let d = tempdir();
    let ro = d.path().join("ro");
    std::fs::create_dir(&ro).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
    let ro2 = ro.clone();
    let r = std::thread::spawn(move || {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        if root && !drop_dac_override_in_this_thread() {
            return None;
        }
        Some(SsdStore::open(&cfg(&[&ro2], 64 << 20, 1 << 20)).err().map(|e| e.to_string()))
    })
    .join()
    .unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o755)).unwrap();
    match r {
        None => println!("skipped: running as root and could not drop CAP_DAC_OVERRIDE"),
        Some(e) => {
            let e = e.expect("a read-only directory must be refused");
            assert!(e.contains(ro.to_str().unwrap()) && e.contains("not writable"), "{e}");
        }
    }
}

const CHILD_ENV: &str = "UMBP_SSD_TEST_CHILD_DIR";

fn run_child(test: &str, dir: &Path) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "--nocapture", "--test-threads=1", test])
        .env(CHILD_ENV, dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

/// Child of `sigkill_mid_write_keeps_everything_acknowledged`: stores objects forever,
/// printing each acknowledged index.
#[test]
#[ignore = "helper run by sigkill_mid_write_keeps_everything_acknowledged"]
fn child_writer() {
    let Some(dir) = std::env::var_os(CHILD_ENV) else { return };
    let store = open_store(&cfg(&[Path::new(&dir)], 1 << 30, 4 << 20));
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    for i in 0.. {
        let items: Vec<(ObjectKey, u128, u64, Vec<u8>)> =
            (i * 8..i * 8 + 8).map(|j| (key(j), 7, 65536, payload(j, 100_000 + (j as usize % 5) * 7_000))).collect();
        let refs: Vec<(ObjectKey, u128, u64, &[u8])> = items.iter().map(|(k, n, l, d)| (*k, *n, *l, &d[..])).collect();
        for r in store.put_batch(&refs) {
            r.unwrap();
        }
        writeln!(out, "ack {}", i * 8 + 8).unwrap();
        out.flush().unwrap();
    }
}

/// A writer killed with SIGKILL loses nothing it acknowledged, and what it wrote but did
/// not acknowledge is byte-exact or absent. The kill should land inside a segment being
/// written (its footer missing: the restart scans it). Now and then (once in 37 runs on
/// the 2-core VM) it lands right after a segment was sealed and before the next one got a
/// record: every segment then has its footer, the scan went unobserved, and the attempt
/// is run again.
#[test]
fn sigkill_mid_write_keeps_everything_acknowledged() {
    const ATTEMPTS: usize = 5;
    for attempt in 1..=ATTEMPTS {
        if kill_writer_and_check_restart() {
            return;
        }
        println!("attempt {attempt}: the kill landed between two segments (no segment to scan); again");
    }
    panic!("in {ATTEMPTS} attempts no kill landed inside a segment being written");
}

/// One kill and restart; whether the restart scanned a segment left without a footer.
fn kill_writer_and_check_restart() -> bool {
    let d = tempdir();
    let mut child = run_child("tests::child_writer", d.path());
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut acked = 0u64;
    while acked < 600 {
        let l = lines.next().expect("child exited early").unwrap();
        if let Some(n) = l.strip_prefix("ack ") {
            acked = n.parse().unwrap();
        }
    }
    // Land the kill at some point inside a later batch's writes (0-20 ms on).
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    std::thread::sleep(std::time::Duration::from_micros(u64::from(nanos % 20_000)));
    // SAFETY: kill has no memory preconditions; the pid is our live child.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    // Acks printed after we stopped reading still count as acknowledged.
    for l in lines.map_while(Result::ok) {
        if let Some(n) = l.strip_prefix("ack ") {
            acked = n.parse().unwrap();
        }
    }
    let status = child.wait().unwrap();
    assert!(!status.success());
    let store = open_store(&cfg(&[d.path()], 1 << 30, 4 << 20));
    let st = store.stats();
    println!(
        "after SIGKILL: acked {acked}, found {}, torn skipped {}, scanned {}",
        st.objects, st.torn_records_skipped, st.segments_scanned
    );
    for j in 0..acked {
        let (_, data) = store.get(key(j), 7).unwrap_or_else(|| panic!("acknowledged object {j} lost"));
        assert!(data == payload(j, 100_000 + (j as usize % 5) * 7_000), "object {j} differs");
    }
    // Whatever else was found (written but not acknowledged) is byte-exact too.
    for (k, _) in store.keys() {
        let j = (0..acked + 1000).find(|&j| key(j) == k).expect("a key we wrote");
        let (_, data) = store.get(k, 7).unwrap();
        assert!(data == payload(j, 100_000 + (j as usize % 5) * 7_000));
    }
    if st.segments_scanned == 0 {
        assert_eq!(st.segments_from_footer, st.segments, "no segment scanned, so every one had its footer: {st:?}");
    }
    st.segments_scanned >= 1
}

/// Child of `disk_full_gives_a_clear_error`: writes under RLIMIT_FSIZE until refused.
#[test]
#[ignore = "helper run by disk_full_gives_a_clear_error"]
fn child_disk_full() {
    let Some(dir) = std::env::var_os(CHILD_ENV) else { return };
    // SAFETY: ignoring SIGXFSZ so an over-limit write fails with EFBIG instead of killing us.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    let lim = libc::rlimit { rlim_cur: 1 << 20, rlim_max: 1 << 20 };
    // SAFETY: setrlimit reads one rlimit.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_FSIZE, &lim) }, 0);
    let store = open_store(&cfg(&[Path::new(&dir)], 1 << 30, 4 << 20));
    for i in 0..100 {
        match store.put(key(i), 7, 65536, &payload(i, 100_000)) {
            Ok(_) => {}
            Err(e) => {
                println!("DISKFULL {i} {}", matches!(e, SsdError::DiskFull { .. }));
                println!("MESSAGE {e}");
                // What was stored before stays readable; the failed one is a miss.
                for j in 0..i {
                    assert!(store.get(key(j), 7).unwrap().1 == payload(j, 100_000));
                }
                assert!(store.get(key(i), 7).is_none());
                return;
            }
        }
    }
    println!("NEVER FULL");
}

#[test]
fn disk_full_gives_a_clear_error() {
    let d = tempdir();
    let child = run_child("tests::child_disk_full", d.path());
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed:\n{text}");
    let line = text.lines().find_map(|l| l.split_once("DISKFULL ")).unwrap_or_else(|| panic!("never refused:\n{text}")).1;
    let n: u64 = line.split(' ').next().unwrap().parse().unwrap();
    assert!((5..=10).contains(&n), "refused at object {n} (1 MiB limit, ~100 KiB objects)");
    assert!(line.ends_with("true"), "{line}\n{text}");
    let msg = text.lines().find(|l| l.contains("MESSAGE")).unwrap();
    assert!(msg.contains(d.path().to_str().unwrap()) && msg.contains("disk full"), "{msg}");
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

/// Child of `a_write_cut_short_by_the_file_size_limit_is_disk_full`: with a 6,000-byte file
/// size limit, an 8 KiB io_uring write at offset 0 (the kernel writes the first 6,000
/// bytes and stops) prints the error of the rest.
#[test]
#[ignore = "helper run by a_write_cut_short_by_the_file_size_limit_is_disk_full"]
fn child_short_write() {
    let Some(dir) = std::env::var_os(CHILD_ENV) else { return };
    // SAFETY: ignoring SIGXFSZ so an over-limit write fails with EFBIG instead of killing us.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    let lim = libc::rlimit { rlim_cur: 6000, rlim_max: 6000 };
    // SAFETY: setrlimit reads one rlimit.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_FSIZE, &lim) }, 0);
    let file = std::fs::File::create(Path::new(&dir).join("short")).unwrap();
    let mut ring = super::uring::Ring::new(4, 64 << 10, true).expect("io_uring");
    let data = vec![7u8; 8192];
    let job = super::uring::WriteJob { fd: std::os::fd::AsRawFd::as_raw_fd(&file), offset: 0, len: 8192, pieces: vec![&data] };
    let r = ring.write_batch(&[job]);
    println!("URING {}", ring.is_uring());
    match &r[0] {
        Ok(()) => println!("RESULT ok"),
        Err(e) => println!("RESULT {:?}", e.raw_os_error()),
    }
}

/// A write the kernel cuts short (here by the file size limit; a full disk does the same)
/// is not an opaque "short write": the rest is written again and fails with the kernel's
/// reason (EFBIG, ENOSPC), which the store reports as disk full. (io_uring returned the
/// short count, and the store called it a plain I/O error, in one of ten runs of
/// `disk_full_gives_a_clear_error` beside the other tests.)
#[test]
fn a_write_cut_short_by_the_file_size_limit_is_disk_full() {
    let d = tempdir();
    let out = run_child("tests::child_short_write", d.path()).wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed:\n{text}");
    if text.contains("URING false") {
        println!("io_uring is not available here: this checked the synchronous path only");
    }
    assert!(text.contains(&format!("RESULT Some({})", libc::EFBIG)), "{text}");
}

/// Keys of the store, as a set.
fn key_set(store: &SsdStore) -> std::collections::BTreeSet<(u128, u128)> {
    store.keys().into_iter().map(|(k, i)| (k.0, i.namespace)).collect()
}

/// Checks S1's contract for one call: every key that was in the store (or just put) and is
/// not any more is reported by `take_evicted` (the pool removes exactly those from its
/// index), and nothing still there is. Returns how many were evicted.
fn check_evictions_reported(store: &SsdStore, before: &std::collections::BTreeSet<(u128, u128)>, removed: Option<(u128, u128)>) -> usize {
    let after = key_set(store);
    let reported: std::collections::BTreeSet<(u128, u128)> = store.take_evicted().into_iter().map(|(k, ns)| (k.0, ns)).collect();
    let left: std::collections::BTreeSet<(u128, u128)> =
        before.iter().filter(|k| !after.contains(k) && Some(**k) != removed).copied().collect();
    assert_eq!(reported, left, "keys that left the SSD store without being reported (phantom index entries), or reported while present");
    left.len()
}

/// Issue #34, S1: a removal's tombstone that pushes the shard over its high watermark
/// reclaims room, dropping the oldest segment's objects; every one of them is reported to
/// the pool (old code: `remove` discarded them and the pool kept listing them).
#[test]
fn a_tombstone_that_triggers_reclaim_reports_every_evicted_key() {
    let d = tempdir();
    let seg = 256u64 << 10;
    let c = cfg(&[d.path()], 8 * seg, seg);
    let high = (8.0 * seg as f64 * c.high_watermark) as u64;
    let store = open_store(&c);
    let size = 30_000usize;
    let rec = format::record_len(size as u64);
    let mut i = 0;
    // Fill up to just under the high watermark: the next put would reclaim.
    while store.stats().used_bytes + rec + format::BLOCK <= high {
        store.put(key(i), 7, 65536, &payload(i, size)).unwrap();
        i += 1;
    }
    assert!(store.take_evicted().is_empty(), "nothing dropped while filling");
    // Tombstones (one block each) until one crosses the watermark.
    let mut evicted = 0;
    for j in (0..i).rev().take(16) {
        let before = key_set(&store);
        assert!(store.remove(key(j), 7));
        evicted += check_evictions_reported(&store, &before, Some((key(j).0, 7)));
        if evicted > 0 {
            break;
        }
    }
    assert!(evicted > 0, "a tombstone reclaimed room: {:?}", store.stats());
    assert!(store.get(key(0), 7).is_none(), "the oldest segment went first");
}

/// Child of `disk_full_mid_batch_reports_every_evicted_key`: put batches under a 1 MiB
/// file size limit (as a full drive), checking after each that every key that left the
/// store was reported; prints what it saw.
#[test]
#[ignore = "helper run by disk_full_mid_batch_reports_every_evicted_key"]
fn child_disk_full_batches() {
    let Some(dir) = std::env::var_os(CHILD_ENV) else { return };
    // SAFETY: ignoring SIGXFSZ so an over-limit write fails with EFBIG instead of killing us.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    let lim = libc::rlimit { rlim_cur: 1 << 20, rlim_max: 1 << 20 };
    // SAFETY: setrlimit reads one rlimit.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_FSIZE, &lim) }, 0);
    // 3 segments of 4 MiB of capacity, but each file is refused past 1 MiB: failed writes
    // still take their reserved room, so reclaims run in batches whose writes fail.
    let store = open_store(&cfg(&[Path::new(&dir)], 12 << 20, 4 << 20));
    let (mut failed, mut evicted, mut mixed) = (0, 0, 0);
    for b in 0..40u64 {
        let before = key_set(&store);
        let data: Vec<Vec<u8>> = (0..8).map(|j| payload(b * 8 + j, 100_000)).collect();
        let items: Vec<(ObjectKey, u128, u64, &[u8])> = (0..8).map(|j| (key(b * 8 + j), 7u128, 65536u64, &data[j as usize][..])).collect();
        let r = store.put_batch(&items);
        let mut with_new = before.clone();
        for (it, r) in items.iter().zip(&r) {
            match r {
                Ok(_) => {
                    with_new.insert((it.0 .0, 7));
                }
                Err(e) => {
                    assert!(matches!(e, SsdError::DiskFull { .. }), "{e}");
                    failed += 1;
                }
            }
        }
        let n = check_evictions_reported(&store, &with_new, None);
        evicted += n;
        if n > 0 && r.iter().any(|r| r.is_err()) {
            mixed += 1;
        }
    }
    println!("FAILED {failed} EVICTED {evicted} MIXED {mixed}");
}

/// Issue #34, S1: on a full drive (EFBIG, as ENOSPC) a batch whose writes fail still
/// reports the keys its reclaim dropped (old code: an item's evictions were overwritten by
/// its write error, and a compaction that could not rewrite a record dropped it silently).
#[test]
fn disk_full_mid_batch_reports_every_evicted_key() {
    let d = tempdir();
    let out = run_child("tests::child_disk_full_batches", d.path()).wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed:\n{text}");
    let line = text.lines().find_map(|l| l.split_once("FAILED ")).unwrap_or_else(|| panic!("no summary:\n{text}")).1;
    let v: Vec<u64> = line.split(' ').step_by(2).map(|x| x.parse().unwrap()).collect();
    assert!(v[0] > 0 && v[1] > 0 && v[2] > 0, "writes failed, keys were evicted, and both in one batch: {line}");
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
    let forged = format::RecordHeader {
        flags: 0,
        key: victim.0 .0,
        namespace: victim.1,
        size: forged_data.len() as u64,
        layout_object_size: 65536,
        seq: u64::MAX / 2,
        payload_crc: crc32c::crc32c(&forged_data),
    };
    // The attacker's payload: the forged record starts at the record's second block.
    let mut evil = payload(100, size);
    let at = format::BLOCK as usize - HEADER_BYTES;
    evil[at..at + HEADER_BYTES].copy_from_slice(&forged.encode());
    evil[at + HEADER_BYTES..at + HEADER_BYTES + forged_data.len()].copy_from_slice(&forged_data);
    {
        let store = open_store(&c);
        for i in 0..5 {
            store.put(key(i), 7, 65536, &payload(i, size)).unwrap();
        }
        store.put(key(100), 9, 65536, &evil).unwrap();
        for i in 5..10 {
            store.put(key(i), 7, 65536, &payload(i, size)).unwrap();
        }
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
