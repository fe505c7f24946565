//! The cluster port's caps on unauthenticated connections (docs/cluster.md, "Control
//! connection"), on a real node: past the per-source cap a connection is closed at once,
//! those within it are cut at the total handshake deadline, and with fewer descriptors
//! left than the local side's reserve nothing is accepted. Each refusal is counted. Skips,
//! printing why, without libnixl_capi.so (unless UMBP_REQUIRE_NIXL is set).

use std::io::Read;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_cluster::control::Secret;
use umbp_cluster::mem_pool::MemPool;
use umbp_cluster::membership::StaticPeers;
use umbp_cluster::{transport, Cluster, ClusterConfig};

/// The tests of this binary start NIXL one at a time (as `nixl_loopback.rs` does).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn nixl() -> Option<std::sync::MutexGuard<'static, ()>> {
    let g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if std::env::var_os("UCX_TLS").is_none() {
        // SAFETY (of the env write): under SERIAL, before the first NIXL/UCX thread; later
        // calls find it set.
        std::env::set_var("UCX_TLS", "tcp,self");
        std::env::set_var("UCX_NET_DEVICES", "lo");
    }
    match transport::load_library() {
        Ok(_) => Some(g),
        Err(e) => {
            assert!(std::env::var_os("UMBP_REQUIRE_NIXL").is_none(), "UMBP_REQUIRE_NIXL is set and libnixl_capi.so cannot be loaded: {e}");
            println!("skipped: libnixl_capi.so not found (set {}): {e}", transport::LIB_ENV);
            None
        }
    }
}

/// When the node closed `s` (EOF or reset), waiting at most `bound`; None if still open.
fn closed_within(s: &mut TcpStream, bound: Duration) -> Option<Duration> {
    let t = Instant::now();
    s.set_read_timeout(Some(bound)).unwrap();
    let mut b = [0u8; 8];
    match s.read(&mut b) {
        Ok(_) => Some(t.elapsed()),
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => None,
        Err(_) => Some(t.elapsed()),
    }
}

#[test]
fn unauthenticated_connections_are_capped_per_source_and_cut_at_the_deadline() {
    let Some(_serial) = nixl() else { return };
    let pool = Arc::new(MemPool::new(1 << 20));
    let mut cfg = ClusterConfig::new("127.0.0.1:0".into(), Secret::new(b"port-caps-secret-0123456789".to_vec()).unwrap());
    cfg.max_unauthenticated_per_source = 2;
    cfg.connect_timeout = Duration::from_millis(1500);
    // SAFETY: `pool` outlives the node (declared first, dropped last).
    let node = unsafe { Cluster::start(cfg, Box::new(StaticPeers(vec![])), pool.clone(), pool.base(), pool.len()) }.unwrap();
    let addr = node.local_addr();
    let mut held: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(200)); // both accepted and in their handshake
    let t0 = Instant::now();
    for _ in 0..3 {
        let mut s = TcpStream::connect(addr).unwrap();
        let at = closed_within(&mut s, Duration::from_millis(1000));
        assert!(at.is_some(), "a third connection from one source was not closed at once");
    }
    assert!(t0.elapsed() < Duration::from_millis(1000), "over the cap: closed at once ({:?})", t0.elapsed());
    assert_eq!(node.stats().refused_connections, 3);
    // The two within the cap: cut at the 1.5 s total deadline (they never send a byte).
    for s in &mut held {
        let at = closed_within(s, Duration::from_secs(3)).expect("cut at the handshake deadline");
        assert!(at < Duration::from_millis(1500), "cut {at:?} after the check began (deadline 1.5 s from accept)");
    }
    settle(node);
}

/// Drops `node` and gives its threads time to end (the last one drops the NIXL agent)
/// before the next test starts one or the process exits: `Cluster`'s drop does not join
/// its threads, and an agent torn down during exit crashed this binary about once in 20.
fn settle(node: Cluster) {
    drop(node);
    std::thread::sleep(Duration::from_millis(400));
}

#[test]
fn nothing_is_accepted_inside_the_local_sides_fd_reserve() {
    let Some(_serial) = nixl() else { return };
    let pool = Arc::new(MemPool::new(1 << 20));
    let mut cfg = ClusterConfig::new("127.0.0.1:0".into(), Secret::new(b"port-caps-secret-0123456789".to_vec()).unwrap());
    // More than any RLIMIT_NOFILE leaves: every connection is inside the reserve.
    cfg.fd_reserve = usize::MAX / 2;
    // SAFETY: `pool` outlives the node (declared first, dropped last).
    let node = unsafe { Cluster::start(cfg, Box::new(StaticPeers(vec![])), pool.clone(), pool.base(), pool.len()) }.unwrap();
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the local it is given.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    if lim.rlim_cur == libc::RLIM_INFINITY {
        println!("skipped: RLIMIT_NOFILE is unlimited here (no reserve to keep)");
        settle(node);
        return;
    }
    let mut s = TcpStream::connect(node.local_addr()).unwrap();
    assert!(closed_within(&mut s, Duration::from_millis(1000)).is_some(), "accepted inside the fd reserve");
    assert_eq!(node.stats().refused_connections, 1);
    settle(node);
}
