//! The SSD tier as operators see it (issue #16), against a real `umbp-pool` with a small
//! DRAM and an SSD directory: `ringtool dump` (objects by tier, the SSD section), `ringtool
//! inspect` (per-tier counts decoded from the index's location words, keys with their
//! tier, events with their tier), the Prometheus tier and SSD series, all checked against
//! the pool's own report and the traffic; the flush syncs (`--ssd-sync-interval`: 0
//! before any write, counted once a periodic flush ran, issue #34); then SIGKILL and a warm
//! restart on the same directory.
//!
//! Needs the workspace binaries (`cargo build --workspace --bins`).

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use umbp_integration_tests::metrics::{free_port, http_get, sample};
use umbp_worker::{BlockStatus, MemorySpec, ObjectKey, Segment, Worker, WorkerConfig};

const OBJECT: u64 = 16 << 10;
const BATCH: u64 = 64;

struct TestWorker {
    w: Worker,
    mem: Vec<u8>,
}

impl TestWorker {
    fn connect(socket: &Path, ns: u128) -> Self {
        let mem = vec![0u8; (2 * BATCH * OBJECT) as usize];
        let mut w = Worker::connect(WorkerConfig::new(socket, ns)).expect("worker connects");
        // SAFETY: `mem` lives in the `TestWorker` with `w` (its heap buffer never moves)
        // and is only touched between transfers.
        unsafe { w.register_memory(MemorySpec::HostProcess { ptr: mem.as_ptr() as usize, len: mem.len() }) }.unwrap();
        assert_eq!(w.register_layout(0, vec![Segment::new(0, 0, OBJECT, OBJECT, 2 * BATCH)]).unwrap(), OBJECT);
        Self { w, mem }
    }

    fn block(&mut self, b: u64) -> &mut [u8] {
        &mut self.mem[(b * OBJECT) as usize..((b + 1) * OBJECT) as usize]
    }

    /// Stores `keys` (at most BATCH) with their patterns until each is in the pool (a store
    /// that finds DRAM full while the evictor is still demoting is `NotStored`: retried).
    fn store(&mut self, keys: &[u128]) {
        for (i, k) in keys.iter().enumerate() {
            fill_pattern(*k, self.block(i as u64));
        }
        let mut todo: Vec<(ObjectKey, u64)> = keys.iter().enumerate().map(|(i, k)| (ObjectKey(*k), i as u64)).collect();
        for _ in 0..100 {
            let id = self.w.store(0, &todo).expect("store");
            let st = self.w.wait(id, Duration::from_secs(30)).expect("completion").statuses;
            assert!(st.iter().all(|s| matches!(s, BlockStatus::Stored | BlockStatus::NotStored)), "{st:?}");
            todo = todo.into_iter().zip(st).filter(|(_, s)| *s == BlockStatus::NotStored).map(|(b, _)| b).collect();
            if todo.is_empty() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("stores kept finding no room");
    }

    /// Loads `keys` into the second half; returns how many loaded with their exact pattern.
    fn load_verified(&mut self, keys: &[u128]) -> usize {
        self.mem[(BATCH * OBJECT) as usize..].fill(0);
        let batch: Vec<(ObjectKey, u64)> = keys.iter().enumerate().map(|(i, k)| (ObjectKey(*k), BATCH + i as u64)).collect();
        let id = self.w.load(0, &batch).expect("load");
        let st = self.w.wait(id, Duration::from_secs(30)).expect("completion").statuses;
        keys.iter().enumerate().filter(|(i, k)| st[*i] == BlockStatus::Loaded && verify_pattern(**k, self.block(BATCH + *i as u64))).count()
    }
}

fn ringtool(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(workspace_binary("ringtool")).args(args).output().expect("run ringtool");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// `/proc/PID/fd/N` of the pool's memfd whose name starts with `prefix`.
fn memfd(pid: i32, prefix: &str) -> String {
    for e in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().flatten() {
        let target = std::fs::read_link(e.path()).map(|t| t.display().to_string()).unwrap_or_default();
        if target.starts_with(prefix) {
            return e.path().display().to_string();
        }
    }
    panic!("no {prefix} among the fds of {pid}")
}

fn json(out: &str) -> serde_json::Value {
    serde_json::from_str(out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

#[test]
fn tiers_and_the_ssd_section_in_ringtool_metrics_and_after_a_warm_restart() {
    let ssd = tempfile::tempdir_in(std::env::var_os("UMBP_SSD_TEST_DIR").unwrap_or_else(|| "/var/tmp".into())).unwrap();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let dir = ssd.path().to_str().unwrap().to_string();
    // 4 MiB of DRAM = 256 objects of 16 KiB; 1024 objects go in (4x DRAM).
    let mut pool = PoolProcess::start(
        &unique_socket("ssdobs"),
        &[
            "--capacity", "4MiB", "--min-object-size", "16KiB", "--metrics-addr", &addr, "--ssd-dir", &dir, "--ssd-capacity", "64MiB",
            "--ssd-segment-size", "4MiB", "--ssd-admission", "all", "--ssd-sync-interval", "0.5",
        ],
    );
    let sock = pool.socket.to_str().unwrap().to_string();
    // Nothing written yet: nothing synced (an idle pool is never flushed).
    let s = pool.report().ssd.unwrap();
    assert_eq!((s.segment_syncs, s.dir_syncs, s.puts), (0, 0, 0), "{s:?}");
    let m = http_get(port, "/metrics").1;
    assert_eq!((sample(&m, "umbp_ssd_segment_syncs_total"), sample(&m, "umbp_ssd_dir_syncs_total")), (0.0, 0.0));
    let mut w = TestWorker::connect(&pool.socket, 11);
    let keys: Vec<u128> = (1..=1024u128).map(|i| i * 0x1_0000_0001).collect();
    for chunk in keys.chunks(BATCH as usize) {
        w.store(chunk);
    }
    // The evictor demotes in the background: wait until every object is listed somewhere
    // and nothing moves any more (two reports 300 ms apart agree), so that every view
    // below sees the same state.
    let settled = eventually(Duration::from_secs(30), || {
        let a = pool.report();
        std::thread::sleep(Duration::from_millis(300));
        let b = pool.report();
        let demotions = |r: &umbp_pool::PoolReport| r.ssd.as_ref().map_or(0, |s| s.demotions);
        demotions(&b) > 0
            && b.tiers.dram + b.tiers.ssd == keys.len() as u64
            && (a.tiers, demotions(&a), a.pool.allocated_bytes) == (b.tiers, demotions(&b), b.pool.allocated_bytes)
    });
    let r = pool.report();
    assert!(settled, "tiers {:?}, ssd {:?}", r.tiers, r.ssd);
    let s = r.ssd.clone().unwrap();
    assert!(r.tiers.ssd >= 1024 - 256, "most objects are on SSD: {:?}", r.tiers);
    assert!(s.objects >= r.tiers.ssd && s.crc_misses == 0 && s.demotion_failures == 0, "{s:?}");
    assert_eq!(s.dirs, vec![dir.clone()]);
    assert!(s.puts >= s.demotions && s.put_bytes >= s.demoted_bytes, "every demotion is a put: {s:?}");

    // The demotions were flushed within the sync interval: segments fdatasynced, the
    // directory fsynced; the report, ringtool and the metrics say so.
    let synced = eventually(Duration::from_secs(10), || pool.report().ssd.is_some_and(|s| s.segment_syncs > 0 && s.dir_syncs > 0));
    let s = pool.report().ssd.unwrap();
    assert!(synced, "no periodic flush within 10 s: {s:?}");
    assert!(s.segment_syncs <= s.puts && s.segment_syncs >= 1, "{s:?}");
    let m = http_get(port, "/metrics").1;
    assert!(sample(&m, "umbp_ssd_segment_syncs_total") >= s.segment_syncs as f64, "{m}");
    assert!(sample(&m, "umbp_ssd_dir_syncs_total") >= s.dir_syncs as f64, "{m}");
    assert_eq!(sample(&m, "umbp_ssd_puts_total"), s.puts as f64);
    let (ok, text, err) = ringtool(&["dump", "--socket", &sock]);
    assert!(ok, "{err}");
    assert!(text.contains("  syncs: segments ") && !text.contains("none yet"), "{text}");

    // dump: the tier line and the SSD section, with the report's numbers.
    let (ok, text, err) = ringtool(&["dump", "--socket", &sock]);
    assert!(ok, "{err}");
    let tier_line = format!("objects by tier (indexes)  dram {}  ssd {}  remote 0", r.tiers.dram, r.tiers.ssd);
    assert!(text.contains(&tier_line), "{tier_line:?} not in:\n{text}");
    assert!(text.contains(&format!("SSD\n  dirs {dir}\n")), "{text}");
    assert!(text.contains("admission all"), "{text}");
    let (ok, out, err) = ringtool(&["dump", "--json", "--socket", &sock]);
    assert!(ok, "{err}");
    let j = json(&out);
    assert_eq!(j["tiers"]["ssd"], r.tiers.ssd);
    assert_eq!(j["ssd"]["demotions"], s.demotions);

    // inspect: the index's locations decoded per tier agree with the report; listed keys
    // carry their tier; events carry theirs (a demotion: removed dram, stored ssd).
    let index_fd = memfd(pool.pid(), "/memfd:umbp-index");
    let (ok, out, err) = ringtool(&["inspect", "--fd", &index_fd, "--keys", "2000", "--json"]);
    assert!(ok, "{err}");
    let v = json(&out);
    assert_eq!((v["tiers"]["dram"].as_u64(), v["tiers"]["ssd"].as_u64()), (Some(r.tiers.dram), Some(r.tiers.ssd)), "{}", v["tiers"]);
    let listed = v["keys"].as_array().unwrap();
    assert_eq!(listed.len(), keys.len());
    let on_ssd = listed.iter().filter(|k| k["tier"] == "ssd").count() as u64;
    assert_eq!(on_ssd, r.tiers.ssd);
    assert!(listed.iter().all(|k| keys.contains(&u128::from_str_radix(k["key"].as_str().unwrap(), 16).unwrap())));
    let (ok, text, err) = ringtool(&["inspect", "--fd", &index_fd, "--keys", "3"]);
    assert!(ok, "{err}");
    assert!(text.contains(&format!("tiers: dram {}  ssd {}  remote 0", r.tiers.dram, r.tiers.ssd)), "{text}");
    let events_fd = memfd(pool.pid(), "/memfd:umbp-events");
    let (ok, out, err) = ringtool(&["inspect", "--fd", &events_fd, "--events", "100000", "--json"]);
    assert!(ok, "{err}");
    let ev = json(&out);
    let recent = ev["recent"].as_array().unwrap();
    let count = |kind: &str, tier: &str| recent.iter().filter(|e| e["kind"] == kind && e["tier"] == tier).count() as u64;
    assert_eq!(count("stored", "dram"), keys.len() as u64, "every store entered DRAM");
    assert_eq!(count("removed", "dram"), s.demotions, "each demotion left DRAM...");
    assert_eq!(count("stored", "ssd"), s.demotions, "...and entered the SSD");

    // Metrics: the same numbers.
    let m = http_get(port, "/metrics").1;
    assert_eq!(sample(&m, "umbp_tier_objects{tier=\"dram\"}"), r.tiers.dram as f64);
    assert_eq!(sample(&m, "umbp_tier_objects{tier=\"ssd\"}"), r.tiers.ssd as f64);
    assert_eq!(sample(&m, "umbp_tier_bytes{tier=\"ssd\"}"), s.live_bytes as f64);
    assert_eq!(sample(&m, "umbp_ssd_demotions_total"), s.demotions as f64);
    assert_eq!(sample(&m, "umbp_ssd_demoted_bytes_total"), s.demoted_bytes as f64);
    assert_eq!(sample(&m, "umbp_ssd_crc_misses_total"), 0.0);
    assert_eq!(sample(&m, "umbp_ssd_capacity_bytes"), (64u64 << 20) as f64);

    // Every object loads byte-exact; the ones on SSD are promoted.
    let mut good = 0;
    for chunk in keys.chunks(BATCH as usize) {
        good += w.load_verified(chunk);
    }
    assert_eq!(good, keys.len(), "every object loads with its own bytes");
    let r = pool.report();
    let s = r.ssd.clone().unwrap();
    assert!(s.promotions > 0 && s.promotion_failures == 0, "{s:?}");
    assert_eq!(sample(&http_get(port, "/metrics").1, "umbp_ssd_promotions_total"), s.promotions as f64);
    let (ok, text, err) = ringtool(&["watch", "--socket", &sock, "--interval", "0.2", "--count", "2"]);
    assert!(ok && text.contains("demotions/s") && text.contains("promotions/s"), "{err}\n{text}");
    drop(w);

    // SIGKILL and a warm restart on the same directory: the SSD objects are listed again,
    // ringtool says how many came back, and they load byte-exact.
    let on_ssd_before = r.tiers.ssd;
    pool.restart();
    let r = pool.report();
    let s = r.ssd.clone().unwrap();
    assert!(s.restored_objects > 0 && s.restored_objects >= on_ssd_before.min(1), "{s:?}");
    assert_eq!(r.tiers.ssd, s.restored_objects, "restored objects are listed as SSD objects");
    let (ok, text, err) = ringtool(&["dump", "--socket", &sock]);
    assert!(ok, "{err}");
    assert!(text.contains(&format!("warm restart: restored {} objects", s.restored_objects)), "{text}");
    assert_eq!(sample(&http_get(port, "/metrics").1, "umbp_ssd_restored_objects"), s.restored_objects as f64);
    let mut w = TestWorker::connect(&pool.socket, 11);
    let mut good = 0;
    for chunk in keys.chunks(BATCH as usize) {
        good += w.load_verified(chunk);
    }
    assert_eq!(good as u64, s.restored_objects, "every restored object loads byte-exact (and nothing else does)");
}
