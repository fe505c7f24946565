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
    /// When the service thread accepted the submission (transfer latency metric).
    pub submitted: Instant,
}

pub fn run_copy_thread(inner: &PoolInner, rx: crossbeam_channel::Receiver<Job>) {
    loop {
        let job = match rx.recv_timeout(std::time::Duration::from_millis(100)) {
            Ok(job) => job,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) if !inner.is_shutting_down() => continue,
            Err(_) => return,
        };
        if !job.att.is_alive() || inner.is_shutting_down() {
            finish_cancelled(inner, job);
            continue;
        }
        let failed = copy(inner, &job);
        finish(inner, job, &failed);
    }
}

/// Runs the copies; returns the submission positions of blocks whose copy failed.
///
/// All allocations of the job go to `umbp_gpu::transfer` at once, so parts on one GPU
/// (a vLLM worker registers one allocation per layer) run as one batched copy call with
/// one synchronization. A fenced store (`sqe.fence_value != 0`, DESIGN §7) reads device
/// memory only after the worker's stream wrote its fence word; a fenced load has the word
/// written once the bytes landed (on the GPU when possible, see `finish` for the CPU write).
fn copy(inner: &PoolInner, job: &Job) -> Vec<usize> {
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
    let all_users: Vec<usize> = job.blocks.iter().map(|b| b.index).collect();
    let mut per_alloc: Vec<(u32, Vec<CopyOp>)> = Vec::with_capacity(groups.len());
    for (alloc, segs) in &groups {
        let mut ops = Vec::with_capacity(job.blocks.len() * segs.len());
        for b in &job.blocks {
            debug_assert!(b.block_id < job.layout.num_blocks(), "block ids are checked at submission");
            for &(i, off) in segs {
                let seg = &segments[i];
                push_coalesced(
                    &mut ops,
                    CopyOp { alloc_id: *alloc, device_offset: seg.offset + b.block_id * seg.block_stride, host_offset: b.offset + off, len: seg.page_bytes },
                );
            }
        }
        // Every block of the job has a page in every allocation of the layout.
        per_alloc.push((*alloc, ops));
    }
    let regions = job.att.regions.read().expect("regions lock").clone();
    let mut failed = Vec::new();
    let started = Instant::now();
    let mut parts = Vec::with_capacity(per_alloc.len());
    let mut users = Vec::with_capacity(per_alloc.len());
    for (alloc, ops) in &per_alloc {
        match regions.get(alloc) {
            Some(region) => {
                parts.push(umbp_gpu::Part { region: region.as_ref(), ops });
                users.push(&all_users);
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
    match fence {
        Err(e) if job.op == Opcode::Store => {
            // Without its fence a store could read KV the engine has not written yet.
            tracing::warn!(attachment = job.att.id, "store fence unusable: {e}");
            users.iter().for_each(|u| failed.extend(*u));
        }
        fence => {
            let fence = fence.unwrap_or_default();
            let keep_waiting = || job.att.is_alive() && !inner.is_shutting_down();
            let to_host = match job.op {
                Opcode::Store => true,
                Opcode::Load => false,
                Opcode::Nop => return failed,
            };
            // SAFETY: every op's host range is an object reserved (store) or pinned (load)
            // for this job in the object store, inside DRAM; nobody else writes it meanwhile.
            let results = unsafe { umbp_gpu::transfer(to_host, &parts, inner.dram.base(), fence, &keep_waiting) };
            for ((r, u), part) in results.into_iter().zip(&users).zip(&parts) {
                if let Err(e) = r {
                    tracing::warn!(attachment = job.att.id, alloc = part.ops.first().map(|o| o.alloc_id), "copy failed: {e}");
                    failed.extend(*u);
                }
            }
        }
    }
    let ns = started.elapsed().as_nanos() as u64;
    inner.counters.latency.observe_copy(job.op, ns as f64 * 1e-9);
    match job.op {
        Opcode::Store => Counters::add(&inner.counters.store_copy_ns, ns),
        _ => Counters::add(&inner.counters.load_copy_ns, ns),
    }
    failed.sort_unstable();
    failed.dedup();
    failed
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

/// Publishes or unpins, writes per-block statuses and posts the completion.
pub fn finish(inner: &PoolInner, mut job: Job, failed: &[usize]) {
    let size = job.layout.object_bytes();
    {
        let mut store = inner.store.lock().expect("store lock");
        for b in &job.blocks {
            let ok = failed.binary_search(&b.index).is_err();
            job.statuses[b.index] = match job.op {
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
    finish(inner, job, &failed);
}
