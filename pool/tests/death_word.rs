//! The pool's death word in the index header (docs/protocol.md, "Pool liveness"): armed
//! with a pool thread's id while the pool runs, marked OWNER_DIED by the kernel when the
//! pool is SIGKILLed (no code of the pool runs), before the process can be reaped; set by a
//! graceful stop too.

mod common;

use common::{start_pool, unique_socket, RawPeer};
use umbp_protocol::index::IndexView;
use umbp_protocol::wire::Role;

fn index_view(peer: &RawPeer) -> IndexView<'_> {
    // SAFETY: the peer's read-only mapping of the whole index, alive as long as `peer`.
    unsafe { IndexView::attach(peer.index.as_ptr(), peer.index.len()) }.unwrap()
}

#[test]
fn sigkill_marks_the_death_word_before_the_pool_is_reaped() {
    let mut pool = start_pool(&unique_socket("death"), &[]);
    let peer = RawPeer::attach(&pool.socket, Role::Observer, 1).unwrap();
    let view = index_view(&peer);
    assert!(
        umbp_integration_tests::eventually(std::time::Duration::from_secs(5), || view.death_word_armed()),
        "the pool never armed its death word"
    );
    assert!(!view.writer_gone());
    let owner = view.header().info.owner.load(std::sync::atomic::Ordering::Acquire);
    // SIGKILL and waitpid: the word is marked by the time the pool is reaped.
    pool.kill();
    assert!(
        view.writer_gone(),
        "death word {:#x} (was {owner:#x}) not marked after the pool was reaped",
        view.header().info.owner.load(std::sync::atomic::Ordering::Acquire)
    );
    assert!(!view.is_closed(), "a SIGKILLed pool runs no code: only the kernel marked it");
}

#[test]
fn graceful_stop_closes_the_index() {
    let socket = unique_socket("death-stop");
    let pool =
        umbp_pool::Pool::start(umbp_pool::PoolConfig { socket_path: socket.clone(), capacity_bytes: 64 << 20, ..Default::default() })
            .unwrap();
    let peer = RawPeer::attach(&socket, Role::Observer, 1).unwrap();
    let view = index_view(&peer);
    assert!(!view.writer_gone());
    pool.shutdown();
    assert!(view.is_closed() && view.writer_gone());
}

/// With `--namespace-acl` each tenant group has its own index (docs/security.md): the
/// death word is armed in every one (one robust-futex list entry per index header), so a
/// SIGKILLed pool is seen dead by the schedulers of every group, not only group 0's.
#[test]
fn every_tenant_groups_index_carries_the_death_word() {
    let mut pool = start_pool(&unique_socket("death-groups"), &["--namespace-acl", "65533:a1", "--namespace-acl", "65534:b2,b3"]);
    // Root attaches to the group of the namespace it says: 0 (unlisted), a1's, b2's.
    let peers: Vec<RawPeer> = [0u128, 0xa1, 0xb2].iter().map(|ns| RawPeer::attach(&pool.socket, Role::Observer, *ns).unwrap()).collect();
    let views: Vec<IndexView<'_>> = peers.iter().map(index_view).collect();
    for (i, v) in views.iter().enumerate() {
        assert!(
            umbp_integration_tests::eventually(std::time::Duration::from_secs(5), || v.death_word_armed()),
            "group index {i} never armed its death word"
        );
        assert!(!v.writer_gone());
    }
    // Three different indexes (own seeds: the headers differ).
    let seeds: std::collections::BTreeSet<_> =
        views.iter().map(|v| v.header().info.seed[0].load(std::sync::atomic::Ordering::Relaxed)).collect();
    assert_eq!(seeds.len(), 3, "each group has its own index");
    pool.kill();
    for (i, v) in views.iter().enumerate() {
        assert!(
            v.writer_gone() && !v.is_closed(),
            "group index {i}: death word {:#x} not marked by the kernel",
            v.header().info.owner.load(std::sync::atomic::Ordering::Acquire)
        );
    }
}
