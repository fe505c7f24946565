//! SIGINT/SIGTERM as a clean stop for a process that runs a pool: block both in the
//! calling thread before any pool thread starts (threads inherit the mask, so no copy or
//! control thread is interrupted), then wait for one synchronously.

/// The blocked stop signals; [`StopSignals::wait`] returns the one that arrived.
pub struct StopSignals(libc::sigset_t);

impl StopSignals {
    /// Blocks SIGINT and SIGTERM in this thread (and every thread it starts afterwards).
    pub fn block() -> Self {
        // SAFETY: plain libc signal-mask calls on a local sigset.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::sigaddset(&mut set, libc::SIGTERM);
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            StopSignals(set)
        }
    }

    /// Waits until SIGINT or SIGTERM arrives and returns its number.
    pub fn wait(&self) -> i32 {
        let mut sig = 0;
        // SAFETY: waits on the set blocked in `block`.
        unsafe { libc::sigwait(&self.0, &mut sig) };
        sig
    }
}
