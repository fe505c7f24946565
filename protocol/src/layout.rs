//! KV layouts (docs/protocol.md §3 and docs/architecture.md "An object's life") and the address math that turns `(key, block id)` pairs into
//! copies. An object is the concatenation of block `b` of every segment, in order.

use bytemuck::{Pod, Zeroable};

use crate::{assert_layout, ProtocolError};

/// One strided run of pages inside one registered allocation.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable, PartialEq, Eq)]
pub struct Segment {
    pub alloc_id: u32,
    pub _pad: u32,
    /// Byte offset of block 0 inside the allocation.
    pub offset: u64,
    /// Bytes between block `b` and block `b + 1`.
    pub block_stride: u64,
    /// Bytes of one block's page in this segment.
    pub page_bytes: u64,
    pub num_blocks: u64,
}
assert_layout!(Segment, size = 40, align = 8);

impl Segment {
    pub fn new(alloc_id: u32, offset: u64, block_stride: u64, page_bytes: u64, num_blocks: u64) -> Self {
        Self { alloc_id, _pad: 0, offset, block_stride, page_bytes, num_blocks }
    }

    /// One past the last byte this segment touches, or None on overflow.
    fn end(&self) -> Option<u64> {
        (self.num_blocks - 1).checked_mul(self.block_stride)?.checked_add(self.offset)?.checked_add(self.page_bytes)
    }
}

/// A validated layout of one cache group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvLayout {
    segments: Vec<Segment>,
    /// [`KvLayout::segments_by_alloc`], computed once.
    by_alloc: Vec<(u32, Vec<(usize, u64)>)>,
    object_bytes: u64,
    num_blocks: u64,
}

/// Most bytes one object may have (a whole block of a very large model across all layers).
pub const MAX_OBJECT_BYTES: u64 = 1 << 30;

impl KvLayout {
    /// Validates segments against the sizes of the allocations they name.
    /// `alloc_size(id)` returns None for an unknown allocation.
    pub fn new(segments: Vec<Segment>, alloc_size: impl Fn(u32) -> Option<u64>) -> Result<Self, ProtocolError> {
        if segments.is_empty() || segments.len() > crate::wire::MAX_SEGMENTS as usize {
            return Err(ProtocolError::InvalidField { what: "segment count", value: segments.len() as u64 });
        }
        let mut object_bytes: u64 = 0;
        let mut num_blocks = u64::MAX;
        for s in &segments {
            let size = alloc_size(s.alloc_id).ok_or(ProtocolError::InvalidField { what: "segment alloc_id", value: s.alloc_id as u64 })?;
            if s.page_bytes == 0 {
                return Err(ProtocolError::InvalidField { what: "segment page_bytes", value: 0 });
            }
            if s.num_blocks == 0 {
                return Err(ProtocolError::InvalidField { what: "segment num_blocks", value: 0 });
            }
            if s.num_blocks > 1 && s.block_stride < s.page_bytes {
                // Overlapping pages would make concurrent loads of two blocks race.
                return Err(ProtocolError::InvalidField { what: "segment block_stride", value: s.block_stride });
            }
            let end = s.end().ok_or(ProtocolError::InvalidField { what: "segment extent", value: u64::MAX })?;
            if end > size {
                return Err(ProtocolError::InvalidField { what: "segment extent past allocation", value: end });
            }
            object_bytes = object_bytes
                .checked_add(s.page_bytes)
                .filter(|&b| b <= MAX_OBJECT_BYTES)
                .ok_or(ProtocolError::InvalidField { what: "object bytes", value: s.page_bytes })?;
            num_blocks = num_blocks.min(s.num_blocks);
        }
        let mut by_alloc: Vec<(u32, Vec<(usize, u64)>)> = Vec::new();
        let mut object_offset = 0u64;
        for (i, seg) in segments.iter().enumerate() {
            match by_alloc.iter_mut().find(|g| g.0 == seg.alloc_id) {
                Some(g) => g.1.push((i, object_offset)),
                None => by_alloc.push((seg.alloc_id, vec![(i, object_offset)])),
            }
            object_offset += seg.page_bytes;
        }
        Ok(Self { segments, by_alloc, object_bytes, num_blocks })
    }

    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// The segments grouped by allocation, in order of first appearance: for each
    /// allocation, its segments' indexes with each segment's byte offset inside an object.
    /// One pass over an allocation's segments per block lets consecutive segments of a
    /// block (and consecutive blocks) that continue on both sides coalesce, with no hashing
    /// per copy (a 10k-token prefix of a 24-layer model is 7,500 copies).
    pub fn segments_by_alloc(&self) -> &[(u32, Vec<(usize, u64)>)] {
        &self.by_alloc
    }

    /// Bytes of one object of this layout.
    pub fn object_bytes(&self) -> u64 {
        self.object_bytes
    }

    /// Valid block ids are `0..num_blocks`.
    pub fn num_blocks(&self) -> u64 {
        self.num_blocks
    }

    /// Appends the copies that move block `block_id` to/from an object stored at
    /// `host_offset` of pool memory, merging with the previous copy where both sides are
    /// contiguous. Errors (without appending) when the block id is out of range.
    pub fn plan_block(&self, block_id: u64, host_offset: u64, out: &mut Vec<CopyOp>) -> Result<(), ProtocolError> {
        if block_id >= self.num_blocks {
            return Err(ProtocolError::InvalidField { what: "block id", value: block_id });
        }
        let mut host = host_offset;
        for s in &self.segments {
            let op =
                CopyOp { alloc_id: s.alloc_id, device_offset: s.offset + block_id * s.block_stride, host_offset: host, len: s.page_bytes };
            push_coalesced(out, op);
            host += s.page_bytes;
        }
        Ok(())
    }
}

/// One contiguous copy between a registered allocation and pool memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOp {
    pub alloc_id: u32,
    pub device_offset: u64,
    pub host_offset: u64,
    pub len: u64,
}

/// Pushes `op`, or extends the last copy when `op` continues it on both sides. Inlined:
/// the pool calls it once per page of a transfer (issue #14: 35 instructions a call out of
/// line, as much as the rest of the pool's planning of the page).
#[inline]
pub fn push_coalesced(out: &mut Vec<CopyOp>, op: CopyOp) {
    if let Some(last) = out.last_mut() {
        if last.alloc_id == op.alloc_id
            && last.device_offset + last.len == op.device_offset
            && last.host_offset + last.len == op.host_offset
        {
            last.len += op.len;
            return;
        }
    }
    out.push(op);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(id: u32) -> Option<u64> {
        match id {
            0 => Some(1 << 20),
            1 => Some(4096),
            _ => None,
        }
    }

    /// Segments of one allocation come together, in order of first appearance, each with
    /// its offset inside an object (the sum of the pages before it, whatever allocation
    /// they are in).
    #[test]
    fn segments_are_grouped_by_allocation_with_their_object_offsets() {
        let segs = vec![
            Segment::new(0, 0, 1024, 256, 4),
            Segment::new(1, 0, 1024, 512, 4),
            Segment::new(0, 256, 1024, 128, 4),
            Segment::new(1, 512, 1024, 64, 4),
        ];
        let l = KvLayout::new(segs, sizes).unwrap();
        assert_eq!(l.segments_by_alloc(), &[(0, vec![(0, 0), (2, 768)]), (1, vec![(1, 256), (3, 896)])]);
        assert_eq!(l.object_bytes(), 960);
    }

    #[test]
    fn per_layer_layout_addresses() {
        // Two layers, each a [blocks=4][page=1024] tensor, 4096 bytes apart.
        let l = KvLayout::new(vec![Segment::new(0, 0, 1024, 1024, 4), Segment::new(0, 4096, 1024, 1024, 4)], sizes).unwrap();
        assert_eq!(l.object_bytes(), 2048);
        assert_eq!(l.num_blocks(), 4);
        let mut ops = vec![];
        l.plan_block(2, 10_000, &mut ops).unwrap();
        assert_eq!(
            ops,
            vec![
                CopyOp { alloc_id: 0, device_offset: 2048, host_offset: 10_000, len: 1024 },
                CopyOp { alloc_id: 0, device_offset: 6144, host_offset: 11_024, len: 1024 },
            ]
        );
        assert!(l.plan_block(4, 0, &mut ops).is_err());
        assert_eq!(ops.len(), 2, "a rejected block appends nothing");
    }

    #[test]
    fn adjacent_blocks_coalesce() {
        // Cross-layer layout: one segment, blocks contiguous; objects stored back to back.
        let l = KvLayout::new(vec![Segment::new(0, 0, 512, 512, 100)], sizes).unwrap();
        let mut ops = vec![];
        for b in 10..20 {
            l.plan_block(b, (b - 10) * 512, &mut ops).unwrap();
        }
        assert_eq!(ops, vec![CopyOp { alloc_id: 0, device_offset: 5120, host_offset: 0, len: 5120 }]);
        // A gap on the host side breaks the run.
        l.plan_block(20, 99_999, &mut ops).unwrap();
        assert_eq!(ops.len(), 2);
    }

    #[test]
    fn block_outermost_layer_segments_plan_one_copy_per_block() {
        // vLLM's BLHNC registered one segment per layer (a peer need not merge them): 3
        // layers of 512-byte pages, layer l at l * 512, blocks 1536 bytes apart.
        let segs = (0..3).map(|l| Segment::new(0, l * 512, 1536, 512, 100)).collect();
        let l = KvLayout::new(segs, sizes).unwrap();
        assert_eq!(l.object_bytes(), 1536);
        let mut ops = vec![];
        l.plan_block(7, 0, &mut ops).unwrap();
        assert_eq!(ops, vec![CopyOp { alloc_id: 0, device_offset: 7 * 1536, host_offset: 0, len: 1536 }]);
    }

    #[test]
    fn rejects_bad_segments() {
        let bad = |s: Segment| KvLayout::new(vec![s], sizes).unwrap_err();
        assert!(matches!(bad(Segment::new(9, 0, 1, 1, 1)), ProtocolError::InvalidField { what: "segment alloc_id", .. }));
        assert!(matches!(
            bad(Segment::new(1, 0, 1024, 1024, 5)),
            ProtocolError::InvalidField { what: "segment extent past allocation", .. }
        ));
        assert!(matches!(bad(Segment::new(0, 0, 10, 20, 5)), ProtocolError::InvalidField { what: "segment block_stride", .. }));
        assert!(matches!(bad(Segment::new(0, 0, 0, 0, 5)), ProtocolError::InvalidField { what: "segment page_bytes", .. }));
        assert!(matches!(bad(Segment::new(0, u64::MAX - 5, u64::MAX / 2, 10, 3)), ProtocolError::InvalidField { .. }));
        assert!(KvLayout::new(vec![], sizes).is_err());
    }
}
