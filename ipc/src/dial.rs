//! Dialling the pool: connect, send `Hello`, receive `HelloReply` with its fds
//! (docs/connection.md, steps 1-4). Split into `start` and `finish` so that a reconnect
//! from `poll()` never blocks the engine: a pool that accepts but does not answer (stopped,
//! overloaded) costs a zero-timeout poll per call, never a wait.

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::message::{recv_message, send_message, MessageError};
use rustix::event::{poll, PollFd, PollFlags};
use rustix::net::{connect, socket_with, AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
use umbp_protocol::wire::{decode, Hello, HelloReply, MessageKind, ReplyStatus};
use umbp_protocol::{ProtocolError, MAGIC, PROTOCOL_VERSION};

/// fds of a successful `HelloReply`: ring memfd, index memfd, doorbell eventfd, KV event
/// log memfd (`umbp_protocol::wire::HELLO_REPLY_FDS`).
pub const HELLO_FDS: usize = umbp_protocol::wire::HELLO_REPLY_FDS;

#[derive(Debug, thiserror::Error)]
pub enum DialError {
    /// Nothing accepted the connection (no socket file, nobody listening, backlog full).
    #[error("{0}")]
    Unreachable(io::Error),
    /// The pool refused us; retrying with the same Hello will not help.
    #[error("refused: {0}")]
    Refused(Refusal),
    /// The pool accepted but the handshake failed (closed, silent, malformed reply).
    #[error("handshake failed: {0}")]
    Broken(#[source] HandshakeError),
}

/// Why a dial was refused.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// The process listening at `path` runs as an untrusted uid (checked before anything
    /// is sent; `reason` names its uid and the uids trusted).
    #[error("{}: {reason}", path.display())]
    UntrustedPeer { path: PathBuf, reason: String },
    /// The pool's `HelloReply` carried a refusal status and its message.
    #[error("{status:?}: {message}")]
    Status { status: ReplyStatus, message: String },
    /// The pool speaks another protocol version.
    #[error("pool speaks protocol {pool}, this client {PROTOCOL_VERSION}")]
    ProtocolVersion { pool: u32 },
}

/// How a handshake with an accepting pool failed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("making the socket blocking: {0}")]
    Socket(#[source] io::Error),
    #[error("sending Hello: {0}")]
    Send(#[source] MessageError),
    #[error("no reply to Hello within {0:?}")]
    Timeout(Duration),
    #[error("reading HelloReply: {0}")]
    Recv(#[source] MessageError),
    #[error("expected HelloReply, got {0:?}")]
    UnexpectedKind(MessageKind),
    #[error("malformed HelloReply: {0}")]
    Malformed(#[source] ProtocolError),
    #[error("bad magic {0:#010x} in HelloReply: not a UMBP pool")]
    BadMagic(u32),
    #[error("HelloReply carried {0} fds, expected {HELLO_FDS}")]
    FdCount(usize),
}

impl DialError {
    pub fn into_io(self) -> io::Error {
        match self {
            DialError::Unreachable(e) => e,
            DialError::Refused(r) => io::Error::new(io::ErrorKind::PermissionDenied, r),
            DialError::Broken(h) => io::Error::new(io::ErrorKind::ConnectionAborted, h),
        }
    }
}

/// A handshake in progress.
pub struct Dial {
    sock: UnixStream,
    pool: crate::peer::PeerCred,
    deadline: Instant,
    reply_timeout: Duration,
}

/// What a successful handshake hands over.
pub struct Attached {
    pub sock: UnixStream,
    /// The pool's credentials, checked against the trusted uids before anything was sent;
    /// `pool.pid` is the pool's pid as the kernel reports it (0: another pid namespace).
    pub pool: crate::peer::PeerCred,
    pub reply: HelloReply,
    pub fds: Vec<OwnedFd>,
}

fn timespec(d: Duration) -> rustix::time::Timespec {
    rustix::time::Timespec { tv_sec: d.as_secs().min(i64::MAX as u64) as i64, tv_nsec: d.subsec_nanos() as _ }
}

/// Waits up to `wait` for `sock` to be readable (data, EOF or error all count). A signal
/// interrupting the wait (EINTR) does not end it: it goes on for what is left of `wait`.
pub fn readable(sock: &UnixStream, wait: Duration) -> bool {
    let until = Instant::now() + wait;
    loop {
        let mut fds = [PollFd::new(sock, PollFlags::IN)];
        let left = until.saturating_duration_since(Instant::now());
        match poll(&mut fds, Some(&timespec(left))) {
            Err(rustix::io::Errno::INTR) => continue,
            r => return matches!(r, Ok(n) if n > 0),
        }
    }
}

impl Dial {
    /// Connects and sends `hello`. Never waits on the pool: a unix-socket connect either
    /// completes at once or fails (EAGAIN when the listener's backlog is full, which a
    /// blocking connect would wait out).
    ///
    /// Before sending anything, the listening process must run as this process's uid, root,
    /// or `pool_uid` (None: `UMBP_POOL_UID`); anyone else (a socket put in place of the
    /// pool's) is `Refused` with a message naming its uid.
    pub fn start(path: &Path, hello: &Hello, reply_timeout: Duration, pool_uid: Option<u32>) -> Result<Self, DialError> {
        let fd = socket_with(AddressFamily::UNIX, SocketType::STREAM, SocketFlags::CLOEXEC | SocketFlags::NONBLOCK, None)
            .map_err(|e| DialError::Unreachable(e.into()))?;
        let addr = SocketAddrUnix::new(path).map_err(|e| DialError::Unreachable(e.into()))?;
        connect(&fd, &addr).map_err(|e| DialError::Unreachable(e.into()))?;
        let sock = UnixStream::from(fd);
        let pool = crate::peer::check_pool_peer(std::os::fd::AsFd::as_fd(&sock), pool_uid)
            .map_err(|reason| DialError::Refused(Refusal::UntrustedPeer { path: path.to_path_buf(), reason }))?;
        // Unbounded messages (no timeout) block in the call itself: a blocking socket.
        sock.set_nonblocking(false).map_err(|e| DialError::Broken(HandshakeError::Socket(e)))?;
        let sent = send_message(&sock, MessageKind::Hello, bytemuck::bytes_of(hello), &[], Some(reply_timeout));
        let mut d = Self { sock, pool, deadline: Instant::now() + reply_timeout, reply_timeout };
        if let Err(e) = sent {
            // A pool that refuses at accept (a limit, its uid allow-list) answers and closes
            // before our Hello lands: its refusal is the reason, not the broken pipe.
            if let Err(refused @ DialError::Refused(_)) = d.finish(Duration::ZERO) {
                return Err(refused);
            }
            return Err(DialError::Broken(HandshakeError::Send(e)));
        }
        Ok(d)
    }

    /// Waits up to `wait` (zero: just looks) for the reply. Ok(None): not there yet and the
    /// reply timeout has not passed.
    pub fn finish(&mut self, wait: Duration) -> Result<Option<(HelloReply, Vec<OwnedFd>)>, DialError> {
        let wait = wait.min(self.deadline.saturating_duration_since(Instant::now()));
        if !readable(&self.sock, wait) {
            if Instant::now() >= self.deadline {
                return Err(DialError::Broken(HandshakeError::Timeout(self.reply_timeout)));
            }
            return Ok(None);
        }
        // The reply is one small message written at once, so it is all there (or EOF).
        let msg = recv_message(&self.sock, Some(Duration::from_millis(100))).map_err(|e| DialError::Broken(HandshakeError::Recv(e)))?;
        if msg.kind != MessageKind::HelloReply {
            return Err(DialError::Broken(HandshakeError::UnexpectedKind(msg.kind)));
        }
        let reply: HelloReply = decode(&msg.payload).map_err(|e| DialError::Broken(HandshakeError::Malformed(e)))?;
        if reply.magic != MAGIC {
            return Err(DialError::Broken(HandshakeError::BadMagic(reply.magic)));
        }
        if reply.status != ReplyStatus::Ok as u32 {
            let status = ReplyStatus::from_u32(reply.status);
            return Err(DialError::Refused(Refusal::Status { status, message: reply.message() }));
        }
        if reply.protocol_version != PROTOCOL_VERSION {
            return Err(DialError::Refused(Refusal::ProtocolVersion { pool: reply.protocol_version }));
        }
        if msg.fds.len() != HELLO_FDS {
            return Err(DialError::Broken(HandshakeError::FdCount(msg.fds.len())));
        }
        Ok(Some((reply, msg.fds)))
    }

    pub fn into_attached(self, reply: HelloReply, fds: Vec<OwnedFd>) -> Attached {
        Attached { sock: self.sock, pool: self.pool, reply, fds }
    }

    /// Start and finish, waiting for the reply up to `reply_timeout`.
    pub fn blocking(path: &Path, hello: &Hello, reply_timeout: Duration, pool_uid: Option<u32>) -> Result<Attached, DialError> {
        let mut d = Self::start(path, hello, reply_timeout, pool_uid)?;
        loop {
            if let Some((reply, fds)) = d.finish(reply_timeout)? {
                return Ok(d.into_attached(reply, fds));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;
    use std::os::unix::net::UnixListener;
    use umbp_protocol::wire::Role;

    /// Dials a listener whose one accepted peer gets `answer` (after its Hello was read).
    fn dial_against(answer: impl FnOnce(&UnixStream) + Send + 'static) -> DialError {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let (sock, _) = listener.accept().unwrap();
            recv_message(&sock, Some(Duration::from_secs(5))).expect("the Hello");
            answer(&sock);
        });
        let hello = Hello::new(Role::Worker, 1, std::process::id());
        let err = Dial::blocking(&path, &hello, Duration::from_secs(5), None).err().expect("the dial fails");
        server.join().unwrap();
        err
    }

    #[test]
    fn a_refusal_keeps_its_status_and_message() {
        let e = dial_against(|s| {
            let r = HelloReply::refusal(ReplyStatus::PermissionDenied, "uid 5 is not allowed");
            send_message(s, MessageKind::HelloReply, bytemuck::bytes_of(&r), &[], None).unwrap();
        });
        let DialError::Refused(Refusal::Status { status, message }) = &e else { panic!("{e:?}") };
        assert_eq!((*status, message.as_str()), (ReplyStatus::PermissionDenied, "uid 5 is not allowed"));
        assert_eq!(e.to_string(), "refused: PermissionDenied: uid 5 is not allowed");
        assert_eq!(e.into_io().kind(), io::ErrorKind::PermissionDenied);
    }

    #[test]
    fn a_broken_handshake_keeps_its_cause_as_the_source() {
        // The peer closes instead of answering.
        let e = dial_against(|_| {});
        assert!(matches!(e, DialError::Broken(HandshakeError::Recv(MessageError::Closed))), "{e:?}");
        let source = e.source().expect("the handshake error is the source");
        assert!(source.source().is_some_and(|m| m.to_string().contains("closed")), "{source}");
        // The peer answers with another message kind.
        let e = dial_against(|s| send_message(s, MessageKind::Reply, &[0; 8], &[], None).unwrap());
        assert!(matches!(e, DialError::Broken(HandshakeError::UnexpectedKind(MessageKind::Reply))), "{e:?}");
        let io = e.into_io();
        assert_eq!(io.kind(), io::ErrorKind::ConnectionAborted);
        assert!(io.get_ref().is_some_and(|h| h.is::<HandshakeError>()), "{io:?}");
    }
}
