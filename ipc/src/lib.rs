//! Process plumbing shared by the pool, the worker, the scheduler and the tools: sealed
//! memfd regions and their mappings, framed unix-socket messages that carry fds, and
//! eventfd doorbells. Kept out of `umbp-protocol` so that crate stays free of I/O.

pub mod backoff;
pub mod dial;
pub mod doorbell;
pub mod endpoint;
pub mod message;
pub mod peer;
pub mod shm;
pub mod sockdir;

pub use message::{recv_message, send_message, Message, MessageError};
pub use shm::{SharedMemory, ShmError};

/// Where a pool listens when nobody says otherwise: `$XDG_RUNTIME_DIR/umbp/pool.sock`, or
/// `/tmp/umbp/pool.sock` where that variable is unset.
pub fn default_socket_path() -> std::path::PathBuf {
    let dir = std::env::var_os("XDG_RUNTIME_DIR")
        .filter(|d| !d.is_empty())
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from("/tmp"));
    dir.join("umbp").join("pool.sock")
}
