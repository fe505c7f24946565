//! Messages on the unix socket: the handshake and the rare control messages after it.
//! Every message is a fixed-size `Pod` struct preceded by a [`MessageHeader`]; file
//! descriptors travel beside it as SCM_RIGHTS. KV bytes never cross the socket.

use bytemuck::{Pod, Zeroable};

use crate::{assert_layout, ProtocolError, MAGIC, PROTOCOL_VERSION};

/// What a connecting peer intends to do; the pool hands out different fds per role.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// An engine worker: submits stores and loads.
    Worker = 1,
    /// An engine scheduler: maps the index read-only and posts touch hints.
    Scheduler = 2,
    /// A debugging tool (ringtool): read-only view of pool state.
    Observer = 3,
}

impl Role {
    pub fn from_u32(v: u32) -> Result<Self, ProtocolError> {
        match v {
            1 => Ok(Role::Worker),
            2 => Ok(Role::Scheduler),
            3 => Ok(Role::Observer),
            _ => Err(ProtocolError::InvalidField { what: "role", value: v as u64 }),
        }
    }
}

/// Kind of a socket message, the second word of every [`MessageHeader`].
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageKind {
    Hello = 1,
    HelloReply = 2,
    RegisterMemory = 3,
    RegisterLayout = 4,
    Reply = 5,
    /// Observer asks for a pool state snapshot; the reply is JSON text after a `Reply`.
    StatsRequest = 6,
    /// Drop every object of the attachment's namespace (vLLM `reset_cache`).
    ResetNamespace = 7,
}

impl MessageKind {
    pub fn from_u32(v: u32) -> Result<Self, ProtocolError> {
        Ok(match v {
            1 => Self::Hello,
            2 => Self::HelloReply,
            3 => Self::RegisterMemory,
            4 => Self::RegisterLayout,
            5 => Self::Reply,
            6 => Self::StatsRequest,
            7 => Self::ResetNamespace,
            _ => return Err(ProtocolError::InvalidField { what: "message kind", value: v as u64 }),
        })
    }
}

/// Precedes every message. `len` counts the payload after the header.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable, PartialEq, Eq)]
pub struct MessageHeader {
    pub magic: u32,
    pub kind: u32,
    pub len: u32,
    /// Number of fds attached with SCM_RIGHTS.
    pub fd_count: u32,
}
assert_layout!(MessageHeader, size = 16, align = 4);

/// Largest payload any message may declare; a header over it is refused before reading.
pub const MAX_MESSAGE_PAYLOAD: u32 = 1 << 20;

impl MessageHeader {
    pub fn new(kind: MessageKind, len: usize, fd_count: usize) -> Self {
        Self { magic: MAGIC, kind: kind as u32, len: len as u32, fd_count: fd_count as u32 }
    }

    /// Checks a header read from a peer.
    pub fn validate(&self) -> Result<MessageKind, ProtocolError> {
        if self.magic != MAGIC {
            return Err(ProtocolError::BadMagic { what: "message", found: self.magic, expected: MAGIC });
        }
        if self.len > MAX_MESSAGE_PAYLOAD {
            return Err(ProtocolError::InvalidField { what: "message length", value: self.len as u64 });
        }
        if self.fd_count > 8 {
            return Err(ProtocolError::InvalidField { what: "fd count", value: self.fd_count as u64 });
        }
        MessageKind::from_u32(self.kind)
    }
}

/// First message, peer -> pool.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable, PartialEq, Eq)]
pub struct Hello {
    pub magic: u32,
    pub protocol_version: u32,
    pub role: u32,
    pub pid: u32,
    /// Key namespace (model, layout, topology digest); little-endian u128.
    pub namespace: [u8; 16],
    pub tp_rank: u32,
    pub tp_size: u32,
    pub dp_rank: u32,
    /// Requested submission ring entries (power of two; 0 = pool default).
    pub sq_entries: u32,
    /// Requested arena bytes (0 = pool default).
    pub arena_bytes: u64,
    pub reserved: [u64; 4],
}
assert_layout!(Hello, size = 88, align = 8);

impl Hello {
    pub fn new(role: Role, namespace: u128, pid: u32) -> Self {
        Self {
            magic: MAGIC,
            protocol_version: PROTOCOL_VERSION,
            role: role as u32,
            pid,
            namespace: namespace.to_le_bytes(),
            tp_rank: 0,
            tp_size: 1,
            dp_rank: 0,
            sq_entries: 0,
            arena_bytes: 0,
            reserved: [0; 4],
        }
    }

    /// Magic and version check; the pool answers a failure with a readable refusal.
    pub fn validate(&self) -> Result<Role, ProtocolError> {
        if self.magic != MAGIC {
            return Err(ProtocolError::BadMagic { what: "hello", found: self.magic, expected: MAGIC });
        }
        if self.protocol_version != PROTOCOL_VERSION {
            return Err(ProtocolError::VersionMismatch { found: self.protocol_version, expected: PROTOCOL_VERSION });
        }
        Role::from_u32(self.role)
    }

    pub fn namespace(&self) -> u128 {
        u128::from_le_bytes(self.namespace)
    }
}

/// Status of a reply. Non-zero values come with a human-readable message.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyStatus {
    Ok = 0,
    BadMagic = 1,
    VersionMismatch = 2,
    PermissionDenied = 3,
    InvalidRequest = 4,
    ResourceExhausted = 5,
    Unsupported = 6,
    Internal = 7,
}

impl ReplyStatus {
    pub fn from_u32(v: u32) -> Self {
        match v {
            0 => Self::Ok,
            1 => Self::BadMagic,
            2 => Self::VersionMismatch,
            3 => Self::PermissionDenied,
            4 => Self::InvalidRequest,
            5 => Self::ResourceExhausted,
            6 => Self::Unsupported,
            _ => Self::Internal,
        }
    }
}

/// Length of the text carried by replies.
pub const REPLY_MESSAGE_LEN: usize = 192;

/// Pool -> peer answer to [`Hello`]. On success the fds, in order, are: the attachment's
/// ring memfd (SQ, CQ, hint ring, arena; see [`crate::attachment::AttachmentLayout`]), the
/// index memfd (read-only, sealed), the doorbell eventfd the peer signals after it
/// publishes submissions while the pool sleeps, and the KV event log memfd (read-only,
/// sealed; see [`crate::events`]). Peers that need no events may ignore the fourth fd.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct HelloReply {
    pub magic: u32,
    pub protocol_version: u32,
    pub status: u32,
    pub attachment_id: u32,
    pub sq_entries: u32,
    pub cq_entries: u32,
    pub hint_entries: u32,
    pub pool_pid: u32,
    pub arena_bytes: u64,
    pub ring_region_bytes: u64,
    pub index_region_bytes: u64,
    /// Size of the event log memfd (the fourth fd); was reserved (0) before it existed.
    pub event_log_bytes: u64,
    pub message: [u8; REPLY_MESSAGE_LEN],
}
assert_layout!(HelloReply, size = 256, align = 8);

impl HelloReply {
    pub fn refusal(status: ReplyStatus, message: &str) -> Self {
        let mut r = Self::zeroed();
        r.magic = MAGIC;
        r.protocol_version = PROTOCOL_VERSION;
        r.status = status as u32;
        r.message = encode_message(message);
        r
    }

    pub fn message(&self) -> String {
        decode_message(&self.message)
    }
}

/// Generic reply to a control message.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct Reply {
    pub status: u32,
    pub _pad: u32,
    /// Request-specific value (alloc id, object bytes, payload length of what follows).
    pub value: u64,
    pub message: [u8; REPLY_MESSAGE_LEN],
}
assert_layout!(Reply, size = 208, align = 8);

impl Reply {
    pub fn ok(value: u64) -> Self {
        let mut r = Self::zeroed();
        r.value = value;
        r
    }

    pub fn error(status: ReplyStatus, message: &str) -> Self {
        let mut r = Self::zeroed();
        r.status = status as u32;
        r.message = encode_message(message);
        r
    }

    pub fn message(&self) -> String {
        decode_message(&self.message)
    }
}

/// Where the bytes of a registered allocation live, from the pool's point of view.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryKind {
    /// A memfd passed with the message; offsets are into that file.
    HostMemfd = 1,
    /// Memory of the worker process, reached with process_vm_readv/writev at `address`.
    HostProcess = 2,
    /// A CUDA allocation exported with cuIpcGetMemHandle.
    Cuda = 3,
    /// A HIP allocation exported with hipIpcGetMemHandle.
    Hip = 4,
}

impl MemoryKind {
    pub fn from_u32(v: u32) -> Result<Self, ProtocolError> {
        Ok(match v {
            1 => Self::HostMemfd,
            2 => Self::HostProcess,
            3 => Self::Cuda,
            4 => Self::Hip,
            _ => return Err(ProtocolError::InvalidField { what: "memory kind", value: v as u64 }),
        })
    }
}

/// Worker -> pool: one allocation the pool may copy to and from.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable, PartialEq, Eq)]
pub struct MemoryRegistration {
    pub kind: u32,
    /// Worker-chosen id that layout segments refer to.
    pub alloc_id: u32,
    /// GPU UUID (ordinals differ between processes with different CUDA_VISIBLE_DEVICES).
    pub device_uuid: [u8; 16],
    /// cuIpcMemHandle / hipIpcMemHandle bytes.
    pub ipc_handle: [u8; 64],
    /// Worker-side address of the registered range (HostProcess: what process_vm uses;
    /// GPU: the device pointer, for diagnostics).
    pub address: u64,
    /// Offset of the registered range from the start of the memfd / IPC allocation.
    pub offset: u64,
    pub size: u64,
    pub reserved: u64,
}
assert_layout!(MemoryRegistration, size = 120, align = 8);

/// Worker -> pool: the KV layout of one cache group; followed by `segment_count`
/// [`crate::layout::Segment`]s in the same message.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable, PartialEq, Eq)]
pub struct LayoutHeader {
    pub group: u32,
    pub segment_count: u32,
}
assert_layout!(LayoutHeader, size = 8, align = 4);

/// Most segments one layout may have (a 256-layer model with separate K and V).
pub const MAX_SEGMENTS: u32 = 1024;

/// Fds a successful [`HelloReply`] carries: ring memfd, index memfd, doorbell, event log.
pub const HELLO_REPLY_FDS: usize = 4;

pub fn encode_message(text: &str) -> [u8; REPLY_MESSAGE_LEN] {
    let mut out = [0u8; REPLY_MESSAGE_LEN];
    let bytes = text.as_bytes();
    let mut n = bytes.len().min(REPLY_MESSAGE_LEN - 1);
    while !text.is_char_boundary(n) {
        n -= 1;
    }
    out[..n].copy_from_slice(&bytes[..n]);
    out
}

pub fn decode_message(raw: &[u8; REPLY_MESSAGE_LEN]) -> String {
    let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
    String::from_utf8_lossy(&raw[..end]).into_owned()
}

/// Reads a `Pod` message from a byte buffer received from a peer, with a typed error
/// instead of a panic when it is short.
pub fn decode<T: Pod>(bytes: &[u8]) -> Result<T, ProtocolError> {
    let need = core::mem::size_of::<T>();
    if bytes.len() < need {
        return Err(ProtocolError::Truncated { need, got: bytes.len() });
    }
    Ok(bytemuck::pod_read_unaligned(&bytes[..need]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_checks_magic_and_version() {
        let ok = Hello::new(Role::Worker, 7, 1);
        assert_eq!(ok.validate(), Ok(Role::Worker));
        assert_eq!(ok.namespace(), 7);
        let mut bad = ok;
        bad.magic = 0xdead_beef;
        assert!(matches!(bad.validate(), Err(ProtocolError::BadMagic { .. })));
        let mut old = ok;
        old.protocol_version = 0;
        assert_eq!(old.validate(), Err(ProtocolError::VersionMismatch { found: 0, expected: PROTOCOL_VERSION }));
        let mut role = ok;
        role.role = 9;
        assert!(matches!(role.validate(), Err(ProtocolError::InvalidField { what: "role", .. })));
    }

    #[test]
    fn truncated_messages_are_typed_errors() {
        let bytes = bytemuck::bytes_of(&Hello::new(Role::Scheduler, 1, 2)).to_vec();
        assert!(matches!(decode::<Hello>(&bytes[..10]), Err(ProtocolError::Truncated { need: 88, got: 10 })));
        assert_eq!(decode::<Hello>(&bytes).unwrap().validate(), Ok(Role::Scheduler));
    }

    #[test]
    fn header_limits() {
        let mut h = MessageHeader::new(MessageKind::RegisterLayout, 100, 0);
        assert_eq!(h.validate(), Ok(MessageKind::RegisterLayout));
        h.len = MAX_MESSAGE_PAYLOAD + 1;
        assert!(h.validate().is_err());
        h = MessageHeader::new(MessageKind::Hello, 1, 99);
        assert!(h.validate().is_err());
        h = MessageHeader { kind: 77, ..MessageHeader::new(MessageKind::Hello, 1, 0) };
        assert!(h.validate().is_err());
    }

    #[test]
    fn messages_truncate_on_char_boundary() {
        let long = "é".repeat(200);
        let enc = encode_message(&long);
        let dec = decode_message(&enc);
        assert!(dec.len() < REPLY_MESSAGE_LEN);
        assert!(dec.chars().all(|c| c == 'é'));
        assert_eq!(HelloReply::refusal(ReplyStatus::PermissionDenied, "uid 5 not allowed").message(), "uid 5 not allowed");
    }
}
