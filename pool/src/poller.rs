//! A thin epoll wrapper: the pool sleeps on many fds (sockets, doorbells) from one thread.

use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use rustix::event::epoll;

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

    pub fn remove(&self, fd: impl AsFd) {
        let _ = epoll::delete(&self.ep, fd);
    }

    /// Tokens of ready fds (HUP and errors count as ready).
    pub fn wait(&mut self, timeout: Option<Duration>) -> Vec<u64> {
        self.events.clear();
        let ts = timeout.map(|d| rustix::time::Timespec { tv_sec: d.as_secs() as i64, tv_nsec: d.subsec_nanos() as _ });
        match epoll::wait(&self.ep, rustix::buffer::spare_capacity(&mut self.events), ts.as_ref()) {
            Ok(_) => self.events.iter().map(|e| e.data.u64()).collect(),
            Err(_) => Vec::new(),
        }
    }
}
