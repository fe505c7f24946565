//! The soak parent's view of its worker processes: spawning, commands, their last report,
//! and the counters summed over them.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;

use super::worker::SoakCommand;

#[derive(Default)]
pub(super) struct WorkerState {
    pub(super) last: Value,
    pub(super) paused: u64,
}

pub(super) struct WorkerProc {
    child: Child,
    stdin: ChildStdin,
    pub(super) state: Arc<Mutex<WorkerState>>,
    /// Disconnected when the reader of the worker's stdout has seen EOF (read all it printed).
    reader_done: std::sync::mpsc::Receiver<()>,
}

impl WorkerProc {
    pub(super) fn spawn(socket: &Path, id: u64, seed: u64, timeout_ms: u64, memory: &str) -> Result<Self, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = Command::new(exe)
            .args(["__soak-worker", "--id", &id.to_string(), "--seed", &seed.to_string()])
            .args(["--timeout-ms", &timeout_ms.to_string(), "--memory", memory])
            .arg("--socket")
            .arg(socket)
            // The parent's RUST_LOG reaches the workers (their logs go to its stderr), so a
            // blocked call can be traced (`RUST_LOG=warn,umbp_worker=info`); quiet otherwise.
            .env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "error".into()))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("spawn soak worker: {e}"))?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let state = Arc::new(Mutex::new(WorkerState::default()));
        let s2 = state.clone();
        let (done_tx, reader_done) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            let _done = done_tx; // dropped at EOF: the worker's last report is in
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let Ok(v) = serde_json::from_str::<Value>(&line) else { continue };
                let mut s = s2.lock().unwrap();
                if v["t"] == "paused" {
                    s.paused += 1;
                }
                s.last = v;
            }
        });
        Ok(Self { child, stdin, state, reader_done })
    }

    pub(super) fn send(&mut self, cmd: SoakCommand) {
        let _ = writeln!(self.stdin, "{}", cmd.to_line());
        let _ = self.stdin.flush();
    }

    pub(super) fn last(&self) -> Value {
        self.state.lock().unwrap().last.clone()
    }

    pub(super) fn kill(&mut self) -> Value {
        let _ = self.child.kill();
        self.reap()
    }

    /// Waits for the worker's exit and for its reader to have read everything it printed
    /// (EOF; at most 10 s: nothing else holds the pipe), then returns its last report.
    pub(super) fn reap(&mut self) -> Value {
        let _ = self.child.wait();
        let _ = self.reader_done.recv_timeout(Duration::from_secs(10));
        self.last()
    }
}

pub(super) fn num(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or(0.0)
}

/// Counters summed over workers (max for `max_blocked_ms`).
#[derive(Default, Clone, Copy, Debug)]
pub(super) struct Totals {
    pub(super) transfers: f64,
    pub(super) blocks: f64,
    pub(super) loaded: f64,
    pub(super) corrupt_bytes: f64,
    pub(super) cancelled: f64,
    pub(super) disconnects: f64,
    pub(super) started_waits: f64,
    pub(super) max_blocked_ms: f64,
    pub(super) max_blocked_call: Option<&'static str>,
}

impl Totals {
    pub(super) fn add(&mut self, v: &Value) {
        self.transfers += num(v, "transfers");
        self.blocks += num(v, "blocks");
        self.loaded += num(v, "loaded");
        self.corrupt_bytes += num(v, "corrupt_bytes");
        self.cancelled += num(v, "cancelled");
        self.disconnects += num(v, "disconnects");
        self.started_waits += num(v, "started_waits");
        if num(v, "max_blocked_ms") > self.max_blocked_ms {
            self.max_blocked_ms = num(v, "max_blocked_ms");
            self.max_blocked_call = match v["max_blocked_call"].as_str() {
                Some("store") => Some("store"),
                Some("load") => Some("load"),
                Some("poll") => Some("poll"),
                Some("wait") => Some("wait"),
                Some("cancel") => Some("cancel"),
                _ => None,
            };
        }
    }
}
