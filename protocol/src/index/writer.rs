//! The index's single writer: inserts, in-place location updates, removals (tombstones)
//! and rebuilds into the other table, each slot written under its seqlock.

use super::{probe_len, IndexSlot, IndexView, SlotCopy, SLOT_EMPTY, SLOT_FULL, SLOT_TOMBSTONE};
use crate::sync::{fence, Ordering};
use crate::ObjectKey;

/// Outcome of [`IndexWriter::insert`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Insert {
    Inserted,
    /// First writer wins: the key was there, with this location.
    Exists(u64),
}

/// The table is too full even after a rebuild.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("index full: {live} live entries in {slots} slots")]
pub struct IndexFull {
    pub live: u64,
    pub slots: u64,
}

/// Why an insert was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum InsertError {
    #[error(transparent)]
    Full(#[from] IndexFull),
    /// Every slot within [`MAX_PROBE`](super::MAX_PROBE) of the key's home is taken (keys piled up there).
    #[error("index probe limit: the {limit} slots from home slot {home} are all taken")]
    ProbeLimit { home: u64, limit: u64 },
}

/// The single writer. Lives in the pool; all updates go through one instance.
pub struct IndexWriter<'a> {
    view: IndexView<'a>,
    epoch: u64,
    live: u64,
    tombstones: u64,
}

impl<'a> IndexWriter<'a> {
    /// Takes the writer role over a formatted region (the pool formats it itself, so its
    /// contents are trusted).
    pub fn new(view: IndexView<'a>) -> Self {
        let epoch = view.header.epoch.load(Ordering::Relaxed);
        let live = view.header.stats.live.load(Ordering::Relaxed);
        let tombstones = view.header.stats.tombstones.load(Ordering::Relaxed);
        Self { view, epoch, live, tombstones }
    }

    pub fn view(&self) -> IndexView<'a> {
        self.view
    }

    pub fn len(&self) -> u64 {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    pub(super) fn active(&self) -> &'a [IndexSlot] {
        self.view.tables[(self.epoch & 1) as usize]
    }

    fn write_slot(slot: &IndexSlot, state: u32, key: ObjectKey, location: u64) {
        let s = slot.seq.load(Ordering::Relaxed);
        slot.seq.store(s.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        let [lo, hi] = key.to_words();
        slot.state.store(state, Ordering::Relaxed);
        slot.key[0].store(lo, Ordering::Relaxed);
        slot.key[1].store(hi, Ordering::Relaxed);
        slot.location.store(location, Ordering::Relaxed);
        slot.seq.store(s.wrapping_add(2), Ordering::Release);
    }

    // The writer is the only one that changes slots, so it reads them without a seqlock.
    fn plain_read(slot: &IndexSlot) -> SlotCopy {
        SlotCopy {
            state: slot.state.load(Ordering::Relaxed),
            key: ObjectKey::from_words([slot.key[0].load(Ordering::Relaxed), slot.key[1].load(Ordering::Relaxed)]),
            location: slot.location.load(Ordering::Relaxed),
        }
    }

    /// Slot of `key` in the active table, and the first reusable slot seen on the way.
    pub(super) fn find(&self, key: ObjectKey) -> (Option<usize>, Option<usize>) {
        let table = self.active();
        let mask = self.view.mask;
        let mut i = self.view.home(key);
        let mut reusable = None;
        for _ in 0..probe_len(mask) {
            let c = Self::plain_read(&table[i as usize]);
            match c.state {
                SLOT_EMPTY => return (None, reusable.or(Some(i as usize))),
                SLOT_FULL if c.key == key => return (Some(i as usize), None),
                SLOT_TOMBSTONE if reusable.is_none() => reusable = Some(i as usize),
                _ => {}
            }
            i = (i + 1) & mask;
        }
        (None, reusable)
    }

    pub fn get(&self, key: ObjectKey) -> Option<u64> {
        self.find(key).0.map(|i| Self::plain_read(&self.active()[i]).location)
    }

    /// Most live entries the table takes (3/4 of its slots).
    pub fn capacity(&self) -> u64 {
        self.view.slot_count() / 4 * 3
    }

    /// Tombstones in the active table.
    pub fn tombstones(&self) -> u64 {
        self.tombstones
    }

    /// Inserts unless present (first writer wins). Rebuilds first when tombstones or the
    /// load factor call for it. Refused when the table holds [`Self::capacity`] entries, or
    /// when no slot within [`MAX_PROBE`](super::MAX_PROBE) of the key's home is free (after a rebuild, when
    /// tombstones might be what fills them).
    pub fn insert(&mut self, key: ObjectKey, location: u64) -> Result<Insert, InsertError> {
        if let (Some(i), _) = self.find(key) {
            return Ok(Insert::Exists(Self::plain_read(&self.active()[i]).location));
        }
        let slots = self.view.slot_count();
        if (self.live + 1) * 4 > slots * 3 {
            return Err(IndexFull { live: self.live, slots }.into());
        }
        if (self.live + self.tombstones + 1) * 4 > slots * 3 || self.tombstones * 4 > slots {
            self.rebuild();
        }
        let mut free = self.find(key).1;
        if free.is_none() && self.tombstones > 0 {
            self.rebuild();
            free = self.find(key).1;
        }
        let i = free.ok_or(InsertError::ProbeLimit { home: self.view.home(key), limit: probe_len(self.view.mask) })?;
        let slot = &self.active()[i];
        if slot.state.load(Ordering::Relaxed) == SLOT_TOMBSTONE {
            self.tombstones -= 1;
        }
        Self::write_slot(slot, SLOT_FULL, key, location);
        self.live += 1;
        self.view.header.stats.inserts.fetch_add(1, Ordering::Relaxed);
        self.publish_counts();
        Ok(Insert::Inserted)
    }

    /// Rewrites the location of a present key in place (a tier move: readers see the old
    /// or the new location, never a miss). Returns whether the key was present.
    pub fn set_location(&mut self, key: ObjectKey, location: u64) -> bool {
        let Some(i) = self.find(key).0 else { return false };
        Self::write_slot(&self.active()[i], SLOT_FULL, key, location);
        true
    }

    /// Removes `key`, leaving a tombstone; returns its location.
    pub fn remove(&mut self, key: ObjectKey) -> Option<u64> {
        let i = self.find(key).0?;
        let slot = &self.active()[i];
        let location = Self::plain_read(slot).location;
        Self::write_slot(slot, SLOT_TOMBSTONE, key, 0);
        self.live -= 1;
        self.tombstones += 1;
        self.view.header.stats.removes.fetch_add(1, Ordering::Relaxed);
        self.publish_counts();
        Some(location)
    }

    /// Copies the live entries into the other table and flips the epoch. Readers of the old
    /// table notice the flip and retry.
    ///
    /// Each run of occupied slots is copied in the order of its entries' home slots (the
    /// layout Robin Hood hashing gives), which never places an entry farther from its home
    /// than the farthest one was before: for an entry that lands `d` past its home `h`, the
    /// run in the new table from its start `c` to that entry holds `d + h - c + 1` entries
    /// homed in `c..=h`, which cannot all have fitted before `h + d` in the old table. So
    /// every entry stays within [`MAX_PROBE`](super::MAX_PROBE) of its home, where readers look.
    pub fn rebuild(&mut self) {
        let target = self.view.tables[((self.epoch + 1) & 1) as usize];
        for slot in target {
            if slot.state.load(Ordering::Relaxed) != SLOT_EMPTY {
                Self::write_slot(slot, SLOT_EMPTY, ObjectKey(0), 0);
            }
        }
        let mask = self.view.mask;
        let active = self.active();
        // At most 3/4 of the slots are ever in use, so there is an empty one; runs start
        // after it and never wrap past it.
        let start = active.iter().position(|s| s.state.load(Ordering::Relaxed) == SLOT_EMPTY).unwrap_or(0) as u64;
        let mut run: Vec<(u64, SlotCopy)> = Vec::new();
        for step in 1..=mask + 1 {
            let c = Self::plain_read(&active[((start + step) & mask) as usize]);
            if c.state == SLOT_FULL {
                run.push(((self.view.home(c.key).wrapping_sub(start)) & mask, c));
            }
            if c.state != SLOT_EMPTY && step <= mask {
                continue;
            }
            run.sort_unstable_by_key(|(off, _)| *off);
            for (off, c) in run.drain(..) {
                let mut i = (start + off) & mask;
                while target[i as usize].state.load(Ordering::Relaxed) != SLOT_EMPTY {
                    i = (i + 1) & mask;
                }
                debug_assert!((i.wrapping_sub(start + off) & mask) < probe_len(mask), "rebuild moved an entry past MAX_PROBE");
                Self::write_slot(&target[i as usize], SLOT_FULL, c.key, c.location);
            }
        }
        self.epoch += 1;
        self.view.header.epoch.store(self.epoch, Ordering::Release);
        self.tombstones = 0;
        self.view.header.stats.rebuilds.fetch_add(1, Ordering::Relaxed);
        self.publish_counts();
    }

    /// Removes everything (vLLM reset_cache of the whole pool) by flipping to an empty table.
    pub fn clear(&mut self) {
        let live: Vec<_> = self.entries().collect();
        for (k, _) in live {
            self.remove(k);
        }
        self.rebuild();
    }

    /// Live entries of the active table.
    pub fn entries(&self) -> impl Iterator<Item = (ObjectKey, u64)> + 'a {
        self.active().iter().filter_map(|s| {
            let c = Self::plain_read(s);
            (c.state == SLOT_FULL).then_some((c.key, c.location))
        })
    }

    fn publish_counts(&self) {
        self.view.header.stats.live.store(self.live, Ordering::Relaxed);
        self.view.header.stats.tombstones.store(self.tombstones, Ordering::Relaxed);
    }
}
