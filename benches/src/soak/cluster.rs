//! `soak --cluster`: a second `umbp-pool` (the *holder*) in a cluster with the soak's pool,
//! with its own worker storing and loading the same key space. The soak's workers then
//! also load objects only the holder has: remote-tier promotions over NIXL (UCX TCP on
//! loopback). Besides the faults of the soak's own pool, the chaos loop stops the holder
//! (remote reads outlive their budget: the reading pool quarantines their DRAM) and
//! restarts it (it is forgotten, and that DRAM reclaimed).

use std::path::{Path, PathBuf};
use std::time::Duration;

use umbp_pool::pool_report::PoolReport;

use super::pool::{PoolCmd, PoolProc};
use super::procs::WorkerProc;

/// The cluster's timing: a stopped holder is dropped after `DEAD_AFTER_MS`; a remote read
/// gets `READ_TIMEOUT_MS` (past a worker's `--timeout-ms` of 1000, so that a load the
/// worker cancels still has its read running, and lands or is quarantined).
const HEARTBEAT_MS: u64 = 200;
const DEAD_AFTER_MS: u64 = 1000;
const READ_TIMEOUT_MS: u64 = 1500;

/// TCP sockets the soak's pool may hold with its one peer: a control connection each way
/// and UCX's endpoints, with room for ones closing; more means they pile up with restarts.
pub(super) const MAX_TCP_FDS: usize = 32;

/// The second member and the workers attached to it.
pub(super) struct Holder {
    pub(super) pool: PoolProc,
    pub(super) workers: Vec<WorkerProc>,
    pub(super) stops: u64,
    pub(super) restarts: u64,
}

/// The cluster flags of one member listening at `me`, subscribed to `peer`.
fn member_args(me: &str, peer: &str, secret: &Path) -> Vec<String> {
    let mut v: Vec<String> = vec!["--cluster-listen".into(), me.into(), "--cluster-peer".into(), peer.into()];
    v.extend(["--cluster-secret-file".into(), secret.display().to_string()]);
    for (flag, ms) in [
        ("--cluster-heartbeat-ms", HEARTBEAT_MS),
        ("--cluster-dead-after-ms", DEAD_AFTER_MS),
        ("--cluster-read-timeout-ms", READ_TIMEOUT_MS),
    ] {
        v.extend([flag.to_string(), ms.to_string()]);
    }
    v
}

/// Loads the NIXL library (UCX over TCP on loopback unless the environment chose a
/// transport: the pools inherit it), writes the cluster secret into `dir` and picks two
/// loopback addresses. Returns the soak pool's extra flags and the holder's start command
/// (`bin`, `capacity`; no SSD tier: its objects are remote only while in its DRAM).
pub(super) fn setup(dir: &Path, bin: &Path, capacity: &str) -> Result<(Vec<String>, PoolCmd), String> {
    if std::env::var_os("UCX_TLS").is_none() {
        // Set before any thread of this process starts a pool; both pools inherit them.
        std::env::set_var("UCX_TLS", "tcp,self");
        std::env::set_var("UCX_NET_DEVICES", "lo");
    }
    umbp_cluster::transport::load_library().map_err(|e| {
        format!(
            "--cluster needs the NIXL library: {e} (scripts/setup-nixl.sh installs it and prints {}=...)",
            umbp_cluster::transport::LIB_ENV
        )
    })?;
    let secret = umbp_integration_tests::cluster::secret_file(dir, b"umbp-soak-cluster-secret-32bytes");
    let (a, b) = (umbp_integration_tests::cluster::loopback_addr(), umbp_integration_tests::cluster::loopback_addr());
    if a == b {
        return Err(format!("the OS handed out {a} twice: no two free loopback ports"));
    }
    let mut holder_args = vec!["--capacity".to_string(), capacity.to_string(), "--min-object-size".into(), "64KiB".into()];
    holder_args.extend(member_args(&b, &a, &secret));
    Ok((member_args(&a, &b, &secret), PoolCmd { bin: bin.to_path_buf(), pre_args: Vec::new(), args: holder_args }))
}

impl Holder {
    pub(super) fn start(cmd: &PoolCmd, dir: &Path) -> Result<Self, String> {
        let socket: PathBuf = dir.join("holder.sock");
        let pool = PoolProc::start(cmd, &socket, &dir.join("holder.log"))?;
        Ok(Self { pool, workers: Vec::new(), stops: 0, restarts: 0 })
    }

    /// SIGSTOP for `ms`, then SIGCONT: remote reads from it stall past their budget when
    /// `ms` is long, and past `DEAD_AFTER_MS` the soak's pool drops it.
    pub(super) fn stop_for(&mut self, ms: u64) {
        self.pool.signal(super::pool::SIGSTOP);
        std::thread::sleep(Duration::from_millis(ms));
        self.pool.signal(super::pool::SIGCONT);
        self.stops += 1;
    }
}

/// Remote fetches of the soak's pool summed over its processes (each restart starts its
/// counters at zero): sampled at every leak check and at the end.
#[derive(Default)]
pub(super) struct FetchTally {
    process: u64,
    banked: (u64, u64),
    last: (u64, u64),
}

impl FetchTally {
    /// Notes the cluster counters of pool process number `process` (`PoolProc::starts`).
    pub(super) fn observe(&mut self, process: u64, r: &PoolReport) {
        if process != self.process {
            self.banked = (self.banked.0 + self.last.0, self.banked.1 + self.last.1);
            self.last = (0, 0);
            self.process = process;
        }
        if let Some(c) = r.cluster {
            self.last = (c.fetches, c.fetch_failures);
        }
    }

    /// (fetches, fetch failures) seen so far.
    pub(super) fn totals(&self) -> (u64, u64) {
        (self.banked.0 + self.last.0, self.banked.1 + self.last.1)
    }
}
