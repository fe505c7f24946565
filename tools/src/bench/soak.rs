//! `umbp-bench soak`: a chaos soak of a real `umbp-pool` process and real worker processes
//! (docs/reliability.md).
//!
//! `--workers` processes (this binary re-executed as `__soak-worker`) store and load
//! checksummed blocks at random, over one shared key space, for `--seconds`, while a chaos
//! loop SIGKILLs workers (and starts replacements), SIGSTOPs and SIGCONTs the pool, and
//! kills and restarts the pool at the same socket. It checks, and fails (exit 1) when one
//! does not hold:
//!
//! - `corrupted_bytes` = 0: every block a load reports `Loaded` has exactly the bytes its
//!   key's pattern says, whoever stored it;
//! - `max_blocked_ms` <= `--timeout-ms`: no worker call (submit, poll) took longer than the
//!   engine timeout, and no `wait(t)` returned later than `t` plus the timeout;
//! - `leaked_bytes` = 0 and no leaked fd: after every worker death (the others paused with
//!   nothing in flight) every allocated byte of the pool belongs to a published object, no
//!   object is pinned, and the pool has exactly its baseline fds plus those of the live
//!   attachments;
//! - every worker is attached again at the end.
//!
//! A fault-free warm-up phase first measures the operation rate the `operations` case is
//! compared with (DESIGN §12: the baseline is measured in the same run).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use umbp_worker::{BlockStatus, MemorySpec, ObjectKey, Segment, TransferId, Worker, WorkerConfig, WorkerError};

use super::report::{Better, Case};

#[derive(clap::Args, Debug, Clone)]
pub struct SoakCli {
    /// Length of the chaos phase.
    #[arg(long, default_value_t = 60)]
    pub seconds: u64,
    /// Worker processes.
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Engine timeout of each worker (`timeout_ms`); also the bound on any blocked call.
    #[arg(long = "timeout-ms", default_value_t = 1000)]
    pub timeout_ms: u64,
    /// Pool DRAM.
    #[arg(long, default_value = "256MiB")]
    pub capacity: String,
    /// Seed of the chaos schedule and the workers' choices.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The `umbp-pool` binary [default: next to this one].
    #[arg(long = "pool-bin")]
    pub pool_bin: Option<PathBuf>,
    /// Worker KV memory: `process` (any memory, the pool uses process_vm_readv/writev) or
    /// `memfd` (a sealed memfd the pool maps; needed under valgrind, which lacks pidfd_open).
    #[arg(long, default_value = "process", value_parser = ["process", "memfd"])]
    pub memory: String,
    /// Extra flags for every `umbp-pool` start (space separated).
    #[arg(long = "pool-args", default_value = "", allow_hyphen_values = true)]
    pub pool_args: String,
    /// Negative control, TEST ONLY: the pool flips one byte of its DRAM copy of one object
    /// in every N stored, so the run must fail with `corrupted_bytes` > 0. The pool is then
    /// this binary (hidden `__soak-pool`), which arms the fault inside its own process;
    /// `umbp-pool` has no flag, variable or message that arms it.
    #[arg(long = "inject-corruption", value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub inject_corruption: Option<u64>,
    /// One JSON object per case and line.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args, Debug, Clone)]
pub struct SoakWorkerCli {
    #[arg(long)]
    socket: PathBuf,
    #[arg(long)]
    id: u64,
    #[arg(long)]
    seed: u64,
    #[arg(long = "timeout-ms")]
    timeout_ms: u64,
    #[arg(long, default_value = "process")]
    memory: String,
}

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
        // SAFETY: plain libc signal-mask calls on a local sigset.
        let set = unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::sigaddset(&mut set, libc::SIGTERM);
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            set
        };
        umbp_pool::fault::corrupt_every_nth_store(self.inject_corruption);
        tracing::warn!(every = self.inject_corruption, "TEST POOL: corrupting one stored object in every N (umbp-bench soak --inject-corruption)");
        let pool = umbp_pool::Pool::start(config).map_err(|e| e.to_string())?;
        let mut sig = 0;
        // SAFETY: waits on the set blocked above.
        unsafe { libc::sigwait(&set, &mut sig) };
        tracing::warn!(flipped_bytes = umbp_pool::fault::corrupted_bytes(), "TEST POOL: stopping");
        pool.shutdown();
        Ok(())
    }
}

const NS: u128 = 0x736f_616b;
/// Layout of every worker: LAYERS segments of BLOCKS pages.
const LAYERS: u64 = 4;
const BLOCKS: u64 = 32;
const PAGE: u64 = 16 << 10;
const OBJECT_BYTES: u64 = LAYERS * PAGE;
/// Shared key space (a quarter of it fits a 256 MiB pool at once: eviction runs too).
const KEYS: u64 = 16384;
/// Transfers each worker keeps in flight.
const DEPTH: usize = 4;

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The bytes of the object with `key`: every byte depends on the key and its position.
fn pattern(key: u128, out: &mut [u8]) {
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let w = splitmix(key as u64 ^ (key >> 64) as u64 ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        chunk.copy_from_slice(&w.to_le_bytes()[..chunk.len()]);
    }
}

fn key_of(k: u64) -> ObjectKey {
    ObjectKey::derive(NS, 0, 0, &k.to_le_bytes())
}

// ---------------------------------------------------------------------------------------
// Worker process
// ---------------------------------------------------------------------------------------

struct Pending {
    /// (key number, key, block)
    batch: Vec<(u64, ObjectKey, u64)>,
    submitted: Instant,
    /// Cancel was tried and the pool had started it (a load): wait for its completion.
    cancel_refused: bool,
}

#[derive(Default)]
struct Tally {
    transfers: u64,
    blocks: u64,
    stored: u64,
    loaded: u64,
    failed: u64,
    corrupt_bytes: u64,
    corrupt_blocks: u64,
    max_blocked_ms: f64,
    /// Which call that was.
    max_blocked_call: &'static str,
    busy: u64,
    stalled: u64,
    disconnected: u64,
    /// Transfers past the timeout cancelled (their blocks reused at once, as an engine does).
    cancelled: u64,
}

/// A worker's KV memory: a heap buffer or a mapped memfd.
struct KvMemory {
    heap: Vec<u8>,
    shm: Option<umbp_ipc::SharedMemory>,
}

impl std::ops::Deref for KvMemory {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.shm {
            // SAFETY: the mapping lives as long as `self`; only this process and the pool
            // (which never writes a block while a transfer of it is pending) touch it.
            Some(s) => unsafe { std::slice::from_raw_parts(s.as_ptr(), s.len()) },
            None => &self.heap,
        }
    }
}

impl std::ops::DerefMut for KvMemory {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &self.shm {
            // SAFETY: as above.
            Some(s) => unsafe { std::slice::from_raw_parts_mut(s.as_ptr(), s.len()) },
            None => &mut self.heap,
        }
    }
}

struct SoakWorker {
    id: u64,
    w: Worker,
    mem: KvMemory,
    obj: Vec<u8>,
    pending: Vec<(TransferId, Pending)>,
    free: Vec<u64>,
    /// Key numbers this worker stored lately (what its loads mostly ask for).
    recent: std::collections::VecDeque<u64>,
    t: Tally,
    rng: u64,
    /// The engine timeout: a transfer older than this is cancelled.
    timeout: Duration,
}

/// How long a call that was allowed to wait `wait` blocked beyond it, in ms. The run fails
/// when this passes the engine timeout: `wait(t)` is bounded by `t + timeout`, the other
/// calls by `timeout` (docs/reliability.md).
fn blocked_ms(wait: Duration, took: Duration) -> f64 {
    took.saturating_sub(wait).as_secs_f64() * 1e3
}

fn page_offsets(b: u64) -> impl Iterator<Item = usize> {
    (0..LAYERS).map(move |l| ((l * BLOCKS + b) * PAGE) as usize)
}

impl SoakWorker {
    fn next(&mut self) -> u64 {
        self.rng = splitmix(self.rng);
        self.rng
    }

    /// Runs `f` (a worker-library call that may wait up to `wait`: `wait(t)`'s `t`, zero
    /// for the others) and records how long it blocked beyond that.
    fn timed<R>(&mut self, call: &'static str, wait: Duration, f: impl FnOnce(&mut Worker) -> R) -> R {
        let started = Instant::now();
        let r = f(&mut self.w);
        let over = blocked_ms(wait, started.elapsed());
        if over > self.t.max_blocked_ms {
            self.t.max_blocked_ms = over;
            self.t.max_blocked_call = call;
        }
        r
    }

    /// Verifies the Loaded blocks of a completion and frees its blocks.
    fn complete(&mut self, c: umbp_worker::Completion) {
        let Some(pos) = self.pending.iter().position(|(id, _)| *id == c.id) else { return };
        let (_, p) = self.pending.swap_remove(pos);
        self.t.transfers += 1;
        if c.error == Some(umbp_worker::CqeError::Busy) {
            self.t.busy += 1;
        }
        for (s, &(n, k, b)) in c.statuses.iter().zip(&p.batch) {
            self.t.blocks += 1;
            match s {
                BlockStatus::Stored | BlockStatus::AlreadyPresent => {
                    self.t.stored += 1;
                    self.recent.push_back(n);
                    if self.recent.len() > 256 {
                        self.recent.pop_front();
                    }
                }
                BlockStatus::Loaded => {
                    self.t.loaded += 1;
                    pattern(k.0, &mut self.obj);
                    let mut bad = 0u64;
                    for (l, off) in page_offsets(b).enumerate() {
                        let want = &self.obj[l * PAGE as usize..(l + 1) * PAGE as usize];
                        bad += self.mem[off..off + PAGE as usize].iter().zip(want).filter(|(x, y)| x != y).count() as u64;
                    }
                    if bad > 0 {
                        self.t.corrupt_bytes += bad;
                        self.t.corrupt_blocks += 1;
                        // The first few by name; all of them are counted.
                        if self.t.corrupt_blocks <= 5 {
                            eprintln!("soak worker {}: key {n} (block {b}): {bad} corrupted bytes", self.id);
                        }
                        self.report("corrupt");
                    }
                }
                _ => self.t.failed += 1,
            }
        }
        self.free.extend(p.batch.iter().map(|&(_, _, b)| b));
    }

    fn submit(&mut self) {
        let store = self.next().is_multiple_of(2) || self.recent.is_empty();
        let n = 1 + self.next() % 8;
        let mut batch: Vec<(u64, ObjectKey, u64)> = Vec::new();
        for _ in 0..n {
            let k = if store || self.next().is_multiple_of(4) {
                self.next() % KEYS
            } else {
                let i = (self.next() % self.recent.len() as u64) as usize;
                self.recent[i]
            };
            if batch.iter().any(|&(kk, _, _)| kk == k) {
                continue;
            }
            let b = self.free.pop().expect("the caller checked there are free blocks");
            batch.push((k, key_of(k), b));
        }
        for &(_, k, b) in &batch {
            if store {
                pattern(k.0, &mut self.obj);
                for (l, off) in page_offsets(b).enumerate() {
                    self.mem[off..off + PAGE as usize].copy_from_slice(&self.obj[l * PAGE as usize..(l + 1) * PAGE as usize]);
                }
            } else {
                for off in page_offsets(b) {
                    self.mem[off..off + PAGE as usize].fill(0xEE);
                }
            }
        }
        let blocks: Vec<(ObjectKey, u64)> = batch.iter().map(|&(_, k, b)| (k, b)).collect();
        let r = self.timed(if store { "store" } else { "load" }, Duration::ZERO, |w| if store { w.store(0, &blocks) } else { w.load(0, &blocks) });
        match r {
            Ok(id) => self.pending.push((id, Pending { batch, submitted: Instant::now(), cancel_refused: false })),
            Err(e) => {
                match e {
                    WorkerError::Stalled { .. } => self.t.stalled += 1,
                    WorkerError::Disconnected => self.t.disconnected += 1,
                    _ => {}
                }
                self.free.extend(batch.iter().map(|&(_, _, b)| b));
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }

    /// One round: reap, then submit or wait for the oldest transfer.
    fn step(&mut self, submit: bool) {
        for c in self.timed("poll", Duration::ZERO, |w| w.poll()) {
            self.complete(c);
        }
        // Cancel, never abandon: a transfer past the timeout is cancelled and, unless the
        // pool already writes it (a started load), its blocks are reused at once for other
        // keys, as an engine hands them to other requests. A pool that touched them after
        // that would show up as corrupted bytes.
        let overdue = self.pending.iter().position(|(_, p)| !p.cancel_refused && p.submitted.elapsed() > self.timeout);
        if let Some(pos) = overdue {
            let id = self.pending[pos].0;
            match self.timed("cancel", Duration::ZERO, |w| w.cancel(id)) {
                umbp_worker::CancelOutcome::Started => self.pending[pos].1.cancel_refused = true,
                umbp_worker::CancelOutcome::Cancelled => self.t.cancelled += 1,
                umbp_worker::CancelOutcome::NotInFlight => {}
            }
            for c in self.timed("poll", Duration::ZERO, |w| w.poll()) {
                self.complete(c);
            }
        }
        if submit && self.pending.len() < DEPTH && self.free.len() >= 8 {
            self.submit();
        } else if let Some(&(id, _)) = self.pending.first() {
            let slice = Duration::from_millis(20);
            // wait(t) must come back within t: what it takes beyond t is "blocked", and the
            // run fails when that passes the engine timeout (the bound is t + timeout).
            if let Some(c) = self.timed("wait", slice, |w| w.wait(id, slice)) {
                self.complete(c);
            }
        } else {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn report(&self, kind: &str) {
        let t = &self.t;
        let line = json!({
            "t": kind,
            "transfers": t.transfers, "blocks": t.blocks, "stored": t.stored, "loaded": t.loaded,
            "failed": t.failed, "corrupt_bytes": t.corrupt_bytes,
            "max_blocked_ms": (t.max_blocked_ms * 1000.0).round() / 1000.0,
            "max_blocked_call": t.max_blocked_call,
            "busy": t.busy, "stalled": t.stalled, "disconnected": t.disconnected, "cancelled": t.cancelled,
            "connected": self.w.is_connected(), "pending": self.pending.len(),
        });
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}

impl SoakWorkerCli {
    /// The worker process: commands `pause` (finish what is in flight, report `paused`,
    /// submit nothing), `resume` and `quit` arrive on stdin; reports go to stdout.
    pub fn run(self) -> Result<(), String> {
        let commands = Arc::new(Mutex::new(Vec::<String>::new()));
        let c2 = commands.clone();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                c2.lock().unwrap().push(line.trim().to_string());
            }
            c2.lock().unwrap().push("quit".into());
        });
        let bytes = (LAYERS * BLOCKS * PAGE) as usize;
        let mem = if self.memory == "memfd" {
            let shm = umbp_ipc::SharedMemory::create("umbp-soak-kv", bytes, false).map_err(|e| e.to_string())?;
            KvMemory { heap: Vec::new(), shm: Some(shm) }
        } else {
            KvMemory { heap: vec![0u8; bytes], shm: None }
        };
        let mut cfg = WorkerConfig::new(&self.socket, NS);
        cfg.timeout = Duration::from_millis(self.timeout_ms);
        cfg.startup_timeout = Duration::from_secs(60);
        let mut w = Worker::connect(cfg).map_err(|e| e.to_string())?;
        let spec = match &mem.shm {
            Some(s) => MemorySpec::HostMemfd {
                fd: s.fd().try_clone_to_owned().map_err(|e| e.to_string())?,
                offset: 0,
                len: bytes as u64,
            },
            None => MemorySpec::HostProcess { ptr: mem.heap.as_ptr() as usize, len: bytes },
        };
        // SAFETY: `mem` moves into the SoakWorker with `w` and outlives the attachment.
        unsafe { w.register_memory(spec) }.map_err(|e| e.to_string())?;
        let segs = (0..LAYERS).map(|l| Segment::new(0, l * BLOCKS * PAGE, PAGE, PAGE, BLOCKS)).collect();
        w.register_layout(0, segs).map_err(|e| e.to_string())?;
        let mut sw = SoakWorker {
            id: self.id,
            w,
            mem,
            obj: vec![0u8; OBJECT_BYTES as usize],
            pending: Vec::new(),
            free: (0..BLOCKS).collect(),
            recent: Default::default(),
            t: Tally::default(),
            rng: splitmix(self.seed ^ self.id.wrapping_mul(0x1234_5678_9abc)),
            timeout: Duration::from_millis(self.timeout_ms),
        };
        sw.report("ready");
        let mut paused = false;
        let mut paused_reported = false;
        let mut last_report = Instant::now();
        loop {
            for cmd in std::mem::take(&mut *commands.lock().unwrap()) {
                match cmd.as_str() {
                    "pause" => {
                        paused = true;
                        paused_reported = false;
                    }
                    "resume" => paused = false,
                    "quit" => {
                        sw.report("final");
                        return Ok(());
                    }
                    _ => {}
                }
            }
            sw.step(!paused);
            if paused && sw.pending.is_empty() && !paused_reported {
                sw.report("paused");
                paused_reported = true;
            }
            if last_report.elapsed() >= Duration::from_millis(200) {
                sw.report("stats");
                last_report = Instant::now();
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Parent: pool process, worker processes, chaos, checks
// ---------------------------------------------------------------------------------------

#[derive(Default)]
struct WorkerState {
    last: Value,
    paused: u64,
}

struct WorkerProc {
    child: Child,
    stdin: ChildStdin,
    state: Arc<Mutex<WorkerState>>,
    /// Disconnected when the reader of the worker's stdout has seen EOF (read all it printed).
    reader_done: std::sync::mpsc::Receiver<()>,
}

impl WorkerProc {
    fn spawn(socket: &Path, id: u64, seed: u64, timeout_ms: u64, memory: &str) -> Result<Self, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = Command::new(exe)
            .args(["__soak-worker", "--id", &id.to_string(), "--seed", &seed.to_string()])
            .args(["--timeout-ms", &timeout_ms.to_string(), "--memory", memory])
            .arg("--socket")
            .arg(socket)
            .env("RUST_LOG", "error")
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

    fn send(&mut self, cmd: &str) {
        let _ = writeln!(self.stdin, "{cmd}");
        let _ = self.stdin.flush();
    }

    fn last(&self) -> Value {
        self.state.lock().unwrap().last.clone()
    }

    fn kill(&mut self) -> Value {
        let _ = self.child.kill();
        self.reap()
    }

    /// Waits for the worker's exit and for its reader to have read everything it printed
    /// (EOF; at most 10 s: nothing else holds the pipe), then returns its last report.
    fn reap(&mut self) -> Value {
        let _ = self.child.wait();
        let _ = self.reader_done.recv_timeout(Duration::from_secs(10));
        self.last()
    }
}

fn num(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or(0.0)
}

/// Counters summed over workers (max for `max_blocked_ms`).
#[derive(Default, Clone, Copy, Debug)]
struct Totals {
    transfers: f64,
    blocks: f64,
    loaded: f64,
    corrupt_bytes: f64,
    cancelled: f64,
    max_blocked_ms: f64,
    max_blocked_call: Option<&'static str>,
}

impl Totals {
    fn add(&mut self, v: &Value) {
        self.transfers += num(v, "transfers");
        self.blocks += num(v, "blocks");
        self.loaded += num(v, "loaded");
        self.corrupt_bytes += num(v, "corrupt_bytes");
        self.cancelled += num(v, "cancelled");
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

/// How the pool is started: `bin [subcommand...] --socket S args...`.
#[derive(Clone)]
struct PoolCmd {
    bin: PathBuf,
    /// Before `--socket` (`__soak-pool --inject-corruption N` for the negative control).
    pre_args: Vec<String>,
    args: Vec<String>,
}

struct PoolProc {
    child: Child,
    cmd: PoolCmd,
    socket: PathBuf,
    log: PathBuf,
    /// Pool processes started so far.
    starts: u64,
}

/// How a pool process ended, in words ("exit status: 99", "signal: 11 (SIGSEGV)").
fn describe(st: &std::process::ExitStatus) -> String {
    st.to_string()
}

/// Whether the pool ended by the soak's own SIGKILL (an injected restart).
fn killed_by_us(st: &std::process::ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    st.signal() == Some(libc::SIGKILL)
}

/// The last `n` lines of a log file (for failure messages).
fn log_tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

impl PoolProc {
    fn start(cmd: &PoolCmd, socket: &Path, log: &Path) -> Result<Self, String> {
        let mut p = Self { child: Self::spawn(cmd, socket, log)?, cmd: cmd.clone(), socket: socket.into(), log: log.into(), starts: 1 };
        p.wait_listening()?;
        Ok(p)
    }

    fn spawn(cmd: &PoolCmd, socket: &Path, log: &Path) -> Result<Child, String> {
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

    fn wait_listening(&mut self) -> Result<(), String> {
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

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Signals the pool, unless it already exited (and was reaped: its pid may be reused).
    fn signal(&mut self, sig: Signal) {
        if !matches!(self.child.try_wait(), Ok(None)) {
            return;
        }
        if let Some(pid) = rustix::process::Pid::from_raw(self.pid()) {
            let _ = rustix::process::kill_process(pid, sig);
        }
    }

    /// How the pool ended if it is no longer running (without waiting).
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// A new pool process at the same socket (the old one has exited and been reaped).
    fn respawn(&mut self) -> Result<(), String> {
        self.child = Self::spawn(&self.cmd, &self.socket, &self.log)?;
        self.starts += 1;
        self.wait_listening()
    }

    /// The injected restart: SIGKILL and a new process. Returns how the old one ended if
    /// that was not this SIGKILL (it had exited or crashed on its own before).
    fn restart(&mut self) -> Result<Option<std::process::ExitStatus>, String> {
        let st = self.kill();
        self.respawn()?;
        Ok(st.filter(|st| !killed_by_us(st)))
    }

    fn kill(&mut self) -> Option<std::process::ExitStatus> {
        let _ = self.child.kill();
        self.child.wait().ok()
    }

    /// The clean stop at the end: SIGTERM, then the exit status, which must be success: a
    /// sanitizer's or valgrind's error exit code (`--error-exitcode`, ASAN/LSAN `exitcode`)
    /// shows here. SIGKILL after `grace`.
    fn stop(&mut self, grace: Duration) -> Result<std::process::ExitStatus, String> {
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

    /// Open fds by kind (`socket`, `/memfd:umbp-rings-N`, `anon_inode:[eventfd]`...).
    fn fd_kinds(&self) -> std::collections::BTreeMap<String, i64> {
        let mut m = std::collections::BTreeMap::new();
        for e in std::fs::read_dir(format!("/proc/{}/fd", self.pid())).into_iter().flatten().flatten() {
            let t = std::fs::read_link(e.path()).map(|t| t.display().to_string()).unwrap_or_default();
            let kind: String = t.split(" (deleted)").next().unwrap_or("").chars().map(|c| if c.is_ascii_digit() { 'N' } else { c }).collect();
            *m.entry(kind).or_insert(0) += 1;
        }
        m
    }

    fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid())).map(|d| d.count()).unwrap_or(0)
    }

    /// The pool's JSON state report, through an observer attachment.
    fn report(&self) -> Result<Value, String> {
        use umbp_ipc::message::{recv_message, send_message};
        use umbp_protocol::wire::{self, Hello, HelloReply, MessageKind, Reply, Role};
        let t = Some(Duration::from_secs(5));
        let sock = UnixStream::connect(&self.socket).map_err(|e| format!("report: {e}"))?;
        let hello = Hello::new(Role::Observer, 0, std::process::id());
        send_message(&sock, MessageKind::Hello, bytemuck::bytes_of(&hello), &[], t).map_err(|e| e.to_string())?;
        let m = recv_message(&sock, t).map_err(|e| e.to_string())?;
        let r: HelloReply = wire::decode(&m.payload).map_err(|e| e.to_string())?;
        if r.status != 0 {
            return Err(r.message());
        }
        send_message(&sock, MessageKind::StatsRequest, &[], &[], t).map_err(|e| e.to_string())?;
        let m = recv_message(&sock, t).map_err(|e| e.to_string())?;
        let _: Reply = wire::decode(&m.payload).map_err(|e| e.to_string())?;
        serde_json::from_slice(&m.payload[std::mem::size_of::<Reply>()..]).map_err(|e| e.to_string())
    }
}

impl Drop for PoolProc {
    /// A clean stop (SIGTERM) so that a tool wrapping the pool (valgrind) can report; SIGKILL
    /// after 30 s. (A finished run has stopped it already and checked its exit status.)
    fn drop(&mut self) {
        let _ = self.stop(Duration::from_secs(30));
    }
}

use rustix::process::Signal;

const SIGSTOP: Signal = Signal::STOP;
const SIGCONT: Signal = Signal::CONT;

fn worker_attachments(r: &Value) -> usize {
    r["attachments"].as_array().map_or(0, |a| a.iter().filter(|a| a["role"] == "worker").count())
}

fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The pool's fd count once it stays the same for 200 ms and satisfies `ok` (its last
/// observer attachment, background GPU probing and the like have settled); gives up after
/// 10 s and returns the last count.
fn settled_fds(pool: &PoolProc, ok: impl Fn(usize) -> bool) -> usize {
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
fn kind_diff(a: &std::collections::BTreeMap<String, i64>, b: &std::collections::BTreeMap<String, i64>) -> Vec<String> {
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    keys.into_iter()
        .filter_map(|k| {
            let d = a.get(k).unwrap_or(&0) - b.get(k).unwrap_or(&0);
            (d != 0).then(|| format!("{k}: {d:+}"))
        })
        .collect()
}

struct Soak {
    cli: SoakCli,
    pool: PoolProc,
    workers: Vec<WorkerProc>,
    next_id: u64,
    banked: Totals,
    base_fds: usize,
    fds_per_worker: usize,
    base_kinds: std::collections::BTreeMap<String, i64>,
    worker_kinds: std::collections::BTreeMap<String, i64>,
    leaked_bytes: u64,
    leaked_fds: i64,
    leak_checks: u64,
    /// Pool processes that ended other than by the soak's own SIGKILL (an injected
    /// restart) or, at the end, by its SIGTERM with exit status 0.
    pool_crashes: u64,
    failures: Vec<String>,
}

impl Soak {
    /// Records a pool process that ended on its own.
    fn pool_crashed(&mut self, when: &str, st: &std::process::ExitStatus) {
        self.pool_crashes += 1;
        let msg = format!("{when}: umbp-pool crashed or exited on its own ({}); its log ends: {}", describe(st), log_tail(&self.pool.log, 5));
        eprintln!("soak: {msg}");
        self.failures.push(msg);
    }

    /// Fails the run if the pool ended on its own since the last look, and starts a new
    /// one so that the rest of the run still measures. Called before every injected fault,
    /// around every leak check and at the end, so a crash is never taken for a fault.
    fn check_pool(&mut self, when: &str) -> Result<(), String> {
        if let Some(st) = self.pool.exited() {
            self.pool_crashed(when, &st);
            self.pool.respawn()?;
        }
        Ok(())
    }

    fn spawn_worker(&mut self) -> Result<(), String> {
        let id = self.next_id;
        self.next_id += 1;
        let w = WorkerProc::spawn(&self.pool.socket, id, self.cli.seed, self.cli.timeout_ms, &self.cli.memory)?;
        self.workers.push(w);
        Ok(())
    }

    fn totals(&self) -> Totals {
        let mut t = self.banked;
        for w in &self.workers {
            t.add(&w.last());
        }
        t
    }

    /// Pauses every worker (each finishes what it has in flight) and waits until all say so.
    fn pause_all(&mut self) -> Result<(), String> {
        let before: Vec<u64> = self.workers.iter().map(|w| w.state.lock().unwrap().paused).collect();
        for w in &mut self.workers {
            w.send("pause");
        }
        let ok = eventually(Duration::from_secs(30), || {
            self.workers.iter().zip(&before).all(|(w, b)| w.state.lock().unwrap().paused > *b)
        });
        if ok { Ok(()) } else { Err("a worker did not drain its transfers within 30 s of pause".into()) }
    }

    fn resume_all(&mut self) {
        for w in &mut self.workers {
            w.send("resume");
        }
    }

    /// With every worker paused: the pool holds only published, unpinned objects, all its
    /// allocated bytes belong to them, and it has its baseline fds plus the live workers'.
    fn leak_check(&mut self, when: &str) -> Result<(), String> {
        self.check_pool(when)?;
        self.pause_all()?;
        let live = self.workers.len();
        let mut last = Value::Null;
        let settled = eventually(Duration::from_secs(20), || {
            let Ok(r) = self.pool.report() else { return false };
            let ok = worker_attachments(&r) == live
                && r["pool"]["objects"] == r["pool"]["published_objects"]
                && r["pool"]["pinned_objects"] == 0;
            last = r;
            ok
        });
        if !settled {
            self.failures.push(format!("{when}: pool did not settle: {} worker attachments of {live}, pool {}", worker_attachments(&last), last["pool"]));
            // A pool that died meanwhile explains it (and must be counted as a crash).
            self.check_pool(when)?;
        }
        let allocated = last["pool"]["allocated_bytes"].as_u64().unwrap_or(0);
        let published = last["pool"]["published_objects"].as_u64().unwrap_or(0);
        let leaked = allocated.saturating_sub(published * OBJECT_BYTES);
        self.leaked_bytes = self.leaked_bytes.max(leaked);
        if leaked > 0 {
            self.failures.push(format!("{when}: {leaked} bytes allocated beyond published objects: {}", last["pool"]));
        }
        let want = self.base_fds + live * self.fds_per_worker;
        let mut fds = 0;
        eventually(Duration::from_secs(10), || {
            fds = self.pool.fds();
            fds == want
        });
        if fds != want {
            self.leaked_fds = self.leaked_fds.max(fds as i64 - want as i64);
            let mut expect = self.base_kinds.clone();
            for (k, v) in &self.worker_kinds {
                *expect.entry(k.clone()).or_insert(0) += v * live as i64;
            }
            self.failures.push(format!(
                "{when}: pool has {fds} fds, expected {want} ({} + {live} x {}); by kind vs expected: {}",
                self.base_fds,
                self.fds_per_worker,
                kind_diff(&self.pool.fd_kinds(), &expect).join(", ")
            ));
        }
        self.leak_checks += 1;
        self.resume_all();
        Ok(())
    }
}

impl SoakCli {
    pub fn run(self) -> Result<(), String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let (bin, pre_args) = match (self.inject_corruption, &self.pool_bin) {
            (Some(_), Some(_)) => return Err("--inject-corruption runs its own test pool (this binary): it cannot be combined with --pool-bin".into()),
            (Some(_), None) if !self.pool_args.trim().is_empty() => {
                return Err("--inject-corruption runs its own test pool, which takes no --pool-args".into())
            }
            (Some(n), None) => (exe.clone(), vec!["__soak-pool".to_string(), "--inject-corruption".into(), n.to_string()]),
            (None, Some(b)) => (b.clone(), Vec::new()),
            (None, None) => (exe.with_file_name("umbp-pool"), Vec::new()),
        };
        if !bin.exists() {
            return Err(format!("{} not found: build it (cargo build --bins) or pass --pool-bin", bin.display()));
        }
        let dir = std::env::temp_dir().join(format!("umbp-soak-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let socket = dir.join("pool.sock");
        let log = dir.join("pool.log");
        let mut args: Vec<String> = vec!["--capacity".into(), self.capacity.clone(), "--min-object-size".into(), "64KiB".into()];
        args.extend(self.pool_args.split_whitespace().map(String::from));
        let pool = PoolProc::start(&PoolCmd { bin, pre_args, args }, &socket, &log)?;
        let base_fds = settled_fds(&pool, |_| true);
        let base_kinds = pool.fd_kinds();
        let mut s = Soak {
            cli: self.clone(),
            pool,
            workers: Vec::new(),
            next_id: 0,
            banked: Totals::default(),
            base_fds,
            fds_per_worker: 0,
            base_kinds,
            worker_kinds: Default::default(),
            leaked_bytes: 0,
            leaked_fds: 0,
            leak_checks: 0,
            pool_crashes: 0,
            failures: Vec::new(),
        };
        for _ in 0..self.workers.max(1) {
            s.spawn_worker()?;
        }
        let n = s.workers.len();
        // Per-attachment fds, measured with everyone attached and idle.
        s.pause_all()?;
        let attached = eventually(Duration::from_secs(20), || s.pool.report().is_ok_and(|r| worker_attachments(&r) == n));
        if !attached {
            return Err("workers did not attach".into());
        }
        let with = settled_fds(&s.pool, |f| f > base_fds && (f - base_fds) % n == 0);
        if with < base_fds || (with - base_fds) % n != 0 {
            return Err(format!("cannot measure fds per attachment: {base_fds} idle, {with} with {n} workers"));
        }
        s.fds_per_worker = (with - base_fds) / n;
        let with_kinds = s.pool.fd_kinds();
        for (k, v) in &with_kinds {
            let d = v - s.base_kinds.get(k).unwrap_or(&0);
            if d != 0 {
                s.worker_kinds.insert(k.clone(), d / n as i64);
            }
        }
        s.resume_all();

        // Fault-free warm-up: the baseline rate.
        let warmup = Duration::from_secs((self.seconds / 6).clamp(2, 5));
        let t0 = s.totals();
        std::thread::sleep(warmup);
        let t1 = s.totals();
        let base_rate = (t1.transfers - t0.transfers) / warmup.as_secs_f64();
        eprintln!("soak: warm-up done ({base_rate:.0} transfers/s without faults); chaos phase for {} s", self.seconds);

        let bar = if self.json { indicatif::ProgressBar::hidden() } else { indicatif::ProgressBar::new(self.seconds) };
        bar.set_style(
            indicatif::ProgressStyle::with_template("soak [{bar:30}] {pos}/{len} s {msg}").unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        let mut rng = splitmix(self.seed ^ 0x50a4);
        let mut rand = move |n: u64| {
            rng = splitmix(rng);
            rng % n.max(1)
        };
        let (mut kills, mut stops, mut restarts) = (0u64, 0u64, 0u64);
        let start = Instant::now();
        let deadline = start + Duration::from_secs(self.seconds);
        while Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(200 + rand(1000)));
            // A pool that died on its own since the last fault is a crash, not a fault.
            s.check_pool(&format!("chaos phase, {:.1} s in", start.elapsed().as_secs_f64()))?;
            if Instant::now() >= deadline {
                break;
            }
            match rand(9) {
                0..=3 => {
                    let i = rand(s.workers.len() as u64) as usize;
                    let mut w = s.workers.swap_remove(i);
                    let last = w.kill();
                    s.banked.add(&last);
                    kills += 1;
                    s.leak_check(&format!("after worker kill {kills}"))?;
                    s.spawn_worker()?;
                }
                4..=6 => {
                    s.pool.signal(SIGSTOP);
                    std::thread::sleep(Duration::from_millis(100 + rand(2 * self.timeout_ms)));
                    s.pool.signal(SIGCONT);
                    stops += 1;
                }
                _ => {
                    std::thread::sleep(Duration::from_millis(rand(300)));
                    match s.pool.restart()? {
                        // It had ended on its own before our SIGKILL: a crash, not a fault.
                        Some(st) => s.pool_crashed(&format!("chaos phase, {:.1} s in (before a restart)", start.elapsed().as_secs_f64()), &st),
                        None => restarts += 1,
                    }
                }
            }
            bar.set_position(start.elapsed().as_secs().min(self.seconds));
            bar.set_message(format!("{kills} worker kills, {stops} pool stops, {restarts} pool restarts"));
        }
        bar.finish_and_clear();
        s.check_pool("after the chaos phase")?;

        // All workers must come back (the last fault may have been a pool restart).
        let reattached = eventually(Duration::from_secs(30), || {
            s.pool.report().is_ok_and(|r| worker_attachments(&r) == n)
                && s.workers.iter().all(|w| w.last()["connected"] == true)
        });
        if !reattached {
            s.failures.push("not every worker re-attached within 30 s of the last fault".into());
        }
        s.leak_check("at the end")?;
        s.pause_all()?;
        let mut total = s.banked;
        for w in &mut s.workers {
            w.send("quit");
        }
        for w in &mut s.workers {
            total.add(&w.reap());
        }
        // The clean stop: exit status 0, or the run fails (a sanitizer's or valgrind's
        // error exit code comes back here, as does a crash during shutdown).
        let final_exit = match s.pool.stop(Duration::from_secs(120)) {
            Ok(st) if st.success() => describe(&st),
            Ok(st) => {
                s.pool_crashed("at the clean stop (SIGTERM)", &st);
                describe(&st)
            }
            Err(e) => {
                s.pool_crashes += 1;
                s.failures.push(e.clone());
                e
            }
        };
        let injected_flips = std::fs::read_to_string(&log).map_or(0, |t| t.matches("TEST FAULT: flipped a byte").count() as u64);

        let chaos_s = start.elapsed().as_secs_f64();
        let ops = total.transfers - t1.transfers;
        let faults = kills + stops + restarts;
        if total.corrupt_bytes > 0.0 {
            s.failures.push(format!("{} corrupted bytes were returned as Loaded", total.corrupt_bytes));
        }
        if total.max_blocked_ms > self.timeout_ms as f64 {
            s.failures.push(format!("a worker call blocked {} ms past what it allowed (bound {} ms)", total.max_blocked_ms, self.timeout_ms));
        }
        let pass = s.failures.is_empty();
        // Kept for reading when the run failed, unless it was meant to (negative control).
        if pass || self.inject_corruption.is_some() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        let ctx = |c: Case| c.extra("seconds", self.seconds).extra("workers", n as u64).extra("pass", pass);
        let cases = vec![
            ctx(Case::new("soak", "operations", ops, "transfers", base_rate * chaos_s, "fault-free rate x duration (warm-up phase)", Better::Higher))
                .extra("blocks", (total.blocks) as u64)
                .extra("ops_per_s", (ops / chaos_s).round()),
            ctx(Case::new("soak", "faults_injected", faults as f64, "faults", 0.0, "faults in the warm-up phase", Better::Higher))
                .extra("worker_kills", kills)
                .extra("pool_stops", stops)
                .extra("pool_restarts", restarts),
            ctx(Case::new("soak", "corrupted_bytes", total.corrupt_bytes, "bytes", 0.0, "allowed", Better::Lower))
                .extra("verified_blocks", total.loaded as u64)
                .extra("verified_bytes", total.loaded as u64 * OBJECT_BYTES)
                .extra("cancelled_transfers", total.cancelled as u64)
                .extra("inject_corruption", self.inject_corruption.unwrap_or(0))
                .extra("injected_flips", injected_flips),
            ctx(Case::new("soak", "pool_crashes", s.pool_crashes as f64, "crashes", 0.0, "allowed", Better::Lower))
                .extra("pool_processes", s.pool.starts)
                .extra("final_exit", final_exit),
            ctx(Case::new("soak", "leaked_bytes", s.leaked_bytes as f64, "bytes", 0.0, "allowed", Better::Lower))
                .extra("leak_checks", s.leak_checks)
                .extra("leaked_fds", s.leaked_fds)
                .extra("fds_per_worker", s.fds_per_worker as u64),
            ctx(Case::new("soak", "max_blocked_ms", total.max_blocked_ms, "ms", self.timeout_ms as f64, "engine timeout_ms (the bound)", Better::Lower))
                .extra("all_reattached", reattached)
                .extra("call", total.max_blocked_call.unwrap_or("")),
        ];
        super::report::print(&cases, self.json);
        if pass {
            Ok(())
        } else {
            Err(format!("soak failed: {} (pool log: {})", s.failures.join("; "), log.display()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `wait(t)` may take `t` + timeout, not `t` + 2 x timeout: a 20 ms wait that took
    /// 1.5 timeouts more blocked 1.5 timeouts (before: the allowance was `t` + timeout, so it
    /// counted as 0.5 and a run with a 1 s timeout passed a wait that returned 1.52 s late).
    #[test]
    fn wait_bound_is_t_plus_timeout() {
        let (t, timeout) = (Duration::from_millis(20), Duration::from_millis(1000));
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        assert!((blocked_ms(t, t + timeout * 3 / 2) - ms(timeout * 3 / 2)).abs() < 1e-6);
        assert!(blocked_ms(t, t + timeout * 3 / 2) > ms(timeout), "fails the run");
        assert!(blocked_ms(t, t + timeout / 2) < ms(timeout), "within the bound");
        assert_eq!(blocked_ms(t, t / 2), 0.0);
        assert_eq!(blocked_ms(Duration::ZERO, timeout), ms(timeout));
    }
}
