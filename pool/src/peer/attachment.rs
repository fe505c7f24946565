//! One attached peer: its socket (liveness and control), its ring memfd (SQ, CQ, hints,
//! arena), the memory it registered and its KV layouts.

use std::collections::{HashMap, VecDeque};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use umbp_gpu::DeviceRegion;
use umbp_ipc::doorbell::Doorbell;
use umbp_ipc::SharedMemory;
use umbp_protocol::arena::Arena;
use umbp_protocol::attachment::{AttachmentLayout, Hint};
use umbp_protocol::entries::{Cqe, Sqe};
use umbp_protocol::layout::KvLayout;
use umbp_protocol::ring::{Consumer, Producer, Ring, RingSnapshot};
use umbp_protocol::wire::Role;
use umbp_protocol::ProtocolError;

use crate::pool_report::{AttachmentReport, RegionReport};

/// Completion side: CQEs that did not fit wait in `overflow` (the pool never blocks on a
/// slow reaper) and go out in order before newer ones. The overflow is bounded: once it
/// holds a CQ's worth ([`Attachment::completions_backed_up`]) the service thread stops
/// reading that peer's SQ until it reaps, so only the submissions already admitted
/// (at most a CQ's worth, `validate::admit`) and one batch can still add to it: at most
/// `2 x cq_entries + 64` entries of 32 B per peer.
pub struct CompletionQueue {
    producer: Producer<'static, Cqe>,
    overflow: VecDeque<Cqe>,
}

impl CompletionQueue {
    fn flush(&mut self) -> Result<(), ProtocolError> {
        let mut pushed = false;
        while let Some(c) = self.overflow.front() {
            if !self.producer.try_push(*c)? {
                break;
            }
            self.overflow.pop_front();
            pushed = true;
        }
        if pushed {
            self.producer.publish_and_wake();
        }
        Ok(())
    }
}

#[derive(Default)]
pub struct AttachmentCounters {
    pub submissions: AtomicU64,
    pub errors: AtomicU64,
    pub blocks: AtomicU64,
    /// Submissions refused with `Busy` (over a per-peer in-flight limit).
    pub busy: AtomicU64,
    /// Times its SQ was paused because it did not reap its completions.
    pub sq_pauses: AtomicU64,
}

pub struct Attachment {
    pub id: u32,
    pub role: Role,
    /// SO_PEERCRED pid; 0 when the peer runs in a pid namespace the pool cannot see.
    pub pid: u32,
    pub uid: u32,
    /// The process that connected, held by a pidfd from accept on (docs/security.md).
    pub process: umbp_ipc::peer::PeerProcess,
    pub namespace: u128,
    /// The tenant group of `namespace` (groups.rs): whose index, event log and objects
    /// this peer's lookups, hints, stores and loads use.
    pub group: u32,
    pub tp_rank: u32,
    pub tp_size: u32,
    pub dp_rank: u32,
    pub socket: UnixStream,
    pub doorbell: Doorbell,
    pub alive: AtomicBool,
    /// Its SQ is not read: its completion overflow is full (it does not reap).
    pub sq_paused: AtomicBool,
    /// Submissions accepted and not yet completed.
    pub inflight: AtomicU32,
    /// Bytes those submissions may move (blocks x object bytes), for `--max-inflight-bytes`.
    pub inflight_bytes: AtomicU64,
    pub counters: AttachmentCounters,
    pub regions: RwLock<HashMap<u32, Arc<dyn DeviceRegion>>>,
    /// Device UUID of each registered region (zero for host memory), for reports.
    pub region_devices: Mutex<HashMap<u32, [u8; 16]>>,
    pub layouts: RwLock<HashMap<u16, Arc<KvLayout>>>,
    pub layout: AttachmentLayout,
    pub sq: Mutex<Consumer<'static, Sqe>>,
    pub cq: Mutex<CompletionQueue>,
    pub hints: Mutex<Consumer<'static, Hint>>,
    pub arena: Arena,
    // Declared last: the rings and the arena point into this mapping.
    pub ring_mem: Arc<SharedMemory>,
}

impl Attachment {
    /// Formats a fresh ring memfd for this peer.
    #[allow(clippy::too_many_arguments)]
    pub fn create(
        id: u32,
        role: Role,
        process: umbp_ipc::peer::PeerProcess,
        hello: &umbp_protocol::wire::Hello,
        group: u32,
        layout: AttachmentLayout,
        socket: UnixStream,
    ) -> std::io::Result<Self> {
        let ring_mem = SharedMemory::create(&format!("umbp-rings-{id}"), layout.total_bytes, false).map_err(std::io::Error::other)?;
        ring_mem.seal_final().map_err(std::io::Error::other)?;
        let ring_mem = Arc::new(ring_mem);
        let base = ring_mem.as_ptr();
        // SAFETY: the three rings and the arena are disjoint page-aligned sections of a
        // mapping of `total_bytes` (AttachmentLayout); `ring_mem` is kept alive in the
        // struct for as long as these 'static views exist (field order drops them first).
        let (sq, cq, hints, arena) = unsafe {
            let sq = Ring::<Sqe>::init(base.add(layout.sq_offset), layout.sq_bytes(), layout.sq_entries).map_err(std::io::Error::other)?;
            let cq = Ring::<Cqe>::init(base.add(layout.cq_offset), layout.cq_bytes(), layout.cq_entries).map_err(std::io::Error::other)?;
            let hints = Ring::<Hint>::init(base.add(layout.hint_offset), layout.hint_bytes(), layout.hint_entries)
                .map_err(std::io::Error::other)?;
            let arena = Arena::new(base.add(layout.arena_offset), layout.arena_bytes);
            (sq, cq, hints, arena)
        };
        let (pid, uid) = (process.cred.pid, process.cred.uid);
        Ok(Self {
            id,
            role,
            process,
            pid,
            uid,
            namespace: hello.namespace(),
            group,
            tp_rank: hello.tp_rank,
            tp_size: hello.tp_size,
            dp_rank: hello.dp_rank,
            socket,
            doorbell: Doorbell::new()?,
            alive: AtomicBool::new(true),
            sq_paused: AtomicBool::new(false),
            inflight: AtomicU32::new(0),
            inflight_bytes: AtomicU64::new(0),
            counters: AttachmentCounters::default(),
            regions: RwLock::new(HashMap::new()),
            region_devices: Mutex::new(HashMap::new()),
            layouts: RwLock::new(HashMap::new()),
            layout,
            sq: Mutex::new(sq.consumer()),
            cq: Mutex::new(CompletionQueue { producer: cq.producer(), overflow: VecDeque::new() }),
            hints: Mutex::new(hints.consumer()),
            arena,
            ring_mem,
        })
    }

    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Whether the peer is gone, judged now, without waiting for the service thread to
    /// notice: detached, or its socket hung up (the peer closed it, shut it down or died:
    /// the kernel closes a dead process's sockets). The copy thread asks before it claims a
    /// stage and before it publishes a store's stage (docs/protocol.md §4a): a peer that
    /// dropped its connection gave its blocks back, as if it abandoned every transfer.
    ///
    /// Only a hang-up, an error or an invalid fd reported by `poll` means gone: EINTR is
    /// retried, and any other `poll` failure judges nothing (the peer counts as alive).
    pub fn peer_gone(&self) -> bool {
        use rustix::event::{poll, PollFd, PollFlags};
        if !self.is_alive() {
            return true;
        }
        let gone = PollFlags::HUP | PollFlags::RDHUP | PollFlags::ERR | PollFlags::NVAL;
        let mut fds = [PollFd::new(&self.socket, PollFlags::RDHUP)];
        loop {
            // A zero timeout: never waits.
            match poll(&mut fds, Some(&rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 })) {
                Ok(0) => return false,
                Ok(_) => return fds[0].revents().intersects(gone),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    tracing::debug!(attachment = self.id, "liveness poll failed ({e}): judging nothing");
                    return false;
                }
            }
        }
    }

    /// Posts a completion, queueing it privately when the CQ is full. A corrupted CQ
    /// (the peer scribbled on our head word) detaches the peer.
    pub fn complete(&self, cqe: Cqe) {
        let mut cq = self.cq.lock().expect("cq lock");
        cq.overflow.push_back(cqe);
        if let Err(e) = cq.flush() {
            tracing::warn!(attachment = self.id, pid = self.pid, "completion ring corrupted: {e}; detaching");
            self.alive.store(false, Ordering::Release);
            let _ = self.socket.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Retries completions that did not fit earlier.
    pub fn flush_completions(&self) {
        let mut cq = self.cq.lock().expect("cq lock");
        if !cq.overflow.is_empty() {
            let _ = cq.flush();
        }
    }

    pub fn registered_bytes(&self) -> u64 {
        self.regions.read().expect("regions lock").values().map(|r| r.len()).sum()
    }

    pub fn ring_snapshots(&self) -> (RingSnapshot, RingSnapshot, RingSnapshot) {
        // pool/tests/lock_order.rs holds a report here to see that it holds no
        // `attachments` while it takes these per-attachment locks.
        crate::fault::pass(crate::fault::HoldPoint::ReportRings);
        let sq = self.sq.lock().expect("sq lock").ring().snapshot();
        let cq = self.cq.lock().expect("cq lock").producer.ring().snapshot();
        let hints = self.hints.lock().expect("hints lock").ring().snapshot();
        (sq, cq, hints)
    }

    pub fn overflow_len(&self) -> usize {
        self.cq.lock().expect("cq lock").overflow.len()
    }

    /// Whether the completions waiting for room in the CQ reached a CQ's worth: the peer
    /// does not reap, and its SQ must not be read until it does (the overflow would grow
    /// 32 B per submission otherwise). Tracks the transitions in `sq_paused` and returns it.
    pub fn completions_backed_up(&self) -> bool {
        let full = self.overflow_len() >= self.layout.cq_entries as usize;
        if self.sq_paused.swap(full, Ordering::AcqRel) != full {
            if full {
                self.counters.sq_pauses.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    attachment = self.id,
                    pid = self.pid,
                    cq_entries = self.layout.cq_entries,
                    "peer does not reap its completions: its submission ring is paused until it does"
                );
            } else {
                tracing::info!(attachment = self.id, pid = self.pid, "peer reaped its completions: submission ring resumed");
            }
        }
        full
    }

    /// This attachment in the state report (observe/report.rs).
    pub fn report(&self) -> AttachmentReport {
        let (sq, cq, hints) = self.ring_snapshots();
        AttachmentReport {
            id: self.id,
            pid: self.pid,
            uid: self.uid,
            role: self.role.into(),
            namespace: format!("{:032x}", self.namespace),
            tp_rank: self.tp_rank,
            tp_size: self.tp_size,
            dp_rank: self.dp_rank,
            sq: sq.into(),
            cq: cq.into(),
            hints: hints.into(),
            cq_overflow: self.overflow_len(),
            sq_paused: self.sq_paused.load(Ordering::Relaxed),
            sq_pauses: self.counters.sq_pauses.load(Ordering::Relaxed),
            inflight: self.inflight.load(Ordering::Relaxed),
            submissions: self.counters.submissions.load(Ordering::Relaxed),
            errors: self.counters.errors.load(Ordering::Relaxed),
            blocks: self.counters.blocks.load(Ordering::Relaxed),
            registered_bytes: self.registered_bytes(),
            regions: self.regions.read().expect("regions lock").len(),
            devices: region_reports(self),
            layouts: self.layouts.read().expect("layouts lock").keys().copied().collect(),
        }
    }
}

fn uuid_hex(u: &[u8; 16]) -> String {
    u.iter().map(|b| format!("{b:02x}")).collect()
}

/// Registered regions of one attachment: alloc id, memory kind, bytes, device UUID.
fn region_reports(a: &Attachment) -> Vec<RegionReport> {
    let devices = a.region_devices.lock().expect("devices lock").clone();
    let mut regions: Vec<_> = a
        .regions
        .read()
        .expect("regions lock")
        .iter()
        .map(|(id, r)| {
            let uuid = devices.get(id).copied().unwrap_or_default();
            RegionReport {
                alloc_id: *id,
                kind: format!("{:?}", r.kind()),
                bytes: r.len(),
                device_uuid: (uuid != [0; 16]).then(|| uuid_hex(&uuid)),
            }
        })
        .collect();
    regions.sort_by_key(|r| r.alloc_id);
    regions
}
