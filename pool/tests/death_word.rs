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
    assert!(umbp_integration_tests::eventually(std::time::Duration::from_secs(5), || view.death_word_armed()), "the pool never armed its death word");
    assert!(!view.writer_gone());
    let owner = view.header().info.owner.load(std::sync::atomic::Ordering::Acquire);
    // SIGKILL and waitpid: the word is marked by the time the pool is reaped.
    pool.kill();
    assert!(view.writer_gone(), "death word {:#x} (was {owner:#x}) not marked after the pool was reaped", view.header().info.owner.load(std::sync::atomic::Ordering::Acquire));
    assert!(!view.is_closed(), "a SIGKILLed pool runs no code: only the kernel marked it");
}

#[test]
fn graceful_stop_closes_the_index() {
    let socket = unique_socket("death-stop");
    let pool = umbp_pool::Pool::start(umbp_pool::PoolConfig { socket_path: socket.clone(), capacity_bytes: 64 << 20, ..Default::default() }).unwrap();
    let peer = RawPeer::attach(&socket, Role::Observer, 1).unwrap();
    let view = index_view(&peer);
    assert!(!view.writer_gone());
    pool.shutdown();
    assert!(view.is_closed() && view.writer_gone());
}
