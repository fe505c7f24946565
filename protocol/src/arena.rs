//! Bounds-checked access to an attachment's arena, where variable-size submission data
//! (block lists, per-block statuses) lives. The pool copies what it reads into private
//! memory before it validates anything: the peer can rewrite the arena at any time.

use bytemuck::Pod;

use crate::ProtocolError;

/// A view of the arena region of one attachment.
#[derive(Clone, Copy)]
pub struct Arena {
    base: *mut u8,
    len: u64,
}

// SAFETY: the arena is plain shared memory accessed with volatile copies; concurrent
// access is the protocol's concern, not a memory-safety one for Pod data.
unsafe impl Send for Arena {}
// SAFETY: as above.
unsafe impl Sync for Arena {}

impl Arena {
    /// # Safety
    /// `base` must be valid for reads and writes of `len` bytes while the arena is used.
    pub unsafe fn new(base: *mut u8, len: usize) -> Self {
        Self { base, len: len as u64 }
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn base(&self) -> *mut u8 {
        self.base
    }

    fn check<T>(&self, offset: u64, count: u64) -> Result<*mut T, ProtocolError> {
        let size = core::mem::size_of::<T>() as u64;
        let bytes = count.checked_mul(size);
        let end = bytes.and_then(|b| offset.checked_add(b));
        match end {
            Some(end) if end <= self.len && offset.is_multiple_of(core::mem::align_of::<T>() as u64) => {
                // SAFETY: offset + count * size <= len, so the pointer stays in the region.
                Ok(unsafe { self.base.add(offset as usize) } as *mut T)
            }
            _ => Err(ProtocolError::ArenaOutOfRange { offset, len: bytes.unwrap_or(u64::MAX), arena_len: self.len }),
        }
    }

    /// Private copy of `count` values at `offset`.
    pub fn read<T: Pod>(&self, offset: u64, count: u64) -> Result<Vec<T>, ProtocolError> {
        let p = self.check::<T>(offset, count)?;
        let mut out = Vec::with_capacity(count as usize);
        for i in 0..count as usize {
            // SAFETY: in range and aligned (checked); Pod accepts any bytes. Volatile: one
            // copy of racy shared memory, never re-read.
            out.push(unsafe { p.add(i).read_volatile() });
        }
        Ok(out)
    }

    /// Writes `values` at `offset`.
    pub fn write<T: Pod>(&self, offset: u64, values: &[T]) -> Result<(), ProtocolError> {
        let p = self.check::<T>(offset, values.len() as u64)?;
        for (i, v) in values.iter().enumerate() {
            // SAFETY: in range and aligned (checked).
            unsafe { p.add(i).write_volatile(*v) };
        }
        Ok(())
    }

    /// The 8-byte word at `offset`, for atomic access shared with the peer (a transfer's
    /// state word, [`crate::transfer_state`]).
    #[cfg(not(loom))]
    pub fn atomic_u64(&self, offset: u64) -> Result<&core::sync::atomic::AtomicU64, ProtocolError> {
        let p = self.check::<u64>(offset, 1)?;
        // SAFETY: in range and 8-byte aligned (checked); the region outlives `self` (the
        // constructor's contract) and AtomicU64 has u64's layout; both sides access the
        // word only atomically.
        Ok(unsafe { &*(p as *const core::sync::atomic::AtomicU64) })
    }

    /// Checks a range without touching it (validation before queueing work).
    pub fn check_range<T>(&self, offset: u64, count: u64) -> Result<(), ProtocolError> {
        self.check::<T>(offset, count).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_and_alignment() {
        let mut buf = vec![0u64; 64];
        // SAFETY: buf outlives the arena.
        let a = unsafe { Arena::new(buf.as_mut_ptr() as *mut u8, 512) };
        a.write::<u64>(8, &[1, 2, 3]).unwrap();
        assert_eq!(a.read::<u64>(8, 3).unwrap(), vec![1, 2, 3]);
        assert!(matches!(a.read::<u64>(504, 2), Err(ProtocolError::ArenaOutOfRange { .. })));
        assert!(a.read::<u64>(4, 1).is_err(), "misaligned");
        assert!(a.read::<u64>(u64::MAX - 3, 1).is_err(), "overflow");
        assert!(a.read::<u64>(8, u64::MAX / 4).is_err(), "overflow in count");
        assert!(a.write::<u8>(511, &[1, 2]).is_err());
        a.write::<u8>(511, &[9]).unwrap();
    }
}
