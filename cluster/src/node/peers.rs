//! The client side of a cluster node: a connection to each peer (its `Join`, catalog and
//! pin answers), dropping and forgetting peers, and the ticker (heartbeats, liveness,
//! reconnects).

use super::*;

impl Inner {
    pub(super) fn connect(self: Arc<Self>, addr: String) {
        let r = self.clone().run_peer(&addr);
        if let Err(e) = r {
            tracing::debug!(peer = %addr, "cluster peer connection: {e}");
        }
        self.state.lock().expect("state").connecting.remove(&addr);
    }

    fn run_peer(self: Arc<Self>, addr: &str) -> Result<(), String> {
        let sa = addr.to_socket_addrs().map_err(|e| e.to_string())?.next().ok_or("no address")?;
        let s = TcpStream::connect_timeout(&sa, self.cfg.connect_timeout).map_err(|e| e.to_string())?;
        let est = match client_handshake(&s, &self.cfg.secret, self.node, &self.cfg.acl, self.cfg.connect_timeout) {
            Ok(n) => n,
            Err(e) => {
                if matches!(e, control::ControlError::Auth(_)) {
                    self.auth_failures.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(peer = %addr, "cluster peer refused: {e}");
                }
                if matches!(e, control::ControlError::AclMismatch { .. }) {
                    tracing::error!(peer = %addr, "cluster peer refused: {e}");
                }
                return Err(e.to_string());
            }
        };
        let server = est.peer;
        if server == self.node {
            return Ok(());
        }
        self.set_timeouts(&s);
        let mut rx = est.opener;
        let writer = Outbox::new(&s, est.sealer, "cluster-peer-tx").map_err(|e| e.to_string())?;
        self.state.lock().expect("state").peers.insert(
            server,
            Peer { addr: addr.to_string(), writer: writer.clone(), region: None, metadata: None, lease: None, pending: HashMap::new() },
        );
        self.liveness.lock().expect("liveness").seen(server, Instant::now());
        tracing::info!(peer = %addr, node = format!("{server:016x}"), "cluster peer connected");
        let mut snapshot: Option<Vec<RemoteObject>> = None;
        let mut snap_counts: HashMap<u32, usize> = HashMap::new();
        let r = loop {
            let m = match read_msg(&mut rx, MAX_FRAME) {
                Ok(m) => m,
                Err(e) => break Err(e.to_string()),
            };
            self.liveness.lock().expect("liveness").seen(server, Instant::now());
            match m {
                Msg::Heartbeat => {}
                Msg::Join { agent, metadata, base, len, lease_ms } => {
                    // A holder re-joining while a read given up from it is pending is the
                    // same process (agent names carry a random node id): its metadata is
                    // still loaded (its forget waits for that read), and loading it again
                    // would re-register the agent, after which NIXL answers the pending
                    // read's status with an error forever (node/given_up.rs).
                    let keep = self.given_up_agents().contains(&agent) && self.agent.has_peer(&agent);
                    let loaded = match if keep { Ok(agent.clone()) } else { self.agent.load_peer(&metadata) } {
                        Ok(name) if name == agent => name,
                        Ok(name) => break Err(format!("metadata names agent {name}, Join said {agent}")),
                        Err(e) => break Err(e.to_string()),
                    };
                    if let Some(p) = self.state.lock().expect("state").peers.get_mut(&server) {
                        p.region = Some(PeerRegion { agent: loaded, base, len });
                        p.metadata = Some(metadata);
                        p.lease = (lease_ms > 0).then(|| Duration::from_millis(lease_ms));
                    }
                }
                Msg::Keys { changes, snapshot: first, more } => {
                    let mut out = Vec::new();
                    if first || snapshot.is_some() {
                        if first {
                            snap_counts.clear();
                        }
                        let snap = snapshot.get_or_insert_with(Vec::new);
                        // Bounded while it accumulates: per group, as the catalog is.
                        for c in changes.iter().filter(|c| c.stored && c.tier == 0) {
                            let n = snap_counts.entry(c.group).or_default();
                            if c.group >= self.cfg.groups || *n >= self.cfg.max_catalog_entries_per_group {
                                // Relaxed: a counter for reports; it orders nothing.
                                self.snapshot_over_cap.fetch_add(1, Ordering::Relaxed);
                                continue;
                            }
                            *n += 1;
                            snap.push(RemoteObject { group: c.group, key: ObjectKey(c.key), size: c.size, namespace: c.namespace });
                        }
                        if !more {
                            let keys = snapshot.take().unwrap_or_default();
                            self.state.lock().expect("state").catalog.replace_peer(server, keys, &mut out);
                        }
                    } else {
                        let mut st = self.state.lock().expect("state");
                        for c in changes {
                            st.catalog.apply(server, c, &mut out);
                        }
                    }
                    if !out.is_empty() {
                        self.pool.apply_index(&out);
                    }
                }
                Msg::Pinned { id, group, key, offset, namespace, digest } => {
                    self.answer_pin(server, id, group, key, Ok(Pin { offset, namespace, digest }))
                }
                Msg::PinFailed { id, reason } => self.answer_pin(server, id, 0, 0, Err(reason)),
                other => tracing::debug!("ignored from peer: {other:?}"),
            }
        };
        self.drop_peer(server, &writer);
        tracing::warn!(peer = %addr, node = format!("{server:016x}"), "cluster peer left");
        r
    }

    fn answer_pin(&self, server: NodeId, id: u64, group: u32, key: u128, r: PinReply) {
        let (w, writer) = {
            let mut st = self.state.lock().expect("state");
            let p = st.peers.get_mut(&server);
            let writer = p.as_ref().map(|p| p.writer.clone());
            (p.and_then(|p| p.pending.remove(&id)), writer)
        };
        match w {
            Some(w) => {
                let _ = w.tx.send((w.id, r));
            }
            // Nobody waits any more (timed out): give the pin back at once.
            None => {
                if let (Ok(p), Some(writer)) = (r, writer) {
                    writer.send(&Msg::Unpin { group, namespace: p.namespace, key });
                }
            }
        }
    }

    /// A peer is gone (closed, silent past `dead_after`, or stopping): its keys leave the
    /// index, its pending pins fail now, its NIXL metadata is dropped.
    pub(super) fn drop_peer(&self, node: NodeId, writer: &Arc<Outbox>) {
        writer.close();
        let mut out = Vec::new();
        let region = {
            let mut st = self.state.lock().expect("state");
            match st.peers.get(&node) {
                Some(p) if Arc::ptr_eq(&p.writer, writer) => {}
                _ => return,
            }
            let p = st.peers.remove(&node).expect("present");
            st.catalog.drop_peer(node, &mut out);
            p.region // dropping p.pending wakes every waiting fetch with "gone"
        };
        self.liveness.lock().expect("liveness").remove(node);
        if !out.is_empty() {
            self.pool.apply_index(&out);
        }
        if let Some(r) = region {
            // Forgotten once no read is in flight (a read to it then fails on its own).
            self.forget.lock().expect("forget").push(r.agent);
        }
    }

    pub(super) fn forget_idle_peers(&self) {
        if self.reads_in_flight.load(Ordering::Acquire) > 0 {
            return;
        }
        // Not a holder with a given-up read still pending: NIXL answers the status of a
        // request whose remote agent was invalidated with an error that says nothing of
        // the transfer ("invalidated or re-registered during transfer"), so that read
        // could never be seen final and its DRAM never reclaimed (node/given_up.rs). Its
        // forget waits until the read is final.
        let pending = self.given_up_agents();
        let names: Vec<String> = {
            let mut f = self.forget.lock().expect("forget");
            let (later, now): (Vec<String>, Vec<String>) = std::mem::take(&mut *f).into_iter().partition(|n| pending.contains(n));
            *f = later;
            now
        };
        for n in names {
            self.agent.forget_peer(&n);
            self.pool.holder_forgotten(&n);
            // The same process may have re-joined meanwhile (stopped past the heartbeat
            // bound, then resumed; or dropped after a read outlived its budget): its
            // endpoint was just closed with the old one, so load its metadata again, or
            // every read from it would fail as from an unknown peer until it left again.
            // A read posted in between fails (a miss), never reads through the old endpoint.
            let again: Vec<Vec<u8>> = {
                let st = self.state.lock().expect("state");
                st.peers.values().filter(|p| p.region.as_ref().is_some_and(|r| r.agent == n)).filter_map(|p| p.metadata.clone()).collect()
            };
            for md in again {
                match self.agent.load_peer(&md) {
                    Ok(_) => tracing::info!(agent = %n, "re-joined cluster peer's NIXL metadata loaded again after its forget"),
                    Err(e) => tracing::warn!(agent = %n, "re-joined cluster peer: loading its NIXL metadata again failed: {e}"),
                }
            }
        }
    }

    // ---- ticker ----

    pub(super) fn tick_loop(self: Arc<Self>) {
        let mut last_connect = Instant::now() - Duration::from_secs(3600);
        while !self.stopped() {
            let now = Instant::now();
            // Heartbeats to everyone we talk to, peers and subscribers.
            let writers: Vec<Arc<Outbox>> = {
                let st = self.state.lock().expect("state");
                st.peers.values().map(|p| p.writer.clone()).chain(st.subscribers.iter().map(|s| s.writer.clone())).collect()
            };
            for w in writers {
                w.send(&Msg::Heartbeat);
            }
            // Members silent too long: close their connections; the reader threads clean up.
            let dead = self.liveness.lock().expect("liveness").expire(now);
            if !dead.is_empty() {
                let st = self.state.lock().expect("state");
                for n in dead {
                    tracing::warn!(node = format!("{n:016x}"), "cluster member silent past the heartbeat bound: dropped");
                    if let Some(p) = st.peers.get(&n) {
                        p.writer.close();
                    }
                    for s in st.subscribers.iter().filter(|s| s.node == n) {
                        s.writer.close();
                    }
                }
            }
            // (Re)connect to discovered peers we are not connected to.
            if now.duration_since(last_connect) >= self.cfg.heartbeat.max(Duration::from_millis(200)) {
                last_connect = now;
                let addrs = self.discovery.lock().expect("discovery").peers();
                let mut st = self.state.lock().expect("state");
                let connected: HashSet<String> = st.peers.values().map(|p| p.addr.clone()).collect();
                // A member that left discovery (its etcd lease ended) is dropped now, not at
                // dead-after; a static list never shrinks, so this is etcd's leave.
                let wanted: HashSet<&String> = addrs.iter().collect();
                for p in st.peers.values().filter(|p| !wanted.contains(&p.addr)) {
                    tracing::info!(addr = %p.addr, "cluster member left discovery: dropped");
                    p.writer.close();
                }
                for a in addrs {
                    if connected.contains(&a) || !st.connecting.insert(a.clone()) {
                        continue;
                    }
                    let me = self.clone();
                    let _ = std::thread::Builder::new().name("cluster-peer".into()).spawn(move || me.connect(a));
                }
            }
            self.forget_idle_peers();
            self.reap_given_up();
            self.release_leases(Some(now));
            std::thread::sleep(self.cfg.heartbeat.min(Duration::from_millis(100)).max(Duration::from_millis(10)));
        }
        // Stopping: the pool goes too; give the leased pins back.
        self.release_leases(None);
    }
}
