//! The KV event log in shared memory (protocol `events`): the object store appends a
//! `Stored` event when an object becomes visible and a `Removed` event when it leaves
//! (eviction, namespace reset, failed publish never counts). Schedulers and ringtool map
//! it read-only (fourth fd of the HelloReply) and follow it with their own cursors.

use std::sync::Arc;

use umbp_ipc::SharedMemory;
use umbp_protocol::events::{self, EventKind, EventLog, EventLogWriter};

use crate::objects::ObjectEvent;

pub struct SharedEventLog {
    writer: EventLogWriter<'static>,
    // Declared last: the writer points into this mapping.
    mem: Arc<SharedMemory>,
}

impl SharedEventLog {
    /// Creates, formats and seals (read-only for everyone else) a log of `capacity` events.
    pub fn create(name: &str, capacity: u32) -> Result<Self, String> {
        let mem = SharedMemory::create(name, events::region_bytes(capacity), false).map_err(|e| e.to_string())?;
        // SAFETY: a fresh zeroed mapping that only this pool writes.
        unsafe { EventLog::init(mem.as_ptr(), mem.len(), capacity) }.map_err(|e| e.to_string())?;
        mem.seal_read_only().map_err(|e| e.to_string())?;
        let mem = Arc::new(mem);
        // SAFETY: formatted above; `mem` is kept in the struct (dropped after the writer)
        // and the mapping never moves, so extending the borrow to 'static is sound.
        let log = unsafe { EventLog::attach(mem.as_ptr(), mem.len()) }.map_err(|e| e.to_string())?;
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
