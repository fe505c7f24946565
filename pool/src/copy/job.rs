//! One submission on its way through the copy threads: taken from a peer's ring by the
//! service thread, queued for a copy slot (copy_slots.rs), run in stages by a copy thread.

use std::sync::Arc;
use std::time::Instant;

use umbp_protocol::entries::{BlockStatus, Opcode, Sqe};
use umbp_protocol::layout::KvLayout;

use crate::copy::job_blocks::{Candidate, JobBlock};
use crate::peer::attachment::Attachment;

pub struct Job {
    pub att: Arc<Attachment>,
    pub sqe: Sqe,
    pub op: Opcode,
    pub layout: Arc<KvLayout>,
    /// Blocks that need a copy, in submission order; the others already have their status.
    pub candidates: Vec<Candidate>,
    /// Candidates reserved so far (the copy thread reserves stage by stage), in order.
    pub blocks: Vec<JobBlock>,
    pub statuses: Vec<BlockStatus>,
    /// Arena offset of the transfer's state word, when the worker may cancel it
    /// (umbp_protocol::transfer_state: the pool claims each stage before issuing it).
    pub state_offset: Option<u64>,
    /// The worker abandoned it before the pool started it: it completes as `Cancelled`.
    pub cancelled: bool,
    /// When the service thread took the submission from the ring.
    pub accepted: Instant,
    /// When the service thread queued it for a copy thread (transfer latency metric).
    pub submitted: Instant,
    /// Loads: promotions from lower tiers launched ahead of the copy (promote.rs); the
    /// copy thread of the peer's previous load may launch the first ones.
    pub ahead: Arc<crate::copy::promote::Ahead>,
}
