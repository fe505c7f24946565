//! `umbp-bench`: benchmarks with one output convention (docs/benchmarks.md): one JSON
//! object per case and line with `--json`, a table otherwise. The measuring code lives in
//! the `umbp_bench` library (`benches/src/`); this file only parses the command line.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use umbp_bench as bench;
use umbp_bench::index::IndexArgs;
use umbp_bench::ring::RingArgs;

#[derive(Parser)]
#[command(name = "umbp-bench", about = "UMBP benchmarks (rings, index, lookups, transfers, SSD tier, chaos soak)", version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Cross-process SQ->CQ round trip (polling and futex-sleeping consumers) against a
    /// unix-socket round trip of the same 64 bytes.
    Ring {
        /// Timed round trips per phase.
        #[arg(long, default_value_t = 100_000)]
        iterations: usize,
        /// Untimed round trips before each phase.
        #[arg(long, default_value_t = 2_000)]
        warmup: usize,
        /// One JSON object per case and line.
        #[arg(long)]
        json: bool,
    },
    /// Shared-index prefix match and miss cost at production size against std HashMap.
    Index {
        /// Entries in the table.
        #[arg(long, default_value_t = 1_000_000)]
        entries: u64,
        /// Keys per match_prefix call (and miss keys).
        #[arg(long, default_value_t = 1_000)]
        keys: usize,
        /// Timed rounds per case.
        #[arg(long, default_value_t = 5_000)]
        iterations: usize,
        /// Smallest object size the table is sized for (slots_for divisor).
        #[arg(long, default_value_t = 64 << 10)]
        min_object_bytes: u64,
        /// One JSON object per case and line.
        #[arg(long)]
        json: bool,
    },
    /// Scheduler prefix lookup through the shared index of a live pool under concurrent
    /// store traffic, against the same lookup as a unix-socket request/response.
    Lookup {
        /// Timed lookups per prompt size.
        #[arg(long, default_value_t = 20_000)]
        iterations: usize,
        /// Prompt sizes in blocks (comma separated).
        #[arg(long, value_delimiter = ',', default_value = "64,1024")]
        blocks: Vec<usize>,
        /// One JSON object per case and line.
        #[arg(long)]
        json: bool,
    },
    /// SSD tier store (segment files, io_uring, O_DIRECT, CRC32C) write/read GB/s against raw
    /// io_uring O_DIRECT of the same bytes in the same directory, and warm restart.
    Ssd {
        /// Directory on the drive to measure (a scratch subdirectory is made and removed).
        #[arg(long, default_value = "/var/tmp")]
        dir: std::path::PathBuf,
        /// Bytes written and read in each of the two phases.
        #[arg(long, default_value = "1GiB", value_parser = parse_bytes)]
        bytes: u64,
        /// Object size.
        #[arg(long, default_value = "256KiB", value_parser = parse_bytes)]
        object_size: u64,
        /// Objects per batched submission.
        #[arg(long, default_value_t = 64)]
        batch: usize,
        /// One-block objects for the warm-restart cases (0: skip them).
        #[arg(long, default_value_t = 100_000)]
        rebuild_objects: u64,
        /// Pool DRAM of the admission cases: a store/re-hit workload of 8x this (64 KiB
        /// objects) under each admission policy, SSD bytes written and re-hit rate (0: skip).
        #[arg(long, default_value = "32MiB", value_parser = parse_bytes)]
        admission_dram: u64,
        /// One JSON object per case and line.
        #[arg(long)]
        json: bool,
    },
    /// KV store/load GB/s through a pool (host memfd or CUDA memory, workers in child
    /// processes) beside contiguous-copy baselines; `--check` runs the GPU data-path checks.
    Transfer(bench::transfer::TransferCli),
    /// Cluster tier remote load (pin + NIXL READ over UCX) against a raw NIXL READ of the
    /// same bytes between the same two agents; needs libnixl_capi.so (scripts/setup-nixl.sh).
    Cluster(bench::cluster::ClusterCli),
    /// Internal: the holder process of `cluster`.
    #[command(name = "__cluster-peer", hide = true)]
    ClusterPeer(bench::cluster::ClusterPeerCli),
    /// Internal: the holder pool process of `cluster` (the cases through real pools).
    #[command(name = "__cluster-pool-peer", hide = true)]
    ClusterPoolPeer(bench::cluster_pools::ClusterPoolPeerCli),
    /// Chaos soak: worker processes store and load checksummed blocks while workers are
    /// SIGKILLed and the pool is stopped, resumed, killed and restarted; checks no corrupted
    /// byte, no blocked call, no leak after any worker death, every worker re-attached.
    Soak(bench::soak::SoakCli),
    /// Internal: a worker process of `soak`.
    #[command(name = "__soak-worker", hide = true)]
    SoakWorker(bench::soak::SoakWorkerCli),
    /// Internal: the pool process of `soak --inject-corruption` (a test-only fault armed).
    #[command(name = "__soak-pool", hide = true)]
    SoakPool(bench::soak::SoakPoolCli),
    /// Internal: a worker process of `transfer`.
    #[command(name = "__transfer-worker", hide = true)]
    TransferWorker(bench::transfer::TransferWorkerCli),
    /// Internal: the pool side of `ring`, started by `ring` itself.
    #[command(name = "__ring-peer", hide = true)]
    RingPeer {
        #[arg(long)]
        fd: i32,
        #[arg(long)]
        sock_fd: i32,
        #[arg(long)]
        rounds: usize,
    },
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    umbp_pool::parse_size("size", s).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Ring { iterations, warmup, json } => {
            bench::ring::run(&RingArgs { iterations: iterations.max(1), warmup }).map(|c| bench::report::print(&c, json))
        }
        Cmd::Index { entries, keys, iterations, min_object_bytes, json } => bench::index::run(&IndexArgs {
            entries: entries.max(1),
            keys: keys.max(1),
            iterations: iterations.max(1),
            min_object_bytes: min_object_bytes.max(1),
        })
        .map(|c| bench::report::print(&c, json)),
        Cmd::Lookup { iterations, blocks, json } => {
            bench::lookup::run(&bench::lookup::LookupArgs { iterations: iterations.max(1), blocks }).map(|c| bench::report::print(&c, json))
        }
        Cmd::Ssd { dir, bytes, object_size, batch, rebuild_objects, admission_dram, json } => {
            bench::ssd::run(&bench::ssd::SsdArgs { dir, bytes, object_bytes: object_size.max(1), batch, rebuild_objects, admission_dram })
                .map(|c| bench::report::print(&c, json))
                .map_err(std::io::Error::other)
        }
        Cmd::Transfer(t) => t.run(),
        Cmd::TransferWorker(t) => t.run(),
        Cmd::Cluster(c) => c.run(),
        Cmd::ClusterPeer(c) => c.run(),
        Cmd::ClusterPoolPeer(c) => c.run(),
        Cmd::Soak(s) => s.run().map_err(std::io::Error::other),
        Cmd::SoakWorker(s) => s.run().map_err(std::io::Error::other),
        Cmd::SoakPool(s) => s.run().map_err(std::io::Error::other),
        Cmd::RingPeer { fd, sock_fd, rounds } => bench::ring::peer(fd, sock_fd, rounds),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("umbp-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
