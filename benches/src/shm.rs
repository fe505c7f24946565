//! Child processes for the cross-process benchmarks: re-executing this binary with
//! inherited fds (shared memory is `umbp_ipc::SharedMemory`, as in the pool).

use std::io;
use std::os::fd::{AsFd, BorrowedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};

/// Re-executes this binary with `args`, keeping `fds` open in the child (same numbers)
/// and killing the child if this process dies.
pub fn spawn_self(args: &[String], fds: &[RawFd]) -> io::Result<ChildGuard> {
    let keep = fds.to_vec();
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::inherit());
    // SAFETY: only async-signal-safe syscalls (prctl, fcntl) run between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))?;
            for &fd in &keep {
                rustix::io::fcntl_setfd(BorrowedFd::borrow_raw(fd), rustix::io::FdFlags::empty())?;
            }
            Ok(())
        });
    }
    Ok(ChildGuard(Some(cmd.spawn()?)))
}

/// Kills and reaps the child on drop unless [`ChildGuard::wait`] already reaped it.
pub struct ChildGuard(Option<Child>);

impl ChildGuard {
    pub fn wait(mut self) -> io::Result<std::process::ExitStatus> {
        self.0.take().expect("child").wait()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Borrow of an fd number inherited from the parent.
///
/// # Safety
/// `fd` must be open for the life of the process (inherited and never closed).
pub unsafe fn inherited(fd: RawFd) -> BorrowedFd<'static> {
    // SAFETY: the caller's contract.
    unsafe { BorrowedFd::borrow_raw(fd) }
}

/// Raw number of an fd, for passing on a command line.
pub fn raw(fd: impl AsFd) -> RawFd {
    use std::os::fd::AsRawFd;
    fd.as_fd().as_raw_fd()
}
