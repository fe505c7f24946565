//! Helpers shared by the integration test files.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};

pub use umbp_integration_tests::*;

/// Flags of a small pool that evicts soon: [`EVICTING_POOL_BYTES`], 16 KiB objects,
/// watermarks 0.9 / 0.7.
pub const EVICTING_POOL: [&str; 8] = ["--capacity", "64MiB", "--min-object-size", "16KiB", "--high-wm", "0.9", "--low-wm", "0.7"];
/// The capacity of [`EVICTING_POOL`].
pub const EVICTING_POOL_BYTES: u64 = 64 << 20;

/// An SSD tier in `dir` for in-process test pools: 256 MiB in 4 MiB segments, every
/// evicted object admitted (so a test's evictions reach the drive).
pub fn small_ssd(dir: &Path) -> umbp_ssd::SsdConfig {
    umbp_ssd::SsdConfig {
        dirs: vec![dir.to_path_buf()],
        capacity_bytes: 256 << 20,
        segment_bytes: 4 << 20,
        admission: umbp_ssd::SsdAdmission::All,
        ..Default::default()
    }
}

/// Runs the test worker to completion and returns its JSON result line.
pub fn run_worker(socket: &Path, ns: u128, layout: &str, cmd: &[&str]) -> serde_json::Value {
    let out = Command::new(workspace_binary("umbp-test-worker"))
        .arg("--socket")
        .arg(socket)
        .args(["--namespace", &ns.to_string(), "--layout", layout])
        .args(cmd)
        .stderr(Stdio::inherit())
        .output()
        .expect("run umbp-test-worker");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or_else(|| panic!("no output from test worker ({:?})", out.status));
    serde_json::from_str(line).unwrap_or_else(|e| panic!("bad output {line:?}: {e}"))
}

pub fn n(v: &serde_json::Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or_else(|| panic!("no {k} in {v}"))
}

/// Stores keys 0..count through the test worker (`per-layer` layout, namespace `ns`, the
/// worker flags `extra` first), again and again until every one is in the pool: a store
/// that finds DRAM full while the evictor is still demoting is `NotStored`, and retried.
pub fn store_all(socket: &Path, ns: u128, count: u64, extra: &[&str]) {
    let c = count.to_string();
    for pass in 0..60 {
        let mut args: Vec<&str> = extra.to_vec();
        args.extend(["store", "--first-key", "0", "--count", &c]);
        let r = run_worker(socket, ns, "per-layer", &args);
        assert_eq!(n(&r, "failed"), 0, "pass {pass}: {r}");
        assert_eq!(n(&r, "stored") + n(&r, "already_present") + n(&r, "not_stored"), count, "{r}");
        if n(&r, "not_stored") == 0 {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    panic!("stores kept finding no room after 60 passes");
}

/// A test worker left running (`store-pin`, `flood-loads`): started and waited for until
/// its first line says it is ready. Killed and reaped on drop.
pub struct RunningWorker {
    pub child: Child,
    out: BufReader<ChildStdout>,
}

impl RunningWorker {
    /// `umbp-test-worker --socket SOCKET --namespace NS ARGS...`, once it printed `ready`.
    pub fn start(socket: &Path, ns: u128, args: &[&str], ready: &str) -> Self {
        let mut child = Command::new(workspace_binary("umbp-test-worker"))
            .arg("--socket")
            .arg(socket)
            .args(["--namespace", &ns.to_string()])
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn umbp-test-worker");
        let out = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut w = Self { child, out };
        let first = w.next_line();
        assert_eq!(first.trim(), ready, "umbp-test-worker {args:?} did not start");
        w
    }

    /// Its next line of output ("" at its end).
    pub fn next_line(&mut self) -> String {
        let mut line = String::new();
        self.out.read_line(&mut line).expect("read umbp-test-worker output");
        line
    }

    /// Its result: the next line, parsed as JSON, once it has exited.
    pub fn finish(mut self) -> serde_json::Value {
        let line = self.next_line();
        let _ = self.child.wait();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad output {line:?}: {e}"))
    }
}

impl Drop for RunningWorker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
