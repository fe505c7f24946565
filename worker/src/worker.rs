use std::cell::Cell;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::marker::PhantomData;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use umbp_ipc::message::peer_gone;
use umbp_protocol::attachment::MAX_ARENA_BYTES;
use umbp_protocol::entries::{BlockRef, BlockStatus, Cqe, CqeError, Opcode, Sqe, MAX_BLOCKS_PER_SQE, SQE_CANCELLABLE};
use umbp_protocol::layout::Segment;
use umbp_protocol::ring::MAX_RING_CAPACITY;
use umbp_protocol::transfer_state::{Abandoned, TransferState, STATE_BYTES};
use umbp_protocol::wire::{Hello, MemoryRegistration, MessageKind, Role, MAX_SEGMENTS};
use umbp_protocol::{ObjectKey, ProtocolError};

use crate::arena_alloc::submission_bytes;
use crate::connection::Connection;
use crate::WorkerError;
use umbp_ipc::backoff::Backoff;
use umbp_ipc::dial::{Attached, Dial, DialError};

mod fenced;
mod lost_pool;
mod reconnect;

/// The pool's socket when nothing else is configured: `UMBP_STANDALONE_ADDRESS` (a path or
/// `unix://` address, parsed by [`umbp_ipc::endpoint::parse_endpoint`]), else
/// `$XDG_RUNTIME_DIR/umbp/pool.sock`, else `/tmp/umbp/pool.sock` (docs/connection.md).
pub use umbp_ipc::endpoint::default_endpoint;

#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// The pool's socket: a path or a `unix://` address ([`Worker::connect`] refuses others).
    pub endpoint: PathBuf,
    pub namespace: u128,
    pub tp_rank: u32,
    pub tp_size: u32,
    pub dp_rank: u32,
    /// How long a transfer may go without completion before the pool counts as stalled;
    /// also bounds each control request.
    pub timeout: Duration,
    /// How long [`Worker::connect`] keeps retrying an absent pool.
    pub startup_timeout: Duration,
    /// Submission ring entries (power of two; 0 = pool default).
    pub sq_entries: u32,
    /// Arena bytes (0 = pool default).
    pub arena_bytes: u64,
    /// A uid accepted as the pool's besides this process's own and root (the pool's
    /// service user); None: `UMBP_POOL_UID`, if set. A socket served by anyone else is
    /// refused before anything is sent to it (docs/security.md).
    pub pool_uid: Option<u32>,
    /// How long [`Worker::wait`] keeps polling the completion ring (yielding the CPU
    /// between polls) before it sleeps on the ring's futex. A sleeping thread takes tens
    /// of microseconds to wake on a virtual machine (measured on the H200 VM: the
    /// single-object transfers lost 10-100 µs per round trip to wake-ups), which is what a
    /// 1 MiB copy takes; polling through a copy's expected duration saves it, at the price
    /// of one busy core while waiting (as CUDA's own stream synchronization does by
    /// default). `Duration::ZERO`: sleep after a short spin, as before.
    pub wait_poll: Duration,
}

impl WorkerConfig {
    pub fn new(endpoint: impl Into<PathBuf>, namespace: u128) -> Self {
        Self {
            endpoint: endpoint.into(),
            namespace,
            tp_rank: 0,
            tp_size: 1,
            dp_rank: 0,
            timeout: Duration::from_secs(5),
            startup_timeout: Duration::from_secs(10),
            sq_entries: 0,
            arena_bytes: 0,
            pool_uid: None,
            wait_poll: DEFAULT_WAIT_POLL,
        }
    }

    fn validate(&self) -> Result<(), WorkerError> {
        let bad = |m: String| Err(WorkerError::Invalid(m));
        if self.tp_size == 0 || self.tp_rank >= self.tp_size {
            return bad(format!("tp_rank {} must be below tp_size {}", self.tp_rank, self.tp_size));
        }
        if self.sq_entries != 0 && (!self.sq_entries.is_power_of_two() || self.sq_entries > MAX_RING_CAPACITY / 2) {
            return bad(format!("sq_entries {} must be 0 or a power of two up to {}", self.sq_entries, MAX_RING_CAPACITY / 2));
        }
        if self.arena_bytes > MAX_ARENA_BYTES {
            return bad(format!("arena_bytes {} exceeds {MAX_ARENA_BYTES}", self.arena_bytes));
        }
        if self.timeout.is_zero() {
            return bad("timeout must be positive".into());
        }
        Ok(())
    }

    fn hello(&self) -> Hello {
        let mut h = Hello::new(Role::Worker, self.namespace, std::process::id());
        h.tp_rank = self.tp_rank;
        h.tp_size = self.tp_size;
        h.dp_rank = self.dp_rank;
        h.sq_entries = self.sq_entries;
        h.arena_bytes = self.arena_bytes;
        h
    }
}

/// Memory the pool may copy KV blocks to and from.
#[derive(Debug)]
pub enum MemorySpec {
    /// Any memory of this process, reached by the pool through `/proc/<pid>/mem`. The
    /// range must stay mapped while registered (the contract of
    /// [`Worker::register_memory`], an `unsafe fn`).
    HostProcess { ptr: usize, len: usize },
    /// A range of a memfd sealed against shrinking; the worker keeps the fd to register it
    /// again after a reconnect.
    HostMemfd { fd: OwnedFd, offset: u64, len: u64 },
    /// A CUDA device allocation, exported with an IPC handle; it must stay allocated while
    /// registered ([`Worker::register_memory`]).
    Cuda { ptr: u64, len: u64 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransferId(pub u64);

/// Outcome of one store or load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    pub id: TransferId,
    /// One per submitted block, in submission order.
    pub statuses: Vec<BlockStatus>,
    /// Set when the pool rejected the whole submission (every status is then `Failed`).
    pub error: Option<CqeError>,
}

impl Completion {
    /// Blocks that reached the wanted state (stored, already present, loaded).
    pub fn ok_count(&self) -> usize {
        self.statuses.iter().filter(|s| s.is_ok()).count()
    }

    pub fn all_ok(&self) -> bool {
        self.error.is_none() && self.statuses.iter().all(|s| s.is_ok())
    }

    fn failed(id: u64, count: usize, error: Option<CqeError>) -> Self {
        Self { id: TransferId(id), statuses: vec![BlockStatus::Failed; count], error }
    }
}

/// A registration kept for replay after a reconnect.
struct Registered {
    /// The id the caller knows; segments name it.
    id: u32,
    reg: MemoryRegistration,
    fd: Option<OwnedFd>,
}

struct InFlight {
    /// Arena range (offset, rounded size) holding the state word, refs, then statuses.
    range: (u64, u64),
    status_offset: u64,
    count: u32,
    op: Opcode,
    submitted: Instant,
}

impl InFlight {
    /// The transfer's state word (the cancel contract) is the first word of its range.
    fn state_offset(&self) -> u64 {
        self.range.0
    }
}

/// A lost attachment kept for its started loads (docs/connection.md "A lost pool"): the
/// pool may still be copying into their blocks, so they complete only when the pool
/// answers on this attachment's completion ring or its process is known dead.
struct Quarantine {
    conn: Connection,
    loads: HashMap<u64, InFlight>,
    /// Transfers of the attachment already failed at the loss: a live pool still completes
    /// them here; their completions are dropped unseen.
    gone: HashMap<u64, InFlight>,
    /// The completion ring failed to read (corrupt): only the pool's death ends these.
    ring_broken: bool,
}

impl Quarantine {
    /// Whether the pool's copies into these loads' blocks are over: its process exited,
    /// or (its pid not visible here, another pid namespace) the socket closed, which is
    /// then the only sign of death there is.
    fn pool_dead(&self) -> bool {
        match self.conn.pool_dead() {
            Some(dead) => dead,
            None => peer_gone(&self.conn.sock),
        }
    }
}

/// Sets `ABANDONED` in `f`'s state word; returns whether the pool may have started it (a
/// started stage, garbage in the word, or abandoned before by a cancel that found it
/// started).
fn abandon(conn: &Connection, f: &InFlight) -> bool {
    match conn.arena.atomic_u64(f.state_offset()) {
        Ok(w) => !matches!(TransferState::new(w).abandon(), Abandoned::BeforeStart),
        // Our own offset inside our own arena: cannot fail; if it did, assume started.
        Err(_) => true,
    }
}

/// What [`Worker::cancel`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The transfer is cancelled and its blocks are the caller's again: the pool had not
    /// started it and never will (a load), or will publish nothing it reads from now on (a
    /// store). Its completion, all blocks `Failed` with error `Cancelled`, is ready for
    /// [`Worker::wait`] / [`Worker::poll`].
    Cancelled,
    /// A load the pool has started: its copies may still write the blocks, which stay in
    /// use until its completion arrives (or the pool is known dead: then it completes as
    /// failed). No further stage of it starts.
    Started,
    /// Not in flight: already completed (its completion is returned as usual) or unknown.
    NotInFlight,
}

/// Spins before sleeping on the CQ futex: copies take tens of microseconds at least, so a
/// short spin only catches completions that are already on their way.
const WAIT_SPINS: u32 = 128;
/// [`WorkerConfig::wait_poll`] by default: longer than one 64 MiB copy (~1.2 ms at
/// 55 GB/s), so a waiter for one large object is awake when its completion lands.
pub const DEFAULT_WAIT_POLL: Duration = Duration::from_millis(2);
/// Longest futex sleep in [`Worker::wait`]: a dead pool never wakes the futex, so the
/// socket is checked at least this often.
const LIVENESS_SLICE: Duration = Duration::from_millis(10);

/// A client attachment to a pool. See the crate docs.
pub struct Worker {
    cfg: WorkerConfig,
    conn: Option<Connection>,
    /// Reconnect handshake in progress (never waited on from poll/store/load).
    dial: Option<Dial>,
    backoff: Backoff,
    memory: Vec<Registered>,
    layouts: BTreeMap<u16, Vec<Segment>>,
    next_transfer: u64,
    next_alloc: u32,
    inflight: HashMap<u64, InFlight>,
    /// Transfers cancelled before the pool answered: their arena range (and state word)
    /// stays allocated until the pool's completion for them arrives, which is dropped.
    abandoned: HashMap<u64, InFlight>,
    ready: VecDeque<Completion>,
    /// Lost attachments whose started loads still hold their blocks (see [`Quarantine`]).
    quarantine: Vec<Quarantine>,
    stall_warned: bool,
    /// GPU fence page, made at the first stream-ordered transfer (crate::fence).
    fences: Option<crate::fence::Fences>,
    /// The rings are single-producer/single-consumer: one thread at a time.
    _not_sync: PhantomData<Cell<()>>,
}

impl Worker {
    /// Attaches to the pool at `cfg.endpoint`, retrying an absent pool until
    /// `startup_timeout`; then fails with an error naming the socket path. A refusal (wrong
    /// version, uid not allowed) fails at once.
    pub fn connect(mut cfg: WorkerConfig) -> Result<Worker, WorkerError> {
        cfg.validate()?;
        // `unix:///path` as the seed writes it; another scheme is refused here, by name.
        cfg.endpoint =
            umbp_ipc::endpoint::parse_endpoint("endpoint", cfg.endpoint.as_os_str()).map_err(|e| WorkerError::Invalid(e.to_string()))?;
        let start = Instant::now();
        let deadline = start + cfg.startup_timeout;
        let hello = cfg.hello();
        let mut backoff = Backoff::default();
        let attached = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let reply_timeout = cfg.timeout.min(left).max(Duration::from_millis(50));
            match Dial::blocking(&cfg.endpoint, &hello, reply_timeout, cfg.pool_uid) {
                Ok(a) => break a,
                Err(DialError::Refused(refusal)) => {
                    tracing::error!(endpoint = %cfg.endpoint.display(), %refusal, "UMBP pool refused this worker");
                    return Err(WorkerError::Refused { message: refusal.to_string() });
                }
                Err(e) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(WorkerError::Unreachable { path: cfg.endpoint.clone(), source: e.into_io() });
                    }
                    let delay = backoff.failed(now).min(deadline - now);
                    tracing::debug!(endpoint = %cfg.endpoint.display(), error = %e, ?delay, "UMBP pool not reachable yet");
                    std::thread::sleep(delay);
                }
            }
        };
        let conn = Connection::new(attached)?;
        tracing::info!(
            endpoint = %cfg.endpoint.display(),
            attachment = conn.attachment_id,
            waited_ms = start.elapsed().as_millis() as u64,
            "attached to UMBP pool"
        );
        Ok(Worker {
            cfg,
            conn: Some(conn),
            dial: None,
            backoff: Backoff::default(),
            memory: Vec::new(),
            layouts: BTreeMap::new(),
            next_transfer: 1,
            next_alloc: 0,
            inflight: HashMap::new(),
            abandoned: HashMap::new(),
            ready: VecDeque::new(),
            quarantine: Vec::new(),
            stall_warned: false,
            fences: None,
            _not_sync: PhantomData,
        })
    }

    pub fn config(&self) -> &WorkerConfig {
        &self.cfg
    }

    /// Registers a range of a memfd the pool may copy to and from; returns its alloc id.
    /// Safe: the pool reaches the memory through the fd, never through this process's
    /// pointers (what this process maps of the memfd is its own `unsafe` business).
    pub fn register_memfd(&mut self, fd: OwnedFd, offset: u64, len: u64) -> Result<u32, WorkerError> {
        // SAFETY: a memfd range puts no contract on this process's memory (see above).
        unsafe { self.register_memory(MemorySpec::HostMemfd { fd, offset, len }) }
    }

    /// Registers memory the pool may copy to and from; returns its alloc id, which layout
    /// segments name. Registrations are replayed (same ids) after every reconnect.
    ///
    /// # Safety
    /// For [`MemorySpec::HostProcess`] and [`MemorySpec::Cuda`] the pool writes (loads)
    /// and reads (stores) `ptr..ptr + len` of this process or device from another process,
    /// at any time a transfer naming it is in flight, for as long as this `Worker` lives:
    /// - the range is one live allocation of this process (host) or of a CUDA context of
    ///   this process (device) and stays allocated, and is not unmapped, freed or reused
    ///   for anything else, until this `Worker` is dropped;
    /// - no Rust reference (`&[u8]`, `&mut [u8]`) to bytes of a block may be alive while a
    ///   load into that block, or (for `&mut`) a store from it, is in flight: read and
    ///   write the memory through raw pointers or volatile access, or only between
    ///   transfers (after their completion was reaped).
    ///
    /// [`MemorySpec::HostMemfd`] has no such contract; use the safe [`Worker::register_memfd`].
    pub unsafe fn register_memory(&mut self, spec: MemorySpec) -> Result<u32, WorkerError> {
        self.service();
        if self.conn.is_none() {
            return Err(WorkerError::Disconnected);
        }
        let proposed = self.next_alloc;
        let (reg, fd) = export(spec, proposed)?;
        let timeout = self.cfg.timeout;
        let conn = self.conn.as_mut().expect("checked above");
        let result = conn.register_memory(&reg, fd.as_ref().map(|f| f.as_fd()), timeout);
        let id = self.after_control(result)?;
        if self.memory.iter().any(|m| m.id == id) {
            return Err(WorkerError::Invalid(format!("pool returned alloc id {id}, which is already registered")));
        }
        if let Some(conn) = self.conn.as_mut() {
            conn.alloc_ids.insert(id, id);
        }
        self.next_alloc = proposed.max(id).wrapping_add(1);
        self.memory.push(Registered { id, reg: MemoryRegistration { alloc_id: id, ..reg }, fd });
        tracing::debug!(alloc_id = id, kind = reg.kind, size = reg.size, "registered memory with UMBP pool");
        Ok(id)
    }

    /// Registers (or replaces) the KV layout of cache `group`; returns the bytes of one
    /// object. Replayed after every reconnect.
    pub fn register_layout(&mut self, group: u16, segments: Vec<Segment>) -> Result<u64, WorkerError> {
        if segments.is_empty() || segments.len() > MAX_SEGMENTS as usize {
            return Err(WorkerError::Invalid(format!("a layout needs 1..={MAX_SEGMENTS} segments, got {}", segments.len())));
        }
        if let Some(s) = segments.iter().find(|s| !self.memory.iter().any(|m| m.id == s.alloc_id)) {
            return Err(WorkerError::Invalid(format!("segment names alloc id {}, never registered", s.alloc_id)));
        }
        self.service();
        let timeout = self.cfg.timeout;
        let Some(conn) = self.conn.as_mut() else {
            return Err(WorkerError::Disconnected);
        };
        let result = conn.register_layout(group, &segments, timeout);
        let bytes = self.after_control(result)?;
        self.layouts.insert(group, segments);
        Ok(bytes)
    }

    /// Submits a store of `blocks` (object key, block id of `group`'s layout). Does not wait.
    /// `Full`: nothing was submitted, retry after reaping. `Stalled`: a transfer is overdue.
    pub fn store(&mut self, group: u16, blocks: &[(ObjectKey, u64)]) -> Result<TransferId, WorkerError> {
        self.submit(Opcode::Store, group, blocks)
    }

    /// Submits a load of `blocks` into the worker's memory. Does not wait.
    pub fn load(&mut self, group: u16, blocks: &[(ObjectKey, u64)]) -> Result<TransferId, WorkerError> {
        self.submit(Opcode::Load, group, blocks)
    }

    /// Completions available now. Never blocks. Also notices a dead pool (every pending
    /// transfer then completes with all blocks `Failed`) and advances reconnection.
    pub fn poll(&mut self) -> Vec<Completion> {
        self.service();
        self.ready.drain(..).collect()
    }

    /// Waits up to `timeout` for transfer `id`; None when it is still pending then (or the
    /// id is unknown or already returned). Other completions reaped meanwhile are kept for
    /// [`Self::poll`].
    pub fn wait(&mut self, id: TransferId, timeout: Duration) -> Option<Completion> {
        let start = Instant::now();
        let deadline = start + timeout;
        let poll_until = start + self.cfg.wait_poll.min(timeout);
        loop {
            self.reap();
            if let Some(pos) = self.ready.iter().position(|c| c.id == id) {
                return self.ready.remove(pos);
            }
            if !self.inflight.contains_key(&id.0) {
                if !self.quarantined(id.0) {
                    return None;
                }
                // A started load of a lost attachment: it ends with the pool's answer
                // on that attachment or the pool's death, checked every slice.
                self.check_quarantine();
                if self.ready.iter().any(|c| c.id == id) {
                    continue;
                }
                let now = Instant::now();
                if now >= deadline {
                    return None;
                }
                std::thread::sleep((deadline - now).min(LIVENESS_SLICE));
                continue;
            }
            if self.conn.as_ref().is_some_and(|c| peer_gone(&c.sock)) {
                self.lose("socket closed");
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            if now < poll_until {
                // Poll (wait_poll): stay awake for a completion that lands soon. The
                // socket was checked above; the slice bounds the poll like a sleep.
                let slice_end = (now + LIVENESS_SLICE).min(poll_until);
                if let Some(conn) = self.conn.as_mut() {
                    if let Err(e) = poll_cq(conn, slice_end) {
                        self.lose(&format!("completion ring: {e}"));
                    }
                }
                continue;
            }
            let slice = (deadline - now).min(LIVENESS_SLICE);
            if let Some(conn) = self.conn.as_mut() {
                if let Err(e) = conn.cq.wait(WAIT_SPINS, Some(slice)) {
                    self.lose(&format!("completion ring: {e}"));
                }
            }
        }
    }

    /// Gives up on transfer `id` (the cancel contract, docs/protocol.md "Cancelling a
    /// transfer"): a load the pool has not started, or any store, is cancelled and its
    /// blocks are the caller's again at once, with no help from the pool (which may be
    /// stopped); a load the pool has started keeps its blocks until it completes. Never
    /// blocks.
    pub fn cancel(&mut self, id: TransferId) -> CancelOutcome {
        self.reap();
        self.check_quarantine();
        if self.quarantined(id.0) {
            // Abandoned when its attachment was lost; started, so its blocks stay in use.
            return CancelOutcome::Started;
        }
        let Some(conn) = self.conn.as_ref() else { return CancelOutcome::NotInFlight };
        let Some(f) = self.inflight.get(&id.0) else { return CancelOutcome::NotInFlight };
        let state = match conn.arena.atomic_u64(f.state_offset()) {
            Ok(w) => TransferState::new(w).abandon(),
            // Our own offset inside our own arena: cannot fail.
            Err(_) => return CancelOutcome::Started,
        };
        let cancelled = match (f.op, state) {
            (Opcode::Load, Abandoned::AfterStages(_)) => false,
            (_, Abandoned::Already) => !matches!(f.op, Opcode::Load),
            _ => true,
        };
        if !cancelled {
            tracing::debug!(transfer = id.0, "cancel: the pool started this load; its blocks stay in use until it completes");
            return CancelOutcome::Started;
        }
        let f = self.inflight.remove(&id.0).expect("looked up above");
        if f.op == Opcode::Load {
            // The pool will never write this load's fence word; release a stream waiting on it.
            if let Some(fences) = &self.fences {
                fences.release_load(id.0);
            }
        }
        tracing::debug!(transfer = id.0, op = ?f.op, "transfer cancelled; its blocks are the caller's again");
        self.ready.push_back(Completion::failed(id.0, f.count as usize, Some(CqeError::Cancelled)));
        self.abandoned.insert(id.0, f);
        CancelOutcome::Cancelled
    }

    /// Whether a transfer has gone without an answer from the pool past `timeout` (new
    /// transfers are refused with `Stalled` meanwhile).
    pub fn is_stalled(&self) -> bool {
        self.overdue_ms(Instant::now()).is_some()
    }

    /// Whether an attachment is up and the pool's end of the socket is open.
    pub fn is_connected(&self) -> bool {
        self.conn.as_ref().is_some_and(|c| !peer_gone(&c.sock))
    }

    /// Transfers submitted whose completion has not been returned yet.
    pub fn pending(&self) -> usize {
        self.inflight.len() + self.ready.len() + self.quarantined_count()
    }

    /// Drops every unpinned object of this namespace in the pool; returns how many.
    pub fn reset_namespace(&mut self) -> Result<u64, WorkerError> {
        self.service();
        let timeout = self.cfg.timeout;
        let Some(conn) = self.conn.as_mut() else {
            return Err(WorkerError::Disconnected);
        };
        let result = conn.control(MessageKind::ResetNamespace, &[], &[], timeout);
        self.after_control(result)
    }

    fn submit(&mut self, op: Opcode, group: u16, blocks: &[(ObjectKey, u64)]) -> Result<TransferId, WorkerError> {
        self.submit_fenced(op, group, blocks, None)
    }

    /// Submits like [`Self::store`]/[`Self::load`]; `fence` = `(alloc id of the fence
    /// page, slot)` makes it a fenced transfer whose fence value is its transfer id
    /// (crate::fence, docs/gpu.md "Stream-ordered transfers").
    fn submit_fenced(
        &mut self,
        op: Opcode,
        group: u16,
        blocks: &[(ObjectKey, u64)],
        fence: Option<(u32, u32)>,
    ) -> Result<TransferId, WorkerError> {
        if blocks.len() > MAX_BLOCKS_PER_SQE as usize {
            return Err(WorkerError::Invalid(format!("{} blocks in one transfer; at most {MAX_BLOCKS_PER_SQE}", blocks.len())));
        }
        if !self.layouts.contains_key(&group) {
            return Err(WorkerError::Invalid(format!("cache group {group} has no registered layout")));
        }
        if blocks.is_empty() {
            // Nothing for the pool to do; completing here keeps callers free of special cases.
            let id = self.take_id();
            self.ready.push_back(Completion { id, statuses: vec![], error: None });
            return Ok(id);
        }
        self.service();
        let now = Instant::now();
        if let Some(oldest_ms) = self.overdue_ms(now) {
            return Err(WorkerError::Stalled { oldest_ms });
        }
        let Some(conn) = self.conn.as_mut() else {
            return Err(WorkerError::Disconnected);
        };
        if self.inflight.len() + self.abandoned.len() >= conn.cq_capacity as usize {
            // The pool must always find room for a completion; more in flight than the CQ
            // holds could make it drop one.
            return Err(WorkerError::Full);
        }
        let n = blocks.len() as u64;
        let Some((off, size)) = conn.alloc.alloc(submission_bytes(n)) else {
            return Err(WorkerError::Full);
        };
        let refs: Vec<BlockRef> = blocks.iter().map(|&(k, b)| BlockRef::new(k, b)).collect();
        let refs_offset = off + STATE_BYTES;
        let status_offset = refs_offset + n * core::mem::size_of::<BlockRef>() as u64;
        let written = conn
            .arena
            .atomic_u64(off)
            .map(|w| TransferState::new(w).reset())
            .and_then(|()| conn.arena.write(refs_offset, &refs))
            .and_then(|()| conn.arena.write(status_offset, &vec![BlockStatus::Pending as u8; n as usize]));
        if let Err(e) = written {
            conn.alloc.free(off, size);
            return Err(e.into());
        }
        let id = self.next_transfer;
        // The fence page's id in this attachment (ids may differ after a reconnect).
        let fence_ref = match fence.map(|(alloc, slot)| (conn.alloc_ids.get(&alloc).copied(), slot)) {
            None => None,
            Some((Some(pool_alloc), slot)) => Some(umbp_gpu::fence::encode_ref(pool_alloc, slot)),
            Some((None, _)) => {
                conn.alloc.free(off, size);
                return Err(WorkerError::Invalid("the fence page is not registered with this pool".into()));
            }
        };
        let sqe = Sqe {
            opcode: op as u8,
            flags: SQE_CANCELLABLE,
            group,
            count: n as u32,
            user_data: id,
            refs_offset,
            status_offset,
            fence_value: if fence_ref.is_some() { id } else { 0 },
            fence_ref: fence_ref.unwrap_or(0),
            state_offset: off,
            reserved: 0,
        };
        match conn.sq.try_push(sqe) {
            Ok(true) => {}
            Ok(false) => {
                conn.alloc.free(off, size);
                return Err(WorkerError::Full);
            }
            Err(e) => {
                conn.alloc.free(off, size);
                self.lose(&format!("submission ring: {e}"));
                return Err(e.into());
            }
        }
        if conn.sq.publish() {
            conn.doorbell.ring();
        }
        self.next_transfer += 1;
        self.inflight.insert(id, InFlight { range: (off, size), status_offset, count: n as u32, op, submitted: now });
        Ok(TransferId(id))
    }

    /// Whether transfer `id` was submitted and the pool has not completed it yet (also
    /// when it was cancelled: the pool may still look at its fence slot until then).
    fn in_flight(&self, id: u64) -> bool {
        self.inflight.contains_key(&id) || self.abandoned.contains_key(&id) || self.quarantined(id)
    }

    /// The current attachment's id, socket and a dup of the pool's pidfd (the fence
    /// watchdog watches them).
    fn attachment_socket(&self) -> Option<(u32, &std::os::unix::net::UnixStream, Option<OwnedFd>)> {
        self.conn.as_ref().map(|c| (c.attachment_id, &c.sock, c.pool_pidfd()))
    }

    fn take_id(&mut self) -> TransferId {
        let id = self.next_transfer;
        self.next_transfer += 1;
        TransferId(id)
    }

    /// Everything a call does before its own work: reap, notice a dead or stalled pool,
    /// advance a reconnect. Never blocks on the pool.
    fn service(&mut self) {
        let began = Instant::now();
        self.reap();
        self.check_quarantine();
        self.check_alive();
        let checked = Instant::now();
        if self.conn.is_none() {
            // The whole call, checks included, stays within one timeout (the soak's bound).
            self.try_reconnect(began + self.cfg.timeout);
        }
        let done = Instant::now();
        // The engine thread is ours for this long: past the timeout an operator must learn
        // which part held it (the soak fails on it: docs/reliability.md).
        if done - began > self.cfg.timeout {
            tracing::warn!(
                endpoint = %self.cfg.endpoint.display(),
                took_ms = (done - began).as_millis() as u64,
                checks_ms = (checked - began).as_millis() as u64,
                reconnect_ms = (done - checked).as_millis() as u64,
                "UMBP worker call held the calling thread past timeout_ms"
            );
        }
        let overdue = self.overdue_ms(Instant::now());
        match (overdue, self.stall_warned) {
            (Some(ms), false) => {
                tracing::warn!(
                    endpoint = %self.cfg.endpoint.display(),
                    oldest_ms = ms,
                    pending = self.inflight.len(),
                    "UMBP pool stalled: transfers overdue; refusing new ones until it answers"
                );
                self.stall_warned = true;
            }
            (None, true) => {
                tracing::info!(endpoint = %self.cfg.endpoint.display(), "UMBP pool answered again");
                self.stall_warned = false;
            }
            _ => {}
        }
    }

    fn overdue_ms(&self, now: Instant) -> Option<u64> {
        // A cancelled transfer the pool has not answered still says the pool is stuck.
        self.inflight
            .values()
            .chain(self.abandoned.values())
            .map(|f| now.saturating_duration_since(f.submitted))
            .filter(|age| *age > self.cfg.timeout)
            .max()
            .map(|age| age.as_millis() as u64)
    }

    fn reap(&mut self) {
        let Some(conn) = self.conn.as_mut() else { return };
        if let Err(e) = reap_into(conn, &mut self.inflight, &mut self.abandoned, &mut self.ready) {
            self.lose(&format!("completion ring: {e}"));
        }
    }

    fn check_alive(&mut self) {
        if self.conn.as_ref().is_some_and(|c| peer_gone(&c.sock)) {
            self.lose("socket closed");
        }
    }
}

/// Polls `conn`'s completion ring until an entry is there or `until` passes; yields the
/// CPU between short spins, so a polling waiter never starves the threads it shares a
/// core with (the pool's, on a small machine).
fn poll_cq(conn: &mut Connection, until: Instant) -> Result<(), ProtocolError> {
    loop {
        for _ in 0..32 {
            if conn.cq.available()? > 0 {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        if Instant::now() >= until {
            return Ok(());
        }
        std::thread::yield_now();
    }
}

/// Moves every completion in the CQ to `ready`, freeing arena ranges.
fn reap_into(
    conn: &mut Connection,
    inflight: &mut HashMap<u64, InFlight>,
    abandoned: &mut HashMap<u64, InFlight>,
    ready: &mut VecDeque<Completion>,
) -> Result<(), ProtocolError> {
    let mut any = false;
    while let Some(cqe) = conn.cq.try_pop()? {
        any = true;
        if let Some(f) = abandoned.remove(&cqe.user_data) {
            // Its completion was returned at cancel time; the pool is done with the range.
            conn.alloc.free(f.range.0, f.range.1);
            continue;
        }
        let Some(f) = inflight.remove(&cqe.user_data) else {
            tracing::warn!(user_data = cqe.user_data, "UMBP pool completed a transfer this worker does not have");
            continue;
        };
        let c = completion(conn, cqe, &f);
        conn.alloc.free(f.range.0, f.range.1);
        ready.push_back(c);
    }
    if any {
        conn.cq.release();
    }
    Ok(())
}

fn completion(conn: &Connection, cqe: Cqe, f: &InFlight) -> Completion {
    if cqe.result != 0 {
        let error = CqeError::from_result(cqe.result).unwrap_or(CqeError::Internal);
        return Completion::failed(cqe.user_data, f.count as usize, Some(error));
    }
    // Offsets are ours, never the CQE's: a buggy pool cannot point us elsewhere.
    let statuses = match conn.arena.read::<u8>(f.status_offset, f.count as u64) {
        Ok(bytes) => bytes
            .into_iter()
            .map(|b| match BlockStatus::from_u8(b) {
                // A block the pool never finished is not usable data.
                BlockStatus::Pending => BlockStatus::Failed,
                s => s,
            })
            .collect(),
        Err(_) => vec![BlockStatus::Failed; f.count as usize],
    };
    Completion { id: TransferId(cqe.user_data), statuses, error: None }
}

fn export(spec: MemorySpec, alloc_id: u32) -> Result<(MemoryRegistration, Option<OwnedFd>), WorkerError> {
    let gpu = |source| WorkerError::Gpu { what: "exporting the memory to register".into(), source };
    Ok(match spec {
        MemorySpec::HostProcess { ptr, len } => {
            (umbp_gpu::host::export_process_memory(ptr as *const u8, len, alloc_id).map_err(gpu)?, None)
        }
        MemorySpec::HostMemfd { fd, offset, len } => {
            (umbp_gpu::host::export_memfd(fd.as_fd(), offset, len, alloc_id).map_err(gpu)?, Some(fd))
        }
        MemorySpec::Cuda { ptr, len } => (umbp_gpu::cuda::export_cuda_memory(ptr, len, alloc_id).map_err(gpu)?, None),
    })
}

#[cfg(test)]
mod tests;
