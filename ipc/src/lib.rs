//! Process plumbing shared by the pool, the worker, the scheduler and the tools: sealed
//! memfd regions and their mappings, framed unix-socket messages that carry fds, and
//! eventfd doorbells. Kept out of `umbp-protocol` so that crate stays free of I/O.

pub mod doorbell;
pub mod message;
pub mod shm;

pub use message::{recv_message, send_message, Message, MessageError};
pub use shm::{SharedMemory, ShmError};
