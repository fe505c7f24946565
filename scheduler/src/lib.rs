//! What an engine's scheduler links (docs/protocol.md §2 "Shared index"): prefix lookups in the pool's index, read
//! straight from a read-only shared mapping (no RPC), and best-effort touch hints so that a
//! hit is still there when a worker loads it.
//!
//! Lookups never block and never fail: while no pool is attached (absent, dead, restarting)
//! every key is a miss, which costs a recompute, never a wrong token. A dead pool's mapping
//! stays readable but nobody holds the objects it names, so every lookup checks liveness
//! (docs/protocol.md, "Pool liveness"): the index header's `closed` word, which a pool sets
//! first thing when it shuts down, and its death word, which the kernel marks when the
//! pool dies however it dies (a robust futex), both plain loads; and, as the fallback for
//! a pool without a death word, at most once per [`LIVENESS_INTERVAL`] a zero-timeout poll
//! of the pool's end of the socket. Once the client noticed, it drops the mapping and never
//! reads it again.
//!
//! ```no_run
//! # use umbp_scheduler::*;
//! let mut idx = IndexClient::lazy(std::path::Path::new("/tmp/umbp/pool.sock"), 0x1234);
//! let hits = idx.match_prefix(&[ObjectKey(1), ObjectKey(2)]);
//! ```

mod events;

use std::io;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use umbp_ipc::message::peer_gone;
use umbp_ipc::SharedMemory;
use umbp_protocol::attachment::{AttachmentLayout, Hint};
use umbp_protocol::index::{IndexView, MIN_STALL_TIMEOUT_MS, TABLES_OFFSET};
use umbp_protocol::ring::{Producer, Ring};
use umbp_protocol::wire::{Hello, Role};
use umbp_protocol::ProtocolError;

pub use events::EventKind;
pub use umbp_ipc::backoff::{BACKOFF_MAX, BACKOFF_MIN};
pub use umbp_protocol::index::IndexSnapshot;
pub use umbp_protocol::ObjectKey;

use umbp_ipc::backoff::Backoff;
use umbp_ipc::dial::{Attached, Dial, DialError};

#[derive(Debug, thiserror::Error)]
pub enum SchedulerError {
    /// No pool answered at the endpoint within the timeout.
    #[error("UMBP pool not reachable at {}: {source} (is umbp-pool running there? see --socket / UMBP_STANDALONE_ADDRESS)", path.display())]
    Unreachable { path: PathBuf, source: io::Error },
    /// The pool answered with a refusal (version, permissions).
    #[error("refused by the UMBP pool at {}: {message}", path.display())]
    Refused { path: PathBuf, message: String },
    #[error("I/O error attaching to the UMBP pool: {0}")]
    Io(#[from] io::Error),
    #[error("UMBP protocol error: {0}")]
    Protocol(#[from] ProtocolError),
    /// The endpoint is not a socket path or `unix://` address.
    #[error("{0}")]
    Endpoint(#[from] umbp_ipc::endpoint::EndpointError),
}

impl From<umbp_ipc::ShmError> for SchedulerError {
    fn from(e: umbp_ipc::ShmError) -> Self {
        SchedulerError::Io(io::Error::other(e))
    }
}

/// How long a reattach waits for the pool's reply to Hello, across calls (a reattach never
/// blocks a lookup; this only bounds how long a silent pool is waited for).
const REATTACH_REPLY_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a socket check vouches for the pool: a lookup polls the pool socket when the
/// last poll that found it open is at least this old. It bounds how long a killed pool's
/// stale mapping can still answer hits (the poll costs ~0.6 µs; a clock read ~20 ns).
pub const LIVENESS_INTERVAL: Duration = Duration::from_millis(1);

/// How old the pool's heartbeat may be before lookups miss (the vLLM connector passes its
/// `lookup_timeout_ms`).
pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_millis(1000);

/// `CLOCK_MONOTONIC` in ns, the clock the pool stamps its heartbeat with (vDSO, ~20 ns).
fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (t.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(t.tv_nsec as u64)
}

/// One attachment: the index mapping, the hint ring and the liveness socket.
struct Attachment {
    index: IndexView<'static>,
    hints: Producer<'static, Hint>,
    sock: UnixStream,
    /// When a poll of `sock` last found the pool there.
    checked: Instant,
    /// A full check ([`Self::alive`], from `is_attached` or `snapshot`) found the pool
    /// gone: the next lookup must not trust the mapping on the strength of an older poll.
    seen_dead: std::cell::Cell<bool>,
    attachment_id: u32,
    /// The pool's KV event log (None from a pool that sent none).
    events: Option<events::EventFollower>,
    /// The last lookup found the pool's heartbeat stale (logged on each change).
    stalled: bool,
    // Dropped after the views above, which point into these mappings.
    _ring: SharedMemory,
    _index: SharedMemory,
}

impl Attachment {
    fn new(a: Attached) -> Result<Self, SchedulerError> {
        let r = a.reply;
        let layout = AttachmentLayout::new(r.sq_entries, r.cq_entries, r.hint_entries, r.arena_bytes)?;
        let mut fds = a.fds.into_iter();
        let (Some(ring_fd), Some(index_fd)) = (fds.next(), fds.next()) else {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "HelloReply lacks its fds").into());
        };
        // The doorbell (third fd) is not needed: the pool drains hints on its own timer.
        let _doorbell = fds.next();
        let events = match fds.next().map(events::EventFollower::new) {
            Some(Ok(f)) => Some(f),
            Some(Err(e)) => {
                tracing::warn!(error = %e, "UMBP event log unusable; take_events stays empty");
                None
            }
            None => None,
        };
        let ring = SharedMemory::from_received(ring_fd, layout.total_bytes, true)?;
        let index = SharedMemory::from_received(index_fd, TABLES_OFFSET, false)?;
        // Lookups are on the engine scheduler's critical path: fault the whole index in
        // now (tens of MiB for a 10 GiB pool) rather than a page at a time during lookups.
        let t = std::time::Instant::now();
        let populated = index.populate_read();
        tracing::debug!(bytes = index.len(), populated, ms = t.elapsed().as_secs_f64() * 1e3, "index mapping populated");
        // SAFETY: the hint ring section lies inside the ring mapping (AttachmentLayout,
        // size checked by from_received); the mapping is owned by `_ring`, dropped after
        // this producer, and does not move with the struct.
        let hints = unsafe { Ring::<Hint>::attach(ring.as_ptr().add(layout.hint_offset), layout.hint_bytes()) }?.producer();
        // SAFETY: the whole index mapping, read-only, owned by `_index` (dropped after the
        // view); IndexView::attach checks every header field against `len`.
        let index_view = unsafe { IndexView::attach(index.as_ptr(), index.len()) }?;
        let checked = Instant::now();
        Ok(Self {
            index: index_view,
            hints,
            sock: a.sock,
            checked,
            seen_dead: std::cell::Cell::new(false),
            attachment_id: r.attachment_id,
            events,
            stalled: false,
            _ring: ring,
            _index: index,
        })
    }

    /// Full check: the pool did not close its index, its death word is clear and its
    /// socket is open.
    fn alive(&self) -> bool {
        let alive = !self.seen_dead.get() && !self.index.writer_gone() && !peer_gone(&self.sock);
        if !alive {
            self.seen_dead.set(true);
        }
        alive
    }

    /// The lookup-path check: the `closed` and death words every time, the socket when the
    /// last poll that found it open is [`LIVENESS_INTERVAL`] old.
    fn alive_cheap(&mut self) -> bool {
        if self.seen_dead.get() || self.index.writer_gone() {
            return false;
        }
        let now = Instant::now();
        if now.saturating_duration_since(self.checked) < LIVENESS_INTERVAL {
            return true;
        }
        if peer_gone(&self.sock) {
            return false;
        }
        self.checked = now;
        true
    }

    /// Whether the pool's heartbeat is older than `timeout` (it is stopped or wedged):
    /// lookups miss meanwhile. Logs each change.
    fn stalled(&mut self, timeout: Duration) -> bool {
        let stalled = self.index.stalled(monotonic_ns(), timeout.as_nanos() as u64);
        if stalled != self.stalled {
            self.stalled = stalled;
            if stalled {
                tracing::warn!(
                    attachment = self.attachment_id,
                    timeout_ms = timeout.as_millis() as u64,
                    "UMBP pool stalled (its heartbeat is older than the stall timeout); lookups miss until it runs again"
                );
            } else {
                tracing::info!(attachment = self.attachment_id, "UMBP pool runs again; lookups hit");
            }
        }
        stalled
    }

    /// Posts hints for `keys`, dropping what does not fit: they are advice, and a
    /// scheduler must never wait on the pool.
    fn touch(&mut self, keys: &[ObjectKey]) {
        let mut any = false;
        for k in keys {
            match self.hints.try_push(Hint { key: k.to_words() }) {
                Ok(true) => any = true,
                Ok(false) | Err(_) => break,
            }
        }
        if any {
            // No doorbell: the pool drains hint rings at least every 10 ms.
            let _ = self.hints.publish();
        }
    }
}

/// A scheduler's view of a pool's index. `Send`; not meant to be shared between threads
/// (the hint ring has one producer).
pub struct IndexClient {
    endpoint: PathBuf,
    namespace: u128,
    reply_timeout: Duration,
    att: Option<Attachment>,
    events_lost: u64,
    dial: Option<Dial>,
    backoff: Backoff,
    /// Trusted pool uid besides ours and root (None: `UMBP_POOL_UID`).
    pool_uid: Option<u32>,
    /// A pool whose heartbeat is older than this reads as empty.
    stall_timeout: Duration,
}

impl IndexClient {
    /// Attaches now, retrying an absent pool for up to `timeout`; the error names the
    /// socket path. After a successful attach it behaves like [`Self::lazy`]: it detaches
    /// when the pool dies and reattaches when it comes back.
    pub fn connect(endpoint: &Path, namespace: u128, timeout: Duration) -> Result<IndexClient, SchedulerError> {
        Self::connect_with_pool_uid(endpoint, namespace, timeout, None)
    }

    /// [`Self::connect`], also accepting a pool that runs as `pool_uid` (besides this
    /// process's uid and root; None: `UMBP_POOL_UID`). A socket served by anyone else is
    /// refused before anything is sent to it.
    pub fn connect_with_pool_uid(
        endpoint: &Path,
        namespace: u128,
        timeout: Duration,
        pool_uid: Option<u32>,
    ) -> Result<IndexClient, SchedulerError> {
        let endpoint = &umbp_ipc::endpoint::parse_endpoint("endpoint", endpoint.as_os_str())?;
        let start = Instant::now();
        let deadline = start + timeout;
        let hello = Hello::new(Role::Scheduler, namespace, std::process::id());
        let mut backoff = Backoff::default();
        let attached = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match Dial::blocking(endpoint, &hello, left.max(Duration::from_millis(50)), pool_uid) {
                Ok(a) => break a,
                Err(DialError::Refused(refusal)) => {
                    tracing::error!(endpoint = %endpoint.display(), %refusal, "UMBP pool refused this scheduler");
                    return Err(SchedulerError::Refused { path: endpoint.to_path_buf(), message: refusal.to_string() });
                }
                Err(e) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(SchedulerError::Unreachable { path: endpoint.to_path_buf(), source: e.into_io() });
                    }
                    let delay = backoff.failed(now).min(deadline - now);
                    tracing::debug!(endpoint = %endpoint.display(), error = %e, ?delay, "UMBP pool not reachable yet");
                    std::thread::sleep(delay);
                }
            }
        };
        let att = Attachment::new(attached)?;
        tracing::info!(endpoint = %endpoint.display(), attachment = att.attachment_id, "scheduler attached to UMBP index");
        Ok(IndexClient {
            endpoint: endpoint.to_path_buf(),
            namespace,
            reply_timeout: REATTACH_REPLY_TIMEOUT,
            att: Some(att),
            events_lost: 0,
            dial: None,
            backoff: Backoff::default(),
            pool_uid,
            stall_timeout: DEFAULT_STALL_TIMEOUT,
        })
    }

    /// A client that attaches whenever the pool is reachable, starting now. Never fails;
    /// until attached every lookup is a miss.
    pub fn lazy(endpoint: &Path, namespace: u128) -> IndexClient {
        Self::lazy_with_pool_uid(endpoint, namespace, None)
    }

    /// [`Self::lazy`] with a trusted pool uid (see [`Self::connect_with_pool_uid`]).
    pub fn lazy_with_pool_uid(endpoint: &Path, namespace: u128, pool_uid: Option<u32>) -> IndexClient {
        // Never fails: a refused endpoint is logged and kept as given (it never attaches,
        // so every lookup misses); callers that can report it parse first.
        let endpoint = umbp_ipc::endpoint::parse_endpoint("endpoint", endpoint.as_os_str()).unwrap_or_else(|e| {
            tracing::error!(error = %e, "UMBP index endpoint refused; lookups will miss");
            endpoint.to_path_buf()
        });
        let mut c = IndexClient {
            pool_uid,
            endpoint,
            namespace,
            reply_timeout: REATTACH_REPLY_TIMEOUT,
            att: None,
            events_lost: 0,
            dial: None,
            backoff: Backoff::default(),
            stall_timeout: DEFAULT_STALL_TIMEOUT,
        };
        c.try_attach();
        c
    }

    /// Sets how old the pool's heartbeat may be before lookups miss (raised to
    /// [`MIN_STALL_TIMEOUT_MS`] at least: the pool beats every few ms, and a loaded machine
    /// must not read as a stalled pool).
    pub fn set_stall_timeout(&mut self, timeout: Duration) {
        self.stall_timeout = timeout.max(Duration::from_millis(MIN_STALL_TIMEOUT_MS));
    }

    /// The stall timeout in effect.
    pub fn stall_timeout(&self) -> Duration {
        self.stall_timeout
    }

    /// Whether the attached pool is stalled right now (its heartbeat is older than the
    /// stall timeout): lookups miss meanwhile.
    pub fn is_stalled(&mut self) -> bool {
        let timeout = self.stall_timeout;
        self.att.as_mut().is_some_and(|a| a.stalled(timeout))
    }

    /// Number of leading `keys` the pool holds (stops at the first miss); 0 while no live
    /// pool is attached, and while the attached pool is stalled (its heartbeat is older
    /// than the stall timeout: a load planned now would be refused). Posts touch hints for
    /// the hits. Never blocks, never errors.
    pub fn match_prefix(&mut self, keys: &[ObjectKey]) -> usize {
        let timeout = self.stall_timeout;
        let Some(att) = self.live() else { return 0 };
        if att.stalled(timeout) {
            return 0;
        }
        let n = att.index.match_prefix(keys);
        // A pool that shut down or died during the probe may be releasing what it found.
        if att.index.writer_gone() {
            self.drop_dead();
            return 0;
        }
        att.touch(&keys[..n]);
        n
    }

    pub fn contains(&mut self, key: ObjectKey) -> bool {
        self.match_prefix(&[key]) == 1
    }

    /// The tier holding `key`'s object (DRAM, SSD, another node), or None when it is
    /// absent, when no live pool is attached, when the attached pool is stalled, and for a
    /// tier this build does not know. For KV events: a block another engine stored is
    /// announced with the medium of its tier. Never blocks, posts no touch hint.
    pub fn tier(&mut self, key: ObjectKey) -> Option<umbp_protocol::location::Tier> {
        let timeout = self.stall_timeout;
        let att = self.live()?;
        if att.stalled(timeout) {
            return None;
        }
        let location = att.index.lookup(key);
        if att.index.writer_gone() {
            self.drop_dead();
            return None;
        }
        umbp_protocol::location::decode(location?).map(|(t, _)| t)
    }

    /// Tells the pool these keys are in use (LRU order, short eviction lease). Best effort.
    pub fn touch(&mut self, keys: &[ObjectKey]) {
        if let Some(att) = self.live() {
            att.touch(keys);
        }
    }

    /// Whether a live pool is attached right now.
    pub fn is_attached(&self) -> bool {
        self.att.as_ref().is_some_and(Attachment::alive)
    }

    /// Index statistics, while a live pool is attached.
    /// KV events since the last call: keys the pool stored (now visible) or removed
    /// (evicted, reset), oldest first. Never blocks. Events of a pool that died are still
    /// returned; after a restart, events start with the new pool's (its objects are new).
    pub fn take_events(&mut self) -> Vec<(EventKind, ObjectKey)> {
        let mut out = Vec::new();
        if let Some(f) = self.att.as_mut().and_then(|a| a.events.as_mut()) {
            let lost = f.drain(&mut out);
            if lost > 0 {
                self.events_lost += lost;
                tracing::warn!(lost, endpoint = %self.endpoint.display(), "UMBP KV events lost: take_events was called too rarely");
            }
        }
        let _ = self.live();
        out
    }

    /// [`Self::take_events`] with each event's tier: a demotion to SSD is `Removed` from
    /// DRAM then `Stored` on SSD, a promotion the reverse.
    pub fn take_tier_events(&mut self) -> Vec<umbp_protocol::events::Event> {
        let mut out = Vec::new();
        if let Some(f) = self.att.as_mut().and_then(|a| a.events.as_mut()) {
            let lost = f.drain_events(&mut out);
            if lost > 0 {
                self.events_lost += lost;
                tracing::warn!(lost, endpoint = %self.endpoint.display(), "UMBP KV events lost: take_events was called too rarely");
            }
        }
        let _ = self.live();
        out
    }

    /// KV events this client missed because it fell more than the log's capacity behind.
    pub fn events_lost(&self) -> u64 {
        self.events_lost
    }

    pub fn snapshot(&self) -> Option<IndexSnapshot> {
        self.att.as_ref().filter(|a| a.alive()).map(|a| a.index.snapshot())
    }

    pub fn endpoint(&self) -> &Path {
        &self.endpoint
    }

    /// The attachment, after checking the pool is still there; otherwise advances a
    /// reattach (without waiting) and returns it if that completed.
    fn live(&mut self) -> Option<&mut Attachment> {
        if self.att.as_mut().is_some_and(|a| !a.alive_cheap()) {
            self.drop_dead();
        }
        if self.att.is_none() {
            self.try_attach();
        }
        self.att.as_mut()
    }

    /// Forgets an attachment whose pool is gone: its mapping is never read again.
    fn drop_dead(&mut self) {
        if let Some(att) = self.att.take() {
            tracing::warn!(endpoint = %self.endpoint.display(), attachment = att.attachment_id, "UMBP pool gone; lookups miss until it is back");
            self.backoff.reset();
        }
    }

    fn try_attach(&mut self) {
        let now = Instant::now();
        if self.dial.is_none() {
            if !self.backoff.due(now) {
                return;
            }
            let hello = Hello::new(Role::Scheduler, self.namespace, std::process::id());
            match Dial::start(&self.endpoint, &hello, self.reply_timeout, self.pool_uid) {
                Ok(d) => self.dial = Some(d),
                Err(e) => {
                    let delay = self.backoff.failed(now);
                    tracing::debug!(endpoint = %self.endpoint.display(), error = %e, ?delay, "UMBP pool not reachable");
                    return;
                }
            }
        }
        let Some(dial) = self.dial.as_mut() else { return };
        let result = match dial.finish(Duration::ZERO) {
            Ok(None) => return,
            Ok(Some((reply, fds))) => Attachment::new(self.dial.take().expect("dial in progress").into_attached(reply, fds)),
            Err(DialError::Refused(refusal)) => Err(SchedulerError::Refused { path: self.endpoint.clone(), message: refusal.to_string() }),
            Err(e) => Err(SchedulerError::Io(e.into_io())),
        };
        self.dial = None;
        match result {
            Ok(att) => {
                tracing::info!(endpoint = %self.endpoint.display(), attachment = att.attachment_id, "scheduler attached to UMBP index");
                self.att = Some(att);
                self.backoff.reset();
            }
            Err(e) => {
                let delay = self.backoff.failed(Instant::now());
                match e {
                    SchedulerError::Refused { .. } => tracing::warn!(error = %e, ?delay, "UMBP pool refused the scheduler"),
                    _ => tracing::debug!(endpoint = %self.endpoint.display(), error = %e, ?delay, "UMBP attach failed"),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_is_send() {
        fn send<T: Send>() {}
        send::<IndexClient>();
    }

    #[test]
    fn detached_client_misses_without_blocking() {
        let path = Path::new("/nonexistent/umbp-sched-test/pool.sock");
        let mut c = IndexClient::lazy(path, 1);
        let t = Instant::now();
        for _ in 0..1000 {
            assert_eq!(c.match_prefix(&[ObjectKey(1)]), 0);
        }
        assert!(!c.contains(ObjectKey(1)));
        c.touch(&[ObjectKey(1)]);
        assert!(t.elapsed() < Duration::from_millis(500));
        assert!(!c.is_attached());
        assert!(c.snapshot().is_none());
    }

    #[test]
    fn unreachable_names_the_path() {
        let path = Path::new("/nonexistent/umbp-sched-test/pool.sock");
        let err = IndexClient::connect(path, 1, Duration::from_millis(100)).err().unwrap();
        assert!(matches!(err, SchedulerError::Unreachable { .. }));
        assert!(err.to_string().contains("/nonexistent/umbp-sched-test/pool.sock"), "{err}");
    }
}
