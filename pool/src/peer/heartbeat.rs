//! The pool's heartbeat in every index header (docs/protocol.md, "Pool liveness"): the
//! service thread stores `CLOCK_MONOTONIC` there as it goes round its loop, at most once per
//! [`BEAT_EVERY`], and never sleeps longer than [`HEARTBEAT_PERIOD_MS`] while a scheduler is
//! attached. A stopped or wedged pool stops beating, and schedulers then read its index as
//! empty (a miss) instead of planning loads it would refuse.

use std::time::{Duration, Instant};

use umbp_protocol::index::{IndexView, HEARTBEAT_PERIOD_MS};

use crate::store::Store;

/// Least time between two stores (a busy service thread goes round in microseconds).
const BEAT_EVERY: Duration = Duration::from_millis(1);

/// How long the idle service thread may sleep while a scheduler is attached.
pub const PERIOD: Duration = Duration::from_millis(HEARTBEAT_PERIOD_MS);

/// `CLOCK_MONOTONIC` in ns: the clock schedulers compare the heartbeat with.
pub fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (t.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(t.tv_nsec as u64)
}

/// The service thread's writer of the heartbeat words.
pub struct Heartbeat<'a> {
    views: Vec<IndexView<'a>>,
    last: Option<Instant>,
}

impl<'a> Heartbeat<'a> {
    pub fn new(store: &'a Store) -> Self {
        let views = store
            .group_mem
            .iter()
            // SAFETY: the pool's own writable index mappings, alive as long as `store`
            // (which the service thread borrows for its whole run).
            .filter_map(|g| unsafe { IndexView::attach(g.index_mem.as_ptr(), g.index_mem.len()) }.ok())
            .collect();
        Self { views, last: None }
    }

    /// Stores the heartbeat in every index, unless it did less than [`BEAT_EVERY`] ago.
    pub fn beat(&mut self) {
        let now = Instant::now();
        if self.last.is_some_and(|l| now.saturating_duration_since(l) < BEAT_EVERY) {
            return;
        }
        self.last = Some(now);
        let ns = monotonic_ns();
        for v in &self.views {
            // SAFETY: the pool's writable mapping (see `new`).
            unsafe { v.beat(ns) };
        }
    }
}
