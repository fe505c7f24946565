//! `umbp-bench transfer`: KV store/load bandwidth through a real pool, worker(s) in child
//! processes, each figure beside a baseline measured in the same run (DESIGN §12), and
//! `--check`: the multi-process correctness checks of the GPU data path (docs/gpu.md).
//!
//! The pool runs in this process (the same library the `umbp-pool` daemon runs; workers
//! attach over its socket exactly as to a standalone pool), or `--pool-socket` names a
//! running `umbp-pool`. Workers are this binary re-executed (`__transfer-worker`), driven
//! by JSON lines on stdin/stdout.
//!
//! Backends: `host` (worker memory is a sealed memfd, `HostMemfd`; baseline: one plain
//! memcpy of the same bytes) and `cuda` (worker memory from `cuMemAlloc`, one allocation
//! per layer as vLLM's per-layer KV tensors; baseline: one contiguous pinned
//! `cuMemcpyDtoH`/`HtoD` of the same byte count).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use umbp_pool::{Pool, PoolConfig};
use umbp_worker::{BlockStatus, Completion, MemorySpec, ObjectKey, Segment, TransferId, Worker, WorkerConfig};

use super::report::{Better, Case};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendArg {
    Host,
    Cuda,
}

#[derive(Clone, Debug)]
pub struct TransferArgs {
    pub backend: BackendArg,
    /// Run the correctness checks instead of the benchmark.
    pub check: bool,
    /// Smaller sizes and fewer repetitions.
    pub quick: bool,
    /// Pool DRAM (in-process pool).
    pub capacity: u64,
    /// Timed repetitions per case (median reported).
    pub reps: usize,
    /// Use this running pool instead of starting one (checks that need the pool's
    /// internals are skipped).
    pub pool_socket: Option<PathBuf>,
    /// cuda: only the gpt-oss layout cases (store, load, restore, fenced).
    pub layout_only: bool,
    /// cuda: the multi-GPU run (bench/multi_gpu.rs) instead of the single-GPU cases.
    pub multi_gpu: bool,
    /// Command running a matmul loop for `interference_pct` (cuda); it gets
    /// `--seconds S` appended and must print a JSON line with `tflops`.
    pub matmul: Option<String>,
    /// Try these stream counts (and batching on/off) on the main layout, then use the
    /// best for the other cases (in-process pool only).
    pub sweep: bool,
}

pub(super) const NS: u128 = 0x7472_616e_7366_6572;
const MIB: u64 = 1 << 20;

pub(super) fn gbps(bytes: u64, ns: u64) -> f64 {
    bytes as f64 / ns.max(1) as f64
}

pub(super) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

// ---------------------------------------------------------------------------------------
// Parent side
// ---------------------------------------------------------------------------------------

/// A worker child process driven by JSON lines.
pub(super) struct WorkerProc {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    name: String,
}

impl WorkerProc {
    pub(super) fn spawn(name: &str, socket: &Path, backend: BackendArg, namespace: u128) -> Result<Self, String> {
        Self::spawn_with_env(name, socket, backend, namespace, &[])
    }

    /// As [`Self::spawn`], with extra environment (e.g. `CUDA_VISIBLE_DEVICES` to put the
    /// worker on one GPU).
    pub(super) fn spawn_with_env(name: &str, socket: &Path, backend: BackendArg, namespace: u128, env: &[(&str, String)]) -> Result<Self, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = Command::new(exe)
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

    pub(super) fn send(&mut self, cmd: Value) -> Result<(), String> {
        writeln!(self.stdin, "{cmd}").and_then(|()| self.stdin.flush()).map_err(|e| format!("worker {}: {e}", self.name))
    }

    pub(super) fn recv(&mut self) -> Result<Value, String> {
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

    pub(super) fn call(&mut self, cmd: Value) -> Result<Value, String> {
        self.send(cmd)?;
        self.recv()
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for WorkerProc {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "{}", json!({"cmd": "exit"}));
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
pub(super) struct PoolHandle {
    pool: Option<Pool>,
    pub(super) socket: PathBuf,
    _dir: Option<TempDir>,
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl PoolHandle {
    /// The in-process pool's per-phase time counters (none for an external pool).
    fn phases(&self) -> Option<Value> {
        self.pool.as_ref().map(|p| serde_json::to_value(p.report().counters.phases).expect("json"))
    }
}

/// Mean microseconds per job of each pool phase between two [`PoolHandle::phases`]
/// snapshots, per direction: where a submission's time went inside the pool.
fn phase_means(before: &Option<Value>, after: &Option<Value>) -> Value {
    let (Some(b), Some(a)) = (before, after) else { return Value::Null };
    let mut out = serde_json::Map::new();
    for op in ["store", "load"] {
        let d = |k: &str| u64_of(&a[op], k).saturating_sub(u64_of(&b[op], k));
        let jobs = d("jobs");
        if jobs == 0 {
            continue;
        }
        let mut m = serde_json::Map::new();
        m.insert("jobs".into(), jobs.into());
        m.insert("stages_per_job".into(), json!(d("stages") as f64 / jobs as f64));
        for phase in ["admit", "queue", "reserve", "plan", "copy", "publish", "finish"] {
            let us = d(&format!("{phase}_ns")) as f64 / jobs as f64 / 1e3;
            m.insert(format!("{phase}_us"), json!((us * 10.0).round() / 10.0));
        }
        out.insert(op.into(), Value::Object(m));
    }
    Value::Object(out)
}

pub(super) fn start_pool(args: &TransferArgs) -> Result<PoolHandle, String> {
    if let Some(s) = &args.pool_socket {
        return Ok(PoolHandle { pool: None, socket: s.clone(), _dir: None });
    }
    let dir = std::env::temp_dir().join(format!("umbp-bench-transfer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let socket = dir.join("pool.sock");
    let config = PoolConfig {
        socket_path: socket.clone(),
        capacity_bytes: args.capacity,
        prefault: true,
        // pool_overhead's objects: 24 pages of 64 B (layouts below this are refused).
        min_object_bytes: 24 * 64,
        ..PoolConfig::default()
    };
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
    Ok(PoolHandle { pool: Some(pool), socket, _dir: Some(TempDir(dir)) })
}

pub(super) fn u64_of(v: &Value, k: &str) -> u64 {
    v.get(k).and_then(Value::as_u64).unwrap_or(0)
}

/// The main KV layout: gpt-oss-20b-like (24 layers, 32-token blocks, 8 KV heads x 64 x
/// (K+V) bf16 = 64 KiB pages), a 10,000-token prefix = 313 blocks, scattered over a cache of
/// `cache_blocks` blocks like a vLLM block table.
pub(super) struct Layout {
    pub(super) name: &'static str,
    pub(super) layers: u64,
    pub(super) page: u64,
    pub(super) cache_blocks: u64,
    pub(super) blocks: Vec<u64>,
    pub(super) per_layer_alloc: bool,
}

impl Layout {
    pub(super) fn object_bytes(&self) -> u64 {
        self.layers * self.page
    }
    pub(super) fn bytes(&self) -> u64 {
        self.object_bytes() * self.blocks.len() as u64
    }
    pub(super) fn setup(&self, w: &mut WorkerProc, group: u16, seed: u64) -> Result<(), String> {
        let r = w.call(json!({"cmd": "setup", "group": group, "layers": self.layers, "page": self.page,
            "blocks": self.cache_blocks, "per_layer_alloc": self.per_layer_alloc, "seed": seed}))?;
        if u64_of(&r, "object_bytes") != self.object_bytes() {
            return Err(format!("layout {}: pool says {r}", self.name));
        }
        Ok(())
    }
}

fn scattered(count: u64, cache: u64) -> Vec<u64> {
    // A permutation step coprime with the cache size: blocks spread over the whole cache.
    let step = (cache / 3) | 1;
    (0..count).map(|i| (i * step) % cache).collect()
}

#[allow(clippy::too_many_arguments)]
fn xfer(w: &mut WorkerProc, op: &str, group: u16, key_base: u64, blocks: &[u64], per: usize, inflight: usize, rounds: u64) -> Result<Value, String> {
    let r = w.call(json!({"cmd": "xfer", "op": op, "group": group, "key_base": key_base, "blocks": blocks,
        "per_transfer": per, "inflight": inflight, "rounds": rounds}))?;
    if u64_of(&r, "bad") != 0 {
        return Err(format!("{op} of group {group}: {} blocks not ok ({r})", u64_of(&r, "bad")));
    }
    Ok(r)
}

/// Runs the benchmark or the checks.
pub fn run(args: &TransferArgs) -> Result<Vec<Case>, String> {
    if args.backend == BackendArg::Cuda {
        let n = umbp_gpu::cuda::device_count().map_err(|e| format!("--backend cuda: {e}"))?;
        if n == 0 {
            return Err("--backend cuda: the CUDA driver sees no device".into());
        }
    }
    if args.multi_gpu {
        return super::multi_gpu::run(args);
    }
    if args.check {
        return checks(args);
    }
    match args.backend {
        BackendArg::Host => bench_host(args),
        BackendArg::Cuda => bench_cuda(args),
    }
}

fn host_note() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| c.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string()))
        .unwrap_or_default()
}

fn bench_host(args: &TransferArgs) -> Result<Vec<Case>, String> {
    let pool = start_pool(args)?;
    let mut a = WorkerProc::spawn("A", &pool.socket, BackendArg::Host, NS)?;
    let total: u64 = if args.quick { 256 * MIB } else { 1 << 30 };
    let layers = 32;
    let mut cases = Vec::new();
    let pages: &[u64] = &[64 << 10, 256 << 10, 1 << 20, 2 << 20];
    for (group, &page) in pages.iter().enumerate() {
        let group = group as u16;
        let blocks = total / (layers * page);
        let l = Layout { name: "host", layers, page, cache_blocks: blocks, blocks: (0..blocks).collect(), per_layer_alloc: false };
        l.setup(&mut a, group, 1)?;
        let bytes = l.bytes();
        let base = a.call(json!({"cmd": "baseline", "bytes": bytes, "dir": "d2h", "reps": args.reps}))?;
        let base_ns = u64_of(&base, "ns");
        // Several transfers in flight, as several requests' stores would be.
        let per = (blocks as usize / 8).max(1);
        let mut st = Vec::new();
        let mut ld = Vec::new();
        for r in 0..args.reps as u64 {
            a.call(json!({"cmd": "reset"}))?;
            let key = 1_000_000 * (r + 1) + group as u64 * 100_000_000;
            let s = xfer(&mut a, "store", group, key, &l.blocks, per, 4, 1)?;
            st.push(gbps(bytes, u64_of(&s, "ns")));
            let d = xfer(&mut a, "load", group, key, &l.blocks, per, 4, 1)?;
            ld.push(gbps(bytes, u64_of(&d, "ns")));
        }
        let label = format!("p{}k", page >> 10);
        let base_gbps = gbps(bytes, base_ns);
        for (op, v) in [("store", st), ("load", ld)] {
            cases.push(
                Case::new("transfer", &format!("{label}_{op}_gbps"), median(v), "GB/s", base_gbps, "one memcpy of the same bytes", Better::Higher)
                    .extra("backend", "host")
                    .extra("memory", "HostMemfd")
                    .extra("bytes", bytes)
                    .extra("layers", layers)
                    .extra("page_bytes", page)
                    .extra("blocks", blocks)
                    .extra("blocks_per_transfer", per)
                    .extra("inflight", 4)
                    .extra("copy_threads", PoolConfig::default().copy_threads)
                    .extra("cpus", super::report::cpus())
                    .extra("cpu", host_note()),
            );
        }
        a.call(json!({"cmd": "drop", "group": group}))?;
        a.call(json!({"cmd": "reset"}))?;
    }
    cases.extend(pool_overhead(args, &pool, &mut a)?);
    Ok(cases)
}

/// The pool's own cost per submission, apart from moving bytes: the gpt-oss-like shape (313
/// blocks x 24 per-layer allocations = 7,512 pages) with 64-byte pages, so the copies cost
/// next to nothing and what is measured is validation, reservation/pinning, copy planning,
/// publication and the completion. Baseline: a one-block submission of the same layout.
fn pool_overhead(args: &TransferArgs, pool: &PoolHandle, a: &mut WorkerProc) -> Result<Vec<Case>, String> {
    let mut l = gpt_oss(args.quick);
    l.name = "gptoss_shape";
    l.page = 64;
    let group = 90;
    l.setup(a, group, 1)?;
    let mut cases = Vec::new();
    let reps = (args.reps * 4).max(8) as u64;
    let mut key = 7u64 << 40;
    let mut measure = |blocks: &[u64], a: &mut WorkerProc| -> Result<(f64, f64), String> {
        let (mut st, mut ld) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            key += 1_000_003;
            st.push(u64_of(&xfer(a, "store", group, key, blocks, blocks.len(), 1, 1)?, "ns") as f64 / 1e3);
            ld.push(u64_of(&xfer(a, "load", group, key, blocks, blocks.len(), 1, 1)?, "ns") as f64 / 1e3);
        }
        Ok((median(st), median(ld)))
    };
    let (one_st, one_ld) = measure(&l.blocks[..1], a)?;
    let p0 = pool.phases();
    let (st, ld) = measure(&l.blocks, a)?;
    let phases = phase_means(&p0, &pool.phases());
    for (op, v, base) in [("store", st, one_st), ("load", ld, one_ld)] {
        cases.push(
            Case::new("transfer", &format!("gptoss_shape_{op}_overhead_us"), v, "us", base, "one-block submission, same layout", Better::Lower)
                .extra("pool_phases_us", phases[op].clone())
                .extra("backend", "host")
                .extra("blocks", l.blocks.len())
                .extra("layers", l.layers)
                .extra("page_bytes", l.page)
                .extra("cpus", super::report::cpus()),
        );
    }
    a.call(json!({"cmd": "drop", "group": group}))?;
    a.call(json!({"cmd": "reset"}))?;
    Ok(cases)
}

pub(super) fn gpt_oss(quick: bool) -> Layout {
    let cache_blocks = 512;
    let prefix_tokens = 10_000u64;
    let blocks = prefix_tokens.div_ceil(32);
    let _ = quick;
    Layout { name: "gptoss", layers: 24, page: 64 << 10, cache_blocks, blocks: scattered(blocks, cache_blocks), per_layer_alloc: true }
}

fn bench_cuda(args: &TransferArgs) -> Result<Vec<Case>, String> {
    let pool = start_pool(args)?;
    let mut a = WorkerProc::spawn("A", &pool.socket, BackendArg::Cuda, NS)?;
    let info = a.call(json!({"cmd": "info"}))?;
    eprintln!("worker A: {info}");
    let gpu = info.get("gpu").cloned().unwrap_or(Value::Null);
    let batch_api = umbp_gpu::cuda::batch_copy_api();
    let mut cases = Vec::new();
    let reps = args.reps as u64;
    let ctx = |c: Case| c.extra("backend", "cuda").extra("gpu", gpu.clone()).extra("batch_api", batch_api);

    // --- gpt-oss-20b-like layout, 10k-token prefix
    let l = gpt_oss(args.quick);
    let bytes = l.bytes();
    l.setup(&mut a, 0, 1)?;
    let bd = a.call(json!({"cmd": "baseline", "bytes": bytes, "dir": "d2h", "reps": 5}))?;
    let bh = a.call(json!({"cmd": "baseline", "bytes": bytes, "dir": "h2d", "reps": 5}))?;
    let (base_d2h, base_h2d) = (gbps(bytes, u64_of(&bd, "ns")), gbps(bytes, u64_of(&bh, "ns")));
    eprintln!("baseline contiguous pinned: d2h {base_d2h:.1} GB/s, h2d {base_h2d:.1} GB/s ({} MiB)", bytes / MIB);
    let mut key = 1u64 << 40;
    let mut next_key = |n: u64| {
        key += n + 1000;
        key
    };
    let n = l.blocks.len();
    let measure = |a: &mut WorkerProc, key: u64, reps: u64| -> Result<(f64, f64), String> {
        let mut st = Vec::new();
        let mut ld = Vec::new();
        for r in 0..reps {
            a.call(json!({"cmd": "reset"}))?;
            let k = key + r * 10_000;
            let s = xfer(a, "store", 0, k, &l.blocks, n, 1, 1)?;
            st.push(gbps(bytes, u64_of(&s, "ns")));
            let d = xfer(a, "load", 0, k, &l.blocks, n, 1, 1)?;
            ld.push(gbps(bytes, u64_of(&d, "ns")));
        }
        Ok((median(st), median(ld)))
    };
    // Warm up (stream sets, IPC mappings, first-touch of pool pages).
    measure(&mut a, next_key(0), 2)?;
    #[derive(Clone, Copy, Debug, PartialEq)]
    struct Tune {
        streams: usize,
        batch: bool,
        parallel: bool,
        batch_max: usize,
        stage_mib: u64,
    }
    let apply = |t: Tune| {
        umbp_gpu::set_tuning(t.streams, t.batch);
        umbp_gpu::set_parallel_submit(t.parallel);
        umbp_gpu::set_batch_max(t.batch_max);
        if let Some(p) = &pool.pool {
            p.set_copy_stage_bytes(t.stage_mib * MIB);
        }
    };
    let (st0, b0) = umbp_gpu::tuning();
    let stage0 = umbp_pool::config::DEFAULT_COPY_STAGE_BYTES / MIB;
    let mut tuning = Tune { streams: st0, batch: b0, parallel: umbp_gpu::parallel_submit(), batch_max: umbp_gpu::batch_max(), stage_mib: stage0 };
    if args.sweep && pool.pool.is_some() {
        let mut variants = Vec::new();
        for streams in [1usize, 4] {
            for stage_mib in [0, 16, 32, 64, 128] {
                variants.push(Tune { streams, batch: true, parallel: false, batch_max: 512, stage_mib });
            }
        }
        for streams in [2usize, 8] {
            variants.push(Tune { streams, batch: true, parallel: false, batch_max: 512, stage_mib: stage0 });
        }
        variants.push(Tune { streams: 4, batch: true, parallel: true, batch_max: 512, stage_mib: 0 });
        variants.push(Tune { streams: 4, batch: true, parallel: false, batch_max: 128, stage_mib: stage0 });
        variants.push(Tune { streams: 4, batch: true, parallel: false, batch_max: 2048, stage_mib: stage0 });
        variants.push(Tune { streams: 4, batch: false, parallel: false, batch_max: 512, stage_mib: stage0 });
        let mut best = (0.0, tuning);
        for t in variants {
            apply(t);
            let e0 = umbp_gpu::engine_stats();
            let p0 = pool.phases();
            let (s, d) = measure(&mut a, next_key(0), reps.min(5))?;
            let phases = phase_means(&p0, &pool.phases());
            let e1 = umbp_gpu::engine_stats();
            let calls = (e1.calls - e0.calls).max(1);
            let engine = gbps(e1.bytes - e0.bytes, e1.total_ns - e0.total_ns);
            let enqueue_ms = (e1.enqueue_ns - e0.enqueue_ns) as f64 / calls as f64 / 1e6;
            eprintln!("tuning {t:?}: store {s:.1} GB/s, load {d:.1} GB/s; engine {engine:.1} GB/s, enqueue {enqueue_ms:.2} ms per call; pool phases {phases}");
            let name = format!("tune_s{}_b{}_p{}_m{}_st{}", t.streams, t.batch as u8, t.parallel as u8, t.batch_max, t.stage_mib);
            for (op, v, b) in [("store", s, base_d2h), ("load", d, base_h2d)] {
                cases.push(ctx(Case::new("transfer", &format!("{name}_{op}_gbps"), v, "GB/s", b, "contiguous pinned cuMemcpy, same bytes", Better::Higher)
                    .extra("layout", l.name).extra("bytes", bytes).extra("streams", t.streams).extra("batch", t.batch)
                    .extra("parallel_submit", t.parallel).extra("batch_max", t.batch_max).extra("copy_stage_mib", t.stage_mib)
                    .extra("engine_gbps", engine).extra("enqueue_ms_per_call", enqueue_ms).extra("pool_phases_us", phases[op].clone())));
            }
            if s + d > best.0 {
                best = (s + d, t);
            }
        }
        tuning = best.1;
        eprintln!("tuning: using {tuning:?}");
    }
    apply(tuning);
    let e0 = umbp_gpu::engine_stats();
    let p0 = pool.phases();
    let (s, d) = measure(&mut a, next_key(0), reps)?;
    let phases = phase_means(&p0, &pool.phases());
    let e1 = umbp_gpu::engine_stats();
    let engine_gbps = gbps(e1.bytes - e0.bytes, e1.total_ns - e0.total_ns);
    let enqueue_ms = (e1.enqueue_ns - e0.enqueue_ns) as f64 / (e1.calls - e0.calls).max(1) as f64 / 1e6;
    let lay = |c: Case| ctx(c).extra("layout", "24 layers x 64 KiB pages (gpt-oss-20b-like), one allocation per layer").extra("bytes", bytes)
        .extra("blocks", n).extra("streams", tuning.streams).extra("batch", tuning.batch)
        .extra("parallel_submit", tuning.parallel).extra("batch_max", tuning.batch_max).extra("copy_stage_mib", tuning.stage_mib);
    cases.push(lay(Case::new("transfer", "gptoss_store_gbps", s, "GB/s", base_d2h, "contiguous pinned cuMemcpyDtoH, same bytes", Better::Higher)
        .extra("engine_gbps_store_and_load", engine_gbps).extra("enqueue_ms_per_call", enqueue_ms).extra("pool_phases_us", phases["store"].clone())));
    cases.push(lay(Case::new("transfer", "gptoss_load_gbps", d, "GB/s", base_h2d, "contiguous pinned cuMemcpyHtoD, same bytes", Better::Higher)
        .extra("engine_gbps_store_and_load", engine_gbps).extra("enqueue_ms_per_call", enqueue_ms).extra("pool_phases_us", phases["load"].clone())));

    // --- restore: lookup + load of the 10k prefix, end to end
    let k = next_key(0);
    a.call(json!({"cmd": "reset"}))?;
    xfer(&mut a, "store", 0, k, &l.blocks, n, 1, 1)?;
    let mut ms = Vec::new();
    let mut lookup_us = Vec::new();
    for _ in 0..reps.max(3) {
        let r = a.call(json!({"cmd": "restore", "group": 0, "key_base": k, "blocks": l.blocks}))?;
        if u64_of(&r, "hits") != n as u64 || u64_of(&r, "bad") != 0 {
            return Err(format!("restore: {r}"));
        }
        ms.push(u64_of(&r, "ns") as f64 / 1e6);
        lookup_us.push(u64_of(&r, "lookup_ns") as f64 / 1e3);
    }
    let base_ms = u64_of(&bh, "ns") as f64 / 1e6;
    cases.push(lay(Case::new("transfer", "restore_10k_ms", median(ms), "ms", base_ms, "contiguous pinned cuMemcpyHtoD, same bytes", Better::Lower)
        .extra("lookup_us", median(lookup_us)).extra("tokens", 10_000)));

    // --- fenced store and load (stream-ordered, DESIGN §7): same layout
    let mut fs = Vec::new();
    let mut fl = Vec::new();
    for r in 0..reps {
        a.call(json!({"cmd": "reset"}))?;
        let k = next_key(0) + r;
        let s = a.call(json!({"cmd": "xfer", "op": "store", "group": 0, "key_base": k, "blocks": l.blocks, "per_transfer": n, "inflight": 1, "rounds": 1, "fence": true}))?;
        let d = a.call(json!({"cmd": "xfer", "op": "load", "group": 0, "key_base": k, "blocks": l.blocks, "per_transfer": n, "inflight": 1, "rounds": 1, "fence": true}))?;
        if u64_of(&s, "bad") + u64_of(&d, "bad") != 0 {
            return Err(format!("fenced transfers failed: {s} {d}"));
        }
        fs.push(gbps(bytes, u64_of(&s, "ns")));
        fl.push(gbps(bytes, u64_of(&d, "ns")));
    }
    cases.push(lay(Case::new("transfer", "gptoss_fenced_store_gbps", median(fs), "GB/s", base_d2h, "contiguous pinned cuMemcpyDtoH, same bytes", Better::Higher)
        .extra("note", "store_after_stream; time to completion")));
    cases.push(lay(Case::new("transfer", "gptoss_fenced_load_gbps", median(fl), "GB/s", base_h2d, "contiguous pinned cuMemcpyHtoD, same bytes", Better::Higher)
        .extra("note", "load_before_stream; time until the worker's stream passed its wait")));

    if args.layout_only {
        return Ok(cases);
    }

    // --- the seed's object table: 1, 16, 64 MiB objects, x1 and x8 in flight
    let total = if args.quick { 512 * MIB } else { 1 << 30 };
    for (i, size) in [MIB, 16 * MIB, 64 * MIB].into_iter().enumerate() {
        let group = 10 + i as u16;
        let count = (total / size).max(8);
        let ol = Layout { name: "obj", layers: 1, page: size, cache_blocks: count, blocks: (0..count).collect(), per_layer_alloc: false };
        ol.setup(&mut a, group, 7)?;
        let ob = ol.bytes();
        let bd = gbps(ob, u64_of(&a.call(json!({"cmd": "baseline", "bytes": ob, "dir": "d2h", "reps": 5}))?, "ns"));
        let bh = gbps(ob, u64_of(&a.call(json!({"cmd": "baseline", "bytes": ob, "dir": "h2d", "reps": 5}))?, "ns"));
        for inflight in [1usize, 8] {
            let mut st = Vec::new();
            let mut ld = Vec::new();
            for _ in 0..reps {
                a.call(json!({"cmd": "reset"}))?;
                let k = next_key(count);
                st.push(gbps(ob, u64_of(&xfer(&mut a, "store", group, k, &ol.blocks, 1, inflight, 1)?, "ns")));
                ld.push(gbps(ob, u64_of(&xfer(&mut a, "load", group, k, &ol.blocks, 1, inflight, 1)?, "ns")));
            }
            let label = format!("obj{}m_x{inflight}", size / MIB);
            for (op, v, b, bn) in [("store", st, bd, "contiguous pinned cuMemcpyDtoH, same bytes"), ("load", ld, bh, "contiguous pinned cuMemcpyHtoD, same bytes")] {
                cases.push(ctx(Case::new("transfer", &format!("{label}_{op}_gbps"), median(v), "GB/s", b, bn, Better::Higher)
                    .extra("object_bytes", size).extra("objects", count).extra("inflight", inflight).extra("bytes", ob)
                    .extra("streams", tuning.streams).extra("batch", tuning.batch).extra("parallel_submit", tuning.parallel)));
            }
        }
        a.call(json!({"cmd": "drop", "group": group}))?;
    }

    // --- bidirectional: A stores fresh keys while B loads stored ones
    a.call(json!({"cmd": "reset"}))?;
    let mut b = WorkerProc::spawn("B", &pool.socket, BackendArg::Cuda, NS + 1)?;
    l.setup(&mut b, 0, 2)?;
    let rounds = if args.quick { 3 } else { 6 };
    let kb = next_key(0);
    for r in 0..rounds {
        xfer(&mut b, "store", 0, kb + r * 1000, &l.blocks, n, 1, 1)?;
    }
    let mut bi = Vec::new();
    for r in 0..reps.min(3) {
        a.call(json!({"cmd": "reset"}))?;
        let ka = next_key(0) + r;
        a.send(json!({"cmd": "xfer", "op": "store", "group": 0, "key_base": ka, "blocks": l.blocks, "per_transfer": n, "inflight": 2, "rounds": rounds, "round_stride": 1000}))?;
        b.send(json!({"cmd": "xfer", "op": "load", "group": 0, "key_base": kb, "blocks": l.blocks, "per_transfer": n, "inflight": 2, "rounds": rounds, "round_stride": 1000}))?;
        let (ra, rb) = (a.recv()?, b.recv()?);
        if u64_of(&ra, "bad") + u64_of(&rb, "bad") != 0 {
            return Err(format!("bidir: {ra} {rb}"));
        }
        let ns = u64_of(&ra, "ns").max(u64_of(&rb, "ns"));
        bi.push(gbps(2 * rounds * bytes, ns));
    }
    let bb = a.call(json!({"cmd": "baseline", "bytes": bytes * rounds, "dir": "bidir", "reps": 3}))?;
    cases.push(lay(Case::new("transfer", "bidir_gbps", median(bi), "GB/s", gbps(2 * rounds * bytes, u64_of(&bb, "ns")),
        "contiguous pinned cuMemcpyDtoH + HtoD at once, same bytes", Better::Higher).extra("rounds", rounds).extra("workers", 2)));
    drop(b);

    // --- interference with a matmul loop in another process
    if let Some(cmd) = &args.matmul {
        match interference(&mut a, cmd, &l, next_key(0), args.quick) {
            Ok(c) => cases.push(lay(c)),
            Err(e) => eprintln!("interference_pct skipped: {e}"),
        }
    } else {
        eprintln!("interference_pct skipped: no --matmul command given");
    }
    Ok(cases)
}

fn run_matmul(cmd: &str, seconds: f64) -> Result<f64, String> {
    let out = Command::new("sh")
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
fn interference(a: &mut WorkerProc, cmd: &str, l: &Layout, key: u64, quick: bool) -> Result<Case, String> {
    let secs = if quick { 3.0 } else { 5.0 };
    let _warm = run_matmul(cmd, 1.0)?;
    let alone1 = run_matmul(cmd, secs)?;
    let with = |a: &mut WorkerProc, loop_cmd: Value| -> Result<(f64, Value), String> {
        a.send(loop_cmd)?;
        let started = a.recv()?;
        if started.get("started").is_none() {
            return Err(format!("loop did not start: {started}"));
        }
        let t = run_matmul(cmd, secs)?;
        let done = a.recv()?;
        Ok((t, done))
    };
    a.call(json!({"cmd": "reset"}))?;
    let (t_store, st) = with(a, json!({"cmd": "store_loop", "group": 0, "key_base": key, "blocks": l.blocks, "seconds": secs + 1.5}))?;
    let (t_copy, cp) = with(a, json!({"cmd": "memcpy_loop", "bytes": l.bytes(), "seconds": secs + 1.5}))?;
    let alone2 = run_matmul(cmd, secs)?;
    let alone = (alone1 + alone2) / 2.0;
    let pct = |t: f64| (1.0 - t / alone) * 100.0;
    let noise = ((alone1 - alone2) / alone).abs() * 100.0;
    Ok(Case::new("transfer", "interference_pct", pct(t_store), "%", pct(t_copy), "same matmul slowdown under a contiguous cuMemcpyDtoH loop", Better::Lower)
        .extra("matmul_tflops_alone", alone)
        .extra("matmul_tflops_with_stores", t_store)
        .extra("matmul_tflops_with_memcpy", t_copy)
        .extra("alone_run_to_run_pct", noise)
        .extra("store_gbps_during", gbps(u64_of(&st, "bytes"), u64_of(&st, "ns")))
        .extra("memcpy_gbps_during", gbps(u64_of(&cp, "bytes"), u64_of(&cp, "ns"))))
}

// ---------------------------------------------------------------------------------------
// Checks (scripts/device/run-gpu-tests.sh runs them with --backend cuda)
// ---------------------------------------------------------------------------------------

pub(super) struct Checks {
    pub(super) cases: Vec<Case>,
    pub(super) failed: u32,
}

impl Checks {
    pub(super) fn record(&mut self, name: &str, ok: bool, detail: Value) {
        println!("{}", json!({"check": "transfer", "case": name, "ok": ok, "detail": detail}));
        if !ok {
            self.failed += 1;
        }
        self.cases.push(Case::new("transfer-check", name, ok as u8 as f64, "ok", 1.0, "expected", Better::Higher).extra("detail", detail));
    }

    /// A check that cannot observe what it checks here: `"ok": "skipped"` with the reason,
    /// neither passed nor failed.
    pub(super) fn skip(&mut self, name: &str, reason: &str, detail: Value) {
        println!("{}", json!({"check": "transfer", "case": name, "ok": "skipped", "skipped": reason, "detail": detail}));
        eprintln!("{name} skipped: {reason}");
    }
}

fn checks(args: &TransferArgs) -> Result<Vec<Case>, String> {
    let pool = start_pool(args)?;
    let cuda = args.backend == BackendArg::Cuda;
    let mut c = Checks { cases: Vec::new(), failed: 0 };
    let mut a = WorkerProc::spawn("A", &pool.socket, args.backend, NS)?;
    let mut b = WorkerProc::spawn("B", &pool.socket, args.backend, NS)?;
    let l = Layout { name: "gptoss", layers: 24, page: 64 << 10, cache_blocks: 128, blocks: scattered(40, 128), per_layer_alloc: true };
    l.setup(&mut a, 0, 11)?;
    l.setup(&mut b, 0, 22)?;
    // 1. Two workers store, then load each other's blocks, byte-exact.
    {
        let ra = store_retry(&mut a, 0, 1000, &l.blocks);
        let rb = store_retry(&mut b, 0, 2000, &l.blocks);
        let stored = ra.is_ok() && rb.is_ok();
        a.call(json!({"cmd": "poison", "group": 0}))?;
        b.call(json!({"cmd": "poison", "group": 0}))?;
        let la = xfer(&mut a, "load", 0, 2000, &l.blocks, 16, 2, 1);
        let lb = xfer(&mut b, "load", 0, 1000, &l.blocks, 16, 2, 1);
        let va = a.call(json!({"cmd": "verify", "group": 0, "seed": 22, "blocks": l.blocks}))?;
        let vb = b.call(json!({"cmd": "verify", "group": 0, "seed": 11, "blocks": l.blocks}))?;
        let ok = stored && la.is_ok() && lb.is_ok() && u64_of(&va, "bad_words") == 0 && u64_of(&vb, "bad_words") == 0 && u64_of(&va, "words") > 0;
        c.record("cross_worker_byte_exact", ok, json!({"a_verify": va, "b_verify": vb, "errors": [ra.err(), rb.err(), la.err(), lb.err()]}));
        // Blocks not loaded must be untouched (still poison): the pool wrote only what it should.
        let untouched: Vec<u64> = (0..l.cache_blocks).filter(|x| !l.blocks.contains(x)).take(8).collect();
        let p = a.call(json!({"cmd": "verify_poison", "group": 0, "blocks": untouched}))?;
        c.record("load_writes_only_its_blocks", u64_of(&p, "bad_words") == 0, p);
    }
    if cuda {
        // 2. Store ordered after a slow kernel writing the KV (fence), with an unfenced control.
        let fl = Layout { name: "fence", layers: 1, page: MIB, cache_blocks: 256, blocks: (0..256).collect(), per_layer_alloc: false };
        fl.setup(&mut a, 1, 3)?;
        fl.setup(&mut b, 1, 4)?;
        let r = a.call(json!({"cmd": "fence_store", "group": 1, "old_seed": 3, "new_seed": 5, "spin_ms": 300, "key_base": 50_000, "control_key_base": 60_000}))?;
        b.call(json!({"cmd": "poison", "group": 1}))?;
        xfer(&mut b, "load", 1, 50_000, &fl.blocks, 256, 1, 1)?;
        let v = b.call(json!({"cmd": "verify", "group": 1, "seed": 5, "blocks": fl.blocks}))?;
        c.record("fenced_store_sees_kernel_output", u64_of(&r, "bad") == 0 && u64_of(&v, "bad_words") == 0, json!({"store": r, "verify": v}));
        b.call(json!({"cmd": "poison", "group": 1}))?;
        let ctl = xfer(&mut b, "load", 1, 60_000, &fl.blocks, 256, 1, 1);
        let cv = b.call(json!({"cmd": "verify", "group": 1, "seed": 5, "blocks": fl.blocks}))?;
        // Informational: without the fence the pool copies before the kernel ran.
        println!("{}", json!({"check": "transfer", "case": "unfenced_store_control", "info": true,
            "words_not_from_kernel": u64_of(&cv, "bad_words"), "words": u64_of(&cv, "words"), "load": ctl.err()}));
        // 3. Load ordered before a kernel that reads (fence), with an unfenced control.
        let r = a.call(json!({"cmd": "fence_load", "group": 1, "seed": 5, "key_base": 50_000}))?;
        c.record("fenced_load_before_reading_kernel", u64_of(&r, "bad_words") == 0 && u64_of(&r, "load_bad") == 0, r.clone());
        println!("{}", json!({"check": "transfer", "case": "unfenced_load_control", "info": true,
            "kernel_saw_unloaded_words": u64_of(&r, "control_bad_words")}));
        // Many fenced loads back to back on one stream (slot reuse, ordering).
        let r = a.call(json!({"cmd": "xfer", "op": "load", "group": 1, "key_base": 50_000, "blocks": fl.blocks, "per_transfer": 4, "inflight": 16, "rounds": 1, "fence": true}))?;
        let v = a.call(json!({"cmd": "verify", "group": 1, "seed": 5, "blocks": fl.blocks}))?;
        c.record("many_fenced_loads", u64_of(&r, "bad") == 0 && u64_of(&v, "bad_words") == 0, json!({"xfer": r, "verify": v}));
    }
    // 4. A worker killed mid-transfer: the pool keeps serving, its mappings close.
    {
        let before_maps = open_mappings(args.backend, pool.pool.is_some());
        let before_att = pool.pool.as_ref().map(|p| p.attachment_count());
        // Same namespace as A, so A can drop what K stored (a full pool refuses stores).
        let mut k = WorkerProc::spawn("K", &pool.socket, args.backend, NS)?;
        let kl = Layout { name: "kill", layers: 24, page: 64 << 10, cache_blocks: 512, blocks: scattered(313, 512), per_layer_alloc: true };
        kl.setup(&mut k, 0, 9)?;
        let during_maps = open_mappings(args.backend, pool.pool.is_some());
        k.send(json!({"cmd": "store_loop", "group": 0, "key_base": 900_000, "blocks": kl.blocks, "seconds": 30.0, "no_reset": true}))?;
        let started = k.recv()?;
        std::thread::sleep(Duration::from_millis(300));
        k.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut after_maps = open_mappings(args.backend, pool.pool.is_some());
        let mut after_att = pool.pool.as_ref().map(|p| p.attachment_count());
        while Instant::now() < deadline && (after_maps != before_maps || after_att != before_att) {
            std::thread::sleep(Duration::from_millis(50));
            after_maps = open_mappings(args.backend, pool.pool.is_some());
            after_att = pool.pool.as_ref().map(|p| p.attachment_count());
        }
        // The killed worker may have filled the pool: the evictor makes room in the
        // background (stores never evict synchronously), so retry "not stored" briefly.
        a.call(json!({"cmd": "fill", "group": 0, "seed": 11}))?;
        a.call(json!({"cmd": "reset"}))?;
        let mut rt = Err(String::new());
        let mut key = 3000;
        for attempt in 0..50 {
            key = 3000 + attempt * 100;
            rt = xfer(&mut a, "store", 0, key, &l.blocks, 40, 1, 1);
            if rt.is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let rt = rt
            .and_then(|_| a.call(json!({"cmd": "poison", "group": 0})))
            .and_then(|_| xfer(&mut a, "load", 0, key, &l.blocks, 40, 1, 1))
            .and_then(|_| a.call(json!({"cmd": "verify", "group": 0, "seed": 11, "blocks": l.blocks})));
        let served = rt.as_ref().is_ok_and(|v| u64_of(v, "bad_words") == 0);
        c.record("killed_worker_pool_keeps_serving", served && started.get("started").is_some(), json!({"roundtrip": rt.as_ref().map_err(|e| e.clone())}));
        let detail = json!({"open_mappings_before": before_maps, "while_attached": during_maps, "after_death": after_maps,
                            "attachments_before": before_att, "attachments_after": after_att});
        match (before_maps, during_maps, after_maps) {
            (Some(b), Some(d), Some(a)) => c.record("killed_worker_mappings_closed", d > b && a == b && after_att == before_att, detail),
            // Not observed is not "ok": reported as skipped (an observable attachment
            // count that did not come back still fails).
            _ if after_att != before_att => c.record("killed_worker_mappings_closed", false, detail),
            _ => c.skip("killed_worker_mappings_closed", "mapping counts need the in-process pool and a GPU backend", detail),
        }
    }
    drop(a);
    drop(b);
    println!("{}", json!({"check": "transfer", "summary": format!("{} passed, {} failed", c.cases.len() as u32 - c.failed, c.failed)}));
    if c.failed > 0 {
        return Err(format!("{} transfer checks failed", c.failed));
    }
    Ok(Vec::new())
}

/// Stores with keys `key..`, retrying while the pool answers "not stored" (a pool still
/// registering its DRAM hands out only the registered part; a full one evicts in the
/// background). Keys that did get stored stay (first writer wins), so a retry is harmless.
fn store_retry(w: &mut WorkerProc, group: u16, key: u64, blocks: &[u64]) -> Result<Value, String> {
    let mut last = Err(String::new());
    for _ in 0..100 {
        last = xfer(w, "store", group, key, blocks, blocks.len(), 1, 1);
        if last.is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    last
}

/// IPC mappings the in-process pool holds (GPU backends), None where not observable.
fn open_mappings(backend: BackendArg, in_process: bool) -> Option<usize> {
    if !in_process {
        return None;
    }
    match backend {
        BackendArg::Cuda => umbp_gpu::backend_for(umbp_gpu::MemoryKind::Cuda).ok().map(|b| b.open_mappings()),
        BackendArg::Host => None,
    }
}

// ---------------------------------------------------------------------------------------
// Worker child
// ---------------------------------------------------------------------------------------

/// Pattern word `i` of seed `seed`; the PTX kernels compute the same.
fn word(seed: u64, i: u64) -> u64 {
    (i ^ (seed << 40)).wrapping_mul(0x5851_F42D_4C95_7F2D).wrapping_add(seed)
}

const POISON: u8 = 0xEE;

enum Mem {
    Host(umbp_ipc::SharedMemory),
    Cuda { ptr: u64, len: usize },
}

impl Mem {
    fn len(&self) -> usize {
        match self {
            Mem::Host(m) => m.len(),
            Mem::Cuda { len, .. } => *len,
        }
    }
}

struct Group {
    allocs: Vec<(u32, Mem)>,
    segments: Vec<Segment>,
    object_bytes: u64,
}

struct WorkerState {
    w: Worker,
    gpu: Option<cu::Gpu>,
    groups: std::collections::HashMap<u16, Group>,
    socket: PathBuf,
    namespace: u128,
}

pub fn worker_main(socket: &Path, backend: BackendArg, namespace: u128) -> Result<(), String> {
    let gpu = match backend {
        BackendArg::Cuda => Some(cu::Gpu::new()?),
        BackendArg::Host => None,
    };
    let mut cfg = WorkerConfig::new(socket, namespace);
    cfg.timeout = Duration::from_secs(60);
    cfg.sq_entries = 1024;
    cfg.arena_bytes = 16 << 20;
    let w = Worker::connect(cfg).map_err(|e| e.to_string())?;
    let mut st = WorkerState { w, gpu, groups: Default::default(), socket: socket.to_path_buf(), namespace };
    let out = std::io::stdout();
    let say = |v: Value| {
        let mut o = out.lock();
        let _ = writeln!(o, "{v}");
        let _ = o.flush();
    };
    say(json!({"ready": true}));
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| e.to_string())?;
        let cmd: Value = serde_json::from_str(&line).map_err(|e| format!("bad command {line:?}: {e}"))?;
        if cmd["cmd"] == "exit" {
            break;
        }
        let reply = st.handle(&cmd, &say).unwrap_or_else(|e| json!({"error": e}));
        say(reply);
    }
    Ok(())
}

fn blocks_of(cmd: &Value) -> Vec<u64> {
    cmd["blocks"].as_array().map(|a| a.iter().filter_map(Value::as_u64).collect()).unwrap_or_default()
}

impl WorkerState {
    fn handle(&mut self, cmd: &Value, say: &dyn Fn(Value)) -> Result<Value, String> {
        let group = cmd["group"].as_u64().unwrap_or(0) as u16;
        match cmd["cmd"].as_str().unwrap_or("") {
            "info" => Ok(json!({"gpu": self.gpu.as_ref().map(|g| g.name.clone()), "pid": std::process::id()})),
            "setup" => self.setup(cmd),
            "drop" => {
                // Registrations stay (the pool keeps them until detach); memory is kept too
                // because the pool may still reference it. Only forget the layout locally.
                Ok(json!({"ok": true}))
            }
            "reset" => self.w.reset_namespace().map(|n| json!({"dropped": n})).map_err(|e| e.to_string()),
            "xfer" => self.xfer(cmd),
            "baseline" => self.baseline(cmd),
            "poison" => {
                let g = self.groups.get(&group).ok_or("no such group")?;
                for (_, m) in &g.allocs {
                    fill_poison(self.gpu.as_ref(), m)?;
                }
                Ok(json!({"ok": true}))
            }
            "fill" => {
                let g = self.groups.get(&group).ok_or("no such group")?;
                for (_, m) in &g.allocs {
                    fill_pattern(self.gpu.as_ref(), m, cmd["seed"].as_u64().unwrap_or(0))?;
                }
                Ok(json!({"ok": true}))
            }
            "verify" => self.verify(group, cmd["seed"].as_u64().unwrap_or(0), &blocks_of(cmd), false),
            "verify_poison" => self.verify(group, 0, &blocks_of(cmd), true),
            "restore" => self.restore(cmd),
            "store_loop" => self.store_loop(cmd, say),
            "memcpy_loop" => {
                let gpu = self.gpu.as_ref().ok_or("memcpy_loop needs cuda")?;
                say(json!({"started": true}));
                gpu.memcpy_loop(cmd["bytes"].as_u64().unwrap_or(MIB) as usize, cmd["seconds"].as_f64().unwrap_or(1.0))
            }
            "fence_store" => self.fence_store(cmd),
            "fence_load" => self.fence_load(cmd),
            other => Err(format!("unknown command {other:?}")),
        }
    }

    fn setup(&mut self, cmd: &Value) -> Result<Value, String> {
        let group = cmd["group"].as_u64().unwrap_or(0) as u16;
        let layers = cmd["layers"].as_u64().unwrap_or(1);
        let page = cmd["page"].as_u64().unwrap_or(MIB);
        let blocks = cmd["blocks"].as_u64().unwrap_or(1);
        let per_layer = cmd["per_layer_alloc"].as_bool().unwrap_or(false);
        let seed = cmd["seed"].as_u64().unwrap_or(1);
        let sizes: Vec<u64> = if per_layer { vec![blocks * page; layers as usize] } else { vec![layers * blocks * page] };
        let mut allocs = Vec::new();
        for (i, &len) in sizes.iter().enumerate() {
            let mem = match &self.gpu {
                Some(g) => Mem::Cuda { ptr: g.alloc(len as usize)?, len: len as usize },
                None => Mem::Host(
                    umbp_ipc::SharedMemory::create(&format!("kv-{group}-{i}"), len as usize, false).map_err(|e| e.to_string())?,
                ),
            };
            fill_pattern(self.gpu.as_ref(), &mem, seed)?;
            let spec = match &mem {
                Mem::Host(m) => MemorySpec::HostMemfd {
                    fd: m.fd().try_clone_to_owned().map_err(|e| e.to_string())?,
                    offset: 0,
                    len,
                },
                Mem::Cuda { ptr, len } => MemorySpec::Cuda { ptr: *ptr, len: *len as u64 },
            };
            // SAFETY: `mem` (a memfd or a CUDA allocation) is kept in `allocs` for as long as
            // the worker lives.
            let id = unsafe { self.w.register_memory(spec) }.map_err(|e| format!("register_memory: {e}"))?;
            allocs.push((id, mem));
        }
        let segments: Vec<Segment> = (0..layers)
            .map(|l| {
                if per_layer {
                    Segment::new(allocs[l as usize].0, 0, page, page, blocks)
                } else {
                    Segment::new(allocs[0].0, l * blocks * page, page, page, blocks)
                }
            })
            .collect();
        let object_bytes = self.w.register_layout(group, segments.clone()).map_err(|e| format!("register_layout: {e}"))?;
        self.groups.insert(group, Group { allocs, segments, object_bytes });
        Ok(json!({"object_bytes": object_bytes}))
    }

    /// Submits `rounds` x `blocks` (keys `key_base + round * stride + i`) in transfers of
    /// `per_transfer` blocks with at most `inflight` outstanding; waits for all.
    fn xfer(&mut self, cmd: &Value) -> Result<Value, String> {
        let load = cmd["op"] == "load";
        let group = cmd["group"].as_u64().unwrap_or(0) as u16;
        let base = cmd["key_base"].as_u64().unwrap_or(0);
        let blocks = blocks_of(cmd);
        let per = cmd["per_transfer"].as_u64().unwrap_or(blocks.len() as u64).max(1) as usize;
        let inflight = cmd["inflight"].as_u64().unwrap_or(1).max(1) as usize;
        let rounds = cmd["rounds"].as_u64().unwrap_or(1).max(1);
        let stride = cmd["round_stride"].as_u64().unwrap_or(blocks.len() as u64);
        let fence = cmd["fence"].as_bool().unwrap_or(false);
        let stream = match (&self.gpu, fence) {
            (Some(g), true) => Some(g.stream),
            (None, true) => return Err("fenced transfers need cuda".into()),
            _ => None,
        };
        // Keys: `keys` (hex, one per block, e.g. per-rank keys) or `key_base + round * stride + i`.
        let explicit: Option<Vec<ObjectKey>> = cmd["keys"].as_array().map(|a| {
            a.iter().map(|v| ObjectKey(v.as_str().and_then(|h| u128::from_str_radix(h, 16).ok()).unwrap_or(0))).collect()
        });
        if explicit.as_ref().is_some_and(|k| k.len() != blocks.len()) {
            return Err("xfer: `keys` must have one key per block".into());
        }
        let key = |r: u64, i: usize| match &explicit {
            Some(k) => k[i],
            None => ObjectKey((base + r * stride + i as u64) as u128),
        };
        let mut work: Vec<Vec<(ObjectKey, u64)>> = Vec::new();
        for r in 0..rounds {
            for chunk in blocks.iter().enumerate().collect::<Vec<_>>().chunks(per) {
                work.push(chunk.iter().map(|&(i, &b)| (key(r, i), b)).collect());
            }
        }
        let bytes = self.groups.get(&group).map_or(0, |g| g.object_bytes) * blocks.len() as u64 * rounds;
        let mut pending: std::collections::VecDeque<TransferId> = Default::default();
        let (mut ok, mut bad) = (0u64, 0u64);
        let mut statuses: std::collections::BTreeMap<String, u64> = Default::default();
        let mut tally = |c: Completion| {
            for s in &c.statuses {
                if s.is_ok() {
                    ok += 1;
                } else {
                    bad += 1;
                }
                *statuses.entry(format!("{s:?}")).or_default() += 1;
            }
            if let Some(e) = c.error {
                *statuses.entry(format!("error {e:?}")).or_default() += 1;
            }
        };
        let t = Instant::now();
        for job in &work {
            while pending.len() >= inflight {
                let id = pending.pop_front().expect("non-empty");
                tally(self.w.wait(id, Duration::from_secs(60)).ok_or("transfer timed out")?);
            }
            loop {
                let r = match (load, stream) {
                    (false, None) => self.w.store(group, job),
                    (true, None) => self.w.load(group, job),
                    (false, Some(s)) => self.w.store_after_stream(group, job, s),
                    (true, Some(s)) => self.w.load_before_stream(group, job, s),
                };
                match r {
                    Ok(id) => {
                        pending.push_back(id);
                        break;
                    }
                    Err(umbp_worker::WorkerError::Full) if !pending.is_empty() => {
                        let id = pending.pop_front().expect("non-empty");
                        tally(self.w.wait(id, Duration::from_secs(60)).ok_or("transfer timed out")?);
                    }
                    Err(e) => return Err(format!("submit: {e}")),
                }
            }
        }
        if let (Some(g), true) = (&self.gpu, fence && load) {
            // The stream passes its waits once every load landed: that is when the engine
            // could use the KV.
            g.sync()?;
        }
        let gpu_ns = t.elapsed().as_nanos() as u64;
        while let Some(id) = pending.pop_front() {
            tally(self.w.wait(id, Duration::from_secs(60)).ok_or("transfer timed out")?);
        }
        let ns = if fence && load { gpu_ns } else { t.elapsed().as_nanos() as u64 };
        Ok(json!({"ns": ns, "ok": ok, "bad": bad, "bytes": bytes, "statuses": statuses, "transfers": work.len()}))
    }

    fn baseline(&mut self, cmd: &Value) -> Result<Value, String> {
        let bytes = cmd["bytes"].as_u64().unwrap_or(MIB) as usize;
        let reps = cmd["reps"].as_u64().unwrap_or(5).max(1) as usize;
        let dir = cmd["dir"].as_str().unwrap_or("d2h");
        let ns = match &self.gpu {
            Some(g) => g.baseline(bytes, dir, reps)?,
            None => {
                let src = vec![1u8; bytes];
                let mut dst = vec![0u8; bytes];
                let mut v = Vec::new();
                for _ in 0..reps + 1 {
                    let t = Instant::now();
                    dst.copy_from_slice(&src);
                    std::hint::black_box(&mut dst);
                    v.push(t.elapsed().as_nanos() as f64);
                }
                v.remove(0);
                median(v) as u64
            }
        };
        Ok(json!({"ns": ns}))
    }

    /// Counts words of `blocks`' pages that differ from the pattern `seed` (or from the
    /// poison byte).
    fn verify(&mut self, group: u16, seed: u64, blocks: &[u64], poison: bool) -> Result<Value, String> {
        let g = self.groups.get(&group).ok_or("no such group")?;
        let (mut words, mut bad) = (0u64, 0u64);
        let mut first_bad = Value::Null;
        for s in &g.segments {
            let mem = &g.allocs.iter().find(|(id, _)| *id == s.alloc_id).ok_or("segment alloc")?.1;
            for &b in blocks {
                let off = s.offset + b * s.block_stride;
                let bytes = read_mem(self.gpu.as_ref(), mem, off as usize, s.page_bytes as usize)?;
                for (j, w) in bytes.chunks_exact(8).enumerate() {
                    let i = off / 8 + j as u64;
                    let got = u64::from_le_bytes(w.try_into().expect("8 bytes"));
                    let want = if poison { u64::from_ne_bytes([POISON; 8]) } else { word(seed, i) };
                    words += 1;
                    if got != want {
                        if bad == 0 {
                            first_bad = json!({"alloc": s.alloc_id, "word": i, "got": format!("{got:#x}"), "want": format!("{want:#x}")});
                        }
                        bad += 1;
                    }
                }
            }
        }
        Ok(json!({"words": words, "bad_words": bad, "first_bad": first_bad}))
    }

    /// Lookup through the scheduler's shared index, then load the hits; end to end.
    fn restore(&mut self, cmd: &Value) -> Result<Value, String> {
        let group = cmd["group"].as_u64().unwrap_or(0) as u16;
        let base = cmd["key_base"].as_u64().unwrap_or(0);
        let blocks = blocks_of(cmd);
        let keys: Vec<ObjectKey> = (0..blocks.len()).map(|i| ObjectKey((base + i as u64) as u128)).collect();
        let mut index = umbp_scheduler::IndexClient::connect(&self.socket, self.namespace, Duration::from_secs(5)).map_err(|e| e.to_string())?;
        let t = Instant::now();
        let hits = index.match_prefix(&keys);
        let lookup_ns = t.elapsed().as_nanos() as u64;
        let job: Vec<(ObjectKey, u64)> = keys.iter().copied().zip(blocks.iter().copied()).take(hits).collect();
        let id = self.w.load(group, &job).map_err(|e| e.to_string())?;
        let c = self.w.wait(id, Duration::from_secs(60)).ok_or("restore timed out")?;
        let ns = t.elapsed().as_nanos() as u64;
        Ok(json!({"ns": ns, "lookup_ns": lookup_ns, "hits": hits, "bad": c.statuses.iter().filter(|s| !s.is_ok()).count()}))
    }

    /// Stores `blocks` with fresh keys in a loop for `seconds` (resetting the namespace
    /// when the pool fills), one transfer in flight; for interference and the kill check.
    fn store_loop(&mut self, cmd: &Value, say: &dyn Fn(Value)) -> Result<Value, String> {
        let group = cmd["group"].as_u64().unwrap_or(0) as u16;
        let mut base = cmd["key_base"].as_u64().unwrap_or(0);
        let blocks = blocks_of(cmd);
        let secs = cmd["seconds"].as_f64().unwrap_or(1.0);
        let no_reset = cmd["no_reset"].as_bool().unwrap_or(false);
        let ob = self.groups.get(&group).map_or(0, |g| g.object_bytes);
        say(json!({"started": true}));
        let t = Instant::now();
        let mut bytes = 0u64;
        while t.elapsed().as_secs_f64() < secs {
            let job: Vec<(ObjectKey, u64)> = blocks.iter().enumerate().map(|(i, &b)| (ObjectKey((base + i as u64) as u128), b)).collect();
            base += blocks.len() as u64;
            let id = self.w.store(group, &job).map_err(|e| e.to_string())?;
            let c = self.w.wait(id, Duration::from_secs(60)).ok_or("store timed out")?;
            let stored = c.statuses.iter().filter(|s| **s == BlockStatus::Stored).count() as u64;
            bytes += stored * ob;
            if stored < blocks.len() as u64 && !no_reset {
                self.w.reset_namespace().map_err(|e| e.to_string())?;
            }
        }
        Ok(json!({"ns": t.elapsed().as_nanos() as u64, "bytes": bytes}))
    }

    fn fence_store(&mut self, cmd: &Value) -> Result<Value, String> {
        let group = cmd["group"].as_u64().unwrap_or(1) as u16;
        let old = cmd["old_seed"].as_u64().unwrap_or(3);
        let new = cmd["new_seed"].as_u64().unwrap_or(5);
        let spin_ns = cmd["spin_ms"].as_u64().unwrap_or(300) * 1_000_000;
        let gpu = self.gpu.as_ref().ok_or("needs cuda")?;
        let g = self.groups.get(&group).ok_or("no such group")?;
        let (ptr, len) = match &g.allocs[0].1 {
            Mem::Cuda { ptr, len } => (*ptr, *len),
            Mem::Host(_) => return Err("needs cuda memory".into()),
        };
        let n = g.segments[0].num_blocks;
        let job = |base: u64| -> Vec<(ObjectKey, u64)> { (0..n).map(|b| (ObjectKey((base + b) as u128), b)).collect() };
        // Fenced: the slow kernel writes `new` after spinning; the store is submitted at once.
        fill_pattern(Some(gpu), &g.allocs[0].1, old)?;
        let t = Instant::now();
        gpu.spin_fill(ptr, len, new, spin_ns)?;
        let id = self.w.store_after_stream(group, &job(cmd["key_base"].as_u64().unwrap_or(0)), gpu.stream).map_err(|e| e.to_string())?;
        let submit_us = t.elapsed().as_micros() as u64;
        let c = self.w.wait(id, Duration::from_secs(30)).ok_or("fenced store timed out")?;
        let done_ms = t.elapsed().as_millis() as u64;
        gpu.sync()?;
        // Control: the same without the fence.
        let gpu = self.gpu.as_ref().expect("checked");
        let g = self.groups.get(&group).expect("checked");
        fill_pattern(Some(gpu), &g.allocs[0].1, old)?;
        gpu.spin_fill(ptr, len, new, spin_ns)?;
        let id2 = self.w.store(group, &job(cmd["control_key_base"].as_u64().unwrap_or(1))).map_err(|e| e.to_string())?;
        let c2 = self.w.wait(id2, Duration::from_secs(30)).ok_or("control store timed out")?;
        self.gpu.as_ref().expect("checked").sync()?;
        Ok(json!({"bad": c.statuses.iter().filter(|s| !s.is_ok()).count(), "submit_us": submit_us,
            "completed_after_ms": done_ms, "kernel_spin_ms": spin_ns / 1_000_000,
            "control_bad": c2.statuses.iter().filter(|s| !s.is_ok()).count()}))
    }

    fn fence_load(&mut self, cmd: &Value) -> Result<Value, String> {
        let group = cmd["group"].as_u64().unwrap_or(1) as u16;
        let seed = cmd["seed"].as_u64().unwrap_or(5);
        let base = cmd["key_base"].as_u64().unwrap_or(0);
        let gpu = self.gpu.as_ref().ok_or("needs cuda")?;
        let g = self.groups.get(&group).ok_or("no such group")?;
        let (ptr, len) = match &g.allocs[0].1 {
            Mem::Cuda { ptr, len } => (*ptr, *len),
            Mem::Host(_) => return Err("needs cuda memory".into()),
        };
        let n = g.segments[0].num_blocks;
        let job: Vec<(ObjectKey, u64)> = (0..n).map(|b| (ObjectKey((base + b) as u128), b)).collect();
        fill_poison(Some(gpu), &g.allocs[0].1)?;
        let id = self.w.load_before_stream(group, &job, gpu.stream).map_err(|e| e.to_string())?;
        let gpu = self.gpu.as_ref().expect("checked");
        let bad_words = gpu.check_pattern(ptr, len, seed)?;
        let c = self.w.wait(id, Duration::from_secs(30)).ok_or("fenced load timed out")?;
        // Control: plain load, kernel launched right after the submission.
        let g = self.groups.get(&group).expect("checked");
        fill_poison(Some(gpu), &g.allocs[0].1)?;
        let id2 = self.w.load(group, &job).map_err(|e| e.to_string())?;
        let gpu = self.gpu.as_ref().expect("checked");
        let control_bad_words = gpu.check_pattern(ptr, len, seed)?;
        let c2 = self.w.wait(id2, Duration::from_secs(30)).ok_or("control load timed out")?;
        Ok(json!({"bad_words": bad_words, "words": len / 8, "load_bad": c.statuses.iter().filter(|s| !s.is_ok()).count(),
            "control_bad_words": control_bad_words, "control_load_bad": c2.statuses.iter().filter(|s| !s.is_ok()).count()}))
    }
}

fn pattern_bytes(seed: u64, first_word: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    for j in 0..(len / 8) as u64 {
        v.extend_from_slice(&word(seed, first_word + j).to_le_bytes());
    }
    v
}

fn fill_pattern(gpu: Option<&cu::Gpu>, mem: &Mem, seed: u64) -> Result<(), String> {
    const STEP: usize = 64 << 20;
    let len = mem.len();
    let mut off = 0;
    while off < len {
        let n = STEP.min(len - off);
        let bytes = pattern_bytes(seed, (off / 8) as u64, n);
        match mem {
            Mem::Host(m) => {
                // SAFETY: inside our own mapping of `len` bytes; nobody else writes it now
                // (the pool copies only while a transfer runs).
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), m.as_ptr().add(off), n) };
            }
            Mem::Cuda { ptr, .. } => gpu.ok_or("cuda memory without gpu")?.htod(ptr + off as u64, &bytes)?,
        }
        off += n;
    }
    Ok(())
}

fn fill_poison(gpu: Option<&cu::Gpu>, mem: &Mem) -> Result<(), String> {
    match mem {
        // SAFETY: our own mapping, written only by us or by the pool during a load.
        Mem::Host(m) => unsafe { std::ptr::write_bytes(m.as_ptr(), POISON, m.len()) },
        Mem::Cuda { ptr, len } => gpu.ok_or("cuda memory without gpu")?.memset(*ptr, POISON, *len)?,
    }
    Ok(())
}

fn read_mem(gpu: Option<&cu::Gpu>, mem: &Mem, off: usize, len: usize) -> Result<Vec<u8>, String> {
    if off + len > mem.len() {
        return Err("read past the allocation".into());
    }
    match mem {
        Mem::Host(m) => {
            let mut v = vec![0u8; len];
            // SAFETY: inside our mapping (checked above).
            unsafe { std::ptr::copy_nonoverlapping(m.as_ptr().add(off), v.as_mut_ptr(), len) };
            Ok(v)
        }
        Mem::Cuda { ptr, .. } => gpu.ok_or("cuda memory without gpu")?.dtoh(ptr + off as u64, len),
    }
}

/// The CUDA side of a worker child: its context, stream, kernels and baselines.
mod cu {
    use std::ffi::{c_void, CString};
    use std::time::Instant;

    use serde_json::{json, Value};
    use umbp_gpu::cuda::sys::{self, CUcontext, CUdeviceptr, CUfunction, CUmodule, CUresult, CUstream};

    /// PTX both kernels share, so the pattern they write and check is one piece of text: a
    /// grid-stride loop over word indices `%rd8` (stride `%rd10`) below `%rd2` (nwords),
    /// leaving word `%rd8` of pattern `%rd3` (seed; as `super::word`) in `%rd12` and its
    /// address in `%rd1` (buf) in `%rd13`. The kernel's own step follows, then
    /// `ptx_next_word!`.
    macro_rules! ptx_for_each_pattern_word {
        () => {
            r#"    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    mul.wide.u32 %rd8, %r1, %r2;
    cvt.u64.u32 %rd9, %r3;
    add.u64 %rd8, %rd8, %rd9;
    mul.wide.u32 %rd10, %r4, %r2;
    shl.b64 %rd11, %rd3, 40;
    mov.u64 %rd14, 6364136223846793005;
LOOP:
    setp.ge.u64 %p2, %rd8, %rd2;
    @%p2 bra DONE;
    xor.b64 %rd12, %rd8, %rd11;
    mul.lo.u64 %rd12, %rd12, %rd14;
    add.u64 %rd12, %rd12, %rd3;
    shl.b64 %rd13, %rd8, 3;
    add.u64 %rd13, %rd1, %rd13;
"#
        };
    }

    /// Closes `ptx_for_each_pattern_word!` and the kernel.
    macro_rules! ptx_next_word {
        () => {
            r#"    add.u64 %rd8, %rd8, %rd10;
    bra LOOP;
DONE:
    ret;
}
"#
        };
    }

    /// `spin_fill(buf, nwords, seed, spin_ns)`: every thread spins on %globaltimer for
    /// `spin_ns`, then the grid writes the pattern (`super::word`) over `nwords` words.
    /// `check_pattern(buf, nwords, seed, bad)`: counts words that differ into `*bad`.
    /// Hand-written PTX so nothing here needs nvcc; the driver JIT-compiles it.
    const PTX: &str = concat!(
        r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry spin_fill(.param .u64 p_buf, .param .u64 p_n, .param .u64 p_seed, .param .u64 p_spin)
{
    .reg .pred %p<3>;
    .reg .b32 %r<6>;
    .reg .b64 %rd<16>;
    ld.param.u64 %rd1, [p_buf];
    ld.param.u64 %rd2, [p_n];
    ld.param.u64 %rd3, [p_seed];
    ld.param.u64 %rd4, [p_spin];
    mov.u64 %rd5, %globaltimer;
    add.u64 %rd6, %rd5, %rd4;
SPIN:
    mov.u64 %rd7, %globaltimer;
    setp.lt.u64 %p1, %rd7, %rd6;
    @%p1 bra SPIN;
"#,
        ptx_for_each_pattern_word!(),
        r#"    st.global.u64 [%rd13], %rd12;
"#,
        ptx_next_word!(),
        r#"
.visible .entry check_pattern(.param .u64 p_buf, .param .u64 p_n, .param .u64 p_seed, .param .u64 p_bad)
{
    .reg .pred %p<4>;
    .reg .b32 %r<6>;
    .reg .b64 %rd<18>;
    ld.param.u64 %rd1, [p_buf];
    ld.param.u64 %rd2, [p_n];
    ld.param.u64 %rd3, [p_seed];
    ld.param.u64 %rd4, [p_bad];
"#,
        ptx_for_each_pattern_word!(),
        r#"    ld.global.u64 %rd15, [%rd13];
    setp.ne.u64 %p3, %rd15, %rd12;
    @%p3 atom.global.add.u64 %rd16, [%rd4], 1;
"#,
        ptx_next_word!(),
    );

    fn ck(call: &str, r: CUresult) -> Result<(), String> {
        if r == CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(format!("{call} failed: {r:?}"))
        }
    }

    pub struct Gpu {
        /// Device 0's primary context, current on the worker's thread.
        _ctx: CUcontext,
        pub stream: u64,
        pub name: String,
        module: Option<(CUfunction, CUfunction)>,
        bad: CUdeviceptr,
    }

    impl Gpu {
        pub fn new() -> Result<Self, String> {
            umbp_gpu::cuda::init().map_err(|e| e.to_string())?;
            let name = umbp_gpu::cuda::device_name(0).unwrap_or_default();
            let mut ctx: CUcontext = std::ptr::null_mut();
            let mut stream: CUstream = std::ptr::null_mut();
            let mut bad: CUdeviceptr = 0;
            // SAFETY: plain driver calls with out-pointers to locals; the primary context
            // of device 0 stays retained (and current on this thread) for the process.
            unsafe {
                let mut dev = 0;
                ck("cuDeviceGet", sys::cuDeviceGet(&mut dev, 0))?;
                ck("cuDevicePrimaryCtxRetain", sys::cuDevicePrimaryCtxRetain(&mut ctx, dev))?;
                ck("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx))?;
                ck("cuStreamCreate", sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32))?;
                ck("cuMemAlloc", sys::cuMemAlloc_v2(&mut bad, 8))?;
            }
            let module = Self::load_module().map_err(|e| eprintln!("worker: PTX kernels unavailable: {e}")).ok();
            Ok(Gpu { _ctx: ctx, stream: stream as u64, name, module, bad })
        }

        fn load_module() -> Result<(CUfunction, CUfunction), String> {
            let src = CString::new(PTX).expect("no NUL in PTX");
            let mut m: CUmodule = std::ptr::null_mut();
            let (mut f1, mut f2): (CUfunction, CUfunction) = (std::ptr::null_mut(), std::ptr::null_mut());
            // SAFETY: a NUL-terminated PTX image; out-pointers to locals; the module is
            // never unloaded (functions stay valid for the process).
            unsafe {
                ck("cuModuleLoadData", sys::cuModuleLoadData(&mut m, src.as_ptr().cast()))?;
                ck("cuModuleGetFunction(spin_fill)", sys::cuModuleGetFunction(&mut f1, m, c"spin_fill".as_ptr()))?;
                ck("cuModuleGetFunction(check_pattern)", sys::cuModuleGetFunction(&mut f2, m, c"check_pattern".as_ptr()))?;
            }
            Ok((f1, f2))
        }

        fn cs(&self) -> CUstream {
            self.stream as CUstream
        }

        pub fn alloc(&self, len: usize) -> Result<u64, String> {
            let mut p: CUdeviceptr = 0;
            // SAFETY: out-pointer to a local; never freed (the pool may hold an IPC
            // mapping of it until this process exits).
            ck("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut p, len) })?;
            Ok(p)
        }

        pub fn htod(&self, dst: u64, src: &[u8]) -> Result<(), String> {
            // SAFETY: `dst..+len` lies in one of our allocations (callers check), `src` is
            // a live slice; synchronous copy.
            ck("cuMemcpyHtoD", unsafe { sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len()) })
        }

        pub fn dtoh(&self, src: u64, len: usize) -> Result<Vec<u8>, String> {
            let mut v = vec![0u8; len];
            // SAFETY: as htod, reversed.
            ck("cuMemcpyDtoH", unsafe { sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), src, len) })?;
            Ok(v)
        }

        pub fn memset(&self, dst: u64, byte: u8, len: usize) -> Result<(), String> {
            // SAFETY: inside one of our allocations; synchronous.
            ck("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(dst, byte, len) })
        }

        pub fn sync(&self) -> Result<(), String> {
            // SAFETY: our live stream.
            ck("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(self.cs()) })
        }

        fn launch(&self, f: CUfunction, args: &mut [u64; 4]) -> Result<(), String> {
            let mut params: Vec<*mut c_void> = args.iter_mut().map(|a| (a as *mut u64).cast()).collect();
            // SAFETY: the kernel takes four 8-byte parameters, pointed to by `params`,
            // which outlive the call (the driver copies them at launch).
            ck("cuLaunchKernel", unsafe {
                sys::cuLaunchKernel(f, 264, 1, 1, 256, 1, 1, 0, self.cs(), params.as_mut_ptr(), std::ptr::null_mut())
            })
        }

        /// Enqueues (without waiting) the slow kernel that writes pattern `seed`.
        pub fn spin_fill(&self, ptr: u64, len: usize, seed: u64, spin_ns: u64) -> Result<(), String> {
            let (f, _) = self.module.ok_or("PTX kernels unavailable")?;
            self.launch(f, &mut [ptr, (len / 8) as u64, seed, spin_ns])
        }

        /// Enqueues the checking kernel right away, then waits for the stream; returns the
        /// number of words that differed from pattern `seed` when the kernel read them.
        pub fn check_pattern(&self, ptr: u64, len: usize, seed: u64) -> Result<u64, String> {
            let (_, f) = self.module.ok_or("PTX kernels unavailable")?;
            // SAFETY: our 8-byte counter, reset asynchronously in stream order.
            ck("cuMemsetD8Async", unsafe { sys::cuMemsetD8Async(self.bad, 0, 8, self.cs()) })?;
            self.launch(f, &mut [ptr, (len / 8) as u64, seed, self.bad])?;
            self.sync()?;
            let v = self.dtoh(self.bad, 8)?;
            Ok(u64::from_le_bytes(v.try_into().expect("8 bytes")))
        }

        /// Median time of a contiguous pinned copy of `bytes` ("d2h", "h2d", or "bidir":
        /// both at once on two streams).
        pub fn baseline(&self, bytes: usize, dir: &str, reps: usize) -> Result<u64, String> {
            let mut host: *mut c_void = std::ptr::null_mut();
            let mut dev: CUdeviceptr = 0;
            let mut host2: *mut c_void = std::ptr::null_mut();
            let mut dev2: CUdeviceptr = 0;
            let mut s2: CUstream = std::ptr::null_mut();
            let bidir = dir == "bidir";
            // SAFETY: allocations of `bytes` each, freed below; copies stay inside them.
            unsafe {
                ck("cuMemAllocHost", sys::cuMemAllocHost_v2(&mut host, bytes))?;
                ck("cuMemAlloc", sys::cuMemAlloc_v2(&mut dev, bytes))?;
                if bidir {
                    ck("cuMemAllocHost", sys::cuMemAllocHost_v2(&mut host2, bytes))?;
                    ck("cuMemAlloc", sys::cuMemAlloc_v2(&mut dev2, bytes))?;
                    ck("cuStreamCreate", sys::cuStreamCreate(&mut s2, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32))?;
                }
                std::ptr::write_bytes(host.cast::<u8>(), 1, bytes);
            }
            let mut times = Vec::new();
            for _ in 0..reps + 1 {
                let t = Instant::now();
                // SAFETY: the buffers above, `bytes` long.
                unsafe {
                    match dir {
                        "h2d" => ck("cuMemcpyHtoDAsync", sys::cuMemcpyHtoDAsync_v2(dev, host, bytes, self.cs()))?,
                        _ => ck("cuMemcpyDtoHAsync", sys::cuMemcpyDtoHAsync_v2(host, dev, bytes, self.cs()))?,
                    }
                    if bidir {
                        ck("cuMemcpyHtoDAsync", sys::cuMemcpyHtoDAsync_v2(dev2, host2, bytes, s2))?;
                        ck("cuStreamSynchronize", sys::cuStreamSynchronize(s2))?;
                    }
                }
                self.sync()?;
                times.push(t.elapsed().as_nanos() as f64);
            }
            times.remove(0);
            // SAFETY: frees what was allocated above; nothing is in flight.
            unsafe {
                sys::cuMemFreeHost(host);
                sys::cuMemFree_v2(dev);
                if bidir {
                    sys::cuMemFreeHost(host2);
                    sys::cuMemFree_v2(dev2);
                    sys::cuStreamDestroy_v2(s2);
                }
            }
            Ok(super::median(times) as u64)
        }

        /// Contiguous pinned device-to-host copies for `seconds` (interference baseline).
        pub fn memcpy_loop(&self, bytes: usize, seconds: f64) -> Result<Value, String> {
            let mut host: *mut c_void = std::ptr::null_mut();
            let mut dev: CUdeviceptr = 0;
            // SAFETY: as in baseline.
            unsafe {
                ck("cuMemAllocHost", sys::cuMemAllocHost_v2(&mut host, bytes))?;
                ck("cuMemAlloc", sys::cuMemAlloc_v2(&mut dev, bytes))?;
            }
            let t = Instant::now();
            let mut moved = 0u64;
            while t.elapsed().as_secs_f64() < seconds {
                // SAFETY: the buffers above.
                unsafe { ck("cuMemcpyDtoHAsync", sys::cuMemcpyDtoHAsync_v2(host, dev, bytes, self.cs()))? };
                self.sync()?;
                moved += bytes as u64;
            }
            let ns = t.elapsed().as_nanos() as u64;
            // SAFETY: frees the buffers above; nothing in flight.
            unsafe {
                sys::cuMemFreeHost(host);
                sys::cuMemFree_v2(dev);
            }
            Ok(json!({"ns": ns, "bytes": moved}))
        }
    }
}

/// Command line of `umbp-bench transfer` (kept here so the entry point only registers it).
#[derive(clap::Args, Debug)]
pub struct TransferCli {
    /// Worker memory: a host memfd, or CUDA device memory.
    #[arg(long, value_enum, default_value_t = BackendArg::Host)]
    backend: BackendArg,
    /// Run the multi-process correctness checks instead of measuring.
    #[arg(long)]
    check: bool,
    /// Smaller sizes (quick look, CI machines).
    #[arg(long)]
    quick: bool,
    /// Pool DRAM, e.g. 8GiB (default: 10 GiB for cuda, 2 GiB for host; 1.5 GiB with --quick).
    #[arg(long)]
    capacity: Option<String>,
    /// Timed repetitions per case (median reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Attach to this running umbp-pool instead of starting one in-process.
    #[arg(long)]
    pool_socket: Option<PathBuf>,
    /// Matmul loop for interference_pct (cuda), e.g. "python3 scripts/device/matmul_loop.py".
    #[arg(long)]
    matmul: Option<String>,
    /// Sweep copy streams, stage sizes and batching on the main layout, then use the best.
    #[arg(long)]
    sweep: bool,
    /// cuda: measure only the gpt-oss layout (store, load, restore, fenced), not the object
    /// table, bidirectional and interference cases.
    #[arg(long)]
    layout_only: bool,
    /// cuda: one worker per GPU (needs 2+): TP2 store/restore byte-exact with per-rank keys,
    /// then store/load GB/s of each GPU alone and of both at once, beside host memcpy.
    #[arg(long)]
    multi_gpu: bool,
    /// Copy streams per copy call (default 1 or UMBP_COPY_STREAMS).
    #[arg(long)]
    streams: Option<usize>,
    /// Submit copies one call each instead of batched.
    #[arg(long)]
    no_batch: bool,
    /// One JSON object per case and line.
    #[arg(long)]
    json: bool,
}

impl TransferCli {
    pub fn run(self) -> std::io::Result<()> {
        self.run_inner().map_err(std::io::Error::other)
    }

    fn run_inner(self) -> Result<(), String> {
        init_logs();
        if self.streams.is_some() || self.no_batch {
            let (s, _) = umbp_gpu::tuning();
            umbp_gpu::set_tuning(self.streams.unwrap_or(s), !self.no_batch);
        }
        let default_cap = match (self.backend, self.quick) {
            (_, true) => "1536MiB",
            (BackendArg::Cuda, false) => "10GiB",
            (BackendArg::Host, false) => "2GiB",
        };
        let capacity = umbp_pool::parse_size("--capacity", self.capacity.as_deref().unwrap_or(default_cap)).map_err(|e| e.to_string())?;
        let args = TransferArgs {
            backend: self.backend,
            check: self.check,
            quick: self.quick,
            capacity,
            reps: self.reps.max(1),
            pool_socket: self.pool_socket,
            layout_only: self.layout_only,
            multi_gpu: self.multi_gpu,
            matmul: self.matmul,
            sweep: self.sweep,
        };
        let cases = run(&args)?;
        if !cases.is_empty() {
            super::report::print(&cases, self.json);
        }
        Ok(())
    }
}

/// Pool and worker logs on stderr (RUST_LOG, default: warnings, pool progress).
fn init_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,umbp_pool::dram=info"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

/// Internal: a worker process of `transfer`.
#[derive(clap::Args, Debug)]
pub struct TransferWorkerCli {
    #[arg(long)]
    socket: PathBuf,
    #[arg(long, value_enum)]
    backend: BackendArg,
    #[arg(long)]
    namespace: u128,
}

impl TransferWorkerCli {
    pub fn run(self) -> std::io::Result<()> {
        init_logs();
        worker_main(&self.socket, self.backend, self.namespace).map_err(std::io::Error::other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without CUDA (CI), stream-ordered transfers refuse with a reason and submit nothing;
    /// the GPU behaviour is checked on a GPU machine by scripts/device/run-gpu-tests.sh.
    #[test]
    fn without_cuda_stream_ordered_transfers_refuse_cleanly() {
        if umbp_gpu::cuda::device_count().is_ok_and(|n| n > 0) {
            eprintln!("SKIPPED: a CUDA device is present; the GPU checks cover this path");
            return;
        }
        let dir = std::env::temp_dir().join(format!("umbp-fence-test-{}", std::process::id()));
        let socket = dir.join("pool.sock");
        let pool = umbp_pool::Pool::start(umbp_pool::PoolConfig {
            socket_path: socket.clone(),
            capacity_bytes: 64 << 20,
            min_object_bytes: 4096,
            ..Default::default()
        })
        .expect("pool");
        let mut w = Worker::connect(WorkerConfig::new(&socket, 7)).expect("connect");
        let mut kv = vec![0u8; 16 << 10];
        // SAFETY: `kv` lives to the end of the test and no transfer ever runs.
        let alloc = unsafe { w.register_memory(MemorySpec::HostProcess { ptr: kv.as_mut_ptr() as usize, len: kv.len() }) }
            .expect("register");
        w.register_layout(0, vec![Segment::new(alloc, 0, 4096, 4096, 4)]).expect("layout");
        let e = w.store_after_stream(0, &[(ObjectKey(1), 0)], 0).unwrap_err();
        assert!(e.to_string().contains("CUDA"), "{e}");
        let e = w.load_before_stream(0, &[(ObjectKey(1), 0)], 0).unwrap_err();
        assert!(e.to_string().contains("CUDA"), "{e}");
        assert!(!w.fences_ready());
        assert_eq!(w.pending(), 0, "nothing was submitted");
        // Empty transfers need no fence and complete at once.
        w.store_after_stream(0, &[], 0).expect("empty store");
        drop(w);
        drop(pool);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn scattered_blocks_are_a_permutation() {
        let b = scattered(313, 512);
        let mut s = b.clone();
        s.sort_unstable();
        s.dedup();
        assert_eq!(s.len(), 313, "no block twice");
        assert!(b.iter().all(|&x| x < 512));
        assert!(b.windows(2).any(|w| w[1] != w[0] + 1), "not simply consecutive");
    }

    #[test]
    fn gpt_oss_layout_matches_the_model() {
        let l = gpt_oss(false);
        assert_eq!(l.page, 32 * 8 * 64 * 2 * 2, "32 tokens x 8 KV heads x 64 x (K+V) x bf16");
        assert_eq!(l.blocks.len(), 313, "10,000 tokens in 32-token blocks");
        assert_eq!(l.object_bytes(), 24 << 16);
    }

    #[test]
    fn pattern_is_position_and_seed_dependent() {
        assert_ne!(word(1, 0), word(2, 0));
        assert_ne!(word(1, 0), word(1, 1));
        let b = pattern_bytes(3, 10, 16);
        assert_eq!(&b[..8], &word(3, 10).to_le_bytes());
        assert_eq!(&b[8..], &word(3, 11).to_le_bytes());
    }
}
