//! The unit of a copy call: one contiguous range between host and device memory. A leaf, so
//! the driver seam, batching and the page copy kernel use it without importing the engine.

/// One contiguous copy between host memory and device memory, in absolute addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Item {
    pub host: *mut u8,
    pub device: u64,
    pub len: usize,
}

// SAFETY: plain addresses; what may be done with them is the copy call's contract, and a
// call's items are only handed to the driver (from one or several enqueueing threads).
unsafe impl Send for Item {}
// SAFETY: as above; items are never written after they are built.
unsafe impl Sync for Item {}
