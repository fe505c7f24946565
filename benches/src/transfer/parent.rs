//! The parent side of `transfer`: the pool the workers attach to (in this process or a
//! running `umbp-pool`) and the worker child processes, driven by [`Command`]s.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use umbp_pool::{Pool, PoolConfig};

use super::command::{Command, Op, Xfer};
use super::{u64_of, BackendArg, TransferArgs, MIB};

/// A worker child process driven by JSON lines.
pub(crate) struct WorkerProc {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    name: String,
}

impl WorkerProc {
    pub(crate) fn spawn(name: &str, socket: &Path, backend: BackendArg, namespace: u128) -> Result<Self, String> {
        Self::spawn_with_env(name, socket, backend, namespace, &[])
    }

    /// As [`Self::spawn`], with extra environment (e.g. `CUDA_VISIBLE_DEVICES` to put the
    /// worker on one GPU).
    pub(crate) fn spawn_with_env(
        name: &str,
        socket: &Path,
        backend: BackendArg,
        namespace: u128,
        env: &[(&str, String)],
    ) -> Result<Self, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = std::process::Command::new(exe)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .arg("__transfer-worker")
            .arg("--socket")
            .arg(socket)
            .arg("--backend")
            .arg(match backend {
                BackendArg::Host => "host",
                BackendArg::Cuda => "cuda",
            })
            .arg("--namespace")
            .arg(namespace.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("spawning worker {name}: {e}"))?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = BufReader::new(child.stdout.take().expect("piped"));
        let mut w = WorkerProc { child, stdin, stdout, name: name.into() };
        let hello = w.recv()?;
        if hello.get("ready").is_none() {
            return Err(format!("worker {name}: {hello}"));
        }
        Ok(w)
    }

    pub(crate) fn send(&mut self, cmd: &Command) -> Result<(), String> {
        writeln!(self.stdin, "{}", cmd.to_line()).and_then(|()| self.stdin.flush()).map_err(|e| format!("worker {}: {e}", self.name))
    }

    pub(crate) fn recv(&mut self) -> Result<Value, String> {
        let mut line = String::new();
        let n = self.stdout.read_line(&mut line).map_err(|e| format!("worker {}: {e}", self.name))?;
        if n == 0 {
            return Err(format!("worker {} exited", self.name));
        }
        let v: Value = serde_json::from_str(&line).map_err(|e| format!("worker {}: bad reply {line:?}: {e}", self.name))?;
        if let Some(e) = v.get("error") {
            return Err(format!("worker {}: {}", self.name, e.as_str().unwrap_or("?")));
        }
        Ok(v)
    }

    pub(crate) fn call(&mut self, cmd: &Command) -> Result<Value, String> {
        self.send(cmd)?;
        self.recv()
    }

    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for WorkerProc {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "{}", Command::Exit.to_line());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.kill();
    }
}

/// The pool the workers attach to.
pub(crate) struct PoolHandle {
    pub(crate) pool: Option<Pool>,
    pub(crate) socket: PathBuf,
    /// The in-process pool's config (a pool's config is fixed for its life: a case that
    /// tunes it restarts the pool, [`Self::restart_with`]).
    config: Option<PoolConfig>,
    _dir: Option<tempfile::TempDir>,
}

impl PoolHandle {
    /// Restarts the in-process pool, on the same socket, with its copy tuning set to
    /// `tuning` when that differs from the running pool's. Returns whether it restarted:
    /// then every worker attached to the old pool must be spawned again. An external pool
    /// (`--pool-socket`) keeps its own tuning (false).
    pub(crate) fn restart_with(&mut self, args: &TransferArgs, tuning: CopyTuning) -> Result<bool, String> {
        let Some(config) = &self.config else { return Ok(false) };
        if CopyTuning::of(config) == tuning {
            return Ok(false);
        }
        let mut config = config.clone();
        tuning.apply(&mut config);
        // The old pool goes first: the new one binds the same socket path.
        if let Some(old) = self.pool.take() {
            old.shutdown();
        }
        self.pool = Some(start_registered(args, config.clone())?);
        self.config = Some(config);
        Ok(true)
    }

    /// The in-process pool's per-phase time counters and its service thread's wake-ups
    /// (none for an external pool).
    pub(crate) fn phases(&self) -> Option<Value> {
        self.pool.as_ref().map(|p| {
            let c = p.report().counters;
            let mut v = serde_json::to_value(c.phases).expect("json");
            v["service_wakeups"] = c.service_wakeups.into();
            v
        })
    }
}

/// Mean microseconds per job of each pool phase between two [`PoolHandle::phases`]
/// snapshots, per direction: where a submission's time went inside the pool; and the
/// share of jobs that found the pool asleep (`service_wakeups_per_job`, both directions).
pub(crate) fn phase_means(before: &Option<Value>, after: &Option<Value>) -> Value {
    let (Some(b), Some(a)) = (before, after) else { return Value::Null };
    let mut out = serde_json::Map::new();
    let all_jobs: u64 = ["store", "load"].iter().map(|op| u64_of(&a[op], "jobs").saturating_sub(u64_of(&b[op], "jobs"))).sum();
    if all_jobs > 0 {
        let wakeups = u64_of(a, "service_wakeups").saturating_sub(u64_of(b, "service_wakeups"));
        out.insert("service_wakeups_per_job".into(), json!((wakeups as f64 / all_jobs as f64 * 100.0).round() / 100.0));
    }
    for op in ["store", "load"] {
        let d = |k: &str| u64_of(&a[op], k).saturating_sub(u64_of(&b[op], k));
        let jobs = d("jobs");
        if jobs == 0 {
            continue;
        }
        let mut m = serde_json::Map::new();
        m.insert("jobs".into(), jobs.into());
        m.insert("stages_per_job".into(), json!(d("stages") as f64 / jobs as f64));
        for phase in ["admit", "queue", "reserve", "plan", "copy", "publish", "finish", "first_stage"] {
            let us = d(&format!("{phase}_ns")) as f64 / jobs as f64 / 1e3;
            m.insert(format!("{phase}_us"), json!((us * 10.0).round() / 10.0));
        }
        out.insert(op.into(), Value::Object(m));
    }
    Value::Object(out)
}

pub(crate) fn start_pool(args: &TransferArgs) -> Result<PoolHandle, String> {
    if let Some(s) = &args.pool_socket {
        return Ok(PoolHandle { pool: None, socket: s.clone(), config: None, _dir: None });
    }
    let dir = tempfile::Builder::new()
        .prefix("umbp-bench-transfer-")
        .tempdir()
        .map_err(|e| format!("a temporary directory for the pool's socket: {e}"))?;
    let socket = dir.path().join("pool.sock");
    let config = PoolConfig {
        socket_path: socket.clone(),
        capacity_bytes: args.capacity,
        prefault: true,
        hugepages: args.hugepages,
        // pool_overhead's objects: 24 pages of 64 B (layouts below this are refused).
        min_object_bytes: 24 * 64,
        copy_threads: args.copy_threads,
        // Several values: the small-page layouts set each in turn, the rest use the first.
        copy_stage_growth_percent: args.first_stage_growth(),
        idle_poll: args.idle_poll,
        engine: args.engine,
        ssd: args.ssd_dir.as_ref().map(|d| umbp_ssd::SsdConfig {
            dirs: vec![d.clone()],
            capacity_bytes: args.capacity.saturating_mul(4),
            admission: umbp_ssd::SsdAdmission::All,
            ..Default::default()
        }),
        ..PoolConfig::default()
    };
    let pool = start_registered(args, config.clone())?;
    Ok(PoolHandle { pool: Some(pool), socket, config: Some(config), _dir: Some(dir) })
}

/// The pool's copy settings that the cuda cases tune (`--sweep`, `--stage-growth`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct CopyTuning {
    pub(crate) engine: umbp_gpu::EngineConfig,
    pub(crate) stage_bytes: u64,
    pub(crate) growth_percent: u32,
}

impl CopyTuning {
    pub(crate) fn of(config: &PoolConfig) -> Self {
        CopyTuning { engine: config.engine, stage_bytes: config.copy_stage_bytes, growth_percent: config.copy_stage_growth_percent }
    }

    fn apply(self, config: &mut PoolConfig) {
        config.engine = self.engine;
        config.copy_stage_bytes = self.stage_bytes;
        config.copy_stage_growth_percent = self.growth_percent;
    }
}

/// Starts an in-process pool and waits until its DRAM is registered with the GPU driver.
fn start_registered(args: &TransferArgs, config: PoolConfig) -> Result<Pool, String> {
    let started = Instant::now();
    let pool = Pool::start(config).map_err(|e| format!("starting the pool: {e}"))?;
    // Measure on pinned DRAM only: wait for the background registration.
    loop {
        let (bytes, done) = pool.dram_registration();
        if done {
            eprintln!(
                "pool: {} MiB DRAM ready ({} MiB registered with the GPU driver) in {:.1} s",
                args.capacity / MIB,
                bytes / MIB,
                started.elapsed().as_secs_f64()
            );
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(pool)
}

/// One round of `blocks` (keys `key_base + i`) in transfers of `per` blocks, `inflight`
/// outstanding; an error when a block did not complete ok.
pub(crate) fn xfer(
    w: &mut WorkerProc,
    op: Op,
    group: u16,
    key_base: u64,
    blocks: &[u64],
    per: usize,
    inflight: usize,
) -> Result<Value, String> {
    xfer_with(w, Xfer::new(op, group, key_base, blocks, per, inflight))
}

/// As [`xfer`], any [`Xfer`].
pub(crate) fn xfer_with(w: &mut WorkerProc, x: Xfer) -> Result<Value, String> {
    let (op, group) = (x.op, x.group);
    let r = w.call(&Command::Xfer(x))?;
    if u64_of(&r, "bad") != 0 {
        return Err(format!("{op:?} of group {group}: {} blocks not ok ({r})", u64_of(&r, "bad")));
    }
    Ok(r)
}

/// Stores fresh copies of the layout (new keys) until everything stored before them has
/// left DRAM: the evictor takes the least recently used first, and with admission `all`
/// it demotes them to SSD. Each copy waits for the evictor to settle first: a store into
/// a full DRAM is refused (NotStored), and a refused copy pushes nothing out.
pub(super) fn push_out_of_dram(
    a: &mut WorkerProc,
    p: &umbp_pool::Pool,
    blocks: &[u64],
    n: usize,
    next_key: &mut impl FnMut(u64) -> u64,
) -> Result<(), String> {
    let settle = || -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut last = u64::MAX;
        loop {
            let r = p.report();
            let demoted = r.ssd.map_or(0, |s| s.demotions);
            if r.pool.allocated_bytes as f64 <= r.pool.capacity_bytes as f64 * r.pool.high_watermark && demoted == last {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err("pushing the prefix out of DRAM: the evictor did not settle in 120 s".into());
            }
            last = demoted;
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let r = p.report();
    let prefix_bytes = r.pool.allocated_bytes.max(1);
    let rounds = r.pool.capacity_bytes.div_ceil(prefix_bytes.min(r.pool.capacity_bytes)) + 1;
    for _ in 0..rounds {
        settle()?;
        a.call(&Command::Xfer(Xfer::new(Op::Store, 0, next_key(0), blocks, n, 1)))?;
    }
    settle()
}
