//! A cluster peer process for tests and benchmarks: a `MemPool` of `--objects` objects of
//! `--object-bytes` each (key `--first-key` + i, bytes `mem_pool::pattern`), served by a real
//! cluster node on `--listen`. Prints `READY <addr>` once listening; runs until killed.

use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use umbp_cluster::control::Secret;
use umbp_cluster::mem_pool::{pattern, MemPool};
use umbp_cluster::membership::StaticPeers;
use umbp_cluster::{Cluster, ClusterConfig};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    #[arg(long = "peer")]
    peers: Vec<String>,
    #[arg(long)]
    secret_file: std::path::PathBuf,
    #[arg(long, default_value_t = 4)]
    objects: u64,
    #[arg(long, default_value_t = 1 << 20)]
    object_bytes: u64,
    /// Key of the first object (the others follow it).
    #[arg(long, default_value_t = 1)]
    first_key: u128,
    /// Bytes of the export area [default: room for every object pinned at once, at least
    /// the node's default]
    #[arg(long)]
    export_bytes: Option<u64>,
    /// This node's `read_timeout` in ms (with the margin, its pin lease) [default: the node's]
    #[arg(long)]
    read_timeout_ms: Option<u64>,
    /// This node's `pin_lease_margin` in ms [default: the node's]
    #[arg(long)]
    pin_lease_margin_ms: Option<u64>,
}

fn main() {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).with_writer(std::io::stderr).init();
    let a = Args::parse();
    let secret = Secret::from_file(&a.secret_file).unwrap_or_else(|e| {
        eprintln!("umbp-cluster-peer: {e}");
        std::process::exit(2)
    });
    let pool = Arc::new(MemPool::new((a.objects * a.object_bytes).max(4096) as usize));
    for i in 0..a.objects {
        let key = a.first_key + i as u128;
        pool.put(key, i * a.object_bytes, &pattern(key, a.object_bytes as usize));
    }
    let mut cfg = ClusterConfig::new(a.listen, secret);
    cfg.heartbeat = Duration::from_millis(200);
    cfg.dead_after = Duration::from_millis(1000);
    if let Some(ms) = a.read_timeout_ms {
        cfg.read_timeout = Duration::from_millis(ms);
    }
    if let Some(ms) = a.pin_lease_margin_ms {
        cfg.pin_lease_margin = Duration::from_millis(ms);
    }
    let all = (a.objects * a.object_bytes.next_multiple_of(umbp_cluster::export::SLOT_ALIGN)).max(cfg.export_bytes);
    cfg.export_bytes = a.export_bytes.unwrap_or(all).next_multiple_of(umbp_cluster::export::SLOT_ALIGN);
    // SAFETY: the mapping lives as long as `pool`, which outlives the node (never dropped).
    let node = unsafe { Cluster::start(cfg, Box::new(StaticPeers(a.peers)), pool.clone(), pool.base(), pool.len()) };
    let node = node.unwrap_or_else(|e| {
        eprintln!("umbp-cluster-peer: {e}");
        std::process::exit(2)
    });
    println!("READY {}", node.local_addr());
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}
