//! A thin epoll wrapper: the pool sleeps on many fds (sockets, doorbells) from one thread.

use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use rustix::event::epoll;

/// What to wait for on one fd. Hang-ups and errors are always reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interest {
    pub read: bool,
    pub write: bool,
}

impl Interest {
    fn flags(self) -> epoll::EventFlags {
        let mut f = epoll::EventFlags::empty();
        if self.read {
            f |= epoll::EventFlags::IN | epoll::EventFlags::RDHUP;
        }
        if self.write {
            f |= epoll::EventFlags::OUT;
        }
        f
    }
}

/// One ready fd: its token, and whether it hung up or failed (EPOLLHUP / EPOLLERR).
#[derive(Debug, Clone, Copy)]
pub struct Ready {
    pub token: u64,
    pub hangup: bool,
}

pub struct Poller {
    ep: OwnedFd,
    events: Vec<epoll::Event>,
}

impl Poller {
    pub fn new() -> std::io::Result<Self> {
        Ok(Self { ep: epoll::create(epoll::CreateFlags::CLOEXEC)?, events: Vec::with_capacity(256) })
    }

    pub fn add(&self, fd: impl AsFd, token: u64) -> std::io::Result<()> {
        Ok(epoll::add(&self.ep, fd, epoll::EventData::new_u64(token), epoll::EventFlags::IN | epoll::EventFlags::RDHUP)?)
    }

    /// Adds `fd` waiting for `interest`.
    pub fn add_with(&self, fd: impl AsFd, token: u64, interest: Interest) -> std::io::Result<()> {
        Ok(epoll::add(&self.ep, fd, epoll::EventData::new_u64(token), interest.flags())?)
    }

    /// Changes what `fd` waits for.
    pub fn modify(&self, fd: impl AsFd, token: u64, interest: Interest) -> std::io::Result<()> {
        Ok(epoll::modify(&self.ep, fd, epoll::EventData::new_u64(token), interest.flags())?)
    }

    pub fn remove(&self, fd: impl AsFd) {
        let _ = epoll::delete(&self.ep, fd);
    }

    /// Tokens of ready fds (HUP and errors count as ready).
    pub fn wait(&mut self, timeout: Option<Duration>) -> Vec<u64> {
        self.wait_ready(timeout).into_iter().map(|r| r.token).collect()
    }

    /// Ready fds with their hang-up state.
    pub fn wait_ready(&mut self, timeout: Option<Duration>) -> Vec<Ready> {
        self.events.clear();
        let ts = timeout.map(|d| rustix::time::Timespec { tv_sec: d.as_secs() as i64, tv_nsec: d.subsec_nanos() as _ });
        match epoll::wait(&self.ep, rustix::buffer::spare_capacity(&mut self.events), ts.as_ref()) {
            Ok(_) => self
                .events
                .iter()
                .map(|e| {
                    // A packed struct: copy the field out before using it.
                    let flags = { e.flags };
                    Ready { token: e.data.u64(), hangup: flags.intersects(epoll::EventFlags::HUP | epoll::EventFlags::ERR) }
                })
                .collect(),
            Err(_) => Vec::new(),
        }
    }
}
