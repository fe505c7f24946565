//! `umbp-pool`: the node-local KV-cache pool daemon.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use umbp_pool::{parse_fraction, parse_size, Pool, PoolConfig};

/// The node-local KV-cache pool that LLM serving engines share.
///
/// Every flag can also be set through the environment variable named in brackets; a flag
/// on the command line wins over the environment. Logs go to stderr; set RUST_LOG
/// (e.g. RUST_LOG=umbp_pool=debug) for more.
#[derive(Parser, Debug)]
#[command(name = "umbp-pool", version, about, long_about)]
struct Args {
    /// Unix socket to listen on [default: $XDG_RUNTIME_DIR/umbp/pool.sock or /tmp/umbp/pool.sock].
    #[arg(long, env = "UMBP_STANDALONE_ADDRESS", value_name = "PATH")]
    socket: Option<PathBuf>,
    /// DRAM to hold KV blocks in, e.g. 64GiB, 512MiB [default: half of available memory].
    #[arg(long, env = "UMBP_DRAM_CAPACITY", value_name = "SIZE")]
    capacity: Option<String>,
    /// Occupancy (fraction of capacity) above which the evictor starts.
    #[arg(long = "high-wm", env = "UMBP_DRAM_HIGH_WM", value_name = "FRACTION", default_value = "0.9")]
    high_wm: String,
    /// Occupancy the evictor brings the pool back down to.
    #[arg(long = "low-wm", env = "UMBP_DRAM_LOW_WM", value_name = "FRACTION", default_value = "0.7")]
    low_wm: String,
    /// Back DRAM with 2 MiB huge pages (reserve them first: /proc/sys/vm/nr_hugepages).
    #[arg(long, env = "UMBP_DRAM_USE_HUGEPAGES", value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, default_missing_value = "true")]
    hugepages: Option<bool>,
    /// Bind DRAM to this NUMA node (use the GPUs' node: nvidia-smi topo -m).
    #[arg(long = "numa-node", env = "UMBP_DRAM_NUMA_NODE", value_name = "N")]
    numa_node: Option<u32>,
    /// Fault in all DRAM at start (shows progress) so first stores are not slowed.
    #[arg(long, env = "UMBP_DRAM_PREFAULT", value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, default_missing_value = "true")]
    prefault: Option<bool>,
    /// Also allow peers running as this uid (repeatable). The pool's own uid and root are always allowed.
    #[arg(long = "allow-uid", value_name = "UID")]
    allow_uid: Vec<u32>,
    /// Smallest KV object expected; sizes the shared index (capacity / this x 2 slots).
    #[arg(long = "min-object-size", env = "UMBP_MIN_OBJECT_SIZE", value_name = "SIZE", default_value = "64KiB")]
    min_object_size: String,
    /// How long a scheduler's prefix hit protects the blocks from eviction, in ms.
    #[arg(long = "lease-ms", env = "UMBP_LEASE_MS", value_name = "MS", default_value_t = 2000)]
    lease_ms: u64,
    /// Threads that run copies [default: CPU count clamped to 2..8].
    #[arg(long = "copy-threads", env = "UMBP_COPY_THREADS", value_name = "N")]
    copy_threads: Option<usize>,
}

fn config_from(args: Args) -> Result<PoolConfig, String> {
    let mut c = PoolConfig::default();
    if let Some(s) = args.socket {
        c.socket_path = s;
    }
    if let Some(cap) = args.capacity {
        c.capacity_bytes = parse_size("capacity (UMBP_DRAM_CAPACITY)", &cap).map_err(|e| e.to_string())?;
    }
    c.high_watermark = parse_fraction("high-wm (UMBP_DRAM_HIGH_WM)", &args.high_wm).map_err(|e| e.to_string())?;
    c.low_watermark = parse_fraction("low-wm (UMBP_DRAM_LOW_WM)", &args.low_wm).map_err(|e| e.to_string())?;
    c.hugepages = args.hugepages.unwrap_or(false);
    c.numa_node = args.numa_node;
    c.prefault = args.prefault.unwrap_or(false);
    c.allow_uids = args.allow_uid;
    c.min_object_bytes = parse_size("min-object-size", &args.min_object_size).map_err(|e| e.to_string())?;
    c.lease = std::time::Duration::from_millis(args.lease_ms);
    if let Some(n) = args.copy_threads {
        c.copy_threads = n;
    }
    c.validate().map_err(|e| e.to_string())?;
    Ok(c)
}

/// Blocks SIGINT/SIGTERM in every thread and returns when one arrives.
fn block_signals() -> libc::sigset_t {
    // SAFETY: plain libc signal-mask calls on a local sigset.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let config = match config_from(Args::parse()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("umbp-pool: {e}");
            return ExitCode::from(2);
        }
    };
    // Before any thread starts, so all inherit the mask and only sigwait sees the signal.
    let set = block_signals();
    let pool = match Pool::start(config) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("umbp-pool: {e}");
            return ExitCode::from(1);
        }
    };
    let mut sig = 0;
    // SAFETY: waits on the set blocked above.
    unsafe { libc::sigwait(&set, &mut sig) };
    tracing::info!(signal = sig, "shutting down");
    pool.shutdown();
    ExitCode::SUCCESS
}
