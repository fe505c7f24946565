//! The copy path: the service thread takes submissions off the rings (intake), the copy
//! threads run them in stages under their slots, promotions run ahead of a load's stages,
//! and the finish publishes or unpins and signals fences. The top room: it imports peer/
//! and every room below, and none imports it.

pub(crate) mod copy_slots;
pub(crate) mod finish;
pub(crate) mod idle_poll;
pub(crate) mod job;
pub(crate) mod job_blocks;
pub(crate) mod promote;
pub(crate) mod service;
pub(crate) mod transfer;
