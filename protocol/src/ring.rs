//! Single-producer single-consumer ring over shared memory (docs/protocol.md §1 "SPSC ring").
//!
//! ```text
//!  header (4 cache lines)                          entries
//! ┌──────────────┬──────────────┬──────────────┬──────────────┬────┬────┬────┬─────┐
//! │ info (magic, │ tail         │ head         │ need_wakeup  │ e0 │ e1 │ .. │ eN-1│
//! │ version, size│ producer     │ consumer     │ consumer sets│    │    │    │     │
//! │ capacity)    │ writes       │ writes       │ before sleep │    │    │    │     │
//! └──────────────┴──────────────┴──────────────┴──────────────┴────┴────┴────┴─────┘
//! ```
//! `head` and `tail` are free-running u32 counters; slot = counter & (capacity - 1).
//! Each side keeps its own counter privately and only *publishes* it (one Release store
//! per batch); it never re-reads its own word from shared memory, which a faulty peer may
//! have overwritten. The other side's word is read with Acquire, cached, and validated:
//! `tail - head` must never exceed the capacity.
//!
//! Wakeups (no lost wakeup): the consumer sets `need_wakeup` with an RMW, then re-reads
//! `tail` with an RMW, and sleeps only if the ring is still empty; the producer publishes
//! `tail` with an RMW, then reads `need_wakeup` with an RMW. RMWs read the latest value in
//! each word's modification order, so one of the two sides must see the other's write.

#[cfg(not(loom))]
use core::marker::PhantomData;

use bytemuck::Pod;
use crossbeam_utils::CachePadded;

use crate::sync::{AtomicU32, Ordering};
use crate::{ProtocolError, MAGIC, PROTOCOL_VERSION};

/// Immutable ring description, written once by the creator.
#[repr(C)]
pub struct RingInfo {
    pub magic: AtomicU32,
    pub version: AtomicU32,
    pub entry_size: AtomicU32,
    pub capacity: AtomicU32,
}

/// Shared ring header. Each word on its own cache line so producer and consumer never
/// false-share.
#[repr(C)]
pub struct RingHeader {
    pub info: CachePadded<RingInfo>,
    /// Producer's publish counter.
    pub tail: CachePadded<AtomicU32>,
    /// Consumer's release counter.
    pub head: CachePadded<AtomicU32>,
    /// Non-zero while the consumer is (about to be) asleep and wants a wake.
    pub need_wakeup: CachePadded<AtomicU32>,
}
#[cfg(not(loom))]
crate::assert_layout!(RingHeader, size = 512, align = 128);

/// Bytes of a ring with `capacity` entries of `T`, header included.
pub const fn ring_bytes<T>(capacity: u32) -> usize {
    core::mem::size_of::<RingHeader>() + capacity as usize * core::mem::size_of::<T>()
}

/// Largest ring capacity accepted from a peer.
pub const MAX_RING_CAPACITY: u32 = 1 << 20;

/// A checked view of a ring: header plus entry storage.
pub struct Ring<'a, T> {
    header: &'a RingHeader,
    entries: Entries<'a, T>,
    capacity: u32,
}

// In real builds entries are raw shared memory. Under loom they are loom cells so the
// model also checks that no entry is read before it is published.
#[cfg(not(loom))]
struct Entries<'a, T> {
    base: *mut T,
    _life: PhantomData<&'a T>,
}

#[cfg(loom)]
struct Entries<'a, T> {
    cells: &'a [loom::cell::UnsafeCell<T>],
}

// SAFETY: entries are only accessed through the SPSC protocol: the producer writes slots
// the consumer has released, the consumer reads slots the producer has published.
unsafe impl<T: Send> Send for Ring<'_, T> {}
// SAFETY: as above; each handle is used by one side only.
unsafe impl<T: Send> Sync for Ring<'_, T> {}

fn check_info(info: &RingInfo, entry_size: usize) -> Result<u32, ProtocolError> {
    let magic = info.magic.load(Ordering::Acquire);
    if magic != MAGIC {
        return Err(ProtocolError::BadMagic { what: "ring", found: magic, expected: MAGIC });
    }
    let version = info.version.load(Ordering::Relaxed);
    if version != PROTOCOL_VERSION {
        return Err(ProtocolError::VersionMismatch { found: version, expected: PROTOCOL_VERSION });
    }
    let size = info.entry_size.load(Ordering::Relaxed);
    if size as usize != entry_size {
        return Err(ProtocolError::InvalidField { what: "ring entry size", value: size as u64 });
    }
    let capacity = info.capacity.load(Ordering::Relaxed);
    if capacity == 0 || !capacity.is_power_of_two() || capacity > MAX_RING_CAPACITY {
        return Err(ProtocolError::InvalidField { what: "ring capacity", value: capacity as u64 });
    }
    Ok(capacity)
}

#[cfg(not(loom))]
impl<'a, T: Pod> Ring<'a, T> {
    /// Writes a fresh header for `capacity` entries at `mem` and returns the ring.
    ///
    /// # Safety
    /// `mem` must be valid for reads and writes of `len` bytes for `'a`, and nobody else
    /// may use the ring until this returns.
    pub unsafe fn init(mem: *mut u8, len: usize, capacity: u32) -> Result<Self, ProtocolError> {
        if capacity == 0 || !capacity.is_power_of_two() || capacity > MAX_RING_CAPACITY {
            return Err(ProtocolError::InvalidField { what: "ring capacity", value: capacity as u64 });
        }
        check_region::<T>(mem, len, capacity)?;
        // SAFETY: aligned and large enough (checked above); the caller grants exclusive
        // access during init, and all words are atomics so any bit pattern is valid.
        let header = unsafe { &*(mem as *const RingHeader) };
        header.tail.store(0, Ordering::Relaxed);
        header.head.store(0, Ordering::Relaxed);
        header.need_wakeup.store(0, Ordering::Relaxed);
        header.info.entry_size.store(core::mem::size_of::<T>() as u32, Ordering::Relaxed);
        header.info.capacity.store(capacity, Ordering::Relaxed);
        header.info.version.store(PROTOCOL_VERSION, Ordering::Relaxed);
        header.info.magic.store(MAGIC, Ordering::Release);
        // SAFETY: same contract as ours.
        unsafe { Self::attach(mem, len) }
    }

    /// Attaches to a ring some other process initialised; every header field is checked.
    ///
    /// # Safety
    /// `mem` must be valid for reads and writes of `len` bytes for `'a` (a shared mapping).
    pub unsafe fn attach(mem: *mut u8, len: usize) -> Result<Self, ProtocolError> {
        check_region::<T>(mem, len, 0)?;
        // SAFETY: aligned and at least a header long (checked above); all atomics.
        let header = unsafe { &*(mem as *const RingHeader) };
        let capacity = check_info(&header.info, core::mem::size_of::<T>())?;
        check_region::<T>(mem, len, capacity)?;
        // SAFETY: the header is followed by `capacity` entries inside `len` (checked).
        let base = unsafe { mem.add(core::mem::size_of::<RingHeader>()) } as *mut T;
        Ok(Self { header, entries: Entries { base, _life: PhantomData }, capacity })
    }

    fn read_entry(&self, index: u32) -> T {
        let slot = (index & (self.capacity - 1)) as usize;
        // SAFETY: slot < capacity, inside the region; T is Pod so any bytes are a valid T,
        // and the SPSC protocol gives this side the slot. Volatile because the peer may
        // still write shared memory it should not: we take one copy and use only that.
        unsafe { self.entries.base.add(slot).read_volatile() }
    }

    fn write_entry(&self, index: u32, value: T) {
        let slot = (index & (self.capacity - 1)) as usize;
        // SAFETY: slot < capacity, inside the region; the producer owns unpublished slots.
        unsafe { self.entries.base.add(slot).write_volatile(value) }
    }
}

#[cfg(not(loom))]
fn check_region<T>(mem: *mut u8, len: usize, capacity: u32) -> Result<(), ProtocolError> {
    let align = core::mem::align_of::<RingHeader>().max(core::mem::align_of::<T>());
    if !(mem as usize).is_multiple_of(align) {
        return Err(ProtocolError::Misaligned { align });
    }
    let need = ring_bytes::<T>(capacity);
    if len < need {
        return Err(ProtocolError::RegionTooSmall { need, have: len });
    }
    Ok(())
}

#[cfg(loom)]
impl<'a, T: Pod> Ring<'a, T> {
    /// Loom model constructor over heap storage initialised by [`LoomRingStorage`].
    pub fn from_loom(storage: &'a LoomRingStorage<T>) -> Result<Self, ProtocolError> {
        let capacity = check_info(&storage.header.info, core::mem::size_of::<T>())?;
        Ok(Self { header: &storage.header, entries: Entries { cells: &storage.cells }, capacity })
    }

    fn read_entry(&self, index: u32) -> T {
        let slot = (index & (self.capacity - 1)) as usize;
        // SAFETY: loom checks that this read does not race with a write.
        self.entries.cells[slot].with(|p| unsafe { *p })
    }

    fn write_entry(&self, index: u32, value: T) {
        let slot = (index & (self.capacity - 1)) as usize;
        // SAFETY: loom checks that this write does not race with a read.
        self.entries.cells[slot].with_mut(|p| unsafe { *p = value })
    }
}

/// Heap-backed ring storage for loom models.
#[cfg(loom)]
pub struct LoomRingStorage<T> {
    pub header: RingHeader,
    cells: Vec<loom::cell::UnsafeCell<T>>,
}

#[cfg(loom)]
impl<T: Pod> LoomRingStorage<T> {
    pub fn new(capacity: u32) -> Self {
        let header = RingHeader {
            info: CachePadded::new(RingInfo {
                magic: AtomicU32::new(MAGIC),
                version: AtomicU32::new(PROTOCOL_VERSION),
                entry_size: AtomicU32::new(core::mem::size_of::<T>() as u32),
                capacity: AtomicU32::new(capacity),
            }),
            tail: CachePadded::new(AtomicU32::new(0)),
            head: CachePadded::new(AtomicU32::new(0)),
            need_wakeup: CachePadded::new(AtomicU32::new(0)),
        };
        let cells = (0..capacity).map(|_| loom::cell::UnsafeCell::new(T::zeroed())).collect();
        Self { header, cells }
    }
}

impl<'a, T: Pod> Ring<'a, T> {
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    pub fn header(&self) -> &'a RingHeader {
        self.header
    }

    /// Producer handle. Exactly one may exist per ring across all processes.
    pub fn producer(self) -> Producer<'a, T> {
        let tail = self.header.tail.load(Ordering::Relaxed);
        let head = self.header.head.load(Ordering::Acquire);
        // As in `consumer`: an implausible head (the counters already say more than
        // `capacity` entries are outstanding) is not cached. Caching it as "full" makes the
        // first push re-read the head and report `CorruptRing`, and `in_flight` stays within
        // the capacity (fuzz/ring found a producer reporting 255 outstanding in a ring of 1).
        let cached_head = if tail.wrapping_sub(head) > self.capacity { tail.wrapping_sub(self.capacity) } else { head };
        Producer { ring: self, tail, cached_head }
    }

    /// Consumer handle. Exactly one may exist per ring across all processes.
    pub fn consumer(self) -> Consumer<'a, T> {
        let head = self.header.head.load(Ordering::Relaxed);
        let tail = self.header.tail.load(Ordering::Acquire);
        // Cache the tail only if it is plausible. A corrupt one (more than `capacity` ahead
        // of the head) is not cached, so the first `available()` re-reads and reports it
        // instead of handing out `tail - head` garbage entries.
        let cached_tail = if tail.wrapping_sub(head) > self.capacity { head } else { tail };
        Consumer { ring: self, head, cached_tail }
    }

    /// A snapshot of the shared counters, for tools. Values come from a live peer and may
    /// be inconsistent with each other.
    pub fn snapshot(&self) -> RingSnapshot {
        RingSnapshot {
            capacity: self.capacity,
            head: self.header.head.load(Ordering::Acquire),
            tail: self.header.tail.load(Ordering::Acquire),
            need_wakeup: self.header.need_wakeup.load(Ordering::Acquire) != 0,
        }
    }
}

/// Shared counters of a ring at one moment (for ringtool and metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingSnapshot {
    pub capacity: u32,
    pub head: u32,
    pub tail: u32,
    pub need_wakeup: bool,
}

impl RingSnapshot {
    pub fn len(&self) -> u32 {
        self.tail.wrapping_sub(self.head)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Producing side: writes entries, then publishes them in one store.
pub struct Producer<'a, T> {
    ring: Ring<'a, T>,
    /// Next index to write (private; published on `publish`).
    tail: u32,
    cached_head: u32,
}

impl<'a, T: Pod> Producer<'a, T> {
    /// Free slots, refreshing the consumer's head only when the cached one says full.
    fn free(&mut self) -> Result<u32, ProtocolError> {
        let mut used = self.tail.wrapping_sub(self.cached_head);
        if used >= self.ring.capacity {
            let head = self.ring.header.head.load(Ordering::Acquire);
            used = self.tail.wrapping_sub(head);
            if used > self.ring.capacity {
                // Not cached: like the consumer's tail, an implausible head never becomes
                // this side's view (fuzz/ring: `in_flight` reported it).
                return Err(ProtocolError::CorruptRing { head, tail: self.tail, capacity: self.ring.capacity });
            }
            self.cached_head = head;
        }
        Ok(self.ring.capacity - used)
    }

    /// Writes one entry without publishing it. `Ok(false)` when the ring is full.
    pub fn try_push(&mut self, value: T) -> Result<bool, ProtocolError> {
        if self.free()? == 0 {
            return Ok(false);
        }
        self.ring.write_entry(self.tail, value);
        self.tail = self.tail.wrapping_add(1);
        Ok(true)
    }

    /// Writes as many of `values` as fit and publishes them; returns how many went in.
    /// The bool is true when the consumer asked to be woken.
    pub fn push_batch(&mut self, values: &[T]) -> Result<(usize, bool), ProtocolError> {
        let mut n = 0;
        for v in values {
            if !self.try_push(*v)? {
                break;
            }
            n += 1;
        }
        let wake = if n > 0 { self.publish() } else { false };
        Ok((n, wake))
    }

    /// Makes every written entry visible. Returns true when the consumer is asleep (or
    /// about to be) and must be woken by the caller (futex or doorbell).
    pub fn publish(&mut self) -> bool {
        // RMW on both words: see the module comment on lost wakeups.
        self.ring.header.tail.swap(self.tail, Ordering::AcqRel);
        self.ring.header.need_wakeup.fetch_add(0, Ordering::AcqRel) != 0
    }

    /// Entries written but not yet consumed (as far as the cached head knows).
    pub fn in_flight(&self) -> u32 {
        self.tail.wrapping_sub(self.cached_head)
    }

    /// The published tail word: the futex consumers sleep on.
    pub fn tail_word(&self) -> &'a AtomicU32 {
        &self.ring.header.tail
    }

    pub fn ring(&self) -> &Ring<'a, T> {
        &self.ring
    }

    #[cfg(not(loom))]
    /// Publishes and wakes a consumer sleeping on the tail futex.
    pub fn publish_and_wake(&mut self) {
        if self.publish() {
            crate::futex::wake(&self.ring.header.tail, 1);
        }
    }
}

/// Consuming side: reads entries, then releases their slots in one store.
pub struct Consumer<'a, T> {
    ring: Ring<'a, T>,
    /// Next index to read (private; published on `release`).
    head: u32,
    cached_tail: u32,
}

impl<'a, T: Pod> Consumer<'a, T> {
    /// Entries available, refreshing the producer's tail only when the cache says empty.
    pub fn available(&mut self) -> Result<u32, ProtocolError> {
        if self.cached_tail == self.head {
            self.refresh_tail(self.ring.header.tail.load(Ordering::Acquire))?;
        }
        Ok(self.cached_tail.wrapping_sub(self.head))
    }

    fn refresh_tail(&mut self, tail: u32) -> Result<(), ProtocolError> {
        if tail.wrapping_sub(self.head) > self.ring.capacity {
            return Err(ProtocolError::CorruptRing { head: self.head, tail, capacity: self.ring.capacity });
        }
        self.cached_tail = tail;
        Ok(())
    }

    /// Takes one entry (a private copy) without releasing its slot.
    pub fn try_pop(&mut self) -> Result<Option<T>, ProtocolError> {
        if self.available()? == 0 {
            return Ok(None);
        }
        let v = self.ring.read_entry(self.head);
        self.head = self.head.wrapping_add(1);
        Ok(Some(v))
    }

    /// Returns consumed slots to the producer.
    pub fn release(&mut self) {
        self.ring.header.head.store(self.head, Ordering::Release);
    }

    /// Pops up to `max` entries into `out` and releases them; returns how many.
    pub fn pop_batch(&mut self, out: &mut Vec<T>, max: usize) -> Result<usize, ProtocolError> {
        let mut n = 0;
        while n < max {
            match self.try_pop()? {
                Some(v) => {
                    out.push(v);
                    n += 1;
                }
                None => break,
            }
        }
        if n > 0 {
            self.release();
        }
        Ok(n)
    }

    /// First half of going to sleep: releases consumed slots, announces `need_wakeup` and
    /// re-checks the tail. Returns Ok(true) when the ring is still empty and the caller may
    /// sleep (futex on [`Self::tail_word`] with [`Self::sleep_value`], or its doorbell);
    /// Ok(false) when entries arrived meanwhile.
    pub fn prepare_sleep(&mut self) -> Result<bool, ProtocolError> {
        self.release();
        self.ring.header.need_wakeup.swap(1, Ordering::AcqRel);
        let tail = self.ring.header.tail.fetch_add(0, Ordering::AcqRel);
        self.refresh_tail(tail)?;
        if tail != self.head {
            self.ring.header.need_wakeup.store(0, Ordering::Relaxed);
            return Ok(false);
        }
        Ok(true)
    }

    /// Second half: the consumer is awake again and polling.
    pub fn finish_sleep(&mut self) {
        self.ring.header.need_wakeup.store(0, Ordering::Relaxed);
    }

    /// The tail value that means "still empty" for a futex wait.
    pub fn sleep_value(&self) -> u32 {
        self.head
    }

    pub fn tail_word(&self) -> &'a AtomicU32 {
        &self.ring.header.tail
    }

    pub fn ring(&self) -> &Ring<'a, T> {
        &self.ring
    }

    /// Adaptive wait: spins `spins` times, then sleeps on the tail futex until entries
    /// arrive or `timeout` passes. Returns Ok(true) when entries are available.
    #[cfg(not(loom))]
    pub fn wait(&mut self, spins: u32, timeout: Option<std::time::Duration>) -> Result<bool, ProtocolError> {
        for _ in 0..spins {
            if self.available()? > 0 {
                return Ok(true);
            }
            crate::sync::spin_hint();
        }
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        loop {
            if self.available()? > 0 {
                return Ok(true);
            }
            if self.prepare_sleep()? {
                let left = match deadline {
                    Some(d) => {
                        let now = std::time::Instant::now();
                        if now >= d {
                            self.finish_sleep();
                            return Ok(false);
                        }
                        Some(d - now)
                    }
                    None => None,
                };
                crate::futex::wait(&self.ring.header.tail, self.head, left);
                self.finish_sleep();
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[repr(C, align(128))]
    struct Aligned([u8; 4096]);

    fn region() -> Box<Aligned> {
        Box::new(Aligned([0; 4096]))
    }

    #[test]
    fn push_pop_in_order_with_wraparound() {
        let mut mem = region();
        let p = mem.0.as_mut_ptr();
        // SAFETY: the buffer outlives the handles and is only used through them.
        let mut prod = unsafe { Ring::<u64>::init(p, 4096, 8) }.unwrap().producer();
        // SAFETY: as above.
        let mut cons = unsafe { Ring::<u64>::attach(p, 4096) }.unwrap().consumer();
        let mut next = 0u64;
        let mut expect = 0u64;
        let mut out = vec![];
        for round in 0..100 {
            let batch: Vec<u64> = (0..(round % 9))
                .map(|_| {
                    next += 1;
                    next
                })
                .collect();
            let (n, _) = prod.push_batch(&batch).unwrap();
            next -= (batch.len() - n) as u64;
            out.clear();
            cons.pop_batch(&mut out, 5).unwrap();
            for v in &out {
                expect += 1;
                assert_eq!(*v, expect);
            }
        }
    }

    #[test]
    fn full_ring_refuses() {
        let mut mem = region();
        // SAFETY: buffer outlives the handle.
        let mut prod = unsafe { Ring::<u64>::init(mem.0.as_mut_ptr(), 4096, 4) }.unwrap().producer();
        for i in 0..4 {
            assert!(prod.try_push(i).unwrap());
        }
        assert!(!prod.try_push(9).unwrap());
    }

    #[test]
    fn malformed_regions_are_typed_errors() {
        let mut mem = region();
        let p = mem.0.as_mut_ptr();
        // SAFETY: the buffer outlives every handle.
        assert!(matches!(unsafe { Ring::<u64>::attach(p, 4096) }, Err(ProtocolError::BadMagic { .. })));
        // SAFETY: the buffer outlives every handle.
        assert!(matches!(unsafe { Ring::<u64>::init(p, 100, 4) }, Err(ProtocolError::RegionTooSmall { .. })));
        // SAFETY: the buffer outlives every handle.
        assert!(matches!(unsafe { Ring::<u64>::init(p, 4096, 3) }, Err(ProtocolError::InvalidField { .. })));
        // SAFETY: the buffer outlives every handle.
        assert!(matches!(unsafe { Ring::<u64>::init(p.wrapping_add(8), 4000, 4) }, Err(ProtocolError::Misaligned { .. })));
        // SAFETY: the buffer outlives every handle.
        unsafe { Ring::<u64>::init(p, 4096, 8) }.unwrap();
        // SAFETY: the buffer outlives every handle.
        assert!(matches!(unsafe { Ring::<u32>::attach(p, 4096) }, Err(ProtocolError::InvalidField { what: "ring entry size", .. })));
        // A capacity that does not fit the region.
        // SAFETY: the buffer outlives every handle.
        let h = unsafe { &*(p as *const RingHeader) };
        h.info.capacity.store(1 << 12, Ordering::Relaxed);
        // SAFETY: the buffer outlives every handle.
        assert!(matches!(unsafe { Ring::<u64>::attach(p, 4096) }, Err(ProtocolError::RegionTooSmall { .. })));
        h.info.capacity.store(8, Ordering::Relaxed);
        h.info.version.store(99, Ordering::Relaxed);
        // SAFETY: the buffer outlives every handle.
        assert!(matches!(unsafe { Ring::<u64>::attach(p, 4096) }, Err(ProtocolError::VersionMismatch { found: 99, .. })));
    }

    #[test]
    fn corrupted_counters_are_detected() {
        let mut mem = region();
        let p = mem.0.as_mut_ptr();
        // SAFETY: the buffer outlives every handle.
        let ring = unsafe { Ring::<u64>::init(p, 4096, 8) }.unwrap();
        let header = ring.header();
        let mut cons = ring.consumer();
        // Producer claims more entries than the ring holds.
        header.tail.store(100, Ordering::Release);
        assert!(matches!(cons.try_pop(), Err(ProtocolError::CorruptRing { tail: 100, .. })));
        // Consumer claims to have consumed entries never produced.
        header.tail.store(0, Ordering::Release);
        // SAFETY: as above.
        let mut prod = unsafe { Ring::<u64>::attach(p, 4096) }.unwrap().producer();
        for i in 0..8 {
            assert!(prod.try_push(i).unwrap());
        }
        header.head.store(u32::MAX - 5, Ordering::Release);
        assert!(matches!(prod.try_push(1), Err(ProtocolError::CorruptRing { .. })));
    }

    #[test]
    fn producer_over_a_corrupt_header_reports_it() {
        // Regression (fuzz/ring): a producer created while the tail word says 255 entries
        // are outstanding in a ring of 1 claimed 255 in flight; now it claims at most the
        // capacity and its first push reports the corruption.
        let mut mem = region();
        let p = mem.0.as_mut_ptr();
        // SAFETY: the buffer outlives every handle.
        let ring = unsafe { Ring::<u64>::init(p, 4096, 1) }.unwrap();
        ring.header().tail.fetch_add(255, Ordering::Release);
        // SAFETY: as above.
        let mut prod = unsafe { Ring::<u64>::attach(p, 4096) }.unwrap().producer();
        assert!(prod.in_flight() <= 1);
        assert!(matches!(prod.try_push(7), Err(ProtocolError::CorruptRing { tail: 255, .. })));
        // ...and a failed refresh does not cache the implausible head either.
        assert!(prod.in_flight() <= 1, "{}", prod.in_flight());
        assert!(prod.try_push(7).is_err());
    }

    #[test]
    fn sleeping_consumer_is_woken() {
        let mut mem = region();
        let addr = mem.0.as_mut_ptr() as usize;
        // SAFETY: the buffer outlives both threads (joined below).
        let mut prod = unsafe { Ring::<u64>::init(addr as *mut u8, 4096, 8) }.unwrap().producer();
        let t = std::thread::spawn(move || {
            // SAFETY: as above.
            let mut cons = unsafe { Ring::<u64>::attach(addr as *mut u8, 4096) }.unwrap().consumer();
            let mut got = vec![];
            while got.len() < 1000 {
                assert!(cons.wait(10, Some(std::time::Duration::from_secs(10))).unwrap());
                cons.pop_batch(&mut got, 64).unwrap();
            }
            got
        });
        let mut sent = 0u64;
        while sent < 1000 {
            if prod.try_push(sent).unwrap() {
                sent += 1;
                if sent.is_multiple_of(3) {
                    prod.publish_and_wake();
                    std::thread::sleep(std::time::Duration::from_micros(50));
                }
            } else {
                prod.publish_and_wake();
                std::thread::yield_now();
            }
        }
        prod.publish_and_wake();
        let got = t.join().unwrap();
        assert_eq!(got, (0..1000).collect::<Vec<_>>());
        drop(mem);
    }
}
