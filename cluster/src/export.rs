//! The export area: the only memory a peer can reach over NIXL (issue #32 item 2). A
//! separate anonymous mapping, registered with the node's export agent alone; a peer's pin
//! copies the object from the pool's DRAM into a slot here (copy-on-pin) and the peer
//! reads the slot. The pool's DRAM is registered only with the node's reader agent, whose
//! metadata is never sent, so a peer holding a `Join` cannot address it.
//!
//! Slots come from a first-fit allocator over the area and are given back when the
//! [`Slot`] is dropped (the subscriber unpinned, its connection's lease ended, or the node
//! stopped), so no path can leak one.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Slots start and end on this boundary (page-aligned copies; no two slots share a page).
pub const SLOT_ALIGN: u64 = 4096;

/// Default size of the area (`--cluster-export-bytes`).
pub const DEFAULT_EXPORT_BYTES: u64 = 256 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("export area of {0} bytes: the size must be a non-zero multiple of {SLOT_ALIGN}")]
    BadSize(u64),
    #[error("mapping the {len}-byte export area: {source}")]
    Map {
        len: u64,
        #[source]
        source: std::io::Error,
    },
}

/// Free extents (offset → length), coalesced, and the bytes handed out.
#[derive(Debug, Default)]
struct Extents {
    free: BTreeMap<u64, u64>,
    used: u64,
}

/// The mapping and its allocator. Shared (`Arc`) by the node and every live [`Slot`].
pub struct ExportArea {
    base: *mut u8,
    len: u64,
    extents: Mutex<Extents>,
    /// Allocations refused because no free extent was large enough.
    full: AtomicU64,
}

// SAFETY: the mapping is plain memory owned by this struct; each byte range is written only
// by the holder of the `Slot` covering it (and read by peers over NIXL).
unsafe impl Send for ExportArea {}
// SAFETY: as above; the allocator state is behind a mutex.
unsafe impl Sync for ExportArea {}

impl std::fmt::Debug for ExportArea {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExportArea").field("len", &self.len).field("used", &self.used()).finish()
    }
}

impl ExportArea {
    /// Maps `len` bytes (private, anonymous, left out of core dumps: they hold copies of
    /// tenants' KV, as the pool's DRAM does).
    pub fn new(len: u64) -> Result<Arc<Self>, ExportError> {
        if len == 0 || !len.is_multiple_of(SLOT_ALIGN) {
            return Err(ExportError::BadSize(len));
        }
        let map_err = |source| ExportError::Map { len, source };
        let size = usize::try_from(len).map_err(|_| map_err(std::io::Error::from(std::io::ErrorKind::InvalidInput)))?;
        // SAFETY: a fresh private anonymous mapping; checked for failure below.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), size, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        if p == libc::MAP_FAILED {
            return Err(map_err(std::io::Error::last_os_error()));
        }
        // SAFETY: advice on the mapping just made; failure only means it stays dumpable.
        if unsafe { libc::madvise(p, size, libc::MADV_DONTDUMP) } != 0 {
            tracing::warn!("MADV_DONTDUMP on the export area: {}", std::io::Error::last_os_error());
        }
        let mut free = BTreeMap::new();
        free.insert(0, len);
        Ok(Arc::new(Self { base: p.cast(), len, extents: Mutex::new(Extents { free, used: 0 }), full: AtomicU64::new(0) }))
    }

    pub fn base(&self) -> *mut u8 {
        self.base
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held by live slots (rounded up to [`SLOT_ALIGN`] each).
    pub fn used(&self) -> u64 {
        self.extents.lock().expect("export extents").used
    }

    /// Allocations refused since start: the area had no free extent large enough.
    pub fn full_count(&self) -> u64 {
        // Relaxed: a counter for reports; it orders nothing.
        self.full.load(Ordering::Relaxed)
    }

    /// A slot of at least `len` bytes (first fit), or None when the area has no room
    /// (counted in [`Self::full_count`]).
    pub fn alloc(self: &Arc<Self>, len: u64) -> Option<Slot> {
        let mut x = self.extents.lock().expect("export extents");
        let fit = len
            .max(1)
            .checked_next_multiple_of(SLOT_ALIGN)
            .and_then(|need| x.free.iter().find(|(_, &have)| have >= need).map(|(&at, &have)| (at, have, need)));
        let Some((at, have, need)) = fit else {
            drop(x);
            // Relaxed: a counter for reports; it orders nothing.
            self.full.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        x.free.remove(&at);
        if have > need {
            x.free.insert(at + need, have - need);
        }
        x.used += need;
        Some(Slot { area: self.clone(), offset: at, len, reserved: need })
    }

    fn release(&self, offset: u64, reserved: u64) {
        let mut x = self.extents.lock().expect("export extents");
        x.used -= reserved;
        let (mut at, mut len) = (offset, reserved);
        // Coalesce with the free neighbours so first fit keeps finding large extents.
        if let Some((&prev, &plen)) = x.free.range(..offset).next_back() {
            if prev + plen == offset {
                x.free.remove(&prev);
                at = prev;
                len += plen;
            }
        }
        if let Some(nlen) = x.free.remove(&(offset + reserved)) {
            len += nlen;
        }
        x.free.insert(at, len);
    }
}

impl Drop for ExportArea {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once; every `Slot` holds an `Arc` to this area,
        // so none is left, and the export agent (which registered it) is dropped first by
        // its owner (the node keeps the agent's and this area's drop order).
        unsafe { libc::munmap(self.base.cast(), self.len as usize) };
    }
}

/// One allocation in the export area: `len` bytes at `offset` from its base (as peers
/// address it). Given back to the area on drop.
pub struct Slot {
    area: Arc<ExportArea>,
    offset: u64,
    len: u64,
    reserved: u64,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot").field("offset", &self.offset).field("len", &self.len).finish()
    }
}

impl Slot {
    /// Offset from the area's base: what a `Pinned` answer carries.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `n` bytes from `src` into the slot, starting `at` bytes into it.
    ///
    /// # Safety
    /// `src..src+n` must be readable and not written while this runs.
    pub unsafe fn copy_in(&mut self, at: u64, src: *const u8, n: u64) {
        assert!(at.checked_add(n).is_some_and(|end| end <= self.len), "copy past the slot");
        // SAFETY: the destination lies in this slot (asserted), which only its holder (us,
        // through `&mut self`) writes; the source is readable per this function's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, self.area.base.add((self.offset + at) as usize), n as usize) };
    }

    /// The slot's bytes (tests; what a peer's READ of it returns).
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: in the mapping (the slot lies inside it); written only through
        // `copy_in(&mut self)`, so not while this shared borrow lives.
        unsafe { std::slice::from_raw_parts(self.area.base.add(self.offset as usize), self.len as usize) }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.area.release(self.offset, self.reserved);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_reuses_the_lowest_hole_and_coalesces_on_release() {
        let a = ExportArea::new(16 * SLOT_ALIGN).unwrap();
        let s1 = a.alloc(SLOT_ALIGN).unwrap();
        let s2 = a.alloc(2 * SLOT_ALIGN + 1).unwrap();
        let s3 = a.alloc(SLOT_ALIGN).unwrap();
        assert_eq!((s1.offset(), s2.offset(), s3.offset()), (0, SLOT_ALIGN, 4 * SLOT_ALIGN));
        assert_eq!(a.used(), 5 * SLOT_ALIGN);
        drop(s2);
        // The hole at 1 page (3 pages long) is the first fit for 2 pages.
        let s4 = a.alloc(2 * SLOT_ALIGN).unwrap();
        assert_eq!(s4.offset(), SLOT_ALIGN);
        drop((s1, s3, s4));
        assert_eq!(a.used(), 0);
        // Everything coalesced back into one extent: the whole area fits again.
        assert_eq!(a.alloc(16 * SLOT_ALIGN).unwrap().offset(), 0);
    }

    #[test]
    fn a_full_area_refuses_and_counts_and_frees_on_drop() {
        let a = ExportArea::new(4 * SLOT_ALIGN).unwrap();
        let held: Vec<Slot> = (0..4).map(|_| a.alloc(100).unwrap()).collect();
        assert!(a.alloc(1).is_none());
        assert!(a.alloc(u64::MAX).is_none(), "an absurd size is refused, not wrapped");
        assert_eq!(a.full_count(), 2);
        drop(held);
        assert_eq!(a.used(), 0);
        assert!(a.alloc(4 * SLOT_ALIGN).is_some());
    }

    #[test]
    fn copy_in_lands_in_the_slot_only() {
        let a = ExportArea::new(4 * SLOT_ALIGN).unwrap();
        let mut s = a.alloc(10).unwrap();
        let other = a.alloc(10).unwrap();
        let src = *b"0123456789";
        // SAFETY: `src` is a live local array.
        unsafe {
            s.copy_in(0, src.as_ptr(), 4);
            s.copy_in(4, src.as_ptr().add(4), 6);
        }
        assert_eq!(s.bytes(), b"0123456789");
        assert!(other.bytes().iter().all(|&b| b == 0));
    }

    #[test]
    fn sizes_that_are_not_whole_pages_are_refused() {
        assert!(matches!(ExportArea::new(0), Err(ExportError::BadSize(0))));
        assert!(matches!(ExportArea::new(SLOT_ALIGN + 1), Err(ExportError::BadSize(_))));
    }
}
