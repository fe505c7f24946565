//! Malformed input from a peer (docs/connection.md "Failure rules", "malicious or buggy peer"): every check on a
//! shared region or a socket message must come back as a typed `ProtocolError`, never a
//! panic, a hang or an out-of-bounds access. The unit tests in `src/` cover the basic
//! cases one by one; these go through the public API only, corrupt regions *after* the
//! handles exist too, and throw random bytes at every parser.
#![cfg(not(loom))]

mod common;

use common::Region;
use proptest::prelude::*;
use umbp_protocol::arena::Arena;
use umbp_protocol::attachment::{AttachmentLayout, MAX_ARENA_BYTES};
use umbp_protocol::entries::{Cqe, Opcode, Sqe};
use umbp_protocol::index::{region_bytes, IndexHeader, IndexView, IndexWriter, MAX_SLOTS, MIN_SLOTS, TABLES_OFFSET};
use umbp_protocol::ring::{ring_bytes, Ring, RingHeader, MAX_RING_CAPACITY};
use umbp_protocol::wire::{self, Hello, HelloReply, MessageHeader, MessageKind, Role};
use umbp_protocol::{ObjectKey, ProtocolError, MAGIC, PROTOCOL_VERSION};

// Byte offsets of header words (the layout is part of the protocol; docs/protocol.md).
const RING_MAGIC: usize = 0;
const RING_VERSION: usize = 4;
const RING_ENTRY_SIZE: usize = 8;
const RING_CAPACITY: usize = 12;
const RING_TAIL: usize = 128;
const RING_HEAD: usize = 256;
const INDEX_MAGIC: usize = 0;
const INDEX_VERSION: usize = 4;
const INDEX_SLOT_COUNT: usize = 8;
const INDEX_TABLE_OFFSET: [usize; 2] = [16, 24];

fn ring_region(capacity: u32) -> (Region, usize) {
    let len = ring_bytes::<u64>(capacity);
    let mem = Region::new(len);
    // SAFETY: the region outlives the ring (dropped at the end of this call).
    unsafe { Ring::<u64>::init(mem.ptr(), len, capacity) }.unwrap();
    (mem, len)
}

fn attach_ring(mem: &Region, len: usize) -> Result<Ring<'_, u64>, ProtocolError> {
    // SAFETY: `len` is within the region, which outlives the returned ring.
    unsafe { Ring::<u64>::attach(mem.ptr(), len) }
}

#[test]
fn header_offsets_match_the_layout() {
    // The constants above are what another implementation would use; keep them honest.
    let (mem, len) = ring_region(8);
    let ring = attach_ring(&mem, len).unwrap();
    let h: &RingHeader = ring.header();
    let base = mem.ptr() as usize;
    assert_eq!(&*h.info as *const _ as usize - base, RING_MAGIC);
    assert_eq!(&h.info.capacity as *const _ as usize - base, RING_CAPACITY);
    assert_eq!(&*h.tail as *const _ as usize - base, RING_TAIL);
    assert_eq!(&*h.head as *const _ as usize - base, RING_HEAD);
    assert_eq!(&*h.need_wakeup as *const _ as usize - base, 384);

    let ilen = region_bytes(MIN_SLOTS);
    let imem = Region::new(ilen);
    // SAFETY: the region outlives the view.
    let view = unsafe { IndexView::init(imem.ptr(), ilen, MIN_SLOTS) }.unwrap();
    let ih: &IndexHeader = view.header();
    let ibase = imem.ptr() as usize;
    assert_eq!(&ih.info.slot_count as *const _ as usize - ibase, INDEX_SLOT_COUNT);
    assert_eq!(&ih.info.table_offset[1] as *const _ as usize - ibase, INDEX_TABLE_OFFSET[1]);
    assert_eq!(&*ih.epoch as *const _ as usize - ibase, 128);
}

// ---------------------------------------------------------------------------------------
// Rings

/// `Ring::init` over the first `len` bytes of `mem` (`len` may be anything up to its size).
fn init_ring(mem: &Region, len: usize, capacity: u32) -> Result<Ring<'_, u64>, ProtocolError> {
    assert!(len <= mem.len());
    // SAFETY: `len` is within the region, which outlives the returned ring.
    unsafe { Ring::<u64>::init(mem.ptr(), len, capacity) }
}

#[test]
fn ring_region_too_small() {
    let mem = Region::new(8192);
    // Smaller than the header.
    let r = init_ring(&mem, 100, 4);
    assert!(matches!(r, Err(ProtocolError::RegionTooSmall { need, have: 100 }) if need == ring_bytes::<u64>(4)));
    assert!(matches!(attach_ring(&mem, 511), Err(ProtocolError::RegionTooSmall { .. })));
    assert!(matches!(attach_ring(&mem, 0), Err(ProtocolError::RegionTooSmall { .. })));
    // Header fits but the entries do not.
    let cap = 64;
    assert!(matches!(init_ring(&mem, ring_bytes::<u64>(cap) - 1, cap), Err(ProtocolError::RegionTooSmall { .. })));
    // A valid ring whose peer claims a capacity bigger than the mapping.
    init_ring(&mem, 8192, 16).unwrap();
    mem.put_u32(RING_CAPACITY, 1024);
    assert!(matches!(attach_ring(&mem, 8192), Err(ProtocolError::RegionTooSmall { need, have: 8192 }) if need == ring_bytes::<u64>(1024)));
}

#[test]
fn ring_bad_magic_and_version() {
    let (mem, len) = ring_region(8);
    mem.put_u32(RING_MAGIC, 0);
    assert_eq!(attach_ring(&mem, len).err(), Some(ProtocolError::BadMagic { what: "ring", found: 0, expected: MAGIC }));
    mem.put_u32(RING_MAGIC, MAGIC.swap_bytes());
    assert!(matches!(attach_ring(&mem, len), Err(ProtocolError::BadMagic { .. })));
    mem.put_u32(RING_MAGIC, MAGIC);
    for v in [0, PROTOCOL_VERSION + 1, u32::MAX] {
        mem.put_u32(RING_VERSION, v);
        assert_eq!(attach_ring(&mem, len).err(), Some(ProtocolError::VersionMismatch { found: v, expected: PROTOCOL_VERSION }));
    }
}

#[test]
fn ring_bad_entry_size_and_capacity() {
    let (mem, len) = ring_region(8);
    mem.put_u32(RING_ENTRY_SIZE, 64);
    assert!(matches!(attach_ring(&mem, len), Err(ProtocolError::InvalidField { what: "ring entry size", value: 64 })));
    mem.put_u32(RING_ENTRY_SIZE, 8);
    for cap in [0, 3, 6, MAX_RING_CAPACITY + 1, MAX_RING_CAPACITY * 2, u32::MAX] {
        mem.put_u32(RING_CAPACITY, cap);
        assert!(matches!(attach_ring(&mem, len), Err(ProtocolError::InvalidField { what: "ring capacity", .. })), "capacity {cap}");
    }
    // Typed errors for a local mistake too.
    let big = Region::new(4096);
    // SAFETY: within the region.
    let r = unsafe { Ring::<Sqe>::init(big.ptr(), 4096, 0) };
    assert!(matches!(r, Err(ProtocolError::InvalidField { .. })));
    // SAFETY: within the region.
    let r = unsafe { Ring::<Sqe>::init(big.ptr().wrapping_add(64), 4000, 1) };
    assert!(matches!(r, Err(ProtocolError::Misaligned { align: 128 })));
}

/// The consumer's view: a tail more than `capacity` ahead of the head ("head > tail +
/// capacity" in the other direction, or a tail that is simply garbage).
#[test]
fn ring_corrupt_tail_seen_by_consumer() {
    let cap = 8u32;
    for (head, tail) in [(0u32, 9u32), (0, u32::MAX), (100, 50), (u32::MAX - 2, 7), (5, 5 + cap + 1)] {
        let (mem, len) = ring_region(cap);
        // Corrupt *before* the consumer attaches: its first look at the tail must fail.
        mem.put_u32(RING_HEAD, head);
        mem.put_u32(RING_TAIL, tail);
        let mut c = attach_ring(&mem, len).unwrap().consumer();
        let e = c.try_pop();
        assert_eq!(e, Err(ProtocolError::CorruptRing { head, tail, capacity: cap }), "head {head} tail {tail}");
        assert!(c.available().is_err());
        assert!(c.pop_batch(&mut Vec::new(), 4).is_err());
        assert!(c.prepare_sleep().is_err());
    }
    // Corrupt *after* the consumer drained a valid ring.
    let (mem, len) = ring_region(cap);
    let mut p = attach_ring(&mem, len).unwrap().producer();
    let mut c = attach_ring(&mem, len).unwrap().consumer();
    p.push_batch(&[1, 2, 3]).unwrap();
    assert_eq!(c.pop_batch(&mut Vec::new(), 8), Ok(3));
    mem.put_u32(RING_TAIL, 3 + cap + 1);
    assert!(matches!(c.try_pop(), Err(ProtocolError::CorruptRing { .. })));
    assert!(matches!(c.prepare_sleep(), Err(ProtocolError::CorruptRing { .. })));
}

/// The producer's view: a head that claims more was consumed than was produced, so that
/// `tail - head` (wrapping) exceeds the capacity.
#[test]
fn ring_corrupt_head_seen_by_producer() {
    let cap = 8u32;
    for (head, tail) in [(1u32, 0u32), (u32::MAX, 10), (100, 50), (20, 11)] {
        let (mem, len) = ring_region(cap);
        mem.put_u32(RING_HEAD, head);
        mem.put_u32(RING_TAIL, tail);
        let mut p = attach_ring(&mem, len).unwrap().producer();
        let mut saw_error = false;
        for i in 0..=cap as u64 {
            match p.try_push(i) {
                Ok(true) => {}
                Ok(false) => {
                    panic!("full ring reported instead of corruption (head {head} tail {tail})")
                }
                Err(e) => {
                    assert!(matches!(e, ProtocolError::CorruptRing { capacity: 8, .. }), "{e:?}");
                    saw_error = true;
                    break;
                }
            }
        }
        assert!(saw_error, "head {head} tail {tail}: corruption never detected");
    }
    // Head moved past the producer's private tail after the producer filled the ring.
    let (mem, len) = ring_region(cap);
    let mut p = attach_ring(&mem, len).unwrap().producer();
    for i in 0..cap as u64 {
        assert!(p.try_push(i).unwrap());
    }
    p.publish();
    mem.put_u32(RING_HEAD, cap + 3);
    assert!(matches!(p.try_push(99), Err(ProtocolError::CorruptRing { .. })));
    assert!(matches!(p.push_batch(&[1]), Err(ProtocolError::CorruptRing { .. })));
}

// ---------------------------------------------------------------------------------------
// Index

fn index_region() -> (Region, usize) {
    let len = region_bytes(MIN_SLOTS);
    let mem = Region::new(len);
    // SAFETY: the region outlives the view (dropped at the end of this call).
    unsafe { IndexView::init(mem.ptr(), len, MIN_SLOTS) }.unwrap();
    (mem, len)
}

fn attach_index(mem: &Region, len: usize) -> Result<IndexView<'_>, ProtocolError> {
    // SAFETY: `len` is within the region, which outlives the view.
    unsafe { IndexView::attach(mem.ptr(), len) }
}

#[test]
fn index_region_too_small() {
    let (mem, len) = index_region();
    for short in [0, 100, TABLES_OFFSET - 1, TABLES_OFFSET, len - 1] {
        assert!(matches!(attach_index(&mem, short), Err(ProtocolError::RegionTooSmall { .. })), "len {short}");
    }
    let fresh = Region::new(len);
    // SAFETY: within the region.
    let r = unsafe { IndexView::init(fresh.ptr(), len - 32, MIN_SLOTS) };
    assert!(matches!(r, Err(ProtocolError::RegionTooSmall { .. })));
    // SAFETY: within the region.
    let r = unsafe { IndexView::init(fresh.ptr().wrapping_add(64), len - 64, MIN_SLOTS) };
    assert!(matches!(r, Err(ProtocolError::Misaligned { .. })));
    // A slot count that does not fit the mapping.
    mem.put_u64(INDEX_SLOT_COUNT, MIN_SLOTS * 2);
    assert!(matches!(attach_index(&mem, len), Err(ProtocolError::RegionTooSmall { .. })));
}

#[test]
fn index_bad_magic_version_and_slot_count() {
    let (mem, len) = index_region();
    mem.put_u32(INDEX_MAGIC, 0x1234_5678);
    assert_eq!(attach_index(&mem, len).err(), Some(ProtocolError::BadMagic { what: "index", found: 0x1234_5678, expected: MAGIC }));
    mem.put_u32(INDEX_MAGIC, MAGIC);
    mem.put_u32(INDEX_VERSION, PROTOCOL_VERSION + 7);
    assert!(matches!(attach_index(&mem, len), Err(ProtocolError::VersionMismatch { .. })));
    mem.put_u32(INDEX_VERSION, PROTOCOL_VERSION);
    for n in [0, 1, MIN_SLOTS / 2, MIN_SLOTS + 1, 3 * MIN_SLOTS, MAX_SLOTS * 2, u64::MAX, 1 << 63] {
        mem.put_u64(INDEX_SLOT_COUNT, n);
        assert!(matches!(attach_index(&mem, len), Err(ProtocolError::InvalidField { what: "index slot count", .. })), "slot count {n}");
    }
}

#[test]
fn index_table_offsets_out_of_range() {
    let (mem, len) = index_region();
    let table_bytes = MIN_SLOTS * 32;
    let bad = [
        0u64,                          // overlaps the header
        64,                            // overlaps the header
        len as u64 - table_bytes + 32, // runs past the end
        len as u64,                    // starts at the end
        u64::MAX,                      // overflows
        u64::MAX - table_bytes + 1,    // overflows exactly
        TABLES_OFFSET as u64 + 8,      // misaligned slots
        (usize::MAX as u64) & !31,     // huge but aligned
    ];
    for (t, field) in INDEX_TABLE_OFFSET.into_iter().enumerate() {
        for off in bad {
            let (mem, len) = index_region();
            mem.put_u64(field, off);
            assert_eq!(
                attach_index(&mem, len).err(),
                Some(ProtocolError::InvalidField { what: "index table offset", value: off }),
                "table {t} offset {off:#x}"
            );
        }
    }
    // Both tables at the same valid place is accepted by the reader (it only reads).
    mem.put_u64(INDEX_TABLE_OFFSET[1], TABLES_OFFSET as u64);
    assert!(attach_index(&mem, len).is_ok());
}

/// Garbage slots written by a faulty pool: lookups terminate (bounded probes and
/// retries) and return something, never panic; odd sequence numbers everywhere read as
/// misses.
#[test]
fn index_garbage_slots_never_hang() {
    let (mem, len) = index_region();
    let mut x = 0x1234_5678_9abc_def0u64;
    for off in (TABLES_OFFSET..len).step_by(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        mem.put_u64(off, x);
    }
    let view = attach_index(&mem, len).unwrap();
    for i in 0..2000u128 {
        let _ = view.lookup(ObjectKey(i * 0x9E37_79B9_7F4A_7C15));
    }
    let _ = view.match_prefix(&[ObjectKey(1), ObjectKey(2)]);
    let _ = view.probe_histogram(8);
    // Every seq odd: a writer stuck mid-write on every slot. All misses, quickly.
    for off in (TABLES_OFFSET..len).step_by(32) {
        mem.put_u32(off, 1);
    }
    let t = std::time::Instant::now();
    for i in 0..100u128 {
        assert_eq!(view.lookup(ObjectKey(i)), None);
    }
    assert!(t.elapsed() < std::time::Duration::from_secs(5));
    // Every slot FULL with even seq: a full table with no empty slot; probes stop after
    // one lap.
    for off in (TABLES_OFFSET..len).step_by(32) {
        mem.put_u32(off, 0);
        mem.put_u32(off + 4, 1);
    }
    assert_eq!(view.lookup(ObjectKey(u128::MAX)), None);
    // A writer attaching to such a region still cannot be driven out of bounds.
    let mut w = IndexWriter::new(view);
    let _ = w.insert(ObjectKey(5), 5);
    let _ = w.remove(ObjectKey(5));
}

// ---------------------------------------------------------------------------------------
// Socket messages, arena, attachment layout

#[test]
fn wire_messages_reject_garbage() {
    let hello = Hello::new(Role::Worker, 42, 7);
    let bytes = bytemuck::bytes_of(&hello);
    for n in 0..bytes.len() {
        assert_eq!(wire::decode::<Hello>(&bytes[..n]).err(), Some(ProtocolError::Truncated { need: 88, got: n }));
    }
    assert!(wire::decode::<HelloReply>(&[0u8; 255]).is_err());
    assert!(wire::decode::<MessageHeader>(&[0u8; 15]).is_err());
    // Header checks.
    let ok = MessageHeader::new(MessageKind::Hello, 88, 0);
    assert_eq!(ok.validate(), Ok(MessageKind::Hello));
    assert!(matches!(MessageHeader { magic: 0, ..ok }.validate(), Err(ProtocolError::BadMagic { what: "message", .. })));
    assert!(matches!(MessageHeader { kind: 0, ..ok }.validate(), Err(ProtocolError::InvalidField { what: "message kind", .. })));
    assert!(matches!(MessageHeader { len: u32::MAX, ..ok }.validate(), Err(ProtocolError::InvalidField { what: "message length", .. })));
    assert!(matches!(MessageHeader { fd_count: 9, ..ok }.validate(), Err(ProtocolError::InvalidField { what: "fd count", .. })));
    // Hello checks.
    assert!(matches!(
        Hello {
            protocol_version: PROTOCOL_VERSION + 1,
            ..hello
        }
        .validate(),
        Err(ProtocolError::VersionMismatch { found, .. }) if found == PROTOCOL_VERSION + 1
    ));
    assert!(matches!(Hello { role: 0, ..hello }.validate(), Err(ProtocolError::InvalidField { what: "role", .. })));
    assert!(matches!(Hello { magic: MAGIC + 1, ..hello }.validate(), Err(ProtocolError::BadMagic { .. })));
    assert!(Opcode::from_u8(0).is_err() && Opcode::from_u8(255).is_err());
    // A refusal's text survives a round trip and garbage text is decoded lossily.
    let mut r = HelloReply::refusal(wire::ReplyStatus::VersionMismatch, "peer speaks 9");
    assert_eq!(r.message(), "peer speaks 9");
    r.message = [0xff; wire::REPLY_MESSAGE_LEN];
    assert!(!r.message().is_empty());
}

#[test]
fn arena_and_attachment_limits() {
    let mem = Region::new(4096);
    // SAFETY: within the region, which outlives the arena.
    let arena = unsafe { Arena::new(mem.ptr(), 4096) };
    for (off, count) in [(4096u64, 1u64), (4088, 2), (u64::MAX, 1), (8, u64::MAX), (u64::MAX - 7, 1), (1, 1)] {
        assert!(matches!(arena.read::<u64>(off, count), Err(ProtocolError::ArenaOutOfRange { .. })), "{off}+{count}");
        assert!(arena.check_range::<u64>(off, count).is_err());
    }
    assert_eq!(arena.read::<u64>(4088, 1).unwrap(), vec![0]);
    assert_eq!(arena.read::<u64>(4096, 0).unwrap(), Vec::<u64>::new());
    assert!(arena.write::<Cqe>(4096 - 31, &[Cqe::default_zeroed()]).is_err());
    for bad in [(0, 4, 4, 1), (4, 0, 4, 1), (4, 4, 3, 1), (MAX_RING_CAPACITY * 2, 4, 4, 1), (4, 4, 4, 0), (4, 4, 4, MAX_ARENA_BYTES + 1)] {
        assert!(matches!(AttachmentLayout::new(bad.0, bad.1, bad.2, bad.3), Err(ProtocolError::InvalidField { .. })), "{bad:?}");
    }
}

trait Zeroed {
    fn default_zeroed() -> Self;
}
impl Zeroed for Cqe {
    fn default_zeroed() -> Self {
        bytemuck::Zeroable::zeroed()
    }
}

// ---------------------------------------------------------------------------------------
// Random bytes everywhere

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Random ring header words (often near-valid): attach either fails with a typed error
    /// or gives a ring whose producer and consumer only ever return Ok or CorruptRing.
    #[test]
    fn random_ring_headers_never_panic(
        magic_ok in proptest::bool::weighted(0.9),
        version_ok in proptest::bool::weighted(0.9),
        size_ok in proptest::bool::weighted(0.9),
        cap in prop_oneof![Just(8u32), any::<u32>(), 0u32..64],
        head in any::<u32>(), tail in prop_oneof![any::<u32>(), 0u32..20],
        len in prop_oneof![3 => Just(ring_bytes::<u64>(8)), 1 => 0usize..2048],
        ops in proptest::collection::vec(0u8..5, 0..40),
    ) {
        let mem = Region::new(ring_bytes::<u64>(8));
        mem.put_u32(RING_MAGIC, if magic_ok { MAGIC } else { head });
        mem.put_u32(RING_VERSION, if version_ok { PROTOCOL_VERSION } else { tail });
        mem.put_u32(RING_ENTRY_SIZE, if size_ok { 8 } else { cap });
        mem.put_u32(RING_CAPACITY, cap);
        mem.put_u32(RING_HEAD, head);
        mem.put_u32(RING_TAIL, tail);
        let len = len.min(mem.len());
        if let Ok(ring) = attach_ring(&mem, len) {
            prop_assert!(ring_bytes::<u64>(ring.capacity()) <= len);
            let mut p = ring.producer();
            let mut c = attach_ring(&mem, len).unwrap().consumer();
            for op in ops {
                let r = match op {
                    0 => p.try_push(1).map(|_| ()),
                    1 => p.push_batch(&[1, 2, 3]).map(|_| ()),
                    2 => c.try_pop().map(|_| ()),
                    3 => c.pop_batch(&mut Vec::new(), 5).map(|_| ()),
                    _ => c.prepare_sleep().map(|_| c.finish_sleep()),
                };
                if let Err(e) = r {
                    prop_assert!(matches!(e, ProtocolError::CorruptRing { .. }), "{:?}", e);
                }
            }
        }
    }

    /// Random index header words: attach fails with a typed error or yields a view whose
    /// lookups stay inside the region.
    #[test]
    fn random_index_headers_never_panic(
        slot_count in prop_oneof![Just(MIN_SLOTS), any::<u64>(), 0u64..5000],
        off0 in prop_oneof![Just(TABLES_OFFSET as u64), any::<u64>(), 0u64..100_000],
        off1 in prop_oneof![Just((TABLES_OFFSET + 32 * 1024) as u64), any::<u64>(), 0u64..100_000],
        version_ok in any::<bool>(),
        keys in proptest::collection::vec(any::<u128>(), 0..20),
    ) {
        let (mem, len) = index_region();
        mem.put_u64(INDEX_SLOT_COUNT, slot_count);
        mem.put_u64(INDEX_TABLE_OFFSET[0], off0);
        mem.put_u64(INDEX_TABLE_OFFSET[1], off1);
        if !version_ok {
            mem.put_u32(INDEX_VERSION, slot_count as u32);
        }
        if let Ok(view) = attach_index(&mem, len) {
            prop_assert_eq!(view.slot_count(), MIN_SLOTS);
            for k in keys {
                let _ = view.lookup(ObjectKey(k));
            }
        }
    }

    /// Random bytes as socket messages.
    #[test]
    fn random_messages_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        if let Ok(h) = wire::decode::<MessageHeader>(&bytes) {
            let _ = h.validate();
        }
        if let Ok(h) = wire::decode::<Hello>(&bytes) {
            let _ = h.validate();
            let _ = h.namespace();
        }
        if let Ok(r) = wire::decode::<HelloReply>(&bytes) {
            let _ = r.message();
        }
        if let Ok(s) = wire::decode::<Sqe>(&bytes) {
            let _ = Opcode::from_u8(s.opcode);
        }
    }
}
