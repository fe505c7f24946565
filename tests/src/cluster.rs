//! What the cluster tests (`tests/cluster_*.rs`) share: UCX over TCP on loopback, the NIXL
//! library or a printed "skipped", free listen addresses and the cluster secret file.

use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use umbp_cluster::channel::{client_handshake, Established};
use umbp_cluster::control::{acl_digest, read_msg, write_msg, Msg, Secret, MAX_FRAME};
use umbp_cluster::transport::nixl_sys::{MemType, XferDescList, XferOp, XferStatus};
use umbp_cluster::transport::Agent;

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

/// The test as a member: subscribed to the pool at `addr`, its `Join` and snapshot read.
pub struct Member {
    pub est: Established,
    pub sock: TcpStream,
    pub join: (String, Vec<u8>, u64, u64),
    /// (key, size, namespace) of the snapshot.
    pub keys: Vec<(u128, u64, u128)>,
}

impl Member {
    pub fn join(addr: &str, secret: &[u8]) -> Self {
        let sock = TcpStream::connect(addr).unwrap();
        let acl = acl_digest(&umbp_pool::groups::TenantGroups::single());
        let mut est = client_handshake(&sock, &Secret::new(secret.to_vec()).unwrap(), 0x7e57, &acl, Duration::from_secs(5)).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut join = None;
        let mut keys = Vec::new();
        loop {
            match read_msg(&mut est.opener, MAX_FRAME).unwrap() {
                Msg::Join { agent, metadata, base, len, .. } => join = Some((agent, metadata, base, len)),
                Msg::Keys { changes, more, .. } => {
                    keys.extend(changes.iter().filter(|c| c.stored).map(|c| (c.key, c.size, c.namespace)));
                    if !more {
                        break;
                    }
                }
                _ => {}
            }
        }
        Self { est, sock, join: join.expect("a Join before the snapshot"), keys }
    }

    pub fn send(&mut self, m: &Msg) {
        let mut plain = Vec::new();
        write_msg(&mut plain, m).unwrap();
        self.est.sealer.write_frames(&mut self.sock, &plain).unwrap();
    }

    /// The next pin answer: Ok(offset) or Err(reason).
    pub fn pin_answer(&mut self) -> (u64, Result<u64, String>) {
        loop {
            match read_msg(&mut self.est.opener, MAX_FRAME).unwrap() {
                Msg::Pinned { id, offset, .. } => return (id, Ok(offset)),
                Msg::PinFailed { id, reason } => return (id, Err(reason)),
                _ => {}
            }
        }
    }
}

impl Member {
    /// Pins `key` and waits for the answer: Ok((offset, digest)) or the refusal.
    pub fn pin(&mut self, id: u64, namespace: u128, key: u128, size: u64) -> Result<(u64, u128), String> {
        self.send(&Msg::Pin { id, group: 0, namespace, key, size });
        loop {
            match read_msg(&mut self.est.opener, MAX_FRAME).unwrap() {
                Msg::Pinned { id: got, offset, digest, .. } if got == id => return Ok((offset, digest)),
                Msg::PinFailed { id: got, reason } if got == id => return Err(reason),
                _ => {}
            }
        }
    }
}

/// A one-sided NIXL READ (the test's own `agent`, the peer's metadata loaded) of
/// `local.len()` bytes at `remote_addr` of `peer_agent`'s registered DRAM into `local`
/// (registered with `agent`). True once it completed within 5 s.
pub fn nixl_read(agent: &Agent, peer_agent: &str, remote_addr: u64, local: &mut [u8]) -> bool {
    let mut l = XferDescList::new(MemType::Dram).unwrap();
    let mut r = XferDescList::new(MemType::Dram).unwrap();
    l.add_desc(local.as_mut_ptr() as usize, local.len(), 0);
    r.add_desc(remote_addr as usize, local.len(), 0);
    let raw = agent.raw();
    let req = raw.create_xfer_req(XferOp::Read, &l, &r, peer_agent, Some(agent.opt_args())).expect("a NIXL READ request");
    raw.post_xfer_req(&req, Some(agent.opt_args())).expect("the READ posted");
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(5) {
        if matches!(raw.get_xfer_status(&req), Ok(XferStatus::Success)) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    false
}
