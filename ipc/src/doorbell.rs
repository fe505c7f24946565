//! eventfd doorbells: a producer rings after publishing when the consumer asked for a
//! wake (`need_wakeup`), so a pool thread can sleep on many attachments at once.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::event::{eventfd, EventfdFlags};

pub struct Doorbell {
    fd: OwnedFd,
}

impl Doorbell {
    pub fn new() -> std::io::Result<Self> {
        let fd = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        Ok(Self { fd })
    }

    pub fn from_fd(fd: OwnedFd) -> Self {
        Self { fd }
    }

    pub fn ring(&self) {
        // EAGAIN means the counter is saturated: the consumer will wake anyway.
        let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
    }

    /// Resets the counter; returns whether it had been rung.
    pub fn drain(&self) -> bool {
        let mut buf = [0u8; 8];
        matches!(rustix::io::read(&self.fd, &mut buf), Ok(8))
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub fn try_clone_fd(&self) -> std::io::Result<OwnedFd> {
        self.fd.try_clone()
    }
}
