//! `--interference` (cuda): how much a matmul loop (scripts/device/matmul_loop.py) slows
//! down while the pool streams stores, against the same loop under a plain contiguous
//! cuMemcpy loop measured in the same run.

use std::process::Stdio;

use serde_json::Value;

use super::command::Command;
use super::parent::WorkerProc;
use super::{gbps, u64_of, Layout};
use crate::report::{Better, Case};

fn run_matmul(cmd: &str, seconds: f64) -> Result<f64, String> {
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{cmd} --seconds {seconds}"))
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("{cmd}: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Value = text
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .ok_or_else(|| format!("{cmd}: no JSON line in its output ({text:?}, {})", out.status))?;
    v.get("tflops").and_then(Value::as_f64).ok_or_else(|| format!("{cmd}: {v}"))
}

/// Matmul rate alone, then while stores stream (and while a plain contiguous cuMemcpy
/// loop streams, the baseline); the slowdown in percent.
pub(super) fn interference(
    a: &mut WorkerProc,
    cmd: &str,
    l: &Layout,
    group: u16,
    key: u64,
    name: &str,
    quick: bool,
) -> Result<Case, String> {
    let secs = if quick { 3.0 } else { 5.0 };
    let _warm = run_matmul(cmd, 1.0)?;
    let alone1 = run_matmul(cmd, secs)?;
    let with = |a: &mut WorkerProc, loop_cmd: Command| -> Result<(f64, Value), String> {
        a.send(&loop_cmd)?;
        let started = a.recv()?;
        if started.get("started").is_none() {
            return Err(format!("loop did not start: {started}"));
        }
        let t = run_matmul(cmd, secs)?;
        let done = a.recv()?;
        Ok((t, done))
    };
    a.call(&Command::Reset)?;
    let (t_store, st) =
        with(a, Command::StoreLoop { group, key_base: key, blocks: l.blocks.clone(), seconds: secs + 1.5, no_reset: false })?;
    let (t_copy, cp) = with(a, Command::MemcpyLoop { bytes: l.bytes(), seconds: secs + 1.5 })?;
    let alone2 = run_matmul(cmd, secs)?;
    let alone = (alone1 + alone2) / 2.0;
    let pct = |t: f64| (1.0 - t / alone) * 100.0;
    let noise = ((alone1 - alone2) / alone).abs() * 100.0;
    Ok(Case::new(
        "transfer",
        name,
        pct(t_store),
        "%",
        pct(t_copy),
        "same matmul slowdown under a contiguous cuMemcpyDtoH loop",
        Better::Lower,
    )
    .extra("matmul_tflops_alone", alone)
    .extra("matmul_tflops_with_stores", t_store)
    .extra("matmul_tflops_with_memcpy", t_copy)
    .extra("alone_run_to_run_pct", noise)
    .extra("store_gbps_during", gbps(u64_of(&st, "bytes"), u64_of(&st, "ns")))
    .extra("memcpy_gbps_during", gbps(u64_of(&cp, "bytes"), u64_of(&cp, "ns"))))
}
