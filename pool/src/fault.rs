//! Fault injection for tests of the pool's failure handling (in-process pools only: there
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
