//! The socket side: binding (never stealing a live socket), and the control loop:
//! accepts, handshakes, control messages and peer liveness (EOF on the socket = peer gone)
//! as one non-blocking event loop over per-peer state machines (control.rs).

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::net::RecvFlags;
use umbp_ipc::message::{recv_chunk, send_chunk, MessageError};
use umbp_protocol::wire::{HelloReply, MessageKind, Reply, ReplyStatus};
use umbp_protocol::{MAGIC, PROTOCOL_VERSION};

use crate::peer::attachment::Attachment;
use crate::peer::control::{self, Event, Next, PeerConn, Phase, Request, Timeouts, Violation};
use crate::peer::validate::{self, AcceptedHello};
use crate::poller::{Interest, Poller};
use crate::{PoolError, PoolInner};

mod registration;

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

/// The control thread: one epoll loop over the listener, the wake doorbell and every peer
/// socket. Each peer is a [`PeerConn`] state machine (control.rs) fed with what its socket
/// has, never blocking on it: a peer that trickles bytes, stalls mid-message or never
/// reads its replies costs its own deadline and nothing else. Memory registrations (a
/// region probe can be slow) run on short-lived threads, one per uid at a time, at most
/// [`MAX_REGISTRATIONS`] in all; everything else a peer asks is bounded work done here.
pub fn run_control(inner: &Arc<PoolInner>, listener: UnixListener) {
    let mut c = Control::new(inner, listener);
    while !inner.is_shutting_down() {
        let now = Instant::now();
        let timeout = c.next_deadline.map_or(TICK, |d| d.saturating_duration_since(now).min(TICK));
        for ready in c.poller.wait_ready(Some(timeout.max(Duration::from_millis(1)))) {
            match ready.token {
                TOKEN_LISTENER => c.accept_all(),
                TOKEN_WAKE => {
                    inner.control_wake.drain();
                }
                token => c.serve(token, ready.hangup),
            }
        }
        c.finish_registrations();
        c.expire(Instant::now());
    }
}

const TOKEN_LISTENER: u64 = u64::MAX;
const TOKEN_WAKE: u64 = u64::MAX - 1;
/// Memory registrations running at once, all uids together (one per uid at a time).
const MAX_REGISTRATIONS: usize = 16;
/// The longest the loop sleeps (shutdown, deadlines).
const TICK: Duration = Duration::from_millis(200);
/// How long accepting pauses when the pool is out of fds and has no spare to refuse with.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// Who is on the other end, captured once at accept (SO_PEERCRED), before anything else.
#[derive(Debug, Clone, Copy)]
struct PeerIdentity {
    uid: u32,
    pid: u32,
}

/// SO_PEERCRED (pid 0 = another pid namespace, served without process memory) and a
/// pidfd of the process that connected, taken before anything is read from it
/// (`SO_PEERPIDFD`, else, or with `--peer-pidfd-fallback`, `pidfd_open` + start time).
fn peer_identity(inner: &PoolInner, sock: &UnixStream) -> Result<(PeerIdentity, umbp_ipc::peer::PeerProcess), String> {
    let process = umbp_ipc::peer::PeerProcess::capture_with(sock.as_fd(), !inner.config.peer_pidfd_fallback)
        .map_err(|e| format!("SO_PEERCRED: {e}"))?;
    if process.source == umbp_ipc::peer::PidfdSource::PidfdOpen {
        inner.counters.pidfd_open_peers.fetch_add(1, Ordering::Relaxed);
    }
    Ok((PeerIdentity { uid: process.cred.uid, pid: process.cred.pid }, process))
}

/// The uid allow-list (the same rule as `validate::check_hello`), checked at accept so a
/// uid that may not attach holds nothing, not even a handshake slot.
fn uid_allowed(inner: &PoolInner, uid: u32) -> bool {
    uid == inner.uid || uid == 0 || inner.config.allow_uids.contains(&uid)
}

struct Peer {
    sock: UnixStream,
    conn: PeerConn,
    id: PeerIdentity,
    /// The process identity taken at accept, moved into the attachment at Hello.
    process: Option<umbp_ipc::peer::PeerProcess>,
    att: Option<Arc<Attachment>>,
    interest: Interest,
    /// Counted in the handshake caps (until attached or gone).
    handshaking: bool,
}

struct RegJob {
    token: u64,
    att: Arc<Attachment>,
    payload: Vec<u8>,
    fds: Vec<OwnedFd>,
}

struct RegDone {
    token: u64,
    uid: u32,
    reply: Reply,
}

struct Control<'a> {
    inner: &'a Arc<PoolInner>,
    listener: UnixListener,
    poller: Poller,
    peers: HashMap<u64, Peer>,
    next_token: u64,
    handshakes: usize,
    handshakes_by_uid: HashMap<u32, usize>,
    /// Closed to accept-and-refuse a connection when the pool is out of fds.
    spare_fd: Option<OwnedFd>,
    accept_paused_until: Option<Instant>,
    nofile: u64,
    reg_queue: VecDeque<RegJob>,
    reg_uids: HashSet<u32>,
    reg_tx: crossbeam_channel::Sender<RegDone>,
    reg_rx: crossbeam_channel::Receiver<RegDone>,
    scratch: Vec<u8>,
    timeouts: Timeouts,
    next_deadline: Option<Instant>,
    /// Connections refused at accept, kept (write side shut) until their Hello had time to
    /// land, so the peer's send succeeds and it reads the refusal instead of EPIPE.
    lingering: VecDeque<(Instant, UnixStream)>,
}

/// How long a connection refused at accept is kept, and how many at most.
const LINGER: Duration = Duration::from_millis(250);
const MAX_LINGERING: usize = 64;

fn open_spare() -> Option<OwnedFd> {
    std::fs::File::open("/dev/null").ok().map(OwnedFd::from)
}

impl<'a> Control<'a> {
    fn new(inner: &'a Arc<PoolInner>, listener: UnixListener) -> Self {
        let poller = Poller::new().expect("epoll");
        poller.add(listener.as_fd(), TOKEN_LISTENER).expect("epoll add listener");
        poller.add(inner.control_wake.fd(), TOKEN_WAKE).expect("epoll add wake");
        let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile).current.unwrap_or(u64::MAX);
        let (reg_tx, reg_rx) = crossbeam_channel::unbounded();
        let c = &inner.config.control;
        Self {
            inner,
            listener,
            poller,
            peers: HashMap::new(),
            next_token: 1,
            handshakes: 0,
            handshakes_by_uid: HashMap::new(),
            spare_fd: open_spare(),
            accept_paused_until: None,
            nofile,
            reg_queue: VecDeque::new(),
            reg_uids: HashSet::new(),
            reg_tx,
            reg_rx,
            scratch: vec![0u8; control::READ_CHUNK],
            timeouts: Timeouts { handshake: c.handshake_timeout, message: c.message_timeout },
            next_deadline: None,
            lingering: VecDeque::new(),
        }
    }

    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((sock, _)) => self.admit(sock),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE)) => {
                    // Out of fds: free the spare, take the connection, refuse it, close it,
                    // so the listener does not stay readable forever.
                    // (accept fails with EMFILE before it looks at the queue: an empty
                    // queue shows only once an fd is free.)
                    if self.spare_fd.take().is_some() {
                        let accepted = match self.listener.accept() {
                            Ok((sock, _)) => {
                                refuse_now(
                                    &sock,
                                    self.inner,
                                    ReplyStatus::ResourceExhausted,
                                    "the pool is out of file descriptors; retry later".into(),
                                );
                                true
                            }
                            Err(_) => false,
                        };
                        self.spare_fd = open_spare();
                        if !accepted {
                            return;
                        }
                        if self.spare_fd.is_some() {
                            continue;
                        }
                    }
                    tracing::warn!("accept: {e}; not accepting for {ACCEPT_PAUSE:?}");
                    self.poller.remove(self.listener.as_fd());
                    self.accept_paused_until = Some(Instant::now() + ACCEPT_PAUSE);
                    return;
                }
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    return;
                }
            }
        }
    }

    /// A new connection: fd headroom, identity, uid allow-list and handshake caps, in that
    /// order, before the pool keeps anything for it.
    fn admit(&mut self, sock: UnixStream) {
        let inner = self.inner;
        if sock.set_nonblocking(true).is_err() {
            return;
        }
        let cfg = &inner.config.control;
        let fd_number = sock.as_raw_fd() as u64;
        // fds are numbered lowest-free first: all below this one are in use.
        if fd_number.saturating_add(cfg.fd_reserve) >= self.nofile {
            let m = format!(
                "the pool is near its file descriptor limit (fd {fd_number}, RLIMIT_NOFILE {}, {} kept for attached peers by \
                 --fd-reserve); retry later",
                self.nofile, cfg.fd_reserve
            );
            tracing::warn!("connection refused: {m}");
            refuse_now(&sock, inner, ReplyStatus::ResourceExhausted, m);
            return;
        }
        let (id, process) = match peer_identity(inner, &sock) {
            Ok(id) => id,
            Err(e) => {
                tracing::info!("connection dropped: {e}");
                return;
            }
        };
        if !uid_allowed(inner, id.uid) {
            let uid = id.uid;
            let m = format!("uid {uid} is not allowed by this pool (start it with --allow-uid {uid})");
            tracing::info!(pid = id.pid, "handshake refused: {m}");
            return self.refuse_at_accept(sock, ReplyStatus::PermissionDenied, m);
        }
        let of_uid = self.handshakes_by_uid.get(&id.uid).copied().unwrap_or(0);
        let over = if self.handshakes >= cfg.max_handshakes {
            Some(format!("{} handshakes in progress, the limit (--max-handshakes); retry", self.handshakes))
        } else if of_uid >= cfg.handshakes_per_uid {
            Some(format!("uid {} has {of_uid} handshakes in progress, the limit per uid (--max-handshakes-per-uid); retry", id.uid))
        } else {
            None
        };
        if let Some(m) = over {
            tracing::info!(pid = id.pid, uid = id.uid, "handshake refused: {m}");
            return self.refuse_at_accept(sock, ReplyStatus::ResourceExhausted, m);
        }
        let token = self.next_token;
        self.next_token += 1;
        let interest = Interest { read: true, write: false };
        if let Err(e) = self.poller.add_with(sock.as_fd(), token, interest) {
            tracing::warn!("epoll add: {e}");
            return;
        }
        self.handshakes += 1;
        *self.handshakes_by_uid.entry(id.uid).or_default() += 1;
        let now = Instant::now();
        let conn = PeerConn::new(now, self.timeouts);
        self.note_deadline(conn.deadline());
        self.peers.insert(token, Peer { sock, conn, id, process: Some(process), att: None, interest, handshaking: true });
    }

    /// Refuses a connection the pool keeps no state for; it lingers (bounded) so that the
    /// peer's Hello lands and it reads the refusal.
    fn refuse_at_accept(&mut self, sock: UnixStream, status: ReplyStatus, message: String) {
        refuse_now(&sock, self.inner, status, message);
        if self.lingering.len() < MAX_LINGERING {
            let _ = sock.shutdown(std::net::Shutdown::Write);
            let until = Instant::now() + LINGER;
            self.lingering.push_back((until, sock));
            self.note_deadline(Some(until));
        }
    }

    fn note_deadline(&mut self, d: Option<Instant>) {
        if let Some(d) = d {
            self.next_deadline = Some(self.next_deadline.map_or(d, |n| n.min(d)));
        }
    }

    /// An event on a peer socket: write what is owed, read what is wanted.
    fn serve(&mut self, token: u64, hangup: bool) {
        let Some(peer) = self.peers.get_mut(&token) else { return };
        if peer.conn.has_output() {
            self.flush(token);
        }
        let Some(peer) = self.peers.get_mut(&token) else { return };
        let want = peer.conn.want();
        if want == 0 {
            if hangup {
                // Nothing to read (a request is being answered): the peer is gone.
                self.drop_peer(token, &Violation::Closed.to_string());
            }
            return;
        }
        // Read on while the socket has bytes (a header and its payload usually arrive
        // together), at most a few reads per event so one peer cannot hog the loop.
        let mut scratch = std::mem::take(&mut self.scratch);
        let mut result = Ok(None);
        for _ in 0..4 {
            let want = peer.conn.want();
            if want == 0 {
                break;
            }
            result = match recv_chunk(&peer.sock, &mut scratch[..want], RecvFlags::DONTWAIT) {
                Ok(chunk) => {
                    tracing::trace!(
                        pid = peer.id.pid,
                        bytes = chunk.bytes,
                        fds = chunk.fds.len(),
                        truncated = chunk.truncated,
                        "control read"
                    );
                    peer.conn.feed(Instant::now(), &scratch[..chunk.bytes], chunk.fds, chunk.truncated)
                }
                Err(MessageError::Timeout) => break,
                Err(MessageError::Closed) => Err(Violation::Closed),
                Err(e) => Err(Violation::Recv(e)),
            };
            if !matches!(result, Ok(None)) {
                break;
            }
        }
        self.scratch = scratch;
        match result {
            Ok(Some(event)) => self.handle(token, event),
            Ok(None) => {
                let d = peer.conn.deadline();
                self.note_deadline(d);
            }
            Err(v) => self.drop_peer(token, &v.to_string()),
        }
        self.update_interest(token);
    }

    fn handle(&mut self, token: u64, event: Event) {
        match event {
            Event::Hello(payload) => self.hello(token, &payload),
            Event::Truncated(kind) => {
                let Some(peer) = self.peers.get(&token) else { return };
                let m = format!(
                    "{kind:?} refused: the file descriptors sent with it were dropped by the kernel (MSG_CTRUNC): \
                     the pool is out of file descriptors or more than 8 were sent; nothing was done, retry later"
                );
                tracing::warn!(pid = peer.id.pid, uid = peer.id.uid, "{m}");
                if peer.conn.phase() == Phase::Handshake {
                    self.refuse(token, ReplyStatus::ResourceExhausted, m);
                } else {
                    self.reply(token, Reply::error(ReplyStatus::ResourceExhausted, &m), Vec::new());
                }
            }
            Event::Request(req) => self.request(token, req),
        }
    }

    /// A refusal in the handshake phase: the reply, then close.
    fn refuse(&mut self, token: u64, status: ReplyStatus, message: String) {
        let Some(peer) = self.peers.get_mut(&token) else { return };
        self.inner.counters.refusals.fetch_add(1, Ordering::Relaxed);
        tracing::info!(pid = peer.id.pid, uid = peer.id.uid, "handshake refused: {message}");
        let reply = HelloReply::refusal(status, &message);
        peer.conn.respond(Instant::now(), MessageKind::HelloReply, bytemuck::bytes_of(&reply), Vec::new(), Next::Close);
        self.leave_handshake(token);
        self.flush(token);
    }

    fn leave_handshake(&mut self, token: u64) {
        let Some(peer) = self.peers.get_mut(&token) else { return };
        if std::mem::replace(&mut peer.handshaking, false) {
            self.handshakes -= 1;
            let uid = peer.id.uid;
            if let Some(n) = self.handshakes_by_uid.get_mut(&uid) {
                *n -= 1;
                if *n == 0 {
                    self.handshakes_by_uid.remove(&uid);
                }
            }
        }
    }

    /// A complete Hello: the checks, the attachment, the reply with its fds.
    fn hello(&mut self, token: u64, payload: &[u8]) {
        let inner = self.inner;
        let Some(peer) = self.peers.get(&token) else { return };
        let PeerIdentity { uid, pid } = peer.id;
        // Magic, version, role, uid allow-list, namespace ACL, ring and arena limits.
        let AcceptedHello { hello, role, layout } = match validate::check_hello(payload, uid, inner.uid, &inner.config) {
            Ok(a) => a,
            Err(r) => return self.refuse(token, r.status, r.message),
        };
        let count_check = |list: &[Arc<Attachment>]| {
            let of_uid = list.iter().filter(|a| a.uid == uid).count();
            validate::check_attachment_count(list.len(), of_uid, uid, &inner.config)
        };
        if let Err(r) = count_check(&inner.attachments.lock().expect("attachments lock")) {
            return self.refuse(token, r.status, r.message);
        }
        let sock2 = match peer.sock.try_clone() {
            Ok(s) => s,
            Err(e) => return self.refuse(token, ReplyStatus::ResourceExhausted, fd_hint(format!("cannot keep the socket: {e}"))),
        };
        let Some(process) = self.peers.get_mut(&token).and_then(|p| p.process.take()) else {
            return self.refuse(token, ReplyStatus::Internal, "the peer's identity was already used".into());
        };
        let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
        // The peer gets the index and event log of its namespace's tenant group only
        // (check_hello made sure the namespace is one its uid may use).
        let group = inner.store.tenant_groups.group_of(hello.namespace());
        let gm = &inner.store.group_mem[group as usize];
        let att = match Attachment::create(id, role, process, &hello, group, layout, sock2) {
            Ok(a) => Arc::new(a),
            Err(e) => return self.refuse(token, ReplyStatus::Internal, fd_hint(format!("cannot create rings: {e}"))),
        };
        let dup = |f: std::os::fd::BorrowedFd<'_>| f.try_clone_to_owned();
        let fds = match [att.ring_mem.fd(), gm.index_mem.fd(), att.doorbell.fd(), gm.events_mem.fd()]
            .into_iter()
            .map(dup)
            .collect::<Result<Vec<_>, _>>()
        {
            Ok(f) => f,
            Err(e) => return self.refuse(token, ReplyStatus::ResourceExhausted, format!("the pool is out of file descriptors: {e}")),
        };
        {
            let mut list = inner.attachments.lock().expect("attachments lock");
            if let Err(r) = count_check(&list) {
                drop(list);
                return self.refuse(token, r.status, r.message);
            }
            list.push(att.clone());
            count_attached_uids(inner, &list);
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
        reply.index_region_bytes = gm.index_mem.len() as u64;
        reply.event_log_bytes = gm.events_mem.len() as u64;
        reply.pool_pid = std::process::id();
        tracing::info!(attachment = id, pid, uid, ?role, namespace = format!("{:032x}", hello.namespace()), group, "attached");
        inner.counters.attachments_total.fetch_add(1, Ordering::Relaxed);
        inner.service_wake.ring();
        let peer = self.peers.get_mut(&token).expect("present");
        peer.att = Some(att);
        peer.conn.respond(Instant::now(), MessageKind::HelloReply, bytemuck::bytes_of(&reply), fds, Next::Attach);
        self.leave_handshake(token);
        self.flush(token);
    }

    fn request(&mut self, token: u64, req: Request) {
        let inner = self.inner;
        let Some(att) = self.peers.get(&token).and_then(|p| p.att.clone()) else { return };
        let (reply, extra) = match req.kind {
            MessageKind::RegisterMemory => {
                self.reg_queue.push_back(RegJob { token, att, payload: req.payload, fds: req.fds });
                self.start_registrations();
                return;
            }
            MessageKind::RegisterLayout => (registration::register_layout(inner, &att, &req.payload), Vec::new()),
            MessageKind::ResetNamespace => {
                let n = inner.store.objects.lock().expect("store lock").reset_namespace(att.namespace);
                tracing::info!(attachment = att.id, dropped = n, "namespace reset");
                (Reply::ok(n), Vec::new())
            }
            MessageKind::StatsRequest => {
                let json = serde_json::to_vec(&crate::observe::report::for_peer(inner, att.uid)).unwrap_or_default();
                (Reply::ok(json.len() as u64), json)
            }
            other => (Reply::error(ReplyStatus::InvalidRequest, &format!("unexpected message {other:?}")), Vec::new()),
        };
        self.reply(token, reply, extra);
    }

    fn reply(&mut self, token: u64, reply: Reply, extra: Vec<u8>) {
        let Some(peer) = self.peers.get_mut(&token) else { return };
        let mut payload = bytemuck::bytes_of(&reply).to_vec();
        payload.extend_from_slice(&extra);
        peer.conn.respond(Instant::now(), MessageKind::Reply, &payload, Vec::new(), Next::Continue);
        self.flush(token);
    }

    /// Starts queued registrations: one per uid at a time (so per-uid totals are exact and
    /// one uid's slow probes never hold another's), at most MAX_REGISTRATIONS in all.
    fn start_registrations(&mut self) {
        let mut i = 0;
        while i < self.reg_queue.len() && self.reg_uids.len() < MAX_REGISTRATIONS {
            let uid = self.reg_queue[i].att.uid;
            if self.reg_uids.contains(&uid) {
                i += 1;
                continue;
            }
            let job = self.reg_queue.remove(i).expect("in range");
            if !self.peers.contains_key(&job.token) || !job.att.is_alive() {
                continue;
            }
            let token = job.token;
            let (inner, tx) = (self.inner.clone(), self.reg_tx.clone());
            let spawned = std::thread::Builder::new().name("umbp-regmem".into()).spawn(move || {
                let reply = registration::register_memory(&inner, &job.att, &job.payload, job.fds);
                let _ = tx.send(RegDone { token: job.token, uid, reply });
                inner.control_wake.ring();
            });
            match spawned {
                Ok(_) => {
                    self.reg_uids.insert(uid);
                }
                Err(e) => {
                    self.reply(token, Reply::error(ReplyStatus::Internal, &format!("cannot start a registration thread: {e}")), Vec::new())
                }
            }
        }
    }

    fn finish_registrations(&mut self) {
        while let Ok(done) = self.reg_rx.try_recv() {
            self.reg_uids.remove(&done.uid);
            self.reply(done.token, done.reply, Vec::new());
            self.update_interest(done.token);
        }
        if !self.reg_queue.is_empty() {
            self.start_registrations();
        }
    }

    /// Writes what the peer is owed, as far as its socket takes it now.
    fn flush(&mut self, token: u64) {
        let Some(peer) = self.peers.get_mut(&token) else { return };
        while peer.conn.has_output() {
            let (bytes, fds) = peer.conn.output();
            match send_chunk(&peer.sock, bytes, fds) {
                Ok(n) => peer.conn.wrote(n),
                Err(MessageError::Timeout) => break,
                Err(e) => {
                    let why = format!("sending a reply: {e}");
                    return self.drop_peer(token, &why);
                }
            }
        }
        if peer.conn.is_done() {
            return self.drop_peer(token, "refused");
        }
        let d = peer.conn.deadline();
        self.note_deadline(d);
        self.update_interest(token);
    }

    fn update_interest(&mut self, token: u64) {
        let Some(peer) = self.peers.get_mut(&token) else { return };
        let want = Interest { read: peer.conn.want() > 0, write: peer.conn.has_output() };
        if want != peer.interest && self.poller.modify(peer.sock.as_fd(), token, want).is_ok() {
            peer.interest = want;
        }
    }

    fn drop_peer(&mut self, token: u64, why: &str) {
        self.leave_handshake(token);
        let Some(peer) = self.peers.remove(&token) else { return };
        self.poller.remove(peer.sock.as_fd());
        match &peer.att {
            Some(att) => detach(self.inner, att, why),
            None => tracing::info!(pid = peer.id.pid, uid = peer.id.uid, "handshake failed: {why}"),
        }
    }

    /// Deadlines; attachments detached elsewhere (a corrupted ring); the paused listener.
    fn expire(&mut self, now: Instant) {
        if self.next_deadline.is_some_and(|d| d <= now) || self.peers.values().any(|p| p.att.as_ref().is_some_and(|a| !a.is_alive())) {
            let mut gone = Vec::new();
            let mut next: Option<Instant> = None;
            for (token, peer) in &self.peers {
                if let Err(v) = peer.conn.check(now) {
                    gone.push((*token, v.to_string()));
                } else if peer.att.as_ref().is_some_and(|a| !a.is_alive()) {
                    gone.push((*token, "detached".to_string()));
                } else if let Some(d) = peer.conn.deadline() {
                    next = Some(next.map_or(d, |n| n.min(d)));
                }
            }
            self.next_deadline = next;
            for (token, why) in gone {
                self.drop_peer(token, &why);
            }
        }
        while self.lingering.front().is_some_and(|(until, _)| *until <= now) {
            self.lingering.pop_front();
        }
        if let Some((until, _)) = self.lingering.front() {
            let until = *until;
            self.note_deadline(Some(until));
        }
        if self.accept_paused_until.is_some_and(|t| t <= now) {
            self.accept_paused_until = None;
            if self.spare_fd.is_none() {
                self.spare_fd = open_spare();
            }
            let _ = self.poller.add(self.listener.as_fd(), TOKEN_LISTENER);
            self.accept_all();
        }
    }
}

/// Says plainly when an error is the pool running out of fds (EMFILE / ENFILE).
fn fd_hint(message: String) -> String {
    if message.contains("os error 24") || message.contains("os error 23") || message.contains("Too many open files") {
        format!("the pool is out of file descriptors: {message}")
    } else {
        message
    }
}

/// Refuses a connection the pool keeps nothing for: one non-blocking HelloReply, best
/// effort, then the socket closes.
fn refuse_now(sock: &UnixStream, inner: &PoolInner, status: ReplyStatus, message: String) {
    inner.counters.refusals.fetch_add(1, Ordering::Relaxed);
    let reply = HelloReply::refusal(status, &message);
    let header = umbp_protocol::wire::MessageHeader::new(MessageKind::HelloReply, std::mem::size_of::<HelloReply>(), 0);
    let mut bytes = bytemuck::bytes_of(&header).to_vec();
    bytes.extend_from_slice(bytemuck::bytes_of(&reply));
    let _ = send_chunk(sock, &bytes, &[]);
}

/// Sets `inner.attached_uids` from the attachment list (called under its lock).
pub fn count_attached_uids(inner: &PoolInner, list: &[Arc<Attachment>]) {
    let mut uids: Vec<u32> = list.iter().map(|a| a.uid).collect();
    uids.sort_unstable();
    uids.dedup();
    // Relaxed: a count read as a hint by `dispatch` (copy/transfer.rs); a stale value only
    // moves the cap for the jobs dispatched meanwhile, and the list's lock orders the writes
    // among themselves.
    inner.attached_uids.store(uids.len(), Ordering::Relaxed);
}

/// Marks a peer gone: the service thread stops serving it; copy jobs already queued see
/// `alive == false` and cancel; regions close when the last job drops its reference.
pub fn detach(inner: &PoolInner, att: &Arc<Attachment>, why: &str) {
    att.alive.store(false, Ordering::Release);
    let _ = att.socket.shutdown(std::net::Shutdown::Both);
    let mut list = inner.attachments.lock().expect("attachments lock");
    let before = list.len();
    list.retain(|a| a.id != att.id);
    count_attached_uids(inner, &list);
    if list.len() != before {
        tracing::info!(attachment = att.id, pid = att.pid, "{why}");
    }
    drop(list);
    inner.service_wake.ring();
}
