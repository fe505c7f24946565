//! docs/connection.md "Failure rules", one test per row: the pool is killed, stalled, restarted; workers are killed
//! mid-transfer; the pool is absent at start. The test process is the engine worker here
//! (real `umbp_worker::Worker`, real socket); the pool is a real `umbp-pool` process.

mod common;
mod engine;
use common::*;
use engine::*;

use std::time::{Duration, Instant};

use umbp_protocol::ObjectKey;
use umbp_scheduler::IndexClient;
use umbp_worker::{BlockStatus, Worker, WorkerConfig, WorkerError};

#[test]
fn pool_absent_at_startup_names_the_socket() {
    let socket = unique_socket("absent");
    let mut cfg = WorkerConfig::new(&socket, 1);
    cfg.startup_timeout = Duration::from_millis(300);
    let t = Instant::now();
    let e = Worker::connect(cfg).err().expect("no pool there");
    assert!(e.to_string().contains(socket.to_str().unwrap()), "{e}");
    assert!(t.elapsed() < Duration::from_secs(3));
    let e = IndexClient::connect(&socket, 1, Duration::from_millis(200)).err().expect("no pool there");
    assert!(e.to_string().contains(socket.to_str().unwrap()), "{e}");
}

/// A 256 MiB pool (socket tagged `tag`), an engine on it with `timeout`, and a scheduler
/// index of the engine's namespace.
fn pool_engine_index(tag: &str, timeout: Duration) -> (PoolProcess, Engine, IndexClient) {
    let pool = PoolProcess::start(&unique_socket(tag), &["--capacity", "256MiB"]);
    let e = Engine::connect(&pool.socket, timeout);
    let mut idx = IndexClient::connect(&pool.socket, 7, Duration::from_secs(5)).unwrap();
    idx.set_stall_timeout(Duration::from_millis(300));
    (pool, e, idx)
}

#[test]
fn pool_killed_mid_transfer() {
    let (mut pool, mut e, mut idx) = pool_engine_index("kill", Duration::from_secs(5));
    assert!(all(&e.store_wait(0, 16), BlockStatus::Stored));
    assert_eq!(idx.match_prefix(&keys(0, 16)), 16);
    // 32 MiB in flight, then SIGKILL.
    let id = e.store(1000, BLOCKS).unwrap();
    pool.kill();
    let t = Instant::now();
    let c = e.w.wait(id, Duration::from_secs(5)).expect("a dead pool completes the transfer as failed");
    assert!(t.elapsed() < Duration::from_secs(2), "waited {:?}", t.elapsed());
    assert!(c.statuses.iter().all(|s| matches!(s, BlockStatus::Failed | BlockStatus::Stored)), "{c:?}");
    // Lookups miss (never a stale hit from the dead pool's mapping), never block.
    let t = Instant::now();
    assert_eq!(idx.match_prefix(&keys(0, 16)), 0);
    assert!(t.elapsed() < Duration::from_millis(100));
    // New work is refused as "not stored" material: the worker is disconnected.
    assert!(matches!(e.store(2000, 4), Err(WorkerError::Disconnected)), "store while the pool is dead");
    assert!(!e.w.is_connected());
}

#[test]
fn pool_stalled_past_timeout() {
    let (pool, mut e, mut idx) = pool_engine_index("stall", Duration::from_millis(300));
    assert!(all(&e.store_wait(0, 8), BlockStatus::Stored));
    pool.signal(libc::SIGSTOP);
    let id = e.store(100, 8).unwrap();
    assert!(e.w.wait(id, Duration::from_millis(600)).is_none(), "no completion from a stopped pool");
    // Past timeout_ms: new transfers are refused, the old one stays pending (blocks held).
    match e.w.store(0, &[(ObjectKey(200), 40)]) {
        Err(WorkerError::Stalled { oldest_ms }) => assert!(oldest_ms >= 300),
        other => panic!("expected Stalled, got {other:?}"),
    }
    assert_eq!(e.w.pending(), 1);
    // The pool has been stopped for 600 ms, past the index's stall timeout (300 ms, set
    // in pool_engine_index): lookups miss (a load planned on a hit would be refused, as
    // the store above was), never block, and the client stays attached.
    let t = Instant::now();
    assert_eq!(idx.match_prefix(&keys(0, 8)), 0, "a stalled pool must read as a miss");
    assert!(t.elapsed() < Duration::from_millis(50), "lookup blocked {:?}", t.elapsed());
    assert!(idx.is_stalled() && idx.is_attached());
    pool.signal(libc::SIGCONT);
    let c = e.w.wait(id, Duration::from_secs(5)).expect("completes once the pool runs again");
    assert!(all(&c.statuses, BlockStatus::Stored), "{c:?}");
    // The pool beats again: its objects hit again, without a reattach.
    assert!(eventually(Duration::from_secs(2), || idx.match_prefix(&keys(0, 8)) == 8), "lookups hit again after SIGCONT");
    assert!(all(&e.load_wait(100, 8), BlockStatus::Loaded));
    assert!(all(&e.store_wait(300, 4), BlockStatus::Stored), "accepting work again");
}

/// Issue #33 item 6: a SIGSTOPped pool reads as a miss within the stall timeout (the
/// heartbeat in the index header stops), and hits until then; an idle running pool never
/// reads as stalled (it beats while asleep).
#[test]
fn stopped_pool_misses_within_the_stall_timeout() {
    let (pool, mut e, mut idx) = pool_engine_index("stallmiss", Duration::from_secs(5));
    assert_eq!(idx.stall_timeout(), Duration::from_millis(300));
    assert!(all(&e.store_wait(0, 8), BlockStatus::Stored));
    // Idle pool, scheduler attached: 3 stall timeouts without any work still hit.
    std::thread::sleep(Duration::from_millis(900));
    assert_eq!(idx.match_prefix(&keys(0, 8)), 8, "an idle pool is not stalled");
    pool.signal(libc::SIGSTOP);
    let stopped = Instant::now();
    let missed = eventually(Duration::from_secs(3), || idx.match_prefix(&keys(0, 8)) == 0);
    let after = stopped.elapsed();
    pool.signal(libc::SIGCONT);
    assert!(missed, "lookups still hit 3 s after SIGSTOP");
    // Heartbeat period 10 ms + timeout 300 ms, and slack for a loaded 2-core machine.
    assert!(after < Duration::from_millis(300 + 200), "missed only after {after:?}");
    assert!(after >= Duration::from_millis(300 - 20), "missed after {after:?}, before the timeout");
    assert!(eventually(Duration::from_secs(2), || idx.match_prefix(&keys(0, 8)) == 8), "hits again after SIGCONT");
}

#[test]
fn pool_restarted_at_the_same_path() {
    let (mut pool, mut e, mut idx) = pool_engine_index("restart", Duration::from_secs(2));
    assert!(all(&e.store_wait(0, 8), BlockStatus::Stored));
    pool.restart();
    // The engine is not restarted: its worker and index re-attach on their own.
    let reattached = eventually(Duration::from_secs(10), || {
        e.w.poll();
        e.w.is_connected()
    });
    assert!(reattached, "worker did not re-attach");
    assert!(all(&e.load_wait(0, 8), BlockStatus::Missing), "a new pool starts empty");
    assert!(all(&e.store_wait(0, 8), BlockStatus::Stored), "memory and layout were re-registered");
    assert!(all(&e.load_wait(0, 8), BlockStatus::Loaded));
    assert!(eventually(Duration::from_secs(10), || idx.match_prefix(&keys(0, 8)) == 8), "index did not re-attach");
}

#[test]
fn workers_killed_mid_transfer_leak_nothing() {
    let pool = PoolProcess::start(&unique_socket("wkill"), &["--capacity", "256MiB", "--min-object-size", "16KiB"]);
    // Baseline after one clean attach/detach, so lazily opened fds are counted.
    run_worker(&pool.socket, 3, "per-layer", &["store", "--first-key", "0", "--count", "8"]);
    assert!(eventually(Duration::from_secs(5), || workers(&pool.report()) == 0));
    let base_fds = pool.open_fds();
    let base = pool.report();
    for round in 0..50u64 {
        let mut child = std::process::Command::new(workspace_binary("umbp-test-worker"))
            .arg("--socket")
            .arg(&pool.socket)
            .args(["--namespace", "3", "--blocks", "32", "store-loop", "--first-key"])
            .arg((1_000_000 * (round + 1)).to_string())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line).unwrap();
        assert_eq!(line.trim(), "ready");
        std::thread::sleep(Duration::from_micros(500 + (round * 397) % 5000));
        child.kill().unwrap();
        child.wait().unwrap();
    }
    let settled = eventually(Duration::from_secs(10), || {
        let r = pool.report();
        workers(&r) == 0 && r.pool.objects == r.pool.published_objects && r.pool.pinned_objects == 0
    });
    let r = pool.report();
    assert!(settled, "unpublished or pinned objects left behind: {}", r.pool);
    // Memory: every allocated byte belongs to a published object (16 KiB each).
    let published = r.pool.published_objects;
    assert_eq!(r.pool.allocated_bytes, published * (16 << 10), "{}", r.pool);
    assert!(published > base.pool.published_objects, "the workers did store");
    assert!(eventually(Duration::from_secs(5), || pool.open_fds() <= base_fds), "fds: {} now, {base_fds} at baseline", pool.open_fds());
    // And the pool still serves.
    let ok = run_worker(&pool.socket, 3, "per-layer", &["load", "--first-key", "0", "--count", "8"]);
    assert_eq!((n(&ok, "loaded"), n(&ok, "corrupt")), (8, 0), "{ok}");
}

#[test]
fn scheduler_hits_are_leased_against_eviction() {
    let pool = PoolProcess::start(&unique_socket("lease"), &["--capacity", "64MiB", "--min-object-size", "16KiB", "--lease-ms", "60000"]);
    let s = &pool.socket;
    let r = run_worker(s, 1, "per-layer", &["store", "--first-key", "0", "--count", "64"]);
    assert_eq!(n(&r, "stored"), 64);
    let mut idx = IndexClient::connect(s, 1, Duration::from_secs(5)).unwrap();
    let hot: Vec<ObjectKey> = (0..64u128).map(|i| ObjectKey::derive(1, 0, 0, &i.to_le_bytes())).collect();
    assert_eq!(idx.match_prefix(&hot), 64);
    // Hints are drained every few ms; give the pool a moment, then flood it.
    std::thread::sleep(Duration::from_millis(100));
    let flood = run_worker(s, 1, "per-layer", &["store", "--first-key", "100000", "--count", "12288"]);
    assert!(n(&flood, "stored") > 0);
    assert!(pool.report().pool.evictions > 0);
    assert_eq!(idx.match_prefix(&hot), 64, "leased (recently hit) blocks survive eviction");
    let l = run_worker(s, 1, "per-layer", &["load", "--first-key", "0", "--count", "64"]);
    assert_eq!((n(&l, "loaded"), n(&l, "corrupt")), (64, 0), "{l}");
}

/// Issue #33 item 4 (progress visible): the pool report carries the background DRAM
/// registration's progress. Host backends here: nothing to register, so it is done at once
/// with 0 bytes; with a GPU driver it ends with the whole tier registered.
#[test]
fn dram_registration_progress_is_reported() {
    let pool = PoolProcess::start(&unique_socket("dramreg"), &["--capacity", "64MiB"]);
    let done = eventually(Duration::from_secs(20), || report_json(&pool.socket)["pool"]["dram_registration_done"] == true);
    assert!(done, "registration not reported done: {}", report_json(&pool.socket)["pool"]);
    let r = report_json(&pool.socket);
    let registered = r["pool"]["dram_registered_bytes"].as_u64().expect("dram_registered_bytes in the report");
    let capacity = r["pool"]["capacity_bytes"].as_u64().unwrap();
    assert!(registered == 0 || registered >= capacity, "registration done at {registered} of {capacity} bytes");
}
