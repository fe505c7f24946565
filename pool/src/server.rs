//! The socket side: binding (never stealing a live socket), handshakes, control messages
//! and peer liveness (EOF on the socket = peer gone).

use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use umbp_ipc::message::{peer_gone, recv_message, send_message, MessageError};
use umbp_protocol::attachment::AttachmentLayout;
use umbp_protocol::layout::{KvLayout, Segment};
use umbp_protocol::wire::{
    self, Hello, HelloReply, LayoutHeader, MemoryKind, MemoryRegistration, MessageKind, Reply, ReplyStatus, Role,
};
use umbp_protocol::{MAGIC, PROTOCOL_VERSION};

use crate::attachment::Attachment;
use crate::poller::Poller;
use crate::{PoolError, PoolInner};

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
const CONTROL_TIMEOUT: Duration = Duration::from_secs(1);
const TOKEN_LISTENER: u64 = u64::MAX;
const TOKEN_WAKE: u64 = u64::MAX - 1;

/// Binds the pool socket. A live pool at the path is never displaced; a stale socket
/// file (its pool died) is replaced.
pub fn bind(path: &Path) -> Result<UnixListener, PoolError> {
    let err = |message: String| PoolError::Socket { path: path.to_path_buf(), message };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| err(format!("cannot create directory {}: {e}", dir.display())))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) => {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                return Err(err("exists and is not a socket; refusing to replace it".into()));
            }
            if UnixStream::connect(path).is_ok() {
                return Err(PoolError::AddressInUse(path.to_path_buf()));
            }
            tracing::info!(socket = %path.display(), "replacing stale socket left by a dead pool");
            std::fs::remove_file(path).map_err(|e| err(format!("cannot remove stale socket: {e}")))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e.to_string())),
    }
    let listener = UnixListener::bind(path).map_err(|e| err(format!("bind failed: {e}")))?;
    // Group members may attach (engines often run under a service group); others may not.
    let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660));
    listener.set_nonblocking(true)?;
    Ok(listener)
}

pub fn run_control(inner: &Arc<PoolInner>, listener: UnixListener) {
    let mut poller = Poller::new().expect("epoll");
    poller.add(listener.as_fd(), TOKEN_LISTENER).expect("epoll add listener");
    poller.add(inner.control_wake.fd(), TOKEN_WAKE).expect("epoll add wake");
    let mut known: std::collections::HashMap<u32, Arc<Attachment>> = Default::default();
    while !inner.is_shutting_down() {
        for token in poller.wait(Some(Duration::from_millis(200))) {
            match token {
                TOKEN_LISTENER => accept_all(inner, &listener),
                TOKEN_WAKE => {
                    inner.control_wake.drain();
                }
                id => {
                    let Some(att) = known.get(&(id as u32)).cloned() else { continue };
                    if let Err(why) = serve_control(inner, &att) {
                        detach(inner, &att, &why);
                        poller.remove(att.socket.as_fd());
                        known.remove(&att.id);
                    }
                }
            }
        }
        // Pick up attachments whose handshake finished; drop ones that died elsewhere.
        let current = inner.attachments.lock().expect("attachments lock").clone();
        for att in &current {
            if !known.contains_key(&att.id) {
                let _ = poller.add(att.socket.as_fd(), att.id as u64);
                known.insert(att.id, att.clone());
            }
        }
        known.retain(|id, att| {
            let keep = att.is_alive() && current.iter().any(|a| a.id == *id);
            if !keep {
                poller.remove(att.socket.as_fd());
                detach(inner, att, "detached");
            }
            keep
        });
    }
}

fn accept_all(inner: &Arc<PoolInner>, listener: &UnixListener) {
    loop {
        match listener.accept() {
            Ok((sock, _)) => {
                let inner = inner.clone();
                // A peer that stalls mid-handshake costs one short-lived thread, not the
                // control loop.
                let _ = std::thread::Builder::new().name("umbp-handshake".into()).spawn(move || {
                    if let Err(e) = handshake(&inner, sock) {
                        tracing::info!("handshake refused: {e}");
                    }
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                return;
            }
        }
    }
}

fn refuse(sock: &UnixStream, inner: &PoolInner, status: ReplyStatus, message: String) -> String {
    inner.counters.refusals.fetch_add(1, Ordering::Relaxed);
    let reply = HelloReply::refusal(status, &message);
    let _ = send_message(sock, MessageKind::HelloReply, bytemuck::bytes_of(&reply), &[], Some(HANDSHAKE_TIMEOUT));
    message
}

fn handshake(inner: &Arc<PoolInner>, sock: UnixStream) -> Result<(), String> {
    sock.set_nonblocking(false).map_err(|e| e.to_string())?;
    let cred = rustix::net::sockopt::socket_peercred(&sock).map_err(|e| format!("SO_PEERCRED: {e}"))?;
    let (uid, pid) = (cred.uid.as_raw(), cred.pid.as_raw_nonzero().get() as u32);
    let msg = recv_message(&sock, Some(HANDSHAKE_TIMEOUT)).map_err(|e| format!("pid {pid}: {e}"))?;
    if msg.kind != MessageKind::Hello {
        return Err(refuse(&sock, inner, ReplyStatus::InvalidRequest, format!("expected Hello, got {:?}", msg.kind)));
    }
    let hello: Hello = wire::decode(&msg.payload)
        .map_err(|e| refuse(&sock, inner, ReplyStatus::InvalidRequest, format!("bad Hello: {e}")))?;
    let role = match hello.validate() {
        Ok(r) => r,
        Err(e @ umbp_protocol::ProtocolError::VersionMismatch { .. }) => {
            return Err(refuse(&sock, inner, ReplyStatus::VersionMismatch, format!("umbp-pool refuses: {e}")))
        }
        Err(e) => return Err(refuse(&sock, inner, ReplyStatus::BadMagic, format!("umbp-pool refuses: {e}"))),
    };
    if !(uid == inner.uid || uid == 0 || inner.config.allow_uids.contains(&uid)) {
        return Err(refuse(
            &sock,
            inner,
            ReplyStatus::PermissionDenied,
            format!("uid {uid} is not allowed by this pool (start it with --allow-uid {uid})"),
        ));
    }
    let live = inner.attachments.lock().expect("attachments lock").len();
    if live >= inner.config.max_attachments {
        return Err(refuse(&sock, inner, ReplyStatus::ResourceExhausted, format!("pool has {live} attachments, the limit")));
    }
    let sq = if hello.sq_entries == 0 { inner.config.default_sq_entries } else { hello.sq_entries };
    let arena = if hello.arena_bytes == 0 { inner.config.default_arena_bytes } else { hello.arena_bytes };
    let layout = AttachmentLayout::new(sq, sq.saturating_mul(2).min(umbp_protocol::ring::MAX_RING_CAPACITY), 1024, arena)
        .map_err(|e| refuse(&sock, inner, ReplyStatus::InvalidRequest, format!("bad ring sizes: {e}")))?;
    let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
    let sock2 = sock.try_clone().map_err(|e| e.to_string())?;
    let att = Attachment::create(id, role, pid, uid, &hello, layout, sock2)
        .map_err(|e| refuse(&sock, inner, ReplyStatus::Internal, format!("cannot create rings: {e}")))?;
    let mut reply = HelloReply::refusal(ReplyStatus::Ok, "");
    reply.magic = MAGIC;
    reply.protocol_version = PROTOCOL_VERSION;
    reply.attachment_id = id;
    reply.sq_entries = layout.sq_entries;
    reply.cq_entries = layout.cq_entries;
    reply.hint_entries = layout.hint_entries;
    reply.arena_bytes = layout.arena_bytes as u64;
    reply.ring_region_bytes = layout.total_bytes as u64;
    reply.index_region_bytes = inner.index_mem.len() as u64;
    reply.pool_pid = std::process::id();
    let fds = [att.ring_mem.fd(), inner.index_mem.fd(), att.doorbell.fd()];
    send_message(&sock, MessageKind::HelloReply, bytemuck::bytes_of(&reply), &fds, Some(HANDSHAKE_TIMEOUT))
        .map_err(|e| format!("pid {pid}: sending reply: {e}"))?;
    tracing::info!(attachment = id, pid, uid, ?role, namespace = format!("{:032x}", hello.namespace()), "attached");
    inner.counters.attachments_total.fetch_add(1, Ordering::Relaxed);
    inner.attachments.lock().expect("attachments lock").push(Arc::new(att));
    inner.service_wake.ring();
    inner.control_wake.ring();
    Ok(())
}

/// Handles one readable event on a peer socket; Err means the peer is gone or broke the
/// protocol and must be detached.
fn serve_control(inner: &PoolInner, att: &Arc<Attachment>) -> Result<(), String> {
    if peer_gone(&att.socket) {
        return Err("peer closed its socket".into());
    }
    let msg = match recv_message(&att.socket, Some(CONTROL_TIMEOUT)) {
        Ok(m) => m,
        Err(MessageError::Closed) => return Err("peer closed its socket".into()),
        Err(e) => return Err(format!("control message: {e}")),
    };
    let (reply, extra) = match msg.kind {
        MessageKind::RegisterMemory => (register_memory(att, &msg.payload, msg.fds), Vec::new()),
        MessageKind::RegisterLayout => (register_layout(att, &msg.payload), Vec::new()),
        MessageKind::ResetNamespace => {
            let n = inner.store.lock().expect("store lock").reset_namespace(att.namespace);
            tracing::info!(attachment = att.id, dropped = n, "namespace reset");
            (Reply::ok(n), Vec::new())
        }
        MessageKind::StatsRequest => {
            let json = serde_json::to_vec(&crate::report::build(inner)).unwrap_or_default();
            (Reply::ok(json.len() as u64), json)
        }
        other => (Reply::error(ReplyStatus::InvalidRequest, &format!("unexpected message {other:?}")), Vec::new()),
    };
    let mut payload = bytemuck::bytes_of(&reply).to_vec();
    payload.extend_from_slice(&extra);
    send_message(&att.socket, MessageKind::Reply, &payload, &[], Some(CONTROL_TIMEOUT))
        .map_err(|e| format!("sending reply: {e}"))
}

fn register_memory(att: &Attachment, payload: &[u8], fds: Vec<std::os::fd::OwnedFd>) -> Reply {
    let reg: MemoryRegistration = match wire::decode(payload) {
        Ok(r) => r,
        Err(e) => return Reply::error(ReplyStatus::InvalidRequest, &format!("RegisterMemory: {e}")),
    };
    if att.role != Role::Worker {
        return Reply::error(ReplyStatus::PermissionDenied, "only workers register memory");
    }
    let kind = match MemoryKind::from_u32(reg.kind) {
        Ok(k) => k,
        Err(e) => return Reply::error(ReplyStatus::InvalidRequest, &format!("RegisterMemory: {e}")),
    };
    if att.regions.read().expect("regions lock").contains_key(&reg.alloc_id) {
        return Reply::error(ReplyStatus::InvalidRequest, &format!("alloc_id {} is already registered", reg.alloc_id));
    }
    let backend = match umbp_gpu::backend_for(kind) {
        Ok(b) => b,
        Err(e) => return Reply::error(ReplyStatus::Unsupported, &format!("{kind:?} memory: {e}")),
    };
    // The pid comes from SO_PEERCRED, never from the message.
    match backend.open_region(&reg, fds.into_iter().next(), att.pid) {
        Ok(region) => {
            tracing::info!(attachment = att.id, alloc = reg.alloc_id, ?kind, bytes = region.len(), "memory registered");
            att.regions.write().expect("regions lock").insert(reg.alloc_id, Arc::from(region));
            Reply::ok(reg.alloc_id as u64)
        }
        Err(e) => Reply::error(ReplyStatus::InvalidRequest, &format!("alloc_id {}: {e}", reg.alloc_id)),
    }
}

fn register_layout(att: &Attachment, payload: &[u8]) -> Reply {
    let header: LayoutHeader = match wire::decode(payload) {
        Ok(h) => h,
        Err(e) => return Reply::error(ReplyStatus::InvalidRequest, &format!("RegisterLayout: {e}")),
    };
    if header.group > u16::MAX as u32 || header.segment_count > wire::MAX_SEGMENTS {
        return Reply::error(ReplyStatus::InvalidRequest, "RegisterLayout: group or segment count out of range");
    }
    let seg_bytes = &payload[std::mem::size_of::<LayoutHeader>()..];
    let need = header.segment_count as usize * std::mem::size_of::<Segment>();
    if seg_bytes.len() < need {
        return Reply::error(ReplyStatus::InvalidRequest, &format!("RegisterLayout: truncated: need {need} segment bytes"));
    }
    let segments: Vec<Segment> =
        seg_bytes[..need].chunks_exact(std::mem::size_of::<Segment>()).map(bytemuck::pod_read_unaligned).collect();
    let layout = {
        let regions = att.regions.read().expect("regions lock");
        KvLayout::new(segments, |id| regions.get(&id).map(|r| r.len()))
    };
    match layout {
        Ok(l) => {
            let bytes = l.object_bytes();
            tracing::info!(attachment = att.id, group = header.group, object_bytes = bytes, blocks = l.num_blocks(), "layout registered");
            att.layouts.write().expect("layouts lock").insert(header.group as u16, Arc::new(l));
            Reply::ok(bytes)
        }
        Err(e) => Reply::error(ReplyStatus::InvalidRequest, &format!("RegisterLayout group {}: {e}", header.group)),
    }
}

/// Marks a peer gone: the service thread stops serving it; copy jobs already queued see
/// `alive == false` and cancel; regions close when the last job drops its reference.
pub fn detach(inner: &PoolInner, att: &Arc<Attachment>, why: &str) {
    att.alive.store(false, Ordering::Release);
    let _ = att.socket.shutdown(std::net::Shutdown::Both);
    let mut list = inner.attachments.lock().expect("attachments lock");
    let before = list.len();
    list.retain(|a| a.id != att.id);
    if list.len() != before {
        tracing::info!(attachment = att.id, pid = att.pid, "{why}");
    }
    drop(list);
    inner.service_wake.ring();
}
