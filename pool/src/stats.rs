//! Pool-wide counters, updated with relaxed atomics on the data path and read by reports.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Default)]
pub struct Counters {
    pub submissions: AtomicU64,
    pub rejected_submissions: AtomicU64,
    pub blocks_stored: AtomicU64,
    pub blocks_already_present: AtomicU64,
    pub blocks_not_stored: AtomicU64,
    pub blocks_loaded: AtomicU64,
    pub blocks_missing: AtomicU64,
    pub blocks_failed: AtomicU64,
    pub blocks_invalid: AtomicU64,
    pub bytes_stored: AtomicU64,
    pub bytes_loaded: AtomicU64,
    pub hints: AtomicU64,
    pub attachments_total: AtomicU64,
    pub refusals: AtomicU64,
    /// Submissions refused with `Busy` because their peer was over an in-flight limit.
    pub busy_refusals: AtomicU64,
    /// Nanoseconds spent in copy calls, per direction, for GB/s.
    pub store_copy_ns: AtomicU64,
    pub load_copy_ns: AtomicU64,
    /// Transfer and copy latency histograms (Prometheus).
    pub latency: crate::metrics::Latencies,
}

impl Counters {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub fn to_json(&self) -> serde_json::Value {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        serde_json::json!({
            "submissions": g(&self.submissions),
            "rejected_submissions": g(&self.rejected_submissions),
            "blocks_stored": g(&self.blocks_stored),
            "blocks_already_present": g(&self.blocks_already_present),
            "blocks_not_stored": g(&self.blocks_not_stored),
            "blocks_loaded": g(&self.blocks_loaded),
            "blocks_missing": g(&self.blocks_missing),
            "blocks_failed": g(&self.blocks_failed),
            "blocks_invalid": g(&self.blocks_invalid),
            "bytes_stored": g(&self.bytes_stored),
            "bytes_loaded": g(&self.bytes_loaded),
            "hints": g(&self.hints),
            "attachments_total": g(&self.attachments_total),
            "refusals": g(&self.refusals),
            "busy_refusals": g(&self.busy_refusals),
            "store_copy_ns": g(&self.store_copy_ns),
            "load_copy_ns": g(&self.load_copy_ns),
        })
    }
}
