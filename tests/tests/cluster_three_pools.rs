//! The cluster tier (docs/cluster.md) between three real pool processes over real NIXL
//! (UCX TCP on loopback), with real worker processes on each:
//!
//! - a block stored through pool 1 is in pools 2's and 3's indexes and loads byte-exact
//!   through each;
//! - a key held by two pools is pulled from its rendezvous home only: with that home
//!   stopped (SIGSTOP) the load of the key is a clean miss although the other holder has it;
//! - a stopped (hung, partitioned) peer leaves every other pool's index within the
//!   heartbeat bound (and not before it: no connection reset tells them), loads of its
//!   objects end as misses, local loads keep their latency meanwhile, and keys it shared
//!   with a live peer stay listed and load from that peer;
//! - SIGCONT: it re-joins and its objects reappear and load;
//! - `--cluster-max-remote-entries` caps the remote entries of a pool's index while its own
//!   stores go on; keys held back are listed as room frees.
//!
//! Skips, printing why, without libnixl_capi.so (scripts/setup-nixl.sh).

mod common;
use common::*;

use std::time::{Duration, Instant};

use umbp_protocol::ObjectKey;
use umbp_scheduler::IndexClient;

const HEARTBEAT_MS: u64 = 200;
const DEAD_AFTER_MS: u64 = 2000;
/// Bound on one remote load; pins get half of it (docs/cluster.md). Below DEAD_AFTER_MS, so
/// a pin to a stopped peer times out before the peer is dropped.
const READ_TIMEOUT_MS: u64 = 1600;
/// Remote entries pool 3 may list.
const POOL3_CAP: u64 = 400;

fn keys(first: u128, count: u128) -> Vec<ObjectKey> {
    (first..first + count).map(|i| ObjectKey::derive(1, 0, 0, &i.to_le_bytes())).collect()
}

/// How many of `keys` the index behind `idx` lists (any tier).
fn listed(idx: &mut IndexClient, keys: &[ObjectKey]) -> usize {
    keys.iter().filter(|k| idx.contains(**k)).count()
}

fn signal(pool: &PoolProcess, sig: i32) {
    // SAFETY: signalling our own live child process.
    assert_eq!(unsafe { libc::kill(pool.pid(), sig) }, 0);
}

fn load(pool: &PoolProcess, layout: &str, first: u128, count: u64) -> serde_json::Value {
    run_worker(&pool.socket, 1, layout, &["load", "--first-key", &first.to_string(), "--count", &count.to_string()])
}

fn store(pool: &PoolProcess, first: u128, count: u64) {
    let a = run_worker(&pool.socket, 1, "per-layer", &["store", "--first-key", &first.to_string(), "--count", &count.to_string()]);
    assert_eq!((n(&a, "stored"), n(&a, "failed")), (count, 0), "{a}");
}

#[test]
fn three_pools_share_blocks_survive_a_stopped_peer_and_cap_remote_entries() {
    if !cluster::nixl_on_loopback() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let secret = cluster::secret_file(dir.path(), b"three-pools-share-a-secret-0123456789");
    let addrs = [cluster::loopback_addr(), cluster::loopback_addr(), cluster::loopback_addr()];
    let timing = cluster::Timing { heartbeat_ms: HEARTBEAT_MS, dead_after_ms: DEAD_AFTER_MS, read_timeout_ms: READ_TIMEOUT_MS };
    let args = |me: usize, extra: &[&str]| {
        let peers: Vec<&str> = (0..addrs.len()).filter(|&i| i != me).map(|i| addrs[i].as_str()).collect();
        cluster::pool_args(&addrs[me], &peers, &secret, timing, extra)
    };
    let start = |i: usize, extra: &[&str]| {
        let a = args(i, extra);
        PoolProcess::start(&unique_socket(&format!("clu3-{i}")), &a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let cap = POOL3_CAP.to_string();
    let pool1 = start(0, &[]);
    let pool2 = start(1, &[]);
    let pool3 = start(2, &["--cluster-max-remote-entries", &cap]);
    let mut idx1 = IndexClient::connect(&pool1.socket, 1, Duration::from_secs(5)).unwrap();
    let mut idx2 = IndexClient::connect(&pool2.socket, 1, Duration::from_secs(5)).unwrap();
    let mut idx3 = IndexClient::connect(&pool3.socket, 1, Duration::from_secs(5)).unwrap();

    // 1. Stored through pool 1: listed in pools 2's and 3's indexes, byte-exact through each.
    let k1 = keys(0, 100);
    store(&pool1, 0, 100);
    let took = wait_until("pools 2 and 3 to list pool 1's blocks", Duration::from_secs(20), || {
        listed(&mut idx2, &k1) == 100 && listed(&mut idx3, &k1) == 100
    });
    println!("pools 2 and 3 listed 100 blocks of pool 1 {took:?} after the store");
    assert_eq!((idx2.match_prefix(&k1), idx3.match_prefix(&k1)), (100, 100));
    assert_eq!((pool2.report().tiers.remote, pool3.report().tiers.remote), (100, 100));
    let b = load(&pool2, "strided", 0, 100);
    assert_eq!((n(&b, "loaded"), n(&b, "corrupt"), n(&b, "missing"), n(&b, "failed")), (100, 0, 0, 0), "pool 2: {b}");
    let c = load(&pool3, "cross", 0, 100);
    assert_eq!((n(&c, "loaded"), n(&c, "corrupt"), n(&c, "missing"), n(&c, "failed")), (100, 0, 0, 0), "pool 3: {c}");
    assert_eq!(pool3.report().tiers.remote, 0, "both copies are local now");

    // Set-up for the stopped peer: K2 held by pools 1 and 2 (stored through 1, pulled by 2),
    // K3 held by pool 2 only, L local on pool 3.
    store(&pool1, 1000, 32);
    wait_until("pool 2 to list K2", Duration::from_secs(20), || listed(&mut idx2, &keys(1000, 32)) == 32);
    let b = load(&pool2, "per-layer", 1000, 32);
    assert_eq!((n(&b, "loaded"), n(&b, "corrupt")), (32, 0), "{b}");
    store(&pool2, 2000, 100);
    store(&pool3, 3000, 100);
    let k2 = keys(1000, 32);
    let k3 = keys(2000, 100);
    wait_until("pools 1 and 3 to list K2 and K3", Duration::from_secs(20), || {
        listed(&mut idx3, &k2) == 32 && listed(&mut idx3, &k3) == 100 && listed(&mut idx1, &k3) == 100
    });
    let base = load(&pool3, "per-layer", 3000, 100);
    assert_eq!((n(&base, "loaded"), n(&base, "corrupt")), (100, 0), "{base}");
    let base_wait = n(&base, "max_wait_ms");

    // 2. Pool 2 hangs (SIGSTOP: its sockets stay open, nothing tells the others).
    signal(&pool2, libc::SIGSTOP);
    let stopped = Instant::now();
    // K2 on pool 3, in one request: each key is pinned at its rendezvous home among
    // {pool 1, pool 2} only; the keys homed on the stopped pool miss (pin timeout) although
    // pool 1 holds them too, the others load from pool 1.
    let s3 = pool3.socket.clone();
    let remote = std::thread::spawn(move || {
        let r = run_worker(&s3, 1, "per-layer", &["load", "--first-key", "1000", "--count", "32"]);
        (r, stopped.elapsed())
    });
    // Meanwhile local loads on pool 3 keep their latency (the remote load holds one copy
    // thread for up to the read timeout; local traffic never waits on a peer).
    std::thread::sleep(Duration::from_millis(200));
    let local = load(&pool3, "strided", 3000, 100);
    let local_took = stopped.elapsed();
    println!("local loads while a peer is stopped: {local} (before: max_wait_ms {base_wait})");
    assert_eq!((n(&local, "loaded"), n(&local, "corrupt"), n(&local, "missing")), (100, 0, 0), "{local}");
    assert!(
        n(&local, "max_wait_ms") < READ_TIMEOUT_MS / 4,
        "a local load waited {} ms while a remote load waited on a stopped peer (read timeout {READ_TIMEOUT_MS} ms)",
        n(&local, "max_wait_ms")
    );
    let (r, remote_took) = remote.join().unwrap();
    println!("K2 (two holders, one stopped) on pool 3: {r} in {remote_took:?}; local loads done {local_took:?} after the stop");
    if local_took >= remote_took {
        println!("skipped: the local loads did not overlap the remote load (machine too slow to start the worker); the latency bound above was not observed under a stuck fetch");
    }
    assert_eq!(n(&r, "corrupt"), 0, "{r}");
    assert_eq!(n(&r, "loaded") + n(&r, "missing") + n(&r, "failed"), 32, "{r}");
    assert!(n(&r, "loaded") > 0, "keys homed on the live holder load from it: {r}");
    assert!(n(&r, "missing") + n(&r, "failed") > 0, "keys homed on the stopped holder are not pulled from the other one: {r}");
    // The live holder's items were read with time to spare, not timed out behind the
    // stopped one's pins (a timed-out read quarantines its destination DRAM).
    assert_eq!(pool3.report().pool.quarantined_bytes, 0, "no read timed out");

    // The stopped pool leaves pools 1's and 3's indexes within the heartbeat bound, and not
    // before it (no connection reset announces a hung peer).
    let bound = Duration::from_millis(DEAD_AFTER_MS + 4 * HEARTBEAT_MS + 2000);
    wait_until("pool 2's keys to leave pools 1's and 3's indexes", bound, || listed(&mut idx1, &k3) == 0 && listed(&mut idx3, &k3) == 0);
    let gone = stopped.elapsed();
    println!("the stopped pool's keys left both indexes {gone:?} after SIGSTOP (dead-after {DEAD_AFTER_MS} ms)");
    // (Lower bound loose for a loaded machine, where the last heartbeat before the stop
    // may be late: what it rules out is a drop by connection reset, within milliseconds.)
    assert!(gone >= Duration::from_millis(DEAD_AFTER_MS / 2), "dropped after {gone:?}, long before the heartbeat bound");
    // Its objects are misses (recompute), never wrong bytes.
    let m = load(&pool3, "per-layer", 2000, 100);
    assert_eq!((n(&m, "loaded"), n(&m, "corrupt"), n(&m, "missing") + n(&m, "failed")), (0, 0, 100), "{m}");
    // K2's keys that missed above stay listed (pool 1 still holds them) and now load from
    // pool 1: the whole of K2 loads.
    assert_eq!(listed(&mut idx3, &k2), 32, "keys a live peer holds stay listed after a failed pull");
    let r = load(&pool3, "cross", 1000, 32);
    assert_eq!((n(&r, "loaded"), n(&r, "corrupt"), n(&r, "missing")), (32, 0, 0), "{r}");

    // 3. SIGCONT: pool 2 re-joins; its objects reappear in pools 1 and 3 and load.
    signal(&pool2, libc::SIGCONT);
    let back =
        wait_until("pool 2's keys to reappear", Duration::from_secs(20), || listed(&mut idx1, &k3) == 100 && listed(&mut idx3, &k3) == 100);
    println!("pool 2 re-joined: its keys reappeared {back:?} after SIGCONT");
    let r = load(&pool3, "strided", 2000, 100);
    assert_eq!((n(&r, "loaded"), n(&r, "corrupt"), n(&r, "missing")), (100, 0, 0), "{r}");
    // And pool 2 loads as before, once it has re-joined pool 3 in turn (on resuming it finds
    // pool 3 silent past the bound, drops it and re-subscribes for a fresh snapshot).
    let l = keys(3000, 100);
    let took = wait_until("pool 2 to list pool 3's blocks again", Duration::from_secs(20), || listed(&mut idx2, &l) == 100);
    println!("pool 2 listed pool 3's blocks again {took:?} later");
    let r = load(&pool2, "per-layer", 3000, 100);
    assert_eq!((n(&r, "loaded"), n(&r, "corrupt")), (100, 0), "{r}");

    // 4. The cap: pool 1 stores more than pool 3 may list; pool 3 lists exactly its cap of
    // remote entries, and its own stores still go in.
    let remote_now = pool3.report().tiers.remote;
    assert!(remote_now < POOL3_CAP, "{remote_now}");
    store(&pool1, 10_000, 600);
    wait_until("pool 2 to list the 600 new blocks", Duration::from_secs(20), || listed(&mut idx2, &keys(10_000, 600)) == 600);
    wait_until("pool 3 to fill its cap", Duration::from_secs(20), || pool3.report().tiers.remote == POOL3_CAP);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(pool3.report().tiers.remote, POOL3_CAP, "never past the cap");
    // Room frees as remote entries become local (pool 3 loads some): the keys the cap held
    // back are listed then, up to the cap again.
    let r = load(&pool3, "per-layer", 10_000, 600);
    assert_eq!((n(&r, "corrupt"), n(&r, "loaded") + n(&r, "missing")), (0, 600), "{r}");
    assert!(n(&r, "loaded") >= 100, "{r}");
    let refilled = wait_until("pool 3 to list held-back keys as room frees", Duration::from_secs(10), || {
        pool3.report().tiers.remote == remote_now + (600 - n(&r, "loaded")).min(POOL3_CAP - remote_now)
    });
    // (Without the refill: exactly the 400 listed ones load and nothing is remote after.)
    println!("pool 3 loaded {} of the 600 and listed the held-back keys {refilled:?} later", n(&r, "loaded"));
    store(&pool3, 20_000, 200);
    assert_eq!(listed(&mut idx3, &keys(20_000, 200)), 200, "local objects are listed beside the capped remote entries");
    let r = load(&pool3, "per-layer", 20_000, 200);
    assert_eq!((n(&r, "loaded"), n(&r, "corrupt")), (200, 0), "{r}");
}

/// The cluster flags are checked before anything starts (no NIXL needed): each refusal
/// exits 2 and names the flag.
#[test]
fn cluster_flags_are_refused_with_a_message_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let secret = cluster::secret_file(dir.path(), b"flags-check-secret-0123456789");
    let s = secret.to_str().unwrap();
    let cases: [(&[&str], &str); 4] = [
        (&["--cluster-max-remote-entries", "10"], "--cluster-max-remote-entries need --cluster-listen"),
        (&["--cluster-peer", "127.0.0.1:1"], "need --cluster-listen"),
        // (--namespace-acl with --cluster-listen is allowed since issue #17: cluster_namespaces.rs.)
        (&["--cluster-listen", "127.0.0.1:0", "--namespace-acl", "4242:aa"], "--cluster-listen needs --cluster-secret-file"),
        (&["--cluster-secret-file", s, "--namespace-acl", "4242:aa"], "need --cluster-listen"),
    ];
    for (args, says) in cases {
        let out = std::process::Command::new(umbp_integration_tests::pool_binary())
            .arg("--socket")
            .arg(dir.path().join("pool.sock"))
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}
