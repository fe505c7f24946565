//! Issue #33 item 4 on the host backend: an engine attaches, registers, stores and loads
//! at once while a big pool is still pinning its DRAM in the background, and the pool
//! unpins every chunk at stop.
//!
//! No GPU here, so the pool pins with `PacedMlock`: it page-locks each chunk for real
//! (mlock(2)) and then waits, so that one 128 MiB chunk takes as long as a slow GPU driver
//! would take (300 ms, about a fifth of the 1.6 GiB/s measured on the H100 host). The pool
//! takes its pinners as an argument (`Pool::start_with_pinners`); nothing in the pool's
//! code knows this one is a test's.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use umbp_integration_tests::{eventually, fill_pattern, unique_socket, verify_pattern, worker_on_memfd};
use umbp_pool::{DramPinner, Pool, PoolConfig};
use umbp_worker::{ObjectKey, WorkerConfig};

const PAGE: u64 = 64 << 10;
const BLOCKS: u64 = 32;
const CAPACITY: u64 = 1 << 30;
const PER_CHUNK: Duration = Duration::from_millis(300);

/// Page-locks with mlock(2), paced like a slow driver; records what it pinned and unpinned.
#[derive(Default)]
struct PacedMlock {
    pinned: Mutex<Vec<(usize, usize, Instant)>>,
    unpinned: Mutex<Vec<usize>>,
}

impl DramPinner for PacedMlock {
    fn name(&self) -> String {
        "mlock (paced like a slow driver)".into()
    }

    unsafe fn pin(&self, base: *mut u8, len: usize) -> Result<(), String> {
        let started = Instant::now();
        // SAFETY: the pool keeps `[base, base + len)` mapped until `unpin` (the trait's contract).
        if unsafe { libc::mlock(base.cast(), len) } != 0 {
            return Err(format!("mlock: {}", std::io::Error::last_os_error()));
        }
        std::thread::sleep(PER_CHUNK.saturating_sub(started.elapsed()));
        self.pinned.lock().unwrap().push((base as usize, len, Instant::now()));
        Ok(())
    }

    unsafe fn unpin(&self, base: *mut u8) -> Result<(), String> {
        let len = self.pinned.lock().unwrap().iter().find(|p| p.0 == base as usize).map(|p| p.1).ok_or("never pinned")?;
        // SAFETY: pinned above with this length; the pool no longer copies there.
        if unsafe { libc::munlock(base.cast(), len) } != 0 {
            return Err(format!("munlock: {}", std::io::Error::last_os_error()));
        }
        self.unpinned.lock().unwrap().push(base as usize);
        Ok(())
    }
}

#[test]
fn a_worker_attaches_stores_and_loads_while_the_pool_is_still_pinning() {
    let socket = unique_socket("pinning-host");
    let pinner = Arc::new(PacedMlock::default());
    let config = PoolConfig { socket_path: socket.clone(), capacity_bytes: CAPACITY, ..PoolConfig::default() };
    let pool = Pool::start_with_pinners(config, vec![pinner.clone() as Arc<dyn DramPinner>]).expect("pool starts");
    // The first 256 MiB is pinned before `start` returns; 6 chunks of 128 MiB remain.
    let (registered, done) = pool.dram_registration();
    assert!(!done && registered < CAPACITY, "the background pass has not begun yet: {registered} bytes, done {done}");

    let began = Instant::now();
    let (mut w, kv) = worker_on_memfd(WorkerConfig::new(&socket, 5), PAGE, BLOCKS);
    let half = BLOCKS / 2;
    let keys: Vec<(ObjectKey, u64)> = (0..half).map(|i| (ObjectKey(0x5eed_0000 + i as u128), i)).collect();
    for &(key, block) in &keys {
        let mut page = vec![0u8; PAGE as usize];
        fill_pattern(key.0, &mut page);
        // SAFETY: block `block` of the worker's memfd KV, mapped for the test's life; no transfer runs.
        unsafe { std::ptr::copy_nonoverlapping(page.as_ptr(), kv.as_ptr().add((block * PAGE) as usize), PAGE as usize) };
    }
    let id = w.store(0, &keys).expect("store accepted");
    let c = w.wait(id, Duration::from_secs(5)).expect("store completes");
    assert!(c.all_ok(), "stores while the pool pins: {c:?}");
    // Load into the other half of the KV, byte-exact.
    let into: Vec<(ObjectKey, u64)> = keys.iter().map(|&(k, b)| (k, b + half)).collect();
    let id = w.load(0, &into).expect("load accepted");
    let c = w.wait(id, Duration::from_secs(5)).expect("load completes");
    assert!(c.all_ok(), "loads while the pool pins: {c:?}");
    for &(key, block) in &into {
        // SAFETY: as above; the load completed.
        let got = unsafe { std::slice::from_raw_parts(kv.as_ptr().add((block * PAGE) as usize), PAGE as usize) };
        assert!(verify_pattern(key.0, got), "block {block} loaded for {key:?} is not what was stored");
    }
    let took = began.elapsed();
    let report = pool.report();
    let (registered, done) = pool.dram_registration();
    assert!(
        !done && registered < CAPACITY,
        "the pool finished pinning ({registered} of {CAPACITY} bytes) before the worker was served: the test saw nothing"
    );
    assert!(took < Duration::from_secs(1), "attach + register + store + load took {took:?} while the pool pinned");
    assert!(!report.pool.dram_registration_done && report.pool.dram_registered_bytes >= 256 << 20, "progress in the report: {report}");

    // The pass ends with the whole tier pinned, in 128 MiB chunks after the first 256 MiB.
    assert!(eventually(Duration::from_secs(20), || pool.dram_registration().1), "registration never finished");
    assert_eq!(pool.report().pool.dram_registered_bytes, CAPACITY);
    let pinned = pinner.pinned.lock().unwrap().clone();
    let base = pinned[0].0;
    let mut next = base;
    for &(b, len, _) in &pinned {
        assert_eq!(b, next, "chunks pinned in order, without gaps: {pinned:?}");
        next = b + len;
    }
    assert_eq!(next - base, CAPACITY as usize, "the whole tier is pinned");
    assert!(pinner.unpinned.lock().unwrap().is_empty(), "nothing unpinned while serving");

    drop(w);
    pool.shutdown();
    let mut unpinned = pinner.unpinned.lock().unwrap().clone();
    unpinned.sort_unstable();
    let mut bases: Vec<usize> = pinned.iter().map(|p| p.0).collect();
    bases.sort_unstable();
    assert_eq!(unpinned, bases, "every pinned chunk is unpinned once at stop");
}
