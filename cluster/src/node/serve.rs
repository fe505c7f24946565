//! The server side of a cluster node: the listener, each subscriber's connection (its
//! handshake under the unauthenticated-connection caps, its `Join`, snapshot and changes),
//! the pins it asks for (copied into the export area) and their leases.

use super::*;

/// One unauthenticated connection's slot; given back on drop (handshake done or failed).
struct UnauthPermit {
    inner: Arc<Inner>,
    ip: std::net::IpAddr,
}

impl Drop for UnauthPermit {
    fn drop(&mut self) {
        let mut a = self.inner.admission.lock().expect("admission");
        a.total -= 1;
        if let Some(n) = a.per_source.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                a.per_source.remove(&self.ip);
            }
        }
    }
}

/// File descriptors left under this process's RLIMIT_NOFILE (None when unknown).
fn fds_left() -> Option<usize> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct it is given, a valid local.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 || lim.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    let open = std::fs::read_dir("/proc/self/fd").ok()?.count();
    Some((lim.rlim_cur as usize).saturating_sub(open))
}

impl Inner {
    pub(super) fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        loop {
            let conn = listener.accept();
            if self.stopped() {
                return;
            }
            let (s, from) = match conn {
                Ok(c) => c,
                Err(e) => {
                    // Out of fds (EMFILE) or the like: do not spin on it.
                    tracing::warn!("cluster accept: {e}");
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
            };
            let Some(permit) = self.admit(from.ip()) else {
                // Relaxed: a counter for reports; it orders nothing.
                self.refused_connections.fetch_add(1, Ordering::Relaxed);
                drop(s);
                continue;
            };
            let me = self.clone();
            let _ = std::thread::Builder::new().name("cluster-sub".into()).spawn(move || me.serve(s, permit));
        }
    }

    /// A slot for one unauthenticated connection from `ip`, or None (close it): over the
    /// caps, or fewer than `fd_reserve` descriptors left for the local side.
    fn admit(self: &Arc<Self>, ip: std::net::IpAddr) -> Option<UnauthPermit> {
        let mut a = self.admission.lock().expect("admission");
        let from_ip = a.per_source.get(&ip).copied().unwrap_or(0);
        if a.total >= self.cfg.max_unauthenticated || from_ip >= self.cfg.max_unauthenticated_per_source {
            if a.warned_at.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                a.warned_at = Some(Instant::now());
                tracing::warn!(
                    source = %ip, from_source = from_ip, total = a.total,
                    "cluster port: unauthenticated connections at their cap; new ones are closed at once"
                );
            }
            return None;
        }
        if fds_left().is_some_and(|left| left < self.cfg.fd_reserve) {
            if a.warned_at.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                a.warned_at = Some(Instant::now());
                tracing::warn!(
                    reserve = self.cfg.fd_reserve,
                    "cluster port: file descriptors near RLIMIT_NOFILE; refusing cluster connections to keep the local side's reserve"
                );
            }
            return None;
        }
        a.total += 1;
        *a.per_source.entry(ip).or_default() += 1;
        Some(UnauthPermit { inner: self.clone(), ip })
    }

    fn serve(self: Arc<Self>, s: TcpStream, permit: UnauthPermit) {
        let peer_addr = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        let est = server_handshake(&s, &self.cfg.secret, self.node, &self.cfg.acl, self.cfg.connect_timeout);
        drop(permit);
        let est = match est {
            Ok(c) => c,
            Err(e) => {
                if matches!(e, control::ControlError::Auth(_)) {
                    self.auth_failures.fetch_add(1, Ordering::Relaxed);
                }
                if matches!(e, control::ControlError::AclMismatch { .. }) {
                    tracing::error!(peer = %peer_addr, "cluster connection refused: {e}");
                } else {
                    tracing::warn!(peer = %peer_addr, "cluster connection refused: {e}");
                }
                return;
            }
        };
        let client = est.peer;
        let mut rx = est.opener;
        if client == self.node {
            return; // our own address in --cluster-peer
        }
        self.set_timeouts(&s);
        let writer = match Outbox::new(&s, est.sealer, "cluster-sub-tx") {
            Ok(w) => w,
            Err(e) => {
                tracing::error!(peer = %peer_addr, "cluster connection writer: {e}");
                return;
            }
        };
        let region = self.export_agent.local_region().expect("registered at start");
        let md = match self.export_agent.metadata() {
            Ok(m) => m,
            Err(e) => {
                tracing::error!("NIXL metadata: {e}");
                return;
            }
        };
        {
            // Register first, then snapshot holding the outbox's order: a change published
            // meanwhile is either in the snapshot or queued after it (docs/cluster.md).
            let mut w = writer.batch();
            self.state.lock().expect("state").subscribers.push(Subscriber { node: client, writer: writer.clone() });
            let lease_ms = (self.cfg.read_timeout + self.cfg.pin_lease_margin).as_millis() as u64;
            let join = Msg::Join { agent: region.agent, metadata: md, base: region.base, len: region.len, lease_ms };
            let snap = self.pool.snapshot();
            let mut ok = w.push_unbounded(&join);
            let mut chunks = snap.chunks(65536).peekable();
            if chunks.peek().is_none() {
                ok &= w.push_unbounded(&Msg::Keys { changes: vec![], snapshot: true, more: false });
            }
            let mut first = true;
            while let Some(c) = chunks.next() {
                let more = chunks.peek().is_some();
                ok &= w.push_unbounded(&Msg::Keys { changes: c.to_vec(), snapshot: first, more });
                first = false;
            }
            if !ok {
                drop(w);
                self.drop_subscriber(client, &writer);
                return;
            }
        }
        tracing::info!(peer = %peer_addr, node = format!("{client:016x}"), "cluster subscriber joined");
        // This subscriber's copies in the export area, by (group, namespace, key).
        let mut pins: HashMap<(u32, u128, u128), Exported> = HashMap::new();
        // Pinned objects and bytes of this subscriber (its caps).
        let (mut pinned_n, mut pinned_bytes) = (0usize, 0u64);
        loop {
            let m = match read_msg(&mut rx, MAX_FRAME) {
                Ok(m) => m,
                Err(e) => {
                    if !matches!(&e, control::ControlError::Io(io) if io.kind() == std::io::ErrorKind::UnexpectedEof) {
                        tracing::warn!(peer = %peer_addr, "cluster subscriber connection closed: {e}");
                    }
                    break;
                }
            };
            self.liveness.lock().expect("liveness").seen(client, Instant::now());
            match m {
                Msg::Heartbeat => {}
                Msg::Pin { id, group, namespace, key, size } => {
                    let reply = if pinned_n >= self.cfg.max_pins_per_peer
                        || pinned_bytes.saturating_add(size) > self.cfg.max_pinned_bytes_per_peer
                    {
                        // Relaxed: a counter for reports; it orders nothing.
                        self.pins_over_cap.fetch_add(1, Ordering::Relaxed);
                        let reason = format!(
                            "pin cap: this peer holds {pinned_n} pins of {pinned_bytes} bytes (caps {} pins, {} bytes)",
                            self.cfg.max_pins_per_peer, self.cfg.max_pinned_bytes_per_peer
                        );
                        Msg::PinFailed { id, reason }
                    } else {
                        match self.export_pin(group, namespace, key, size, &mut pins) {
                            Ok(p) => {
                                pinned_n += 1;
                                pinned_bytes += size;
                                Msg::Pinned { id, group, key, offset: p.offset, namespace: p.namespace, digest: p.digest }
                            }
                            Err(reason) => Msg::PinFailed { id, reason },
                        }
                    };
                    if !writer.send(&reply) {
                        break;
                    }
                }
                Msg::Unpin { group, namespace, key } => {
                    if let Some(e) = pins.get_mut(&(group, namespace, key)) {
                        e.pins -= 1;
                        pinned_n -= 1;
                        pinned_bytes -= e.size;
                        if e.pins == 0 {
                            // Its slot goes back to the export area.
                            pins.remove(&(group, namespace, key));
                        }
                    }
                }
                other => tracing::debug!("ignored from subscriber: {other:?}"),
            }
        }
        // The subscriber is gone, but a one-sided READ of what it pinned may still be in
        // flight on the data path (a control connection can close while RDMA is fine): its
        // export slots are kept for the reader's whole budget and a margin (a lease), so no
        // slot it may still read is reused meanwhile; the ticker frees them (issue #35 C1).
        // All leases together are bounded by one subscriber's pin caps, so a member that
        // reconnects in a loop cannot hold the export area through them; past the bound a
        // closed connection's slots are freed at once (the reader's digest check still
        // catches a reused slot) and counted.
        if !pins.is_empty() {
            let until = Instant::now() + self.cfg.read_timeout + self.cfg.pin_lease_margin;
            let lease = Lease { until, pins: pins.into_values().map(|e| (e.slot, e.pins)).collect(), count: pinned_n, bytes: pinned_bytes };
            let mut l = self.leases.lock().expect("leases");
            let (n, b) = l.iter().fold((0usize, 0u64), |(n, b), x| (n + x.count, b + x.bytes));
            if n + lease.count > self.cfg.max_pins_per_peer || b + lease.bytes > self.cfg.max_pinned_bytes_per_peer {
                drop(l);
                // Relaxed: a counter for reports; it orders nothing.
                self.leases_over_cap.fetch_add(lease.count as u64, Ordering::Relaxed);
                tracing::warn!(peer = %peer_addr, pins = lease.count, "closed subscriber's pins released at once: the leases hold a subscriber's pin caps already");
            } else {
                tracing::debug!(peer = %peer_addr, pins = pinned_n, "subscriber closed with pins held: kept until their lease ends");
                l.push(lease);
            }
        }
        self.drop_subscriber(client, &writer);
        tracing::info!(peer = %peer_addr, "cluster subscriber left");
    }

    /// Copy-on-pin: pins the object in the pool just long enough to copy it into an export
    /// slot of this subscriber's (`pins`), then unpins it; the peer reads the copy. A
    /// second pin of an object the subscriber holds a copy of shares that copy.
    fn export_pin(
        &self,
        group: u32,
        namespace: u128,
        key: u128,
        size: u64,
        pins: &mut HashMap<(u32, u128, u128), Exported>,
    ) -> Result<Pin, String> {
        let p = self.pool.pin(group, namespace, ObjectKey(key), size)?;
        let k = (group, p.namespace, key);
        let copied = match pins.get_mut(&k) {
            Some(e) if e.digest == p.digest && e.size == size => {
                e.pins += 1;
                Ok(e.slot.offset())
            }
            Some(_) => Err(format!("key {key:032x} changed while this peer holds a copy of it")),
            None => self.copy_out(p.offset, size).map(|slot| {
                let at = slot.offset();
                pins.insert(k, Exported { slot, pins: 1, size, digest: p.digest });
                at
            }),
        };
        self.pool.unpin(group, p.namespace, ObjectKey(key));
        copied.map(|offset| Pin { offset, ..p })
    }

    /// A fresh export slot holding `size` bytes of the pool's DRAM at `offset`. The caller
    /// holds the object's pin, so the bytes do not change while they are copied.
    fn copy_out(&self, offset: u64, size: u64) -> Result<Slot, String> {
        let (dram, dram_len) = self.dram;
        if offset.checked_add(size).is_none_or(|end| end > dram_len as u64) {
            return Err(format!("the pool pinned {size} bytes at {offset}, outside its {dram_len}-byte DRAM"));
        }
        let Some(mut slot) = self.export.alloc(size) else {
            return Err(format!(
                "export area full: {} of {} bytes hold copies for peers' pins (--cluster-export-bytes)",
                self.export.used(),
                self.export.len()
            ));
        };
        // SAFETY: the range lies in the pool's DRAM (checked above), which stays mapped
        // while the node lives (`Cluster::start`); it is a published object the caller
        // holds pinned, so nothing writes it during the copy.
        unsafe { slot.copy_in(0, (dram as *const u8).add(offset as usize), size) };
        Ok(slot)
    }

    /// Frees the export slots of leases ended by `now` (all of them when `now` is None).
    pub(super) fn release_leases(&self, now: Option<Instant>) {
        let ended: Vec<Lease> = {
            let mut l = self.leases.lock().expect("leases");
            let (ended, kept) = std::mem::take(&mut *l).into_iter().partition(|x| now.is_none_or(|n| x.until <= n));
            *l = kept;
            ended
        };
        // Dropping a lease frees its slots.
        drop(ended);
    }

    pub(super) fn drop_subscriber(&self, node: NodeId, writer: &Arc<Outbox>) {
        writer.close();
        let mut st = self.state.lock().expect("state");
        st.subscribers.retain(|s| !(s.node == node && Arc::ptr_eq(&s.writer, writer)));
    }
}
