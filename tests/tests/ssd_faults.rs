//! SSD tier faults (issue #16, docs/ssd.md "Failure behaviour"), real processes and files:
//! the pool killed in the middle of a demotion batch (fault injection) restarts on the
//! same directory and never loads wrong bytes; bad `--ssd-dir`s stop the pool at start
//! with an error naming the flag and the path.

mod common;
use common::*;

use std::io::BufRead;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CHILD_ENV: &str = "UMBP_SSD_FAULT_CHILD";
const OBJECT: u64 = 16 << 10;
const DRAM: u64 = 8 << 20;

fn ssd_dir(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("umbp-ssd-it-{tag}-")).tempdir_in("/var/tmp").expect("tempdir in /var/tmp")
}

/// Child of `kill_during_demotion_then_restart`: an in-process pool (this test binary links
/// the pool with `fault-injection`) that aborts itself while its 4th demotion batch is
/// being written.
#[test]
#[ignore = "helper run by kill_during_demotion_then_restart"]
fn child_pool_aborting_during_demotion() {
    let Some(spec) = std::env::var(CHILD_ENV).ok() else { return };
    let (socket, dir) = spec.split_once('|').unwrap();
    let ssd = umbp_ssd::SsdConfig {
        // 8 KiB I/Os: a 20 KiB record is three writes in flight at once, so the kill can
        // land between them (a record with a header and part of its payload: torn).
        chunk_bytes: 8 << 10,
        ..small_ssd(Path::new(dir))
    };
    let config = umbp_pool::PoolConfig {
        socket_path: socket.into(),
        capacity_bytes: DRAM,
        min_object_bytes: OBJECT,
        ssd: Some(ssd),
        ..Default::default()
    };
    umbp_pool::fault::abort_during_demotion(4, 150);
    let _pool = umbp_pool::Pool::start(config).expect("child pool starts");
    println!("listening");
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// (f) A pool killed while a demotion batch is being written (records half on disk, the
/// segment without a footer), restarted on the same directory by the daemon: the torn
/// records are skipped, every listed object loads byte-exact, nothing wrong is loaded.
#[test]
fn kill_during_demotion_then_restart() {
    let dir = ssd_dir("abort");
    let socket = unique_socket("ssd-abort");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_pool_aborting_during_demotion", "--ignored", "--nocapture", "--test-threads", "1"])
        .env(CHILD_ENV, format!("{}|{}", socket.display(), dir.path().display()))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut lines = out.lines();
    assert!(lines.any(|l| l.is_ok_and(|l| l.contains("listening"))), "child pool did not start");
    let deadline = Instant::now() + Duration::from_secs(10);
    while UnixStream::connect(&socket).is_err() {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(10));
    }
    // Store keys 0..count again and again (stores that find DRAM full while the evictor
    // demotes are NotStored) until the pool dies in its 4th demotion batch.
    let count = 8 * DRAM / OBJECT;
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the pool never reached its 4th demotion batch");
        let _ = Command::new(workspace_binary("umbp-test-worker"))
            .arg("--socket")
            .arg(&socket)
            .args(["--namespace", "1", "--timeout-ms", "2000", "store", "--first-key", "0", "--count", &count.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        std::thread::sleep(Duration::from_millis(50));
    }
    let status = child.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGABRT), "the fault killed the pool during a demotion: {status:?}");
    let _ = std::fs::remove_file(&socket);
    // The daemon restarts on the directory.
    let d = dir.path().to_str().unwrap();
    let pool = PoolProcess::start(
        &socket,
        &[
            "--capacity", "8MiB", "--min-object-size", "16KiB", "--ssd-dir", d, "--ssd-capacity", "256MiB", "--ssd-segment-size", "4MiB",
            "--ssd-admission", "all",
        ],
    );
    let ssd = pool.report().ssd.unwrap();
    println!("after the kill: restored {}, torn records skipped {}", ssd.restored_objects, ssd.torn_records_skipped);
    assert!(ssd.restored_objects > 0, "the batches before the kill are on SSD: {ssd:?}");
    let l = run_worker(&pool.socket, 1, "per-layer", &["load", "--first-key", "0", "--count", &count.to_string()]);
    assert_eq!(n(&l, "corrupt"), 0, "wrong bytes after a kill during demotion: {l}");
    assert_eq!(n(&l, "failed"), 0, "{l}");
    assert!(n(&l, "loaded") >= ssd.restored_objects, "every restored object loads: {l} {ssd:?}");
    let ssd = pool.report().ssd.unwrap();
    assert_eq!((ssd.crc_misses, ssd.promotion_failures), (0, 0), "torn records were skipped at start, not listed: {ssd:?}");
}

fn start_error(args: &[&str]) -> (i32, String) {
    let socket = unique_socket("ssd-bad");
    let out = Command::new(pool_binary()).arg("--socket").arg(&socket).args(args).stdin(Stdio::null()).output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// (d) A missing directory, a file and a directory another pool holds stop the pool at
/// start with an error naming the flag or the directory; it does not start without its tier.
#[test]
fn bad_ssd_dirs_stop_the_pool_at_start() {
    let dir = ssd_dir("bad");
    let missing = dir.path().join("missing");
    let (code, err) = start_error(&["--capacity", "8MiB", "--ssd-dir", missing.to_str().unwrap(), "--ssd-capacity", "1GiB"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("ssd-dir") && err.contains(missing.to_str().unwrap()), "{err}");
    let file = dir.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let (code, err) = start_error(&["--capacity", "8MiB", "--ssd-dir", file.to_str().unwrap(), "--ssd-capacity", "1GiB"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not a directory") && err.contains(file.to_str().unwrap()), "{err}");
    // A directory in use by a running pool.
    let d = dir.path().to_str().unwrap();
    let args = ["--capacity", "8MiB", "--ssd-dir", d, "--ssd-capacity", "256MiB", "--ssd-segment-size", "4MiB"];
    let _first = PoolProcess::start(&unique_socket("ssd-first"), &args);
    let (code, err) = start_error(&args);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("SSD tier") && err.contains(d) && err.contains("in use"), "{err}");
    let _ = Path::new(d);
}

/// A directory of SSD format 1 (segments, no salt file; an upgrade, issue #34 S4): its
/// records cannot be authenticated, so the pool removes its segment files (the tier is a
/// cache) and starts with an empty tier and a new salt, instead of refusing to start (an
/// embedded engine with `ssd_dir` would not start after an upgrade).
#[test]
fn a_directory_of_format_1_is_emptied_and_the_pool_starts() {
    let old = ssd_dir("format1");
    let seg = old.path().join("seg-0000000000000000.umbp");
    std::fs::write(&seg, vec![0u8; 8192]).unwrap();
    let o = old.path().to_str().unwrap();
    let args = ["--capacity", "8MiB", "--ssd-dir", o, "--ssd-capacity", "256MiB", "--ssd-segment-size", "4MiB"];
    let _pool = PoolProcess::start(&unique_socket("ssd-format1"), &args);
    // The tier opens beside the listening socket: wait for the new salt (made after the
    // old segments are gone).
    let salt = old.path().join(".umbp-ssd.salt");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !salt.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(salt.exists(), "no salt file 10 s after the start");
    assert!(!seg.exists(), "the unauthenticated format-1 segment is still there");
}
