//! Cross-process futex on a word in shared memory. No `FUTEX_PRIVATE_FLAG`: the waiter and
//! the waker are different processes mapping the same memfd.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

use rustix::thread::futex;

/// Sleeps while `*word == expected`, at most `timeout`. Spurious returns are allowed:
/// callers re-check their condition.
pub fn wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
    let ts = timeout.map(|d| rustix::time::Timespec { tv_sec: d.as_secs().min(i64::MAX as u64) as i64, tv_nsec: d.subsec_nanos() as _ });
    // EAGAIN (value changed), ETIMEDOUT and EINTR all mean "go look again".
    let _ = futex::wait(word, futex::Flags::empty(), expected, ts.as_ref());
}

/// Wakes up to `n` sleepers on `word`.
pub fn wake(word: &AtomicU32, n: u32) {
    let _ = futex::wake(word, futex::Flags::empty(), n);
}
