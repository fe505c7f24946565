//! The one error type of every backend. Messages name the cause (driver error name, errno,
//! which op and offset) because they end up in pool logs and in refusals sent to workers.

use std::io;

use crate::MemoryKind;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The shared library of a backend could not be loaded (no driver on this machine).
    #[error("{library} could not be loaded ({detail}); install the {what} driver or use another memory kind")]
    LibraryMissing { library: &'static str, what: &'static str, detail: String },

    /// The library loaded but lacks a function this crate calls (driver too old).
    #[error("{library} has no symbol {symbol}: the installed driver is too old")]
    MissingSymbol { library: &'static str, symbol: &'static str },

    /// A driver call returned an error code.
    #[error("{call} failed: {name} ({code})")]
    Driver { call: &'static str, code: i32, name: String },

    /// A system call failed.
    #[error("{op} failed: {source}")]
    Os { op: &'static str, source: io::Error },

    /// A copy op reaches outside the registered region; nothing was copied.
    #[error("copy op {index}: device range {device_offset}..+{len} lies outside the region of {region_len} bytes")]
    OutOfRange { index: usize, device_offset: u64, len: u64, region_len: u64 },

    /// A copy op names another allocation than the region it was given to.
    #[error("copy op {index}: alloc_id {found} given to the region of alloc_id {expected}")]
    WrongAllocation { index: usize, expected: u32, found: u32 },

    /// The registration is unusable; the text says which field and why.
    #[error("invalid {kind:?} registration: {reason}")]
    InvalidRegistration { kind: MemoryKind, reason: String },

    /// The memfd a peer passed could be truncated under us (it would SIGBUS the pool).
    #[error("memfd is not sealed against shrinking (seals {seals:#x}, need F_SEAL_SHRINK)")]
    NotSealed { seals: u32 },

    /// The peer process of a HostProcess region exited.
    #[error("peer process {pid} is gone")]
    PeerGone { pid: u32 },

    /// process_vm_readv/writev refused or faulted on the peer's memory.
    #[error("{op} on pid {pid} at {address:#x} (+{len}) failed: {source}")]
    PeerMemory { op: &'static str, pid: u32, address: u64, len: u64, source: io::Error },

    /// No GPU visible to this process has the UUID the worker registered.
    #[error("no visible {api} device has UUID {uuid}; the pool must see every GPU its workers use (check CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES of the pool)")]
    DeviceNotFound { api: &'static str, uuid: String },

    /// A backend was asked for a kind it does not serve.
    #[error("backend for {backend:?} cannot handle {requested:?} memory")]
    KindMismatch { backend: MemoryKind, requested: MemoryKind },

    /// The operation exists in the contract but this region cannot do it.
    #[error("{0}")]
    Unsupported(String),

    /// A store waited for its fence word ([`crate::fence`]) and the word never reached the value:
    /// the worker did not write it in time, or was gone. Nothing was published.
    #[error("fence word never reached {value} (last {last}) within {waited_ms} ms{why}")]
    FenceTimeout { value: u64, last: u64, waited_ms: u64, why: &'static str },

    /// The fence word carries the abort mark ([`crate::fence::ABORT`]): the worker (or the
    /// pool's watchdog) released it without the data being ready.
    #[error("fence {value} was aborted (word {word:#x})")]
    FenceAborted { value: u64, word: u64 },
}

impl GpuError {
    pub(crate) fn os(op: &'static str, source: impl Into<io::Error>) -> Self {
        GpuError::Os { op, source: source.into() }
    }

    pub(crate) fn invalid(kind: MemoryKind, reason: impl Into<String>) -> Self {
        GpuError::InvalidRegistration { kind, reason: reason.into() }
    }
}

/// Formats a device UUID the way `nvidia-smi -L` does, for messages.
pub(crate) fn format_uuid(uuid: &[u8; 16]) -> String {
    let h: Vec<String> = uuid.iter().map(|b| format!("{b:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", h[0..4].concat(), h[4..6].concat(), h[6..8].concat(), h[8..10].concat(), h[10..16].concat())
}
