//! Wire and shared-memory layouts of UMBP, and the lock-free algorithms that run over
//! shared memory: the SPSC ring and the seqlocked hash index.
//!
//! This crate does no I/O. It is handed raw regions (a `memfd` mapping, or a heap buffer in
//! tests) and interprets them. Every type that lives in shared memory is `#[repr(C)]` and
//! asserts its size at compile time, because two processes built at different times must
//! agree on it byte for byte.

pub mod arena;
pub mod attachment;
pub mod entries;
pub mod error;
pub mod events;
#[cfg(not(loom))]
pub mod futex;
pub mod index;
pub mod key;
pub mod layout;
pub mod location;
pub mod ring;
pub mod stage_split;
mod sync;
pub mod transfer_state;
pub mod wire;

pub use error::ProtocolError;
pub use key::ObjectKey;
pub use location::Tier;

/// First word of every handshake message and shared-memory header: "UMBP".
pub const MAGIC: u32 = u32::from_le_bytes(*b"UMBP");
/// Bumped on any incompatible change of a layout in this crate.
pub const PROTOCOL_VERSION: u32 = 3;

/// Compile-time size and alignment check for a shared-memory or wire type.
#[macro_export]
macro_rules! assert_layout {
    ($t:ty, size = $size:expr, align = $align:expr) => {
        const _: () = assert!(core::mem::size_of::<$t>() == $size);
        const _: () = assert!(core::mem::align_of::<$t>() == $align);
    };
    ($t:ty, size = $size:expr) => {
        const _: () = assert!(core::mem::size_of::<$t>() == $size);
    };
}
