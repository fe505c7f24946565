//! The pools' own control connection (TCP, `--cluster-listen HOST:PORT`): the messages
//! (NIXL metadata exchange, heartbeats, the key change stream, pin/unpin around a read),
//! their framing, the cluster secret and the namespace ACL digest. The connection itself
//! is a Noise channel keyed by the secret (`channel.rs`): every frame here travels sealed
//! (encrypted and authenticated), after a handshake that only holders of the secret
//! complete. The ACL digest is compared inside that handshake: the members of a cluster
//! enforce the same ACL, so a key listed on one pool is visible to the same engines on
//! every pool (docs/cluster.md, "Namespaces and tenant groups").
//!
//! ## Frames
//! `u32 LE length` then that many bytes of JSON ([`Msg`]), at most [`MAX_FRAME`] bytes
//! (checked before allocating). JSON because this is the control plane (metadata once per
//! join, key changes in batches, heartbeats); the bytes of objects go over NIXL.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use sha2::Sha256;

use crate::catalog::{u128_hex, KeyChange};

/// 2: the namespace ACL digest in the handshake, the namespace in pins. 3: the Noise
/// channel (`channel.rs`), digests in pins.
pub const PROTOCOL_VERSION: u32 = 3;
/// Largest handshake record, and largest frame before the client is admitted.
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
    #[error("cluster control channel (Noise): {0}")]
    Noise(String),
    #[error("cluster secret file {path}: {reason}")]
    Secret { path: String, reason: String },
}

/// Everything that crosses a control connection.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "t")]
pub enum Msg {
    /// The client's first sealed frame: it completed the handshake (`channel.rs`).
    Ready,
    /// The server's export agent: metadata to load and its export area (the only memory
    /// it registers for peers; `export.rs`).
    Join {
        agent: String,
        metadata: Vec<u8>,
        base: u64,
        len: u64,
        /// The server's pin lease in ms (`read_timeout + pin_lease_margin`): how long after
        /// a closed connection it keeps that subscriber's export slots. A READ completing
        /// later than this after its batch began is late (not published). 0 (a server
        /// that does not send it): the client's own `read_timeout` applies.
        #[serde(default)]
        lease_ms: u64,
    },
    /// Key changes of the server's pool; `snapshot`: the first batch of a full listing
    /// (replaces what the client knew), `more`: further batches of it follow.
    Keys {
        changes: Vec<KeyChange>,
        snapshot: bool,
        more: bool,
    },
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
        /// xxh3-128 of the object's bytes as pinned: the reader checks what it read
        /// against it before publishing (a mismatch is a miss).
        #[serde(with = "u128_hex")]
        digest: u128,
    },
    PinFailed {
        id: u64,
        reason: String,
    },
    Unpin {
        group: u32,
        #[serde(with = "u128_hex")]
        namespace: u128,
        #[serde(with = "u128_hex")]
        key: u128,
    },
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

/// The PSK of the Noise handshake: HKDF-SHA256 (salt and info fixed labels) of the secret.
pub fn derive_psk(secret: &[u8]) -> [u8; 32] {
    let hk = hkdf::Hkdf::<sha2::Sha256>::new(Some(b"umbp-cluster-psk-salt-v1"), secret);
    let mut psk = [0u8; 32];
    hk.expand(b"umbp cluster control channel: Noise_NNpsk0 psk", &mut psk).expect("32 bytes is a valid HKDF-SHA256 length");
    psk
}

/// The shared cluster secret (from `--cluster-secret-file`), kept only as the Noise PSK
/// derived from it ([`derive_psk`]).
#[derive(Clone)]
pub struct Secret {
    psk: [u8; 32],
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret(derived PSK)")
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
        Ok(Self { psk: derive_psk(&bytes) })
    }

    /// The Noise PSK derived from the secret.
    pub fn psk(&self) -> &[u8; 32] {
        &self.psk
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

/// 32 bytes from the kernel's CSPRNG.
pub fn nonce() -> [u8; 32] {
    let mut b = [0u8; 32];
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).expect("/dev/urandom");
    b
}

/// Time left until `deadline` (zero once past).
pub fn left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn groups(e: &[(u32, &[u128])]) -> umbp_pool::groups::TenantGroups {
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

    #[test]
    fn oversized_frame_is_refused_before_allocation() {
        let mut buf = Vec::new();
        buf.extend_from_slice(&(1u32 << 30).to_le_bytes());
        let e = read_msg(&mut buf.as_slice(), HANDSHAKE_MAX_FRAME).unwrap_err();
        assert!(matches!(e, ControlError::FrameTooLarge { .. }), "{e}");
    }

    #[test]
    fn messages_round_trip() {
        let m = Msg::Keys { changes: vec![KeyChange::stored(u128::MAX, 1 << 21, 7)], snapshot: true, more: false };
        let m2 = Msg::Pinned { id: 3, group: 0, key: 9, offset: 1 << 40, namespace: u128::MAX - 5, digest: u128::MAX - 1 };
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
        let s = Secret::from_file(&p).unwrap();
        assert_eq!(s.psk(), &derive_psk(b"0123456789abcdef"), "the newline dropped; only the derived PSK kept");
        assert_ne!(&s.psk()[..16], b"0123456789abcdef");
        std::fs::write(&p, b"short").unwrap();
        assert!(Secret::from_file(&p).unwrap_err().to_string().contains("at least 16"));
    }
}
