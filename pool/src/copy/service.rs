//! The service thread: drains every attachment's submission ring, validates each
//! submission against private copies, admits it under the peer limits and queues it for
//! the copy threads. Idle, it arms `need_wakeup` on every ring and sleeps on their doorbells.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_protocol::attachment::Hint;
use umbp_protocol::entries::{BlockStatus, Cqe, CqeError, Sqe};
use umbp_protocol::wire::Role;
use umbp_protocol::ObjectKey;

use crate::copy::idle_poll;
use crate::copy::job::Job;
use crate::copy::job_blocks::Candidate;
use crate::observe::stats::Counters;
use crate::peer::attachment::Attachment;
use crate::peer::heartbeat;
use crate::peer::validate;
use crate::poller::Poller;
use crate::PoolInner;

/// Submissions taken from one ring before looking at the next (fairness).
const BATCH: usize = 64;
/// How long the thread keeps polling past a peer's last transfer in flight.
const SPIN: Duration = Duration::from_micros(50);
/// How long the thread keeps polling after the last work while a peer has transfers in
/// flight: longer than one 64 MiB copy (~1.2 ms at 55 GB/s).
const INFLIGHT_POLL: Duration = Duration::from_millis(2);
const TOKEN_WAKE: u64 = u64::MAX;
/// How often a peer whose SQ is paused (it does not reap) is checked for having reaped.
const PAUSED_POLL: Duration = Duration::from_millis(2);
/// Touch hints applied per hold of the store lock (about 0.35 µs each, on the 2-core VM):
/// a copy thread waits at most one batch for its stage's reservations.
const HINT_BATCH: usize = 32;

pub fn run(inner: &Arc<PoolInner>) {
    let mut poller = Poller::new().expect("epoll");
    poller.add(inner.service_wake.fd(), TOKEN_WAKE).expect("epoll add");
    let mut watched: HashMap<u32, Arc<Attachment>> = HashMap::new();
    let mut sqes = Vec::with_capacity(BATCH);
    let mut last_work = Instant::now();
    // Last time a worker peer had a transfer in flight (see INFLIGHT_POLL).
    let mut last_inflight = Instant::now().checked_sub(SPIN).unwrap_or_else(Instant::now);
    let mut last_hints = Instant::now();
    let mut heartbeat = heartbeat::Heartbeat::new(&inner.store);
    while !inner.is_shutting_down() {
        // Every round, busy or idle (the sleep below is at most one heartbeat period while
        // a scheduler is attached): schedulers read an old heartbeat as a stalled pool.
        heartbeat.beat();
        let current = inner.attachments.lock().expect("attachments lock").clone();
        sync_watch_list(&mut poller, &mut watched, &current);
        let mut worked = false;
        let mut paused = false;
        for att in &current {
            if !att.is_alive() {
                continue;
            }
            if att.role == Role::Worker {
                att.flush_completions();
                // A peer that does not reap is not read: its SQ fills and it gets
                // backpressure, instead of the pool queueing its completions forever.
                if att.completions_backed_up() {
                    paused = true;
                    continue;
                }
                worked |= drain_submissions(inner, att, &mut sqes);
                att.flush_completions();
            }
        }
        if last_hints.elapsed() >= Duration::from_millis(5) {
            drain_hints(inner, &current);
            last_hints = Instant::now();
        }
        if worked {
            last_work = Instant::now();
            continue;
        }
        // Idle since this thread's last work or a copy thread's last completion, whichever
        // is later: a worker's next submission follows its completion.
        let idle = inner.idle_since(last_work);
        if idle_poll::poll_pause(idle, inner.idle_poll()) {
            continue;
        }
        // A peer with transfers in flight submits again right after their completion
        // (one object at a time, say): polling, not sleeping, through the copy and SPIN
        // past its completion saves the wake-up on its doorbell (tens of µs on a VM).
        // Yields: never starves the copy threads on a small machine.
        if idle < INFLIGHT_POLL {
            if current.iter().any(|a| a.role == Role::Worker && a.is_alive() && a.inflight.load(Ordering::Acquire) > 0) {
                last_inflight = Instant::now();
            }
            if last_inflight.elapsed() < SPIN {
                std::thread::yield_now();
                continue;
            }
        }
        // Arm every ring; sleep only if all are still empty.
        crate::fault::pass(crate::fault::HoldPoint::ServiceBeforeArm);
        let mut all_empty = true;
        // A paused SQ is not armed: its pending entries are not work until its peer reaps.
        for att in current.iter().filter(|a| a.role == Role::Worker && a.is_alive() && !a.sq_paused.load(Ordering::Acquire)) {
            // The guard must end before `corrupt` (which takes `attachments`): a guard
            // taken in a `match` head lives through every arm (docs/architecture.md,
            // "Lock order").
            let armed = att.sq.lock().expect("sq lock").prepare_sleep();
            match armed {
                Ok(true) => {}
                Ok(false) => all_empty = false,
                Err(e) => corrupt(inner, att, e),
            }
        }
        // Work is coming (a ring was not empty, or a doorbell rang): poll again after it.
        // A wake by timeout or for an attachment change is no work: with a long
        // `idle_poll` the thread would otherwise never really sleep.
        let mut woken_for_work = !all_empty;
        let mut slept = false;
        if all_empty {
            // Announce the sleep, then look once more for a completion that came since
            // (pairs with PoolInner::note_completion: one of the two sees the other).
            inner.service_asleep.store(true, Ordering::SeqCst);
            slept = inner.idle_since(last_work) >= inner.idle_poll();
        }
        if slept {
            let has_schedulers = current.iter().any(|a| a.role == Role::Scheduler);
            // A paused peer is polled for reaping (it rings no doorbell when it reaps).
            let timeout = if paused {
                PAUSED_POLL
            } else if has_schedulers {
                heartbeat::PERIOD
            } else {
                Duration::from_millis(100)
            };
            for token in poller.wait(Some(timeout)) {
                if token == TOKEN_WAKE {
                    inner.service_wake.drain();
                } else if let Some(a) = watched.get(&(token as u32)) {
                    a.doorbell.drain();
                    woken_for_work = true;
                }
            }
        }
        inner.service_asleep.store(false, Ordering::SeqCst);
        if slept && woken_for_work {
            Counters::add(&inner.counters.service_wakeups, 1);
            adapt_idle_poll(inner, inner.idle_since(last_work));
        }
        for att in current.iter().filter(|a| a.role == Role::Worker) {
            att.sq.lock().expect("sq lock").finish_sleep();
        }
        if woken_for_work {
            last_work = Instant::now();
        }
    }
}

/// Work woke the thread `gap` after the pool's last activity: the idle-poll window adapts
/// (idle_poll.rs). Only this thread writes the window.
fn adapt_idle_poll(inner: &PoolInner, gap: Duration) {
    let window = idle_poll::after_sleep(inner.config.idle_poll, inner.idle_poll(), gap);
    if window != inner.idle_poll() {
        tracing::trace!(gap_us = gap.as_micros() as u64, window_us = window.as_micros() as u64, "idle poll window");
    }
    inner.idle_poll_ns.store(window.as_nanos() as u64, Ordering::Relaxed);
}

fn sync_watch_list(poller: &mut Poller, watched: &mut HashMap<u32, Arc<Attachment>>, current: &[Arc<Attachment>]) {
    watched.retain(|id, a| {
        let keep = current.iter().any(|c| c.id == *id);
        if !keep {
            poller.remove(a.doorbell.fd());
        }
        keep
    });
    for a in current.iter().filter(|a| a.role == Role::Worker) {
        if let std::collections::hash_map::Entry::Vacant(slot) = watched.entry(a.id) {
            let _ = poller.add(a.doorbell.fd(), a.id as u64);
            slot.insert(a.clone());
        }
    }
}

fn corrupt(inner: &PoolInner, att: &Arc<Attachment>, e: umbp_protocol::ProtocolError) {
    tracing::warn!(attachment = att.id, pid = att.pid, "submission ring corrupted: {e}; detaching");
    crate::fault::pass(crate::fault::HoldPoint::ServiceCorrupt);
    crate::peer::server::detach(inner, att, "detached after ring corruption");
}

fn drain_submissions(inner: &Arc<PoolInner>, att: &Arc<Attachment>, sqes: &mut Vec<Sqe>) -> bool {
    sqes.clear();
    let popped = att.sq.lock().expect("sq lock").pop_batch(sqes, BATCH);
    match popped {
        Ok(0) => false,
        Ok(_) => {
            for sqe in sqes.iter() {
                handle(inner, att, *sqe);
            }
            true
        }
        Err(e) => {
            corrupt(inner, att, e);
            false
        }
    }
}

fn reject(inner: &PoolInner, att: &Attachment, sqe: &Sqe, err: CqeError) {
    reject_with(inner, att, sqe, err, 0);
}

fn reject_with(inner: &PoolInner, att: &Attachment, sqe: &Sqe, err: CqeError, detail: u64) {
    // A worker stream may be waiting on this load's fence word (docs/gpu.md "Stream-ordered transfers", umbp_gpu::fence).
    crate::copy::finish::signal_load_fence(att, sqe, false);
    Counters::add(&inner.counters.rejected_submissions, 1);
    att.counters.errors.fetch_add(1, Ordering::Relaxed);
    att.complete(Cqe { user_data: sqe.user_data, result: -(err as i32), reserved: detail, ..Cqe::default() });
}

/// Validates one submission (a private copy) and queues it for a copy thread.
fn handle(inner: &Arc<PoolInner>, att: &Arc<Attachment>, sqe: Sqe) {
    let accepted = Instant::now();
    Counters::add(&inner.counters.submissions, 1);
    att.counters.submissions.fetch_add(1, Ordering::Relaxed);
    let layouts = &att.layouts;
    let sub = match validate::check_sqe(&sqe, &att.arena, |g| layouts.read().expect("layouts lock").get(&g).cloned()) {
        Ok(validate::SqeCheck::Nop) => return att.complete(Cqe { user_data: sqe.user_data, ..Cqe::default() }),
        Ok(validate::SqeCheck::Transfer(sub)) => sub,
        Err(e) => return reject(inner, att, &sqe, e),
    };
    // Per-peer limits: a peer may not have more work in flight than its completion ring
    // holds, --max-inflight submissions, or --max-inflight-bytes.
    let bytes = sub.bytes();
    let admitted = validate::admit(
        att.inflight.load(Ordering::Acquire),
        att.inflight_bytes.load(Ordering::Acquire),
        att.layout.cq_entries,
        bytes,
        &inner.config.limits,
    );
    if let Err(reason) = admitted {
        Counters::add(&inner.counters.busy_refusals, 1);
        if att.counters.busy.fetch_add(1, Ordering::Relaxed).is_multiple_of(1024) {
            tracing::warn!(
                attachment = att.id,
                pid = att.pid,
                limit = reason.limit_name(),
                "submission refused (Busy): the peer is over its in-flight limit"
            );
        }
        return reject_with(inner, att, &sqe, CqeError::Busy, reason as u64);
    }
    let validate::Submission { op, layout, refs, in_range, state_offset } = sub;
    att.counters.blocks.fetch_add(refs.len() as u64, Ordering::Relaxed);
    let mut statuses = vec![BlockStatus::Pending; refs.len()];
    let mut candidates = Vec::with_capacity(refs.len());
    for (i, r) in refs.iter().enumerate() {
        if in_range[i] {
            candidates.push(Candidate { index: i, key: ObjectKey::from_words(r.key), block_id: r.block_id });
        } else {
            statuses[i] = BlockStatus::Invalid;
        }
    }
    att.inflight.fetch_add(1, Ordering::AcqRel);
    att.inflight_bytes.fetch_add(bytes, Ordering::AcqRel);
    // Objects are reserved (stores) or pinned (loads) by the copy thread, stage by stage,
    // so that a large submission's first copies start before its last blocks are looked at.
    let job = Job {
        att: att.clone(),
        sqe,
        op,
        layout,
        candidates,
        blocks: Vec::new(),
        statuses,
        state_offset,
        cancelled: false,
        accepted,
        submitted: Instant::now(),
        ahead: Default::default(),
    };
    if job.candidates.is_empty() {
        crate::copy::finish::finish(inner, job, &[], 0);
    } else {
        crate::copy::transfer::dispatch(inner, job);
    }
}

/// Touch hints from schedulers: count as use and protect the object for the lease, for
/// keys of the scheduler's own namespace (or its uid's, under --namespace-acl) only, within
/// its uid's lease cap (`ObjectStore::touch_hint`).
fn drain_hints(inner: &PoolInner, current: &[Arc<Attachment>]) {
    let mut hints: Vec<Hint> = Vec::new();
    for att in current.iter().filter(|a| a.role == Role::Scheduler && a.is_alive()) {
        hints.clear();
        let r = att.hints.lock().expect("hints lock").pop_batch(&mut hints, 4096);
        if let Err(e) = r {
            corrupt(inner, att, e);
        }
        if hints.is_empty() {
            continue;
        }
        Counters::add(&inner.counters.hints, hints.len() as u64);
        let acl = inner.config.namespace_acl.get(&att.uid).map_or(&[][..], |v| v.as_slice());
        let now = Instant::now();
        let mut store = inner.store.objects.lock().expect("store lock");
        for (i, batch) in hints.chunks(HINT_BATCH).enumerate() {
            if i > 0 {
                // The hints of a lookup arrive right before the load of the same prefix:
                // that load's copy thread goes first.
                store =
                    inner.store.objects.yield_to_urgent(store, crate::store::priority_lock::BACKGROUND_YIELD_PATIENCE).expect("store lock");
            }
            for h in batch {
                let key = crate::store::objects::GroupKey::new(att.group, ObjectKey::from_words(h.key));
                store.touch_hint(att.uid, att.namespace, acl, key, inner.config.lease, now);
            }
        }
    }
}
