//! How a submission ends: its blocks published (stores) or unpinned (loads), or their
//! reservations undone; per-block statuses and counters; a fenced load's fence word; and
//! the completion posted to the worker.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use umbp_protocol::entries::{BlockStatus, Cqe, CqeError, Opcode, Sqe};

use crate::copy::job::Job;
use crate::copy::job_blocks::JobBlock;
use crate::observe::stats::Counters;
use crate::peer::attachment::Attachment;
use crate::PoolInner;

/// Fails the blocks of a landed stage not settled yet (after a panic while settling):
/// stores' objects are freed (their copies landed: no DMA writes them any more), loads'
/// are unpinned. A store lock poisoned by that panic cannot be trusted: the pool stops
/// (as `contain_panic` does).
pub(crate) fn fail_landed(inner: &PoolInner, op: Opcode, blocks: &[JobBlock], statuses: &mut [BlockStatus]) {
    let Ok(mut store) = inner.store.objects.lock_urgent() else {
        tracing::error!("the object store's lock is poisoned by a panic while settling a stage: stopping the pool");
        std::process::abort();
    };
    for b in blocks {
        if statuses[b.index] != BlockStatus::Pending {
            continue;
        }
        match op {
            Opcode::Store => {
                store.finish_store(b.object(), false);
            }
            _ => store.finish_load(b.object()),
        }
        statuses[b.index] = BlockStatus::Failed;
    }
}

/// Publishes (store) or unpins (load) `blocks` and writes their statuses; a block whose
/// submission position is in `failed` (sorted) did not copy.
pub(crate) fn settle(inner: &PoolInner, op: Opcode, blocks: &[JobBlock], statuses: &mut [BlockStatus], failed: &[usize]) {
    if blocks.is_empty() {
        return;
    }
    let mut store = inner.store.objects.lock_urgent().expect("store lock");
    for b in blocks {
        let ok = failed.binary_search(&b.index).is_err();
        statuses[b.index] = match op {
            Opcode::Store => {
                if store.finish_store(b.object(), ok) {
                    BlockStatus::Stored
                } else if ok {
                    BlockStatus::NotStored
                } else {
                    BlockStatus::Failed
                }
            }
            _ => {
                store.finish_load(b.object());
                if ok {
                    BlockStatus::Loaded
                } else {
                    BlockStatus::Failed
                }
            }
        };
    }
}

pub(crate) type Regions = HashMap<u32, Arc<dyn umbp_gpu::DeviceRegion>>;

/// The fence word and value of a fenced submission: `fence_value` != 0, the word in slot
/// `decode_ref(fence_ref)` of a HostMemfd region the worker registered (umbp_gpu::fence).
pub(crate) fn fence_word<'a>(sqe: &Sqe, regions: &'a Regions) -> Option<Result<(umbp_gpu::FenceWord<'a>, u64), umbp_gpu::GpuError>> {
    if sqe.fence_value == 0 {
        return None;
    }
    let (alloc, slot) = umbp_gpu::fence::decode_ref(sqe.fence_ref);
    Some(match regions.get(&alloc) {
        Some(r) => r.fence_word(slot).map(|w| (w, sqe.fence_value)),
        None => Err(umbp_gpu::GpuError::Unsupported(format!("fence page alloc_id {alloc} is not registered"))),
    })
}

/// Releases the stream of a worker waiting for a fenced load (docs/gpu.md "Stream-ordered transfers"): writes the
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
    // Promotions launched for it and not taken: unpinned once fetched.
    job.ahead.close(inner);
    let size = job.layout.object_bytes();
    settle(inner, job.op, &job.blocks[settled.min(job.blocks.len())..], &mut job.statuses, failed);
    // Candidates never reserved (the copy failed or was refused before their stage).
    for c in &job.candidates {
        if job.statuses[c.index] == BlockStatus::Pending {
            job.statuses[c.index] = BlockStatus::Failed;
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
    // Every path of a fenced load ends here (copied, failed, refused by the device layer,
    // cancelled, panicked, nothing in range): the worker's stream waits for this word. The
    // copies have all landed or stopped by now, so the CPU write never releases it early.
    signal_load_fence(att, &job.sqe, ok_count as usize == job.statuses.len());
    let raw: Vec<u8> = job.statuses.iter().map(|s| *s as u8).collect();
    // Checked at submission; the arena cannot shrink (sealed memfd).
    let _ = att.arena.write(job.sqe.status_offset, &raw);
    // Before the worker can see the completion: the service thread's wake-up, if it
    // slept through the copy, overlaps the worker's.
    inner.note_completion();
    att.complete(Cqe {
        user_data: job.sqe.user_data,
        result: if job.cancelled { -(CqeError::Cancelled as i32) } else { 0 },
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
