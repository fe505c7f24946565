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

#[cfg(all(test, not(loom)))]
mod tests;
mod writer;

pub use writer::{IndexFull, IndexWriter, Insert, InsertError};

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
    /// The pool's heartbeat: `CLOCK_MONOTONIC` in ns when the pool's service thread last
    /// went round its loop (it stores at least every [`HEARTBEAT_PERIOD_MS`] while a
    /// scheduler is attached, and when one attaches). A reader whose clock is more than its
    /// stall timeout past it treats the pool as stalled (SIGSTOP, swapped out, wedged):
    /// every lookup misses, since a load planned on a hit would be refused. 0 = never beat
    /// (a pool that predates the word): readers do not judge it.
    pub heartbeat_ns: AtomicU64,
}
#[cfg(not(loom))]
crate::assert_layout!(IndexInfo, size = 80, align = 8);

/// Longest gap between two heartbeats of a pool that runs (and has a scheduler attached).
/// Readers' stall timeouts must be well above it ([`MIN_STALL_TIMEOUT_MS`]).
pub const HEARTBEAT_PERIOD_MS: u64 = 10;
/// Shortest stall timeout a reader applies: twenty heartbeat periods, so a pool that is
/// only slow to be scheduled (a loaded machine), or whose service thread slept its longest
/// idle sleep (100 ms, no scheduler attached) right before a scheduler attached, is not
/// taken for a stalled one.
pub const MIN_STALL_TIMEOUT_MS: u64 = 20 * HEARTBEAT_PERIOD_MS;

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
/// Keys of a prefix whose home slots [`IndexView::match_prefix`] loads together before
/// probing them one by one (past a miss, at most this many minus one were loaded for
/// nothing).
pub const PREFETCH_WINDOW: usize = 16;

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
            *t = unsafe { core::slice::from_raw_parts(mem.add(off as usize) as *const IndexSlot, slot_count as usize) };
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
                heartbeat_ns: z(),
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

/// Index statistics at one moment (serde: the pool report's `index` section, where
/// `slot_count` is `slots`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct IndexSnapshot {
    #[serde(rename = "slots")]
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

    /// Stores the writer's heartbeat: `now_ns` is `CLOCK_MONOTONIC` in ns (never 0 on
    /// Linux after boot). Relaxed: the word orders nothing; a reader only compares it with
    /// its own clock, and a late-visible store only makes a running pool look older by the
    /// store's propagation delay (nanoseconds), far below any stall timeout.
    ///
    /// # Safety
    /// As [`Self::mark_closed`]: the view's mapping is writable.
    pub unsafe fn beat(&self, now_ns: u64) {
        self.header.info.heartbeat_ns.store(now_ns, Ordering::Relaxed);
    }

    /// Whether the writer's heartbeat is more than `stall_timeout_ns` older than `now_ns`
    /// (the reader's `CLOCK_MONOTONIC`). False for a writer that never beat (0: it predates
    /// the word) and for a heartbeat ahead of `now_ns` (a clock read before the store).
    /// One Relaxed load of the header line the lookup reads anyway (see [`Self::beat`]).
    pub fn stalled(&self, now_ns: u64, stall_timeout_ns: u64) -> bool {
        let beat = self.header.info.heartbeat_ns.load(Ordering::Relaxed);
        beat != 0 && now_ns.saturating_sub(beat) > stall_timeout_ns
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
    ///
    /// Keys go in windows of [`PREFETCH_WINDOW`]: each window's home slots are touched
    /// first, independent loads the CPU overlaps, so a long prefix in a cold index pays
    /// about one memory latency per window instead of one per key (a 10k-token restore
    /// looks up 625 keys in a table of many MiB).
    pub fn match_prefix(&self, keys: &[ObjectKey]) -> usize {
        let mut found = 0;
        for window in keys.chunks(PREFETCH_WINDOW) {
            self.touch_homes(window);
            let hits = window.iter().take_while(|k| self.lookup(**k).is_some()).count();
            found += hits;
            if hits < window.len() {
                break;
            }
        }
        found
    }

    /// Loads the first word of each key's home slot in the active table and drops it:
    /// only to bring those cache lines in, all at once.
    fn touch_homes(&self, keys: &[ObjectKey]) {
        let table = self.tables[(self.header.epoch.load(Ordering::Relaxed) & 1) as usize];
        let mut sink = 0u32;
        for k in keys {
            sink ^= table[self.home(*k) as usize].seq.load(Ordering::Relaxed);
        }
        core::hint::black_box(sink);
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
