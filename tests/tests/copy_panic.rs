//! A bug that panics a copy thread mid-submission (injected here through the in-process
//! hook `umbp_pool::fault`) fails that submission with a completion instead of hanging
//! its worker, keeps the thread serving, and never reuses DRAM a copy may still write
//! (nor keeps DRAM no copy can write any more).

use std::time::Duration;

use umbp_integration_tests::{unique_socket, worker_on_memfd};
use umbp_pool::{Pool, PoolConfig};
use umbp_worker::{BlockStatus, ObjectKey, WorkerConfig};

const PAGE: u64 = 64 << 10;
const BLOCKS: u64 = 64;

#[test]
fn a_panicking_copy_fails_its_submission_and_the_pool_keeps_serving() {
    let socket = unique_socket("copy-panic");
    // One copy thread: if the panic killed it, nothing after it would ever complete.
    let pool = Pool::start(PoolConfig { socket_path: socket.clone(), capacity_bytes: 64 << 20, copy_threads: 1, ..PoolConfig::default() })
        .expect("pool starts");
    let (mut w, _kv) = worker_on_memfd(WorkerConfig::new(&socket, 5), PAGE, BLOCKS);
    let job = |first: u128, n: u64| -> Vec<(ObjectKey, u64)> { (0..n).map(|i| (ObjectKey(first + i as u128), i)).collect() };

    umbp_pool::fault::panic_on_copy_of(Some(ObjectKey(1003)));
    let id = w.store(0, &job(1000, 8)).unwrap();
    let c = w.wait(id, Duration::from_secs(10)).expect("the failed submission completes instead of hanging");
    assert_eq!(c.statuses, vec![BlockStatus::Failed; 8], "{c:?}");
    umbp_pool::fault::panic_on_copy_of(None);
    // The panic came from the copy thread's planning: the device layer drained every copy
    // before it went on, so the reservations are freed, not quarantined (issue #31 item
    // 6g: before, they stayed allocated until the pool restarted).
    let report = pool.report();
    assert_eq!(report.pool.quarantined_bytes, 0, "nothing can write the reservations any more: {report}");
    assert_eq!(report.pool.allocated_bytes, 0, "the failed store's DRAM is free again: {report}");
    assert_eq!(report.pool.objects, 0, "{report}");

    // The same thread serves on; the keys of the failed store can be stored again.
    for round in 0..3 {
        let id = w.store(0, &job(1000 + round * 8, 8)).unwrap();
        let c = w.wait(id, Duration::from_secs(10)).expect("later submissions complete");
        assert!(c.all_ok(), "{c:?}");
    }
    let id = w.load(0, &job(1000, 8)).unwrap();
    assert!(w.wait(id, Duration::from_secs(10)).expect("load completes").all_ok());
    assert_eq!(pool.report().pool.published_objects, 24);
}

/// Issue #31 item 6d: a panic while the copy thread settles a landed stage (inside the
/// device layer's stage-done callback) is contained there: the transfer drains (every
/// stage in flight lands and is reported), the submission completes with its unsettled
/// blocks failed, and, the copies having landed, no DRAM is quarantined. Before, the
/// panic unwound through the device layer with later stages unreported, so their objects
/// were treated as possibly still written: quarantined for good.
#[test]
fn a_panic_settling_a_landed_stage_drains_the_transfer() {
    let socket = unique_socket("landing-panic");
    // Stages of one block; one copy thread (a killed thread would hang what follows).
    let pool = Pool::start(PoolConfig {
        socket_path: socket.clone(),
        capacity_bytes: 64 << 20,
        copy_threads: 1,
        copy_stage_bytes: PAGE,
        ..PoolConfig::default()
    })
    .expect("pool starts");
    let (mut w, _kv) = worker_on_memfd(WorkerConfig::new(&socket, 5), PAGE, BLOCKS);
    let job = |first: u128, n: u64| -> Vec<(ObjectKey, u64)> { (0..n).map(|i| (ObjectKey(first + i as u128), i)).collect() };

    umbp_pool::fault::panic_on_landing_of(Some(ObjectKey(2001)));
    let id = w.store(0, &job(2000, 4)).unwrap();
    let c = w.wait(id, Duration::from_secs(10)).expect("the submission completes instead of hanging");
    umbp_pool::fault::panic_on_landing_of(None);
    assert_eq!(c.statuses[0], BlockStatus::Stored, "the stage before the panic was published: {c:?}");
    assert_eq!(&c.statuses[1..], &[BlockStatus::Failed; 3], "{c:?}");
    let report = pool.report();
    assert_eq!(report.pool.quarantined_bytes, 0, "the copies landed: nothing is quarantined: {report}");
    assert_eq!(report.pool.objects, 1, "{report}");
    // The thread serves on; the failed keys can be stored again and load.
    let id = w.store(0, &job(2000, 4)).unwrap();
    let c = w.wait(id, Duration::from_secs(10)).expect("a later submission completes");
    assert_eq!(c.statuses[0], BlockStatus::AlreadyPresent, "{c:?}");
    assert_eq!(&c.statuses[1..], &[BlockStatus::Stored; 3], "{c:?}");
    let id = w.load(0, &job(2000, 4)).unwrap();
    assert!(w.wait(id, Duration::from_secs(10)).expect("load completes").all_ok());
}
