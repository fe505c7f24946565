//! DRAM the store gave up because a transfer may still write it: never handed out while
//! that transfer may land, handed back once it cannot, and bounded.
//!
//! Two transfers leave DRAM behind: a remote read that timed out (the promotion's
//! destination, `abandon_promotion`), and a copy thread that panicked inside the device
//! layer (the store's reserved objects, `quarantine`). A range is reclaimed when both
//! - its owner is done with it: the load that began the promotion has called
//!   `finish_promotion` (which then matches nothing; until it has, reusing the offset
//!   would let that late finish end another promotion given the same offset), and
//! - the transfer can no longer land (`reclaim_quarantine_of`, for a writer that reports
//!   it). The cluster tier files each timed-out read under a tag of its own and reports it
//!   once NIXL says the kept request is final (cluster/src/node/given_up.rs); forgetting the
//!   holder is no such event (a posted read still lands). A copy-thread panic inside the
//!   device layer has none (the device layer drains its streams on every path it knows of;
//!   a panic inside it is a bug of unknown state): its ranges stay until the pool restarts.
//!
//! The bound (`PoolConfig::quarantine_max_bytes`): at it, the store refuses what could add
//! more — a promotion from the remote tier is a miss (the load's engine recomputes, never
//! a wrong byte) — counts each refusal and logs once per crossing. Copy-thread panics
//! cannot be refused ahead; they are counted past the bound.

/// Who may still write a quarantined range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Writer {
    /// A remote read that timed out, by the tag the cluster tier gave it (the holder's
    /// transport agent name, `#`, the read's number).
    RemoteRead(String),
    /// A transfer whose end no event reports (a panic inside the device layer, or a
    /// remote fetch that panicked): reclaimed only by a restart.
    Unknown,
}

struct Range {
    offset: u64,
    size: u64,
    writer: Writer,
    /// The promotion's owner finished it (always true for a panicked copy: no owner left).
    owner_done: bool,
    /// The writer can no longer land a byte.
    writer_gone: bool,
}

/// The store's quarantined ranges and their bound.
#[derive(Default)]
pub struct Quarantine {
    ranges: Vec<Range>,
    bytes: u64,
    /// None until the pool sets it (`ObjectStore::set_quarantine_max_bytes`): no bound.
    max_bytes: Option<u64>,
    reclaimed_bytes: u64,
    refusals: u64,
    /// The bound was hit and not yet left: logged once per crossing.
    at_bound: bool,
}

/// What the quarantine counts, for reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QuarantineStats {
    pub bytes: u64,
    pub ranges: u64,
    pub reclaimed_bytes: u64,
    /// The bound (0: none set).
    pub max_bytes: u64,
    /// Remote promotions refused because the quarantine was at its bound.
    pub refusals: u64,
}

impl Quarantine {
    pub fn set_max_bytes(&mut self, max: u64) {
        self.max_bytes = Some(max);
    }

    pub fn add(&mut self, offset: u64, size: u64, writer: Writer, owner_done: bool) {
        self.ranges.push(Range { offset, size, writer, owner_done, writer_gone: false });
        self.bytes += size;
        if self.max_bytes.is_some_and(|m| self.bytes >= m) && !self.at_bound {
            self.at_bound = true;
            tracing::error!(
                bytes = self.bytes,
                max = self.max_bytes,
                "quarantined DRAM reached its bound (quarantine_max_bytes): remote-tier promotions are misses until ranges are reclaimed"
            );
        }
    }

    /// Whether a remote read may begin (one that times out quarantines its destination);
    /// false counts a refusal.
    pub fn admits_remote_read(&mut self) -> bool {
        if self.max_bytes.is_some_and(|m| self.bytes >= m) {
            self.refusals += 1;
            return false;
        }
        true
    }

    /// The owner of the range at `offset` finished its promotion; ranges now safe are
    /// returned for freeing (offset, size).
    pub fn owner_done(&mut self, offset: u64) -> Vec<(u64, u64)> {
        if let Some(r) = self.ranges.iter_mut().find(|r| r.offset == offset && !r.owner_done) {
            r.owner_done = true;
        }
        self.take_safe()
    }

    /// The remote holder `agent` can no longer write here; ranges now safe are returned.
    pub fn writer_gone(&mut self, agent: &str) -> Vec<(u64, u64)> {
        for r in &mut self.ranges {
            if matches!(&r.writer, Writer::RemoteRead(a) if a == agent) {
                r.writer_gone = true;
            }
        }
        self.take_safe()
    }

    fn take_safe(&mut self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        self.ranges.retain(|r| {
            let safe = r.owner_done && r.writer_gone;
            if safe {
                out.push((r.offset, r.size));
            }
            !safe
        });
        let freed: u64 = out.iter().map(|&(_, s)| s).sum();
        self.bytes -= freed;
        self.reclaimed_bytes += freed;
        if self.at_bound && self.max_bytes.is_none_or(|m| self.bytes < m) {
            self.at_bound = false;
            tracing::warn!(bytes = self.bytes, "quarantined DRAM back under its bound: remote-tier promotions resume");
        }
        out
    }

    pub fn stats(&self) -> QuarantineStats {
        QuarantineStats {
            bytes: self.bytes,
            ranges: self.ranges.len() as u64,
            reclaimed_bytes: self.reclaimed_bytes,
            max_bytes: self.max_bytes.unwrap_or(0),
            refusals: self.refusals,
        }
    }
}
