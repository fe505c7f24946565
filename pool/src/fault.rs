//! Fault injection and hold points for tests of the pool's failure handling (in-process pools only: there
//! is no flag, variable or message that reaches it from outside the process).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use umbp_protocol::ObjectKey;

use crate::transfer::JobBlock;

static PANIC_ON_COPY_OF: Mutex<Option<ObjectKey>> = Mutex::new(None);
static PAUSE_ON_COPY_OF: Mutex<Option<(ObjectKey, Arc<Pause>)>> = Mutex::new(None);
/// Whether anything is armed: the copy path then pays one relaxed load, no lock.
static ARMED: AtomicBool = AtomicBool::new(false);

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

/// Called by the copy thread after reserving a stage's blocks.
pub(crate) fn check_copy(blocks: &[JobBlock]) {
    if !ARMED.load(Ordering::Acquire) {
        return;
    }
    let armed = *PANIC_ON_COPY_OF.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(key) = armed {
        if blocks.iter().any(|b| b.key == key) {
            panic!("injected copy fault for key {:032x}", key.0);
        }
    }
    let pause = {
        let mut p = PAUSE_ON_COPY_OF.lock().unwrap_or_else(|e| e.into_inner());
        match p.as_ref() {
            Some((key, _)) if blocks.iter().any(|b| b.key == *key) => p.take().map(|(_, pause)| pause),
            _ => None,
        }
    };
    if let Some(pause) = pause {
        pause.hold();
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
}

struct Holds {
    armed: [bool; 2],
    reached: [bool; 2],
}

static HOLDS: Mutex<Holds> = Mutex::new(Holds { armed: [false; 2], reached: [false; 2] });
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
    let (h, _) = HOLDS_CHANGED
        .wait_timeout_while(h, timeout, |h| !h.reached[point as usize])
        .unwrap_or_else(|e| e.into_inner());
    h.reached[point as usize]
}

/// Called by pool threads at `point`: returns at once unless a test armed it.
pub(crate) fn pass(point: HoldPoint) {
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
