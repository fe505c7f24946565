//! Attacks of one tenant on the others (issue #13 items 7, 8, 11; docs/security.md):
//! a real `umbp-pool` process, real worker and scheduler processes on its socket.
//!
//! - index flooding: tiny objects, keys chosen to collide, one namespace taking the pool;
//! - touch hints that pin the whole pool;
//! - the state report leaking other tenants' pids, uids and namespaces.

mod common;
use common::*;

use std::io::BufRead;
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
    let pool =
        PoolProcess::start(&unique_socket("pin"), &["--capacity", "64MiB", "--min-object-size", "16KiB", "--lease-ms", "60000"]);
    let mut pinner = Command::new(workspace_binary("umbp-test-worker"))
        .arg("--socket")
        .arg(&pool.socket)
        .args(["--namespace", "1", "store-pin", "--first-key", "0", "--count", "4096", "--seconds", "30"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(pinner.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "pinned", "pinner did not start");
    std::thread::sleep(Duration::from_millis(300));
    let v = worker(&pool.socket, 2, &[], &["store", "--first-key", "0", "--count", "512"]);
    let low = (64u64 << 20) * 7 / 10;
    let back_to_low = eventually(Duration::from_secs(5), || pool.report().pool.allocated_bytes <= low + (1 << 20));
    let report = pool.report();
    let _ = pinner.kill();
    let _ = pinner.wait();
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
    let keys: Vec<umbp_protocol::ObjectKey> =
        (0..64u128).map(|i| umbp_protocol::ObjectKey::derive(1, 0, 0, &i.to_le_bytes())).collect();
    let mut idx = umbp_scheduler::IndexClient::connect(&pool.socket, 9, Duration::from_secs(5)).unwrap();
    assert_eq!(idx.match_prefix(&keys), 64, "lookups still see them");
    idx.touch(&keys);
    assert!(
        eventually(Duration::from_secs(5), || pool.report().pool.defences.foreign_hints_ignored >= 64),
        "{}",
        pool.report().pool
    );
}

/// The state report: a peer of another uid (65534, an unprivileged user) gets only its own
/// figures — no pid, uid or namespace of the pool's other tenants — while root (and the
/// pool's uid: ringtool) still gets the full report. Before, everyone got everything.
#[test]
fn stats_report_hides_other_tenants() {
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } != 0 {
        eprintln!("skipped: needs root to run a peer as uid 65534");
        return;
    }
    let bin = workspace_binary("umbp-test-worker");
    let probe = Command::new(&bin).arg("--help").uid_gid(65534).stdout(Stdio::null()).stderr(Stdio::null()).status();
    if !probe.is_ok_and(|s| s.success()) {
        eprintln!("skipped: uid 65534 cannot run {} (directory permissions)", bin.display());
        return;
    }
    let pool = PoolProcess::start(
        &unique_socket("stats"),
        &["--capacity", "64MiB", "--min-object-size", "16KiB", "--allow-uid", "65534", "--socket-group", "65534"],
    );
    // A tenant of root (namespace 0xabcdef) stays attached while the report is taken.
    let mut tenant = Command::new(&bin)
        .arg("--socket")
        .arg(&pool.socket)
        .args(["--namespace", &0xabcdefu128.to_string(), "store-pin", "--first-key", "0", "--count", "64", "--seconds", "20"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(tenant.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "pinned");
    let full = pool.report();
    let secret_ns = format!("{:032x}", 0xabcdefu128);
    assert!(full.to_string().contains(&secret_ns), "root gets the full report: {full}");
    let out = Command::new(&bin).arg("--socket").arg(&pool.socket).arg("stats").uid_gid(65534).output().unwrap();
    let _ = tenant.kill();
    let _ = tenant.wait();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "stats as uid 65534 failed: {text} {}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    eprintln!("uid 65534 sees: {r}");
    assert_eq!(r["scope"], "tenant", "{r}");
    let typed: umbp_pool::Report = serde_json::from_value(r.clone()).unwrap_or_else(|e| panic!("not a report: {e}: {r}"));
    assert!(matches!(typed, umbp_pool::Report::Tenant(_)), "parsed as the tenant view: {r}");
    let s = r.to_string();
    assert!(!s.contains(&secret_ns), "another tenant's namespace leaked: {r}");
    assert!(!s.contains(&format!("\"pid\":{}", tenant.id())), "another tenant's pid leaked: {r}");
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
