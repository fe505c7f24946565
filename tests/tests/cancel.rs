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
        Self::start_with(tag, |_| {})
    }

    /// Like [`Held::start`], with the pool's configuration changed by `tune`.
    fn start_with(tag: &str, tune: impl FnOnce(&mut PoolConfig)) -> Held {
        let socket = unique_socket(tag);
        let mut cfg = PoolConfig {
            socket_path: socket.clone(),
            capacity_bytes: 64 << 20,
            copy_threads: 1,
            copy_stage_bytes: PAGE,
            ..PoolConfig::default()
        };
        tune(&mut cfg);
        let pool = Pool::start(cfg).expect("pool starts");
        let (w, kv) = Self::attach(&socket);
        Held { _pool: pool, w, kv }
    }

    /// Another worker of the same namespace, with its own memfd "GPU".
    fn attach(socket: &std::path::Path) -> (Worker, umbp_ipc::SharedMemory) {
        let mut wc = WorkerConfig::new(socket, 5);
        wc.timeout = TIMEOUT;
        worker_on_memfd(wc, PAGE, BLOCKS)
    }

    /// Shuts the worker's socket down under it (its peer, the pool, sees a hang-up), the
    /// way a worker's connection ends when its process dies or its `Worker` is dropped,
    /// but without the worker abandoning any state word: what the pool does then is its
    /// own decision.
    fn cut_the_workers_socket(&self) {
        let path = self._pool.socket_path().to_path_buf();
        let mut cut = 0;
        for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
            let Ok(fd) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
            // SAFETY: a zeroed sockaddr_un is a valid out-buffer of the length passed.
            let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
            // SAFETY: `addr`/`len` describe a writable sockaddr_un; a non-socket fd fails.
            if unsafe { libc::getpeername(fd, &mut addr as *mut _ as *mut libc::sockaddr, &mut len) } != 0 {
                continue;
            }
            let bytes: Vec<u8> = addr.sun_path.iter().take_while(|c| **c != 0).map(|c| *c as u8).collect();
            // Only a client connected to this pool's socket: the worker's end (the pool's
            // accepted ends have an unnamed peer).
            if addr.sun_family as i32 == libc::AF_UNIX && bytes == path.as_os_str().as_encoded_bytes() {
                // SAFETY: shutting down a socket this process holds; the fd stays open.
                assert_eq!(unsafe { libc::shutdown(fd, libc::SHUT_RDWR) }, 0);
                cut += 1;
            }
        }
        assert_eq!(cut, 1, "exactly the one worker of this pool is connected");
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

/// Releases a held pool thread when dropped, also when the test fails first (a pool
/// thread held for ever would hang the pool's shutdown, not fail the test).
struct Released(std::sync::Arc<umbp_pool::fault::Pause>);

impl std::ops::Deref for Released {
    type Target = umbp_pool::fault::Pause;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl Drop for Released {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// Issue #31 item 2 (pool side): a store held mid-transfer whose worker's connection ends
/// (its socket hung up: the worker died or dropped its `Worker`) publishes nothing, even
/// though the worker never set ABANDONED: the pool itself treats a gone peer as having
/// abandoned the transfer. Before, the pool published the blocks as they were when its
/// copies ran (here: the new owner's bytes, written after the connection ended).
#[test]
fn a_store_whose_peer_hung_up_publishes_nothing() {
    let h = &mut Held::start("cancel-peer-gone-store");
    for i in 0..4 {
        h.fill(i, 800 + i as u128);
    }
    // Held after claiming stage 2 of 4 (one block per stage), before any copy ran.
    let pause = Released(umbp_pool::fault::pause_on_copy_of(ObjectKey(802)));
    let _id = h.w.store(0, &batch(800, 4)).unwrap();
    assert!(pause.wait_reached(Duration::from_secs(10)), "the copy thread reached the stage");
    h.cut_the_workers_socket();
    // The blocks are another request's now (an engine that lost its pool reuses them).
    for i in 0..4 {
        h.fill(i, 9_800 + i as u128);
    }
    pause.release();
    let (mut w2, _kv2) = Held::attach(h._pool.socket_path());
    let probe = eventually(Duration::from_secs(10), || {
        let id = w2.load(0, &batch(800, 4)).unwrap();
        match w2.wait(id, Duration::from_secs(5)) {
            Some(c) => c.statuses.iter().all(|s| *s == BlockStatus::Missing),
            None => false,
        }
    });
    assert!(probe, "a store whose peer was gone published blocks the peer had given back");
}

/// Issue #31 item 2 (pool side), loads: once the worker's connection ended, the pool
/// claims no further stage of its load, so those blocks are never written (the engine may
/// reuse them); before, every later stage started as if the worker were there.
#[test]
fn a_load_whose_peer_hung_up_starts_no_further_stage() {
    let h = &mut Held::start("cancel-peer-gone-load");
    for i in 0..4 {
        h.fill(i, 850 + i as u128);
    }
    let id = h.w.store(0, &batch(850, 4)).unwrap();
    assert!(h.w.wait(id, Duration::from_secs(10)).expect("stored").all_ok());
    for i in 0..4 {
        h.fill(i, 1);
    }
    // Held after claiming stage 1 of 4: stages 0 and 1 are started, 2 and 3 are not.
    let pause = Released(umbp_pool::fault::pause_on_copy_of(ObjectKey(851)));
    let _id = h.w.load(0, &batch(850, 4)).unwrap();
    assert!(pause.wait_reached(Duration::from_secs(10)));
    h.cut_the_workers_socket();
    pause.release();
    let (mut w2, _kv2) = Held::attach(h._pool.socket_path());
    // The pool is done with the load once a later one (another worker's) completes.
    let answered = eventually(Duration::from_secs(10), || {
        let id = w2.load(0, &batch(850, 1)).unwrap();
        w2.wait(id, Duration::from_secs(5)).is_some()
    });
    assert!(answered);
    assert!(h.holds(2, 1) && h.holds(3, 1), "blocks of stages after the hang-up were written");
}

/// Issue #31 item 3: a load waiting on a slow SSD read (held in the SSD tier's fetch) has
/// not started: its stage is claimed only once its promotions are in DRAM, so a cancel
/// then is `Cancelled` (the blocks are the worker's at once), not `Started` (which made
/// the connector wait for the fetch, without bound). The fetch goes on, its object stays
/// in DRAM (unpinned, published) and the blocks are never written.
#[test]
fn a_load_waiting_on_an_ssd_promotion_is_cancellable() {
    let dir = tempfile::Builder::new().prefix("umbp-cancel-ssd-").tempdir_in("/var/tmp").expect("tempdir in /var/tmp");
    // DRAM for 32 objects of 64 KiB; 128 stored: the oldest go to SSD.
    let h = &mut Held::start_with("cancel-ssd-promotion", |c| {
        c.capacity_bytes = 32 * PAGE;
        c.min_object_bytes = PAGE;
        c.ssd = Some(small_ssd(dir.path()));
    });
    // In batches of 8, so that the evictor keeps up (a store finding no room is NotStored).
    for round in 0..16u128 {
        let first = 1_000 + round * 8;
        for i in 0..8 {
            h.fill(i, first + i as u128);
        }
        let id = h.w.store(0, &batch(first, 8)).unwrap();
        let c = h.w.wait(id, Duration::from_secs(10)).expect("stored");
        assert!(round > 0 || c.all_ok(), "the first keys are stored: {c:?}");
    }
    // Key 1000, stored first and never touched since, is the first demoted to SSD.
    let access = h._pool.cluster_access();
    let on_ssd =
        eventually(Duration::from_secs(10), || h._pool.report().tiers.ssd >= 8 && access.dram_object(0, ObjectKey(1_000)).is_none());
    assert!(on_ssd, "objects never reached SSD: {:?}", h._pool.report().tiers);
    let pause = Released(umbp_pool::fault::pause_on_promotion_of(ObjectKey(1_000)));
    h.fill(0, 1);
    let id = h.w.load(0, &batch(1_000, 1)).unwrap();
    assert!(pause.wait_reached(Duration::from_secs(10)), "the load's SSD read began (key 1000 was on SSD)");
    assert_eq!(h.w.cancel(id), CancelOutcome::Cancelled, "no byte reached the worker: the load had not started");
    assert_eq!(h.w.wait(id, Duration::ZERO).expect("a cancelled load completes at once").error, Some(CqeError::Cancelled));
    h.fill(0, 9_000);
    pause.release();
    // The pool answered the cancelled load (a later one completes) and the promoted object
    // is in DRAM, unpinned: it loads, byte-exact.
    let loaded = eventually(Duration::from_secs(10), || {
        let id = h.w.load(0, &[(ObjectKey(1_000), 1)]).unwrap();
        h.w.wait(id, Duration::from_secs(5)).is_some_and(|c| c.statuses == [BlockStatus::Loaded])
    });
    assert!(loaded, "the promoted object loads once the fetch is done");
    assert!(h.holds(1, 1_000), "loaded byte-exact");
    assert!(h.holds(0, 9_000), "the cancelled load never wrote its block");
}
