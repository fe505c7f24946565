//! The pools' own control connection (TCP, `--cluster-listen HOST:PORT`): framing, the
//! mutual HMAC-SHA256 challenge-response over the shared cluster secret, and the messages
//! (NIXL metadata exchange, heartbeats, the key change stream, pin/unpin around a read).
//!
//! ## Handshake (both sides prove the secret; the secret never crosses the wire)
//! ```text
//!  client                                           server
//!  Hello{version, node_c, nonce_c, acl_c}   ─────▶  acl_c != acl_s: Refused (names both)
//!                                           ◀─────  Challenge{node_s, nonce_s, acl_s,
//!                                                     mac_s = H(S, "umbp-s" nc ns node_c node_s acl)}
//!  acl_s != acl_c: stop (names both); verify mac_s (else: server does not know S)
//!  Proof{mac_c = H(S, "umbp-c" ns nc node_s node_c acl)} ─▶ verify mac_c (else: Refused, close)
//!                                           ◀─────  Welcome
//! ```
//! `acl` is [`acl_digest`] of the pool's namespace ACL: the members of a cluster enforce
//! the same ACL, so a key listed on one pool is visible to the same engines on every pool
//! (docs/cluster.md, "Namespaces and tenant groups"). The digest is covered by both MACs,
//! so a peer cannot join with one digest and act on another.
//! Fresh 32-byte nonces from both sides make every transcript unique (no replay); the
//! role labels keep a reflected server MAC from passing as a client proof. Frames before
//! Welcome are at most [`HANDSHAKE_MAX_FRAME`] bytes and the handshake has a deadline, so
//! an unauthenticated peer can hold neither memory nor a thread for long. After Welcome
//! the connection is trusted but not encrypted or integrity-protected: run the cluster on
//! a private network (docs/cluster.md).
//!
//! ## Frames
//! `u32 LE length` then that many bytes of JSON ([`Msg`]). JSON because this is the
//! control plane (metadata once per join, key changes in batches, heartbeats); the bytes
//! of objects go over NIXL.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::catalog::{u128_hex, KeyChange};

/// 2: the namespace ACL digest in the handshake, the namespace in pins.
pub const PROTOCOL_VERSION: u32 = 2;
/// Largest frame before authentication.
pub const HANDSHAKE_MAX_FRAME: usize = 4096;
/// Largest frame after it (a snapshot batch, a metadata blob).
pub const MAX_FRAME: usize = 16 << 20;
/// Smallest accepted secret.
pub const MIN_SECRET_BYTES: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("control connection I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("control frame of {len} bytes exceeds the {max}-byte limit")]
    FrameTooLarge { len: usize, max: usize },
    #[error("bad control message: {0}")]
    Decode(#[from] serde_json::Error),
    #[error("unexpected control message: expected {expected}, got {got}")]
    Unexpected { expected: &'static str, got: String },
    #[error("peer runs cluster protocol {0}, this pool {PROTOCOL_VERSION}")]
    Version(u32),
    #[error("cluster authentication failed: {0}")]
    Auth(&'static str),
    #[error("the peer enforces another --namespace-acl (ACL digest {peer}, this pool {ours}): every member must run with the same --namespace-acl flags")]
    AclMismatch { peer: String, ours: String },
    #[error("cluster secret file {path}: {reason}")]
    Secret { path: String, reason: String },
}

/// Everything that crosses a control connection.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "t")]
pub enum Msg {
    Hello { version: u32, node: u64, nonce: [u8; 32], acl: [u8; 32] },
    Challenge { node: u64, nonce: [u8; 32], acl: [u8; 32], mac: [u8; 32] },
    Proof { mac: [u8; 32] },
    Welcome,
    Refused { reason: String },
    /// The server's NIXL agent: metadata to load and its registered DRAM.
    Join { agent: String, metadata: Vec<u8>, base: u64, len: u64 },
    /// Key changes of the server's pool; `snapshot`: the first batch of a full listing
    /// (replaces what the client knew), `more`: further batches of it follow.
    Keys { changes: Vec<KeyChange>, snapshot: bool, more: bool },
    Heartbeat,
    /// Pin `key` (of `size` bytes), stored under `namespace`, for a read; answered by
    /// `Pinned` or `PinFailed` (also when the holder has the key under another namespace).
    Pin {
        id: u64,
        group: u32,
        #[serde(with = "u128_hex")]
        namespace: u128,
        #[serde(with = "u128_hex")]
        key: u128,
        size: u64,
    },
    Pinned {
        id: u64,
        group: u32,
        #[serde(with = "u128_hex")]
        key: u128,
        offset: u64,
        #[serde(with = "u128_hex")]
        namespace: u128,
    },
    PinFailed { id: u64, reason: String },
    Unpin {
        group: u32,
        #[serde(with = "u128_hex")]
        namespace: u128,
        #[serde(with = "u128_hex")]
        key: u128,
    },
}

impl Msg {
    fn name(&self) -> String {
        let s = format!("{self:?}");
        s.split([' ', '{']).next().unwrap_or("?").to_string()
    }
}

pub fn write_msg(w: &mut impl Write, m: &Msg) -> Result<(), ControlError> {
    let body = serde_json::to_vec(m)?;
    if body.len() > MAX_FRAME {
        return Err(ControlError::FrameTooLarge { len: body.len(), max: MAX_FRAME });
    }
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
    buf.extend_from_slice(&body);
    w.write_all(&buf)?;
    Ok(())
}

pub fn read_msg(r: &mut impl Read, max: usize) -> Result<Msg, ControlError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(ControlError::FrameTooLarge { len, max });
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(serde_json::from_slice(&body)?)
}

/// The shared cluster secret (from `--cluster-secret-file`).
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret({} bytes)", self.0.len())
    }
}

impl Secret {
    pub fn new(bytes: Vec<u8>) -> Result<Self, ControlError> {
        if bytes.len() < MIN_SECRET_BYTES {
            return Err(ControlError::Secret {
                path: "<bytes>".into(),
                reason: format!("{} bytes; at least {MIN_SECRET_BYTES} needed", bytes.len()),
            });
        }
        Ok(Self(bytes))
    }

    /// Reads a secret file: its bytes, a trailing newline dropped. Refuses a file other
    /// users can read (it is a credential) and one shorter than [`MIN_SECRET_BYTES`].
    pub fn from_file(path: &std::path::Path) -> Result<Self, ControlError> {
        use std::os::unix::fs::MetadataExt;
        let err = |reason: String| ControlError::Secret { path: path.display().to_string(), reason };
        let md = std::fs::metadata(path).map_err(|e| err(e.to_string()))?;
        if md.mode() & 0o077 != 0 {
            return Err(err(format!("mode {:o} lets other users read it; chmod 600", md.mode() & 0o777)));
        }
        let mut b = std::fs::read(path).map_err(|e| err(e.to_string()))?;
        while b.last().is_some_and(|c| *c == b'\n' || *c == b'\r') {
            b.pop();
        }
        let n = b.len();
        Self::new(b).map_err(|_| err(format!("{n} bytes; at least {MIN_SECRET_BYTES} needed")))
    }
}

/// SHA-256 of a pool's normalized namespace ACL: its tenant groups (groups.rs), each
/// group's sorted uids and namespaces, in their numbering, which depends on the ACL and
/// not on the order of the flags. Equal digests: the same uids may read the same
/// namespaces on both pools, and a namespace is in the same group on both.
pub fn acl_digest(groups: &umbp_pool::groups::TenantGroups) -> [u8; 32] {
    use sha2::Digest;
    let mut h = Sha256::new();
    h.update(b"umbp-namespace-acl-v1");
    h.update((groups.len() as u64).to_le_bytes());
    for g in groups.specs() {
        h.update((g.uids.len() as u64).to_le_bytes());
        for u in &g.uids {
            h.update(u.to_le_bytes());
        }
        h.update((g.namespaces.len() as u64).to_le_bytes());
        for ns in &g.namespaces {
            h.update(ns.to_le_bytes());
        }
    }
    h.finalize().into()
}

/// The first 8 bytes of a digest in hex (for errors and logs).
pub fn short_hex(d: &[u8; 32]) -> String {
    d[..8].iter().map(|b| format!("{b:02x}")).collect()
}

fn transcript(secret: &Secret, label: &[u8], first: &[u8; 32], second: &[u8; 32], node_a: u64, node_b: u64, acl: &[u8; 32]) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&secret.0).expect("HMAC takes any key length");
    m.update(label);
    m.update(first);
    m.update(second);
    m.update(&node_a.to_le_bytes());
    m.update(&node_b.to_le_bytes());
    m.update(acl);
    m
}

/// HMAC-SHA256 over the role label and the transcript (the ACL digest both sides agreed on).
pub fn transcript_mac(secret: &Secret, label: &[u8], first: &[u8; 32], second: &[u8; 32], node_a: u64, node_b: u64, acl: &[u8; 32]) -> [u8; 32] {
    transcript(secret, label, first, second, node_a, node_b, acl).finalize().into_bytes().into()
}

#[allow(clippy::too_many_arguments)]
fn verify(secret: &Secret, label: &[u8], first: &[u8; 32], second: &[u8; 32], a: u64, b: u64, acl: &[u8; 32], mac: &[u8; 32]) -> bool {
    transcript(secret, label, first, second, a, b, acl).verify_slice(mac).is_ok() // constant time
}

const SERVER_LABEL: &[u8] = b"umbp-cluster-v1-server";
const CLIENT_LABEL: &[u8] = b"umbp-cluster-v1-client";

/// 32 bytes from the kernel's CSPRNG.
pub fn nonce() -> [u8; 32] {
    let mut b = [0u8; 32];
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).expect("/dev/urandom");
    b
}

fn with_deadline<T>(s: &TcpStream, timeout: Duration, f: impl FnOnce() -> Result<T, ControlError>) -> Result<T, ControlError> {
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let r = f();
    s.set_read_timeout(None)?;
    s.set_write_timeout(None)?;
    r
}

fn expect_msg(got: Msg, expected: &'static str) -> ControlError {
    match got {
        Msg::Refused { reason } => ControlError::Unexpected { expected, got: format!("Refused ({reason})") },
        other => ControlError::Unexpected { expected, got: other.name() },
    }
}

/// Client side of the handshake (`acl`: this pool's [`acl_digest`]); returns the
/// server's node id.
pub fn client_handshake(s: &mut TcpStream, secret: &Secret, node: u64, acl: &[u8; 32], timeout: Duration) -> Result<u64, ControlError> {
    let stream = s.try_clone()?;
    with_deadline(&stream, timeout, || {
        let nc = nonce();
        write_msg(s, &Msg::Hello { version: PROTOCOL_VERSION, node, nonce: nc, acl: *acl })?;
        let (server, ns, peer_acl, mac) = match read_msg(s, HANDSHAKE_MAX_FRAME)? {
            Msg::Challenge { node, nonce, acl, mac } => (node, nonce, acl, mac),
            Msg::Refused { reason } if reason.starts_with("version") => {
                return Err(ControlError::Unexpected { expected: "Challenge", got: reason })
            }
            Msg::Refused { reason } if reason.starts_with("namespace ACL") => {
                // "namespace ACL digest {ours} differs from this pool's {theirs}"
                let peer = reason.rsplit(' ').next().unwrap_or("?").to_string();
                return Err(ControlError::AclMismatch { peer, ours: short_hex(acl) });
            }
            m => return Err(expect_msg(m, "Challenge")),
        };
        if peer_acl != *acl {
            return Err(ControlError::AclMismatch { peer: short_hex(&peer_acl), ours: short_hex(acl) });
        }
        if !verify(secret, SERVER_LABEL, &nc, &ns, node, server, acl, &mac) {
            return Err(ControlError::Auth("the server does not know the cluster secret"));
        }
        write_msg(s, &Msg::Proof { mac: transcript_mac(secret, CLIENT_LABEL, &ns, &nc, server, node, acl) })?;
        match read_msg(s, HANDSHAKE_MAX_FRAME)? {
            Msg::Welcome => Ok(server),
            Msg::Refused { .. } => Err(ControlError::Auth("the server refused this pool's proof (different cluster secret)")),
            m => Err(expect_msg(m, "Welcome")),
        }
    })
}

/// Server side of the handshake (`acl`: this pool's [`acl_digest`]); returns the
/// client's node id. A client with another ACL digest is refused before any MAC.
pub fn server_handshake(s: &mut TcpStream, secret: &Secret, node: u64, acl: &[u8; 32], timeout: Duration) -> Result<u64, ControlError> {
    let stream = s.try_clone()?;
    with_deadline(&stream, timeout, || {
        let (client, nc) = match read_msg(s, HANDSHAKE_MAX_FRAME)? {
            Msg::Hello { version, node, nonce, acl: peer_acl } => {
                if version != PROTOCOL_VERSION {
                    let _ = write_msg(s, &Msg::Refused { reason: format!("version {version} unsupported") });
                    return Err(ControlError::Version(version));
                }
                if peer_acl != *acl {
                    let (peer, ours) = (short_hex(&peer_acl), short_hex(acl));
                    let reason = format!("namespace ACL digest {peer} differs from this pool's {ours}");
                    let _ = write_msg(s, &Msg::Refused { reason });
                    return Err(ControlError::AclMismatch { peer, ours });
                }
                (node, nonce)
            }
            m => return Err(expect_msg(m, "Hello")),
        };
        let ns = nonce();
        let mac = transcript_mac(secret, SERVER_LABEL, &nc, &ns, client, node, acl);
        write_msg(s, &Msg::Challenge { node, nonce: ns, acl: *acl, mac })?;
        match read_msg(s, HANDSHAKE_MAX_FRAME)? {
            Msg::Proof { mac } if verify(secret, CLIENT_LABEL, &ns, &nc, node, client, acl, &mac) => {
                write_msg(s, &Msg::Welcome)?;
                Ok(client)
            }
            Msg::Proof { .. } => {
                let _ = write_msg(s, &Msg::Refused { reason: "authentication failed".into() });
                Err(ControlError::Auth("the client does not know the cluster secret"))
            }
            m => Err(expect_msg(m, "Proof")),
        }
    })
}

/// Time left until `deadline` (zero once past).
pub fn left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn secret(b: &[u8]) -> Secret {
        Secret::new(b.to_vec()).unwrap()
    }

    fn pair(client_secret: Secret, server_secret: Secret) -> (Result<u64, ControlError>, Result<u64, ControlError>) {
        pair_acl(client_secret, [0; 32], server_secret, [0; 32])
    }

    fn pair_acl(
        client_secret: Secret,
        client_acl: [u8; 32],
        server_secret: Secret,
        server_acl: [u8; 32],
    ) -> (Result<u64, ControlError>, Result<u64, ControlError>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            server_handshake(&mut s, &server_secret, 2, &server_acl, Duration::from_secs(5))
        });
        let mut c = TcpStream::connect(addr).unwrap();
        let cr = client_handshake(&mut c, &client_secret, 1, &client_acl, Duration::from_secs(5));
        (cr, server.join().unwrap())
    }

    fn groups(e: &[(u32, &[u128])]) -> umbp_pool::groups::TenantGroups {
        let mut m: std::collections::BTreeMap<u32, Vec<u128>> = Default::default();
        for (u, l) in e {
            m.entry(*u).or_default().extend_from_slice(l);
        }
        umbp_pool::groups::TenantGroups::from_acl(&m)
    }

    #[test]
    fn acl_digest_depends_on_the_acl_not_on_its_order() {
        let a = acl_digest(&groups(&[(7, &[0x30, 0x10]), (5, &[0x20])]));
        assert_eq!(a, acl_digest(&groups(&[(5, &[0x20, 0x20]), (7, &[0x10, 0x30])])));
        assert_ne!(a, acl_digest(&groups(&[(7, &[0x30, 0x10]), (5, &[0x21])])), "another namespace");
        assert_ne!(a, acl_digest(&groups(&[(7, &[0x30, 0x10]), (6, &[0x20])])), "another uid");
        assert_ne!(a, acl_digest(&umbp_pool::groups::TenantGroups::single()), "no ACL");
    }

    /// Same secret, different namespace ACLs: both sides refuse with an error naming both
    /// digests (not an authentication failure).
    #[test]
    fn a_peer_with_another_acl_is_refused_naming_both_digests() {
        let k = secret(b"0123456789abcdef-shared");
        let (ca, sa) = (acl_digest(&groups(&[(1, &[0xa])])), acl_digest(&groups(&[(1, &[0xb])])));
        let (c, s) = pair_acl(k.clone(), ca, k, sa);
        for (side, r) in [("client", c), ("server", s)] {
            let e = r.expect_err(side);
            assert!(matches!(e, ControlError::AclMismatch { .. }), "{side}: {e:?}");
            let t = e.to_string();
            assert!(t.contains(&short_hex(&ca)) && t.contains(&short_hex(&sa)) && t.contains("--namespace-acl"), "{side}: {t}");
        }
        let (c, s) = pair_acl(secret(b"0123456789abcdef-shared"), ca, secret(b"0123456789abcdef-shared"), ca);
        assert_eq!((c.unwrap(), s.unwrap()), (2, 1), "same ACL joins");
    }

    #[test]
    fn same_secret_authenticates_both_ways() {
        let (c, s) = pair(secret(b"0123456789abcdef-shared"), secret(b"0123456789abcdef-shared"));
        assert_eq!(c.unwrap(), 2);
        assert_eq!(s.unwrap(), 1);
    }

    #[test]
    fn wrong_secret_is_refused_on_both_sides() {
        let (c, s) = pair(secret(b"0123456789abcdef-client"), secret(b"0123456789abcdef-server"));
        assert!(matches!(c, Err(ControlError::Auth(_))), "{c:?}");
        // The client stops at the server's bad MAC: the server never gets a proof.
        assert!(s.is_err(), "{s:?}");
    }

    #[test]
    fn a_reflected_server_mac_is_not_a_client_proof() {
        let k = secret(b"0123456789abcdef-shared");
        let (nc, ns) = (nonce(), nonce());
        let acl = [7u8; 32];
        let server_mac = transcript_mac(&k, SERVER_LABEL, &nc, &ns, 1, 2, &acl);
        assert!(!verify(&k, CLIENT_LABEL, &ns, &nc, 2, 1, &acl, &server_mac));
        let mac = transcript_mac(&k, CLIENT_LABEL, &ns, &nc, 2, 1, &acl);
        assert!(verify(&k, CLIENT_LABEL, &ns, &nc, 2, 1, &acl, &mac));
        assert!(!verify(&k, CLIENT_LABEL, &ns, &nc, 2, 1, &[8u8; 32], &mac), "the MAC covers the ACL digest");
    }

    #[test]
    fn oversized_handshake_frame_is_refused_before_allocation() {
        let mut buf = Vec::new();
        buf.extend_from_slice(&(1u32 << 30).to_le_bytes());
        let e = read_msg(&mut buf.as_slice(), HANDSHAKE_MAX_FRAME).unwrap_err();
        assert!(matches!(e, ControlError::FrameTooLarge { .. }), "{e}");
    }

    #[test]
    fn a_silent_client_times_out_the_handshake() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let _c = TcpStream::connect(addr).unwrap();
        let (mut s, _) = l.accept().unwrap();
        let t = Instant::now();
        let r = server_handshake(&mut s, &secret(b"0123456789abcdef"), 2, &[0; 32], Duration::from_millis(200));
        assert!(r.is_err());
        assert!(t.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn messages_round_trip() {
        let m = Msg::Keys { changes: vec![KeyChange::stored(u128::MAX, 1 << 21, 7)], snapshot: true, more: false };
        let m2 = Msg::Pinned { id: 3, group: 0, key: 9, offset: 1 << 40, namespace: u128::MAX - 5 };
        let mut buf = Vec::new();
        write_msg(&mut buf, &m).unwrap();
        write_msg(&mut buf, &m2).unwrap();
        let mut r = buf.as_slice();
        assert_eq!(read_msg(&mut r, MAX_FRAME).unwrap(), m);
        assert_eq!(read_msg(&mut r, MAX_FRAME).unwrap(), m2);
    }

    #[test]
    fn secret_file_must_be_private_and_long_enough() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("s");
        std::fs::write(&p, b"0123456789abcdef\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = Secret::from_file(&p).unwrap_err().to_string();
        assert!(e.contains("chmod 600") && e.contains(p.to_str().unwrap()), "{e}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(Secret::from_file(&p).unwrap().0, b"0123456789abcdef");
        std::fs::write(&p, b"short").unwrap();
        assert!(Secret::from_file(&p).unwrap_err().to_string().contains("at least 16"));
    }
}
