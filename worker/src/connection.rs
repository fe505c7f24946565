//! One attachment: the socket, the mapped ring memfd (SQ, CQ, arena) and the doorbell.
//! Everything here dies with the attachment; what must survive a reconnect (registrations,
//! layouts, transfer ids) lives in [`crate::Worker`].

use std::collections::HashMap;
use std::os::fd::BorrowedFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use umbp_ipc::doorbell::Doorbell;
use umbp_ipc::message::{recv_message, send_message, MessageError};
use umbp_ipc::SharedMemory;
use umbp_protocol::arena::Arena;
use umbp_protocol::attachment::AttachmentLayout;
use umbp_protocol::entries::{Cqe, Sqe};
use umbp_protocol::layout::Segment;
use umbp_protocol::ring::{Consumer, Producer, Ring};
use umbp_protocol::wire::{decode, LayoutHeader, MemoryRegistration, MessageKind, Reply, ReplyStatus};

use crate::arena_alloc::ArenaAllocator;
use crate::WorkerError;
use umbp_ipc::dial::Attached;

pub(crate) struct Connection {
    pub sq: Producer<'static, Sqe>,
    pub cq: Consumer<'static, Cqe>,
    pub arena: Arena,
    pub alloc: ArenaAllocator,
    pub doorbell: Doorbell,
    pub sock: UnixStream,
    /// Alloc id the caller knows (from the first attachment) -> id on this attachment.
    pub alloc_ids: HashMap<u32, u32>,
    /// Replies the pool still owes for control requests that timed out. The socket is a
    /// byte stream, so they are read and dropped before the next request's reply.
    owed_replies: u32,
    pub attachment_id: u32,
    pub cq_capacity: u32,
    /// The pool's pid from SO_PEERCRED of this socket (0: another pid namespace).
    pub pool_pid: u32,
    /// The pool's process, held by a pidfd taken at attach (`SO_PEERPIDFD` of this socket,
    /// else `pidfd_open` of the verified pid): tells "the pool process is dead" (its copies
    /// into our memory are over) from "the socket broke" (they may still run).
    pool_process: Option<umbp_ipc::peer::PeerProcess>,
    // Last field, so dropped last: `sq`, `cq` and `arena` point into this mapping.
    _shm: SharedMemory,
}

impl Connection {
    pub fn new(a: Attached) -> Result<Self, WorkerError> {
        let r = a.reply;
        let layout = AttachmentLayout::new(r.sq_entries, r.cq_entries, r.hint_entries, r.arena_bytes)?;
        let mut fds = a.fds.into_iter();
        let (Some(ring_fd), Some(_index_fd), Some(bell_fd)) = (fds.next(), fds.next(), fds.next()) else {
            return Err(WorkerError::Invalid("HelloReply lacks its fds".into()));
        };
        let shm = SharedMemory::from_received(ring_fd, layout.total_bytes, true)?;
        let base = shm.as_ptr();
        // SAFETY: `from_received` checked the mapping covers `total_bytes`, and each section
        // lies inside it (AttachmentLayout). The mapping is owned by `_shm`, which this
        // struct drops after the handles that borrow it, and moving `SharedMemory` does not
        // move the mapping, so `'static` here means "as long as this Connection".
        let (sq, cq, arena) = unsafe {
            let sq = Ring::<Sqe>::attach(base.add(layout.sq_offset), layout.sq_bytes())?.producer();
            let cq = Ring::<Cqe>::attach(base.add(layout.cq_offset), layout.cq_bytes())?.consumer();
            let arena = Arena::new(base.add(layout.arena_offset), layout.arena_bytes);
            (sq, cq, arena)
        };
        let pool_process = umbp_ipc::peer::PeerProcess::capture(std::os::fd::AsFd::as_fd(&a.sock))
            .ok()
            .filter(|p| p.pidfd().is_some() && p.pid() == Some(a.pool.pid));
        Ok(Self {
            sq,
            cq,
            alloc: ArenaAllocator::new(arena.len()),
            arena,
            doorbell: Doorbell::from_fd(bell_fd),
            sock: a.sock,
            alloc_ids: HashMap::new(),
            owed_replies: 0,
            attachment_id: r.attachment_id,
            cq_capacity: layout.cq_entries,
            pool_pid: a.pool.pid,
            pool_process,
            _shm: shm,
        })
    }

    /// Whether the pool's process is known to have exited: Some(true) dead, Some(false)
    /// alive, None unknown (its pid is not visible here: another pid namespace).
    pub fn pool_dead(&self) -> Option<bool> {
        let pidfd = self.pool_process.as_ref()?.pidfd()?;
        Some(umbp_ipc::peer::pidfd_exited(pidfd))
    }

    /// A duplicate of the pool's pidfd (the fence watchdog's), if there is one.
    pub fn pool_pidfd(&self) -> Option<std::os::fd::OwnedFd> {
        self.pool_process.as_ref()?.pidfd()?.try_clone_to_owned().ok()
    }

    /// One control request and its `Reply`; returns the reply's value.
    pub fn control(&mut self, kind: MessageKind, payload: &[u8], fds: &[BorrowedFd<'_>], timeout: Duration) -> Result<u64, WorkerError> {
        let stalled = || WorkerError::Stalled { oldest_ms: timeout.as_millis() as u64 };
        while self.owed_replies > 0 {
            match recv_message(&self.sock, Some(timeout)) {
                Ok(_) => self.owed_replies -= 1,
                Err(MessageError::Timeout) => return Err(stalled()),
                Err(e) => return Err(e.into()),
            }
        }
        send_message(&self.sock, kind, payload, fds, Some(timeout))?;
        let msg = match recv_message(&self.sock, Some(timeout)) {
            Ok(m) => m,
            Err(MessageError::Timeout) => {
                self.owed_replies += 1;
                return Err(stalled());
            }
            Err(e) => return Err(e.into()),
        };
        if msg.kind != MessageKind::Reply {
            return Err(WorkerError::Invalid(format!("pool answered {kind:?} with {:?}", msg.kind)));
        }
        let reply: Reply = decode(&msg.payload)?;
        if reply.status != ReplyStatus::Ok as u32 {
            let status = ReplyStatus::from_u32(reply.status);
            return Err(WorkerError::Refused { message: format!("{kind:?}: {status:?}: {}", reply.message()) });
        }
        Ok(reply.value)
    }

    /// Registers one allocation; returns the pool's id for it on this attachment.
    pub fn register_memory(&mut self, reg: &MemoryRegistration, fd: Option<BorrowedFd<'_>>, timeout: Duration) -> Result<u32, WorkerError> {
        let fds: Vec<BorrowedFd<'_>> = fd.into_iter().collect();
        if reg.kind == umbp_protocol::wire::MemoryKind::HostProcess as u32 {
            // Under Yama, let exactly this pool (its verified pid) open our memory; done on
            // every (re)registration, so a restarted pool is named, not the old one.
            umbp_gpu::host::allow_pool_ptrace(self.pool_pid).map_err(|source| WorkerError::Gpu {
                what: format!("allowing the pool (pid {}) to read this process's memory", self.pool_pid),
                source,
            })?;
        }
        let value = self.control(MessageKind::RegisterMemory, bytemuck::bytes_of(reg), &fds, timeout)?;
        u32::try_from(value).map_err(|_| WorkerError::Invalid(format!("pool returned alloc id {value}, not a u32")))
    }

    /// Registers a layout whose segments name caller-side alloc ids; returns object bytes.
    pub fn register_layout(&mut self, group: u16, segments: &[Segment], timeout: Duration) -> Result<u64, WorkerError> {
        let header = LayoutHeader { group: group as u32, segment_count: segments.len() as u32 };
        let mut payload = Vec::with_capacity(8 + core::mem::size_of_val(segments));
        payload.extend_from_slice(bytemuck::bytes_of(&header));
        for s in segments {
            let alloc_id = *self
                .alloc_ids
                .get(&s.alloc_id)
                .ok_or_else(|| WorkerError::Invalid(format!("segment names alloc id {}, never registered", s.alloc_id)))?;
            payload.extend_from_slice(bytemuck::bytes_of(&Segment { alloc_id, ..*s }));
        }
        self.control(MessageKind::RegisterLayout, &payload, &[], timeout)
    }
}
