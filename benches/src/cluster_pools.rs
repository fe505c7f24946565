//! `umbp-bench cluster`, through real pools: a prefix stored through a worker of pool A
//! (a child process: this binary, hidden `__cluster-pool-peer`, an in-process
//! `umbp_pool::Pool` with its cluster tier) and loaded through a worker of pool B (this
//! process) into host memory: the whole remote path a serving engine takes (index entry
//! marked remote, load request, promotion through the cluster's `TierSource`: pin, NIXL READ,
//! unpin, publish, copy to the worker). Beside it, in the same run: the same prefix loaded
//! again through the same worker (now local DRAM), and the scheduler's local lookup
//! (`match_prefix` of a locally stored prefix) with no remote entries in the index and then
//! with the holder's entries present.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use umbp_cluster::control::Secret;
use umbp_cluster::mem_pool::pattern;
use umbp_cluster::membership::StaticPeers;
use umbp_cluster::pool_tier::{ClusterTier, TierOptions};
use umbp_cluster::ClusterConfig;
use umbp_protocol::ObjectKey;
use umbp_scheduler::IndexClient;
use umbp_worker::{MemorySpec, Segment, Worker, WorkerConfig};

use crate::report::{Better, Case};

pub const POOL_PEER_SUBCOMMAND: &str = "__cluster-pool-peer";

/// Namespace of the prefix (remote) and of the lookup's local prefix.
const NS_REMOTE: u128 = 0xc1u128;
const NS_LOCAL: u128 = 0xc2u128;
/// Blocks of the locally stored prefix the lookup measures.
const LOOKUP_BLOCKS: u64 = 64;
const LOOKUP_ITERATIONS: usize = 20_000;
/// Blocks per load request.
const REQUEST_BLOCKS: u64 = 32;

/// The hidden holder process: a pool with its cluster tier, the prefix stored through a worker.
#[derive(Debug, Clone, clap::Args)]
pub struct ClusterPoolPeerCli {
    #[arg(long)]
    pub secret_file: std::path::PathBuf,
    #[arg(long)]
    pub blocks: u64,
    #[arg(long)]
    pub block_bytes: u64,
}

fn key(ns: u128, i: u64) -> ObjectKey {
    ObjectKey::derive(ns, 0, 0, &i.to_le_bytes())
}

fn cluster_cfg(secret: Secret) -> ClusterConfig {
    let mut c = ClusterConfig::new("127.0.0.1:0".into(), secret);
    c.read_timeout = Duration::from_secs(60);
    c
}

fn start_pool(socket: &std::path::Path, bytes: u64, block: u64, promotion_ahead: Option<u64>) -> Result<umbp_pool::Pool, String> {
    let mut cfg = umbp_pool::PoolConfig {
        socket_path: socket.to_path_buf(),
        // Room for the prefix and the lookup's prefix, below the eviction watermark.
        capacity_bytes: (bytes + LOOKUP_BLOCKS * block) * 3 / 2,
        min_object_bytes: 64 << 10,
        // Steady state: DRAM touched once (a fresh pool's first remote loads also pay the
        // page faults of their destinations; the fetch-level cases warm up likewise).
        prefault: true,
        ..Default::default()
    };
    if let Some(b) = promotion_ahead {
        cfg.promotion_ahead_bytes = b;
    }
    umbp_pool::Pool::start(cfg).map_err(|e| e.to_string())
}

/// A worker over `blocks` blocks of `block` bytes of `mem` (this process's memory).
fn worker(socket: &std::path::Path, ns: u128, mem: &[u8], block: u64, blocks: u64) -> Result<Worker, String> {
    let mut w = Worker::connect(WorkerConfig::new(socket, ns)).map_err(|e| e.to_string())?;
    // SAFETY: the caller keeps `mem` alive and in place while `w` lives.
    unsafe { w.register_memory(MemorySpec::HostProcess { ptr: mem.as_ptr() as usize, len: mem.len() }) }.map_err(|e| e.to_string())?;
    w.register_layout(0, vec![Segment::new(0, 0, block, block, blocks)]).map_err(|e| e.to_string())?;
    Ok(w)
}

/// Submits every request of `blocks` (key, block id) at once, waits for all; Ok(blocks ok).
fn transfer(w: &mut Worker, store: bool, blocks: &[(ObjectKey, u64)]) -> Result<usize, String> {
    let mut ids = Vec::new();
    for chunk in blocks.chunks(REQUEST_BLOCKS as usize) {
        let id = if store { w.store(0, chunk) } else { w.load(0, chunk) }.map_err(|e| e.to_string())?;
        ids.push(id);
    }
    let mut ok = 0;
    for id in ids {
        let c = w.wait(id, Duration::from_secs(120)).ok_or("a transfer did not complete in 120 s")?;
        ok += c.ok_count();
    }
    Ok(ok)
}

impl ClusterPoolPeerCli {
    pub fn run(self) -> std::io::Result<()> {
        crate::cluster_setup::ucx_loopback_defaults();
        fn e(m: impl ToString) -> std::io::Error {
            std::io::Error::other(m.to_string())
        }
        let secret = Secret::from_file(&self.secret_file).map_err(e)?;
        let dir = tempfile::Builder::new().prefix("umbp-bench-cluster-a-").tempdir()?;
        let socket = dir.path().join("pool.sock");
        let pool = start_pool(&socket, self.blocks * self.block_bytes, self.block_bytes, None).map_err(e)?;
        let tier = ClusterTier::start(pool.cluster_access(), cluster_cfg(secret), Box::new(StaticPeers(vec![])), TierOptions::default())
            .map_err(e)?;
        let mut mem = vec![0u8; (self.blocks * self.block_bytes) as usize];
        for i in 0..self.blocks {
            let at = (i * self.block_bytes) as usize;
            mem[at..at + self.block_bytes as usize].copy_from_slice(&pattern(i as u128 + 1, self.block_bytes as usize));
        }
        let mut w = worker(&socket, NS_REMOTE, &mem, self.block_bytes, self.blocks).map_err(e)?;
        let blocks: Vec<(ObjectKey, u64)> = (0..self.blocks).map(|i| (key(NS_REMOTE, i), i)).collect();
        let ok = transfer(&mut w, true, &blocks).map_err(e)?;
        if ok != blocks.len() {
            return Err(e(format!("holder stored {ok} of {} blocks", blocks.len())));
        }
        println!("READY {}", tier.cluster().local_addr());
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}

fn lookup_ns(idx: &mut IndexClient, keys: &[ObjectKey]) -> Result<(f64, f64), String> {
    let mut lat = Vec::with_capacity(LOOKUP_ITERATIONS);
    for _ in 0..LOOKUP_ITERATIONS {
        let t = Instant::now();
        let hits = idx.match_prefix(keys);
        lat.push(t.elapsed().as_nanos() as u64);
        if hits != keys.len() {
            return Err(format!("lookup found {hits} of {} local blocks", keys.len()));
        }
    }
    lat.sort_unstable();
    let p = |q: f64| lat[((lat.len() - 1) as f64 * q).round() as usize] as f64;
    Ok((p(0.5), p(0.99)))
}

/// The pool-path cases; `a` as for the fetch-level cases.
pub fn run(a: &crate::cluster_setup::ClusterCli, secret_path: &std::path::Path) -> Result<Vec<Case>, String> {
    let blocks = a.prefix_tokens.div_ceil(a.tokens_per_block.max(1));
    let block = a.tokens_per_block * a.token_bytes;
    let total = blocks * block;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args([POOL_PEER_SUBCOMMAND, "--blocks", &blocks.to_string(), "--block-bytes", &block.to_string()])
        .arg("--secret-file")
        .arg(secret_path)
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line).map_err(|e| e.to_string())?;
    let _holder = crate::cluster_setup::Holder(child);
    let addr = line.strip_prefix("READY ").ok_or_else(|| format!("holder pool said {line:?}"))?.trim().to_string();

    let dir = tempfile::Builder::new().prefix("umbp-bench-cluster-b-").tempdir().map_err(|e| e.to_string())?;
    let socket = dir.path().join("pool.sock");
    let promotion_ahead = a.promotion_ahead_mib.map(|m| m << 20);
    let pool = start_pool(&socket, total, block, promotion_ahead)?;
    let mut mem = vec![0u8; ((blocks + LOOKUP_BLOCKS) * block) as usize];
    // Touched before anything is timed: the local reload below writes resident pages, so
    // the remote restore must too (a first write into fresh pages costs a page fault per
    // page, which measured more than the fetch and the copy together on the 2-core VM).
    mem.fill(0xa5);
    let mut w = worker(&socket, NS_REMOTE, &mem, block, blocks + LOOKUP_BLOCKS)?;
    // The lookup's prefix, stored locally (from the tail of `mem`).
    let mut lw = worker(&socket, NS_LOCAL, &mem, block, blocks + LOOKUP_BLOCKS)?;
    let local: Vec<(ObjectKey, u64)> = (0..LOOKUP_BLOCKS).map(|i| (key(NS_LOCAL, i), blocks + i)).collect();
    if transfer(&mut lw, true, &local)? != local.len() {
        return Err("the lookup prefix was not stored".into());
    }
    let local_keys: Vec<ObjectKey> = local.iter().map(|b| b.0).collect();
    let mut idx = IndexClient::connect(&socket, NS_LOCAL, Duration::from_secs(5)).map_err(|e| e.to_string())?;
    lookup_ns(&mut idx, &local_keys)?; // warm-up
    let (none_p50, none_p99) = lookup_ns(&mut idx, &local_keys)?;

    // Join the holder; wait for its entries.
    let secret = Secret::from_file(secret_path).map_err(|e| e.to_string())?;
    let tier = ClusterTier::start(
        pool.cluster_access(),
        cluster_cfg(secret),
        Box::new(StaticPeers(vec![addr])),
        TierOptions { max_remote_entries: Some(blocks) },
    )
    .map_err(|e| e.to_string())?;
    let t = Instant::now();
    while pool.report().tiers.remote < blocks {
        if t.elapsed() > Duration::from_secs(120) {
            return Err(format!("pool B listed {} of {blocks} remote entries in 120 s", pool.report().tiers.remote));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let remote_entries = pool.report().tiers.remote;
    let (with_p50, with_p99) = lookup_ns(&mut idx, &local_keys)?;

    // The prefix through pool B's worker: remote (pulled, cached), then again (local).
    let prefix: Vec<(ObjectKey, u64)> = (0..blocks).map(|i| (key(NS_REMOTE, i), i)).collect();
    let t = Instant::now();
    let ok = transfer(&mut w, false, &prefix)?;
    let remote_ms = t.elapsed().as_secs_f64() * 1e3;
    if ok != prefix.len() {
        return Err(format!("remote restore loaded {ok} of {blocks} blocks"));
    }
    for i in 0..blocks {
        let at = (i * block) as usize;
        if mem[at..at + block as usize] != pattern(i as u128 + 1, block as usize)[..] {
            return Err(format!("block {i} differs after the remote restore"));
        }
    }
    mem[..total as usize].fill(0);
    let t = Instant::now();
    let ok = transfer(&mut w, false, &prefix)?;
    let local_ms = t.elapsed().as_secs_f64() * 1e3;
    if ok != prefix.len() || pool.report().tiers.remote != 0 {
        return Err(format!("local restore loaded {ok} of {blocks} blocks"));
    }
    let stats = tier.cluster().stats();
    let pool_ahead = promotion_ahead.unwrap_or(umbp_pool::config::DEFAULT_PROMOTION_AHEAD_BYTES);
    drop(tier);
    let ctx = |c: Case| {
        c.extra("cpus", std::thread::available_parallelism().map_or(1, |n| n.get()))
            .extra("path", "pool worker (host memory) -> pool B -> cluster tier -> pool A")
            .extra("blocks", blocks)
            .extra("block_bytes", block)
            .extra("bytes", total)
            .extra("prefix_tokens", a.prefix_tokens)
            .extra("request_blocks", REQUEST_BLOCKS)
            .extra("remote_fetches", stats.fetches)
            .extra("prefault", true)
            .extra("destination_touched", true)
            .extra("promotion_ahead_bytes", pool_ahead)
            .extra("ucx_tls", std::env::var("UCX_TLS").unwrap_or_default())
            .extra("verified_bytes", true)
    };
    let lctx = |c: Case| {
        c.extra("lookup_blocks", LOOKUP_BLOCKS)
            .extra("iterations", LOOKUP_ITERATIONS)
            .extra("remote_entries", remote_entries)
            .extra("p99_ns_with_remote", with_p99)
            .extra("p99_ns_without", none_p99)
    };
    Ok(vec![
        ctx(Case::new(
            "cluster",
            "pool_remote_restore_ms",
            remote_ms,
            "ms",
            local_ms,
            "the same prefix loaded again through the same worker (local DRAM)",
            Better::Lower,
        )),
        lctx(Case::new(
            "cluster",
            "lookup_with_remote_entries_p50_ns",
            with_p50,
            "ns",
            none_p50,
            "the same lookup with no remote entries (same pool, same run)",
            Better::Lower,
        )),
    ])
}
