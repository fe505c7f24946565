//! One peer's control connection as a pure state machine: bytes and fds in, complete
//! messages out, replies framed into an output buffer, and the deadlines that bound each
//! step. No sockets, no threads, no clock of its own (the driver passes `now`), so the
//! fuzz target `control` (fuzz/) runs exactly this code on arbitrary byte/fd sequences.
//!
//! The driver (`server.rs`) owns the socket and the epoll set. Per readable event it reads
//! at most [`PeerConn::want`] bytes (never past the current frame, so fds that arrive with
//! a read belong to the message being read) and passes them to [`PeerConn::feed`]. A
//! complete message becomes an [`Event`]; the connection then reads nothing more until the
//! driver answers it ([`PeerConn::respond`]): one request at a time per peer, later ones
//! wait in the peer's socket buffer (backpressure, no unbounded queue in the pool).
//!
//! Deadlines ([`PeerConn::deadline`], [`PeerConn::check`]):
//! - handshake: the whole Hello must have arrived within `handshake` of the connection
//!   being accepted (after the uid check), however the peer spreads its bytes;
//! - attached: each control message must be complete within `message` of its first byte,
//!   and each reply taken by the peer within `message` of being queued.
//!
//! A violation ends the connection; nothing a peer sends can make this type block, grow
//! past one message (`MAX_MESSAGE_PAYLOAD` + header) or hold more than 8 of its fds.

use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use umbp_protocol::wire::{MessageHeader, MessageKind, MAX_MESSAGE_PAYLOAD};

const HEADER: usize = std::mem::size_of::<MessageHeader>();
/// Most fds one message may carry (the header's own limit).
pub const MAX_FDS: usize = 8;
/// Largest single read the driver is asked for.
pub const READ_CHUNK: usize = 64 << 10;

/// The deadlines of one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// From accept to a complete Hello.
    pub handshake: Duration,
    /// From a control message's first byte to its last; from a reply queued to sent.
    pub message: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Waiting for the Hello.
    Handshake,
    /// Attached: control requests, one at a time.
    Attached,
    /// A final reply (a refusal) is going out; then the driver closes the socket.
    Closing,
}

/// A complete message from the peer.
#[derive(Debug)]
pub struct Request {
    pub kind: MessageKind,
    pub payload: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

/// What the driver must answer.
#[derive(Debug)]
pub enum Event {
    /// Handshake phase: a complete Hello payload; answer with `respond(.., Next::Attach)`
    /// or a refusal with `Next::Close`.
    Hello(Vec<u8>),
    /// Attached: a control request; answer with `respond(.., Next::Continue)`.
    Request(Request),
    /// A complete message whose fds the kernel dropped (MSG_CTRUNC: the pool is out of
    /// fds, or the peer sent more than fit). The message is not acted on; the driver
    /// refuses it clearly and the peer may retry.
    Truncated(MessageKind),
}

/// What the connection does after a reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Read the next request.
    Continue,
    /// The Hello was accepted: the peer is attached from now on.
    Attach,
    /// Send this reply, then close.
    Close,
}

/// Why a connection ends. Every variant reads as a sentence for the log.
#[derive(Debug, thiserror::Error)]
pub enum Violation {
    #[error("peer closed its socket")]
    Closed,
    #[error("no complete Hello within {0:?} of connecting")]
    HandshakeTimeout(Duration),
    #[error("a control message was not complete within {0:?} of its first byte")]
    MessageTimeout(Duration),
    #[error("the peer did not take its reply within {0:?}")]
    ReplyTimeout(Duration),
    #[error("malformed message: {0}")]
    Malformed(#[source] umbp_protocol::ProtocolError),
    /// Reading the peer's socket failed (the driver's `recvmsg`).
    #[error("reading the control socket: {0}")]
    Recv(#[source] umbp_ipc::message::MessageError),
    #[error("expected Hello, got {0:?}")]
    NotHello(MessageKind),
    #[error("peer sent {got} fds with a message that carries {want}")]
    FdCount { got: usize, want: usize },
    #[error("driver fed {got} bytes where {want} were wanted")]
    Overread { got: usize, want: usize },
}

/// One peer's control connection (see the module docs).
#[derive(Debug)]
pub struct PeerConn {
    phase: Phase,
    timeouts: Timeouts,
    /// Handshake phase: the Hello must be complete by then.
    handshake_deadline: Instant,
    /// The current message so far (header, then payload).
    buf: Vec<u8>,
    /// Payload length once the header is in.
    len: Option<(MessageKind, usize, usize)>,
    fds: Vec<OwnedFd>,
    truncated: bool,
    /// When the current message's first byte arrived.
    started: Option<Instant>,
    /// A message was handed out and not answered yet.
    awaiting: bool,
    out: Vec<u8>,
    out_sent: usize,
    out_fds: Vec<OwnedFd>,
    out_since: Option<Instant>,
}

impl PeerConn {
    /// A connection accepted at `now` (its uid already allowed).
    pub fn new(now: Instant, timeouts: Timeouts) -> Self {
        Self {
            phase: Phase::Handshake,
            timeouts,
            handshake_deadline: now + timeouts.handshake,
            buf: Vec::new(),
            len: None,
            fds: Vec::new(),
            truncated: false,
            started: None,
            awaiting: false,
            out: Vec::new(),
            out_sent: 0,
            out_fds: Vec::new(),
            out_since: None,
        }
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Bytes the driver may read now: never past the current frame; 0 while a message
    /// awaits its answer, a reply is going out or the connection is closing.
    pub fn want(&self) -> usize {
        if self.awaiting || self.phase == Phase::Closing || self.has_output() {
            return 0;
        }
        match self.len {
            None => HEADER - self.buf.len(),
            Some((_, len, _)) => (HEADER + len - self.buf.len()).min(READ_CHUNK),
        }
    }

    /// Takes what one read returned: `bytes` (empty: EOF), the fds that came with them,
    /// and whether the kernel dropped fds (MSG_CTRUNC). Returns a complete message when
    /// this read finished one.
    pub fn feed(&mut self, now: Instant, bytes: &[u8], fds: Vec<OwnedFd>, truncated: bool) -> Result<Option<Event>, Violation> {
        if bytes.is_empty() {
            return Err(Violation::Closed);
        }
        let want = self.want();
        if bytes.len() > want {
            return Err(Violation::Overread { got: bytes.len(), want });
        }
        if self.buf.is_empty() {
            self.started = Some(now);
        }
        self.buf.extend_from_slice(bytes);
        self.fds.extend(fds);
        self.truncated |= truncated;
        if self.fds.len() > MAX_FDS {
            return Err(Violation::FdCount { got: self.fds.len(), want: MAX_FDS });
        }
        if self.len.is_none() && self.buf.len() == HEADER {
            let header: MessageHeader = bytemuck::pod_read_unaligned(&self.buf);
            let kind = header.validate().map_err(Violation::Malformed)?;
            debug_assert!(header.len <= MAX_MESSAGE_PAYLOAD);
            if self.phase == Phase::Handshake && kind != MessageKind::Hello {
                return Err(Violation::NotHello(kind));
            }
            self.len = Some((kind, header.len as usize, header.fd_count as usize));
        }
        let Some((kind, len, fd_count)) = self.len else { return Ok(None) };
        if self.fds.len() > fd_count {
            return Err(Violation::FdCount { got: self.fds.len(), want: fd_count });
        }
        if self.buf.len() < HEADER + len {
            return Ok(None);
        }
        // Complete.
        let payload = self.buf.split_off(HEADER);
        let fds = std::mem::take(&mut self.fds);
        let truncated = std::mem::replace(&mut self.truncated, false);
        self.buf.clear();
        self.len = None;
        self.started = None;
        self.awaiting = true;
        if truncated {
            // fds dropped here close now: the message is refused as a whole.
            return Ok(Some(Event::Truncated(kind)));
        }
        if fds.len() != fd_count {
            return Err(Violation::FdCount { got: fds.len(), want: fd_count });
        }
        Ok(Some(match self.phase {
            Phase::Handshake => Event::Hello(payload),
            _ => Event::Request(Request { kind, payload, fds }),
        }))
    }

    /// Answers the message handed out last (or, with `Next::Close`, any time: a refusal
    /// of a connection that sent nothing yet).
    pub fn respond(&mut self, now: Instant, kind: MessageKind, payload: &[u8], fds: Vec<OwnedFd>, next: Next) {
        let header = MessageHeader::new(kind, payload.len(), fds.len());
        if self.out_sent == self.out.len() {
            self.out.clear();
            self.out_sent = 0;
        }
        self.out.extend_from_slice(bytemuck::bytes_of(&header));
        self.out.extend_from_slice(payload);
        self.out_fds.extend(fds);
        self.out_since.get_or_insert(now);
        self.awaiting = false;
        match next {
            Next::Continue => {}
            Next::Attach => {
                if self.phase == Phase::Handshake {
                    self.phase = Phase::Attached;
                }
            }
            Next::Close => self.phase = Phase::Closing,
        }
    }

    pub fn has_output(&self) -> bool {
        self.out_sent < self.out.len()
    }

    /// What to write next: bytes, and fds that must go with the first of them.
    pub fn output(&self) -> (&[u8], &[OwnedFd]) {
        (&self.out[self.out_sent..], &self.out_fds)
    }

    /// `n` bytes of [`Self::output`] were written (its fds with the first of them).
    pub fn wrote(&mut self, n: usize) {
        if n > 0 {
            self.out_fds.clear();
        }
        self.out_sent = (self.out_sent + n).min(self.out.len());
        if !self.has_output() {
            self.out.clear();
            self.out_sent = 0;
            self.out_since = None;
        }
    }

    /// A closing connection whose last reply went out: the driver closes it now.
    pub fn is_done(&self) -> bool {
        self.phase == Phase::Closing && !self.has_output()
    }

    /// The next instant at which [`Self::check`] may fail (None: no deadline runs; the
    /// connection waits on the pool, not on the peer).
    pub fn deadline(&self) -> Option<Instant> {
        let out = self.out_since.map(|t| t + self.timeouts.message);
        let input = match self.phase {
            Phase::Handshake => Some(self.handshake_deadline),
            Phase::Attached => self.started.map(|t| t + self.timeouts.message),
            Phase::Closing => None,
        };
        match (out, input) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Fails once a deadline passed.
    pub fn check(&self, now: Instant) -> Result<(), Violation> {
        if self.phase == Phase::Handshake && !self.awaiting && now >= self.handshake_deadline {
            return Err(Violation::HandshakeTimeout(self.timeouts.handshake));
        }
        if let Some(t) = self.out_since {
            if now >= t + self.timeouts.message {
                return Err(Violation::ReplyTimeout(self.timeouts.message));
            }
        }
        if self.phase == Phase::Attached {
            if let Some(t) = self.started {
                if now >= t + self.timeouts.message {
                    return Err(Violation::MessageTimeout(self.timeouts.message));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use umbp_protocol::wire::{Hello, Role};

    const T: Timeouts = Timeouts { handshake: Duration::from_secs(2), message: Duration::from_secs(1) };

    fn frame(kind: MessageKind, payload: &[u8], fds: usize) -> Vec<u8> {
        let mut v = bytemuck::bytes_of(&MessageHeader::new(kind, payload.len(), fds)).to_vec();
        v.extend_from_slice(payload);
        v
    }

    /// Feeds `bytes` the way the driver reads them: never past `want()`, fds with the
    /// first read. Returns the last read's result.
    fn feed_all(c: &mut PeerConn, now: Instant, bytes: &[u8], fds: Vec<OwnedFd>, truncated: bool) -> Result<Option<Event>, Violation> {
        let (mut off, mut fds) = (0, Some(fds));
        loop {
            let n = c.want().min(bytes.len() - off);
            let r = c.feed(now, &bytes[off..off + n], fds.take().unwrap_or_default(), truncated)?;
            off += n;
            if r.is_some() || off == bytes.len() {
                return Ok(r);
            }
        }
    }

    fn memfd() -> OwnedFd {
        rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap()
    }

    #[test]
    fn hello_byte_by_byte_then_requests() {
        let t0 = Instant::now();
        let mut c = PeerConn::new(t0, T);
        let hello = frame(MessageKind::Hello, bytemuck::bytes_of(&Hello::new(Role::Worker, 1, 2)), 0);
        let mut ev = None;
        for (i, b) in hello.iter().enumerate() {
            assert!(c.want() >= 1);
            ev = c.feed(t0 + Duration::from_millis(i as u64), &[*b], vec![], false).unwrap();
        }
        assert!(matches!(ev, Some(Event::Hello(ref p)) if p.len() == std::mem::size_of::<Hello>()));
        assert_eq!(c.want(), 0, "nothing is read while the Hello awaits its answer");
        c.respond(t0, MessageKind::HelloReply, &[1, 2, 3], vec![memfd()], Next::Attach);
        assert_eq!(c.phase(), Phase::Attached);
        let (bytes, fds) = c.output();
        assert_eq!((bytes.len(), fds.len()), (HEADER + 3, 1));
        c.wrote(5);
        assert!(c.output().1.is_empty(), "fds go with the first bytes");
        c.wrote(HEADER - 2);
        assert!(!c.has_output());
        // A request with one fd.
        let reg = frame(MessageKind::RegisterMemory, &[0u8; 40], 1);
        assert!(c.feed(t0, &reg[..10], vec![memfd()], false).unwrap().is_none());
        match feed_all(&mut c, t0, &reg[10..], vec![], false).unwrap() {
            Some(Event::Request(r)) => assert_eq!((r.kind, r.payload.len(), r.fds.len()), (MessageKind::RegisterMemory, 40, 1)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn deadlines_are_per_message_not_per_read() {
        let t0 = Instant::now();
        let mut c = PeerConn::new(t0, T);
        let hello = frame(MessageKind::Hello, bytemuck::bytes_of(&Hello::new(Role::Worker, 1, 2)), 0);
        // One byte every 0.9 s: each read is "on time", the handshake is not.
        c.feed(t0 + Duration::from_millis(900), &hello[..1], vec![], false).unwrap();
        c.feed(t0 + Duration::from_millis(1800), &hello[1..2], vec![], false).unwrap();
        assert!(c.check(t0 + Duration::from_millis(1900)).is_ok());
        assert!(matches!(c.check(t0 + Duration::from_millis(2000)), Err(Violation::HandshakeTimeout(d)) if d == T.handshake));
        // Attached: a message's own deadline starts at its first byte.
        let mut c = PeerConn::new(t0, T);
        feed_all(&mut c, t0, &hello, vec![], false).unwrap();
        c.respond(t0, MessageKind::HelloReply, &[], vec![], Next::Attach);
        c.wrote(HEADER);
        assert_eq!(c.deadline(), None, "an idle attached peer has no deadline");
        let t1 = t0 + Duration::from_secs(60);
        c.feed(t1, &frame(MessageKind::StatsRequest, &[], 0)[..3], vec![], false).unwrap();
        assert_eq!(c.deadline(), Some(t1 + T.message));
        assert!(matches!(c.check(t1 + T.message), Err(Violation::MessageTimeout(d)) if d == T.message));
    }

    #[test]
    fn protocol_violations() {
        let t0 = Instant::now();
        let mut c = PeerConn::new(t0, T);
        let e = c.feed(t0, &[0xAB; 16], vec![], false).unwrap_err();
        assert!(matches!(e, Violation::Malformed(umbp_protocol::ProtocolError::BadMagic { .. })), "{e}");
        assert!(e.to_string().contains("malformed"), "{e}");
        let mut c = PeerConn::new(t0, T);
        let stats = frame(MessageKind::StatsRequest, &[], 0);
        assert!(matches!(feed_all(&mut c, t0, &stats, vec![], false), Err(Violation::NotHello(MessageKind::StatsRequest))));
        let mut c = PeerConn::new(t0, T);
        assert!(matches!(c.feed(t0, &[0; 17], vec![], false), Err(Violation::Overread { got: 17, want: 16 })));
        let mut c = PeerConn::new(t0, T);
        let hello = frame(MessageKind::Hello, bytemuck::bytes_of(&Hello::new(Role::Worker, 1, 2)), 0);
        assert!(matches!(c.feed(t0, &hello[..16], vec![memfd()], false), Err(Violation::FdCount { got: 1, want: 0 })));
        let mut c = PeerConn::new(t0, T);
        assert!(matches!(c.feed(t0, &[], vec![], false), Err(Violation::Closed)));
    }

    #[test]
    fn truncated_fds_refuse_the_message_not_the_peer() {
        let t0 = Instant::now();
        let mut c = PeerConn::new(t0, T);
        let hello = frame(MessageKind::Hello, bytemuck::bytes_of(&Hello::new(Role::Worker, 1, 2)), 0);
        feed_all(&mut c, t0, &hello, vec![], false).unwrap();
        c.respond(t0, MessageKind::HelloReply, &[], vec![], Next::Attach);
        c.wrote(HEADER);
        let reg = frame(MessageKind::RegisterMemory, &[0u8; 40], 1);
        assert!(matches!(feed_all(&mut c, t0, &reg, vec![], true), Ok(Some(Event::Truncated(MessageKind::RegisterMemory)))));
        c.respond(t0, MessageKind::Reply, &[], vec![], Next::Continue);
        c.wrote(HEADER);
        assert_eq!(c.phase(), Phase::Attached);
        assert_eq!(c.want(), HEADER);
    }
}
