//! Scheduler touch hints: leases that keep an object from eviction for a while, and each
//! uid's lease book (a FIFO capped in bytes and entries, docs/security.md).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::{GroupKey, ObjectState, ObjectStore};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Lease {
    pub(super) uid: u32,
    pub(super) until: Instant,
}

/// The leases one uid's touch hints hold, oldest first, and the bytes of those still in
/// force (an entry is in force while its object's lease is exactly that uid and time).
#[derive(Debug, Default)]
pub(super) struct LeaseBook {
    queue: VecDeque<(GroupKey, Instant)>,
    pub(super) bytes: u64,
}

/// Lease entries one uid may have queued (re-touches of one key add entries); past it
/// its oldest leases end early, like past its byte cap.
const MAX_LEASE_QUEUE: usize = 1 << 18;

impl ObjectStore {
    /// A scheduler hit from a peer of `uid` attached with namespace `namespace`: counts as
    /// use and protects the object for `lease`, if the object is of `namespace` or of one
    /// `also_allowed` (the uid's ACL). A hint for another namespace's key is ignored
    /// (counted), so a peer cannot pin what it may not load. The uid's leases are a FIFO of
    /// at most `Policy::lease_max_bytes`: past it, its oldest leases end early. Returns
    /// whether the hint was applied.
    pub fn touch_hint(
        &mut self,
        uid: u32,
        namespace: u128,
        also_allowed: &[u128],
        key: impl Into<GroupKey>,
        lease: Duration,
        now: Instant,
    ) -> bool {
        let key = key.into();
        let Some(o) = self.objects.get_mut(&key) else { return false };
        if o.namespace != namespace && !also_allowed.contains(&o.namespace) {
            self.foreign_hints += 1;
            return false;
        }
        if let ObjectState::Lower { .. } = o.state {
            // A hit on a lower tier: bring it into DRAM ahead of the load (best effort,
            // tier::prefetch on the evictor thread).
            o.hits = o.hits.saturating_add(1);
            if self.prefetch.len() < super::tiering::PREFETCH_QUEUE {
                self.prefetch.push(key);
            }
            self.touch_lru(key);
            return true;
        }
        if o.state != ObjectState::Published {
            return false;
        }
        // A scheduler's prefix hit is use: the SSD admission policy counts it.
        o.hits = o.hits.saturating_add(1);
        let until = now + lease;
        let size = o.size;
        if let Some(old) = o.lease.replace(Lease { uid, until }) {
            // The old entry (this uid's or another's) is no longer in force.
            self.leases.get_mut(&old.uid).expect("a lease has its book").bytes -= size;
        }
        let book = self.leases.entry(uid).or_default();
        book.queue.push_back((key, until));
        book.bytes += size;
        self.touch_lru(key);
        self.trim_leases(uid, now);
        true
    }

    /// Ends `uid`'s expired leases and, while it is over its cap, its oldest ones.
    fn trim_leases(&mut self, uid: u32, now: Instant) {
        let cap = self.policy.lease_max_bytes;
        let Some(book) = self.leases.get_mut(&uid) else { return };
        while let Some(&(key, until)) = book.queue.front() {
            if until > now && book.bytes <= cap && book.queue.len() <= MAX_LEASE_QUEUE {
                break;
            }
            book.queue.pop_front();
            let Some(o) = self.objects.get_mut(&key) else { continue };
            if o.lease == Some(Lease { uid, until }) {
                o.lease = None;
                book.bytes -= o.size;
                if until > now {
                    self.leases_dropped += 1;
                }
            }
        }
        if book.queue.is_empty() {
            self.leases.remove(&uid);
        }
    }

    /// Bytes of objects `uid`'s hints keep leased now (expired leases still count until
    /// that uid's next hint trims them; they protect nothing).
    #[cfg(test)]
    pub fn leased_bytes(&self, uid: u32) -> u64 {
        self.leases.get(&uid).map_or(0, |b| b.bytes)
    }

    /// A hint from a scheduler of the object's own namespace, uid 0 (tests).
    #[cfg(test)]
    pub fn touch(&mut self, key: impl Into<GroupKey>, lease: Duration, now: Instant) {
        let key = key.into();
        let ns = self.objects.get(&key).map(|o| o.namespace).unwrap_or_default();
        self.touch_hint(0, ns, &[], key, lease, now);
    }
}
