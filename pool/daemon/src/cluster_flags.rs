//! The `--cluster-*` flags (docs/cluster.md): parsed and checked here, the tier started
//! after the pool. NIXL is loaded only when `--cluster-listen` is given.

use std::path::PathBuf;
use std::time::Duration;

use umbp_cluster::control::Secret;
use umbp_cluster::membership::StaticPeers;
use umbp_cluster::pool_tier::{ClusterTier, TierOptions, DEFAULT_REMOTE_SHARE};
use umbp_cluster::ClusterConfig;

#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "Cluster (docs/cluster.md)")]
pub struct ClusterArgs {
    /// Join a cluster of pools: this pool's control address. Needs the NIXL library at run
    /// time (`pip install nixl-cu12`; set UMBP_NIXL_LIB to libnixl_capi.so or its
    /// directory) and --cluster-secret-file. With --namespace-acl every member must run the
    /// same ACL (a peer with another is refused); peers' objects are then listed only for
    /// the uids allowed their namespace [default: no cluster]
    #[arg(long = "cluster-listen", env = "UMBP_CLUSTER_LISTEN", value_name = "HOST:PORT")]
    pub listen: Option<String>,
    /// Another pool's --cluster-listen address (repeatable): its DRAM objects appear in this
    /// pool's index (that of their namespace's tenant group) marked remote and load over NIXL.
    #[arg(long = "cluster-peer", value_name = "HOST:PORT")]
    pub peers: Vec<String>,
    /// File holding the shared cluster secret (at least 16 bytes, mode 0600); pools
    /// authenticate each other and encrypt their control connections with a key derived
    /// from it (Noise NNpsk0; the secret is never sent)
    #[arg(long = "cluster-secret-file", env = "UMBP_CLUSTER_SECRET_FILE", value_name = "PATH")]
    pub secret_file: Option<PathBuf>,
    /// Heartbeat period to peers.
    #[arg(long = "cluster-heartbeat-ms", value_name = "MS", default_value_t = 500)]
    pub heartbeat_ms: u64,
    /// A peer silent this long is dropped: its keys leave the index.
    #[arg(long = "cluster-dead-after-ms", value_name = "MS", default_value_t = 2000)]
    pub dead_after_ms: u64,
    /// Bound on one remote load (pin at the holder and NIXL READ); past it the block fails.
    #[arg(long = "cluster-read-timeout-ms", value_name = "MS", default_value_t = 5000)]
    pub read_timeout_ms: u64,
    /// Most peers' keys listed in this pool's index at once (remote entries never crowd
    /// local objects out past it; further remote keys wait and are listed as room frees)
    /// [default: half of the index capacity]
    #[arg(long = "cluster-max-remote-entries", value_name = "N")]
    pub max_remote_entries: Option<u64>,
}

impl ClusterArgs {
    /// The node's configuration, None without --cluster-listen; errors name the flag.
    pub fn config(&self) -> anyhow::Result<Option<(ClusterConfig, Vec<String>, TierOptions)>> {
        let Some(listen) = self.listen.clone() else {
            if !self.peers.is_empty() || self.secret_file.is_some() || self.max_remote_entries.is_some() {
                anyhow::bail!("--cluster-peer, --cluster-secret-file and --cluster-max-remote-entries need --cluster-listen");
            }
            return Ok(None);
        };
        let Some(path) = &self.secret_file else {
            anyhow::bail!("--cluster-listen needs --cluster-secret-file (a shared secret of at least 16 bytes, mode 0600)");
        };
        let secret = Secret::from_file(path)?;
        if self.heartbeat_ms == 0 || self.dead_after_ms <= self.heartbeat_ms {
            anyhow::bail!("--cluster-dead-after-ms ({}) must exceed --cluster-heartbeat-ms ({}), which must be > 0", self.dead_after_ms, self.heartbeat_ms);
        }
        let mut c = ClusterConfig::new(listen, secret);
        c.heartbeat = Duration::from_millis(self.heartbeat_ms);
        c.dead_after = Duration::from_millis(self.dead_after_ms);
        c.read_timeout = Duration::from_millis(self.read_timeout_ms.max(1));
        Ok(Some((c, self.peers.clone(), TierOptions { max_remote_entries: self.max_remote_entries })))
    }
}

/// Starts the cluster tier on a running pool.
pub fn start(pool: &umbp_pool::Pool, cfg: ClusterConfig, peers: Vec<String>, opts: TierOptions) -> anyhow::Result<ClusterTier> {
    let listen = cfg.listen.clone();
    let tier = ClusterTier::start(pool.cluster_access(), cfg, Box::new(StaticPeers(peers.clone())), opts)?;
    tracing::info!(
        listen = %listen,
        bound = %tier.cluster().local_addr(),
        peers = ?peers,
        max_remote_entries = tier.max_remote_entries(),
        default_share = DEFAULT_REMOTE_SHARE,
        "cluster tier started"
    );
    Ok(tier)
}
