//! What the cluster bench's two halves (cluster.rs: fetch level; cluster_pools.rs: real
//! pools) share: the command line, the holder child process and UCX's loopback defaults.

use std::process::Child;

/// What to measure: a prefix of `prefix_tokens` tokens in blocks of `tokens_per_block`
/// tokens of `token_bytes` each (default: Llama-3.1-8B bf16, 128 KiB of KV per token).
#[derive(Debug, Clone, clap::Args)]
pub struct ClusterCli {
    #[arg(long, default_value_t = 10_000)]
    pub prefix_tokens: u64,
    #[arg(long, default_value_t = 16)]
    pub tokens_per_block: u64,
    #[arg(long, default_value_t = 128 << 10)]
    pub token_bytes: u64,
    /// Blocks per request (a load's stage: 64 MiB of 2 MiB blocks), for both paths.
    #[arg(long, default_value_t = 32)]
    pub batch: u64,
    /// Batches the cluster path fetches ahead of the one being read (`Cluster::fetch_stages`:
    /// the holder copies batch k+1 and the reader checks batch k-1 while batch k is READ, as
    /// the pool's promotion look-ahead overlaps a load's stages); 0 = one batch at a time.
    /// Lowered where the holder's export area cannot hold that many batches' copies.
    #[arg(long, default_value_t = 1)]
    pub ahead: usize,
    /// Timed rounds (each: the whole prefix raw, then through the cluster tier).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// One JSON object per case and line.
    #[arg(long)]
    pub json: bool,
    /// Skip the cases through real pools (cluster_pools.rs: a worker's remote restore and
    /// the local lookup with remote entries present).
    #[arg(long)]
    pub no_pools: bool,
    /// The loading pool's `promotion_ahead_bytes` in MiB (pipelined promotion; 0 = each
    /// stage fetched only when the copy reaches it) [default: the pool's default].
    #[arg(long, value_name = "MIB")]
    pub promotion_ahead_mib: Option<u64>,
}

/// UCX over TCP on loopback, unless the caller chose its transports (`UCX_TLS`).
pub(crate) fn ucx_loopback_defaults() {
    if std::env::var_os("UCX_TLS").is_none() {
        // SAFETY (of the env write): called before any thread or NIXL/UCX state exists.
        std::env::set_var("UCX_TLS", "tcp,self");
        std::env::set_var("UCX_NET_DEVICES", "lo");
    }
}

/// A child process killed and reaped when dropped.
pub(crate) struct Holder(pub(crate) Child);
impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
