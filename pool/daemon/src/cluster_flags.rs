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
    /// A closed subscriber's pins are kept this long past --cluster-read-timeout-ms after
    /// its connection closes (a lease: its one-sided READs may still be in flight). Members
    /// run the same --cluster-read-timeout-ms.
    #[arg(long = "cluster-pin-lease-margin-ms", env = "UMBP_CLUSTER_PIN_LEASE_MARGIN_MS", value_name = "MS", default_value_t = 1000)]
    pub pin_lease_margin_ms: u64,
    /// Objects one subscribing peer may hold pinned here at once; a pin past it is refused.
    #[arg(long = "cluster-max-pins-per-peer", env = "UMBP_CLUSTER_MAX_PINS_PER_PEER", value_name = "N", default_value_t = 4096)]
    pub max_pins_per_peer: usize,
    /// Bytes one subscribing peer may hold pinned here at once (sizes as --capacity).
    #[arg(long = "cluster-max-pinned-bytes-per-peer", env = "UMBP_CLUSTER_MAX_PINNED_BYTES_PER_PEER", value_name = "SIZE", default_value = "4GiB")]
    pub max_pinned_bytes_per_peer: String,
    /// Keys one peer may have in this pool's catalog per tenant group; further keys are
    /// dropped (counted, `catalog_over_cap`).
    #[arg(long = "cluster-max-catalog-entries-per-group", env = "UMBP_CLUSTER_MAX_CATALOG_ENTRIES_PER_GROUP", value_name = "N", default_value_t = 1 << 20)]
    pub max_catalog_entries_per_group: usize,
    /// Unauthenticated connections (handshake not done) held at once on the cluster port;
    /// past it a new one is closed at once (counted, `refused_connections`).
    #[arg(long = "cluster-max-unauthenticated", env = "UMBP_CLUSTER_MAX_UNAUTHENTICATED", value_name = "N", default_value_t = 64)]
    pub max_unauthenticated: usize,
    /// As --cluster-max-unauthenticated, per source address.
    #[arg(long = "cluster-max-unauthenticated-per-source", env = "UMBP_CLUSTER_MAX_UNAUTHENTICATED_PER_SOURCE", value_name = "N", default_value_t = 16)]
    pub max_unauthenticated_per_source: usize,
    /// Size of the export area (sizes as --capacity; rounded up to whole pages): the only
    /// memory peers can reach over NIXL. A peer's pin copies the object here and the peer
    /// reads the copy; a pin that finds no room is refused (counted, `export_full`) and the
    /// peer recomputes. Size it for the pins in flight: docs/operations.md
    #[arg(long = "cluster-export-bytes", env = "UMBP_CLUSTER_EXPORT_BYTES", value_name = "SIZE", default_value = "256MiB")]
    pub export_bytes: String,
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
        for (flag, v) in [
            ("--cluster-max-pins-per-peer", self.max_pins_per_peer),
            ("--cluster-max-catalog-entries-per-group", self.max_catalog_entries_per_group),
            ("--cluster-max-unauthenticated", self.max_unauthenticated),
            ("--cluster-max-unauthenticated-per-source", self.max_unauthenticated_per_source),
        ] {
            if v == 0 {
                anyhow::bail!("{flag} must be at least 1 (0 would refuse every peer)");
            }
        }
        if self.max_unauthenticated_per_source > self.max_unauthenticated {
            anyhow::bail!(
                "--cluster-max-unauthenticated-per-source ({}) exceeds --cluster-max-unauthenticated ({})",
                self.max_unauthenticated_per_source,
                self.max_unauthenticated
            );
        }
        let pinned = umbp_pool::parse_size("cluster-max-pinned-bytes-per-peer (UMBP_CLUSTER_MAX_PINNED_BYTES_PER_PEER)", &self.max_pinned_bytes_per_peer)?;
        if pinned == 0 {
            anyhow::bail!("--cluster-max-pinned-bytes-per-peer must be more than 0 bytes");
        }
        let export = umbp_pool::parse_size("cluster-export-bytes (UMBP_CLUSTER_EXPORT_BYTES)", &self.export_bytes)?;
        let Some(export) = export.checked_next_multiple_of(umbp_cluster::export::SLOT_ALIGN).filter(|&e| e > 0) else {
            anyhow::bail!("--cluster-export-bytes must be more than 0 bytes (and fit the address space)");
        };
        let mut c = ClusterConfig::new(listen, secret);
        c.export_bytes = export;
        c.pin_lease_margin = Duration::from_millis(self.pin_lease_margin_ms);
        c.max_pins_per_peer = self.max_pins_per_peer;
        c.max_pinned_bytes_per_peer = pinned;
        c.max_catalog_entries_per_group = self.max_catalog_entries_per_group;
        c.max_unauthenticated = self.max_unauthenticated;
        c.max_unauthenticated_per_source = self.max_unauthenticated_per_source;
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

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use clap::Parser;

    use super::*;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        cluster: ClusterArgs,
    }

    /// `--cluster-listen` with a real secret file, then `extra`: the parsed config.
    fn config(extra: &[&str]) -> anyhow::Result<ClusterConfig> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("secret");
        std::fs::write(&p, b"cluster-flags-secret-0123456789").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let argv = ["umbp-pool", "--cluster-listen", "127.0.0.1:0", "--cluster-secret-file", p.to_str().unwrap()];
        let cli = Cli::try_parse_from(argv.iter().chain(extra)).map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(cli.cluster.config()?.expect("--cluster-listen given").0)
    }

    /// The caps that are `ClusterConfig` fields reach it; defaults are the config's own;
    /// bad values are refused naming the flag.
    #[test]
    fn cluster_cap_flags_reach_the_config_and_bad_values_name_the_flag() {
        let d = config(&[]).unwrap();
        let def = ClusterConfig::new(String::new(), Secret::new(b"0123456789abcdef".to_vec()).unwrap());
        assert_eq!(
            (d.max_pins_per_peer, d.max_pinned_bytes_per_peer, d.max_catalog_entries_per_group, d.max_unauthenticated, d.max_unauthenticated_per_source, d.pin_lease_margin, d.export_bytes),
            (def.max_pins_per_peer, def.max_pinned_bytes_per_peer, def.max_catalog_entries_per_group, def.max_unauthenticated, def.max_unauthenticated_per_source, def.pin_lease_margin, def.export_bytes),
            "the flags' defaults are ClusterConfig's"
        );
        let c = config(&[
            "--cluster-max-pins-per-peer", "7",
            "--cluster-max-pinned-bytes-per-peer", "3MiB",
            "--cluster-max-catalog-entries-per-group", "1000",
            "--cluster-max-unauthenticated", "9",
            "--cluster-max-unauthenticated-per-source", "2",
            "--cluster-pin-lease-margin-ms", "250",
            "--cluster-export-bytes", "64MiB",
        ])
        .unwrap();
        assert_eq!(
            (c.max_pins_per_peer, c.max_pinned_bytes_per_peer, c.max_catalog_entries_per_group, c.max_unauthenticated, c.max_unauthenticated_per_source, c.pin_lease_margin, c.export_bytes),
            (7, 3 << 20, 1000, 9, 2, Duration::from_millis(250), 64 << 20)
        );
        // A size that is not whole pages is rounded up to them (the area's slot boundary).
        assert_eq!(config(&["--cluster-export-bytes", "5000"]).unwrap().export_bytes, 8192);
        for (args, says) in [
            (&["--cluster-max-pins-per-peer", "0"][..], "--cluster-max-pins-per-peer must be at least 1"),
            (&["--cluster-max-pins-per-peer", "many"], "--cluster-max-pins-per-peer"),
            (&["--cluster-max-pinned-bytes-per-peer", "3 parsecs"], "cluster-max-pinned-bytes-per-peer"),
            (&["--cluster-max-pinned-bytes-per-peer", "0"], "--cluster-max-pinned-bytes-per-peer must be more than 0"),
            (&["--cluster-max-catalog-entries-per-group", "0"], "--cluster-max-catalog-entries-per-group must be at least 1"),
            (&["--cluster-max-unauthenticated", "0"], "--cluster-max-unauthenticated must be at least 1"),
            (&["--cluster-max-unauthenticated", "4", "--cluster-max-unauthenticated-per-source", "5"], "--cluster-max-unauthenticated-per-source (5) exceeds --cluster-max-unauthenticated (4)"),
            (&["--cluster-pin-lease-margin-ms", "soon"], "--cluster-pin-lease-margin-ms"),
            (&["--cluster-export-bytes", "0"], "--cluster-export-bytes must be more than 0"),
            (&["--cluster-export-bytes", "lots"], "cluster-export-bytes"),
        ] {
            let e = format!("{:#}", config(args).expect_err(&format!("{args:?} refused")));
            assert!(e.contains(says), "{args:?}: {e}");
        }
    }
}
