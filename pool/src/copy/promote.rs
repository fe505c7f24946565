//! Pipelined promotion (look-ahead): a load's objects on a lower tier (SSD, a remote pool)
//! are fetched into DRAM by the pool's promotion threads ahead of the load's copy thread,
//! so that the fetch of the next stage (and of the peer's next queued load) runs while the
//! copy thread copies the current one to the worker.
//!
//! The copy thread *launches* a range of a load's candidates: under the store lock each one
//! on a lower tier gets its DRAM allocation and is marked promoting, pinned for that load
//! (`begin_promotion`), exactly as a synchronous promotion does; the batch (a [`Ticket`])
//! goes to a promotion thread, which fetches through the tier's `TierSource` outside the
//! lock and finishes each promotion under the lock (published in DRAM and still pinned for
//! the load, or dropped: a miss). When the copy thread reaches the stage, it *takes* the
//! ticket: it waits for it (while its peer lives) and adds the promoted objects to the
//! stage like pinned DRAM objects; a failed fetch is a miss for those blocks only.
//!
//! Bounds and endings:
//! - A load's current stage is always launched; what lies beyond it is launched only while
//!   the pool's look-ahead (bytes of DRAM promoted or promoting for stages not reached yet)
//!   stays within `PoolConfig::promotion_ahead_bytes` (0 = no look-ahead at all): a huge
//!   load cannot take all DRAM.
//! - A load that ends before it took a ticket (cancelled, failed, its peer gone, the pool
//!   stopping) abandons it: its promoted objects are unpinned (they stay in DRAM, published,
//!   evictable, like a prefetch's) once the fetch is done; nothing stays pinned or promoting.
//! - A promotion thread that panics inside a fetch ends those promotions as failed through
//!   `tier::Promotions` (remote ones abandoned first: their DRAM is quarantined), completes the
//!   ticket as all-failed (the load sees misses, never waits forever) and keeps serving.
//!
//! Locks: a ticket's own mutex and a load's look-ahead mutex are never held while the store
//! lock is taken, nor the other way round.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use umbp_protocol::entries::BlockStatus;
use umbp_protocol::location::Tier;

use crate::copy::job_blocks::{Candidate, JobBlock};
use crate::peer::attachment::Attachment;
use crate::store::objects::GroupKey;
use crate::tier::{Promotion, Promotions};
use crate::PoolInner;

/// The pool's promotion threads' side: where tickets go, and the look-ahead in DRAM.
pub struct Promoter {
    tx: crossbeam_channel::Sender<Arc<Ticket>>,
    /// Bytes of DRAM held by launched look-ahead tickets not taken (nor abandoned) yet.
    ahead_bytes: AtomicU64,
    /// `PoolConfig::promotion_ahead_bytes`, at most a quarter of DRAM.
    window: u64,
    /// Objects launched ahead of their load's current stage (counter).
    launched_ahead: AtomicU64,
}

/// Promotion threads per pool.
pub const PROMOTION_THREADS: usize = 2;

impl Promoter {
    /// `window`: `PoolConfig::promotion_ahead_bytes`; the look-ahead never holds more than a
    /// quarter of the pool's `dram_bytes`.
    pub fn new(window: u64, dram_bytes: u64) -> (Self, crossbeam_channel::Receiver<Arc<Ticket>>) {
        let (tx, rx) = crossbeam_channel::unbounded();
        (Self { tx, ahead_bytes: AtomicU64::new(0), window: window.min(dram_bytes / 4), launched_ahead: AtomicU64::new(0) }, rx)
    }

    /// Objects promoted ahead of their load's current stage so far.
    pub fn launched_ahead(&self) -> u64 {
        self.launched_ahead.load(Ordering::Relaxed)
    }

    /// Bytes of DRAM the look-ahead holds now (the pool report's `promotion_ahead_bytes`).
    pub fn ahead_bytes(&self) -> u64 {
        self.ahead_bytes.load(Ordering::Relaxed)
    }

    /// Whether look-ahead is on at all.
    pub fn enabled(&self) -> bool {
        self.window > 0
    }
}

/// One promotion of a ticket.
struct Item {
    /// Position of the candidate in its load's `candidates`.
    pos: usize,
    cand: Candidate,
    offset: u64,
    tier: Tier,
    namespace: u128,
}

enum TicketState {
    InFlight,
    Done(Vec<bool>),
    /// The load took the results.
    Taken,
    /// The load ended first: whoever sees the results unpins them.
    Abandoned,
}

/// A batch of promotions begun for one load, fetched by a promotion thread.
pub struct Ticket {
    group: u32,
    size: u64,
    items: Vec<Item>,
    /// Counted in the pool's look-ahead bytes until taken or abandoned.
    counted: AtomicBool,
    state: Mutex<TicketState>,
    done: Condvar,
}

impl Ticket {
    fn first_pos(&self) -> usize {
        self.items.first().map_or(usize::MAX, |i| i.pos)
    }

    fn key(&self, i: &Item) -> GroupKey {
        GroupKey::new(self.group, i.cand.key)
    }

    fn uncount(&self, inner: &PoolInner) {
        if self.counted.swap(false, Ordering::AcqRel) {
            inner.promoter.ahead_bytes.fetch_sub(self.items.len() as u64 * self.size, Ordering::AcqRel);
        }
    }

    /// Unpins the objects promoted for a load that is gone.
    fn unpin(&self, inner: &PoolInner, results: &[bool]) {
        self.uncount(inner);
        if !results.iter().any(|ok| *ok) {
            return;
        }
        let mut store = inner.store.objects.lock().unwrap_or_else(|p| p.into_inner());
        for (item, ok) in self.items.iter().zip(results) {
            if *ok {
                store.finish_load(self.key(item));
            }
        }
    }

    /// The promotion thread is done with it: hands the results to the load, or unpins
    /// them if the load is gone.
    fn complete(&self, inner: &PoolInner, results: Vec<bool>) {
        let abandoned = {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            match *st {
                TicketState::Abandoned => true,
                _ => {
                    *st = TicketState::Done(results.clone());
                    false
                }
            }
        };
        self.done.notify_all();
        if abandoned {
            self.unpin(inner, &results);
        }
    }
}

/// A load's look-ahead: its tickets not taken yet and which candidates are handled.
/// Shared (`Arc`) because the copy thread running the peer's previous load may launch
/// the first tickets of this one while it waits in the peer's queue.
#[derive(Default)]
pub struct Ahead {
    state: Mutex<AheadState>,
}

#[derive(Default)]
struct AheadState {
    /// Candidates before this position were considered for launching.
    launched: usize,
    tickets: Vec<Arc<Ticket>>,
    /// By candidate position: its block is in the load's `blocks` or has its status.
    handled: Vec<bool>,
    /// The load ended: nothing more is launched for it.
    closed: bool,
}

impl Ahead {
    /// Candidates before this position were considered for launching.
    fn launched(&self) -> (usize, bool) {
        let s = self.state.lock().expect("look-ahead lock");
        (s.launched, s.closed)
    }

    /// Candidates before `reached` were considered; the load's state after it (`closed`:
    /// it ended). `ticket`, if any, joins the load's tickets unless it ended.
    fn mark_launched(&self, reached: usize, ticket: Option<&Arc<Ticket>>) -> bool {
        let mut s = self.state.lock().expect("look-ahead lock");
        s.launched = s.launched.max(reached);
        if let Some(t) = ticket {
            if !s.closed {
                s.tickets.push(t.clone());
            }
        }
        s.closed
    }

    /// Positions in `range` not handled yet (not taken from a ticket).
    pub fn unhandled(&self, range: std::ops::Range<usize>) -> Vec<usize> {
        let s = self.state.lock().expect("look-ahead lock");
        range.filter(|&p| !s.handled.get(p).copied().unwrap_or(false)).collect()
    }

    /// Marks candidates as handled by the load's own reservation (a ticket that races in
    /// later for one of them only unpins it).
    pub fn mark_handled(&self, n: usize, positions: impl Iterator<Item = usize>) {
        let mut s = self.state.lock().expect("look-ahead lock");
        if s.handled.len() < n {
            s.handled.resize(n, false);
        }
        for p in positions {
            s.handled[p] = true;
        }
    }

    /// The load ends: tickets it did not take are abandoned (their promotions are unpinned
    /// when done), and nothing more is launched for it.
    pub fn close(&self, inner: &PoolInner) {
        let tickets = {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            s.closed = true;
            std::mem::take(&mut s.tickets)
        };
        for t in tickets {
            let done = {
                let mut st = t.state.lock().unwrap_or_else(|p| p.into_inner());
                match std::mem::replace(&mut *st, TicketState::Abandoned) {
                    TicketState::Done(r) => Some(r),
                    TicketState::InFlight => None,
                    other => {
                        *st = other;
                        None
                    }
                }
            };
            // Still in flight: the promotion thread unpins when it completes; until then
            // the bytes count.
            if let Some(results) = done {
                t.unpin(inner, &results);
            }
        }
    }
}

/// Launches the promotions of `candidates[from..to]` of a load of `att` (objects of `size`
/// bytes) that are on a lower tier this pool can fetch from: all of them when `forced`
/// (the load's current stage), else only while the pool's look-ahead stays within its
/// window. Returns the position up to which candidates were considered.
pub fn launch(inner: &PoolInner, att: &Attachment, size: u64, candidates: &[Candidate], ahead: &Ahead, to: usize, forced: bool) -> usize {
    let (from, closed) = ahead.launched();
    let to = to.min(candidates.len());
    if closed || from >= to || inner.is_shutting_down() || (!forced && !inner.promoter.enabled()) {
        return from;
    }
    if inner.store.lower_objects.load(Ordering::Acquire) == 0 {
        // Nothing of the pool below DRAM: the load needs no look-ahead at all, and none of
        // its stages is looked at again, without taking the store lock (a look-ahead per
        // stage cost 60-170 us before a kv4k load's first byte). An object demoted
        // meanwhile is promoted by its stage's own reservation.
        ahead.mark_launched(candidates.len(), None);
        return candidates.len();
    }
    let strict = !inner.config.namespace_acl.is_empty();
    let mut items = Vec::new();
    let mut reached = from;
    {
        let mut store = inner.store.objects.lock_urgent().expect("store lock");
        for (pos, c) in candidates.iter().enumerate().take(to).skip(from) {
            let key = GroupKey::new(att.group, c.key);
            let lower =
                [Tier::Ssd, Tier::Remote].into_iter().find(|&t| inner.tiers.source(t).is_some() && store.size_on(key, t) == Some(size));
            if lower.is_some() && !forced {
                let held = inner.promoter.ahead_bytes.load(Ordering::Acquire);
                if held + (items.len() as u64 + 1) * size > inner.promoter.window {
                    break;
                }
            }
            reached = pos + 1;
            // A tenant under --namespace-acl never loads another namespace's object: left
            // to the load's own reservation, which reports the miss.
            if lower.is_none() || (strict && store.namespace_of(key).is_some_and(|ns| ns != att.namespace)) {
                continue;
            }
            // No DRAM free now: left to the load's own reservation (it waits for room).
            if let Some((offset, tier, namespace)) = store.begin_promotion(key) {
                items.push(Item { pos, cand: *c, offset, tier, namespace });
            }
        }
    }
    if !items.is_empty() {
        inner.store.wake_evictor();
    }
    let ticket = (!items.is_empty()).then(|| {
        let counted = !forced;
        if counted {
            inner.promoter.ahead_bytes.fetch_add(items.len() as u64 * size, Ordering::AcqRel);
            inner.promoter.launched_ahead.fetch_add(items.len() as u64, Ordering::Relaxed);
        }
        Arc::new(Ticket {
            group: att.group,
            size,
            items,
            counted: AtomicBool::new(counted),
            state: Mutex::new(TicketState::InFlight),
            done: Condvar::new(),
        })
    });
    let closed = ahead.mark_launched(reached, ticket.as_ref());
    if let Some(t) = ticket {
        if closed {
            // The load ended meanwhile: the ticket runs abandoned (unpinned when done).
            *t.state.lock().expect("ticket lock") = TicketState::Abandoned;
        }
        if let Err(e) = inner.promoter.tx.send(t) {
            // Only if the promotion threads are gone: finish these as failed here.
            let t = e.into_inner();
            fail_all(inner, &t);
        }
    }
    reached
}

/// Finishes a ticket's promotions as failed without fetching.
fn fail_all(inner: &PoolInner, t: &Ticket) {
    {
        let mut store = inner.store.objects.lock().unwrap_or_else(|p| p.into_inner());
        for i in &t.items {
            store.finish_promotion(t.key(i), i.offset, false);
        }
    }
    t.complete(inner, vec![false; t.items.len()]);
}

/// Takes the load's tickets holding any candidate before position `to`: waits for each
/// (while `keep_waiting`: the peer lives and wants the load, the pool runs), appends the
/// promoted objects to `blocks` and writes `Missing` for those whose fetch failed.
/// Candidates taken are marked handled.
pub fn take(
    inner: &PoolInner,
    keep_waiting: &dyn Fn() -> bool,
    ahead: &Ahead,
    to: usize,
    blocks: &mut Vec<JobBlock>,
    statuses: &mut [BlockStatus],
    n: usize,
) {
    let tickets: Vec<Arc<Ticket>> = {
        let mut s = ahead.state.lock().expect("look-ahead lock");
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut s.tickets).into_iter().partition(|t| t.first_pos() < to);
        s.tickets = later;
        due
    };
    for t in tickets {
        let results = {
            let mut st = t.state.lock().expect("ticket lock");
            loop {
                match std::mem::replace(&mut *st, TicketState::Taken) {
                    TicketState::Done(r) => break Some(r),
                    TicketState::InFlight if keep_waiting() => {
                        *st = TicketState::InFlight;
                        st = t.done.wait_timeout(st, Duration::from_millis(50)).expect("ticket lock").0;
                    }
                    // The peer is gone or gave up (or the pool stops): the ticket is abandoned.
                    _ => {
                        *st = TicketState::Abandoned;
                        break None;
                    }
                }
            }
        };
        let Some(results) = results else {
            // Its blocks fail (the load's completion is not read anyway).
            let mut s = ahead.state.lock().expect("look-ahead lock");
            if s.handled.len() < n {
                s.handled.resize(n, false);
            }
            for i in &t.items {
                if !s.handled[i.pos] {
                    s.handled[i.pos] = true;
                    statuses[i.cand.index] = BlockStatus::Failed;
                }
            }
            continue;
        };
        t.uncount(inner);
        let mut duplicates = Vec::new();
        {
            let mut s = ahead.state.lock().expect("look-ahead lock");
            if s.handled.len() < n {
                s.handled.resize(n, false);
            }
            for (i, ok) in t.items.iter().zip(&results) {
                if s.handled[i.pos] {
                    // Handled by the load's own reservation meanwhile (a race with the
                    // launch): this pin is surplus.
                    if *ok {
                        duplicates.push(t.key(i));
                    }
                    continue;
                }
                s.handled[i.pos] = true;
                if *ok {
                    blocks.push(JobBlock {
                        index: i.cand.index,
                        key: i.cand.key,
                        group: t.group,
                        block_id: i.cand.block_id,
                        offset: i.offset,
                    });
                } else {
                    statuses[i.cand.index] = BlockStatus::Missing;
                }
            }
        }
        if !duplicates.is_empty() {
            let mut store = inner.store.objects.lock_urgent().expect("store lock");
            for k in duplicates {
                store.finish_load(k);
            }
        }
    }
}

/// A promotion thread: fetches tickets' objects until the pool stops (and its queue is
/// empty). A panic inside one ticket's fetch fails that ticket only.
pub fn run_promotion_thread(inner: &PoolInner, rx: crossbeam_channel::Receiver<Arc<Ticket>>) {
    loop {
        let t = match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(t) => t,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) if !inner.is_shutting_down() => continue,
            Err(_) => return,
        };
        match std::panic::catch_unwind(AssertUnwindSafe(|| fetch(inner, &t))) {
            Ok(results) => t.complete(inner, results),
            Err(panic) => {
                let what =
                    panic.downcast_ref::<&str>().copied().or_else(|| panic.downcast_ref::<String>().map(String::as_str)).unwrap_or("?");
                tracing::error!(
                    objects = t.items.len(),
                    "promotion thread panicked: {what}; these promotions failed (misses), the pool keeps serving"
                );
                // The guard in `fetch` finished them as failed while unwinding.
                t.complete(inner, vec![false; t.items.len()]);
            }
        }
    }
}

/// Fetches a ticket's objects and finishes their promotions; true = published in DRAM
/// (still pinned for the load).
fn fetch(inner: &PoolInner, t: &Ticket) -> Vec<bool> {
    // Finished as failed if the fetch panics.
    let promotions = Promotions::new(
        inner.tier_work(),
        t.items.iter().map(|i| Promotion { key: t.key(i), offset: i.offset, size: t.size, tier: i.tier, namespace: i.namespace }).collect(),
    );
    let mut fetched = promotions.fetch();
    for (ok, i) in fetched.iter_mut().zip(&t.items) {
        *ok = *ok && !crate::fault::fetch_fails(i.cand.key);
    }
    let mut store = inner.store.objects.lock().expect("store lock");
    promotions.finish(&mut store, &fetched)
}
