//! A real network partition of the cluster tier (issue #17; docs/cluster.md, "What was
//! tested here"): three real `umbp-pool` daemons, each in a network namespace of its own
//! (`ip netns`), joined by veth pairs to a bridge in a fourth ("switch") namespace, talking
//! their control protocol and NIXL (UCX TCP on the namespace's veth device, not loopback)
//! over 10.201.0.0/24. Workers and index clients run in the test's namespace and attach
//! over each pool's unix socket (a path on the shared filesystem, so it crosses network
//! namespaces). The partition detaches pool A's port from the bridge: both veth ends stay
//! up and nothing is reset or refused, A's frames just stop arriving (a cut between
//! switches), while B and C keep their link.
//!
//! - blocks stored through A are listed in B's and C's indexes and load byte-exact via B;
//! - partition: a load through B of A's keys started during the partition ends as misses
//!   (no wrong byte) within the read budget; B's local loads and stores keep their
//!   latency (< 1 s) and B still loads C's blocks; A's keys leave B's and C's indexes
//!   within the heartbeat bound (and not before half of it: no connection reset tells
//!   them), B's and C's keys leave A's; A still serves its own engines;
//! - heal: A re-joins both (keys listed again, loads byte-exact again);
//! - a partition in the middle of B's load of 1000 of A's blocks: every block ends loaded
//!   or missing, none corrupt, each request within the read budget; after healing all
//!   1000 load byte-exact.
//!
//! More tests pin down bugs this found. Blocking socket writes under a peer's writer lock
//! (fixed by cluster/src/outbox.rs): a partitioned subscriber stalled its holder's
//! heartbeats to healthy peers, and a fetch from a partitioned holder overran its read
//! budget. UCX's blocking TCP connect to a peer that does not answer (fixed by
//! cluster/src/transport.rs's non-blocking connects): a healthy holder's reads stalled after
//! a partition, and reliably beside a member whose NIXL address (a second network, `veth1`,
//! its port cut) does not answer. Each failed on the code before its fix.
//!
//! `UMBP_PARTITION_LOG_DIR=DIR` writes each pool's log to `DIR/{a,b,c}.log`.
//!
//! Skips, printing why, as a non-root user, without `ip` (iproute2), when `ip netns add`
//! is refused (no CAP_SYS_ADMIN/CAP_NET_ADMIN, e.g. in an unprivileged container), or
//! without libnixl_capi.so. The namespaces (and with them the veths and the bridge) are
//! deleted on drop, also when the test fails; the pools are killed first.

mod common;
use common::*;

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use umbp_protocol::ObjectKey;
use umbp_scheduler::IndexClient;

const HEARTBEAT_MS: u64 = 200;
const DEAD_AFTER_MS: u64 = 2000;
/// Bound on one remote load (pins: half of it). Below DEAD_AFTER_MS, so a load started
/// right after the cut meets A still listed and its pins time out.
const READ_TIMEOUT_MS: u64 = 1600;
/// The pools' names, addresses (10.201.0.{1,2,3}) and switch ports.
const POOLS: [&str; 3] = ["a", "b", "c"];
const CONTROL_PORT: u16 = 7400;
/// The veth end inside each pool's namespace (control, and NIXL's UCX_NET_DEVICES).
const DEV: &str = "veth0";
/// The second veth end of a split network ([`Net::create_split`]): NIXL only.
const DATA_DEV: &str = "veth1";

/// Runs `ip ARGS`; its stderr on failure.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).stdin(Stdio::null()).output().map_err(|e| format!("run ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {} {}", args.join(" "), out.status, String::from_utf8_lossy(&out.stderr).trim()))
    }
}

fn must(args: &[&str]) {
    ip(args).unwrap_or_else(|e| panic!("{e}"));
}

/// A test's network: namespaces `umbp-part-<pid>-<tag>-{sw,a,b,c}`; deleted on drop (which
/// deletes the veths and the bridge in them).
struct Net {
    prefix: String,
    made: Vec<String>,
}

impl Net {
    /// None (after printing why) where network namespaces cannot be made here.
    /// `tag` tells apart the tests of this file running at once.
    fn create(tag: &str) -> Option<Self> {
        Self::create_with(tag, false)
    }

    /// As [`Net::create`], plus a second network for NIXL only: a bridge `br1` and in each
    /// pool's namespace [`DATA_DEV`] at 10.202.0.{1,2,3}, its neighbours' MACs fixed (so a
    /// cut port's SYNs go unanswered, as after a partition, instead of failing at ARP).
    fn create_split(tag: &str) -> Option<Self> {
        Self::create_with(tag, true)
    }

    fn create_with(tag: &str, split: bool) -> Option<Self> {
        if !umbp_integration_tests::root_or_skip("ip netns add, veth pairs") {
            return None;
        }
        if let Err(e) = ip(&["-V"]) {
            println!("skipped: `ip` (iproute2) is not usable here: {e}");
            return None;
        }
        let mut net = Self { prefix: format!("umbp-part-{}-{tag}", std::process::id()), made: Vec::new() };
        let sw = net.ns("sw");
        if let Err(e) = ip(&["netns", "add", &sw]) {
            println!("skipped: cannot create a network namespace (needs CAP_SYS_ADMIN and CAP_NET_ADMIN): {e}");
            return None;
        }
        net.made.push(sw.clone());
        // Bridge and veth are kernel modules a container may lack: a skip, not a failure.
        if let Err(e) = ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"]) {
            println!("skipped: cannot create a bridge (kernel module `bridge`): {e}");
            return None;
        }
        must(&["-n", &sw, "link", "set", "br0", "up"]);
        for (i, p) in POOLS.iter().enumerate() {
            let ns = net.ns(p);
            must(&["netns", "add", &ns]);
            net.made.push(ns.clone());
            let port = format!("p{p}");
            let veth = ["-n", &sw, "link", "add", &port, "type", "veth", "peer", "name", DEV, "netns", &ns];
            if let Err(e) = ip(&veth) {
                if i == 0 {
                    println!("skipped: cannot create a veth pair (kernel module `veth`): {e}");
                    return None;
                }
                panic!("{e}");
            }
            must(&["-n", &sw, "link", "set", &port, "master", "br0"]);
            must(&["-n", &sw, "link", "set", &port, "up"]);
            must(&["-n", &ns, "addr", "add", &format!("{}/24", Self::host(i)), "dev", DEV]);
            must(&["-n", &ns, "link", "set", DEV, "up"]);
            must(&["-n", &ns, "link", "set", "lo", "up"]);
        }
        if split {
            must(&["-n", &sw, "link", "add", "br1", "type", "bridge"]);
            must(&["-n", &sw, "link", "set", "br1", "up"]);
            for (i, p) in POOLS.iter().enumerate() {
                let (ns, port) = (net.ns(p), format!("q{p}"));
                let mac = Self::data_mac(i);
                must(&["-n", &sw, "link", "add", &port, "type", "veth", "peer", "name", DATA_DEV, "address", &mac, "netns", &ns]);
                must(&["-n", &sw, "link", "set", &port, "master", "br1"]);
                must(&["-n", &sw, "link", "set", &port, "up"]);
                must(&["-n", &ns, "addr", "add", &format!("{}/24", Self::data_host(i)), "dev", DATA_DEV]);
                must(&["-n", &ns, "link", "set", DATA_DEV, "up"]);
            }
            for (i, p) in POOLS.iter().enumerate() {
                for o in (0..POOLS.len()).filter(|&o| o != i) {
                    let (host, mac) = (Self::data_host(o), Self::data_mac(o));
                    must(&["-n", &net.ns(p), "neigh", "replace", &host, "lladdr", &mac, "dev", DATA_DEV, "nud", "permanent"]);
                }
            }
        }
        Some(net)
    }

    fn data_host(i: usize) -> String {
        format!("10.202.0.{}", i + 1)
    }

    fn data_mac(i: usize) -> String {
        format!("02:00:0a:ca:00:{:02x}", i + 1)
    }

    /// Cuts pool `p`'s NIXL port ([`Net::create_split`]) off its bridge; control stays up.
    fn cut_data(&self, p: &str) {
        must(&["-n", &self.ns("sw"), "link", "set", &format!("q{p}"), "nomaster"]);
    }

    fn ns(&self, pool: &str) -> String {
        format!("{}-{pool}", self.prefix)
    }

    fn host(i: usize) -> String {
        format!("10.201.0.{}", i + 1)
    }

    /// Cuts pool `p`'s port off the bridge: its frames go nowhere, nobody's link goes down.
    fn cut(&self, p: &str) {
        must(&["-n", &self.ns("sw"), "link", "set", &format!("p{p}"), "nomaster"]);
    }

    fn heal(&self, p: &str) {
        must(&["-n", &self.ns("sw"), "link", "set", &format!("p{p}"), "master", "br0"]);
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in self.made.iter().rev() {
            if let Err(e) = ip(&["netns", "del", ns]) {
                eprintln!("cleanup: {e}");
            }
        }
    }
}

/// A `umbp-pool` run inside a network namespace (`ip netns exec` execs it in place, so
/// the child is the pool); killed on drop, its socket directory removed.
struct NsPool {
    child: Child,
    socket: PathBuf,
}

impl NsPool {
    /// `dev`: UCX_NET_DEVICES, the device NIXL uses.
    fn start(ns: &str, socket: &Path, args: &[String], dev: &str) -> Self {
        let mut cmd = Command::new("ip");
        if let Some(dir) = std::env::var_os("UMBP_PARTITION_LOG_DIR") {
            let name = ns.rsplit('-').next().unwrap_or("pool");
            let f = std::fs::File::create(Path::new(&dir).join(format!("{name}.log"))).expect("pool log file");
            cmd.stderr(f);
        }
        let child = cmd
            .args(["netns", "exec", ns])
            .arg(pool_binary())
            .arg("--socket")
            .arg(socket)
            .args(args)
            .env("UCX_TLS", "tcp,self")
            .env("UCX_NET_DEVICES", dev)
            .env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()))
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn ip netns exec umbp-pool");
        let mut p = Self { child, socket: socket.to_path_buf() };
        let deadline = Instant::now() + Duration::from_secs(20);
        while UnixStream::connect(socket).is_err() {
            if let Ok(Some(st)) = p.child.try_wait() {
                panic!("pool in {ns} exited before listening: {st}");
            }
            assert!(Instant::now() < deadline, "pool in {ns} did not start listening at {}", socket.display());
            std::thread::sleep(Duration::from_millis(10));
        }
        p
    }

    fn report(&self) -> umbp_pool::PoolReport {
        report(&self.socket)
    }
}

impl Drop for NsPool {
    fn drop(&mut self) {
        kill_and_clean(&mut self.child, &self.socket);
    }
}

fn keys(first: u128, count: u128) -> Vec<ObjectKey> {
    (first..first + count).map(|i| ObjectKey::derive(1, 0, 0, &i.to_le_bytes())).collect()
}

fn listed(idx: &mut IndexClient, keys: &[ObjectKey]) -> usize {
    keys.iter().filter(|k| idx.contains(**k)).count()
}

fn load(pool: &NsPool, first: u128, count: u64) -> serde_json::Value {
    run_worker(&pool.socket, 1, "per-layer", &["load", "--first-key", &first.to_string(), "--count", &count.to_string()])
}

fn store(pool: &NsPool, first: u128, count: u64) -> serde_json::Value {
    let r = run_worker(&pool.socket, 1, "per-layer", &["store", "--first-key", &first.to_string(), "--count", &count.to_string()]);
    assert_eq!((n(&r, "stored"), n(&r, "failed")), (count, 0), "{r}");
    r
}

/// (loaded, corrupt, missing + failed) of a load's result.
fn outcome(r: &serde_json::Value) -> (u64, u64, u64) {
    (n(r, "loaded"), n(r, "corrupt"), n(r, "missing") + n(r, "failed"))
}

/// The network and the three pools on it. Fields drop in declaration order: the pools are
/// killed before their namespaces are deleted.
struct Cluster3 {
    _secret_dir: tempfile::TempDir,
    pools: Vec<NsPool>,
    net: Net,
}

/// Three pools A, B, C (10.201.0.1-3), each listing the other two; None where the test
/// cannot run here (printed why).
fn cluster3(tag: &str) -> Option<Cluster3> {
    start_cluster3(tag, Net::create(tag)?, DEV)
}

/// The pools of [`cluster3`] on `net`, NIXL on device `dev`.
fn start_cluster3(tag: &str, net: Net, dev: &str) -> Option<Cluster3> {
    if !cluster::nixl_on_loopback() {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let secret = cluster::secret_file(dir.path(), b"partition-test-secret-0123456789");
    let addr = |i: usize| format!("{}:{CONTROL_PORT}", Net::host(i));
    let timing = cluster::Timing { heartbeat_ms: HEARTBEAT_MS, dead_after_ms: DEAD_AFTER_MS, read_timeout_ms: READ_TIMEOUT_MS };
    let pools: Vec<NsPool> = (0..POOLS.len())
        .map(|me| {
            let peers: Vec<String> = (0..POOLS.len()).filter(|&o| o != me).map(addr).collect();
            let peers: Vec<&str> = peers.iter().map(String::as_str).collect();
            let a = cluster::pool_args(&addr(me), &peers, &secret, timing, &[]);
            NsPool::start(&net.ns(POOLS[me]), &unique_socket(&format!("part-{tag}-{}", POOLS[me])), &a, dev)
        })
        .collect();
    Some(Cluster3 { _secret_dir: dir, pools, net })
}

fn index(p: &NsPool) -> IndexClient {
    IndexClient::connect(&p.socket, 1, Duration::from_secs(5)).expect("index client over the unix socket")
}

#[test]
fn a_partitioned_pool_leaves_every_index_in_bounded_time_and_rejoins() {
    let Some(c3) = cluster3("rejoin") else { return };
    let (net, pools) = (&c3.net, &c3.pools);
    let (pa, pb, pc) = (&pools[0], &pools[1], &pools[2]);
    let (mut ia, mut ib, mut ic) = (index(pa), index(pb), index(pc));

    // 1. Over the veths: A's blocks listed in B and C, byte-exact through B.
    let k_a = keys(0, 100);
    store(pa, 0, 100);
    let took = wait_until("B and C to list A's blocks over the veths", Duration::from_secs(30), || {
        listed(&mut ib, &k_a) == 100 && listed(&mut ic, &k_a) == 100
    });
    println!("B and C listed 100 blocks of A {took:?} after the store (control + NIXL over 10.201.0.0/24)");
    assert_eq!(pb.report().tiers.remote, 100);
    let r = load(pb, 0, 100);
    assert_eq!(outcome(&r), (100, 0, 0), "B loads A's blocks: {r}");
    // Set-up for the partition: K_A2 held by A only, K_B by B only, K_C by C only.
    let k_a2 = keys(5000, 200);
    let k_b = keys(1000, 100);
    let k_c = keys(2000, 100);
    store(pa, 5000, 200);
    store(pb, 1000, 100);
    store(pc, 2000, 100);
    wait_until("every pool to list the others' blocks", Duration::from_secs(30), || {
        listed(&mut ib, &k_a2) == 200
            && listed(&mut ic, &k_a2) == 200
            && listed(&mut ia, &k_b) == 100
            && listed(&mut ia, &k_c) == 100
            && listed(&mut ic, &k_b) == 100
            && listed(&mut ib, &k_c) == 100
    });
    let base = load(pb, 1000, 100);
    assert_eq!(outcome(&base), (100, 0, 0), "{base}");
    println!("B's local loads before the partition: max_wait_ms {}", n(&base, "max_wait_ms"));

    // 2. Partition A off the bridge.
    net.cut("a");
    let cut = Instant::now();
    // A load through B of A's keys, started now (A still listed): misses, within the budget.
    let sb = pb.socket.clone();
    let remote = std::thread::spawn(move || {
        let t = Instant::now();
        let r = run_worker(&sb, 1, "per-layer", &["load", "--first-key", "5000", "--count", "64"]);
        (r, t.elapsed(), cut.elapsed())
    });
    // Meanwhile B's own traffic: loads of its blocks and stores of new ones, not held up.
    std::thread::sleep(Duration::from_millis(200));
    let local = load(pb, 1000, 100);
    let local_done = cut.elapsed();
    assert_eq!(outcome(&local), (100, 0, 0), "B's local loads during the partition: {local}");
    assert!(
        n(&local, "max_wait_ms") < 1000,
        "a local load on B waited {} ms while A was partitioned (read timeout {READ_TIMEOUT_MS} ms)",
        n(&local, "max_wait_ms")
    );
    // (20 blocks: their change stream to A, ~3 KB, stays within the connection's send
    // buffer; a larger one stalled B's heartbeats to C before outbox.rs, the stall test below.)
    let st = store(pb, 3000, 20);
    assert!(n(&st, "max_wait_ms") < 1000, "a local store on B waited {} ms during the partition", n(&st, "max_wait_ms"));
    println!(
        "B's local loads during the partition: max_wait_ms {} (done {local_done:?} after the cut), stores max_wait_ms {}",
        n(&local, "max_wait_ms"),
        n(&st, "max_wait_ms")
    );
    let (r, remote_took, remote_done) = remote.join().unwrap();
    println!("B's load of 64 of A's blocks started at the cut: {r} in {remote_took:?}");
    assert_eq!(outcome(&r), (0, 0, 64), "a partitioned holder's blocks are misses, never bytes: {r}");
    assert!(n(&r, "max_wait_ms") < READ_TIMEOUT_MS + 200, "the fetch took {} ms, budget {READ_TIMEOUT_MS} ms: {r}", n(&r, "max_wait_ms"));
    assert!(
        remote_took < Duration::from_millis(READ_TIMEOUT_MS + 1500),
        "the load of a partitioned holder's blocks took {remote_took:?} (read budget {READ_TIMEOUT_MS} ms)"
    );
    if local_done >= remote_done {
        println!(
            "skipped: B's local loads did not overlap the stuck remote load (machine too slow); their latency was not observed beside it"
        );
    }
    // The healthy link B-C still carries remote loads.
    let r = load(pb, 2000, 100);
    assert_eq!(outcome(&r), (100, 0, 0), "B loads C's blocks while A is partitioned: {r}");

    // A leaves B's and C's indexes within the heartbeat bound, B and C leave A's; not
    // before half the bound (nothing resets a partitioned connection).
    let bound = Duration::from_millis(DEAD_AFTER_MS + 4 * HEARTBEAT_MS + 2000);
    wait_until("A's keys to leave B's and C's indexes, B's and C's to leave A's", bound, || {
        listed(&mut ib, &k_a2) == 0 && listed(&mut ic, &k_a2) == 0 && listed(&mut ia, &k_b) == 0 && listed(&mut ia, &k_c) == 0
    });
    let gone = cut.elapsed();
    keeps_quarantined_reads_of(pb, "A", "the first drop");
    println!("partition: A and {{B, C}} dropped each other {gone:?} after the cut (dead-after {DEAD_AFTER_MS} ms)");
    assert!(gone >= Duration::from_millis(DEAD_AFTER_MS / 2), "dropped after {gone:?}, long before the heartbeat bound");
    assert_eq!(listed(&mut ic, &k_b), 100, "C keeps B's entries: their link is up");
    let t = Instant::now();
    let r = load(pb, 5064, 136);
    assert_eq!(outcome(&r), (0, 0, 136), "{r}");
    println!("B's load of 136 more of A's blocks after the drop: all missing in {:?}", t.elapsed());
    let r = load(pa, 5000, 200);
    assert_eq!(outcome(&r), (200, 0, 0), "A serves its own engines while partitioned: {r}");

    // 3. Heal: A re-joins both, its blocks are listed and load again, and it sees theirs.
    net.heal("a");
    let back = wait_until("A to re-join B and C after the heal", Duration::from_secs(30), || {
        listed(&mut ib, &k_a2) == 200 && listed(&mut ic, &k_a2) == 200 && listed(&mut ia, &k_b) == 100
    });
    println!("heal: A's blocks listed in B and C again, B's in A, {back:?} after re-attaching the port");
    reclaims_quarantine_after_heal(pb, "the first heal");
    let r = load(pb, 5000, 200);
    assert_eq!(outcome(&r), (200, 0, 0), "B loads A's blocks after the heal: {r}");
    let r = load(pa, 1000, 100);
    assert_eq!(outcome(&r), (100, 0, 0), "A loads B's blocks after the heal: {r}");

    // 4. A partition in the middle of B's load of 1000 of A's blocks.
    // (K_A4: held by A only, to watch A leave and re-join B's index; B holds K_A2 now.)
    let k_a3 = keys(10_000, 1000);
    let k_a4 = keys(20_000, 50);
    store(pa, 10_000, 1000);
    store(pa, 20_000, 50);
    wait_until("B to list the 1050 new blocks of A", Duration::from_secs(30), || {
        listed(&mut ib, &k_a3) == 1000 && listed(&mut ib, &k_a4) == 50
    });
    // Requests of 16 blocks: the pins sent after the cut (~2.5 KB a request) stay within
    // the connection's send buffer; larger ones overran the read budget before outbox.rs,
    // the budget test below.
    let sb = pb.socket.clone();
    let t = Instant::now();
    let inflight =
        std::thread::spawn(move || run_worker(&sb, 1, "per-layer", &["--blocks", "16", "load", "--first-key", "10000", "--count", "1000"]));
    std::thread::sleep(Duration::from_millis(60));
    net.cut("a");
    let r = inflight.join().unwrap();
    let took = t.elapsed();
    println!("B's load of 1000 of A's blocks, A cut 60 ms in: {r} in {took:?}; B quarantined {} bytes", pb.report().pool.quarantined_bytes);
    let (loaded, corrupt, missing) = outcome(&r);
    assert_eq!((corrupt, loaded + missing), (0, 1000), "every block loaded or missing, none corrupt: {r}");
    assert!(n(&r, "max_wait_ms") < READ_TIMEOUT_MS + 200, "a request took {} ms, budget {READ_TIMEOUT_MS} ms: {r}", n(&r, "max_wait_ms"));
    assert!(
        took < Duration::from_millis(DEAD_AFTER_MS + READ_TIMEOUT_MS + 3000),
        "the load cut off mid-way took {took:?} (dead-after {DEAD_AFTER_MS} ms, read budget {READ_TIMEOUT_MS} ms)"
    );
    if missing == 0 {
        println!("skipped: the load finished before the cut; a cut mid-load was not observed this run");
    }
    wait_until("B to drop A again", bound, || listed(&mut ib, &k_a4) == 0);
    keeps_quarantined_reads_of(pb, "A", "the second drop");
    net.heal("a");
    wait_until("A to re-join B again", Duration::from_secs(30), || listed(&mut ib, &k_a4) == 50);
    reclaims_quarantine_after_heal(pb, "the second heal");
    // What loaded is local on B now, the rest is listed again from A: all 1000 byte-exact
    // (nothing half-fetched was published).
    wait_until("B to list A's 1000 blocks again", Duration::from_secs(30), || listed(&mut ib, &k_a3) == 1000);
    let r = load(pb, 10_000, 1000);
    assert_eq!(outcome(&r), (1000, 0, 0), "after the second heal: {r}");
}

/// Issue #31: the DRAM of reads from a dropped holder that timed out stays quarantined while
/// the holder stays cut off: its reads are not final (NIXL reports them neither completed
/// nor failed), and a posted read can still land when the link comes back (the chaos soak
/// saw one land, on the holder's resume, in DRAM that had been reclaimed at the holder's
/// forget and given to another object: 65,307 wrong bytes returned as `Loaded`). Reads time
/// out in some runs only (others miss at the pin): a run where none did says so.
fn keeps_quarantined_reads_of(pool: &NsPool, holder: &str, when: &str) {
    let before = pool.report().pool;
    // Past the drop (within a second of the timeout).
    std::thread::sleep(Duration::from_secs(2));
    let p = pool.report().pool;
    assert_eq!(
        p.quarantine_reclaimed_bytes, before.quarantine_reclaimed_bytes,
        "after {when}: DRAM of timed-out reads from {holder} was reclaimed while {holder} is cut off: {p:?}"
    );
    assert!(p.quarantined_bytes >= before.quarantined_bytes, "after {when}: quarantined DRAM shrank from {before:?} to {p:?}");
    if p.quarantined_bytes == 0 {
        println!("not observed after {when}: no read from {holder} had timed out (nothing was quarantined)");
    } else {
        println!("after {when}: {} bytes of timed-out reads from {holder} stay quarantined", p.quarantined_bytes);
    }
}

/// Once the link is back, the given-up reads end (they complete, or their endpoint fails
/// them) and NIXL reports them final: their quarantined DRAM is reclaimed.
fn reclaims_quarantine_after_heal(pool: &NsPool, when: &str) {
    let q = pool.report().pool.quarantined_bytes;
    let took = wait_until(&format!("the quarantine to be reclaimed after {when}"), Duration::from_secs(60), || {
        pool.report().pool.quarantined_bytes == 0
    });
    println!("after {when}: {q} quarantined bytes reclaimed within {took:?} (the given-up reads were final)");
}

/// Fixed bug (issue #17; docs/cluster.md, "What was tested here"): a partitioned
/// *subscriber* stalled its holder's heartbeats to healthy peers. B stores 1200 blocks just
/// after A is cut off: B's change stream to A (~170 KB of `Keys` JSON) fills that
/// connection's send buffer, `Cluster::publish` (the `cluster-events` thread) blocks in
/// the write for up to the write timeout (`dead_after`) holding A's writer lock, and B's
/// ticker waits on that lock before it heartbeats anyone else. C hears nothing from B for
/// `dead_after` and drops it; the healthy B-C link is torn down and B's blocks vanish from
/// C's index (observed: K_B 0 of 100 listed in C, B's new keys listed in C 3.4 s after the
/// store; B's loads of C's blocks then missed; in other runs C keeps B but lists B's new
/// keys only after more than 3.5 s: the change stream to C waits behind the one to A). Fixed by cluster/src/outbox.rs:
/// only a connection's own writer thread ever blocks on its socket.
#[test]
fn a_partitioned_subscriber_does_not_stall_heartbeats_to_healthy_peers() {
    partition_a_while_b_stores("stall");
}

/// Fixed bug (issue #17; docs/cluster.md "What was tested here"): after A is cut off and
/// dropped, C's first NIXL READ from the healthy B stalled past the 1.6 s budget in about 1
/// run of 7 on the 2-core VM (pins answered in 3-8 ms, all 100 blocks then missing, never a
/// wrong byte). The cut can land while B is still loading A's NIXL metadata (the `Join` of
/// B's subscription to A, which no step before the cut waits for). UCX's TCP transport then
/// connected to A with a blocking `connect()` inside `ucp_ep_create`, under B's UCP worker
/// lock, for the kernel's SYN retries (14 s seen): a stack of B taken during the stalled
/// READ had that `connect()` under `load_remote_md` and NIXL's progress thread spinning on
/// the worker lock in `ucp_worker_progress`, so B served no read. Fixed by non-blocking UCX
/// TCP connects (cluster/src/transport.rs, `UCX_ENGINE_CONFIG`). This test meets the race
/// only now and then; the next one makes that cause certain.
#[test]
fn a_healthy_holders_first_read_after_a_partition_completes() {
    let Some(c3) = partition_a_while_b_stores("stall-read") else { return };
    let pc = &c3.pools[2];
    let r = load(pc, 1000, 100);
    println!("C's load of B's blocks: {r}; promoted ahead in C: {}", pc.report().pool.promotions_ahead);
    assert_eq!(outcome(&r), (100, 0, 0), "C loads B's blocks while A is partitioned: {r}");
    assert!(
        n(&r, "max_wait_ms") < READ_TIMEOUT_MS,
        "C's load of B's blocks waited {} ms (budget {READ_TIMEOUT_MS} ms): {r}",
        n(&r, "max_wait_ms")
    );
}

/// Fixed bug (issue #17), the cause of the one above made certain: a member whose NIXL
/// address does not answer (its data port cut before the pools start, its control
/// connections up) must not stall the reads between the others. Before the fix, B's and
/// C's `load_remote_md` of A's `Join` created their UCX endpoints to A with a blocking TCP
/// `connect()` under their UCP worker's lock (UCX_TCP_CONN_NB=n, UCX's default); the SYNs
/// go unanswered, so for the kernel's SYN retries neither worker progressed and every read
/// between B and C timed out (reproduce with `UCX_TCP_CONN_NB=n` in the environment,
/// which NIXL lets override cluster/src/transport.rs's `TCP_CONN_NB=y`).
#[test]
fn a_member_whose_nixl_address_does_not_answer_stalls_no_other_read() {
    let Some(net) = Net::create_split("dataless") else { return };
    net.cut_data("a");
    let Some(c3) = start_cluster3("dataless", net, DATA_DEV) else { return };
    let (pa, pb, pc) = (&c3.pools[0], &c3.pools[1], &c3.pools[2]);
    let (mut ib, mut ic) = (index(pb), index(pc));
    let (k_a, k_b, k_c) = (keys(50_000, 10), keys(1000, 100), keys(2000, 100));
    store(pa, 50_000, 10);
    store(pb, 1000, 100);
    store(pc, 2000, 100);
    // A's keys listed means A's Join (NIXL metadata) was loaded first: B and C have an
    // endpoint to A's unanswering address.
    let took = wait_until("B and C to list each other's and A's blocks", Duration::from_secs(30), || {
        listed(&mut ib, &k_a) == 10 && listed(&mut ic, &k_a) == 10 && listed(&mut ib, &k_c) == 100 && listed(&mut ic, &k_b) == 100
    });
    println!("B and C listed A's, B's and C's blocks {took:?} after the stores (A's NIXL port cut)");
    for (who, p, first) in [("C", pc, 1000), ("B", pb, 2000)] {
        let t = Instant::now();
        let r = load(p, first, 100);
        println!("{who}'s load of 100 blocks of a healthy member: {r} in {:?}", t.elapsed());
        assert_eq!(outcome(&r), (100, 0, 0), "{who} loads a healthy member's blocks beside an unanswering one: {r}");
        assert!(
            n(&r, "max_wait_ms") < READ_TIMEOUT_MS,
            "{who}'s load waited {} ms (budget {READ_TIMEOUT_MS} ms): {r}",
            n(&r, "max_wait_ms")
        );
    }
    let r = load(pc, 50_000, 10);
    println!("C's load of A's blocks: {r}");
    assert_eq!(outcome(&r), (0, 0, 10), "the unanswering member's blocks are misses, never bytes: {r}");
    assert!(n(&r, "max_wait_ms") < READ_TIMEOUT_MS + 200, "the fetch took {} ms, budget {READ_TIMEOUT_MS} ms: {r}", n(&r, "max_wait_ms"));

    // Issue #31: those reads outlived their budget while A stays a member (its control
    // connection answers heartbeats), so their DRAM in C may still be written: quarantined.
    // C drops A at the timeout and A re-joins; the DRAM stays quarantined even so, as the
    // reads are not final (their endpoint's connect is still unanswered; a posted read can
    // land later: see `keeps_quarantined_reads_of`). Before f55169f's fix was undone, C
    // reclaimed it when it forgot A.
    let quarantined = pc.report().pool.quarantined_bytes;
    assert!(quarantined > 0, "C's timed-out reads from A quarantine their DRAM");
    wait_until("A to re-join C (its blocks listed again)", Duration::from_secs(30), || listed(&mut ic, &k_a) == 10);
    let p = pc.report().pool;
    assert!(p.quarantined_bytes >= quarantined && p.quarantine_reclaimed_bytes == 0, "after A re-joined C: {p:?}");
    let r = load(pb, 2000, 100);
    assert_eq!(outcome(&r), (100, 0, 0), "B still loads C's blocks: {r}");
}

/// The stall test's steps (see above), on a fresh cluster; returns it with A still cut off
/// (None where the test cannot run here).
fn partition_a_while_b_stores(tag: &str) -> Option<Cluster3> {
    let c3 = cluster3(tag)?;
    let (net, pools) = (&c3.net, &c3.pools);
    let (pb, pc) = (&pools[1], &pools[2]);
    let mut ic = index(pc);
    let k_b = keys(1000, 100);
    store(pb, 1000, 100);
    wait_until("C to list B's blocks", Duration::from_secs(30), || listed(&mut ic, &k_b) == 100);
    // Wait until A subscribes to B (B then publishes to it): A lists B's blocks.
    let mut ia = index(&pools[0]);
    wait_until("A to list B's blocks", Duration::from_secs(30), || listed(&mut ia, &k_b) == 100);

    net.cut("a");
    let cut = Instant::now();
    let k_new = keys(30_000, 1200);
    store(pb, 30_000, 1200);
    let stored = cut.elapsed();
    // For longer than dead-after: C must keep B (their link is up) and list B's new keys
    // promptly (B's change stream to C must not queue behind the one to A).
    let (mut fewest, mut all_new) = (100, None);
    while cut.elapsed() < Duration::from_millis(DEAD_AFTER_MS + 1500) {
        fewest = fewest.min(listed(&mut ic, &k_b));
        if all_new.is_none() && listed(&mut ic, &k_new) == 1200 {
            all_new = Some(cut.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    println!("B stored 1200 blocks {stored:?} after A's cut; C listed them {all_new:?} after the cut; fewest of B's 100 old blocks listed in C: {fewest}");
    assert_eq!(fewest, 100, "C dropped B (a healthy link) while A was partitioned");
    let listed_at = all_new.expect("C never listed B's new blocks");
    assert!(listed_at < stored + Duration::from_millis(1000), "C listed B's new blocks {listed_at:?} after the cut (stored {stored:?})");
    Some(c3)
}

/// Fixed bug (issue #17; docs/cluster.md, "What was tested here"): a fetch from a
/// partitioned holder overran its read budget. B loads 1024 of A's blocks in one request
/// just after A is cut off: `fetch_batch` (cluster/src/node.rs) sends the 1024 `Pin` frames
/// (~150 KB of JSON) with blocking socket writes before it starts its pin deadline; the
/// unacknowledged connection's send buffer fills and a write blocks for the socket's write
/// timeout (`dead_after`, 2 s here), holding the peer's writer lock (so the ticker's
/// heartbeats wait too), against a budget of `read_timeout` (1.6 s). In the main test's
/// cut-mid-load phase the same shows now and then (fetches of 64 blocks of 2.03 s and
/// 5.4 s measured with the budget 1.6 s). Fixed by cluster/src/outbox.rs:
/// pins are queued, never written by the fetch itself; a connection that does not drain is
/// closed and its pins fail at once as `PeerGone`.
#[test]
fn a_fetch_from_a_partitioned_holder_ends_within_the_read_budget() {
    let Some(c3) = cluster3("budget") else { return };
    let (net, pools) = (&c3.net, &c3.pools);
    let (pa, pb) = (&pools[0], &pools[1]);
    let mut ib = index(pb);
    let k = keys(40_000, 1024);
    store(pa, 40_000, 1024);
    wait_until("B to list A's 1024 blocks", Duration::from_secs(30), || listed(&mut ib, &k) == 1024);
    net.cut("a");
    let t = Instant::now();
    let r = run_worker(&pb.socket, 1, "per-layer", &["--blocks", "1024", "load", "--first-key", "40000", "--count", "1024"]);
    println!("B's load of 1024 of A's blocks in one request right after the cut: {r} in {:?}", t.elapsed());
    assert_eq!(outcome(&r), (0, 0, 1024), "{r}");
    assert!(n(&r, "max_wait_ms") < READ_TIMEOUT_MS + 400, "the fetch took {} ms, budget {READ_TIMEOUT_MS} ms", n(&r, "max_wait_ms"));
}
