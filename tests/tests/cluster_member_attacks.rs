//! What a cluster member (a holder of the secret, here the test itself speaking the
//! control protocol) can do to another member's pool (issue #32 items 2 and 5;
//! docs/security.md, "Cluster"), against real pool processes over real NIXL:
//! - a pin flood: pins past the per-subscriber cap are answered `PinFailed` (before, a
//!   member could pin every object of another pool);
//! - a NIXL WRITE into the pool's registered DRAM (a second NIXL agent loading the
//!   metadata of the pool's `Join`): the next remote load of the overwritten object checks
//!   the digest the holder took when the object was stored, and misses instead of
//!   publishing the attacker's bytes (before, the other member's worker loaded them).

mod common;
use common::*;

use std::net::TcpStream;
use std::time::{Duration, Instant};

use cluster::Member;
use umbp_cluster::control::Msg;
use umbp_cluster::transport::nixl_sys::{MemType, XferDescList, XferOp, XferStatus};
use umbp_cluster::transport::Agent;
use umbp_protocol::ObjectKey;

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

#[test]
fn a_nixl_write_into_a_members_dram_is_caught_by_the_digest_at_the_next_remote_load() {
    if !cluster::nixl_on_loopback() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let secret = b"cluster-member-attacks-secret-0123456789";
    let path = cluster::secret_file(dir.path(), secret);
    let (a, b) = (cluster::loopback_addr(), cluster::loopback_addr());
    let pool_a = cluster_pool("wra", &a, &[], &path, &[]);
    let pool_b = cluster_pool("wrb", &b, &[&a], &path, &[]);
    let r = run_worker(&pool_a.socket, 1, "per-layer", &["store", "--first-key", "0", "--count", "8"]);
    assert_eq!(n(&r, "stored"), 8, "{r}");
    wait_until("pool B to list pool A's blocks", Duration::from_secs(20), || pool_b.report().tiers.remote == 8);

    // The attacker: a member with its own NIXL agent and A's metadata from A's Join.
    let mut m = Member::join(&a, secret);
    let (agent_name, metadata, base, _len) = m.join.clone();
    let victim = ObjectKey::derive(1, 0, 0, &3u128.to_le_bytes()).0;
    let &(_, size, ns) = m.keys.iter().find(|k| k.0 == victim).expect("key 3 in A's snapshot");
    m.send(&Msg::Pin { id: 1, group: 0, namespace: ns, key: victim, size });
    let offset = m.pin_answer().1.expect("pinned");
    m.send(&Msg::Unpin { group: 0, namespace: ns, key: victim });

    let mut garbage = vec![0xa5u8; size as usize];
    let mut agent = Agent::new("umbp-test-attacker").unwrap();
    // SAFETY: `garbage` is declared first, so it outlives the agent (dropped in reverse).
    unsafe { agent.register_dram(garbage.as_mut_ptr(), garbage.len()) }.unwrap();
    assert_eq!(agent.load_peer(&metadata).unwrap(), agent_name);
    let mut local = XferDescList::new(MemType::Dram).unwrap();
    let mut remote = XferDescList::new(MemType::Dram).unwrap();
    local.add_desc(garbage.as_ptr() as usize, size as usize, 0);
    remote.add_desc((base + offset) as usize, size as usize, 0);
    let raw = agent.raw();
    let wrote = raw
        .create_xfer_req(XferOp::Write, &local, &remote, &agent_name, Some(agent.opt_args()))
        .and_then(|req| {
            raw.post_xfer_req(&req, Some(agent.opt_args()))?;
            let t = Instant::now();
            loop {
                if matches!(raw.get_xfer_status(&req)?, XferStatus::Success) {
                    return Ok(true);
                }
                if t.elapsed() > Duration::from_secs(5) {
                    return Ok(false);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        });
    println!("the attacker's NIXL WRITE into A's DRAM: {wrote:?}");

    // B loads the overwritten block (remote, from A) and one that was left alone.
    let victim_load = run_worker(&pool_b.socket, 1, "per-layer", &["load", "--first-key", "3", "--count", "1"]);
    let other_load = run_worker(&pool_b.socket, 1, "per-layer", &["load", "--first-key", "4", "--count", "1"]);
    println!("B's load of the overwritten block: {victim_load}; of another: {other_load}");
    assert_eq!(n(&victim_load, "corrupt"), 0, "B published the attacker's bytes: {victim_load}");
    assert_eq!(n(&other_load, "loaded"), 1, "an untouched block still loads: {other_load}");
    let c = pool_b.report().cluster.expect("B reports its cluster counters");
    if matches!(wrote, Ok(true)) {
        assert_eq!(n(&victim_load, "loaded"), 0, "the overwritten block is a miss: {victim_load}");
        // Counted where the check ran: the reader's report (ringtool dump).
        assert_eq!(c.digest_mismatches, 1, "{c:?}");
    } else {
        println!("the WRITE did not land (refused by NIXL/UCX): nothing to detect");
    }
}
