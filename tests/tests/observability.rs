//! Observability against real `umbp-pool` processes: `ringtool` output and the Prometheus
//! endpoint checked against known traffic, `ringtool inspect` on the pool's memfds, and
//! KV events: an eviction in the pool shows up as a `Removed` event at a scheduler.
//!
//! Needs the workspace binaries (`cargo build --workspace --bins`).

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use umbp_integration_tests::metrics::{free_port, http_get, sample};
use umbp_pool::pool_report::{PeerRole, PoolReport};
use umbp_scheduler::{EventKind, IndexClient};
use umbp_worker::{BlockStatus, MemorySpec, ObjectKey, Segment, Worker, WorkerConfig};

const LAYERS: u64 = 4;
const PAGE: u64 = 4096;
const BLOCKS: u64 = 64;
const OBJECT: u64 = LAYERS * PAGE;

/// An in-process worker (so its pid is ours) over a per-layer layout in its own memory.
struct TestWorker {
    w: Worker,
    _mem: Vec<u8>,
}

impl TestWorker {
    fn connect(socket: &Path, ns: u128) -> Self {
        let mem = vec![0u8; (LAYERS * BLOCKS * PAGE) as usize];
        let mut w = Worker::connect(WorkerConfig::new(socket, ns)).expect("worker connects");
        // SAFETY: `mem` moves into the `TestWorker` with `w` and drops after it (field
        // order); it is only touched between transfers.
        unsafe { w.register_memory(MemorySpec::HostProcess { ptr: mem.as_ptr() as usize, len: mem.len() }) }.unwrap();
        let segs = (0..LAYERS).map(|l| Segment::new(0, l * BLOCKS * PAGE, PAGE, PAGE, BLOCKS)).collect();
        assert_eq!(w.register_layout(0, segs).unwrap(), OBJECT);
        Self { w, _mem: mem }
    }

    /// One submission of `keys` (block i = key i); returns the statuses.
    fn run(&mut self, keys: &[u128], store: bool) -> Vec<BlockStatus> {
        let batch: Vec<(ObjectKey, u64)> = keys.iter().enumerate().map(|(i, k)| (ObjectKey(*k), i as u64)).collect();
        let id = if store { self.w.store(0, &batch) } else { self.w.load(0, &batch) }.expect("submit");
        self.w.wait(id, Duration::from_secs(20)).expect("completion").statuses
    }
}

fn ringtool(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(workspace_binary("ringtool")).args(args).output().expect("run ringtool");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn ringtool_and_metrics_match_known_traffic() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let pool = PoolProcess::start(
        &unique_socket("obs"),
        &["--capacity", "64MiB", "--min-object-size", "16KiB", "--quarantine-max-size", "3MiB", "--metrics-addr", &addr],
    );
    let sock = pool.socket.to_str().unwrap().to_string();
    let mut w = TestWorker::connect(&pool.socket, 7);
    let stored: Vec<u128> = (1000..1040).collect();
    assert!(w.run(&stored, true).iter().all(|s| *s == BlockStatus::Stored));
    assert!(w.run(&stored, true).iter().all(|s| *s == BlockStatus::AlreadyPresent));
    let mut loads: Vec<u128> = stored[..10].to_vec();
    loads.extend(5000..5005);
    let st = w.run(&loads, false);
    assert_eq!(st.iter().filter(|s| **s == BlockStatus::Loaded).count(), 10);
    assert_eq!(st.iter().filter(|s| **s == BlockStatus::Missing).count(), 5);

    // dump --json: the pool's report, checked field by field against the traffic above.
    let (ok, out, err) = ringtool(&["dump", "--json", "--socket", &sock]);
    assert!(ok, "ringtool dump failed: {err}");
    // The JSON parses as the typed report: every field there, of its type.
    let raw: serde_json::Value = serde_json::from_str(&out).expect("dump --json is JSON");
    let r: PoolReport = serde_json::from_value(raw.clone()).expect("dump --json is the pool's report");
    // The wire form keeps its names (scripts read them; docs/operations.md).
    assert_eq!(raw["pool"]["published_objects"], 40, "{}", raw["pool"]);
    assert_eq!(raw["counters"]["phases"]["store"]["jobs"], 2, "{}", raw["counters"]);
    assert_eq!(r.pool.published_objects, 40, "{:?}", r.pool);
    assert_eq!(r.pool.objects, 40);
    assert_eq!(r.pool.pinned_objects, 0);
    assert_eq!(r.pool.allocated_bytes % OBJECT, 0);
    assert_eq!(r.namespaces.len(), 1);
    assert_eq!(r.namespaces[0].namespace, format!("{:032x}", 7));
    assert_eq!(r.namespaces[0].id(), Some(7));
    assert_eq!(r.namespaces[0].objects, 40);
    assert_eq!(r.namespaces[0].bytes, 40 * OBJECT);
    let index = r.index.as_ref().expect("index section");
    assert_eq!(index.live, 40);
    assert_eq!(index.probe_histogram.iter().sum::<u64>(), 40);
    assert_eq!(r.events.written, 40, "one Stored event per published object");
    let c = &r.counters;
    assert_eq!((c.blocks_stored, c.blocks_already_present), (40, 40));
    assert_eq!((c.blocks_loaded, c.blocks_missing), (10, 5));
    assert_eq!(c.bytes_stored, 40 * OBJECT);
    assert_eq!(c.bytes_loaded, 10 * OBJECT);
    // Where the time went, per direction: two store jobs (one copied, one all already
    // present) and one load, each through every phase; the copied store spent time copying.
    let phases = &c.phases;
    assert_eq!((phases.store.jobs, phases.load.jobs), (2, 1), "{phases:?}");
    for (phase, ns) in phases.store.phases() {
        if phase != "publish" {
            assert!(ns > 0, "store {phase}: {phases:?}");
        }
    }
    assert_eq!(phases.store.copy_ns, c.store_copy_ns);
    let me = r.attachments.iter().find(|a| a.pid == std::process::id()).expect("the worker's attachment is listed");
    assert_eq!(me.role, PeerRole::Worker);
    assert_eq!(me.namespace, format!("{:032x}", 7));
    assert_eq!(me.submissions, 3);
    assert_eq!(me.blocks, 40 + 40 + 15);
    assert_eq!(me.errors, 0);
    assert_eq!(me.inflight, 0);
    assert_eq!((me.sq.head, me.sq.tail), (3, 3));
    assert_eq!((me.cq.tail, me.cq.pending), (3, 0));
    assert_eq!(me.registered_bytes, LAYERS * BLOCKS * PAGE);
    assert_eq!(me.devices[0].kind, "HostProcess");
    assert_eq!(me.devices[0].bytes, LAYERS * BLOCKS * PAGE);
    assert!(r.attachments_of(PeerRole::Observer).next().is_some(), "ringtool attaches as an observer");

    // The readable table names the same things.
    let (ok, table, err) = ringtool(&["dump", "--socket", &sock]);
    assert!(ok, "{err}");
    for needle in ["POOL", "ATTACHMENTS (2)", "INDEX", "live 40", &std::process::id().to_string(), "HostProcess"] {
        assert!(table.contains(needle), "{needle:?} missing from\n{table}");
    }

    // watch: two refreshes as JSON lines, the second with rates.
    let (ok, out, err) = ringtool(&["watch", "--socket", &sock, "--interval", "0.2", "--count", "2", "--json"]);
    assert!(ok, "{err}");
    let lines: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[1]["rates"]["stores/s"], 0.0, "no traffic between the refreshes");

    // Prometheus: the same numbers.
    let (head, m) = http_get(port, "/metrics");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    for (name, want) in [
        ("umbp_blocks_total{result=\"stored\"}", 40.0),
        ("umbp_blocks_total{result=\"already_present\"}", 40.0),
        ("umbp_stores_total", 40.0),
        ("umbp_loads_total", 10.0),
        ("umbp_load_hits_total", 10.0),
        ("umbp_load_misses_total", 5.0),
        ("umbp_bytes_total{direction=\"store\"}", (40 * OBJECT) as f64),
        ("umbp_bytes_total{direction=\"load\"}", (10 * OBJECT) as f64),
        ("umbp_published_objects", 40.0),
        ("umbp_index_live", 40.0),
        ("umbp_events_total", 40.0),
        ("umbp_evictions_total", 0.0),
        // Nothing quarantined without a remote tier; the bound is the flag's.
        ("umbp_quarantined_bytes", 0.0),
        ("umbp_quarantine_refusals_total", 0.0),
        ("umbp_quarantine_max_bytes", (3u64 << 20) as f64),
        ("umbp_submissions_total", 3.0),
        ("umbp_attachments{role=\"worker\"}", 1.0),
        ("umbp_capacity_bytes", (64u64 << 20) as f64),
        // Two store submissions (one copied, one all already present) and one load.
        ("umbp_transfer_seconds_count{op=\"store\"}", 2.0),
        ("umbp_transfer_seconds_count{op=\"load\"}", 1.0),
        ("umbp_transfer_seconds_bucket{op=\"load\",le=\"+Inf\"}", 1.0),
    ] {
        assert_eq!(sample(&m, name), want, "{name}");
    }
    let occ = sample(&m, "umbp_occupancy_ratio");
    assert!(occ > 0.0 && occ < 0.1, "{occ}");
    assert!(sample(&m, "umbp_copy_bandwidth_gigabytes_per_second{direction=\"store\"}") > 0.0);
    assert!(sample(&m, "umbp_store_phase_seconds_total{phase=\"copy\"}") > 0.0);
    assert!(sample(&m, "umbp_load_phase_seconds_total{phase=\"reserve\"}") > 0.0);
    assert!(http_get(port, "/nope").0.starts_with("HTTP/1.1 404"));

    // inspect: the pool's own memfds, read-only, recognised by their headers.
    let mut seen = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{}/fd", pool.pid())).unwrap().flatten() {
        let target = std::fs::read_link(e.path()).map(|t| t.display().to_string()).unwrap_or_default();
        let region = match () {
            _ if target.starts_with("/memfd:umbp-index") => "index",
            _ if target.starts_with("/memfd:umbp-events") => "event_log",
            _ if target.starts_with("/memfd:umbp-rings") => "attachment_rings",
            _ => continue,
        };
        let path = e.path().display().to_string();
        let (ok, out, err) = ringtool(&["inspect", "--fd", &path, "--json"]);
        assert!(ok, "inspect {path} ({target}): {err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["region"], region, "{path} is {target}: {v}");
        match region {
            "index" => assert_eq!(v["live"], 40),
            "event_log" => {
                assert_eq!(v["written"], 40);
                assert_eq!(v["recent"].as_array().unwrap().len(), 10);
                assert_eq!(v["recent"][9]["kind"], "stored");
            }
            _ => assert_eq!(v["layout_consistent"], true, "{v}"),
        }
        seen.push(region);
    }
    for region in ["index", "event_log", "attachment_rings"] {
        assert!(seen.contains(&region), "no {region} memfd among the pool's fds ({seen:?})");
    }
    let (ok, _, err) = ringtool(&["inspect", "--fd", "/proc/self/exe"]);
    assert!(!ok && err.contains("not a UMBP region"), "{err}");
}

#[test]
fn ringtool_errors_name_the_socket() {
    let (ok, _, err) = ringtool(&["dump", "--socket", "/nonexistent/umbp-obs/pool.sock"]);
    assert!(!ok);
    assert!(err.contains("/nonexistent/umbp-obs/pool.sock"), "{err}");
    // decode -> encode through the CLI gives the same bytes back.
    let cqe = "0900000000000000 fbffffff 01000000 02000000 00000000 0100000000000000";
    let (ok, out, err) = ringtool(&["decode", "--type", "cqe", "--json", cqe]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["result_name"], "Busy");
    assert_eq!(v["failed_count"], 2);
    let (ok, hex, err) = ringtool(&["encode", "--type", "cqe", out.trim()]);
    assert!(ok, "{err}");
    assert_eq!(hex.trim(), cqe.replace(' ', ""));
    let (ok, _, err) = ringtool(&["decode", "--type", "sqe", "00ff"]);
    assert!(!ok && err.contains("64 bytes each"), "{err}");
}

#[test]
fn metrics_address_in_use_stops_the_pool_naming_it() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let socket = unique_socket("obs-busy");
    let out = Command::new(pool_binary())
        .args(["--socket", socket.to_str().unwrap(), "--capacity", "64MiB", "--metrics-addr", &addr])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&addr), "{err}");
    let _ = std::fs::remove_dir_all(socket.parent().unwrap());
}

#[test]
fn eviction_reaches_the_scheduler_as_removed_events() {
    let cap = EVICTING_POOL_BYTES;
    let pool = PoolProcess::start(&unique_socket("obs-evict"), &EVICTING_POOL);
    let ns = 3u128;
    let mut sched = IndexClient::connect(&pool.socket, ns, Duration::from_secs(5)).expect("scheduler attaches");
    assert!(sched.take_events().is_empty());
    let mut w = TestWorker::connect(&pool.socket, ns);
    // 2x capacity in 16 KiB objects, 64 per submission: the evictor must run.
    let total = 2 * cap / OBJECT;
    let mut stored = std::collections::HashSet::new();
    let mut next = 0u128;
    while (next as u64) < total {
        let keys: Vec<u128> = (next..next + BLOCKS as u128).collect();
        for (k, s) in keys.iter().zip(w.run(&keys, true)) {
            if s == BlockStatus::Stored {
                stored.insert(*k);
            }
        }
        next += BLOCKS as u128;
    }
    let evictions = || pool.report().pool.evictions;
    assert!(eventually(Duration::from_secs(5), || evictions() > 0), "nothing was evicted");
    // Let the evictor settle, then read every event.
    std::thread::sleep(Duration::from_millis(200));
    let expected_removed = evictions();
    let mut events = Vec::new();
    assert!(eventually(Duration::from_secs(5), || {
        events.extend(sched.take_events());
        events.iter().filter(|(k, _)| *k == EventKind::Removed).count() as u64 >= expected_removed
    }));
    let stored_events: Vec<_> = events.iter().filter(|(k, _)| *k == EventKind::Stored).map(|(_, key)| key.0).collect();
    let removed: Vec<_> = events.iter().filter(|(k, _)| *k == EventKind::Removed).map(|(_, key)| key.0).collect();
    assert_eq!(stored_events.len(), stored.len(), "one Stored event per stored block");
    assert!(stored_events.iter().all(|k| stored.contains(k)));
    assert_eq!(removed.len() as u64, expected_removed, "one Removed event per eviction");
    assert_eq!(sched.events_lost(), 0);
    for k in &removed {
        assert!(stored.contains(k), "removed key {k} was never stored");
        // Every Removed comes after that key's Stored.
        let s = events.iter().position(|e| *e == (EventKind::Stored, ObjectKey(*k))).unwrap();
        let r = events.iter().position(|e| *e == (EventKind::Removed, ObjectKey(*k))).unwrap();
        assert!(s < r);
        assert!(!sched.contains(ObjectKey(*k)), "an evicted key is not in the index");
    }
    // The oldest blocks went first (LRU): the first stored key is among the removed.
    assert!(removed.contains(&0));
}
