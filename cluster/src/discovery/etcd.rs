//! Membership on etcd (issue #35): each pool registers `<prefix>/members/<control addr>`
//! under a lease it keeps alive, and reads the prefix for the others; [`EtcdDiscovery`] is
//! the `Discovery` the node's ticker asks. etcd only says whom to dial: the authenticated
//! handshake (the cluster secret) still decides who is a member (docs/security.md).
//!
//! One background thread (`cluster-etcd`) talks to etcd; the ticker never waits on it.
//! etcd unreachable: the last view is kept (a WARN once, `EtcdStatus::up` false,
//! `outages` counted); when it answers again the lease is renewed or, if it expired,
//! granted anew and the key written again, and the view refreshed (an INFO).
//!
//! The prefix is read with a range every `poll` (not a watch stream): one small request
//! per pool per poll, and an outage or an etcd restart needs no resume logic.
//!
//! [`EtcdHandle::health`] is what operators see of it (the pool report's `cluster.etcd`,
//! the `umbp_cluster_etcd_*` metrics): reachable now, time since the last good poll,
//! failed requests, members seen, this pool's registration live.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::gateway::{b64, int, unb64, Gateway, GatewayError};
use crate::membership::Discovery;

/// Longest control address accepted from etcd (anything longer is ignored).
const MAX_ADDR: usize = 255;

#[derive(Debug, Clone)]
pub struct EtcdConfig {
    /// `http://HOST:PORT` of each etcd member.
    pub endpoints: Vec<String>,
    /// Key prefix of this cluster (pools of one cluster share it).
    pub prefix: String,
    /// Lease TTL: a pool that stops keeping it alive leaves the others' view this long after.
    pub ttl: Duration,
    /// How often the prefix is read.
    pub poll: Duration,
    /// Bound on one request to etcd.
    pub request_timeout: Duration,
    /// Addresses dialled whatever etcd says (`--cluster-peer`).
    pub static_peers: Vec<String>,
}

impl EtcdConfig {
    pub fn new(endpoints: Vec<String>, prefix: String, ttl: Duration) -> Self {
        Self {
            endpoints,
            prefix,
            ttl,
            poll: Duration::from_millis(200),
            request_timeout: Duration::from_millis(500),
            static_peers: Vec::new(),
        }
    }

    fn members_prefix(&self) -> String {
        format!("{}/members/", self.prefix.trim_end_matches('/'))
    }
}

/// What the etcd thread last saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EtcdStatus {
    /// The last request to etcd succeeded.
    pub up: bool,
    /// Times etcd went from reachable to unreachable.
    pub outages: u64,
    /// Times this pool's lease was found expired (or missing) and granted anew.
    pub regrants: u64,
    /// Members' control addresses in the view (this pool's own included).
    pub members: Vec<String>,
    pub last_error: Option<String>,
    /// Requests to etcd that failed (no endpoint answered in time, or an error status);
    /// each ends its poll, so this is also the count of failed polls.
    pub failed_requests: u64,
    /// When the last poll succeeded (None: none has yet).
    pub last_ok: Option<Instant>,
    /// When etcd last confirmed this pool's lease (granted or kept alive).
    pub lease_confirmed: Option<Instant>,
}

struct Shared {
    me: Mutex<Option<String>>,
    status: Mutex<EtcdStatus>,
    stop: AtomicBool,
    /// When the membership started (the age of "no good poll yet").
    started: Instant,
    ttl: Duration,
}

impl Shared {
    fn new(ttl: Duration) -> Self {
        Self { me: Mutex::default(), status: Mutex::default(), stop: AtomicBool::new(false), started: Instant::now(), ttl }
    }
}

/// What an operator sees of etcd membership (the report's `cluster.etcd`, the metrics).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EtcdHealth {
    /// The last poll succeeded.
    pub reachable: bool,
    /// Since the last successful poll, or since the start while none has succeeded.
    pub since_success: Duration,
    pub failed_requests: u64,
    pub outages: u64,
    /// Times this pool's key was written under a new lease (the first registration included).
    pub registrations: u64,
    /// Members in the view: the last successful read of the prefix (kept while etcd is down).
    pub members: usize,
    /// This pool's key was in the last read and etcd confirmed its lease less than a TTL
    /// ago: the others can find it through etcd.
    pub registered: bool,
}

/// A reader of the membership's health; cloned into the cluster tier's report.
#[derive(Clone)]
pub struct EtcdHandle(Arc<Shared>);

impl EtcdHandle {
    pub fn health(&self) -> EtcdHealth {
        let me = self.0.me.lock().expect("me").clone();
        let st = self.0.status.lock().expect("status");
        EtcdHealth {
            reachable: st.up,
            since_success: st.last_ok.unwrap_or(self.0.started).elapsed(),
            failed_requests: st.failed_requests,
            outages: st.outages,
            registrations: st.regrants,
            members: st.members.len(),
            registered: me.is_some_and(|me| st.members.contains(&me)) && st.lease_confirmed.is_some_and(|t| t.elapsed() < self.0.ttl),
        }
    }
}

/// The `Discovery` the node asks: etcd's view (less this pool) plus the static list.
pub struct EtcdDiscovery {
    shared: Arc<Shared>,
    static_peers: Vec<String>,
}

impl Discovery for EtcdDiscovery {
    fn peers(&mut self) -> Vec<String> {
        let me = self.shared.me.lock().expect("me").clone();
        let st = self.shared.status.lock().expect("status");
        let mut all: BTreeSet<String> = st.members.iter().cloned().collect();
        all.extend(self.static_peers.iter().cloned());
        all.into_iter().filter(|a| Some(a) != me.as_ref()).collect()
    }
}

/// The registration: started before the node (which takes the [`EtcdDiscovery`]), told
/// the node's address with [`EtcdMembership::advertise`]; dropping it revokes the lease,
/// so a pool that stops cleanly leaves the others' view at once.
pub struct EtcdMembership {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl EtcdMembership {
    /// Checks the endpoints and starts the thread (it reads the view at once; it registers
    /// once [`advertise`](Self::advertise) gave the address).
    pub fn start(cfg: EtcdConfig) -> Result<(Self, EtcdDiscovery), GatewayError> {
        let gw = Gateway::new(&cfg.endpoints, cfg.request_timeout)?;
        let shared = Arc::new(Shared::new(cfg.ttl));
        let d = EtcdDiscovery { shared: shared.clone(), static_peers: cfg.static_peers.clone() };
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("cluster-etcd".into())
            .spawn(move || Worker { cfg, gw, shared: s, lease: None, last_keepalive: None }.run())
            .expect("spawn cluster-etcd");
        Ok((Self { shared, thread: Some(thread) }, d))
    }

    /// This pool's control address as peers dial it; registered under the lease.
    pub fn advertise(&self, addr: String) {
        *self.shared.me.lock().expect("me") = Some(addr);
    }

    pub fn status(&self) -> EtcdStatus {
        self.shared.status.lock().expect("status").clone()
    }

    /// A reader of the health this membership shows operators.
    pub fn handle(&self) -> EtcdHandle {
        EtcdHandle(self.shared.clone())
    }
}

impl Drop for EtcdMembership {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed); // a flag; the thread re-checks within one poll
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Worker {
    cfg: EtcdConfig,
    gw: Gateway,
    shared: Arc<Shared>,
    lease: Option<i64>,
    last_keepalive: Option<Instant>,
}

impl Worker {
    fn run(mut self) {
        while !self.shared.stop.load(Ordering::Relaxed) {
            let res = self.step();
            let mut st = self.shared.status.lock().expect("status");
            match res {
                Ok(members) => {
                    if !st.up && st.outages > 0 {
                        tracing::info!(
                            members = members.len(),
                            "cluster etcd reachable again: membership view refreshed, registration renewed"
                        );
                    }
                    st.up = true;
                    st.last_error = None;
                    st.members = members;
                    st.last_ok = Some(Instant::now());
                }
                Err(e) => {
                    if st.up || (st.outages == 0 && st.last_error.is_none()) {
                        st.outages += 1;
                        tracing::warn!(error = %e, members = st.members.len(),
                            "cluster etcd unreachable: keeping the current membership view until it answers");
                    }
                    st.up = false;
                    st.last_error = Some(e.to_string());
                    st.failed_requests += 1;
                }
            }
            drop(st);
            std::thread::sleep(self.cfg.poll);
        }
        // Leaving cleanly: revoke the lease, so the key goes now, not after the TTL.
        if let Some(id) = self.lease {
            let _ = self.gw.call("/v3/lease/revoke", &json!({ "ID": id.to_string() }));
        }
    }

    /// Keeps the registration alive (if advertised) and reads the members.
    fn step(&mut self) -> Result<Vec<String>, GatewayError> {
        let me = self.shared.me.lock().expect("me").clone();
        if let Some(me) = &me {
            self.keep_registered(me)?;
        }
        let prefix = self.cfg.members_prefix();
        let r =
            self.gw.call("/v3/kv/range", &json!({ "key": b64(prefix.as_bytes()), "range_end": b64(&prefix_end(prefix.as_bytes())) }))?;
        let members = parse_members(&r);
        if let Some(me) = me {
            if !members.contains(&me) {
                // Our key is gone (deleted, or the lease ended meanwhile): write it again.
                self.lease = None;
                self.keep_registered(&me)?;
            }
        }
        Ok(members)
    }

    fn keep_registered(&mut self, me: &str) -> Result<(), GatewayError> {
        let ttl_s = self.cfg.ttl.as_secs().max(1);
        let due = self.last_keepalive.is_none_or(|t| t.elapsed() >= self.cfg.ttl / 3);
        if let (Some(id), true) = (self.lease, due) {
            let r = self.gw.call("/v3/lease/keepalive", &json!({ "ID": id.to_string() }))?;
            let ttl = r.get("result").and_then(|x| x.get("TTL")).and_then(int).unwrap_or(0);
            if ttl > 0 {
                let now = Instant::now();
                self.last_keepalive = Some(now);
                self.shared.status.lock().expect("status").lease_confirmed = Some(now);
                return Ok(());
            }
            tracing::warn!(lease = id, "cluster etcd lease expired: registering again");
            self.lease = None;
        }
        if self.lease.is_some() {
            return Ok(());
        }
        let r = self.gw.call("/v3/lease/grant", &json!({ "TTL": ttl_s.to_string() }))?;
        let id = r
            .get("ID")
            .and_then(int)
            .filter(|&i| i != 0)
            .ok_or_else(|| GatewayError::Io { endpoint: "lease/grant".into(), what: format!("no lease ID in {r}") })?;
        let key = format!("{}{me}", self.cfg.members_prefix());
        let value = json!({ "control": me }).to_string();
        self.gw.call("/v3/kv/put", &json!({ "key": b64(key.as_bytes()), "value": b64(value.as_bytes()), "lease": id.to_string() }))?;
        let mut st = self.shared.status.lock().expect("status");
        if st.regrants > 0 || self.last_keepalive.is_some() {
            tracing::info!(addr = me, "cluster etcd registration written again under a new lease");
        } else {
            tracing::info!(addr = me, ttl_s, "cluster registered in etcd");
        }
        st.regrants += 1;
        self.lease = Some(id);
        let now = Instant::now();
        self.last_keepalive = Some(now);
        st.lease_confirmed = Some(now);
        Ok(())
    }
}

/// etcd's `range_end` for "every key with this prefix": the prefix with its last byte
/// below 0xff incremented (and what followed it dropped).
fn prefix_end(p: &[u8]) -> Vec<u8> {
    let mut e = p.to_vec();
    while let Some(&last) = e.last() {
        if last < 0xff {
            *e.last_mut().expect("non-empty") += 1;
            return e;
        }
        e.pop();
    }
    vec![0]
}

/// The control addresses in a range answer's values; values that are not
/// `{"control": "HOST:PORT"}` are ignored (they cannot make a pool dial anything else).
fn parse_members(r: &Value) -> Vec<String> {
    let mut out = BTreeSet::new();
    for kv in r.get("kvs").and_then(Value::as_array).into_iter().flatten() {
        let Some(v) = kv.get("value").and_then(Value::as_str).and_then(unb64) else { continue };
        let Ok(v) = serde_json::from_slice::<Value>(&v) else { continue };
        if let Some(a) = v.get("control").and_then(Value::as_str) {
            if !a.is_empty() && a.len() <= MAX_ADDR && a.contains(':') && !a.chars().any(char::is_whitespace) {
                out.insert(a.to_string());
            }
        }
    }
    out.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefix_range_ends_past_every_key_under_it() {
        assert_eq!(prefix_end(b"/umbp/a/members/"), b"/umbp/a/members0");
        assert_eq!(prefix_end(&[b'a', 0xff]), b"b");
        assert_eq!(prefix_end(&[0xff]), vec![0]);
    }

    #[test]
    fn members_are_read_from_values_and_junk_is_ignored() {
        let v = |s: &str| b64(s.as_bytes());
        let r = json!({ "kvs": [
            { "key": v("/p/members/a"), "value": v(r#"{"control":"10.0.0.1:7400"}"#) },
            { "key": v("/p/members/b"), "value": v(r#"{"control":"10.0.0.2:7400"}"#) },
            { "key": v("/p/members/c"), "value": v("not json") },
            { "key": v("/p/members/d"), "value": v(r#"{"control":"no port"}"#) },
            { "key": v("/p/members/e"), "value": "%%%" },
        ]});
        assert_eq!(parse_members(&r), vec!["10.0.0.1:7400".to_string(), "10.0.0.2:7400".to_string()]);
        assert!(parse_members(&json!({})).is_empty());
    }

    #[test]
    fn discovery_leaves_out_this_pool_and_adds_the_static_list() {
        let shared = Arc::new(Shared::new(Duration::from_secs(2)));
        *shared.me.lock().unwrap() = Some("h:1".into());
        shared.status.lock().unwrap().members = vec!["h:1".into(), "h:2".into()];
        let mut d = EtcdDiscovery { shared, static_peers: vec!["h:3".into(), "h:2".into()] };
        assert_eq!(d.peers(), vec!["h:2".to_string(), "h:3".to_string()]);
    }

    /// Registered only while this pool's key is in the view and etcd confirmed its lease
    /// less than a TTL ago; the time since success counts from the start until one.
    #[test]
    fn health_says_registered_only_with_the_key_listed_and_the_lease_fresh() {
        let shared = Arc::new(Shared::new(Duration::from_millis(300)));
        let h = EtcdHandle(shared.clone());
        std::thread::sleep(Duration::from_millis(20));
        let first = h.health();
        assert!(!first.reachable && !first.registered && first.since_success >= Duration::from_millis(20), "{first:?}");
        *shared.me.lock().unwrap() = Some("h:1".into());
        {
            let mut st = shared.status.lock().unwrap();
            st.up = true;
            st.members = vec!["h:1".into(), "h:2".into()];
            st.last_ok = Some(Instant::now());
            st.lease_confirmed = Some(Instant::now());
        }
        let ok = h.health();
        assert!(ok.reachable && ok.registered && ok.members == 2 && ok.since_success < Duration::from_millis(20), "{ok:?}");
        shared.status.lock().unwrap().members = vec!["h:2".into()];
        assert!(!h.health().registered, "key not in the view");
        shared.status.lock().unwrap().members = vec!["h:1".into(), "h:2".into()];
        std::thread::sleep(Duration::from_millis(310));
        assert!(!h.health().registered, "lease not confirmed for a TTL");
    }
}
