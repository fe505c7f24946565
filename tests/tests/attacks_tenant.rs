//! Attacks of one tenant on the others (issue #13 items 7, 8, 11; docs/security.md):
//! a real `umbp-pool` process, real worker and scheduler processes on its socket.
//!
//! - index flooding: tiny objects, keys chosen to collide, one namespace taking the pool;
//! - touch hints that pin the whole pool;
//! - the state report leaking other tenants' pids, uids and namespaces;
//! - the shared index and KV event log listing every tenant's keys (per-group indexes).

mod common;
use common::*;

use std::process::{Command, Stdio};
use std::time::Duration;

/// `--layers 4 --page 16384`: 64 KiB objects, the pool's default --min-object-size.
const OBJ64K: [&str; 4] = ["--layers", "4", "--page", "16384"];

fn worker(socket: &std::path::Path, ns: u128, extra: &[&str], cmd: &[&str]) -> serde_json::Value {
    let mut args: Vec<&str> = extra.to_vec();
    args.extend_from_slice(cmd);
    run_worker(socket, ns, "per-layer", &args)
}

/// Tiny objects: a tenant registers a layout of 16 KiB objects on a pool whose index is
/// sized for 64 KiB ones (the default) and stores 3x the pool. Before, the index filled at
/// 37.5 % of DRAM, the evictor (watching bytes only) never ran, and every later store of
/// every tenant was NotStored. Now the layout is refused, naming both sizes, and the other
/// tenant stores everything.
#[test]
fn tiny_objects_cannot_fill_the_index_for_everyone() {
    let pool = PoolProcess::start(&unique_socket("tiny"), &["--capacity", "64MiB"]);
    let count = (3 * (64u64 << 20) / (16 << 10)).to_string();
    let a = worker(&pool.socket, 1, &[], &["store", "--first-key", "0", "--count", &count]);
    let err = a["error"].as_str().unwrap_or_else(|| panic!("a layout of 16 KiB objects was accepted: {a}"));
    assert!(err.contains("16384") && err.contains("65536") && err.contains("--min-object-size"), "{err}");
    let v = worker(&pool.socket, 2, &OBJ64K, &["store", "--first-key", "0", "--count", "256"]);
    assert_eq!(n(&v, "stored"), 256, "the other tenant's stores: {v}");
}

/// Keys chosen to pile into one probe run: 1500 keys that protocol v2's unkeyed mix sent
/// to one home slot, so the index held them as one run of 1500 slots that every probe
/// near it walked (probe histogram: 1493 entries 7+ slots from home). With the per-pool
/// seed they spread like random keys, and the other tenant's stores all succeed.
#[test]
fn colliding_keys_do_not_pile_into_one_probe_run() {
    let pool = PoolProcess::start(&unique_socket("collide"), &["--capacity", "64MiB", "--min-object-size", "16KiB"]);
    let a = worker(&pool.socket, 1, &["--keys", "colliding"], &["store", "--first-key", "0", "--count", "1500"]);
    assert_eq!(n(&a, "stored"), 1500, "{a}");
    let v = worker(&pool.socket, 2, &[], &["store", "--first-key", "0", "--count", "512"]);
    assert_eq!(n(&v, "stored"), 512, "the other tenant's stores: {v}");
    let report = pool.report();
    let hist: Vec<u64> = report.index.as_ref().expect("index section").probe_histogram.clone();
    eprintln!("probe histogram after 1500 colliding + 512 derived keys: {hist:?}");
    assert_eq!(hist.iter().sum::<u64>(), 2012);
    assert!(hist[7] < 20, "entries 7+ slots from their home: {hist:?}");
}

/// One namespace storing 3x the pool evicts every other tenant's objects (LRU) unless
/// `--namespace-share` caps it: then it evicts its own oldest objects first and the other
/// tenant keeps all of its blocks. Run both ways: without the quota the attack works.
#[test]
fn namespace_quota_keeps_a_flooding_tenant_from_evicting_others() {
    let run = |tag: &str, extra: &[&str]| {
        let mut args = vec!["--capacity", "64MiB", "--min-object-size", "16KiB"];
        args.extend_from_slice(extra);
        let pool = PoolProcess::start(&unique_socket(tag), &args);
        let v = worker(&pool.socket, 2, &[], &["store", "--first-key", "0", "--count", "512"]);
        assert_eq!(n(&v, "stored"), 512, "{v}");
        let flood = (3 * (64u64 << 20) / (16 << 10)).to_string();
        let a = worker(&pool.socket, 1, &[], &["store", "--first-key", "0", "--count", &flood]);
        // A long timeout: on a loaded machine a load must not fail for lack of time.
        let l = worker(&pool.socket, 2, &["--timeout-ms", "30000"], &["load", "--first-key", "0", "--count", "512"]);
        assert_eq!(n(&l, "corrupt"), 0, "{l}");
        (a, l, pool.report())
    };
    let (a0, l0, _) = run("quota-off", &[]);
    eprintln!("no quota: flooder {a0}, victim loads {l0}");
    assert!(n(&l0, "missing") > 256, "without a quota the flood evicts the victim: {l0}");
    let (a, l, report) = run("quota", &["--namespace-share", "0.5"]);
    eprintln!("--namespace-share 0.5: flooder {a}, victim loads {l}, {}", report.pool.defences);
    assert_eq!(n(&l, "missing"), 0, "the victim keeps every block: {l}");
    assert_eq!(n(&l, "loaded"), 512, "{l}");
    assert!(n(&a, "stored") > n(&a, "not_stored"), "the flooder still stores, evicting its own: {a}");
    assert!(report.pool.defences.quota_evictions > 0, "{}", report.pool);
    let ns1 = report.namespaces.iter().find(|n| n.id() == Some(1)).unwrap();
    assert!(ns1.bytes <= 32 << 20, "{ns1}");
}

/// A tenant stores the whole pool and keeps re-touching every key with long leases
/// (`--lease-ms 60000`). Before, all of its objects stayed leased: when another tenant's
/// stores pushed the pool over the high watermark, the evictor could evict only that
/// tenant's fresh objects and the pool stayed above the high watermark for as long as the
/// pinner kept touching (every store beyond the last 10 % NotStored). Now one uid's leases
/// cover at most `--lease-share` of DRAM (0.5 by default), so the evictor gets the pool
/// back to its low watermark.
#[test]
fn touch_hints_cannot_pin_the_whole_pool() {
    let pool = PoolProcess::start(&unique_socket("pin"), &["--capacity", "64MiB", "--min-object-size", "16KiB", "--lease-ms", "60000"]);
    let pinner = RunningWorker::start(&pool.socket, 1, &["store-pin", "--first-key", "0", "--count", "4096", "--seconds", "30"], "pinned");
    std::thread::sleep(Duration::from_millis(300));
    let v = worker(&pool.socket, 2, &[], &["store", "--first-key", "0", "--count", "512"]);
    let low = (64u64 << 20) * 7 / 10;
    let back_to_low = eventually(Duration::from_secs(5), || pool.report().pool.allocated_bytes <= low + (1 << 20));
    let report = pool.report();
    drop(pinner);
    eprintln!("victim stores: {v}; pool {}", report.pool);
    assert!(back_to_low, "a pinning tenant kept the pool above its low watermark: {}", report.pool);
    assert!(report.pool.defences.leases_dropped > 0, "{}", report.pool);
}

/// Hints for another namespace's keys are ignored: a scheduler of namespace 9 re-touching
/// namespace 1's keys (it can compute them) does not lease them.
#[test]
fn hints_for_another_namespace_are_ignored() {
    let pool = PoolProcess::start(&unique_socket("foreign"), &["--capacity", "64MiB", "--min-object-size", "16KiB"]);
    let v = worker(&pool.socket, 1, &[], &["store", "--first-key", "0", "--count", "64"]);
    assert_eq!(n(&v, "stored"), 64, "{v}");
    let keys: Vec<umbp_protocol::ObjectKey> = (0..64u128).map(|i| umbp_protocol::ObjectKey::derive(1, 0, 0, &i.to_le_bytes())).collect();
    let mut idx = umbp_scheduler::IndexClient::connect(&pool.socket, 9, Duration::from_secs(5)).unwrap();
    assert_eq!(idx.match_prefix(&keys), 64, "lookups still see them");
    idx.touch(&keys);
    assert!(eventually(Duration::from_secs(5), || pool.report().pool.defences.foreign_hints_ignored >= 64), "{}", pool.report().pool);
}

/// The state report: a peer of another uid (65534, an unprivileged user) gets only its own
/// figures — no pid, uid or namespace of the pool's other tenants — while root (and the
/// pool's uid: ringtool) still gets the full report. Before, everyone got everything.
#[test]
fn stats_report_hides_other_tenants() {
    if !umbp_integration_tests::root_or_skip("to run a peer as uid 65534") {
        return;
    }
    let bin = workspace_binary("umbp-test-worker");
    let probe = Command::new(&bin).arg("--help").uid_gid(65534).stdout(Stdio::null()).stderr(Stdio::null()).status();
    if !probe.is_ok_and(|s| s.success()) {
        umbp_integration_tests::root::skip_root_part(&format!("uid 65534 cannot run {} (directory permissions)", bin.display()));
        return;
    }
    let pool = PoolProcess::start(
        &unique_socket("stats"),
        &["--capacity", "64MiB", "--min-object-size", "16KiB", "--allow-uid", "65534", "--socket-group", "65534"],
    );
    // A tenant of root (namespace 0xabcdef) stays attached while the report is taken.
    let tenant =
        RunningWorker::start(&pool.socket, 0xabcdef, &["store-pin", "--first-key", "0", "--count", "64", "--seconds", "20"], "pinned");
    let full = pool.report();
    let secret_ns = format!("{:032x}", 0xabcdefu128);
    assert!(full.to_string().contains(&secret_ns), "root gets the full report: {full}");
    let out = Command::new(&bin).arg("--socket").arg(&pool.socket).arg("stats").uid_gid(65534).output().unwrap();
    let tenant_pid = tenant.child.id();
    drop(tenant);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "stats as uid 65534 failed: {text} {}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    eprintln!("uid 65534 sees: {r}");
    assert_eq!(r["scope"], "tenant", "{r}");
    let typed: umbp_pool::Report = serde_json::from_value(r.clone()).unwrap_or_else(|e| panic!("not a report: {e}: {r}"));
    assert!(matches!(typed, umbp_pool::Report::Tenant(_)), "parsed as the tenant view: {r}");
    let s = r.to_string();
    assert!(!s.contains(&secret_ns), "another tenant's namespace leaked: {r}");
    assert!(!s.contains(&format!("\"pid\":{tenant_pid}")), "another tenant's pid leaked: {r}");
    assert!(r["attachments"].as_array().unwrap().iter().all(|a| a["uid"] == 65534), "{r}");
    assert!(r.get("counters").is_none() && r.get("index").is_none(), "pool-wide figures leaked: {r}");
}

trait UidGid {
    fn uid_gid(&mut self, id: u32) -> &mut Self;
}

impl UidGid for Command {
    fn uid_gid(&mut self, id: u32) -> &mut Self {
        use std::os::unix::process::CommandExt;
        self.gid(id).uid(id)
    }
}

/// Switches the calling thread (only) to `uid` as its real and effective uid (Linux
/// credentials are per thread; SO_PEERCRED records the connecting thread's). Needs root.
fn become_uid(uid: u32) {
    // SAFETY: a raw syscall on this thread's credentials; no memory is passed.
    let rc = unsafe { libc::syscall(libc::SYS_setresuid, uid as libc::c_long, uid as libc::c_long, -1 as libc::c_long) };
    assert_eq!(rc, 0, "setresuid({uid}): {}", std::io::Error::last_os_error());
}

/// (inode, name) of every index and event-log memfd this process maps.
fn mapped_pool_memfds() -> std::collections::BTreeSet<(u64, String)> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter(|l| l.contains("memfd:umbp-index") || l.contains("memfd:umbp-events"))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[4].parse().unwrap(), f[5..].join(" "))
        })
        .collect()
}

/// What tenant B's peers (uid 65534) saw and did.
#[derive(Debug)]
struct TenantView {
    hits: usize,
    events: Vec<(umbp_scheduler::EventKind, umbp_protocol::ObjectKey)>,
    snapshot: umbp_scheduler::IndexSnapshot,
    memfds: std::collections::BTreeSet<(u64, String)>,
    store_statuses: Vec<umbp_protocol::entries::BlockStatus>,
    hits_after_own_store: usize,
}

/// Tenant B, on a thread of uid 65534 with namespace `ns`: a scheduler that attaches
/// (then says so on `ready` and waits for `go`: meanwhile the other tenant stores), looks
/// up `probe` (the other tenant's keys, which it computed), follows its event log and
/// reads its index's occupancy; then a worker that stores the same keys (16 KiB objects
/// from a memfd) and the scheduler looks again.
fn tenant_b(
    socket: &std::path::Path,
    ns: u128,
    probe: &[umbp_protocol::ObjectKey],
    ready: std::sync::mpsc::Sender<()>,
    go: std::sync::mpsc::Receiver<()>,
) -> TenantView {
    use std::os::fd::OwnedFd;
    use umbp_worker::{Segment, Worker, WorkerConfig};
    become_uid(65534);
    let mut idx = umbp_scheduler::IndexClient::connect(socket, ns, Duration::from_secs(5)).expect("B's scheduler attaches");
    ready.send(()).unwrap();
    go.recv().unwrap();
    let hits = idx.match_prefix(probe);
    let events = idx.take_events();
    let snapshot = idx.snapshot().expect("attached");
    let memfds = mapped_pool_memfds();
    const OBJ: u64 = 16 << 10;
    let n = probe.len() as u64;
    let mut w = Worker::connect(WorkerConfig::new(socket, ns)).expect("B's worker attaches");
    let mfd = memfd::MemfdOptions::default().allow_sealing(true).create("tenant-b").unwrap();
    mfd.as_file().set_len(OBJ * n).unwrap();
    mfd.add_seals(&[memfd::FileSeal::SealShrink, memfd::FileSeal::SealGrow]).unwrap();
    let fd: OwnedFd = mfd.as_file().try_clone().unwrap().into();
    let id = w.register_memfd(fd, 0, OBJ * n).expect("B registers a memfd");
    w.register_layout(0, vec![Segment::new(id, 0, OBJ, OBJ, n)]).expect("B's layout");
    let batch: Vec<_> = probe.iter().enumerate().map(|(i, k)| (*k, i as u64)).collect();
    let t = w.store(0, &batch).expect("B's store");
    let c = loop {
        if let Some(c) = w.wait(t, Duration::from_secs(10)) {
            break c;
        }
    };
    let hits_after_own_store = eventually_count(|| idx.match_prefix(probe), probe.len());
    TenantView { hits, events, snapshot, memfds, store_statuses: c.statuses, hits_after_own_store }
}

/// Polls `f` for up to 5 s until it returns `want`; its last value.
fn eventually_count(mut f: impl FnMut() -> usize, want: usize) -> usize {
    let end = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let v = f();
        if v == want || std::time::Instant::now() > end {
            return v;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Issue #13 item 12: with `--namespace-acl`, tenant B (uid 65534) must not learn which
/// of tenant A's keys are cached. Before, every peer mapped the one index and event log:
/// B's scheduler found all 64 of A's keys by lookup (it can compute them when it knows
/// A's namespace), saw them in its event log and in the index's occupancy, and B's store
/// of those keys reported `AlreadyPresent`. Now each tenant group has its own index and
/// event log: B's lookups miss, its log and index show nothing of A (an empty table: every
/// probe ends at its first slot, so probe counts and timing say nothing either), its
/// process maps none of A's memfds, its store of the same keys is `Stored` (a separate
/// object), and A still finds and loads its own blocks, unpoisoned.
#[test]
fn another_tenants_keys_are_invisible_in_index_and_event_log() {
    if !umbp_integration_tests::root_or_skip("to run tenant B as uid 65534") {
        return;
    }
    const NS_A: u128 = 0xa11ce;
    const NS_B: u128 = 0xb0b;
    // Tenant A's uid is 65533 in the ACL; A's peers here run as root, which attaches to
    // the group of its Hello namespace.
    let pool = PoolProcess::start(
        &unique_socket("groups"),
        &[
            "--capacity", "64MiB", "--min-object-size", "16KiB", "--allow-uid", "65534", "--namespace-acl", "65533:a11ce",
            "--namespace-acl", "65534:b0b",
        ],
    );
    {
        use std::os::unix::fs::PermissionsExt;
        // Uid 65534 is not in the socket's group: let every uid connect (the allow-list
        // and the ACL still apply).
        std::fs::set_permissions(&pool.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    }
    let keys_a: Vec<umbp_protocol::ObjectKey> =
        (0..64u128).map(|i| umbp_protocol::ObjectKey::derive(NS_A, 0, 0, &i.to_le_bytes())).collect();
    // Both schedulers attach first, so their event logs would show what follows.
    let mut idx_a = umbp_scheduler::IndexClient::connect(&pool.socket, NS_A, Duration::from_secs(5)).unwrap();
    let a_memfds = mapped_pool_memfds();
    assert!(!a_memfds.is_empty());
    let (socket, probe) = (pool.socket.clone(), keys_a.clone());
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel();
    let b = std::thread::spawn(move || tenant_b(&socket, NS_B, &probe, ready_tx, go_rx));
    ready_rx.recv_timeout(Duration::from_secs(10)).expect("tenant B attached");
    let a = worker(&pool.socket, NS_A, &[], &["store", "--first-key", "0", "--count", "64"]);
    assert_eq!(n(&a, "stored"), 64, "{a}");
    assert_eq!(idx_a.match_prefix(&keys_a), 64, "A finds its own keys");
    let stored_a = idx_a.take_events().iter().filter(|(k, _)| *k == umbp_scheduler::EventKind::Stored).count();
    assert_eq!(stored_a, 64, "A's event log lists its stores");
    go_tx.send(()).unwrap();
    let b = b.join().expect("tenant B's thread");
    let b_memfds: std::collections::BTreeSet<_> = b.memfds.difference(&a_memfds).cloned().collect();
    eprintln!(
        "tenant B: {} hits on A's keys, {} events, index {:?}, new memfds {:?}, A's memfds {:?}, store statuses {:?}",
        b.hits,
        b.events.len(),
        b.snapshot,
        b_memfds,
        a_memfds,
        b.store_statuses.iter().fold(std::collections::BTreeMap::new(), |mut m, s| {
            *m.entry(format!("{s:?}")).or_insert(0) += 1;
            m
        })
    );
    assert_eq!(b.hits, 0, "B's scheduler found A's keys by lookup");
    assert!(b.events.iter().all(|(_, k)| !keys_a.contains(k)), "B's event log lists A's keys ({} events)", b.events.len());
    assert_eq!((b.snapshot.live, b.snapshot.inserts), (0, 0), "B's index shows A's entries: {:?}", b.snapshot);
    assert!(!b_memfds.is_empty(), "B was handed no index or event log of its own (it maps A's: {a_memfds:?})");
    assert!(b_memfds.iter().all(|(ino, _)| !a_memfds.iter().any(|(a, _)| a == ino)), "B maps A's memfds");
    assert!(
        b.store_statuses.iter().all(|s| *s == umbp_protocol::entries::BlockStatus::Stored),
        "B's store of A's keys must be Stored (its own objects), not AlreadyPresent: {:?}",
        b.store_statuses
    );
    assert_eq!(b.hits_after_own_store, 64, "B finds its own objects");
    // A: still finds all of its keys, its log shows nothing of B, and its loads return
    // its own bytes (B's same-key objects did not replace or poison them).
    assert_eq!(idx_a.match_prefix(&keys_a), 64, "A's keys after B stored the same keys");
    assert!(idx_a.take_events().is_empty(), "A's event log shows B's stores");
    let l = worker(&pool.socket, NS_A, &["--timeout-ms", "30000"], &["load", "--first-key", "0", "--count", "64"]);
    assert_eq!((n(&l, "loaded"), n(&l, "corrupt")), (64, 0), "{l}");
    let report = pool.report();
    let groups = &report.groups;
    assert_eq!(groups.len(), 3, "{report}");
    let summed = report.index.as_ref().expect("index section");
    assert_eq!(summed.live, 128, "the summed index: {summed}");
    for g in &groups[1..] {
        assert_eq!(g.index.as_ref().map(|i| i.live), Some(64), "each tenant's own index: {g}");
        assert_eq!(g.events.written, 64, "each tenant's own event log: {g}");
    }
    // ringtool (the pool's uid) still shows the live pool, with a section per group.
    let out = Command::new(workspace_binary("ringtool")).args(["dump", "--socket"]).arg(&pool.socket).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ringtool dump: {}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("TENANT GROUPS") && text.contains("uids 65533") && text.contains("uids 65534"), "{text}");
}
