//! A shard's in-memory index entries, kept compact (issue #34, S7): the map's key is the
//! record's (key, namespace), its value where the record is and the header fields a read
//! checks, no more. The full header is rebuilt from the two when a record is read; footer
//! entries are kept in memory only for segments still open (`shard::SegMeta::records`).

use super::format::{RecordHeader, BLOCK, FLAG_TOMBSTONE};

/// A record's identity: (key, namespace), as four u64 words (alignment 8: a pair of u128
/// would round every table bucket up to a multiple of 16 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct RecKey([u64; 4]);

impl RecKey {
    pub fn new(key: u128, namespace: u128) -> Self {
        Self([key as u64, (key >> 64) as u64, namespace as u64, (namespace >> 64) as u64])
    }

    pub fn key(&self) -> u128 {
        self.0[0] as u128 | (self.0[1] as u128) << 64
    }

    pub fn namespace(&self) -> u128 {
        self.0[2] as u128 | (self.0[3] as u128) << 64
    }
}

pub(super) fn rec_key(h: &RecordHeader) -> RecKey {
    RecKey::new(h.key, h.namespace)
}

/// Where an indexed record (or tombstone) lives and what its header says besides its
/// identity: 40 bytes, where a full location (segment, offset, header) took 96.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Slot {
    pub seg: u64,
    pub size: u64,
    pub layout_object_size: u64,
    pub seq: u64,
    /// Offset in the segment, in blocks (segments are at most `format::MAX_SEGMENT_BYTES`).
    block: u32,
    pub payload_crc: u32,
}

// Index memory per entry: the figure docs/ssd.md states follows from these.
const _: () = assert!(std::mem::size_of::<Slot>() == 40 && std::mem::size_of::<RecKey>() == 32);

/// A record with everything its header says and where it is (a read, the warm restart).
#[derive(Debug, Clone, Copy)]
pub(super) struct Loc {
    pub seg: u64,
    pub offset: u64,
    pub header: RecordHeader,
}

impl Slot {
    /// The slot of a record at a block-aligned `offset` below `format::MAX_SEGMENT_BYTES`
    /// (the store's own offsets, and those the warm restart checked).
    pub fn new(loc: &Loc) -> Self {
        debug_assert!(loc.offset.is_multiple_of(BLOCK));
        let block = u32::try_from(loc.offset / BLOCK).expect("segment offsets are below MAX_SEGMENT_BYTES (checked at open and rebuild)");
        let h = &loc.header;
        Self { seg: loc.seg, size: h.size, layout_object_size: h.layout_object_size, seq: h.seq, block, payload_crc: h.payload_crc }
    }

    pub fn offset(&self) -> u64 {
        self.block as u64 * BLOCK
    }

    pub fn is_at(&self, seg: u64, offset: u64) -> bool {
        self.seg == seg && self.offset() == offset
    }

    /// The full record this slot (of `key`, in the index or, with `tombstone`, among the
    /// tombstones) stands for.
    pub fn loc(&self, key: &RecKey, tombstone: bool) -> Loc {
        let header = RecordHeader {
            flags: if tombstone { FLAG_TOMBSTONE } else { 0 },
            key: key.key(),
            namespace: key.namespace(),
            size: self.size,
            layout_object_size: self.layout_object_size,
            seq: self.seq,
            payload_crc: self.payload_crc,
        };
        Loc { seg: self.seg, offset: self.offset(), header }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_gives_back_the_record_it_was_made_of() {
        let k = RecKey::new(u128::MAX - 5, 1 << 100 | 3);
        assert_eq!((k.key(), k.namespace()), (u128::MAX - 5, 1 << 100 | 3));
        for (flags, tomb) in [(0, false), (FLAG_TOMBSTONE, true)] {
            let header = RecordHeader {
                flags,
                key: k.key(),
                namespace: k.namespace(),
                size: 123_456,
                layout_object_size: 65536,
                seq: 1 << 61,
                payload_crc: 0xdead_beef,
            };
            let loc = Loc { seg: 1 << 40, offset: (u32::MAX as u64) * BLOCK, header };
            let back = Slot::new(&loc).loc(&k, tomb);
            assert_eq!((back.seg, back.offset, back.header), (loc.seg, loc.offset, loc.header));
        }
    }
}
