//! Who is in the cluster (discovery) and who is alive (liveness), kept apart so a registry
//! can replace the static list without touching liveness.
//!
//! - [`Discovery`] answers "which addresses should this pool keep a control connection
//!   to". [`StaticPeers`] is the `--cluster-peer` list. An etcd implementation would
//!   watch a prefix (`/umbp/<cluster>/members/<node>` → listen address, written with a
//!   lease the pool keeps alive) and return what it last saw; nothing else changes.
//! - [`Liveness`] drops a member not heard from (any frame, heartbeats included) for the
//!   timeout. Pure: the caller passes `now`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::placement::NodeId;

/// Source of the addresses to connect to.
pub trait Discovery: Send {
    /// Control addresses (`HOST:PORT`) of the members this pool should connect to; may
    /// change between calls (a registry) or never (a static list).
    fn peers(&mut self) -> Vec<String>;
}

/// The `--cluster-peer` list.
#[derive(Debug, Clone)]
pub struct StaticPeers(pub Vec<String>);

impl Discovery for StaticPeers {
    fn peers(&mut self) -> Vec<String> {
        self.0.clone()
    }
}

/// Heartbeat bookkeeping: when each member was last heard from.
#[derive(Debug)]
pub struct Liveness {
    timeout: Duration,
    last: HashMap<NodeId, Instant>,
}

impl Liveness {
    pub fn new(timeout: Duration) -> Self {
        Self { timeout, last: HashMap::new() }
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// `node` was heard from at `now` (joins it if new).
    pub fn seen(&mut self, node: NodeId, now: Instant) {
        self.last.insert(node, now);
    }

    /// `node` left (connection closed): forget it now.
    pub fn remove(&mut self, node: NodeId) -> bool {
        self.last.remove(&node).is_some()
    }

    pub fn is_live(&self, node: NodeId) -> bool {
        self.last.contains_key(&node)
    }

    /// Drops and returns the members silent for longer than the timeout.
    pub fn expire(&mut self, now: Instant) -> Vec<NodeId> {
        let dead: Vec<NodeId> =
            self.last.iter().filter(|(_, &t)| now.saturating_duration_since(t) > self.timeout).map(|(&n, _)| n).collect();
        for n in &dead {
            self.last.remove(n);
        }
        dead
    }

    pub fn members(&self) -> Vec<NodeId> {
        self.last.keys().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_silent_member_is_dropped_after_the_timeout_and_not_before() {
        let t0 = Instant::now();
        let mut l = Liveness::new(Duration::from_secs(3));
        l.seen(1, t0);
        l.seen(2, t0);
        assert!(l.expire(t0 + Duration::from_secs(2)).is_empty());
        l.seen(2, t0 + Duration::from_secs(2));
        assert_eq!(l.expire(t0 + Duration::from_millis(3001)), vec![1]);
        assert!(!l.is_live(1) && l.is_live(2));
        assert_eq!(l.expire(t0 + Duration::from_millis(5001)), vec![2]);
        assert!(l.members().is_empty());
    }

    #[test]
    fn a_member_heard_again_rejoins() {
        let t0 = Instant::now();
        let mut l = Liveness::new(Duration::from_secs(1));
        l.seen(7, t0);
        assert_eq!(l.expire(t0 + Duration::from_secs(2)), vec![7]);
        l.seen(7, t0 + Duration::from_secs(3));
        assert!(l.is_live(7));
        assert!(l.remove(7) && !l.remove(7));
    }

    #[test]
    fn static_peers_are_the_flag_list() {
        let mut d = StaticPeers(vec!["10.0.0.1:7070".into(), "10.0.0.2:7070".into()]);
        assert_eq!(d.peers().len(), 2);
    }
}
