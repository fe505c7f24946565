//! Stream-ordered fence words (docs/gpu.md, "Stream-ordered transfers"): ordering between a worker's compute stream and
//! the pool's copies without a CPU wait on the worker's hot path.
//!
//! A fence word is a `u64` in host memory that both processes map: a small sealed memfd
//! the worker creates and registers as [`crate::MemoryKind::HostMemfd`] memory, with one
//! 8-byte *slot* per fenced transfer. Both sides register their mapping with the GPU
//! driver (device-mapped), so streams of either process can write or wait on it.
//!
//! - **Store** (worker -> pool): the worker submits the store with
//!   `Sqe::fence_value = v` and `Sqe::fence_ref = encode_ref(fence_alloc, slot)`, then
//!   enqueues `cuStreamWriteValue64(slot, v)` on its compute stream after the forward pass.
//!   The pool's copy streams `cuStreamWaitValue64(slot >= v)` before their device-to-host
//!   copies, so the copies start the moment the KV is final; no CPU waits for the GPU.
//! - **Load** (pool -> worker): the pool writes `v` into the slot once the copies into
//!   the worker's memory are done (from its copy stream, and again from the CPU after it
//!   synchronized; also when the load failed or was refused, the completion says which);
//!   the worker enqueues `cuStreamWaitValue64(slot >= v)` before the kernels that read
//!   the KV.
//!
//! Comparisons are cyclic, as the driver's `GEQ` is: `(word - v) as i64 >= 0`. Values are
//! transfer ids (small, growing), so a slot reused by a later transfer never passes early,
//! and CPU writes only ever raise a word ([`FenceWord::signal`]). One mark exists:
//! [`ABORT`] added to `v` by a worker that could not enqueue its stream write; it passes
//! the wait but tells the pool not to trust the bytes (the store fails).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::GpuError;

/// Added to a fence value to release a waiter without valid data. Keeps the cyclic
/// `GEQ` true (it is below 2^63) and is far above any transfer id.
pub const ABORT: u64 = 1 << 62;

/// Bytes of one slot.
pub const SLOT_BYTES: u64 = 8;

/// Largest HostMemfd region the pool accepts as a fence page (it pins it).
pub const MAX_FENCE_REGION_BYTES: u64 = 1 << 20;

/// How long the pool waits for a worker's store fence before failing the store, unless
/// configured otherwise (`TransferArgs::fence_timeout`, the pool's `--store-fence-timeout-ms`).
pub const FENCE_TIMEOUT: Duration = Duration::from_secs(30);

/// Whether `word` has reached `value` (the driver's cyclic `GEQ`).
pub fn reached(word: u64, value: u64) -> bool {
    (word.wrapping_sub(value) as i64) >= 0
}

/// Whether `word` reached `value` through an abort rather than the real write.
pub fn aborted(word: u64, value: u64) -> bool {
    let d = word.wrapping_sub(value);
    (d as i64) >= 0 && d >= ABORT / 2
}

/// `Sqe::fence_ref` of a fenced submission: which registered allocation holds the fence
/// page, and which slot of it.
pub fn encode_ref(alloc_id: u32, slot: u32) -> u64 {
    ((slot as u64) << 32) | alloc_id as u64
}

/// Inverse of [`encode_ref`]: `(alloc_id, slot)`.
pub fn decode_ref(r: u64) -> (u32, u32) {
    (r as u32, (r >> 32) as u32)
}

/// One fence word as this process sees it: its host address, and its device address when
/// the page is registered with a GPU driver (None: only CPU waits and writes work).
#[derive(Clone, Copy)]
pub struct FenceWord<'a> {
    host: &'a AtomicU64,
    device: Option<u64>,
}

impl<'a> FenceWord<'a> {
    /// # Safety
    /// `host` is 8-byte aligned, mapped for `'a`, and only accessed atomically (by this and
    /// other processes, and by GPUs); `device` is its device-mapped address if given.
    pub unsafe fn new(host: *mut u64, device: Option<u64>) -> Self {
        // SAFETY: forwarded contract; AtomicU64 has the layout of u64.
        Self { host: unsafe { &*(host as *const AtomicU64) }, device }
    }

    pub fn load(&self) -> u64 {
        self.host.load(Ordering::Acquire)
    }

    /// Plain store (resetting a slot nobody waits on).
    pub fn store(&self, value: u64) {
        self.host.store(value, Ordering::Release)
    }

    /// Raises the word to `value` unless it already reached it (cyclic compare): releases
    /// waiters for `value` without ever lowering a word a newer transfer raised.
    pub fn signal(&self, value: u64) {
        let mut cur = self.host.load(Ordering::Acquire);
        while !reached(cur, value) {
            match self.host.compare_exchange_weak(cur, value, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(now) => cur = now,
            }
        }
    }

    pub fn device(&self) -> Option<u64> {
        self.device
    }

    pub fn host_ptr(&self) -> *const u64 {
        (self.host as *const AtomicU64).cast()
    }

    /// Blocks the calling thread until the word reaches `value`. Gives up with
    /// [`GpuError::FenceTimeout`] after `timeout` or as soon as `keep_waiting`
    /// says no (peer gone, pool stopping), and returns [`GpuError::FenceAborted`] when it
    /// was released with the abort mark. Spins briefly, then sleeps in growing steps up
    /// to 200 µs.
    pub fn wait_cpu(&self, value: u64, timeout: Duration, keep_waiting: &dyn Fn() -> bool) -> Result<(), GpuError> {
        let start = Instant::now();
        let mut round = 0u32;
        loop {
            let w = self.load();
            if reached(w, value) {
                return if aborted(w, value) { Err(GpuError::FenceAborted { value, word: w }) } else { Ok(()) };
            }
            round += 1;
            if round < 2000 {
                std::hint::spin_loop();
                continue;
            }
            let waited = start.elapsed();
            let why = if !keep_waiting() {
                ": the peer is gone or the pool is stopping"
            } else if waited >= timeout {
                ""
            } else {
                std::thread::sleep(Duration::from_micros((round as u64 / 100).min(200)));
                continue;
            };
            return Err(GpuError::FenceTimeout { value, last: w, waited_ms: waited.as_millis() as u64, why });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cyclic_comparison_matches_the_driver() {
        assert!(reached(5, 5));
        assert!(reached(6, 5));
        assert!(!reached(4, 5));
        assert!(!reached(0, 5), "a fresh slot does not pass");
        assert!(reached(5 + ABORT, 5), "an abort releases the waiter");
        assert!(aborted(5 + ABORT, 5));
        assert!(!aborted(5, 5));
        assert!(!aborted(7, 5));
        // A slot still holding an older transfer's value (or its abort) does not pass a
        // newer one... unless that older value was aborted, which is why aborted slots are
        // never reused (worker side).
        assert!(!reached(3, 1000));
        assert!(reached(u64::MAX.wrapping_add(3), u64::MAX - 1), "wraps like the driver");
    }

    #[test]
    fn refs_round_trip() {
        assert_eq!(decode_ref(encode_ref(7, 300)), (7, 300));
        assert_eq!(decode_ref(encode_ref(u32::MAX, u32::MAX)), (u32::MAX, u32::MAX));
    }

    #[test]
    fn cpu_wait_sees_writes_aborts_and_gives_up() {
        let mut word = 0u64;
        // SAFETY: a local aligned word, only used atomically below.
        let f = unsafe { FenceWord::new(&mut word, None) };
        f.store(9);
        assert!(f.wait_cpu(9, FENCE_TIMEOUT, &|| true).is_ok());
        f.store(10 + ABORT);
        assert!(matches!(f.wait_cpu(10, FENCE_TIMEOUT, &|| true), Err(GpuError::FenceAborted { .. })));
        let t = Instant::now();
        let e = f.wait_cpu(u64::MAX / 2, FENCE_TIMEOUT, &|| false).unwrap_err();
        assert!(matches!(e, GpuError::FenceTimeout { .. }), "{e}");
        assert!(e.to_string().contains("peer is gone"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(1));
        let t = Instant::now();
        let e = f.wait_cpu(u64::MAX / 2, Duration::from_millis(50), &|| true).unwrap_err();
        assert!(matches!(e, GpuError::FenceTimeout { .. }), "{e}");
        assert!(t.elapsed() >= Duration::from_millis(50) && t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        f.store(0);
        f.signal(5);
        assert_eq!(f.load(), 5);
        f.signal(3);
        assert_eq!(f.load(), 5, "signal never lowers a word");
        f.store(0);
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                f.store(11);
            });
            assert!(f.wait_cpu(11, FENCE_TIMEOUT, &|| true).is_ok());
        });
    }
}
