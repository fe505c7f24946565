//! Shared test plumbing: a real `umbp-pool` process on a private socket, and a
//! hand-crafted raw peer that speaks the wire protocol directly (for bad-input tests).
#![allow(dead_code)]

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use umbp_ipc::message::{recv_message, send_message};
use umbp_ipc::SharedMemory;
use umbp_protocol::attachment::AttachmentLayout;
use umbp_protocol::entries::{Cqe, Sqe};
use umbp_protocol::layout::Segment;
use umbp_protocol::ring::{Consumer, Producer, Ring};
use umbp_protocol::wire::{self, Hello, HelloReply, LayoutHeader, MessageKind, Reply, Role};

// Pool processes, socket dirs and the wrapper hook are the integration-test crate's; this
// file only adds the hand-crafted peer.
pub use umbp_integration_tests::{unique_socket, PoolProcess};

/// A small pool (64 MiB, 4 KiB minimum objects) at `socket`; `extra` flags come after the
/// defaults and override them.
pub fn start_pool(socket: &Path, extra: &[&str]) -> PoolProcess {
    let mut args = vec!["--capacity", "64MiB", "--min-object-size", "4KiB"];
    args.extend_from_slice(extra);
    PoolProcess::start(socket, &args)
}

/// A peer that speaks the protocol by hand.
pub struct RawPeer {
    pub sock: UnixStream,
    pub reply: HelloReply,
    pub rings: SharedMemory,
    pub index: SharedMemory,
    pub doorbell: OwnedFd,
    /// The KV event log (fourth fd, read-only).
    pub events: SharedMemory,
    pub layout: AttachmentLayout,
}

pub fn handshake(sock: &UnixStream, hello: &Hello) -> Result<(HelloReply, Vec<OwnedFd>), String> {
    send_message(sock, MessageKind::Hello, bytemuck::bytes_of(hello), &[], Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
    let m = recv_message(sock, Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
    assert_eq!(m.kind, MessageKind::HelloReply);
    let reply: HelloReply = wire::decode(&m.payload).unwrap();
    if reply.status != 0 {
        return Err(reply.message());
    }
    Ok((reply, m.fds))
}

impl RawPeer {
    pub fn attach(socket: &Path, role: Role, namespace: u128) -> Result<Self, String> {
        let sock = UnixStream::connect(socket).map_err(|e| e.to_string())?;
        let hello = Hello::new(role, namespace, std::process::id());
        let (reply, fds) = handshake(&sock, &hello)?;
        let mut fds = fds.into_iter();
        let layout = AttachmentLayout::new(reply.sq_entries, reply.cq_entries, reply.hint_entries, reply.arena_bytes).unwrap();
        let rings = SharedMemory::from_received(fds.next().unwrap(), layout.total_bytes, true).unwrap();
        let index = SharedMemory::from_received(fds.next().unwrap(), reply.index_region_bytes as usize, false).unwrap();
        let doorbell = fds.next().unwrap();
        let events = SharedMemory::from_received(fds.next().expect("4th fd: event log"), reply.event_log_bytes as usize, false).unwrap();
        assert!(fds.next().is_none(), "HelloReply carries exactly 4 fds");
        Ok(Self { sock, reply, rings, index, doorbell, events, layout })
    }

    /// Sends a control message and returns the reply and any bytes after it.
    pub fn control(&mut self, kind: MessageKind, payload: &[u8], fds: &[std::os::fd::BorrowedFd<'_>]) -> (Reply, Vec<u8>) {
        send_message(&self.sock, kind, payload, fds, Some(Duration::from_secs(5))).unwrap();
        let m = recv_message(&self.sock, Some(Duration::from_secs(5))).unwrap();
        assert_eq!(m.kind, MessageKind::Reply);
        let r: Reply = wire::decode(&m.payload).unwrap();
        (r, m.payload[std::mem::size_of::<Reply>()..].to_vec())
    }

    /// The pool's full state report, asked on this peer's own socket.
    pub fn stats(&mut self) -> umbp_pool::PoolReport {
        umbp_integration_tests::report::request_report_bytes(&self.sock)
            .and_then(|json| umbp_integration_tests::report::parse_full_report(&json))
            .unwrap_or_else(|e| panic!("report: {e}"))
    }

    pub fn sq(&self) -> Producer<'_, Sqe> {
        // SAFETY: the section lies inside our mapping (AttachmentLayout from the reply).
        unsafe { Ring::<Sqe>::attach(self.rings.as_ptr().add(self.layout.sq_offset), self.layout.sq_bytes()) }.unwrap().producer()
    }

    pub fn cq(&self) -> Consumer<'_, Cqe> {
        // SAFETY: as above.
        unsafe { Ring::<Cqe>::attach(self.rings.as_ptr().add(self.layout.cq_offset), self.layout.cq_bytes()) }.unwrap().consumer()
    }

    pub fn arena(&self) -> umbp_protocol::arena::Arena {
        // SAFETY: as above.
        unsafe { umbp_protocol::arena::Arena::new(self.rings.as_ptr().add(self.layout.arena_offset), self.layout.arena_bytes) }
    }

    pub fn ring_doorbell(&self) {
        let _ = rustix::io::write(&self.doorbell, &1u64.to_ne_bytes());
    }

    /// Submits SQEs and waits for that many CQEs.
    pub fn submit_and_reap(&self, sqes: &[Sqe]) -> Vec<Cqe> {
        let mut sq = self.sq();
        let mut cq = self.cq();
        for s in sqes {
            assert!(sq.try_push(*s).unwrap());
        }
        if sq.publish() {
            self.ring_doorbell();
        }
        let mut out = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while out.len() < sqes.len() {
            assert!(Instant::now() < deadline, "no completion within 10 s");
            cq.wait(100, Some(Duration::from_millis(100))).unwrap();
            cq.pop_batch(&mut out, 64).unwrap();
        }
        out
    }
}

/// A worker peer in namespace `ns` with one memfd region of `blocks` pages of `page` bytes,
/// every byte `fill`, registered as alloc 0, and layout group 0 of one segment over it
/// (objects of one page).
pub fn memfd_worker(pool: &PoolProcess, ns: u128, page: u64, blocks: u64, fill: u8) -> (RawPeer, SharedMemory) {
    memfd_worker_at(&pool.socket, ns, page, blocks, fill)
}

/// [`memfd_worker`] for a pool listening at `socket` (also an in-process one).
pub fn memfd_worker_at(socket: &Path, ns: u128, page: u64, blocks: u64, fill: u8) -> (RawPeer, SharedMemory) {
    let mut peer = RawPeer::attach(socket, Role::Worker, ns).unwrap();
    let mem = SharedMemory::create("kv", (page * blocks) as usize, false).unwrap();
    // SAFETY: inside the mapping.
    unsafe { std::ptr::write_bytes(mem.as_ptr(), fill, (page * blocks) as usize) };
    let reg = umbp_gpu::host::export_memfd(mem.fd(), 0, page * blocks, 0).unwrap();
    let (r, _) = peer.control(MessageKind::RegisterMemory, bytemuck::bytes_of(&reg), &[mem.fd()]);
    assert_eq!(r.status, 0, "{}", r.message());
    let mut msg = bytemuck::bytes_of(&LayoutHeader { group: 0, segment_count: 1 }).to_vec();
    msg.extend_from_slice(bytemuck::bytes_of(&Segment::new(0, 0, page, page, blocks)));
    let (r, _) = peer.control(MessageKind::RegisterLayout, &msg, &[]);
    assert_eq!(r.status, 0, "{}", r.message());
    assert_eq!(r.value, page);
    (peer, mem)
}
