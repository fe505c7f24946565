//! Lock order (docs/architecture.md "Lock order"): a peer whose submission ring turns out
//! corrupted while the service thread arms the rings for sleep is detached, while a stats
//! report that walks every attachment's rings runs at the same moment. The interleaving is
//! forced with the pool's in-process hold points (`umbp_pool::fault`), so this test has its
//! own binary: hold points are process-wide.
//!
//! Before the fix, the service thread held the peer's `sq` guard (a temporary in a `match`
//! head) through `corrupt` -> `detach`, which takes `attachments`, while the control thread
//! building the report held `attachments` and waited for that `sq`: the whole pool hung.

mod common;

use std::time::{Duration, Instant};

use common::{unique_socket, RawPeer};
use umbp_ipc::message::{peer_gone, recv_message, send_message};
use umbp_pool::fault::{hold, wait_reached, HoldPoint};
use umbp_pool::{Pool, PoolConfig};
use umbp_protocol::wire::{MessageKind, Role};

#[test]
fn corrupt_ring_detach_racing_a_stats_report_does_not_deadlock() {
    let socket = unique_socket("lock-order");
    let pool = Pool::start(PoolConfig { socket_path: socket.clone(), capacity_bytes: 64 << 20, ..PoolConfig::default() })
        .expect("pool starts");
    let bad = RawPeer::attach(&socket, Role::Worker, 1).unwrap();
    let mut observer = RawPeer::attach(&socket, Role::Observer, 2).unwrap();
    assert_eq!(observer.stats().attachments.len(), 2);

    // 1. Hold the idle service thread just before it arms the rings (after its last pop).
    hold(HoldPoint::ServiceCorrupt, true);
    hold(HoldPoint::ServiceBeforeArm, true);
    assert!(wait_reached(HoldPoint::ServiceBeforeArm, Duration::from_secs(10)), "service thread never went idle");
    // 2. The peer claims a billion submissions: the arming (prepare_sleep) finds it corrupt.
    bad.sq().tail_word().store(1_000_000_000, std::sync::atomic::Ordering::Release);
    hold(HoldPoint::ServiceBeforeArm, false);
    assert!(wait_reached(HoldPoint::ServiceCorrupt, Duration::from_secs(10)), "the corrupt tail was not seen while arming");
    // 3. While the service thread is about to detach the peer, a report walks the rings.
    send_message(&observer.sock, MessageKind::StatsRequest, &[], &[], Some(Duration::from_secs(5))).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    hold(HoldPoint::ServiceCorrupt, false);
    let t = Instant::now();
    let reply = recv_message(&observer.sock, Some(Duration::from_secs(5)));
    let reply = match reply {
        Ok(m) => m,
        Err(e) => {
            // The pool's threads are deadlocked: dropping it would join them forever.
            std::mem::forget(pool);
            panic!("pool deadlocked: the stats report did not come within 5 s ({e})");
        }
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
    drop(pool);
}
