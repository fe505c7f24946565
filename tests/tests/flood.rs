//! Per-peer limits keep a flooding peer from taking the pool from others (docs/security.md):
//! a worker process keeps 64 loads of 64 MiB each in flight while a well-behaved worker
//! process stores one block at a time. With `--max-inflight-bytes` the flooder meets `Busy`
//! and the well-behaved worker's p99 store latency stays bounded; without it (the same run
//! on a pool with the default limit) the well-behaved worker waits behind the flood.

mod common;
use common::*;

/// Runs the flood against a fresh pool started with `pool_args`; returns (flooder result,
/// well-behaved worker result).
fn flood_vs_latency(tag: &str, pool_args: &[&str]) -> (serde_json::Value, serde_json::Value) {
    // The well-behaved worker's objects are 16 KiB (layouts below --min-object-size are refused).
    let mut args = vec!["--min-object-size", "16KiB"];
    args.extend_from_slice(pool_args);
    let pool = PoolProcess::start(&unique_socket(tag), &args);
    let flood_args =
        ["--layers", "4", "--page", "262144", "--blocks", "64", "flood-loads", "--first-key", "0", "--seconds", "8", "--depth", "64"];
    let flooder = RunningWorker::start(&pool.socket, 5, &flood_args, "flooding");
    std::thread::sleep(std::time::Duration::from_millis(500));
    let lat = run_worker(&pool.socket, 6, "per-layer", &["latency", "--first-key", "1000000", "--seconds", "4"]);
    let flood = flooder.finish();
    (flood, lat)
}

#[test]
fn a_flooding_peer_is_refused_and_others_keep_their_latency() {
    let (flood, lat) = flood_vs_latency("flood", &["--capacity", "512MiB", "--max-inflight-bytes", "32MiB"]);
    let (flood0, lat0) = flood_vs_latency("flood-nolimit", &["--capacity", "512MiB"]);
    eprintln!("with --max-inflight-bytes 32MiB: flooder {flood}, well-behaved {lat}");
    eprintln!("with the default limit:          flooder {flood0}, well-behaved {lat0}");
    assert!(n(&flood, "busy") > 0, "the flooder met Busy: {flood}");
    assert!(n(&flood, "ok") > 0, "the flooder still gets served: {flood}");
    assert!(n(&lat, "samples") >= 50, "{lat}");
    assert_eq!(n(&lat, "failed"), 0, "{lat}");
    let p99 = n(&lat, "p99_us");
    assert!(p99 < 250_000, "well-behaved p99 store latency {p99} us under a flood, with the limit");
}
