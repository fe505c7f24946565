//! The KV event log: a fixed-size circular log of `{seq, kind, tier, key}` entries in a memfd,
//! written only by the pool and followed by any number of read-only readers (schedulers,
//! ringtool), each with its own cursor. Readers never block the writer and never slow it
//! down; a reader that falls more than one lap behind *detects* that it lost events
//! (overrun) and learns how many.
//!
//! ```text
//!  offset 0            128                256 ... 4096 (entries start on a page)
//! ┌───────────────────┬──────────────────┬─────┬──────────┬──────────┬─────┬────────────┐
//! │ EventLogInfo      │ head (u64)       │ pad │ entry 0  │ entry 1  │ ... │ entry cap-1│
//! │ magic       @0    │ events written   │     │ 32 B     │          │     │            │
//! │ version     @4    │ so far; Release  │     │          │          │     │            │
//! │ tag "EVTL"  @8    │ after each entry │     │          │          │     │            │
//! │ entry_size  @12   │                  │     │          │          │     │            │
//! │ capacity    @16   │                  │     │          │          │     │            │
//! └───────────────────┴──────────────────┴─────┴──────────┴──────────┴─────┴────────────┘
//!  entry (32 B):
//! ┌─────────────────┬───────────┬──────────┬─────────────────┬─────────────────┐
//! │ stamp u64       │ kind u32  │ tier u32 │ key lo u64      │ key hi u64      │
//! └─────────────────┴───────────┴──────────┴─────────────────┴─────────────────┘
//!  stamp of event n: 2n+1 while being written, 2n+2 once complete (0 = never written)
//! ```
//!
//! Event `n` (0-based, the `n`-th event the pool ever wrote) lives in entry
//! `n & (capacity - 1)`. Each entry is a seqlock whose sequence *is* the event number, so
//! a reader can tell "complete copy of event n" from "not written yet" and from "already
//! overwritten by event n + capacity" by the stamp alone:
//!
//! ```text
//!  writer (EventLogWriter::push)                   reader (EventLogReader::read_event(n))
//!  stamp.store(2n+1, Relaxed)                      s1 = stamp.load(Acquire)
//!  fence(Release)                                  s1 <  2n+2 → not written yet
//!  kind, tier, key: atomic stores, Relaxed         s1 >  2n+2 → overwritten (overrun)
//!  stamp.store(2n+2, Release)                      kind, tier, key: atomic loads, Relaxed
//!  head.store(n+1, Release)                        fence(Acquire)
//!                                                  stamp.load(Relaxed) == s1 ? event : overrun
//! ```
//!
//! This is the index's seqlock (Boehm) with a stamp that never repeats (u64, never wraps in
//! practice), so there is no ABA: a reader that copied any data word of event
//! `n + capacity` synchronises through the two fences and sees that event's odd stamp at its
//! re-check. `head` only tells readers how far to look; the stamps are the truth.
//! Readers only load (a `PROT_READ` mapping of a `F_SEAL_FUTURE_WRITE` memfd is enough).

use crossbeam_utils::CachePadded;

use crate::sync::{fence, AtomicU32, AtomicU64, Ordering};
use crate::{ObjectKey, ProtocolError, Tier, MAGIC, PROTOCOL_VERSION};

/// Third header word of an event log region ("EVTL"); tells it apart from a ring memfd
/// (entry size there) and an index memfd (slot count there).
pub const EVENT_LOG_TAG: u32 = u32::from_le_bytes(*b"EVTL");
/// Where entry 0 starts.
pub const EVENT_ENTRIES_OFFSET: usize = 4096;
/// Smallest and largest capacity accepted.
pub const MIN_EVENT_CAPACITY: u32 = 2;
pub const MAX_EVENT_CAPACITY: u32 = 1 << 24;
/// Capacity the pool uses (2 MiB of entries: ~65 k events of history per reader).
pub const DEFAULT_EVENT_CAPACITY: u32 = 1 << 16;

/// What happened to a key.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// The object became visible (its bytes are complete in the pool).
    Stored = 1,
    /// The object left the pool (eviction, namespace reset).
    Removed = 2,
}

impl EventKind {
    pub fn from_u32(v: u32) -> Result<Self, ProtocolError> {
        match v {
            1 => Ok(Self::Stored),
            2 => Ok(Self::Removed),
            _ => Err(ProtocolError::InvalidField { what: "event kind", value: v as u64 }),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stored => "stored",
            Self::Removed => "removed",
        }
    }
}

/// One event as a reader sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    /// Event number (0 = the first event this pool wrote).
    pub seq: u64,
    pub kind: EventKind,
    pub key: ObjectKey,
    /// The tier the object entered (Stored) or left (Removed); a demotion is Removed from
    /// DRAM then Stored on SSD. Logs written before tiers existed read as DRAM.
    pub tier: Tier,
}

/// One entry; all words atomics because other processes read them concurrently.
#[repr(C, align(32))]
pub struct EventEntry {
    pub stamp: AtomicU64,
    pub kind: AtomicU32,
    /// [`Tier`] as u32 (zero, DRAM, in logs written before tiers existed).
    pub tier: AtomicU32,
    pub key: [AtomicU64; 2],
}
#[cfg(not(loom))]
crate::assert_layout!(EventEntry, size = 32, align = 32);

#[repr(C)]
pub struct EventLogInfo {
    pub magic: AtomicU32,
    pub version: AtomicU32,
    pub tag: AtomicU32,
    pub entry_size: AtomicU32,
    pub capacity: AtomicU32,
}

#[repr(C)]
pub struct EventLogHeader {
    pub info: CachePadded<EventLogInfo>,
    /// Events written so far (the next event's number).
    pub head: CachePadded<AtomicU64>,
}
#[cfg(not(loom))]
crate::assert_layout!(EventLogHeader, size = 256, align = 128);

/// Bytes of an event log region with `capacity` entries.
pub const fn region_bytes(capacity: u32) -> usize {
    EVENT_ENTRIES_OFFSET + capacity as usize * 32
}

fn check_capacity(capacity: u32) -> Result<(), ProtocolError> {
    if !capacity.is_power_of_two() || !(MIN_EVENT_CAPACITY..=MAX_EVENT_CAPACITY).contains(&capacity) {
        return Err(ProtocolError::InvalidField { what: "event log capacity", value: capacity as u64 });
    }
    Ok(())
}

/// Checked view of an event log region.
#[derive(Clone, Copy)]
pub struct EventLog<'a> {
    header: &'a EventLogHeader,
    entries: &'a [EventEntry],
}

#[cfg(not(loom))]
impl<'a> EventLog<'a> {
    /// Formats a zeroed region (a fresh memfd) for `capacity` entries.
    ///
    /// # Safety
    /// `mem` valid for reads and writes of `len` bytes for `'a`; no other user until this
    /// returns.
    pub unsafe fn init(mem: *mut u8, len: usize, capacity: u32) -> Result<Self, ProtocolError> {
        check_capacity(capacity)?;
        check_region(mem, len, capacity)?;
        // SAFETY: aligned and large enough (checked); all fields are atomics.
        let header = unsafe { &*(mem as *const EventLogHeader) };
        header.head.store(0, Ordering::Relaxed);
        header.info.capacity.store(capacity, Ordering::Relaxed);
        header.info.entry_size.store(core::mem::size_of::<EventEntry>() as u32, Ordering::Relaxed);
        header.info.tag.store(EVENT_LOG_TAG, Ordering::Relaxed);
        header.info.version.store(PROTOCOL_VERSION, Ordering::Relaxed);
        header.info.magic.store(MAGIC, Ordering::Release);
        // SAFETY: same contract.
        unsafe { Self::attach(mem as *const u8, len) }
    }

    /// Attaches to a region formatted by [`Self::init`] (possibly by another process),
    /// checking every header field against `len`.
    ///
    /// # Safety
    /// `mem` valid for reads of `len` bytes for `'a` (a read-only mapping is enough for
    /// readers; the writer needs a writable one).
    pub unsafe fn attach(mem: *const u8, len: usize) -> Result<Self, ProtocolError> {
        check_region(mem, len, 0)?;
        // SAFETY: aligned and at least a header long.
        let header = unsafe { &*(mem as *const EventLogHeader) };
        let magic = header.info.magic.load(Ordering::Acquire);
        if magic != MAGIC {
            return Err(ProtocolError::BadMagic { what: "event log", found: magic, expected: MAGIC });
        }
        let version = header.info.version.load(Ordering::Relaxed);
        if version != PROTOCOL_VERSION {
            return Err(ProtocolError::VersionMismatch { found: version, expected: PROTOCOL_VERSION });
        }
        let tag = header.info.tag.load(Ordering::Relaxed);
        if tag != EVENT_LOG_TAG {
            return Err(ProtocolError::InvalidField { what: "event log tag", value: tag as u64 });
        }
        let size = header.info.entry_size.load(Ordering::Relaxed);
        if size as usize != core::mem::size_of::<EventEntry>() {
            return Err(ProtocolError::InvalidField { what: "event entry size", value: size as u64 });
        }
        let capacity = header.info.capacity.load(Ordering::Relaxed);
        check_capacity(capacity)?;
        check_region(mem, len, capacity)?;
        // SAFETY: `capacity` entries start at EVENT_ENTRIES_OFFSET inside the region
        // (checked), 32-aligned; all atomics, valid for any bit pattern.
        let entries = unsafe { core::slice::from_raw_parts(mem.add(EVENT_ENTRIES_OFFSET) as *const EventEntry, capacity as usize) };
        Ok(Self { header, entries })
    }
}

#[cfg(not(loom))]
fn check_region(mem: *const u8, len: usize, capacity: u32) -> Result<(), ProtocolError> {
    let align = core::mem::align_of::<EventLogHeader>();
    if !(mem as usize).is_multiple_of(align) {
        return Err(ProtocolError::Misaligned { align });
    }
    let need = if capacity == 0 { EVENT_ENTRIES_OFFSET } else { region_bytes(capacity) };
    if len < need {
        return Err(ProtocolError::RegionTooSmall { need, have: len });
    }
    Ok(())
}

/// Heap-backed event log for loom models.
#[cfg(loom)]
pub struct LoomEventStorage {
    header: EventLogHeader,
    entries: Vec<EventEntry>,
}

#[cfg(loom)]
impl LoomEventStorage {
    pub fn new(capacity: u32) -> Self {
        check_capacity(capacity).expect("loom model capacity");
        let header = EventLogHeader {
            info: CachePadded::new(EventLogInfo {
                magic: AtomicU32::new(MAGIC),
                version: AtomicU32::new(PROTOCOL_VERSION),
                tag: AtomicU32::new(EVENT_LOG_TAG),
                entry_size: AtomicU32::new(32),
                capacity: AtomicU32::new(capacity),
            }),
            head: CachePadded::new(AtomicU64::new(0)),
        };
        let entries = (0..capacity)
            .map(|_| EventEntry {
                stamp: AtomicU64::new(0),
                kind: AtomicU32::new(0),
                tier: AtomicU32::new(0),
                key: [AtomicU64::new(0), AtomicU64::new(0)],
            })
            .collect();
        Self { header, entries }
    }

    pub fn log(&self) -> EventLog<'_> {
        EventLog { header: &self.header, entries: &self.entries }
    }
}

/// Outcome of reading one event number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryRead {
    Event(Event),
    /// Event `n` is not complete yet.
    NotYet,
    /// Event `n` was overwritten by a later lap (the reader fell too far behind).
    Overwritten,
}

/// Header facts at one moment, for tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventLogSnapshot {
    pub capacity: u32,
    /// Events written so far.
    pub head: u64,
}

impl<'a> EventLog<'a> {
    pub fn capacity(&self) -> u32 {
        self.entries.len() as u32
    }

    /// Events written so far.
    pub fn head(&self) -> u64 {
        self.header.head.load(Ordering::Acquire)
    }

    pub fn snapshot(&self) -> EventLogSnapshot {
        EventLogSnapshot { capacity: self.capacity(), head: self.head() }
    }

    /// The raw entries (tools and models; readers use [`Self::read_event`]).
    pub fn entries(&self) -> &'a [EventEntry] {
        self.entries
    }

    fn entry(&self, n: u64) -> &'a EventEntry {
        &self.entries[(n & (self.entries.len() as u64 - 1)) as usize]
    }

    /// Seqlock read of event `n`.
    pub fn read_event(&self, n: u64) -> EntryRead {
        let e = self.entry(n);
        let want = n.wrapping_mul(2).wrapping_add(2);
        let s1 = e.stamp.load(Ordering::Acquire);
        if s1 < want {
            return EntryRead::NotYet;
        }
        if s1 > want {
            return EntryRead::Overwritten;
        }
        let kind = e.kind.load(Ordering::Relaxed);
        let tier = e.tier.load(Ordering::Relaxed);
        let lo = e.key[0].load(Ordering::Relaxed);
        let hi = e.key[1].load(Ordering::Relaxed);
        fence(Ordering::Acquire);
        if e.stamp.load(Ordering::Relaxed) != s1 {
            return EntryRead::Overwritten;
        }
        let tier = u8::try_from(tier).ok().and_then(Tier::from_u8);
        match (EventKind::from_u32(kind), tier) {
            (Ok(kind), Some(tier)) => EntryRead::Event(Event { seq: n, kind, key: ObjectKey::from_words([lo, hi]), tier }),
            // Only a foreign writer could store this; treat the entry as lost.
            _ => EntryRead::Overwritten,
        }
    }
}

/// The single writer (the pool). All events go through one instance.
pub struct EventLogWriter<'a> {
    log: EventLog<'a>,
    next: u64,
}

impl<'a> EventLogWriter<'a> {
    /// Takes the writer role over a region this process formatted.
    pub fn new(log: EventLog<'a>) -> Self {
        let next = log.header.head.load(Ordering::Relaxed);
        Self { log, next }
    }

    pub fn log(&self) -> EventLog<'a> {
        self.log
    }

    /// Events written so far.
    pub fn written(&self) -> u64 {
        self.next
    }

    /// Appends one DRAM-tier event (see [`Self::push_tiered`]).
    pub fn push(&mut self, kind: EventKind, key: ObjectKey) {
        self.push_tiered(kind, key, Tier::Dram)
    }

    /// Appends one event, overwriting the oldest once the log is full. Never blocks.
    pub fn push_tiered(&mut self, kind: EventKind, key: ObjectKey, tier: Tier) {
        let n = self.next;
        let e = self.log.entry(n);
        e.stamp.store(n.wrapping_mul(2).wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        let [lo, hi] = key.to_words();
        e.kind.store(kind as u32, Ordering::Relaxed);
        e.tier.store(tier as u32, Ordering::Relaxed);
        e.key[0].store(lo, Ordering::Relaxed);
        e.key[1].store(hi, Ordering::Relaxed);
        e.stamp.store(n.wrapping_mul(2).wrapping_add(2), Ordering::Release);
        self.next = n + 1;
        self.log.header.head.store(self.next, Ordering::Release);
    }
}

/// What one [`EventLogReader::poll`] found besides events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PollResult {
    /// Events appended to the output.
    pub read: usize,
    /// Events the reader missed because the writer lapped it (overrun).
    pub lost: u64,
}

/// A reader with its own cursor. Any number may follow one log; none affects the writer.
pub struct EventLogReader<'a> {
    log: EventLog<'a>,
    cursor: u64,
    lost: u64,
}

impl<'a> EventLogReader<'a> {
    /// A reader that sees events written from now on.
    pub fn from_now(log: EventLog<'a>) -> Self {
        let cursor = log.head();
        Self { log, cursor, lost: 0 }
    }

    /// A reader that starts with the oldest event still in the log.
    pub fn from_oldest(log: EventLog<'a>) -> Self {
        let cursor = log.head().saturating_sub(log.capacity() as u64);
        Self { log, cursor, lost: 0 }
    }

    /// A reader that resumes at event number `cursor` (e.g. one saved by another reader).
    pub fn at(log: EventLog<'a>, cursor: u64) -> Self {
        Self { log, cursor, lost: 0 }
    }

    /// Number of the next event this reader will return.
    pub fn cursor(&self) -> u64 {
        self.cursor
    }

    /// Events lost to overruns since this reader was created.
    pub fn lost(&self) -> u64 {
        self.lost
    }

    pub fn log(&self) -> EventLog<'a> {
        self.log
    }

    /// Appends up to `max` new events to `out` in order. Never blocks and never waits
    /// for the writer. Overruns skip the cursor forward and are counted in `lost`.
    pub fn poll(&mut self, out: &mut Vec<Event>, max: usize) -> PollResult {
        let mut res = PollResult::default();
        let cap = self.log.capacity() as u64;
        let mut head = self.log.head();
        if head < self.cursor {
            // Only a writer that started over could do this (never the pool); resync.
            self.cursor = head;
        }
        while res.read < max && self.cursor < head {
            if head - self.cursor > cap {
                let skip = head - cap - self.cursor;
                res.lost += skip;
                self.cursor += skip;
                continue;
            }
            match self.log.read_event(self.cursor) {
                EntryRead::Event(e) => {
                    out.push(e);
                    res.read += 1;
                    self.cursor += 1;
                }
                // `head` is published after the entry, so an event below it is complete
                // unless a later lap started on it.
                EntryRead::NotYet => break,
                // The writer started event `cursor + capacity` on this entry, so it has
                // published at least that many: skip the lost one and look again.
                EntryRead::Overwritten => {
                    res.lost += 1;
                    self.cursor += 1;
                    head = self.log.head().max(head);
                }
            }
        }
        self.lost += res.lost;
        res
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    struct Region(Vec<u128>);

    impl Region {
        fn new(capacity: u32) -> Self {
            Self(vec![0u128; region_bytes(capacity) / 16 + 8])
        }
        fn ptr(&mut self) -> *mut u8 {
            let p = self.0.as_mut_ptr() as usize;
            ((p + 127) & !127) as *mut u8
        }
    }

    fn key(n: u64) -> ObjectKey {
        ObjectKey((n as u128) << 64 | (n.wrapping_mul(0x9E37_79B9_7F4A_7C15)) as u128)
    }

    #[test]
    fn writer_and_readers_follow_in_order() {
        let mut r = Region::new(8);
        // SAFETY: the region outlives every view.
        let log = unsafe { EventLog::init(r.ptr(), region_bytes(8), 8) }.unwrap();
        let mut w = EventLogWriter::new(log);
        let mut early = EventLogReader::from_now(log);
        for n in 0..5 {
            w.push(if n % 2 == 0 { EventKind::Stored } else { EventKind::Removed }, key(n));
        }
        let mut late = EventLogReader::from_now(log);
        let mut out = Vec::new();
        assert_eq!(early.poll(&mut out, 100), PollResult { read: 5, lost: 0 });
        assert_eq!(out.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
        assert_eq!(out[1], Event { seq: 1, kind: EventKind::Removed, key: key(1), tier: Tier::Dram });
        out.clear();
        assert_eq!(late.poll(&mut out, 100).read, 0);
        w.push(EventKind::Stored, key(5));
        assert_eq!(late.poll(&mut out, 100).read, 1);
        assert_eq!(out[0].key, key(5));
        // Batches honour `max`.
        out.clear();
        assert_eq!(EventLogReader::from_oldest(log).poll(&mut out, 3).read, 3);
        assert_eq!(out[0].seq, 0);
    }

    #[test]
    fn overrun_is_detected_and_counted() {
        let mut r = Region::new(4);
        // SAFETY: the region outlives every view.
        let log = unsafe { EventLog::init(r.ptr(), region_bytes(4), 4) }.unwrap();
        let mut w = EventLogWriter::new(log);
        let mut reader = EventLogReader::from_now(log);
        for n in 0..11 {
            w.push(EventKind::Stored, key(n));
        }
        let mut out = Vec::new();
        let res = reader.poll(&mut out, 100);
        assert_eq!(res, PollResult { read: 4, lost: 7 });
        assert_eq!(out.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![7, 8, 9, 10]);
        assert!(out.iter().all(|e| e.key == key(e.seq)));
        assert_eq!(reader.lost(), 7);
        assert_eq!(log.read_event(2), EntryRead::Overwritten);
        assert_eq!(log.read_event(11), EntryRead::NotYet);
    }

    #[test]
    fn malformed_regions_are_typed_errors() {
        let mut r = Region::new(16);
        let p = r.ptr();
        let len = region_bytes(16);
        // SAFETY: `p` points into `r`, which outlives every view made here.
        let attach = |len| unsafe { EventLog::attach(p, len) };
        // SAFETY: as above; nothing else uses the region during init.
        let init = |len, cap| unsafe { EventLog::init(p, len, cap) };
        assert!(matches!(attach(len), Err(ProtocolError::BadMagic { .. })));
        assert!(matches!(init(len, 12), Err(ProtocolError::InvalidField { .. })));
        assert!(matches!(init(100, 16), Err(ProtocolError::RegionTooSmall { .. })));
        let log = init(len, 16).unwrap();
        log.header.info.capacity.store(1 << 20, Ordering::Relaxed);
        assert!(matches!(attach(len), Err(ProtocolError::RegionTooSmall { .. })));
        log.header.info.capacity.store(16, Ordering::Relaxed);
        log.header.info.tag.store(64, Ordering::Relaxed);
        assert!(matches!(attach(len), Err(ProtocolError::InvalidField { what: "event log tag", .. })));
        log.header.info.tag.store(EVENT_LOG_TAG, Ordering::Relaxed);
        // A garbage kind is never returned as an event.
        let log = attach(len).unwrap();
        let mut w = EventLogWriter::new(log);
        w.push(EventKind::Stored, key(0));
        log.entries[0].kind.store(99, Ordering::Relaxed);
        assert_eq!(log.read_event(0), EntryRead::Overwritten);
    }
}
