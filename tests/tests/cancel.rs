//! The cancel contract (docs/protocol.md "Cancelling a transfer"): after a worker gives up
//! on a transfer, the pool never reads or writes that transfer's blocks again — whether
//! the pool was stopped (SIGSTOP) before it saw the transfer or held mid-transfer — and
//! what it read after the worker gave up is never published.
//!
//! Before the contract (the connector dropped a timed-out transfer and vLLM reused its
//! blocks), a resumed pool copied the new owner's KV and published it under the old keys:
//! `a_store_cancelled_while_the_pool_is_stopped_publishes_nothing` then loads the new
//! owner's bytes (Loaded) instead of Missing.

mod common;
mod engine;
use common::*;
use engine::*;

use std::time::Duration;

use umbp_pool::{Pool, PoolConfig};
use umbp_protocol::ObjectKey;
use umbp_worker::{BlockStatus, CancelOutcome, CqeError, Worker, WorkerConfig};

const TIMEOUT: Duration = Duration::from_millis(300);

fn batch(first: u128, n: u64) -> Vec<(ObjectKey, u64)> {
    (0..n).map(|i| (ObjectKey(first + i as u128), i)).collect()
}

/// Waits until the worker has no transfer the pool owes an answer for: a fresh store is
/// accepted again (the pool answered every cancelled one too).
fn until_pool_answered_all(e: &mut Engine, probe_first: u128) {
    let ok = eventually(Duration::from_secs(10), || match e.w.store(0, &batch(probe_first, 1)) {
        Ok(id) => e.w.wait(id, Duration::from_secs(5)).is_some(),
        Err(_) => false,
    });
    assert!(ok, "the resumed pool never answered the cancelled transfers");
}

#[test]
fn a_store_cancelled_while_the_pool_is_stopped_publishes_nothing() {
    let pool = PoolProcess::start(&unique_socket("cancel-store"), &["--capacity", "256MiB"]);
    let mut e = Engine::connect(&pool.socket, TIMEOUT);
    pool.signal(libc::SIGSTOP);
    let id = e.store(100, 8).unwrap();
    assert!(e.w.wait(id, TIMEOUT + Duration::from_millis(100)).is_none(), "a stopped pool answers nothing");
    assert_eq!(e.w.cancel(id), CancelOutcome::Cancelled);
    let c = e.w.wait(id, Duration::ZERO).expect("a cancelled transfer completes at once");
    assert_eq!(c.error, Some(CqeError::Cancelled));
    assert!(c.statuses.iter().all(|s| *s == BlockStatus::Failed), "{c:?}");
    // The blocks are the engine's again: another request's KV goes into them.
    for i in 0..8 {
        e.fill(i, ObjectKey(9_000 + i as u128));
    }
    pool.signal(libc::SIGCONT);
    until_pool_answered_all(&mut e, 50_000);
    let st = e.load_wait(100, 8);
    assert!(st.iter().all(|s| *s == BlockStatus::Missing), "a cancelled store must publish nothing, got {st:?}");
    assert!(pool.report().counters.transfers_cancelled >= 1, "{}", pool.report().counters);
}

#[test]
fn a_load_cancelled_while_the_pool_is_stopped_never_writes_the_blocks() {
    let pool = PoolProcess::start(&unique_socket("cancel-load"), &["--capacity", "256MiB"]);
    let mut e = Engine::connect(&pool.socket, TIMEOUT);
    let id = e.store(200, 8).unwrap();
    assert!(e.w.wait(id, Duration::from_secs(10)).expect("stored").all_ok());
    pool.signal(libc::SIGSTOP);
    let id = e.w.load(0, &batch(200, 8)).unwrap();
    assert!(e.w.wait(id, TIMEOUT + Duration::from_millis(100)).is_none());
    assert_eq!(e.w.cancel(id), CancelOutcome::Cancelled);
    assert_eq!(e.w.wait(id, Duration::ZERO).expect("completes at once").error, Some(CqeError::Cancelled));
    for i in 0..8 {
        e.fill(i, ObjectKey(7_000 + i as u128));
    }
    pool.signal(libc::SIGCONT);
    until_pool_answered_all(&mut e, 60_000);
    for i in 0..8 {
        assert!(e.verify(i, ObjectKey(7_000 + i as u128)), "block {i}: the pool wrote a cancelled load's block");
    }
    // A cancel after the completion changes nothing.
    assert_eq!(e.w.cancel(id), CancelOutcome::NotInFlight);
}

/// An in-process pool whose copy thread can be held at a chosen stage, over a memfd
/// "GPU" of `BLOCKS` blocks of one 64 KiB page each, in stages of one block.
struct Held {
    _pool: Pool,
    w: Worker,
    kv: umbp_ipc::SharedMemory,
}

impl Held {
    fn start(tag: &str) -> Held {
        let socket = unique_socket(tag);
        let cfg = PoolConfig { socket_path: socket.clone(), capacity_bytes: 64 << 20, copy_threads: 1, copy_stage_bytes: PAGE, ..PoolConfig::default() };
        let pool = Pool::start(cfg).expect("pool starts");
        let mut wc = WorkerConfig::new(&socket, 5);
        wc.timeout = TIMEOUT;
        let (w, kv) = worker_on_memfd(wc, PAGE, BLOCKS);
        Held { _pool: pool, w, kv }
    }

    fn fill(&self, block: u64, key: u128) {
        let mut page = vec![0u8; PAGE as usize];
        fill_pattern(key, &mut page);
        // SAFETY: the test's own mapping of PAGE * BLOCKS bytes; the pool writes it only
        // through loads, none of which runs on this block now (that is what is tested).
        unsafe { std::ptr::copy_nonoverlapping(page.as_ptr(), self.kv.as_ptr().add((block * PAGE) as usize), PAGE as usize) };
    }

    fn holds(&self, block: u64, key: u128) -> bool {
        let mut page = vec![0u8; PAGE as usize];
        fill_pattern(key, &mut page);
        // SAFETY: as in `fill`; read-only.
        let got = unsafe { std::slice::from_raw_parts(self.kv.as_ptr().add((block * PAGE) as usize), PAGE as usize) };
        got == page.as_slice()
    }
}

#[test]
fn a_store_abandoned_mid_transfer_publishes_nothing_read_after_the_abandon() {
    let h = &mut Held::start("cancel-held-store");
    for i in 0..4 {
        h.fill(i, 300 + i as u128);
    }
    // Held after claiming stage 2 of 4 (one block per stage): stages 0-2 are started.
    let pause = umbp_pool::fault::pause_on_copy_of(ObjectKey(302));
    let id = h.w.store(0, &batch(300, 4)).unwrap();
    assert!(pause.wait_reached(Duration::from_secs(10)), "the copy thread reached the stage");
    // A store is the worker's to cancel even when started: its blocks go back at once.
    assert_eq!(h.w.cancel(id), CancelOutcome::Cancelled);
    for i in 0..4 {
        h.fill(i, 9_300 + i as u128);
    }
    pause.release();
    // Nothing read after the abandon is published; the later stage never starts.
    let probe = eventually(Duration::from_secs(10), || {
        let id = h.w.load(0, &batch(300, 4)).unwrap();
        match h.w.wait(id, Duration::from_secs(5)) {
            Some(c) => c.statuses.iter().all(|s| *s == BlockStatus::Missing),
            None => false,
        }
    });
    assert!(probe, "an abandoned store published blocks the worker had given back");
}

#[test]
fn a_started_load_keeps_its_blocks_and_starts_no_further_stage() {
    let h = &mut Held::start("cancel-held-load");
    for i in 0..4 {
        h.fill(i, 400 + i as u128);
    }
    let id = h.w.store(0, &batch(400, 4)).unwrap();
    assert!(h.w.wait(id, Duration::from_secs(10)).expect("stored").all_ok());
    for i in 0..4 {
        h.fill(i, 1);
    }
    // Held after claiming stage 1 of 4: stages 0 and 1 are started, 2 and 3 are not.
    let pause = umbp_pool::fault::pause_on_copy_of(ObjectKey(401));
    let id = h.w.load(0, &batch(400, 4)).unwrap();
    assert!(pause.wait_reached(Duration::from_secs(10)));
    assert_eq!(h.w.cancel(id), CancelOutcome::Started, "a started load keeps its blocks");
    assert!(h.w.wait(id, TIMEOUT).is_none(), "and completes only when the pool does");
    pause.release();
    let c = h.w.wait(id, Duration::from_secs(10)).expect("completes once the pool goes on");
    assert_eq!(c.error, None);
    assert_eq!(&c.statuses[..2], &[BlockStatus::Loaded; 2], "{c:?}");
    assert_eq!(&c.statuses[2..], &[BlockStatus::Failed; 2], "stages after the abandon never start: {c:?}");
    assert!(h.holds(0, 400) && h.holds(1, 401), "started stages landed");
    assert!(h.holds(2, 1) && h.holds(3, 1), "blocks of stages after the abandon were never written");
}
