//! The `--cluster-*` flags (docs/cluster.md): parsed and checked here, the tier started
//! after the pool. NIXL is loaded only when `--cluster-listen` is given.

use std::path::PathBuf;
use std::time::Duration;

use umbp_cluster::control::Secret;
use umbp_cluster::discovery::etcd::{EtcdConfig, EtcdMembership};
use umbp_cluster::membership::{Discovery, StaticPeers};
use umbp_cluster::pool_tier::{ClusterTier, TierOptions, DEFAULT_REMOTE_SHARE};
use umbp_cluster::ClusterConfig;
use umbp_pool::config::settings::{CLUSTER_EXPORT_BYTES, CLUSTER_MAX_PINNED_BYTES_PER_PEER};

/// `--cluster-etcd-prefix` when not given (its settings row says so in its help).
pub const DEFAULT_ETCD_PREFIX: &str = "/umbp/default";

/// Defaults, variables, help and section come from the settings table (settings_args.rs).
#[derive(clap::Args, Debug, Clone)]
pub struct ClusterArgs {
    #[arg(long = "cluster-listen")]
    pub listen: Option<String>,
    #[arg(long = "cluster-peer")]
    pub peers: Vec<String>,
    #[arg(long = "cluster-secret-file")]
    pub secret_file: Option<PathBuf>,
    #[arg(long = "cluster-heartbeat-ms")]
    pub heartbeat_ms: u64,
    #[arg(long = "cluster-dead-after-ms")]
    pub dead_after_ms: u64,
    #[arg(long = "cluster-read-timeout-ms")]
    pub read_timeout_ms: u64,
    #[arg(long = "cluster-max-remote-entries")]
    pub max_remote_entries: Option<u64>,
    #[arg(long = "cluster-pin-lease-margin-ms")]
    pub pin_lease_margin_ms: u64,
    #[arg(long = "cluster-max-pins-per-peer")]
    pub max_pins_per_peer: usize,
    #[arg(long = "cluster-max-pinned-bytes-per-peer")]
    pub max_pinned_bytes_per_peer: String,
    #[arg(long = "cluster-max-catalog-entries-per-group")]
    pub max_catalog_entries_per_group: usize,
    #[arg(long = "cluster-max-unauthenticated")]
    pub max_unauthenticated: usize,
    #[arg(long = "cluster-max-unauthenticated-per-source")]
    pub max_unauthenticated_per_source: usize,
    #[arg(long = "cluster-export-bytes")]
    pub export_bytes: String,
    #[arg(long = "cluster-etcd", value_delimiter = ',')]
    pub etcd: Vec<String>,
    #[arg(long = "cluster-etcd-prefix")]
    pub etcd_prefix: Option<String>,
    #[arg(long = "cluster-etcd-ttl-s")]
    pub etcd_ttl_s: u64,
}

/// Whom a node dials: the `--cluster-peer` list, and etcd's members with `--cluster-etcd`.
#[derive(Debug, Clone)]
pub struct Members {
    pub static_peers: Vec<String>,
    pub etcd: Option<EtcdConfig>,
}

impl ClusterArgs {
    /// The node's configuration, None without --cluster-listen; errors name the flag.
    pub fn config(&self) -> anyhow::Result<Option<(ClusterConfig, Members, TierOptions)>> {
        let Some(listen) = self.listen.clone() else {
            if !self.peers.is_empty() || self.secret_file.is_some() || self.max_remote_entries.is_some() || !self.etcd.is_empty() {
                anyhow::bail!(
                    "--cluster-peer, --cluster-etcd, --cluster-secret-file and --cluster-max-remote-entries need --cluster-listen"
                );
            }
            return Ok(None);
        };
        let Some(path) = &self.secret_file else {
            anyhow::bail!("--cluster-listen needs --cluster-secret-file (a shared secret of at least 16 bytes, mode 0600)");
        };
        let secret = Secret::from_file(path)?;
        if self.heartbeat_ms == 0 || self.dead_after_ms <= self.heartbeat_ms {
            anyhow::bail!(
                "--cluster-dead-after-ms ({}) must exceed --cluster-heartbeat-ms ({}), which must be > 0",
                self.dead_after_ms,
                self.heartbeat_ms
            );
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
        let pinned = umbp_pool::parse_size(&CLUSTER_MAX_PINNED_BYTES_PER_PEER.label(), &self.max_pinned_bytes_per_peer)?;
        if pinned == 0 {
            anyhow::bail!("--cluster-max-pinned-bytes-per-peer must be more than 0 bytes");
        }
        let export = umbp_pool::parse_size(&CLUSTER_EXPORT_BYTES.label(), &self.export_bytes)?;
        let Some(export) = export.checked_next_multiple_of(umbp_cluster::export::SLOT_ALIGN).filter(|&e| e > 0) else {
            anyhow::bail!("--cluster-export-bytes must be more than 0 bytes (and fit the address space)");
        };
        let etcd = self.etcd_config()?;
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
        let members = Members { static_peers: self.peers.clone(), etcd };
        Ok(Some((c, members, TierOptions { max_remote_entries: self.max_remote_entries })))
    }

    fn etcd_config(&self) -> anyhow::Result<Option<EtcdConfig>> {
        let urls: Vec<String> = self.etcd.iter().map(|u| u.trim().to_string()).filter(|u| !u.is_empty()).collect();
        if urls.is_empty() {
            return Ok(None);
        }
        for u in &urls {
            let hp = u.strip_prefix("http://").map(|h| h.trim_end_matches('/')).unwrap_or("");
            if hp.is_empty() || hp.contains('/') || !hp.contains(':') {
                anyhow::bail!("--cluster-etcd: {u:?} is not http://HOST:PORT (https is not supported: put TLS in a local proxy)");
            }
        }
        if self.etcd_ttl_s == 0 {
            anyhow::bail!("--cluster-etcd-ttl-s must be at least 1");
        }
        let given = self.etcd_prefix.as_deref().unwrap_or(DEFAULT_ETCD_PREFIX);
        let prefix = given.trim_end_matches('/');
        if !prefix.starts_with('/') {
            anyhow::bail!("--cluster-etcd-prefix {given:?} must start with '/'");
        }
        let mut e = EtcdConfig::new(urls, prefix.to_string(), Duration::from_secs(self.etcd_ttl_s));
        e.static_peers = self.peers.clone();
        Ok(Some(e))
    }
}

/// The running tier and its etcd registration (dropped first: a clean stop revokes the
/// lease, so the others drop this pool at once, then the tier stops).
pub struct RunningTier {
    _etcd: Option<EtcdMembership>,
    _tier: ClusterTier,
}

/// Starts the cluster tier on a running pool.
pub fn start(pool: &umbp_pool::Pool, cfg: ClusterConfig, members: Members, opts: TierOptions) -> anyhow::Result<RunningTier> {
    let listen = cfg.listen.clone();
    let peers = members.static_peers.clone();
    let (etcd, discovery): (Option<EtcdMembership>, Box<dyn Discovery>) = match members.etcd {
        Some(e) => {
            let (m, d) = EtcdMembership::start(e).map_err(|e| anyhow::anyhow!("--cluster-etcd: {e}"))?;
            (Some(m), Box::new(d))
        }
        None => (None, Box::new(StaticPeers(peers.clone()))),
    };
    let tier = ClusterTier::start(pool.cluster_access(), cfg, discovery, opts)?;
    let bound = tier.cluster().local_addr();
    if let Some(m) = &etcd {
        if bound.ip().is_unspecified() {
            anyhow::bail!(
                "--cluster-etcd registers the --cluster-listen address for peers to dial: {listen} is not dialable (give this host's address, not 0.0.0.0)"
            );
        }
        m.advertise(bound.to_string());
        tier.report_etcd(m.handle());
    }
    tracing::info!(
        listen = %listen,
        bound = %tier.cluster().local_addr(),
        peers = ?peers,
        max_remote_entries = tier.max_remote_entries(),
        default_share = DEFAULT_REMOTE_SHARE,
        etcd = etcd.is_some(),
        "cluster tier started"
    );
    Ok(RunningTier { _etcd: etcd, _tier: tier })
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

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
        let cli: Cli = crate::settings_args::try_parse_from(argv.iter().chain(extra)).map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(cli.cluster.config()?.expect("--cluster-listen given").0)
    }

    /// `--cluster-etcd` (comma-separated URLs) with its prefix and TTL reaches the etcd
    /// config, with the `--cluster-peer` list beside it; without it there is none.
    #[test]
    fn etcd_flags_reach_the_membership_config() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("secret");
        std::fs::write(&p, b"cluster-flags-secret-0123456789").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let parse = |extra: &[&str]| {
            let argv = ["umbp-pool", "--cluster-listen", "127.0.0.1:0", "--cluster-secret-file", p.to_str().unwrap()];
            let cli: Cli = crate::settings_args::try_parse_from(argv.iter().chain(extra)).unwrap();
            cli.cluster.config().unwrap().unwrap().1
        };
        assert!(parse(&[]).etcd.is_none());
        let m = parse(&["--cluster-etcd", "http://a:2379,http://b:2379/", "--cluster-peer", "c:7400", "--cluster-etcd-ttl-s", "3"]);
        let e = m.etcd.expect("etcd configured");
        assert_eq!(e.endpoints, vec!["http://a:2379".to_string(), "http://b:2379/".to_string()]);
        assert_eq!(
            (e.prefix.as_str(), e.ttl, e.static_peers.clone()),
            ("/umbp/default", Duration::from_secs(3), vec!["c:7400".to_string()])
        );
        let cli: Result<Cli, _> = crate::settings_args::try_parse_from(["umbp-pool", "--cluster-etcd", "http://a:2379"]);
        let e = format!("{:#}", cli.unwrap().cluster.config().expect_err("needs --cluster-listen"));
        assert!(e.contains("--cluster-etcd") && e.contains("need --cluster-listen"), "{e}");
    }

    /// The caps that are `ClusterConfig` fields reach it; defaults are the config's own;
    /// bad values are refused naming the flag.
    #[test]
    fn cluster_cap_flags_reach_the_config_and_bad_values_name_the_flag() {
        let d = config(&[]).unwrap();
        let def = ClusterConfig::new(String::new(), Secret::new(b"0123456789abcdef".to_vec()).unwrap());
        assert_eq!(
            (
                d.max_pins_per_peer, d.max_pinned_bytes_per_peer, d.max_catalog_entries_per_group, d.max_unauthenticated,
                d.max_unauthenticated_per_source, d.pin_lease_margin, d.export_bytes
            ),
            (
                def.max_pins_per_peer, def.max_pinned_bytes_per_peer, def.max_catalog_entries_per_group, def.max_unauthenticated,
                def.max_unauthenticated_per_source, def.pin_lease_margin, def.export_bytes
            ),
            "the flags' defaults are ClusterConfig's"
        );
        let c = config(&[
            "--cluster-max-pins-per-peer",
            "7",
            "--cluster-max-pinned-bytes-per-peer",
            "3MiB",
            "--cluster-max-catalog-entries-per-group",
            "1000",
            "--cluster-max-unauthenticated",
            "9",
            "--cluster-max-unauthenticated-per-source",
            "2",
            "--cluster-pin-lease-margin-ms",
            "250",
            "--cluster-export-bytes",
            "64MiB",
        ])
        .unwrap();
        assert_eq!(
            (
                c.max_pins_per_peer, c.max_pinned_bytes_per_peer, c.max_catalog_entries_per_group, c.max_unauthenticated,
                c.max_unauthenticated_per_source, c.pin_lease_margin, c.export_bytes
            ),
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
            (
                &["--cluster-max-unauthenticated", "4", "--cluster-max-unauthenticated-per-source", "5"],
                "--cluster-max-unauthenticated-per-source (5) exceeds --cluster-max-unauthenticated (4)",
            ),
            (&["--cluster-pin-lease-margin-ms", "soon"], "--cluster-pin-lease-margin-ms"),
            (&["--cluster-export-bytes", "0"], "--cluster-export-bytes must be more than 0"),
            (&["--cluster-export-bytes", "lots"], "cluster-export-bytes"),
            (&["--cluster-etcd", "https://10.0.0.1:2379"], "--cluster-etcd: \"https://10.0.0.1:2379\" is not http://HOST:PORT"),
            (&["--cluster-etcd", "http://10.0.0.1:2379,10.0.0.2:2379"], "--cluster-etcd: \"10.0.0.2:2379\" is not http://HOST:PORT"),
            (&["--cluster-etcd", "http://e:2379", "--cluster-etcd-ttl-s", "0"], "--cluster-etcd-ttl-s must be at least 1"),
            (&["--cluster-etcd", "http://e:2379", "--cluster-etcd-prefix", "umbp"], "--cluster-etcd-prefix \"umbp\" must start with '/'"),
        ] {
            let e = format!("{:#}", config(args).expect_err(&format!("{args:?} refused")));
            assert!(e.contains(says), "{args:?}: {e}");
        }
    }
}
