//! KV events at the scheduler: the pool's event log (the fourth fd of the HelloReply,
//! mapped read-only) followed with this client's own cursor. The pool appends `Stored` when
//! an object becomes visible and `Removed` when it leaves (eviction, namespace reset), so a
//! vLLM connector's `take_events` can report what the pool holds without any RPC.
//!
//! Reading never blocks and never slows the pool. A client that does not call
//! [`crate::IndexClient::take_events`] for a long time (more than the log's capacity,
//! 65,536 events by default) loses the oldest ones; it learns how many from
//! [`crate::IndexClient::events_lost`], and a warning is logged.

use std::os::fd::OwnedFd;

use umbp_ipc::SharedMemory;
pub use umbp_protocol::events::EventKind;
use umbp_protocol::events::{Event, EventLog, EventLogReader, EVENT_ENTRIES_OFFSET};
use umbp_protocol::ObjectKey;

use crate::SchedulerError;

/// Most events one `take_events` call returns (the rest wait for the next call).
const MAX_BATCH: usize = 1 << 16;

pub(crate) struct EventFollower {
    reader: EventLogReader<'static>,
    buf: Vec<Event>,
    // Dropped after the reader, which points into this mapping.
    _mem: SharedMemory,
}

impl EventFollower {
    /// Maps the log read-only and starts at its current end: events from now on.
    pub fn new(fd: OwnedFd) -> Result<Self, SchedulerError> {
        let mem = SharedMemory::from_received(fd, EVENT_ENTRIES_OFFSET, false)?;
        // SAFETY: the whole read-only mapping, owned by `_mem` (dropped after the reader,
        // field order) and never moved; attach checks every header field against `len`.
        let log = unsafe { EventLog::attach(mem.as_ptr(), mem.len()) }?;
        // SAFETY: as above; extending the borrow to 'static is sound because the mapping
        // lives exactly as long as the reader.
        let log: EventLog<'static> = unsafe { std::mem::transmute::<EventLog<'_>, EventLog<'static>>(log) };
        Ok(Self { reader: EventLogReader::from_now(log), buf: Vec::new(), _mem: mem })
    }

    /// Appends new events to `out`; returns how many were lost to an overrun this time.
    pub fn drain(&mut self, out: &mut Vec<(EventKind, ObjectKey)>) -> u64 {
        self.buf.clear();
        let r = self.reader.poll(&mut self.buf, MAX_BATCH);
        out.extend(self.buf.iter().map(|e| (e.kind, e.key)));
        r.lost
    }

    /// [`Self::drain`] with each event whole (its tier included).
    pub fn drain_events(&mut self, out: &mut Vec<Event>) -> u64 {
        self.reader.poll(out, MAX_BATCH).lost
    }
}
