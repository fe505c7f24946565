//! The encrypted, authenticated control channel between pools: a Noise handshake
//! (`Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s`, the `snow` crate) keyed by a PSK derived from
//! the cluster secret, then AEAD records in both directions.
//!
//! ## Handshake (every byte after the 8-byte preface is Noise)
//! ```text
//!  client                                              server
//!  "UMBP" version(u32 LE)                     ─────▶  another version: close (named in its log)
//!  rec( psk, e ; enc{Hello{node_c, acl_c}} )  ─────▶  fails to decrypt: rec(empty) = "refused", close
//!                                                     acl_c != acl_s: rec(... enc{Refused}) , close
//!                                             ◀─────  rec( e, ee ; enc{Accept{node_s, acl_s}} )
//!  fails to decrypt: the server lacks the secret
//!  transport: enc{Ready}                      ─────▶  the client is admitted only now
//! ```
//! `rec(x)` is a u16 BE length then `x` (the Noise framing convention). The PSK is
//! HKDF-SHA256 of the secret ([`crate::control::derive_psk`]), never the secret itself; it is mixed in
//! before the first message, so only a holder of the secret can produce a first message
//! the server accepts or a reply the client accepts. Both ephemeral keys enter the
//! session keys: the keys of every connection are fresh, and a relay that forwards the
//! handshake (an address a member dials, see docs/security.md) forwards ciphertext it can
//! neither read nor alter. A replayed first message gets a reply no one can decrypt, and
//! the server admits a client only on its first transport record (`Ready`), so a replay
//! holds no admitted slot.
//!
//! ## Records after the handshake
//! The plaintext is the stream of control frames (`control::write_msg`: u32 LE length,
//! JSON), cut into records of at most [`MAX_RECORD_PLAINTEXT`] bytes, each sealed with
//! ChaCha20-Poly1305 under the direction's key and an implicit nonce (the record's number
//! in its direction, never sent). A record altered, dropped, replayed, reordered or
//! injected fails to open, and the connection is closed.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use snow::StatelessTransportState;

use crate::control::{ControlError, Msg, Secret, HANDSHAKE_MAX_FRAME, PROTOCOL_VERSION};

/// The Noise pattern and primitives.
pub const NOISE_PARAMS: &str = "Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s";
const PREFACE_MAGIC: &[u8; 4] = b"UMBP";
const PROLOGUE: &[u8] = b"umbp-cluster-control-v3";
/// Largest Noise message (the spec's bound) and the plaintext one record carries.
pub const MAX_RECORD: usize = 65535;
pub const MAX_RECORD_PLAINTEXT: usize = MAX_RECORD - 16;

/// The handshake payloads (inside the Noise messages, so encrypted and authenticated).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(tag = "t")]
enum HandshakePayload {
    Hello { node: u64, acl: [u8; 32] },
    Accept { node: u64, acl: [u8; 32] },
    Refused { reason: String },
}

/// One direction's sealing key and record counter (the implicit nonce).
pub struct Sealer {
    state: Arc<StatelessTransportState>,
    nonce: u64,
    buf: Vec<u8>,
}

impl Sealer {
    /// Writes `plain` (whole control frames) as sealed records in one `write_all`.
    pub fn write_frames(&mut self, w: &mut impl Write, plain: &[u8]) -> io::Result<()> {
        self.buf.clear();
        for chunk in plain.chunks(MAX_RECORD_PLAINTEXT) {
            let at = self.buf.len();
            self.buf.resize(at + 2 + chunk.len() + 16, 0);
            let n = self
                .state
                .write_message(self.nonce, chunk, &mut self.buf[at + 2..])
                .map_err(|e| io::Error::other(format!("control record seal: {e}")))?;
            self.nonce += 1;
            self.buf[at..at + 2].copy_from_slice(&(n as u16).to_be_bytes());
            self.buf.truncate(at + 2 + n);
        }
        w.write_all(&self.buf)
    }
}

/// One direction's opening key and record counter; reads the plaintext frame stream.
pub struct Opener<R> {
    state: Arc<StatelessTransportState>,
    nonce: u64,
    inner: R,
    rec: Vec<u8>,
    plain: Vec<u8>,
    pos: usize,
}

impl<R: Read> Opener<R> {
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }

    fn next_record(&mut self) -> io::Result<()> {
        let mut len = [0u8; 2];
        self.inner.read_exact(&mut len)?;
        let len = u16::from_be_bytes(len) as usize;
        self.rec.resize(len, 0);
        self.inner.read_exact(&mut self.rec)?;
        self.plain.resize(len, 0);
        let n = self.state.read_message(self.nonce, &self.rec, &mut self.plain).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("control record {} failed authentication ({e}): altered or injected", self.nonce),
            )
        })?;
        self.nonce += 1;
        self.plain.truncate(n);
        self.pos = 0;
        Ok(())
    }
}

impl<R: Read> Read for Opener<R> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        while self.pos == self.plain.len() {
            self.next_record()?;
        }
        let n = out.len().min(self.plain.len() - self.pos);
        out[..n].copy_from_slice(&self.plain[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// An established channel: the peer's node id and both directions' keys.
pub struct Established {
    pub peer: u64,
    pub sealer: Sealer,
    pub opener: Opener<TcpStream>,
}

/// A socket under one total deadline: every read and write gets the time left (not a
/// fresh timeout each), so a peer trickling a byte at a time is cut at the deadline.
struct Deadlined<'a> {
    s: &'a TcpStream,
    deadline: Instant,
}

impl Deadlined<'_> {
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "cluster handshake deadline passed"));
        }
        Ok(left)
    }
}

impl Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.s.set_read_timeout(Some(self.left()?))?;
        (&mut &*self.s).read(buf)
    }
}

impl Write for Deadlined<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.s.set_write_timeout(Some(self.left()?))?;
        (&mut &*self.s).write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn read_record(r: &mut impl Read) -> Result<Vec<u8>, ControlError> {
    let mut len = [0u8; 2];
    r.read_exact(&mut len)?;
    let len = u16::from_be_bytes(len) as usize;
    if len > HANDSHAKE_MAX_FRAME {
        return Err(ControlError::FrameTooLarge { len, max: HANDSHAKE_MAX_FRAME });
    }
    let mut b = vec![0u8; len];
    r.read_exact(&mut b)?;
    Ok(b)
}

fn write_record(w: &mut impl Write, body: &[u8]) -> Result<(), ControlError> {
    let mut b = Vec::with_capacity(2 + body.len());
    b.extend_from_slice(&(body.len() as u16).to_be_bytes());
    b.extend_from_slice(body);
    w.write_all(&b)?;
    Ok(())
}

fn builder(secret: &Secret) -> snow::Builder<'_> {
    snow::Builder::new(NOISE_PARAMS.parse().expect("a valid Noise pattern name")).psk(0, secret.psk()).prologue(PROLOGUE)
}

fn noise_err(e: snow::Error) -> ControlError {
    ControlError::Noise(e.to_string())
}

fn split(hs: snow::HandshakeState, s: &TcpStream) -> Result<(Sealer, Opener<TcpStream>), ControlError> {
    let state = Arc::new(hs.into_stateless_transport_mode().map_err(noise_err)?);
    let sealer = Sealer { state: state.clone(), nonce: 0, buf: Vec::new() };
    let opener = Opener { state, nonce: 0, inner: s.try_clone()?, rec: Vec::new(), plain: Vec::new(), pos: 0 };
    Ok((sealer, opener))
}

fn clear_timeouts(s: &TcpStream) -> Result<(), ControlError> {
    s.set_read_timeout(None)?;
    s.set_write_timeout(None)?;
    Ok(())
}

/// Client side (`acl`: this pool's `control::acl_digest`), all of it within `timeout`.
pub fn client_handshake(s: &TcpStream, secret: &Secret, node: u64, acl: &[u8; 32], timeout: Duration) -> Result<Established, ControlError> {
    let mut d = Deadlined { s, deadline: Instant::now() + timeout };
    let mut hs = builder(secret).build_initiator().map_err(noise_err)?;
    let hello = serde_json::to_vec(&HandshakePayload::Hello { node, acl: *acl })?;
    let mut msg = vec![0u8; HANDSHAKE_MAX_FRAME];
    let n = hs.write_message(&hello, &mut msg).map_err(noise_err)?;
    let mut first = Vec::with_capacity(10 + n);
    first.extend_from_slice(PREFACE_MAGIC);
    first.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    first.extend_from_slice(&(n as u16).to_be_bytes());
    first.extend_from_slice(&msg[..n]);
    d.write_all(&first)?;
    let reply = match read_record(&mut d) {
        Ok(r) if r.is_empty() => return Err(ControlError::Auth("the server refused this pool's handshake (different cluster secret)")),
        Ok(r) => r,
        Err(ControlError::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof => {
            return Err(ControlError::Auth("the server closed the handshake (another cluster protocol version?)"))
        }
        Err(e) => return Err(e),
    };
    let mut payload = vec![0u8; reply.len()];
    let n = hs.read_message(&reply, &mut payload).map_err(|_| ControlError::Auth("the server does not know the cluster secret"))?;
    let server = match serde_json::from_slice(&payload[..n])? {
        HandshakePayload::Accept { node, acl: peer_acl } => {
            if peer_acl != *acl {
                return Err(ControlError::AclMismatch { peer: crate::control::short_hex(&peer_acl), ours: crate::control::short_hex(acl) });
            }
            node
        }
        HandshakePayload::Refused { reason } if reason.starts_with("namespace ACL") => {
            // "namespace ACL digest {ours} differs from this pool's {theirs}"
            let peer = reason.rsplit(' ').next().unwrap_or("?").to_string();
            return Err(ControlError::AclMismatch { peer, ours: crate::control::short_hex(acl) });
        }
        HandshakePayload::Refused { reason } => return Err(ControlError::Unexpected { expected: "Accept", got: reason }),
        HandshakePayload::Hello { .. } => return Err(ControlError::Unexpected { expected: "Accept", got: "Hello".into() }),
    };
    let (mut sealer, opener) = split(hs, s)?;
    let mut ready = Vec::new();
    crate::control::write_msg(&mut ready, &Msg::Ready)?;
    sealer.write_frames(&mut d, &ready)?;
    clear_timeouts(s)?;
    Ok(Established { peer: server, sealer, opener })
}

/// Server side (`acl`: this pool's `control::acl_digest`), all of it — up to the client's
/// first sealed record — within `timeout`. A client with another ACL digest (that knows
/// the secret) is refused naming both digests.
pub fn server_handshake(s: &TcpStream, secret: &Secret, node: u64, acl: &[u8; 32], timeout: Duration) -> Result<Established, ControlError> {
    let mut d = Deadlined { s, deadline: Instant::now() + timeout };
    let mut preface = [0u8; 8];
    d.read_exact(&mut preface)?;
    if &preface[..4] != PREFACE_MAGIC {
        return Err(ControlError::Unexpected { expected: "the UMBP cluster preface", got: format!("{:02x?}", &preface[..4]) });
    }
    let version = u32::from_le_bytes(preface[4..].try_into().expect("4 bytes"));
    if version != PROTOCOL_VERSION {
        return Err(ControlError::Version(version));
    }
    let first = read_record(&mut d)?;
    let mut hs = builder(secret).build_responder().map_err(noise_err)?;
    let mut payload = vec![0u8; first.len()];
    let n = match hs.read_message(&first, &mut payload) {
        Ok(n) => n,
        Err(_) => {
            // Unauthenticated "refused" (an empty record): a clear error at an honest client
            // with another secret; an attacker on the path could forge it, but could as well
            // drop the connection.
            let _ = write_record(&mut d, &[]);
            return Err(ControlError::Auth("the client does not know the cluster secret"));
        }
    };
    let (client, peer_acl) = match serde_json::from_slice(&payload[..n])? {
        HandshakePayload::Hello { node, acl } => (node, acl),
        _ => return Err(ControlError::Unexpected { expected: "Hello", got: "another handshake payload".into() }),
    };
    let mut msg = vec![0u8; HANDSHAKE_MAX_FRAME];
    if peer_acl != *acl {
        let (peer, ours) = (crate::control::short_hex(&peer_acl), crate::control::short_hex(acl));
        let reason = format!("namespace ACL digest {peer} differs from this pool's {ours}");
        let body = serde_json::to_vec(&HandshakePayload::Refused { reason })?;
        if let Ok(n) = hs.write_message(&body, &mut msg) {
            let _ = write_record(&mut d, &msg[..n]);
        }
        return Err(ControlError::AclMismatch { peer, ours });
    }
    let body = serde_json::to_vec(&HandshakePayload::Accept { node, acl: *acl })?;
    let n = hs.write_message(&body, &mut msg).map_err(noise_err)?;
    write_record(&mut d, &msg[..n])?;
    let (sealer, opener) = split(hs, s)?;
    // The client's first sealed record, read under the same deadline.
    let mut opener = Opener { inner: d, state: opener.state, nonce: 0, rec: Vec::new(), plain: Vec::new(), pos: 0 };
    match crate::control::read_msg(&mut opener, HANDSHAKE_MAX_FRAME)? {
        Msg::Ready => {}
        m => return Err(ControlError::Unexpected { expected: "Ready", got: format!("{m:?}") }),
    }
    if opener.pos != opener.plain.len() {
        return Err(ControlError::Unexpected { expected: "Ready alone in its record", got: "more".into() });
    }
    let opener = Opener { inner: s.try_clone()?, state: opener.state, nonce: opener.nonce, rec: Vec::new(), plain: Vec::new(), pos: 0 };
    clear_timeouts(s)?;
    Ok(Established { peer: client, sealer, opener })
}

/// Two ends of an established channel over loopback TCP (for tests of what runs over it).
#[cfg(test)]
pub(crate) fn test_pair() -> (Established, Established) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let k = Secret::new(b"0123456789abcdef-test".to_vec()).unwrap();
    let k2 = k.clone();
    let server = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        server_handshake(&s, &k2, 2, &[0; 32], Duration::from_secs(5)).unwrap()
    });
    let c = TcpStream::connect(addr).unwrap();
    let c = client_handshake(&c, &k, 1, &[0; 32], Duration::from_secs(5)).unwrap();
    (c, server.join().unwrap())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::{acl_digest, read_msg, short_hex, write_msg, MAX_FRAME};
    use std::net::TcpListener;

    fn secret(b: &[u8]) -> Secret {
        Secret::new(b.to_vec()).unwrap()
    }

    type Side = Result<Established, ControlError>;

    fn pair_acl(cs: Secret, ca: [u8; 32], ss: Secret, sa: [u8; 32]) -> (Side, Side) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            server_handshake(&s, &ss, 2, &sa, Duration::from_secs(5))
        });
        let c = TcpStream::connect(addr).unwrap();
        let cr = client_handshake(&c, &cs, 1, &ca, Duration::from_secs(5));
        (cr, server.join().unwrap())
    }

    fn pair(cs: Secret, ss: Secret) -> (Side, Side) {
        pair_acl(cs, [0; 32], ss, [0; 32])
    }

    #[test]
    fn same_secret_authenticates_both_ways_and_frames_flow_sealed() {
        let (c, s) = pair(secret(b"0123456789abcdef-shared"), secret(b"0123456789abcdef-shared"));
        let (mut c, mut s) = (c.unwrap(), s.unwrap());
        assert_eq!((c.peer, s.peer), (2, 1));
        // A frame larger than one record, both ways.
        let big = Msg::Join { agent: "a".into(), metadata: vec![7u8; 200_000], base: 1, len: 2, lease_ms: 3 };
        let mut plain = Vec::new();
        write_msg(&mut plain, &big).unwrap();
        write_msg(&mut plain, &Msg::Heartbeat).unwrap();
        let mut sock = c.opener.get_mut().try_clone().unwrap();
        c.sealer.write_frames(&mut sock, &plain).unwrap();
        assert_eq!(read_msg(&mut s.opener, MAX_FRAME).unwrap(), big);
        assert_eq!(read_msg(&mut s.opener, MAX_FRAME).unwrap(), Msg::Heartbeat);
        let mut sock = s.opener.get_mut().try_clone().unwrap();
        s.sealer.write_frames(&mut sock, &plain).unwrap();
        assert_eq!(read_msg(&mut c.opener, MAX_FRAME).unwrap(), big);
    }

    #[test]
    fn wrong_secret_is_refused_on_both_sides() {
        let (c, s) = pair(secret(b"0123456789abcdef-client"), secret(b"0123456789abcdef-server"));
        assert!(matches!(c, Err(ControlError::Auth(_))), "{:?}", c.err());
        assert!(matches!(s, Err(ControlError::Auth(_))), "{:?}", s.err());
    }

    /// Same secret, different namespace ACLs: both sides refuse with an error naming both
    /// digests (not an authentication failure).
    #[test]
    fn a_peer_with_another_acl_is_refused_naming_both_digests() {
        use crate::control::tests::groups;
        let k = secret(b"0123456789abcdef-shared");
        let (ca, sa) = (acl_digest(&groups(&[(1, &[0xa])])), acl_digest(&groups(&[(1, &[0xb])])));
        let (c, s) = pair_acl(k.clone(), ca, k.clone(), sa);
        for (side, r) in [("client", c), ("server", s)] {
            let e = r.err().expect(side);
            assert!(matches!(e, ControlError::AclMismatch { .. }), "{side}: {e:?}");
            let t = e.to_string();
            assert!(t.contains(&short_hex(&ca)) && t.contains(&short_hex(&sa)) && t.contains("--namespace-acl"), "{side}: {t}");
        }
        let (c, s) = pair_acl(k.clone(), ca, k, ca);
        assert_eq!((c.unwrap().peer, s.unwrap().peer), (2, 1), "same ACL joins");
    }

    /// The handshake deadline is total: a client sending one byte every 1.5 s (each read
    /// well within any per-read timeout) is cut at the deadline. Failed on the per-read
    /// timeout of the HMAC handshake (it waited as long as the trickle lasted).
    #[test]
    fn a_trickling_client_is_cut_at_the_total_deadline() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let trickle = std::thread::spawn(move || {
            let mut c = TcpStream::connect(addr).unwrap();
            let bytes = b"UMBP\x03\x00\x00\x00\x00\x40";
            for b in bytes.iter().cycle().take(8) {
                if c.write_all(&[*b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(1500));
            }
        });
        let (s, _) = l.accept().unwrap();
        let t = Instant::now();
        let r = server_handshake(&s, &secret(b"0123456789abcdef"), 2, &[0; 32], Duration::from_secs(2));
        let took = t.elapsed();
        assert!(r.is_err());
        assert!(took < Duration::from_millis(2500), "cut after {took:?}, deadline 2 s");
        drop(s);
        trickle.join().unwrap();
    }

    #[test]
    fn an_oversized_handshake_record_is_refused() {
        let mut b = Vec::new();
        b.extend_from_slice(&60000u16.to_be_bytes());
        let e = read_record(&mut b.as_slice()).unwrap_err();
        assert!(matches!(e, ControlError::FrameTooLarge { .. }), "{e}");
    }

    /// What a relay between two members sees and can do: only ciphertext (no frame, no
    /// field name, no key in the clear), and any record it alters or injects fails to open.
    #[test]
    fn a_relay_reads_nothing_and_cannot_alter_or_inject() {
        let (c, s) = pair(secret(b"0123456789abcdef-shared"), secret(b"0123456789abcdef-shared"));
        let (mut c, mut s) = (c.unwrap(), s.unwrap());
        let mut plain = Vec::new();
        let pin = Msg::Pin { id: 77, group: 0, namespace: 5, key: 0xfeed_beef, size: 4096 };
        write_msg(&mut plain, &pin).unwrap();
        let mut wire = Vec::new();
        c.sealer.write_frames(&mut wire, &plain).unwrap();
        for needle in [&b"Pin"[..], b"feedbeef", b"\"t\"", b"size"] {
            assert!(!wire.windows(needle.len()).any(|w| w == needle), "{:?} in the clear", String::from_utf8_lossy(needle));
        }
        // Altered: one bit flipped in the ciphertext.
        let mut bad = wire.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        let mut o = Opener { state: s.opener.state.clone(), nonce: 0, inner: bad.as_slice(), rec: Vec::new(), plain: Vec::new(), pos: 0 };
        let e = read_msg(&mut o, MAX_FRAME).unwrap_err();
        assert!(e.to_string().contains("failed authentication"), "{e}");
        // Injected: a plaintext frame of the old protocol, then a replay of a real record.
        let mut inj = Vec::new();
        write_msg(&mut inj, &pin).unwrap();
        let mut o = Opener { state: s.opener.state.clone(), nonce: 0, inner: inj.as_slice(), rec: Vec::new(), plain: Vec::new(), pos: 0 };
        assert!(read_msg(&mut o, MAX_FRAME).is_err(), "a plaintext frame is not a record");
        let mut sock = c.opener.get_mut().try_clone().unwrap();
        sock.write_all(&wire).unwrap();
        assert_eq!(read_msg(&mut s.opener, MAX_FRAME).unwrap(), pin, "the genuine record opens");
        sock.write_all(&wire).unwrap();
        let e = read_msg(&mut s.opener, MAX_FRAME).unwrap_err();
        assert!(e.to_string().contains("failed authentication"), "a replayed record: {e}");
    }
}
