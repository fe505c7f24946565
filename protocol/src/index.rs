//! The shared hash index (docs/protocol.md §2 "Shared index"): open addressing with linear probing in a memfd that
//! the pool writes and schedulers map read-only.
//!
//! ```text
//!  header                          table 0                      table 1
//! ┌──────┬───────┬───────┐ ┌─────────────────────────┐ ┌─────────────────────────┐
//! │ info │ epoch │ stats │ │ slot slot slot ...      │ │ slot slot slot ...      │
//! └──────┴───────┴───────┘ └─────────────────────────┘ └─────────────────────────┘
//!                  active table = epoch & 1; rebuilds go into the other one.
//!  slot (32 B, two per cache line):
//! ┌───────────┬───────────┬────────────────┬────────────────┬────────────────┐
//! │ seq (u32) │ state u32 │ key lo (u64)   │ key hi (u64)   │ location (u64) │
//! └───────────┴───────────┴────────────────┴────────────────┴────────────────┘
//! ```
//! One writer (the pool serialises its index updates); any number of readers in other
//! processes. Each slot is a seqlock: the writer makes `seq` odd, fences, writes the
//! fields, then publishes an even `seq` with Release. A reader loads `seq` (Acquire),
//! copies the fields with atomic loads, fences (Acquire) and re-loads `seq`; a change means
//! a torn copy and the slot is read again. Readers never block: every retry loop is
//! bounded, and running out of retries is a miss (a recompute), never a wrong hit.
//!
//! Rebuild: tombstones slow lookups, so when they pass a threshold the writer copies live
//! entries into the other table and flips `epoch` (Release). A reader checks that `epoch`
//! did not change across its lookup and retries if it did, so it never trusts a table that
//! the writer may have started to reuse.

use crossbeam_utils::CachePadded;

use crate::sync::{fence, AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
use crate::ProtocolError;
use crate::{ObjectKey, MAGIC, PROTOCOL_VERSION};

pub const SLOT_EMPTY: u32 = 0;
pub const SLOT_FULL: u32 = 1;
pub const SLOT_TOMBSTONE: u32 = 2;

/// One slot; all words atomics because other processes read them concurrently.
#[repr(C, align(32))]
pub struct IndexSlot {
    pub seq: AtomicU32,
    pub state: AtomicU32,
    pub key: [AtomicU64; 2],
    pub location: AtomicU64,
}
#[cfg(not(loom))]
crate::assert_layout!(IndexSlot, size = 32, align = 32);

#[repr(C)]
pub struct IndexInfo {
    pub magic: AtomicU32,
    pub version: AtomicU32,
    /// Slots per table (power of two).
    pub slot_count: AtomicU64,
    /// Byte offsets of the two tables from the start of the region.
    pub table_offset: [AtomicU64; 2],
    /// Key of the home-slot hash (SipHash-1-3), drawn at random by the pool when it formats
    /// the region (protocol v3). Readers hash with it too.
    pub seed: [AtomicU64; 2],
    /// Non-zero once the writer shut down (see [`IndexView::mark_closed`]): every entry is
    /// stale from then on. Zero in a fresh region, so a pool that predates the word reads
    /// as open and readers fall back to their socket check.
    pub closed: AtomicU32,
    pub reserved: AtomicU32,
    /// The pool's death notice, a Linux robust-futex entry: `robust_next` is the `next`
    /// pointer of a robust list entry (in the pool's address space; readers ignore it) and
    /// `owner` its futex word. A pool thread registers the list and stores its thread id in
    /// `owner`; when that thread exits, however the process dies (SIGKILL included), the
    /// kernel sets [`OWNER_DIED`] in `owner` before the process can be reaped. 0 = not armed
    /// (a pool that could not register it, or predates it): readers rely on their socket.
    pub robust_next: AtomicU64,
    pub owner: AtomicU32,
}
#[cfg(not(loom))]
crate::assert_layout!(IndexInfo, size = 72, align = 8);

/// Bit the kernel sets in a robust futex word whose owner thread died (linux/futex.h).
pub const OWNER_DIED: u32 = 0x4000_0000;

/// Counters the writer maintains for tools (ringtool, metrics).
#[repr(C)]
pub struct IndexStats {
    pub live: AtomicU64,
    pub tombstones: AtomicU64,
    pub inserts: AtomicU64,
    pub removes: AtomicU64,
    pub rebuilds: AtomicU64,
}

#[repr(C)]
pub struct IndexHeader {
    pub info: CachePadded<IndexInfo>,
    pub epoch: CachePadded<AtomicU64>,
    pub stats: CachePadded<IndexStats>,
}
#[cfg(not(loom))]
crate::assert_layout!(IndexHeader, size = 384, align = 128);

/// Where table 0 starts: the header rounded up to a page.
pub const TABLES_OFFSET: usize = 4096;
/// Fewest slots a table may have.
pub const MIN_SLOTS: u64 = 1024;
/// Largest table accepted from a peer (2^30 slots = 32 GiB per table).
pub const MAX_SLOTS: u64 = 1 << 30;

/// Slots per table for a pool of `capacity_bytes` holding objects of at least
/// `min_object_bytes`: twice the most objects that fit, so the load stays under one half.
pub fn slots_for(capacity_bytes: u64, min_object_bytes: u64) -> u64 {
    let objects = capacity_bytes / min_object_bytes.max(1);
    objects.saturating_mul(2).next_power_of_two().clamp(MIN_SLOTS, MAX_SLOTS)
}

/// Bytes of an index region with `slot_count` slots per table.
pub fn region_bytes(slot_count: u64) -> usize {
    TABLES_OFFSET + 2 * slot_count as usize * core::mem::size_of::<IndexSlot>()
}

/// Retries a reader spends on one slot before calling it a miss (the writer may be
/// stopped mid-write, SIGSTOP, and must not stall a scheduler).
const SLOT_RETRIES: u32 = 64;
/// Retries a reader spends on epoch changes (concurrent rebuilds) before a miss.
const EPOCH_RETRIES: u32 = 4;
/// No entry sits this many slots or more past its home slot: the writer refuses an insert
/// that would (`IndexFull::ProbeLimit`) and readers stop probing here. Keys a client
/// chose to collide cost every probe at most this much. With the pool's load (at most one
/// half live when objects respect `--min-object-size`), random keys come nowhere near it:
/// the longest displacement expected in 2^30 slots at load 1/2 is about 110.
pub const MAX_PROBE: u64 = 512;

/// Checked view over an index region: header plus two tables.
#[derive(Clone, Copy)]
pub struct IndexView<'a> {
    header: &'a IndexHeader,
    tables: [&'a [IndexSlot]; 2],
    mask: u64,
    seed: [u64; 2],
}

/// Home slot of `key` in a table of `mask + 1` slots: a keyed 128-bit multiply-fold mix
/// (wyhash's `mum`, twice) of the key's two words with the region's `seed`. Keys made by
/// [`crate::key`] are uniform already, but a client that picks its own keys (counters,
/// strides, or keys made to collide under an unkeyed mix: protocol v2 used murmur3's fmix64
/// of `lo ^ rotl(hi, 32)`, so any keys with equal `lo ^ rotl(hi, 32)` shared one home in
/// every pool) would pile them onto one run of slots. Keyed, such keys are as hard to find
/// as random ones for anyone who does not hold the seed. Every peer that maps the index
/// reads the seed (it homes keys too), so a cryptographic PRF would buy nothing over this
/// mix against peers; [`MAX_PROBE`] bounds what they can do. (SipHash-1-3 here cost ~8 ns
/// per key, doubling a 64-block `match_prefix`.)
pub fn home_slot(key: ObjectKey, mask: u64, seed: [u64; 2]) -> u64 {
    const P0: u64 = 0xa076_1d64_78bd_642f;
    const P1: u64 = 0xe703_7ed1_a0b4_28db;
    const P2: u64 = 0x8ebc_6af0_9c88_c6e3;
    let x = mum(key.0 as u64 ^ seed[0] ^ P0, (key.0 >> 64) as u64 ^ seed[1] ^ P1);
    mum(x ^ P2, seed[0] ^ seed[1].rotate_left(32) ^ P1) & mask
}

/// 64 x 64 -> 128-bit multiply, folded: the two halves xored.
fn mum(a: u64, b: u64) -> u64 {
    let r = a as u128 * b as u128;
    (r as u64) ^ ((r >> 64) as u64)
}

/// Slots a probe looks at: the whole table when it is smaller than [`MAX_PROBE`].
fn probe_len(mask: u64) -> u64 {
    (mask + 1).min(MAX_PROBE)
}

#[cfg(not(loom))]
impl<'a> IndexView<'a> {
    /// Formats a region for `slot_count` slots per table with the home-slot seed 0 (tests
    /// and tools; the pool uses [`Self::init_seeded`]).
    ///
    /// # Safety
    /// As [`Self::init_seeded`].
    pub unsafe fn init(mem: *mut u8, len: usize, slot_count: u64) -> Result<Self, ProtocolError> {
        // SAFETY: same contract.
        unsafe { Self::init_seeded(mem, len, slot_count, [0, 0]) }
    }

    /// Formats a region for `slot_count` slots per table, homing keys with `seed` (draw it
    /// at random: see [`home_slot`]). The region must be zeroed (a fresh memfd is).
    ///
    /// # Safety
    /// `mem` valid for reads and writes of `len` bytes for `'a`; no other user until this
    /// returns.
    pub unsafe fn init_seeded(mem: *mut u8, len: usize, slot_count: u64, seed: [u64; 2]) -> Result<Self, ProtocolError> {
        if !slot_count.is_power_of_two() || !(MIN_SLOTS..=MAX_SLOTS).contains(&slot_count) {
            return Err(ProtocolError::InvalidField { what: "index slot count", value: slot_count });
        }
        check_index_region(mem, len, slot_count)?;
        // SAFETY: aligned, large enough (checked); all fields are atomics.
        let header = unsafe { &*(mem as *const IndexHeader) };
        header.info.slot_count.store(slot_count, Ordering::Relaxed);
        let table_bytes = slot_count * core::mem::size_of::<IndexSlot>() as u64;
        header.info.table_offset[0].store(TABLES_OFFSET as u64, Ordering::Relaxed);
        header.info.table_offset[1].store(TABLES_OFFSET as u64 + table_bytes, Ordering::Relaxed);
        header.info.seed[0].store(seed[0], Ordering::Relaxed);
        header.info.seed[1].store(seed[1], Ordering::Relaxed);
        header.info.version.store(PROTOCOL_VERSION, Ordering::Relaxed);
        header.info.magic.store(MAGIC, Ordering::Release);
        // SAFETY: same contract.
        unsafe { Self::attach(mem as *const u8, len) }
    }

    /// Attaches to a region formatted by [`Self::init`], checking every header field.
    ///
    /// # Safety
    /// `mem` valid for reads of `len` bytes for `'a` (a read-only mapping is fine for
    /// readers; the writer needs a writable one).
    pub unsafe fn attach(mem: *const u8, len: usize) -> Result<Self, ProtocolError> {
        check_index_region(mem, len, 0)?;
        // SAFETY: aligned and at least a header long.
        let header = unsafe { &*(mem as *const IndexHeader) };
        let magic = header.info.magic.load(Ordering::Acquire);
        if magic != MAGIC {
            return Err(ProtocolError::BadMagic { what: "index", found: magic, expected: MAGIC });
        }
        let version = header.info.version.load(Ordering::Relaxed);
        if version != PROTOCOL_VERSION {
            return Err(ProtocolError::VersionMismatch { found: version, expected: PROTOCOL_VERSION });
        }
        let slot_count = header.info.slot_count.load(Ordering::Relaxed);
        if !slot_count.is_power_of_two() || !(MIN_SLOTS..=MAX_SLOTS).contains(&slot_count) {
            return Err(ProtocolError::InvalidField { what: "index slot count", value: slot_count });
        }
        check_index_region(mem, len, slot_count)?;
        let table_bytes = slot_count as usize * core::mem::size_of::<IndexSlot>();
        let mut tables: [&[IndexSlot]; 2] = [&[], &[]];
        for (i, t) in tables.iter_mut().enumerate() {
            let off = header.info.table_offset[i].load(Ordering::Relaxed);
            let in_range = (off as usize)
                .checked_add(table_bytes)
                .is_some_and(|end| end <= len && off as usize >= core::mem::size_of::<IndexHeader>());
            if !in_range || off % 32 != 0 {
                return Err(ProtocolError::InvalidField { what: "index table offset", value: off });
            }
            // SAFETY: [off, off + table_bytes) is inside the region and 32-aligned;
            // IndexSlot is all atomics, valid for any bit pattern.
            *t = unsafe {
                core::slice::from_raw_parts(mem.add(off as usize) as *const IndexSlot, slot_count as usize)
            };
        }
        let seed = [header.info.seed[0].load(Ordering::Relaxed), header.info.seed[1].load(Ordering::Relaxed)];
        Ok(Self { header, tables, mask: slot_count - 1, seed })
    }
}

#[cfg(not(loom))]
fn check_index_region(mem: *const u8, len: usize, slot_count: u64) -> Result<(), ProtocolError> {
    let align = core::mem::align_of::<IndexHeader>();
    if !(mem as usize).is_multiple_of(align) {
        return Err(ProtocolError::Misaligned { align });
    }
    let need = if slot_count == 0 { TABLES_OFFSET } else { region_bytes(slot_count) };
    if len < need {
        return Err(ProtocolError::RegionTooSmall { need, have: len });
    }
    Ok(())
}

/// Heap-backed index storage for loom models.
#[cfg(loom)]
pub struct LoomIndexStorage {
    pub header: IndexHeader,
    tables: [Vec<IndexSlot>; 2],
}

#[cfg(loom)]
impl LoomIndexStorage {
    pub fn new(slot_count: u64) -> Self {
        let z = || AtomicU64::new(0);
        let header = IndexHeader {
            info: CachePadded::new(IndexInfo {
                magic: AtomicU32::new(MAGIC),
                version: AtomicU32::new(PROTOCOL_VERSION),
                slot_count: AtomicU64::new(slot_count),
                table_offset: [z(), z()],
                seed: [z(), z()],
                closed: AtomicU32::new(0),
                reserved: AtomicU32::new(0),
                robust_next: z(),
                owner: AtomicU32::new(0),
            }),
            epoch: CachePadded::new(z()),
            stats: CachePadded::new(IndexStats { live: z(), tombstones: z(), inserts: z(), removes: z(), rebuilds: z() }),
        };
        let table = || {
            (0..slot_count)
                .map(|_| IndexSlot {
                    seq: AtomicU32::new(0),
                    state: AtomicU32::new(0),
                    key: [AtomicU64::new(0), AtomicU64::new(0)],
                    location: AtomicU64::new(0),
                })
                .collect()
        };
        Self { header, tables: [table(), table()] }
    }

    pub fn view(&self) -> IndexView<'_> {
        let n = self.tables[0].len() as u64;
        IndexView { header: &self.header, tables: [&self.tables[0], &self.tables[1]], mask: n - 1, seed: [0, 0] }
    }
}

/// A consistent copy of one slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotCopy {
    pub state: u32,
    pub key: ObjectKey,
    pub location: u64,
}

/// Index statistics at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IndexSnapshot {
    pub slot_count: u64,
    pub epoch: u64,
    pub live: u64,
    pub tombstones: u64,
    pub inserts: u64,
    pub removes: u64,
    pub rebuilds: u64,
}

impl<'a> IndexView<'a> {
    pub fn slot_count(&self) -> u64 {
        self.mask + 1
    }

    pub fn header(&self) -> &'a IndexHeader {
        self.header
    }

    /// Home slot of `key` in this region (its seed and size).
    pub fn home(&self, key: ObjectKey) -> u64 {
        home_slot(key, self.mask, self.seed)
    }

    /// Whether the writer marked the index closed (it shut down): no entry may be trusted.
    /// One Acquire load of a header word the writer stores once, so cheap enough for every
    /// lookup.
    pub fn is_closed(&self) -> bool {
        self.header.info.closed.load(Ordering::Acquire) != 0
    }

    /// Whether the writer is gone: it marked the index closed, or the kernel marked its
    /// death word ([`IndexInfo::owner`]) with [`OWNER_DIED`]. Two loads of one cache line
    /// the writer (or the kernel) stores once, cheap enough for every lookup.
    pub fn writer_gone(&self) -> bool {
        self.is_closed() || self.header.info.owner.load(Ordering::Acquire) & OWNER_DIED != 0
    }

    /// Whether the writer armed its death word (non-zero `owner`).
    pub fn death_word_armed(&self) -> bool {
        self.header.info.owner.load(Ordering::Acquire) != 0
    }

    /// Marks the index closed: readers stop trusting it from their next lookup on. The
    /// writer calls it first thing when it shuts down, before it releases any object the
    /// index names (Release, so a reader that sees the word also sees everything before).
    ///
    /// # Safety
    /// The view's mapping is writable (the writer's own; a reader's read-only mapping
    /// would fault).
    pub unsafe fn mark_closed(&self) {
        self.header.info.closed.store(1, Ordering::Release);
    }

    /// Seqlock read of one slot; None when the writer kept it busy for every retry.
    pub fn read_slot(slot: &IndexSlot) -> Option<SlotCopy> {
        for _ in 0..SLOT_RETRIES {
            let s1 = slot.seq.load(Ordering::Acquire);
            if s1 & 1 == 1 {
                crate::sync::spin_hint();
                continue;
            }
            let state = slot.state.load(Ordering::Relaxed);
            let lo = slot.key[0].load(Ordering::Relaxed);
            let hi = slot.key[1].load(Ordering::Relaxed);
            let location = slot.location.load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            if slot.seq.load(Ordering::Relaxed) == s1 {
                return Some(SlotCopy { state, key: ObjectKey::from_words([lo, hi]), location });
            }
            crate::sync::spin_hint();
        }
        None
    }

    /// Location of `key`, or None (absent, or could not be read consistently in time).
    pub fn lookup(&self, key: ObjectKey) -> Option<u64> {
        for _ in 0..EPOCH_RETRIES {
            let epoch = self.header.epoch.load(Ordering::Acquire);
            let found = self.probe(self.tables[(epoch & 1) as usize], key);
            fence(Ordering::Acquire);
            if self.header.epoch.load(Ordering::Relaxed) == epoch {
                return found;
            }
        }
        None
    }

    fn probe(&self, table: &[IndexSlot], key: ObjectKey) -> Option<u64> {
        let mut i = self.home(key);
        for _ in 0..probe_len(self.mask) {
            let copy = Self::read_slot(&table[i as usize])?;
            match copy.state {
                SLOT_EMPTY => return None,
                SLOT_FULL if copy.key == key => return Some(copy.location),
                _ => {}
            }
            i = (i + 1) & self.mask;
        }
        None
    }

    /// Count of leading keys present; stops at the first miss.
    pub fn match_prefix(&self, keys: &[ObjectKey]) -> usize {
        keys.iter().take_while(|k| self.lookup(**k).is_some()).count()
    }

    pub fn snapshot(&self) -> IndexSnapshot {
        let s = &self.header.stats;
        IndexSnapshot {
            slot_count: self.slot_count(),
            epoch: self.header.epoch.load(Ordering::Acquire),
            live: s.live.load(Ordering::Relaxed),
            tombstones: s.tombstones.load(Ordering::Relaxed),
            inserts: s.inserts.load(Ordering::Relaxed),
            removes: s.removes.load(Ordering::Relaxed),
            rebuilds: s.rebuilds.load(Ordering::Relaxed),
        }
    }

    /// Probe-length histogram of the active table (bucket i = entries found after i
    /// probes, last bucket = that many or more), for ringtool.
    pub fn probe_histogram(&self, buckets: usize) -> Vec<u64> {
        let mut hist = vec![0u64; buckets.max(1)];
        let table = self.tables[(self.header.epoch.load(Ordering::Acquire) & 1) as usize];
        for (i, slot) in table.iter().enumerate() {
            if let Some(c) = Self::read_slot(slot) {
                if c.state == SLOT_FULL {
                    let dist = (i as u64).wrapping_sub(self.home(c.key)) & self.mask;
                    let last = hist.len() - 1;
                    hist[(dist as usize).min(last)] += 1;
                }
            }
        }
        hist
    }
}

/// Outcome of [`IndexWriter::insert`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Insert {
    Inserted,
    /// First writer wins: the key was there, with this location.
    Exists(u64),
}

/// The table is too full even after a rebuild.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("index full: {live} live entries in {slots} slots")]
pub struct IndexFull {
    pub live: u64,
    pub slots: u64,
}

/// Why an insert was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum InsertError {
    #[error(transparent)]
    Full(#[from] IndexFull),
    /// Every slot within [`MAX_PROBE`] of the key's home is taken (keys piled up there).
    #[error("index probe limit: the {limit} slots from home slot {home} are all taken")]
    ProbeLimit { home: u64, limit: u64 },
}

/// The single writer. Lives in the pool; all updates go through one instance.
pub struct IndexWriter<'a> {
    view: IndexView<'a>,
    epoch: u64,
    live: u64,
    tombstones: u64,
}

impl<'a> IndexWriter<'a> {
    /// Takes the writer role over a formatted region (the pool formats it itself, so its
    /// contents are trusted).
    pub fn new(view: IndexView<'a>) -> Self {
        let epoch = view.header.epoch.load(Ordering::Relaxed);
        let live = view.header.stats.live.load(Ordering::Relaxed);
        let tombstones = view.header.stats.tombstones.load(Ordering::Relaxed);
        Self { view, epoch, live, tombstones }
    }

    pub fn view(&self) -> IndexView<'a> {
        self.view
    }

    pub fn len(&self) -> u64 {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    fn active(&self) -> &'a [IndexSlot] {
        self.view.tables[(self.epoch & 1) as usize]
    }

    fn write_slot(slot: &IndexSlot, state: u32, key: ObjectKey, location: u64) {
        let s = slot.seq.load(Ordering::Relaxed);
        slot.seq.store(s.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        let [lo, hi] = key.to_words();
        slot.state.store(state, Ordering::Relaxed);
        slot.key[0].store(lo, Ordering::Relaxed);
        slot.key[1].store(hi, Ordering::Relaxed);
        slot.location.store(location, Ordering::Relaxed);
        slot.seq.store(s.wrapping_add(2), Ordering::Release);
    }

    // The writer is the only one that changes slots, so it reads them without a seqlock.
    fn plain_read(slot: &IndexSlot) -> SlotCopy {
        SlotCopy {
            state: slot.state.load(Ordering::Relaxed),
            key: ObjectKey::from_words([slot.key[0].load(Ordering::Relaxed), slot.key[1].load(Ordering::Relaxed)]),
            location: slot.location.load(Ordering::Relaxed),
        }
    }

    /// Slot of `key` in the active table, and the first reusable slot seen on the way.
    fn find(&self, key: ObjectKey) -> (Option<usize>, Option<usize>) {
        let table = self.active();
        let mask = self.view.mask;
        let mut i = self.view.home(key);
        let mut reusable = None;
        for _ in 0..probe_len(mask) {
            let c = Self::plain_read(&table[i as usize]);
            match c.state {
                SLOT_EMPTY => return (None, reusable.or(Some(i as usize))),
                SLOT_FULL if c.key == key => return (Some(i as usize), None),
                SLOT_TOMBSTONE if reusable.is_none() => reusable = Some(i as usize),
                _ => {}
            }
            i = (i + 1) & mask;
        }
        (None, reusable)
    }

    pub fn get(&self, key: ObjectKey) -> Option<u64> {
        self.find(key).0.map(|i| Self::plain_read(&self.active()[i]).location)
    }

    /// Most live entries the table takes (3/4 of its slots).
    pub fn capacity(&self) -> u64 {
        self.view.slot_count() / 4 * 3
    }

    /// Tombstones in the active table.
    pub fn tombstones(&self) -> u64 {
        self.tombstones
    }

    /// Inserts unless present (first writer wins). Rebuilds first when tombstones or the
    /// load factor call for it. Refused when the table holds [`Self::capacity`] entries, or
    /// when no slot within [`MAX_PROBE`] of the key's home is free (after a rebuild, when
    /// tombstones might be what fills them).
    pub fn insert(&mut self, key: ObjectKey, location: u64) -> Result<Insert, InsertError> {
        if let (Some(i), _) = self.find(key) {
            return Ok(Insert::Exists(Self::plain_read(&self.active()[i]).location));
        }
        let slots = self.view.slot_count();
        if (self.live + 1) * 4 > slots * 3 {
            return Err(IndexFull { live: self.live, slots }.into());
        }
        if (self.live + self.tombstones + 1) * 4 > slots * 3 || self.tombstones * 4 > slots {
            self.rebuild();
        }
        let mut free = self.find(key).1;
        if free.is_none() && self.tombstones > 0 {
            self.rebuild();
            free = self.find(key).1;
        }
        let i = free.ok_or(InsertError::ProbeLimit { home: self.view.home(key), limit: probe_len(self.view.mask) })?;
        let slot = &self.active()[i];
        if slot.state.load(Ordering::Relaxed) == SLOT_TOMBSTONE {
            self.tombstones -= 1;
        }
        Self::write_slot(slot, SLOT_FULL, key, location);
        self.live += 1;
        self.view.header.stats.inserts.fetch_add(1, Ordering::Relaxed);
        self.publish_counts();
        Ok(Insert::Inserted)
    }

    /// Rewrites the location of a present key in place (a tier move: readers see the old
    /// or the new location, never a miss). Returns whether the key was present.
    pub fn set_location(&mut self, key: ObjectKey, location: u64) -> bool {
        let Some(i) = self.find(key).0 else { return false };
        Self::write_slot(&self.active()[i], SLOT_FULL, key, location);
        true
    }

    /// Removes `key`, leaving a tombstone; returns its location.
    pub fn remove(&mut self, key: ObjectKey) -> Option<u64> {
        let i = self.find(key).0?;
        let slot = &self.active()[i];
        let location = Self::plain_read(slot).location;
        Self::write_slot(slot, SLOT_TOMBSTONE, key, 0);
        self.live -= 1;
        self.tombstones += 1;
        self.view.header.stats.removes.fetch_add(1, Ordering::Relaxed);
        self.publish_counts();
        Some(location)
    }

    /// Copies the live entries into the other table and flips the epoch. Readers of the old
    /// table notice the flip and retry.
    ///
    /// Each run of occupied slots is copied in the order of its entries' home slots (the
    /// layout Robin Hood hashing gives), which never places an entry farther from its home
    /// than the farthest one was before: for an entry that lands `d` past its home `h`, the
    /// run in the new table from its start `c` to that entry holds `d + h - c + 1` entries
    /// homed in `c..=h`, which cannot all have fitted before `h + d` in the old table. So
    /// every entry stays within [`MAX_PROBE`] of its home, where readers look.
    pub fn rebuild(&mut self) {
        let target = self.view.tables[((self.epoch + 1) & 1) as usize];
        for slot in target {
            if slot.state.load(Ordering::Relaxed) != SLOT_EMPTY {
                Self::write_slot(slot, SLOT_EMPTY, ObjectKey(0), 0);
            }
        }
        let mask = self.view.mask;
        let active = self.active();
        // At most 3/4 of the slots are ever in use, so there is an empty one; runs start
        // after it and never wrap past it.
        let start = active.iter().position(|s| s.state.load(Ordering::Relaxed) == SLOT_EMPTY).unwrap_or(0) as u64;
        let mut run: Vec<(u64, SlotCopy)> = Vec::new();
        for step in 1..=mask + 1 {
            let c = Self::plain_read(&active[((start + step) & mask) as usize]);
            if c.state == SLOT_FULL {
                run.push(((self.view.home(c.key).wrapping_sub(start)) & mask, c));
            }
            if c.state != SLOT_EMPTY && step <= mask {
                continue;
            }
            run.sort_unstable_by_key(|(off, _)| *off);
            for (off, c) in run.drain(..) {
                let mut i = (start + off) & mask;
                while target[i as usize].state.load(Ordering::Relaxed) != SLOT_EMPTY {
                    i = (i + 1) & mask;
                }
                debug_assert!((i.wrapping_sub(start + off) & mask) < probe_len(mask), "rebuild moved an entry past MAX_PROBE");
                Self::write_slot(&target[i as usize], SLOT_FULL, c.key, c.location);
            }
        }
        self.epoch += 1;
        self.view.header.epoch.store(self.epoch, Ordering::Release);
        self.tombstones = 0;
        self.view.header.stats.rebuilds.fetch_add(1, Ordering::Relaxed);
        self.publish_counts();
    }

    /// Removes everything (vLLM reset_cache of the whole pool) by flipping to an empty table.
    pub fn clear(&mut self) {
        let live: Vec<_> = self.entries().collect();
        for (k, _) in live {
            self.remove(k);
        }
        self.rebuild();
    }

    /// Live entries of the active table.
    pub fn entries(&self) -> impl Iterator<Item = (ObjectKey, u64)> + 'a {
        self.active().iter().filter_map(|s| {
            let c = Self::plain_read(s);
            (c.state == SLOT_FULL).then_some((c.key, c.location))
        })
    }

    fn publish_counts(&self) {
        self.view.header.stats.live.store(self.live, Ordering::Relaxed);
        self.view.header.stats.tombstones.store(self.tombstones, Ordering::Relaxed);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    pub(crate) struct Region(Vec<u128>);

    impl Region {
        fn new(slots: u64) -> Self {
            Self(vec![0u128; region_bytes(slots) / 16 + 8])
        }
        fn ptr(&mut self) -> *mut u8 {
            // Align to 128 inside the buffer.
            let p = self.0.as_mut_ptr() as usize;
            ((p + 127) & !127) as *mut u8
        }
    }

    #[test]
    fn insert_lookup_remove_rebuild() {
        let mut r = Region::new(MIN_SLOTS);
        let p = r.ptr();
        // SAFETY: region outlives the view.
        let view = unsafe { IndexView::init(p, region_bytes(MIN_SLOTS), MIN_SLOTS) }.unwrap();
        let mut w = IndexWriter::new(view);
        for i in 0..500u128 {
            assert_eq!(w.insert(ObjectKey(i * 7919), i as u64), Ok(Insert::Inserted));
        }
        assert_eq!(w.insert(ObjectKey(7919), 99), Ok(Insert::Exists(1)));
        // SAFETY: as above; a second (reader) view of the same region.
        let reader = unsafe { IndexView::attach(p, region_bytes(MIN_SLOTS)) }.unwrap();
        assert_eq!(reader.lookup(ObjectKey(7919 * 3)), Some(3));
        let keys: Vec<_> = (0..10u128).map(|i| ObjectKey(i * 7919)).collect();
        assert_eq!(reader.match_prefix(&keys), 10);
        // A tier move rewrites the location in place: same entry count, no tombstone.
        let (live, tombs) = (w.len(), w.tombstones());
        assert!(w.set_location(ObjectKey(7919 * 2), crate::location::encode(crate::location::Tier::Ssd, 4)));
        assert_eq!(reader.lookup(ObjectKey(7919 * 2)), Some(crate::location::encode(crate::location::Tier::Ssd, 4)));
        assert!(w.set_location(ObjectKey(7919 * 2), 2));
        assert!(!w.set_location(ObjectKey(1), 7), "absent keys are not inserted");
        assert_eq!((w.len(), w.tombstones(), reader.lookup(ObjectKey(1))), (live, tombs, None));
        assert_eq!(w.remove(ObjectKey(7919 * 5)), Some(5));
        assert_eq!(reader.match_prefix(&keys), 5);
        assert_eq!(reader.lookup(ObjectKey(7919 * 5)), None);
        // Churn until a rebuild happens; everything live stays visible.
        for round in 0..2000u128 {
            let k = ObjectKey(1_000_000 + round);
            w.insert(k, 1).unwrap();
            w.remove(k).unwrap();
        }
        let snap = reader.snapshot();
        assert!(snap.rebuilds > 0, "{snap:?}");
        assert_eq!(snap.live, 499);
        assert_eq!(reader.lookup(ObjectKey(7919 * 499)), Some(499));
        w.clear();
        assert_eq!(reader.lookup(ObjectKey(7919 * 499)), None);
        assert_eq!(reader.snapshot().live, 0);
    }

    /// Keys a client picks itself, all a multiple of the table size apart (so the raw low
    /// words agree modulo the table), and sequential runs of them: the home slots still
    /// spread, so no entry sits far from its home (raw words: one run of 300 slots).
    #[test]
    fn strided_and_sequential_keys_spread_over_the_table() {
        let slots = 4 * MIN_SLOTS;
        let mut r = Region::new(slots);
        let p = r.ptr();
        // SAFETY: region outlives the view.
        let view = unsafe { IndexView::init(p, region_bytes(slots), slots) }.unwrap();
        let mut w = IndexWriter::new(view);
        for round in 0..10u128 {
            for i in 0..300u128 {
                let key = (round << 80) | (round * slots as u128 * 1024) | i;
                w.insert(ObjectKey(key), 1).unwrap();
            }
        }
        // SAFETY: as above.
        let reader = unsafe { IndexView::attach(p, region_bytes(slots)) }.unwrap();
        let hist = reader.probe_histogram(32);
        assert_eq!(hist.iter().sum::<u64>(), 3000);
        // 3000 of 4096 slots filled (73 %): linear probing keeps nearly all within a few
        // slots of home; a clustering home function puts thousands at distance >= 31.
        assert!(hist[31] < 30, "far-from-home entries: {hist:?}");
    }

    #[test]
    fn full_table_refuses() {
        let mut r = Region::new(MIN_SLOTS);
        // SAFETY: region outlives the view.
        let view = unsafe { IndexView::init(r.ptr(), region_bytes(MIN_SLOTS), MIN_SLOTS) }.unwrap();
        let mut w = IndexWriter::new(view);
        let mut n = 0;
        while w.insert(ObjectKey(n as u128 + 1), 0).is_ok() {
            n += 1;
        }
        assert_eq!(n, 768);
        assert!(matches!(w.insert(ObjectKey(u128::MAX), 0), Err(InsertError::Full(IndexFull { live: 768, .. }))));
    }

    /// Keys chosen so that protocol v2's unkeyed mix gave them all one home slot (equal
    /// `lo ^ rotl(hi, 32)`): v2 put 600 of them in one run of 600 slots, so every probe
    /// near there walked it. Keyed, they spread like random keys.
    #[test]
    fn keys_colliding_under_the_unkeyed_mix_spread() {
        let slots = 4 * MIN_SLOTS;
        let mut r = Region::new(slots);
        // SAFETY: region outlives the view.
        let view = unsafe { IndexView::init_seeded(r.ptr(), region_bytes(slots), slots, [0x1234, 0x5678]) }.unwrap();
        let mut w = IndexWriter::new(view);
        for i in 0..600u64 {
            let key = ((i as u128) << 64) | (i.rotate_left(32) ^ 0xdead_beef) as u128;
            w.insert(ObjectKey(key), 1).unwrap();
        }
        let hist = view.probe_histogram(32);
        assert_eq!(hist.iter().sum::<u64>(), 600);
        assert!(hist[31] == 0 && hist[0] > 400, "far-from-home entries: {hist:?}");
    }

    /// Keys found (knowing the seed) to share one home slot: the writer takes
    /// MAX_PROBE of them and refuses the rest with ProbeLimit; a key homed elsewhere is
    /// unaffected, and a lookup never probes more than MAX_PROBE slots.
    #[test]
    fn probe_runs_are_bounded_even_for_keys_chosen_with_the_seed() {
        let slots = 4 * MIN_SLOTS;
        let seed = [7, 9];
        let mut r = Region::new(slots);
        // SAFETY: region outlives the view.
        let view = unsafe { IndexView::init_seeded(r.ptr(), region_bytes(slots), slots, seed) }.unwrap();
        let mut w = IndexWriter::new(view);
        let colliding: Vec<ObjectKey> = (1u128..).map(ObjectKey).filter(|k| view.home(*k) == 100).take(800).collect();
        let mut refused = 0;
        for k in &colliding {
            match w.insert(*k, 1) {
                Ok(Insert::Inserted) => {}
                Err(InsertError::ProbeLimit { home: 100, limit: MAX_PROBE }) => refused += 1,
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(refused, 800 - MAX_PROBE as usize);
        assert_eq!(view.lookup(colliding[0]), Some(1));
        assert_eq!(view.lookup(colliding[799]), None);
        let elsewhere = (1u128..).map(ObjectKey).find(|k| view.home(*k) == 2000).unwrap();
        assert_eq!(w.insert(elsewhere, 5), Ok(Insert::Inserted));
        assert_eq!(view.lookup(elsewhere), Some(5));
        // Removing half and churning forces rebuilds; every live one stays within reach.
        for k in colliding.iter().take(MAX_PROBE as usize).step_by(2) {
            w.remove(*k).unwrap();
        }
        for round in 0..3000u128 {
            let k = ObjectKey(1 << 100 | round);
            w.insert(k, 1).unwrap();
            w.remove(k).unwrap();
        }
        assert!(view.snapshot().rebuilds > 0);
        for k in colliding.iter().take(MAX_PROBE as usize).skip(1).step_by(2) {
            assert_eq!(view.lookup(*k), Some(1));
        }
        assert_eq!(view.lookup(elsewhere), Some(5));
        // Room again near slot 100: colliding keys go in up to the bound once more.
        let mut more = 0;
        for k in &colliding[MAX_PROBE as usize..] {
            if w.insert(*k, 1).is_ok() {
                more += 1;
            }
        }
        assert_eq!(more, MAX_PROBE as usize / 2);
    }

    /// Random keys at the pool's loads stay far inside MAX_PROBE (2^20 slots, filled to
    /// one half and then to the 3/4 limit).
    #[test]
    fn random_keys_stay_far_inside_the_probe_limit() {
        let slots = 1u64 << 20;
        let mut r = Region::new(slots);
        // SAFETY: region outlives the view.
        let view = unsafe { IndexView::init_seeded(r.ptr(), region_bytes(slots), slots, [11, 13]) }.unwrap();
        let mut w = IndexWriter::new(view);
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let max_dist = |v: &IndexView<'_>| {
            let hist = v.probe_histogram(MAX_PROBE as usize + 1);
            hist.iter().rposition(|&n| n > 0).unwrap_or(0)
        };
        for (load, bound) in [(slots / 2, 128), (slots / 4 * 3, MAX_PROBE as usize)] {
            while w.len() < load {
                w.insert(ObjectKey(((next() as u128) << 64) | next() as u128), 1).unwrap();
            }
            let d = max_dist(&view);
            eprintln!("load {load}/{slots}: longest displacement {d}");
            assert!(d < bound, "{d}");
        }
    }

    #[test]
    fn the_seed_is_in_the_header_and_changes_homes() {
        let mut a = Region::new(MIN_SLOTS);
        let mut b = Region::new(MIN_SLOTS);
        let len = region_bytes(MIN_SLOTS);
        // SAFETY: regions outlive the views.
        let va = unsafe { IndexView::init_seeded(a.ptr(), len, MIN_SLOTS, [1, 2]) }.unwrap();
        // SAFETY: as above.
        let vb = unsafe { IndexView::init_seeded(b.ptr(), len, MIN_SLOTS, [3, 4]) }.unwrap();
        // SAFETY: as above; a reader attaching later reads the seed from the header.
        let ra = unsafe { IndexView::attach(a.ptr(), len) }.unwrap();
        let same = (0..1000u128).filter(|i| va.home(ObjectKey(*i)) == vb.home(ObjectKey(*i))).count();
        assert!(same < 10, "{same} of 1000 keys kept their home under another seed");
        assert!((0..1000u128).all(|i| ra.home(ObjectKey(i)) == va.home(ObjectKey(i))));
    }

    /// The home mix spreads keys a fixed stride apart and keys that collided under v2's
    /// unkeyed mix (equal `lo ^ rotl(hi, 32)`) like random ones.
    #[test]
    fn home_mix_spreads_structured_keys() {
        let mask = (1u64 << 12) - 1;
        for seed in [[0, 0], [0x1234, 0x5678]] {
            let families: [Box<dyn Fn(u128) -> ObjectKey>; 3] = [
                Box::new(ObjectKey),
                Box::new(|i| ObjectKey(i << 64)),
                // v2 colliders: lo ^ rotl(hi, 32) constant.
                Box::new(|i| { let hi = i as u64; ObjectKey(((hi.rotate_left(32) ^ 0xabc) as u128) | ((hi as u128) << 64)) }),
            ];
            for f in &families {
                let mut used = std::collections::HashSet::new();
                for i in 0..4096u128 {
                    used.insert(home_slot(f(i), mask, seed));
                }
                // 4096 random keys into 4096 slots occupy ~63% of them (1 - 1/e).
                assert!(used.len() > 2300, "{} of 4096 home slots used", used.len());
            }
        }
    }

    #[test]
    fn malformed_index_regions() {
        let mut r = Region::new(MIN_SLOTS);
        let p = r.ptr();
        let len = region_bytes(MIN_SLOTS);
        // SAFETY: the region outlives every view.
        assert!(matches!(unsafe { IndexView::attach(p, len) }, Err(ProtocolError::BadMagic { .. })));
        // SAFETY: the region outlives every view.
        assert!(matches!(unsafe { IndexView::init(p, len, 1000) }, Err(ProtocolError::InvalidField { .. })));
        // SAFETY: the region outlives every view.
        assert!(matches!(unsafe { IndexView::init(p, 100, MIN_SLOTS) }, Err(ProtocolError::RegionTooSmall { .. })));
        // SAFETY: the region outlives every view.
        let view = unsafe { IndexView::init(p, len, MIN_SLOTS) }.unwrap();
        view.header.info.table_offset[1].store(len as u64, Ordering::Relaxed);
        // SAFETY: the region outlives every view.
        assert!(matches!(unsafe { IndexView::attach(p, len) }, Err(ProtocolError::InvalidField { what: "index table offset", .. })));
        view.header.info.slot_count.store(MIN_SLOTS * 4, Ordering::Relaxed);
        // SAFETY: the region outlives every view.
        assert!(matches!(unsafe { IndexView::attach(p, len) }, Err(ProtocolError::RegionTooSmall { .. })));
    }

    #[test]
    fn stuck_writer_is_a_miss_not_a_hang() {
        let mut r = Region::new(MIN_SLOTS);
        // SAFETY: region outlives the view.
        let view = unsafe { IndexView::init(r.ptr(), region_bytes(MIN_SLOTS), MIN_SLOTS) }.unwrap();
        let mut w = IndexWriter::new(view);
        let k = ObjectKey(42);
        w.insert(k, 7).unwrap();
        let i = w.find(k).0.unwrap();
        // A writer stopped between its two seq stores leaves the slot odd forever.
        w.active()[i].seq.fetch_add(1, Ordering::Relaxed);
        assert_eq!(view.lookup(k), None);
        w.active()[i].seq.fetch_add(1, Ordering::Relaxed);
        assert_eq!(view.lookup(k), Some(7));
    }

    #[test]
    fn sizing() {
        assert_eq!(slots_for(64 << 30, 64 << 10), 1 << 21);
        assert_eq!(slots_for(1 << 20, 64 << 10), MIN_SLOTS);
    }
}
