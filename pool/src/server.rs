//! The socket side: binding (never stealing a live socket), handshakes, control messages
//! and peer liveness (EOF on the socket = peer gone).

use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use umbp_ipc::message::{peer_gone, recv_message, send_message, MessageError};
use umbp_protocol::layout::KvLayout;
use umbp_protocol::wire::{HelloReply, MessageKind, Reply, ReplyStatus, Role};
use umbp_protocol::{MAGIC, PROTOCOL_VERSION};

use crate::attachment::Attachment;
use crate::poller::Poller;
use crate::validate::{self, AcceptedHello};
use crate::{PoolError, PoolInner};

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
const CONTROL_TIMEOUT: Duration = Duration::from_secs(1);
const TOKEN_LISTENER: u64 = u64::MAX;
/// Handshakes in progress (each on its own short-lived thread), in this process.
static HANDSHAKES: AtomicUsize = AtomicUsize::new(0);
/// More concurrent handshakes than this are refused at once (connection floods).
const MAX_HANDSHAKES: usize = 64;
const TOKEN_WAKE: u64 = u64::MAX - 1;

/// Binds the pool socket (mode 0660, group `group` when given: its members may connect;
/// the uid allow-list still applies). A live pool at the path is never displaced; a stale
/// socket file (its pool died) is replaced.
pub fn bind(path: &Path, group: Option<u32>) -> Result<UnixListener, PoolError> {
    let err = |message: String| PoolError::Socket { path: path.to_path_buf(), message };
    // Whoever may rename entries in the directory may put their socket in place of ours:
    // refuse a directory of another user or one others may write (docs/security.md).
    if let Some(dir) = path.parent() {
        umbp_ipc::sockdir::prepare_socket_dir(dir, group).map_err(|e| err(e.to_string()))?;
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
    if let Some(gid) = group {
        std::os::unix::fs::lchown(path, None, Some(gid))
            .map_err(|e| err(format!("cannot give the socket to group {gid} (--socket-group): {e}")))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .map_err(|e| err(format!("cannot set the socket's mode to 0660: {e}")))?;
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
            if let std::collections::hash_map::Entry::Vacant(slot) = known.entry(att.id) {
                let _ = poller.add(att.socket.as_fd(), att.id as u64);
                slot.insert(att.clone());
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
                // A peer that stalls mid-handshake costs one short-lived thread, not the
                // control loop; a flood of them is refused past MAX_HANDSHAKES.
                if HANDSHAKES.fetch_add(1, Ordering::AcqRel) >= MAX_HANDSHAKES {
                    HANDSHAKES.fetch_sub(1, Ordering::AcqRel);
                    let _ = sock.set_nonblocking(true);
                    refuse(&sock, inner, ReplyStatus::ResourceExhausted, format!("{MAX_HANDSHAKES} handshakes in progress; retry"));
                    continue;
                }
                let inner = inner.clone();
                let spawned = std::thread::Builder::new().name("umbp-handshake".into()).spawn(move || {
                    if let Err(e) = handshake(&inner, sock) {
                        tracing::info!("handshake refused: {e}");
                    }
                    HANDSHAKES.fetch_sub(1, Ordering::AcqRel);
                });
                if spawned.is_err() {
                    HANDSHAKES.fetch_sub(1, Ordering::AcqRel);
                }
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
    // Identity first, before reading anything: SO_PEERCRED (pid 0 = another pid namespace,
    // served without process memory) and a pidfd of the process that connected.
    let process = umbp_ipc::peer::PeerProcess::capture(sock.as_fd()).map_err(|e| format!("SO_PEERCRED: {e}"))?;
    let (uid, pid) = (process.cred.uid, process.cred.pid);
    let msg = recv_message(&sock, Some(HANDSHAKE_TIMEOUT)).map_err(|e| format!("pid {pid}: {e}"))?;
    if msg.kind != MessageKind::Hello {
        return Err(refuse(&sock, inner, ReplyStatus::InvalidRequest, format!("expected Hello, got {:?}", msg.kind)));
    }
    // Magic, version, role, uid allow-list, namespace ACL, ring and arena limits.
    let AcceptedHello { hello, role, layout } = validate::check_hello(&msg.payload, uid, inner.uid, &inner.config)
        .map_err(|r| refuse(&sock, inner, r.status, r.message))?;
    let count_check = |list: &[Arc<Attachment>]| {
        let of_uid = list.iter().filter(|a| a.uid == uid).count();
        validate::check_attachment_count(list.len(), of_uid, uid, &inner.config)
    };
    // A cheap early check; the binding one is below, under the same lock as the insert.
    let early = count_check(&inner.attachments.lock().expect("attachments lock"));
    early.map_err(|r| refuse(&sock, inner, r.status, r.message))?;
    let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
    let sock2 = sock.try_clone().map_err(|e| e.to_string())?;
    let att = Attachment::create(id, role, process, &hello, layout, sock2)
        .map_err(|e| refuse(&sock, inner, ReplyStatus::Internal, format!("cannot create rings: {e}")))?;
    let att = Arc::new(att);
    {
        let mut list = inner.attachments.lock().expect("attachments lock");
        if let Err(r) = count_check(&list) {
            drop(list);
            return Err(refuse(&sock, inner, r.status, r.message));
        }
        // Counted from now on, so concurrent handshakes of one uid cannot overshoot.
        list.push(att.clone());
    }
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
    reply.event_log_bytes = inner.events_mem.len() as u64;
    reply.pool_pid = std::process::id();
    let fds = [att.ring_mem.fd(), inner.index_mem.fd(), att.doorbell.fd(), inner.events_mem.fd()];
    if let Err(e) = send_message(&sock, MessageKind::HelloReply, bytemuck::bytes_of(&reply), &fds, Some(HANDSHAKE_TIMEOUT)) {
        detach(inner, &att, "handshake reply not delivered");
        return Err(format!("pid {pid}: sending reply: {e}"));
    }
    tracing::info!(attachment = id, pid, uid, ?role, namespace = format!("{:032x}", hello.namespace()), "attached");
    inner.counters.attachments_total.fetch_add(1, Ordering::Relaxed);
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
        MessageKind::RegisterMemory => (register_memory(inner, att, &msg.payload, msg.fds), Vec::new()),
        MessageKind::RegisterLayout => (register_layout(inner, att, &msg.payload), Vec::new()),
        MessageKind::ResetNamespace => {
            let n = inner.store.lock().expect("store lock").reset_namespace(att.namespace);
            tracing::info!(attachment = att.id, dropped = n, "namespace reset");
            (Reply::ok(n), Vec::new())
        }
        MessageKind::StatsRequest => {
            let json = serde_json::to_vec(&crate::report::for_peer(inner, att)).unwrap_or_default();
            (Reply::ok(json.len() as u64), json)
        }
        other => (Reply::error(ReplyStatus::InvalidRequest, &format!("unexpected message {other:?}")), Vec::new()),
    };
    let mut payload = bytemuck::bytes_of(&reply).to_vec();
    payload.extend_from_slice(&extra);
    send_message(&att.socket, MessageKind::Reply, &payload, &[], Some(CONTROL_TIMEOUT))
        .map_err(|e| format!("sending reply: {e}"))
}

fn register_memory(inner: &PoolInner, att: &Attachment, payload: &[u8], fds: Vec<std::os::fd::OwnedFd>) -> Reply {
    let (reg, kind) = match validate::parse_memory_registration(payload) {
        Ok(r) => r,
        Err(r) => return Reply::error(r.status, &r.message),
    };
    if att.role != Role::Worker {
        return Reply::error(ReplyStatus::PermissionDenied, "only workers register memory");
    }
    if att.regions.read().expect("regions lock").contains_key(&reg.alloc_id) {
        return Reply::error(ReplyStatus::InvalidRequest, &format!("alloc_id {} is already registered", reg.alloc_id));
    }
    // --max-regions / --max-registered-bytes, on the claimed size before opening anything.
    let (count, bytes) = (att.regions.read().expect("regions lock").len(), att.registered_bytes());
    if let Err(r) = validate::check_registration(count, bytes, reg.size, &inner.config.limits) {
        tracing::warn!(attachment = att.id, pid = att.pid, "memory registration refused: {}", r.message);
        return Reply::error(r.status, &r.message);
    }
    let backend = match umbp_gpu::backend_for(kind) {
        Ok(b) => b,
        Err(e) => {
            let hint = match kind {
                umbp_protocol::wire::MemoryKind::Cuda | umbp_protocol::wire::MemoryKind::Hip => {
                    " (umbp-pool must see every GPU its workers use: check its CUDA_VISIBLE_DEVICES / container devices)"
                }
                _ => "",
            };
            return Reply::error(ReplyStatus::Unsupported, &format!("{kind:?} memory: {e}{hint}"));
        }
    };
    // The pid comes from SO_PEERCRED, never from the message, and is checked to still be
    // the process that connected, running as the peer's uid (HostProcess; item 1 of #13).
    let verify = || att.process.verify();
    let peer = umbp_gpu::Peer { attachment: att.id, pid: att.pid, pidfd: att.process.pidfd(), verify: &verify };
    match backend.open_region_for(&reg, fds.into_iter().next(), &peer) {
        Ok(region) => {
            // The opened size is what copies may touch; check it too.
            if let Err(r) = validate::check_registration(count, bytes, region.len(), &inner.config.limits) {
                return Reply::error(r.status, &r.message);
            }
            tracing::info!(attachment = att.id, alloc = reg.alloc_id, ?kind, bytes = region.len(), "memory registered");
            att.regions.write().expect("regions lock").insert(reg.alloc_id, Arc::from(region));
            att.region_devices.lock().expect("devices lock").insert(reg.alloc_id, reg.device_uuid);
            Reply::ok(reg.alloc_id as u64)
        }
        Err(e) => Reply::error(ReplyStatus::InvalidRequest, &format!("alloc_id {}: {e}", reg.alloc_id)),
    }
}

fn register_layout(inner: &PoolInner, att: &Attachment, payload: &[u8]) -> Reply {
    let (group, segments) = match validate::parse_layout(payload) {
        Ok(p) => p,
        Err(r) => return Reply::error(r.status, &r.message),
    };
    {
        let layouts = att.layouts.read().expect("layouts lock");
        if let Err(r) = validate::check_layout_count(layouts.len(), layouts.contains_key(&group), &inner.config.limits) {
            return Reply::error(r.status, &r.message);
        }
    }
    let layout = {
        let regions = att.regions.read().expect("regions lock");
        KvLayout::new(segments, |id| regions.get(&id).map(|r| r.len()))
    };
    match layout {
        Ok(l) => {
            let bytes = l.object_bytes();
            if let Err(r) = validate::check_layout_object(group, bytes, inner.config.min_object_bytes) {
                tracing::warn!(attachment = att.id, pid = att.pid, "{}", r.message);
                return Reply::error(r.status, &r.message);
            }
            tracing::info!(attachment = att.id, group, object_bytes = bytes, blocks = l.num_blocks(), "layout registered");
            att.layouts.write().expect("layouts lock").insert(group, Arc::new(l));
            Reply::ok(bytes)
        }
        Err(e) => Reply::error(ReplyStatus::InvalidRequest, &format!("RegisterLayout group {group}: {e}")),
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
