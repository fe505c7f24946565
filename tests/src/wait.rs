//! Waiting for a condition in another process, with a deadline.

use std::time::{Duration, Instant};

/// Waits until `f` holds or `timeout` passes; returns whether it held.
pub fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until `f` holds, polling every 20 ms; panics naming `what` after `bound`. Returns
/// how long it took (tests assert bounds on it, e.g. a heartbeat's).
pub fn wait_until(what: &str, bound: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < bound, "timed out after {bound:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
    t.elapsed()
}

/// Whether every thread of process `pid` is in state T (stopped), per /proc.
pub fn all_threads_stopped(pid: i32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
    tasks.flatten().all(|t| {
        std::fs::read_to_string(t.path().join("stat"))
            .ok()
            .and_then(|stat| stat.rsplit_once(')').map(|(_, rest)| rest.trim_start().starts_with('T')))
            .unwrap_or(false)
    })
}
