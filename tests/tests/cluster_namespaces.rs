//! Namespace ACLs across the cluster (issue #17; docs/cluster.md, "Namespaces and tenant
//! groups"): two real pools over real NIXL (UCX TCP on loopback), both with
//! `--namespace-acl`. With the same ACL, a block stored in namespace A through pool 1 is
//! listed in pool 2 only in A's tenant group (A's scheduler finds it, B's does not), loads
//! byte-exact through pool 2 for A and is a miss for a worker attached with B. With
//! different ACLs the pools refuse each other (a clear error naming both digests in the
//! log) and share nothing.
//!
//! Both tenants' workers run as root here (root attaches to the group of its Hello
//! namespace, as in attacks_tenant.rs), so one uid is enough: the namespace decides what a
//! worker sees. Skips, printing why, without libnixl_capi.so or as a non-root user.

mod common;
use common::*;

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::Duration;

use umbp_protocol::entries::BlockStatus;
use umbp_protocol::ObjectKey;

const NS_A: u128 = 0xa11ce;
const NS_B: u128 = 0xb0b;
/// The test worker's default block: 4 layers x 4 KiB pages, one 16 KiB object.
const OBJ: u64 = 16 << 10;

/// None (after printing why) when the test cannot run here.
fn setup() -> Option<()> {
    if !umbp_integration_tests::root_or_skip("workers attach as root to the group of their namespace") {
        return None;
    }
    cluster::nixl_on_loopback().then_some(())
}

fn pool_args(me: &str, peer: &str, secret: &Path, acl: &[&str]) -> Vec<String> {
    let acl: Vec<&str> = acl.iter().flat_map(|a| ["--namespace-acl", a]).collect();
    cluster::pool_args(me, &[peer], secret, cluster::Timing { heartbeat_ms: 200, dead_after_ms: 1000, read_timeout_ms: 3000 }, &acl)
}

fn keys(ns: u128, n: u128) -> Vec<ObjectKey> {
    (0..n).map(|i| ObjectKey::derive(ns, 0, 0, &i.to_le_bytes())).collect()
}

/// Loads `keys` (16 KiB objects) through `socket` with a worker attached with namespace
/// `ns`; the per-block statuses.
fn load_as(socket: &Path, ns: u128, keys: &[ObjectKey]) -> Vec<BlockStatus> {
    use std::os::fd::OwnedFd;
    use umbp_worker::{Segment, Worker, WorkerConfig};
    let n = keys.len() as u64;
    let mut w = Worker::connect(WorkerConfig::new(socket, ns)).expect("worker attaches");
    let mfd = memfd::MemfdOptions::default().allow_sealing(true).create("ns-load").unwrap();
    mfd.as_file().set_len(OBJ * n).unwrap();
    mfd.add_seals(&[memfd::FileSeal::SealShrink, memfd::FileSeal::SealGrow]).unwrap();
    let fd: OwnedFd = mfd.as_file().try_clone().unwrap().into();
    let id = w.register_memfd(fd, 0, OBJ * n).expect("register a memfd");
    w.register_layout(0, vec![Segment::new(id, 0, OBJ, OBJ, n)]).expect("layout");
    let batch: Vec<_> = keys.iter().enumerate().map(|(i, k)| (*k, i as u64)).collect();
    let t = w.load(0, &batch).expect("load");
    loop {
        if let Some(c) = w.wait(t, Duration::from_secs(10)) {
            return c.statuses;
        }
    }
}

fn count(s: &[BlockStatus], want: BlockStatus) -> usize {
    s.iter().filter(|x| **x == want).count()
}

#[test]
fn same_acl_routes_remote_blocks_by_namespace() {
    if setup().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let secret = cluster::secret_file(dir.path(), b"namespaces-share-a-secret-0123456789");
    let acl = ["65533:a11ce", "65534:b0b"];
    let (a1, a2) = (cluster::loopback_addr(), cluster::loopback_addr());
    let (args1, args2) = (pool_args(&a1, &a2, &secret, &acl), pool_args(&a2, &a1, &secret, &acl));
    let pool1 = PoolProcess::start(&unique_socket("nsclu1"), &args1.iter().map(String::as_str).collect::<Vec<_>>());
    let pool2 = PoolProcess::start(&unique_socket("nsclu2"), &args2.iter().map(String::as_str).collect::<Vec<_>>());

    // Stored in namespace A through pool 1 ...
    let s = run_worker(&pool1.socket, NS_A, "per-layer", &["store", "--first-key", "0", "--count", "50"]);
    assert_eq!((n(&s, "stored"), n(&s, "failed")), (50, 0), "{s}");
    let ka = keys(NS_A, 50);
    let took = wait_until("pool 2 to list pool 1's blocks", Duration::from_secs(20), || pool2.report().tiers.remote == 50);
    println!("pool 2 listed 50 remote blocks {took:?} after the store");
    // ... listed in pool 2 only in A's tenant group: A's scheduler finds them, B's not.
    let mut idx_a = umbp_scheduler::IndexClient::connect(&pool2.socket, NS_A, Duration::from_secs(5)).unwrap();
    let mut idx_b = umbp_scheduler::IndexClient::connect(&pool2.socket, NS_B, Duration::from_secs(5)).unwrap();
    assert_eq!(idx_a.match_prefix(&ka), 50, "A's scheduler on pool 2 finds A's remote blocks");
    assert_eq!(idx_b.match_prefix(&ka), 0, "B's scheduler on pool 2 finds A's blocks");
    let snap_b = idx_b.snapshot().expect("B attached");
    assert_eq!((snap_b.live, snap_b.inserts), (0, 0), "B's index on pool 2 holds entries: {snap_b:?}");
    let r2 = pool2.report();
    let live: Vec<u64> = r2.groups.iter().map(|g| g.index.as_ref().map_or(0, |i| i.live)).collect();
    assert_eq!(live.iter().sum::<u64>(), 50, "{r2}");
    assert_eq!(live.iter().filter(|l| **l == 50).count(), 1, "all in one group (A's): {live:?}");
    assert_eq!(live[0], 0, "not in group 0: {live:?}");

    // A worker attached with B asks pool 2 for A's keys: a miss (not fetched from pool 1).
    let b = load_as(&pool2.socket, NS_B, &ka);
    assert_eq!(count(&b, BlockStatus::Loaded), 0, "B loaded A's blocks: {b:?}");
    assert_eq!(count(&b, BlockStatus::Missing), 50, "{b:?}");
    assert_eq!(pool2.report().tiers.remote, 50, "B's misses did not pull A's blocks");

    // A loads them byte-exact through pool 2 (pulled over NIXL).
    let l = run_worker(&pool2.socket, NS_A, "strided", &["load", "--first-key", "0", "--count", "50"]);
    assert_eq!((n(&l, "loaded"), n(&l, "corrupt"), n(&l, "missing"), n(&l, "failed")), (50, 0, 0, 0), "{l}");
    let r2 = pool2.report();
    assert_eq!((r2.tiers.dram, r2.tiers.remote), (50, 0), "{r2}");
    // Now local on pool 2, still only A's: B misses, A (this helper) loads.
    let b = load_as(&pool2.socket, NS_B, &ka);
    assert_eq!(count(&b, BlockStatus::Loaded), 0, "B loaded A's blocks: {b:?}");
    let a = load_as(&pool2.socket, NS_A, &ka);
    assert_eq!(count(&a, BlockStatus::Loaded), 50, "A's own load through the same helper: {a:?}");

    // And B's own blocks through pool 2 reach pool 1 in B's group only.
    let s = run_worker(&pool2.socket, NS_B, "per-layer", &["store", "--first-key", "0", "--count", "20"]);
    assert_eq!(n(&s, "stored"), 20, "{s}");
    wait_until("pool 1 to list pool 2's B blocks", Duration::from_secs(20), || pool1.report().tiers.remote == 20);
    let kb = keys(NS_B, 20);
    let mut idx1_a = umbp_scheduler::IndexClient::connect(&pool1.socket, NS_A, Duration::from_secs(5)).unwrap();
    assert_eq!(idx1_a.match_prefix(&kb), 0, "A's scheduler on pool 1 finds B's blocks");
    assert_eq!(count(&load_as(&pool1.socket, NS_A, &kb), BlockStatus::Loaded), 0, "A loaded B's blocks");
    let l = run_worker(&pool1.socket, NS_B, "strided", &["load", "--first-key", "0", "--count", "20"]);
    assert_eq!((n(&l, "loaded"), n(&l, "corrupt")), (20, 0), "{l}");
}

/// A pool started with its stderr in `log` (to read the refusal from it); killed on drop.
struct LoggedPool {
    child: Child,
    socket: std::path::PathBuf,
}

impl LoggedPool {
    fn start(socket: &Path, args: &[String], log: &Path) -> Self {
        let child = pool_command(&pool_binary())
            .arg("--socket")
            .arg(socket)
            .args(args)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .expect("spawn umbp-pool");
        let p = Self { child, socket: socket.to_path_buf() };
        wait_until("the pool to listen", Duration::from_secs(20), || std::os::unix::net::UnixStream::connect(&p.socket).is_ok());
        p
    }
}

impl Drop for LoggedPool {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn pools_with_different_acls_refuse_each_other_and_share_nothing() {
    if setup().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let secret = cluster::secret_file(dir.path(), b"namespaces-share-a-secret-0123456789");
    let (a1, a2) = (cluster::loopback_addr(), cluster::loopback_addr());
    // Pool 2 also lets uid 65534 read namespace c0c: another ACL.
    let args1 = pool_args(&a1, &a2, &secret, &["65533:a11ce", "65534:b0b"]);
    let args2 = pool_args(&a2, &a1, &secret, &["65533:a11ce", "65534:b0b,c0c"]);
    let (log1, log2) = (dir.path().join("pool1.log"), dir.path().join("pool2.log"));
    let pool1 = LoggedPool::start(&unique_socket("nsdiff1"), &args1, &log1);
    let pool2 = LoggedPool::start(&unique_socket("nsdiff2"), &args2, &log2);

    let s = run_worker(&pool1.socket, NS_A, "per-layer", &["store", "--first-key", "0", "--count", "30"]);
    assert_eq!(n(&s, "stored"), 30, "{s}");
    let s = run_worker(&pool2.socket, NS_A, "per-layer", &["store", "--first-key", "100", "--count", "30"]);
    assert_eq!(n(&s, "stored"), 30, "{s}");
    // Both sides log the refusal, naming both digests.
    let refused = |p: &Path| {
        let t = std::fs::read_to_string(p).unwrap_or_default();
        t.lines().filter(|l| l.contains("enforces another --namespace-acl (ACL digest")).count() >= 2
    };
    wait_until("both pools to log the ACL refusal", Duration::from_secs(20), || refused(&log1) && refused(&log2));
    // Several heartbeats later: nothing was listed or is loadable across.
    std::thread::sleep(Duration::from_secs(2));
    for (sock, other) in [(&pool1.socket, 100u128), (&pool2.socket, 0u128)] {
        let r = umbp_integration_tests::report::report(sock);
        assert_eq!(r.tiers.remote, 0, "a pool listed the other's blocks: {r}");
        let other_keys: Vec<ObjectKey> = (other..other + 30).map(|i| ObjectKey::derive(NS_A, 0, 0, &i.to_le_bytes())).collect();
        assert_eq!(count(&load_as(sock, NS_A, &other_keys), BlockStatus::Loaded), 0, "loaded the other pool's blocks");
    }
    let t = std::fs::read_to_string(&log2).unwrap();
    let line = t.lines().find(|l| l.contains("enforces another --namespace-acl")).unwrap();
    println!("pool 2 logged: {line}");
    assert!(line.contains("this pool"), "{line}");
}
