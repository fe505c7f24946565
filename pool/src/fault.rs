//! Fault injection for tests of the pool's failure handling, and for the soak's negative
//! control (docs/reliability.md).
//!
//! In-process only: the switches are library functions. There is no flag, variable or
//! message that reaches them from outside the process: the `umbp-pool` binary never calls
//! them, so a production pool (and any peer of it) cannot arm a fault. The soak's
//! negative control runs its pool as `umbp-bench __soak-pool`, a process that links this
//! library and arms [`corrupt_every_nth_store`] itself.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use umbp_protocol::ObjectKey;

use crate::transfer::JobBlock;

static PANIC_ON_COPY_OF: Mutex<Option<ObjectKey>> = Mutex::new(None);
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
    ARMED.store(key.is_some(), Ordering::Release);
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

/// Called with a store stage's blocks once their copies landed, before they are published.
///
/// # Safety
/// `dram` is the base of the pool's DRAM, and every block's object (`offset`, `size`
/// bytes from it) is reserved for this store and not published yet: nobody else reads or
/// writes it now.
pub(crate) unsafe fn stored(dram: *mut u8, blocks: &[JobBlock], size: u64) {
    let every = CORRUPT_EVERY.load(Ordering::Acquire);
    if every == 0 || size == 0 {
        return;
    }
    for b in blocks {
        let n = STORED.fetch_add(1, Ordering::Relaxed) + 1;
        if !n.is_multiple_of(every) {
            continue;
        }
        // A position that moves around the object (any layer, any page).
        let at = b.offset + (n.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 17) % size;
        // SAFETY: `at` lies inside this block's object, which the caller vouches is ours.
        unsafe { *dram.add(at as usize) ^= 0xFF };
        CORRUPTED.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(key = %format_args!("{:032x}", b.key.0), "TEST FAULT: flipped a byte of a stored object (corrupt_every_nth_store)");
    }
}
