//! Copy threads: execute the copies of one submission through the device backends, then
//! publish (stores) or unpin (loads) and post the completion.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use umbp_protocol::entries::{BlockStatus, Cqe, Opcode, Sqe};
use umbp_protocol::layout::{push_coalesced, CopyOp, KvLayout};
use umbp_protocol::ObjectKey;

use crate::attachment::Attachment;
use crate::stats::Counters;
use crate::PoolInner;

pub struct JobBlock {
    /// Position in the submission (and in `statuses`).
    pub index: usize,
    pub key: ObjectKey,
    pub block_id: u64,
    /// Object offset in DRAM.
    pub offset: u64,
}

pub struct Job {
    pub att: Arc<Attachment>,
    pub sqe: Sqe,
    pub op: Opcode,
    pub layout: Arc<KvLayout>,
    /// Blocks that need a copy; the others already have their status.
    pub blocks: Vec<JobBlock>,
    pub statuses: Vec<BlockStatus>,
    /// When the service thread took the submission from the ring.
    pub accepted: Instant,
    /// When the service thread had reserved its objects and queued it (transfer latency
    /// metric).
    pub submitted: Instant,
}

pub fn run_copy_thread(inner: &PoolInner, rx: crossbeam_channel::Receiver<Job>) {
    loop {
        let mut job = match rx.recv_timeout(std::time::Duration::from_millis(100)) {
            Ok(job) => job,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) if !inner.is_shutting_down() => continue,
            Err(_) => return,
        };
        if !job.att.is_alive() || inner.is_shutting_down() {
            finish_cancelled(inner, job);
            continue;
        }
        let picked = Instant::now();
        let phases = inner.counters.phases(job.op);
        Counters::add(&phases.reserve_ns, ns_between(job.accepted, job.submitted));
        Counters::add(&phases.queue_ns, ns_between(job.submitted, picked));
        let copied = copy(inner, &mut job);
        let tail = Instant::now();
        finish(inner, job, &copied.failed, copied.settled);
        Counters::add(&phases.finish_ns, tail.elapsed().as_nanos() as u64);
        Counters::add(&phases.jobs, 1);
    }
}

fn ns_between(a: Instant, b: Instant) -> u64 {
    b.saturating_duration_since(a).as_nanos() as u64
}

/// Blocks in this many stages or fewer: `stage_bytes` of objects per stage (0 = one
/// stage), at most one stage per block and [`MAX_STAGES`].
pub fn stage_count(blocks: usize, object_bytes: u64, stage_bytes: u64) -> usize {
    if stage_bytes == 0 || blocks == 0 {
        return 1;
    }
    let total = blocks as u64 * object_bytes;
    (total.div_ceil(stage_bytes) as usize).clamp(1, blocks.min(MAX_STAGES))
}

/// Stages per submission at most (each costs an event per copy stream).
const MAX_STAGES: usize = 64;

/// What [`copy`] did: submission positions whose copy failed, and how many of the job's
/// blocks (a prefix of `job.blocks`) are settled already — published or unpinned, status
/// written — because their stage landed while later stages still copied.
struct Copied {
    failed: Vec<usize>,
    settled: usize,
}

/// Runs the copies of a job.
///
/// All allocations of the job go to `umbp_gpu::transfer_staged` at once, so parts on one
/// GPU (a vLLM worker registers one allocation per layer) run as one batched copy call
/// with one synchronization. The job's blocks are cut into stages (`--copy-stage-size`);
/// each stage's blocks are published (stores) or unpinned (loads) as soon as that stage
/// has landed, under the DMA of the next stages, so that only the last stage's
/// bookkeeping remains once the last byte moved. A fenced store (`sqe.fence_value != 0`,
/// DESIGN §7) reads device memory only after the worker's stream wrote its fence word; a
/// fenced load has the word written once the bytes landed (on the GPU when possible, see
/// `finish` for the CPU write).
fn copy(inner: &PoolInner, job: &mut Job) -> Copied {
    let started = Instant::now();
    // Group copies per allocation, remembering which blocks use it: one pass over the
    // segments of each allocation, block by block, so consecutive segments of a block (and
    // consecutive blocks) that continue on both sides coalesce; no per-op hashing (a
    // 10k-token prefix of a 24-layer model is 7,500 ops).
    let segments = job.layout.segments();
    let mut groups: Vec<(u32, Vec<(usize, u64)>)> = Vec::new();
    let mut host_off = 0u64;
    for (i, seg) in segments.iter().enumerate() {
        match groups.iter_mut().find(|g| g.0 == seg.alloc_id) {
            Some(g) => g.1.push((i, host_off)),
            None => groups.push((seg.alloc_id, vec![(i, host_off)])),
        }
        host_off += seg.page_bytes;
    }
    let stages = stage_count(job.blocks.len(), job.layout.object_bytes(), inner.copy_stage_bytes.load(Ordering::Relaxed));
    // Stage s = job.blocks[bounds[s]..bounds[s + 1]].
    let bounds: Vec<usize> = (0..=stages).map(|s| s * job.blocks.len() / stages).collect();
    let mut per_alloc: Vec<(u32, Vec<CopyOp>, Vec<usize>)> = Vec::with_capacity(groups.len());
    for (alloc, segs) in &groups {
        let mut ops = Vec::with_capacity(job.blocks.len() * segs.len());
        let mut ends = Vec::with_capacity(stages);
        for stage in bounds.windows(2) {
            let stage_start = ops.len();
            for b in &job.blocks[stage[0]..stage[1]] {
                debug_assert!(b.block_id < job.layout.num_blocks(), "block ids are checked at submission");
                for &(i, off) in segs {
                    let seg = &segments[i];
                    let op = CopyOp { alloc_id: *alloc, device_offset: seg.offset + b.block_id * seg.block_stride, host_offset: b.offset + off, len: seg.page_bytes };
                    // Never across a stage boundary: a stage's ops are its blocks' only.
                    if ops.len() == stage_start {
                        ops.push(op);
                    } else {
                        push_coalesced(&mut ops, op);
                    }
                }
            }
            ends.push(ops.len());
        }
        // Every block of the job has a page in every allocation of the layout.
        per_alloc.push((*alloc, ops, ends));
    }
    let all_users: Vec<usize> = job.blocks.iter().map(|b| b.index).collect();
    let regions = job.att.regions.read().expect("regions lock").clone();
    let mut failed = Vec::new();
    let mut parts = Vec::with_capacity(per_alloc.len());
    let mut stage_ends = Vec::with_capacity(per_alloc.len());
    for (alloc, ops, ends) in &per_alloc {
        match regions.get(alloc) {
            Some(region) => {
                parts.push(umbp_gpu::Part { region: region.as_ref(), ops });
                stage_ends.push(ends.clone());
            }
            None => failed.extend(&all_users),
        }
    }
    let fence_region = fence_region(job, &regions);
    let fence = match (&fence_region, job.op) {
        (None, _) => Ok(umbp_gpu::Fence::None),
        (Some(Err(e)), _) => Err(e.to_string()),
        (Some(Ok((word, value))), Opcode::Store) => Ok(umbp_gpu::Fence::WaitBefore(*word, *value)),
        (Some(Ok((word, value))), _) => Ok(umbp_gpu::Fence::SignalAfter(*word, *value)),
    };
    let phases = inner.counters.phases(job.op);
    let mut settled = 0;
    let mut publish_ns = 0u64;
    let copy_started = Instant::now();
    Counters::add(&phases.plan_ns, ns_between(started, copy_started));
    match fence {
        Err(e) if job.op == Opcode::Store => {
            // Without its fence a store could read KV the engine has not written yet.
            tracing::warn!(attachment = job.att.id, "store fence unusable: {e}");
            failed.extend(&all_users);
        }
        fence => {
            let fence = fence.unwrap_or_default();
            let keep_waiting = || job.att.is_alive() && !inner.is_shutting_down();
            let to_host = match job.op {
                Opcode::Store => true,
                Opcode::Load => false,
                Opcode::Nop => return Copied { failed, settled },
            };
            // A missing region fails every block: nothing may be published early then.
            let whole = failed.is_empty();
            let (blocks, statuses, op) = (&job.blocks, &mut job.statuses, job.op);
            let mut stage_landed = |s: usize| {
                if !whole {
                    return;
                }
                let t = Instant::now();
                settle(inner, op, &blocks[bounds[s]..bounds[s + 1]], statuses, &[]);
                settled = bounds[s + 1];
                publish_ns += t.elapsed().as_nanos() as u64;
                Counters::add(&phases.stages, 1);
            };
            // SAFETY: every op's host range is an object reserved (store) or pinned (load)
            // for this job in the object store, inside DRAM; nobody else writes it meanwhile
            // (an object settled early is one whose copies have all landed).
            let results = unsafe {
                umbp_gpu::transfer_staged(to_host, &parts, &stage_ends, inner.dram.base(), fence, &keep_waiting, &mut stage_landed)
            };
            for (r, part) in results.into_iter().zip(&parts) {
                if let Err(e) = r {
                    tracing::warn!(attachment = job.att.id, alloc = part.ops.first().map(|o| o.alloc_id), "copy failed: {e}");
                    failed.extend(&all_users);
                }
            }
        }
    }
    let ns = ns_between(copy_started, Instant::now()).saturating_sub(publish_ns);
    inner.counters.latency.observe_copy(job.op, ns as f64 * 1e-9);
    Counters::add(&phases.copy_ns, ns);
    Counters::add(&phases.publish_ns, publish_ns);
    failed.sort_unstable();
    failed.dedup();
    Copied { failed, settled }
}

/// Publishes (store) or unpins (load) `blocks` and writes their statuses; a block whose
/// submission position is in `failed` (sorted) did not copy.
fn settle(inner: &PoolInner, op: Opcode, blocks: &[JobBlock], statuses: &mut [BlockStatus], failed: &[usize]) {
    if blocks.is_empty() {
        return;
    }
    let mut store = inner.store.lock().expect("store lock");
    for b in blocks {
        let ok = failed.binary_search(&b.index).is_err();
        statuses[b.index] = match op {
            Opcode::Store => {
                if store.finish_store(b.key, ok) {
                    BlockStatus::Stored
                } else if ok {
                    BlockStatus::NotStored
                } else {
                    BlockStatus::Failed
                }
            }
            _ => {
                store.finish_load(b.key);
                if ok { BlockStatus::Loaded } else { BlockStatus::Failed }
            }
        };
    }
}

type Regions = HashMap<u32, Arc<dyn umbp_gpu::DeviceRegion>>;

/// The fence word and value of a fenced submission: `fence_value` != 0, the word in slot
/// `decode_ref(reserved[0])` of a HostMemfd region the worker registered (umbp_gpu::fence).
fn fence_region<'a>(job: &Job, regions: &'a Regions) -> Option<Result<(umbp_gpu::FenceWord<'a>, u64), umbp_gpu::GpuError>> {
    fence_word(&job.sqe, regions)
}

fn fence_word<'a>(sqe: &Sqe, regions: &'a Regions) -> Option<Result<(umbp_gpu::FenceWord<'a>, u64), umbp_gpu::GpuError>> {
    if sqe.fence_value == 0 {
        return None;
    }
    let (alloc, slot) = umbp_gpu::fence::decode_ref(sqe.reserved[0]);
    Some(match regions.get(&alloc) {
        Some(r) => r.fence_word(slot).map(|w| (w, sqe.fence_value)),
        None => Err(umbp_gpu::GpuError::Unsupported(format!("fence page alloc_id {alloc} is not registered"))),
    })
}

/// Releases the stream of a worker waiting for a fenced load (DESIGN §7): writes the
/// load's fence value, also when not every block loaded (the completion says so). Called before the
/// completion is posted, also for loads that were rejected or copied nothing, so that a
/// waiting stream never hangs while the pool lives.
pub fn signal_load_fence(att: &Attachment, sqe: &Sqe, all_loaded: bool) {
    if Opcode::from_u8(sqe.opcode).ok() != Some(Opcode::Load) {
        return;
    }
    let regions = att.regions.read().expect("regions lock");
    match fence_word(sqe, &regions) {
        None => {}
        Some(Ok((word, value))) => {
            if !all_loaded {
                tracing::debug!(attachment = att.id, value, "releasing the fence of a load that did not fully load");
            }
            word.signal(value)
        }
        Some(Err(e)) => tracing::warn!(attachment = att.id, "load fence unusable: {e}"),
    }
}

/// Publishes or unpins the blocks not settled yet (all but the first `settled`), writes
/// per-block statuses and posts the completion.
pub fn finish(inner: &PoolInner, mut job: Job, failed: &[usize], settled: usize) {
    let size = job.layout.object_bytes();
    settle(inner, job.op, &job.blocks[settled.min(job.blocks.len())..], &mut job.statuses, failed);
    let c = &inner.counters;
    let mut ok_count = 0;
    for s in &job.statuses {
        let counter = match s {
            BlockStatus::Stored => &c.blocks_stored,
            BlockStatus::AlreadyPresent => &c.blocks_already_present,
            BlockStatus::NotStored => &c.blocks_not_stored,
            BlockStatus::Loaded => &c.blocks_loaded,
            BlockStatus::Missing => &c.blocks_missing,
            BlockStatus::Invalid => &c.blocks_invalid,
            _ => &c.blocks_failed,
        };
        Counters::add(counter, 1);
        ok_count += s.is_ok() as u32;
    }
    let moved = job.statuses.iter().filter(|s| matches!(s, BlockStatus::Stored | BlockStatus::Loaded)).count() as u64 * size;
    Counters::add(if job.op == Opcode::Store { &c.bytes_stored } else { &c.bytes_loaded }, moved);
    c.latency.observe_transfer(job.op, job.submitted.elapsed().as_secs_f64());
    let att = &job.att;
    att.inflight.fetch_sub(1, Ordering::AcqRel);
    // Same formula as at admission (service.rs, validate::Submission::bytes).
    att.inflight_bytes.fetch_sub(job.statuses.len() as u64 * size, Ordering::AcqRel);
    if !att.is_alive() {
        return;
    }
    let raw: Vec<u8> = job.statuses.iter().map(|s| *s as u8).collect();
    // Checked at submission; the arena cannot shrink (sealed memfd).
    let _ = att.arena.write(job.sqe.status_offset, &raw);
    att.complete(Cqe {
        user_data: job.sqe.user_data,
        result: 0,
        ok_count,
        failed_count: job.statuses.len() as u32 - ok_count,
        ..Cqe::default()
    });
}

/// The peer is gone (or the pool is stopping): nothing is copied, reservations are undone.
pub fn finish_cancelled(inner: &PoolInner, job: Job) {
    let failed: Vec<usize> = job.blocks.iter().map(|b| b.index).collect();
    finish(inner, job, &failed, 0);
}
