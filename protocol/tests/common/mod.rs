//! Helpers shared by the integration tests (not a test target itself).
#![allow(dead_code)]

use std::alloc::{alloc_zeroed, dealloc, Layout};

#[cfg(loom)]
pub mod loom_model;

/// A zeroed, page-aligned heap buffer standing in for a fresh memfd mapping.
pub struct Region {
    ptr: *mut u8,
    layout: Layout,
}

impl Region {
    pub fn new(len: usize) -> Self {
        let layout = Layout::from_size_align(len.max(1), 4096).unwrap();
        // SAFETY: non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "out of memory");
        Self { ptr, layout }
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// Writes a little-endian u32 at `offset` (to corrupt headers on purpose).
    pub fn put_u32(&self, offset: usize, v: u32) {
        assert!(offset + 4 <= self.len());
        // SAFETY: in bounds (checked); the tests use the region from one thread here.
        unsafe { (self.ptr.add(offset) as *mut u32).write_unaligned(v) }
    }

    pub fn put_u64(&self, offset: usize, v: u64) {
        assert!(offset + 8 <= self.len());
        // SAFETY: as above.
        unsafe { (self.ptr.add(offset) as *mut u64).write_unaligned(v) }
    }

    pub fn fill(&self, offset: usize, bytes: &[u8]) {
        assert!(offset + bytes.len() <= self.len());
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.add(offset), bytes.len()) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

/// The only location the tests ever store with a key, so any hit can be checked.
pub fn checksum(k: umbp_protocol::ObjectKey) -> u64 {
    let [lo, hi] = k.to_words();
    (lo ^ hi.rotate_left(29)).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1
}
