//! `umbp-pool` child processes on private sockets: start, signal, restart, kill; the
//! `UMBP_POOL_WRAPPER` hook (valgrind, sanitizers); finding workspace binaries.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A private socket path (`pool.sock`) in a fresh directory of its own; [`PoolProcess`]
/// removes the directory when dropped.
pub fn unique_socket(tag: &str) -> PathBuf {
    let dir = tempfile::Builder::new()
        .prefix(&format!("umbp-it-{}-{tag}-", std::process::id()))
        .tempdir()
        .expect("create a socket directory under $TMPDIR")
        .keep();
    dir.join("pool.sock")
}

/// `UMBP_POOL_WRAPPER`: a command every test pool runs under, e.g.
/// `valgrind --tool=memcheck --error-exitcode=99 --log-file=/tmp/vg-%p.log` or a script
/// that runs a sanitizer build (scripts/sanitize.sh, docs/reliability.md). Wrapped pools
/// are stopped with SIGTERM (a clean shutdown, so the tool can report) instead of SIGKILL
/// at the end, and their exit status must be 0: the test fails on the tool's error exit
/// code (nothing reads its logs).
pub fn pool_wrapper() -> Option<Vec<String>> {
    std::env::var("UMBP_POOL_WRAPPER").ok().filter(|w| !w.trim().is_empty()).map(|w| w.split_whitespace().map(String::from).collect())
}

/// A command that runs the pool binary `bin`, under `UMBP_POOL_WRAPPER` when set.
pub fn pool_command(bin: &Path) -> Command {
    match pool_wrapper() {
        Some(w) => {
            let mut c = Command::new(&w[0]);
            c.args(&w[1..]).arg(bin);
            c
        }
        None => Command::new(bin),
    }
}

/// Stops a wrapped pool with SIGTERM and waits for its clean exit (up to 60 s); returns
/// its exit status (None: it did not exit in time). A pool that already exited is not
/// signalled (its pid may be reused); its status is returned.
pub fn stop_gracefully(child: &mut Child) -> Option<std::process::ExitStatus> {
    if let Ok(Some(st)) = child.try_wait() {
        return Some(st);
    }
    // SAFETY: signalling our own child, not reaped yet (checked above).
    unsafe { libc::kill(child.id() as i32, libc::SIGCONT) };
    // SAFETY: as above.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Ok(Some(st)) = child.try_wait() {
            return Some(st);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

/// Kills and reaps a pool started by hand and removes its socket's directory (what a
/// test's own pool handle does on drop).
pub fn kill_and_clean(child: &mut Child, socket: &Path) {
    let _ = child.kill();
    let _ = child.wait();
    if let Some(d) = socket.parent() {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// A `umbp-pool` child process; killed on drop.
pub struct PoolProcess {
    pub child: Child,
    pub socket: PathBuf,
    pub args: Vec<String>,
    /// The test SIGKILLed the current process itself (`kill`): no exit status to check.
    killed: bool,
}

/// A workspace binary: test executables live in `target/<profile>/deps`, binaries one up.
/// Refuses one older than any source it was built from: `cargo test` builds the test code
/// but not the other crates' binaries, and a stale `umbp-pool` fails tests for reasons
/// that have nothing to do with the code under test.
pub fn workspace_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap();
    for cand in [dir.join(name), dir.parent().unwrap().join(name)] {
        if cand.exists() {
            if let Some((source, _)) = newer_source(&cand) {
                panic!(
                    "{} is older than {}; run `cargo build --workspace --bins` (scripts/test.sh does) before the tests",
                    cand.display(),
                    source.display()
                );
            }
            return cand;
        }
    }
    panic!("{name} not found next to {}; run `cargo build --workspace --bins` first", exe.display());
}

/// The newest source `binary` was built from, if it is newer than the binary: read from
/// the dep-info file cargo writes next to it (`<binary>.d`: "binary: source source ...").
/// No dep-info, no verdict.
fn newer_source(binary: &Path) -> Option<(PathBuf, std::time::SystemTime)> {
    let built = std::fs::metadata(binary).and_then(|m| m.modified()).ok()?;
    let deps = std::fs::read_to_string(binary.with_extension("d")).ok()?;
    let (_, sources) = deps.lines().next()?.split_once(": ")?;
    sources
        .split_whitespace()
        .filter_map(|f| {
            let t = std::fs::metadata(f).and_then(|m| m.modified()).ok()?;
            (t > built).then(|| (PathBuf::from(f), t))
        })
        .max_by_key(|(_, t)| *t)
}

pub fn pool_binary() -> PathBuf {
    workspace_binary("umbp-pool")
}

impl PoolProcess {
    pub fn start(socket: &Path, args: &[&str]) -> Self {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let child = Self::spawn(socket, &args);
        let p = Self { child, socket: socket.to_path_buf(), args, killed: false };
        p.wait_listening();
        p
    }

    fn spawn(socket: &Path, args: &[String]) -> Child {
        pool_command(&pool_binary())
            .arg("--socket")
            .arg(socket)
            .args(args)
            .env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()))
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn umbp-pool")
    }

    /// Starts a new pool process at the same socket (after `kill`).
    pub fn restart(&mut self) {
        self.kill();
        self.child = Self::spawn(&self.socket, &self.args);
        self.killed = false;
        self.wait_listening();
    }

    pub fn wait_listening(&self) {
        let deadline = Instant::now() + Duration::from_secs(if pool_wrapper().is_some() { 120 } else { 20 });
        while UnixStream::connect(&self.socket).is_err() {
            assert!(Instant::now() < deadline, "pool did not start listening at {}", self.socket.display());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Sends `sig`. For SIGSTOP, returns once every thread of the pool is stopped: kill()
    /// returns before a running thread has actually stopped, and a test that submits work
    /// right after must not race a pool thread still picking it up.
    pub fn signal(&self, sig: i32) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.pid(), sig) };
        if sig == libc::SIGSTOP {
            let stopped = crate::wait::eventually(Duration::from_secs(5), || crate::wait::all_threads_stopped(self.pid()));
            assert!(stopped, "pool {} did not stop within 5 s of SIGSTOP", self.pid());
        }
    }

    pub fn kill(&mut self) {
        self.killed = true;
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid())).map(|d| d.count()).unwrap_or(0)
    }

    /// The pool's full state report through an observer attachment (panics on failure).
    pub fn report(&self) -> umbp_pool::PoolReport {
        crate::report::report(&self.socket)
    }

    /// The report's JSON exactly as the pool sent it.
    pub fn report_json(&self) -> serde_json::Value {
        crate::report::report_json(&self.socket)
    }
}

impl Drop for PoolProcess {
    /// A wrapped pool (sanitizer, valgrind) must end with exit status 0: its tool's error
    /// exit code fails the test here.
    fn drop(&mut self) {
        let wrapped = (pool_wrapper().is_some() && !self.killed).then(|| stop_gracefully(&mut self.child));
        self.kill();
        if let Some(d) = self.socket.parent() {
            let _ = std::fs::remove_dir_all(d);
        }
        if let Some(st) = wrapped {
            if !st.is_some_and(|s| s.success()) && !std::thread::panicking() {
                panic!(
                    "pool at {} under UMBP_POOL_WRAPPER ended with {} (a sanitizer's or valgrind's error exit code, or a crash)",
                    self.socket.display(),
                    st.map_or("no exit within 60 s of SIGTERM".to_string(), |s| s.to_string())
                );
            }
        }
    }
}
