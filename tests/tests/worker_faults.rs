//! The worker's side of the fault paths of issue #31 (docs/connection.md "A lost pool"):
//!
//! - a signal storm while the engine polls never makes the worker drop a live pool (a
//!   zero-timeout `poll` interrupted by a signal returned EINTR, which read as "pool gone":
//!   the worker failed a store the pool still held, the engine reused its blocks and the
//!   pool published the new owner's bytes under the old keys);
//! - a dropped or disconnected worker abandons its transfers: a live pool publishes none
//!   of its stores, and a load the pool started keeps its blocks until the pool answers.
//!
//! In-process pools whose copy thread is held at a chosen stage (umbp_pool::fault), over a
//! memfd "GPU" of one 64 KiB page per block, in stages of one block. The hold point is one
//! global slot, so the tests here take turns.

mod common;
use common::*;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use umbp_ipc::SharedMemory;
use umbp_pool::{Pool, PoolConfig};
use umbp_protocol::ObjectKey;
use umbp_worker::{BlockStatus, CancelOutcome, Worker, WorkerConfig};

const PAGE: u64 = 64 << 10;
const BLOCKS: u64 = 8;
const TIMEOUT: Duration = Duration::from_millis(300);

/// The copy-thread hold point is one process-wide slot: one test at a time.
static TURN: Mutex<()> = Mutex::new(());

/// Holds the copy thread at the stage holding `key`; the hold ends when the guard drops,
/// also when an assertion fails (else the pool's drop would wait for the held thread).
struct Hold(Arc<umbp_pool::fault::Pause>);

impl Hold {
    fn at(key: u128) -> Hold {
        Hold(umbp_pool::fault::pause_on_copy_of(ObjectKey(key)))
    }
}

impl std::ops::Deref for Hold {
    type Target = umbp_pool::fault::Pause;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.0.release();
    }
}

fn batch(first: u128, n: u64) -> Vec<(ObjectKey, u64)> {
    (0..n).map(|i| (ObjectKey(first + i as u128), i)).collect()
}

struct Held {
    pool: Pool,
    socket: std::path::PathBuf,
    w: Option<Worker>,
    kv: SharedMemory,
}

impl Held {
    fn start(tag: &str) -> Held {
        let socket = unique_socket(tag);
        let cfg = PoolConfig {
            socket_path: socket.clone(),
            capacity_bytes: 64 << 20,
            copy_threads: 1,
            copy_stage_bytes: PAGE,
            ..PoolConfig::default()
        };
        let pool = Pool::start(cfg).expect("pool starts");
        let (w, kv) = worker_on_memfd(Self::config(&socket), PAGE, BLOCKS);
        Held { pool, socket, w: Some(w), kv }
    }

    fn config(socket: &std::path::Path) -> WorkerConfig {
        let mut wc = WorkerConfig::new(socket, 5);
        wc.timeout = TIMEOUT;
        wc
    }

    fn w(&mut self) -> &mut Worker {
        self.w.as_mut().expect("worker attached")
    }

    fn fill(&self, block: u64, key: u128) {
        let mut page = vec![0u8; PAGE as usize];
        fill_pattern(key, &mut page);
        // SAFETY: the test's own mapping of PAGE * BLOCKS bytes; no load into this block
        // is in flight when the tests fill it.
        unsafe { std::ptr::copy_nonoverlapping(page.as_ptr(), self.kv.as_ptr().add((block * PAGE) as usize), PAGE as usize) };
    }

    fn holds(kv: &SharedMemory, block: u64, key: u128) -> bool {
        let mut page = vec![0u8; PAGE as usize];
        fill_pattern(key, &mut page);
        // SAFETY: as in `fill`; read-only.
        let got = unsafe { std::slice::from_raw_parts(kv.as_ptr().add((block * PAGE) as usize), PAGE as usize) };
        got == page.as_slice()
    }

    /// Loads `n` keys from `first` with a fresh worker; for each key: None when the pool
    /// has nothing under it, else which of `old` (the bytes stored) or `new` (the bytes
    /// the engine put in the blocks after the pool was dropped) it holds.
    fn published(&self, first: u128, n: u64, old: u128, new: u128) -> Vec<Option<&'static str>> {
        let (mut r, kv) = worker_on_memfd(Self::config(&self.socket), PAGE, BLOCKS);
        let id = r.load(0, &batch(first, n)).unwrap();
        let c = r.wait(id, Duration::from_secs(10)).expect("the probe load completes");
        (0..n)
            .map(|i| match c.statuses[i as usize] {
                BlockStatus::Loaded if Self::holds(&kv, i, new + i as u128) => Some("NEW bytes"),
                BlockStatus::Loaded if Self::holds(&kv, i, old + i as u128) => Some("old bytes"),
                BlockStatus::Loaded => Some("other bytes"),
                _ => None,
            })
            .collect()
    }
}

extern "C" fn on_signal(_: libc::c_int) {}

/// SIGUSR2 with a handler installed without SA_RESTART (as CPython installs its own), sent
/// to the calling thread by another thread as fast as it goes, until the flag is set.
fn signal_storm() -> (Arc<AtomicBool>, std::thread::JoinHandle<u64>) {
    // SAFETY: a handler that does nothing, for SIGUSR2, which nothing else here uses.
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = on_signal as *const () as usize;
        libc::sigemptyset(&mut act.sa_mask);
        act.sa_flags = 0;
        assert_eq!(libc::sigaction(libc::SIGUSR2, &act, std::ptr::null_mut()), 0);
    }
    // SAFETY: no preconditions.
    let target = unsafe { libc::pthread_self() };
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let storm = std::thread::spawn(move || {
        let mut sent = 0;
        while !s.load(Ordering::Relaxed) {
            // SAFETY: the target thread joins this one before it ends.
            sent += (unsafe { libc::pthread_kill(target, libc::SIGUSR2) } == 0) as u64;
        }
        sent
    });
    (stop, storm)
}

/// Issue #31 item 1, end to end. Before the fix the worker called `lose()` within a
/// fraction of a second of the storm, failed the held store, and (the engine having
/// refilled its blocks) the resumed pool published the new bytes under the old keys.
#[test]
fn a_signal_storm_while_polling_never_drops_a_live_pool_nor_publishes_foreign_bytes() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let mut h = Held::start("wf-storm");
    for i in 0..4 {
        h.fill(i, 500 + i as u128);
    }
    // Held after claiming stage 1 of 4: the store is in the pool, not finished.
    let pause = Hold::at(501);
    let id = h.w().store(0, &batch(500, 4)).unwrap();
    assert!(pause.wait_reached(Duration::from_secs(10)), "the copy thread reached the stage");
    let (stop, storm) = signal_storm();
    let start = Instant::now();
    let mut early = None;
    let mut calls = 0u64;
    while start.elapsed() < Duration::from_secs(2) && early.is_none() {
        calls += 1;
        early = h.w().poll().into_iter().find(|c| c.id == id);
        if early.is_none() && calls.is_multiple_of(16) {
            early = h.w().wait(id, Duration::from_millis(1));
        }
    }
    stop.store(true, Ordering::Relaxed);
    let sent = storm.join().unwrap();
    assert!(sent > 1000, "the storm sent only {sent} signals: nothing was tested");
    if early.is_some() {
        // What an engine does with a failed store: its blocks take another request's KV.
        for i in 0..4 {
            h.fill(i, 9_500 + i as u128);
        }
    }
    pause.release();
    let dropped = early.is_some();
    let done = match early {
        Some(c) => c,
        None => h.w().wait(id, Duration::from_secs(10)).expect("the store completes once the pool goes on"),
    };
    let published = h.published(500, 4, 500, 9_500);
    assert!(
        !published.contains(&Some("NEW bytes")),
        "foreign bytes published under the held store's keys: {published:?} (store completion {done:?})"
    );
    assert!(
        !dropped,
        "the worker dropped a live pool under {sent} signals ({calls} polls in {:?}): the held store completed {done:?} before the pool finished it",
        start.elapsed()
    );
    assert!(done.all_ok(), "{done:?}");
    assert_eq!(published, vec![Some("old bytes"); 4]);
    assert!(h.w().is_connected());
}

/// Issue #31 item 2. Before the fix a dropped worker's store held in the pool was finished
/// after the drop and all its keys were published holding what the blocks held then.
#[test]
fn a_dropped_workers_held_store_publishes_nothing_read_after_the_drop() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let mut h = Held::start("wf-drop");
    for i in 0..4 {
        h.fill(i, 600 + i as u128);
    }
    // Held after claiming stage 1 (key 601) of 4: stage 0 landed and may be published.
    let pause = Hold::at(601);
    h.w().store(0, &batch(600, 4)).unwrap();
    assert!(pause.wait_reached(Duration::from_secs(10)));
    drop(h.w.take());
    // The engine's blocks are free once the worker is gone: another request's KV.
    for i in 0..4 {
        h.fill(i, 9_600 + i as u128);
    }
    pause.release();
    // Let the pool finish (or drop) the held job before probing.
    std::thread::sleep(Duration::from_millis(200));
    let published = h.published(600, 4, 600, 9_600);
    assert!(!published.contains(&Some("NEW bytes")), "a dropped worker's store published bytes read after the drop: {published:?}");
    assert_eq!(&published[2..], &[None, None], "stages after the drop never start: {published:?}");
    let _ = &h.pool;
}

/// Issue #31 item 2, a load: a worker that drops its attachment (a lost pool whose process
/// lives) keeps a started load's blocks until the pool answers it, and fails an unstarted
/// one at once. Before the fix `lose()` failed every transfer at once, so the engine reused
/// blocks the pool was still writing.
#[test]
fn a_started_load_of_a_lost_attachment_keeps_its_blocks_until_the_pool_answers() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let mut h = Held::start("wf-lose-load");
    for i in 0..4 {
        h.fill(i, 700 + i as u128);
    }
    let id = h.w().store(0, &batch(700, 4)).unwrap();
    assert!(h.w().wait(id, Duration::from_secs(10)).expect("stored").all_ok());
    for i in 0..4 {
        h.fill(i, 1);
    }
    // Held after claiming stage 1 of 4.
    let pause = Hold::at(701);
    let id = h.w().load(0, &batch(700, 4)).unwrap();
    assert!(pause.wait_reached(Duration::from_secs(10)));
    h.w().disconnect();
    let early: Vec<_> = h.w().poll().into_iter().filter(|c| c.id == id).collect();
    assert!(early.is_empty(), "a started load failed while the pool process lives and may still write its blocks: {early:?}");
    assert_eq!(h.w().cancel(id), CancelOutcome::Started);
    assert!(h.w().wait(id, TIMEOUT).is_none(), "it completes only when the pool does");
    assert_eq!(h.w().quarantined_count(), 1);
    pause.release();
    let c = h.w().wait(id, Duration::from_secs(10)).expect("completes once the pool goes on");
    assert_eq!(&c.statuses[..2], &[BlockStatus::Loaded; 2], "{c:?}");
    assert_eq!(&c.statuses[2..], &[BlockStatus::Failed; 2], "no stage starts after the loss: {c:?}");
    assert!(Held::holds(&h.kv, 0, 700) && Held::holds(&h.kv, 1, 701), "started stages landed");
    assert!(Held::holds(&h.kv, 2, 1) && Held::holds(&h.kv, 3, 1), "blocks of later stages were never written");
    assert_eq!(h.w().quarantined_count(), 0);
    // The worker attached again and works.
    let ok = eventually(Duration::from_secs(10), || {
        h.w().store(0, &batch(800, 1)).ok().and_then(|id| h.w().wait(id, Duration::from_secs(5))).is_some_and(|c| c.all_ok())
    });
    assert!(ok, "the worker reattaches after a disconnect");
}
