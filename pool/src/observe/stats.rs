//! Pool-wide counters, updated with relaxed atomics on the data path and read by reports.

use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use umbp_protocol::entries::Opcode;

use crate::pool_report::{CountersReport, PhaseReport, Phases};

#[derive(Default)]
pub struct Counters {
    pub submissions: AtomicU64,
    pub rejected_submissions: AtomicU64,
    /// Transfers their worker abandoned (timed out) before the pool started a stage of
    /// them or before all stages were issued: never touched after that.
    pub transfers_cancelled: AtomicU64,
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
    /// Peers whose pidfd was taken with `pidfd_open` at accept (no `SO_PEERPIDFD`).
    pub pidfd_open_peers: AtomicU64,
    /// Times the service thread slept and a worker's doorbell woke it: each is a transfer
    /// that found the pool asleep and paid its wake-ups (idle_poll.rs).
    pub service_wakeups: AtomicU64,
    /// Where the time of stores and of loads goes (copy time also gives GB/s).
    pub store_phases: PhaseCounters,
    pub load_phases: PhaseCounters,
    /// Transfer and copy latency histograms (Prometheus).
    pub latency: Latencies,
}

/// Time of the jobs of one direction, split by phase, in nanoseconds summed over jobs.
/// The phases follow one job: `admit` (service thread: validation, peer limits), `queue`
/// (waiting for a copy thread), `reserve` (reserving or pinning objects), `plan` (building
/// the copy list), `copy` (in the device copy call, less the reserving, planning and
/// publishing done inside it for later stages), `publish` (settling landed stages while
/// later ones copy), `finish` (after the copy call: settling the rest, statuses, the
/// completion). Only stage 0's reserve and plan delay the first byte; the rest overlap
/// the copies. `first_stage` (not a phase of its own) is the copy thread's time from taking
/// the job to handing stage 0 to the device: what of `reserve` and `plan` delays the first
/// byte.
#[derive(Default)]
pub struct PhaseCounters {
    pub jobs: AtomicU64,
    pub admit_ns: AtomicU64,
    pub reserve_ns: AtomicU64,
    pub queue_ns: AtomicU64,
    pub plan_ns: AtomicU64,
    pub copy_ns: AtomicU64,
    pub publish_ns: AtomicU64,
    pub finish_ns: AtomicU64,
    pub first_stage_ns: AtomicU64,
    /// Stages settled through the staged-copy callback (during the copy call on one GPU,
    /// at its end otherwise).
    pub stages: AtomicU64,
}

impl PhaseCounters {
    pub fn snapshot(&self) -> PhaseReport {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        PhaseReport {
            jobs: g(&self.jobs),
            stages: g(&self.stages),
            admit_ns: g(&self.admit_ns),
            queue_ns: g(&self.queue_ns),
            reserve_ns: g(&self.reserve_ns),
            plan_ns: g(&self.plan_ns),
            copy_ns: g(&self.copy_ns),
            publish_ns: g(&self.publish_ns),
            finish_ns: g(&self.finish_ns),
            first_stage_ns: g(&self.first_stage_ns),
        }
    }
}

impl Counters {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub fn phases(&self, op: umbp_protocol::entries::Opcode) -> &PhaseCounters {
        match op {
            umbp_protocol::entries::Opcode::Store => &self.store_phases,
            _ => &self.load_phases,
        }
    }

    /// The counters as the report carries them (relaxed loads: each is exact, together
    /// they are not one instant).
    pub fn snapshot(&self) -> CountersReport {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let (store, load) = (self.store_phases.snapshot(), self.load_phases.snapshot());
        CountersReport {
            submissions: g(&self.submissions),
            rejected_submissions: g(&self.rejected_submissions),
            transfers_cancelled: g(&self.transfers_cancelled),
            blocks_stored: g(&self.blocks_stored),
            blocks_already_present: g(&self.blocks_already_present),
            blocks_not_stored: g(&self.blocks_not_stored),
            blocks_loaded: g(&self.blocks_loaded),
            blocks_missing: g(&self.blocks_missing),
            blocks_failed: g(&self.blocks_failed),
            blocks_invalid: g(&self.blocks_invalid),
            bytes_stored: g(&self.bytes_stored),
            bytes_loaded: g(&self.bytes_loaded),
            hints: g(&self.hints),
            attachments_total: g(&self.attachments_total),
            refusals: g(&self.refusals),
            busy_refusals: g(&self.busy_refusals),
            pidfd_open_peers: g(&self.pidfd_open_peers),
            service_wakeups: g(&self.service_wakeups),
            store_copy_ns: store.copy_ns,
            load_copy_ns: load.copy_ns,
            phases: Phases { store, load },
        }
    }
}

pub(crate) type OpLabel = [(&'static str, &'static str); 1];
pub(crate) type HistogramFamily = Family<OpLabel, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 1 µs .. ~8.4 s in powers of two.
    Histogram::new(exponential_buckets(1e-6, 2.0, 24))
}

fn op_label(op: Opcode) -> OpLabel {
    [("op", if op == Opcode::Store { "store" } else { "load" })]
}

/// Latency histograms, observed by the copy threads.
pub struct Latencies {
    /// Submission accepted by the service thread -> completion posted.
    pub(crate) transfer: HistogramFamily,
    /// Time inside the device backends' copy calls of one submission.
    pub(crate) copy: HistogramFamily,
}

impl Default for Latencies {
    fn default() -> Self {
        let l = Self {
            transfer: Family::new_with_constructor(latency_histogram as fn() -> Histogram),
            copy: Family::new_with_constructor(latency_histogram as fn() -> Histogram),
        };
        // Both series exist from the start (zero counts), so dashboards need no special case.
        for op in [Opcode::Store, Opcode::Load] {
            let _ = l.transfer.get_or_create(&op_label(op));
            let _ = l.copy.get_or_create(&op_label(op));
        }
        l
    }
}

impl Latencies {
    pub fn observe_transfer(&self, op: Opcode, seconds: f64) {
        if op != Opcode::Nop {
            self.transfer.get_or_create(&op_label(op)).observe(seconds);
        }
    }

    pub fn observe_copy(&self, op: Opcode, seconds: f64) {
        if op != Opcode::Nop {
            self.copy.get_or_create(&op_label(op)).observe(seconds);
        }
    }
}
