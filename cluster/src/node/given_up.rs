//! Reads the node gave up on (they outlived `read_timeout`) until NIXL reports them final
//! (issue #31: reclaim the DRAM of a timed-out read only when it is safe).
//!
//! A given-up read may still land: releasing its NIXL request does not stop it (NIXL's UCX
//! backend cancels the UCX requests on release, and UCX cancels only tag/stream receives,
//! not an RMA GET: openucx/ucx#9584), and neither does forgetting the holder's metadata (the
//! chaos soak of 2026-12-05 saw a forgotten holder's read land on SIGCONT). So the request
//! is kept, not released: its destinations are quarantined under a tag of their own
//! ([`LocalPool::read_given_up`]) and the ticker polls it; once NIXL reports it completed
//! or failed, nothing of it lands any more, the request is released and the pool told
//! ([`LocalPool::read_final`]), which reclaims the DRAM once the loads are done with it.
//! A holder stopped for good keeps its read pending and its DRAM quarantined (bounded by
//! the pool's `quarantine_max_bytes`) until it dies (its endpoint fails the read) or the
//! pool restarts.

use super::*;
use crate::transport::{PendingRead, ReadEnd};

impl Inner {
    /// Gives `read` (from `agent`, into the destinations of `items`) up: quarantines them
    /// under a fresh tag, keeps the request for [`Self::reap_given_up`]. Returns the tag.
    pub(super) fn give_up(&self, read: PendingRead<'_>, agent: &str, items: impl Iterator<Item = (u128, ObjectKey)>) -> String {
        // Relaxed: a unique number; it orders nothing.
        let tag = format!("{agent}#{}", self.next_read.fetch_add(1, Ordering::Relaxed));
        let items: Vec<(u128, ObjectKey)> = items.collect();
        // Quarantined before the read is listed for the ticker, so its final report
        // always comes after (the pool would otherwise miss it and keep the DRAM forever).
        self.pool.read_given_up(&tag, &items);
        tracing::debug!(read = %tag, objects = items.len(), "remote read given up: kept until NIXL reports it final");
        self.given_up.lock().expect("given up").push((tag.clone(), read.give_up()));
        tag
    }

    /// The holders (agent names) with a given-up read not final yet: their NIXL metadata
    /// is not forgotten meanwhile (`forget_idle_peers`).
    pub(super) fn given_up_agents(&self) -> HashSet<String> {
        self.given_up.lock().expect("given up").iter().map(|(_, r)| r.peer().to_string()).collect()
    }

    /// Polls every given-up read; those NIXL reports final are released and reported to
    /// the pool. The ticker calls it.
    pub(super) fn reap_given_up(&self) {
        let ended: Vec<(String, ReadEnd, transport::GivenUpRead)> = {
            let mut g = self.given_up.lock().expect("given up");
            if g.is_empty() {
                return;
            }
            let mut ended = Vec::new();
            let mut i = 0;
            while i < g.len() {
                let end = self.agent.poll_given_up(&mut g[i].1);
                if end == ReadEnd::Pending {
                    i += 1;
                } else {
                    let (tag, read) = g.swap_remove(i);
                    ended.push((tag, end, read));
                }
            }
            ended
        };
        for (tag, end, read) in ended {
            tracing::info!(read = %tag, end = ?end, after_ms = read.given_up_for().as_millis() as u64, "given-up remote read is final: its DRAM may be reclaimed");
            // Final: releasing the request now cannot leave anything in flight.
            drop(read);
            // Relaxed: a counter for reports; it orders nothing.
            self.given_up_final.fetch_add(1, Ordering::Relaxed);
            self.pool.read_final(&tag);
        }
    }
}
