//! Atomics used by the shared-memory algorithms: std in real builds, loom's under
//! `--cfg loom` so the models check the exact code that runs.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

#[cfg(loom)]
pub(crate) fn spin_hint() {
    loom::thread::yield_now();
}

#[cfg(not(loom))]
pub(crate) fn spin_hint() {
    std::hint::spin_loop();
}
