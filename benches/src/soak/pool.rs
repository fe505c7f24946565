//! The soak's pool process: `umbp-pool` (or this binary's `__soak-pool` test pool with a
//! fault armed) started, signalled, killed, restarted and inspected (fds, state report).

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rustix::process::Signal;
use umbp_pool::pool_report::{PeerRole, PoolReport};

/// The pool process of `soak --inject-corruption` (hidden `__soak-pool`): the pool library
/// with [`umbp_pool::fault::corrupt_every_nth_store`] armed, stopped by SIGTERM/SIGINT
/// like `umbp-pool`. Only the flags the soak passes.
#[derive(clap::Args, Debug, Clone)]
pub struct SoakPoolCli {
    #[arg(long)]
    socket: PathBuf,
    #[arg(long)]
    capacity: String,
    #[arg(long = "min-object-size")]
    min_object_size: String,
    /// Flip one byte in every N stored objects (0: never).
    #[arg(long = "inject-corruption", default_value_t = 0)]
    inject_corruption: u64,
}

impl SoakPoolCli {
    pub fn run(self) -> Result<(), String> {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
            .with_writer(std::io::stderr)
            .try_init();
        let config = umbp_pool::PoolConfig {
            socket_path: self.socket.clone(),
            capacity_bytes: umbp_pool::parse_size("capacity", &self.capacity).map_err(|e| e.to_string())?,
            min_object_bytes: umbp_pool::parse_size("min-object-size", &self.min_object_size).map_err(|e| e.to_string())?,
            ..Default::default()
        };
        config.validate().map_err(|e| e.to_string())?;
        // Before any thread starts, so all inherit the mask and only sigwait sees the signal.
        let stop = umbp_pool::StopSignals::block();
        umbp_pool::fault::corrupt_every_nth_store(self.inject_corruption);
        tracing::warn!(
            every = self.inject_corruption,
            "TEST POOL: corrupting one stored object in every N (umbp-bench soak --inject-corruption)"
        );
        let pool = umbp_pool::Pool::start(config).map_err(|e| e.to_string())?;
        stop.wait();
        tracing::warn!(flipped_bytes = umbp_pool::fault::corrupted_bytes(), "TEST POOL: stopping");
        pool.shutdown();
        Ok(())
    }
}

/// How the pool is started: `bin [subcommand...] --socket S args...`.
#[derive(Clone)]
pub(super) struct PoolCmd {
    pub(super) bin: PathBuf,
    /// Before `--socket` (`__soak-pool --inject-corruption N` for the negative control).
    pub(super) pre_args: Vec<String>,
    pub(super) args: Vec<String>,
}

pub(super) struct PoolProc {
    child: Child,
    cmd: PoolCmd,
    pub(super) socket: PathBuf,
    pub(super) log: PathBuf,
    /// Pool processes started so far.
    pub(super) starts: u64,
    /// Leave TCP sockets out of [`Self::fd_kinds`] (`soak --cluster`: the cluster's control
    /// connections and UCX's endpoints come and go with the peers, not with the workers;
    /// [`Self::tcp_fds`] counts them apart).
    pub(super) skip_tcp: bool,
}

/// An SSD tier segment file (`.../seg-<hex>.umbp`).
fn is_segment(target: &str) -> bool {
    target.rsplit('/').next().is_some_and(|f| f.starts_with("seg-") && f.ends_with(".umbp"))
}

/// The inode of an fd's `socket:[INODE]` link target.
fn socket_inode(target: &str) -> Option<u64> {
    target.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
}

/// How a pool process ended, in words ("exit status: 99", "signal: 11 (SIGSEGV)").
pub(super) fn describe(st: &std::process::ExitStatus) -> String {
    st.to_string()
}

/// Whether the pool ended by the soak's own SIGKILL (an injected restart).
pub(super) fn killed_by_us(st: &std::process::ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    st.signal() == Some(libc::SIGKILL)
}

/// The last `n` lines of a log file (for failure messages).
pub(super) fn log_tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

impl PoolProc {
    pub(super) fn start(cmd: &PoolCmd, socket: &Path, log: &Path) -> Result<Self, String> {
        let mut p = Self {
            child: Self::spawn(cmd, socket, log)?,
            cmd: cmd.clone(),
            socket: socket.into(),
            log: log.into(),
            starts: 1,
            skip_tcp: false,
        };
        p.wait_listening()?;
        Ok(p)
    }

    pub(super) fn spawn(cmd: &PoolCmd, socket: &Path, log: &Path) -> Result<Child, String> {
        let bin = &cmd.bin;
        let log = std::fs::OpenOptions::new().create(true).append(true).open(log).map_err(|e| e.to_string())?;
        Command::new(bin)
            .args(&cmd.pre_args)
            .arg("--socket")
            .arg(socket)
            .args(&cmd.args)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", bin.display()))
    }

    pub(super) fn wait_listening(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(20);
        while UnixStream::connect(&self.socket).is_err() {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Err(format!("umbp-pool exited at start ({st}); log: {}", self.log.display()));
            }
            if Instant::now() > deadline {
                return Err(format!("umbp-pool did not listen at {}", self.socket.display()));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    pub(super) fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Signals the pool, unless it already exited (and was reaped: its pid may be reused).
    pub(super) fn signal(&mut self, sig: Signal) {
        if !matches!(self.child.try_wait(), Ok(None)) {
            return;
        }
        if let Some(pid) = rustix::process::Pid::from_raw(self.pid()) {
            let _ = rustix::process::kill_process(pid, sig);
        }
    }

    /// How the pool ended if it is no longer running (without waiting).
    pub(super) fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// A new pool process at the same socket (the old one has exited and been reaped).
    pub(super) fn respawn(&mut self) -> Result<(), String> {
        self.child = Self::spawn(&self.cmd, &self.socket, &self.log)?;
        self.starts += 1;
        self.wait_listening()
    }

    /// The injected restart: SIGKILL and a new process. Returns how the old one ended if
    /// that was not this SIGKILL (it had exited or crashed on its own before).
    pub(super) fn restart(&mut self) -> Result<Option<std::process::ExitStatus>, String> {
        let st = self.kill();
        self.respawn()?;
        Ok(st.filter(|st| !killed_by_us(st)))
    }

    pub(super) fn kill(&mut self) -> Option<std::process::ExitStatus> {
        let _ = self.child.kill();
        self.child.wait().ok()
    }

    /// The clean stop at the end: SIGTERM, then the exit status, which must be success: a
    /// sanitizer's or valgrind's error exit code (`--error-exitcode`, ASAN/LSAN `exitcode`)
    /// shows here. SIGKILL after `grace`.
    pub(super) fn stop(&mut self, grace: Duration) -> Result<std::process::ExitStatus, String> {
        self.signal(SIGCONT); // in case it is stopped
        self.signal(Signal::TERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Some(st) = self.exited() {
                return Ok(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        Err(format!("umbp-pool did not exit within {} s of SIGTERM (killed)", grace.as_secs()))
    }

    /// Open fds by kind (`socket`, `/memfd:umbp-rings-N`, `anon_inode:[eventfd]`...), less
    /// the SSD tier's segment files (counted by [`Self::segment_fds`]) and, with
    /// `skip_tcp`, TCP sockets (counted by [`Self::tcp_fds`]).
    pub(super) fn fd_kinds(&self) -> std::collections::BTreeMap<String, i64> {
        let tcp = if self.skip_tcp { self.tcp_inodes() } else { Default::default() };
        let mut m = std::collections::BTreeMap::new();
        for e in std::fs::read_dir(format!("/proc/{}/fd", self.pid())).into_iter().flatten().flatten() {
            let t = std::fs::read_link(e.path()).map(|t| t.display().to_string()).unwrap_or_default();
            if is_segment(&t) || socket_inode(&t).is_some_and(|i| tcp.contains(&i)) {
                continue;
            }
            let kind: String =
                t.split(" (deleted)").next().unwrap_or("").chars().map(|c| if c.is_ascii_digit() { 'N' } else { c }).collect();
            *m.entry(kind).or_insert(0) += 1;
        }
        m
    }

    /// Open fds, less the SSD tier's segment files (one per segment, bounded by its
    /// capacity: checked against the report by the soak).
    pub(super) fn fds(&self) -> usize {
        self.fd_kinds().values().sum::<i64>() as usize
    }

    /// Inodes of the TCP sockets in the pool's network namespace (`/proc/PID/net/tcp{,6}`).
    fn tcp_inodes(&self) -> std::collections::HashSet<u64> {
        let mut set = std::collections::HashSet::new();
        for table in ["tcp", "tcp6"] {
            let text = std::fs::read_to_string(format!("/proc/{}/net/{table}", self.pid())).unwrap_or_default();
            // Columns: sl local rem st tx:rx tr:when retrnsmt uid timeout inode ...
            set.extend(text.lines().skip(1).filter_map(|l| l.split_whitespace().nth(9)?.parse::<u64>().ok()));
        }
        set
    }

    /// Open fds of TCP sockets.
    pub(super) fn tcp_fds(&self) -> usize {
        let tcp = self.tcp_inodes();
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| {
                std::fs::read_link(e.path()).is_ok_and(|t| socket_inode(&t.display().to_string()).is_some_and(|i| tcp.contains(&i)))
            })
            .count()
    }

    /// Open fds of SSD segment files (`seg-*.umbp`).
    pub(super) fn segment_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| std::fs::read_link(e.path()).is_ok_and(|t| is_segment(&t.display().to_string())))
            .count()
    }

    /// The pool's state report, through an observer attachment (the test kit's client).
    pub(super) fn report(&self) -> Result<PoolReport, String> {
        umbp_integration_tests::try_report(&self.socket)?
            .into_full()
            .map_err(|t| format!("got the tenant view (uid {}), not the full report", t.uid))
    }
}

impl Drop for PoolProc {
    /// A clean stop (SIGTERM) so that a tool wrapping the pool (valgrind) can report; SIGKILL
    /// after 30 s. (A finished run has stopped it already and checked its exit status.)
    fn drop(&mut self) {
        let _ = self.stop(Duration::from_secs(30));
    }
}

pub(super) const SIGSTOP: Signal = Signal::STOP;
pub(super) const SIGCONT: Signal = Signal::CONT;

pub(super) fn worker_attachments(r: &PoolReport) -> usize {
    r.attachments_of(PeerRole::Worker).count()
}

/// The pool's fd count once it stays the same for 200 ms and satisfies `ok` (its last
/// observer attachment, background GPU probing and the like have settled); gives up after
/// 10 s and returns the last count.
pub(super) fn settled_fds(pool: &PoolProc, ok: impl Fn(usize) -> bool) -> usize {
    let mut prev = pool.fds();
    let mut same = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let now = pool.fds();
        same = if now == prev { same + 1 } else { 0 };
        // A second of no change (a slow pool, e.g. under valgrind, tears down late).
        if (same >= 5 && ok(now)) || Instant::now() > deadline {
            return now;
        }
        prev = now;
    }
}

/// `a - b` per kind, without the zeros.
pub(super) fn kind_diff(a: &std::collections::BTreeMap<String, i64>, b: &std::collections::BTreeMap<String, i64>) -> Vec<String> {
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    keys.into_iter()
        .filter_map(|k| {
            let d = a.get(k).unwrap_or(&0) - b.get(k).unwrap_or(&0);
            (d != 0).then(|| format!("{k}: {d:+}"))
        })
        .collect()
}
