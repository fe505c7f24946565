//! What a cluster member (a holder of the secret, here the test itself speaking the
//! control protocol) can do to another member's pool (issue #32 items 2 and 5;
//! docs/security.md, "Cluster"), against real pool processes over real NIXL:
//! - a pin flood: pins past the per-subscriber cap are answered `PinFailed` (before, a
//!   member could pin every object of another pool);
//! - NIXL WRITEs into what the pool's `Join` exposes (a second NIXL agent with its
//!   metadata): only the export area, where the copies for peers' pins lie; a remote load
//!   whose copy was overwritten checks the digest the holder took when the object was
//!   stored and misses instead of publishing the attacker's bytes, and the pool's own
//!   objects are untouched (tests/cluster_export_attacks.rs: its DRAM is out of reach).

mod common;
use common::*;

use std::net::TcpStream;
use std::time::{Duration, Instant};

use cluster::Member;
use umbp_cluster::control::Msg;
use umbp_cluster::transport::nixl_sys::{MemType, XferDescList, XferOp, XferStatus};
use umbp_cluster::transport::Agent;

fn cluster_pool(tag: &str, me: &str, peers: &[&str], secret: &std::path::Path, extra: &[&str]) -> PoolProcess {
    let timing = cluster::Timing { heartbeat_ms: 200, dead_after_ms: 3000, read_timeout_ms: 3000 };
    let args = cluster::pool_args(me, peers, secret, timing, extra);
    let p = PoolProcess::start(&unique_socket(tag), &args.iter().map(String::as_str).collect::<Vec<_>>());
    wait_until("the cluster port to listen", Duration::from_secs(20), || TcpStream::connect(me).is_ok());
    p
}

#[test]
fn a_pin_flood_gets_pin_failed_past_the_cap() {
    if !cluster::nixl_on_loopback() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let secret = b"cluster-member-attacks-secret-0123456789";
    let path = cluster::secret_file(dir.path(), secret);
    let a = cluster::loopback_addr();
    let port = metrics::free_port();
    let pool = cluster_pool("pinflood", &a, &[], &path, &["--metrics-addr", &format!("127.0.0.1:{port}")]);
    let r = run_worker(&pool.socket, 1, "per-layer", &["store", "--first-key", "0", "--count", "4"]);
    assert_eq!(n(&r, "stored"), 4, "{r}");
    let mut m = Member::join(&a, secret);
    let (key, size, ns) = m.keys[0];
    // The default cap: 4096 pins per subscriber. 4200 pins of one object, never unpinned.
    let total = 4200u64;
    for id in 0..total {
        m.send(&Msg::Pin { id, group: 0, namespace: ns, key, size });
    }
    let (mut ok, mut capped) = (0, 0);
    for _ in 0..total {
        match m.pin_answer() {
            (_, Ok(_)) => ok += 1,
            (_, Err(reason)) => {
                assert!(reason.contains("pin cap"), "{reason}");
                capped += 1;
            }
        }
    }
    println!("{ok} pins granted, {capped} refused at the cap");
    assert_eq!((ok, capped), (4096, total - 4096));
    // One given back: one more is granted.
    m.send(&Msg::Unpin { group: 0, namespace: ns, key });
    m.send(&Msg::Pin { id: 9999, group: 0, namespace: ns, key, size });
    assert!(m.pin_answer().1.is_ok(), "a pin after an unpin");
    // The refusals are counted in the pool report (ringtool dump) and on /metrics.
    let c = pool.report().cluster.expect("a cluster pool reports its cluster counters");
    assert_eq!((c.pins_over_cap, c.subscribers), (total - 4096, 1), "{c:?}");
    let (_, text) = metrics::http_get(port, "/metrics");
    assert_eq!(metrics::sample(&text, "umbp_cluster_pins_over_cap_total"), (total - 4096) as f64);
}

/// Remote loads by B while the attacker writes (one object each).
const ROUNDS: u64 = 32;

#[test]
fn a_nixl_write_into_the_export_area_is_caught_by_the_digest_and_never_published() {
    if !cluster::nixl_on_loopback() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let secret = b"cluster-member-attacks-secret-0123456789";
    let path = cluster::secret_file(dir.path(), secret);
    let (a, b) = (cluster::loopback_addr(), cluster::loopback_addr());
    // An export area of one 16 KiB slot: every copy A makes for B lies where the attacker
    // writes.
    let pool_a = cluster_pool("wra", &a, &[], &path, &["--cluster-export-bytes", "16KiB"]);
    let pool_b = cluster_pool("wrb", &b, &[&a], &path, &[]);
    let r = run_worker(&pool_a.socket, 1, "per-layer", &["store", "--first-key", "0", "--count", &ROUNDS.to_string()]);
    assert_eq!(n(&r, "stored"), ROUNDS, "{r}");
    wait_until("pool B to list pool A's blocks", Duration::from_secs(20), || pool_b.report().tiers.remote == ROUNDS);

    // The attacker: a member with its own NIXL agent and A's metadata from A's Join; the
    // only memory it can address is A's export area, which it overwrites over and over.
    let m = Member::join(&a, secret);
    let (agent_name, metadata, base, len) = m.join.clone();
    assert_eq!(len, 16 << 10, "the Join carries the export area");
    let mut garbage = vec![0xa5u8; len as usize];
    let mut agent = Agent::new("umbp-test-attacker").unwrap();
    // SAFETY: `garbage` is declared first, so it outlives the agent (dropped in reverse).
    unsafe { agent.register_dram(garbage.as_mut_ptr(), garbage.len()) }.unwrap();
    assert_eq!(agent.load_peer(&metadata).unwrap(), agent_name);
    let stop = std::sync::atomic::AtomicBool::new(false);
    /// Stops the attacker's thread however the loads end (a failed assertion included).
    struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
    let (mut loaded, mut missed, mut writes) = (0u64, 0u64, 0u64);
    std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let mut local = XferDescList::new(MemType::Dram).unwrap();
            let mut remote = XferDescList::new(MemType::Dram).unwrap();
            local.add_desc(garbage.as_ptr() as usize, len as usize, 0);
            remote.add_desc(base as usize, len as usize, 0);
            let raw = agent.raw();
            let mut done = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let req = raw
                    .create_xfer_req(XferOp::Write, &local, &remote, &agent_name, Some(agent.opt_args()))
                    .expect("a WRITE into the export area is accepted");
                raw.post_xfer_req(&req, Some(agent.opt_args())).unwrap();
                let t = Instant::now();
                while !matches!(raw.get_xfer_status(&req), Ok(XferStatus::Success)) && t.elapsed() < Duration::from_secs(5) {
                    std::hint::spin_loop();
                }
                done += 1;
            }
            done
        });
        let guard = StopOnDrop(&stop);
        // B loads A's blocks one by one while the attacker writes.
        for round in 0..ROUNDS {
            let r = run_worker(&pool_b.socket, 1, "per-layer", &["load", "--first-key", &round.to_string(), "--count", "1"]);
            assert_eq!(n(&r, "corrupt"), 0, "B published the attacker's bytes: {r}");
            loaded += n(&r, "loaded");
            missed += 1 - n(&r, "loaded").min(1);
        }
        drop(guard);
        writes = writer.join().unwrap();
    });
    let c = pool_b.report().cluster.expect("B reports its cluster counters");
    println!("{writes} WRITEs into A's export area during {ROUNDS} remote loads: {loaded} loaded byte-exact, {missed} missed; {c:?}");
    // Every miss is a copy the attacker overwrote, caught by the digest (counted where the
    // check ran: the reader's report); never a wrong byte.
    assert!(writes > 0, "the attacker wrote");
    assert_eq!(c.digest_mismatches, missed, "{c:?}");
    // A's own objects are untouched.
    let own = run_worker(&pool_a.socket, 1, "per-layer", &["load", "--first-key", "0", "--count", &ROUNDS.to_string()]);
    assert_eq!((n(&own, "loaded"), n(&own, "corrupt")), (ROUNDS, 0), "{own}");
}
