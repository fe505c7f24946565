//! Lock order (docs/architecture.md "Lock order"): a peer whose submission ring turns out
//! corrupted while the service thread arms the rings for sleep is detached, while a stats
//! report that walks every attachment's rings runs at the same moment. The interleavings
//! are forced with the pool's in-process hold points (`umbp_pool::fault`), so this test has
//! its own binary: hold points are process-wide (one test, phases in sequence).
//!
//! The old bug had two halves, and the pool hung only with both: the service thread held
//! the peer's `sq` guard (a temporary in a `match` head) through `corrupt` -> `detach`,
//! which takes `attachments` (half A), while the control thread building the report held
//! `attachments` and waited for that `sq` (half B). Each phase below catches one half
//! alone (issue #31): A, a report must complete while the service thread is held just
//! before the detach (it would wait for the `sq` the service thread holds); B, while a
//! report is held about to take a peer's ring locks, `attachments` must be free (it would
//! be held by the report).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{unique_socket, RawPeer};
use umbp_ipc::message::{peer_gone, recv_message, send_message};
use umbp_pool::fault::{hold, wait_reached, HoldPoint};
use umbp_pool::{Pool, PoolConfig};
use umbp_protocol::wire::{MessageKind, Role};

/// Lets every held pool thread go (before a failing assertion, so that the pool can stop).
fn release_all() {
    for p in [HoldPoint::ServiceBeforeArm, HoldPoint::ServiceCorrupt, HoldPoint::ReportRings] {
        hold(p, false);
    }
}

#[test]
fn corrupt_ring_detach_racing_a_stats_report_takes_no_lock_under_another() {
    let socket = unique_socket("lock-order");
    let pool = Arc::new(
        Pool::start(PoolConfig { socket_path: socket.clone(), capacity_bytes: 64 << 20, ..PoolConfig::default() }).expect("pool starts"),
    );
    let bad = RawPeer::attach(&socket, Role::Worker, 1).unwrap();
    let mut observer = RawPeer::attach(&socket, Role::Observer, 2).unwrap();
    assert_eq!(observer.stats().attachments.len(), 2);

    // Half A. 1. Hold the idle service thread just before it arms the rings (after its
    // last pop).
    hold(HoldPoint::ServiceCorrupt, true);
    hold(HoldPoint::ServiceBeforeArm, true);
    assert!(wait_reached(HoldPoint::ServiceBeforeArm, Duration::from_secs(10)), "service thread never went idle");
    // 2. The peer claims a billion submissions: the arming (prepare_sleep) finds it corrupt.
    bad.sq().tail_word().store(1_000_000_000, std::sync::atomic::Ordering::Release);
    hold(HoldPoint::ServiceBeforeArm, false);
    assert!(wait_reached(HoldPoint::ServiceCorrupt, Duration::from_secs(10)), "the corrupt tail was not seen while arming");
    // 3. While the service thread is held about to detach the peer, a report walks the
    // rings, the corrupt peer's `sq` included: it completes without the service thread.
    send_message(&observer.sock, MessageKind::StatsRequest, &[], &[], Some(Duration::from_secs(5))).unwrap();
    let reply = recv_message(&observer.sock, Some(Duration::from_secs(5)));
    hold(HoldPoint::ServiceCorrupt, false);
    let t = Instant::now();
    let reply = match reply {
        Ok(m) => m,
        Err(e) => match recv_message(&observer.sock, Some(Duration::from_secs(5))) {
            // Answered once the service thread went on: it held the peer's `sq` into
            // the detach (half A).
            Ok(_) => panic!("the report waited for the service thread: it holds the peer's sq through the detach ({e})"),
            Err(e) => {
                // Both halves: the pool's threads are deadlocked; dropping it would join
                // them forever.
                std::mem::forget(pool);
                panic!("pool deadlocked: the stats report did not come within 10 s ({e})");
            }
        },
    };
    assert_eq!(reply.kind, MessageKind::Reply);
    // 4. The corrupt peer is gone, the pool serves on.
    while !peer_gone(&bad.sock) {
        if t.elapsed() > Duration::from_secs(5) {
            std::mem::forget(pool);
            panic!("the corrupt peer was not detached within 5 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(observer.stats().attachments.len(), 1);

    // Half B. A report held just before it takes a peer's ring locks holds no
    // `attachments` (which a detach, an attach or the service thread would wait for).
    hold(HoldPoint::ReportRings, true);
    send_message(&observer.sock, MessageKind::StatsRequest, &[], &[], Some(Duration::from_secs(5))).unwrap();
    if !wait_reached(HoldPoint::ReportRings, Duration::from_secs(10)) {
        release_all();
        panic!("the report never reached the ring locks");
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let p = pool.clone();
    std::thread::spawn(move || {
        let _ = tx.send(p.attachment_count());
    });
    let count = rx.recv_timeout(Duration::from_secs(5));
    hold(HoldPoint::ReportRings, false);
    assert_eq!(count, Ok(1), "`attachments` is held by a report while it takes a peer's ring locks");
    let reply = recv_message(&observer.sock, Some(Duration::from_secs(5))).expect("the held report completes");
    assert_eq!(reply.kind, MessageKind::Reply);
    release_all();
    drop(observer);
    drop(pool);
}
