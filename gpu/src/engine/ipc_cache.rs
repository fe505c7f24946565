//! The keys and entries of the IPC mapping cache (`shared.rs` holds the cache): who
//! registered a mapping, and what one mapping is.

#[derive(Clone, Copy)]
pub(super) struct IpcMapping {
    pub(super) ptr: u64,
    /// Bytes of the exported allocation from `ptr` on.
    pub(super) size: u64,
    pub(super) refs: usize,
}

/// Who registered a mapping: the peer's process when the pool can name it, else (pid 0: a
/// peer in another pid namespace, where every such peer reads as pid 0) its attachment.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(super) enum Holder {
    Process(u32),
    Attachment(u32),
}

impl Holder {
    pub(super) fn of(peer: &crate::Peer<'_>) -> Self {
        if peer.pid == 0 {
            Holder::Attachment(peer.attachment)
        } else {
            Holder::Process(peer.pid)
        }
    }
}

/// (holder, device UUID, handle bytes). IPC handles are bearer tokens: the driver maps
/// whatever handle it is given, and a process-wide cache keyed by the bytes alone let any
/// peer that presented another's handle reuse the other's mapping without even a driver
/// call. Keyed by the registering process too, a handle is shared only among the
/// attachments of the one process that sent it (a reconnecting worker re-registers while
/// its old regions may still be held); another process gets its own driver call. Peers
/// whose pid the pool cannot see share nothing: one attachment each.
pub(super) type IpcKey = (Holder, [u8; 16], [u8; 64]);
