//! Who may use the copy threads now: each peer's share (`copy_threads_per_peer`) and, while
//! several uids are attached, each uid's (`copy_threads_per_uid`), with the jobs each cap
//! holds back in submission order. Two leaf locks, never held together and never held while
//! a job is sent (transfer.rs sends what these hand back).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use crate::copy::job::Job;

#[derive(Default)]
pub struct CopySlots {
    /// Per attachment id: its jobs running and its jobs waiting for its share. An entry
    /// goes when the peer has neither.
    peers: Mutex<HashMap<u32, PeerSlots>>,
    uids: Mutex<UidSlots>,
}

#[derive(Default)]
struct PeerSlots {
    running: usize,
    waiting: VecDeque<Job>,
}

#[derive(Default)]
struct UidSlots {
    running: HashMap<u32, usize>,
    waiting: VecDeque<Job>,
}

impl CopySlots {
    /// The job back when it took one of its peer's `per_peer` slots; None: queued behind
    /// the peer's earlier jobs (`release_peer_slot` hands it out later).
    pub fn take_peer_slot(&self, job: Job, per_peer: usize) -> Option<Job> {
        let mut peers = self.peers.lock().expect("copy slots lock");
        let slots = peers.entry(job.att.id).or_default();
        if slots.running >= per_peer {
            slots.waiting.push_back(job);
            return None;
        }
        slots.running += 1;
        Some(job)
    }

    /// One of peer `id`'s jobs finished: its next waiting job, which keeps the slot; None
    /// frees the slot.
    pub fn release_peer_slot(&self, id: u32) -> Option<Job> {
        let mut peers = self.peers.lock().expect("copy slots lock");
        let slots = peers.get_mut(&id)?;
        if let Some(job) = slots.waiting.pop_front() {
            return Some(job);
        }
        slots.running = slots.running.saturating_sub(1);
        if slots.running == 0 {
            peers.remove(&id);
        }
        None
    }

    /// Runs `f` over peer `id`'s waiting jobs, oldest first (the look-ahead of its next loads).
    pub fn peer_waiting<R>(&self, id: u32, f: impl FnOnce(&mut dyn Iterator<Item = &Job>) -> R) -> R {
        let peers = self.peers.lock().expect("copy slots lock");
        let mut jobs = peers.get(&id).into_iter().flat_map(|s| s.waiting.iter());
        f(&mut jobs)
    }

    /// The job back when its uid is under `cap` (None: no cap) and took a slot; None: held
    /// back until one of its uid's jobs finishes (so a held-back job's uid always has one
    /// running, whose end hands it out).
    pub fn take_uid_slot(&self, job: Job, cap: Option<usize>) -> Option<Job> {
        let mut uids = self.uids.lock().expect("copy uids lock");
        let running = uids.running.entry(job.att.uid).or_default();
        if cap.is_some_and(|cap| *running >= cap) {
            uids.waiting.push_back(job);
            return None;
        }
        *running += 1;
        Some(job)
    }

    /// One of `uid`'s jobs finished: the held-back jobs now under `cap` (of this uid, or of
    /// others when uids left meanwhile), in order, each holding its uid's slot.
    pub fn release_uid_slot(&self, uid: u32, cap: Option<usize>) -> Vec<Job> {
        let mut guard = self.uids.lock().expect("copy uids lock");
        let uids = &mut *guard;
        if let Some(n) = uids.running.get_mut(&uid) {
            *n -= 1;
            if *n == 0 {
                uids.running.remove(&uid);
            }
        }
        let mut ready = Vec::new();
        let mut i = 0;
        while i < uids.waiting.len() {
            let u = uids.waiting[i].att.uid;
            let running = uids.running.entry(u).or_default();
            if cap.is_none_or(|cap| *running < cap) {
                *running += 1;
                ready.extend(uids.waiting.remove(i));
            } else {
                i += 1;
            }
        }
        ready
    }
}
