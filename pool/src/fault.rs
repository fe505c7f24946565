//! Fault injection for tests of the pool's failure handling (in-process pools only: there
//! is no flag, variable or message that reaches it from outside the process).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use umbp_protocol::ObjectKey;

use crate::transfer::JobBlock;

static PANIC_ON_COPY_OF: Mutex<Option<ObjectKey>> = Mutex::new(None);
/// Whether anything is armed: the copy path then pays one relaxed load, no lock.
static ARMED: AtomicBool = AtomicBool::new(false);

/// Makes the copy thread panic when it has reserved `key` for a copy (None: never).
#[doc(hidden)]
pub fn panic_on_copy_of(key: Option<ObjectKey>) {
    *PANIC_ON_COPY_OF.lock().unwrap_or_else(|e| e.into_inner()) = key;
    ARMED.store(key.is_some(), Ordering::Release);
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
}
