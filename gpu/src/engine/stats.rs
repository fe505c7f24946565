//! Counters of the GPU engine's copy calls.

use std::sync::atomic::{AtomicU64, Ordering};

/// Engine counters of this process (all GPU copy calls), for benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub calls: u64,
    pub items: u64,
    pub bytes: u64,
    /// Time spent handing copies to the driver.
    pub enqueue_ns: u64,
    /// Time of whole copy calls (fence waits, enqueue, synchronization).
    pub total_ns: u64,
    /// Stages reported finished before their copy call ended (staged calls).
    pub stages: u64,
}

pub(super) static STAT_CALLS: AtomicU64 = AtomicU64::new(0);
pub(super) static STAT_ITEMS: AtomicU64 = AtomicU64::new(0);
pub(super) static STAT_BYTES: AtomicU64 = AtomicU64::new(0);
pub(super) static STAT_ENQUEUE: AtomicU64 = AtomicU64::new(0);
pub(super) static STAT_TOTAL: AtomicU64 = AtomicU64::new(0);
pub(super) static STAT_STAGES: AtomicU64 = AtomicU64::new(0);

/// Snapshot of [`EngineStats`].
pub fn engine_stats() -> EngineStats {
    EngineStats {
        calls: STAT_CALLS.load(Ordering::Relaxed),
        items: STAT_ITEMS.load(Ordering::Relaxed),
        bytes: STAT_BYTES.load(Ordering::Relaxed),
        enqueue_ns: STAT_ENQUEUE.load(Ordering::Relaxed),
        total_ns: STAT_TOTAL.load(Ordering::Relaxed),
        stages: STAT_STAGES.load(Ordering::Relaxed),
    }
}
