//! Fixed-size slab allocator over the DRAM tier (docs/architecture.md "An object's life"). DRAM is cut into 2 MiB pages;
//! a page is handed to one size class on demand and cut into equal slots; objects larger
//! than a page take a run of contiguous pages. Offsets are what the index stores.

use std::collections::{BTreeSet, HashMap};

pub use crate::config::PAGE_BYTES;
/// Slot sizes are rounded up to this, so copies stay cache-line aligned.
const SLOT_ALIGN: u64 = 64;

#[derive(Debug, Default)]
struct SizeClass {
    /// Pages of this class with at least one free slot.
    partial: BTreeSet<u32>,
}

#[derive(Debug)]
struct SlabPage {
    slot_bytes: u64,
    free_slots: Vec<u32>,
    used: u32,
}

/// Allocation state; not thread-safe (the object store serialises access).
#[derive(Debug)]
pub struct SlabAllocator {
    total_pages: u32,
    /// Pages below this may be handed out (DRAM registration with the GPU driver proceeds
    /// in the background; unregistered pages are held back).
    page_limit: u32,
    free_pages: BTreeSet<u32>,
    classes: HashMap<u64, SizeClass>,
    slabs: HashMap<u32, SlabPage>,
    /// Large allocations: first page -> page count.
    runs: HashMap<u32, u32>,
    allocated_bytes: u64,
}

impl SlabAllocator {
    pub fn new(capacity_bytes: u64) -> Self {
        let total_pages = (capacity_bytes / PAGE_BYTES) as u32;
        Self {
            total_pages,
            page_limit: total_pages,
            free_pages: (0..total_pages).collect(),
            classes: HashMap::new(),
            slabs: HashMap::new(),
            runs: HashMap::new(),
            allocated_bytes: 0,
        }
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.total_pages as u64 * PAGE_BYTES
    }

    /// Footprint of the slots and runs handed out (what watermarks compare against): a
    /// slot counts its share of its page, waste included, so a pool whose pages are all
    /// taken reads as full whatever the object size.
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated_bytes
    }

    #[cfg(test)]
    pub fn free_pages(&self) -> usize {
        self.free_pages.len()
    }

    pub fn set_page_limit(&mut self, limit: u32) {
        self.page_limit = limit.min(self.total_pages);
    }

    /// DRAM one allocation of `size` takes out of the pool: its slot plus its share of
    /// the page's leftover (1.5 MiB objects fit one per 2 MiB page and cost a whole page).
    pub fn footprint(size: u64) -> u64 {
        let slot = Self::slot_bytes(size);
        if slot > PAGE_BYTES {
            slot
        } else {
            PAGE_BYTES / (PAGE_BYTES / slot)
        }
    }

    pub fn slot_bytes(size: u64) -> u64 {
        if size > PAGE_BYTES {
            size.div_ceil(PAGE_BYTES) * PAGE_BYTES
        } else {
            size.div_ceil(SLOT_ALIGN).max(1) * SLOT_ALIGN
        }
    }

    fn take_page(&mut self) -> Option<u32> {
        let p = *self.free_pages.range(..self.page_limit).next()?;
        self.free_pages.remove(&p);
        Some(p)
    }

    /// Offset of a fresh allocation of `size` bytes, or None when DRAM is full.
    pub fn alloc(&mut self, size: u64) -> Option<u64> {
        if size == 0 {
            return None;
        }
        let slot = Self::slot_bytes(size);
        if slot > PAGE_BYTES {
            return self.alloc_run((slot / PAGE_BYTES) as u32);
        }
        let page = match self.classes.entry(slot).or_default().partial.iter().next().copied() {
            Some(p) => p,
            None => {
                let p = self.take_page()?;
                let n = (PAGE_BYTES / slot) as u32;
                // Reverse so the lowest slot is handed out first.
                self.slabs.insert(p, SlabPage { slot_bytes: slot, free_slots: (0..n).rev().collect(), used: 0 });
                self.classes.get_mut(&slot).expect("class exists").partial.insert(p);
                p
            }
        };
        let slab = self.slabs.get_mut(&page).expect("partial page has a slab");
        let idx = slab.free_slots.pop().expect("partial page has a free slot");
        slab.used += 1;
        if slab.free_slots.is_empty() {
            self.classes.get_mut(&slot).expect("class exists").partial.remove(&page);
        }
        self.allocated_bytes += Self::footprint(size);
        Some(page as u64 * PAGE_BYTES + idx as u64 * slot)
    }

    fn alloc_run(&mut self, pages: u32) -> Option<u64> {
        // First fit over the free set: large objects are rare next to per-block ones.
        let mut start = None;
        let mut len = 0u32;
        let mut prev = None;
        for &p in self.free_pages.range(..self.page_limit) {
            if prev.is_some_and(|q: u32| q + 1 == p) {
                len += 1;
            } else {
                start = Some(p);
                len = 1;
            }
            prev = Some(p);
            if len == pages {
                break;
            }
        }
        if len < pages {
            return None;
        }
        let first = start.expect("a run has a start");
        for p in first..first + pages {
            self.free_pages.remove(&p);
        }
        self.runs.insert(first, pages);
        self.allocated_bytes += pages as u64 * PAGE_BYTES;
        Some(first as u64 * PAGE_BYTES)
    }

    /// Returns an allocation made by [`Self::alloc`] with the same `size`.
    pub fn free(&mut self, offset: u64, size: u64) {
        let slot = Self::slot_bytes(size);
        let page = (offset / PAGE_BYTES) as u32;
        if slot > PAGE_BYTES {
            let pages = self.runs.remove(&page).expect("freeing an allocated run");
            for p in page..page + pages {
                self.free_pages.insert(p);
            }
            self.allocated_bytes -= pages as u64 * PAGE_BYTES;
            return;
        }
        let slab = self.slabs.get_mut(&page).expect("freeing inside a slab page");
        debug_assert_eq!(slab.slot_bytes, slot);
        slab.free_slots.push(((offset % PAGE_BYTES) / slot) as u32);
        slab.used -= 1;
        self.allocated_bytes -= Self::footprint(size);
        let class = self.classes.get_mut(&slot).expect("class exists");
        if slab.used == 0 {
            // An empty page goes back to the shared pool so other sizes can use it.
            class.partial.remove(&page);
            self.slabs.remove(&page);
            self.free_pages.insert(page);
        } else {
            class.partial.insert(page);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn slabs_fill_and_return_pages() {
        let mut a = SlabAllocator::new(4 * PAGE_BYTES);
        let per_page = (PAGE_BYTES / (64 << 10)) as usize;
        let mut offs = HashSet::new();
        for _ in 0..4 * per_page {
            let o = a.alloc(64 << 10).unwrap();
            assert_eq!(o % (64 << 10), 0);
            assert!(offs.insert(o), "no offset handed out twice");
        }
        assert_eq!(a.alloc(64 << 10), None, "full");
        assert_eq!(a.allocated_bytes(), 4 * PAGE_BYTES);
        for o in offs.drain() {
            a.free(o, 64 << 10);
        }
        assert_eq!(a.allocated_bytes(), 0);
        assert_eq!(a.free_pages(), 4);
        // Freed pages serve a different size class.
        assert!(a.alloc(1000).is_some());
    }

    #[test]
    fn large_objects_take_contiguous_runs() {
        let mut a = SlabAllocator::new(8 * PAGE_BYTES);
        let small = a.alloc(100).unwrap(); // occupies page 0
        let big = a.alloc(3 * PAGE_BYTES - 5).unwrap();
        assert_eq!(big, PAGE_BYTES);
        let big2 = a.alloc(4 * PAGE_BYTES).unwrap();
        assert_eq!(big2, 4 * PAGE_BYTES);
        assert_eq!(a.alloc(2 * PAGE_BYTES), None);
        a.free(big, 3 * PAGE_BYTES - 5);
        assert_eq!(a.alloc(2 * PAGE_BYTES), Some(PAGE_BYTES));
        a.free(small, 100);
        assert_eq!(a.alloc(PAGE_BYTES), Some(0));
    }

    #[test]
    fn page_waste_counts_as_allocated() {
        // 1.5 MiB objects: one per page; a full pool must read as full, or the evictor
        // (which compares against the watermarks) would never run.
        let mut a = SlabAllocator::new(4 * PAGE_BYTES);
        let big = 3 * PAGE_BYTES / 4;
        let offs: Vec<_> = (0..4).map(|_| a.alloc(big).unwrap()).collect();
        assert_eq!(a.alloc(big), None);
        assert_eq!(a.allocated_bytes(), a.capacity_bytes());
        for o in offs {
            a.free(o, big);
        }
        assert_eq!(a.allocated_bytes(), 0);
        // 100 KB objects: 20 per page, each accounts for a twentieth of it.
        assert_eq!(SlabAllocator::footprint(100_000), PAGE_BYTES / 20);
    }

    #[test]
    fn page_limit_holds_back_unregistered_memory() {
        let mut a = SlabAllocator::new(4 * PAGE_BYTES);
        a.set_page_limit(1);
        assert_eq!(a.alloc(PAGE_BYTES), Some(0));
        assert_eq!(a.alloc(PAGE_BYTES), None);
        a.set_page_limit(4);
        assert_eq!(a.alloc(PAGE_BYTES), Some(PAGE_BYTES));
    }
}
