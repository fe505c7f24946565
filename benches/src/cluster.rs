//! `umbp-bench cluster`: a remote load through the cluster tier (pin at the holder over the
//! encrypted control connection, which copies the object into its export area; NIXL READ of
//! the copy into local DRAM; digest check; unpin: `umbp_cluster::Cluster::fetch`) against a
//! raw NIXL READ of as many bytes from the holder's export area by the same two agents in
//! the same run (nixl-sys directly: descriptor lists, create, post, poll). The holder is a child
//! process (this binary, hidden `__cluster-peer`) with a real cluster node; UCX runs over
//! TCP on loopback unless `UCX_TLS` is set. Needs libnixl_capi.so (scripts/setup-nixl.sh).

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_cluster::control::Secret;
use umbp_cluster::mem_pool::{pattern, MemPool};
use umbp_cluster::membership::StaticPeers;
use umbp_cluster::{transport, Cluster, ClusterConfig, FetchRequest};
use umbp_protocol::ObjectKey;

pub use crate::cluster_setup::ClusterCli;
use crate::cluster_setup::{ucx_loopback_defaults, Holder};
use crate::report::{Better, Case};

pub const PEER_SUBCOMMAND: &str = "__cluster-peer";

/// The hidden holder process.
#[derive(Debug, Clone, clap::Args)]
pub struct ClusterPeerCli {
    #[arg(long)]
    pub secret_file: std::path::PathBuf,
    #[arg(long)]
    pub objects: u64,
    #[arg(long)]
    pub object_bytes: u64,
}

fn cluster_cfg(secret: Secret) -> ClusterConfig {
    let mut c = ClusterConfig::new("127.0.0.1:0".into(), secret);
    c.read_timeout = Duration::from_secs(60);
    c
}

impl ClusterPeerCli {
    pub fn run(self) -> std::io::Result<()> {
        ucx_loopback_defaults();
        let secret = Secret::from_file(&self.secret_file).map_err(std::io::Error::other)?;
        let pool = Arc::new(MemPool::new((self.objects * self.object_bytes) as usize));
        for i in 0..self.objects {
            pool.put(i as u128 + 1, i * self.object_bytes, &pattern(i as u128 + 1, self.object_bytes as usize));
        }
        // SAFETY: `pool` is never dropped while the node runs (the process ends first).
        let node = unsafe { Cluster::start(cluster_cfg(secret), Box::new(StaticPeers(vec![])), pool.clone(), pool.base(), pool.len()) }
            .map_err(std::io::Error::other)?;
        println!("READY {}", node.local_addr());
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}

/// One raw NIXL READ of `(local, remote, len)` pieces: descriptor lists, create, post,
/// poll to completion.
fn raw_read(agent: &transport::Agent, peer_agent: &str, pieces: &[(usize, usize, usize)]) -> Result<(), String> {
    use nixl_sys::{MemType, XferDescList, XferOp, XferStatus};
    let e = |e: nixl_sys::NixlError| e.to_string();
    let a = agent.raw();
    let mut l = XferDescList::new(MemType::Dram).map_err(e)?;
    let mut r = XferDescList::new(MemType::Dram).map_err(e)?;
    for &(local, remote, len) in pieces {
        l.add_desc(local, len, 0);
        r.add_desc(remote, len, 0);
    }
    let req = a.create_xfer_req(XferOp::Read, &l, &r, peer_agent, Some(agent.opt_args())).map_err(e)?;
    if a.post_xfer_req(&req, Some(agent.opt_args())).map_err(e)? {
        // The same completion polling as the cluster tier's reads.
        let mut backoff = transport::Backoff::default();
        while a.get_xfer_status(&req).map_err(e)? == XferStatus::InProgress {
            backoff.wait();
        }
    }
    Ok(())
}

impl ClusterCli {
    pub fn run(self) -> std::io::Result<()> {
        let cases = run(&self).map_err(std::io::Error::other)?;
        crate::report::print(&cases, self.json);
        Ok(())
    }
}

pub fn run(a: &ClusterCli) -> Result<Vec<Case>, String> {
    ucx_loopback_defaults();
    transport::load_library().map_err(|e| e.to_string())?;
    let blocks = a.prefix_tokens.div_ceil(a.tokens_per_block.max(1));
    let block = a.tokens_per_block * a.token_bytes;
    let total = blocks * block;
    let batch = a.batch.max(1);
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let secret_path = dir.path().join("secret");
    std::fs::write(&secret_path, crate::cluster::secret_bytes()).map_err(|e| e.to_string())?;
    std::fs::set_permissions(&secret_path, std::fs::Permissions::from_mode(0o600)).map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args([PEER_SUBCOMMAND, "--objects", &blocks.to_string(), "--object-bytes", &block.to_string()])
        .arg("--secret-file")
        .arg(&secret_path)
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line).map_err(|e| e.to_string())?;
    let _holder = Holder(child);
    let addr = line.strip_prefix("READY ").ok_or_else(|| format!("holder process said {line:?}"))?.trim().to_string();

    let pool = Arc::new(MemPool::new(total as usize));
    let secret = Secret::from_file(&secret_path).map_err(|e| e.to_string())?;
    // SAFETY: `pool` outlives `node` (declared before it, dropped after).
    let node = unsafe { Cluster::start(cluster_cfg(secret), Box::new(StaticPeers(vec![addr])), pool.clone(), pool.base(), pool.len()) }
        .map_err(|e| e.to_string())?;
    let t = Instant::now();
    while pool.remote_keys().len() < blocks as usize {
        if t.elapsed() > Duration::from_secs(120) {
            return Err(format!("holder advertised {} of {blocks} keys in 120 s", pool.remote_keys().len()));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let (_, region) = node.peer_regions().into_iter().next().ok_or("holder has not joined")?;
    // The raw READs address the holder's export area (all a peer can reach), a batch at a
    // time from its start, as the cluster path's slots are.
    if batch * block > region.len {
        return Err(format!("a batch of {batch} blocks of {block} bytes exceeds the holder's {}-byte export area", region.len));
    }

    let mut raw_s = Vec::new();
    let mut umbp_s = Vec::new();
    let raw_pass = || -> Result<f64, String> {
        let t = Instant::now();
        for first in (0..blocks).step_by(batch as usize) {
            let pieces: Vec<(usize, usize, usize)> = (first..(first + batch).min(blocks))
                .map(|i| {
                    let off = (i * block) as usize;
                    let remote = ((i - first) * block) as usize;
                    (pool.base() as usize + off, region.base as usize + remote, block as usize)
                })
                .collect();
            raw_read(node.agent(), &region.agent, &pieces)?;
        }
        Ok(t.elapsed().as_secs_f64())
    };
    // Batches in flight at once on the cluster path: each holds its copies in the holder's
    // export area until read, so no more than the area holds.
    let ahead = a.ahead.min((region.len / (batch * block)).saturating_sub(1) as usize);
    let umbp_pass = || -> Result<f64, String> {
        // Poison the destination so the cluster path must bring every byte again.
        // SAFETY: our own mapping, no transfer in flight.
        unsafe { std::ptr::write_bytes(pool.base(), 0, total as usize) };
        let t = Instant::now();
        let stages: Vec<Vec<FetchRequest>> = (0..blocks)
            .step_by(batch as usize)
            .map(|first| {
                (first..(first + batch).min(blocks))
                    .map(|i| FetchRequest {
                        key: ObjectKey(i as u128 + 1),
                        namespace: 0,
                        size: block,
                        // SAFETY: block i's range is in the registered mapping and used by nothing else.
                        dest: unsafe { pool.base().add((i * block) as usize) },
                    })
                    .collect()
            })
            .collect();
        let stages: Vec<&[FetchRequest]> = stages.iter().map(Vec::as_slice).collect();
        // SAFETY: as above, for every request of every stage.
        for r in unsafe { node.fetch_stages(0, &stages, ahead) }.into_iter().flatten() {
            r.map_err(|e| e.to_string())?;
        }
        Ok(t.elapsed().as_secs_f64())
    };
    // Round 0 warms both paths (connections, page faults), is checked byte by byte and not
    // counted; the order of the two passes alternates between rounds.
    raw_pass()?;
    umbp_pass()?;
    let warm = node.stats().phases;
    for i in 0..blocks {
        if pool.read(i * block, block as usize) != pattern(i as u128 + 1, block as usize) {
            return Err(format!("block {i} differs after a remote load"));
        }
    }
    for round in 0..a.rounds.max(1) {
        if round % 2 == 0 {
            raw_s.push(raw_pass()?);
            umbp_s.push(umbp_pass()?);
        } else {
            umbp_s.push(umbp_pass()?);
            raw_s.push(raw_pass()?);
        }
    }
    // Where the cluster path's time went, per pass (sums over its holder reads: they
    // overlap one another, so they may add up to more than the pass).
    let ph = node.stats().phases;
    let passes = a.rounds.max(1) as f64;
    let per_pass_ms = |after: u64, before: u64| (after - before) as f64 / 1e6 / passes;
    let wall_ms = umbp_s.iter().sum::<f64>() * 1e3 / passes;
    let busy_ms = per_pass_ms(ph.read_busy_ns, warm.read_busy_ns);
    let phases = serde_json::json!({
        "wall_ms": wall_ms,
        "wire_busy_ms": busy_ms,
        "wire_idle_ms": (wall_ms - busy_ms).max(0.0),
        "holder_prepare_ms": per_pass_ms(ph.pin_ns, warm.pin_ns),
        "read_ms": per_pass_ms(ph.read_ns, warm.read_ns),
        "check_ms": per_pass_ms(ph.check_ns, warm.check_ns),
        "reads": (ph.reads - warm.reads) as f64 / passes,
        "what": "means per timed cluster pass. wall: the pass; wire_busy: time some READ was in flight; wire_idle = wall - wire_busy (pins, copies, checks not overlapped with a READ). Sums over the pass's holder reads (8 MiB chunks, several in flight at once, so they exceed wall): holder_prepare = batch start (its pins sent) to the chunk's last pin answered (the holder's copy into its export area, queue, round trip); read = READ post to completion; check = digest checks",
    });
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let (raw, umbp) = (median(&mut raw_s), median(&mut umbp_s));
    let gbps = |s: f64| total as f64 / s / 1e9;
    let ctx = |c: Case| {
        c.extra("cpus", std::thread::available_parallelism().map_or(1, |n| n.get()))
            .extra("blocks", blocks)
            .extra("block_bytes", block)
            .extra("bytes", total)
            .extra("prefix_tokens", a.prefix_tokens)
            .extra("token_bytes", a.token_bytes)
            .extra("rounds", a.rounds.max(1))
            .extra("batch_blocks", batch)
            .extra("ahead_batches", ahead)
            .extra("phases", phases.clone())
            .extra("ucx_tls", std::env::var("UCX_TLS").unwrap_or_default())
            .extra("verified_bytes", true)
    };
    let mut cases = vec![
        ctx(Case::new(
            "cluster",
            "remote_load_gbps",
            gbps(umbp),
            "GB/s",
            gbps(raw),
            "raw NIXL READ, as many bytes, same two agents",
            Better::Higher,
        )),
        ctx(Case::new("cluster", "remote_restore_ms", umbp * 1e3, "ms", raw * 1e3, "raw NIXL READ of the prefix's blocks", Better::Lower)),
    ];
    if !a.no_pools {
        // The fetch-level holder and node go first (their memory with them).
        drop(node);
        drop(_holder);
        drop(pool);
        cases.extend(crate::cluster_pools::run(a, &secret_path)?);
    }
    Ok(cases)
}

/// A fresh random secret for the run (the holder reads the same file).
pub fn secret_bytes() -> Vec<u8> {
    umbp_cluster::control::nonce().iter().map(|b| format!("{b:02x}")).collect::<String>().into_bytes()
}
