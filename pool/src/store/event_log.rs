//! The KV event log in shared memory (protocol `events`): the object store appends a
//! `Stored` event when an object becomes visible and a `Removed` event when it leaves
//! (eviction, namespace reset, failed publish never counts). Schedulers and ringtool map
//! it read-only (fourth fd of the HelloReply) and follow it with their own cursors.

use std::sync::Arc;

use umbp_ipc::{SharedMemory, ShmError};
use umbp_protocol::events::{self, EventKind, EventLog, EventLogWriter};
use umbp_protocol::{ObjectKey, ProtocolError};

/// A key that left the pool or entered it, for KV events: what the object store hands the
/// log (defined here, below the store, so the log needs nothing of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ObjectEvent {
    Stored(ObjectKey),
    Removed(ObjectKey),
}

/// Why the event log could not be created.
#[derive(Debug, thiserror::Error)]
pub enum EventLogError {
    /// Creating, mapping or sealing its memfd.
    #[error("{0}")]
    Memory(#[from] ShmError),
    /// Formatting or attaching the region (a capacity the layout refuses).
    #[error("{0}")]
    Format(#[from] ProtocolError),
}

pub struct SharedEventLog {
    writer: EventLogWriter<'static>,
    // Declared last: the writer points into this mapping.
    mem: Arc<SharedMemory>,
}

impl SharedEventLog {
    /// Creates, formats and seals (read-only for everyone else) a log of `capacity` events.
    pub fn create(name: &str, capacity: u32) -> Result<Self, EventLogError> {
        let mem = SharedMemory::create(name, events::region_bytes(capacity), false)?;
        // SAFETY: a fresh zeroed mapping that only this pool writes.
        unsafe { EventLog::init(mem.as_ptr(), mem.len(), capacity) }?;
        mem.seal_read_only()?;
        let mem = Arc::new(mem);
        // SAFETY: formatted above; `mem` is kept in the struct (dropped after the writer)
        // and the mapping never moves, so extending the borrow to 'static is sound.
        let log = unsafe { EventLog::attach(mem.as_ptr(), mem.len()) }?;
        // SAFETY: as above.
        let log: EventLog<'static> = unsafe { std::mem::transmute::<EventLog<'_>, EventLog<'static>>(log) };
        Ok(Self { writer: EventLogWriter::new(log), mem })
    }

    pub fn memory(&self) -> &Arc<SharedMemory> {
        &self.mem
    }

    /// Appends an event of `tier` (a tier move is Removed from one, Stored in the other).
    pub fn push(&mut self, e: ObjectEvent, tier: umbp_protocol::location::Tier) {
        match e {
            ObjectEvent::Stored(k) => self.writer.push_tiered(EventKind::Stored, k, tier),
            ObjectEvent::Removed(k) => self.writer.push_tiered(EventKind::Removed, k, tier),
        }
    }

    pub fn written(&self) -> u64 {
        self.writer.written()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_capacity_is_a_format_error_that_names_it() {
        let Err(e) = SharedEventLog::create("umbp-events-test", 3) else { panic!("3 entries is no power of two") };
        assert!(matches!(e, EventLogError::Format(ProtocolError::InvalidField { what: "event log capacity", value: 3 })), "{e}");
        assert_eq!(e.to_string(), "invalid event log capacity: 3");
    }
}
