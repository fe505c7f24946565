//! KV events: the keys that entered or left the pool, for each group's shared-memory event
//! log and for the embedded pool's own engine.

use umbp_protocol::location::Tier;

use super::ObjectStore;
use crate::store::event_log::ObjectEvent;

/// Events kept for observers before the oldest are dropped.
const MAX_EVENTS: usize = 1 << 16;

impl ObjectStore {
    /// From now on every event of `group` also goes to this shared-memory log.
    pub fn set_event_log(&mut self, group: u32, log: crate::store::event_log::SharedEventLog) {
        self.groups[group as usize].event_log = Some(log);
    }

    /// Events written to the shared logs so far, all groups.
    pub fn events_written(&self) -> u64 {
        (0..self.groups.len() as u32).map(|g| self.group_events_written(g)).sum()
    }

    /// Events written to one group's shared log so far.
    pub fn group_events_written(&self, group: u32) -> u64 {
        self.groups[group as usize].event_log.as_ref().map_or(0, |l| l.written())
    }

    pub(super) fn push_event(&mut self, group: u32, e: ObjectEvent, tier: Tier) {
        if let Some(log) = self.groups[group as usize].event_log.as_mut() {
            log.push(e, tier);
        }
        if self.events.len() >= MAX_EVENTS {
            self.events.drain(..MAX_EVENTS / 2);
        }
        self.events.push(e);
    }

    /// Events since the last call, all groups (the embedded pool's own engine).
    pub fn take_events(&mut self) -> Vec<ObjectEvent> {
        std::mem::take(&mut self.events)
    }
}
