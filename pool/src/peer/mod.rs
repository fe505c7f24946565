//! The peers: the socket server and its control loop (handshake, control messages as pure
//! state machines, their validation, memory registrations), one [`attachment::Attachment`]
//! per attached peer, and the signs of life schedulers read (heartbeat, death notice).
//! Imports observe/ and the rooms below it; copy/ imports it.

pub(crate) mod attachment;
pub mod control;
pub(crate) mod heartbeat;
pub(crate) mod liveness;
pub(crate) mod server;
pub mod validate;
