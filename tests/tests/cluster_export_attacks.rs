//! Issue #32 item 2 against a real pool process over real NIXL (docs/security.md,
//! "Cluster"): what a peer holding one of the pool's `Join` frames can reach.
//! - it cannot WRITE the pool's DRAM: the `Join` names the export agent, which registers
//!   only the export area, so NIXL refuses every descriptor in DRAM (before, the `Join`
//!   carried the agent that registered all DRAM, read and write: every WRITE landed and the
//!   pool's own worker then loaded the attacker's bytes);
//! - what it can write is its own copy in the export area (the test's positive control:
//!   the same WRITE path lands there);
//! - a pin that finds the export area full is `PinFailed` (counted), the reader loads a
//!   miss, and a vanished peer's slots are freed when its lease ends (no leak).
//!
//! The test finds the pool's DRAM and its objects' offsets in it through /proc/PID/maps and
//! /proc/PID/mem (root, or the pool's uid): the attacker is given the layout it would have
//! to guess, the worst case.

mod common;
use common::*;

use std::collections::HashMap;
use std::net::TcpStream;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use cluster::{nixl_read, Member};
use umbp_cluster::control::Msg;
use umbp_cluster::transport::nixl_sys::{MemType, XferDescList, XferOp, XferStatus};
use umbp_cluster::transport::Agent;

const SECRET: &[u8] = b"cluster-export-attacks-secret-0123456789";
/// Objects the victim pool holds (and the attacker writes at).
const OBJECTS: u64 = 64;

fn cluster_pool(tag: &str, me: &str, peers: &[&str], secret: &std::path::Path, extra: &[&str]) -> PoolProcess {
    let timing = cluster::Timing { heartbeat_ms: 200, dead_after_ms: 3000, read_timeout_ms: 2000 };
    let args = cluster::pool_args(me, peers, secret, timing, extra);
    let p = PoolProcess::start(&unique_socket(tag), &args.iter().map(String::as_str).collect::<Vec<_>>());
    wait_until("the cluster port to listen", Duration::from_secs(20), || TcpStream::connect(me).is_ok());
    p
}

fn store(p: &PoolProcess, first: u64, count: u64) -> serde_json::Value {
    run_worker(&p.socket, 1, "per-layer", &["store", "--first-key", &first.to_string(), "--count", &count.to_string()])
}

fn load(p: &PoolProcess, first: u64, count: u64) -> serde_json::Value {
    run_worker(&p.socket, 1, "per-layer", &["load", "--first-key", &first.to_string(), "--count", &count.to_string()])
}

/// Address and length of the pool's DRAM mapping (the `umbp-dram` memfd) in process `pid`.
fn dram_of(pid: i32) -> (u64, u64) {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("read the pool's maps");
    let line = maps.lines().find(|l| l.contains("memfd:umbp-dram")).unwrap_or_else(|| panic!("no umbp-dram mapping in:\n{maps}"));
    let (a, b) = line.split_whitespace().next().unwrap().split_once('-').unwrap();
    let (a, b) = (u64::from_str_radix(a, 16).unwrap(), u64::from_str_radix(b, 16).unwrap());
    (a, b - a)
}

/// `len` bytes at `addr` of process `pid`'s memory.
fn peek(pid: i32, addr: u64, len: u64) -> Vec<u8> {
    let f = std::fs::File::open(format!("/proc/{pid}/mem")).expect("open the pool's /proc/PID/mem (root or its uid)");
    let mut v = vec![0u8; len as usize];
    f.read_exact_at(&mut v, addr).expect("read the pool's memory");
    v
}

/// The offset of each object in `dram` (searched on 4 KiB steps), by its bytes.
fn locate(dram: &[u8], objects: &[Vec<u8>]) -> Vec<u64> {
    const PREFIX: usize = 256;
    let by_prefix: HashMap<&[u8], usize> = objects.iter().enumerate().map(|(i, o)| (&o[..PREFIX], i)).collect();
    assert_eq!(by_prefix.len(), objects.len(), "objects with distinct first bytes");
    let mut at = vec![None; objects.len()];
    for off in (0..dram.len() - PREFIX).step_by(4096) {
        if let Some(&i) = by_prefix.get(&dram[off..off + PREFIX]) {
            if dram.get(off..off + objects[i].len()) == Some(&objects[i][..]) {
                at[i] = Some(off as u64);
            }
        }
    }
    at.into_iter().enumerate().map(|(i, a)| a.unwrap_or_else(|| panic!("object {i} not found in the pool's DRAM"))).collect()
}

/// One NIXL WRITE of `local` to `remote_addr` of `peer`: Ok(true) once it completed, Ok(false)
/// when it did not complete in 5 s, Err when NIXL refused it (no such registered memory).
fn nixl_write(agent: &Agent, peer: &str, remote_addr: u64, local: &[u8]) -> Result<bool, String> {
    let mut l = XferDescList::new(MemType::Dram).unwrap();
    let mut r = XferDescList::new(MemType::Dram).unwrap();
    l.add_desc(local.as_ptr() as usize, local.len(), 0);
    r.add_desc(remote_addr as usize, local.len(), 0);
    let raw = agent.raw();
    let req = raw.create_xfer_req(XferOp::Write, &l, &r, peer, Some(agent.opt_args())).map_err(|e| e.to_string())?;
    raw.post_xfer_req(&req, Some(agent.opt_args())).map_err(|e| e.to_string())?;
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(5) {
        if matches!(raw.get_xfer_status(&req).map_err(|e| e.to_string())?, XferStatus::Success) {
            return Ok(true);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(false)
}

#[test]
fn a_peer_holding_the_join_cannot_write_any_object_in_the_pools_dram() {
    if !cluster::nixl_on_loopback() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = cluster::secret_file(dir.path(), SECRET);
    let a = cluster::loopback_addr();
    let pool = cluster_pool("xw", &a, &[], &path, &[]);
    let r = store(&pool, 0, OBJECTS);
    assert_eq!(n(&r, "stored"), OBJECTS, "{r}");

    // The attacker: a member with its own NIXL agent and the pool's metadata from its Join.
    let mut m = Member::join(&a, SECRET);
    let (agent_name, metadata, base, _len) = m.join.clone();
    assert_eq!(m.keys.len() as u64, OBJECTS);
    let max = m.keys.iter().map(|k| k.1).max().unwrap() as usize;
    let mut buf = vec![0u8; 2 * max];
    let mut agent = Agent::new("umbp-test-export-attacker").unwrap();
    // SAFETY: `buf` is declared before the agent, so it outlives it (dropped in reverse).
    unsafe { agent.register_dram(buf.as_mut_ptr(), buf.len()) }.unwrap();
    assert_eq!(agent.load_peer(&metadata).unwrap(), agent_name);

    // Every object's bytes, read as a peer reads them (pin, READ, unpin).
    let mut objects = Vec::new();
    for (id, &(key, size, ns)) in m.keys.clone().iter().enumerate() {
        let (offset, _) = m.pin(id as u64, ns, key, size).expect("pinned");
        let (into, _) = buf.split_at_mut(size as usize);
        assert!(nixl_read(&agent, &agent_name, base + offset, into), "the READ of a pinned object");
        objects.push(into.to_vec());
        m.send(&Msg::Unpin { group: 0, namespace: ns, key });
    }
    // Where they are in the pool's DRAM: the addresses the attacker aims at.
    let pid = pool.pid();
    let (dram, dram_len) = dram_of(pid);
    let offsets = locate(&peek(pid, dram, dram_len), &objects);

    // The WRITEs' source: the attacker's registered buffer, filled with its bytes.
    buf.fill(0xa5);
    let (mut completed, mut refused, mut pending) = (0, 0, 0);
    for (o, &off) in objects.iter().zip(&offsets) {
        match nixl_write(&agent, &agent_name, dram + off, &buf[..o.len()]) {
            Ok(true) => completed += 1,
            Ok(false) => pending += 1,
            Err(e) => {
                if refused == 0 {
                    println!("NIXL refused a WRITE into the pool's DRAM: {e}");
                }
                refused += 1;
            }
        }
    }
    let after = peek(pid, dram, dram_len);
    let landed = objects.iter().zip(&offsets).filter(|(o, &off)| after[off as usize..off as usize + o.len()] != o[..]).count();
    println!(
        "{} WRITEs into the pool's DRAM: {completed} completed, {refused} refused by NIXL, {pending} pending; {landed} landed",
        objects.len()
    );
    // The pool's own worker loads every object byte for byte.
    let own = load(&pool, 0, OBJECTS);
    println!("the pool's own worker after the WRITEs: {own}");
    assert_eq!(landed, 0, "{landed} of {OBJECTS} WRITEs by a holder of the Join landed in the pool's DRAM");
    assert_eq!((n(&own, "loaded"), n(&own, "corrupt")), (OBJECTS, 0), "{own}");

    // Positive control: the same WRITE path does land where a peer may write, its own copy
    // in the export area (so the refusals above are not a broken attacker).
    let &(key, size, ns) = &m.keys[0];
    let (offset, _) = m.pin(1000, ns, key, size).expect("pinned");
    let (from, into) = buf.split_at_mut(max);
    assert_eq!(nixl_write(&agent, &agent_name, base + offset, &from[..size as usize]), Ok(true), "a WRITE into the export area");
    let into = &mut into[..size as usize];
    into.fill(0);
    assert!(nixl_read(&agent, &agent_name, base + offset, into));
    assert!(into.iter().all(|&b| b == 0xa5), "the WRITE landed in the attacker's own copy");
    assert_eq!(n(&load(&pool, 0, 1), "corrupt"), 0, "the pool's object is untouched");
}

#[test]
fn a_full_export_area_refuses_pins_the_reader_misses_and_a_vanished_peers_slots_are_freed() {
    if !cluster::nixl_on_loopback() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = cluster::secret_file(dir.path(), SECRET);
    let (a, b) = (cluster::loopback_addr(), cluster::loopback_addr());
    // Room for a few objects' copies only.
    let port = metrics::free_port();
    let m_addr = format!("127.0.0.1:{port}");
    let pool_a = cluster_pool(
        "xfa",
        &a,
        &[],
        &path,
        &["--cluster-export-bytes", "256KiB", "--cluster-pin-lease-margin-ms", "500", "--metrics-addr", &m_addr],
    );
    let pool_b = cluster_pool("xfb", &b, &[&a], &path, &[]);
    let r = store(&pool_a, 0, 32);
    assert_eq!(n(&r, "stored"), 32, "{r}");
    wait_until("pool B to list pool A's blocks", Duration::from_secs(20), || pool_b.report().tiers.remote == 32);

    // A member fills the export area with pins it keeps, then vanishes.
    let mut m = Member::join(&a, SECRET);
    let (mut held, mut full) = (0u64, 0u64);
    for (id, &(key, size, ns)) in m.keys.clone().iter().enumerate() {
        match m.pin(id as u64, ns, key, size) {
            Ok(_) => held += size,
            Err(reason) => {
                assert!(reason.contains("export area full"), "{reason}");
                full += 1;
            }
        }
    }
    let c = pool_a.report().cluster.unwrap();
    println!("export area: {held} bytes pinned, {full} pins refused full; {c:?}");
    assert!(full > 0 && held > 0, "the area filled: {held} bytes held, {full} refused");
    assert_eq!(c.export_full, full, "{c:?}");
    assert!(c.export_bytes_used >= held && c.export_bytes_used <= 256 << 10, "{c:?}");
    // The same on /metrics.
    let (_, text) = metrics::http_get(port, "/metrics");
    assert_eq!(metrics::sample(&text, "umbp_cluster_export_full_total"), full as f64);
    assert_eq!(metrics::sample(&text, "umbp_cluster_export_bytes_used"), c.export_bytes_used as f64);

    // B's remote load finds no room at A: misses (recomputed), never a wrong byte.
    let l = load(&pool_b, 0, 4);
    println!("B's load while A's export area is full: {l}");
    assert_eq!((n(&l, "loaded"), n(&l, "corrupt")), (0, 0), "{l}");

    // The member vanishes: its slots are kept for its lease, then freed; B loads again.
    let gone = Instant::now();
    drop(m);
    wait_until("the lease to end and the slots to be freed", Duration::from_secs(20), || {
        pool_a.report().cluster.is_some_and(|c| c.export_bytes_used == 0 && c.leased_pins == 0)
    });
    assert!(gone.elapsed() >= Duration::from_millis(2000), "freed only once the lease ended ({:?})", gone.elapsed());
    // B lists the keys its failed pulls dropped again (A still holds them).
    wait_until("pool B to list pool A's blocks again", Duration::from_secs(20), || pool_b.report().tiers.remote == 32);
    let l = load(&pool_b, 0, 4);
    assert_eq!((n(&l, "loaded"), n(&l, "corrupt")), (4, 0), "{l}");
    // B unpins after its read lands, over the control connection, beside publishing the
    // load: A frees the slots when that message arrives (a moment after the load returns).
    wait_until("B's pins to give their slots back", Duration::from_secs(5), || {
        pool_a.report().cluster.is_some_and(|c| c.export_bytes_used == 0)
    });
}
