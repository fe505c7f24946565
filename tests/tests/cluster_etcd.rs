//! Membership on etcd (issue #35; docs/cluster.md "Membership on etcd") with a real `etcd`
//! and real `umbp-pool` processes over real NIXL (UCX TCP on loopback), no `--cluster-peer`:
//!
//! - three pools find each other through etcd, list and load each other's blocks;
//! - a fourth joins the running cluster (no other restarted): it lists and loads the
//!   others' blocks, and they list and load its own;
//! - a SIGSTOPped pool (its sockets open, heartbeats silenced, dead-after set to 30 s so
//!   only etcd can drop it) leaves every other pool's index within the lease TTL + 1 s;
//! - etcd SIGKILLed: the pools keep their view (blocks stay listed and load byte-exact,
//!   nothing hangs); etcd restarted on its data: every live pool is registered again, the
//!   stopped one, continued, registers anew and its blocks are listed and load again;
//! - what operators see of it (pool 1's report, `ringtool dump` and `/metrics`): etcd
//!   reachable with its members and this pool registered; unreachable within a few
//!   seconds of the kill, failed requests counted, the view kept; reachable and registered
//!   again after the restart.
//!
//! Skips, printing why, without libnixl_capi.so or the etcd binary (fails instead under
//! UMBP_REQUIRE_NIXL, as CI runs it).

mod common;
use common::*;

use std::time::{Duration, Instant};

use umbp_integration_tests::etcd::{etcd_or_skip, EtcdProcess};
use umbp_integration_tests::metrics::{free_port, http_get, sample};
use umbp_pool::pool_report::EtcdReport;
use umbp_protocol::ObjectKey;
use umbp_scheduler::IndexClient;

const TTL_S: u64 = 2;
/// Far beyond the test: a pool leaves another's view only through etcd.
const DEAD_AFTER_MS: u64 = 30_000;

fn keys(first: u128, count: u128) -> Vec<ObjectKey> {
    (first..first + count).map(|i| ObjectKey::derive(1, 0, 0, &i.to_le_bytes())).collect()
}

fn listed(idx: &mut IndexClient, keys: &[ObjectKey]) -> usize {
    keys.iter().filter(|k| idx.contains(**k)).count()
}

fn store(pool: &PoolProcess, first: u128, count: u64) {
    let a = run_worker(&pool.socket, 1, "per-layer", &["store", "--first-key", &first.to_string(), "--count", &count.to_string()]);
    assert_eq!((n(&a, "stored"), n(&a, "failed")), (count, 0), "{a}");
}

/// etcd's health in `pool`'s report (`cluster.etcd`).
fn etcd_health(pool: &PoolProcess) -> EtcdReport {
    let r = pool.report();
    r.cluster.and_then(|c| c.etcd).unwrap_or_else(|| panic!("no cluster.etcd in the report: {:?}", r.cluster))
}

/// The `umbp_cluster_etcd_*` series on `port`: (reachable, failed requests, members, registered).
fn etcd_metrics(port: u16) -> (f64, f64, f64, f64) {
    let m = http_get(port, "/metrics").1;
    assert_eq!(sample(&m, "umbp_cluster_membership_etcd"), 1.0);
    (
        sample(&m, "umbp_cluster_etcd_reachable"),
        sample(&m, "umbp_cluster_etcd_failed_requests_total"),
        sample(&m, "umbp_cluster_etcd_members"),
        sample(&m, "umbp_cluster_etcd_registered"),
    )
}

/// `ringtool dump` of `pool`: the text.
fn ringtool_dump(pool: &PoolProcess) -> String {
    let out = std::process::Command::new(workspace_binary("ringtool"))
        .args(["dump", "--socket", pool.socket.to_str().unwrap()])
        .output()
        .expect("run ringtool");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Loads `count` blocks from `first` through `pool`: all load, byte-exact.
fn load_all(pool: &PoolProcess, first: u128, count: u64, what: &str) {
    let t = Instant::now();
    let r = run_worker(&pool.socket, 1, "per-layer", &["load", "--first-key", &first.to_string(), "--count", &count.to_string()]);
    assert_eq!((n(&r, "loaded"), n(&r, "corrupt"), n(&r, "missing"), n(&r, "failed")), (count, 0, 0, 0), "{what}: {r}");
    println!("{what}: {count} blocks loaded byte-exact in {:?}", t.elapsed());
}

#[test]
fn pools_join_leave_and_outlive_etcd_without_any_peer_list() {
    if !cluster::nixl_on_loopback() {
        return;
    }
    let Some(bin) = etcd_or_skip() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut etcd = EtcdProcess::start(&bin, dir.path());
    let prefix = format!("/umbp-test/{}", std::process::id());
    let secret = cluster::secret_file(dir.path(), b"etcd-members-share-a-secret-0123456789");
    let timing = cluster::Timing { heartbeat_ms: 200, dead_after_ms: DEAD_AFTER_MS, read_timeout_ms: 1600 };
    let (url, ttl) = (etcd.url(), TTL_S.to_string());
    // Pool 1 serves /metrics.
    let port = free_port();
    let metrics = format!("127.0.0.1:{port}");
    let start = |i: usize| {
        let me = cluster::loopback_addr();
        let mut extra = vec!["--cluster-etcd", &url, "--cluster-etcd-prefix", &prefix, "--cluster-etcd-ttl-s", &ttl];
        if i == 1 {
            extra.extend(["--metrics-addr", metrics.as_str()]);
        }
        let a = cluster::pool_args(&me, &[], &secret, timing, &extra);
        let p = PoolProcess::start(&unique_socket(&format!("etcd-{i}")), &a.iter().map(String::as_str).collect::<Vec<_>>());
        let idx = IndexClient::connect(&p.socket, 1, Duration::from_secs(5)).unwrap();
        (p, idx, me)
    };
    let (pool1, mut idx1, a1) = start(1);
    let (pool2, mut idx2, a2) = start(2);
    let (pool3, mut idx3, a3) = start(3);

    // 1. Three pools, no --cluster-peer: each is registered and lists the others' blocks.
    let mut want = vec![a1.clone(), a2.clone(), a3.clone()];
    want.sort();
    wait_until("the three pools to register in etcd", Duration::from_secs(10), || etcd.members(&prefix) == want);
    // What an operator sees: etcd reachable, three members, this pool registered.
    wait_until("pool 1's report to show etcd reachable with 3 members", Duration::from_secs(5), || {
        let e = etcd_health(&pool1);
        e.reachable && e.members == 3 && e.registered
    });
    let e = etcd_health(&pool1);
    assert!(e.registrations >= 1 && e.seconds_since_success < 3.0, "{e:?}");
    let (reachable, _, members, registered) = etcd_metrics(port);
    assert_eq!((reachable, members, registered), (1.0, 3.0, 1.0));
    let text = ringtool_dump(&pool1);
    assert!(text.contains("membership: etcd reachable") && text.contains("etcd members 3  this pool registered"), "{text}");
    let failed_before = e.failed_requests;
    let (k1, k2) = (keys(0, 64), keys(1000, 64));
    store(&pool1, 0, 64);
    store(&pool2, 1000, 64);
    let took = wait_until("pools 2 and 3 to list pool 1's blocks, 1 and 3 pool 2's", Duration::from_secs(20), || {
        listed(&mut idx2, &k1) == 64 && listed(&mut idx3, &k1) == 64 && listed(&mut idx1, &k2) == 64 && listed(&mut idx3, &k2) == 64
    });
    println!("three pools through etcd: blocks listed {took:?} after the stores");
    load_all(&pool3, 0, 64, "pool 3 loads pool 1's blocks");

    // 2. A fourth pool joins the running cluster; nobody restarts.
    let (pool4, mut idx4, a4) = start(4);
    let t = Instant::now();
    wait_until("pool 4 to list pools 1's and 2's blocks", Duration::from_secs(20), || {
        listed(&mut idx4, &k1) == 64 && listed(&mut idx4, &k2) == 64
    });
    println!("pool 4 joined: the others' blocks listed {:?} after its start", t.elapsed());
    load_all(&pool4, 0, 64, "pool 4 loads pool 1's blocks");
    let k4 = keys(4000, 64);
    store(&pool4, 4000, 64);
    wait_until("pools 1, 2 and 3 to list pool 4's blocks", Duration::from_secs(20), || {
        listed(&mut idx1, &k4) == 64 && listed(&mut idx2, &k4) == 64 && listed(&mut idx3, &k4) == 64
    });
    load_all(&pool1, 4000, 64, "pool 1 loads pool 4's blocks");

    // 3. Pool 2 hangs: nothing but its lease ending tells the others (dead-after is 30 s).
    pool2.signal(libc::SIGSTOP);
    let left = wait_until("pool 2's blocks to leave pools 1's, 3's and 4's indexes", Duration::from_secs(TTL_S + 5), || {
        listed(&mut idx1, &k2) == 0 && listed(&mut idx3, &k2) == 0 && listed(&mut idx4, &k2) == 0
    });
    println!("SIGSTOPped pool 2 left every view {left:?} after the stop (TTL {TTL_S} s)");
    assert!(left <= Duration::from_secs(TTL_S + 1), "pool 2 left after {left:?}, past TTL + 1 s");
    assert!(!etcd.members(&prefix).contains(&a2), "its key left etcd");

    // 4. etcd dies: every pool keeps its view; loads neither fail nor hang; the report
    // and the metrics say etcd is unreachable within a few seconds.
    etcd.kill();
    let killed = Instant::now();
    let seen = wait_until("pool 1's report to show etcd unreachable", Duration::from_secs(5), || !etcd_health(&pool1).reachable);
    println!("etcd SIGKILLed: pool 1 reports it unreachable {seen:?} later");
    let down = etcd_health(&pool1);
    assert!(down.failed_requests > failed_before && down.outages >= 1, "{down:?}");
    assert_eq!(down.members, 3, "the view is kept (pools 1, 3, 4): {down:?}");
    let (reachable, failed, _, _) = etcd_metrics(port);
    assert_eq!(reachable, 0.0);
    assert!(failed >= down.failed_requests as f64, "failed requests {failed}, report {down:?}");
    assert!(ringtool_dump(&pool1).contains("membership: etcd UNREACHABLE (view kept)"));
    store(&pool3, 3000, 32);
    let k3 = keys(3000, 32);
    wait_until("pools 1 and 4 to list pool 3's blocks stored while etcd is down", Duration::from_secs(10), || {
        listed(&mut idx1, &k3) == 32 && listed(&mut idx4, &k3) == 32
    });
    std::thread::sleep(Duration::from_secs(TTL_S + 1).saturating_sub(killed.elapsed()));
    assert_eq!(
        (listed(&mut idx3, &k1), listed(&mut idx1, &k4), listed(&mut idx4, &k3)),
        (64, 64, 32),
        "views kept past the lease TTL while etcd is down"
    );
    load_all(&pool3, 4000, 64, "etcd down: pool 3 loads pool 4's blocks");
    load_all(&pool4, 3000, 32, "etcd down: pool 4 loads pool 3's blocks");
    // Past the TTL without etcd: still unreachable, the failures go on, the time since the
    // last good poll grows, and the lease is no longer known to be live.
    let later = etcd_health(&pool1);
    assert!(!later.reachable && !later.registered && later.failed_requests > down.failed_requests, "{later:?}");
    assert!(later.seconds_since_success >= TTL_S as f64, "{later:?}");

    // 5. etcd back on its data: the live pools are registered (renewed or registered anew),
    // the views go on; pool 2 continued registers anew and its blocks come back.
    etcd.restart();
    let mut live = vec![a1.clone(), a3.clone(), a4.clone()];
    live.sort();
    let back = wait_until("pools 1, 3 and 4 to be registered again", Duration::from_secs(TTL_S + 5), || etcd.members(&prefix) == live);
    println!("etcd restarted: live pools registered {back:?} later");
    wait_until("pool 1's report to show etcd reachable and itself registered again", Duration::from_secs(5), || {
        let e = etcd_health(&pool1);
        e.reachable && e.registered && e.members == 3
    });
    let up = etcd_health(&pool1);
    assert!(up.outages >= later.outages && up.seconds_since_success < 3.0, "{up:?}");
    let (reachable, _, members, registered) = etcd_metrics(port);
    assert_eq!((reachable, members, registered), (1.0, 3.0, 1.0));
    pool2.signal(libc::SIGCONT);
    let t = Instant::now();
    wait_until("pool 2 to re-register and its blocks to be listed again", Duration::from_secs(TTL_S + 10), || {
        listed(&mut idx1, &k2) == 64 && listed(&mut idx4, &k2) == 64
    });
    println!("pool 2 continued: its blocks listed again {:?} later", t.elapsed());
    let mut all = vec![a1, a2, a3, a4];
    all.sort();
    assert_eq!(etcd.members(&prefix), all);
    load_all(&pool4, 1000, 64, "pool 4 loads pool 2's blocks after the rejoin");
    drop(pool2);
}
