//! What the cluster tests (`tests/cluster_*.rs`) share: UCX over TCP on loopback, the NIXL
//! library or a printed "skipped", free listen addresses and the cluster secret file.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Set (to anything) where the cluster tests must run: a missing NIXL then fails them.
pub const REQUIRE_NIXL_ENV: &str = "UMBP_REQUIRE_NIXL";

/// Sets UCX to TCP on loopback (unless the environment already chose) and loads
/// libnixl_capi.so; false, after printing "skipped" and why, when the library is missing
/// (scripts/setup-nixl.sh installs it), unless [`REQUIRE_NIXL_ENV`] is set: then it
/// panics. Call it first in a test: the pools it starts
/// inherit the environment.
pub fn nixl_on_loopback() -> bool {
    if std::env::var_os("UCX_TLS").is_none() {
        // Every cluster test sets the same values, before it starts a pool.
        std::env::set_var("UCX_TLS", "tcp,self");
        std::env::set_var("UCX_NET_DEVICES", "lo");
    }
    match umbp_cluster::transport::load_library() {
        Ok(_) => true,
        Err(e) => {
            // CI sets it (scripts/test.sh installs NIXL): a lost library must fail there,
            // not pass every cluster test as skipped.
            assert!(std::env::var_os(REQUIRE_NIXL_ENV).is_none(), "{REQUIRE_NIXL_ENV} is set and libnixl_capi.so cannot be loaded: {e}");
            println!("skipped: libnixl_capi.so not found (set {}): {e}", umbp_cluster::transport::LIB_ENV);
            false
        }
    }
}

/// A free TCP address on loopback ("127.0.0.1:PORT") for `--cluster-listen`.
pub fn loopback_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    l.local_addr().expect("its address").to_string()
}

/// `dir/secret` holding `secret`, mode 0600 (the pool refuses a secret others can read).
pub fn secret_file(dir: &Path, secret: &[u8]) -> PathBuf {
    let p = dir.join("secret");
    std::fs::write(&p, secret).expect("write the cluster secret");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).expect("chmod 0600 the secret");
    p
}

/// Heartbeat period, dead-after bound and read budget of a test cluster, in milliseconds.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub heartbeat_ms: u64,
    pub dead_after_ms: u64,
    pub read_timeout_ms: u64,
}

/// The flags of a small cluster pool (64 MiB of DRAM, 16 KiB objects) listening at `me`,
/// subscribed to each of `peers`, with the secret file and `timing`; then `extra`.
pub fn pool_args(me: &str, peers: &[&str], secret: &Path, timing: Timing, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = ["--capacity", "64MiB", "--min-object-size", "16KiB", "--cluster-listen", me, "--cluster-secret-file"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    v.push(secret.to_str().expect("a UTF-8 secret path").to_string());
    for p in peers {
        v.extend(["--cluster-peer".to_string(), p.to_string()]);
    }
    for (flag, ms) in [
        ("--cluster-heartbeat-ms", timing.heartbeat_ms),
        ("--cluster-dead-after-ms", timing.dead_after_ms),
        ("--cluster-read-timeout-ms", timing.read_timeout_ms),
    ] {
        v.extend([flag.to_string(), ms.to_string()]);
    }
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}
