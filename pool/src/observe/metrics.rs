//! Prometheus metrics: `umbp-pool --metrics-addr 127.0.0.1:9464` (or `UMBP_METRICS_ADDR`)
//! serves the Prometheus text format (0.0.4) on `GET /metrics`.
//!
//! Counters and gauges are read at scrape time from the pool's own atomics and state (a
//! [`Collector`]), so the data path pays nothing extra for them; only the latency
//! histograms are observed as transfers finish (`transfer.rs`). A scrape takes the store
//! lock only to copy a few running counters, never to walk the objects.
//!
//! The HTTP side is a tiny non-blocking loop on its own thread (epoll over the listener and
//! each connection): one request per connection, `Connection: close`, nothing but `GET
//! /metrics` (and a pointer to it on `GET /`). Each connection has [`CONNECTION_DEADLINE`]
//! in all to send its request and take the answer, and at most [`MAX_CONNECTIONS`] are
//! open (a new one closes the oldest), so a slow or silent client never stalls another
//! scrape. `--metrics-addr PORT` binds loopback; another host is bound only when named.
//! `--metrics-addr unix:PATH` serves on a unix socket instead, readable only by the pool's
//! uid and root (mode 0600, peer uid checked at accept), or by `--metrics-group` (0660):
//! the metrics show pool-wide traffic that the tenant report hides (docs/security.md).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use umbp_protocol::wire::Role;

use crate::pool_report::{SsdReport, TierCounts};
use crate::tier::TierSource;
use crate::{PoolError, PoolInner};

/// A connection's whole time: its request in, the answer out.
pub const CONNECTION_DEADLINE: Duration = Duration::from_secs(2);
/// Connections open at once; a new one closes the oldest.
pub const MAX_CONNECTIONS: usize = 32;
/// Largest request head read.
const MAX_REQUEST: usize = 16 << 10;

/// `PORT` alone means loopback (`127.0.0.1:PORT`); `HOST:PORT` is taken as given.
pub fn resolve_addr(addr: &str) -> String {
    let a = addr.trim();
    let port_only = a.strip_prefix(':').unwrap_or(a);
    if !port_only.is_empty() && port_only.bytes().all(|b| b.is_ascii_digit()) {
        format!("127.0.0.1:{port_only}")
    } else {
        a.to_string()
    }
}

/// Where scrapes come in: TCP, or a unix socket whose peers are checked.
pub enum Listener {
    Tcp(TcpListener),
    /// `only_uid`: without a metrics group, only this uid (the pool's) and root are served.
    Unix {
        listener: UnixListener,
        path: PathBuf,
        only_uid: Option<u32>,
    },
}

/// One accepted scrape connection.
enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.flush(),
            Stream::Unix(s) => s.flush(),
        }
    }
}

impl Stream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Stream::Tcp(s) => s.as_fd(),
            Stream::Unix(s) => s.as_fd(),
        }
    }
}

impl Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Listener::Tcp(l) => l.as_fd(),
            Listener::Unix { listener, .. } => listener.as_fd(),
        }
    }

    fn describe(&self) -> String {
        match self {
            Listener::Tcp(l) => l.local_addr().map(|a| format!("http://{a}/metrics")).unwrap_or_default(),
            Listener::Unix { path, .. } => format!("unix:{} (GET /metrics)", path.display()),
        }
    }

    /// The next connection: None when there is none now (or accept failed: logged), an
    /// error naming why for a unix peer of another uid (without a metrics group), closed at
    /// once, unanswered.
    fn accept(&self) -> Option<Result<Stream, String>> {
        let done = |e: std::io::Error| {
            if e.kind() != std::io::ErrorKind::WouldBlock {
                tracing::debug!("metrics accept: {e}");
            }
            None
        };
        match self {
            Listener::Tcp(l) => match l.accept() {
                Ok((s, _)) => Some(Ok(Stream::Tcp(s))),
                Err(e) => done(e),
            },
            Listener::Unix { listener, only_uid, .. } => match listener.accept() {
                Ok((s, _)) => {
                    if let Some(me) = *only_uid {
                        match umbp_ipc::peer::peer_cred(s.as_fd()) {
                            Ok(c) if c.uid == me || c.uid == 0 => {}
                            Ok(c) => {
                                return Some(Err(format!(
                                    "refused a scrape from uid {} (only uid {me} and root; --metrics-group widens it)",
                                    c.uid
                                )))
                            }
                            Err(e) => return Some(Err(format!("SO_PEERCRED of a scrape: {e}"))),
                        }
                    }
                    Some(Ok(Stream::Unix(s)))
                }
                Err(e) => done(e),
            },
        }
    }
}

/// The path of a `unix:PATH` (or `unix://PATH`, as pool endpoints are written) metrics
/// address, if it is one.
pub fn unix_path(addr: &str) -> Option<&Path> {
    let a = addr.trim();
    let rest = a.strip_prefix("unix:")?;
    Some(Path::new(rest.strip_prefix("//").unwrap_or(rest)))
}

/// Binds the metrics listener at start, so a bad or busy address is a startup error that
/// names it. `PORT` alone binds loopback only; `unix:PATH` a unix socket (its directory
/// checked as the pool socket's is), mode 0600, or 0660 with group `group`.
pub fn bind(addr: &str, group: Option<u32>) -> Result<Listener, PoolError> {
    let err = |message: String| PoolError::Metrics { addr: addr.to_string(), message };
    if let Some(path) = unix_path(addr) {
        return bind_unix(path, group).map_err(err);
    }
    let resolved = resolve_addr(addr);
    let addrs: Vec<_> = resolved.to_socket_addrs().map_err(|e| err(format!("not a host:port address ({e})")))?.collect();
    let listener = TcpListener::bind(&addrs[..]).map_err(|e| err(format!("cannot listen: {e}")))?;
    listener.set_nonblocking(true).map_err(|e| err(e.to_string()))?;
    tracing::warn!(address = %resolved, "metrics on TCP: every local user (and the network, for a non-loopback HOST) can read pool-wide traffic; use --metrics-addr unix:PATH to restrict them");
    Ok(Listener::Tcp(listener))
}

fn bind_unix(path: &Path, group: Option<u32>) -> Result<Listener, String> {
    if path.as_os_str().is_empty() || path.file_name().is_none() {
        return Err("unix: needs a socket path (unix:/run/umbp/metrics.sock)".into());
    }
    if let Some(dir) = path.parent() {
        umbp_ipc::sockdir::prepare_socket_dir(dir, group).map_err(|e| e.to_string())?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) => {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                return Err("exists and is not a socket; refusing to replace it".into());
            }
            if UnixStream::connect(path).is_ok() {
                return Err("another process serves this socket".into());
            }
            std::fs::remove_file(path).map_err(|e| format!("cannot remove the stale socket: {e}"))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e.to_string()),
    }
    let listener = UnixListener::bind(path).map_err(|e| format!("bind failed: {e}"))?;
    let mode = match group {
        Some(gid) => {
            std::os::unix::fs::lchown(path, None, Some(gid))
                .map_err(|e| format!("cannot give the socket to group {gid} (--metrics-group): {e}"))?;
            0o660
        }
        None => 0o600,
    };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| format!("cannot set the socket's mode to {mode:04o}: {e}"))?;
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    // Without a group the mode alone would do, but the accept check also covers the moment
    // between bind and chmod, and a directory another tool loosens later.
    let only_uid = group.is_none().then(|| rustix::process::geteuid().as_raw());
    Ok(Listener::Unix { listener, path: path.to_path_buf(), only_uid })
}

/// The metrics thread: serves scrapes until the pool shuts down.
pub fn serve(inner: &Arc<PoolInner>, listener: Listener) {
    let mut registry = Registry::default();
    registry.register(
        "umbp_transfer_seconds",
        "Time from a submission's acceptance to its completion, per operation",
        inner.counters.latency.transfer.clone(),
    );
    registry.register(
        "umbp_copy_seconds",
        "Time spent in device copy calls per submission, per operation",
        inner.counters.latency.copy.clone(),
    );
    registry.register_collector(Box::new(PoolCollector { inner: inner.clone() }));
    tracing::info!("metrics on {}", listener.describe());
    let Ok(mut poller) = crate::poller::Poller::new() else {
        tracing::warn!("metrics: cannot create an epoll set; metrics are off");
        return;
    };
    const LISTENER: u64 = u64::MAX;
    if poller.add(listener.as_fd(), LISTENER).is_err() {
        tracing::warn!("metrics: cannot watch the listener; metrics are off");
        return;
    }
    let mut conns: HashMap<u64, HttpConn> = HashMap::new();
    let mut next = 0u64;
    while !inner.is_shutting_down() {
        let now = Instant::now();
        let wait = conns.values().map(|c| c.deadline.saturating_duration_since(now)).min().unwrap_or(Duration::from_millis(200));
        for ready in poller.wait_ready(Some(wait.clamp(Duration::from_millis(1), Duration::from_millis(200)))) {
            if ready.token == LISTENER {
                while let Some(accepted) = listener.accept() {
                    let stream = match accepted {
                        Ok(s) => s,
                        Err(why) => {
                            tracing::debug!("metrics: {why}");
                            continue;
                        }
                    };
                    let nonblocking = match &stream {
                        Stream::Tcp(s) => s.set_nonblocking(true),
                        Stream::Unix(s) => s.set_nonblocking(true),
                    };
                    if nonblocking.is_err() {
                        continue;
                    }
                    if conns.len() >= MAX_CONNECTIONS {
                        if let Some(oldest) = conns.iter().min_by_key(|(_, c)| c.deadline).map(|(t, _)| *t) {
                            let c = conns.remove(&oldest).expect("present");
                            poller.remove(c.stream.as_fd());
                        }
                    }
                    next += 1;
                    let interest = crate::poller::Interest { read: true, write: false };
                    if poller.add_with(stream.as_fd(), next, interest).is_ok() {
                        let c = HttpConn {
                            stream,
                            request: Vec::new(),
                            out: Vec::new(),
                            sent: 0,
                            deadline: Instant::now() + CONNECTION_DEADLINE,
                        };
                        conns.insert(next, c);
                    }
                }
                continue;
            }
            let Some(c) = conns.get_mut(&ready.token) else { continue };
            let done = match c.progress(&registry) {
                Ok(done) => done,
                Err(e) => {
                    tracing::debug!("metrics request: {e}");
                    true
                }
            };
            if done || ready.hangup {
                let c = conns.remove(&ready.token).expect("present");
                poller.remove(c.stream.as_fd());
            } else if !c.out.is_empty() {
                let _ = poller.modify(c.stream.as_fd(), ready.token, crate::poller::Interest { read: false, write: true });
            }
        }
        let now = Instant::now();
        conns.retain(|_, c| {
            let keep = c.deadline > now;
            if !keep {
                tracing::debug!("metrics connection closed: not done within {CONNECTION_DEADLINE:?}");
                poller.remove(c.stream.as_fd());
            }
            keep
        });
    }
}

/// One HTTP connection: its request head so far, then the answer going out.
struct HttpConn {
    stream: Stream,
    request: Vec<u8>,
    out: Vec<u8>,
    sent: usize,
    deadline: Instant,
}

impl HttpConn {
    /// Reads what is there and writes what it can; Ok(true) once the answer is out.
    fn progress(&mut self, registry: &Registry) -> std::io::Result<bool> {
        let would_block = |e: &std::io::Error| e.kind() == std::io::ErrorKind::WouldBlock;
        if self.out.is_empty() {
            let mut chunk = [0u8; 1024];
            loop {
                match self.stream.read(&mut chunk) {
                    Ok(0) => break,
                    Ok(n) => self.request.extend_from_slice(&chunk[..n]),
                    Err(e) if would_block(&e) => break,
                    Err(e) => return Err(e),
                }
                if self.request.len() >= MAX_REQUEST || self.request.windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
            let complete = self.request.windows(4).any(|w| w == b"\r\n\r\n") || self.request.len() >= MAX_REQUEST;
            if !complete {
                return Ok(false);
            }
            self.out = answer(&self.request, registry);
        }
        while self.sent < self.out.len() {
            match self.stream.write(&self.out[self.sent..]) {
                Ok(0) => return Ok(true),
                Ok(n) => self.sent += n,
                Err(e) if would_block(&e) => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        let _ = self.stream.flush();
        Ok(true)
    }
}

/// The response to one request head.
fn answer(request: &[u8], registry: &Registry) -> Vec<u8> {
    let head = String::from_utf8_lossy(request);
    let mut parts = head.lines().next().unwrap_or("").split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    let (status, ctype, body) = match (method, path) {
        ("GET", "/metrics") => {
            let mut body = String::new();
            match prometheus_client::encoding::prometheus_text::encode(&mut body, registry) {
                Ok(()) => ("200 OK", prometheus_client::encoding::prometheus_text::CONTENT_TYPE, body),
                Err(_) => ("500 Internal Server Error", "text/plain", "encoding failed\n".to_string()),
            }
        }
        ("GET", "/") => ("200 OK", "text/plain", "umbp-pool: metrics at /metrics\n".to_string()),
        ("GET", _) => ("404 Not Found", "text/plain", "not found; metrics are at /metrics\n".to_string()),
        _ => ("405 Method Not Allowed", "text/plain", "only GET\n".to_string()),
    };
    let mut out =
        format!("HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len()).into_bytes();
    out.extend_from_slice(body.as_bytes());
    out
}

/// Reads counters and state at scrape time.
struct PoolCollector {
    inner: Arc<PoolInner>,
}

impl std::fmt::Debug for PoolCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PoolCollector")
    }
}

fn counter(enc: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> Result<(), std::fmt::Error> {
    let m = ConstCounter::new(v);
    m.encode(enc.encode_descriptor(name, help, None, MetricType::Counter)?)
}

fn gauge(enc: &mut DescriptorEncoder, name: &str, help: &str, v: f64) -> Result<(), std::fmt::Error> {
    let m = ConstGauge::new(v);
    m.encode(enc.encode_descriptor(name, help, None, MetricType::Gauge)?)
}

/// One counter with one label, several values.
fn labelled_counter(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    label: &'static str,
    values: &[(&'static str, u64)],
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (value, v) in values {
        ConstCounter::new(*v).encode(m.encode_family(&[(label, *value)])?)?;
    }
    Ok(())
}

fn labelled_gauge(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    label: &'static str,
    values: &[(&'static str, f64)],
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (value, v) in values {
        ConstGauge::new(*v).encode(m.encode_family(&[(label, *value)])?)?;
    }
    Ok(())
}

impl Collector for PoolCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let inner = &self.inner;
        let (p, namespaces, tier_stats) = {
            let s = inner.store.objects.lock().expect("store lock");
            (crate::observe::report::pool_section(inner, &s), s.namespaces().len() as u64, s.tier_stats())
        };
        // The SSD store's own counters, never under the store lock (as report.rs).
        let ssd = inner.tiers.ssd.as_deref().map(|t| crate::observe::report::ssd_report(t, &tier_stats));
        let [dram, ssd_objects, remote] = tier_stats.objects;
        let tiers = TierCounts { dram, ssd: ssd_objects, remote };
        let c = inner.counters.snapshot();
        let (capacity, allocated) = (p.capacity_bytes, p.allocated_bytes);
        let (mut workers, mut schedulers, mut observers, mut inflight) = (0u64, 0u64, 0u64, 0u64);
        for a in inner.attachments.lock().expect("attachments lock").iter() {
            match a.role {
                Role::Worker => workers += 1,
                Role::Scheduler => schedulers += 1,
                Role::Observer => observers += 1,
            }
            inflight += a.inflight.load(Ordering::Relaxed) as u64;
        }

        gauge(&mut enc, "umbp_capacity_bytes", "DRAM capacity of the pool", capacity as f64)?;
        gauge(
            &mut enc,
            "umbp_dram_registered_bytes",
            "DRAM registered (pinned) with the GPU drivers so far; equals capacity once done (0 without a GPU)",
            p.dram_registered_bytes as f64,
        )?;
        gauge(&mut enc, "umbp_allocated_bytes", "DRAM handed to objects (published or being written)", allocated as f64)?;
        gauge(
            &mut enc,
            "umbp_occupancy_ratio",
            "allocated / capacity (the evictor keeps it between the watermarks)",
            if capacity > 0 { allocated as f64 / capacity as f64 } else { 0.0 },
        )?;
        gauge(&mut enc, "umbp_high_watermark_ratio", "Occupancy above which the evictor starts", p.high_watermark)?;
        gauge(&mut enc, "umbp_low_watermark_ratio", "Occupancy the evictor brings the pool down to", p.low_watermark)?;
        gauge(&mut enc, "umbp_objects", "Objects held (published or being written)", p.objects as f64)?;
        gauge(&mut enc, "umbp_published_objects", "Objects visible in the index", p.published_objects as f64)?;
        gauge(&mut enc, "umbp_pinned_objects", "Objects pinned by loads in flight", p.pinned_objects as f64)?;
        gauge(&mut enc, "umbp_namespaces", "Namespaces with at least one object", namespaces as f64)?;
        counter(&mut enc, "umbp_evictions", "Objects evicted by the evictor", p.evictions)?;
        gauge(
            &mut enc,
            "umbp_quarantined_bytes",
            "DRAM kept out of use because a timed-out remote read may still write it",
            p.quarantined_bytes as f64,
        )?;
        gauge(&mut enc, "umbp_quarantined_ranges", "Quarantined DRAM ranges", p.quarantined_ranges as f64)?;
        gauge(&mut enc, "umbp_quarantine_max_bytes", "Bound on quarantined DRAM (--quarantine-max-size)", p.quarantine_max_bytes as f64)?;
        counter(
            &mut enc,
            "umbp_quarantine_reclaimed_bytes",
            "Quarantined DRAM handed back (its writer can no longer land)",
            p.quarantine_reclaimed_bytes,
        )?;
        counter(
            &mut enc,
            "umbp_quarantine_refusals",
            "Remote-tier promotions served as misses because the quarantine was at its bound",
            p.quarantine_refusals,
        )?;
        counter(&mut enc, "umbp_events", "KV events written to the shared event log", p.events_written)?;
        gauge(
            &mut enc,
            "umbp_idle_poll_window_seconds",
            "How long idle pool threads poll for work before they sleep (--idle-poll-us)",
            p.idle_poll_window_us / 1e6,
        )?;

        labelled_counter(
            &mut enc,
            "umbp_blocks",
            "Blocks by outcome (stored, already_present, not_stored, loaded, missing, failed, invalid)",
            "result",
            &[
                ("stored", c.blocks_stored),
                ("already_present", c.blocks_already_present),
                ("not_stored", c.blocks_not_stored),
                ("loaded", c.blocks_loaded),
                ("missing", c.blocks_missing),
                ("failed", c.blocks_failed),
                ("invalid", c.blocks_invalid),
            ],
        )?;
        counter(&mut enc, "umbp_stores", "Blocks stored (copied into the pool and published)", c.blocks_stored)?;
        counter(&mut enc, "umbp_loads", "Blocks loaded (copied out of the pool)", c.blocks_loaded)?;
        counter(&mut enc, "umbp_load_hits", "Load requests for blocks the pool held", c.blocks_loaded)?;
        counter(&mut enc, "umbp_load_misses", "Load requests for blocks the pool did not hold", c.blocks_missing)?;
        labelled_counter(
            &mut enc,
            "umbp_bytes",
            "Bytes copied, by direction (store: into the pool, load: out of it)",
            "direction",
            &[("store", c.bytes_stored), ("load", c.bytes_loaded)],
        )?;
        for (direction, phases) in [("store", &c.phases.store), ("load", &c.phases.load)] {
            let (name, help) = (
                format!("umbp_{direction}_phase_seconds"),
                format!("Time of {direction} jobs by phase, summed over jobs (admit, queue, reserve, plan, copy, publish, finish)"),
            );
            let mut m = enc.encode_descriptor(&name, &help, None, MetricType::Counter)?;
            for (phase, ns) in phases.phases() {
                ConstCounter::new(ns as f64 * 1e-9).encode(m.encode_family(&[("phase", phase)])?)?;
            }
        }
        let mut m = enc.encode_descriptor(
            "umbp_first_stage_seconds",
            "Copy threads' time from taking a job to its first stage handed to the device, summed over jobs (part of reserve and plan: what delays the first byte)",
            None,
            MetricType::Counter,
        )?;
        for (direction, phases) in [("store", &c.phases.store), ("load", &c.phases.load)] {
            ConstCounter::new(phases.first_stage_ns as f64 * 1e-9).encode(m.encode_family(&[("direction", direction)])?)?;
        }
        let gbps = |bytes: u64, ns: u64| if ns > 0 { bytes as f64 / ns as f64 } else { 0.0 };
        labelled_gauge(
            &mut enc,
            "umbp_copy_bandwidth_gigabytes_per_second",
            "Bytes copied / time inside copy calls since start (GB/s), by direction",
            "direction",
            &[("store", gbps(c.bytes_stored, c.phases.store.copy_ns)), ("load", gbps(c.bytes_loaded, c.phases.load.copy_ns))],
        )?;
        counter(&mut enc, "umbp_submissions", "Submissions (SQEs) taken from the rings", c.submissions)?;
        counter(
            &mut enc,
            "umbp_service_wakeups",
            "Submissions that found the pool asleep: the service thread woke for a doorbell (--idle-poll-us)",
            c.service_wakeups,
        )?;
        counter(&mut enc, "umbp_rejected_submissions", "Submissions answered with an error CQE", c.rejected_submissions)?;
        counter(
            &mut enc,
            "umbp_transfers_cancelled",
            "Transfers abandoned by their worker before the pool issued all their stages",
            c.transfers_cancelled,
        )?;
        counter(&mut enc, "umbp_hints", "Touch hints drained from schedulers", c.hints)?;
        labelled_gauge(
            &mut enc,
            "umbp_attachments",
            "Live attachments by role",
            "role",
            &[("worker", workers as f64), ("scheduler", schedulers as f64), ("observer", observers as f64)],
        )?;
        gauge(&mut enc, "umbp_inflight_submissions", "Submissions accepted and not yet completed", inflight as f64)?;
        counter(&mut enc, "umbp_attachments_accepted", "Handshakes accepted since start", c.attachments_total)?;
        counter(&mut enc, "umbp_handshake_refusals", "Handshakes refused since start", c.refusals)?;

        // Summed over the tenant groups' indexes (one without --namespace-acl); headers
        // only: a scrape never walks the tables for the probe histogram.
        if let Some(s) = crate::observe::group_report::index_totals(inner) {
            gauge(&mut enc, "umbp_index_slots", "Slots per index table (all tenant groups' indexes)", s.slot_count as f64)?;
            gauge(&mut enc, "umbp_index_live", "Live index entries", s.live as f64)?;
            gauge(&mut enc, "umbp_index_tombstones", "Index tombstones", s.tombstones as f64)?;
            gauge(&mut enc, "umbp_index_epoch", "Index epoch (rebuild count, active table = epoch & 1; group 0's)", s.epoch as f64)?;
            counter(&mut enc, "umbp_index_rebuilds", "Index rebuilds", s.rebuilds)?;
        }
        gauge(&mut enc, "umbp_uptime_seconds", "Seconds since the pool started", inner.started.elapsed().as_secs_f64())?;
        encode_tiers(&mut enc, &tiers, allocated, ssd.as_ref())?;
        if let Some(cl) = inner.remote_source.cluster_report() {
            encode_cluster(&mut enc, &cl)?;
        }
        Ok(())
    }
}

/// The cluster tier's counters (docs/cluster.md, "Counters"); written only in a cluster.
pub fn encode_cluster(enc: &mut DescriptorEncoder, c: &crate::pool_report::ClusterReport) -> Result<(), std::fmt::Error> {
    gauge(enc, "umbp_cluster_peers", "Cluster peers connected and joined (this pool reads from them)", c.peers as f64)?;
    gauge(enc, "umbp_cluster_subscribers", "Pools subscribed to this one", c.subscribers as f64)?;
    gauge(enc, "umbp_cluster_leased_pins", "Pins kept for closed subscriber connections until their lease ends", c.leased_pins as f64)?;
    gauge(enc, "umbp_cluster_export_bytes_used", "Bytes of the export area holding copies for peers' pins", c.export_bytes_used as f64)?;
    for (name, help, v) in [
        ("umbp_cluster_fetches", "Remote objects fetched or tried", c.fetches),
        ("umbp_cluster_fetch_failures", "Remote fetches that failed (misses)", c.fetch_failures),
        (
            "umbp_cluster_digest_mismatches",
            "Remote reads whose bytes did not match the holder's digest (not published)",
            c.digest_mismatches,
        ),
        ("umbp_cluster_late_reads", "Remote reads completed past the holder's pin lease (not published)", c.late_reads),
        ("umbp_cluster_refused_connections", "Connections closed at accept (unauthenticated caps, fd reserve)", c.refused_connections),
        ("umbp_cluster_auth_failures", "Cluster handshakes that failed authentication", c.auth_failures),
        ("umbp_cluster_pins_over_cap", "Peers' pins refused at the per-subscriber caps", c.pins_over_cap),
        (
            "umbp_cluster_leases_over_cap",
            "Closed subscribers' pins released at once: the leases held a subscriber's pin caps",
            c.leases_over_cap,
        ),
        ("umbp_cluster_catalog_over_cap", "Peers' keys left out of the catalog at the per-group cap", c.catalog_over_cap),
        ("umbp_cluster_published_changes", "DRAM key changes sent to subscribers", c.published_changes),
        ("umbp_cluster_export_full", "Peers' pins refused: the export area had no room for the copy", c.export_full),
    ] {
        counter(enc, name, help, v)?;
    }
    let flag = |b: bool| f64::from(u8::from(b));
    gauge(
        enc,
        "umbp_cluster_membership_etcd",
        "1 when peers are found through etcd (--cluster-etcd), 0 with the --cluster-peer list only",
        flag(c.etcd.is_some()),
    )?;
    let Some(e) = &c.etcd else { return Ok(()) };
    gauge(enc, "umbp_cluster_etcd_reachable", "1 when the last poll of etcd succeeded, 0 while etcd is unreachable", flag(e.reachable))?;
    gauge(
        enc,
        "umbp_cluster_etcd_seconds_since_success",
        "Seconds since the last successful etcd poll (since the start while none has): grows while etcd is down",
        e.seconds_since_success,
    )?;
    counter(
        enc,
        "umbp_cluster_etcd_failed_requests",
        "Requests to etcd that failed (no endpoint answered in time, or an error status)",
        e.failed_requests,
    )?;
    counter(enc, "umbp_cluster_etcd_outages", "Times etcd went from reachable to unreachable", e.outages)?;
    counter(
        enc,
        "umbp_cluster_etcd_registrations",
        "Times this pool's key was written under a new etcd lease (the first one included)",
        e.registrations,
    )?;
    gauge(
        enc,
        "umbp_cluster_etcd_members",
        "Members under the etcd prefix in the last successful read, this pool included (kept while etcd is down)",
        e.members as f64,
    )?;
    gauge(
        enc,
        "umbp_cluster_etcd_registered",
        "1 when this pool's key was in the last read and etcd confirmed its lease less than a TTL ago",
        flag(e.registered),
    )?;
    Ok(())
}

/// Per-tier gauges and the SSD tier's counters (docs/operations.md, "Metrics"): objects by
/// tier (what the indexes list), bytes by tier (DRAM: allocated; SSD: live records), and,
/// with an SSD tier, its use, traffic and failures. Without one only the tier gauges are
/// written (SSD 0), so dashboards need no special case.
pub fn encode_tiers(
    enc: &mut DescriptorEncoder,
    tiers: &TierCounts,
    dram_bytes: u64,
    ssd: Option<&SsdReport>,
) -> Result<(), std::fmt::Error> {
    labelled_gauge(
        enc,
        "umbp_tier_objects",
        "Objects the indexes list, by tier (dram: loads copy from there; ssd: a load promotes first; remote: another node)",
        "tier",
        &[("dram", tiers.dram as f64), ("ssd", tiers.ssd as f64), ("remote", tiers.remote as f64)],
    )?;
    labelled_gauge(
        enc,
        "umbp_tier_bytes",
        "Bytes held by tier (dram: allocated to objects; ssd: live records)",
        "tier",
        &[("dram", dram_bytes as f64), ("ssd", ssd.map_or(0, |s| s.live_bytes) as f64)],
    )?;
    let Some(s) = ssd else { return Ok(()) };
    gauge(enc, "umbp_ssd_capacity_bytes", "SSD capacity (all directories)", s.capacity_bytes as f64)?;
    gauge(enc, "umbp_ssd_used_bytes", "Bytes of SSD segment files (live and dead records, footers)", s.bytes as f64)?;
    gauge(
        enc,
        "umbp_ssd_occupancy_ratio",
        "SSD used / capacity (writes reclaim space above the high watermark)",
        if s.capacity_bytes > 0 { s.bytes as f64 / s.capacity_bytes as f64 } else { 0.0 },
    )?;
    gauge(enc, "umbp_ssd_high_watermark_ratio", "SSD occupancy above which a write first reclaims space", s.high_watermark)?;
    gauge(enc, "umbp_ssd_low_watermark_ratio", "SSD occupancy reclaiming brings a drive down to", s.low_watermark)?;
    gauge(enc, "umbp_ssd_objects", "Objects on SSD (live records)", s.objects as f64)?;
    gauge(enc, "umbp_ssd_segments", "SSD segment files (each held open)", s.segments as f64)?;
    gauge(enc, "umbp_ssd_direct_io", "1 when every SSD directory uses O_DIRECT, 0 when buffered", f64::from(u8::from(s.direct_io)))?;
    gauge(
        enc,
        "umbp_ssd_io_uring",
        "1 when SSD I/O runs through io_uring, 0 on the pread/pwrite fallback",
        f64::from(u8::from(s.io_uring)),
    )?;
    counter(enc, "umbp_ssd_demotions", "Objects written to SSD when evicted from DRAM", s.demotions)?;
    counter(enc, "umbp_ssd_demoted_bytes", "Bytes written to SSD by demotions (drive wear)", s.demoted_bytes)?;
    counter(enc, "umbp_ssd_not_admitted", "Evicted objects the admission policy dropped instead of demoting", s.not_admitted)?;
    counter(
        enc,
        "umbp_ssd_demotion_failures",
        "Demotions that failed (disk full, I/O error, no room): the object was dropped",
        s.demotion_failures,
    )?;
    counter(enc, "umbp_ssd_promotions", "Objects read back from SSD into DRAM by loads", s.promotions)?;
    counter(enc, "umbp_ssd_promoted_bytes", "Bytes read from SSD by promotions", s.promoted_bytes)?;
    counter(enc, "umbp_ssd_promotion_failures", "Promotions that found no readable record (served as misses)", s.promotion_failures)?;
    counter(enc, "umbp_ssd_crc_misses", "SSD reads whose CRC32C did not match (served as misses, never loaded)", s.crc_misses)?;
    labelled_counter(
        enc,
        "umbp_ssd_io_errors",
        "SSD I/O errors, by direction",
        "direction",
        &[("read", s.read_errors), ("write", s.write_errors)],
    )?;
    counter(enc, "umbp_ssd_evicted_objects", "Objects the SSD tier dropped for room (oldest segments first)", s.evicted_objects)?;
    counter(enc, "umbp_ssd_compactions", "SSD segments compacted", s.compactions)?;
    gauge(enc, "umbp_ssd_restored_objects", "Objects listed from the SSD segments at start (warm restart)", s.restored_objects as f64)?;
    gauge(enc, "umbp_ssd_torn_records_skipped", "Torn SSD records (crash mid-write) skipped at start", s.torn_records_skipped as f64)?;
    gauge(
        enc,
        "umbp_ssd_segments_refused",
        "SSD segment files refused at start (symlink, not a regular file, another uid's, hard-linked) and left untouched",
        s.segments_refused as f64,
    )?;
    gauge(enc, "umbp_ssd_rebuild_seconds", "Time the SSD index rebuild took at start", s.rebuild_ms / 1e3)?;
    counter(enc, "umbp_ssd_puts", "Records the SSD store wrote (demotions, the clean stop's writes, compaction moves)", s.puts)?;
    counter(enc, "umbp_ssd_put_bytes", "Bytes of records the SSD store wrote", s.put_bytes)?;
    labelled_counter(
        enc,
        "umbp_ssd_reads",
        "SSD store reads by result (hit: a readable record; miss: absent, I/O error or bad CRC)",
        "result",
        &[("hit", s.hits), ("miss", s.misses)],
    )?;
    counter(enc, "umbp_ssd_compacted_bytes", "Bytes of live SSD records moved by compaction", s.compacted_bytes)?;
    counter(
        enc,
        "umbp_ssd_segment_syncs",
        "SSD segment files fdatasynced by flushes (--ssd-sync-interval, clean stop); records written since the last one do not survive a power loss",
        s.segment_syncs,
    )?;
    counter(enc, "umbp_ssd_dir_syncs", "SSD directory fsyncs by flushes (one per directory per flush)", s.dir_syncs)?;
    labelled_gauge(
        enc,
        "umbp_ssd_start_segments",
        "SSD segments at start, by how they were read (footer, scanned) or skipped (unreadable: their objects are misses)",
        "how",
        &[("footer", s.segments_from_footer as f64), ("scanned", s.segments_scanned as f64), ("unreadable", s.segments_unreadable as f64)],
    )?;
    gauge(
        enc,
        "umbp_ssd_misplaced_records",
        "SSD records found at start in a directory their key does not map to (the directory list changed)",
        s.misplaced_records as f64,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Fixed(TierCounts, u64, Option<SsdReport>);

    impl Collector for Fixed {
        fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
            encode_tiers(&mut enc, &self.0, self.1, self.2.as_ref())
        }
    }

    fn scrape(c: Fixed) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(c));
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &registry).unwrap();
        text
    }

    fn sample(text: &str, series: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series).and_then(|r| r.strip_prefix(' ')))
            .unwrap_or_else(|| panic!("{series} not in:\n{text}"))
            .parse()
            .unwrap()
    }

    /// Each tier's objects and bytes and each SSD counter come out under its name with the
    /// report's value; without an SSD tier only the tier gauges are written (SSD zero).
    #[test]
    fn unix_addresses_name_their_path() {
        assert_eq!(unix_path("unix:/run/umbp/m.sock"), Some(Path::new("/run/umbp/m.sock")));
        assert_eq!(unix_path(" unix:///run/umbp/m.sock "), Some(Path::new("/run/umbp/m.sock")));
        assert_eq!(unix_path("unix:rel/m.sock"), Some(Path::new("rel/m.sock")));
        assert_eq!(unix_path("9464"), None);
        assert_eq!(unix_path("127.0.0.1:9464"), None);
    }

    #[derive(Debug)]
    struct FixedCluster(crate::pool_report::ClusterReport);

    impl Collector for FixedCluster {
        fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
            encode_cluster(&mut enc, &self.0)
        }
    }

    /// etcd's health comes out under its names with the report's values; a pool on the
    /// --cluster-peer list shows `umbp_cluster_membership_etcd 0` and no etcd series.
    #[test]
    fn etcd_membership_series_carry_the_report() {
        let text = |c| {
            let mut registry = Registry::default();
            registry.register_collector(Box::new(FixedCluster(c)));
            let mut t = String::new();
            prometheus_client::encoding::prometheus_text::encode(&mut t, &registry).unwrap();
            t
        };
        let etcd = crate::pool_report::EtcdReport {
            reachable: false,
            seconds_since_success: 2.5,
            failed_requests: 7,
            outages: 1,
            registrations: 3,
            members: 4,
            registered: false,
        };
        let t = text(crate::pool_report::ClusterReport { etcd: Some(etcd), ..Default::default() });
        for (series, want) in [
            ("umbp_cluster_membership_etcd", 1.0),
            ("umbp_cluster_etcd_reachable", 0.0),
            ("umbp_cluster_etcd_seconds_since_success", 2.5),
            ("umbp_cluster_etcd_failed_requests_total", 7.0),
            ("umbp_cluster_etcd_outages_total", 1.0),
            ("umbp_cluster_etcd_registrations_total", 3.0),
            ("umbp_cluster_etcd_members", 4.0),
            ("umbp_cluster_etcd_registered", 0.0),
        ] {
            assert_eq!(sample(&t, series), want, "{series}");
        }
        let t = text(crate::pool_report::ClusterReport {
            etcd: Some(crate::pool_report::EtcdReport { reachable: true, registered: true, ..etcd }),
            ..Default::default()
        });
        assert_eq!((sample(&t, "umbp_cluster_etcd_reachable"), sample(&t, "umbp_cluster_etcd_registered")), (1.0, 1.0));
        let t = text(crate::pool_report::ClusterReport::default());
        assert_eq!(sample(&t, "umbp_cluster_membership_etcd"), 0.0);
        assert!(!t.contains("umbp_cluster_etcd_"), "no etcd series without etcd:\n{t}");
    }

    #[test]
    fn tier_gauges_and_ssd_counters_carry_the_report() {
        let t = scrape(Fixed(TierCounts { dram: 7, ssd: 30, remote: 2 }, 1 << 20, Some(SsdReport::example())));
        for (series, want) in [
            ("umbp_tier_objects{tier=\"dram\"}", 7.0),
            ("umbp_tier_objects{tier=\"ssd\"}", 30.0),
            ("umbp_tier_objects{tier=\"remote\"}", 2.0),
            ("umbp_tier_bytes{tier=\"dram\"}", (1 << 20) as f64),
            ("umbp_tier_bytes{tier=\"ssd\"}", (2u64 << 30) as f64),
            ("umbp_ssd_capacity_bytes", (4u64 << 30) as f64),
            ("umbp_ssd_used_bytes", (3u64 << 30) as f64),
            ("umbp_ssd_occupancy_ratio", 0.75),
            ("umbp_ssd_objects", 30.0),
            ("umbp_ssd_segments", 13.0),
            ("umbp_ssd_direct_io", 0.0),
            ("umbp_ssd_io_uring", 1.0),
            ("umbp_ssd_demotions_total", 77.0),
            ("umbp_ssd_demoted_bytes_total", (77 << 20) as f64),
            ("umbp_ssd_not_admitted_total", 5.0),
            ("umbp_ssd_demotion_failures_total", 2.0),
            ("umbp_ssd_promotions_total", 9.0),
            ("umbp_ssd_promoted_bytes_total", (9 << 20) as f64),
            ("umbp_ssd_promotion_failures_total", 1.0),
            ("umbp_ssd_crc_misses_total", 3.0),
            ("umbp_ssd_io_errors_total{direction=\"read\"}", 4.0),
            ("umbp_ssd_io_errors_total{direction=\"write\"}", 6.0),
            ("umbp_ssd_evicted_objects_total", 8.0),
            ("umbp_ssd_compactions_total", 10.0),
            ("umbp_ssd_restored_objects", 1000.0),
            ("umbp_ssd_torn_records_skipped", 11.0),
            ("umbp_ssd_segments_refused", 13.0),
            ("umbp_ssd_rebuild_seconds", 0.0125),
            ("umbp_ssd_puts_total", 14.0),
            ("umbp_ssd_put_bytes_total", (14 << 20) as f64),
            ("umbp_ssd_reads_total{result=\"hit\"}", 15.0),
            ("umbp_ssd_reads_total{result=\"miss\"}", 16.0),
            ("umbp_ssd_compacted_bytes_total", (17 << 20) as f64),
            ("umbp_ssd_segment_syncs_total", 18.0),
            ("umbp_ssd_dir_syncs_total", 19.0),
            ("umbp_ssd_start_segments{how=\"footer\"}", 20.0),
            ("umbp_ssd_start_segments{how=\"scanned\"}", 21.0),
            ("umbp_ssd_start_segments{how=\"unreadable\"}", 22.0),
            ("umbp_ssd_misplaced_records", 23.0),
        ] {
            assert_eq!(sample(&t, series), want, "{series}");
        }
        assert!(t.contains("# TYPE umbp_ssd_crc_misses_total counter"), "{t}");
        let t = scrape(Fixed(TierCounts { dram: 3, ssd: 0, remote: 0 }, 4096, None));
        assert_eq!(sample(&t, "umbp_tier_objects{tier=\"dram\"}"), 3.0);
        assert_eq!(sample(&t, "umbp_tier_bytes{tier=\"ssd\"}"), 0.0);
        assert!(!t.contains("umbp_ssd_"), "no SSD series without an SSD tier:\n{t}");
    }
}
