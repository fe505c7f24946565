//! Shared memory and child processes for the cross-process benchmarks: sealed memfds,
//! `MAP_SHARED` mappings, and re-executing this binary with inherited fds.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};

use memfd::{FileSeal, MemfdOptions};
use rustix::mm::{MapFlags, ProtFlags};

/// A `MAP_SHARED` read-write mapping, unmapped on drop.
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    pub fn new(fd: BorrowedFd<'_>, len: usize) -> io::Result<Self> {
        // SAFETY: a new mapping at a kernel-chosen address; only reached through `ptr`.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                0,
            )
        }?;
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped in `new` with this length; borrows of it end before drop.
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) };
    }
}

/// A memfd of `len` bytes, sealed against shrinking and growing (docs/security.md "Sealed shared memory").
pub fn sealed_memfd(name: &str, len: usize) -> io::Result<memfd::Memfd> {
    let fd = MemfdOptions::new()
        .allow_sealing(true)
        .close_on_exec(true)
        .create(name)
        .map_err(to_io)?;
    fd.as_file().set_len(len as u64)?;
    fd.add_seals(&[FileSeal::SealShrink, FileSeal::SealGrow, FileSeal::SealSeal])
        .map_err(to_io)?;
    Ok(fd)
}

fn to_io(e: memfd::Error) -> io::Error {
    io::Error::other(e.to_string())
}

/// Re-executes this binary with `args`, keeping `fds` open in the child (same numbers)
/// and killing the child if this process dies.
pub fn spawn_self(args: &[String], fds: &[RawFd]) -> io::Result<ChildGuard> {
    let keep = fds.to_vec();
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
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
