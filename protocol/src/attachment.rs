//! Layout of one attachment's ring memfd: submission ring, completion ring, hint ring and
//! arena, each page aligned. Both sides compute it from the numbers in the handshake reply.

use bytemuck::{Pod, Zeroable};

use crate::entries::{Cqe, Sqe};
use crate::ring::{ring_bytes, MAX_RING_CAPACITY};
use crate::{assert_layout, ProtocolError};

/// A touch hint, scheduler -> pool: "this key was just hit, keep it".
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable, PartialEq, Eq)]
pub struct Hint {
    pub key: [u64; 2],
}
assert_layout!(Hint, size = 16, align = 8);

const PAGE: usize = 4096;

fn page_up(n: usize) -> usize {
    n.div_ceil(PAGE) * PAGE
}

/// Largest arena a peer may ask for.
pub const MAX_ARENA_BYTES: u64 = 256 << 20;

/// Offsets inside the ring memfd of one attachment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttachmentLayout {
    pub sq_entries: u32,
    pub cq_entries: u32,
    pub hint_entries: u32,
    pub sq_offset: usize,
    pub cq_offset: usize,
    pub hint_offset: usize,
    pub arena_offset: usize,
    pub arena_bytes: usize,
    pub total_bytes: usize,
}

impl AttachmentLayout {
    pub fn new(sq_entries: u32, cq_entries: u32, hint_entries: u32, arena_bytes: u64) -> Result<Self, ProtocolError> {
        for (what, n) in [("sq entries", sq_entries), ("cq entries", cq_entries), ("hint entries", hint_entries)] {
            if n == 0 || !n.is_power_of_two() || n > MAX_RING_CAPACITY {
                return Err(ProtocolError::InvalidField { what, value: n as u64 });
            }
        }
        if arena_bytes == 0 || arena_bytes > MAX_ARENA_BYTES {
            return Err(ProtocolError::InvalidField { what: "arena bytes", value: arena_bytes });
        }
        let sq_offset = 0;
        let cq_offset = page_up(sq_offset + ring_bytes::<Sqe>(sq_entries));
        let hint_offset = page_up(cq_offset + ring_bytes::<Cqe>(cq_entries));
        let arena_offset = page_up(hint_offset + ring_bytes::<Hint>(hint_entries));
        let arena_bytes = page_up(arena_bytes as usize);
        Ok(Self {
            sq_entries,
            cq_entries,
            hint_entries,
            sq_offset,
            cq_offset,
            hint_offset,
            arena_offset,
            arena_bytes,
            total_bytes: arena_offset + arena_bytes,
        })
    }

    pub fn sq_bytes(&self) -> usize {
        ring_bytes::<Sqe>(self.sq_entries)
    }

    pub fn cq_bytes(&self) -> usize {
        ring_bytes::<Cqe>(self.cq_entries)
    }

    pub fn hint_bytes(&self) -> usize {
        ring_bytes::<Hint>(self.hint_entries)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_are_disjoint_and_page_aligned() {
        let l = AttachmentLayout::new(256, 512, 1024, 1 << 20).unwrap();
        assert!(l.sq_offset + l.sq_bytes() <= l.cq_offset);
        assert!(l.cq_offset + l.cq_bytes() <= l.hint_offset);
        assert!(l.hint_offset + l.hint_bytes() <= l.arena_offset);
        for off in [l.cq_offset, l.hint_offset, l.arena_offset, l.total_bytes] {
            assert_eq!(off % PAGE, 0);
        }
        assert!(AttachmentLayout::new(3, 4, 4, 1).is_err());
        assert!(AttachmentLayout::new(4, 4, 4, 0).is_err());
        assert!(AttachmentLayout::new(4, 4, 4, MAX_ARENA_BYTES + 1).is_err());
    }
}
