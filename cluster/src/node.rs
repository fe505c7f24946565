//! One pool's cluster node: the control listener and the connections to peers, heartbeats
//! and liveness, the catalog of peers' keys fed into the local index, and fetches (pin at
//! the holder over control, NIXL READ into local DRAM, unpin).
//!
//! Connections are one-way subscriptions: pool P connects to each address discovery gives
//! it (`--cluster-peer`); over that connection the peer Q sends its NIXL `Join`, a
//! snapshot of its DRAM keys and then their changes, and serves P's pins. So P reads from
//! Q only if P lists Q; list every other member on each pool (or use a registry).
//!
//! Threads: an acceptor (one thread per accepted subscriber), a connector (one thread per
//! connected peer), a writer per connection (`outbox`) and a ticker (heartbeats, liveness,
//! reconnects). Only a connection's own writer blocks on its socket (with a write
//! timeout); everyone else queues, so a slow or stuck peer is dropped, never waited on.
//!
//! Files: this one (configuration, the public face, shared state), `node/serve.rs` (the
//! server side: subscribers), `node/peers.rs` (the client side: peers, and the ticker),
//! `node/fetch.rs` (a batched fetch), `node/given_up.rs` (timed-out reads until final).
//!
//! The pool's own traffic never enters this module except for a fetch (`node/fetch.rs`),
//! which is bounded by `read_timeout`.

use std::collections::{HashMap, HashSet};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use umbp_protocol::ObjectKey;

use crate::catalog::{Catalog, CatalogCaps, IndexChange, KeyChange, RemoteObject};
use crate::channel::{client_handshake, server_handshake};
use crate::control::{self, read_msg, Msg, Secret, MAX_FRAME};
use crate::export::{ExportArea, ExportError, Slot, DEFAULT_EXPORT_BYTES};
use crate::membership::{Discovery, Liveness};
use crate::outbox::Outbox;
use crate::placement::NodeId;
use crate::transport::{self, Agent, PeerRegion, TransportError};

mod fetch;
mod given_up;
mod peers;
mod serve;

/// What the cluster node needs from the local pool.
pub trait LocalPool: Send + Sync + 'static {
    /// The DRAM-tier keys held now (every tenant group), for a joining subscriber.
    fn snapshot(&self) -> Vec<KeyChange>;
    /// Pins a published DRAM object of `size` bytes, stored under `namespace`, for a
    /// peer's read (a key held under another namespace is a miss); returns its offset in
    /// the pool's DRAM (the mapping given to [`Cluster::start`]) and its namespace. The
    /// node copies it into the export area and unpins it at once (copy-on-pin). `group`: the tenant group the peer found it
    /// in (the same as here: members run the same ACL).
    /// The pin carries the xxh3-128 digest of the object's bytes.
    fn pin(&self, group: u32, namespace: u128, key: ObjectKey, size: u64) -> Result<Pin, String>;
    fn unpin(&self, group: u32, namespace: u128, key: ObjectKey);
    /// Remote keys appeared (first holder) or vanished (last holder gone): mirror them in
    /// the local index. Called without any cluster lock held.
    fn apply_index(&self, changes: &[IndexChange]);
    /// The node forgot the holder `agent` (it left or died, and no read to it was in
    /// flight). This does NOT mean an earlier, timed-out read from it can no longer land
    /// (see pool_tier.rs): never a reason to reuse that read's destination.
    fn holder_forgotten(&self, agent: &str) {
        let _ = agent;
    }
    /// The node gave up waiting for a read (it outlived `read_timeout`) that may still
    /// write the destinations of `items` (namespace, key): quarantine them under `tag`
    /// (unique to this read). Called before the fetch returns and before the read can be
    /// reported final, so [`Self::read_final`] for `tag` always comes after.
    fn read_given_up(&self, tag: &str, items: &[(u128, ObjectKey)]) {
        let _ = (tag, items);
    }
    /// The given-up read `tag` is final (NIXL reports it completed or failed): it writes
    /// nothing more, so its destinations may be reused once their loads are done.
    fn read_final(&self, tag: &str) {
        let _ = tag;
    }
}

#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// `--cluster-listen HOST:PORT`.
    pub listen: String,
    pub secret: Secret,
    /// Heartbeat period; a member silent for `dead_after` is dropped.
    pub heartbeat: Duration,
    pub dead_after: Duration,
    /// Bound on one fetch (pin round trip and read).
    pub read_timeout: Duration,
    /// A closed subscriber's pins are kept `read_timeout + pin_lease_margin` after its
    /// control connection closes (its one-sided READs may still be in flight): the lease,
    /// sent to subscribers in `Join`. A reader takes a READ that completes past the holder's
    /// lease (or its own `read_timeout`, if shorter) as late (not published; docs/cluster.md).
    pub pin_lease_margin: Duration,
    /// Bound on connect, and the total deadline of a handshake (not per read).
    pub connect_timeout: Duration,
    /// Unauthenticated connections (accepted, handshake not done) held at once: overall and
    /// per source address; past either a new connection is closed at once.
    pub max_unauthenticated: usize,
    pub max_unauthenticated_per_source: usize,
    /// File descriptors kept free for the pool's local side (attachments, memfds, its
    /// socket): the cluster port accepts nothing while fewer are left under RLIMIT_NOFILE.
    pub fd_reserve: usize,
    /// Caps per subscriber: objects pinned at once and their bytes; a pin past either is
    /// answered `PinFailed`.
    pub max_pins_per_peer: usize,
    pub max_pinned_bytes_per_peer: u64,
    /// Keys one peer may have in the catalog per tenant group (stream and snapshot);
    /// further keys are dropped (counted, `catalog_over_cap`).
    pub max_catalog_entries_per_group: usize,
    /// Tenant groups of this pool (members run the same ACL); keys a peer advertises in
    /// another group number are dropped.
    pub groups: u32,
    /// [`control::acl_digest`] of this pool's namespace ACL; a peer with another one is
    /// refused. Default: that of a pool without `--namespace-acl`.
    pub acl: [u8; 32],
    /// Bytes of the export area (`--cluster-export-bytes`): the copies of pinned objects
    /// peers read, the only memory registered for them (`export.rs`).
    pub export_bytes: u64,
}

impl ClusterConfig {
    pub fn new(listen: String, secret: Secret) -> Self {
        Self {
            listen,
            secret,
            heartbeat: Duration::from_millis(500),
            dead_after: Duration::from_millis(2000),
            read_timeout: Duration::from_secs(5),
            pin_lease_margin: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(2),
            max_unauthenticated: 64,
            max_unauthenticated_per_source: 16,
            fd_reserve: 256,
            max_pins_per_peer: 4096,
            max_pinned_bytes_per_peer: 4 << 30,
            max_catalog_entries_per_group: 1 << 20,
            groups: 1,
            acl: control::acl_digest(&umbp_pool::groups::TenantGroups::single()),
            export_bytes: DEFAULT_EXPORT_BYTES,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cluster listen address {addr}: {source}")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error(transparent)]
    Export(#[from] ExportError),
}

/// Why a fetch failed; every case means "recompute".
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("key {0:032x} has no live remote holder")]
    NoHolder(u128),
    #[error("peer {0:x} left before the fetch finished")]
    PeerGone(NodeId),
    #[error("peer {peer:x} refused to pin {key:032x}: {reason}")]
    PinRefused { peer: NodeId, key: u128, reason: String },
    #[error("peer {peer:x} did not answer a pin of {key:032x} within {timeout:?}")]
    PinTimeout { peer: NodeId, key: u128, timeout: Duration },
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The read completed past the holder's pin lease: the holder may have reused the
    /// range, so the bytes are not trusted (a miss, never published).
    #[error("peer {peer:x}: the read of {key:032x} completed after {took:?}, past the pin lease ({lease:?}): not published")]
    Late { peer: NodeId, key: u128, took: Duration, lease: Duration },
    /// The bytes read are not those the holder pinned (altered at the holder or on the
    /// way): a miss, never published.
    #[error("peer {peer:x}: {key:032x} read with digest {got:032x}, the pin said {expected:032x}: not published")]
    Digest { peer: NodeId, key: u128, expected: u128, got: u128 },
    /// The read of a batch failed (the transport's error, shared by its items).
    #[error("remote read failed: {0}")]
    Read(String),
}

impl FetchError {
    /// The destination may still be written by the transfer (quarantine it).
    pub fn destination_tainted(&self) -> bool {
        matches!(self, Self::Transport(e) if e.destination_tainted())
    }

    /// The given-up read (`agent#n`: the holder's transport agent name and the read's
    /// number) that may still write the destination, when [`Self::destination_tainted`]:
    /// the node quarantined it under this tag ([`LocalPool::read_given_up`]) and reports
    /// when the read is final ([`LocalPool::read_final`]).
    pub fn tainting_holder(&self) -> Option<&str> {
        match self {
            Self::Transport(TransportError::Timeout { peer, .. }) => Some(peer),
            _ => None,
        }
    }
}

/// A pin: where the object is (from [`LocalPool::pin`]: in the pool's DRAM; in a
/// `Pinned` answer: in the holder's export area), its namespace, and the xxh3-128 digest of
/// its bytes (checked after the read, before publishing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pin {
    pub offset: u64,
    pub namespace: u128,
    pub digest: u128,
}

type PinReply = Result<Pin, String>;

/// Unauthenticated connections held now (the cluster port's caps).
#[derive(Default)]
struct Admission {
    total: usize,
    per_source: HashMap<std::net::IpAddr, usize>,
    warned_at: Option<Instant>,
}

/// Where a pin reply goes: the batch that asked, tagged with its pin id.
struct PinWaiter {
    tx: mpsc::Sender<(u64, PinReply)>,
    id: u64,
}

/// One object of a batched fetch: `size` bytes of `key` into `dest`.
#[derive(Debug, Clone, Copy)]
pub struct FetchRequest {
    pub key: ObjectKey,
    /// The namespace it was stored under (the holder serves only that).
    pub namespace: u128,
    pub size: u64,
    pub dest: *mut u8,
}

struct Peer {
    addr: String,
    writer: Arc<Outbox>,
    region: Option<PeerRegion>,
    /// Its `Join`'s NIXL metadata, loaded again after a deferred forget of the same agent
    /// (`forget_idle_peers`: a stopped holder that came back re-joins under its old name).
    metadata: Option<Vec<u8>>,
    /// Its pin lease (from `Join`; None: it sent none): a READ from it completing later than
    /// this after its batch began is late.
    lease: Option<Duration>,
    pending: HashMap<u64, PinWaiter>,
}

struct Subscriber {
    node: NodeId,
    writer: Arc<Outbox>,
}

#[derive(Default)]
struct State {
    catalog: Catalog,
    peers: HashMap<NodeId, Peer>,
    /// Addresses with a live or connecting connection.
    connecting: HashSet<String>,
    subscribers: Vec<Subscriber>,
}

/// Counters for reports and tests.
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct ClusterStats {
    pub peers: usize,
    pub subscribers: usize,
    pub remote_keys: usize,
    pub fetches: u64,
    pub fetch_failures: u64,
    pub fetched_bytes: u64,
    pub auth_failures: u64,
    /// Connections closed at accept: over the unauthenticated caps or the fd reserve.
    pub refused_connections: u64,
    /// Pins answered `PinFailed` because the subscriber was at its pin caps.
    pub pins_over_cap: u64,
    /// Remote reads whose bytes did not match the holder's digest (published as misses).
    pub digest_mismatches: u64,
    /// Peers' keys left out of the catalog at the per-group cap (or in no group here).
    pub catalog_over_cap: u64,
    /// Remote reads that completed past the pin lease (published as misses).
    pub late_reads: u64,
    /// Pins kept now for closed subscriber connections until their lease ends.
    pub leased_pins: u64,
    /// Pins of closed connections released at once: all leases held a subscriber's caps.
    pub leases_over_cap: u64,
    /// DRAM key changes sent to subscribers (once per subscriber).
    pub published_changes: u64,
    /// Bytes of the export area held now (copies of pinned objects, leases included).
    pub export_bytes_used: u64,
    /// Pins answered `PinFailed` because the export area had no room for the copy.
    pub export_full: u64,
    /// Reads given up (timed out) whose NIXL request is not final yet: their destinations
    /// stay quarantined.
    pub given_up_reads: u64,
    /// Given-up reads that became final since start (their quarantine released).
    pub given_up_final: u64,
    /// Where the fetches' time went, summed over every holder read since start (they
    /// overlap one another, so the sum exceeds the wall time when the pipeline works).
    pub phases: FetchPhases,
}

/// Summed per-phase times of the fetches since start, in nanoseconds.
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct FetchPhases {
    /// From a read's first pin sent to its last pin answered (the holder's copy into its
    /// export area, its queue and the round trip).
    pub pin_ns: u64,
    /// From a read's post to its completion (NIXL READ).
    pub read_ns: u64,
    /// The digest checks of the bytes read.
    pub check_ns: u64,
    /// Holder reads (chunks) settled.
    pub reads: u64,
    /// Time during which at least one READ was in flight (the union over all fetches): the
    /// wall time minus this is where the wire sat idle (pins, copies, checks not overlapped).
    pub read_busy_ns: u64,
}

/// The union of the times READs were in flight (`FetchPhases::read_busy_ns`).
#[derive(Debug, Default)]
struct BusyClock {
    in_flight: usize,
    since: Option<Instant>,
    busy_ns: u64,
}

impl BusyClock {
    fn posted(&mut self) {
        if self.in_flight == 0 {
            self.since = Some(Instant::now());
        }
        self.in_flight += 1;
    }

    fn settled(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
        if self.in_flight == 0 {
            if let Some(t) = self.since.take() {
                self.busy_ns += t.elapsed().as_nanos() as u64;
            }
        }
    }

    fn busy_ns(&self) -> u64 {
        self.busy_ns + self.since.map_or(0, |t| t.elapsed().as_nanos() as u64)
    }
}

/// A subscriber's copy of one pinned object: the export slot its READs address, the pins
/// it holds on it, and the size and digest the copy was made for.
struct Exported {
    slot: Slot,
    pins: u32,
    size: u64,
    digest: u128,
}

/// A closed subscriber's export slots, freed at `until` (a lease: its READs may be in
/// flight), with the pins each carried.
struct Lease {
    until: Instant,
    pins: Vec<(Slot, u32)>,
    /// Objects and bytes it keeps pinned (bounded over all leases, as one subscriber's).
    count: usize,
    bytes: u64,
}

struct Inner {
    cfg: ClusterConfig,
    node: NodeId,
    /// The reader: registers the pool's DRAM as the destination of this node's READs. Its
    /// metadata is never sent, so no peer can address that DRAM.
    agent: Agent,
    /// Registers only the export area; its metadata is what `Join` carries. Declared
    /// before `export`, so it deregisters the area before the area can be unmapped.
    export_agent: Agent,
    export: Arc<ExportArea>,
    /// The pool's DRAM (address, length): where a pin's copy comes from.
    dram: (usize, usize),
    pool: Arc<dyn LocalPool>,
    state: Mutex<State>,
    liveness: Mutex<Liveness>,
    discovery: Mutex<Box<dyn Discovery>>,
    stop: AtomicBool,
    next_pin: AtomicU64,
    fetches: AtomicU64,
    fetch_failures: AtomicU64,
    fetched_bytes: AtomicU64,
    auth_failures: AtomicU64,
    refused_connections: AtomicU64,
    pins_over_cap: AtomicU64,
    digest_mismatches: AtomicU64,
    late_reads: AtomicU64,
    leases_over_cap: AtomicU64,
    published_changes: AtomicU64,
    snapshot_over_cap: AtomicU64,
    /// Closed subscribers' pins until their lease ends (released by the ticker).
    leases: Mutex<Vec<Lease>>,
    admission: Mutex<Admission>,
    local_addr: std::net::SocketAddr,
    reads_in_flight: std::sync::atomic::AtomicUsize,
    forget: Mutex<Vec<String>>,
    /// Reads given up (timed out) until NIXL reports them final (`node/fetch.rs`); the
    /// ticker polls them. Each carries the tag its destinations are quarantined under.
    given_up: Mutex<Vec<(String, transport::GivenUpRead)>>,
    next_read: AtomicU64,
    given_up_final: AtomicU64,
    phase_pin_ns: AtomicU64,
    phase_read_ns: AtomicU64,
    phase_check_ns: AtomicU64,
    phase_reads: AtomicU64,
    read_busy: Mutex<BusyClock>,
}

/// A running cluster node; stops its threads on drop.
pub struct Cluster {
    inner: Arc<Inner>,
}

fn random_u64() -> u64 {
    u64::from_le_bytes(control::nonce()[..8].try_into().expect("8"))
}

impl Cluster {
    /// Starts a node: loads NIXL (a clear error naming `pip install nixl-cu12` when it is
    /// missing), maps the export area, creates the export agent (the area registered, for
    /// peers) and the reader agent (`dram` registered, for this node's fetches), listens.
    ///
    /// # Safety
    /// `dram..dram+dram_len` must stay mapped while the node lives; pins copy objects out
    /// of it (the offsets the pool's pins give) and fetches write into it.
    pub unsafe fn start(
        cfg: ClusterConfig,
        discovery: Box<dyn Discovery>,
        pool: Arc<dyn LocalPool>,
        dram: *mut u8,
        dram_len: usize,
    ) -> Result<Self, ClusterError> {
        transport::load_library()?;
        let listener = TcpListener::bind(&cfg.listen).map_err(|source| ClusterError::Listen { addr: cfg.listen.clone(), source })?;
        let local_addr = listener.local_addr().map_err(|source| ClusterError::Listen { addr: cfg.listen.clone(), source })?;
        let node = random_u64();
        let export = ExportArea::new(cfg.export_bytes)?;
        let mut export_agent = Agent::new(&format!("umbp-{local_addr}-{node:016x}"))?;
        // SAFETY: the area stays mapped while `export` lives, which outlives the agent
        // (`Inner`'s field order); it holds only copies made for peers' pins.
        unsafe { export_agent.register_dram(export.base(), export.len() as usize) }?;
        let mut agent = Agent::new(&format!("umbp-{local_addr}-{node:016x}-reader"))?;
        // SAFETY: forwarded from this function's contract; this agent's metadata never
        // leaves the process, so peers cannot address the region.
        unsafe { agent.register_dram(dram, dram_len) }?;
        let caps = CatalogCaps { per_group: cfg.max_catalog_entries_per_group, groups: cfg.groups };
        let inner = Arc::new(Inner {
            liveness: Mutex::new(Liveness::new(cfg.dead_after)),
            cfg,
            node,
            agent,
            export_agent,
            export,
            dram: (dram as usize, dram_len),
            pool,
            state: Mutex::new(State { catalog: Catalog::with_caps(caps), ..State::default() }),
            discovery: Mutex::new(discovery),
            stop: AtomicBool::new(false),
            next_pin: AtomicU64::new(1),
            fetches: AtomicU64::new(0),
            fetch_failures: AtomicU64::new(0),
            fetched_bytes: AtomicU64::new(0),
            auth_failures: AtomicU64::new(0),
            refused_connections: AtomicU64::new(0),
            pins_over_cap: AtomicU64::new(0),
            digest_mismatches: AtomicU64::new(0),
            late_reads: AtomicU64::new(0),
            leases_over_cap: AtomicU64::new(0),
            published_changes: AtomicU64::new(0),
            snapshot_over_cap: AtomicU64::new(0),
            leases: Mutex::new(Vec::new()),
            admission: Mutex::new(Admission::default()),
            local_addr,
            reads_in_flight: std::sync::atomic::AtomicUsize::new(0),
            forget: Mutex::new(Vec::new()),
            given_up: Mutex::new(Vec::new()),
            next_read: AtomicU64::new(1),
            given_up_final: AtomicU64::new(0),
            phase_pin_ns: AtomicU64::new(0),
            phase_read_ns: AtomicU64::new(0),
            phase_check_ns: AtomicU64::new(0),
            phase_reads: AtomicU64::new(0),
            read_busy: Mutex::new(BusyClock::default()),
        });
        tracing::info!(listen = %local_addr, node = format!("{node:016x}"), "cluster node started");
        let i = inner.clone();
        std::thread::Builder::new().name("cluster-accept".into()).spawn(move || i.accept_loop(listener)).expect("spawn");
        let i = inner.clone();
        std::thread::Builder::new().name("cluster-tick".into()).spawn(move || i.tick_loop()).expect("spawn");
        Ok(Self { inner })
    }

    pub fn node_id(&self) -> NodeId {
        self.inner.node
    }

    pub fn local_addr(&self) -> std::net::SocketAddr {
        self.inner.local_addr
    }

    /// The reader agent (the pool's DRAM registered; its metadata never sent).
    pub fn agent(&self) -> &Agent {
        &self.inner.agent
    }

    /// The export agent (only the export area registered; its metadata is in `Join`).
    pub fn export_agent(&self) -> &Agent {
        &self.inner.export_agent
    }

    /// The export area (its base, size and use).
    pub fn export_area(&self) -> &ExportArea {
        &self.inner.export
    }

    pub fn stats(&self) -> ClusterStats {
        let st = self.inner.state.lock().expect("state");
        ClusterStats {
            peers: st.peers.values().filter(|p| p.region.is_some()).count(),
            subscribers: st.subscribers.len(),
            remote_keys: st.catalog.len(),
            fetches: self.inner.fetches.load(Ordering::Relaxed),
            fetch_failures: self.inner.fetch_failures.load(Ordering::Relaxed),
            fetched_bytes: self.inner.fetched_bytes.load(Ordering::Relaxed),
            auth_failures: self.inner.auth_failures.load(Ordering::Relaxed),
            refused_connections: self.inner.refused_connections.load(Ordering::Relaxed),
            pins_over_cap: self.inner.pins_over_cap.load(Ordering::Relaxed),
            digest_mismatches: self.inner.digest_mismatches.load(Ordering::Relaxed),
            catalog_over_cap: st.catalog.over_cap() + self.inner.snapshot_over_cap.load(Ordering::Relaxed),
            late_reads: self.inner.late_reads.load(Ordering::Relaxed),
            leases_over_cap: self.inner.leases_over_cap.load(Ordering::Relaxed),
            leased_pins: self.inner.leases.lock().expect("leases").iter().flat_map(|l| &l.pins).map(|p| u64::from(p.1)).sum(),
            published_changes: self.inner.published_changes.load(Ordering::Relaxed),
            export_bytes_used: self.inner.export.used(),
            export_full: self.inner.export.full_count(),
            given_up_reads: self.inner.given_up.lock().expect("given up").len() as u64,
            given_up_final: self.inner.given_up_final.load(Ordering::Relaxed),
            phases: FetchPhases {
                pin_ns: self.inner.phase_pin_ns.load(Ordering::Relaxed),
                read_ns: self.inner.phase_read_ns.load(Ordering::Relaxed),
                check_ns: self.inner.phase_check_ns.load(Ordering::Relaxed),
                reads: self.inner.phase_reads.load(Ordering::Relaxed),
                read_busy_ns: self.inner.read_busy.lock().expect("read busy").busy_ns(),
            },
        }
    }

    /// The export area of each joined peer (what this node's reads address).
    pub fn peer_regions(&self) -> Vec<(NodeId, PeerRegion)> {
        let st = self.inner.state.lock().expect("state");
        st.peers.iter().filter_map(|(n, p)| p.region.clone().map(|r| (*n, r))).collect()
    }

    /// Whether some live peer advertises `key`.
    pub fn holds_remote(&self, group: u32, key: ObjectKey) -> bool {
        self.inner.state.lock().expect("state").catalog.source((group, key)).is_some()
    }

    /// The connected peers that advertise `key` (placement picks among them).
    pub fn holders(&self, group: u32, key: ObjectKey) -> Vec<NodeId> {
        self.inner.state.lock().expect("state").catalog.holders((group, key)).to_vec()
    }

    /// `key` as the catalog knows it, while some connected peer advertises it.
    pub fn remote_object(&self, group: u32, key: ObjectKey) -> Option<RemoteObject> {
        self.inner.state.lock().expect("state").catalog.object((group, key))
    }

    /// Closes every subscriber connection; they re-connect and get a fresh snapshot (after
    /// the change stream lost events).
    pub fn resync_subscribers(&self) {
        let st = self.inner.state.lock().expect("state");
        for s in &st.subscribers {
            s.writer.close();
        }
    }

    /// Sends local key changes to every subscriber (the pool's change stream). Only
    /// DRAM-tier changes are sent: peers read DRAM objects only and drop the rest (issue
    /// #35 C2), so the others would be (N-1)x wasted control traffic.
    pub fn publish(&self, changes: &[KeyChange]) {
        let dram: Vec<KeyChange>;
        let changes = if changes.iter().all(|c| c.tier == umbp_protocol::Tier::Dram as u8) {
            changes
        } else {
            dram = changes.iter().filter(|c| c.tier == umbp_protocol::Tier::Dram as u8).copied().collect();
            &dram
        };
        if changes.is_empty() {
            return;
        }
        let subs: Vec<Arc<Outbox>> = self.inner.state.lock().expect("state").subscribers.iter().map(|s| s.writer.clone()).collect();
        // Relaxed: a counter for reports; it orders nothing.
        self.inner.published_changes.fetch_add((changes.len() * subs.len()) as u64, Ordering::Relaxed);
        for chunk in changes.chunks(4096) {
            let m = Msg::Keys { changes: chunk.to_vec(), snapshot: false, more: false };
            for w in &subs {
                // Queued, never waited on: a subscriber that falls too far behind is
                // closed (it re-joins with a snapshot).
                w.send(&m);
            }
        }
    }

    /// Pulls `key` (`size` bytes) from a peer that holds it into `dest`; returns the
    /// object's namespace. Bounded by `read_timeout`.
    ///
    /// # Safety
    /// `dest..dest+size` must lie in the pool's DRAM (the reader agent's region) and be
    /// reserved for this fetch;
    /// on an error for which [`FetchError::destination_tainted`] is true it must never be
    /// reused (quarantine it).
    pub unsafe fn fetch(&self, group: u32, namespace: u128, key: ObjectKey, size: u64, dest: *mut u8) -> Result<u128, FetchError> {
        // SAFETY: forwarded.
        unsafe { self.fetch_batch(group, &[FetchRequest { key, namespace, size, dest }]) }.pop().expect("one result")
    }

    /// [`Self::fetch`] of many objects at once: every pin in flight together, one NIXL
    /// request per holder. Per-item results, in order.
    ///
    /// # Safety
    /// As for [`Self::fetch`], for every item's `dest..dest+size`.
    pub unsafe fn fetch_batch(&self, group: u32, items: &[FetchRequest]) -> Vec<Result<u128, FetchError>> {
        self.inner.fetches.fetch_add(items.len() as u64, Ordering::Relaxed);
        // SAFETY: forwarded.
        let r = unsafe { self.inner.fetch_batch(group, items) };
        for (it, r) in items.iter().zip(&r) {
            match r {
                Ok(_) => {
                    self.inner.fetched_bytes.fetch_add(it.size, Ordering::Relaxed);
                }
                Err(e) => {
                    self.inner.fetch_failures.fetch_add(1, Ordering::Relaxed);
                    // A holder that just left is routine (its keys are being dropped): debug.
                    if matches!(e, FetchError::NoHolder(_) | FetchError::PeerGone(_)) {
                        tracing::debug!(key = format!("{:032x}", it.key.0), "remote fetch failed: {e}");
                    } else {
                        tracing::warn!(key = format!("{:032x}", it.key.0), "remote fetch failed: {e}");
                    }
                }
            }
        }
        r
    }
}

impl Cluster {
    /// [`Self::fetch_batch`] of several stages (a load's batches, in order), pipelined:
    /// up to `ahead` stages after the current one are fetched at the same time, each on
    /// its own thread, so the holder copies stage k+1 into its export area and the reader
    /// checks stage k-1's digests while stage k is READ (the pool overlaps a load's stages
    /// the same way through its promotion look-ahead). Each stage is a whole
    /// [`Self::fetch_batch`]: its own budget, pins, digests and quarantine; nothing is
    /// shared between stages but the connection. `ahead` = 0 runs them one after another.
    /// Per-stage, per-item results, in order.
    ///
    /// # Safety
    /// As for [`Self::fetch`], for every item of every stage.
    pub unsafe fn fetch_stages(&self, group: u32, stages: &[&[FetchRequest]], ahead: usize) -> Vec<Vec<Result<u128, FetchError>>> {
        /// A stage's requests, to move to its thread.
        struct Stage<'a>(&'a [FetchRequest]);
        // SAFETY: the raw destinations are reserved for this fetch by the caller
        // (`fetch_stages`' contract); only the thread the stage moves to writes them.
        unsafe impl Send for Stage<'_> {}
        let mut out: Vec<Vec<Result<u128, FetchError>>> = Vec::with_capacity(stages.len());
        std::thread::scope(|sc| {
            let mut running = std::collections::VecDeque::new();
            for &stage in stages {
                if running.len() > ahead {
                    let h: std::thread::ScopedJoinHandle<'_, _> = running.pop_front().expect("running");
                    out.push(h.join().expect("a fetch does not panic"));
                }
                let st = Stage(stage);
                running.push_back(sc.spawn(move || {
                    let st = st;
                    // SAFETY: forwarded from this function's contract.
                    unsafe { self.fetch_batch(group, st.0) }
                }));
            }
            for h in running {
                out.push(h.join().expect("a fetch does not panic"));
            }
        });
        out
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Release);
        // Wake the acceptor and close every connection so their threads end.
        let _ = TcpStream::connect_timeout(&self.inner.local_addr, Duration::from_millis(200));
        let st = self.inner.state.lock().expect("state");
        for p in st.peers.values() {
            p.writer.close();
        }
        for s in &st.subscribers {
            s.writer.close();
        }
    }
}

impl Inner {
    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    fn set_timeouts(&self, s: &TcpStream) {
        let _ = s.set_nodelay(true);
        let _ = s.set_write_timeout(Some(self.cfg.dead_after));
    }
}
