//! The worker process of `soak` (hidden `__soak-worker`): stores and loads checksummed
//! blocks at random until told to stop; [`SoakCommand`]s arrive on stdin, JSON reports go
//! to stdout.
//!
//! Its KV memory is written by the pool (loads) while this process runs: it is never
//! handed out as `&[u8]`/`&mut [u8]`; [`KvMemory`] reads and writes it through raw
//! pointers (volatile word reads for what the pool wrote).

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::json;
use umbp_worker::{BlockStatus, MemorySpec, ObjectKey, Segment, TransferId, Worker, WorkerConfig, WorkerError};

use super::{key_of, pattern, splitmix, BLOCKS, DEPTH, KEYS, LAYERS, NS, OBJECT_BYTES, PAGE};

/// A command of the soak parent to a worker, one JSON object per line (`{"cmd":"pause"}`);
/// anything else is an error that ends the worker (the parent counts it as a failure).
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(tag = "cmd", rename_all = "snake_case", deny_unknown_fields)]
pub enum SoakCommand {
    /// Finish what is in flight, report `paused`, submit nothing.
    Pause,
    Resume,
    /// Report `final` and exit.
    Quit,
}

impl SoakCommand {
    pub fn to_line(self) -> String {
        serde_json::to_string(&self).expect("commands serialize")
    }
}

/// Internal: a worker process of `soak`.
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
    /// `Worker::disconnect` on a live pool (issue #31): stores and unstarted loads fail and
    /// their blocks are reused at once; started loads complete when the pool answers.
    disconnects: u64,
    /// Cancels answered `Started` (a load the pool writes): the worker waits on it in
    /// bounded slices until it completes or the pool dies (issue #31 item 4).
    started_waits: u64,
}

/// A worker's KV memory: a heap buffer (registered as `HostProcess`) or a mapped memfd
/// (`HostMemfd`). The pool writes it (loads) and reads it (stores) concurrently with this
/// process, so no Rust reference to its bytes is ever made: every access goes through
/// [`Self::base`] with raw-pointer copies and volatile word reads, inside the bounds
/// checked by each method.
struct KvMemory {
    /// Keeps the heap allocation alive (8-byte aligned: words are read in place); never
    /// borrowed as a slice after [`Self::base`] was taken.
    _heap: Vec<u64>,
    shm: Option<umbp_ipc::SharedMemory>,
    base: *mut u8,
    len: usize,
}

impl KvMemory {
    fn heap(len: usize) -> Self {
        let mut heap = vec![0u64; len.div_ceil(8)];
        let base = heap.as_mut_ptr().cast::<u8>();
        KvMemory { _heap: heap, shm: None, base, len }
    }

    fn memfd(shm: umbp_ipc::SharedMemory) -> Self {
        let (base, len) = (shm.as_ptr(), shm.len());
        KvMemory { _heap: Vec::new(), shm: Some(shm), base, len }
    }

    /// Start of the memory (for registration with the pool).
    fn base(&self) -> *mut u8 {
        self.base
    }

    fn check(&self, off: usize, len: usize) {
        assert!(
            off.is_multiple_of(8) && off.checked_add(len).is_some_and(|e| e <= self.len),
            "KV access {off}+{len} outside {} bytes",
            self.len
        );
    }

    /// Copies `src` to `off..`. Only for blocks with no transfer in flight (the pool reads
    /// or writes a block only while a transfer of it is pending).
    fn write(&mut self, off: usize, src: &[u8]) {
        self.check(off, src.len());
        // SAFETY: `off..off + src.len()` lies inside the live allocation or mapping
        // (checked above); `src` is our own buffer and cannot overlap it; no reference to
        // this memory exists (raw-pointer access only), so a concurrent pool access to
        // another block cannot alias a Rust reference.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.base.add(off), src.len()) };
    }

    /// Fills `off..off + len` with `byte` (poisoning a load's destination before it runs).
    fn fill(&mut self, off: usize, len: usize, byte: u8) {
        self.check(off, len);
        // SAFETY: inside the allocation or mapping (checked above); raw-pointer write, no
        // reference made; the block has no transfer in flight.
        unsafe { std::ptr::write_bytes(self.base.add(off), byte, len) };
    }

    /// Bytes of `off..off + want.len()` that differ from `want`, read word by word with
    /// volatile loads: the pool wrote this memory from another process, and a buggy pool
    /// might still be writing it; what is read is compared, never referenced.
    fn count_diff(&self, off: usize, want: &[u8]) -> u64 {
        self.check(off, want.len());
        let mut bad = 0u64;
        for (i, w) in want.chunks(8).enumerate() {
            // SAFETY: `off` is a multiple of 8 and the base is 8-byte aligned (a `Vec<u64>`
            // or a page-aligned mapping), so this word is aligned and inside the checked
            // range (`want.len()` is a multiple of 8 here: pages are); volatile: the value
            // may have been written by another process behind the compiler's back.
            let got = unsafe { std::ptr::read_volatile(self.base.add(off + i * 8).cast::<u64>()) }.to_le_bytes();
            bad += got.iter().zip(w).filter(|(x, y)| x != y).count() as u64;
        }
        bad
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
    /// When the next `disconnect` on a live pool comes.
    next_disconnect: Instant,
}

/// How long a call that was allowed to wait `wait` blocked beyond it, in ms. The run fails
/// when this passes the engine timeout: `wait(t)` is bounded by `t + timeout`, the other
/// calls by `timeout` (docs/reliability.md).
pub(super) fn blocked_ms(wait: Duration, took: Duration) -> f64 {
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
        if over > self.timeout.as_secs_f64() * 1e3 {
            // Named with the time, so the pool's and this worker's logs show what held it.
            tracing::warn!(worker = self.id, call, blocked_ms = over, "soak worker call blocked past the engine timeout");
        }
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
                        bad += self.mem.count_diff(off, &self.obj[l * PAGE as usize..(l + 1) * PAGE as usize]);
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
                    self.mem.write(off, &self.obj[l * PAGE as usize..(l + 1) * PAGE as usize]);
                }
            } else {
                for off in page_offsets(b) {
                    self.mem.fill(off, PAGE as usize, 0xEE);
                }
            }
        }
        let blocks: Vec<(ObjectKey, u64)> = batch.iter().map(|&(_, k, b)| (k, b)).collect();
        let r =
            self.timed(
                if store { "store" } else { "load" },
                Duration::ZERO,
                |w| if store { w.store(0, &blocks) } else { w.load(0, &blocks) },
            );
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
        // Every few seconds: drop the attachment of a live pool, as an engine reset or a
        // false loss would (a pool that published a store after that, or wrote a load's
        // blocks after they failed, shows up as corrupted bytes).
        if !self.pending.is_empty() && Instant::now() >= self.next_disconnect {
            self.timed("disconnect", Duration::ZERO, |w| w.disconnect());
            self.t.disconnects += 1;
            self.next_disconnect = Instant::now() + Duration::from_millis(2_000 + self.next() % 2_000);
        }
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
                umbp_worker::CancelOutcome::Started => {
                    self.pending[pos].1.cancel_refused = true;
                    self.t.started_waits += 1;
                }
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
            "busy": t.busy, "stalled": t.stalled, "disconnected": t.disconnected, "cancelled": t.cancelled, "disconnects": t.disconnects, "started_waits": t.started_waits,
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
        // The worker library's own logs (a lost pool, a reconnect) with the soak's RUST_LOG.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
            .with_writer(std::io::stderr)
            .try_init();
        let commands = Arc::new(Mutex::new(Vec::<Result<SoakCommand, String>>::new()));
        let c2 = commands.clone();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                let cmd = serde_json::from_str(&line).map_err(|e| format!("bad command {line:?}: {e}"));
                c2.lock().unwrap().push(cmd);
            }
            c2.lock().unwrap().push(Ok(SoakCommand::Quit));
        });
        let bytes = (LAYERS * BLOCKS * PAGE) as usize;
        let mem = if self.memory == "memfd" {
            KvMemory::memfd(umbp_ipc::SharedMemory::create("umbp-soak-kv", bytes, false).map_err(|e| e.to_string())?)
        } else {
            KvMemory::heap(bytes)
        };
        let mut cfg = WorkerConfig::new(&self.socket, NS);
        cfg.timeout = Duration::from_millis(self.timeout_ms);
        cfg.startup_timeout = Duration::from_secs(60);
        let mut w = Worker::connect(cfg).map_err(|e| e.to_string())?;
        let spec = match &mem.shm {
            Some(s) => MemorySpec::HostMemfd { fd: s.fd().try_clone_to_owned().map_err(|e| e.to_string())?, offset: 0, len: bytes as u64 },
            None => MemorySpec::HostProcess { ptr: mem.base() as usize, len: bytes },
        };
        // SAFETY: `mem` moves into the SoakWorker with `w` (declared after it: dropped
        // after it) and outlives the attachment.
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
            next_disconnect: Instant::now() + Duration::from_secs(2),
        };
        start_signal_storms();
        sw.report("ready");
        let mut paused = false;
        let mut paused_reported = false;
        let mut last_report = Instant::now();
        loop {
            for cmd in std::mem::take(&mut *commands.lock().unwrap()) {
                match cmd {
                    Ok(SoakCommand::Pause) => {
                        paused = true;
                        paused_reported = false;
                    }
                    Ok(SoakCommand::Resume) => paused = false,
                    Ok(SoakCommand::Quit) => {
                        sw.report("final");
                        return Ok(());
                    }
                    Err(e) => {
                        sw.report("final");
                        return Err(e);
                    }
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

extern "C" fn on_sigusr2(_: libc::c_int) {}

/// SIGUSR2 storms at this (the polling) thread: a handler installed without SA_RESTART, as
/// CPython installs its own, and bursts of a few thousand signals every half second, so
/// every `poll`/`recv`/`read` of the worker sees EINTR (issue #31: a signal made the
/// worker drop a live pool).
fn start_signal_storms() {
    // SAFETY: a handler that does nothing, for SIGUSR2, which nothing else here uses.
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = on_sigusr2 as *const () as usize;
        libc::sigemptyset(&mut act.sa_mask);
        act.sa_flags = 0;
        libc::sigaction(libc::SIGUSR2, &act, std::ptr::null_mut());
    }
    // SAFETY: no preconditions.
    let target = unsafe { libc::pthread_self() };
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(500));
        for _ in 0..2000 {
            // SAFETY: the target is the process's main thread, which lives as long as the
            // process (its return ends the process and this thread with it).
            unsafe { libc::pthread_kill(target, libc::SIGUSR2) };
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn soak_commands_are_typed() {
        for c in [SoakCommand::Pause, SoakCommand::Resume, SoakCommand::Quit] {
            assert_eq!(serde_json::from_str::<SoakCommand>(&c.to_line()).expect("parses"), c);
        }
        // Before: any other line was ignored silently ("puase" did nothing).
        let e = serde_json::from_str::<SoakCommand>(r#"{"cmd":"puase"}"#).unwrap_err().to_string();
        assert!(e.contains("puase"), "{e}");
        assert!(serde_json::from_str::<SoakCommand>("pause").is_err(), "the old bare-word form is refused");
    }

    #[test]
    fn kv_memory_is_accessed_through_raw_pointers_in_bounds() {
        for mut m in [KvMemory::heap(4 * 4096), KvMemory::memfd(umbp_ipc::SharedMemory::create("kv-test", 4 * 4096, false).expect("memfd"))]
        {
            let want: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
            m.write(4096, &want);
            assert_eq!(m.count_diff(4096, &want), 0);
            m.fill(4096, 16, 0xEE);
            assert_eq!(m.count_diff(4096, &want), 16 - want[..16].iter().filter(|&&b| b == 0xEE).count() as u64);
            assert_eq!(m.base() as usize % 8, 0, "words are read in place");
        }
        let r = std::panic::catch_unwind(|| {
            let mut m = KvMemory::heap(4096);
            m.write(4096 - 8, &[0u8; 16]);
        });
        assert!(r.is_err(), "a write past the end is refused");
    }
}
