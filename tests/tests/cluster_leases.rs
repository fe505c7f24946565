//! Issue #35 C1 and C2 against a real pool process over real NIXL, the test speaking the
//! control protocol as a member (`cluster::Member`):
//! - a pin lease: a subscriber's control connection closes while its one-sided READ may
//!   still be in flight; the holder keeps its export slot (the copy the READ addresses) for
//!   `read_timeout` + the lease margin, so other peers' pins meanwhile do not reuse it
//!   (without the lease the slot is freed at the close and the next pin's copy takes it,
//!   first fit: a late READ then gets another object's bytes); once the lease ends the
//!   slot is freed (no export bytes leak after a peer vanished);
//! - only DRAM-tier key changes reach subscribers (before, every SSD change was sent to
//!   every peer, which dropped it).
//!
//! Skips, printing why, without libnixl_capi.so (unless UMBP_REQUIRE_NIXL is set).

mod common;
use common::*;

use std::net::TcpStream;
use std::time::{Duration, Instant};

use cluster::{nixl_read, Member};
use umbp_cluster::control::{read_msg, Msg, MAX_FRAME};
use umbp_cluster::transport::Agent;
use umbp_protocol::ObjectKey;

const SECRET: &[u8] = b"cluster-leases-secret-0123456789";
const READ_TIMEOUT_MS: u64 = 2000;
const LEASE_MARGIN_MS: u64 = 2000;

/// A pool of 8 MiB DRAM (16 KiB objects) listening at `me`, then `extra`.
fn pool(tag: &str, me: &str, secret: &std::path::Path, extra: &[&str]) -> PoolProcess {
    let (rt, margin) = (READ_TIMEOUT_MS.to_string(), LEASE_MARGIN_MS.to_string());
    let mut args = vec![
        "--capacity",
        "8MiB",
        "--min-object-size",
        "16KiB",
        "--high-wm",
        "0.9",
        "--low-wm",
        "0.7",
        "--cluster-listen",
        me,
        "--cluster-secret-file",
        secret.to_str().unwrap(),
        "--cluster-heartbeat-ms",
        "200",
        "--cluster-dead-after-ms",
        "10000",
        "--cluster-read-timeout-ms",
        &rt,
        "--cluster-pin-lease-margin-ms",
        &margin,
    ];
    args.extend_from_slice(extra);
    let p = PoolProcess::start(&unique_socket(tag), &args);
    wait_until("the cluster port to listen", Duration::from_secs(20), || TcpStream::connect(me).is_ok());
    p
}

fn store(p: &PoolProcess, first: u64, count: u64) -> serde_json::Value {
    run_worker(&p.socket, 1, "per-layer", &["store", "--first-key", &first.to_string(), "--count", &count.to_string()])
}

#[test]
fn a_closed_subscribers_pinned_range_is_not_reused_before_its_lease_ends() {
    if !cluster::nixl_on_loopback() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = cluster::secret_file(dir.path(), SECRET);
    let a = cluster::loopback_addr();
    // One pin per subscriber: all leases together hold at most that many too.
    let pool = pool("lease", &a, &path, &["--cluster-max-pins-per-peer", "1"]);
    let r = store(&pool, 0, 8);
    assert_eq!(n(&r, "stored"), 8, "{r}");

    let mut m = Member::join(&a, SECRET);
    let (agent_name, metadata, base, _) = m.join.clone();
    let victim = ObjectKey::derive(1, 0, 0, &3u128.to_le_bytes()).0;
    let &(_, size, ns) = m.keys.iter().find(|k| k.0 == victim).expect("key 3 in the snapshot");
    let (offset, _digest) = m.pin(1, ns, victim, size).expect("pinned");
    // The member's data path: its own NIXL agent, the pool's metadata from its Join.
    let mut buf = vec![0u8; 2 * size as usize];
    let mut agent = Agent::new("umbp-test-lease-reader").unwrap();
    // SAFETY: `buf` is declared before the agent, so it outlives it (dropped in reverse).
    unsafe { agent.register_dram(buf.as_mut_ptr(), buf.len()) }.unwrap();
    assert_eq!(agent.load_peer(&metadata).unwrap(), agent_name);
    let (before, after) = buf.split_at_mut(size as usize);
    assert!(nixl_read(&agent, &agent_name, base + offset, before), "the READ of the pinned range");

    // The control connection closes (the data path stays up); the READ is still owed.
    let cut = Instant::now();
    drop(m);
    wait_until("the pool to see the subscriber gone", Duration::from_secs(10), || {
        pool.report().cluster.is_some_and(|c| c.subscribers == 0)
    });
    // Churn of the export area: another member pins (and unpins) every other object; first
    // fit gives each copy the lowest free slot, the closed subscriber's were it free.
    let mut m3 = Member::join(&a, SECRET);
    for (id, &(key, size3, ns3)) in m3.keys.clone().iter().filter(|k| k.0 != victim).enumerate() {
        let (at, _) = m3.pin(100 + id as u64, ns3, key, size3).expect("pinned");
        assert_ne!(at, offset, "another peer's copy took the closed subscriber's slot within its lease");
        m3.send(&Msg::Unpin { group: 0, namespace: ns3, key });
    }
    let churn = cut.elapsed();
    let lease = Duration::from_millis(READ_TIMEOUT_MS + LEASE_MARGIN_MS);
    if churn >= lease {
        println!("skipped: the churn took {churn:?}, past the {lease:?} lease (nothing to observe)");
        return;
    }
    assert!(nixl_read(&agent, &agent_name, base + offset, after), "the late READ");
    assert!(
        before == after,
        "the pinned slot was reused within its lease ({churn:?} after the close): a late READ gets another object's bytes"
    );
    let c = pool.report().cluster.unwrap();
    assert_eq!(c.leased_pins, 1, "{c:?}");
    // Leases are bounded as one subscriber's pins: another closed subscriber's pin is
    // released at once (a member reconnecting in a loop cannot pin DRAM through leases).
    let mut m2 = Member::join(&a, SECRET);
    let &(other, size2, ns2) = m2.keys.iter().find(|k| k.0 != victim).expect("another object in the snapshot");
    m2.pin(1, ns2, other, size2).expect("pinned");
    drop(m2);
    wait_until("the second lease to be refused", Duration::from_secs(5), || pool.report().cluster.is_some_and(|c| c.leases_over_cap == 1));
    assert_eq!(pool.report().cluster.unwrap().leased_pins, 1);

    // The lease ends: the slot is freed (nothing of the vanished peer's is left in the
    // export area) and the next copy takes it.
    wait_until("the lease to end", lease + Duration::from_secs(3), || pool.report().cluster.is_some_and(|c| c.leased_pins == 0));
    assert!(cut.elapsed() >= lease, "released only at the lease's end ({:?})", cut.elapsed());
    let c = pool.report().cluster.unwrap();
    assert_eq!(c.export_bytes_used, 0, "the export area holds nothing once the leases ended: {c:?}");
    assert_eq!(m3.pin(999, ns, victim, size).expect("pinned").0, offset, "the freed slot is the first fit again");
}

#[test]
fn only_dram_key_changes_are_published_to_subscribers() {
    if !cluster::nixl_on_loopback() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = cluster::secret_file(dir.path(), SECRET);
    let ssd = tempfile::Builder::new().prefix("umbp-cluster-c2-").tempdir_in("/var/tmp").unwrap();
    let d = ssd.path().to_str().unwrap().to_string();
    let a = cluster::loopback_addr();
    let pool = pool("c2", &a, &path, &["--ssd-dir", &d, "--ssd-capacity", "256MiB", "--ssd-admission", "all"]);
    let mut m = Member::join(&a, SECRET);
    // Twice the DRAM: the older half is demoted to SSD (SSD-tier events in the log).
    let socket = pool.socket.clone();
    let worker = std::thread::spawn(move || run_worker(&socket, 1, "per-layer", &["store", "--first-key", "0", "--count", "1024"]));
    let (mut dram, mut other, mut frames) = (0u64, 0u64, 0u64);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut settled_at: Option<Instant> = None;
    loop {
        // The pool heartbeats every 200 ms: this returns at least that often.
        if let Msg::Keys { changes, .. } = read_msg(&mut m.est.opener, MAX_FRAME).unwrap() {
            frames += 1;
            for c in changes {
                if c.tier == 0 {
                    dram += 1
                } else {
                    other += 1
                }
            }
        }
        m.send(&Msg::Heartbeat);
        assert!(Instant::now() < deadline, "no end to the change stream: {dram} DRAM, {other} other changes");
        if !worker.is_finished() {
            continue;
        }
        // Stored; demotions settle; then everything the pool says it sent has arrived.
        let c = pool.report().cluster.unwrap();
        if c.published_changes == dram + other {
            if *settled_at.get_or_insert_with(Instant::now) + Duration::from_millis(600) < Instant::now() {
                break;
            }
        } else {
            settled_at = None;
        }
    }
    let r = worker.join().unwrap();
    let report = pool.report();
    let demotions = report.ssd.as_ref().unwrap().demotions;
    println!("{frames} frames: {dram} DRAM changes, {other} other; {demotions} demotions; {r}");
    assert!(demotions > 0, "the store demoted objects to SSD: {:?}", report.ssd);
    assert_eq!(other, 0, "non-DRAM changes were sent to a subscriber");
    assert!(dram >= n(&r, "stored"), "a Stored per object stored: {dram}");
}
