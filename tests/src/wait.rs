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

/// CPU time (user + system) in ms of each thread of process `pid` whose name starts with
/// `name`, in thread id order, per /proc (empty when the process is gone).
pub fn thread_cpu_ms(pid: i32, name: &str) -> Vec<u64> {
    // SAFETY: sysconf only reads a system constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    let mut tasks: Vec<_> = tasks.flatten().map(|t| t.path()).collect();
    tasks.sort();
    tasks
        .iter()
        .filter_map(|t| {
            let stat = std::fs::read_to_string(t.join("stat")).ok()?;
            let (head, rest) = stat.rsplit_once(')')?;
            if !head.split_once('(').is_some_and(|(_, comm)| comm.starts_with(name)) {
                return None;
            }
            // After the name: state is field 0, utime 11, stime 12 (proc(5)).
            let f: Vec<u64> = rest.split_whitespace().map(|f| f.parse().unwrap_or(0)).collect();
            Some((f.get(11).unwrap_or(&0) + f.get(12).unwrap_or(&0)) * 1000 / hz)
        })
        .collect()
}
