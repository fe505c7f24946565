//! The measured cases of `umbp-bench transfer` (host and cuda backends), each beside a
//! contiguous-copy baseline measured in the same run, and the byte-exactness check of every
//! layout measured (a poisoned destination loaded back; a failure fails the run).

use serde_json::{json, Value};
use umbp_pool::PoolConfig;

use super::command::{Command, CopyDir, Op, Xfer};
use super::interference::interference;
use super::parent::{phase_means, push_out_of_dram, start_pool, xfer, xfer_with, CopyTuning, PoolHandle, WorkerProc};
use super::{gbps, gpt_oss, median, small_page_layouts, u64_of, BackendArg, Layout, TransferArgs, MIB, NS};
use crate::report::{Better, Case};

fn host_note() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| c.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string()))
        .unwrap_or_default()
}

/// Same-run contiguous baselines of one byte count.
struct Base {
    /// GB/s of the store direction (cuda: pinned DtoH; host: one memcpy).
    store: f64,
    /// GB/s of the load direction (cuda: pinned HtoD; host: one memcpy).
    load: f64,
    /// ns of the load-direction copy (the restore baseline).
    load_ns: u64,
    store_name: &'static str,
    load_name: &'static str,
    /// Host: GB/s of a memcpy split over the pool's copy-thread count, and that count.
    mt: Option<(f64, usize)>,
}

impl Base {
    fn measure(a: &mut WorkerProc, backend: BackendArg, bytes: u64, reps: usize, copy_threads: usize) -> Result<Self, String> {
        let ns = |a: &mut WorkerProc, dir, threads| -> Result<u64, String> {
            Ok(u64_of(&a.call(&Command::Baseline { bytes, dir, reps, threads })?, "ns"))
        };
        Ok(match backend {
            BackendArg::Host => {
                let one = ns(a, CopyDir::D2h, 1)?;
                let mt = ns(a, CopyDir::D2h, copy_threads)?;
                let name = "one memcpy of the same bytes";
                Base {
                    store: gbps(bytes, one),
                    load: gbps(bytes, one),
                    load_ns: one,
                    store_name: name,
                    load_name: name,
                    mt: Some((gbps(bytes, mt), copy_threads)),
                }
            }
            BackendArg::Cuda => {
                let d = ns(a, CopyDir::D2h, 1)?;
                let h = ns(a, CopyDir::H2d, 1)?;
                Base {
                    store: gbps(bytes, d),
                    load: gbps(bytes, h),
                    load_ns: h,
                    store_name: "contiguous pinned cuMemcpyDtoH, same bytes",
                    load_name: "contiguous pinned cuMemcpyHtoD, same bytes",
                    mt: None,
                }
            }
        })
    }

    /// A restore case: the median of `ms` against the load-direction copy of the same bytes.
    fn restore_case(&self, name: &str, ms: Vec<f64>) -> Case {
        Case::new("transfer", name, median(ms), "ms", self.load_ns as f64 / 1e6, self.load_name, Better::Lower)
    }

    /// The store- or load-direction case of `value` GB/s, with the host's second baseline
    /// (`baseline_mt`, `baseline_mt_name`, `speedup_mt`) where there is one.
    fn case(&self, name: &str, op: Op, value: f64) -> Case {
        let (b, bn) = match op {
            Op::Store => (self.store, self.store_name),
            Op::Load => (self.load, self.load_name),
        };
        let c = Case::new("transfer", name, value, "GB/s", b, bn, Better::Higher);
        match self.mt {
            Some((mt, threads)) => c
                .extra("baseline_mt", (mt * 1000.0).round() / 1000.0)
                .extra("baseline_mt_name", format!("memcpy of the same bytes split over {threads} threads (the pool's copy threads)"))
                .extra("speedup_mt", if mt > 0.0 { (value / mt * 100.0).round() / 100.0 } else { f64::NAN }),
            None => c,
        }
    }
}

/// Byte-exactness of `l` (group `group`, memory filled with pattern `seed`): every byte of
/// the worker's memory is poisoned, the blocks stored under keys `key..` are loaded, and
/// every word compared: the pattern in the prefix's pages (placed by the layout's shape),
/// poison everywhere else. Refills the pattern afterwards. An error (the run fails) when
/// one word differs.
fn check_exact(a: &mut WorkerProc, l: &Layout, group: u16, key: u64, seed: u64) -> Result<Value, String> {
    a.call(&Command::Poison { group })?;
    xfer(a, Op::Load, group, key, &l.blocks, l.blocks.len(), 1)?;
    let v = a.call(&Command::VerifyAll { group, seed, blocks: l.blocks.clone() })?;
    a.call(&Command::Fill { group, seed })?;
    let want_words = l.bytes() / 8;
    if u64_of(&v, "bad_words") != 0 || u64_of(&v, "prefix_words") != want_words {
        return Err(format!("layout {}: load into poisoned memory is not byte-exact: {v}", l.name));
    }
    Ok(json!({"byte_exact": true, "prefix_words": want_words, "words_checked": u64_of(&v, "words")}))
}

/// What the in-process pool's GPU copy calls took during timed transfers (none on the host
/// backend or with an external pool), per direction, beside the end-to-end figures: a
/// submission's time outside its copy call is the pool's and the rings'.
#[derive(Default)]
struct EngineTime {
    ops: u64,
    calls: u64,
    bytes: u64,
    total_ns: u64,
    enqueue_ns: u64,
}

impl EngineTime {
    /// Runs `f` (one timed transfer) and adds the engine counters it moved.
    fn around<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let e0 = engine_totals();
        let r = f();
        let e1 = engine_totals();
        self.ops += 1;
        self.calls += e1.calls - e0.calls;
        self.bytes += e1.bytes - e0.bytes;
        self.total_ns += e1.total_ns - e0.total_ns;
        self.enqueue_ns += e1.enqueue_ns - e0.enqueue_ns;
        r
    }

    fn json(&self) -> Value {
        if self.calls == 0 {
            return Value::Null;
        }
        json!({
            "calls_per_transfer": self.calls as f64 / self.ops as f64,
            "us_per_call": self.total_ns as f64 / self.calls as f64 / 1e3,
            "enqueue_us_per_call": self.enqueue_ns as f64 / self.calls as f64 / 1e3,
            "gbps_in_calls": gbps(self.bytes, self.total_ns),
        })
    }
}

/// Store and load GB/s of `l` (`per` blocks a transfer, `inflight` outstanding; median of
/// `reps`), the restore of the prefix (scheduler lookup + one load) in ms, and the
/// byte-exactness check; cases `<name>_store_gbps`, `<name>_load_gbps`, `<name>_restore_ms`
/// (`<name>`: `name`, else the layout's).
#[allow(clippy::too_many_arguments)]
fn layout_cases(
    args: &TransferArgs,
    a: &mut WorkerProc,
    l: &Layout,
    group: u16,
    key0: u64,
    per: usize,
    inflight: usize,
    name: Option<&str>,
    pool: &PoolHandle,
    ctx: &dyn Fn(Case) -> Case,
) -> Result<Vec<Case>, String> {
    let seed = 40 + group as u64;
    l.setup(a, group, seed)?;
    let bytes = l.bytes();
    let base = Base::measure(a, args.backend, bytes, args.reps.max(3), args.copy_threads)?;
    let (mut st, mut ld) = (Vec::new(), Vec::new());
    let (mut est, mut eld) = (EngineTime::default(), EngineTime::default());
    // Warm up as the gpt-oss cases do: the first transfers of a layout in a process ran up
    // to 10 % slower, which is not what a running pool sees
    // (docs/history/benchmarks-2026-11.md, seventh pass).
    a.call(&Command::Reset)?;
    xfer(a, Op::Store, group, key0 + 999_000_000, &l.blocks, per, inflight)?;
    xfer(a, Op::Load, group, key0 + 999_000_000, &l.blocks, per, inflight)?;
    let p0 = pool.phases();
    let mut key = key0;
    for r in 0..args.reps as u64 {
        a.call(&Command::Reset)?;
        key = key0 + r * 1_000_000;
        st.push(gbps(bytes, u64_of(&est.around(|| xfer(a, Op::Store, group, key, &l.blocks, per, inflight))?, "ns")));
        ld.push(gbps(bytes, u64_of(&eld.around(|| xfer(a, Op::Load, group, key, &l.blocks, per, inflight))?, "ns")));
    }
    let phases = phase_means(&p0, &pool.phases());
    let cold =
        restores(a, pool, group, key, &l.blocks, args.reps.max(3), false).map_err(|e| format!("restore of layout {}: {e}", l.name))?;
    let warm =
        restores(a, pool, group, key, &l.blocks, args.reps.max(3), true).map_err(|e| format!("restore of layout {}: {e}", l.name))?;
    let exact = check_exact(a, l, group, key, seed)?;
    a.call(&Command::Reset)?;
    let pages = l.blocks.len() as u64 * l.shape.layers * l.shape.segments_per_layer;
    let lay = |c: Case| {
        ctx(c)
            .extra("layout", l.about)
            .extra("bytes", bytes)
            .extra("blocks", l.blocks.len())
            .extra("pages", pages)
            .extra("page_bytes", l.shape.page)
            .extra("layers", l.shape.layers)
            .extra("blocks_per_transfer", per)
            .extra("inflight", inflight)
    };
    let name = name.unwrap_or(l.name);
    let restore_name = format!("{name}_restore_ms");
    Ok(vec![
        lay(base.case(&format!("{name}_store_gbps"), Op::Store, median(st)))
            .extra("engine", est.json())
            .extra("pool_phases_us", phases["store"].clone())
            .extra("service_wakeups_per_job", phases["service_wakeups_per_job"].clone()),
        lay(base.case(&format!("{name}_load_gbps"), Op::Load, median(ld)))
            .extra("check", exact)
            .extra("engine", eld.json())
            .extra("pool_phases_us", phases["load"].clone())
            .extra("service_wakeups_per_job", phases["service_wakeups_per_job"].clone()),
        lay(cold.case(&restore_name, &base)).extra("tokens", args.tokens),
        lay(warm.case(&format!("{name}_restore_warm_ms"), &base)).extra("tokens", args.tokens),
    ])
}

/// Restores of one prefix (a scheduler's lookup, then one load of the hits, end to end).
struct Restores {
    ms: Vec<f64>,
    lookup_us: Vec<f64>,
    /// The worker's load call (building and posting the submission).
    submit_us: Vec<f64>,
    /// Share of the restores that found the pool asleep (its service thread woken).
    wakeups: Value,
    /// The pool's load phases over these restores (`first_stage_us`: before the first byte).
    phases: Value,
    keep_index: bool,
}

impl Restores {
    fn case(&self, name: &str, base: &Base) -> Case {
        base.restore_case(name, self.ms.clone())
            .extra("lookup_us", median(self.lookup_us.clone()))
            .extra("submit_us", median(self.submit_us.clone()))
            .extra("service_wakeups_per_job", self.wakeups.clone())
            .extra("pool_phases_us", self.phases["load"].clone())
            .extra(
                "index_client",
                if self.keep_index { "kept: connected once, restores back to back" } else { "connected for each restore" },
            )
    }
}

/// `n` restores of `blocks` stored at `key`; with `keep_index` the worker's index client
/// stays connected (one untimed restore connects it first), as an engine's scheduler does.
fn restores(
    a: &mut WorkerProc,
    pool: &PoolHandle,
    group: u16,
    key: u64,
    blocks: &[u64],
    n: usize,
    keep_index: bool,
) -> Result<Restores, String> {
    let restore = |a: &mut WorkerProc| -> Result<Value, String> {
        let r = a.call(&Command::Restore { group, key_base: key, blocks: blocks.to_vec(), keep_index })?;
        if u64_of(&r, "hits") != blocks.len() as u64 || u64_of(&r, "bad") != 0 {
            return Err(format!("restore: {r}"));
        }
        Ok(r)
    };
    if keep_index {
        restore(a)?;
    }
    let p0 = pool.phases();
    let (mut ms, mut lookup_us, mut submit_us) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..n {
        let r = restore(a)?;
        ms.push(u64_of(&r, "ns") as f64 / 1e6);
        lookup_us.push(u64_of(&r, "lookup_ns") as f64 / 1e3);
        submit_us.push(u64_of(&r, "submit_ns") as f64 / 1e3);
    }
    let phases = phase_means(&p0, &pool.phases());
    Ok(Restores { ms, lookup_us, submit_us, wakeups: phases["service_wakeups_per_job"].clone(), phases, keep_index })
}

/// The single-object table: objects of `--sizes` MiB, one and eight in flight, both ways,
/// each checked byte-exact after the timed runs.
fn object_cases(args: &TransferArgs, a: &mut WorkerProc, pool: &PoolHandle, ctx: &dyn Fn(Case) -> Case) -> Result<Vec<Case>, String> {
    let total = if args.quick { 64 * MIB } else { 1 << 30 };
    let reps = args.reps as u64;
    let mut cases = Vec::new();
    for (i, &mib) in args.sizes.iter().enumerate() {
        let size = mib * MIB;
        let group = 10 + i as u16;
        let count = (total / size).max(8);
        let ol = Layout::contiguous("obj", 1, size, count);
        let seed = 7 + i as u64;
        ol.setup(a, group, seed)?;
        let ob = ol.bytes();
        let base = Base::measure(a, args.backend, ob, 5, args.copy_threads)?;
        // The latency floor of one object in flight: one copy of one object and its
        // synchronization at a time, in the worker's own process (no pool, no IPC).
        let one = |a: &mut WorkerProc, dir| -> Result<f64, String> {
            Ok(gbps(size, u64_of(&a.call(&Command::Baseline { bytes: size, dir, reps: 100, threads: 1 })?, "ns")))
        };
        let one_store = one(a, CopyDir::D2h)?;
        let one_load = if args.backend == BackendArg::Cuda { one(a, CopyDir::H2d)? } else { one_store };
        let one_name = match args.backend {
            BackendArg::Cuda => "one pinned cuMemcpy of one object and a stream synchronize at a time, in the worker process (no pool)",
            BackendArg::Host => "one memcpy of one object at a time, in the worker process (no pool)",
        };
        let mut key = 0;
        for inflight in [1usize, 8] {
            let (mut st, mut ld) = (Vec::new(), Vec::new());
            let (mut est, mut eld) = (EngineTime::default(), EngineTime::default());
            let p0 = pool.phases();
            for r in 0..reps {
                a.call(&Command::Reset)?;
                key = (50 + group as u64) << 32 | (inflight as u64) << 24 | r << 16;
                st.push(gbps(ob, u64_of(&est.around(|| xfer(a, Op::Store, group, key, &ol.blocks, 1, inflight))?, "ns")));
                ld.push(gbps(ob, u64_of(&eld.around(|| xfer(a, Op::Load, group, key, &ol.blocks, 1, inflight))?, "ns")));
            }
            let phases = phase_means(&p0, &pool.phases());
            let label = format!("obj{mib}m_x{inflight}");
            for (op, v, e) in [(Op::Store, st, &est), (Op::Load, ld, &eld)] {
                let opn = if op == Op::Store { "store" } else { "load" };
                let value = median(v);
                let mut c = ctx(base.case(&format!("{label}_{opn}_gbps"), op, value))
                    .extra("object_bytes", size)
                    .extra("objects", count)
                    .extra("inflight", inflight)
                    .extra("bytes", ob)
                    .extra("engine", e.json())
                    .extra("pool_phases_us", phases[opn].clone());
                if inflight == 1 {
                    let one = if op == Op::Store { one_store } else { one_load };
                    c = c
                        .extra("baseline_one_copy", (one * 1000.0).round() / 1000.0)
                        .extra("baseline_one_copy_name", one_name)
                        .extra("speedup_one_copy", if one > 0.0 { (value / one * 100.0).round() / 100.0 } else { f64::NAN });
                }
                cases.push(c);
            }
        }
        let exact = check_exact(a, &ol, group, key, seed)?;
        if let Some(c) = cases.last_mut() {
            c.extra.insert("check".into(), exact);
        }
        a.call(&Command::Drop { group })?;
        a.call(&Command::Reset)?;
    }
    Ok(cases)
}

pub(crate) fn bench_host(args: &TransferArgs) -> Result<Vec<Case>, String> {
    let pool = start_pool(args)?;
    let mut a = WorkerProc::spawn("A", &pool.socket, BackendArg::Host, NS)?;
    let cpu = host_note();
    let copy_threads = args.copy_threads;
    let per_peer = PoolConfig { copy_threads, ..PoolConfig::default() }.copy_threads_per_peer();
    let ctx = move |c: Case| {
        c.extra("backend", "host")
            .extra("memory", "HostMemfd")
            .extra("copy_threads", copy_threads)
            .extra("copy_threads_per_peer", per_peer)
            .extra("cpus", crate::report::cpus())
            .extra("cpu", cpu.clone())
    };
    let mut cases = Vec::new();
    if args.wants("pages") {
        let total: u64 = if args.quick { 256 * MIB } else { 1 << 30 };
        let layers = 32;
        for (group, &page) in [64u64 << 10, 256 << 10, 1 << 20, 2 << 20].iter().enumerate() {
            let group = group as u16;
            let blocks = total / (layers * page);
            let l = Layout::contiguous("host", layers, page, blocks);
            l.setup(&mut a, group, 1)?;
            let bytes = l.bytes();
            let base = Base::measure(&mut a, BackendArg::Host, bytes, args.reps, copy_threads)?;
            // Several transfers in flight, as several requests' stores would be.
            let per = (blocks as usize / 8).max(1);
            let (mut st, mut ld) = (Vec::new(), Vec::new());
            let mut key = 0;
            for r in 0..args.reps as u64 {
                a.call(&Command::Reset)?;
                key = 1_000_000 * (r + 1) + group as u64 * 100_000_000;
                st.push(gbps(bytes, u64_of(&xfer(&mut a, Op::Store, group, key, &l.blocks, per, 4)?, "ns")));
                ld.push(gbps(bytes, u64_of(&xfer(&mut a, Op::Load, group, key, &l.blocks, per, 4)?, "ns")));
            }
            let exact = check_exact(&mut a, &l, group, key, 1)?;
            let label = format!("p{}k", page >> 10);
            for (op, v) in [(Op::Store, st), (Op::Load, ld)] {
                let opn = if op == Op::Store { "store" } else { "load" };
                let c = ctx(base.case(&format!("{label}_{opn}_gbps"), op, median(v)))
                    .extra("bytes", bytes)
                    .extra("layers", layers)
                    .extra("page_bytes", page)
                    .extra("blocks", blocks)
                    .extra("blocks_per_transfer", per)
                    .extra("inflight", 4);
                cases.push(if op == Op::Load { c.extra("check", exact.clone()) } else { c });
            }
            a.call(&Command::Drop { group })?;
            a.call(&Command::Reset)?;
        }
    }
    for (i, l) in small_page_layouts(args).iter().enumerate() {
        // One submission per store or load, as the connector submits a request's blocks.
        cases.extend(layout_cases(args, &mut a, l, 20 + i as u16, (30 + i as u64) << 32, l.blocks.len(), 1, None, &pool, &ctx)?);
    }
    if args.wants("obj") {
        cases.extend(object_cases(args, &mut a, &pool, &ctx)?);
    }
    if args.wants("overhead") {
        cases.extend(pool_overhead(args, &pool, &mut a)?);
    }
    Ok(cases)
}

/// The pool's own cost per submission, apart from moving bytes: the gpt-oss-like shape (313
/// blocks x 24 per-layer allocations = 7,512 pages) with 64-byte pages, so the copies cost
/// next to nothing and what is measured is validation, reservation/pinning, copy planning,
/// publication and the completion. Baseline: a one-block submission of the same layout.
fn pool_overhead(args: &TransferArgs, pool: &PoolHandle, a: &mut WorkerProc) -> Result<Vec<Case>, String> {
    let mut l = gpt_oss();
    l.name = "gptoss_shape";
    l.shape.page = 64;
    let group = 90;
    l.setup(a, group, 1)?;
    let mut cases = Vec::new();
    let reps = (args.reps * 4).max(8) as u64;
    let mut key = 7u64 << 40;
    let mut measure = |blocks: &[u64], a: &mut WorkerProc| -> Result<(f64, f64), String> {
        let (mut st, mut ld) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            key += 1_000_003;
            st.push(u64_of(&xfer(a, Op::Store, group, key, blocks, blocks.len(), 1)?, "ns") as f64 / 1e3);
            ld.push(u64_of(&xfer(a, Op::Load, group, key, blocks, blocks.len(), 1)?, "ns") as f64 / 1e3);
        }
        Ok((median(st), median(ld)))
    };
    let (one_st, one_ld) = measure(&l.blocks[..1], a)?;
    let p0 = pool.phases();
    let (st, ld) = measure(&l.blocks, a)?;
    let phases = phase_means(&p0, &pool.phases());
    for (op, v, base) in [("store", st, one_st), ("load", ld, one_ld)] {
        cases.push(
            Case::new(
                "transfer",
                &format!("gptoss_shape_{op}_overhead_us"),
                v,
                "us",
                base,
                "one-block submission, same layout",
                Better::Lower,
            )
            .extra("pool_phases_us", phases[op].clone())
            .extra("backend", "host")
            .extra("blocks", l.blocks.len())
            .extra("layers", l.shape.layers)
            .extra("page_bytes", l.shape.page)
            .extra("cpus", crate::report::cpus()),
        );
    }
    a.call(&Command::Drop { group })?;
    a.call(&Command::Reset)?;
    Ok(cases)
}

/// Copy tuning of the cuda cases (swept with `--sweep`).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Tune {
    streams: usize,
    batch: bool,
    parallel: bool,
    batch_max: usize,
    stage_mib: u64,
}

/// Restarts the in-process pool with the copy tuning `t` and stage growth `growth` (a
/// pool's config is fixed for its life) when they differ from its own; then worker A
/// again, on the new pool, with the gpt-oss layout set up as before (group 0, seed 1).
fn retune(args: &TransferArgs, pool: &mut PoolHandle, a: &mut WorkerProc, l: &Layout, t: Tune, growth: u32) -> Result<bool, String> {
    let mut engine = args.engine;
    engine.streams = t.streams;
    engine.batch = t.batch;
    engine.parallel_submit = t.parallel;
    engine.batch_max = t.batch_max;
    let tuning = CopyTuning { engine, stage_bytes: t.stage_mib * MIB, growth_percent: growth };
    if !pool.restart_with(args, tuning)? {
        return Ok(false);
    }
    *a = WorkerProc::spawn("A", &pool.socket, BackendArg::Cuda, NS)?;
    l.setup(a, 0, 1)?;
    Ok(true)
}

pub(crate) fn bench_cuda(args: &TransferArgs) -> Result<Vec<Case>, String> {
    let mut pool = start_pool(args)?;
    let mut a = WorkerProc::spawn("A", &pool.socket, BackendArg::Cuda, NS)?;
    let info = a.call(&Command::Info)?;
    eprintln!("worker A: {info}");
    let gpu = info.get("gpu").cloned().unwrap_or(Value::Null);
    let batch_api = umbp_gpu::cuda::batch_copy_api();
    let mut cases = Vec::new();
    let reps = args.reps as u64;
    // The in-process pool's; an external pool's is its own (null).
    // A number for a fixed window, "auto" for the adaptive one; null with an external pool.
    let idle_poll_us = args.pool_socket.is_none().then(|| match args.idle_poll {
        umbp_pool::config::IdlePoll::Fixed(d) => serde_json::json!(d.as_micros() as u64),
        auto => serde_json::json!(auto.to_string()),
    });
    let ctx = |c: Case| {
        c.extra("backend", "cuda")
            .extra("gpu", gpu.clone())
            .extra("batch_api", batch_api)
            .extra("idle_poll_us", idle_poll_us.clone())
            .extra("hugepages", args.pool_socket.is_none().then_some(args.hugepages))
    };
    let mut key = 1u64 << 40;
    let mut next_key = |n: u64| {
        key += n + 1000;
        key
    };
    let e = args.engine;
    let stage0 = args.stage_mib.unwrap_or(umbp_pool::config::DEFAULT_COPY_STAGE_BYTES / MIB);
    let mut tuning = Tune { streams: e.streams, batch: e.batch, parallel: e.parallel_submit, batch_max: e.batch_max, stage_mib: stage0 };
    let mut growth = args.first_stage_growth();
    // --- gpt-oss-20b-like layout, 10k-token prefix
    let l = gpt_oss();
    let bytes = l.bytes();
    let n = l.blocks.len();
    l.setup(&mut a, 0, 1)?;
    let base = Base::measure(&mut a, BackendArg::Cuda, bytes, 5, 1)?;
    eprintln!("baseline contiguous pinned: d2h {:.1} GB/s, h2d {:.1} GB/s ({} MiB)", base.store, base.load, bytes / MIB);
    let measure = |a: &mut WorkerProc, key: u64, reps: u64| -> Result<(f64, f64), String> {
        let (mut st, mut ld) = (Vec::new(), Vec::new());
        for r in 0..reps {
            a.call(&Command::Reset)?;
            let k = key + r * 10_000;
            st.push(gbps(bytes, u64_of(&xfer(a, Op::Store, 0, k, &l.blocks, n, 1)?, "ns")));
            ld.push(gbps(bytes, u64_of(&xfer(a, Op::Load, 0, k, &l.blocks, n, 1)?, "ns")));
        }
        Ok((median(st), median(ld)))
    };
    let lay = |c: Case, t: Tune| {
        ctx(c)
            .extra("layout", l.about)
            .extra("bytes", bytes)
            .extra("blocks", n)
            .extra("streams", t.streams)
            .extra("batch", t.batch)
            .extra("parallel_submit", t.parallel)
            .extra("batch_max", t.batch_max)
            .extra("copy_stage_mib", t.stage_mib)
    };
    if args.wants("gptoss") {
        // Warm up (stream sets, IPC mappings, first-touch of pool pages).
        measure(&mut a, next_key(0), 2)?;
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
                // A restarted pool and worker are warmed up as the first were.
                if retune(args, &mut pool, &mut a, &l, t, growth)? {
                    measure(&mut a, next_key(0), 2)?;
                }
                let e0 = engine_totals();
                let p0 = pool.phases();
                let (s, d) = measure(&mut a, next_key(0), reps.min(5))?;
                let phases = phase_means(&p0, &pool.phases());
                let e1 = engine_totals();
                let calls = (e1.calls - e0.calls).max(1);
                let engine = gbps(e1.bytes - e0.bytes, e1.total_ns - e0.total_ns);
                let enqueue_ms = (e1.enqueue_ns - e0.enqueue_ns) as f64 / calls as f64 / 1e6;
                eprintln!("tuning {t:?}: store {s:.1} GB/s, load {d:.1} GB/s; engine {engine:.1} GB/s, enqueue {enqueue_ms:.2} ms per call; pool phases {phases}");
                let name = format!("tune_s{}_b{}_p{}_m{}_st{}", t.streams, t.batch as u8, t.parallel as u8, t.batch_max, t.stage_mib);
                for (op, v, opn) in [(Op::Store, s, "store"), (Op::Load, d, "load")] {
                    cases.push(
                        lay(base.case(&format!("{name}_{opn}_gbps"), op, v), t)
                            .extra("engine_gbps", engine)
                            .extra("enqueue_ms_per_call", enqueue_ms)
                            .extra("pool_phases_us", phases[opn].clone()),
                    );
                }
                if s + d > best.0 {
                    best = (s + d, t);
                }
            }
            tuning = best.1;
            eprintln!("tuning: using {tuning:?}");
        }
        if retune(args, &mut pool, &mut a, &l, tuning, growth)? {
            measure(&mut a, next_key(0), 2)?;
        }
        let e0 = engine_totals();
        let p0 = pool.phases();
        let (s, d) = measure(&mut a, next_key(0), reps)?;
        let phases = phase_means(&p0, &pool.phases());
        let e1 = engine_totals();
        let engine_gbps = gbps(e1.bytes - e0.bytes, e1.total_ns - e0.total_ns);
        let enqueue_ms = (e1.enqueue_ns - e0.enqueue_ns) as f64 / (e1.calls - e0.calls).max(1) as f64 / 1e6;
        for (op, v, opn) in [(Op::Store, s, "store"), (Op::Load, d, "load")] {
            cases.push(
                lay(base.case(&format!("gptoss_{opn}_gbps"), op, v), tuning)
                    .extra("engine_gbps_store_and_load", engine_gbps)
                    .extra("enqueue_ms_per_call", enqueue_ms)
                    .extra("pool_phases_us", phases[opn].clone())
                    .extra("service_wakeups_per_job", phases["service_wakeups_per_job"].clone()),
            );
        }

        // --- restore: lookup + load of the 10k prefix, end to end
        let k = next_key(0);
        a.call(&Command::Reset)?;
        xfer(&mut a, Op::Store, 0, k, &l.blocks, n, 1)?;
        let cold = restores(&mut a, &pool, 0, k, &l.blocks, reps.max(3) as usize, false)?;
        let exact = check_exact(&mut a, &l, 0, k, 1)?;
        cases.push(lay(cold.case("restore_10k_ms", &base), tuning).extra("tokens", 10_000).extra("check", exact));

        // --- restore from the SSD tier: the prefix pushed out of DRAM (demoted), then lookup +
        // load end to end, each object promoted to DRAM before its copy to the GPU
        if let (true, Some(p)) = (args.wants("ssd") && args.ssd_dir.is_some(), pool.pool.as_ref()) {
            let ssd_of = |r: umbp_pool::pool_report::PoolReport| r.ssd.ok_or("--ssd-dir given but the pool reports no SSD tier");
            let (mut ms, mut promoted) = (Vec::new(), Vec::new());
            let mut k = 0;
            for _ in 0..reps.max(3) {
                // A fresh prefix each time: a restore's lookup leases what it hit, which
                // keeps it in DRAM for the lease.
                k = next_key(0);
                a.call(&Command::Reset)?;
                xfer(&mut a, Op::Store, 0, k, &l.blocks, n, 1)?;
                push_out_of_dram(&mut a, p, &l.blocks, n, &mut next_key)?;
                let before = ssd_of(p.report())?;
                let r = a.call(&Command::Restore { group: 0, key_base: k, blocks: l.blocks.clone(), keep_index: false })?;
                if u64_of(&r, "hits") != n as u64 || u64_of(&r, "bad") != 0 {
                    return Err(format!("restore from SSD: {r}"));
                }
                ms.push(u64_of(&r, "ns") as f64 / 1e6);
                let after = p.report();
                let tiers = after.tiers;
                let from_ssd = ssd_of(after)?.promotions - before.promotions;
                promoted.push(from_ssd as f64 / n as f64);
                eprintln!("ssd restore: {:.2} ms, {from_ssd} of {n} objects promoted from SSD; tiers {:?}", ms.last().expect("one"), tiers);
            }
            let exact = check_exact(&mut a, &l, 0, k, 1)?;
            let s = ssd_of(p.report())?;
            cases.push(
                lay(base.restore_case("ssd_restore_10k_ms", ms), tuning)
                    .extra("promoted_fraction", median(promoted))
                    .extra("tokens", 10_000)
                    .extra("check", exact)
                    .extra("direct_io", s.direct_io)
                    .extra("io_uring", s.io_uring)
                    .extra("ssd_dir", s.dirs.join(",")),
            );
        }

        // --- fenced store and load (stream-ordered, docs/gpu.md "Stream-ordered transfers"): same layout
        let (mut fs, mut fl) = (Vec::new(), Vec::new());
        for r in 0..reps {
            a.call(&Command::Reset)?;
            let k = next_key(0) + r;
            let s = xfer_with(&mut a, Xfer { fence: true, ..Xfer::new(Op::Store, 0, k, &l.blocks, n, 1) })?;
            let d = xfer_with(&mut a, Xfer { fence: true, ..Xfer::new(Op::Load, 0, k, &l.blocks, n, 1) })?;
            fs.push(gbps(bytes, u64_of(&s, "ns")));
            fl.push(gbps(bytes, u64_of(&d, "ns")));
        }
        cases.push(
            lay(base.case("gptoss_fenced_store_gbps", Op::Store, median(fs)), tuning)
                .extra("note", "store_after_stream; time to completion"),
        );
        cases.push(
            lay(base.case("gptoss_fenced_load_gbps", Op::Load, median(fl)), tuning)
                .extra("note", "load_before_stream; time until the worker's stream passed its wait"),
        );
    }
    retune(args, &mut pool, &mut a, &l, tuning, growth)?;
    if args.layout_only {
        return Ok(cases);
    }
    let ctx_t = |c: Case| ctx(c).extra("streams", tuning.streams).extra("batch", tuning.batch).extra("parallel_submit", tuning.parallel);

    // --- the small-page layouts of issue #14 (one submission per store or load), once per
    // --stage-growth (one value: the case names stay plain)
    let growth0 = args.first_stage_growth();
    let growths = if args.stage_growth.is_empty() { vec![growth0] } else { args.stage_growth.clone() };
    let named = growths.len() > 1;
    for (i, sl) in small_page_layouts(args).iter().enumerate() {
        let group = 20 + i as u16;
        for &percent in &growths {
            growth = percent;
            retune(args, &mut pool, &mut a, &l, tuning, growth)?;
            let name = named.then(|| format!("{}_g{percent}", sl.name));
            let ctx_g = |c: Case| ctx_t(c).extra("copy_stage_growth_percent", percent);
            cases.extend(layout_cases(args, &mut a, sl, group, next_key(0) << 8, sl.blocks.len(), 1, name.as_deref(), &pool, &ctx_g)?);
        }
        growth = growth0;
        if retune(args, &mut pool, &mut a, &l, tuning, growth)? {
            // A fresh worker: this layout set up again (as layout_cases did) for the
            // interference case below.
            sl.setup(&mut a, group, 40 + group as u64)?;
        }
        // The same matmul slowdown while this layout's stores stream (its pages may take the
        // page copy kernel, which the main layout's 64 KiB pages do not).
        if let (true, Some(cmd)) = (args.wants("interference"), &args.matmul) {
            let name = format!("{}_interference_pct", sl.name);
            match interference(&mut a, cmd, sl, group, next_key(0) << 8, &name, args.quick) {
                Ok(c) => cases.push(ctx_t(c).extra("layout", sl.about).extra("gather", format!("{:?}", args.engine.gather))),
                Err(e) => eprintln!("{name} skipped: {e}"),
            }
        }
    }

    // --- the seed's object table: 1, 16, 64 MiB objects, x1 and x8 in flight
    if args.wants("obj") {
        cases.extend(object_cases(args, &mut a, &pool, &ctx_t)?);
    }

    // --- bidirectional: A stores fresh keys while B loads stored ones
    if args.wants("bidir") {
        a.call(&Command::Reset)?;
        let mut b = WorkerProc::spawn("B", &pool.socket, BackendArg::Cuda, NS + 1)?;
        l.setup(&mut b, 0, 2)?;
        let rounds = if args.quick { 3 } else { 6 };
        let kb = next_key(0);
        for r in 0..rounds {
            xfer(&mut b, Op::Store, 0, kb + r * 1000, &l.blocks, n, 1)?;
        }
        let mut bi = Vec::new();
        for r in 0..reps.min(3) {
            a.call(&Command::Reset)?;
            let ka = next_key(0) + r;
            let many = |op, k| Command::Xfer(Xfer { rounds, round_stride: Some(1000), ..Xfer::new(op, 0, k, &l.blocks, n, 2) });
            a.send(&many(Op::Store, ka))?;
            b.send(&many(Op::Load, kb))?;
            let (ra, rb) = (a.recv()?, b.recv()?);
            if u64_of(&ra, "bad") + u64_of(&rb, "bad") != 0 {
                return Err(format!("bidir: {ra} {rb}"));
            }
            let ns = u64_of(&ra, "ns").max(u64_of(&rb, "ns"));
            bi.push(gbps(2 * rounds * bytes, ns));
        }
        let bb = a.call(&Command::Baseline { bytes: bytes * rounds, dir: CopyDir::Bidir, reps: 3, threads: 1 })?;
        cases.push(
            lay(
                Case::new(
                    "transfer",
                    "bidir_gbps",
                    median(bi),
                    "GB/s",
                    gbps(2 * rounds * bytes, u64_of(&bb, "ns")),
                    "contiguous pinned cuMemcpyDtoH + HtoD at once, same bytes",
                    Better::Higher,
                ),
                tuning,
            )
            .extra("rounds", rounds)
            .extra("workers", 2),
        );
        drop(b);
    }

    // --- interference with a matmul loop in another process
    if args.wants("interference") {
        if let Some(cmd) = &args.matmul {
            match interference(&mut a, cmd, &l, 0, next_key(0), "interference_pct", args.quick) {
                Ok(c) => cases.push(lay(c, tuning)),
                Err(e) => eprintln!("interference_pct skipped: {e}"),
            }
        } else {
            eprintln!("interference_pct skipped: no --matmul command given");
        }
    }
    Ok(cases)
}

/// Counters of every GPU copy engine of this process (the in-process pool's) together.
fn engine_totals() -> umbp_gpu::EngineStats {
    let mut t = umbp_gpu::EngineStats::default();
    for e in umbp_gpu::loaded_backends().iter().flat_map(|b| b.engine_stats()) {
        t.add(&e);
    }
    t
}
