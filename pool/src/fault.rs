//! Fault injection and hold points for tests of the pool's failure handling, and the
//! soak's negative control (docs/reliability.md).
//!
//! In-process only: the switches are library functions. There is no flag, variable or
//! message that reaches them from outside the process: the `umbp-pool` binary never calls
//! them, so a production pool (and any peer of it) cannot arm a fault. The soak's
//! negative control runs its pool as `umbp-bench __soak-pool`, a process that links this
//! library and arms `corrupt_every_nth_store` itself.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use umbp_protocol::ObjectKey;

static PANIC_ON_COPY_OF: Mutex<Option<ObjectKey>> = Mutex::new(None);
static PANIC_ON_PROMOTION_OF: Mutex<Option<ObjectKey>> = Mutex::new(None);
static PROMOTION_ARMED: AtomicBool = AtomicBool::new(false);
static PAUSE_ON_COPY_OF: Mutex<Option<(ObjectKey, Arc<Pause>)>> = Mutex::new(None);
/// Whether anything is armed: the copy path then pays one relaxed load, no lock.
static ARMED: AtomicBool = AtomicBool::new(false);
/// Corrupt one of every this many stored objects (0: never).
static CORRUPT_EVERY: AtomicU64 = AtomicU64::new(0);
/// Objects stored since [`corrupt_every_nth_store`] armed the fault.
static STORED: AtomicU64 = AtomicU64::new(0);
/// Bytes flipped so far.
static CORRUPTED: AtomicU64 = AtomicU64::new(0);

/// Makes the copy thread panic when it has reserved `key` for a copy (None: never).
#[doc(hidden)]
pub fn panic_on_copy_of(key: Option<ObjectKey>) {
    *PANIC_ON_COPY_OF.lock().unwrap_or_else(|e| e.into_inner()) = key;
    ARMED.store(key.is_some() || PAUSE_ON_COPY_OF.lock().unwrap_or_else(|e| e.into_inner()).is_some(), Ordering::Release);
}

/// A copy thread held at a stage (a pool stalled mid-transfer, deterministically).
#[doc(hidden)]
#[derive(Default)]
pub struct Pause {
    /// (reached, released)
    state: Mutex<(bool, bool)>,
    cv: Condvar,
}

impl Pause {
    /// Waits until a copy thread is held here; false after `timeout`.
    pub fn wait_reached(&self, timeout: std::time::Duration) -> bool {
        let g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (g, _) = self.cv.wait_timeout_while(g, timeout, |s| !s.0).unwrap_or_else(|e| e.into_inner());
        g.0
    }

    /// Lets the held copy thread go on.
    pub fn release(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
        self.cv.notify_all();
    }

    fn hold(&self) {
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        g.0 = true;
        self.cv.notify_all();
        while !g.1 {
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Holds the copy thread once, right after it claimed and reserved the stage holding
/// `key` (before that stage's copies are issued), until the returned pause is released.
#[doc(hidden)]
pub fn pause_on_copy_of(key: ObjectKey) -> Arc<Pause> {
    let pause = Arc::new(Pause::default());
    *PAUSE_ON_COPY_OF.lock().unwrap_or_else(|e| e.into_inner()) = Some((key, pause.clone()));
    ARMED.store(true, Ordering::Release);
    pause
}

/// TEST ONLY: flips one byte of the pool's DRAM copy of one object in every `n` stored
/// (after its bytes landed, before it is published), so that a load of it returns wrong
/// bytes with status `Loaded`: a checker that verifies loads must see them. 0 disarms.
#[doc(hidden)]
pub fn corrupt_every_nth_store(n: u64) {
    STORED.store(0, Ordering::Relaxed);
    CORRUPT_EVERY.store(n, Ordering::Release);
}

/// Bytes [`corrupt_every_nth_store`] flipped so far in this process.
#[doc(hidden)]
pub fn corrupted_bytes() -> u64 {
    CORRUPTED.load(Ordering::Relaxed)
}

/// Called by the copy thread with the keys of a stage's blocks, after reserving them.
pub(crate) fn check_copy(keys: impl Iterator<Item = ObjectKey> + Clone) {
    if !ARMED.load(Ordering::Acquire) {
        return;
    }
    let armed = *PANIC_ON_COPY_OF.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(key) = armed {
        if keys.clone().any(|k| k == key) {
            panic!("injected copy fault for key {:032x}", key.0);
        }
    }
    let pause = {
        let mut p = PAUSE_ON_COPY_OF.lock().unwrap_or_else(|e| e.into_inner());
        match p.as_ref() {
            Some((key, _)) if keys.clone().any(|k| k == *key) => p.take().map(|(_, pause)| pause),
            _ => None,
        }
    };
    if let Some(pause) = pause {
        pause.hold();
    }
}

static PANIC_ON_LANDING_OF: Mutex<Option<ObjectKey>> = Mutex::new(None);
static LANDING_ARMED: AtomicBool = AtomicBool::new(false);

/// TEST ONLY: makes the copy thread panic while it settles the landed stage holding
/// `key` (inside the device layer's stage-done callback). None disarms.
#[doc(hidden)]
pub fn panic_on_landing_of(key: Option<ObjectKey>) {
    *PANIC_ON_LANDING_OF.lock().unwrap_or_else(|e| e.into_inner()) = key;
    LANDING_ARMED.store(key.is_some(), Ordering::Release);
}

/// Called by the copy thread with the keys of a landed stage's blocks, before they are settled.
pub(crate) fn check_landed(mut keys: impl Iterator<Item = ObjectKey>) {
    if !LANDING_ARMED.load(Ordering::Acquire) {
        return;
    }
    let armed = *PANIC_ON_LANDING_OF.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(key) = armed.filter(|k| keys.any(|b| b == *k)) {
        panic!("injected landing fault for key {:032x}", key.0);
    }
}

/// Points where a test can hold a pool thread, to force an interleaving that is otherwise
/// a matter of microseconds (e.g. a lock-order race).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldPoint {
    /// The service thread, idle, about to arm every ring before it sleeps.
    ServiceBeforeArm = 0,
    /// The service thread found a corrupted ring and is about to detach that peer.
    ServiceCorrupt = 1,
    /// The cluster tier's change follower, started, before its first read of the KV event
    /// logs (a thread the scheduler runs late).
    ClusterFollowerStart = 2,
    /// A report about to take one attachment's ring locks (`Attachment::ring_snapshots`):
    /// whatever the reporting thread holds here, it holds while it waits for them.
    ReportRings = 3,
}

const HOLD_POINTS: usize = 4;

struct Holds {
    armed: [bool; HOLD_POINTS],
    reached: [bool; HOLD_POINTS],
}

static HOLDS: Mutex<Holds> = Mutex::new(Holds { armed: [false; HOLD_POINTS], reached: [false; HOLD_POINTS] });
static HOLDS_CHANGED: std::sync::Condvar = std::sync::Condvar::new();
static HOLDS_ARMED: AtomicBool = AtomicBool::new(false);

/// Arms (`on`) or releases a hold point: a pool thread that reaches an armed point marks it
/// reached and waits there until it is released.
#[doc(hidden)]
pub fn hold(point: HoldPoint, on: bool) {
    let mut h = HOLDS.lock().unwrap_or_else(|e| e.into_inner());
    h.armed[point as usize] = on;
    h.reached[point as usize] = false;
    HOLDS_ARMED.store(h.armed.iter().any(|a| *a), Ordering::Release);
    HOLDS_CHANGED.notify_all();
}

/// Waits until a pool thread reached the armed `point`; false after `timeout`.
#[doc(hidden)]
pub fn wait_reached(point: HoldPoint, timeout: std::time::Duration) -> bool {
    let h = HOLDS.lock().unwrap_or_else(|e| e.into_inner());
    let (h, _) = HOLDS_CHANGED.wait_timeout_while(h, timeout, |h| !h.reached[point as usize]).unwrap_or_else(|e| e.into_inner());
    h.reached[point as usize]
}

/// Called by pool threads (and the cluster tier's, over the pool) at `point`: returns at
/// once unless a test armed it.
#[doc(hidden)]
pub fn pass(point: HoldPoint) {
    if !HOLDS_ARMED.load(Ordering::Acquire) {
        return;
    }
    let mut h = HOLDS.lock().unwrap_or_else(|e| e.into_inner());
    if !h.armed[point as usize] {
        return;
    }
    h.reached[point as usize] = true;
    HOLDS_CHANGED.notify_all();
    while h.armed[point as usize] {
        h = HOLDS_CHANGED.wait(h).unwrap_or_else(|e| e.into_inner());
    }
}

/// Called with a store stage's blocks (key, DRAM offset) once their copies landed, before
/// they are published.
///
/// # Safety
/// `dram` is the base of the pool's DRAM, and every block's object (`offset`, `size`
/// bytes from it) is reserved for this store and not published yet: nobody else reads or
/// writes it now.
pub(crate) unsafe fn stored(dram: *mut u8, blocks: impl Iterator<Item = (ObjectKey, u64)>, size: u64) {
    let every = CORRUPT_EVERY.load(Ordering::Acquire);
    if every == 0 || size == 0 {
        return;
    }
    for (key, offset) in blocks {
        let n = STORED.fetch_add(1, Ordering::Relaxed) + 1;
        if !n.is_multiple_of(every) {
            continue;
        }
        // A position that moves around the object (any layer, any page).
        let at = offset + (n.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 17) % size;
        // SAFETY: `at` lies inside this block's object, which the caller vouches is ours.
        unsafe { *dram.add(at as usize) ^= 0xFF };
        CORRUPTED.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(key = %format_args!("{:032x}", key.0), "TEST FAULT: flipped a byte of a stored object (corrupt_every_nth_store)");
    }
}

/// Demotion batches still to start before the kill (0: disarmed).
static ABORT_DEMOTION_AT: AtomicU64 = AtomicU64::new(0);
/// Microseconds after that batch's writes start when the process aborts.
static ABORT_DEMOTION_DELAY_US: AtomicU64 = AtomicU64::new(0);

/// TEST ONLY: kills this process (SIGABRT, no unwinding, no clean close: like SIGKILL)
/// `delay_us` microseconds after the `batch`-th demotion batch (1 = the next) starts
/// writing to SSD, so the kill lands while records are being written. 0 disarms.
#[doc(hidden)]
pub fn abort_during_demotion(batch: u64, delay_us: u64) {
    ABORT_DEMOTION_DELAY_US.store(delay_us, Ordering::Relaxed);
    ABORT_DEMOTION_AT.store(batch, Ordering::Release);
}

/// Called by the demoter just before a batch of `objects` is written.
pub(crate) fn demotion_batch(objects: usize) {
    let at = ABORT_DEMOTION_AT.load(Ordering::Acquire);
    if at == 0 {
        return;
    }
    if ABORT_DEMOTION_AT.fetch_sub(1, Ordering::AcqRel) != 1 {
        return;
    }
    let delay = std::time::Duration::from_micros(ABORT_DEMOTION_DELAY_US.load(Ordering::Relaxed));
    tracing::warn!(objects, ?delay, "TEST FAULT: aborting the pool during this demotion batch (abort_during_demotion)");
    std::thread::spawn(move || {
        std::thread::sleep(delay);
        std::process::abort();
    });
}

/// TEST ONLY: makes the copy thread panic inside the SSD tier's fetch of a batch holding
/// `key` (after `begin_promotion`, before `finish_promotion`). None disarms.
#[doc(hidden)]
pub fn panic_on_promotion_of(key: Option<ObjectKey>) {
    *PANIC_ON_PROMOTION_OF.lock().unwrap_or_else(|e| e.into_inner()) = key;
    let paused = PAUSE_ON_PROMOTION_OF.lock().unwrap_or_else(|e| e.into_inner()).is_some();
    PROMOTION_ARMED.store(key.is_some() || paused, Ordering::Release);
}

static PAUSE_ON_PROMOTION_OF: Mutex<Option<(ObjectKey, Arc<Pause>)>> = Mutex::new(None);

/// TEST ONLY: holds the SSD tier's fetch of the batch holding `key` once (a slow SSD read,
/// deterministically), before it reads, until the returned pause is released.
#[doc(hidden)]
pub fn pause_on_promotion_of(key: ObjectKey) -> Arc<Pause> {
    let pause = Arc::new(Pause::default());
    *PAUSE_ON_PROMOTION_OF.lock().unwrap_or_else(|e| e.into_inner()) = Some((key, pause.clone()));
    PROMOTION_ARMED.store(true, Ordering::Release);
    pause
}

/// Called by the SSD tier's fetch with the keys of one promotion batch.
pub(crate) fn promotion(keys: impl Iterator<Item = ObjectKey>) {
    if !PROMOTION_ARMED.load(Ordering::Acquire) {
        return;
    }
    let keys: Vec<ObjectKey> = keys.collect();
    let armed = *PANIC_ON_PROMOTION_OF.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(key) = armed.filter(|k| keys.contains(k)) {
        panic!("injected promotion fault for key {:032x}", key.0);
    }
    let pause = {
        let mut p = PAUSE_ON_PROMOTION_OF.lock().unwrap_or_else(|e| e.into_inner());
        match p.as_ref() {
            Some((key, _)) if keys.contains(key) => p.take().map(|(_, pause)| pause),
            _ => None,
        }
    };
    if let Some(pause) = pause {
        pause.hold();
    }
}

static FAIL_FETCH_OF: Mutex<Vec<ObjectKey>> = Mutex::new(Vec::new());
static FETCH_FAIL_ARMED: AtomicBool = AtomicBool::new(false);

/// TEST ONLY: a promotion thread's fetch of any of `keys` reports failure (as a tier's
/// read error or bad CRC would), after the tier wrote the bytes: the promotion must end as
/// a miss, never publish them. Empty disarms.
#[doc(hidden)]
pub fn fail_fetch_of(keys: Vec<ObjectKey>) {
    let armed = !keys.is_empty();
    *FAIL_FETCH_OF.lock().unwrap_or_else(|e| e.into_inner()) = keys;
    FETCH_FAIL_ARMED.store(armed, Ordering::Release);
}

/// Whether the fetch of `key` is to fail (see [`fail_fetch_of`]).
pub(crate) fn fetch_fails(key: ObjectKey) -> bool {
    FETCH_FAIL_ARMED.load(Ordering::Acquire) && FAIL_FETCH_OF.lock().unwrap_or_else(|e| e.into_inner()).contains(&key)
}
