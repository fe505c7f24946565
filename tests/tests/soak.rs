//! The chaos soak, short: `umbp-bench soak` (tools/src/bench/soak.rs) drives a real
//! `umbp-pool` process and worker processes while it SIGKILLs workers and stops, resumes,
//! kills and restarts the pool; it fails unless no corrupted byte came back, no call
//! blocked past the timeout, nothing leaked after any worker death and every worker
//! re-attached. docs/reliability.md records a long run. UMBP_SOAK_SECS sets the length.

mod common;
use common::*;

use std::process::Command;

#[test]
fn chaos_soak_short() {
    let secs = std::env::var("UMBP_SOAK_SECS").unwrap_or_else(|_| "15".into());
    let out = Command::new(workspace_binary("umbp-bench"))
        .args(["soak", "--seconds", &secs, "--workers", "3", "--timeout-ms", "1000", "--json"])
        .output()
        .expect("run umbp-bench soak");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "soak failed:\n{stdout}\n{stderr}");
    let cases: Vec<serde_json::Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let case = |name: &str| cases.iter().find(|c| c["case"] == name).unwrap_or_else(|| panic!("no {name} in {stdout}"));
    eprintln!("{stdout}");
    assert_eq!(case("corrupted_bytes")["value"], 0.0);
    assert!(case("corrupted_bytes")["verified_blocks"].as_u64().unwrap() > 100, "loads were verified");
    assert_eq!(case("leaked_bytes")["value"], 0.0);
    assert_eq!(case("leaked_bytes")["leaked_fds"], 0);
    assert!(case("leaked_bytes")["leak_checks"].as_u64().unwrap() >= 1);
    assert!(case("faults_injected")["value"].as_f64().unwrap() >= 3.0, "{}", case("faults_injected"));
    assert!(case("operations")["value"].as_f64().unwrap() > 0.0);
    assert!(case("max_blocked_ms")["value"].as_f64().unwrap() <= 1000.0);
    assert_eq!(case("max_blocked_ms")["all_reattached"], true);
}
