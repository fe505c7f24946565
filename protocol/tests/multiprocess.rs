//! Multi-process stress over real shared memory: a memfd mapped `MAP_SHARED` by separate
//! processes, exactly as the pool, workers and schedulers use it.
//!
//! Children are this test binary re-executed with `UMBP_MP_ROLE` naming the role and
//! `UMBP_MP_FDS` the inherited memfd numbers; the `child_entry` test does the child's work
//! when that variable is set and nothing otherwise. Children get `PR_SET_PDEATHSIG`
//! (SIGKILL) so they die with the test, and a guard kills and reaps them on any failure.
//! Results come back as `UMBP_RESULT key=value ...` lines on the child's stdout.
//!
//! * `index_seqlock_across_processes`: one writer process inserts and removes keys whose
//!   location is `checksum(key)` on the smallest table (1024 slots, so it rebuilds
//!   constantly) while 2 reader processes look keys up for `UMBP_STRESS_SECS` seconds
//!   (default 3) and count hits, misses and inconsistent hits. Asserts hits > 0,
//!   inconsistencies == 0, rebuilds > 0.
//! * `ring_ten_million_across_processes`: a producer process moves 10,000,000 u64 entries
//!   to a consumer process, which sleeps on the tail futex whenever the ring is empty; the
//!   producer pauses now and then so that the consumer really sleeps. Asserts order,
//!   count, that the consumer slept and was always woken (no sleep ran into its 5 s
//!   timeout), and prints the throughput.
#![cfg(not(loom))]

mod common;

use std::collections::HashMap;
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::checksum;
use memfd::{FileSeal, MemfdOptions};
use rustix::mm::{MapFlags, ProtFlags};
use umbp_protocol::index::{region_bytes, IndexView, IndexWriter, MIN_SLOTS};
use umbp_protocol::ring::{ring_bytes, Ring};
use umbp_protocol::{futex, ObjectKey};

const ROLE_ENV: &str = "UMBP_MP_ROLE";
const FDS_ENV: &str = "UMBP_MP_FDS";
const ARG_ENV: &str = "UMBP_MP_ARG";

// ---------------------------------------------------------------------------------------
// Plumbing

/// A `MAP_SHARED` mapping, unmapped on drop.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    fn new(fd: BorrowedFd<'_>, len: usize, writable: bool) -> Self {
        let prot = if writable { ProtFlags::READ | ProtFlags::WRITE } else { ProtFlags::READ };
        // SAFETY: a fresh mapping at an address the kernel picks; nothing aliases it in
        // this process except through `ptr`.
        let ptr = unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, prot, MapFlags::SHARED, fd, 0) }.expect("mmap");
        Self { ptr: ptr.cast(), len }
    }

    /// The n-th u64 word, as an atomic (control words shared with the other processes).
    fn word(&self, n: usize) -> &AtomicU64 {
        assert!((n + 1) * 8 <= self.len);
        // SAFETY: in bounds and 8-aligned (page-aligned base); shared memory is only ever
        // accessed atomically through these references.
        unsafe { &*(self.ptr.add(n * 8) as *const AtomicU64) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped in `new` with this length; no reference outlives the mapping
        // (they borrow `self`).
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) };
    }
}

/// A sized and sealed memfd (no peer can shrink it and SIGBUS the others).
fn memfd(name: &str, len: usize) -> memfd::Memfd {
    let fd = MemfdOptions::new().allow_sealing(true).close_on_exec(true).create(name).expect("memfd_create");
    fd.as_file().set_len(len as u64).expect("ftruncate");
    fd.add_seals(&[FileSeal::SealShrink, FileSeal::SealGrow, FileSeal::SealSeal]).expect("seal");
    fd
}

/// Children of one test: killed and reaped on drop unless they already exited.
struct Children {
    procs: Vec<(String, Child)>,
}

impl Children {
    fn new() -> Self {
        Self { procs: Vec::new() }
    }

    /// Re-executes this binary as `role`, inheriting `fds` (their numbers are passed in
    /// the environment).
    fn spawn(&mut self, role: &str, fds: &[RawFd], arg: &str) -> usize {
        let exe = std::env::current_exe().unwrap();
        let fd_list = fds.iter().map(|f| f.to_string()).collect::<Vec<_>>().join(",");
        let keep: Vec<RawFd> = fds.to_vec();
        let mut cmd = Command::new(exe);
        cmd.args(["child_entry", "--exact", "--nocapture", "--test-threads=1", "-q"])
            .env(ROLE_ENV, role)
            .env(FDS_ENV, fd_list)
            .env(ARG_ENV, arg)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // SAFETY: only async-signal-safe syscalls (prctl, fcntl) between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))?;
                for &fd in &keep {
                    // The memfds are close-on-exec in the parent; clear that in the child.
                    rustix::io::fcntl_setfd(BorrowedFd::borrow_raw(fd), rustix::io::FdFlags::empty())?;
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("spawn child");
        self.procs.push((role.to_string(), child));
        self.procs.len() - 1
    }

    /// Waits for child `i` to exit (at most until `deadline`), asserts success and returns
    /// its parsed `UMBP_RESULT` fields.
    fn finish(&mut self, i: usize, deadline: Instant) -> HashMap<String, f64> {
        let (role, child) = &mut self.procs[i];
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                let mut out = String::new();
                child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
                assert!(status.success(), "child {role} failed: {status}\n{out}");
                return parse_results(&out, role);
            }
            assert!(Instant::now() < deadline, "child {role} did not finish in time (hung?)");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for (_, child) in &mut self.procs {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

fn parse_results(out: &str, role: &str) -> HashMap<String, f64> {
    let line = out.lines().find_map(|l| l.strip_prefix("UMBP_RESULT ")).unwrap_or_else(|| panic!("child {role} reported nothing:\n{out}"));
    line.split_whitespace().filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.to_string(), v.parse().unwrap())).collect()
}

fn stress_secs() -> f64 {
    std::env::var("UMBP_STRESS_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(3.0)
}

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// The fds this child inherited, in the order the parent listed them.
fn child_fds() -> Vec<BorrowedFd<'static>> {
    std::env::var(FDS_ENV)
        .unwrap()
        .split(',')
        // SAFETY: the parent passed these fds open (close-on-exec cleared) and this
        // process never closes them.
        .map(|s| unsafe { BorrowedFd::borrow_raw(s.parse().unwrap()) })
        .collect()
}

/// The child side: does nothing unless this process was started as a child.
#[test]
fn child_entry() {
    let Ok(role) = std::env::var(ROLE_ENV) else {
        return;
    };
    let arg = std::env::var(ARG_ENV).unwrap_or_default();
    match role.as_str() {
        "index_writer" => index_writer(),
        "index_reader" => index_reader(arg.parse().unwrap()),
        "ring_producer" => ring_producer(),
        "ring_consumer" => ring_consumer(),
        other => panic!("unknown role {other}"),
    }
}

// ---------------------------------------------------------------------------------------
// Index

/// Keys the writer churns through; at most `INDEX_LIVE` of them are present at a time.
const INDEX_UNIVERSE: u64 = 4096;
const INDEX_LIVE: u64 = 700;
// Control words (ctl memfd).
const CTL_READY: usize = 0;
const CTL_STOP: usize = 1;

fn index_key(i: u64) -> ObjectKey {
    // Half clustered on few home slots (long probe chains), half spread.
    if i.is_multiple_of(2) {
        ObjectKey::from_words([i << 24 | (i % 16), i << 24])
    } else {
        ObjectKey::from_words([i.wrapping_mul(0x9E37_79B9_7F4A_7C15), i.wrapping_mul(0xC2B2_AE3D_27D4_EB4F)])
    }
}

fn index_writer() {
    let fds = child_fds();
    let len = region_bytes(MIN_SLOTS);
    let index = Mapping::new(fds[0], len, true);
    let ctl = Mapping::new(fds[1], 4096, true);
    // SAFETY: the mapping lives until the end of this function, beyond the writer.
    let view = unsafe { IndexView::attach(index.ptr, len) }.unwrap();
    let mut w = IndexWriter::new(view);
    let mut rng = XorShift(0x5eed_1234_abcd_0001);
    let mut present = vec![false; INDEX_UNIVERSE as usize];
    let mut live = 0u64;
    let mut ops = 0u64;
    // Fill to about half before the readers start.
    while live < INDEX_LIVE / 2 {
        let i = rng.next() % INDEX_UNIVERSE;
        if !present[i as usize] {
            w.insert(index_key(i), checksum(index_key(i))).unwrap();
            present[i as usize] = true;
            live += 1;
        }
    }
    ctl.word(CTL_READY).store(1, Ordering::Release);
    // Keep going until told to stop, and for a minimum of operations (enough for many
    // rebuilds) even if the readers were quick or this process got little CPU.
    while ctl.word(CTL_STOP).load(Ordering::Acquire) == 0 || ops < 200_000 {
        for _ in 0..256 {
            let i = rng.next() % INDEX_UNIVERSE;
            let k = index_key(i);
            if present[i as usize] {
                assert_eq!(w.remove(k), Some(checksum(k)));
                present[i as usize] = false;
                live -= 1;
            } else if live < INDEX_LIVE {
                w.insert(k, checksum(k)).unwrap();
                present[i as usize] = true;
                live += 1;
            }
            ops += 1;
        }
    }
    let snap = w.view().snapshot();
    assert_eq!(snap.live, live);
    println!("UMBP_RESULT ops={ops} rebuilds={} live={live}", snap.rebuilds);
}

fn index_reader(seed: u64) {
    let fds = child_fds();
    let len = region_bytes(MIN_SLOTS);
    // Read-only, like a scheduler's mapping.
    let index = Mapping::new(fds[0], len, false);
    let ctl = Mapping::new(fds[1], 4096, true);
    while ctl.word(CTL_READY).load(Ordering::Acquire) == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    // SAFETY: the mapping lives until the end of this function, beyond the view.
    let view = unsafe { IndexView::attach(index.ptr, len) }.unwrap();
    let mut rng = XorShift(seed | 1);
    let (mut lookups, mut hits, mut bad, mut prefix_calls) = (0u64, 0u64, 0u64, 0u64);
    let end = Instant::now() + Duration::from_secs_f64(stress_secs());
    while Instant::now() < end {
        for _ in 0..1024 {
            let k = index_key(rng.next() % INDEX_UNIVERSE);
            lookups += 1;
            if let Some(loc) = view.lookup(k) {
                hits += 1;
                if loc != checksum(k) {
                    bad += 1;
                    if bad <= 5 {
                        eprintln!("inconsistent hit: {k:?} -> {loc:#x}, want {:#x}", checksum(k));
                    }
                }
            }
        }
        // match_prefix over a short run: count can be anything from 0 to the length.
        let keys: Vec<_> = (0..8).map(|_| index_key(rng.next() % INDEX_UNIVERSE)).collect();
        assert!(view.match_prefix(&keys) <= keys.len());
        prefix_calls += 1;
    }
    println!("UMBP_RESULT lookups={lookups} hits={hits} inconsistent={bad} prefix_calls={prefix_calls}");
}

#[test]
fn index_seqlock_across_processes() {
    let len = region_bytes(MIN_SLOTS);
    let index_fd = memfd("umbp-test-index", len);
    let ctl_fd = memfd("umbp-test-ctl", 4096);
    {
        let index = Mapping::new(index_fd.as_file().as_fd(), len, true);
        // SAFETY: the region is fresh (zeroed) and nobody else maps it yet.
        unsafe { IndexView::init(index.ptr, len, MIN_SLOTS) }.unwrap();
    }
    let ctl = Mapping::new(ctl_fd.as_file().as_fd(), 4096, true);
    let fds = [index_fd.as_raw_fd(), ctl_fd.as_raw_fd()];
    let mut kids = Children::new();
    let writer = kids.spawn("index_writer", &fds, "");
    let readers: Vec<usize> = (0..2).map(|r| kids.spawn("index_reader", &fds, &(0xfeed + r).to_string())).collect();
    let deadline = Instant::now() + Duration::from_secs_f64(stress_secs() + 60.0);
    let mut total = HashMap::<String, f64>::new();
    for (n, r) in readers.into_iter().enumerate() {
        let res = kids.finish(r, deadline);
        eprintln!("index reader {n}: {res:?}");
        assert!(res["hits"] > 0.0, "reader {n} never hit: {res:?}");
        assert!(res["hits"] < res["lookups"], "reader {n} never missed: {res:?}");
        assert_eq!(res["inconsistent"], 0.0, "reader {n} saw torn or wrong entries: {res:?}");
        for (k, v) in res {
            *total.entry(k).or_default() += v;
        }
    }
    ctl.word(CTL_STOP).store(1, Ordering::Release);
    let w = kids.finish(writer, deadline);
    eprintln!("index writer: {w:?}");
    assert!(w["rebuilds"] > 0.0, "writer never rebuilt: {w:?}");
    eprintln!(
        "index stress: {} lookups, {} hits, 0 inconsistent, writer {} ops / {} rebuilds",
        total["lookups"], total["hits"], w["ops"], w["rebuilds"]
    );
}

// ---------------------------------------------------------------------------------------
// Ring

const RING_ENTRIES: u64 = 10_000_000;
const RING_CAPACITY: u32 = 4096;
/// The producer pauses this often, so that the consumer finds the ring empty and sleeps.
const PAUSE_EVERY: u64 = 500_000;
/// A sleep this long means nobody woke the consumer: a lost wakeup.
const SLEEP_TIMEOUT: Duration = Duration::from_secs(5);

fn ring_producer() {
    let fds = child_fds();
    let len = ring_bytes::<u64>(RING_CAPACITY);
    let mem = Mapping::new(fds[0], len, true);
    // SAFETY: the mapping outlives the ring handle.
    let mut p = unsafe { Ring::<u64>::attach(mem.ptr, len) }.unwrap().producer();
    let mut batch = [0u64; 64];
    let mut next = 0u64;
    let (mut wakes, mut full_spins) = (0u64, 0u64);
    let start = Instant::now();
    while next < RING_ENTRIES {
        let n = (RING_ENTRIES - next).min(batch.len() as u64) as usize;
        for (j, b) in batch[..n].iter_mut().enumerate() {
            *b = next + j as u64;
        }
        let (pushed, wake) = p.push_batch(&batch[..n]).unwrap();
        if wake {
            futex::wake(p.tail_word(), 1);
            wakes += 1;
        }
        if pushed == 0 {
            full_spins += 1;
            std::thread::yield_now();
            continue;
        }
        let before = next;
        next += pushed as u64;
        if before / PAUSE_EVERY != next / PAUSE_EVERY {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!("UMBP_RESULT sent={next} secs={secs} wakes={wakes} full_spins={full_spins}");
}

fn ring_consumer() {
    let fds = child_fds();
    let len = ring_bytes::<u64>(RING_CAPACITY);
    let mem = Mapping::new(fds[0], len, true);
    // SAFETY: the mapping outlives the ring handle.
    let mut c = unsafe { Ring::<u64>::attach(mem.ptr, len) }.unwrap().consumer();
    let mut out = Vec::with_capacity(256);
    let mut expect = 0u64;
    let (mut sleeps, mut stalls) = (0u64, 0u64);
    let mut start = None;
    while expect < RING_ENTRIES {
        out.clear();
        if c.pop_batch(&mut out, 256).unwrap() == 0 {
            // Poll a little, then sleep on the tail futex.
            let mut found = false;
            for _ in 0..200 {
                if c.available().unwrap() > 0 {
                    found = true;
                    break;
                }
                std::hint::spin_loop();
            }
            if !found && c.prepare_sleep().unwrap() {
                let t = Instant::now();
                futex::wait(c.tail_word(), c.sleep_value(), Some(SLEEP_TIMEOUT));
                c.finish_sleep();
                sleeps += 1;
                if t.elapsed() >= SLEEP_TIMEOUT {
                    stalls += 1;
                }
            }
            continue;
        }
        start.get_or_insert_with(Instant::now);
        for &v in &out {
            assert_eq!(v, expect, "entry out of order or lost");
            expect += 1;
        }
    }
    let secs = start.map_or(0.0, |s| s.elapsed().as_secs_f64());
    // Nothing more may arrive.
    assert_eq!(c.available().unwrap(), 0);
    println!("UMBP_RESULT received={expect} secs={secs} sleeps={sleeps} stalls={stalls}");
}

#[test]
fn ring_ten_million_across_processes() {
    let len = ring_bytes::<u64>(RING_CAPACITY);
    let fd = memfd("umbp-test-ring", len);
    {
        let mem = Mapping::new(fd.as_file().as_fd(), len, true);
        // SAFETY: fresh region; no other user until the children start.
        unsafe { Ring::<u64>::init(mem.ptr, len, RING_CAPACITY) }.unwrap();
    }
    let fds = [fd.as_raw_fd()];
    let mut kids = Children::new();
    let consumer = kids.spawn("ring_consumer", &fds, "");
    let producer = kids.spawn("ring_producer", &fds, "");
    let deadline = Instant::now() + Duration::from_secs(300);
    let p = kids.finish(producer, deadline);
    let c = kids.finish(consumer, deadline);
    assert_eq!(p["sent"], RING_ENTRIES as f64);
    assert_eq!(c["received"], RING_ENTRIES as f64);
    assert!(c["sleeps"] > 0.0, "consumer never slept: {c:?}");
    assert!(p["wakes"] > 0.0, "producer never woke the consumer: {p:?}");
    assert_eq!(c["stalls"], 0.0, "a sleep ran into its timeout: lost wakeup? {c:?}");
    eprintln!(
        "ring: {} u64 entries across processes in {:.3} s = {:.1} M entries/s (consumer slept {} times, producer woke {} times)",
        RING_ENTRIES,
        c["secs"],
        RING_ENTRIES as f64 / c["secs"] / 1e6,
        c["sleeps"],
        p["wakes"]
    );
}
