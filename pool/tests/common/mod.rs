//! Shared test plumbing: a real `umbp-pool` process on a private socket, and a
//! hand-crafted raw peer that speaks the wire protocol directly (for bad-input tests).
#![allow(dead_code)]

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use umbp_ipc::message::{recv_message, send_message};
use umbp_ipc::SharedMemory;
use umbp_protocol::attachment::AttachmentLayout;
use umbp_protocol::entries::{Cqe, Sqe};
use umbp_protocol::ring::{Consumer, Producer, Ring};
use umbp_protocol::wire::{self, Hello, HelloReply, MessageKind, Reply, Role};

pub fn unique_socket(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("umbp-test-{}-{tag}-{}", std::process::id(), rand_suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("pool.sock")
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(Instant::now().elapsed().as_nanos() as u64);
    h.finish() & 0xffff_ffff
}

/// A `umbp-pool` child process; killed on drop.
pub struct PoolProcess {
    pub child: Child,
    pub socket: PathBuf,
}


/// `UMBP_POOL_WRAPPER`: a command every test pool runs under, e.g.
/// `valgrind --tool=memcheck --error-exitcode=99 --log-file=/tmp/vg-%p.log` or a script
/// that runs a sanitizer build (docs/reliability.md). Wrapped pools are stopped with
/// SIGTERM (a clean shutdown, so the tool can report) instead of SIGKILL at the end.
pub fn pool_wrapper() -> Option<Vec<String>> {
    std::env::var("UMBP_POOL_WRAPPER").ok().filter(|w| !w.trim().is_empty()).map(|w| w.split_whitespace().map(String::from).collect())
}

/// A command that runs the pool binary `bin`, under `UMBP_POOL_WRAPPER` when set.
pub fn pool_command(bin: &Path) -> Command {
    match pool_wrapper() {
        Some(w) => {
            let mut c = Command::new(&w[0]);
            c.args(&w[1..]).arg(bin);
            c
        }
        None => Command::new(bin),
    }
}

/// Stops a wrapped pool with SIGTERM and waits for its clean exit (up to 60 s).
pub fn stop_gracefully(child: &mut Child) {
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGCONT) };
    // SAFETY: as above.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl PoolProcess {
    pub fn start(socket: &Path, extra: &[&str]) -> Self {
        let child = pool_command(Path::new(env!("CARGO_BIN_EXE_umbp-pool")))
            .arg("--socket")
            .arg(socket)
            .args(["--capacity", "64MiB", "--min-object-size", "4KiB"])
            .args(extra)
            .env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()))
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn umbp-pool");
        let p = Self { child, socket: socket.to_path_buf() };
        p.wait_listening();
        p
    }

    pub fn wait_listening(&self) {
        let deadline = Instant::now() + Duration::from_secs(if pool_wrapper().is_some() { 120 } else { 20 });
        while UnixStream::connect(&self.socket).is_err() {
            assert!(Instant::now() < deadline, "pool did not start listening at {}", self.socket.display());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.pid(), sig) };
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The pool's state report, through a real observer attachment.
    pub fn report(&self) -> serde_json::Value {
        let mut peer = RawPeer::attach(&self.socket, Role::Observer, 0).expect("observer attach");
        peer.stats()
    }

    pub fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid())).unwrap().count()
    }
}

impl Drop for PoolProcess {
    fn drop(&mut self) {
        if pool_wrapper().is_some() {
            stop_gracefully(&mut self.child);
        }
        self.kill();
        if let Some(d) = self.socket.parent() {
            let _ = std::fs::remove_dir_all(d);
        }
    }
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
    send_message(sock, MessageKind::Hello, bytemuck::bytes_of(hello), &[], Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
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

    pub fn stats(&mut self) -> serde_json::Value {
        let (r, json) = self.control(MessageKind::StatsRequest, &[], &[]);
        assert_eq!(r.status, 0, "{}", r.message());
        serde_json::from_slice(&json).unwrap()
    }

    pub fn sq(&self) -> Producer<'_, Sqe> {
        // SAFETY: the section lies inside our mapping (AttachmentLayout from the reply).
        unsafe { Ring::<Sqe>::attach(self.rings.as_ptr().add(self.layout.sq_offset), self.layout.sq_bytes()) }
            .unwrap()
            .producer()
    }

    pub fn cq(&self) -> Consumer<'_, Cqe> {
        // SAFETY: as above.
        unsafe { Ring::<Cqe>::attach(self.rings.as_ptr().add(self.layout.cq_offset), self.layout.cq_bytes()) }
            .unwrap()
            .consumer()
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
