//! The evictor's passes: LRU eviction down to the low watermarks of DRAM bytes, of each
//! group's index entries, and of each namespace's quota, in bounded steps.
//!
//! A pass is decided once, at its start, by the high watermarks; it then evicts in steps of
//! at most a given number of objects, so that the evictor can hand the store lock to the
//! copy threads between steps (evictor.rs). Eviction costs about 1.7 µs an object on the
//! 2-core VM: the 20 % between the default watermarks of a pool of 200,000 objects of
//! 64 KiB held the lock for 80 ms in one go, and every transfer of the node waited.
//! Each target keeps an LRU cursor, so a step does not scan again what earlier steps
//! skipped (pinned, leased, or chosen for demotion and still listed).

use std::time::Instant;

use super::{GroupIndex, GroupKey, Held, Object, ObjectState, ObjectStore};
use crate::store::alloc::SlabAllocator;

/// What one evictor pass still evicts, each target with its LRU cursor (the next tick to
/// look at).
#[derive(Debug, Default)]
pub struct EvictionPass {
    /// DRAM bytes (down to `Policy::low_bytes`).
    bytes: Option<u64>,
    /// Index entries of these groups (down to `Policy::index_low_wm` of the capacity).
    groups: Vec<(u32, u64)>,
    /// Objects and bytes of these namespaces (down to `Policy::namespace_low` of the quota).
    namespaces: Vec<(u128, u64)>,
}

impl EvictionPass {
    /// Every target reached, or nothing evictable left for it.
    pub fn is_done(&self) -> bool {
        self.bytes.is_none() && self.groups.is_empty() && self.namespaces.is_empty()
    }
}

/// Which objects a target may take.
#[derive(Debug, Clone, Copy)]
enum Victims {
    Any,
    Namespace(u128),
    Group(u32),
}

impl ObjectStore {
    /// A group's index watermark in entries (`wm` of its capacity).
    fn index_mark(g: &GroupIndex, wm: f64) -> u64 {
        (g.index.capacity() as f64 * wm) as u64
    }

    fn namespace_over(&self, h: &Held, f: f64) -> bool {
        let p = &self.policy;
        h.objects as f64 > p.namespace_max_objects as f64 * f || h.bytes as f64 > p.namespace_max_bytes as f64 * f
    }

    /// Whether the evictor has work: bytes or index slots above their high watermark, or
    /// a namespace above its quota's.
    pub fn needs_eviction(&self) -> bool {
        let p = &self.policy;
        self.alloc.allocated_bytes().saturating_sub(self.demoting_bytes) > p.high_bytes
            || self.groups.iter().any(|g| g.used() > Self::index_mark(g, p.index_high_wm))
            || self.held.values().any(|h| self.namespace_over(h, p.namespace_high))
    }

    /// Starts a pass: the targets above their high watermark now. A group's index over its
    /// mark only by tombstones is rebuilt here (that frees them) and needs no eviction.
    pub fn eviction_pass(&mut self) -> EvictionPass {
        let p = self.policy;
        let mut pass = EvictionPass::default();
        if self.alloc.allocated_bytes().saturating_sub(self.demoting_bytes) > p.high_bytes {
            pass.bytes = Some(0);
        }
        for (group, g) in self.groups.iter_mut().enumerate() {
            let high = Self::index_mark(g, p.index_high_wm);
            if g.used() <= high {
                continue;
            }
            if g.index.tombstones() > 0 {
                g.index.rebuild();
            }
            if g.index.len() > high {
                pass.groups.push((group as u32, 0));
            }
        }
        pass.namespaces = self.held.iter().filter(|(_, h)| self.namespace_over(h, p.namespace_high)).map(|(ns, _)| (*ns, 0)).collect();
        pass
    }

    /// Evicts at most `budget` objects towards the targets of `pass` (in order: bytes,
    /// index entries, namespaces); a target leaves the pass once reached or when nothing
    /// evictable is left for it. Skips objects being written, pinned or leased. Returns
    /// how many went.
    pub fn evict_step(&mut self, pass: &mut EvictionPass, now: Instant, budget: usize) -> usize {
        let p = self.policy;
        let mut n = 0;
        if let Some(cursor) = pass.bytes.as_mut() {
            let k = self.evict_bytes_to(p.low_bytes, now, cursor, budget);
            n += k;
            if k < budget {
                pass.bytes = None;
            }
        }
        while let Some((group, cursor)) = pass.groups.first_mut() {
            if n == budget {
                return n;
            }
            let (len, low) = {
                let g = &self.groups[*group as usize];
                (g.index.len(), Self::index_mark(g, p.index_low_wm))
            };
            let want = len.saturating_sub(low).min((budget - n) as u64) as usize;
            let victims =
                if want == 0 { Vec::new() } else { self.pick_lru(Victims::Group(*group), now, cursor, |_, chosen| chosen >= want) };
            let k = self.drop_victims(victims);
            self.index_evictions += k as u64;
            n += k;
            if k < want || len - k as u64 <= low {
                pass.groups.remove(0);
            }
        }
        while let Some((ns, cursor)) = pass.namespaces.first_mut() {
            if n == budget {
                return n;
            }
            let ns = *ns;
            let Some(h) = self.held.get(&ns).copied() else {
                pass.namespaces.remove(0);
                continue;
            };
            let (max_o, max_b) = (p.namespace_max_objects as f64 * p.namespace_low, p.namespace_max_bytes as f64 * p.namespace_low);
            let (mut objects, mut bytes) = (h.objects, h.bytes);
            let reached = |objects: u64, bytes: u64| objects as f64 <= max_o && bytes as f64 <= max_b;
            let room = budget - n;
            let victims = if reached(objects, bytes) {
                Vec::new()
            } else {
                self.pick_lru(Victims::Namespace(ns), now, cursor, |size, chosen| {
                    objects -= 1;
                    bytes = bytes.saturating_sub(SlabAllocator::footprint(size));
                    reached(objects, bytes) || chosen >= room
                })
            };
            let k = self.drop_victims(victims);
            self.quota_evictions += k as u64;
            n += k;
            if reached(objects, bytes) || k < room {
                pass.namespaces.remove(0);
            }
        }
        n
    }

    /// Drops `victims` (index entries and DRAM alike); returns how many.
    fn drop_victims(&mut self, victims: Vec<GroupKey>) -> usize {
        let k = victims.len();
        for v in victims {
            self.drop_object(v);
        }
        self.evictions += k as u64;
        k
    }

    /// A whole pass at once (no lock hand-over): LRU eviction down to the low watermarks
    /// of bytes and of index entries, and of each namespace over its quota's high mark down
    /// to its low mark. Returns how many went (tests; the evictor goes step by step).
    #[cfg(test)]
    pub fn evict(&mut self, now: Instant) -> usize {
        let mut pass = self.eviction_pass();
        self.evict_step(&mut pass, now, usize::MAX)
    }

    /// Evicts least recently used DRAM objects until allocated bytes (less those being
    /// demoted) are at most `target`: to SSD (demoted, or moved if their record is still
    /// there) where the admission policy says so, else dropped. Skips objects being
    /// written, pinned by loads, leased or being demoted. Returns how many were chosen.
    #[cfg(test)]
    pub fn evict_to(&mut self, target: u64, now: Instant) -> usize {
        self.evict_bytes_to(target, now, &mut 0, usize::MAX)
    }

    /// [`Self::evict_to`], at most `budget` objects, from LRU tick `cursor` on.
    fn evict_bytes_to(&mut self, target: u64, now: Instant, cursor: &mut u64, budget: usize) -> usize {
        let mut projected = self.alloc.allocated_bytes().saturating_sub(self.demoting_bytes);
        if projected <= target || budget == 0 {
            return 0;
        }
        let victims = self.pick_lru(Victims::Any, now, cursor, |size, chosen| {
            projected = projected.saturating_sub(SlabAllocator::footprint(size));
            projected <= target || chosen >= budget
        });
        for v in &victims {
            self.evict_dram(*v, now);
        }
        self.evictions += victims.len() as u64;
        victims.len()
    }

    /// Least recently used evictable objects (of `which`), from LRU tick `cursor` on,
    /// until `enough(size of the one just chosen, count chosen so far)` says so; `cursor`
    /// moves past what was looked at. DRAM objects for `Any` and `Namespace` (they free
    /// DRAM); for `Group` (index pressure) objects on lower tiers too (they free index
    /// entries).
    fn pick_lru(&self, which: Victims, now: Instant, cursor: &mut u64, mut enough: impl FnMut(u64, usize) -> bool) -> Vec<GroupKey> {
        let mut victims = Vec::new();
        for (&tick, key) in self.lru.range(*cursor..) {
            *cursor = tick + 1;
            let o = &self.objects[key];
            let mine = match which {
                Victims::Any => Self::evictable(o, now),
                Victims::Namespace(ns) => o.namespace == ns && Self::evictable(o, now),
                Victims::Group(g) => key.group == g && (Self::evictable(o, now) || matches!(o.state, ObjectState::Lower { .. })),
            };
            if !mine {
                continue;
            }
            victims.push(*key);
            if enough(o.size, victims.len()) {
                break;
            }
        }
        victims
    }

    fn evictable(o: &Object, now: Instant) -> bool {
        let leased = o.lease.is_some_and(|l| l.until > now);
        o.state == ObjectState::Published && o.pins == 0 && !leased && !o.demoting
    }
}
