//! A real `etcd` (Debian's `etcd-server`) for the membership tests: one member on free
//! loopback ports with its data in a temporary directory; killed and restarted on the same
//! ports and data. Without the binary the test prints "skipped", unless
//! `UMBP_REQUIRE_NIXL` is set (CI: scripts/test.sh installs it): then it fails.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use umbp_cluster::discovery::gateway::{b64, unb64, Gateway};

use crate::cluster::REQUIRE_NIXL_ENV;
use crate::metrics::free_port;

/// `etcd` on PATH, or `UMBP_ETCD_BIN`.
pub fn etcd_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("UMBP_ETCD_BIN") {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("PATH").and_then(|paths| std::env::split_paths(&paths).map(|d| d.join("etcd")).find(|p| p.is_file()))
}

/// The binary, or None after printing "skipped" (panics where the cluster tests must run).
pub fn etcd_or_skip() -> Option<PathBuf> {
    let b = etcd_binary();
    if b.is_none() {
        assert!(
            std::env::var_os(REQUIRE_NIXL_ENV).is_none(),
            "{REQUIRE_NIXL_ENV} is set and no etcd binary was found: apt-get install etcd-server (or set UMBP_ETCD_BIN)"
        );
        println!("skipped: no etcd binary (apt-get install etcd-server, or set UMBP_ETCD_BIN)");
    }
    b
}

pub struct EtcdProcess {
    bin: PathBuf,
    dir: PathBuf,
    pub client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

impl EtcdProcess {
    /// Starts etcd with its data under `dir` and waits until it answers.
    pub fn start(bin: &Path, dir: &Path) -> Self {
        let mut e = Self { bin: bin.to_path_buf(), dir: dir.to_path_buf(), client_port: free_port(), peer_port: free_port(), child: None };
        e.spawn();
        e
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    fn spawn(&mut self) {
        let (c, p) = (format!("http://127.0.0.1:{}", self.client_port), format!("http://127.0.0.1:{}", self.peer_port));
        let child = Command::new(&self.bin)
            .args(["--name", "umbp-test", "--data-dir"])
            .arg(self.dir.join("etcd-data"))
            .args(["--listen-client-urls", &c, "--advertise-client-urls", &c, "--listen-peer-urls", &p])
            .args(["--initial-advertise-peer-urls", &p, "--initial-cluster", &format!("umbp-test={p}")])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.dir.join("etcd.log")).expect("etcd log"))
            .spawn()
            .expect("spawn etcd");
        self.child = Some(child);
        let t = Instant::now();
        let mut gw = Gateway::new(&[self.url()], Duration::from_millis(300)).unwrap();
        while gw.call("/v3/kv/range", &json!({ "key": b64(b"/") })).is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "etcd did not answer within 20 s (log: {})",
                self.dir.join("etcd.log").display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILL (no clean shutdown).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same ports and data.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Control addresses registered under `prefix`/members/ (empty when etcd does not answer).
    pub fn members(&self, prefix: &str) -> Vec<String> {
        let mut gw = Gateway::new(&[self.url()], Duration::from_millis(500)).unwrap();
        let k = format!("{prefix}/members/");
        let mut end = k.clone().into_bytes();
        *end.last_mut().unwrap() += 1;
        let Ok(r) = gw.call("/v3/kv/range", &json!({ "key": b64(k.as_bytes()), "range_end": b64(&end) })) else { return Vec::new() };
        let mut v: Vec<String> = r["kvs"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|kv| unb64(kv["key"].as_str()?))
            .map(|k| String::from_utf8_lossy(&k).into_owned())
            .map(|k| k.rsplit('/').next().unwrap_or_default().to_string())
            .collect();
        v.sort();
        v
    }
}

impl Drop for EtcdProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
