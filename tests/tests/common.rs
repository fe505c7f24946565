//! Helpers shared by the integration test files.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Stdio};

pub use umbp_integration_tests::*;

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
