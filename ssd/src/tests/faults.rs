//! The store under faults: a writer SIGKILLed mid-write, a full disk (also mid-batch and
//! when a tombstone triggers reclaim), a write cut short by RLIMIT_FSIZE, a read-only
//! directory. Each crash or full disk runs in a child test process (`run_child`).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use super::*;

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
    let mut child = run_child("tests::faults::child_writer", d.path());
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
    let child = run_child("tests::faults::child_disk_full", d.path());
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
    let mut ring = crate::uring::Ring::new(4, 64 << 10, true).expect("io_uring");
    let data = vec![7u8; 8192];
    let job = crate::uring::WriteJob { fd: std::os::fd::AsRawFd::as_raw_fd(&file), offset: 0, len: 8192, pieces: vec![&data] };
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
    let out = run_child("tests::faults::child_short_write", d.path()).wait_with_output().unwrap();
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
    let out = run_child("tests::faults::child_disk_full_batches", d.path()).wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed:\n{text}");
    let line = text.lines().find_map(|l| l.split_once("FAILED ")).unwrap_or_else(|| panic!("no summary:\n{text}")).1;
    let v: Vec<u64> = line.split(' ').step_by(2).map(|x| x.parse().unwrap()).collect();
    assert!(v[0] > 0 && v[1] > 0 && v[2] > 0, "writes failed, keys were evicted, and both in one batch: {line}");
}
