//! A minimal in-process pool speaking docs/connection.md, for client tests until the real
//! `umbp_pool::Pool` exists. It really copies (through `umbp_gpu`'s host backends) and keeps
//! an index, so clients are tested end to end; it is not a reference for the pool's
//! internals (one thread, objects in a HashMap, no eviction).
#![allow(dead_code)]

use std::collections::HashMap;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use umbp_gpu::DeviceRegion;
use umbp_ipc::doorbell::Doorbell;
use umbp_ipc::message::{peer_gone, recv_message, send_message};
use umbp_ipc::SharedMemory;
use umbp_protocol::arena::Arena;
use umbp_protocol::attachment::{AttachmentLayout, Hint};
use umbp_protocol::entries::{BlockRef, BlockStatus, Cqe, CqeError, Opcode, Sqe};
use umbp_protocol::index::{region_bytes, IndexView, IndexWriter, MIN_SLOTS};
use umbp_protocol::layout::{KvLayout, Segment};
use umbp_protocol::ring::{Consumer, Producer, Ring};
use umbp_protocol::wire::*;
use umbp_protocol::ObjectKey;

/// Namespace the mock refuses, to test refusals.
pub const REFUSED_NAMESPACE: u128 = 0xBAD;

pub struct Shared {
    stop: AtomicBool,
    /// Stop consuming submissions (control messages are still answered).
    pub stall: AtomicBool,
    /// Hand out pool-chosen alloc ids instead of echoing the worker's.
    pub own_ids: AtomicBool,
    pub hints: Mutex<Vec<ObjectKey>>,
    pub index: Mutex<IndexWriter<'static>>,
    index_shm: &'static SharedMemory,
    pub objects: Mutex<HashMap<ObjectKey, Vec<u8>>>,
    pub attachments: AtomicU32,
}

pub struct MockPool {
    pub path: PathBuf,
    pub shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// A socket path in a fresh private directory (the test kit's).
pub fn socket_path(name: &str) -> PathBuf {
    umbp_integration_tests::unique_socket(name)
}

/// Polls until `f` holds; fails the test after 5 s.
pub fn eventually(f: impl FnMut() -> bool) {
    assert!(umbp_integration_tests::eventually(std::time::Duration::from_secs(5), f), "condition not reached in 5 s");
}

impl MockPool {
    pub fn start(path: &Path) -> MockPool {
        let _ = std::fs::remove_file(path);
        let listener = UnixListener::bind(path).unwrap();
        listener.set_nonblocking(true).unwrap();
        let len = region_bytes(MIN_SLOTS);
        // Leaked: the writer borrows it for 'static; a few pages per test pool.
        let shm: &'static SharedMemory = Box::leak(Box::new(SharedMemory::create("mock-index", len, false).unwrap()));
        // SAFETY: fresh zeroed mapping that lives for the rest of the process.
        let view = unsafe { IndexView::init(shm.as_ptr(), len, MIN_SLOTS) }.unwrap();
        shm.seal_read_only().unwrap();
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            stall: AtomicBool::new(false),
            own_ids: AtomicBool::new(false),
            hints: Mutex::new(vec![]),
            index: Mutex::new(IndexWriter::new(view)),
            index_shm: shm,
            objects: Mutex::new(HashMap::new()),
            attachments: AtomicU32::new(0),
        });
        let s = shared.clone();
        let thread = std::thread::spawn(move || serve(listener, s));
        MockPool { path: path.to_path_buf(), shared, thread: Some(thread) }
    }

    pub fn stall(&self, on: bool) {
        self.shared.stall.store(on, Ordering::SeqCst);
    }

    pub fn insert_index(&self, key: ObjectKey) {
        self.shared.index.lock().unwrap().insert(key, 1).unwrap();
    }

    /// Marks the index closed, as a pool does first thing when it shuts down; the sockets
    /// stay open.
    pub fn mark_index_closed(&self) {
        let view = self.shared.index.lock().unwrap().view();
        // SAFETY: the writer's own writable mapping (leaked, lives for the process).
        unsafe { view.mark_closed() };
    }

    pub fn hints(&self) -> Vec<ObjectKey> {
        self.shared.hints.lock().unwrap().clone()
    }

    /// Stops serving and closes every socket, like a crashed pool; the socket file goes.
    pub fn kill(mut self) {
        self.stop_thread();
    }

    fn stop_thread(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

impl Drop for MockPool {
    fn drop(&mut self) {
        self.stop_thread();
    }
}

struct Conn {
    sock: UnixStream,
    sq: Consumer<'static, Sqe>,
    cq: Producer<'static, Cqe>,
    hints: Consumer<'static, Hint>,
    arena: Arena,
    doorbell: Doorbell,
    regions: HashMap<u32, Box<dyn DeviceRegion>>,
    layouts: HashMap<u16, KvLayout>,
    pid: u32,
    next_id: u32,
    _shm: SharedMemory,
}

fn serve(listener: UnixListener, s: Arc<Shared>) {
    let path = listener.local_addr().unwrap().as_pathname().unwrap().to_path_buf();
    let mut conns: Vec<Conn> = vec![];
    while !s.stop.load(Ordering::SeqCst) {
        if let Ok((sock, _)) = listener.accept() {
            if let Some(c) = handshake(sock, &s) {
                conns.push(c);
            }
        }
        conns.retain_mut(|c| serve_conn(c, &s));
        std::thread::sleep(Duration::from_micros(200));
    }
    drop(listener);
    let _ = std::fs::remove_file(path);
}

fn handshake(sock: UnixStream, s: &Shared) -> Option<Conn> {
    sock.set_nonblocking(false).unwrap();
    let msg = recv_message(&sock, Some(Duration::from_secs(1))).ok()?;
    let hello: Hello = decode(&msg.payload).ok()?;
    hello.validate().ok()?;
    if hello.namespace() == REFUSED_NAMESPACE {
        let r = HelloReply::refusal(ReplyStatus::PermissionDenied, "namespace 0xBAD is not allowed here");
        let _ = send_message(&sock, MessageKind::HelloReply, bytemuck::bytes_of(&r), &[], None);
        return None;
    }
    let sq_entries = if hello.sq_entries == 0 { 1024 } else { hello.sq_entries };
    let arena = if hello.arena_bytes == 0 { 4 << 20 } else { hello.arena_bytes };
    let layout = AttachmentLayout::new(sq_entries, sq_entries * 2, 1024, arena).unwrap();
    let shm = SharedMemory::create("mock-ring", layout.total_bytes, false).unwrap();
    shm.seal_final().unwrap();
    let base = shm.as_ptr();
    // SAFETY: sections lie inside the fresh mapping, owned by the Conn and dropped last.
    let (sq, cq, hints, arena) = unsafe {
        (
            Ring::<Sqe>::init(base.add(layout.sq_offset), layout.sq_bytes(), layout.sq_entries).unwrap().consumer(),
            Ring::<Cqe>::init(base.add(layout.cq_offset), layout.cq_bytes(), layout.cq_entries).unwrap().producer(),
            Ring::<Hint>::init(base.add(layout.hint_offset), layout.hint_bytes(), layout.hint_entries).unwrap().consumer(),
            Arena::new(base.add(layout.arena_offset), layout.arena_bytes),
        )
    };
    let doorbell = Doorbell::new().unwrap();
    let id = s.attachments.fetch_add(1, Ordering::SeqCst) + 1;
    let mut r = HelloReply::refusal(ReplyStatus::Ok, "");
    r.attachment_id = id;
    r.sq_entries = layout.sq_entries;
    r.cq_entries = layout.cq_entries;
    r.hint_entries = layout.hint_entries;
    r.pool_pid = std::process::id();
    r.arena_bytes = layout.arena_bytes as u64;
    r.ring_region_bytes = layout.total_bytes as u64;
    r.index_region_bytes = s.index_shm.len() as u64;
    // Fourth fd: a (never written) KV event log, like the real pool's.
    let events = SharedMemory::create("mock-events", umbp_protocol::events::region_bytes(64), false).unwrap();
    // SAFETY: a fresh zeroed mapping nobody else uses yet.
    unsafe { umbp_protocol::events::EventLog::init(events.as_ptr(), events.len(), 64) }.unwrap();
    events.seal_read_only().unwrap();
    r.event_log_bytes = events.len() as u64;
    let fds = [shm.fd(), s.index_shm.fd(), doorbell.fd(), events.fd()];
    send_message(&sock, MessageKind::HelloReply, bytemuck::bytes_of(&r), &fds, None).ok()?;
    let pid = rustix::net::sockopt::socket_peercred(&sock).unwrap().pid.as_raw_nonzero().get() as u32;
    Some(Conn {
        sock,
        sq,
        cq,
        hints,
        arena,
        doorbell,
        regions: HashMap::new(),
        layouts: HashMap::new(),
        pid,
        next_id: 1000 * id,
        _shm: shm,
    })
}

fn reply(sock: &UnixStream, r: Reply) -> bool {
    send_message(sock, MessageKind::Reply, bytemuck::bytes_of(&r), &[], None).is_ok()
}

/// One service round; false when the connection is gone.
fn serve_conn(c: &mut Conn, s: &Shared) -> bool {
    if peer_gone(&c.sock) {
        return false;
    }
    let mut fds = [rustix::event::PollFd::new(&c.sock, rustix::event::PollFlags::IN)];
    let zero = rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 };
    if matches!(rustix::event::poll(&mut fds, Some(&zero)), Ok(n) if n > 0) {
        let Ok(msg) = recv_message(&c.sock, Some(Duration::from_secs(1))) else { return false };
        let r = control(c, s, msg);
        if !reply(&c.sock, r) {
            return false;
        }
    }
    if s.stall.load(Ordering::SeqCst) {
        return true;
    }
    c.doorbell.drain();
    let mut any = false;
    while let Ok(Some(sqe)) = c.sq.try_pop() {
        any = true;
        let cqe = execute(c, s, &sqe);
        assert!(c.cq.try_push(cqe).unwrap(), "mock CQ overflow");
    }
    if any {
        c.sq.release();
        c.cq.publish_and_wake();
    }
    let mut got = false;
    while let Ok(Some(h)) = c.hints.try_pop() {
        got = true;
        s.hints.lock().unwrap().push(ObjectKey::from_words(h.key));
    }
    if got {
        c.hints.release();
    }
    true
}

fn control(c: &mut Conn, s: &Shared, mut msg: umbp_ipc::Message) -> Reply {
    match msg.kind {
        MessageKind::RegisterMemory => {
            let Ok(reg) = decode::<MemoryRegistration>(&msg.payload) else {
                return Reply::error(ReplyStatus::InvalidRequest, "short registration");
            };
            let Ok(kind) = MemoryKind::from_u32(reg.kind) else {
                return Reply::error(ReplyStatus::InvalidRequest, "kind");
            };
            let id = if s.own_ids.load(Ordering::SeqCst) {
                c.next_id += 1;
                c.next_id
            } else {
                reg.alloc_id
            };
            let reg = MemoryRegistration { alloc_id: id, ..reg };
            let region = umbp_gpu::backend_for(kind).and_then(|b| b.open_region(&reg, msg.fds.pop(), c.pid));
            match region {
                Ok(r) => {
                    c.regions.insert(id, r);
                    Reply::ok(id as u64)
                }
                Err(e) => Reply::error(ReplyStatus::InvalidRequest, &e.to_string()),
            }
        }
        MessageKind::RegisterLayout => {
            let Ok(h) = decode::<LayoutHeader>(&msg.payload) else {
                return Reply::error(ReplyStatus::InvalidRequest, "short layout");
            };
            let body = &msg.payload[8..];
            if body.len() != h.segment_count as usize * 40 {
                return Reply::error(ReplyStatus::InvalidRequest, "segment_count");
            }
            let segs: Vec<Segment> = body.chunks(40).map(bytemuck::pod_read_unaligned).collect();
            match KvLayout::new(segs, |id| c.regions.get(&id).map(|r| r.len())) {
                Ok(l) => {
                    let bytes = l.object_bytes();
                    c.layouts.insert(h.group as u16, l);
                    Reply::ok(bytes)
                }
                Err(e) => Reply::error(ReplyStatus::InvalidRequest, &e.to_string()),
            }
        }
        MessageKind::ResetNamespace => {
            let n = s.objects.lock().unwrap().drain().count();
            s.index.lock().unwrap().clear();
            Reply::ok(n as u64)
        }
        _ => Reply::error(ReplyStatus::Unsupported, "not in the mock"),
    }
}

fn execute(c: &Conn, s: &Shared, sqe: &Sqe) -> Cqe {
    let reject = |e: CqeError| Cqe { user_data: sqe.user_data, result: -(e as i32), ..bytemuck::Zeroable::zeroed() };
    let Ok(op) = Opcode::from_u8(sqe.opcode) else { return reject(CqeError::BadOpcode) };
    let Some(layout) = c.layouts.get(&sqe.group) else { return reject(CqeError::UnknownGroup) };
    let Ok(refs) = c.arena.read::<BlockRef>(sqe.refs_offset, sqe.count as u64) else {
        return reject(CqeError::ArenaOutOfRange);
    };
    if c.arena.check_range::<u8>(sqe.status_offset, sqe.count as u64).is_err() {
        return reject(CqeError::ArenaOutOfRange);
    }
    let mut objects = s.objects.lock().unwrap();
    let mut statuses = vec![];
    for r in &refs {
        let key = ObjectKey::from_words(r.key);
        let mut ops = vec![];
        let st = if layout.plan_block(r.block_id, 0, &mut ops).is_err() {
            BlockStatus::Invalid
        } else {
            match op {
                Opcode::Store if objects.contains_key(&key) => BlockStatus::AlreadyPresent,
                Opcode::Store => {
                    let mut buf = vec![0u8; layout.object_bytes() as usize];
                    // SAFETY: ops were planned at host offset 0 for one object of this size.
                    let ok = ops.iter().all(|o| unsafe { c.regions[&o.alloc_id].copy_to_host(&[*o], buf.as_mut_ptr()) }.is_ok());
                    if ok {
                        objects.insert(key, buf);
                        let _ = s.index.lock().unwrap().insert(key, 1);
                        BlockStatus::Stored
                    } else {
                        BlockStatus::Failed
                    }
                }
                Opcode::Load => match objects.get(&key) {
                    None => BlockStatus::Missing,
                    Some(buf) => {
                        // SAFETY: as above, reading the object's buffer.
                        let ok = ops.iter().all(|o| unsafe { c.regions[&o.alloc_id].copy_from_host(&[*o], buf.as_ptr()) }.is_ok());
                        if ok {
                            BlockStatus::Loaded
                        } else {
                            BlockStatus::Failed
                        }
                    }
                },
                Opcode::Nop => BlockStatus::Pending,
            }
        };
        statuses.push(st as u8);
    }
    c.arena.write(sqe.status_offset, &statuses).unwrap();
    let ok = statuses.iter().filter(|&&b| BlockStatus::from_u8(b).is_ok()).count() as u32;
    Cqe { user_data: sqe.user_data, result: 0, ok_count: ok, failed_count: sqe.count - ok, _pad: 0, reserved: 0 }
}
