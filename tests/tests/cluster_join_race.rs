//! A peer that joins before the holder's change follower first runs still gets every key.
//!
//! The cluster tier streams a pool's key changes from its KV event logs. When that stream
//! began "from now" at the follower thread's first run, keys stored between a peer's join
//! (whose snapshot did not have them yet) and that first run were in neither the snapshot
//! nor the stream: the peer never listed them. CI hit it once in
//! `promotion_pipeline::remote_loads_in_many_stages_are_byte_exact_with_look_ahead` (a
//! loaded 2-core machine ran the thread late). Here the follower is held at its start
//! (`HoldPoint::ClusterFollowerStart`) while the peer joins and the keys are stored, so
//! the interleaving is forced, not hoped for.
//!
//! Two in-process pools over real NIXL (UCX TCP on loopback), a real worker storing into
//! pool 1; skips, printing why, without libnixl_capi.so.

mod common;
use common::*;

use std::time::Duration;

use umbp_cluster::control::Secret;
use umbp_cluster::membership::StaticPeers;
use umbp_cluster::pool_tier::{ClusterTier, TierOptions};
use umbp_cluster::ClusterConfig;
use umbp_pool::fault::{hold, wait_reached, HoldPoint};
use umbp_pool::{Pool, PoolConfig};
use umbp_protocol::ObjectKey;
use umbp_worker::{BlockStatus, MemorySpec, Segment, Worker, WorkerConfig};

const OBJECT: u64 = 16 << 10;
const KEYS: u64 = 64;
const NS: u128 = 7;

fn pool(tag: &str) -> (Pool, std::path::PathBuf) {
    let socket = unique_socket(tag);
    let pool =
        Pool::start(PoolConfig { socket_path: socket.clone(), capacity_bytes: 64 << 20, min_object_bytes: OBJECT, ..Default::default() })
            .expect("pool starts");
    (pool, socket)
}

fn tier(pool: &Pool, peers: Vec<String>) -> ClusterTier {
    let secret = Secret::new(b"cluster-join-race-secret-0123456789".to_vec()).expect("secret");
    let mut cfg = ClusterConfig::new("127.0.0.1:0".into(), secret);
    cfg.heartbeat = Duration::from_millis(100);
    cfg.dead_after = Duration::from_secs(3);
    ClusterTier::start(pool.cluster_access(), cfg, Box::new(StaticPeers(peers)), TierOptions::default()).expect("cluster tier starts")
}

#[test]
fn keys_stored_before_the_follower_first_runs_reach_a_peer_that_joined_earlier() {
    if !cluster::nixl_on_loopback() {
        return;
    }
    let (pool1, socket1) = pool("joinrace1");
    hold(HoldPoint::ClusterFollowerStart, true);
    let tier1 = tier(&pool1, vec![]);
    assert!(wait_reached(HoldPoint::ClusterFollowerStart, Duration::from_secs(10)), "pool 1's follower started");
    let (pool2, _socket2) = pool("joinrace2");
    let tier2 = tier(&pool2, vec![tier1.cluster().local_addr().to_string()]);
    // Pool 2 has pool 1's Join, which pool 1 queues after taking the snapshot: that
    // snapshot is taken, and empty.
    wait_until("pool 2 to join pool 1", Duration::from_secs(20), || !tier2.cluster().peer_regions().is_empty());
    assert_eq!(tier2.cluster().stats().remote_keys, 0);

    // Stored now: after the snapshot, before pool 1's follower read anything.
    let mut w = Worker::connect(WorkerConfig::new(&socket1, NS)).expect("worker attaches");
    let mem = vec![0x5au8; (KEYS * OBJECT) as usize];
    // SAFETY: `mem` outlives `w` (declared before it, dropped after) and is not written
    // while the store is in flight.
    unsafe { w.register_memory(MemorySpec::HostProcess { ptr: mem.as_ptr() as usize, len: mem.len() }) }.unwrap();
    w.register_layout(0, vec![Segment::new(0, 0, OBJECT, OBJECT, KEYS)]).unwrap();
    let blocks: Vec<(ObjectKey, u64)> = (0..KEYS).map(|i| (ObjectKey(0x7ace_0000 + i as u128), i)).collect();
    let id = w.store(0, &blocks).expect("submit store");
    let c = w.wait(id, Duration::from_secs(20)).expect("store completes");
    assert!(c.statuses.iter().all(|s| *s == BlockStatus::Stored), "{c:?}");
    assert_eq!(pool1.report().tiers.dram, KEYS);

    hold(HoldPoint::ClusterFollowerStart, false);
    let mut seen = (0, 0);
    let listed = eventually(Duration::from_secs(20), || {
        seen = (tier2.cluster().stats().remote_keys, pool2.report().tiers.remote);
        seen == (KEYS as usize, KEYS)
    });
    assert!(listed, "pool 2 lists every key pool 1 stored after the join: (catalog, index) = {seen:?}, want {KEYS}");
    drop(w);
    drop(tier2);
    drop(tier1);
    pool2.shutdown();
    pool1.shutdown();
}
