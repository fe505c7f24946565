//! Moving objects between tiers: eviction out of DRAM (the passes are in eviction.rs),
//! demotion to SSD and promotion back to DRAM, and listing lower-tier objects (warm
//! restart, remote keys).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use umbp_protocol::index::Insert;
use umbp_protocol::location::{self, Tier};
use umbp_protocol::ObjectKey;

use super::{GroupKey, Object, ObjectEvent, ObjectState, ObjectStore};
use crate::pool_report::TierMoves;
use crate::store::alloc::SlabAllocator;

/// An object the evictor chose for demotion: its DRAM bytes (stable until
/// [`ObjectStore::finish_demotion`]) to write to SSD.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Demotion {
    pub key: GroupKey,
    pub namespace: u128,
    pub offset: u64,
    pub size: u64,
}

/// Most touch-hinted lower-tier objects queued for prefetch between two evictor passes.
pub const PREFETCH_QUEUE: usize = 4096;

/// Tier counters of the store (reports).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Objects listed in the indexes by tier (DRAM: published in DRAM, incl. promoting).
    pub objects: [u64; 3],
    /// Demotions and promotions (the SSD report shows them as they are).
    pub moves: TierMoves,
    /// Objects moved to SSD without a write (their record was still there).
    pub clean_demotions: u64,
    /// Objects listed at start from the SSD segments.
    pub restored: u64,
}

impl ObjectStore {
    /// Turns on demotion to SSD with this admission policy.
    pub fn set_ssd_admission(&mut self, admission: umbp_ssd::SsdAdmission) {
        self.ssd_admission = Some(admission);
    }

    /// Tier counters; `objects` by tier.
    pub fn tier_stats(&self) -> TierStats {
        let mut t = self.tier_stats;
        let listed = self.published_count();
        let lower: u64 = self.lower.iter().sum();
        t.objects = self.lower;
        t.objects[Tier::Dram as usize] = listed.saturating_sub(lower);
        t
    }

    /// Objects chosen for demotion since the last call.
    pub fn take_demotions(&mut self) -> Vec<Demotion> {
        std::mem::take(&mut self.demotions)
    }

    /// SSD records to remove (their objects left the index) since the last call.
    pub fn take_ssd_drops(&mut self) -> Vec<(ObjectKey, u128)> {
        std::mem::take(&mut self.ssd_drops)
    }

    /// Takes a DRAM object out of DRAM for byte pressure: to SSD at once if its record is
    /// still there, chosen for demotion if the admission policy admits it, else dropped.
    pub(super) fn evict_dram(&mut self, key: GroupKey, now: Instant) {
        let o = &self.objects[&key];
        let Some(admission) = self.ssd_admission else {
            self.drop_object(key);
            return;
        };
        if let Some(payload) = o.ssd_at {
            self.tier_stats.clean_demotions += 1;
            self.move_to_lower(key, Tier::Ssd, payload);
        } else if admission.admits(now.saturating_duration_since(o.stored_at), o.hits) {
            let d = Demotion { key, namespace: o.namespace, offset: o.offset, size: o.size };
            self.demoting_bytes += SlabAllocator::footprint(o.size);
            self.objects.get_mut(&key).expect("present").demoting = true;
            self.demotions.push(d);
        } else {
            self.tier_stats.moves.not_admitted += 1;
            self.drop_object(key);
        }
    }

    /// Frees a DRAM object's bytes and lists it as on `tier` (no I/O: its bytes are
    /// there already). The caller checked it is published, unpinned and not demoting.
    fn move_to_lower(&mut self, key: GroupKey, tier: Tier, payload: u64) {
        let o = self.objects.get_mut(&key).expect("present");
        debug_assert!(o.state == ObjectState::Published && o.pins == 0 && !o.demoting);
        o.state = ObjectState::Lower { tier };
        let (offset, size, namespace, lease) = (o.offset, o.size, o.namespace, o.lease.take());
        if let Some(l) = lease {
            self.leases.get_mut(&l.uid).expect("a lease has its book").bytes -= size;
        }
        self.alloc.free(offset, size);
        self.release_held(namespace, size);
        self.count_lower(tier, 1);
        self.groups[key.group as usize].index.set_location(key.key, location::encode(tier, payload));
        self.push_event(key.group, ObjectEvent::Removed(key.key), Tier::Dram);
        self.push_event(key.group, ObjectEvent::Stored(key.key), tier);
    }

    /// The demoter wrote (Ok: at location payload) or failed to write a demoted object.
    /// Written: it leaves DRAM now (unless a load pinned it or a hint leased it
    /// meanwhile: then the next eviction moves it without a write). Failed: it just goes,
    /// like an eviction without an SSD tier (a pinned one stays in DRAM).
    pub fn finish_demotion(&mut self, key: GroupKey, written: Result<u64, ()>, now: Instant) {
        let Some(o) = self.objects.get_mut(&key) else { return };
        if !o.demoting {
            return;
        }
        o.demoting = false;
        let size = o.size;
        self.demoting_bytes -= SlabAllocator::footprint(size);
        let free_now = o.pins == 0 && o.lease.is_none_or(|l| l.until <= now);
        match written {
            Ok(payload) => {
                o.ssd_at = Some(payload);
                self.tier_stats.moves.demotions += 1;
                self.tier_stats.moves.demoted_bytes += size;
                if free_now {
                    self.move_to_lower(key, Tier::Ssd, payload);
                }
            }
            Err(()) => {
                self.tier_stats.moves.demotion_failures += 1;
                if free_now {
                    self.drop_object(key);
                }
            }
        }
    }

    /// Clean stop (`tier::flush_on_stop`): every published DRAM object without an SSD
    /// record that the admission policy admits now, most recently used first (the likeliest
    /// to be wanted after the restart), marked demoting like the evictor's choices: end
    /// each with [`Self::finish_demotion`] or [`Self::cancel_demotion`].
    pub fn take_flush(&mut self, now: Instant) -> Vec<Demotion> {
        let Some(admission) = self.ssd_admission else { return Vec::new() };
        let keys: Vec<GroupKey> = self
            .lru
            .values()
            .rev()
            .copied()
            .filter(|k| {
                let o = &self.objects[k];
                o.state == ObjectState::Published
                    && !o.demoting
                    && o.ssd_at.is_none()
                    && admission.admits(now.saturating_duration_since(o.stored_at), o.hits)
            })
            .collect();
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let o = self.objects.get_mut(&key).expect("present");
            o.demoting = true;
            self.demoting_bytes += SlabAllocator::footprint(o.size);
            out.push(Demotion { key, namespace: o.namespace, offset: o.offset, size: o.size });
        }
        out
    }

    /// A demotion not written after all (the flush ran out of time): the object stays in
    /// DRAM as it was.
    pub fn cancel_demotion(&mut self, key: GroupKey) {
        let Some(o) = self.objects.get_mut(&key) else { return };
        if o.demoting {
            o.demoting = false;
            self.demoting_bytes -= SlabAllocator::footprint(o.size);
        }
    }

    /// The size of `key` if it is listed on `tier` only (not in DRAM, not being promoted).
    /// Objects listed on a tier below DRAM, those being promoted included.
    #[cfg(test)]
    pub fn lower_objects(&self) -> u64 {
        self.lower.iter().sum()
    }

    /// [`Self::lower_objects`] kept up to date in an atomic, for readers without the store
    /// lock: a load's look-ahead skips the lock when nothing is below DRAM.
    pub fn lower_objects_counter(&self) -> Arc<AtomicU64> {
        self.lower_total.clone()
    }

    /// Adds `delta` to the objects listed on `tier`, and to the lock-free total.
    pub(super) fn count_lower(&mut self, tier: Tier, delta: i64) {
        let n = &mut self.lower[tier as usize];
        *n = n.checked_add_signed(delta).expect("lower-tier count stays in range");
        self.lower_total.store(self.lower.iter().sum(), Ordering::Release);
    }

    pub fn size_on(&self, key: GroupKey, tier: Tier) -> Option<u64> {
        self.objects.get(&key).filter(|o| o.state == ObjectState::Lower { tier }).map(|o| o.size)
    }

    /// Lower-tier objects touch hints asked for since the last call (tier::prefetch).
    pub fn take_prefetch(&mut self) -> Vec<GroupKey> {
        std::mem::take(&mut self.prefetch)
    }

    /// The SSD store dropped these records for room (or found them unreadable): objects
    /// only there leave the index; DRAM copies just forget them.
    pub fn ssd_records_gone(&mut self, gone: &[(ObjectKey, u128)], groups: &crate::store::groups::TenantGroups) {
        for &(key, ns) in gone {
            let gk = GroupKey::new(groups.group_of(ns), key);
            let Some(o) = self.objects.get_mut(&gk) else { continue };
            if o.namespace != ns {
                continue;
            }
            o.ssd_at = None;
            if o.state == (ObjectState::Lower { tier: Tier::Ssd }) {
                self.drop_object(gk);
            }
        }
    }

    /// Lists an object found on a lower tier at start (warm restart): in its group's
    /// index as that tier. False if the key is already held in that group (the first
    /// listed wins) or the index is full.
    pub fn insert_lower(&mut self, group: u32, namespace: u128, key: ObjectKey, size: u64, tier: Tier, payload: u64) -> bool {
        let gk = GroupKey::new(group, key);
        if self.objects.contains_key(&gk) {
            return false;
        }
        if self.groups[group as usize].index.insert(key, location::encode(tier, payload)) != Ok(Insert::Inserted) {
            return false;
        }
        let tick = self.next_tick;
        self.next_tick += 1;
        self.objects.insert(
            gk,
            Object {
                offset: 0,
                size,
                namespace,
                state: ObjectState::Lower { tier },
                pins: 0,
                lease: None,
                tick,
                demoting: false,
                ssd_at: (tier == Tier::Ssd).then_some(payload),
                hits: 0,
                stored_at: Instant::now(),
            },
        );
        self.lru.insert(tick, gk);
        self.count_lower(tier, 1);
        let ns = self.namespaces.entry(namespace).or_default();
        ns.objects += 1;
        ns.bytes += size;
        self.tier_stats.restored += 1;
        self.push_event(group, ObjectEvent::Stored(key), tier);
        true
    }

    /// A load found `key` on a lower tier: allocates its DRAM and pins it for this load,
    /// which fetches the bytes outside the lock and then calls [`Self::finish_promotion`].
    /// Returns the DRAM offset, the tier to fetch from and the object's namespace; None: not on a lower tier any
    /// more, or no DRAM free (the caller wakes the evictor).
    pub fn begin_promotion(&mut self, key: impl Into<GroupKey>) -> Option<(u64, Tier, u128)> {
        let key = key.into();
        let o = self.objects.get(&key)?;
        let ObjectState::Lower { tier } = o.state else { return None };
        if tier == Tier::Remote && !self.quarantine.admits_remote_read() {
            // A timed-out read would quarantine more than the bound: the remote copy is
            // forgotten here, so the load (and the schedulers' lookups) see a miss.
            self.remove_remote(key.group, key.key);
            return None;
        }
        let (size, namespace) = (o.size, o.namespace);
        let offset = self.alloc.alloc(size)?;
        let h = self.held.entry(namespace).or_default();
        h.objects += 1;
        h.bytes += SlabAllocator::footprint(size);
        let o = self.objects.get_mut(&key).expect("present");
        o.state = ObjectState::Promoting { from: tier };
        o.offset = offset;
        o.pins = 1;
        o.hits += 1;
        self.pinned_objects += 1;
        self.touch_lru(key);
        Some((offset, tier, namespace))
    }

    /// Ends the promotion of `key` that [`Self::begin_promotion`] began at DRAM `offset`:
    /// with the bytes in, the object is in DRAM (index and events say so) and stays pinned
    /// for the load that promoted it; without (I/O error, bad CRC, record gone) it leaves
    /// the pool: a miss, never wrong bytes. Returns `fetched`, or false when that promotion
    /// is not running any more.
    ///
    /// The offset is the promotion's identity: only its owner finishes it. A promotion
    /// ended by someone else ([`Self::abandon_promotion`] after a remote read timed out)
    /// keeps its DRAM allocated (quarantined) at least until that late finish, so no later
    /// promotion of the same key, which a load may begin meanwhile, can have that offset; a
    /// late finish by the first owner then matches nothing and never frees or drops the
    /// second one's object while its fetch still writes it (issue #31). It marks the
    /// quarantined range's owner done (objects/quarantine.rs).
    pub fn finish_promotion(&mut self, key: impl Into<GroupKey>, offset: u64, fetched: bool) -> bool {
        let key = key.into();
        let owned = self.objects.get(&key).is_some_and(|o| matches!(o.state, ObjectState::Promoting { .. }) && o.offset == offset);
        if !owned {
            tracing::debug!(key = %format_args!("{:032x}", key.key.0), "promotion finished by a load that no longer owns it (abandoned earlier): ignored");
            // Its owner is done with the abandoned range: it may be reclaimed once its
            // writer is gone too.
            let safe = self.quarantine.owner_done(offset);
            self.free_reclaimed(safe);
            return false;
        }
        let o = self.objects.get_mut(&key).expect("owned");
        let ObjectState::Promoting { from } = o.state else { unreachable!("owned") };
        let (offset, size, namespace) = (o.offset, o.size, o.namespace);
        if fetched {
            o.state = ObjectState::Published;
            self.count_lower(from, -1);
            self.tier_stats.moves.promotions += 1;
            self.tier_stats.moves.promoted_bytes += size;
            self.groups[key.group as usize].index.set_location(key.key, location::encode(Tier::Dram, offset));
            self.push_event(key.group, ObjectEvent::Removed(key.key), from);
            self.push_event(key.group, ObjectEvent::Stored(key.key), Tier::Dram);
            return true;
        }
        // Back to "lower only", then dropped like any object there.
        o.state = ObjectState::Lower { tier: from };
        o.pins = 0;
        self.pinned_objects -= 1;
        self.alloc.free(offset, size);
        self.release_held(namespace, size);
        self.tier_stats.moves.promotion_failures += 1;
        self.drop_object(key);
        false
    }
}
