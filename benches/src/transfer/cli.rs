//! The command lines of `umbp-bench transfer` and of its hidden worker child.

use std::path::PathBuf;

use umbp_pool::PoolConfig;

use super::worker::worker_main;
use super::{run, BackendArg, TransferArgs, GROUPS};

/// Command line of `umbp-bench transfer` (kept here so the entry point only registers it).
/// Environment: `UMBP_BENCH_WAIT_POLL_US` sets the bench workers' completion-wait polling
/// (`WorkerConfig::wait_poll`, µs; 0: sleep at once) for A/B runs.
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
    /// Sweep copy streams, stage sizes and batching on the main layout, then use the best
    /// (the in-process pool and worker A restart for each setting: a pool's config is fixed).
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
    /// Only these case groups (comma separated): pages, gptoss, kv4k, kv8k, kv16k, obj,
    /// overhead, bidir, interference [default: all of the backend].
    #[arg(long, value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(GROUPS))]
    layouts: Vec<String>,
    /// Object sizes in MiB of the single-object cases (`obj`), x1 and x8 in flight.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    sizes: Vec<u64>,
    /// Prefix length in tokens of the small-page layouts kv4k, kv8k, kv16k (16-token blocks;
    /// 10,000 = 625 blocks x 80 layers x 2 = 100,000 pages).
    #[arg(long, default_value_t = 10_000)]
    tokens: u64,
    /// Copy threads of the in-process pool, and the threads of the host backend's second
    /// memcpy baseline [default: the pool's default, min(CPUs, 8), at least 2].
    #[arg(long)]
    copy_threads: Option<usize>,
    /// Copy streams per copy call of the in-process pool (default 1).
    #[arg(long)]
    streams: Option<usize>,
    /// Submit copies one call each instead of batched.
    #[arg(long)]
    no_batch: bool,
    /// One JSON object per case and line.
    #[arg(long)]
    json: bool,
    /// cuda, in-process pool: page copy path: auto (the pool's calibration), kernel,
    /// copy-engine, or staged (kernel gather through device staging + copy engines)
    /// (issue #14).
    #[arg(long, default_value = "auto")]
    gather: String,
    /// cuda, in-process pool: blocks of the page copy kernel (0: calibrated).
    #[arg(long, default_value_t = 0)]
    gather_blocks: u32,
    /// cuda, in-process pool: most KiB one page copy kernel launch moves (0: one launch per stage).
    #[arg(long, default_value_t = 0)]
    gather_launch_kib: usize,
    /// cuda, in-process pool: streams one large object (4 MiB+) is split over (0 or 1: no split).
    #[arg(long, default_value_t = 0)]
    split_streams: usize,
    /// cuda, in-process pool, where stages go through device staging: MiB per staging
    /// chunk (3 per stream set).
    #[arg(long, default_value_t = 16)]
    device_stage_mib: usize,
    /// cuda, in-process pool: copy stage size in MiB (0: one stage per copy call)
    /// [default: the pool's].
    #[arg(long)]
    stage_mib: Option<u64>,
    /// cuda, in-process pool: copy stage growth in percent of the stage before
    /// (`umbp-pool --copy-stage-growth`; 0: auto, by page size); several (comma separated)
    /// measure the small-page layouts once per value in this one process (the in-process
    /// pool and worker A restart for each), cases then named
    /// `<layout>_g<percent>_...` [default: the pool's, auto].
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(0..=1000))]
    stage_growth: Vec<u32>,
    /// In-process pool: µs its service and copy threads poll for work before they sleep, or
    /// `auto` (`umbp-pool --idle-poll-us`) [default: the pool's, auto].
    #[arg(long, value_name = "US|auto")]
    idle_poll_us: Option<umbp_pool::config::IdlePoll>,
    /// In-process pool: give it an SSD tier in this directory (4x --capacity, admission
    /// `all`) and measure `ssd_restore_10k_ms`, the gpt-oss prefix restored from SSD (case
    /// group `ssd`; needs `gptoss`).
    #[arg(long)]
    ssd_dir: Option<std::path::PathBuf>,
    /// In-process pool: back its DRAM with 2 MiB huge pages (`umbp-pool --hugepages`;
    /// needs that many free in /proc/sys/vm/nr_hugepages).
    #[arg(long)]
    hugepages: bool,
}

impl TransferCli {
    pub fn run(self) -> std::io::Result<()> {
        self.run_inner().map_err(std::io::Error::other)
    }

    fn run_inner(self) -> Result<(), String> {
        init_logs();
        let mode = match self.gather.as_str() {
            "auto" => umbp_gpu::GatherMode::Auto,
            "kernel" => umbp_gpu::GatherMode::Kernel,
            "copy-engine" => umbp_gpu::GatherMode::CopyEngine,
            "staged" => umbp_gpu::GatherMode::Staged,
            other => return Err(format!("--gather {other}: expected auto, kernel, copy-engine or staged")),
        };
        let mut engine = umbp_gpu::EngineConfig::default();
        engine.gather = umbp_gpu::GatherConfig {
            mode,
            blocks: self.gather_blocks,
            launch_bytes: self.gather_launch_kib << 10,
            split_streams: self.split_streams,
        };
        engine.stage_bytes = self.device_stage_mib << 20;
        engine.streams = self.streams.unwrap_or(engine.streams);
        engine.batch = !self.no_batch;
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
            engine,
            layout_only: self.layout_only,
            multi_gpu: self.multi_gpu,
            matmul: self.matmul,
            sweep: self.sweep,
            layouts: self.layouts,
            sizes: self.sizes,
            tokens: self.tokens.max(16),
            copy_threads: self.copy_threads.unwrap_or_else(|| PoolConfig::default().copy_threads).max(1),
            stage_mib: self.stage_mib,
            stage_growth: self.stage_growth,
            idle_poll: self.idle_poll_us.unwrap_or(umbp_pool::config::DEFAULT_IDLE_POLL),
            ssd_dir: self.ssd_dir,
            hugepages: self.hugepages,
        };
        if args.sizes.contains(&0) {
            return Err("--sizes: object sizes are in MiB and must be at least 1".into());
        }
        let cases = if args.multi_gpu { crate::multi_gpu::run(&args)? } else { run(&args)? };
        for (ordinal, c) in umbp_gpu::gather::calibrations() {
            eprintln!("page copy kernel calibration, GPU {ordinal}: {c:?}");
        }
        eprintln!("page copy kernel (--gather {}): (launches, pages) {:?}", self.gather, umbp_gpu::gather::kernel_launches());
        eprintln!("device staging: (bytes held, chunks) {:?}", umbp_gpu::gather::staging_stats());
        if !cases.is_empty() {
            crate::report::print(&cases, self.json);
        }
        Ok(())
    }
}

/// Pool and worker logs on stderr (RUST_LOG, default: warnings, pool progress).
fn init_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,umbp_pool::store::dram=info"));
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
