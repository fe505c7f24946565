//! `umbp-bench transfer`: KV store/load bandwidth through a real pool, worker(s) in child
//! processes, each figure beside a baseline measured in the same run (docs/benchmarks.md), and
//! `--check`: the multi-process correctness checks of the GPU data path (docs/gpu.md).
//!
//! The pool runs in this process (the same library the `umbp-pool` daemon runs; workers
//! attach over its socket exactly as to a standalone pool), or `--pool-socket` names a
//! running `umbp-pool`. Workers are this binary re-executed (`__transfer-worker`), driven
//! by typed JSON commands on stdin ([`command::Command`]) and JSON replies on stdout.
//!
//! Backends: `host` (worker memory is a sealed memfd, `HostMemfd`; baseline: one plain
//! memcpy of the same bytes) and `cuda` (worker memory from `cuMemAlloc`, one allocation
//! per layer as vLLM's per-layer KV tensors; baseline: one contiguous pinned
//! `cuMemcpyDtoH`/`HtoD` of the same byte count).
//!
//! Files: `cli.rs` (command lines), `command.rs` (parent-child commands), `parent.rs` (the
//! pool and the worker processes seen from the parent), `bench.rs` (the measured cases),
//! `checks.rs` (`--check`), `worker.rs` (the child), `cu.rs` and `ptx.rs` (the child's CUDA side).

mod bench;
pub(crate) mod checks;
pub mod cli;
pub mod command;
mod cu;
mod interference;
pub(crate) mod parent;
mod worker;

use std::path::PathBuf;

use self::command::{Command, Shape};
use self::parent::WorkerProc;
use super::report::Case;

pub use self::cli::{TransferCli, TransferWorkerCli};

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
    /// GPU copy engine tuning of the in-process pool.
    pub engine: umbp_gpu::EngineConfig,
    /// cuda: only the gpt-oss layout cases (store, load, restore, fenced).
    pub layout_only: bool,
    /// cuda: the multi-GPU run (multi_gpu.rs) instead of the single-GPU cases.
    pub multi_gpu: bool,
    /// Command running a matmul loop for `interference_pct` (cuda); it gets
    /// `--seconds S` appended and must print a JSON line with `tflops`.
    pub matmul: Option<String>,
    /// Try these stream counts (and batching on/off) on the main layout, then use the
    /// best for the other cases (in-process pool only).
    pub sweep: bool,
    /// Only these case groups (see [`GROUPS`]); empty: all.
    pub layouts: Vec<String>,
    /// Object sizes of the single-object table in MiB.
    pub sizes: Vec<u64>,
    /// Prefix length of the small-page layouts (kv4k, kv8k, kv16k).
    pub tokens: u64,
    /// Copy threads of the in-process pool, and the thread count of the host backend's
    /// multi-threaded memcpy baseline.
    pub copy_threads: usize,
    /// cuda, in-process pool: copy stage size in MiB (None: the pool's default).
    pub stage_mib: Option<u64>,
    /// cuda, in-process pool: copy stage growth percentages the small-page layouts are
    /// measured with (empty: the pool's default only).
    pub stage_growth: Vec<u32>,
    /// In-process pool: how long its threads poll for work before they sleep.
    pub idle_poll: umbp_pool::config::IdlePoll,
    /// In-process pool: an SSD tier in this directory (admission `all`), for the `ssd`
    /// case group (`ssd_restore_10k_ms`).
    pub ssd_dir: Option<PathBuf>,
    /// In-process pool: DRAM on 2 MiB huge pages.
    pub hugepages: bool,
}

/// Case groups `--layouts` selects from: `pages` (host: 64 KiB..2 MiB pages, one
/// allocation), `gptoss` (24 layers x 64 KiB; cuda: store, load, restore, fenced),
/// `kv4k`/`kv8k`/`kv16k` (80 layers, K and V pages apart), `obj` (single objects, x1 and
/// x8 in flight), `overhead` (host: the pool's cost per submission), `bidir` and
/// `interference` (cuda), `ssd` (cuda, with `--ssd-dir`: the gpt-oss prefix restored from
/// the SSD tier).
pub const GROUPS: &[&str] = &["pages", "gptoss", "kv4k", "kv8k", "kv16k", "obj", "overhead", "bidir", "interference", "ssd"];

impl TransferArgs {
    /// The stage growth the in-process pool starts with: the first `--stage-growth`, else
    /// the pool's default.
    pub(crate) fn first_stage_growth(&self) -> u32 {
        self.stage_growth.first().copied().unwrap_or(umbp_pool::config::DEFAULT_COPY_STAGE_GROWTH_PERCENT)
    }

    /// Does `--layouts` select case group `g`?
    pub(crate) fn wants(&self, g: &str) -> bool {
        self.layouts.is_empty() || self.layouts.iter().any(|l| l == g)
    }
}

pub(crate) const NS: u128 = 0x7472_616e_7366_6572;
const MIB: u64 = 1 << 20;

pub(crate) fn gbps(bytes: u64, ns: u64) -> f64 {
    bytes as f64 / ns.max(1) as f64
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

pub(crate) fn u64_of(v: &serde_json::Value, k: &str) -> u64 {
    v.get(k).and_then(serde_json::Value::as_u64).unwrap_or(0)
}

/// A KV layout of a worker: `shape` (layers, page size, cache blocks, allocation and K/V
/// split) and the blocks a prefix occupies, scattered over the cache like a vLLM block table.
pub(crate) struct Layout {
    pub(crate) name: &'static str,
    /// One line for the `layout` field of the cases.
    pub(crate) about: &'static str,
    pub(crate) shape: Shape,
    pub(crate) blocks: Vec<u64>,
}

impl Layout {
    pub(crate) fn object_bytes(&self) -> u64 {
        self.shape.object_bytes()
    }
    pub(crate) fn bytes(&self) -> u64 {
        self.object_bytes() * self.blocks.len() as u64
    }
    pub(crate) fn cache_blocks(&self) -> u64 {
        self.shape.blocks
    }
    /// One allocation for all layers, K and V in one page, every block of the cache used.
    pub(crate) fn contiguous(name: &'static str, layers: u64, page: u64, blocks: u64) -> Self {
        let shape = Shape { layers, page, blocks, per_layer_alloc: false, segments_per_layer: 1 };
        Layout { name, about: "", shape, blocks: (0..blocks).collect() }
    }
    pub(crate) fn setup(&self, w: &mut WorkerProc, group: u16, seed: u64) -> Result<(), String> {
        let r = w.call(&Command::Setup { group, shape: self.shape, seed })?;
        if u64_of(&r, "object_bytes") != self.object_bytes() {
            return Err(format!("layout {}: pool says {r}", self.name));
        }
        Ok(())
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// `count` distinct blocks of a cache of `cache`, spread over all of it.
fn scattered(count: u64, cache: u64) -> Vec<u64> {
    assert!(count <= cache, "{count} blocks in a cache of {cache}");
    // A permutation step coprime with the cache size: blocks spread over the whole cache.
    let mut step = (cache / 3) | 1;
    while gcd(step, cache) != 1 {
        step += 2;
    }
    (0..count).map(|i| (i * step) % cache).collect()
}

/// Runs the benchmark or the checks on one GPU (`--multi-gpu`: multi_gpu.rs, chosen by the
/// command line).
pub fn run(args: &TransferArgs) -> Result<Vec<Case>, String> {
    if args.backend == BackendArg::Cuda {
        let n = umbp_gpu::cuda::device_count().map_err(|e| format!("--backend cuda: {e}"))?;
        if n == 0 {
            return Err("--backend cuda: the CUDA driver sees no device".into());
        }
    }
    if args.check {
        return checks::checks(args);
    }
    match args.backend {
        BackendArg::Host => bench::bench_host(args),
        BackendArg::Cuda => bench::bench_cuda(args),
    }
}

/// The main KV layout: gpt-oss-20b-like (24 layers, 32-token blocks, 8 KV heads x 64 x
/// (K+V) bf16 = 64 KiB pages), a 10,000-token prefix = 313 blocks, scattered over a cache of
/// 512 blocks, one allocation per layer.
pub(crate) fn gpt_oss() -> Layout {
    let cache_blocks = 512;
    let blocks = 10_000u64.div_ceil(32);
    let shape = Shape { layers: 24, page: 64 << 10, blocks: cache_blocks, per_layer_alloc: true, segments_per_layer: 1 };
    Layout {
        name: "gptoss",
        about: "24 layers x 64 KiB pages (gpt-oss-20b-like), one allocation per layer",
        shape,
        blocks: scattered(blocks, cache_blocks),
    }
}

/// The small-page layouts of issue #14: a 70B-class GQA model at TP8, block 16: 80 layers,
/// K and V in separate pages of `page` bytes (4, 8 or 16 KiB), one allocation per layer
/// holding all K pages then all V pages (vLLM's `(2, num_blocks, 16, heads, 128)` tensor).
/// A `tokens`-token prefix (10,000: 625 blocks x 80 layers x 2 = 100,000 pages) scattered
/// over a cache one sixteenth larger.
pub(crate) fn small_pages(name: &'static str, page: u64, tokens: u64) -> Layout {
    let blocks = tokens.div_ceil(16).max(1);
    let cache_blocks = blocks + blocks / 16 + 1;
    let shape = Shape { layers: 80, page, blocks: cache_blocks, per_layer_alloc: true, segments_per_layer: 2 };
    let about = match page {
        4096 => "80 layers x (K, V) 4 KiB pages apart (70B-class GQA at TP8, block 16), one allocation per layer",
        8192 => "80 layers x (K, V) 8 KiB pages apart, block 16, one allocation per layer",
        _ => "80 layers x (K, V) 16 KiB pages apart, block 16, one allocation per layer",
    };
    Layout { name, about, shape, blocks: scattered(blocks, cache_blocks) }
}

/// The small-page layouts `--layouts` selects, with `tokens`-token prefixes.
pub(crate) fn small_page_layouts(args: &TransferArgs) -> Vec<Layout> {
    [("kv4k", 4u64 << 10), ("kv8k", 8 << 10), ("kv16k", 16 << 10)]
        .into_iter()
        .filter(|(n, _)| args.wants(n))
        .map(|(n, p)| small_pages(n, p, args.tokens))
        .collect()
}

#[cfg(test)]
mod tests {
    use umbp_worker::{MemorySpec, ObjectKey, Segment, Worker, WorkerConfig};

    use super::worker::{pattern_bytes, word};
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
        let alloc =
            unsafe { w.register_memory(MemorySpec::HostProcess { ptr: kv.as_mut_ptr() as usize, len: kv.len() }) }.expect("register");
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
        let l = gpt_oss();
        assert_eq!(l.shape.page, 32 * 8 * 64 * 2 * 2, "32 tokens x 8 KV heads x 64 x (K+V) x bf16");
        assert_eq!(l.blocks.len(), 313, "10,000 tokens in 32-token blocks");
        assert_eq!(l.object_bytes(), 24 << 16);
    }

    /// Issue #14: 4 KiB K and V pages apart, 80 layers, a 10k-token prefix in 16-token
    /// blocks is 625 blocks x 80 layers x 2 = 100,000 pages.
    #[test]
    fn small_page_layouts_match_the_issue() {
        for (page, name) in [(4096u64, "kv4k"), (8192, "kv8k"), (16384, "kv16k")] {
            let l = small_pages(name, page, 10_000);
            assert_eq!(l.blocks.len(), 625);
            let pages = l.blocks.len() as u64 * l.shape.layers * l.shape.segments_per_layer;
            assert_eq!(pages, 100_000);
            assert_eq!(l.object_bytes(), 160 * page);
            let mut s = l.blocks.clone();
            s.sort_unstable();
            s.dedup();
            assert_eq!(s.len(), 625, "no block twice");
            assert!(l.blocks.iter().all(|&b| b < l.cache_blocks()));
        }
    }

    #[test]
    fn scattered_steps_are_coprime_with_any_cache() {
        for cache in [2u64, 3, 9, 27, 64, 665, 1000, 1024] {
            let b = scattered(cache, cache);
            let mut s = b.clone();
            s.sort_unstable();
            s.dedup();
            assert_eq!(s.len() as u64, cache, "cache {cache}: a permutation");
        }
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
