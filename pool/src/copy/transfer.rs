//! Copy threads: run one submission at a time in stages — reserve or pin its objects,
//! copy through the device backends, publish (stores) or unpin (loads) — and post the
//! completion.

use std::cell::{Cell, RefCell};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_protocol::entries::{BlockStatus, Opcode};
use umbp_protocol::layout::{push_coalesced, CopyOp};
use umbp_protocol::stage_split::{self, StageSplit};
use umbp_protocol::transfer_state::TransferState;

use crate::copy::finish::{fail_landed, fence_word, finish, finish_cancelled, settle};
use crate::copy::idle_poll;
use crate::copy::job::Job;
use crate::copy::job_blocks::{Candidate, JobBlock};
use crate::observe::stats::Counters;
use crate::peer::attachment::Attachment;
use crate::store::objects::{GroupKey, LoadReservation, StoreReservation};
use crate::tier::{Promotion, Promotions};
use crate::PoolInner;

/// Hands a job to the copy threads, or queues it when its peer already occupies its share
/// of them (`copy_threads_per_peer`, queued behind the peer's own jobs) or, while more than
/// one uid is attached, when its uid does (`copy_threads_per_uid`): one peer, or one uid's
/// many peers, whose copies wait never stall another uid.
pub fn dispatch(inner: &PoolInner, job: Job) {
    if let Some(job) = inner.copy_slots.take_peer_slot(job, inner.config.copy_threads_per_peer()) {
        admit_uid(inner, job);
    }
}

/// The per-uid cap on a job that holds a slot of its peer's: sent now, or held back until
/// one of its uid's jobs finishes (so a held-back job's uid always has one running, whose
/// end sends it).
fn admit_uid(inner: &PoolInner, job: Job) {
    if let Some(job) = inner.copy_slots.take_uid_slot(job, uid_cap(inner)) {
        send(inner, job);
    }
}

fn uid_cap(inner: &PoolInner) -> Option<usize> {
    inner.config.copy_threads_per_uid(inner.attached_uids.load(Ordering::Relaxed))
}

fn send(inner: &PoolInner, job: Job) {
    if let Err(e) = inner.jobs.send(job) {
        // Only at shutdown: nothing is reserved yet; the blocks fail.
        finish_cancelled(inner, e.into_inner());
    }
}

/// A copy thread is done with one of `att`'s jobs: its uid's slot goes to the next
/// held-back jobs now under the cap, its peer's slot to the peer's next waiting job, if any.
fn release_slot(inner: &PoolInner, att: &Attachment) {
    for job in inner.copy_slots.release_uid_slot(att.uid, uid_cap(inner)) {
        send(inner, job);
    }
    if let Some(job) = inner.copy_slots.release_peer_slot(att.id) {
        admit_uid(inner, job);
    }
}

pub fn run_copy_thread(inner: &PoolInner, rx: crossbeam_channel::Receiver<Job>) {
    let mut last_job = Instant::now();
    // This thread holds `inner.copy_poller`: it polls through the whole idle-poll window.
    let mut poller = false;
    loop {
        let mut job = match rx.try_recv() {
            Ok(job) => job,
            // A copy thread that just finished a job polls for the next: a worker's next
            // submission usually follows its completion within microseconds, and a
            // sleeping thread takes tens of microseconds to wake (~55 µs measured in the
            // `queue` phase on the H200 VM), as long as a 1 MiB copy. Past the short
            // spin, one thread at a time goes on polling (idle_poll.rs); every thread
            // polling would slow the copies on the cores they share (1 MiB objects one
            // at a time ran 0.9x with all eight polling, H200 VM).
            Err(crossbeam_channel::TryRecvError::Empty) => {
                let idle = last_job.elapsed();
                if !poller && idle >= idle_poll::SHORT_POLL && idle < inner.idle_poll() {
                    poller = inner.copy_poller.compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed).is_ok();
                }
                if idle_poll::poll_pause(idle, if poller { inner.idle_poll() } else { idle_poll::SHORT_POLL.min(inner.idle_poll()) }) {
                    continue;
                }
                release_poller(inner, &mut poller);
                // Blocked until a job comes: a thread that wakes by timeout does not poll
                // (only one fresh from its own job does).
                loop {
                    match rx.recv_timeout(Duration::from_millis(100)) {
                        Ok(job) => break job,
                        Err(crossbeam_channel::RecvTimeoutError::Timeout) if !inner.is_shutting_down() => {}
                        Err(_) => return,
                    }
                }
            }
            Err(crossbeam_channel::TryRecvError::Disconnected) => {
                release_poller(inner, &mut poller);
                return;
            }
        };
        // Busy now: another idle thread may take over polling.
        release_poller(inner, &mut poller);
        let att = job.att.clone();
        if !att.is_alive() || inner.is_shutting_down() {
            finish_cancelled(inner, job);
            release_slot(inner, &att);
            continue;
        }
        let picked = Instant::now();
        let phases = inner.counters.phases(job.op);
        Counters::add(&phases.admit_ns, ns_between(job.accepted, job.submitted));
        Counters::add(&phases.queue_ns, ns_between(job.submitted, picked));
        // A bug in one copy must not hang its peer or take this thread with it.
        let in_device = Cell::new(false);
        let copied = match std::panic::catch_unwind(AssertUnwindSafe(|| copy(inner, &mut job, &in_device))) {
            Ok(copied) => copied,
            Err(panic) => contain_panic(inner, &mut job, panic.as_ref(), in_device.get()),
        };
        let tail = Instant::now();
        job.cancelled = copied.cancelled;
        finish(inner, job, &copied.failed, copied.settled);
        release_slot(inner, &att);
        Counters::add(&phases.finish_ns, tail.elapsed().as_nanos() as u64);
        Counters::add(&phases.jobs, 1);
        last_job = Instant::now();
    }
}

fn release_poller(inner: &PoolInner, poller: &mut bool) {
    if std::mem::take(poller) {
        inner.copy_poller.store(false, Ordering::Release);
    }
}

/// After a copy thread panicked inside `copy`: the job's blocks not settled yet fail.
/// Loads' objects are unpinned (a stray DMA only reads them). Stores' reservations are
/// freed when the panic came from this file's planning or settling (`in_device` false):
/// the device layer synchronizes every stream before such a panic leaves it (umbp_gpu
/// `build_or_drain`), and host copies are done when their call returns, so no DMA writes
/// them any more. A panic inside the device layer itself leaves its copies' state unknown:
/// those objects are quarantined (objects/quarantine.rs; until the pool restarts). If the
/// panic left the object store's lock poisoned, its state cannot be trusted: the pool
/// stops at once (workers see it gone and recompute; a supervisor restarts it) rather than
/// serve from it.
fn contain_panic(inner: &PoolInner, job: &mut Job, panic: &(dyn std::any::Any + Send), in_device: bool) -> Copied {
    let what = panic.downcast_ref::<&str>().copied().or_else(|| panic.downcast_ref::<String>().map(String::as_str)).unwrap_or("?");
    tracing::error!(attachment = job.att.id, op = ?job.op, "copy thread panicked: {what}; the submission fails, the pool keeps serving");
    let Ok(mut store) = inner.store.objects.lock() else {
        tracing::error!("the object store's lock is poisoned by that panic: stopping the pool");
        std::process::abort();
    };
    let mut leaked = 0;
    for b in &job.blocks {
        if job.statuses[b.index] != BlockStatus::Pending {
            continue;
        }
        match job.op {
            Opcode::Store if in_device => leaked += store.quarantine(b.object()),
            Opcode::Store => {
                store.finish_store(b.object(), false);
            }
            _ => store.finish_load(b.object()),
        }
        job.statuses[b.index] = BlockStatus::Failed;
    }
    if leaked > 0 {
        tracing::error!(
            bytes = leaked,
            "the panic came from inside the device layer: DRAM of the failed stores quarantined (not reused until the pool restarts)"
        );
    }
    Copied { failed: Vec::new(), settled: job.blocks.len(), cancelled: false }
}

fn ns_between(a: Instant, b: Instant) -> u64 {
    b.saturating_duration_since(a).as_nanos() as u64
}

/// What [`copy`] did: submission positions whose copy failed, and how many of
/// `job.blocks` (a prefix) are settled already — published or unpinned, status written —
/// because their stage landed while later stages still copied.
struct Copied {
    failed: Vec<usize>,
    settled: usize,
    /// The worker abandoned the transfer before its first stage: nothing was touched.
    cancelled: bool,
}

/// The copy thread's view of a job while its stages run: the planning closure reserves
/// and the landing closure settles, both through this.
struct Progress<'j> {
    candidates: &'j [Candidate],
    blocks: &'j mut Vec<JobBlock>,
    statuses: &'j mut [BlockStatus],
    /// `blocks` range of each stage planned so far.
    stage_blocks: Vec<std::ops::Range<usize>>,
    settled: usize,
    /// A stage could not be claimed (the worker abandoned the transfer): none is issued
    /// from then on.
    abandoned: bool,
    /// Settling a landed stage panicked: that stage's and later stages' unsettled blocks
    /// fail as they land.
    stage_panicked: bool,
    reserve_ns: u64,
    plan_ns: u64,
    first_stage_ns: u64,
    publish_ns: u64,
}

/// Runs the copies of a job, in stages (`--copy-stage-size`): for each stage the copy
/// thread reserves (store) or pins (load) its blocks' objects and plans their copies just
/// before they are enqueued, while the stages before it copy; and it publishes (store) or
/// unpins (load) a stage's blocks as soon as that stage landed, while later ones copy. So
/// a large submission starts moving bytes after its first stage's bookkeeping, and only
/// the last stage's publication remains once the last byte moved.
///
/// All allocations of a stage go to the device layer together, so parts on one GPU (a
/// vLLM worker registers one allocation per layer) run as one batched copy call. A fenced
/// store (`sqe.fence_value != 0`, docs/gpu.md "Stream-ordered transfers") reads device memory only after the worker's
/// stream wrote its fence word; a fenced load has the word written once the bytes landed
/// (on the GPU when possible, see `finish` for the CPU write).
/// `in_device` is true while control is in the device layer rather than in this
/// function's planning or settling closures (read by `contain_panic`).
fn copy(inner: &PoolInner, job: &mut Job, in_device: &Cell<bool>) -> Copied {
    let started = Instant::now();
    let phases = inner.counters.phases(job.op);
    let regions = job.att.regions.read().expect("regions lock").clone();
    let segments = job.layout.segments();
    let groups = job.layout.segments_by_alloc();
    let mut group_regions = Vec::with_capacity(groups.len());
    for (alloc, _) in groups {
        match regions.get(alloc) {
            Some(r) => group_regions.push(r.as_ref()),
            None => {
                tracing::warn!(attachment = job.att.id, alloc, "copy refused: the layout names an allocation that is not registered");
                return Copied { failed: Vec::new(), settled: 0, cancelled: false };
            }
        }
    }
    let fence = match (fence_word(&job.sqe, &regions), job.op) {
        (None, _) => umbp_gpu::Fence::None,
        (Some(Err(e)), Opcode::Store) => {
            // Without its fence a store could read KV the engine has not written yet.
            tracing::warn!(attachment = job.att.id, "store fence unusable: {e}");
            return Copied { failed: Vec::new(), settled: 0, cancelled: false };
        }
        (Some(Err(_)), _) => umbp_gpu::Fence::None,
        (Some(Ok((word, value))), Opcode::Store) => umbp_gpu::Fence::WaitBefore(word, value),
        (Some(Ok((word, value))), _) => umbp_gpu::Fence::SignalAfter(word, value),
    };
    let dir = match job.op {
        Opcode::Store => umbp_gpu::Dir::DeviceToHost,
        Opcode::Load => umbp_gpu::Dir::HostToDevice,
        Opcode::Nop => return Copied { failed: Vec::new(), settled: 0, cancelled: false },
    };
    let size = job.layout.object_bytes();
    let split = stage_split(inner, job.candidates.len(), size, segments.len());
    let (stages, n) = (split.count(), job.candidates.len());
    let progress = RefCell::new(Progress {
        candidates: &job.candidates,
        blocks: &mut job.blocks,
        statuses: &mut job.statuses,
        stage_blocks: Vec::with_capacity(stages),
        settled: 0,
        abandoned: false,
        stage_panicked: false,
        reserve_ns: 0,
        plan_ns: 0,
        first_stage_ns: 0,
        publish_ns: 0,
    });
    let (att, op, ahead) = (&job.att, job.op, &*job.ahead);
    let state = job.state_offset.and_then(|o| att.arena.atomic_u64(o).ok()).map(TransferState::new);
    // The cancel contract (docs/protocol.md §4a): a stage is claimed before anything of it
    // reaches the worker's blocks. A peer whose connection is gone (detached, or its socket
    // hung up: it dropped its worker or died) gave its blocks back as if it abandoned the
    // transfer: nothing of it is claimed either, whatever the worker wrote in the word.
    let claim = |s: usize| !att.peer_gone() && state.is_none_or(|st| st.begin_stage(s as u64));
    // Waits for promotions (another load's, a ticket's, DRAM to promote into) end early
    // once the worker gave up or left: the stage would not be claimed anyway.
    // Checked after a store stage landed, before it is published: the worker abandoned the
    // transfer or its peer is gone (the copies landed before this check, so before the
    // worker took its blocks back, if the check finds neither).
    let store_given_up = || state.is_some_and(|st| st.abandoned()) || att.peer_gone();
    let keep_waiting_for_promotions = || !state.is_some_and(|st| st.abandoned()) && att.is_alive() && !inner.is_shutting_down();
    let plan_stage = |s: usize| -> umbp_gpu::StagePlan<'_> {
        let p = &mut *progress.borrow_mut();
        let t = Instant::now();
        let from = p.blocks.len();
        // A store's reservation waits for nothing: its stage is claimed first, so a worker
        // that gave up keeps its blocks and nothing more is reserved, copied or published.
        if !p.abandoned && op == Opcode::Store {
            p.abandoned = !claim(s);
        }
        if p.abandoned {
            p.stage_blocks.push(from..from);
            return group_regions.iter().map(|r| (*r, Vec::new())).collect();
        }
        let std::ops::Range { start: a, end: b } = split.range(s);
        if op == Opcode::Load {
            // This stage's lower-tier objects go to the promotion threads (if the look-ahead
            // did not already), then later stages' and the peer's next loads' within the
            // look-ahead window: they fetch while this stage copies.
            crate::copy::promote::launch(inner, att, size, p.candidates, ahead, b, true);
            if launch_stages(inner, att, size, p.candidates, ahead, &split, s + 1) {
                launch_next_loads(inner, att);
            }
            crate::copy::promote::take(inner, &keep_waiting_for_promotions, ahead, b, p.blocks, p.statuses, n);
            let rest = ahead.unhandled(a..b);
            let cands: Vec<Candidate> = rest.iter().map(|&i| p.candidates[i]).collect();
            reserve(inner, att, op, size, &cands, p.blocks, p.statuses, &keep_waiting_for_promotions);
            ahead.mark_handled(n, rest.into_iter());
            // A load's stage is claimed only now that its objects are pinned in DRAM, its
            // promotions (SSD reads, remote fetches) done: `Started`, what a cancel then
            // tells the worker, means bytes are moving to its blocks, not that the pool is
            // still fetching into its own DRAM (a cancel during a slow fetch is `Cancelled`
            // and the blocks are the worker's at once). A lost claim unpins what this
            // stage pinned (promoted objects stay in DRAM, published and evictable).
            if !claim(s) {
                p.abandoned = true;
                let undone: Vec<JobBlock> = p.blocks.drain(from..).collect();
                if !undone.is_empty() {
                    let mut store = inner.store.objects.lock_urgent().expect("store lock");
                    for b in &undone {
                        store.finish_load(b.object());
                    }
                }
                for b in &undone {
                    p.statuses[b.index] = BlockStatus::Failed;
                }
                p.stage_blocks.push(from..from);
                return group_regions.iter().map(|r| (*r, Vec::new())).collect();
            }
        } else {
            reserve(inner, att, op, size, &p.candidates[a..b], p.blocks, p.statuses, &keep_waiting_for_promotions);
        }
        crate::fault::check_copy(p.blocks[from..].iter().map(|b| b.key));
        let t_plan = Instant::now();
        p.reserve_ns += ns_between(t, t_plan);
        let stage = &p.blocks[from..];
        let mut plan = Vec::with_capacity(groups.len());
        for ((alloc, segs), region) in groups.iter().zip(&group_regions) {
            let mut ops = Vec::with_capacity(stage.len() * segs.len());
            for b in stage {
                debug_assert!(b.block_id < job.layout.num_blocks(), "block ids are checked at submission");
                for &(i, off) in segs {
                    let seg = &segments[i];
                    push_coalesced(
                        &mut ops,
                        CopyOp {
                            alloc_id: *alloc,
                            device_offset: seg.offset + b.block_id * seg.block_stride,
                            host_offset: b.offset + off,
                            len: seg.page_bytes,
                        },
                    );
                }
            }
            // Every block has a page in every allocation of the layout.
            plan.push((*region, ops));
        }
        p.stage_blocks.push(from..p.blocks.len());
        p.plan_ns += t_plan.elapsed().as_nanos() as u64;
        if s == 0 {
            p.first_stage_ns = ns_between(started, Instant::now());
        }
        plan
    };
    let mut plan = |s: usize| {
        in_device.set(false);
        let plan = plan_stage(s);
        in_device.set(true);
        plan
    };
    let settle_stage = |s: usize| {
        let p = &mut *progress.borrow_mut();
        let t = Instant::now();
        let range = p.stage_blocks[s].clone();
        // A panic while settling a landed stage (a bug) is contained here instead of
        // unwinding through the device layer, which would leave the stages still in flight
        // unwaited for (their copies running while their objects are failed, their fence
        // words written early): the transfer drains, every stage lands and is reported,
        // and the blocks not settled yet fail (their copies landed: nothing to quarantine).
        if !p.stage_panicked {
            let blocks = &p.blocks[range.clone()];
            let statuses = &mut *p.statuses;
            let settled = std::panic::catch_unwind(AssertUnwindSafe(|| {
                // A store the worker abandoned (or whose peer left) may have read blocks
                // that are another request's by now: its landed stage is dropped, never
                // published.
                let dropped: Vec<usize> = match op {
                    Opcode::Store if store_given_up() => blocks.iter().map(|b| b.index).collect(),
                    _ => Vec::new(),
                };
                crate::fault::check_landed(blocks.iter().map(|b| b.key));
                if op == Opcode::Store {
                    // SAFETY: these objects are reserved for this job, their copies
                    // landed, and only the settle below publishes them.
                    unsafe { crate::fault::stored(inner.store.dram.base(), blocks.iter().map(|b| (b.key, b.offset)), size) };
                }
                settle(inner, op, blocks, statuses, &dropped);
            }));
            if let Err(panic) = settled {
                let what =
                    panic.downcast_ref::<&str>().copied().or_else(|| panic.downcast_ref::<String>().map(String::as_str)).unwrap_or("?");
                tracing::error!(attachment = att.id, op = ?op, stage = s, "panic while settling a landed stage: {what}; the transfer drains and its unsettled blocks fail");
                p.stage_panicked = true;
            }
        }
        if p.stage_panicked {
            fail_landed(inner, op, &p.blocks[range.clone()], p.statuses);
        }
        p.settled = range.end;
        p.publish_ns += t.elapsed().as_nanos() as u64;
        Counters::add(&phases.stages, 1);
    };
    let mut stage_landed = |s: usize| {
        in_device.set(false);
        settle_stage(s);
        in_device.set(true);
    };
    // A fenced store's wait for its fence word ends as soon as the worker abandoned it (or
    // left): its blocks are no longer the transfer's, and the wait would hold this copy
    // slot for up to the fence timeout (`store_fence_timeout`) for nothing.
    let keep_waiting = || att.is_alive() && !inner.is_shutting_down() && !(op == Opcode::Store && store_given_up());
    let copy_started = Instant::now();
    let args = umbp_gpu::TransferArgs {
        dir,
        host_base: inner.store.dram.base(),
        fence,
        fence_timeout: inner.config.store_fence_timeout,
        keep_waiting: &keep_waiting,
        engine: inner.config.engine,
    };
    in_device.set(true);
    // SAFETY: every op's host range is an object reserved (store) or pinned (load) for this
    // job in the object store, inside DRAM; nobody else writes it meanwhile (an object is
    // settled only once its stage's copies all landed).
    let result = unsafe { umbp_gpu::transfer_pipelined(&args, stages, &mut plan, &mut stage_landed) };
    in_device.set(false);
    let copy_ns = copy_started.elapsed().as_nanos() as u64;
    let p = progress.into_inner();
    if let Err(e) = &result {
        tracing::warn!(attachment = att.id, "copy failed: {e}");
    }
    // On failure every reserved block not settled yet failed; so did those of a store the
    // worker abandoned (see stage_landed).
    let store_abandoned = op == Opcode::Store && store_given_up();
    let mut failed: Vec<usize> =
        if result.is_err() || store_abandoned { p.blocks[p.settled..].iter().map(|b| b.index).collect() } else { Vec::new() };
    // `settle` searches it; promoted blocks follow pinned ones within a stage.
    failed.sort_unstable();
    if p.abandoned {
        Counters::add(&inner.counters.transfers_cancelled, 1);
    }
    // Time in the device call, less the planning and publishing done inside it.
    let copy_only = copy_ns.saturating_sub(p.reserve_ns + p.plan_ns + p.publish_ns);
    inner.counters.latency.observe_copy(op, copy_only as f64 * 1e-9);
    Counters::add(&phases.reserve_ns, p.reserve_ns);
    Counters::add(&phases.plan_ns, p.plan_ns + ns_between(started, copy_started));
    Counters::add(&phases.copy_ns, copy_only);
    Counters::add(&phases.publish_ns, p.publish_ns);
    Counters::add(&phases.first_stage_ns, p.first_stage_ns);
    Copied { failed, settled: p.settled, cancelled: p.abandoned && p.stage_blocks.first().is_some_and(|r| r.is_empty()) }
}

/// The copy stages of a submission of `blocks` objects of `size` bytes in `pages` pages
/// each, by the pool's settings (`--copy-stage-size`, `--copy-stage-growth`).
fn stage_split(inner: &PoolInner, blocks: usize, size: u64, pages: usize) -> StageSplit {
    let (bytes, growth) = (inner.config.copy_stage_bytes, inner.config.copy_stage_growth_percent);
    let growth = if growth == stage_split::AUTO_GROWTH { stage_split::auto_growth_percent(size / pages.max(1) as u64) } else { growth };
    StageSplit::new(blocks, size, bytes, growth)
}

/// Reserves (store) or pins (load) the objects of `candidates`: reserved ones are
/// appended to `blocks`, the others get their final status (first writer wins: a key
/// present or being written is `AlreadyPresent`; no room is `NotStored`; a load of an
/// absent key is `Missing`).
#[allow(clippy::too_many_arguments)]
fn reserve(
    inner: &PoolInner,
    att: &Attachment,
    op: Opcode,
    size: u64,
    candidates: &[Candidate],
    blocks: &mut Vec<JobBlock>,
    statuses: &mut [BlockStatus],
    keep_waiting: &dyn Fn() -> bool,
) {
    let strict = !inner.config.namespace_acl.is_empty();
    let mut store = inner.store.objects.lock_urgent().expect("store lock");
    let mut no_room = false;
    // Loads of objects on a lower tier: promoted (fetched into DRAM) below, outside the lock.
    let mut lower: Vec<Candidate> = Vec::new();
    for c in candidates {
        let block = |offset| JobBlock { index: c.index, key: c.key, group: att.group, block_id: c.block_id, offset };
        // Objects are (tenant group, key): another group's object of the same key is
        // invisible here, for stores (no AlreadyPresent) and loads alike.
        let key = GroupKey::new(att.group, c.key);
        match op {
            Opcode::Store => match store.reserve_store(att.namespace, key, size, att.id) {
                StoreReservation::Reserved { offset } => blocks.push(block(offset)),
                StoreReservation::AlreadyPresent => statuses[c.index] = BlockStatus::AlreadyPresent,
                StoreReservation::NoRoom => {
                    statuses[c.index] = BlockStatus::NotStored;
                    no_room = true;
                }
            },
            // With --namespace-acl, a tenant only loads what its own namespace stored
            // (no reading, no poisoning across tenants: a foreign key is a miss).
            Opcode::Load if strict && store.namespace_of(key).is_some_and(|ns| ns != att.namespace) => {
                statuses[c.index] = BlockStatus::Missing
            }
            Opcode::Load => match store.reserve_load(key, size) {
                LoadReservation::Pinned { offset } => blocks.push(block(offset)),
                LoadReservation::Missing => statuses[c.index] = BlockStatus::Missing,
                LoadReservation::SizeMismatch { stored } => {
                    tracing::debug!(attachment = att.id, stored, wanted = size, "object size differs from the loader's layout");
                    statuses[c.index] = BlockStatus::Failed;
                }
                LoadReservation::Lower { .. } | LoadReservation::Promoting => lower.push(*c),
            },
            Opcode::Nop => {}
        }
    }
    if op == Opcode::Store && (store.needs_eviction() || no_room) {
        inner.store.wake_evictor();
    }
    drop(store);
    if !lower.is_empty() {
        promote(inner, att, size, lower, blocks, statuses, keep_waiting);
    }
}

/// Loads of the peer queued behind the running ones (the first few): their first
/// lower-tier objects are launched within the look-ahead window, so that they fetch while
/// this load copies (a worker restoring a prefix submits many loads at once).
fn launch_next_loads(inner: &PoolInner, att: &Attachment) {
    const NEXT_LOADS: usize = 4;
    if !inner.promoter.enabled() {
        return;
    }
    let next: Vec<(Arc<crate::copy::promote::Ahead>, Vec<Candidate>, u64, usize)> = inner.copy_slots.peer_waiting(att.id, |waiting| {
        waiting
            .filter(|j| j.op == Opcode::Load)
            .take(NEXT_LOADS)
            .map(|j| (j.ahead.clone(), j.candidates.clone(), j.layout.object_bytes(), j.layout.segments().len()))
            .collect()
    });
    for (ahead, cands, size, pages) in next {
        if !launch_stages(inner, att, size, &cands, &ahead, &stage_split(inner, cands.len(), size, pages), 0) {
            break;
        }
    }
}

/// Launches stages `from..` of a load's candidates (cut by `split`) ahead, one ticket per
/// stage (so that each stage takes only its own), while the look-ahead window has room.
/// True if all were launched.
fn launch_stages(
    inner: &PoolInner,
    att: &Attachment,
    size: u64,
    cands: &[Candidate],
    ahead: &crate::copy::promote::Ahead,
    split: &StageSplit,
    from: usize,
) -> bool {
    (from..split.count()).all(|k| {
        let to = split.range(k).end;
        crate::copy::promote::launch(inner, att, size, cands, ahead, to, false) >= to
    })
}

/// How long a load waits for another load's promotion of the same object, or for DRAM
/// to promote into, before the block is a miss.
const PROMOTION_WAIT: Duration = Duration::from_secs(2);

/// Brings the load's blocks that are on a lower tier into DRAM (tier/mod.rs, the seam): under
/// the store lock each gets a DRAM allocation and is marked promoting (pinned for this
/// load); outside it, the tier's source fetches the bytes; under the lock again each is
/// published in DRAM (or dropped: a miss). A block another load is promoting is waited
/// for (never fetched twice, never freed under a reader). Runs on this load's copy
/// thread before its copies; the peer's share of copy threads bounds what it holds. The
/// waits end early when `keep_waiting` says no (the peer gave up or left, the pool stops).
fn promote(
    inner: &PoolInner,
    att: &Attachment,
    size: u64,
    mut waiting: Vec<Candidate>,
    blocks: &mut Vec<JobBlock>,
    statuses: &mut [BlockStatus],
    keep_waiting: &dyn Fn() -> bool,
) {
    let deadline = Instant::now() + PROMOTION_WAIT;
    let mut first = true;
    while !waiting.is_empty() {
        if !first {
            if Instant::now() >= deadline || !keep_waiting() {
                break;
            }
            std::thread::sleep(Duration::from_micros(500));
        }
        first = false;
        // (candidate, DRAM offset, tier) of each promotion this load runs now.
        let mut mine: Vec<(Candidate, u64, umbp_protocol::location::Tier, u128)> = Vec::new();
        let mut still = Vec::new();
        let mut no_room = false;
        {
            let mut store = inner.store.objects.lock_urgent().expect("store lock");
            for c in waiting.drain(..) {
                let key = GroupKey::new(att.group, c.key);
                match store.reserve_load(key, size) {
                    LoadReservation::Pinned { offset } => {
                        blocks.push(JobBlock { index: c.index, key: c.key, group: att.group, block_id: c.block_id, offset })
                    }
                    LoadReservation::Missing => statuses[c.index] = BlockStatus::Missing,
                    LoadReservation::SizeMismatch { .. } => statuses[c.index] = BlockStatus::Failed,
                    LoadReservation::Promoting => still.push(c),
                    LoadReservation::Lower { tier } if inner.tiers.source(tier).is_none() => statuses[c.index] = BlockStatus::Missing,
                    LoadReservation::Lower { .. } => match store.begin_promotion(key) {
                        Some((offset, tier, namespace)) => mine.push((c, offset, tier, namespace)),
                        None => {
                            no_room = true;
                            still.push(c);
                        }
                    },
                }
            }
        }
        if no_room || !mine.is_empty() {
            inner.store.wake_evictor();
        }
        waiting = still;
        if mine.is_empty() {
            continue;
        }
        // Finished as failed if this thread panics before they end.
        let promotions = Promotions::new(
            inner.tier_work(),
            mine.iter()
                .map(|&(c, offset, tier, namespace)| Promotion { key: GroupKey::new(att.group, c.key), offset, size, tier, namespace })
                .collect(),
        );
        let fetched = promotions.fetch();
        let mut store = inner.store.objects.lock_urgent().expect("store lock");
        for ((c, offset, _, _), published) in mine.into_iter().zip(promotions.finish(&mut store, &fetched)) {
            if published {
                blocks.push(JobBlock { index: c.index, key: c.key, group: att.group, block_id: c.block_id, offset });
            } else {
                statuses[c.index] = BlockStatus::Missing;
            }
        }
    }
    for c in waiting {
        tracing::debug!(attachment = att.id, key = %format_args!("{:032x}", c.key.0), "promotion not done in time (another load's, or no DRAM free): a miss");
        statuses[c.index] = BlockStatus::Missing;
    }
}
