//! First-fit allocator over an attachment's arena. Each submission takes one range holding
//! its `[BlockRef; n]` followed by its `[u8; n]` status bytes, and gives it back when its
//! completion is reaped. Ranges are tracked here, in private memory: the arena itself is
//! shared with the pool and nothing in it is trusted.
//!
//! First fit over an offset-ordered free list keeps long-lived (stalled) ranges from
//! splitting the arena more than necessary and coalesces on every free, so a quiet worker
//! always returns to one free range.

use std::collections::BTreeMap;

/// Granularity and alignment of every range: `BlockRef` is 8-aligned.
pub const ARENA_ALIGN: u64 = 8;

#[derive(Debug)]
pub struct ArenaAllocator {
    len: u64,
    /// offset -> length of each free range; never two adjacent ones (coalesced on free).
    free: BTreeMap<u64, u64>,
    free_bytes: u64,
}

fn round_up(n: u64) -> Option<u64> {
    n.checked_add(ARENA_ALIGN - 1).map(|v| v & !(ARENA_ALIGN - 1))
}

impl ArenaAllocator {
    /// An allocator over `[0, len)`, rounded down to the alignment.
    pub fn new(len: u64) -> Self {
        let len = len & !(ARENA_ALIGN - 1);
        let mut free = BTreeMap::new();
        if len > 0 {
            free.insert(0, len);
        }
        Self { len, free, free_bytes: len }
    }

    #[cfg(test)]
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Number of separate free ranges (1 when nothing is allocated).
    #[cfg(test)]
    pub fn fragments(&self) -> usize {
        self.free.len()
    }

    /// An 8-aligned range of at least `size` bytes, or None when no free range is large
    /// enough. The returned size (rounded up) is what [`Self::free`] must be given.
    pub fn alloc(&mut self, size: u64) -> Option<(u64, u64)> {
        let size = round_up(size.max(1))?;
        let (&off, &len) = self.free.iter().find(|(_, &len)| len >= size)?;
        self.free.remove(&off);
        if len > size {
            self.free.insert(off + size, len - size);
        }
        self.free_bytes -= size;
        Some((off, size))
    }

    /// Returns a range obtained from [`Self::alloc`].
    ///
    /// # Panics
    /// When the range was not allocated (overlaps a free range or lies outside the arena):
    /// that is a bookkeeping bug in this crate, and continuing would hand one arena range
    /// to two submissions.
    pub fn free(&mut self, off: u64, size: u64) {
        assert!(
            off.is_multiple_of(ARENA_ALIGN)
                && size.is_multiple_of(ARENA_ALIGN)
                && size > 0
                && off.checked_add(size).is_some_and(|e| e <= self.len),
            "arena free of {off}+{size} outside an arena of {} bytes",
            self.len
        );
        let mut start = off;
        let mut len = size;
        if let Some((&p_off, &p_len)) = self.free.range(..off).next_back() {
            assert!(p_off + p_len <= off, "double free of arena range {off}+{size}");
            if p_off + p_len == off {
                self.free.remove(&p_off);
                start = p_off;
                len += p_len;
            }
        }
        if let Some((&n_off, &n_len)) = self.free.range(off..).next() {
            assert!(off + size <= n_off, "double free of arena range {off}+{size}");
            if off + size == n_off {
                self.free.remove(&n_off);
                len += n_len;
            }
        }
        self.free.insert(start, len);
        self.free_bytes += size;
    }
}

/// Bytes a submission of `n` blocks needs: its state word (the cancel contract), refs,
/// then one status byte per block.
pub fn submission_bytes(n: u64) -> u64 {
    umbp_protocol::transfer_state::STATE_BYTES + n * core::mem::size_of::<umbp_protocol::entries::BlockRef>() as u64 + n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_split_and_coalesce() {
        let mut a = ArenaAllocator::new(100);
        assert_eq!(a.len, 96, "rounded down to the alignment");
        let x = a.alloc(10).unwrap();
        assert_eq!(x, (0, 16));
        let y = a.alloc(8).unwrap();
        assert_eq!(y, (16, 8));
        let z = a.alloc(40).unwrap();
        assert_eq!(z, (24, 40));
        assert_eq!(a.free_bytes(), 32);
        assert!(a.alloc(33).is_none(), "nothing that large is free");
        a.free(x.0, x.1);
        assert_eq!(a.fragments(), 2);
        // First fit takes the hole at 0, not the tail.
        assert_eq!(a.alloc(8).unwrap(), (0, 8));
        a.free(0, 8);
        a.free(z.0, z.1);
        assert_eq!(a.fragments(), 2, "z merged with the tail, x's hole stays apart");
        a.free(y.0, y.1);
        assert_eq!(a.fragments(), 1);
        assert_eq!(a.free_bytes(), 96);
        assert_eq!(a.alloc(96).unwrap(), (0, 96));
        assert!(a.alloc(1).is_none());
    }

    #[test]
    fn zero_and_huge_requests() {
        let mut a = ArenaAllocator::new(64);
        assert_eq!(a.alloc(0).unwrap(), (0, 8), "empty requests still get a distinct range");
        assert!(a.alloc(u64::MAX).is_none(), "overflow in rounding is a refusal");
        assert!(ArenaAllocator::new(7).alloc(1).is_none());
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_panics() {
        let mut a = ArenaAllocator::new(64);
        let (o, s) = a.alloc(8).unwrap();
        let _keep = a.alloc(8).unwrap();
        a.free(o, s);
        a.free(o, s);
    }

    #[test]
    fn random_workload_matches_a_model() {
        // xorshift: deterministic, no dependency.
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let len = 4096;
        let mut a = ArenaAllocator::new(len);
        let mut live: Vec<(u64, u64)> = vec![];
        for _ in 0..20_000 {
            if rnd() % 3 != 0 {
                if let Some(r) = a.alloc(rnd() % 300) {
                    for &(o, s) in &live {
                        assert!(r.0 + r.1 <= o || o + s <= r.0, "{r:?} overlaps {o}+{s}");
                    }
                    assert!(r.0 % 8 == 0 && r.0 + r.1 <= len);
                    live.push(r);
                }
            } else if !live.is_empty() {
                let i = (rnd() % live.len() as u64) as usize;
                let (o, s) = live.swap_remove(i);
                a.free(o, s);
            }
            assert_eq!(a.free_bytes() + live.iter().map(|r| r.1).sum::<u64>(), len);
        }
        for (o, s) in live.drain(..) {
            a.free(o, s);
        }
        assert_eq!(a.fragments(), 1);
        assert_eq!(a.free_bytes(), len);
    }

    #[test]
    fn submission_sizes() {
        assert_eq!(submission_bytes(1), 8 + 25);
        assert_eq!(submission_bytes(4), 8 + 100);
    }
}
